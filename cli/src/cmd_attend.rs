//! `mosaickv attend`: one decode step's attention over a saved cache
//! (SPEC.md section 9 for `mosaic`, section 12 for the baselines).

use crate::cachedir;
use crate::error::CliError;
use crate::npy;
use mosaickv_reference::{FullCache, MosaicCache, Naive2dCache, QuestCache};
use mosaickv_spec::persist::{load_cache, load_dense};
use mosaickv_spec::{validate, KvCache, MosaicError};
use ndarray::{Array2, Array3};
use std::path::PathBuf;

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Method {
    /// MosaicKV on the compressed cache (cache.mkv).
    Mosaic,
    /// Quest top-k pages on the dense f16 K/V (dense.mkv).
    Quest,
    /// Per-head channel mask + Quest on dense.mkv (the paper's strawman).
    Naive2d,
    /// Exact attention over dense.mkv.
    Full,
}

/// Retention of the naive 2-D baseline when `--retention` is not given (the paper's 25 %).
pub const DEFAULT_RETENTION: f64 = 0.25;

#[derive(clap::Args)]
pub struct Args {
    /// Cache directory written by `compress`.
    #[arg(long)]
    pub cache: PathBuf,
    /// Queries [q_heads, head_dim], float32 or float16 .npy.
    #[arg(long)]
    pub queries: PathBuf,
    #[arg(long, value_enum)]
    pub method: Method,
    /// Fraction of tokens attended (mosaic, quest, naive2d); default: the cache's token_rate.
    #[arg(long)]
    pub token_rate: Option<f64>,
    /// Channels kept by naive2d, as a fraction of head_dim (default 0.25).
    #[arg(long)]
    pub retention: Option<f64>,
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
    let (mut compressed, hk, hv) = load_cache(&cachedir::cache_path(&a.cache))?;
    let shape = compressed.shape;
    let queries = npy::read2(&a.queries, "queries")?;
    validate::queries(&shape, &queries.view(), &[shape.q_heads, shape.head_dim])?;
    let token_rate = a.token_rate.unwrap_or(compressed.config.token_rate);

    let mut cache: Box<dyn KvCache> = match a.method {
        Method::Mosaic => {
            compressed.config.token_rate = token_rate;
            Box::new(MosaicCache::from_parts(compressed, hk, hv)?)
        }
        baseline => {
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
            let widen = |v: &[mosaickv_spec::f16]| {
                Array3::from_shape_vec(dim, v.iter().map(|x| x.to_f32()).collect())
                    .map_err(|e| MosaicError::BadFormat(format!("{}: {e}", dpath.display())))
            };
            let (k, v) = (widen(&rows.keys)?, widen(&rows.values)?);
            let mut c: Box<dyn KvCache> = match baseline {
                Method::Full => Box::new(FullCache::new(shape)),
                Method::Quest => Box::new(QuestCache::new(shape, token_rate)?),
                _ => Box::new(Naive2dCache::new(
                    shape,
                    token_rate,
                    a.retention.unwrap_or(DEFAULT_RETENTION),
                )?),
            };
            c.prefill(k.view(), v.view())?;
            c
        }
    };
    let mut out = Array2::<f32>::zeros((shape.q_heads, shape.head_dim));
    cache.attend(queries.view(), out.view_mut())?;
    npy::write2(&a.out, &out)?;
    Ok(())
}
