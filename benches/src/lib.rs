//! Shared helpers of the benchmarks: memory bandwidth, exact f64 attention, statistics, and
//! the configurations the compare tool runs.

use mosaickv_optimized::profile::Stage;
use mosaickv_spec::{CompressConfig, CompressedCache, MosaicError, Selection, ValueDtype};
use ndarray::{Array2, ArrayView2, ArrayView3};
use rayon::prelude::*;
use std::time::Instant;

/// Sets up rayon's global pool as the CLI does, the main thread one of its workers
/// (`mosaickv_optimized::threads`), so that every method a bench times runs in the same pool
/// as in `mosaickv generate`; `MOSAICKV_MAIN_THREAD_WORKER=0` keeps rayon's default. Call first
/// thing in `main`. Returns the setup's name for the JSON (`"main-thread-worker"`, `"default"`).
pub fn setup_pool() -> &'static str {
    use mosaickv_optimized::threads::{main_thread_worker, PoolSetup};
    match main_thread_worker() {
        Ok(PoolSetup::MainThreadWorker(_)) => "main-thread-worker",
        Ok(PoolSetup::Default) => "default",
        Err(e) => {
            eprintln!("rayon pool: {e}; rayon's default pool");
            "default"
        }
    }
}

/// Measured read bandwidth in GB/s (1e9 bytes/s): best of `reps` multi-threaded
/// passes summing a buffer of `bytes` bytes (u64 words, 4 accumulators per thread).
pub fn read_bandwidth_gbps(bytes: usize, reps: usize) -> f64 {
    let n = bytes / 8;
    let buf: Vec<u64> = (0..n as u64)
        .into_par_iter()
        .map(|i| i.wrapping_mul(0x9e37_79b9))
        .collect();
    let mut best = 0f64;
    for _ in 0..reps {
        let t = Instant::now();
        let s: u64 = buf
            .par_chunks(1 << 16)
            .map(|c| {
                let mut a = [0u64; 4];
                for w in c.chunks_exact(4) {
                    for k in 0..4 {
                        a[k] = a[k].wrapping_add(w[k]);
                    }
                }
                a.iter().fold(0u64, |x, y| x.wrapping_add(*y))
            })
            .reduce(|| 0, |a, b| a.wrapping_add(b));
        let dt = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.max(bytes as f64 / dt / 1e9);
    }
    best
}

/// Exact attention in f64 over every token of f32 K/V `[n, kv, d]` for queries `[q_heads, d]`
/// (parallel over query heads), rounded to f32.
pub fn exact_full_attention(
    keys: ArrayView3<f32>,
    values: ArrayView3<f32>,
    q: ArrayView2<f32>,
) -> Array2<f32> {
    let (n, kv, d) = keys.dim();
    let qh = q.nrows();
    let g = qh / kv;
    let rows: Vec<Vec<f32>> = (0..qh)
        .into_par_iter()
        .map(|h| {
            let j = h / g;
            let z: Vec<f64> = (0..n)
                .map(|t| {
                    let k = keys.slice(ndarray::s![t, j, ..]);
                    k.iter()
                        .zip(q.row(h))
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let mut acc = vec![0f64; d];
            let mut s = 0f64;
            for (t, &zt) in z.iter().enumerate() {
                let p = (zt - m).exp();
                s += p;
                for (a, &v) in acc
                    .iter_mut()
                    .zip(values.slice(ndarray::s![t, j, ..]).iter())
                {
                    *a += p * v as f64;
                }
            }
            acc.iter().map(|a| (a / s) as f32).collect()
        })
        .collect();
    Array2::from_shape_fn((qh, d), |(h, i)| rows[h][i])
}

/// `||a - b|| / ||b||` over all elements (0 when both are 0).
pub fn rel_l2(a: ArrayView2<f32>, b: ArrayView2<f32>) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b.iter())
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    if den == 0.0 {
        if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (num / den).sqrt()
    }
}

/// Median of samples (sorted copy).
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    if v.is_empty() {
        return f64::NAN;
    }
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        0.5 * (v[m - 1] + v[m])
    }
}

/// The configurations `compare --config` knows by name (besides a JSON file), in the order
/// the help text lists them.
pub const NAMED_CONFIGS: [&str; 5] = [
    "default",
    "paper",
    "paper-vblocks",
    "paper-int8",
    "paper-int4",
];

/// A configuration by name: `default` = [`CompressConfig::default`] (the shipped default),
/// `paper` = [`CompressConfig::paper_fixed`], and three variants of the paper's setting:
/// `paper-vblocks` (the default block sizes 16/32/64 by key variance, SPEC 11.3),
/// `paper-int8` / `paper-int4` (its retained values stored as int8 / int4, SPEC 6).
pub fn named_config(name: &str) -> Option<CompressConfig> {
    let paper = CompressConfig::paper_fixed;
    match name {
        "default" => Some(CompressConfig::default()),
        "paper" => Some(paper()),
        "paper-vblocks" => Some(CompressConfig {
            block_sizes: CompressConfig::default().block_sizes,
            ..paper()
        }),
        "paper-int8" => Some(CompressConfig {
            value_dtypes: vec![ValueDtype::Int8],
            ..paper()
        }),
        "paper-int4" => Some(CompressConfig {
            value_dtypes: vec![ValueDtype::Int4],
            ..paper()
        }),
        _ => None,
    }
}

/// One configuration a compare run measures: the label its rows carry and its parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct LabeledConfig {
    /// The name (`default`, `paper`, ...) or, for a file, the file's path as given.
    pub label: String,
    pub config: CompressConfig,
}

/// Resolves one `--config` argument: a name of [`NAMED_CONFIGS`], else a JSON configuration
/// file in the format `mosaickv compress --config` reads ([`CompressConfig::from_json`]:
/// any subset of the keys of SPEC.md section 2). The result is validated for `head_dim`.
pub fn resolve_config(arg: &str, head_dim: usize) -> Result<LabeledConfig, MosaicError> {
    let config = match named_config(arg) {
        Some(c) => c,
        None => {
            let path = std::path::Path::new(arg);
            if !path.is_file() {
                return Err(MosaicError::InvalidConfig(format!(
                    "--config {arg:?} is neither one of {} nor a file",
                    NAMED_CONFIGS.join(", ")
                )));
            }
            let text = std::fs::read_to_string(path)
                .map_err(|e| MosaicError::InvalidConfig(format!("cannot read {arg}: {e}")))?;
            CompressConfig::from_json(&text)?
        }
    };
    config.validate(head_dim)?;
    Ok(LabeledConfig {
        label: arg.to_string(),
        config,
    })
}

/// Resolves every `--config` argument in order; a label given twice is an error (its rows
/// could not be told apart).
pub fn resolve_configs(
    args: &[String],
    head_dim: usize,
) -> Result<Vec<LabeledConfig>, MosaicError> {
    let mut out: Vec<LabeledConfig> = Vec::with_capacity(args.len());
    for a in args {
        if out.iter().any(|c| c.label == *a) {
            return Err(MosaicError::InvalidConfig(format!(
                "--config {a:?} given twice"
            )));
        }
        out.push(resolve_config(a, head_dim)?);
    }
    if out.is_empty() {
        return Err(MosaicError::InvalidConfig("no --config given".into()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_configs_are_what_the_help_says() {
        assert_eq!(named_config("default"), Some(CompressConfig::default()));
        assert_eq!(named_config("paper"), Some(CompressConfig::paper_fixed()));
        for n in NAMED_CONFIGS {
            let c = named_config(n).expect("listed name resolves");
            c.validate(128).expect("valid");
            if n.starts_with("paper-") {
                assert_eq!(c.token_rate, CompressConfig::paper_fixed().token_rate);
                assert_ne!(c, CompressConfig::paper_fixed(), "{n}");
            }
        }
        assert_eq!(
            named_config("paper-int4").unwrap().value_dtypes,
            vec![ValueDtype::Int4]
        );
        assert_eq!(named_config("Default"), None);
    }

    #[test]
    fn config_files_and_bad_arguments() {
        let dir = std::env::temp_dir().join(format!("mkv-bench-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("c.json");
        std::fs::write(&good, r#"{"token_rate": 0.3, "min_budget_tokens": 32}"#).unwrap();
        let c = resolve_config(good.to_str().unwrap(), 128).unwrap();
        assert_eq!(c.label, good.to_str().unwrap());
        assert_eq!(c.config.token_rate, 0.3);
        assert_eq!(c.config.min_budget_tokens, 32);
        // the rest takes the defaults, as `mosaickv compress --config` does
        assert_eq!(
            c.config.value_dtypes,
            CompressConfig::default().value_dtypes
        );
        let unknown = dir.join("u.json");
        std::fs::write(&unknown, r#"{"token_rat": 0.3}"#).unwrap();
        assert!(matches!(
            resolve_config(unknown.to_str().unwrap(), 128),
            Err(MosaicError::UnknownConfigKey(k)) if k == "token_rat"
        ));
        let invalid = dir.join("i.json");
        std::fs::write(&invalid, r#"{"token_rate": 1.5}"#).unwrap();
        assert!(matches!(
            resolve_config(invalid.to_str().unwrap(), 128),
            Err(MosaicError::InvalidConfig(_))
        ));
        assert!(matches!(
            resolve_config("no-such-config", 128),
            Err(MosaicError::InvalidConfig(_))
        ));
        let twice = ["default".to_string(), "default".to_string()];
        assert!(resolve_configs(&twice, 128).is_err());
        let both = ["default".to_string(), "paper".to_string()];
        let r = resolve_configs(&both, 128).unwrap();
        assert_eq!(r[0].label, "default");
        assert_eq!(r[1].config, CompressConfig::paper_fixed());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// What one stage of a MosaicKV decode step reads and computes (`profile_stages`, and the
/// bytes `compare` reports).
#[derive(Debug, Clone, Copy)]
pub struct StageWork {
    pub name: &'static str,
    /// The stage the profiled step times it under (`None`: timed only as part of a phase).
    pub stage: Option<Stage>,
    /// Bytes read.
    pub bytes: usize,
    /// Whether those bytes are the cache's (false: the step's own scratch).
    pub from_cache: bool,
    /// Multiply-adds: f32 FMAs, int8 products for the block scores, exps for the softmax,
    /// one per score for the top blocks. Key logits and values count what the tile kernels
    /// do (`n * g * pad8(Dt)`), not the `r` kept elements.
    pub multiply_adds: usize,
}

/// The work of each stage of one MosaicKV decode step over cache `c` with selection `sel`:
/// all block metadata and every segment's K rotation (queries are rotated per segment), the
/// selected K and V records (bitmap, scale, values, padding), the V rotations of segments
/// with a selected block, the dense sink + buffer rows, and the top blocks' scratch.
pub fn step_work(c: &CompressedCache, sel: &Selection) -> [StageWork; 8] {
    let s = &c.shape;
    let (g, d) = (s.group(), s.head_dim);
    let pad8 = |x: usize| x.div_ceil(8) * 8;
    let work = |name, stage, from_cache| StageWork {
        name,
        stage,
        bytes: 0,
        from_cache,
        multiply_adds: 0,
    };
    let mut rot = work("SPEC 8.1 rotate queries", Some(Stage::Rotate), true);
    let mut score = work("SPEC 8.2 block scores", Some(Stage::Score), true);
    let mut topk = work("SPEC 8.3 top blocks", Some(Stage::TopK), false);
    let mut keys = work("SPEC 9 key logits", Some(Stage::KeyLogits), true);
    let mut soft = work("SPEC 9 softmax (exps)", Some(Stage::Softmax), true);
    let mut vals = work("SPEC 9 values", Some(Stage::Values), true);
    let mut dense = work("SPEC 9 dense rows (sink, buffer)", None, true);
    let mut merge = work("SPEC 9 merge + back-rotation", None, true);
    for (h, blocks) in sel.per_head.iter().enumerate() {
        let mut touched = vec![false; c.segments.len()];
        for &(si, b) in blocks {
            let seg = &c.segments[si as usize];
            let hs = &seg.heads[h];
            let bs = hs.strategy.block_size;
            let n = (seg.len - b as usize * bs).min(bs);
            let (kl, vl) = (&hs.strategy.key.layout, &hs.strategy.value.layout);
            keys.bytes += n * kl.record_bytes();
            keys.multiply_adds += n * g * pad8(kl.kept_dims);
            soft.multiply_adds += n * g;
            vals.bytes += n * vl.record_bytes();
            vals.multiply_adds += n * g * pad8(vl.kept_dims);
            touched[si as usize] = true;
        }
        for (si, seg) in c.segments.iter().enumerate() {
            let hs = &seg.heads[h];
            let (dtk, dtv) = (
                hs.strategy.key.layout.kept_dims,
                hs.strategy.value.layout.kept_dims,
            );
            let blocks = seg.len.div_ceil(hs.strategy.block_size.max(1));
            // the stored rotations, D x Dt f16 (SPEC.md section 3)
            rot.bytes += std::mem::size_of_val(&hs.strategy.key.rotation[..]);
            rot.multiply_adds += g * d * dtk;
            score.bytes += hs.meta.bytes();
            score.multiply_adds += 2 * blocks * g * dtk;
            topk.bytes += 12 * blocks; // a score written and read, a rank key
            topk.multiply_adds += blocks;
            if touched[si] {
                merge.bytes += std::mem::size_of_val(&hs.strategy.value.rotation[..]);
                merge.multiply_adds += g * d * dtv;
            }
        }
    }
    dense.bytes = c.sink.bytes() + c.buffer.bytes();
    dense.multiply_adds = 2 * (c.sink.tokens + c.buffer.tokens) * s.q_heads * d;
    [rot, score, topk, keys, soft, vals, dense, merge]
}
