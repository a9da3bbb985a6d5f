//! The dense f32 prefill: every layer on the whole prompt, chunked causal attention.

use super::{DecodeWeights, Model};
use crate::kv::LayerKv;
use crate::{EngineError, Result};
use candle_core::Tensor;
use mosaickv_optimized::simd::amx::{product, softmax_row_bf16, to_bf16, Bf16Rows, PackedBf16};
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
            let attn = if weights == DecodeWeights::Bf16 {
                self.causal_attention_bf16(&qt, &kt, &vt, 0, Q_CHUNK)?
            } else {
                self.causal_attention(&qt, &kt, &vt)?
            };
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

    /// [`Model::causal_attention_at`] with the products on AMX tiles ([`DecodeWeights::Bf16`]):
    /// [`causal_attention_bf16`] on the tensors' values. Returns `[n, q_heads * d]`.
    pub(super) fn causal_attention_bf16(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        offset: usize,
        q_chunk: usize,
    ) -> Result<Tensor> {
        let (q_heads, n, d) = q.dims3()?;
        let (kv_heads, total, _) = k.dims3()?;
        let shape = AttentionShape {
            q_heads,
            kv_heads,
            d,
            n,
            total,
        };
        // the three tensors' values in place (each `with_f32` holds its tensor's storage)
        let out = super::with_f32(q, |qs| {
            super::with_f32(k, |ks| {
                super::with_f32(v, |vs| {
                    causal_attention_bf16(shape, qs, ks, vs, offset, q_chunk)
                })
                .and_then(|r| r)
            })
            .and_then(|r| r)
        })
        .and_then(|r| r)?;
        Ok(Tensor::from_vec(out, (n, q_heads * d), &self.dev)?)
    }
}

/// The sizes of one prefill attention call: `n` queries of `q_heads` heads over `total` keys
/// of `kv_heads` heads, head size `d`.
#[derive(Clone, Copy)]
pub(super) struct AttentionShape {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub d: usize,
    pub n: usize,
    pub total: usize,
}

/// Causal attention of `n` queries at positions `offset..offset + n` over keys `0..total`
/// (`total = offset + n`) with the products on AMX tiles: `q` `[q_heads][n][d]`, `k`, `v`
/// `[kv_heads][total][d]`; returns `[n][q_heads * d]`. The scaled queries, the keys, the
/// probabilities and the values are rounded to bf16, the logits `q k^T` and the outputs `p V`
/// summed in f32 by `TDPBF16PS`; the causal mask and the online softmax over key blocks of
/// [`K_CHUNK`] as the f32 path computes them ([`Model::causal_attention_at`]). Each KV head's
/// keys and transposed values are packed into tiles once; query chunks of `q_chunk` rows run in
/// parallel.
pub(super) fn causal_attention_bf16(
    shape: AttentionShape,
    qs: &[f32],
    ks: &[f32],
    vs: &[f32],
    offset: usize,
    q_chunk: usize,
) -> Result<Vec<f32>> {
    let AttentionShape {
        q_heads,
        kv_heads: kvh,
        d,
        n,
        total,
    } = shape;
    if q_heads % kvh != 0
        || total != offset + n
        || qs.len() != q_heads * n * d
        || ks.len() != kvh * total * d
        || vs.len() != ks.len()
    {
        return Err(EngineError::Invalid(format!(
            "attention of {n} queries ({q_heads} heads) at {offset} over {total} keys ({kvh} heads) of {d}"
        )));
    }
    let group = q_heads / kvh;
    let width = q_heads * d;
    let scale = (1.0 / (d as f64).sqrt()) as f32;
    let q_chunk = q_chunk.max(1);
    let dblocks = d.div_ceil(32);
    let packed = |x: &[f32], transposed: bool| -> Vec<PackedBf16> {
        (0..kvh)
            .into_par_iter()
            .map(|h| {
                let xh = &x[h * total * d..(h + 1) * total * d];
                if !transposed {
                    return PackedBf16::new(xh, total, d);
                }
                // V^T: row j is dim j of every key
                let t = PackedBf16::from_rows(d, total, |j0, rows: &mut [f32]| {
                    for (jj, row) in rows.chunks_exact_mut(total).enumerate() {
                        for (o, key) in row.iter_mut().zip(xh.chunks_exact(d)) {
                            *o = key[j0 + jj];
                        }
                    }
                    Ok::<(), std::convert::Infallible>(())
                });
                t.unwrap_or_else(|e| match e {})
            })
            .collect()
    };
    let (kp, vp) = (packed(ks, false), packed(vs, true));
    let mut out = vec![0f32; n * width];
    out.par_chunks_mut(q_chunk * width)
        .enumerate()
        .for_each(|(ci, o)| {
            let a = ci * q_chunk;
            let qc = o.len() / width;
            let rows = group * qc;
            // keys 0..end are visible to some query of the chunk
            let end = offset + a + qc;
            let mut qa = Bf16Rows::zeros(rows, d);
            let mut s = vec![0f32; rows * K_CHUNK.min(end)];
            let mut pa = Bf16Rows::zeros(rows, K_CHUNK.min(end));
            let mut pv = vec![0f32; rows * d];
            let mut scaled = vec![0f32; d];
            for h in 0..kvh {
                // row g * qc + i: query head h * group + g at position a + i
                for g in 0..group {
                    for i in 0..qc {
                        let src = &qs[((h * group + g) * n + a + i) * d..][..d];
                        for (x, &y) in scaled.iter_mut().zip(src) {
                            *x = y * scale;
                        }
                        to_bf16(&scaled, qa.row_mut(g * qc + i));
                    }
                }
                let mut m = vec![f32::NEG_INFINITY; rows];
                let mut l = vec![0f32; rows];
                let mut acc = vec![0f32; rows * d];
                for k0 in (0..end).step_by(K_CHUNK) {
                    let kl = K_CHUNK.min(end - k0);
                    product(&qa, kp[h].cols(k0, kl, 0, dblocks), &mut s, kl);
                    for r in 0..rows {
                        let row = &mut s[r * kl..(r + 1) * kl];
                        let pos = offset + a + r % qc;
                        // keys k0 + j <= pos are visible; key 0 is in the first chunk
                        let vis = (pos + 1).saturating_sub(k0).min(kl);
                        let (m_new, sum) = softmax_row_bf16(row, vis, m[r], pa.row_mut(r));
                        let corr = (m[r] - m_new).exp();
                        l[r] = l[r] * corr + sum;
                        m[r] = m_new;
                        for x in &mut acc[r * d..(r + 1) * d] {
                            *x *= corr;
                        }
                    }
                    let vcols = vp[h].cols(0, d, k0 / 32, kl.div_ceil(32));
                    product(&pa, vcols, &mut pv, d);
                    for (x, &y) in acc.iter_mut().zip(&pv) {
                        *x += y;
                    }
                }
                for g in 0..group {
                    for i in 0..qc {
                        let r = g * qc + i;
                        let inv = 1.0 / l[r];
                        let dst = &mut o[i * width + (h * group + g) * d..][..d];
                        for (x, &y) in dst.iter_mut().zip(&acc[r * d..(r + 1) * d]) {
                            *x = y * inv;
                        }
                    }
                }
            }
        });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{causal_attention_bf16, AttentionShape};

    /// Exact causal attention in f64: `q` `[qh][n][d]` at positions `offset..`, `k`, `v`
    /// `[kvh][total][d]`; `[n][qh * d]`.
    fn exact(s: AttentionShape, q: &[f32], k: &[f32], v: &[f32], offset: usize) -> Vec<f64> {
        let AttentionShape {
            q_heads,
            kv_heads,
            d,
            n,
            total,
        } = s;
        let mut out = vec![0f64; n * q_heads * d];
        for h in 0..q_heads {
            let kv = h / (q_heads / kv_heads);
            for i in 0..n {
                let qi = &q[(h * n + i) * d..][..d];
                let logits: Vec<f64> = (0..=offset + i)
                    .map(|t| {
                        let kt = &k[(kv * total + t) * d..][..d];
                        qi.iter()
                            .zip(kt)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let mx = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = logits.iter().map(|&x| (x - mx).exp()).collect();
                let sum: f64 = p.iter().sum();
                for (t, &pt) in p.iter().enumerate() {
                    for j in 0..d {
                        out[(i * q_heads + h) * d + j] +=
                            pt / sum * f64::from(v[(kv * total + t) * d + j]);
                    }
                }
            }
        }
        out
    }

    #[test]
    fn bf16_attention_on_amx_tiles_matches_exact_attention() {
        if !mosaickv_optimized::simd::amx::amx_available() {
            eprintln!("AMX-BF16 not available on this CPU: the bf16 prefill does not run here");
            return;
        }
        let mut st = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            st ^= st << 13;
            st ^= st >> 7;
            st ^= st << 17;
            (st >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        // whole prompts and a chunk at an offset; key blocks of 1,024 crossed, ragged query
        // chunks; GQA group 2, head sizes 64 and 80 (a partial tile of inputs)
        for (offset, n, q_chunk, d) in [(0, 1100, 256, 64), (0, 300, 100, 80), (1500, 700, 96, 64)]
        {
            let s = AttentionShape {
                q_heads: 4,
                kv_heads: 2,
                d,
                n,
                total: offset + n,
            };
            // logits of a few units, as in a model (keys scaled up)
            let q: Vec<f32> = (0..4 * n * d).map(|_| 2.0 * next()).collect();
            let k: Vec<f32> = (0..2 * s.total * d).map(|_| 2.0 * next()).collect();
            let v: Vec<f32> = (0..2 * s.total * d).map(|_| next()).collect();
            let got = causal_attention_bf16(s, &q, &k, &v, offset, q_chunk).unwrap();
            let want = exact(s, &q, &k, &v, offset);
            let worst = got
                .iter()
                .zip(&want)
                .map(|(&a, &b)| (f64::from(a) - b).abs())
                .fold(0f64, f64::max);
            eprintln!("offset {offset} n {n} d {d}: worst |bf16 - exact| {worst:.2e}");
            // bf16 rounding (8 significant bits) of q, k, p and v: a few 1e-3 on outputs of
            // size 1; a wrong mask or block gives errors of 1e-1 (the first rows see one key)
            assert!(worst < 2e-2, "worst {worst}");
        }
        let bad = AttentionShape {
            q_heads: 3,
            kv_heads: 2,
            d: 64,
            n: 4,
            total: 4,
        };
        assert!(causal_attention_bf16(bad, &[0.0; 768], &[0.0; 512], &[0.0; 512], 0, 4).is_err());
    }

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
