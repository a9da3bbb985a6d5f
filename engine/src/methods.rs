//! KV-cache methods for the decode loop: every `mosaickv_spec::KvCache` (MosaicKV and the
//! SPEC.md section 12 baselines) as an engine [`LayerKv`], and [`Method`], the name a user
//! picks on the command line.
//!
//! Prefill stays dense and shared (issue 4): one [`crate::Model::prefill`] per prompt, then each
//! method's caches take the same per-layer K/V through `prefill` and decode from there.
//! Every layer is compressed, except where the method's description says otherwise: `quest`
//! keeps its first [`QUEST_DENSE_LAYERS`] layers dense as Quest's code does (`layer_id < 2`
//! runs dense attention in `evaluation/quest_attention.py`); those layers' f16 bytes are
//! counted in its bytes per token (docs/ACCURACY.md).

use crate::kv::{FullKv, LayerKv};
use crate::{EngineError, Result};
use mosaickv_optimized::baselines::{KvqCache as OptKvqCache, KvqFormat as OptKvqFormat};
use mosaickv_optimized::{CpuBackend, LiveCache, Mode, OptimizedMosaicCache, QuestF16Cache};
use mosaickv_reference::baselines::{KvqCache, KvqFormat, QuestSinkCache};
use mosaickv_reference::{MosaicCache, Naive2dCache, QuestCache};
use mosaickv_spec::{
    Backend as _, ChannelPolicy, CompressConfig, CompressedCache, KvCache, KvShape, ValueDtype,
};
use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2};
use std::fmt;

/// Any [`KvCache`] as a [`LayerKv`]: errors become strings, `bytes()` is the device bytes of
/// `memory()` (SPEC.md section 13, every byte counted).
pub struct KvAdapter<C: KvCache>(pub C);

impl<C: KvCache> LayerKv for KvAdapter<C> {
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<(), String> {
        self.0.prefill(keys, values).map_err(|e| e.to_string())
    }
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<(), String> {
        self.0.append(key, value).map_err(|e| e.to_string())
    }
    fn attend(&mut self, queries: ArrayView2<f32>, out: ArrayViewMut2<f32>) -> Result<(), String> {
        self.0.attend(queries, out).map_err(|e| e.to_string())
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn bytes(&self) -> usize {
        self.0.memory().device_bytes()
    }
    fn bytes_bound(&self, more: usize) -> Option<usize> {
        self.0.device_bytes_bound(more)
    }
    fn set_query_stats(&mut self, stats: mosaickv_spec::QueryStats) -> Result<(), String> {
        self.0
            .set_query_stats(Some(stats))
            .map_err(|e| e.to_string())
    }
    fn host_bytes(&self) -> usize {
        self.0.memory().host_rows
    }
    fn memory_report(&self) -> Option<mosaickv_spec::MemoryReport> {
        Some(self.0.memory())
    }
}

/// A layer cache that can also say which tokens it attends for given queries (for recall@k,
/// SPEC.md section 16). `None`: every token.
pub trait ProbeKv: LayerKv {
    /// Token indices attended per query head for queries `[q_heads, head_dim]`.
    fn attended(&self, queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>, String>;
}

impl ProbeKv for FullKv {
    fn attended(&self, _queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>, String> {
        Ok(None)
    }
}

/// The reference caches report their attended tokens themselves.
macro_rules! probe_via_attended_tokens {
    ($($cache:ty),*) => {$(
        impl ProbeKv for KvAdapter<$cache> {
            fn attended(&self, queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>, String> {
                self.0
                    .attended_tokens(queries)
                    .map(Some)
                    .map_err(|e| e.to_string())
            }
        }
    )*};
}

probe_via_attended_tokens!(MosaicCache, QuestCache, Naive2dCache, QuestSinkCache);

/// kvq8 / kvq4 attend every token.
impl ProbeKv for KvAdapter<KvqCache> {
    fn attended(&self, _queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>, String> {
        Ok(None)
    }
}

impl ProbeKv for KvAdapter<OptimizedMosaicCache> {
    fn attended(&self, queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>, String> {
        attended_of_compressed(self.0.compressed(), queries).map(Some)
    }
}

/// SPEC.md sections 8-9: the tokens a compressed cache attends per query head (sink, the
/// blocks the CPU backend selects, the update buffer).
pub fn attended_of_compressed(
    cache: &CompressedCache,
    queries: ArrayView2<f32>,
) -> Result<Vec<Vec<usize>>, String> {
    let shape = cache.shape;
    let total = cache.len();
    let sink = cache.sink.tokens;
    let seg_end = cache.segments.last().map_or(sink, |s| s.start + s.len);
    let mut per_kv: Vec<Vec<usize>> = vec![(0..sink).collect(); shape.kv_heads];
    if !cache.segments.is_empty() {
        let sel = CpuBackend::new()
            .select(cache, queries)
            .map_err(|e| e.to_string())?;
        for (h, blocks) in sel.per_head.iter().enumerate() {
            for &(s, b) in blocks {
                let seg = &cache.segments[s as usize];
                let bs = seg.heads[h].strategy.block_size;
                let a = seg.start + b as usize * bs;
                let e = (a + bs).min(seg.start + seg.len);
                per_kv[h].extend(a..e);
            }
        }
    }
    for set in &mut per_kv {
        set.extend(seg_end..total);
    }
    Ok((0..shape.q_heads)
        .map(|qh| per_kv[qh / shape.group()].clone())
        .collect())
}

/// Which implementation of MosaicKV runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MosaicBackend {
    /// `mosaickv-reference` (f64 oracle).
    Reference,
    /// `mosaickv-optimized` (CPU kernels).
    Optimized,
}

/// A KV-cache method (issue 4): what `--method` / `--methods` name.
///
/// Names: `full`, `quest`, `quest-sink`, `naive2d`, `kvq8`, `kvq4`, `mosaic` (optimized
/// backend), `mosaic-ref` (reference backend), each optionally followed by `:key=value`
/// overrides separated by `:`: `rate` (token_rate), `dense` (quest: leading dense layers),
/// `ret` (fixed channel retention; for mosaic it switches to the fixed policy), `g` (group
/// size with `ret`), `kloss`, `vloss` (loss thresholds), `rets` (candidate retentions,
/// `/`-separated), `dt` (mosaic: value dtypes, `/`-separated, e.g. `dt=int4/int8/f16`),
/// `minb` (mosaic: min_budget_tokens), `trunc` (truncate_fraction), `sink` (mosaic, quest-sink), `lin`
/// (input_segment_len), `bs` (block sizes, `/`-separated), `var` (variance_threshold).
/// Example: `mosaic:ret=0.5`, `naive2d:ret=0.25`, `mosaic:rate=1:trunc=0`, `quest:dense=0`.
#[derive(Debug, Clone, PartialEq)]
pub enum Method {
    /// Dense f16 cache (engine's [`FullKv`]).
    Full,
    /// SPEC.md section 12 Quest as Quest's code runs it (optimized `QuestF16Cache`): the first
    /// `dense_layers` layers dense ([`FullKv`]), pages of 16, the last page always attended.
    Quest {
        token_rate: f64,
        dense_layers: usize,
    },
    /// SPEC.md section 12 Quest-sink (reference `QuestSinkCache`): Quest's pages under
    /// MosaicKV's sink, update buffer and token budget (the default configuration's, with
    /// `token_rate` and `sink_tokens` overridable), every layer.
    QuestSink { token_rate: f64, sink_tokens: usize },
    /// SPEC.md section 12 kvq8 / kvq4: llama.cpp's `q8_0` / `q4_0` KV cache (optimized
    /// `KvqCache`), every token attended, every layer.
    Kvq { format: KvqFormat },
    /// SPEC.md section 12 naive 2-D (reference `Naive2dCache`).
    Naive2d { retention: f64, token_rate: f64 },
    /// MosaicKV with a configuration (SPEC.md section 2).
    Mosaic {
        backend: MosaicBackend,
        config: CompressConfig,
    },
}

/// Layers Quest's code keeps dense (`layer_id < 2` in `evaluation/quest_attention.py`; the
/// kernel path skips them the same way, `quest/utils/controller.py`'s `set_page_budget`).
pub const QUEST_DENSE_LAYERS: usize = 2;

/// Default channel retention of `naive2d` when none is given: 50 %, the setting that kept the
/// needle on this model's KV in the foundation measurements (SPEC.md section 2).
pub const NAIVE2D_DEFAULT_RETENTION: f64 = 0.5;

impl Method {
    /// Parses a method name with optional `:key=value` overrides (see [`Method`]) and checks
    /// what does not depend on the model; group sizes are checked against the loaded model's
    /// head_dim when its caches are built ([`Method::validate_for`]).
    pub fn parse(spec: &str) -> Result<Method> {
        let mut parts = spec.trim().split(':');
        let name = parts.next().unwrap_or("");
        let mut kv = Vec::new();
        for p in parts {
            let (k, v) = p.split_once('=').ok_or_else(|| {
                EngineError::Invalid(format!("method {spec:?}: override {p:?} is not key=value"))
            })?;
            let k = k.trim().to_string();
            if kv.iter().any(|(seen, _): &(String, String)| *seen == k) {
                return Err(EngineError::Invalid(format!(
                    "method {spec:?}: {k} is given twice"
                )));
            }
            kv.push((k, v.trim().to_string()));
        }
        let num = |k: &str, v: &str| -> Result<f64> {
            v.parse::<f64>().map_err(|_| {
                EngineError::Invalid(format!("method {spec:?}: {k}={v} is not a number"))
            })
        };
        let count = |k: &str, v: &str| -> Result<usize> {
            v.parse::<usize>().map_err(|_| {
                EngineError::Invalid(format!(
                    "method {spec:?}: {k}={v} is not a non-negative integer"
                ))
            })
        };
        let list =
            |k: &str, v: &str| -> Result<Vec<f64>> { v.split('/').map(|x| num(k, x)).collect() };
        let counts = |k: &str, v: &str| -> Result<Vec<usize>> {
            v.split('/').map(|x| count(k, x)).collect()
        };
        let default_rate = CompressConfig::default().token_rate;
        let unknown = |k: &str| {
            EngineError::Invalid(format!(
                "method {spec:?}: unknown override {k:?} for {name}"
            ))
        };
        let method = match name {
            "full" => {
                if let Some((k, _)) = kv.first() {
                    return Err(unknown(k));
                }
                Method::Full
            }
            "quest" => {
                let (mut token_rate, mut dense_layers) = (default_rate, QUEST_DENSE_LAYERS);
                for (k, v) in &kv {
                    match k.as_str() {
                        "rate" => token_rate = num(k, v)?,
                        "dense" => dense_layers = count(k, v)?,
                        _ => return Err(unknown(k)),
                    }
                }
                Method::Quest {
                    token_rate,
                    dense_layers,
                }
            }
            "quest-sink" => {
                let d = CompressConfig::default();
                let (mut token_rate, mut sink_tokens) = (d.token_rate, d.sink_tokens);
                for (k, v) in &kv {
                    match k.as_str() {
                        "rate" => token_rate = num(k, v)?,
                        "sink" => sink_tokens = count(k, v)?,
                        _ => return Err(unknown(k)),
                    }
                }
                Method::QuestSink {
                    token_rate,
                    sink_tokens,
                }
            }
            "kvq8" | "kvq4" => {
                if let Some((k, _)) = kv.first() {
                    return Err(unknown(k));
                }
                Method::Kvq {
                    format: if name == "kvq8" {
                        KvqFormat::Q8_0
                    } else {
                        KvqFormat::Q4_0
                    },
                }
            }
            "naive2d" => {
                let (mut retention, mut token_rate) = (NAIVE2D_DEFAULT_RETENTION, default_rate);
                for (k, v) in &kv {
                    match k.as_str() {
                        "rate" => token_rate = num(k, v)?,
                        "ret" => retention = num(k, v)?,
                        _ => return Err(unknown(k)),
                    }
                }
                Method::Naive2d {
                    retention,
                    token_rate,
                }
            }
            "mosaic" | "mosaic-ref" => {
                let backend = if name == "mosaic" {
                    MosaicBackend::Optimized
                } else {
                    MosaicBackend::Reference
                };
                let mut c = CompressConfig::default();
                let (mut ret, mut g) = (None, None);
                for (k, v) in &kv {
                    match k.as_str() {
                        "rate" => c.token_rate = num(k, v)?,
                        "minb" => c.min_budget_tokens = count(k, v)?,
                        // value dtypes the strategy may use (SPEC.md section 11.2), `/`-separated
                        "dt" => {
                            c.value_dtypes = v
                                .split('/')
                                .map(|name| {
                                    ValueDtype::ALL
                                        .into_iter()
                                        .find(|d| d.name() == name)
                                        .ok_or_else(|| {
                                            EngineError::Invalid(format!(
                                                "method {spec:?}: dt={v}: {name:?} is not f16, int8 or int4"
                                            ))
                                        })
                                })
                                .collect::<Result<_>>()?
                        }
                        "ret" => ret = Some(num(k, v)?),
                        "g" => g = Some(count(k, v)?),
                        "trunc" => c.truncate_fraction = num(k, v)?,
                        "sink" => c.sink_tokens = count(k, v)?,
                        "lin" => c.input_segment_len = count(k, v)?,
                        "var" => c.variance_threshold = num(k, v)?,
                        // the attention loss (SPEC.md section 11.1) with its K/V thresholds
                        "aloss" => match list(k, v)?.as_slice() {
                            &[key_loss, value_loss] => {
                                c.loss = mosaickv_spec::LossPolicy::Attention {
                                    key_loss,
                                    value_loss,
                                }
                            }
                            _ => {
                                return Err(EngineError::Invalid(format!(
                                    "method {spec:?}: aloss={v} is not KEY/VALUE"
                                )))
                            }
                        },
                        "bs" => {
                            c.block_sizes = counts(k, v)?
                        }
                        "kloss" | "vloss" | "rets" | "gs" => {
                            let ChannelPolicy::LossThreshold {
                                key_loss,
                                value_loss,
                                retentions,
                                group_sizes,
                            } = &mut c.channels
                            else {
                                unreachable!("the default policy is loss_threshold")
                            };
                            match k.as_str() {
                                "kloss" => *key_loss = num(k, v)?,
                                "vloss" => *value_loss = num(k, v)?,
                                "rets" => *retentions = list(k, v)?,
                                _ => {
                                    *group_sizes =
                                        counts(k, v)?
                                }
                            }
                        }
                        _ => return Err(unknown(k)),
                    }
                }
                match (ret, g) {
                    (_, Some(0)) => {
                        return Err(EngineError::Invalid(format!(
                            "method {spec:?}: g=0: the group size must be at least 1"
                        )))
                    }
                    (Some(retention), g) => {
                        c.channels = ChannelPolicy::Fixed {
                            retention,
                            group_size: g.unwrap_or(1),
                        }
                    }
                    // g sets the fixed policy's group size; without ret there is no fixed
                    // policy (the loss-threshold policy takes its sizes from gs=...)
                    (None, Some(_)) => {
                        return Err(EngineError::Invalid(format!(
                            "method {spec:?}: g= is the group size of a fixed retention and needs ret= (the loss-threshold policy takes gs=A/B)"
                        )))
                    }
                    (None, None) => {}
                }
                Method::Mosaic { backend, config: c }
            }
            _ => {
                return Err(EngineError::Invalid(format!(
                    "unknown method {name:?}; known: full, quest, quest-sink, naive2d, kvq8, kvq4, mosaic, mosaic-ref"
                )))
            }
        };
        method.validate()?;
        Ok(method)
    }

    /// Checks what does not depend on the model: rates in (0, 1] and, for MosaicKV, every
    /// configuration rule except that each group size divides the model's head_dim, which
    /// [`Method::validate_for`] checks once a model is loaded.
    fn validate(&self) -> Result<()> {
        let rate = |what: &str, x: f64| {
            if x > 0.0 && x <= 1.0 {
                Ok(())
            } else {
                Err(EngineError::Invalid(format!("{what} {x} not in (0, 1]")))
            }
        };
        match self {
            Method::Full | Method::Kvq { .. } => Ok(()),
            Method::Quest { token_rate, .. } => rate("token_rate", *token_rate),
            Method::QuestSink { .. } => self.quest_sink_config().and_then(|c| {
                c.validate(64)
                    .map_err(|e| EngineError::Invalid(e.to_string()))
            }),
            Method::Naive2d {
                retention,
                token_rate,
            } => {
                rate("token_rate", *token_rate)?;
                rate("retention", *retention)
            }
            Method::Mosaic { config, .. } => {
                if group_sizes(config).contains(&0) {
                    return Err(EngineError::Invalid(
                        "a group size of 0: group sizes must be at least 1".into(),
                    ));
                }
                // at a head_dim that every group size divides, only the other rules can fail
                let head_dim = common_multiple(&group_sizes(config)).ok_or_else(|| {
                    EngineError::Invalid(format!(
                        "group sizes {:?} have no common multiple that a head_dim could be",
                        group_sizes(config)
                    ))
                })?;
                config
                    .validate(head_dim)
                    .map_err(|e| EngineError::Invalid(e.to_string()))
            }
        }
    }

    /// Checks the parameters for a model whose heads have `head_dim` dimensions (for MosaicKV:
    /// `CompressConfig::validate` at that head_dim). [`Method::new_caches`] and
    /// [`Method::new_probe_caches`] call it with the loaded model's head_dim.
    pub fn validate_for(&self, head_dim: usize) -> Result<()> {
        self.validate()?;
        match self {
            Method::Mosaic { config, .. } => config.validate(head_dim).map_err(|e| {
                EngineError::Invalid(format!("{self} for the model's head_dim {head_dim}: {e}"))
            }),
            _ => Ok(()),
        }
    }

    /// The MosaicKV configuration whose sink, buffer and token budget `quest-sink` runs under.
    fn quest_sink_config(&self) -> Result<CompressConfig> {
        match self {
            Method::QuestSink {
                token_rate,
                sink_tokens,
            } => Ok(CompressConfig {
                token_rate: *token_rate,
                sink_tokens: *sink_tokens,
                ..CompressConfig::default()
            }),
            _ => Err(EngineError::Invalid(format!("{self} is not quest-sink"))),
        }
    }

    /// Whether the method's caches use query statistics (the attention loss, SPEC.md section
    /// 11.1): then the prompt is prefilled with [`crate::Model::prefill_with_stats`].
    pub fn wants_query_stats(&self) -> bool {
        matches!(self, Method::Mosaic { config, .. } if !config.loss.is_energy())
    }

    /// A short label: the canonical name plus the overrides that differ from the defaults.
    pub fn label(&self) -> String {
        self.to_string()
    }

    /// One empty cache per layer for a model of this configuration (the method is checked
    /// against its head_dim first, [`Method::validate_for`]).
    pub fn new_caches(&self, cfg: &crate::Config) -> Result<Vec<Box<dyn LayerKv>>> {
        self.validate_for(cfg.head_dim)?;
        self.layer_caches(cfg.n_layers, shape_of(cfg)?)
    }

    /// One empty cache per layer of `n_layers` layers of KV shape `shape` (the method's
    /// layer rule, e.g. Quest's dense first layers, applied).
    fn layer_caches(&self, n_layers: usize, shape: KvShape) -> Result<Vec<Box<dyn LayerKv>>> {
        (0..n_layers)
            .map(|layer| -> Result<Box<dyn LayerKv>> {
                Ok(match self {
                    Method::Full => Box::new(FullKv::new(shape.kv_heads, shape.head_dim)),
                    Method::Quest { dense_layers, .. } if layer < *dense_layers => {
                        Box::new(FullKv::new(shape.kv_heads, shape.head_dim))
                    }
                    Method::Quest { token_rate, .. } => Box::new(KvAdapter(
                        QuestF16Cache::new(shape, *token_rate)
                            .map_err(inv)?
                            .with_min_budget_tokens(quest_min_budget()),
                    )),
                    Method::QuestSink { .. } => Box::new(KvAdapter(
                        QuestSinkCache::new(shape, &self.quest_sink_config()?).map_err(inv)?,
                    )),
                    Method::Kvq { format } => Box::new(KvAdapter(
                        OptKvqCache::new(
                            shape,
                            match format {
                                KvqFormat::Q8_0 => OptKvqFormat::Q8_0,
                                KvqFormat::Q4_0 => OptKvqFormat::Q4_0,
                            },
                        )
                        .map_err(inv)?,
                    )),
                    Method::Naive2d {
                        retention,
                        token_rate,
                    } => Box::new(KvAdapter(
                        Naive2dCache::new(shape, *token_rate, *retention)
                            .map_err(inv)?
                            .with_min_budget_tokens(quest_min_budget()),
                    )),
                    // Decode runs on the live cache (SPEC.md section 10.4): generated
                    // tokens are compressed as they arrive and segment closes run on a
                    // background worker per layer.
                    Method::Mosaic {
                        backend: MosaicBackend::Optimized,
                        config,
                    } => Box::new(KvAdapter(
                        LiveCache::new(shape, config.clone(), Mode::Async).map_err(inv)?,
                    )),
                    Method::Mosaic {
                        backend: MosaicBackend::Reference,
                        config,
                    } => Box::new(KvAdapter(
                        MosaicCache::new(shape, config.clone()).map_err(inv)?,
                    )),
                })
            })
            .collect()
    }

    /// As [`Method::new_caches`], with caches that can report their attended tokens (for
    /// `fidelity`). Quest runs on the reference `QuestCache` here (same SPEC.md section 12 rule),
    /// kvq8 / kvq4 on the reference `KvqCache` (the same output bits, conformance/tests/kvq.rs).
    pub fn new_probe_caches(&self, cfg: &crate::Config) -> Result<Vec<Box<dyn ProbeKv>>> {
        self.validate_for(cfg.head_dim)?;
        let shape = shape_of(cfg)?;
        (0..cfg.n_layers)
            .map(|layer| -> Result<Box<dyn ProbeKv>> {
                Ok(match self {
                    Method::Full => Box::new(FullKv::new(cfg.kv_heads, cfg.head_dim)),
                    Method::Quest { dense_layers, .. } if layer < *dense_layers => {
                        Box::new(FullKv::new(cfg.kv_heads, cfg.head_dim))
                    }
                    Method::Quest { token_rate, .. } => Box::new(KvAdapter(
                        QuestCache::new(shape, *token_rate)
                            .map_err(inv)?
                            .with_min_budget_tokens(quest_min_budget()),
                    )),
                    Method::QuestSink { .. } => Box::new(KvAdapter(
                        QuestSinkCache::new(shape, &self.quest_sink_config()?).map_err(inv)?,
                    )),
                    Method::Kvq { format } => {
                        Box::new(KvAdapter(KvqCache::new(shape, *format).map_err(inv)?))
                    }
                    Method::Naive2d {
                        retention,
                        token_rate,
                    } => Box::new(KvAdapter(
                        Naive2dCache::new(shape, *token_rate, *retention)
                            .map_err(inv)?
                            .with_min_budget_tokens(quest_min_budget()),
                    )),
                    Method::Mosaic {
                        backend: MosaicBackend::Optimized,
                        config,
                    } => Box::new(KvAdapter(
                        OptimizedMosaicCache::new(shape, config.clone()).map_err(inv)?,
                    )),
                    Method::Mosaic {
                        backend: MosaicBackend::Reference,
                        config,
                    } => Box::new(KvAdapter(
                        MosaicCache::new(shape, config.clone()).map_err(inv)?,
                    )),
                })
            })
            .collect()
    }
}

/// The group sizes a MosaicKV configuration may use.
fn group_sizes(config: &CompressConfig) -> Vec<usize> {
    match &config.channels {
        ChannelPolicy::Fixed { group_size, .. } => vec![*group_size],
        ChannelPolicy::LossThreshold { group_sizes, .. } => group_sizes.clone(),
    }
}

/// The least common multiple of `gs` (1 when empty or when one is 0, so that validation
/// reports the zero); `None` when it overflows.
fn common_multiple(gs: &[usize]) -> Option<usize> {
    if gs.contains(&0) {
        return Some(1);
    }
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    gs.iter()
        .try_fold(1usize, |l, &g| (l / gcd(l, g)).checked_mul(g))
}

fn inv(e: mosaickv_spec::MosaicError) -> EngineError {
    EngineError::Invalid(e.to_string())
}

/// The budget floor the Quest-style baselines run under: MosaicKV's default (SPEC.md section
/// 8.3), so that at the same `token_rate` every method attends the same number of tokens.
fn quest_min_budget() -> usize {
    CompressConfig::default().min_budget_tokens
}

fn shape_of(cfg: &crate::Config) -> Result<KvShape> {
    KvShape::new(cfg.kv_heads, cfg.q_heads, cfg.head_dim).map_err(inv)
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = CompressConfig::default();
        match self {
            Method::Full => write!(f, "full"),
            Method::Quest {
                token_rate,
                dense_layers,
            } => {
                write!(f, "quest")?;
                if *token_rate != d.token_rate {
                    write!(f, ":rate={token_rate}")?;
                }
                if *dense_layers != QUEST_DENSE_LAYERS {
                    write!(f, ":dense={dense_layers}")?;
                }
                Ok(())
            }
            Method::QuestSink {
                token_rate,
                sink_tokens,
            } => {
                write!(f, "quest-sink")?;
                if *token_rate != d.token_rate {
                    write!(f, ":rate={token_rate}")?;
                }
                if *sink_tokens != d.sink_tokens {
                    write!(f, ":sink={sink_tokens}")?;
                }
                Ok(())
            }
            Method::Kvq { format } => f.write_str(format.name()),
            Method::Naive2d {
                retention,
                token_rate,
            } => {
                write!(f, "naive2d")?;
                if *retention != NAIVE2D_DEFAULT_RETENTION {
                    write!(f, ":ret={retention}")?;
                }
                if *token_rate != d.token_rate {
                    write!(f, ":rate={token_rate}")?;
                }
                Ok(())
            }
            Method::Mosaic { backend, config: c } => {
                f.write_str(match backend {
                    MosaicBackend::Optimized => "mosaic",
                    MosaicBackend::Reference => "mosaic-ref",
                })?;
                if c.token_rate != d.token_rate {
                    write!(f, ":rate={}", c.token_rate)?;
                }
                if c.min_budget_tokens != d.min_budget_tokens {
                    write!(f, ":minb={}", c.min_budget_tokens)?;
                }
                if c.value_dtypes != d.value_dtypes {
                    let s: Vec<&str> = c.value_dtypes.iter().map(|x| x.name()).collect();
                    write!(f, ":dt={}", s.join("/"))?;
                }
                match (&c.channels, &d.channels) {
                    (
                        ChannelPolicy::Fixed {
                            retention,
                            group_size,
                        },
                        _,
                    ) => {
                        write!(f, ":ret={retention}")?;
                        if *group_size != 1 {
                            write!(f, ":g={group_size}")?;
                        }
                    }
                    (
                        ChannelPolicy::LossThreshold {
                            key_loss,
                            value_loss,
                            retentions,
                            group_sizes,
                        },
                        ChannelPolicy::LossThreshold {
                            key_loss: dk,
                            value_loss: dv,
                            retentions: dr,
                            group_sizes: dg,
                        },
                    ) => {
                        if key_loss != dk {
                            write!(f, ":kloss={key_loss}")?;
                        }
                        if value_loss != dv {
                            write!(f, ":vloss={value_loss}")?;
                        }
                        if retentions != dr {
                            let s: Vec<String> = retentions.iter().map(|x| x.to_string()).collect();
                            write!(f, ":rets={}", s.join("/"))?;
                        }
                        if group_sizes != dg {
                            let s: Vec<String> =
                                group_sizes.iter().map(|x| x.to_string()).collect();
                            write!(f, ":gs={}", s.join("/"))?;
                        }
                    }
                    _ => {}
                }
                if let mosaickv_spec::LossPolicy::Attention {
                    key_loss,
                    value_loss,
                } = &c.loss
                {
                    write!(f, ":aloss={key_loss}/{value_loss}")?;
                }
                if c.truncate_fraction != d.truncate_fraction {
                    write!(f, ":trunc={}", c.truncate_fraction)?;
                }
                if c.sink_tokens != d.sink_tokens {
                    write!(f, ":sink={}", c.sink_tokens)?;
                }
                if c.input_segment_len != d.input_segment_len {
                    write!(f, ":lin={}", c.input_segment_len)?;
                }
                if c.variance_threshold != d.variance_threshold {
                    write!(f, ":var={}", c.variance_threshold)?;
                }
                if c.block_sizes != d.block_sizes {
                    let s: Vec<String> = c.block_sizes.iter().map(|x| x.to_string()).collect();
                    write!(f, ":bs={}", s.join("/"))?;
                }
                Ok(())
            }
        }
    }
}

impl std::str::FromStr for Method {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self> {
        Method::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_round_trip() {
        for s in [
            "full",
            "quest",
            "naive2d",
            "mosaic",
            "mosaic-ref",
            "naive2d:ret=0.25",
            "mosaic:ret=0.375",
            "mosaic:rate=1:trunc=0.25",
            "mosaic:kloss=0.02:vloss=0.05",
            "quest:rate=0.3",
            "quest:dense=0",
            "quest-sink",
            "quest-sink:rate=0.1:sink=0",
            "kvq8",
            "kvq4",
        ] {
            let m = Method::parse(s).unwrap();
            assert_eq!(m.to_string(), s);
            assert_eq!(Method::parse(&m.to_string()).unwrap(), m);
        }
        assert!(matches!(
            Method::parse("mosaic").unwrap(),
            Method::Mosaic {
                backend: MosaicBackend::Optimized,
                ..
            }
        ));
        assert_eq!(
            Method::parse("naive2d").unwrap(),
            Method::Naive2d {
                retention: 0.5,
                token_rate: CompressConfig::default().token_rate
            }
        );
    }

    #[test]
    fn bad_names_are_errors() {
        for s in [
            "",
            "dense",
            "full:rate=1",
            "quest:rate=2",
            "mosaic:ret=abc",
            "mosaic:foo=1",
            "naive2d:ret=0",
            "mosaic:g=0:ret=0.5",
            "mosaic:rate=0:g=3:ret=0.5",
            "mosaic:rate",
            "quest:dense=1.5",
            "quest-sink:ret=0.5",
            "quest-sink:rate=0",
            "kvq8:rate=0.5",
            // counts are integers, not numbers cast to one (-5 and NaN became 0, 1e30 the
            // largest usize, 1.5 became 1)
            "mosaic:minb=-5",
            "mosaic:minb=nan",
            "mosaic:minb=1e30",
            "mosaic:g=1.5:ret=0.5",
            "mosaic:bs=16.7/32",
            "mosaic:sink=1e30",
            // a key given twice (the last silently won)
            "mosaic:ret=0.5:ret=0.25",
            "quest:rate=0.1:rate=0.2",
        ] {
            assert!(Method::parse(s).is_err(), "{s} should not parse");
        }
    }

    #[test]
    fn quest_keeps_its_first_two_layers_dense_and_the_others_compressed() {
        let shape = KvShape::new(2, 6, 64).unwrap();
        let kv = ndarray::Array3::from_shape_fn((100, 2, 64), |(t, h, i)| {
            ((t * 7 + h * 3 + i) % 11) as f32 / 11.0 - 0.5
        });
        let bytes = |m: &str| -> Vec<usize> {
            let method = Method::parse(m).unwrap();
            method.validate_for(64).unwrap();
            let mut caches = method.layer_caches(4, shape).unwrap();
            caches
                .iter_mut()
                .map(|c| {
                    c.prefill(kv.view(), kv.view()).unwrap();
                    c.bytes()
                })
                .collect()
        };
        let dense = 100 * 4 * 2 * 64;
        let pages = 7 * 4 * 2 * 64; // f16 min and max per 16-token page
        assert_eq!(
            bytes("quest"),
            vec![dense, dense, dense + pages, dense + pages]
        );
        assert_eq!(bytes("quest:dense=0"), vec![dense + pages; 4]);
        assert_eq!(bytes("full"), vec![dense; 4]);
        assert_eq!(bytes("kvq8"), vec![100 * 2 * 2 * 2 * 34; 4]);
        assert_eq!(bytes("kvq4"), vec![100 * 2 * 2 * 2 * 18; 4]);
    }

    #[test]
    fn a_zero_group_size_and_a_group_size_without_retention_are_refused() {
        for spec in [
            "mosaic:g=0",
            "mosaic:ret=0.5:g=0",
            "mosaic:gs=0",
            "mosaic:gs=2/0",
        ] {
            let e = Method::parse(spec).unwrap_err().to_string();
            assert!(e.contains("at least 1"), "{spec}: {e}");
            assert!(!e.contains("head_dim 1"), "{spec}: {e}");
        }
        let e = Method::parse("mosaic:g=2").unwrap_err().to_string();
        assert!(e.contains("needs ret="), "{e}");
        assert!(Method::parse("mosaic:ret=0.5:g=2").is_ok());
    }

    #[test]
    fn group_sizes_are_checked_against_the_given_head_dim() {
        let m = Method::parse("mosaic:g=3:ret=0.5").unwrap();
        assert!(m.validate_for(48).is_ok());
        let e = m.validate_for(64).unwrap_err().to_string();
        assert!(e.contains("head_dim 64"), "{e}");
        let m = Method::parse("mosaic:gs=1/2/4").unwrap();
        assert!(m.validate_for(64).is_ok() && m.validate_for(4).is_ok());
        assert!(m.validate_for(6).is_err());
        assert_eq!(common_multiple(&[4, 6, 1]), Some(12));
        assert_eq!(common_multiple(&[usize::MAX, usize::MAX - 1]), None);
    }
}
