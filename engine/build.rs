//! Two hashes of source code, part of the keys of what outlives a run (`src/store.rs`):
//! - `MOSAICKV_PREFILL_CODE`: the code a prefill's numbers depend on (the forward pass in
//!   `src/model`, the weight formats and matrices `src/quant/`, `src/kv.rs`, `src/gguf.rs`,
//!   their kernels in `optimized/src/simd/` (`weights.rs`, `ggml.rs`, `span.rs`, `common.rs` and
//!   their ISA files), the query statistics `spec/src/query.rs`, and Cargo.lock's candle, gemm
//!   and half): a change to any
//!   of them stores new prefills instead of reusing ones the new code might not compute bit
//!   for bit, while a change elsewhere (the CLI, a cache method) keeps them;
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

/// Cargo.lock's entries of the crates a prefill's arithmetic comes from (candle's tensors and
/// quantized products, gemm's matrix kernels, half): a change elsewhere in the lock file
/// leaves stored prefills valid.
fn lock_entries(root: &Path, crates: &[&str], h: &mut u64) {
    let lock = std::fs::read_to_string(root.join("../Cargo.lock")).unwrap_or_default();
    println!(
        "cargo:rerun-if-changed={}",
        root.join("../Cargo.lock").display()
    );
    for block in lock.split("[[package]]") {
        let name = block
            .lines()
            .find_map(|l| l.strip_prefix("name = "))
            .unwrap_or("")
            .trim_matches('"');
        if crates.iter().any(|c| name.starts_with(c)) {
            fnv1a(h, block.as_bytes());
        }
    }
}

fn hash_files(root: &Path, paths: &[&str], h: &mut u64) {
    let mut files = Vec::new();
    for p in paths {
        let p = root.join(p);
        println!("cargo:rerun-if-changed={}", p.display());
        if p.is_dir() {
            visit(&p, &mut files);
        } else {
            files.push(p);
        }
    }
    files.sort();
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
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // What a prefill computes with: the forward pass, its weight formats and the query
    // statistics (the token ids are part of a stored prefill's key, so the tokenizer is not).
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    hash_files(
        root,
        &[
            "src/model",
            "src/quant",
            "src/kv.rs",
            // the weight-row and dense-attention kernels and the exp of the softmax
            "../optimized/src/simd/common.rs",
            "../optimized/src/simd/ggml.rs",
            "../optimized/src/simd/weights.rs",
            "../optimized/src/simd/span.rs",
            "../optimized/src/simd/avx2/weights.rs",
            "../optimized/src/simd/avx2/span.rs",
            "../optimized/src/simd/avx512/weights.rs",
            "src/gguf.rs",
            "../spec/src/query.rs",
        ],
        &mut h,
    );
    lock_entries(root, &["candle", "gemm", "half"], &mut h);
    println!("cargo:rustc-env=MOSAICKV_PREFILL_CODE={h:016x}");
    // What an evaluation's results depend on: everything of this crate and the crates it
    // decodes, compresses and scores with, and the whole lock file.
    let mut r = h;
    hash_files(
        root,
        &[
            "src",
            "../spec/src",
            "../reference/src",
            "../optimized/src",
            "../tasks/src",
            // the method registry (which cache a method string builds) and the greedy
            // decode loop the suite scores (eval is above this crate; its report code is not
            // hashed: a change there cannot change a result)
            "../methods/src",
            "../eval/src/llm.rs",
            "../Cargo.lock",
        ],
        &mut r,
    );
    println!("cargo:rustc-env=MOSAICKV_RESULTS_CODE={r:016x}");
}
