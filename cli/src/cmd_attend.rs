//! `mosaickv attend`: one decode step's attention over a saved cache
//! (SPEC.md section 9 for `mosaic`, section 12 for the baselines). The cache is built by the
//! method registry (`mosaickv-methods`) from the method string, as every front end builds it.

use crate::backend::Backend;
use crate::cachedir;
use crate::error::CliError;
use crate::npy;
use mosaickv_methods::{implementation_of, Implementation, Method, Mode, Options};
use mosaickv_optimized::CpuBackend;
use mosaickv_spec::persist::{load_cache, load_dense};
use mosaickv_spec::{validate, Backend as _, KvCache, KvShape, MosaicError};
use ndarray::{Array2, Array3};
use rayon::prelude::*;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Cache directory written by `compress`.
    #[arg(long)]
    pub cache: PathBuf,
    /// Queries [q_heads, head_dim], float32 or float16 .npy; q_heads any positive multiple of
    /// the cache's kv_heads (the GQA group is q_heads / kv_heads).
    #[arg(long)]
    pub queries: PathBuf,
    /// The method, as every front end names it (`mosaickv_spec::method`): `mosaic` (on
    /// cache.mkv, whose configuration is the saved one: only `rate=` applies), `mosaic-ref`,
    /// or a baseline on the dense f16 K/V of dense.mkv: `full`, `quest`, `quest-sink`,
    /// `naive2d`, `kvq8`, `kvq4`, each with its `:key=value` overrides (e.g. `quest:minb=0`,
    /// `naive2d:ret=0.25`).
    #[arg(long)]
    pub method: String,
    /// Which implementation attends (`naive2d`, `quest-sink` and `mosaic-ref` run the
    /// reference's on both).
    #[arg(long, value_enum, default_value_t = Backend::Optimized)]
    pub backend: Backend,
    /// Fraction of tokens attended (every method but full and kvq); default: the method
    /// string's `rate=`, else the cache's token_rate.
    #[arg(long)]
    pub token_rate: Option<f64>,
    /// Channels kept by naive2d, as a fraction of head_dim (default: the method string's
    /// `ret=`, else 0.5, the one default of every front end).
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

/// Whether the method string sets `key` itself (`quest:rate=0.1`).
fn overrides(spec: &str, key: &str) -> bool {
    spec.split(':')
        .skip(1)
        .any(|kv| kv.split('=').next().map(str::trim) == Some(key))
}

/// The method string with the flags applied: `--token-rate` (else the string's `rate=`, else
/// the saved cache's token_rate) and `--retention`.
fn method_of(a: &Args, cache_rate: f64) -> Result<Method, CliError> {
    if let Some(t) = a.token_rate {
        mosaickv_spec::rules::fraction("--token-rate", t)?;
    }
    if let Some(r) = a.retention {
        mosaickv_spec::rules::fraction("--retention", r)?;
    }
    let mut method = Method::parse(&a.method)?;
    let rate = a
        .token_rate
        .or((!overrides(&a.method, "rate")).then_some(cache_rate));
    match &mut method {
        Method::Quest { token_rate, .. }
        | Method::QuestSink { token_rate, .. }
        | Method::Naive2d { token_rate, .. } => *token_rate = rate.unwrap_or(*token_rate),
        Method::Mosaic { config, .. } => {
            let defaults_but_rate = mosaickv_spec::CompressConfig {
                token_rate: config.token_rate,
                ..Default::default()
            };
            if *config != defaults_but_rate {
                return Err(CliError::Input(format!(
                    "--method {}: a saved cache keeps the configuration it was compressed with; only rate= (or --token-rate) applies",
                    a.method
                )));
            }
            config.token_rate = rate.unwrap_or(config.token_rate);
        }
        // every token attended: a token rate has nothing to select (accepted, as before)
        Method::Full | Method::Kvq { .. } | Method::TurboQuant { .. } => {}
    }
    match (&mut method, a.retention) {
        (Method::Naive2d { retention, .. }, Some(r)) => *retention = r,
        (_, Some(_)) => {
            return Err(CliError::Input(
                "--retention applies only to --method naive2d".into(),
            ))
        }
        _ => {}
    }
    Ok(method)
}

pub fn run(a: Args) -> Result<(), CliError> {
    // the arguments first, before any file is read
    method_of(&a, mosaickv_spec::CompressConfig::default().token_rate)?;
    let load_start = Instant::now();
    let (mut compressed, hk, hv) = load_cache(&cachedir::cache_path(&a.cache))?;
    let method = method_of(&a, compressed.config.token_rate)?;
    let options = Options {
        implementation: match a.backend {
            Backend::Optimized => Implementation::Optimized,
            Backend::Reference => Implementation::Reference,
        },
        ..Options::default()
    };
    let queries = npy::read2(&a.queries, "queries")?;
    // The GQA group belongs to the queries, not to the stored cache (whose q_heads is only
    // what `compress` was told).
    let stored = compressed.shape;
    let shape = KvShape::new(stored.kv_heads, queries.nrows(), stored.head_dim)?;
    validate::queries(&shape, &queries.view(), &[shape.q_heads, shape.head_dim])?;
    compressed.shape = shape;
    let tokens = compressed.len();
    let implementation = implementation_of(&method, &options);

    let mut cache: Box<dyn KvCache> = match &method {
        // The production cache rebuilt from the file (its structure checked here, once);
        // `Mode::Sync`: no worker thread (nothing is appended).
        Method::Mosaic { config, .. } => {
            compressed.config.token_rate = config.token_rate;
            mosaickv_methods::mosaic_from_parts(compressed, hk, hv, implementation, Mode::Sync)?
        }
        baseline => {
            let mut c = mosaickv_methods::cache(baseline, shape, &options)?;
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
        let backend = match implementation {
            Implementation::Reference => Backend::Reference.name().into(),
            Implementation::Optimized => {
                format!(
                    "{}, {}",
                    Backend::Optimized.name(),
                    CpuBackend::new().name()
                )
            }
        };
        eprintln!(
            "mosaickv attend: {} ({backend}) over {tokens} tokens, {} query heads: attention {:.3} ms (loading the files and building the cache {:.3} s)",
            method.name(),
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
