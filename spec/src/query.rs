//! Query statistics for the attention loss (SPEC.md section 11.1).
//!
//! What the model's queries looked like while the prompt was prefilled, per layer: for each
//! KV head the second moment of its GQA group's queries, and for each prompt token the mean
//! attention weight it drew. Strategy generation uses them to weigh the error of a
//! reconstruction by what attention will see (`ChannelPolicy` thresholds, `LossPolicy::Attention`).
//! Everything is in the model's basis (post-RoPE keys and queries, as cached: SPEC.md section 1).

use crate::config::{ChannelPolicy, CompressConfig, KvShape, LossPolicy};
use crate::error::{MosaicError, Result};
use ndarray::{ArrayView3, Axis};

/// One layer's query statistics (SPEC.md section 11.1).
#[derive(Debug, Clone, PartialEq)]
pub struct QueryStats {
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Per KV head `j`, `M_j = mean over the prefill queries q of the group's query heads of
    /// q q^T`, `D x D` row-major, f64: `[kv_heads][D][D]`.
    pub key_moment: Vec<f64>,
    /// `[tokens][kv_heads]`: `w_t`, the mean over the sampled prefill queries of the group (the
    /// last `sample` positions, each query head of the group) of the attention probability
    /// `p(t)` of prompt token `t` (causal softmax of `q.k / sqrt(D)` over the exact keys; 0
    /// where no sampled query sees `t`). Token `t` is the cache's token `t`.
    pub key_weight: Vec<f64>,
    /// `[tokens][kv_heads]`: `u_t`, the same mean of `p(t)^2`.
    pub value_weight: Vec<f64>,
    /// `[kv_heads]`: `O^2`, the same mean of the squared norm of the exact attention output
    /// `||sum_t p(t) v_t||^2`.
    pub output_sq: Vec<f64>,
}

impl QueryStats {
    /// Prompt tokens the weights cover.
    pub fn tokens(&self) -> usize {
        self.key_weight.len() / self.kv_heads.max(1)
    }

    /// `M_j` of KV head `h`, `D x D` row-major.
    pub fn moment(&self, h: usize) -> &[f64] {
        let dd = self.head_dim * self.head_dim;
        &self.key_moment[h * dd..(h + 1) * dd]
    }

    /// `(w_t, u_t)` of KV head `h` for tokens `start..start + len` (None past the prompt).
    pub fn weights(&self, h: usize, start: usize, len: usize) -> Option<(Vec<f64>, Vec<f64>)> {
        if start + len > self.tokens() {
            return None;
        }
        let pick = |v: &[f64]| {
            (start..start + len)
                .map(|t| v[t * self.kv_heads + h])
                .collect()
        };
        Some((pick(&self.key_weight), pick(&self.value_weight)))
    }

    /// Checks the statistics against a cache's shape: lengths, finite, `M` entries and
    /// weights finite, weights `>= 0`.
    pub fn validate(&self, shape: &KvShape) -> Result<()> {
        let d = shape.head_dim;
        if self.kv_heads != shape.kv_heads
            || self.head_dim != d
            || self.key_moment.len() != shape.kv_heads * d * d
            || self.key_weight.len() % shape.kv_heads != 0
            || self.value_weight.len() != self.key_weight.len()
            || self.output_sq.len() != shape.kv_heads
        {
            return Err(MosaicError::ShapeMismatch {
                what: "query stats",
                expected: format!("kv_heads {}, head_dim {d}", shape.kv_heads),
                got: format!(
                    "kv_heads {}, head_dim {}, {} moment, {} and {} weight, {} output entries",
                    self.kv_heads,
                    self.head_dim,
                    self.key_moment.len(),
                    self.key_weight.len(),
                    self.value_weight.len(),
                    self.output_sq.len()
                ),
            });
        }
        if let Some(index) = self.key_moment.iter().position(|x| !x.is_finite()) {
            return Err(MosaicError::NonFinite {
                what: "query stats (key moment)",
                index,
            });
        }
        for (what, v) in [
            ("query stats (key weight)", &self.key_weight),
            ("query stats (value weight)", &self.value_weight),
            ("query stats (output norm)", &self.output_sq),
        ] {
            if let Some(index) = v.iter().position(|x| !(x.is_finite() && *x >= 0.0)) {
                return Err(MosaicError::NonFinite { what, index });
            }
        }
        Ok(())
    }

    /// Builds one layer's statistics from its prompt keys and values `[n, kv_heads, D]` and
    /// the prefill queries `[n, q_heads, D]` (post-RoPE, query `i` at position `i`): `M` over
    /// all `n` queries, the weights and `O^2` from the last `sample` (at least 1) positions.
    /// f64 throughout.
    pub fn from_queries(
        shape: &KvShape,
        keys: ArrayView3<f32>,
        values: ArrayView3<f32>,
        queries: ArrayView3<f32>,
        sample: usize,
    ) -> Result<Self> {
        let (kv, qh, d) = (shape.kv_heads, shape.q_heads, shape.head_dim);
        let n = keys.len_of(Axis(0));
        if keys.shape()[1..] != [kv, d]
            || values.shape() != keys.shape()
            || queries.shape() != [n, qh, d]
        {
            return Err(MosaicError::ShapeMismatch {
                what: "queries",
                expected: format!("[{n}, {qh}, {d}] beside keys [{n}, {kv}, {d}]"),
                got: format!("{:?} and keys {:?}", queries.shape(), keys.shape()),
            });
        }
        crate::validate::finite("queries", queries.iter())?;
        crate::validate::finite("keys", keys.iter())?;
        crate::validate::finite("values", values.iter())?;
        let g = shape.group();
        let mut key_moment = vec![0f64; kv * d * d];
        for t in 0..n {
            for h in 0..qh {
                let q = queries.slice(ndarray::s![t, h, ..]);
                let m = &mut key_moment[(h / g) * d * d..(h / g + 1) * d * d];
                for a in 0..d {
                    let qa = f64::from(q[a]);
                    for b in 0..=a {
                        m[a * d + b] += qa * f64::from(q[b]);
                    }
                }
            }
        }
        let count = (n * g).max(1) as f64;
        for m in key_moment.chunks_exact_mut(d * d) {
            for a in 0..d {
                for b in 0..=a {
                    m[a * d + b] /= count;
                    m[b * d + a] = m[a * d + b];
                }
            }
        }
        let mut key_weight = vec![0f64; n * kv];
        let mut value_weight = vec![0f64; n * kv];
        let mut output_sq = vec![0f64; kv];
        let first = n.saturating_sub(sample.max(1));
        let scale = 1.0 / (d as f64).sqrt();
        let mut z = vec![0f64; n];
        let mut o = vec![0f64; d];
        for pos in first..n {
            for h in 0..qh {
                let j = h / g;
                let q = queries.slice(ndarray::s![pos, h, ..]);
                let mut zmax = f64::NEG_INFINITY;
                for (t, zt) in z.iter_mut().enumerate().take(pos + 1) {
                    let k = keys.slice(ndarray::s![t, j, ..]);
                    let mut dot = 0f64;
                    for i in 0..d {
                        dot += f64::from(q[i]) * f64::from(k[i]);
                    }
                    *zt = dot * scale;
                    zmax = zmax.max(*zt);
                }
                let mut sum = 0f64;
                for zt in z.iter_mut().take(pos + 1) {
                    *zt = (*zt - zmax).exp();
                    sum += *zt;
                }
                o.fill(0.0);
                for (t, zt) in z.iter().enumerate().take(pos + 1) {
                    let p = zt / sum;
                    key_weight[t * kv + j] += p;
                    value_weight[t * kv + j] += p * p;
                    let v = values.slice(ndarray::s![t, j, ..]);
                    for i in 0..d {
                        o[i] += p * f64::from(v[i]);
                    }
                }
                output_sq[j] += o.iter().map(|x| x * x).sum::<f64>();
            }
        }
        let samples = ((n - first) * g).max(1) as f64;
        for v in [&mut key_weight, &mut value_weight, &mut output_sq] {
            v.iter_mut().for_each(|x| *x /= samples);
        }
        Ok(Self {
            kv_heads: kv,
            head_dim: d,
            key_moment,
            key_weight,
            value_weight,
            output_sq,
        })
    }
}

/// Where one head's segment sits, for the attention loss: the layer's statistics, the KV
/// head, and the segment's tokens `start..start + len` (their weights are
/// `stats.weights(head, start, len)`).
#[derive(Debug, Clone, Copy)]
pub struct LossContext<'a> {
    pub stats: &'a QueryStats,
    pub head: usize,
    pub start: usize,
    pub len: usize,
}

impl LossContext<'_> {
    /// Whether the statistics cover the segment's tokens (else the energy loss is used).
    pub fn covered(&self) -> bool {
        self.start + self.len <= self.stats.tokens()
    }
}

/// SPEC.md section 11.1.1: the configuration whose channel thresholds compare the attention
/// loss (`LossPolicy::Attention`'s), or `None` when the energy loss is in force (the policy
/// is `Energy`, or no statistics cover the segment: the fallback).
pub fn attention_config(
    config: &CompressConfig,
    ctx: Option<LossContext<'_>>,
) -> Option<CompressConfig> {
    let (
        LossPolicy::Attention {
            key_loss,
            value_loss,
        },
        Some(ctx),
    ) = (&config.loss, ctx)
    else {
        return None;
    };
    if !ctx.covered() {
        return None;
    }
    let mut out = config.clone();
    if let ChannelPolicy::LossThreshold {
        key_loss: k,
        value_loss: v,
        ..
    } = &mut out.channels
    {
        *k = *key_loss;
        *v = *value_loss;
    }
    Some(out)
}

/// The loss a cache chooses channels by, as its manifest reports it: `energy`, `attention`,
/// or `energy (fallback: no query statistics)` when the attention loss was asked for and the
/// cache was given no statistics.
pub fn loss_in_use(config: &CompressConfig, has_stats: bool) -> &'static str {
    match (&config.loss, has_stats) {
        (LossPolicy::Energy, _) => "energy",
        (LossPolicy::Attention { .. }, true) => "attention",
        (LossPolicy::Attention { .. }, false) => "energy (fallback: no query statistics)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array3;

    #[test]
    fn moments_and_weights_of_a_tiny_prompt() {
        let shape = KvShape::new(1, 2, 2).unwrap();
        // Two tokens; queries: head 0 = (1, 0), head 1 = (0, 2) at both positions.
        let keys = Array3::from_shape_vec((2, 1, 2), vec![1.0, 0.0, 0.0, 1.0]).unwrap();
        let values = Array3::from_shape_vec((2, 1, 2), vec![2.0, 0.0, 0.0, 4.0]).unwrap();
        let q = Array3::from_shape_vec((2, 2, 2), vec![1.0, 0.0, 0.0, 2.0, 1.0, 0.0, 0.0, 2.0])
            .unwrap();
        let st = QueryStats::from_queries(&shape, keys.view(), values.view(), q.view(), 1).unwrap();
        // M = mean of (1,0)(1,0)^T and (0,2)(0,2)^T = diag(0.5, 2).
        assert_eq!(st.key_moment, vec![0.5, 0.0, 0.0, 2.0]);
        // Last position only: head 0 logits (1, 0)/sqrt2, head 1 (0, 2)/sqrt2.
        let s = 1.0 / 2f64.sqrt();
        let p0 = 1.0 / (1.0 + (-s).exp());
        let p1 = 1.0 / (1.0 + (2.0 * s).exp());
        let close = |a: f64, b: f64| (a - b).abs() < 1e-15;
        assert!(close(st.key_weight[0], (p0 + p1) / 2.0));
        assert!(close(st.key_weight[0] + st.key_weight[1], 1.0));
        assert!(close(st.value_weight[0], (p0 * p0 + p1 * p1) / 2.0));
        let o2 = |p: f64| (2.0 * p).powi(2) + (4.0 * (1.0 - p)).powi(2);
        assert!(close(st.output_sq[0], (o2(p0) + o2(p1)) / 2.0));
        st.validate(&shape).unwrap();
        assert!(st.validate(&KvShape::new(1, 2, 4).unwrap()).is_err());
        let mut bad = st.clone();
        bad.value_weight[1] = -1.0;
        assert!(matches!(
            bad.validate(&shape),
            Err(MosaicError::NonFinite { index: 1, .. })
        ));
        let ctx = LossContext {
            stats: &st,
            head: 0,
            start: 1,
            len: 2,
        };
        assert!(!ctx.covered());
        let cfg = CompressConfig {
            loss: LossPolicy::Attention {
                key_loss: 0.1,
                value_loss: 0.1,
            },
            ..CompressConfig::default()
        };
        assert!(attention_config(&cfg, Some(ctx)).is_none());
        assert!(attention_config(&cfg, Some(LossContext { len: 1, ..ctx })).is_some());
        assert!(attention_config(
            &CompressConfig::default(),
            Some(LossContext { len: 1, ..ctx })
        )
        .is_none());
    }
}
