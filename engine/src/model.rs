//! Owned llama forward pass for SmolLM2 on candle's CPU tensors.

use crate::fetch::check_gguf_file;
use crate::kv::{FullKv, LayerKv};
use crate::quant::{QMatrix, QVec};
use crate::tokenizer::Tok;
use crate::{EngineError, Result};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use ndarray::{Array2, Array3, ArrayView2};
use rayon::prelude::*;
use std::path::Path;

/// Query rows per attention chunk in prefill.
const Q_CHUNK: usize = 256;
/// Key rows per online-softmax step in prefill.
const K_CHUNK: usize = 1024;

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

/// Which weights a decode step multiplies with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeWeights {
    /// The GGUF's block-quantized weights (Q4_1, Q8_0 LM head) times activations quantized to
    /// 8 bits per block of 32, as llama.cpp computes; reads about 5x fewer bytes than f32.
    #[default]
    Quantized,
    /// The f32 weights prefill uses, f32 activations (slower; for checks against prefill).
    F32,
}

/// Result of [`Model::prefill`].
#[derive(Debug, Clone)]
pub struct Prefill {
    /// Per layer, post-RoPE keys [tokens, kv_heads, head_dim].
    pub keys: Vec<Array3<f32>>,
    /// Per layer, values [tokens, kv_heads, head_dim].
    pub values: Vec<Array3<f32>>,
    /// Logits at the last prompt position.
    pub logits: Vec<f32>,
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
            c.prefill(self.keys[layer].view(), self.values[layer].view())
                .map_err(|message| EngineError::Cache { layer, message })?;
        }
        Ok(())
    }
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

fn md_u32(c: &Content, key: &str) -> Result<usize> {
    let v = c
        .metadata
        .get(key)
        .ok_or_else(|| EngineError::Format(format!("GGUF metadata lacks {key}")))?;
    Ok(v.to_u32()
        .map_err(|e| EngineError::Format(format!("{key}: {e}")))? as usize)
}

fn md_f32(c: &Content, key: &str) -> Result<f64> {
    let v = c
        .metadata
        .get(key)
        .ok_or_else(|| EngineError::Format(format!("GGUF metadata lacks {key}")))?;
    Ok(v.to_f32()
        .map_err(|e| EngineError::Format(format!("{key}: {e}")))? as f64)
}

/// The decode-step copy of a 2-D weight: its own blocks when the GGUF stores Q4_1 or Q8_0,
/// else `f32` (its dequantized values) quantized to Q8_0.
fn to_qmatrix(q: &QTensor, f32w: &Tensor) -> Result<QMatrix> {
    let (rows, cols) = f32w.dims2()?;
    let m = match q.dtype() {
        GgmlDType::Q4_1 => QMatrix::from_q4_1_bytes(&q.data()?, rows, cols),
        GgmlDType::Q8_0 => QMatrix::from_q8_0_bytes(&q.data()?, rows, cols),
        _ => QMatrix::q8_0_from_f32(&f32w.flatten_all()?.to_vec1::<f32>()?, rows, cols),
    };
    m.ok_or_else(|| {
        EngineError::Format(format!(
            "weight {rows}x{cols} ({:?}): width not a multiple of 32 or size mismatch",
            q.dtype()
        ))
    })
}

/// `out = x / sqrt(mean(x^2) + eps) * w` (as candle's `rms_norm`).
fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * inv * g;
    }
}

impl Model {
    /// Loads a GGUF file (checked with [`check_gguf_file`]) and dequantizes every weight to f32.
    pub fn load(path: &Path) -> Result<Self> {
        let (content, file) = check_gguf_file(path)?;
        let mut reader = std::io::BufReader::new(file);
        let dev = Device::Cpu;
        let arch = content
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok().cloned())
            .unwrap_or_default();
        if arch != "llama" {
            return Err(EngineError::Format(format!(
                "architecture {arch:?}, expected llama"
            )));
        }
        let hidden = md_u32(&content, "llama.embedding_length")?;
        let q_heads = md_u32(&content, "llama.attention.head_count")?;
        let kv_heads = md_u32(&content, "llama.attention.head_count_kv")?;
        let head_dim = hidden / q_heads;
        if let Ok(rd) = md_u32(&content, "llama.rope.dimension_count") {
            if rd != head_dim {
                return Err(EngineError::Format(format!(
                    "partial RoPE ({rd} of {head_dim}) is not supported"
                )));
            }
        }
        let tied = !content.tensor_infos.contains_key("output.weight");
        let mut get_q =
            |name: &str| -> Result<QTensor> { Ok(content.tensor(&mut reader, name, &dev)?) };
        let deq = |q: &QTensor| -> Result<Tensor> { Ok(q.dequantize(&dev)?.to_dtype(DType::F32)?) };
        let qembed = get_q("token_embd.weight")?;
        let embed = deq(&qembed)?;
        let (lm_head, q_lm_head) = if tied {
            (embed.clone(), to_qmatrix(&qembed, &embed)?)
        } else {
            let q = get_q("output.weight")?;
            let f = deq(&q)?;
            let m = to_qmatrix(&q, &f)?;
            (f, m)
        };
        drop(qembed);
        let out_norm = deq(&get_q("output_norm.weight")?)?;
        let out_norm_v = out_norm.flatten_all()?.to_vec1::<f32>()?;
        let n_layers = md_u32(&content, "llama.block_count")?;
        let mut layers = Vec::with_capacity(n_layers);
        for i in 0..n_layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let mut mat = |s: &str| -> Result<(Tensor, QMatrix)> {
                let q = get_q(&p(s))?;
                let f = deq(&q)?;
                let m = to_qmatrix(&q, &f)?;
                Ok((f, m))
            };
            let (wq, qq) = mat("attn_q")?;
            let (wk, qk) = mat("attn_k")?;
            let (wv, qv) = mat("attn_v")?;
            let (wo, qo) = mat("attn_output")?;
            let (wg, qg) = mat("ffn_gate")?;
            let (wu, qu) = mat("ffn_up")?;
            let (wd, qd) = mat("ffn_down")?;
            let attn_norm = deq(&get_q(&p("attn_norm"))?)?;
            let ffn_norm = deq(&get_q(&p("ffn_norm"))?)?;
            let stack = |parts: Vec<QMatrix>| {
                QMatrix::vstack(parts).ok_or_else(|| {
                    EngineError::Format(format!(
                        "blk.{i}: weights to stack differ in format or width"
                    ))
                })
            };
            let q = QLayer {
                attn_norm: attn_norm.flatten_all()?.to_vec1::<f32>()?,
                ffn_norm: ffn_norm.flatten_all()?.to_vec1::<f32>()?,
                wqkv: stack(vec![qq, qk, qv])?,
                wo: qo,
                w_gate_up: stack(vec![qg, qu])?,
                w_down: qd,
            };
            layers.push(Layer {
                attn_norm,
                wqkv: Tensor::cat(&[&wq, &wk, &wv], 0)?.contiguous()?,
                wo: wo.contiguous()?,
                ffn_norm,
                w_gate_up: Tensor::cat(&[&wg, &wu], 0)?.contiguous()?,
                w_down: wd.contiguous()?,
                q,
            });
        }

        let (vocab, h2) = embed.dims2()?;
        let ffn = md_u32(&content, "llama.feed_forward_length")?;
        let l0 = &layers[0];
        let qkv_rows = l0.wqkv.dims2()?.0;
        let q_shapes_ok = layers.iter().all(|l| {
            let q = &l.q;
            (q.wqkv.rows(), q.wqkv.cols()) == (qkv_rows, hidden)
                && (q.wo.rows(), q.wo.cols()) == (hidden, q_heads * head_dim)
                && (q.w_gate_up.rows(), q.w_gate_up.cols()) == (2 * ffn, hidden)
                && (q.w_down.rows(), q.w_down.cols()) == (hidden, ffn)
                && q.attn_norm.len() == hidden
                && q.ffn_norm.len() == hidden
        }) && (q_lm_head.rows(), q_lm_head.cols()) == (vocab, hidden)
            && out_norm_v.len() == hidden;
        if h2 != hidden
            || qkv_rows != (q_heads + 2 * kv_heads) * head_dim
            || l0.w_gate_up.dims2()? != (2 * ffn, hidden)
            || !q_shapes_ok
        {
            return Err(EngineError::Format(
                "tensor shapes do not match the metadata".into(),
            ));
        }
        let cfg = Config {
            n_layers,
            hidden,
            ffn,
            q_heads,
            kv_heads,
            head_dim,
            vocab,
            rope_theta: md_f32(&content, "llama.rope.freq_base").unwrap_or(10000.0),
            rms_eps: md_f32(&content, "llama.attention.layer_norm_rms_epsilon")?,
            context_length: md_u32(&content, "llama.context_length").unwrap_or(2048),
            tied_embeddings: tied,
        };
        let inv_freq = (0..head_dim / 2)
            .map(|i| cfg.rope_theta.powf(-2.0 * i as f64 / head_dim as f64))
            .collect();
        let tok = Tok::from_gguf(&content)?;
        Ok(Self {
            cfg,
            embed,
            lm_head,
            out_norm,
            layers,
            q_lm_head,
            out_norm_v,
            inv_freq,
            tok,
            dev,
        })
    }

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

    /// Dense prefill of a prompt. Attention is causal and chunked: queries in blocks of 256
    /// rows, keys in blocks of 1024 with an online softmax, so no n x n matrix is formed.
    pub fn prefill(&self, tokens: &[u32]) -> Result<Prefill> {
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
        let mut attn_time = std::time::Duration::ZERO;
        let t_all = std::time::Instant::now();
        for l in &self.layers {
            let h = self.rms(&x, &l.attn_norm)?;
            let qkv = h.matmul(&l.wqkv.t()?)?;
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
            x = (x + attn.matmul(&l.wo.t()?)?)?;
            x = (&x + self.mlp(l, &x)?)?;
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
        })
    }

    /// q: [q_heads, n, d], k/v: [kv_heads, n, d] (contiguous). Returns [n, q_heads * d].
    fn causal_attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let c = &self.cfg;
        let (_, n, d) = q.dims3()?;
        let group = c.q_heads / c.kv_heads;
        let scale = 1.0 / (d as f64).sqrt();
        let starts: Vec<usize> = (0..n).step_by(Q_CHUNK).collect();
        let outs: Vec<Tensor> = starts
            .par_iter()
            .map(|&a| -> Result<Tensor> {
                let qc = Q_CHUNK.min(n - a);
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
                let end = a + qc; // keys 0..end are visible to some query of the chunk
                for k0 in (0..end).step_by(K_CHUNK) {
                    let kl = K_CHUNK.min(end - k0);
                    let kc = k.narrow(1, k0, kl)?;
                    let vc = v.narrow(1, k0, kl)?;
                    let mut p = qg.matmul(&kc.t()?)?.flatten_all()?.to_vec1::<f32>()?;
                    let mut corr = vec![0f32; rows];
                    // fused causal mask + online softmax update, one row at a time
                    for (r, row) in p.chunks_exact_mut(kl).enumerate() {
                        let pos = a + r % qc;
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

    /// Runs token `token` at position `pos` through all layers: appends its K/V to each layer's
    /// cache, then calls `attend`. Returns the logits. `pos` is the RoPE position (normally the
    /// number of tokens before this one); it is not checked against the caches' `len()`, so caches
    /// that drop tokens keep working. No position cap is applied (prefill refuses prompts longer
    /// than the GGUF context length, 8192; decode does not check).
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
            DecodeWeights::F32 => self.decode_f32(token, pos, caches),
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
            DecodeWeights::F32 => {
                let n = |t: &Tensor| t.elem_count() * 4;
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
            .embed
            .narrow(0, token as usize, 1)?
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
                for (i, &(co, si)) in cs.iter().enumerate() {
                    let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = x0 * co - x1 * si;
                    head[2 * i + 1] = x0 * si + x1 * co;
                }
            }
        };
        for (layer, (l, cache)) in self.layers.iter().zip(caches.iter_mut()).enumerate() {
            let ql = &l.q;
            rms_norm_into(&x, &ql.attn_norm, eps, &mut h);
            xq.quantize(&h);
            ql.wqkv.matvec(&xq, &mut qkv);
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
            xq.quantize(out.as_slice().expect("standard layout"));
            ql.wo.matvec(&xq, &mut tmp);
            x.iter_mut().zip(&tmp).for_each(|(a, b)| *a += b);
            rms_norm_into(&x, &ql.ffn_norm, eps, &mut h);
            xq.quantize(&h);
            ql.w_gate_up.matvec(&xq, &mut gu);
            let (g, u) = gu.split_at(c.ffn);
            for ((a, &gv), &uv) in act.iter_mut().zip(g).zip(u) {
                *a = gv / (1.0 + (-gv).exp()) * uv;
            }
            xq.quantize(&act);
            ql.w_down.matvec(&xq, &mut tmp);
            x.iter_mut().zip(&tmp).for_each(|(a, b)| *a += b);
        }
        rms_norm_into(&x, &self.out_norm_v, eps, &mut h);
        xq.quantize(&h);
        let mut logits = vec![0f32; c.vocab];
        self.q_lm_head.matvec(&xq, &mut logits);
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
            let mut qkv = h.matmul(&l.wqkv.t()?)?.flatten_all()?.to_vec1::<f32>()?;
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
            x = (x + attn.matmul(&l.wo.t()?)?)?;
            x = (&x + self.mlp(l, &x)?)?;
        }
        self.logits(&x)
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

/// `x <- exp(x - shift)` for a slice whose entries are <= shift (softmax numerators).
///
/// Branch-free Cephes-style expf (range reduction by ln 2, degree-6 polynomial, exponent bits
/// assembled directly), so the loop vectorizes; relative error about 2e-7, like libm's expf.
#[inline(always)]
pub(crate) fn exp_shifted_in_place(xs: &mut [f32], shift: f32) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    for x in xs.iter_mut() {
        let v = (*x - shift).max(-87.0);
        let n = (v * LOG2E + ROUND) - ROUND;
        let r = v - n * LN2_HI - n * LN2_LO;
        let mut p = 1.987_569_1e-4f32;
        p = p * r + 1.398_199_9e-3;
        p = p * r + 8.333_452e-3;
        p = p * r + 4.166_579_6e-2;
        p = p * r + 1.666_666_5e-1;
        p = p * r + 5e-1;
        let e = p * r * r + r + 1.0;
        let bits = ((n as i32 + 127) as u32) << 23;
        *x = e * f32::from_bits(bits);
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
