//! The dense f32 prefill: every layer on the whole prompt, chunked causal attention.

use super::{DecodeWeights, Model};
use crate::kv::LayerKv;
use crate::{EngineError, Result};
use candle_core::Tensor;
use mosaickv_optimized::simd::exp_shifted_in_place;
use mosaickv_spec::{KvShape, QueryStats};
use ndarray::{Array3, ArrayView3};
use rayon::prelude::*;

/// Query rows per attention chunk in prefill.
pub(super) const Q_CHUNK: usize = 256;
/// Key rows per online-softmax step in prefill.
const K_CHUNK: usize = 1024;
/// Last prompt positions whose queries give the value weights of the attention loss.
pub const STATS_SAMPLE: usize = 64;

/// Result of [`Model::prefill`].
#[derive(Debug, Clone)]
pub struct Prefill {
    /// Per layer, post-RoPE keys [tokens, kv_heads, head_dim].
    pub keys: Vec<Array3<f32>>,
    /// Per layer, values [tokens, kv_heads, head_dim].
    pub values: Vec<Array3<f32>>,
    /// Logits at the last prompt position.
    pub logits: Vec<f32>,
    /// Per layer, post-RoPE queries [tokens, q_heads, head_dim]; empty unless
    /// [`Model::prefill_with_queries`] made it.
    pub queries: Vec<Array3<f32>>,
    /// Per layer, the query statistics of SPEC.md section 11.1; empty unless
    /// [`Model::prefill_with_stats`] made them. [`Prefill::fill`] hands them to the caches.
    pub query_stats: Vec<QueryStats>,
}

impl Prefill {
    pub fn len(&self) -> usize {
        self.keys.first().map_or(0, |k| k.dim().0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Hands every layer's prompt K/V to the matching cache.
    pub fn fill(&self, caches: &mut [Box<dyn LayerKv>]) -> Result<()> {
        if caches.len() != self.keys.len() {
            return Err(EngineError::Invalid(format!(
                "{} caches for {} layers",
                caches.len(),
                self.keys.len()
            )));
        }
        for (layer, c) in caches.iter_mut().enumerate() {
            if let Some(stats) = self.query_stats.get(layer) {
                c.set_query_stats(stats.clone())
                    .map_err(|message| EngineError::Cache { layer, message })?;
            }
            c.prefill(self.keys[layer].view(), self.values[layer].view())
                .map_err(|message| EngineError::Cache { layer, message })?;
        }
        Ok(())
    }
}

impl Model {
    /// Dense prefill of a prompt. Attention is causal and chunked: queries in blocks of 256
    /// rows, keys in blocks of 1024 with an online softmax, so no n x n matrix is formed.
    pub fn prefill(&self, tokens: &[u32]) -> Result<Prefill> {
        self.prefill_impl(tokens, false, false, self.prefill_weights(tokens.len()))
    }

    /// [`Model::prefill`] with a choice of weights for its products (by default
    /// [`Model::prefill_weights`] of the prompt's length); for comparing the two arithmetics.
    pub fn prefill_using(&self, tokens: &[u32], weights: DecodeWeights) -> Result<Prefill> {
        self.prefill_impl(tokens, false, false, weights)
    }

    /// [`Model::prefill`] that also keeps every layer's post-RoPE queries (`Prefill::queries`).
    pub fn prefill_with_queries(&self, tokens: &[u32]) -> Result<Prefill> {
        self.prefill_impl(tokens, true, false, self.prefill_weights(tokens.len()))
    }

    /// [`Model::prefill`] that also collects every layer's query statistics for the attention
    /// loss (`Prefill::query_stats`, SPEC.md section 11.1): the key second moment over every
    /// prompt query, the value weights from the last [`STATS_SAMPLE`] positions.
    pub fn prefill_with_stats(&self, tokens: &[u32]) -> Result<Prefill> {
        self.prefill_impl(tokens, false, true, self.prefill_weights(tokens.len()))
    }

    fn prefill_impl(
        &self,
        tokens: &[u32],
        keep_queries: bool,
        stats: bool,
        weights: DecodeWeights,
    ) -> Result<Prefill> {
        let n = tokens.len();
        if n == 0 {
            return Err(EngineError::Invalid("empty prompt".into()));
        }
        if n > self.cfg.context_length {
            return Err(EngineError::Invalid(format!(
                "{n} tokens exceed the context length {}",
                self.cfg.context_length
            )));
        }
        let c = &self.cfg;
        let (qd, kvd) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
        let mut x = self.embed_tokens(tokens)?;
        let mut keys = Vec::with_capacity(c.n_layers);
        let mut values = Vec::with_capacity(c.n_layers);
        let mut queries = Vec::new();
        let mut query_stats = Vec::new();
        let shape = KvShape::new(c.kv_heads, c.q_heads, c.head_dim)
            .map_err(|e| EngineError::Invalid(e.to_string()))?;
        let mut attn_time = std::time::Duration::ZERO;
        let t_all = std::time::Instant::now();
        for l in &self.layers {
            let h = self.rms(&x, &l.attn_norm)?;
            let mut qkv = self.matmul_t(&h, &l.wqkv, &l.q.wqkv, weights)?;
            if let Some(b) = &l.bqkv {
                qkv = qkv.broadcast_add(b)?;
            }
            let mut q = qkv
                .narrow(1, 0, qd)?
                .contiguous()?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let mut k = qkv
                .narrow(1, qd, kvd)?
                .contiguous()?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let v = qkv
                .narrow(1, qd + kvd, kvd)?
                .contiguous()?
                .flatten_all()?
                .to_vec1::<f32>()?;
            self.rope(&mut q, c.q_heads, 0);
            self.rope(&mut k, c.kv_heads, 0);
            if keep_queries || stats {
                let qs =
                    Array3::from_shape_vec((n, c.q_heads, c.head_dim), q.clone()).expect("shape");
                if stats {
                    let kvs = (n, c.kv_heads, c.head_dim);
                    let ks = ArrayView3::from_shape(kvs, &k).expect("shape");
                    let vs = ArrayView3::from_shape(kvs, &v).expect("shape");
                    query_stats.push(
                        QueryStats::from_queries(&shape, ks, vs, qs.view(), STATS_SAMPLE)
                            .map_err(|e| EngineError::Invalid(e.to_string()))?,
                    );
                }
                if keep_queries {
                    queries.push(qs);
                }
            }
            let qt = Tensor::from_vec(q, (n, c.q_heads, c.head_dim), &self.dev)?
                .transpose(0, 1)?
                .contiguous()?;
            let kt = Tensor::from_slice(&k, (n, c.kv_heads, c.head_dim), &self.dev)?
                .transpose(0, 1)?
                .contiguous()?;
            let vt = Tensor::from_slice(&v, (n, c.kv_heads, c.head_dim), &self.dev)?
                .transpose(0, 1)?
                .contiguous()?;
            let t0 = std::time::Instant::now();
            let attn = self.causal_attention(&qt, &kt, &vt)?;
            attn_time += t0.elapsed();
            keys.push(Array3::from_shape_vec((n, c.kv_heads, c.head_dim), k).expect("shape"));
            values.push(Array3::from_shape_vec((n, c.kv_heads, c.head_dim), v).expect("shape"));
            x = (x + self.matmul_t(&attn, &l.wo, &l.q.wo, weights)?)?;
            x = (&x + self.mlp(l, &x, weights)?)?;
        }
        let logits = self.logits(&x.narrow(0, n - 1, 1)?)?;
        if std::env::var_os("MOSAICKV_PROFILE").is_some() {
            eprintln!(
                "[prefill {n}: total {:.2} s, attention {:.2} s]",
                t_all.elapsed().as_secs_f64(),
                attn_time.as_secs_f64()
            );
        }
        Ok(Prefill {
            keys,
            values,
            logits,
            queries,
            query_stats,
        })
    }

    /// q: [q_heads, n, d], k/v: [kv_heads, n, d] (contiguous). Returns [n, q_heads * d].
    fn causal_attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        self.causal_attention_at(q, k, v, 0, Q_CHUNK)
    }

    /// Causal attention of `n` queries at prompt positions `offset..offset + n` over the keys
    /// of positions `0..offset + n`: q `[q_heads, n, d]`, k/v `[kv_heads, offset + n, d]`
    /// (contiguous). Queries run in parallel chunks of `q_chunk` rows; keys in blocks of
    /// [`K_CHUNK`] with an online softmax, so no `n x (offset + n)` matrix is formed (the
    /// chunked prefill of [`Model::prefill_chunk`] calls it with its chunk's offset). Returns
    /// `[n, q_heads * d]`.
    pub(super) fn causal_attention_at(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        offset: usize,
        q_chunk: usize,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let (_, n, d) = q.dims3()?;
        let group = c.q_heads / c.kv_heads;
        let scale = 1.0 / (d as f64).sqrt();
        let q_chunk = q_chunk.max(1);
        let starts: Vec<usize> = (0..n).step_by(q_chunk).collect();
        let outs: Vec<Tensor> = starts
            .par_iter()
            .map(|&a| -> Result<Tensor> {
                let qc = q_chunk.min(n - a);
                let rows = c.kv_heads * group * qc;
                // [kv_heads, group * qc, d]: row g * qc + i is query head kv * group + g, position a + i
                let qg =
                    (q.narrow(1, a, qc)?
                        .contiguous()?
                        .reshape((c.kv_heads, group * qc, d))?
                        * scale)?;
                let mut m = vec![f32::NEG_INFINITY; rows];
                let mut l = vec![0f32; rows];
                let mut acc = vec![0f32; rows * d];
                // keys 0..end are visible to some query of the chunk
                let end = offset + a + qc;
                for k0 in (0..end).step_by(K_CHUNK) {
                    let kl = K_CHUNK.min(end - k0);
                    let kc = k.narrow(1, k0, kl)?;
                    let vc = v.narrow(1, k0, kl)?;
                    let mut p = qg.matmul(&kc.t()?)?.flatten_all()?.to_vec1::<f32>()?;
                    let mut corr = vec![0f32; rows];
                    // fused causal mask + online softmax update, one row at a time
                    for (r, row) in p.chunks_exact_mut(kl).enumerate() {
                        let pos = offset + a + r % qc;
                        // keys k0 + j with k0 + j <= pos are visible; key 0 is in the first chunk,
                        // so every row has a finite max after the first chunk
                        let vis = (pos + 1).saturating_sub(k0).min(kl);
                        let (on, off) = row.split_at_mut(vis);
                        off.fill(0.0);
                        let rmax = on.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let m_new = m[r].max(rmax);
                        let mut sum = 0f32;
                        if vis > 0 {
                            exp_shifted_in_place(on, m_new);
                            sum = on.iter().sum();
                        }
                        corr[r] = (m[r] - m_new).exp();
                        l[r] = l[r] * corr[r] + sum;
                        m[r] = m_new;
                    }
                    let p = Tensor::from_vec(p, (c.kv_heads, group * qc, kl), &self.dev)?;
                    let pv = p.matmul(&vc)?.flatten_all()?.to_vec1::<f32>()?;
                    for (r, (a_row, pv_row)) in
                        acc.chunks_exact_mut(d).zip(pv.chunks_exact(d)).enumerate()
                    {
                        for (x, &y) in a_row.iter_mut().zip(pv_row) {
                            *x = *x * corr[r] + y;
                        }
                    }
                }
                for (r, a_row) in acc.chunks_exact_mut(d).enumerate() {
                    let inv = 1.0 / l[r];
                    a_row.iter_mut().for_each(|x| *x *= inv);
                }
                let o = Tensor::from_vec(acc, (c.q_heads, qc, d), &self.dev)?;
                Ok(o.transpose(0, 1)?.reshape((qc, c.q_heads * d))?)
            })
            .collect::<Result<_>>()?;
        Ok(Tensor::cat(&outs, 0)?)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn fast_exp_is_accurate() {
        let mut worst = 0f64;
        let mut xs: Vec<f32> = (0..200_000).map(|i| -(i as f32) * 1e-3).collect();
        xs.extend([-86.9f32, -100.0, -1e-8, 0.0, f32::NEG_INFINITY]);
        let mut ys = xs.clone();
        super::exp_shifted_in_place(&mut ys, 0.0);
        for (&x, &y) in xs.iter().zip(&ys) {
            let want = (x as f64).exp();
            if x >= -87.0 {
                worst = worst.max(((y as f64 - want) / want).abs());
            } else {
                assert!(y >= 0.0 && y < 1e-37, "exp({x}) = {y}");
            }
        }
        assert!(worst < 1e-6, "worst relative error {worst}");
    }
}
