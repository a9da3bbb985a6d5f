//! Batched decode: one step advances many sequences together (issue 16).
//!
//! Each sequence brings its own token, RoPE position and per-layer caches (so its own method and
//! length). Per layer, the weight products run once for the whole batch
//! ([`crate::quant::RowStack::matmul_batch`], the same dispatch and row kernels as single
//! decode: each weight row is read once per step, not once per sequence; a Q4_K/Q6_K row is
//! unpacked once for four sequences), with the model's own rules as in single decode (Q/K/V
//! biases when the architecture has them, its RoPE pairing), and the attention of every
//! sequence runs in one rayon pass over the sequences, each cache splitting its own work over (KV head, token span) items as in single decode. Every
//! per-sequence operation is the one [`Model::decode_step`] runs, in the same order, so a
//! sequence's logits in a batch equal its logits decoded alone bit for bit.

use super::decode::rms_norm_into;
use super::{rotate_head, DecodeWeights, Model};
use crate::kv::LayerKv;
use crate::quant::QVec;
use crate::{EngineError, Result};
use candle_core::Tensor;
use ndarray::{ArrayView2, ArrayViewMut2};
use rayon::prelude::*;

/// One sequence of a batched decode step: the token to run at RoPE position `pos` against
/// `caches` (one per layer; see [`Model::decode_step`] for `pos`).
pub struct BatchSeq<'a> {
    pub token: u32,
    pub pos: usize,
    pub caches: &'a mut [Box<dyn LayerKv>],
}

impl Model {
    /// One decode step for every sequence of `batch` on the quantized weights
    /// ([`crate::DecodeWeights::Quantized`]). Returns each sequence's logits or its own error: a
    /// bad token or a cache error fails that sequence only (its caches may then hold this step's
    /// K/V in some layers; the caller drops them), the others go on.
    pub fn decode_batch(&self, batch: &mut [BatchSeq<'_>]) -> Vec<Result<Vec<f32>>> {
        let c = &self.cfg;
        let mut errors: Vec<Option<EngineError>> = batch
            .iter()
            .map(|s| {
                if s.caches.len() != c.n_layers {
                    Some(EngineError::Invalid(format!(
                        "{} caches for {} layers",
                        s.caches.len(),
                        c.n_layers
                    )))
                } else if s.token as usize >= c.vocab {
                    Some(EngineError::Invalid(format!(
                        "token id {} >= vocab {}",
                        s.token, c.vocab
                    )))
                } else {
                    None
                }
            })
            .collect();
        // residual streams [n, hidden]; a failed sequence runs token 0 (its rows are discarded)
        let tokens: Vec<u32> = batch
            .iter()
            .zip(&errors)
            .map(|(s, e)| if e.is_some() { 0 } else { s.token })
            .collect();
        let mut xs = match self
            .embed_tokens(&tokens)
            .and_then(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?))
        {
            Ok(v) => v,
            Err(err) => {
                let msg = err.to_string();
                return batch
                    .iter()
                    .map(|_| Err(EngineError::Invalid(format!("embedding: {msg}"))))
                    .collect();
            }
        };
        match self.decode_batch_layers(batch, &mut errors, &mut xs) {
            Ok(logits) => errors
                .into_iter()
                .zip(logits.chunks_exact(c.vocab))
                .map(|(e, l)| match e {
                    Some(e) => Err(e),
                    None => Ok(l.to_vec()),
                })
                .collect(),
            Err(err) => {
                let msg = err.to_string();
                batch
                    .iter()
                    .map(|_| Err(EngineError::Invalid(format!("batched product: {msg}"))))
                    .collect()
            }
        }
    }

    /// The layers and the LM head of [`Model::decode_batch`] on the residual streams `xs`
    /// (`[n, hidden]`); records per-sequence cache errors in `errors`. Returns the logits
    /// `[n, vocab]`; an error of a weight product (candle's) fails the whole step.
    fn decode_batch_layers(
        &self,
        batch: &mut [BatchSeq<'_>],
        errors: &mut [Option<EngineError>],
        xs: &mut [f32],
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let n = batch.len();
        let (qd, kvd, hd, d) = (
            c.q_heads * c.head_dim,
            c.kv_heads * c.head_dim,
            c.hidden,
            c.head_dim,
        );
        let eps = c.rms_eps as f32;
        // RoPE angles per sequence, as in the single step
        let angles: Vec<Vec<(f32, f32)>> = batch
            .iter()
            .map(|s| {
                self.inv_freq
                    .iter()
                    .map(|f| {
                        let a = s.pos as f64 * f;
                        (a.cos() as f32, a.sin() as f32)
                    })
                    .collect()
            })
            .collect();
        let rope = |v: &mut [f32], cs: &[(f32, f32)]| {
            for head in v.chunks_exact_mut(d) {
                rotate_head(head, cs, c.rope);
            }
        };
        let mut h = vec![0f32; n * hd];
        let mut xq: Vec<QVec> = vec![QVec::default(); n];
        let mut qkv = vec![0f32; n * (qd + 2 * kvd)];
        let mut tmp = vec![0f32; n * hd];
        let mut gu = vec![0f32; n * 2 * c.ffn];
        let mut act = vec![0f32; n * c.ffn];
        let mut att = vec![0f32; n * qd];
        // rms_norm of every row of `xs` into `h`, each row quantized into `xq`
        let norm = |xs: &[f32], w: &[f32], h: &mut [f32], xq: &mut [QVec]| {
            for ((x, h), q) in xs.chunks_exact(hd).zip(h.chunks_exact_mut(hd)).zip(xq) {
                rms_norm_into(x, w, eps, h);
                q.quantize(h);
            }
        };
        for (layer, l) in self.layers.iter().enumerate() {
            let ql = &l.q;
            norm(xs, &ql.attn_norm, &mut h, &mut xq);
            ql.wqkv.matmul_batch(&h, &xq, &mut qkv)?;
            if let Some(b) = &ql.bqkv {
                for row in qkv.chunks_exact_mut(qd + 2 * kvd) {
                    row.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                }
            }
            // append + attend of every sequence in one parallel pass
            let results: Vec<std::result::Result<(), String>> = batch
                .par_iter_mut()
                .zip(qkv.par_chunks_mut(qd + 2 * kvd))
                .zip(att.par_chunks_mut(qd))
                .zip(angles.par_iter())
                .zip(errors.par_iter())
                .map(|((((s, row), out), cs), err)| {
                    if err.is_some() {
                        return Ok(());
                    }
                    let (q, rest) = row.split_at_mut(qd);
                    let (k, v) = rest.split_at_mut(kvd);
                    rope(q, cs);
                    rope(k, cs);
                    let kv_shape = (c.kv_heads, d);
                    let cache = &mut s.caches[layer];
                    cache.append(
                        ArrayView2::from_shape(kv_shape, k).expect("shape"),
                        ArrayView2::from_shape(kv_shape, v).expect("shape"),
                    )?;
                    cache.attend(
                        ArrayView2::from_shape((c.q_heads, d), q).expect("shape"),
                        ArrayViewMut2::from_shape((c.q_heads, d), out).expect("shape"),
                    )
                })
                .collect();
            for (e, r) in errors.iter_mut().zip(results) {
                if let (None, Err(message)) = (&e, r) {
                    *e = Some(EngineError::Cache { layer, message });
                }
            }
            for (q, o) in xq.iter_mut().zip(att.chunks_exact(qd)) {
                q.quantize(o);
            }
            ql.wo.matmul_batch(&att, &xq, &mut tmp)?;
            xs.iter_mut().zip(&tmp).for_each(|(a, b)| *a += b);
            norm(xs, &ql.ffn_norm, &mut h, &mut xq);
            ql.w_gate_up.matmul_batch(&h, &xq, &mut gu)?;
            for ((q, g_u), a) in xq
                .iter_mut()
                .zip(gu.chunks_exact(2 * c.ffn))
                .zip(act.chunks_exact_mut(c.ffn))
            {
                let (g, u) = g_u.split_at(c.ffn);
                for ((a, &gv), &uv) in a.iter_mut().zip(g).zip(u) {
                    *a = gv / (1.0 + (-gv).exp()) * uv;
                }
                q.quantize(a);
            }
            ql.w_down.matmul_batch(&act, &xq, &mut tmp)?;
            xs.iter_mut().zip(&tmp).for_each(|(a, b)| *a += b);
        }
        norm(xs, &self.out_norm_v, &mut h, &mut xq);
        let mut logits = vec![0f32; n * c.vocab];
        self.q_lm_head.matmul_batch(&h, &xq, &mut logits)?;
        Ok(logits)
    }
}

/// A prompt being prefilled in chunks ([`Model::prefill_chunk`]): every layer's post-RoPE K/V
/// so far, `[tokens, kv_heads, head_dim]` flat.
#[derive(Debug, Clone, Default)]
pub struct ChunkedPrefill {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
}

impl ChunkedPrefill {
    /// Prompt tokens prefilled so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Host bytes of the f32 K/V it holds (not cache bytes: the caches get the prompt in
    /// [`ChunkedPrefill::fill`]).
    pub fn host_bytes(&self) -> usize {
        self.keys
            .iter()
            .chain(&self.values)
            .map(|v| v.len() * 4)
            .sum()
    }

    /// Hands the whole prompt's K/V to the caches (each layer's `prefill`, so a MosaicKV cache
    /// cuts its prompt segments exactly as SPEC.md section 10.1 does for an unchunked prompt).
    pub fn fill(&self, model: &Model, caches: &mut [Box<dyn LayerKv>]) -> Result<()> {
        let c = &model.cfg;
        if caches.len() != c.n_layers || self.keys.len() != c.n_layers {
            return Err(EngineError::Invalid(format!(
                "{} caches, {} prefilled layers for {} layers",
                caches.len(),
                self.keys.len(),
                c.n_layers
            )));
        }
        for (layer, cache) in caches.iter_mut().enumerate() {
            self.fill_layer(model, layer, cache.as_mut())?;
        }
        Ok(())
    }

    /// [`ChunkedPrefill::fill`] for one layer: hands layer `layer`'s prompt K/V to `cache`
    /// (a caller can spread a MosaicKV prompt's compression over several turns this way).
    pub fn fill_layer(&self, model: &Model, layer: usize, cache: &mut dyn LayerKv) -> Result<()> {
        let c = &model.cfg;
        if layer >= self.keys.len() {
            return Err(EngineError::Invalid(format!(
                "layer {layer} of {} prefilled layers",
                self.keys.len()
            )));
        }
        let shape = (self.len, c.kv_heads, c.head_dim);
        let k = ndarray::ArrayView3::from_shape(shape, &self.keys[layer])
            .map_err(|e| EngineError::Invalid(format!("prefilled keys of layer {layer}: {e}")))?;
        let v = ndarray::ArrayView3::from_shape(shape, &self.values[layer])
            .map_err(|e| EngineError::Invalid(format!("prefilled values of layer {layer}: {e}")))?;
        cache
            .prefill(k, v)
            .map_err(|message| EngineError::Cache { layer, message })
    }
}

impl Model {
    /// Prefills the next `tokens` of a prompt whose earlier tokens are in `state` (issue 16: a
    /// long prompt runs in bounded chunks between decode steps). Same f32 layer blocks as
    /// [`Model::prefill`]; the chunk's queries attend every earlier prompt token and the
    /// chunk's own causally, with the whole prefill's blocked online softmax
    /// (`causal_attention_at` at the chunk's offset: key blocks of 1,024, so no
    /// `chunk x tokens` score matrix is formed). Returns the logits at the chunk's last token.
    /// The layer products run on the chunk's rows instead of the whole prompt's (and
    /// [`Model::prefill_weights`] of the chunk's length picks their arithmetic), so logits
    /// agree with [`Model::prefill`]'s to rounding, not bit for bit.
    pub fn prefill_chunk(&self, state: &mut ChunkedPrefill, tokens: &[u32]) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let n = tokens.len();
        if n == 0 {
            return Err(EngineError::Invalid("empty prompt chunk".into()));
        }
        let (a, total) = (state.len, state.len + n);
        if total > c.context_length {
            return Err(EngineError::Invalid(format!(
                "{total} tokens exceed the context length {}",
                c.context_length
            )));
        }
        if state.keys.is_empty() {
            state.keys = vec![Vec::new(); c.n_layers];
            state.values = vec![Vec::new(); c.n_layers];
        }
        let (qd, kvd, d) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim, c.head_dim);
        // query rows per parallel attention task: about two tasks per thread (a 256-token
        // chunk on 2 threads: 4 tasks of 64 rows), at most the whole prefill's
        let q_chunk = n
            .div_ceil(2 * rayon::current_num_threads())
            .clamp(16, super::prefill::Q_CHUNK);
        let mut x = self.embed_tokens(tokens)?;
        let weights = self.prefill_weights(n);
        for (li, l) in self.layers.iter().enumerate() {
            let h = self.rms(&x, &l.attn_norm)?;
            let mut qkv = self.matmul_t(&h, &l.wqkv, &l.q.wqkv, weights)?;
            if let Some(b) = &l.bqkv {
                qkv = qkv.broadcast_add(b)?;
            }
            let take = |off: usize, len: usize| -> Result<Vec<f32>> {
                Ok(qkv
                    .narrow(1, off, len)?
                    .contiguous()?
                    .flatten_all()?
                    .to_vec1::<f32>()?)
            };
            let (mut q, mut k, v) = (take(0, qd)?, take(qd, kvd)?, take(qd + kvd, kvd)?);
            self.rope(&mut q, c.q_heads, a);
            self.rope(&mut k, c.kv_heads, a);
            state.keys[li].extend_from_slice(&k);
            state.values[li].extend_from_slice(&v);
            let kt = Tensor::from_slice(&state.keys[li], (total, c.kv_heads, d), &self.dev)?
                .transpose(0, 1)?
                .contiguous()?;
            let vt = Tensor::from_slice(&state.values[li], (total, c.kv_heads, d), &self.dev)?
                .transpose(0, 1)?
                .contiguous()?;
            let qt = Tensor::from_vec(q, (n, c.q_heads, d), &self.dev)?
                .transpose(0, 1)?
                .contiguous()?;
            let attn = if weights == DecodeWeights::Bf16 {
                self.causal_attention_bf16(&qt, &kt, &vt, a, q_chunk)?
            } else {
                self.causal_attention_at(&qt, &kt, &vt, a, q_chunk)?
            };
            x = (x + self.matmul_t(&attn, &l.wo, &l.q.wo, weights)?)?;
            x = (&x + self.mlp(l, &x, weights)?)?;
        }
        state.len = total;
        self.logits(&x.narrow(0, n - 1, 1)?)
    }
}
