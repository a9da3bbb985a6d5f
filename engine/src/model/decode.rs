//! One-token decode steps against caller-owned caches.

use super::weights::Dense;
use super::{rotate_head, Model};
use crate::kv::LayerKv;
use crate::quant::QVec;
use crate::{EngineError, Result};
use candle_core::Tensor;
use ndarray::{Array2, ArrayView2};

/// Which weights a decode step (or a prefill, [`Model::prefill_using`]) multiplies with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeWeights {
    /// The GGUF's block-quantized weights (Q4_1, Q8_0 LM head; Q4_K, Q6_K) times activations
    /// quantized to 8 bits per block (32; 256 for the k-quants), as llama.cpp computes, with
    /// this crate's kernels (`quant.rs`); reads 5x (Q4_1) to 7x (Q4_K_M) fewer bytes than f32.
    #[default]
    Quantized,
    /// The f32 weights prefill uses, f32 activations (slower, and much slower for a model whose
    /// f32 weights are dequantized on use; for checks against prefill).
    F32,
    /// Many-token products only (prefill, [`super::Model::prefill_weights`]): the f32 weights
    /// and the activations rounded to bf16, the products summed in f32 on AMX tiles
    /// (`mosaickv_optimized::simd::amx`), on CPUs with AMX-BF16. A decode step asked for it
    /// runs [`DecodeWeights::F32`].
    Bf16,
}

impl DecodeWeights {
    /// `"quantized"`, `"f32"` or `"bf16"`.
    pub fn name(self) -> &'static str {
        match self {
            DecodeWeights::Quantized => "quantized",
            DecodeWeights::F32 => "f32",
            DecodeWeights::Bf16 => "bf16",
        }
    }
}

/// `out = x / sqrt(mean(x^2) + eps) * w` (as candle's `rms_norm`).
pub(super) fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * inv * g;
    }
}

impl Model {
    /// Runs token `token` at position `pos` through all layers: appends its K/V to each layer's
    /// cache, then calls `attend`. Returns the logits. `pos` is the RoPE position (normally the
    /// number of tokens before this one); it is not checked against the caches' `len()`, so caches
    /// that drop tokens keep working. No position cap is applied (prefill refuses prompts longer
    /// than the GGUF context length, 8192 for SmolLM2 and 32768 for Qwen2.5; decode does not check).
    ///
    /// Multiplies with the quantized weights ([`DecodeWeights::Quantized`]).
    pub fn decode_step(
        &self,
        token: u32,
        pos: usize,
        caches: &mut [Box<dyn LayerKv>],
    ) -> Result<Vec<f32>> {
        self.decode_step_with(token, pos, caches, DecodeWeights::Quantized)
    }

    /// [`Model::decode_step`] with a choice of weights.
    pub fn decode_step_with(
        &self,
        token: u32,
        pos: usize,
        caches: &mut [Box<dyn LayerKv>],
        weights: DecodeWeights,
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        if caches.len() != c.n_layers {
            return Err(EngineError::Invalid(format!(
                "{} caches for {} layers",
                caches.len(),
                c.n_layers
            )));
        }
        if token as usize >= c.vocab {
            return Err(EngineError::Invalid(format!(
                "token id {token} >= vocab {}",
                c.vocab
            )));
        }
        match weights {
            DecodeWeights::Quantized => self.decode_quantized(token, pos, caches),
            DecodeWeights::F32 | DecodeWeights::Bf16 => self.decode_f32(token, pos, caches),
        }
    }

    /// Bytes of weights a decode step reads with `weights` (LM head included).
    pub fn decode_weight_bytes(&self, weights: DecodeWeights) -> usize {
        match weights {
            DecodeWeights::Quantized => {
                self.q_lm_head.bytes()
                    + self
                        .layers
                        .iter()
                        .map(|l| {
                            l.q.wqkv.bytes()
                                + l.q.wo.bytes()
                                + l.q.w_gate_up.bytes()
                                + l.q.w_down.bytes()
                        })
                        .sum::<usize>()
            }
            DecodeWeights::F32 | DecodeWeights::Bf16 => {
                let n = |t: &Dense| t.elem_count() * 4;
                n(&self.lm_head)
                    + self
                        .layers
                        .iter()
                        .map(|l| n(&l.wqkv) + n(&l.wo) + n(&l.w_gate_up) + n(&l.w_down))
                        .sum::<usize>()
            }
        }
    }

    /// Decode step on the block-quantized weights, plain slices, one scratch allocation per step.
    fn decode_quantized(
        &self,
        token: u32,
        pos: usize,
        caches: &mut [Box<dyn LayerKv>],
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (qd, kvd, hd, d) = (
            c.q_heads * c.head_dim,
            c.kv_heads * c.head_dim,
            c.hidden,
            c.head_dim,
        );
        let eps = c.rms_eps as f32;
        let mut x = self
            .embed_tokens(&[token])?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut h = vec![0f32; hd];
        let mut qkv = vec![0f32; qd + 2 * kvd];
        let mut tmp = vec![0f32; hd];
        let mut gu = vec![0f32; 2 * c.ffn];
        let mut act = vec![0f32; c.ffn];
        let mut out = Array2::<f32>::zeros((c.q_heads, d));
        let mut xq = QVec::default();
        // RoPE angles of this position, as in `rope`
        let cs: Vec<(f32, f32)> = self
            .inv_freq
            .iter()
            .map(|f| {
                let a = pos as f64 * f;
                (a.cos() as f32, a.sin() as f32)
            })
            .collect();
        let rope = |v: &mut [f32]| {
            for head in v.chunks_exact_mut(d) {
                rotate_head(head, &cs, c.rope);
            }
        };
        for (layer, (l, cache)) in self.layers.iter().zip(caches.iter_mut()).enumerate() {
            let ql = &l.q;
            rms_norm_into(&x, &ql.attn_norm, eps, &mut h);
            xq.quantize(&h);
            ql.wqkv.matvec(&h, &xq, &mut qkv)?;
            if let Some(b) = &ql.bqkv {
                qkv.iter_mut().zip(b).for_each(|(a, b)| *a += b);
            }
            let (q, rest) = qkv.split_at_mut(qd);
            let (k, v) = rest.split_at_mut(kvd);
            rope(q);
            rope(k);
            let cache_err = |message| EngineError::Cache { layer, message };
            let kv_shape = (c.kv_heads, d);
            cache
                .append(
                    ArrayView2::from_shape(kv_shape, k).expect("shape"),
                    ArrayView2::from_shape(kv_shape, v).expect("shape"),
                )
                .map_err(cache_err)?;
            cache
                .attend(
                    ArrayView2::from_shape((c.q_heads, d), q).expect("shape"),
                    out.view_mut(),
                )
                .map_err(cache_err)?;
            let o = out.as_slice().expect("standard layout");
            xq.quantize(o);
            ql.wo.matvec(o, &xq, &mut tmp)?;
            x.iter_mut().zip(&tmp).for_each(|(a, b)| *a += b);
            rms_norm_into(&x, &ql.ffn_norm, eps, &mut h);
            xq.quantize(&h);
            ql.w_gate_up.matvec(&h, &xq, &mut gu)?;
            let (g, u) = gu.split_at(c.ffn);
            for ((a, &gv), &uv) in act.iter_mut().zip(g).zip(u) {
                *a = gv / (1.0 + (-gv).exp()) * uv;
            }
            xq.quantize(&act);
            ql.w_down.matvec(&act, &xq, &mut tmp)?;
            x.iter_mut().zip(&tmp).for_each(|(a, b)| *a += b);
        }
        rms_norm_into(&x, &self.out_norm_v, eps, &mut h);
        xq.quantize(&h);
        let mut logits = vec![0f32; c.vocab];
        self.q_lm_head.matvec(&h, &xq, &mut logits)?;
        Ok(logits)
    }

    /// Decode step on the f32 weights (candle matmuls).
    fn decode_f32(
        &self,
        token: u32,
        pos: usize,
        caches: &mut [Box<dyn LayerKv>],
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (qd, kvd) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
        let mut x = self.embed_tokens(&[token])?;
        let mut out = Array2::<f32>::zeros((c.q_heads, c.head_dim));
        for (layer, (l, cache)) in self.layers.iter().zip(caches.iter_mut()).enumerate() {
            let h = self.rms(&x, &l.attn_norm)?;
            let mut qkv = self.matmul_t(&h, &l.wqkv, &l.q.wqkv, DecodeWeights::F32)?;
            if let Some(b) = &l.bqkv {
                qkv = qkv.broadcast_add(b)?;
            }
            let mut qkv = qkv.flatten_all()?.to_vec1::<f32>()?;
            let (q, rest) = qkv.split_at_mut(qd);
            let (k, v) = rest.split_at_mut(kvd);
            self.rope(q, c.q_heads, pos);
            self.rope(k, c.kv_heads, pos);
            let cache_err = |message| EngineError::Cache { layer, message };
            let kv_shape = (c.kv_heads, c.head_dim);
            cache
                .append(
                    ArrayView2::from_shape(kv_shape, k).expect("shape"),
                    ArrayView2::from_shape(kv_shape, v).expect("shape"),
                )
                .map_err(cache_err)?;
            cache
                .attend(
                    ArrayView2::from_shape((c.q_heads, c.head_dim), q).expect("shape"),
                    out.view_mut(),
                )
                .map_err(cache_err)?;
            let attn =
                Tensor::from_slice(out.as_slice().expect("standard layout"), (1, qd), &self.dev)?;
            x = (x + self.matmul_t(&attn, &l.wo, &l.q.wo, DecodeWeights::F32)?)?;
            x = (&x + self.mlp(l, &x, DecodeWeights::F32)?)?;
        }
        self.logits(&x)
    }
}
