//! Loading a GGUF file into a [`Model`]: the configuration and every tensor's shape are checked
//! against the header ([`Config::from_gguf`]) before any weight is read.

use super::weights::{Dense, Embedding, RESIDENT_F32_LIMIT};
use super::{Arch, Config, Layer, Model, QLayer};
use crate::fetch::check_gguf_file;
use crate::quant::{QMatrix, RowStack};
use crate::tokenizer::Tok;
use crate::{EngineError, Result};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use std::path::Path;
use std::sync::Arc;

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

fn bad<T>(message: String) -> Result<T> {
    Err(EngineError::Format(message))
}

/// The per-layer weight matrices, by GGUF name, with their `[rows, cols]` for a configuration.
fn layer_matrices(c: &Config) -> [(&'static str, [usize; 2]); 7] {
    let (q, kv) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
    [
        ("attn_q", [q, c.hidden]),
        ("attn_k", [kv, c.hidden]),
        ("attn_v", [kv, c.hidden]),
        ("attn_output", [c.hidden, q]),
        ("ffn_gate", [c.ffn, c.hidden]),
        ("ffn_up", [c.ffn, c.hidden]),
        ("ffn_down", [c.hidden, c.ffn]),
    ]
}

impl Config {
    /// The hyper-parameters a GGUF header states for one of the [`Arch`]itectures (keys prefixed
    /// with `general.architecture`), checked against each other (every count positive, whole
    /// heads, a whole query group per KV head, an even head_dim for RoPE's pairs, full RoPE) and
    /// against the shape of every tensor the model reads, for each of `{arch}.block_count`
    /// layers. head_dim is `{arch}.attention.key_length` when the file states it, else
    /// `embedding_length / head_count`. Reads no tensor data, so nothing is allocated from a
    /// count in the file before the tensors it implies are known to exist.
    pub fn from_gguf(content: &Content) -> Result<Config> {
        let arch_name = content
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok().cloned())
            .unwrap_or_default();
        let arch = Arch::from_name(&arch_name).ok_or_else(|| {
            EngineError::Format(format!(
                "architecture {arch_name:?}, expected one of {:?}",
                Arch::ALL.map(|a| a.name())
            ))
        })?;
        let a = arch.name();
        let key = |k: &str| format!("{a}.{k}");
        let hidden = md_u32(content, &key("embedding_length"))?;
        let ffn = md_u32(content, &key("feed_forward_length"))?;
        let q_heads = md_u32(content, &key("attention.head_count"))?;
        let kv_heads = md_u32(content, &key("attention.head_count_kv"))?;
        let n_layers = md_u32(content, &key("block_count"))?;
        if hidden == 0 || ffn == 0 {
            return bad(format!(
                "{a}.embedding_length {hidden} and {a}.feed_forward_length {ffn} must be positive"
            ));
        }
        let head_dim = match content.metadata.get(&key("attention.key_length")) {
            Some(_) => {
                let kl = md_u32(content, &key("attention.key_length"))?;
                if let Ok(vl) = md_u32(content, &key("attention.value_length")) {
                    if vl != kl {
                        return bad(format!(
                            "{a}.attention.value_length {vl} differs from key_length {kl}"
                        ));
                    }
                }
                if q_heads == 0 || kl == 0 {
                    return bad(format!(
                        "{a}.attention.head_count {q_heads} and key_length {kl} must be positive"
                    ));
                }
                kl
            }
            None => {
                if q_heads == 0 || hidden % q_heads != 0 {
                    return bad(format!(
                        "{a}.attention.head_count {q_heads} must divide {a}.embedding_length {hidden}"
                    ));
                }
                hidden / q_heads
            }
        };
        if kv_heads == 0 || q_heads % kv_heads != 0 {
            return bad(format!(
                "{a}.attention.head_count_kv {kv_heads} must divide {a}.attention.head_count {q_heads}"
            ));
        }
        if let Ok(rd) = md_u32(content, &key("rope.dimension_count")) {
            if rd != head_dim {
                return bad(format!(
                    "partial RoPE ({rd} of {head_dim}) is not supported"
                ));
            }
        }
        if head_dim % 2 != 0 {
            return bad(format!("head_dim {head_dim} is odd (RoPE rotates pairs)"));
        }
        if n_layers == 0 {
            return bad(format!("{a}.block_count is 0"));
        }
        let shape = |name: &str| -> Result<&[usize]> {
            content
                .tensor_infos
                .get(name)
                .map(|t| t.shape.dims())
                .ok_or_else(|| {
                    EngineError::Format(format!(
                        "GGUF lacks tensor {name} ({a}.block_count {n_layers})"
                    ))
                })
        };
        let vocab = match shape("token_embd.weight")? {
            &[v, h] if v > 0 && h == hidden => v,
            s => {
                return bad(format!(
                    "token_embd.weight has shape {s:?}, expected [vocab, {hidden}]"
                ))
            }
        };
        let qkv_bias = content.tensor_infos.contains_key("blk.0.attn_q.bias");
        if arch.requires_qkv_bias() && !qkv_bias {
            return bad(format!("{a} GGUF lacks blk.0.attn_q.bias (QKV biases)"));
        }
        // Numbers the forward pass divides by or raises to a power: a NaN, infinite, zero or
        // negative one (a damaged or crafted file) would give garbage text, so it is refused.
        let rope_theta = md_f32(content, &key("rope.freq_base")).unwrap_or(10000.0);
        if !(rope_theta.is_finite() && rope_theta > 0.0) {
            return bad(format!(
                "{a}.rope.freq_base is {rope_theta}: it must be finite and positive"
            ));
        }
        let rms_eps = md_f32(content, &key("attention.layer_norm_rms_epsilon"))?;
        if !(rms_eps.is_finite() && rms_eps > 0.0) {
            return bad(format!(
                "{a}.attention.layer_norm_rms_epsilon is {rms_eps}: it must be finite and positive"
            ));
        }
        let context_length = md_u32(content, &key("context_length")).unwrap_or(2048);
        if context_length == 0 {
            return bad(format!("{a}.context_length is 0"));
        }
        let cfg = Config {
            arch,
            n_layers,
            hidden,
            ffn,
            q_heads,
            kv_heads,
            head_dim,
            vocab,
            rope_theta,
            rope: arch.rope(),
            rms_eps,
            context_length,
            tied_embeddings: !content.tensor_infos.contains_key("output.weight"),
            qkv_bias,
        };
        let expect = |name: &str, want: &[usize]| -> Result<()> {
            let got = shape(name)?;
            if got != want {
                return bad(format!(
                    "tensor {name} has shape {got:?}, the metadata implies {want:?}"
                ));
            }
            Ok(())
        };
        // norms and biases: any layout of `n` values (they are read flattened)
        let expect_len = |name: &str, n: usize| -> Result<()> {
            let got = shape(name)?;
            if got.iter().product::<usize>() != n {
                return bad(format!(
                    "tensor {name} has shape {got:?}, expected {n} values"
                ));
            }
            Ok(())
        };
        if !cfg.tied_embeddings {
            expect("output.weight", &[vocab, hidden])?;
        }
        expect_len("output_norm.weight", hidden)?;
        let (qd, kvd) = (q_heads * head_dim, kv_heads * head_dim);
        for i in 0..n_layers {
            for (m, dims) in layer_matrices(&cfg) {
                expect(&format!("blk.{i}.{m}.weight"), &dims)?;
            }
            expect_len(&format!("blk.{i}.attn_norm.weight"), hidden)?;
            expect_len(&format!("blk.{i}.ffn_norm.weight"), hidden)?;
            if qkv_bias {
                for (m, n) in [("attn_q", qd), ("attn_k", kvd), ("attn_v", kvd)] {
                    expect_len(&format!("blk.{i}.{m}.bias"), n)?;
                }
            }
        }
        Ok(cfg)
    }
}

/// The decode-step copy of a 2-D weight: its own blocks when the GGUF stores Q4_1 or Q8_0 (Q5_0
/// blocks are converted exactly to Q8_0), the
/// tensor's Q4_K/Q6_K blocks read in place (this crate's kernels for all of them), its blocks
/// behind candle's `QMatMul` for the other block formats, and f32/f16 values quantized to Q8_0.
fn to_qmatrix(q: &Arc<QTensor>) -> Result<QMatrix> {
    let (rows, cols) = q.shape().dims2()?;
    let m = match q.dtype() {
        GgmlDType::Q4_1 => QMatrix::from_q4_1_bytes(&q.data()?, rows, cols),
        GgmlDType::Q8_0 => QMatrix::from_q8_0_bytes(&q.data()?, rows, cols),
        GgmlDType::Q5_0 => QMatrix::from_q5_0_bytes(&q.data()?, rows, cols),
        GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
            let f = q
                .dequantize(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            QMatrix::q8_0_from_f32(&f, rows, cols)
        }
        _ => QMatrix::ggml(q.clone()),
    };
    m.ok_or_else(|| {
        EngineError::Format(format!(
            "weight {rows}x{cols} ({:?}): width not a multiple of 32 or size mismatch",
            q.dtype()
        ))
    })
}

/// f32 bytes of every weight the model reads (matrices, embedding, LM head; norms and biases
/// are small and always resident), from the header alone.
fn f32_weight_bytes(content: &Content) -> usize {
    content
        .tensor_infos
        .iter()
        .filter(|(name, _)| name.ends_with(".weight") && !name.contains("norm"))
        .map(|(_, t)| t.shape.elem_count() * 4)
        .sum()
}

impl Model {
    /// Loads a GGUF file (header checked with [`check_gguf_file`], configuration and tensor
    /// shapes with [`Config::from_gguf`]). Every weight is kept in its blocks for decode; prefill's
    /// f32 copies are kept when they take at most `RESIDENT_F32_LIMIT` bytes, else dequantized
    /// on each use (see `weights.rs`).
    pub fn load(path: &Path) -> Result<Self> {
        let (content, file) = check_gguf_file(path)?;
        let cfg = Config::from_gguf(&content)?;
        let resident = f32_weight_bytes(&content) <= RESIDENT_F32_LIMIT;
        let mut reader = std::io::BufReader::new(file);
        let dev = Device::Cpu;
        let mut get_q = |name: &str| -> Result<Arc<QTensor>> {
            Ok(Arc::new(content.tensor(&mut reader, name, &dev)?))
        };
        let deq =
            |q: &Arc<QTensor>| -> Result<Tensor> { Ok(q.dequantize(&dev)?.to_dtype(DType::F32)?) };
        let qembed = get_q("token_embd.weight")?;
        let embed = Embedding::new(qembed.clone(), resident)?;
        let (lm_head, q_lm_head) = match (cfg.tied_embeddings, &embed) {
            (true, Embedding::Resident(t)) => (Dense::Resident(t.clone()), to_qmatrix(&qembed)?),
            (true, Embedding::Rows(_)) => (
                Dense::new(vec![qembed.clone()], false)?,
                to_qmatrix(&qembed)?,
            ),
            (false, _) => {
                let q = get_q("output.weight")?;
                let m = to_qmatrix(&q)?;
                (Dense::new(vec![q], resident)?, m)
            }
        };
        drop(qembed);
        let out_norm = deq(&get_q("output_norm.weight")?)?;
        let out_norm_v = out_norm.flatten_all()?.to_vec1::<f32>()?;
        // from_gguf found every layer's tensors in the file, so this is not sized by a bare count
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let mut mats = |names: &[&str]| -> Result<(Dense, RowStack)> {
                let qs = names
                    .iter()
                    .map(|s| get_q(&p(s)))
                    .collect::<Result<Vec<_>>>()?;
                let stack = RowStack::new(qs.iter().map(to_qmatrix).collect::<Result<_>>()?)
                    .ok_or_else(|| {
                        EngineError::Format(format!("blk.{i}: weights to stack differ in width"))
                    })?;
                Ok((Dense::new(qs, resident)?, stack))
            };
            let (wqkv, qqkv) = mats(&["attn_q", "attn_k", "attn_v"])?;
            let (wo, qo) = mats(&["attn_output"])?;
            let (w_gate_up, qgu) = mats(&["ffn_gate", "ffn_up"])?;
            let (w_down, qd) = mats(&["ffn_down"])?;
            let bqkv = if cfg.qkv_bias {
                let parts = ["attn_q", "attn_k", "attn_v"]
                    .iter()
                    .map(|s| -> Result<Tensor> {
                        Ok(deq(&get_q(&format!("blk.{i}.{s}.bias"))?)?.flatten_all()?)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Some(Tensor::cat(&parts, 0)?)
            } else {
                None
            };
            let attn_norm = deq(&get_q(&p("attn_norm"))?)?;
            let ffn_norm = deq(&get_q(&p("ffn_norm"))?)?;
            let q = QLayer {
                attn_norm: attn_norm.flatten_all()?.to_vec1::<f32>()?,
                ffn_norm: ffn_norm.flatten_all()?.to_vec1::<f32>()?,
                wqkv: qqkv,
                bqkv: bqkv.as_ref().map(|b| b.to_vec1::<f32>()).transpose()?,
                wo: qo,
                w_gate_up: qgu,
                w_down: qd,
            };
            layers.push(Layer {
                attn_norm,
                wqkv,
                bqkv,
                wo,
                ffn_norm,
                w_gate_up,
                w_down,
                q,
            });
        }
        let head_dim = cfg.head_dim;
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
}
