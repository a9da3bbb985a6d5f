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
    /// `[tokens][kv_heads]`: the mean over the sampled prefill queries of the group (the last
    /// `sample` positions, each query head) of the attention probability of prompt token `t`
    /// (causal softmax of `q.k / sqrt(D)` over the exact keys; 0 where no sampled query sees
    /// `t`). Token `t` is the cache's token `t`.
    pub value_weight: Vec<f64>,
}

impl QueryStats {
    /// Prompt tokens the weights cover.
    pub fn tokens(&self) -> usize {
        self.value_weight.len() / self.kv_heads.max(1)
    }

    /// `M_j` of KV head `h`, `D x D` row-major.
    pub fn moment(&self, h: usize) -> &[f64] {
        let dd = self.head_dim * self.head_dim;
        &self.key_moment[h * dd..(h + 1) * dd]
    }

    /// Weights of KV head `h` for tokens `start..start + len` (None past the prompt).
    pub fn weights(&self, h: usize, start: usize, len: usize) -> Option<Vec<f64>> {
        if start + len > self.tokens() {
            return None;
        }
        Some(
            (start..start + len)
                .map(|t| self.value_weight[t * self.kv_heads + h])
                .collect(),
        )
    }

    /// Checks the statistics against a cache's shape: lengths, finite, `M` entries and
    /// weights finite, weights `>= 0`.
    pub fn validate(&self, shape: &KvShape) -> Result<()> {
        let d = shape.head_dim;
        if self.kv_heads != shape.kv_heads
            || self.head_dim != d
            || self.key_moment.len() != shape.kv_heads * d * d
            || self.value_weight.len() % shape.kv_heads != 0
        {
            return Err(MosaicError::ShapeMismatch {
                what: "query stats",
                expected: format!("kv_heads {}, head_dim {d}", shape.kv_heads),
                got: format!(
                    "kv_heads {}, head_dim {}, {} moment and {} weight entries",
                    self.kv_heads,
                    self.head_dim,
                    self.key_moment.len(),
                    self.value_weight.len()
                ),
            });
        }
        if let Some(index) = self.key_moment.iter().position(|x| !x.is_finite()) {
            return Err(MosaicError::NonFinite {
                what: "query stats (key moment)",
                index,
            });
        }
        if let Some(index) = self
            .value_weight
            .iter()
            .position(|x| !(x.is_finite() && *x >= 0.0))
        {
            return Err(MosaicError::NonFinite {
                what: "query stats (value weight)",
                index,
            });
        }
        Ok(())
    }

    /// Builds one layer's statistics from its prompt keys `[n, kv_heads, D]` and the prefill
    /// queries `[n, q_heads, D]` (post-RoPE, query `i` at position `i`): `M` over all `n`
    /// queries, the weights from the last `sample` (at least 1) positions. f64 throughout.
    pub fn from_queries(
        shape: &KvShape,
        keys: ArrayView3<f32>,
        queries: ArrayView3<f32>,
        sample: usize,
    ) -> Result<Self> {
        let (kv, qh, d) = (shape.kv_heads, shape.q_heads, shape.head_dim);
        let n = keys.len_of(Axis(0));
        if keys.shape()[1..] != [kv, d] || queries.shape() != [n, qh, d] {
            return Err(MosaicError::ShapeMismatch {
                what: "queries",
                expected: format!("[{n}, {qh}, {d}] beside keys [{n}, {kv}, {d}]"),
                got: format!("{:?} and keys {:?}", queries.shape(), keys.shape()),
            });
        }
        crate::validate::finite("queries", queries.iter())?;
        crate::validate::finite("keys", keys.iter())?;
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
        let mut value_weight = vec![0f64; n * kv];
        let first = n.saturating_sub(sample.max(1));
        let scale = 1.0 / (d as f64).sqrt();
        let mut z = vec![0f64; n];
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
                for (t, zt) in z.iter().enumerate().take(pos + 1) {
                    value_weight[t * kv + j] += zt / sum;
                }
            }
        }
        let samples = ((n - first) * g).max(1) as f64;
        value_weight.iter_mut().for_each(|x| *x /= samples);
        Ok(Self {
            kv_heads: kv,
            head_dim: d,
            key_moment,
            value_weight,
        })
    }
}

/// Where one head's segment sits, for the attention loss: the layer's statistics, the KV
/// head, and the segment's first token (its weights are `stats.weights(head, start, len)`).
#[derive(Debug, Clone, Copy)]
pub struct LossContext<'a> {
    pub stats: &'a QueryStats,
    pub head: usize,
    pub start: usize,
}

/// SPEC.md section 11.1: the configuration whose channel thresholds compare the attention
/// loss (`LossPolicy::Attention`'s), or `None` when the energy loss is in force (the policy
/// is `Energy`, or no statistics were given: the fallback).
pub fn attention_config(
    config: &CompressConfig,
    ctx: Option<LossContext<'_>>,
) -> Option<CompressConfig> {
    let (LossPolicy::Attention {
        key_loss,
        value_loss,
    }, Some(_)) = (&config.loss, ctx)
    else {
        return None;
    };
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
        let q = Array3::from_shape_vec((2, 2, 2), vec![1.0, 0.0, 0.0, 2.0, 1.0, 0.0, 0.0, 2.0])
            .unwrap();
        let st = QueryStats::from_queries(&shape, keys.view(), q.view(), 1).unwrap();
        // M = mean of (1,0)(1,0)^T and (0,2)(0,2)^T = diag(0.5, 2).
        assert_eq!(st.key_moment, vec![0.5, 0.0, 0.0, 2.0]);
        // Last position only: head 0 logits (1, 0)/sqrt2, head 1 (0, 2)/sqrt2.
        let s = 1.0 / 2f64.sqrt();
        let p0 = 1.0 / (1.0 + (-s).exp());
        let p1 = 1.0 / (1.0 + (2.0 * s).exp());
        let want0 = (p0 + p1) / 2.0;
        assert!((st.value_weight[0] - want0).abs() < 1e-15);
        assert!((st.value_weight[0] + st.value_weight[1] - 1.0).abs() < 1e-15);
        st.validate(&shape).unwrap();
        assert!(st.validate(&KvShape::new(1, 2, 4).unwrap()).is_err());
        let mut bad = st.clone();
        bad.value_weight[1] = -1.0;
        assert!(matches!(
            bad.validate(&shape),
            Err(MosaicError::NonFinite { index: 1, .. })
        ));
    }
}
