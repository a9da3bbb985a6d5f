//! # mosaickv-methods: the method registry
//!
//! One factory from a [`Method`] (what a method string such as `mosaic:kloss=0.02`, `kvq4` or
//! `quest:rate=0.1` describes, parsed once by [`Method::parse`] in `mosaickv-spec`) and a
//! [`KvShape`] to a `Box<dyn KvCache>`. Every front end builds its caches here: the engine's
//! layer and probe caches, `mosaickv attend`, the server (through the engine) and the Python
//! package; so the same string gives the same cache everywhere (`tests/front_ends.rs`).
//!
//! Implementations: the optimized CPU backend (`mosaickv-optimized`) serves every method it
//! has; the f64 oracle (`mosaickv-reference`) serves the methods asked for by name
//! (`mosaic-ref`, [`Implementation::Reference`]) and the baselines that exist only there
//! (`naive2d`, `quest-sink`). The oracle is compiled in by the `oracle` feature; without it
//! those methods are `BackendUnavailable`, never silently replaced.

use mosaickv_optimized::baselines::KvqCache;
pub use mosaickv_optimized::Mode;
use mosaickv_optimized::{DenseF16Cache, LiveCache, OptimizedMosaicCache, QuestF16Cache};
pub use mosaickv_spec::method::{
    quest_min_budget, Implementation, Method, NAIVE2D_DEFAULT_RETENTION, NAMES, QUEST_DENSE_LAYERS,
};
use mosaickv_spec::persist_baseline::load_baseline as read_baseline_file;
use mosaickv_spec::{CompressedCache, KvCache, KvShape, MosaicError, Result};
use std::path::Path;

/// How an optimized MosaicKV cache runs its lifecycle (SPEC.md section 10).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MosaicRun {
    /// The production cache (`LiveCache`, SPEC 10.4): generated tokens compressed as they
    /// arrive, segment closes inline ([`Mode::Sync`]) or on a worker thread ([`Mode::Async`]).
    Live(Mode),
    /// `OptimizedMosaicCache`: every close inline, on the caller's thread; what the probes of
    /// `fidelity` measure (its selection is read back between steps).
    Whole,
}

/// What a front end asks of the factory besides the method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// The implementation of methods that have both (`mosaic-ref` is always the reference).
    pub implementation: Implementation,
    pub mosaic: MosaicRun,
}

impl Default for Options {
    /// The optimized backend, MosaicKV as a synchronous live cache.
    fn default() -> Self {
        Self {
            implementation: Implementation::Optimized,
            mosaic: MosaicRun::Live(Mode::Sync),
        }
    }
}

/// One layer of a model: dense (the front end's own dense cache: the engine keeps its f16
/// rows next to its attention kernels) or a cache built here.
pub enum LayerCache {
    Dense,
    Cache(Box<dyn KvCache>),
}

/// Whether this build has the f64 oracle (the `oracle` feature).
pub const fn has_oracle() -> bool {
    cfg!(feature = "oracle")
}

/// The implementation that runs `method` under `options`: `mosaic-ref`, `naive2d` and
/// `quest-sink` run on the reference (the last two exist only there), every other method on
/// `options.implementation`.
pub fn implementation_of(method: &Method, options: &Options) -> Implementation {
    match method {
        Method::Mosaic {
            implementation: Implementation::Reference,
            ..
        }
        | Method::Naive2d { .. }
        | Method::QuestSink { .. } => Implementation::Reference,
        _ => options.implementation,
    }
}

/// The cache of layer `layer` of a model of `layers` layers whose KV shape is `shape`: the
/// method's layer rule applied (`quest` keeps its first `dense_layers` layers dense, as Quest's
/// code does; `turboquant` its first and last `boundary_layers`, as vLLM does), the method
/// checked against `shape.head_dim` first.
pub fn layer_cache(
    method: &Method,
    shape: KvShape,
    layer: usize,
    layers: usize,
    options: &Options,
) -> Result<LayerCache> {
    method.validate_for(shape.head_dim)?;
    Ok(match method {
        Method::Full => LayerCache::Dense,
        Method::Quest { dense_layers, .. } if layer < *dense_layers => LayerCache::Dense,
        Method::TurboQuant {
            boundary_layers, ..
        } if layer < *boundary_layers || layer + boundary_layers >= layers => LayerCache::Dense,
        _ => LayerCache::Cache(build(method, shape, options)?),
    })
}

/// One cache of `method` for KV shape `shape` (no layer rule: a single layer, as `mosaickv
/// attend` and the Python package use it); `full` is the implementation's dense f16 cache.
pub fn cache(method: &Method, shape: KvShape, options: &Options) -> Result<Box<dyn KvCache>> {
    method.validate_for(shape.head_dim)?;
    build(method, shape, options)
}

/// The one table from a method to its cache type.
fn build(method: &Method, shape: KvShape, options: &Options) -> Result<Box<dyn KvCache>> {
    let imp = implementation_of(method, options);
    Ok(match (method, imp) {
        (Method::Full, Implementation::Optimized) => Box::new(DenseF16Cache::new(shape)?),
        (
            Method::Quest {
                token_rate,
                min_budget_tokens,
                ..
            },
            Implementation::Optimized,
        ) => Box::new(
            QuestF16Cache::new(shape, *token_rate)?.with_min_budget_tokens(*min_budget_tokens),
        ),
        (Method::Kvq { format, rotated }, Implementation::Optimized) => {
            let c = KvqCache::new(shape, *format)?;
            Box::new(if *rotated { c.with_rotation() } else { c })
        }
        (Method::TurboQuant { preset, .. }, Implementation::Optimized) => Box::new(
            mosaickv_optimized::turboquant::TurboQuantCache::new(shape, *preset)?,
        ),
        (Method::Mosaic { config, .. }, Implementation::Optimized) => match options.mosaic {
            MosaicRun::Live(mode) => Box::new(LiveCache::new(shape, config.clone(), mode)?),
            MosaicRun::Whole => Box::new(OptimizedMosaicCache::new(shape, config.clone())?),
        },
        (_, Implementation::Reference) => oracle::build(method, shape)?,
        (Method::Naive2d { .. } | Method::QuestSink { .. }, Implementation::Optimized) => {
            unreachable!("implementation_of runs them on the reference")
        }
    })
}

/// A MosaicKV cache rebuilt from a compressed cache and its host rows (SPEC.md section 15.3:
/// the open segment's rows, then the buffer's), its structure checked once.
pub fn mosaic_from_parts(
    cache: CompressedCache,
    host_keys: Vec<f32>,
    host_values: Vec<f32>,
    implementation: Implementation,
    mode: Mode,
) -> Result<Box<dyn KvCache>> {
    match implementation {
        Implementation::Optimized => Ok(Box::new(LiveCache::from_parts(
            cache,
            host_keys,
            host_values,
            mode,
        )?)),
        Implementation::Reference => oracle::mosaic_from_parts(cache, host_keys, host_values),
    }
}

/// A MosaicKV cache file (SPEC.md section 15.3) as a cache of `implementation`.
pub fn load_mosaic(
    path: &Path,
    implementation: Implementation,
    mode: Mode,
) -> Result<Box<dyn KvCache>> {
    let (cache, k, v) = mosaickv_spec::persist::load_cache(path)?;
    mosaic_from_parts(cache, k, v, implementation, mode)
}

/// A baseline cache file (SPEC.md sections 15.5-15.6) of the baseline `name` (`full`, `quest`,
/// `naive2d`, `kvq8`, `kvq4`; `full` also reads the `dense.mkv` of `mosaickv compress`) as a
/// cache of `implementation` (`naive2d`: the reference, its only one). A kvq file says itself
/// whether its rows are rotated, and is read back under that rotation. Another kind of file is
/// `BadFormat` naming what it is.
pub fn load_baseline(
    path: &Path,
    name: &str,
    implementation: Implementation,
) -> Result<Box<dyn KvCache>> {
    let file = read_baseline_file(path, name)?;
    let imp = if name == "naive2d" {
        Implementation::Reference
    } else {
        implementation
    };
    Ok(match (name, imp) {
        ("full", Implementation::Optimized) => Box::new(DenseF16Cache::from_file(&file)?),
        ("quest", Implementation::Optimized) => Box::new(QuestF16Cache::from_file(&file)?),
        (n, Implementation::Optimized) => match mosaickv_spec::KvqFormat::from_name(n) {
            Some(format) => Box::new(KvqCache::from_file(&file, format)?),
            None => {
                return Err(MosaicError::InvalidConfig(format!(
                    "{n:?} has no baseline file format (full, quest, naive2d, kvq8, kvq4)"
                )))
            }
        },
        (n, Implementation::Reference) => oracle::load_baseline(&file, n)?,
    })
}

/// The oracle's side of the table, compiled with the `oracle` feature.
#[cfg(feature = "oracle")]
mod oracle {
    use mosaickv_reference::baselines::{KvqCache, QuestSinkCache};
    use mosaickv_reference::turboquant::TurboQuantCache;
    use mosaickv_reference::{FullCache, MosaicCache, Naive2dCache, QuestCache};
    use mosaickv_spec::persist_baseline::BaselineFile;
    use mosaickv_spec::{CompressedCache, KvCache, KvShape, Method, MosaicError, Result};

    pub fn build(method: &Method, shape: KvShape) -> Result<Box<dyn KvCache>> {
        Ok(match method {
            Method::Full => Box::new(FullCache::new(shape)),
            Method::Quest {
                token_rate,
                min_budget_tokens,
                ..
            } => Box::new(
                QuestCache::new(shape, *token_rate)?.with_min_budget_tokens(*min_budget_tokens),
            ),
            Method::QuestSink { .. } => {
                Box::new(QuestSinkCache::new(shape, &method.quest_sink_config()?)?)
            }
            Method::Kvq { format, rotated } => {
                let c = KvqCache::new(shape, *format)?;
                Box::new(if *rotated { c.with_rotation() } else { c })
            }
            Method::Naive2d {
                retention,
                token_rate,
                min_budget_tokens,
            } => Box::new(
                Naive2dCache::new(shape, *token_rate, *retention)?
                    .with_min_budget_tokens(*min_budget_tokens),
            ),
            Method::TurboQuant { preset, .. } => Box::new(TurboQuantCache::new(shape, *preset)?),
            Method::Mosaic { config, .. } => Box::new(MosaicCache::new(shape, config.clone())?),
        })
    }

    pub fn mosaic_from_parts(
        cache: CompressedCache,
        host_keys: Vec<f32>,
        host_values: Vec<f32>,
    ) -> Result<Box<dyn KvCache>> {
        Ok(Box::new(MosaicCache::from_parts(
            cache,
            host_keys,
            host_values,
        )?))
    }

    pub fn load_baseline(file: &BaselineFile, name: &str) -> Result<Box<dyn KvCache>> {
        Ok(match name {
            "full" => Box::new(FullCache::from_file(file)?),
            "quest" => Box::new(QuestCache::from_file(file)?),
            "naive2d" => Box::new(Naive2dCache::from_file(file)?),
            n => match mosaickv_spec::KvqFormat::from_name(n) {
                Some(format) => Box::new(KvqCache::from_file(file, format)?),
                None => {
                    return Err(MosaicError::InvalidConfig(format!(
                        "{n:?} has no baseline file format (full, quest, naive2d, kvq8, kvq4)"
                    )))
                }
            },
        })
    }
}

/// Without the oracle, whatever needs it is `BackendUnavailable`, saying how to get it.
#[cfg(not(feature = "oracle"))]
mod oracle {
    use mosaickv_spec::persist_baseline::BaselineFile;
    use mosaickv_spec::{CompressedCache, KvCache, KvShape, Method, MosaicError, Result};

    fn missing(what: &str) -> MosaicError {
        MosaicError::BackendUnavailable(format!(
            "{what} runs on the reference implementation (the f64 oracle), which this build \
             leaves out: rebuild with the `oracle` feature (cargo build --features oracle)"
        ))
    }

    pub fn build(method: &Method, _shape: KvShape) -> Result<Box<dyn KvCache>> {
        Err(missing(method.name()))
    }

    pub fn mosaic_from_parts(
        _cache: CompressedCache,
        _host_keys: Vec<f32>,
        _host_values: Vec<f32>,
    ) -> Result<Box<dyn KvCache>> {
        Err(missing("mosaic-ref"))
    }

    pub fn load_baseline(_file: &BaselineFile, name: &str) -> Result<Box<dyn KvCache>> {
        Err(missing(name))
    }
}
