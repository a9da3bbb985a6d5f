//! Loading a GGUF file into a [`Model`].

use super::{Config, Layer, Model, QLayer};
use crate::fetch::check_gguf_file;
use crate::quant::QMatrix;
use crate::tokenizer::Tok;
use crate::{EngineError, Result};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use std::path::Path;

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
}
