//! The method registry through every Rust front end (issue 39): every method string the docs
//! mention builds the same cache in the registry (`mosaickv_methods::cache`, what the Python
//! package calls), in the engine (`Caches::new_caches`, what `eval`, `generate` and `serve`
//! decode with) and in `mosaickv attend`: the same outputs bit for bit, or the same refusal.
//! The Python package's side is `bindings/python/tests/test_registry.py`.

use mosaickv_engine::{Arch, Caches, Config, LayerKv, RopeStyle};
use mosaickv_methods::{Method, Options, NAMES};
use mosaickv_spec::{f16, KvShape};
use ndarray::{Array2, Array3};
use npyz::WriterBuilder;
use std::path::Path;
use std::process::Command;

const KV: usize = 2;
const Q: usize = 4;
const D: usize = 64;
const TOKENS: usize = 700;
/// Layers of the engine's model: layer 2 is compressed under every layer rule (Quest's first
/// two dense layers, TurboQuant's first and last two).
const LAYERS: usize = 6;
const LAYER: usize = 2;

/// Every backticked word of the docs that reads as a method string: a known name, then
/// `:key=value` overrides (`--methods a,b` lists are split at commas).
fn doc_method_strings() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = vec![root.join("README.md"), root.join("spec/SPEC.md")];
    for e in std::fs::read_dir(root.join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            files.push(p);
        }
    }
    let mut found = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for (i, span) in text.split('`').enumerate() {
            if i % 2 == 0 {
                continue;
            }
            for word in span.split(|c: char| c.is_whitespace() || c == ',') {
                if is_method_string(word) && !found.iter().any(|w| w == word) {
                    found.push(word.to_string());
                }
            }
        }
    }
    found
}

fn is_method_string(word: &str) -> bool {
    let mut parts = word.split(':').peekable();
    let name = parts.next().unwrap_or("");
    // `turboquant:4bit_nc`: its preset comes first, without a key
    if name == "turboquant" {
        if parts.peek().is_some_and(|p| !p.contains('=')) {
            parts.next();
        }
    }
    NAMES.contains(&name)
        && parts.all(|kv| {
            kv.split_once('=').is_some_and(|(k, v)| {
                !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase()) && !v.is_empty()
            })
        })
}

/// Low-rank K/V rounded to f16 (what `dense.mkv` stores), so every front end sees the same
/// numbers; queries `[Q, D]`.
fn data() -> (Array3<f32>, Array3<f32>, Array2<f32>) {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut r = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let basis: Vec<f32> = (0..KV * 4 * D).map(|_| r()).collect();
    let mut gen = |scale: f32| {
        let mut x = Vec::with_capacity(TOKENS * KV * D);
        for _ in 0..TOKENS {
            for h in 0..KV {
                let c: Vec<f32> = (0..4).map(|_| scale * r()).collect();
                for i in 0..D {
                    let low: f32 = (0..4).map(|j| c[j] * basis[(h * 4 + j) * D + i]).sum();
                    x.push(f16::from_f32(low + 0.05 * r()).to_f32());
                }
            }
        }
        Array3::from_shape_vec((TOKENS, KV, D), x).unwrap()
    };
    let k = gen(2.0);
    let v = gen(1.0);
    let q = Array2::from_shape_fn((Q, D), |(h, i)| k[[TOKENS / 3 + h, h % KV, i]] * 1.5);
    (k, v, q)
}

/// An f32 .npy of any shape.
fn write_npy<D: ndarray::Dimension>(path: &Path, a: &ndarray::Array<f32, D>) {
    let shape: Vec<u64> = a.shape().iter().map(|&n| n as u64).collect();
    let mut w = npyz::WriteOptions::<f32>::new()
        .default_dtype()
        .shape(&shape)
        .writer(std::io::BufWriter::new(
            std::fs::File::create(path).unwrap(),
        ))
        .begin_nd()
        .unwrap();
    w.extend(a.iter().copied()).unwrap();
    w.finish().unwrap();
}

fn mosaickv(args: &[&str]) -> Result<(), String> {
    let o = Command::new(env!("CARGO_BIN_EXE_mosaickv"))
        .args(args)
        .output()
        .unwrap();
    if o.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&o.stderr).into_owned())
    }
}

/// The registry's output for `method`, or its refusal.
fn through_registry(
    method: &Method,
    k: &Array3<f32>,
    v: &Array3<f32>,
    q: &Array2<f32>,
) -> Result<Vec<f32>, String> {
    let shape = KvShape::new(KV, Q, D).unwrap();
    let mut c =
        mosaickv_methods::cache(method, shape, &Options::default()).map_err(|e| e.to_string())?;
    c.prefill(k.view(), v.view()).map_err(|e| e.to_string())?;
    let mut out = Array2::zeros((Q, D));
    c.attend(q.view(), out.view_mut())
        .map_err(|e| e.to_string())?;
    Ok(out.into_raw_vec_and_offset().0)
}

/// The engine's layer [`LAYER`] for `method`, or its refusal.
fn through_engine(
    method: &Method,
    k: &Array3<f32>,
    v: &Array3<f32>,
    q: &Array2<f32>,
) -> Result<Vec<f32>, String> {
    let cfg = Config {
        arch: Arch::Llama,
        n_layers: LAYERS,
        hidden: Q * D,
        ffn: 4 * Q * D,
        q_heads: Q,
        kv_heads: KV,
        head_dim: D,
        vocab: 16,
        rope_theta: 10000.0,
        rope: RopeStyle::Interleaved,
        rms_eps: 1e-5,
        context_length: 4096,
        tied_embeddings: true,
        qkv_bias: false,
    };
    let mut caches = method.new_caches(&cfg).map_err(|e| e.to_string())?;
    let c: &mut Box<dyn LayerKv> = &mut caches[LAYER];
    c.prefill(k.view(), v.view())?;
    let mut out = Array2::zeros((Q, D));
    c.attend(q.view(), out.view_mut())?;
    Ok(out.into_raw_vec_and_offset().0)
}

/// `mosaickv attend --method STRING` on a directory `compress` wrote with the method's
/// configuration (MosaicKV's), or its refusal.
fn through_cli(word: &str, method: &Method, dir: &Path) -> Result<Vec<f32>, String> {
    let cfg = match method {
        Method::Mosaic { config, .. } => config.clone(),
        _ => mosaickv_spec::CompressConfig::default(),
    };
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, serde_json::to_string(&cfg).unwrap()).unwrap();
    let cache = dir.join("cache");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    // `mosaic-ref` compresses with the implementation it names (the two write the same
    // bytes)
    let backend = match method {
        Method::Mosaic {
            implementation: mosaickv_spec::Implementation::Reference,
            ..
        } => "reference",
        _ => "optimized",
    };
    mosaickv(&[
        "compress",
        "--keys",
        &s(&dir.join("k.npy")),
        "--values",
        &s(&dir.join("v.npy")),
        "--config",
        &s(&cfg_path),
        "--backend",
        backend,
        "--out",
        &s(&cache),
    ])?;
    // a saved MosaicKV cache keeps its configuration: attend takes the name and the rate
    let attend_word = match method {
        Method::Mosaic { config, .. } => format!("{}:rate={}", method.name(), config.token_rate),
        _ => word.to_string(),
    };
    let out = dir.join("o.npy");
    mosaickv(&[
        "attend",
        "--cache",
        &s(&cache),
        "--queries",
        &s(&dir.join("q.npy")),
        "--method",
        &attend_word,
        "--out",
        &s(&out),
    ])?;
    let npy = npyz::NpyFile::new(std::fs::File::open(&out).unwrap()).unwrap();
    Ok(npy.into_vec::<f32>().unwrap())
}

#[test]
fn every_documented_method_string_builds_the_same_cache_through_every_front_end() {
    let words = doc_method_strings();
    // the docs name every method, with overrides
    for name in NAMES {
        assert!(
            words.iter().any(|w| w.split(':').next() == Some(name)),
            "the docs never name {name}: {words:?}"
        );
    }
    assert!(words.iter().any(|w| w.contains(':')), "{words:?}");
    let (k, v, q) = data();
    let t = tempfile::tempdir().unwrap();
    write_npy(&t.path().join("k.npy"), &k);
    write_npy(&t.path().join("v.npy"), &v);
    write_npy(&t.path().join("q.npy"), &q);
    let full = through_registry(&Method::Full, &k, &v, &q).unwrap();
    let mut checked = 0;
    for word in &words {
        let method = match Method::parse(word) {
            Ok(m) => m,
            Err(e) => {
                // a refused string is refused by every front end, with the parser's message
                let cli = mosaickv(&[
                    "attend",
                    "--cache",
                    "x",
                    "--queries",
                    "x",
                    "--method",
                    word,
                    "--out",
                    "x",
                ]);
                assert!(
                    cli.as_ref().is_err_and(
                        |m| m.contains(&e.to_string().replace("invalid configuration: ", ""))
                    ),
                    "{word}: {e} vs {cli:?}"
                );
                continue;
            }
        };
        let reg = through_registry(&method, &k, &v, &q);
        let eng = through_engine(&method, &k, &v, &q);
        let cli = through_cli(word, &method, t.path());
        match (&reg, &eng, &cli) {
            (Ok(r), Ok(e), Ok(c)) => {
                let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                if method == Method::Full {
                    // the engine's own dense cache (f16 rows, its attention kernel)
                    let err = rel(e, r);
                    assert!(err < 1e-5, "{word}: engine vs registry {err}");
                } else {
                    assert_eq!(bits(r), bits(e), "{word}: registry vs engine");
                }
                assert_eq!(bits(r), bits(c), "{word}: registry vs mosaickv attend");
                println!("{word}: same output, rel L2 to full {:.3e}", rel(r, &full));
                checked += 1;
            }
            (Err(r), Err(e), Err(c)) => {
                assert!(
                    e.contains(r.trim_start_matches("invalid configuration: ")),
                    "{word}: {r} vs {e}"
                );
                assert!(
                    c.contains(r.trim_start_matches("invalid configuration: ")),
                    "{word}: {r} vs {c}"
                );
                println!("{word}: refused everywhere: {r}");
            }
            _ => panic!(
                "{word}: the front ends disagree: registry {reg:?}, engine {eng:?}, attend {cli:?}"
            ),
        }
    }
    assert!(checked >= NAMES.len(), "only {checked} of {words:?} ran");
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn the_naive2d_default_retention_is_one_number_everywhere() {
    assert_eq!(
        Method::parse("naive2d").unwrap(),
        Method::Naive2d {
            retention: mosaickv_methods::NAIVE2D_DEFAULT_RETENTION,
            token_rate: mosaickv_spec::CompressConfig::default().token_rate,
            min_budget_tokens: mosaickv_spec::CompressConfig::default().min_budget_tokens,
        }
    );
}
