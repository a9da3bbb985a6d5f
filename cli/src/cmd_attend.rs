//! `mosaickv attend`: one decode step's attention over a saved cache
//! (SPEC.md section 9 for `mosaic`, section 12 for the baselines).

use crate::backend::Backend;
use crate::cachedir;
use crate::error::CliError;
use crate::npy;
use mosaickv_optimized::{CpuBackend, DenseF16Cache, LiveCache, Mode, QuestF16Cache};
use mosaickv_reference::{FullCache, MosaicCache, Naive2dCache, QuestCache};
use mosaickv_spec::persist::{load_cache, load_dense};
use mosaickv_spec::{validate, Backend as _, KvCache, KvShape, MosaicError};
use ndarray::{Array2, Array3};
use rayon::prelude::*;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Method {
    /// MosaicKV on the compressed cache (cache.mkv).
    Mosaic,
    /// Quest top-k pages on the dense f16 K/V (dense.mkv).
    Quest,
    /// Per-head channel mask + Quest on dense.mkv (the paper's strawman; reference code on
    /// either backend: there is no optimized naive2d).
    Naive2d,
    /// Exact attention over dense.mkv.
    Full,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::Mosaic => "mosaic",
            Method::Quest => "quest",
            Method::Naive2d => "naive2d",
            Method::Full => "full",
        }
    }
}

/// Retention of the naive 2-D baseline when `--retention` is not given (the paper's 25 %).
pub const DEFAULT_RETENTION: f64 = 0.25;

#[derive(clap::Args)]
pub struct Args {
    /// Cache directory written by `compress`.
    #[arg(long)]
    pub cache: PathBuf,
    /// Queries [q_heads, head_dim], float32 or float16 .npy; q_heads any positive multiple of
    /// the cache's kv_heads (the GQA group is q_heads / kv_heads).
    #[arg(long)]
    pub queries: PathBuf,
    #[arg(long, value_enum)]
    pub method: Method,
    /// Which implementation attends (naive2d runs the reference's on both).
    #[arg(long, value_enum, default_value_t = Backend::Optimized)]
    pub backend: Backend,
    /// Fraction of tokens attended (mosaic, quest, naive2d); default: the cache's token_rate.
    #[arg(long)]
    pub token_rate: Option<f64>,
    /// Channels kept by naive2d, as a fraction of head_dim (default 0.25).
    #[arg(long)]
    pub retention: Option<f64>,
    /// Print on stderr how long the attention call took, apart from loading the files and
    /// building the cache (reported beside it).
    #[arg(long)]
    pub timing: bool,
    /// Output .npy, [q_heads, head_dim] float32.
    #[arg(long)]
    pub out: PathBuf,
}

fn check_fraction(name: &str, x: f64) -> Result<(), CliError> {
    if x > 0.0 && x <= 1.0 {
        Ok(())
    } else {
        Err(MosaicError::InvalidConfig(format!("{name} {x} not in (0, 1]")).into())
    }
}

pub fn run(a: Args) -> Result<(), CliError> {
    if let Some(t) = a.token_rate {
        check_fraction("--token-rate", t)?;
    }
    if let Some(r) = a.retention {
        check_fraction("--retention", r)?;
        if a.method != Method::Naive2d {
            return Err(CliError::Input(
                "--retention applies only to --method naive2d".into(),
            ));
        }
    }
    let load_start = Instant::now();
    let (mut compressed, hk, hv) = load_cache(&cachedir::cache_path(&a.cache))?;
    let queries = npy::read2(&a.queries, "queries")?;
    // The GQA group belongs to the queries, not to the stored cache (whose q_heads is only
    // what `compress` was told).
    let stored = compressed.shape;
    let shape = KvShape::new(stored.kv_heads, queries.nrows(), stored.head_dim)?;
    validate::queries(&shape, &queries.view(), &[shape.q_heads, shape.head_dim])?;
    compressed.shape = shape;
    let token_rate = a.token_rate.unwrap_or(compressed.config.token_rate);
    let tokens = compressed.len();

    let mut cache: Box<dyn KvCache> = match a.method {
        Method::Mosaic => {
            compressed.config.token_rate = token_rate;
            match a.backend {
                // The production cache rebuilt from the file (its structure checked here, once);
                // `Mode::Sync`: no worker thread (nothing is appended).
                Backend::Optimized => {
                    Box::new(LiveCache::from_parts(compressed, hk, hv, Mode::Sync)?)
                }
                Backend::Reference => Box::new(MosaicCache::from_parts(compressed, hk, hv)?),
            }
        }
        baseline => {
            let mut c: Box<dyn KvCache> = match (baseline, a.backend) {
                (Method::Full, Backend::Optimized) => Box::new(DenseF16Cache::new(shape)?),
                (Method::Full, Backend::Reference) => Box::new(FullCache::new(shape)),
                (Method::Quest, Backend::Optimized) => {
                    Box::new(QuestF16Cache::new(shape, token_rate)?)
                }
                (Method::Quest, Backend::Reference) => {
                    Box::new(QuestCache::new(shape, token_rate)?)
                }
                _ => Box::new(Naive2dCache::new(
                    shape,
                    token_rate,
                    a.retention.unwrap_or(DEFAULT_RETENTION),
                )?),
            };
            let (k, v) = load_dense_f32(&a, &shape)?;
            c.prefill(k.view(), v.view())?;
            c
        }
    };
    // Start every thread of the pool the optimized kernels run on (the baselines' prefill
    // above already did), so that the clock below times attention, not thread creation.
    rayon::broadcast(|_| ());
    let load_s = load_start.elapsed().as_secs_f64();

    let mut out = Array2::<f32>::zeros((shape.q_heads, shape.head_dim));
    let attend_start = Instant::now();
    cache.attend(queries.view(), out.view_mut())?;
    let attend_s = attend_start.elapsed().as_secs_f64();
    npy::write2(&a.out, &out)?;
    if a.timing {
        let backend = match (a.method, a.backend) {
            (Method::Naive2d, _) | (_, Backend::Reference) => Backend::Reference.name().into(),
            (_, b) => format!("{}, {}", b.name(), CpuBackend::new().name()),
        };
        eprintln!(
            "mosaickv attend: {} ({backend}) over {tokens} tokens, {} query heads: attention {:.3} ms (loading the files and building the cache {:.3} s)",
            a.method.name(),
            shape.q_heads,
            1e3 * attend_s,
            load_s
        );
    }
    Ok(())
}

/// Elements widened per parallel task.
const WIDEN_CHUNK: usize = 1 << 16;

/// `dense.mkv`'s K/V `[tokens, kv_heads, head_dim]`, widened to f32 (exact).
fn load_dense_f32(a: &Args, shape: &KvShape) -> Result<(Array3<f32>, Array3<f32>), CliError> {
    let dpath = cachedir::dense_path(&a.cache);
    let (dshape, rows) = load_dense(&dpath)?;
    if (dshape.kv_heads, dshape.head_dim) != (shape.kv_heads, shape.head_dim) {
        return Err(MosaicError::BadFormat(format!(
            "{}: shape {dshape:?} does not match the cache's {shape:?}",
            dpath.display()
        ))
        .into());
    }
    let dim = (rows.tokens, shape.kv_heads, shape.head_dim);
    // f16 -> f32 is exact; chunks in parallel on the fastest kernel the CPU has.
    let path = mosaickv_optimized::Path::detect();
    let widen = |v: &[mosaickv_spec::f16]| {
        let mut wide = vec![0f32; v.len()];
        wide.par_chunks_mut(WIDEN_CHUNK)
            .zip(v.par_chunks(WIDEN_CHUNK))
            .for_each(|(dst, src)| path.f16_to_f32(src, dst));
        Array3::from_shape_vec(dim, wide)
            .map_err(|e| MosaicError::BadFormat(format!("{}: {e}", dpath.display())))
    };
    Ok((widen(&rows.keys)?, widen(&rows.values)?))
}
