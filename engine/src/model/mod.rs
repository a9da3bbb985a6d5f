//! Owned forward pass for the `llama` (SmolLM2) and `qwen2` (Qwen2.5) GGUF architectures on
//! candle's CPU tensors.
//!
//! * `load.rs`: reading the GGUF (metadata per architecture into one [`Config`]; weights).
//! * `weights.rs`: f32 weights for prefill, resident or dequantized on use; the embedding.
//! * `prefill.rs`: the dense f32 prefill with chunked causal attention.
//! * `decode.rs`: one-token decode steps, on the quantized weights or on the f32 ones.
//!
//! This file holds the model's types, the f32 layer blocks that prefill and the f32 decode
//! share (RoPE, RMS norm, MLP, LM head) and greedy generation.

mod batch;
mod decode;
mod load;
mod prefill;
mod weights;

pub use batch::{BatchSeq, ChunkedPrefill};
pub use decode::DecodeWeights;
pub use prefill::{Prefill, STATS_SAMPLE};

use crate::kv::{FullKv, LayerKv};
use crate::quant::{QMatrix, QVec, RowStack};
use crate::tokenizer::Tok;
use crate::{EngineError, Result};
use candle_core::{Device, Tensor};
use mosaickv_optimized::simd::amx;
use rayon::prelude::*;
use weights::{Dense, Embedding};

/// Tokens per quantized many-token product call (see `Model::matmul_t`).
const GEMM_TOKENS: usize = 64;
/// Longest prompt (or prefill chunk) that a model without resident f32 weights multiplies on
/// its blocks ([`Model::prefill_weights`]): measured on Qwen2.5-1.5B (2 threads, loaded
/// machine), both paths cost the same at about 160-200 tokens.
pub const QUANTIZED_PREFILL_TOKENS: usize = 128;
/// Prompts (or prefill chunks) longer than this multiply in bf16 on AMX tiles where the CPU
/// has AMX-BF16 ([`Model::prefill_weights`], [`DecodeWeights::Bf16`]): the long-context
/// regime (issue 36), where the prefill took most of an evaluation's time. Shorter ones, and
/// the default suites at 1K-4K tokens, keep the f32 products on every CPU.
pub const AMX_PREFILL_TOKENS: usize = 4096;

/// The architectures the engine runs (`general.architecture`), and what differs between them.
/// Everything the forward pass needs to know about the architecture is copied into
/// [`Config`] at load (RoPE pairing, biases), so the forward pass never asks which one it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// `llama` (SmolLM2): no biases, interleaved RoPE pairs.
    Llama,
    /// `qwen2` (Qwen2.5): QKV biases, NEOX RoPE pairs.
    Qwen2,
}

impl Arch {
    pub const ALL: [Arch; 2] = [Arch::Llama, Arch::Qwen2];

    /// The `general.architecture` value, also the prefix of its metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
        }
    }

    pub fn from_name(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }

    /// llama.cpp's rope type for the architecture (`llama_model_rope_type`): `llama` GGUFs
    /// have their Q/K rows permuted by the converter so that adjacent pairs rotate together;
    /// `qwen2` GGUFs keep the Hugging Face layout, whose pairs are `(i, i + d/2)`.
    pub fn rope(self) -> RopeStyle {
        match self {
            Arch::Llama => RopeStyle::Interleaved,
            Arch::Qwen2 => RopeStyle::Neox,
        }
    }

    /// Whether every layer must carry Q/K/V biases (`qwen2` does; `llama` may).
    pub fn requires_qkv_bias(self) -> bool {
        matches!(self, Arch::Qwen2)
    }
}

/// Which dimensions of a head RoPE rotates together with frequency `theta^(-2i/d)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// `(2i, 2i + 1)` (GPT-J; llama.cpp's "norm" rope).
    Interleaved,
    /// `(i, i + d/2)` (GPT-NeoX; llama.cpp's "neox" rope).
    Neox,
}

/// Rotates one head in place: pair `i` by the angle whose `(cos, sin)` is `cs[i]`.
#[inline]
pub(crate) fn rotate_head(h: &mut [f32], cs: &[(f32, f32)], style: RopeStyle) {
    let half = h.len() / 2;
    for (i, &(c, s)) in cs.iter().enumerate() {
        let (a, b) = match style {
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
            RopeStyle::Neox => (i, i + half),
        };
        let (x0, x1) = (h[a], h[b]);
        h[a] = x0 * c - x1 * s;
        h[b] = x0 * s + x1 * c;
    }
}

/// Model hyper-parameters and architecture rules, read from the GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub arch: Arch,
    pub n_layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rope_theta: f64,
    pub rope: RopeStyle,
    pub rms_eps: f64,
    pub context_length: usize,
    /// True when the GGUF has no `output.weight` and the LM head reuses `token_embd`.
    pub tied_embeddings: bool,
    /// True when every layer has `attn_q/k/v.bias`, added after the Q/K/V projections.
    pub qkv_bias: bool,
}

struct Layer {
    attn_norm: Tensor,
    /// [q_dim + 2 * kv_dim, hidden]: q, k, v weights stacked.
    wqkv: Dense,
    /// [q_dim + 2 * kv_dim]: q, k, v biases stacked, when the model has them.
    bqkv: Option<Tensor>,
    /// [hidden, q_dim]
    wo: Dense,
    ffn_norm: Tensor,
    /// [2 * ffn, hidden]: gate then up.
    w_gate_up: Dense,
    /// [hidden, ffn]
    w_down: Dense,
    /// The same weights in the GGUF's block formats, for decode steps.
    q: QLayer,
}

/// One layer's decode-step weights (see [`crate::quant`]).
struct QLayer {
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    wqkv: RowStack,
    bqkv: Option<Vec<f32>>,
    wo: RowStack,
    w_gate_up: RowStack,
    w_down: RowStack,
}

/// A GGUF model (one of the [`Arch`]itectures): its blocks for decode, its f32 weights for
/// prefill (resident or dequantized on use, see `weights.rs`).
pub struct Model {
    cfg: Config,
    /// [vocab, hidden]
    embed: Embedding,
    /// [vocab, hidden]; `token_embd` again when tied.
    lm_head: Dense,
    out_norm: Tensor,
    layers: Vec<Layer>,
    /// LM head in a block format, for decode steps.
    q_lm_head: QMatrix,
    out_norm_v: Vec<f32>,
    /// inv_freq[i] = theta^(-2i/head_dim), f64.
    inv_freq: Vec<f64>,
    tok: Tok,
    dev: Device,
}

impl Model {
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn tokenizer(&self) -> &Tok {
        &self.tok
    }

    /// Chat-templated prompt (default system message, one user turn, generation prompt).
    pub fn encode_chat(&self, prompt: &str) -> Result<Vec<u32>> {
        self.tok.encode_raw(&self.tok.chat.render(prompt))
    }

    /// Plain text (control tokens in the text are recognised; BOS only if the GGUF asks for it).
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        self.tok.encode_raw(text)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tok.decode(ids)
    }

    /// `<|im_end|>`, `<|endoftext|>`.
    pub fn eos_ids(&self) -> &[u32] {
        &self.tok.eos_ids
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.tok.eos_ids.contains(&id)
    }

    /// One empty [`FullKv`] per layer.
    pub fn new_full_caches(&self) -> Vec<Box<dyn LayerKv>> {
        (0..self.cfg.n_layers)
            .map(|_| {
                Box::new(FullKv::new(self.cfg.kv_heads, self.cfg.head_dim)) as Box<dyn LayerKv>
            })
            .collect()
    }

    /// RoPE (pairing `cfg.rope`) in place on rows of `heads * head_dim`, positions from `pos0`.
    fn rope(&self, data: &mut [f32], heads: usize, pos0: usize) {
        let d = self.cfg.head_dim;
        let row = heads * d;
        data.par_chunks_mut(row).enumerate().for_each(|(t, r)| {
            let pos = (pos0 + t) as f64;
            let cs: Vec<(f32, f32)> = self
                .inv_freq
                .iter()
                .map(|f| {
                    let a = pos * f;
                    (a.cos() as f32, a.sin() as f32)
                })
                .collect();
            for h in r.chunks_exact_mut(d) {
                rotate_head(h, &cs, self.cfg.rope);
            }
        });
    }

    fn rms(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(x, w, self.cfg.rms_eps as f32)?)
    }

    /// The weights a many-token product (prefill, chunked prefill) of `n` tokens multiplies
    /// with: the f32 values when they are resident (SmolLM2). Otherwise (Qwen2.5-1.5B) the f32
    /// path pays a fixed cost per prefill (dequantizing 1.3 G weights, stacking and packing
    /// them for the GEMM) that the blocks with 8-bit activations do not, but their products
    /// cost about twice as much per token; so prompts of at most [`QUANTIZED_PREFILL_TOKENS`]
    /// use the blocks, longer ones the f32 GEMM (docs/PERFORMANCE.md section 6). Past
    /// [`AMX_PREFILL_TOKENS`], on a CPU with AMX-BF16 (`simd::amx::amx_available`, off with
    /// `MOSAICKV_NO_AMX=1`), the GEMM runs in bf16 on AMX tiles ([`DecodeWeights::Bf16`]).
    pub fn prefill_weights(&self, n: usize) -> DecodeWeights {
        if !self.lm_head.is_resident() && n <= QUANTIZED_PREFILL_TOKENS {
            DecodeWeights::Quantized
        } else if n > AMX_PREFILL_TOKENS && amx::amx_available() {
            DecodeWeights::Bf16
        } else {
            DecodeWeights::F32
        }
    }

    /// `x [n, cols]` times the transposed weight (`w` f32 and `q` the same matrix's blocks):
    /// `F32` through candle's f32 GEMM on `w` (dequantized on use when not resident);
    /// `Quantized`: each row of `x` quantized once ([`QVec::quantize`]), then the blocks' row
    /// kernels for every token ([`RowStack::matmul_batch`], [`GEMM_TOKENS`] tokens per call so
    /// that their activations stay in cache while each weight row is read).
    fn matmul_t(
        &self,
        x: &Tensor,
        w: &Dense,
        q: &RowStack,
        weights: DecodeWeights,
    ) -> Result<Tensor> {
        match weights {
            DecodeWeights::F32 => Ok(x.matmul(&w.tensor()?.t()?)?),
            DecodeWeights::Bf16 => {
                let n = x.dims2()?.0;
                let packed = w.pack_bf16()?;
                let rows = packed.rows();
                let mut out = vec![0f32; n * rows];
                with_f32(x, |xs| amx::matmul_t_bf16(xs, n, &packed, &mut out))?;
                Ok(Tensor::from_vec(out, (n, rows), &self.dev)?)
            }
            DecodeWeights::Quantized => {
                let (n, cols) = x.dims2()?;
                let rows = q.rows();
                let xs = x.flatten_all()?.to_vec1::<f32>()?;
                let mut out = vec![0f32; n * rows];
                let mut xq: Vec<QVec> = Vec::new();
                for (xc, oc) in xs
                    .chunks(GEMM_TOKENS * cols)
                    .zip(out.chunks_mut(GEMM_TOKENS * rows))
                {
                    xq.resize(xc.len() / cols, QVec::default());
                    xq.par_iter_mut()
                        .zip(xc.par_chunks(cols))
                        .for_each(|(q, x)| q.quantize(x));
                    q.matmul_batch(xc, &xq, oc)?;
                }
                Ok(Tensor::from_vec(out, (n, rows), &self.dev)?)
            }
        }
    }

    fn mlp(&self, l: &Layer, x: &Tensor, weights: DecodeWeights) -> Result<Tensor> {
        let h = self.rms(x, &l.ffn_norm)?;
        let gu = self.matmul_t(&h, &l.w_gate_up, &l.q.w_gate_up, weights)?;
        let f = self.cfg.ffn;
        let n = gu.dims2()?.0;
        // silu(gate) * up, row by row on all threads: candle's `silu` and `*` (the same f32
        // operations, `x / (1 + exp(-x)) * u`, so the same bits) run on one thread and
        // allocate two tensors of `n x ffn` (at 16K tokens, 0.6 GB each, per layer)
        let mut act = vec![0f32; n * f];
        with_f32(&gu, |g| {
            act.par_chunks_mut(f)
                .zip(g.par_chunks(2 * f))
                .for_each(|(a, row)| {
                    let (gate, up) = row.split_at(f);
                    for ((o, &x), &u) in a.iter_mut().zip(gate).zip(up) {
                        *o = x / (1.0 + (-x).exp()) * u;
                    }
                })
        })?;
        drop(gu);
        let act = Tensor::from_vec(act, (n, f), &self.dev)?;
        self.matmul_t(&act, &l.w_down, &l.q.w_down, weights)
    }

    /// Logits of one hidden state `[1, hidden]`: with the f32 LM head when it is resident, else
    /// with its blocks (one row does not pay for dequantizing a vocab-sized matrix).
    fn logits(&self, x_last: &Tensor) -> Result<Vec<f32>> {
        let h = self.rms(x_last, &self.out_norm)?;
        if self.lm_head.is_resident() {
            return Ok(h
                .matmul(&self.lm_head.tensor()?.t()?)?
                .flatten_all()?
                .to_vec1::<f32>()?);
        }
        let h = h.flatten_all()?.to_vec1::<f32>()?;
        let mut xq = QVec::default();
        xq.quantize(&h);
        let mut logits = vec![0f32; self.cfg.vocab];
        self.q_lm_head.matvec(&h, &xq, &mut logits)?;
        Ok(logits)
    }

    fn embed_tokens(&self, tokens: &[u32]) -> Result<Tensor> {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            return Err(EngineError::Invalid(format!(
                "token id {t} >= vocab {}",
                self.cfg.vocab
            )));
        }
        self.embed.rows(tokens)
    }

    /// Greedy generation with fresh [`FullKv`] caches: prefill, then up to `max_new` tokens,
    /// stopping after an end-of-sequence token (which is included). `on_token` sees each new id.
    pub fn generate_greedy(
        &self,
        prompt: &[u32],
        max_new: usize,
        mut on_token: impl FnMut(u32),
    ) -> Result<Vec<u32>> {
        let mut caches = self.new_full_caches();
        self.generate_greedy_with(prompt, max_new, &mut caches, &mut on_token)
    }

    /// As [`Model::generate_greedy`], with caller-provided (empty) caches.
    pub fn generate_greedy_with(
        &self,
        prompt: &[u32],
        max_new: usize,
        caches: &mut [Box<dyn LayerKv>],
        mut on_token: impl FnMut(u32),
    ) -> Result<Vec<u32>> {
        let p = self.prefill(prompt)?;
        p.fill(caches)?;
        let mut out = Vec::new();
        let mut logits = p.logits;
        let mut pos = prompt.len();
        while out.len() < max_new {
            let next = argmax(&logits);
            out.push(next);
            on_token(next);
            if self.is_eos(next) || out.len() == max_new {
                break;
            }
            logits = self.decode_step(next, pos, caches)?;
            pos += 1;
        }
        Ok(out)
    }
}

/// Index of the largest logit (lowest index on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The products of a prefill longer than [`AMX_PREFILL_TOKENS`] on this CPU: `"bf16-amx"` or
/// `"f32"` (part of the keys of stored prefills and run logs, which outlive the process).
pub fn long_prefill_products() -> &'static str {
    if amx::amx_available() {
        "bf16-amx"
    } else {
        "f32"
    }
}

/// `f` on the f32 elements of `t` in row-major order, without a copy when `t` is contiguous.
pub(super) fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    if t.is_contiguous() {
        let (storage, layout) = t.storage_and_layout();
        if let candle_core::Storage::Cpu(cpu) = &*storage {
            let all = cpu.as_slice::<f32>()?;
            let start = layout.start_offset();
            return Ok(f(&all[start..start + t.elem_count()]));
        }
    }
    let v = t.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&v))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Interleaved rotates (2i, 2i+1), NEOX (i, i + d/2), each pair by its own angle.
    #[test]
    fn rope_pairings() {
        let cs = [(0.0f32, 1.0f32), (1.0, 0.0)]; // pair 0 by 90 degrees, pair 1 not at all
        let mut h = [1.0f32, 2.0, 3.0, 4.0];
        rotate_head(&mut h, &cs, RopeStyle::Interleaved);
        assert_eq!(h, [-2.0, 1.0, 3.0, 4.0]);
        let mut h = [1.0f32, 2.0, 3.0, 4.0];
        rotate_head(&mut h, &cs, RopeStyle::Neox);
        assert_eq!(h, [-3.0, 2.0, 1.0, 4.0]);
    }
}
