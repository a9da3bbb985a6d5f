//! Owned llama forward pass for SmolLM2 on candle's CPU tensors.
//!
//! * `load.rs`: reading the GGUF (metadata; weights dequantized to f32 and kept in block form).
//! * `prefill.rs`: the dense f32 prefill with chunked causal attention.
//! * `decode.rs`: one-token decode steps, on the quantized weights or on the f32 ones.
//!
//! This file holds the model's types, the f32 layer blocks that prefill and the f32 decode
//! share (RoPE, RMS norm, MLP, LM head) and greedy generation.

mod batch;
mod decode;
mod load;
mod prefill;

pub use batch::{BatchSeq, ChunkedPrefill};
pub use decode::DecodeWeights;
pub(crate) use prefill::exp_shifted_in_place;
pub use prefill::Prefill;

use crate::kv::{FullKv, LayerKv};
use crate::quant::QMatrix;
use crate::tokenizer::Tok;
use crate::{EngineError, Result};
use candle_core::{Device, Tensor};
use rayon::prelude::*;

/// Model hyper-parameters, read from the GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub n_layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rope_theta: f64,
    pub rms_eps: f64,
    pub context_length: usize,
    /// True when the GGUF has no `output.weight` and the LM head reuses `token_embd`.
    pub tied_embeddings: bool,
}

struct Layer {
    attn_norm: Tensor,
    /// [q_dim + 2 * kv_dim, hidden]: q, k, v weights stacked.
    wqkv: Tensor,
    /// [hidden, q_dim]
    wo: Tensor,
    ffn_norm: Tensor,
    /// [2 * ffn, hidden]: gate then up.
    w_gate_up: Tensor,
    /// [hidden, ffn]
    w_down: Tensor,
    /// The same weights in the GGUF's block formats, for decode steps.
    q: QLayer,
}

/// One layer's decode-step weights (see [`crate::quant`]).
struct QLayer {
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    wqkv: QMatrix,
    wo: QMatrix,
    w_gate_up: QMatrix,
    w_down: QMatrix,
}

/// SmolLM2-135M-Instruct with weights dequantized to f32.
pub struct Model {
    cfg: Config,
    /// [vocab, hidden]
    embed: Tensor,
    /// [vocab, hidden]; the same tensor as `embed` when tied.
    lm_head: Tensor,
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

    /// Plain text (control tokens in the text are recognised; no BOS is added).
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

    /// Interleaved (GPT-J / llama.cpp "norm") RoPE in place on rows of `heads * head_dim`.
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
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (x0, x1) = (h[2 * i], h[2 * i + 1]);
                    h[2 * i] = x0 * c - x1 * s;
                    h[2 * i + 1] = x0 * s + x1 * c;
                }
            }
        });
    }

    fn rms(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(x, w, self.cfg.rms_eps as f32)?)
    }

    fn mlp(&self, l: &Layer, x: &Tensor) -> Result<Tensor> {
        let h = self.rms(x, &l.ffn_norm)?;
        let gu = h.matmul(&l.w_gate_up.t()?)?;
        let f = self.cfg.ffn;
        let gate = gu.narrow(1, 0, f)?;
        let up = gu.narrow(1, f, f)?;
        let act = (candle_nn::ops::silu(&gate)? * up)?;
        Ok(act.matmul(&l.w_down.t()?)?)
    }

    fn logits(&self, x_last: &Tensor) -> Result<Vec<f32>> {
        let h = self.rms(x_last, &self.out_norm)?;
        Ok(h.matmul(&self.lm_head.t()?)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    fn embed_tokens(&self, tokens: &[u32]) -> Result<Tensor> {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            return Err(EngineError::Invalid(format!(
                "token id {t} >= vocab {}",
                self.cfg.vocab
            )));
        }
        let ids = Tensor::from_slice(tokens, tokens.len(), &self.dev)?;
        Ok(self.embed.index_select(&ids, 0)?)
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
