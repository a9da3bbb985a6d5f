//! Shapes and the compression configuration (SPEC.md sections 1 and 2).

use crate::error::{MosaicError, Result};
use crate::layout::ValueDtype;
use serde::{Deserialize, Serialize};

/// Shape of one layer's cache and of the queries that read it.
///
/// Keys and values are `[tokens, kv_heads, head_dim]`; queries are
/// `[q_heads, head_dim]`. Query head `h` reads KV head `h / group()` (GQA).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvShape {
    pub kv_heads: usize,
    pub q_heads: usize,
    pub head_dim: usize,
}

impl KvShape {
    /// Validates the shape: every dimension positive, `q_heads` a multiple of `kv_heads`.
    pub fn new(kv_heads: usize, q_heads: usize, head_dim: usize) -> Result<Self> {
        if kv_heads == 0 || q_heads == 0 || q_heads % kv_heads != 0 {
            return Err(MosaicError::GqaMismatch { q_heads, kv_heads });
        }
        if head_dim == 0 {
            return Err(MosaicError::InvalidConfig(
                "head_dim must be positive".into(),
            ));
        }
        // A row of f32 (and a query block) must be addressable: every backend
        // multiplies these, and a product that wraps would index past its buffers.
        if q_heads
            .checked_mul(head_dim)
            .and_then(|x| x.checked_mul(std::mem::size_of::<f64>()))
            .is_none_or(|bytes| bytes > isize::MAX as usize)
        {
            return Err(MosaicError::InvalidConfig(format!(
                "q_heads {q_heads} x head_dim {head_dim} is too large"
            )));
        }
        Ok(Self {
            kv_heads,
            q_heads,
            head_dim,
        })
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }
}

/// How the per-vector retained count `r` and group size `g` are chosen (SPEC.md section 11).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case", deny_unknown_fields)]
pub enum ChannelPolicy {
    /// The paper's fixed setting: `r = ceil_g(retention * head_dim)`, capped at the kept dims.
    Fixed { retention: f64, group_size: usize },
    /// The default: the cheapest `(r, g)` among the candidates whose relative
    /// dropped energy stays at or under the threshold, separately for K and V.
    LossThreshold {
        key_loss: f64,
        value_loss: f64,
        /// Candidate retentions as fractions of head_dim.
        retentions: Vec<f64>,
        /// Candidate element group sizes.
        group_sizes: Vec<usize>,
    },
}

impl Default for ChannelPolicy {
    fn default() -> Self {
        ChannelPolicy::LossThreshold {
            key_loss: 0.01,
            value_loss: 0.02,
            retentions: vec![0.125, 0.25, 0.375, 0.5, 0.625, 0.75],
            group_sizes: vec![1, 2, 4],
        }
    }
}

/// Which loss the channel thresholds compare (SPEC.md section 11.1).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum LossPolicy {
    /// Relative dropped energy, compared with the channel policy's `key_loss` / `value_loss`.
    #[default]
    Energy,
    /// The attention loss of SPEC.md section 11.1.1 (keys: the attention-weighted squared logit
    /// error in softmax units, an absolute quantity; values: the attention-weighted output
    /// error relative to the output, of the reconstruction as stored), compared with these
    /// thresholds (finite, >= 0; the key threshold may exceed 1). A cache
    /// given no query statistics falls back to the energy loss (and says so).
    Attention { key_loss: f64, value_loss: f64 },
}

impl LossPolicy {
    pub fn is_energy(&self) -> bool {
        matches!(self, LossPolicy::Energy)
    }
}

/// Largest token count a configuration may name (2^40): see `CompressConfig::validate`.
pub const MAX_TOKENS: u64 = 1 << 40;

/// Every parameter of the method. Defaults and their reasons: SPEC.md section 2.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CompressConfig {
    /// Fraction of the segment tokens attended per decode step (Quest-style top-k).
    pub token_rate: f64,
    /// Fewest segment tokens attended per decode step, whatever `token_rate` gives
    /// (SPEC.md section 8.3); 0 disables the floor.
    pub min_budget_tokens: usize,
    /// How `(r, g)` are chosen per segment and side.
    pub channels: ChannelPolicy,
    /// Fraction of trailing rotated channels dropped before top-r (rounded down to a multiple of g).
    pub truncate_fraction: f64,
    /// Candidate block sizes, ascending; the variance threshold picks one per segment.
    pub block_sizes: Vec<usize>,
    /// Largest allowed relative within-block key variance (SPEC.md section 11.3).
    pub variance_threshold: f64,
    /// Leading tokens of the sequence kept exact (f16, unrotated) and always attended.
    pub sink_tokens: usize,
    /// Segment length for prompt (prefill) tokens.
    pub input_segment_len: usize,
    /// Hard cap on the length of a generated-token segment (SPEC.md section 10.3); bounds the
    /// f32 host rows an open segment keeps.
    pub max_segment_len: usize,
    /// Length a generated-token segment must reach before the loss rule may
    /// close it (SPEC.md section 10.3); bounds the rotations per token.
    pub min_segment_len: usize,
    /// Update buffer capacity in tokens; flushed (compressed) when full.
    pub buffer_capacity: usize,
    /// A generated segment at least `min_segment_len` long closes when its loss
    /// under the previous strategy exceeds that strategy's fit loss by more than this.
    pub segment_loss_margin: f64,
    /// Element types the strategy may store retained values in (SPEC.md sections 6, 11.2):
    /// `f16`, `int8`, `int4`. The loss-threshold policy tries every listed dtype; the fixed
    /// policy uses the first.
    pub value_dtypes: Vec<ValueDtype>,
    /// The loss `loss_threshold` channels are chosen by (SPEC.md section 11.1); omitted from
    /// JSON when it is the default energy loss, so such files keep their bytes.
    #[serde(skip_serializing_if = "LossPolicy::is_energy")]
    pub loss: LossPolicy,
}

impl Default for CompressConfig {
    fn default() -> Self {
        Self {
            token_rate: 0.20,
            min_budget_tokens: 256,
            channels: ChannelPolicy::default(),
            truncate_fraction: 0.0,
            block_sizes: vec![16, 32, 64],
            variance_threshold: 0.25,
            sink_tokens: 4,
            input_segment_len: 16_384,
            max_segment_len: 2_048,
            min_segment_len: 1_024,
            buffer_capacity: 64,
            segment_loss_margin: 0.02,
            value_dtypes: vec![ValueDtype::F16, ValueDtype::Int8, ValueDtype::Int4],
            loss: LossPolicy::Energy,
        }
    }
}

/// What a JSON value is, for an error message.
pub(crate) fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

impl CompressConfig {
    /// The paper's fixed setting: 25 % channels, g = 1, f16 values, 10 % token rate with no
    /// budget floor, 25 % truncation, blocks of 16, everything else default.
    pub fn paper_fixed() -> Self {
        Self {
            token_rate: 0.10,
            min_budget_tokens: 0,
            truncate_fraction: 0.25,
            channels: ChannelPolicy::Fixed {
                retention: 0.25,
                group_size: 1,
            },
            block_sizes: vec![16],
            value_dtypes: vec![ValueDtype::F16],
            ..Self::default()
        }
    }

    /// Parses a JSON configuration; missing keys take their defaults, unknown keys are an error.
    pub fn from_json(text: &str) -> Result<Self> {
        // serde reads a struct from a JSON array too (fields by position); a configuration
        // is an object of named keys, so anything else is refused before that.
        match serde_json::from_str::<serde_json::Value>(text) {
            Ok(serde_json::Value::Object(_)) | Err(_) => {}
            Ok(other) => {
                return Err(MosaicError::InvalidConfig(format!(
                    "a configuration is a JSON object of named keys, not {}",
                    json_kind(&other)
                )))
            }
        }
        let cfg: Self = serde_json::from_str(text).map_err(|e| {
            let msg = e.to_string();
            match msg.strip_prefix("unknown field `") {
                Some(rest) => {
                    MosaicError::UnknownConfigKey(rest.split('`').next().unwrap_or("").to_string())
                }
                None => MosaicError::InvalidConfig(msg),
            }
        })?;
        Ok(cfg)
    }

    /// Checks every parameter against its range and against `head_dim`.
    pub fn validate(&self, head_dim: usize) -> Result<()> {
        let bad = |m: String| Err(MosaicError::InvalidConfig(m));
        crate::rules::fraction("token_rate", self.token_rate)?;
        if !(0.0..1.0).contains(&self.truncate_fraction) {
            return bad(format!(
                "truncate_fraction {} not in [0, 1)",
                self.truncate_fraction
            ));
        }
        if self.block_sizes.is_empty()
            || self
                .block_sizes
                .iter()
                .any(|&b| b == 0 || self.buffer_capacity % b != 0)
            || self.block_sizes.windows(2).any(|w| w[0] >= w[1])
        {
            return bad(format!(
                "block_sizes {:?} must be ascending, positive, and divide buffer_capacity {}",
                self.block_sizes, self.buffer_capacity
            ));
        }
        if !(self.variance_threshold >= 0.0 && self.variance_threshold.is_finite()) {
            return bad(format!(
                "variance_threshold {} must be >= 0",
                self.variance_threshold
            ));
        }
        if self.input_segment_len == 0 || self.buffer_capacity == 0 {
            return bad("input_segment_len and buffer_capacity must be positive".into());
        }
        // Token counts stay far from usize overflow in the segment rules (2 * input_segment_len,
        // a segment's length times its row size): 2^40 tokens, beyond any context.
        for (name, n) in [
            ("input_segment_len", self.input_segment_len),
            ("max_segment_len", self.max_segment_len),
            ("min_segment_len", self.min_segment_len),
            ("buffer_capacity", self.buffer_capacity),
            ("min_budget_tokens", self.min_budget_tokens),
            ("sink_tokens", self.sink_tokens),
        ] {
            if n as u64 > MAX_TOKENS {
                return bad(format!("{name} {n} is above 2^40 tokens"));
            }
        }
        if self.max_segment_len < self.buffer_capacity
            || self.max_segment_len % self.buffer_capacity != 0
        {
            return bad(format!(
                "max_segment_len {} must be a positive multiple of buffer_capacity {}",
                self.max_segment_len, self.buffer_capacity
            ));
        }
        if self.min_segment_len < self.buffer_capacity
            || self.min_segment_len % self.buffer_capacity != 0
        {
            return bad(format!(
                "min_segment_len {} must be a positive multiple of buffer_capacity {}",
                self.min_segment_len, self.buffer_capacity
            ));
        }
        if !(self.segment_loss_margin >= 0.0 && self.segment_loss_margin.is_finite()) {
            return bad(format!(
                "segment_loss_margin {} must be >= 0",
                self.segment_loss_margin
            ));
        }
        if self.value_dtypes.is_empty()
            || (1..self.value_dtypes.len())
                .any(|i| self.value_dtypes[..i].contains(&self.value_dtypes[i]))
        {
            return bad(format!(
                "value_dtypes {:?} must be non-empty without repeats",
                self.value_dtypes
            ));
        }
        if self.value_dtypes.contains(&ValueDtype::Coded)
            && matches!(self.channels, ChannelPolicy::Fixed { .. })
        {
            // SPEC.md sections 6.1, 11.2: a coded side's step comes from the loss threshold.
            return bad(
                "value dtype `coded` needs the loss_threshold channel policy (its step is the \
                 largest that passes the threshold), not a fixed retention"
                    .into(),
            );
        }
        if let LossPolicy::Attention {
            key_loss,
            value_loss,
        } = &self.loss
        {
            for l in [key_loss, value_loss] {
                if !(*l >= 0.0 && l.is_finite()) {
                    return bad(format!(
                        "attention loss threshold {l} must be finite and >= 0"
                    ));
                }
            }
        }
        let check_g = |g: usize| -> Result<()> {
            if g == 0 || head_dim % g != 0 {
                return Err(MosaicError::GroupSizeNotDivisor {
                    head_dim,
                    group_size: g,
                });
            }
            Ok(())
        };
        match &self.channels {
            ChannelPolicy::Fixed {
                retention,
                group_size,
            } => {
                check_g(*group_size)?;
                crate::rules::fraction("retention", *retention)?;
            }
            ChannelPolicy::LossThreshold {
                key_loss,
                value_loss,
                retentions,
                group_sizes,
            } => {
                if group_sizes.is_empty() || retentions.is_empty() {
                    return bad(
                        "loss_threshold needs at least one retention and one group size".into(),
                    );
                }
                for &g in group_sizes {
                    check_g(g)?;
                }
                if retentions.iter().any(|r| !(*r > 0.0 && *r <= 1.0)) {
                    return bad(format!("retentions {retentions:?} must lie in (0, 1]"));
                }
                for l in [key_loss, value_loss] {
                    if !(*l >= 0.0 && *l <= 1.0) {
                        return bad(format!("loss threshold {l} not in [0, 1]"));
                    }
                }
            }
        }
        Ok(())
    }

    /// SPEC.md section 10.3: the fewest tokens a generated segment holds when it closes,
    /// `min(min_segment_len, max_segment_len)` (the cap closes a segment even below the
    /// minimum), so at most `floor(generated / close_spacing)` closes happen.
    pub fn close_spacing(&self) -> usize {
        self.min_segment_len.min(self.max_segment_len).max(1)
    }

    /// Rotated channels eligible for top-r: `D - floor_g(truncate_fraction * D)` (SPEC.md section 4).
    pub fn kept_dims(&self, head_dim: usize, group_size: usize) -> usize {
        let cut = (self.truncate_fraction * head_dim as f64).floor() as usize;
        head_dim - cut / group_size * group_size
    }

    /// Attention budget in tokens for `segment_tokens` compressed tokens (SPEC.md section 8.3):
    /// `B = min(n_seg, max(ceil(token_rate * n_seg), min_budget_tokens))`.
    pub fn budget_tokens(&self, segment_tokens: usize) -> usize {
        budget_tokens(self.token_rate, self.min_budget_tokens, segment_tokens)
    }
}

/// SPEC.md section 8.3's token budget, shared by MosaicKV and the Quest-style baselines:
/// `B = min(n, max(ceil(token_rate * n), min_tokens))`, the product in f64.
pub fn budget_tokens(token_rate: f64, min_tokens: usize, n: usize) -> usize {
    ((token_rate * n as f64).ceil() as usize)
        .max(min_tokens)
        .min(n)
}

/// Rounds `x` up to a multiple of `g`.
pub fn ceil_to(x: usize, g: usize) -> usize {
    x.div_ceil(g) * g
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_policy_key() {
        let cfg = CompressConfig::from_json(
            r#"{"loss": {"kind": "attention", "key_loss": 0.01, "value_loss": 0.02}}"#,
        )
        .unwrap();
        assert_eq!(
            cfg.loss,
            LossPolicy::Attention {
                key_loss: 0.01,
                value_loss: 0.02
            }
        );
        cfg.validate(64).unwrap();
        // The default is not written, so default configs keep their JSON.
        let json = serde_json::to_string(&CompressConfig::default()).unwrap();
        assert!(!json.contains("\"loss\":"), "{json}");
        assert_eq!(
            CompressConfig::from_json(&json).unwrap(),
            CompressConfig::default()
        );
        let json = serde_json::to_string(&cfg).unwrap();
        assert_eq!(CompressConfig::from_json(&json).unwrap(), cfg);
        let bad = CompressConfig {
            loss: LossPolicy::Attention {
                key_loss: -1.0,
                value_loss: 0.0,
            },
            ..CompressConfig::default()
        };
        assert!(matches!(
            bad.validate(64),
            Err(MosaicError::InvalidConfig(_))
        ));
        assert!(CompressConfig::from_json(r#"{"loss": {"kind": "entropy"}}"#).is_err());
    }

    #[test]
    fn budget_floor() {
        let cfg = CompressConfig::default();
        // A short prompt: the rate alone would give ceil(0.2 * 38) = 8 tokens.
        assert_eq!(cfg.budget_tokens(38), 38);
        assert_eq!(cfg.budget_tokens(1_000), 256);
        assert_eq!(cfg.budget_tokens(1_280), 256);
        assert_eq!(cfg.budget_tokens(1_281), 257);
        assert_eq!(cfg.budget_tokens(4_096), 820);
        assert_eq!(cfg.budget_tokens(0), 0);
        // The paper's setting has no floor.
        assert_eq!(CompressConfig::paper_fixed().budget_tokens(38), 4);
        let cfg = CompressConfig::from_json(r#"{"min_budget_tokens": 0}"#).unwrap();
        assert_eq!(cfg.budget_tokens(38), 8);
        assert_eq!(
            CompressConfig::from_json("{}").unwrap().min_budget_tokens,
            256
        );
    }

    #[test]
    fn min_segment_len_is_a_positive_multiple_of_the_buffer() {
        let with = |min_segment_len| CompressConfig {
            min_segment_len,
            ..CompressConfig::default()
        };
        for bad in [0, 32, 4_000] {
            assert!(
                matches!(with(bad).validate(64), Err(MosaicError::InvalidConfig(_))),
                "min_segment_len {bad} accepted"
            );
        }
        // Above max_segment_len is allowed: then only the cap closes a segment.
        for good in [64, 4_096, 131_072] {
            with(good).validate(64).unwrap();
        }
        let cfg = CompressConfig::from_json(r#"{"min_segment_len": 128}"#).unwrap();
        assert_eq!(cfg.min_segment_len, 128);
        let d = CompressConfig::from_json("{}").unwrap();
        assert_eq!((d.min_segment_len, d.max_segment_len), (1_024, 2_048));
        // the fewest tokens between closes: the cap wins below the minimum
        assert_eq!(d.close_spacing(), 1_024);
        assert_eq!(with(4_096).close_spacing(), 2_048);
    }

    #[test]
    fn value_dtypes_parse_default_and_validate() {
        assert_eq!(
            CompressConfig::default().value_dtypes,
            vec![ValueDtype::F16, ValueDtype::Int8, ValueDtype::Int4]
        );
        assert_eq!(
            CompressConfig::paper_fixed().value_dtypes,
            vec![ValueDtype::F16]
        );
        let cfg =
            CompressConfig::from_json(r#"{"value_dtypes": ["int4", "int8", "f16"]}"#).unwrap();
        assert_eq!(
            cfg.value_dtypes,
            vec![ValueDtype::Int4, ValueDtype::Int8, ValueDtype::F16]
        );
        cfg.validate(64).unwrap();
        assert!(CompressConfig::from_json(r#"{"value_dtypes": ["int3"]}"#).is_err());
        for bad in [vec![], vec![ValueDtype::Int8, ValueDtype::Int8]] {
            let cfg = CompressConfig {
                value_dtypes: bad,
                ..CompressConfig::default()
            };
            assert!(matches!(
                cfg.validate(64),
                Err(MosaicError::InvalidConfig(_))
            ));
        }
    }
}
