//! End-to-end tests of the `mosaickv` binary: numpy-made and npyz-made
//! inputs, the happy path of compress / attend / inspect, and one test per
//! kind of bad input (each a non-zero exit with a one-line message).

use npyz::WriterBuilder;
use std::path::{Path, PathBuf};
use std::process::Command;

const KV: usize = 2;
const Q: usize = 4;
const D: usize = 16;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

fn mosaickv(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Out {
    let o = Command::new(env!("CARGO_BIN_EXE_mosaickv"))
        .args(args.iter().map(|a| a.as_ref()))
        .output()
        .expect("run mosaickv");
    Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

fn ok(args: &[&dyn AsRef<std::ffi::OsStr>]) -> String {
    let o = mosaickv(args);
    assert_eq!(o.code, 0, "stderr: {}", o.stderr);
    o.stdout
}

/// A non-zero exit whose stderr is one line `mosaickv: error: ...` containing `needle`.
fn fails(args: &[&dyn AsRef<std::ffi::OsStr>], needle: &str) {
    let o = mosaickv(args);
    assert_ne!(o.code, 0, "expected failure, stdout: {}", o.stdout);
    let line = o.stderr.trim_end();
    assert!(!line.contains('\n'), "more than one line: {line:?}");
    assert!(line.starts_with("mosaickv: error: "), "{line:?}");
    assert!(
        line.contains(needle),
        "{line:?} does not contain {needle:?}"
    );
}

/// Deterministic low-rank-plus-noise data in [-1, 1]-ish (splitmix64).
struct Rng(u64);
impl Rng {
    fn f32(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

fn kv_data(tokens: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    let basis: Vec<f32> = (0..KV * 3 * D).map(|_| rng.f32()).collect();
    let mut out = Vec::with_capacity(tokens * KV * D);
    for _ in 0..tokens {
        for h in 0..KV {
            let c: Vec<f32> = (0..3).map(|_| 2.0 * rng.f32()).collect();
            for i in 0..D {
                let low: f32 = (0..3).map(|r| c[r] * basis[(h * 3 + r) * D + i]).sum();
                out.push(low + 0.02 * rng.f32());
            }
        }
    }
    out
}

fn write_f32(path: &Path, shape: &[u64], data: &[f32]) {
    let mut w = npyz::WriteOptions::<f32>::new()
        .default_dtype()
        .shape(shape)
        .writer(std::io::BufWriter::new(
            std::fs::File::create(path).unwrap(),
        ))
        .begin_nd()
        .unwrap();
    w.extend(data.iter().copied()).unwrap();
    w.finish().unwrap();
}

fn write_f16(path: &Path, shape: &[u64], data: &[f32]) {
    let mut w = npyz::WriteOptions::<half::f16>::new()
        .default_dtype()
        .shape(shape)
        .writer(std::io::BufWriter::new(
            std::fs::File::create(path).unwrap(),
        ))
        .begin_nd()
        .unwrap();
    w.extend(data.iter().map(|&x| half::f16::from_f32(x)))
        .unwrap();
    w.finish().unwrap();
}

fn read_f32(path: &Path) -> (Vec<u64>, Vec<f32>) {
    let npy = npyz::NpyFile::new(std::fs::File::open(path).unwrap()).unwrap();
    assert_eq!(npy.dtype().descr(), "'<f4'");
    let shape = npy.shape().to_vec();
    (shape, npy.into_vec::<f32>().unwrap())
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Writes keys/values/queries with npyz into `dir` and compresses them to `dir/c`.
fn setup(dir: &Path, tokens: usize) -> PathBuf {
    write_f32(
        &dir.join("k.npy"),
        &[tokens as u64, KV as u64, D as u64],
        &kv_data(tokens, 1),
    );
    write_f16(
        &dir.join("v.npy"),
        &[tokens as u64, KV as u64, D as u64],
        &kv_data(tokens, 2),
    );
    let mut rng = Rng(3);
    let q: Vec<f32> = (0..Q * D).map(|_| rng.f32()).collect();
    write_f32(&dir.join("q.npy"), &[Q as u64, D as u64], &q);
    let c = dir.join("c");
    ok(&[
        &"compress",
        &"--keys",
        &dir.join("k.npy"),
        &"--values",
        &dir.join("v.npy"),
        &"--q-heads",
        &"4",
        &"--out",
        &c,
    ]);
    c
}

#[test]
fn numpy_fixtures_happy_path() {
    let t = tempfile::tempdir().unwrap();
    let c = t.path().join("cache");
    let out = ok(&[
        &"compress",
        &"--keys",
        &fixture("keys_f16.npy"),
        &"--values",
        &fixture("values_f32.npy"),
        &"--q-heads",
        &"4",
        &"--out",
        &c,
    ]);
    assert!(out.contains("bytes/token"), "{out}");
    for f in ["cache.mkv", "dense.mkv", "manifest.json"] {
        assert!(c.join(f).is_file(), "{f} missing");
    }
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(c.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["shape"]["q_heads"], 4);
    assert_eq!(m["tokens"], 96);
    assert!(m["files"]["dense.mkv"]
        .as_str()
        .unwrap()
        .contains("BASELINE"));
    let head0 = &m["segments"][0]["heads"][0];
    for k in ["r", "g", "kept_dims", "fit_loss"] {
        assert!(
            head0["key"][k].is_number() && head0["value"][k].is_number(),
            "{k}"
        );
    }
    assert!(head0["block_size"].as_u64().unwrap() > 0);
    assert!(m["memory"]["ratio_to_dense_f16"].as_f64().unwrap() > 0.0);

    let inspect = ok(&[&"inspect", &"--cache", &c]);
    for needle in [
        "rotations",
        "bitmaps",
        "block metadata",
        "host f32 rows",
        "bytes/token",
        "segment 0",
        "head 1",
    ] {
        assert!(
            inspect.contains(needle),
            "inspect lacks {needle}: {inspect}"
        );
    }

    let (_, expected) = read_f32(&fixture("expected_full.npy"));
    let fixture_q = fixture("queries_f32.npy"); // Fortran order, written by numpy
    let attend = |method: &str, extra: &[&str]| -> Vec<f32> {
        let o = t.path().join(format!("{method}{}.npy", extra.join("")));
        let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![
            &"attend",
            &"--cache",
            &c,
            &"--queries",
            &fixture_q,
            &"--method",
            &method,
            &"--out",
            &o,
        ];
        for e in extra {
            args.push(e);
        }
        ok(&args);
        let (shape, data) = read_f32(&o);
        assert_eq!(shape, vec![Q as u64, D as u64]);
        assert!(data.iter().all(|x| x.is_finite()));
        data
    };
    let full = attend("full", &[]);
    let e_full = rel_err(&full, &expected);
    println!("full vs numpy: rel error {e_full:.2e}");
    assert!(
        e_full < 1e-5,
        "full attention disagrees with numpy: {e_full}"
    );
    let mosaic = attend("mosaic", &["--token-rate", "1"]);
    let e_mosaic = rel_err(&mosaic, &expected);
    println!("mosaic (token_rate 1) vs full: rel error {e_mosaic:.4}");
    assert!(e_mosaic < 0.15, "mosaic too far from full: {e_mosaic}");
    assert!(
        e_mosaic > 0.0,
        "mosaic equal to full: compression did nothing?"
    );
    let e_default = rel_err(&attend("mosaic", &[]), &expected);
    println!("mosaic (default token_rate 0.2) vs full: rel error {e_default:.4}");
    for (m, extra) in [
        ("quest", vec!["--token-rate", "0.5"]),
        ("naive2d", vec!["--retention", "0.5"]),
    ] {
        let e = rel_err(&attend(m, &extra), &expected);
        println!("{m} vs full: rel error {e:.4}");
    }
}

#[test]
fn npyz_written_f32_and_f16_inputs() {
    let t = tempfile::tempdir().unwrap();
    let c = setup(t.path(), 80);
    let o = t.path().join("o.npy");
    ok(&[
        &"attend",
        &"--cache",
        &c,
        &"--queries",
        &t.path().join("q.npy"),
        &"--method",
        &"mosaic",
        &"--token-rate",
        &"1",
        &"--out",
        &o,
    ]);
    let (shape, data) = read_f32(&o);
    assert_eq!(shape, vec![Q as u64, D as u64]);
    let full = t.path().join("full.npy");
    ok(&[
        &"attend",
        &"--cache",
        &c,
        &"--queries",
        &t.path().join("q.npy"),
        &"--method",
        &"full",
        &"--out",
        &full,
    ]);
    let (_, f) = read_f32(&full);
    let e = rel_err(&data, &f);
    println!("npyz data: mosaic (token_rate 1) vs full rel error {e:.4}");
    assert!(e.is_finite() && e < 0.15, "{e}");
}

#[test]
fn bad_array_inputs() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let n = 40;
    let sh = [n as u64, KV as u64, D as u64];
    let good = kv_data(n, 5);
    write_f32(&d.join("k.npy"), &sh, &good);
    write_f32(&d.join("v.npy"), &sh, &good);
    let mut nan = good.clone();
    nan[77] = f32::NAN;
    write_f32(&d.join("k_nan.npy"), &sh, &nan);
    write_f32(
        &d.join("v_short.npy"),
        &[n as u64 - 1, KV as u64, D as u64],
        &good[..(n - 1) * KV * D],
    );
    write_f32(&d.join("empty.npy"), &[0, KV as u64, D as u64], &[]);
    let out = d.join("c");
    let compress = |k: &Path, v: &Path, extra: &[&str], needle: &str| {
        let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> =
            vec![&"compress", &"--keys", &k, &"--values", &v, &"--out", &out];
        for e in extra {
            args.push(e);
        }
        fails(&args, needle);
    };
    let (k, v) = (d.join("k.npy"), d.join("v.npy"));
    compress(
        &d.join("k_nan.npy"),
        &v,
        &[],
        "non-finite value in keys at flat index 77",
    );
    compress(&k, &d.join("v_short.npy"), &[], "shape mismatch for values");
    compress(
        &k,
        &v,
        &["--q-heads", "3"],
        "q_heads 3 is not a positive multiple of kv_heads 2",
    );
    compress(
        &d.join("empty.npy"),
        &d.join("empty.npy"),
        &[],
        "the cache is empty",
    );
    compress(&fixture("keys_i64.npy"), &v, &[], "unsupported dtype '<i8'");
    compress(&fixture("keys_2d.npy"), &v, &[], "expected a 3-D");
    compress(&d.join("missing.npy"), &v, &[], "i/o error");
    std::fs::write(d.join("junk.npy"), b"not an npy file").unwrap();
    compress(&d.join("junk.npy"), &v, &[], "not a valid .npy file");

    let configs = [
        (
            r#"{"channels": {"mode": "fixed", "retention": 0.25, "group_size": 3}}"#,
            "head_dim 16 is not divisible by group size 3",
        ),
        (
            r#"{"channels": {"mode": "fixed", "retention": 1.5, "group_size": 1}}"#,
            "retention 1.5 not in (0, 1]",
        ),
        (
            r#"{"tokn_rate": 0.2}"#,
            "unknown configuration key `tokn_rate`",
        ),
        (r#"{"token_rate": 0}"#, "token_rate 0 not in (0, 1]"),
    ];
    for (i, (json, needle)) in configs.iter().enumerate() {
        let p = d.join(format!("cfg{i}.json"));
        std::fs::write(&p, json).unwrap();
        compress(&k, &v, &["--config", p.to_str().unwrap()], needle);
    }
    assert!(
        !out.join("cache.mkv").exists(),
        "a failed compress wrote a cache"
    );
}

#[test]
fn bad_attend_inputs() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let c = setup(d, 70);
    let mut rng = Rng(9);
    let mut q: Vec<f32> = (0..Q * D).map(|_| rng.f32()).collect();
    write_f32(
        &d.join("q_dim.npy"),
        &[Q as u64, D as u64 - 1],
        &q[..Q * (D - 1)],
    );
    q[5] = f32::INFINITY;
    write_f32(&d.join("q_inf.npy"), &[Q as u64, D as u64], &q);
    let o = d.join("o.npy");
    let attend = |qp: &Path, extra: &[&str], needle: &str| {
        let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> =
            vec![&"attend", &"--cache", &c, &"--queries", &qp, &"--out", &o];
        for e in extra {
            args.push(e);
        }
        fails(&args, needle);
    };
    let good = d.join("q.npy");
    attend(
        &d.join("q_inf.npy"),
        &["--method", "mosaic"],
        "non-finite value in queries at flat index 5",
    );
    attend(
        &d.join("q_dim.npy"),
        &["--method", "full"],
        "shape mismatch for queries",
    );
    attend(
        &good,
        &["--method", "naive2d", "--retention", "0"],
        "--retention 0 not in (0, 1]",
    );
    attend(
        &good,
        &["--method", "naive2d", "--retention", "1.5"],
        "--retention 1.5 not in (0, 1]",
    );
    attend(
        &good,
        &["--method", "quest", "--token-rate", "1.2"],
        "--token-rate 1.2 not in (0, 1]",
    );
    attend(
        &good,
        &["--method", "mosaic", "--retention", "0.5"],
        "--retention applies only to --method naive2d",
    );
    assert!(!o.exists(), "a failed attend wrote an output");
}

/// Runs attend and inspect on `dir` and expects both to fail with `needle`.
fn both_fail(dir: &Path, q: &Path, needle: &str) {
    let o = dir.join("o.npy");
    fails(
        &[
            &"attend",
            &"--cache",
            &dir,
            &"--queries",
            &q,
            &"--method",
            &"mosaic",
            &"--out",
            &o,
        ],
        needle,
    );
    fails(&[&"inspect", &"--cache", &dir], needle);
}

#[test]
fn damaged_cache_files() {
    let t = tempfile::tempdir().unwrap();
    let c = setup(t.path(), 90);
    let q = t.path().join("q.npy");
    let path = c.join("cache.mkv");
    let clean = std::fs::read(&path).unwrap();

    std::fs::write(&path, &clean[..clean.len() - 7]).unwrap();
    both_fail(&c, &q, "bad cache file");
    std::fs::write(&path, &clean[..clean.len() / 2]).unwrap();
    both_fail(&c, &q, "truncated");

    let mut flipped = clean.clone();
    let mid = clean.len() / 2;
    flipped[mid] ^= 0x10;
    std::fs::write(&path, &flipped).unwrap();
    both_fail(&c, &q, "checksum mismatch");

    // The version is checked before the header checksum, so editing it alone names it.
    // Version 1 (f16 block metadata, before SPEC.md section 7 went to int8) is refused.
    let mut v1 = clean.clone();
    v1[8..12].copy_from_slice(&1u32.to_le_bytes());
    std::fs::write(&path, &v1).unwrap();
    both_fail(&c, &q, "unsupported format version 1");

    let mut magic = clean.clone();
    magic[0] = b'X';
    std::fs::write(&path, &magic).unwrap();
    both_fail(&c, &q, "magic");

    let mut longer = clean.clone();
    longer.extend_from_slice(b"junk");
    std::fs::write(&path, &longer).unwrap();
    both_fail(&c, &q, "trailing bytes");

    std::fs::copy(c.join("dense.mkv"), &path).unwrap();
    both_fail(&c, &q, "dense baseline file");

    std::fs::remove_file(&path).unwrap();
    both_fail(&c, &q, "i/o error");

    // Restored, it works again.
    std::fs::write(&path, &clean).unwrap();
    ok(&[&"inspect", &"--cache", &c]);
}

/// `mosaickv attend` on `cache` with `queries`, extra flags appended; the output's data.
fn attend_out(dir: &Path, cache: &Path, queries: &Path, extra: &[&str]) -> Vec<f32> {
    let o = dir.join(format!("out{}.npy", extra.join("").replace(['-', '.'], "")));
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![
        &"attend",
        &"--cache",
        &cache,
        &"--queries",
        &queries,
        &"--out",
        &o,
    ];
    for e in extra {
        args.push(e);
    }
    ok(&args);
    read_f32(&o).1
}

/// Compresses `dir/k.npy`, `dir/v.npy` into `dir/name` with extra flags.
fn compress_to(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let c = dir.join(name);
    let (k, v) = (dir.join("k.npy"), dir.join("v.npy"));
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> =
        vec![&"compress", &"--keys", &k, &"--values", &v, &"--out", &c];
    for e in extra {
        args.push(e);
    }
    ok(&args);
    c
}

/// Several prompt segments, so that the token budget makes the selection matter.
const SEGMENTED: &str = r#"{"input_segment_len": 256, "sink_tokens": 4}"#;

#[test]
fn backends_write_identical_caches_and_agree_on_attention() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let tokens = 900;
    setup(d, tokens);
    let cfg = d.join("cfg.json");
    std::fs::write(&cfg, SEGMENTED).unwrap();
    let cfg = cfg.to_str().unwrap();
    let opt = compress_to(d, "opt", &["--config", cfg, "--backend", "optimized"]);
    let refc = compress_to(d, "ref", &["--config", cfg, "--backend", "reference"]);
    let dflt = compress_to(d, "default", &["--config", cfg]);
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(opt.join("manifest.json")).unwrap()).unwrap();
    assert!(m["segments"].as_array().unwrap().len() >= 3, "{m}");
    for f in ["cache.mkv", "dense.mkv", "manifest.json"] {
        assert!(
            std::fs::read(opt.join(f)).unwrap() == std::fs::read(dflt.join(f)).unwrap(),
            "{f}: the default backend is not the optimized one"
        );
    }
    assert!(
        std::fs::read(opt.join("dense.mkv")).unwrap()
            == std::fs::read(refc.join("dense.mkv")).unwrap()
    );
    // Records, rotations, (r, g), block sizes and block metadata are bit-exact (SPEC.md
    // sections 5-7, 11), and so are the fit losses: both backends add the rows' loss terms
    // in row order (SPEC 11.1). So the files are byte-identical.
    assert!(
        std::fs::read(opt.join("cache.mkv")).unwrap()
            == std::fs::read(refc.join("cache.mkv")).unwrap(),
        "the optimized and reference backends wrote different cache.mkv files"
    );

    let q = d.join("q.npy");
    let tol = mosaickv_conformance::tolerances::ATTEND_REL_L2;
    for (method, extra) in [
        ("mosaic", vec![]),
        ("mosaic", vec!["--token-rate", "0.5"]),
        ("quest", vec![]),
        ("full", vec![]),
        ("naive2d", vec!["--retention", "0.5"]),
    ] {
        let run = |backend: Option<&str>| {
            let mut args = vec!["--method", method];
            args.extend(&extra);
            if let Some(b) = backend {
                args.extend(["--backend", b]);
            }
            attend_out(d, &opt, &q, &args)
        };
        let (o, r, dflt) = (run(Some("optimized")), run(Some("reference")), run(None));
        assert_eq!(o.len(), Q * D);
        assert!(o.iter().all(|x| x.is_finite()));
        let e = rel_err(&o, &r);
        println!("{method} {extra:?}: optimized vs reference rel L2 {e:.2e}");
        assert!(e <= tol, "{method} {extra:?}: {e} > {tol}");
        assert!(
            dflt.iter()
                .map(|x| x.to_bits())
                .eq(o.iter().map(|x| x.to_bits())),
            "{method}: the default backend is not the optimized one"
        );
        if method != "naive2d" {
            // f32 kernels against the f64 oracle: the outputs differ in the last bits,
            // so equal outputs would mean both flags ran the same code.
            assert!(
                e > 0.0,
                "{method}: both backends gave bit-identical outputs"
            );
        }
    }
}

/// Exact attention in f64 over f16-rounded K/V `[tokens, KV, D]` for queries `[qh, D]`,
/// query head `i` reading KV head `i / (qh / KV)`.
fn full_attention(k: &[f32], v: &[f32], q: &[f32], qh: usize) -> Vec<f32> {
    let r = |x: f32| half::f16::from_f32(x).to_f32() as f64;
    let tokens = k.len() / (KV * D);
    let g = qh / KV;
    let mut out = vec![0f32; qh * D];
    for i in 0..qh {
        let h = i / g;
        let logits: Vec<f64> = (0..tokens)
            .map(|t| {
                let row = &k[(t * KV + h) * D..(t * KV + h + 1) * D];
                let dot: f64 = row
                    .iter()
                    .zip(&q[i * D..])
                    .map(|(&a, &b)| r(a) * b as f64)
                    .sum();
                dot / (D as f64).sqrt()
            })
            .collect();
        let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = logits.iter().map(|l| (l - mx).exp()).collect();
        let sum: f64 = w.iter().sum();
        for j in 0..D {
            let acc: f64 = (0..tokens).map(|t| w[t] * r(v[(t * KV + h) * D + j])).sum();
            out[i * D + j] = (acc / sum) as f32;
        }
    }
    out
}

#[test]
fn attend_takes_the_gqa_group_from_the_queries() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let tokens = 300;
    setup(d, tokens);
    // No --q-heads: the cache records q_heads = kv_heads = 2.
    let plain = compress_to(d, "plain", &[]);
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(plain.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(m["shape"]["q_heads"], KV);
    // --q-heads is still accepted, with a deprecation warning, and changes nothing attend reads.
    let (k, v) = (d.join("k.npy"), d.join("v.npy"));
    let with = d.join("with");
    let o = mosaickv(&[
        &"compress",
        &"--keys",
        &k,
        &"--values",
        &v,
        &"--q-heads",
        &"4",
        &"--out",
        &with,
    ]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(o.stderr.contains("--q-heads is deprecated"), "{}", o.stderr);

    let (kd, vd) = (kv_data(tokens, 1), kv_data(tokens, 2));
    let mut rng = Rng(11);
    for qh in [KV, 2 * KV, 3 * KV, 8 * KV] {
        let qdata: Vec<f32> = (0..qh * D).map(|_| rng.f32()).collect();
        let qp = d.join(format!("q{qh}.npy"));
        write_f32(&qp, &[qh as u64, D as u64], &qdata);
        let expected = full_attention(&kd, &vd, &qdata, qh);
        for backend in ["optimized", "reference"] {
            let full = attend_out(d, &plain, &qp, &["--method", "full", "--backend", backend]);
            let e = rel_err(&full, &expected);
            assert!(e < 1e-5, "q_heads {qh}, {backend}: full vs f64 {e}");
            for method in ["mosaic", "quest", "naive2d"] {
                let out = attend_out(d, &plain, &qp, &["--method", method, "--backend", backend]);
                assert_eq!(out.len(), qh * D);
                assert!(out.iter().all(|x| x.is_finite()), "{method} {backend}");
                let again = attend_out(d, &with, &qp, &["--method", method, "--backend", backend]);
                assert!(
                    out == again,
                    "{method} {backend}: the stored q_heads changed the output"
                );
            }
        }
    }

    for (bad, needle) in [
        (3, "q_heads 3 is not a positive multiple of kv_heads 2"),
        (5, "q_heads 5 is not a positive multiple of kv_heads 2"),
    ] {
        let qp = d.join(format!("q{bad}.npy"));
        write_f32(&qp, &[bad as u64, D as u64], &vec![0.5; bad * D]);
        let o = d.join("bad.npy");
        for method in ["mosaic", "full"] {
            for backend in ["optimized", "reference"] {
                fails(
                    &[
                        &"attend",
                        &"--cache",
                        &plain,
                        &"--queries",
                        &qp,
                        &"--method",
                        &method,
                        &"--backend",
                        &backend,
                        &"--out",
                        &o,
                    ],
                    needle,
                );
            }
        }
        assert!(!o.exists());
    }
}

#[test]
fn attend_timing_prints_one_line_on_stderr() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let c = setup(d, 200);
    let q = d.join("q.npy");
    let o = d.join("o.npy");
    for (method, backend, label) in [
        ("mosaic", None, "mosaic (optimized, cpu-"),
        ("mosaic", Some("reference"), "mosaic (reference)"),
        ("full", None, "full (optimized, cpu-"),
        ("quest", Some("optimized"), "quest (optimized, cpu-"),
        ("naive2d", None, "naive2d (reference)"),
    ] {
        let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![
            &"attend",
            &"--cache",
            &c,
            &"--queries",
            &q,
            &"--method",
            &method,
            &"--out",
            &o,
        ];
        if let Some(b) = &backend {
            args.extend([&"--backend" as &dyn AsRef<std::ffi::OsStr>, b]);
        }
        let quiet = mosaickv(&args);
        assert_eq!(quiet.code, 0, "{}", quiet.stderr);
        assert!(
            quiet.stderr.is_empty(),
            "without --timing: {}",
            quiet.stderr
        );
        args.push(&"--timing");
        let timed = mosaickv(&args);
        assert_eq!(timed.code, 0, "{}", timed.stderr);
        let line = timed.stderr.trim_end();
        assert!(!line.contains('\n'), "more than one line: {line:?}");
        assert!(line.starts_with("mosaickv attend: "), "{line:?}");
        assert!(line.contains(label), "{line:?} lacks {label:?}");
        assert!(line.contains("over 200 tokens, 4 query heads"), "{line:?}");
        let ms: f64 = line
            .split("attention ")
            .nth(1)
            .and_then(|s| s.split(" ms").next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no attention time in {line:?}"));
        assert!(ms >= 0.0 && ms.is_finite(), "{line:?}");
        assert!(line.contains("loading the files"), "{line:?}");
        assert!(timed.stdout.is_empty(), "{}", timed.stdout);
    }
}

/// Quantized values (SPEC.md section 6): both backends write the same int8/int4 cache file,
/// and `inspect` and the manifest show each side's dtype and scale bytes.
#[test]
fn quantized_caches_are_identical_and_inspect_shows_dtype_and_scales() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    setup(d, 600);
    let cfg = d.join("q.json");
    std::fs::write(
        &cfg,
        r#"{"input_segment_len": 256, "value_dtypes": ["int4", "int8"]}"#,
    )
    .unwrap();
    let cfg = cfg.to_str().unwrap();
    let opt = compress_to(d, "opt", &["--config", cfg, "--backend", "optimized"]);
    let refc = compress_to(d, "ref", &["--config", cfg, "--backend", "reference"]);
    assert!(
        std::fs::read(opt.join("cache.mkv")).unwrap()
            == std::fs::read(refc.join("cache.mkv")).unwrap(),
        "the optimized and reference backends wrote different quantized cache.mkv files"
    );
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(opt.join("manifest.json")).unwrap()).unwrap();
    let head0 = &m["segments"][0]["heads"][0];
    for side in ["key", "value"] {
        let dtype = head0[side]["dtype"].as_str().unwrap();
        assert!(dtype == "int4" || dtype == "int8", "{side}: {dtype}");
        assert_eq!(head0[side]["scale_bytes_per_record"], 4);
        assert_eq!(
            head0[side]["scale_bytes"].as_u64().unwrap(),
            4 * m["segments"][0]["len"].as_u64().unwrap()
        );
    }
    assert!(m["memory"]["scales"].as_u64().unwrap() > 0);
    let inspect = ok(&[&"inspect", &"--cache", &opt]);
    for needle in ["value minimum + scale", "(scales ", "int"] {
        assert!(
            inspect.contains(needle),
            "inspect lacks {needle}: {inspect}"
        );
    }
}

/// Issue 40, class 1: a compress that fails halfway (here a file-size limit, as a full disk
/// would) leaves the previous cache directory byte for byte as it was, with no temporary
/// file beside it, and the old cache still loads.
#[cfg(unix)]
#[test]
fn a_failed_compress_keeps_the_previous_cache_directory() {
    let dir = tempfile::tempdir().unwrap();
    let c = setup(dir.path(), 600);
    let snapshot = |d: &Path| -> Vec<(String, Vec<u8>)> {
        let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let before = snapshot(&c);
    assert_eq!(before.len(), 3, "cache.mkv, dense.mkv, manifest.json");
    let largest = before.iter().map(|f| f.1.len()).max().unwrap();
    // ulimit -f counts 1024-byte blocks in bash: a limit under the largest file
    let limit = (largest / 1024 / 2).max(1);
    let o = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "ulimit -f {limit}; trap '' XFSZ; exec \"$0\" compress --keys \"$1\" --values \"$2\" \
             --config \"$3\" --out \"$4\""
        ))
        .arg(env!("CARGO_BIN_EXE_mosaickv"))
        .arg(dir.path().join("k.npy"))
        .arg(dir.path().join("v.npy"))
        .arg({
            let p = dir.path().join("cfg.json");
            std::fs::write(&p, r#"{"token_rate": 0.5}"#).unwrap();
            p
        })
        .arg(&c)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_ne!(o.status.code(), Some(0), "the limited compress succeeded");
    assert!(
        err.starts_with("mosaickv: error: ") && err.contains("File too large"),
        "{err}"
    );
    assert!(
        snapshot(&c) == before,
        "the previous cache directory changed (or a temporary file was left)"
    );
    ok(&[&"inspect", &"--cache", &c]);
}

/// Issue 40, the error contract: a usage error is one `mosaickv: error:` line (exit 2), a
/// control character in a message is escaped, and numpy's native-order descr `'=f4'` reads.
#[test]
fn usage_errors_control_characters_and_native_order_npy() {
    let o = mosaickv(&[&"attend", &"--no-such-flag"]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    let line = o.stderr.trim_end();
    assert!(!line.contains('\n'), "{line:?}");
    assert!(
        line.starts_with("mosaickv: error: ") && line.contains("--no-such-flag"),
        "{line:?}"
    );
    let o = mosaickv(&[&"compress", &"--keys"]);
    assert_eq!(o.code, 2);
    assert!(o.stderr.starts_with("mosaickv: error: ") && !o.stderr.trim_end().contains('\n'));
    // missing required arguments: named on the one line
    let o = mosaickv(&[&"attend", &"--cache", &"c", &"--queries", &"q.npy"]);
    assert_eq!(o.code, 2);
    let line = o.stderr.trim_end();
    assert!(!line.contains('\n'), "{line:?}");
    assert!(
        line.contains("not provided: --method <METHOD>, --out <OUT>"),
        "{line:?}"
    );
    // --help and --version still print on stdout, exit 0
    let o = mosaickv(&[&"--version"]);
    assert_eq!(o.code, 0);
    assert!(o.stdout.starts_with("mosaickv "), "{}", o.stdout);

    let dir = tempfile::tempdir().unwrap();
    // a file name with an escape character: echoed escaped, never raw
    let odd = dir.path().join("k\u{1b}[2J.npy");
    let o = mosaickv(&[
        &"compress",
        &"--keys",
        &odd,
        &"--values",
        &odd,
        &"--out",
        &dir.path(),
    ]);
    assert_ne!(o.code, 0);
    assert!(!o.stderr.contains('\u{1b}'), "{:?}", o.stderr);
    assert!(o.stderr.contains("\\u{1b}"), "{:?}", o.stderr);

    // '=f4' (native order, little-endian here): the same array as '<f4'
    let tokens = 40;
    let data = kv_data(tokens, 5);
    let lt = dir.path().join("lt.npy");
    write_f32(&lt, &[tokens as u64, KV as u64, D as u64], &data);
    let mut bytes = std::fs::read(&lt).unwrap();
    let at = bytes.windows(5).position(|w| w == b"'<f4'").unwrap();
    bytes[at + 1] = b'=';
    let native = dir.path().join("native.npy");
    std::fs::write(&native, &bytes).unwrap();
    for (name, k) in [("a", &lt), ("b", &native)] {
        ok(&[
            &"compress",
            &"--keys",
            k,
            &"--values",
            &lt,
            &"--out",
            &dir.path().join(name),
        ]);
    }
    assert_eq!(
        std::fs::read(dir.path().join("a/cache.mkv")).unwrap(),
        std::fs::read(dir.path().join("b/cache.mkv")).unwrap()
    );
}
