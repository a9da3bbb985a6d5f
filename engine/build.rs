//! Two hashes of source code, part of the keys of what outlives a run (`src/store.rs`):
//! - `MOSAICKV_PREFILL_CODE`: the code a prefill's numbers depend on (this crate's sources and
//!   the workspace's Cargo.lock, which pins candle and gemm): a change to any of them stores
//!   new prefills instead of reusing ones the new code might not compute bit for bit;
//! - `MOSAICKV_RESULTS_CODE`: that and every crate an evaluation's results depend on (spec,
//!   reference, optimized, tasks): a run log (`mosaickv eval`'s resume) is only resumed by the
//!   code that wrote it.

use std::path::Path;

fn fnv1a(h: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *h ^= u64::from(b);
        *h = h.wrapping_mul(0x0100_0000_01b3);
    }
}

fn visit(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            visit(&p, files);
        } else if p.extension().is_some_and(|x| x == "rs") {
            files.push(p);
        }
    }
}

fn hash(root: &Path, dirs: &[&str], h: &mut u64) {
    let mut files = Vec::new();
    for d in dirs {
        visit(&root.join(d), &mut files);
    }
    files.sort();
    files.push(root.join("../Cargo.lock"));
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
        fnv1a(
            h,
            f.strip_prefix(root)
                .unwrap_or(f)
                .to_string_lossy()
                .as_bytes(),
        );
        fnv1a(h, &std::fs::read(f).unwrap_or_default());
    }
    for d in dirs {
        println!("cargo:rerun-if-changed={}", root.join(d).display());
    }
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    hash(root, &["src"], &mut h);
    println!("cargo:rustc-env=MOSAICKV_PREFILL_CODE={h:016x}");
    let mut r = h;
    hash(
        root,
        &[
            "../spec/src",
            "../reference/src",
            "../optimized/src",
            "../tasks/src",
        ],
        &mut r,
    );
    println!("cargo:rustc-env=MOSAICKV_RESULTS_CODE={r:016x}");
}
