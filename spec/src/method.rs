//! Method names, their parameters and their defaults: the one parser from a method string
//! (`mosaic:kloss=0.02`, `kvq4`, `quest:rate=0.1`, ...) to a [`Method`], shared by every front
//! end (the engine's `--method`, `mosaickv attend`, the server, the Python package). The
//! factory that builds a cache from a [`Method`] is the method registry, `mosaickv-methods`.
//!
//! Names: `full`, `quest`, `quest-sink`, `naive2d`, `kvq8`, `kvq4` (llama.cpp's quantized cache
//! as it runs today, Hadamard-rotated), `kvq8-norot`, `kvq4-norot` (llama.cpp's before its
//! 2026-04 rotation), `mosaic` (optimized
//! backend), `mosaic-ref` (reference backend), each optionally followed by `:key=value`
//! overrides separated by `:`: `rate` (token_rate), `dense` (quest: leading dense layers),
//! `ret` (fixed channel retention; for mosaic it switches to the fixed policy), `g` (group
//! size with `ret`), `kloss`, `vloss` (loss thresholds), `rets` (candidate retentions,
//! `/`-separated), `gs` (candidate group sizes, `/`-separated), `aloss` (attention-loss
//! thresholds `KEY/VALUE`), `dt` (mosaic: value dtypes, `/`-separated, e.g. `dt=int4/int8/f16`),
//! `minb` (mosaic: min_budget_tokens), `trunc` (truncate_fraction), `sink` (mosaic,
//! quest-sink), `lin` (input_segment_len), `lmin` / `lmax` (min / max_segment_len: when a
//! generated segment may / must close, SPEC.md section 10.3), `bs` (block sizes, `/`-separated), `var`
//! (variance_threshold). Every parameter left out takes the one default written here or in
//! [`CompressConfig::default`] (SPEC.md sections 2 and 12).
//! Example: `mosaic:ret=0.5`, `naive2d:ret=0.25`, `mosaic:rate=1:trunc=0`, `quest:dense=0`.

use crate::config::{ChannelPolicy, CompressConfig, LossPolicy};
use crate::error::{MosaicError, Result};
use crate::kvq::KvqFormat;
use crate::layout::ValueDtype;
use crate::turboquant::{TurboQuantPreset, BOUNDARY_LAYERS};
use std::fmt;

/// Every method name the parser knows, in the order the docs list them.
pub const NAMES: [&str; 11] = [
    "full",
    "quest",
    "quest-sink",
    "naive2d",
    "kvq8",
    "kvq4",
    "kvq8-norot",
    "kvq4-norot",
    "turboquant",
    "mosaic",
    "mosaic-ref",
];

/// Which implementation runs a method: the optimized CPU backend (`mosaickv-optimized`, what
/// users run) or the f64 oracle (`mosaickv-reference`, asked for by name: `mosaic-ref`,
/// `--backend reference`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Implementation {
    #[default]
    Optimized,
    Reference,
}

impl Implementation {
    pub const fn name(self) -> &'static str {
        match self {
            Implementation::Optimized => "optimized",
            Implementation::Reference => "reference",
        }
    }
}

/// A KV-cache method with every parameter resolved: what a method string describes.
#[derive(Debug, Clone, PartialEq)]
pub enum Method {
    /// Dense f16 cache.
    Full,
    /// SPEC.md section 12 Quest as Quest's code runs it: in a model, the first `dense_layers`
    /// layers dense, pages of 16, the last page always attended.
    Quest {
        token_rate: f64,
        dense_layers: usize,
        /// The budget floor of SPEC.md section 8.3 (`minb`; default MosaicKV's, so that at
        /// the same `token_rate` both attend the same number of tokens).
        min_budget_tokens: usize,
    },
    /// SPEC.md section 12 Quest-sink: Quest's pages under MosaicKV's sink, update buffer and
    /// token budget (the default configuration's, with `token_rate` and `sink_tokens`
    /// overridable), every layer.
    QuestSink { token_rate: f64, sink_tokens: usize },
    /// SPEC.md section 12 kvq8 / kvq4: llama.cpp's `q8_0` / `q4_0` KV cache, `rotated` by its
    /// Hadamard as llama.cpp does since 2026-04 (`kvq8`, `kvq4`) or not (`kvq8-norot`,
    /// `kvq4-norot`), every token
    /// attended, every layer.
    Kvq { format: KvqFormat, rotated: bool },
    /// SPEC.md section 12 naive 2-D, with Quest's budget floor (`minb`) as for `quest`.
    Naive2d {
        retention: f64,
        token_rate: f64,
        min_budget_tokens: usize,
    },
    /// SPEC.md section 12 TurboQuant: vLLM's `turboquant_<preset>` KV cache; in a model, the
    /// first and last `boundary_layers` layers dense, as vLLM keeps them.
    TurboQuant {
        preset: TurboQuantPreset,
        boundary_layers: usize,
    },
    /// MosaicKV with a configuration (SPEC.md section 2) on one implementation (`mosaic`,
    /// `mosaic-ref`).
    Mosaic {
        implementation: Implementation,
        config: CompressConfig,
    },
}

/// Layers Quest's code keeps dense (`layer_id < 2` in `evaluation/quest_attention.py`; the
/// kernel path skips them the same way, `quest/utils/controller.py`'s `set_page_budget`).
pub const QUEST_DENSE_LAYERS: usize = 2;

/// Default channel retention of `naive2d` when none is given: 50 %, the setting that kept the
/// needle on SmolLM2's KV in the foundation measurements (SPEC.md section 12). Every front end
/// takes this one.
pub const NAIVE2D_DEFAULT_RETENTION: f64 = 0.5;

/// The budget floor the Quest-style baselines run under: MosaicKV's default (SPEC.md section
/// 8.3), so that at the same `token_rate` every method attends the same number of tokens.
pub fn quest_min_budget() -> usize {
    CompressConfig::default().min_budget_tokens
}

impl Method {
    /// Parses a method name with optional `:key=value` overrides (see the module doc) and
    /// checks what does not depend on the model; group sizes are checked against the cache's
    /// head_dim when caches are built ([`Method::validate_for`]).
    pub fn parse(spec: &str) -> Result<Method> {
        let mut parts = spec.trim().split(':');
        let name = parts.next().unwrap_or("");
        let mut kv = Vec::new();
        for (i, p) in parts.enumerate() {
            // `turboquant:4bit_nc`: the preset, vLLM's name, right after the method name
            if name == "turboquant" && i == 0 && !p.contains('=') {
                kv.push(("preset".to_string(), p.trim().to_string()));
                continue;
            }
            let (k, v) = p.split_once('=').ok_or_else(|| {
                MosaicError::InvalidConfig(format!(
                    "method {spec:?}: override {p:?} is not key=value"
                ))
            })?;
            let k = k.trim().to_string();
            if kv.iter().any(|(seen, _): &(String, String)| *seen == k) {
                return Err(MosaicError::InvalidConfig(format!(
                    "method {spec:?}: {k} is given twice"
                )));
            }
            kv.push((k, v.trim().to_string()));
        }
        let num = |k: &str, v: &str| -> Result<f64> {
            v.parse::<f64>().map_err(|_| {
                MosaicError::InvalidConfig(format!("method {spec:?}: {k}={v} is not a number"))
            })
        };
        let count = |k: &str, v: &str| -> Result<usize> {
            v.parse::<usize>().map_err(|_| {
                MosaicError::InvalidConfig(format!(
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
            MosaicError::InvalidConfig(format!(
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
                let mut min_budget_tokens = quest_min_budget();
                for (k, v) in &kv {
                    match k.as_str() {
                        "rate" => token_rate = num(k, v)?,
                        "dense" => dense_layers = count(k, v)?,
                        "minb" => min_budget_tokens = count(k, v)?,
                        _ => return Err(unknown(k)),
                    }
                }
                Method::Quest {
                    token_rate,
                    dense_layers,
                    min_budget_tokens,
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
            "kvq8" | "kvq4" | "kvq8-norot" | "kvq4-norot" => {
                if let Some((k, _)) = kv.first() {
                    return Err(unknown(k));
                }
                let (base, rotated) = match name.strip_suffix("-norot") {
                    Some(base) => (base, false),
                    None => (name, true),
                };
                Method::Kvq {
                    format: KvqFormat::from_name(base).expect("kvq8 or kvq4"),
                    rotated,
                }
            }
            "naive2d" => {
                let (mut retention, mut token_rate) = (NAIVE2D_DEFAULT_RETENTION, default_rate);
                let mut min_budget_tokens = quest_min_budget();
                for (k, v) in &kv {
                    match k.as_str() {
                        "rate" => token_rate = num(k, v)?,
                        "ret" => retention = num(k, v)?,
                        "minb" => min_budget_tokens = count(k, v)?,
                        _ => return Err(unknown(k)),
                    }
                }
                Method::Naive2d {
                    retention,
                    token_rate,
                    min_budget_tokens,
                }
            }
            "turboquant" => {
                let (mut preset, mut boundary_layers) = (None, BOUNDARY_LAYERS);
                for (k, v) in &kv {
                    match k.as_str() {
                        "preset" => {
                            preset = Some(TurboQuantPreset::from_name(v).ok_or_else(|| {
                                MosaicError::InvalidConfig(format!(
                                    "method {spec:?}: {v:?} is not a TurboQuant preset (k8v4, 4bit_nc, k3v4_nc, 3bit_nc)"
                                ))
                            })?)
                        }
                        "boundary" => boundary_layers = count(k, v)?,
                        _ => return Err(unknown(k)),
                    }
                }
                Method::TurboQuant {
                    preset: preset.ok_or_else(|| {
                        MosaicError::InvalidConfig(format!(
                            "method {spec:?}: turboquant needs its preset: turboquant:k8v4, turboquant:4bit_nc, turboquant:k3v4_nc or turboquant:3bit_nc"
                        ))
                    })?,
                    boundary_layers,
                }
            }
            "mosaic" | "mosaic-ref" => {
                let implementation = if name == "mosaic" {
                    Implementation::Optimized
                } else {
                    Implementation::Reference
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
                                        .chain([ValueDtype::Coded])
                                        .find(|d| d.name() == name)
                                        .ok_or_else(|| {
                                            MosaicError::InvalidConfig(format!(
                                                "method {spec:?}: dt={v}: {name:?} is not f16, int8, int4 or coded"
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
                        "lmin" => c.min_segment_len = count(k, v)?,
                        "lmax" => c.max_segment_len = count(k, v)?,
                        "var" => c.variance_threshold = num(k, v)?,
                        // the attention loss (SPEC.md section 11.1) with its K/V thresholds
                        "aloss" => match list(k, v)?.as_slice() {
                            &[key_loss, value_loss] => {
                                c.loss = LossPolicy::Attention {
                                    key_loss,
                                    value_loss,
                                }
                            }
                            _ => {
                                return Err(MosaicError::InvalidConfig(format!(
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
                        return Err(MosaicError::InvalidConfig(format!(
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
                        return Err(MosaicError::InvalidConfig(format!(
                            "method {spec:?}: g= is the group size of a fixed retention and needs ret= (the loss-threshold policy takes gs=A/B)"
                        )))
                    }
                    (None, None) => {}
                }
                Method::Mosaic {
                    implementation,
                    config: c,
                }
            }
            _ => {
                return Err(MosaicError::InvalidConfig(format!(
                    "unknown method {name:?}; known: {}",
                    NAMES.join(", ")
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
        let rate = crate::rules::fraction;
        match self {
            Method::Full | Method::Kvq { .. } | Method::TurboQuant { .. } => Ok(()),
            Method::Quest { token_rate, .. } => rate("token_rate", *token_rate),
            Method::QuestSink { .. } => self.quest_sink_config()?.validate(64),
            Method::Naive2d {
                retention,
                token_rate,
                ..
            } => {
                rate("token_rate", *token_rate)?;
                rate("retention", *retention)
            }
            Method::Mosaic { config, .. } => {
                if group_sizes(config).contains(&0) {
                    return Err(MosaicError::InvalidConfig(
                        "a group size of 0: group sizes must be at least 1".into(),
                    ));
                }
                // at a head_dim that every group size divides, only the other rules can fail
                let head_dim = common_multiple(&group_sizes(config)).ok_or_else(|| {
                    MosaicError::InvalidConfig(format!(
                        "group sizes {:?} have no common multiple that a head_dim could be",
                        group_sizes(config)
                    ))
                })?;
                config.validate(head_dim)
            }
        }
    }

    /// Checks the parameters for a model whose heads have `head_dim` dimensions (for MosaicKV:
    /// `CompressConfig::validate` at that head_dim). The method registry's factory calls it
    /// with the cache's head_dim.
    pub fn validate_for(&self, head_dim: usize) -> Result<()> {
        self.validate()?;
        match self {
            // the configuration's own error, its kind kept (e.g. GroupSizeNotDivisor)
            Method::Mosaic { config, .. } => config.validate(head_dim),
            Method::TurboQuant { preset, .. } => preset.check_head_dim(head_dim),
            _ => Ok(()),
        }
    }

    /// Whether the method's caches use query statistics (the attention loss, SPEC.md section
    /// 11.1): then the prompt is prefilled with its query statistics.
    pub fn wants_query_stats(&self) -> bool {
        matches!(self, Method::Mosaic { config, .. } if !config.loss.is_energy())
    }

    /// The method's name (without overrides).
    pub fn name(&self) -> &'static str {
        match self {
            Method::Full => "full",
            Method::Quest { .. } => "quest",
            Method::QuestSink { .. } => "quest-sink",
            Method::Kvq {
                format,
                rotated: true,
            } => format.name(),
            Method::Kvq {
                format: KvqFormat::Q8_0,
                rotated: false,
            } => "kvq8-norot",
            Method::Kvq {
                format: KvqFormat::Q4_0,
                rotated: false,
            } => "kvq4-norot",
            Method::Naive2d { .. } => "naive2d",
            Method::TurboQuant { .. } => "turboquant",
            Method::Mosaic {
                implementation: Implementation::Optimized,
                ..
            } => "mosaic",
            Method::Mosaic {
                implementation: Implementation::Reference,
                ..
            } => "mosaic-ref",
        }
    }

    /// A short label: the canonical name plus the overrides that differ from the defaults.
    pub fn label(&self) -> String {
        self.to_string()
    }

    /// The MosaicKV configuration whose sink, buffer and token budget `quest-sink` runs under.
    pub fn quest_sink_config(&self) -> Result<CompressConfig> {
        match self {
            Method::QuestSink {
                token_rate,
                sink_tokens,
            } => Ok(CompressConfig {
                token_rate: *token_rate,
                sink_tokens: *sink_tokens,
                ..CompressConfig::default()
            }),
            _ => Err(MosaicError::InvalidConfig(format!(
                "{self} is not quest-sink"
            ))),
        }
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

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = CompressConfig::default();
        match self {
            Method::Full => write!(f, "full"),
            Method::Quest {
                token_rate,
                dense_layers,
                min_budget_tokens,
            } => {
                write!(f, "quest")?;
                if *token_rate != d.token_rate {
                    write!(f, ":rate={token_rate}")?;
                }
                if *dense_layers != QUEST_DENSE_LAYERS {
                    write!(f, ":dense={dense_layers}")?;
                }
                if *min_budget_tokens != d.min_budget_tokens {
                    write!(f, ":minb={min_budget_tokens}")?;
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
            Method::Kvq { .. } => f.write_str(self.name()),
            Method::TurboQuant {
                preset,
                boundary_layers,
            } => {
                write!(f, "turboquant:{}", preset.name())?;
                if *boundary_layers != BOUNDARY_LAYERS {
                    write!(f, ":boundary={boundary_layers}")?;
                }
                Ok(())
            }
            Method::Naive2d {
                retention,
                token_rate,
                min_budget_tokens,
            } => {
                write!(f, "naive2d")?;
                if *retention != NAIVE2D_DEFAULT_RETENTION {
                    write!(f, ":ret={retention}")?;
                }
                if *token_rate != d.token_rate {
                    write!(f, ":rate={token_rate}")?;
                }
                if *min_budget_tokens != d.min_budget_tokens {
                    write!(f, ":minb={min_budget_tokens}")?;
                }
                Ok(())
            }
            Method::Mosaic {
                implementation,
                config: c,
            } => {
                f.write_str(match implementation {
                    Implementation::Optimized => "mosaic",
                    Implementation::Reference => "mosaic-ref",
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
                if let LossPolicy::Attention {
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
                if c.min_segment_len != d.min_segment_len {
                    write!(f, ":lmin={}", c.min_segment_len)?;
                }
                if c.max_segment_len != d.max_segment_len {
                    write!(f, ":lmax={}", c.max_segment_len)?;
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
    type Err = MosaicError;
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
            "mosaic:lmin=512:lmax=4096",
            "quest:rate=0.3",
            "quest:dense=0",
            "quest:minb=0",
            "naive2d:ret=0.25:minb=0",
            "quest-sink",
            "quest-sink:rate=0.1:sink=0",
            "kvq8",
            "kvq4",
            "kvq8-norot",
            "kvq4-norot",
            "turboquant:4bit_nc",
            "turboquant:k8v4",
            "turboquant:3bit_nc:boundary=0",
        ] {
            let m = Method::parse(s).unwrap();
            assert_eq!(m.to_string(), s);
            assert_eq!(Method::parse(&m.to_string()).unwrap(), m);
        }
        assert!(matches!(
            Method::parse("mosaic").unwrap(),
            Method::Mosaic {
                implementation: Implementation::Optimized,
                ..
            }
        ));
        assert_eq!(
            Method::parse("naive2d").unwrap(),
            Method::Naive2d {
                retention: 0.5,
                token_rate: CompressConfig::default().token_rate,
                min_budget_tokens: 256,
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
            "kvq4-norot:rate=0.5",
            "kvq8-rot",
            "turboquant",
            "turboquant:5bit",
            "turboquant:4bit_nc:rate=0.5",
            "turboquant:boundary=1",
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
