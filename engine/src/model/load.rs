//! Loading a GGUF file into a [`Model`]: the configuration and every tensor's shape are checked
//! against the header ([`Config::from_gguf`]) before any weight is read.

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
    /// The hyper-parameters a llama GGUF header states, checked against each other (every
    /// count positive, whole heads, a whole query group per KV head, an even head_dim for
    /// RoPE's pairs, full RoPE) and against the shape of every tensor the model reads, for
    /// each of `llama.block_count` layers. Reads no tensor data, so nothing is allocated from a
    /// count in the file before the tensors it implies are known to exist.
    pub fn from_gguf(content: &Content) -> Result<Config> {
        let arch = content
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok().cloned())
            .unwrap_or_default();
        if arch != "llama" {
            return bad(format!("architecture {arch:?}, expected llama"));
        }
        let hidden = md_u32(content, "llama.embedding_length")?;
        let ffn = md_u32(content, "llama.feed_forward_length")?;
        let q_heads = md_u32(content, "llama.attention.head_count")?;
        let kv_heads = md_u32(content, "llama.attention.head_count_kv")?;
        let n_layers = md_u32(content, "llama.block_count")?;
        if hidden == 0 || ffn == 0 {
            return bad(format!(
                "llama.embedding_length {hidden} and llama.feed_forward_length {ffn} must be positive"
            ));
        }
        if q_heads == 0 || hidden % q_heads != 0 {
            return bad(format!(
                "llama.attention.head_count {q_heads} must divide llama.embedding_length {hidden}"
            ));
        }
        let head_dim = hidden / q_heads;
        if kv_heads == 0 || q_heads % kv_heads != 0 {
            return bad(format!(
                "llama.attention.head_count_kv {kv_heads} must divide llama.attention.head_count {q_heads}"
            ));
        }
        if let Ok(rd) = md_u32(content, "llama.rope.dimension_count") {
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
            return bad("llama.block_count is 0".into());
        }
        let shape = |name: &str| -> Result<&[usize]> {
            content
                .tensor_infos
                .get(name)
                .map(|t| t.shape.dims())
                .ok_or_else(|| {
                    EngineError::Format(format!(
                        "GGUF lacks tensor {name} (llama.block_count {n_layers})"
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
        let cfg = Config {
            n_layers,
            hidden,
            ffn,
            q_heads,
            kv_heads,
            head_dim,
            vocab,
            rope_theta: md_f32(content, "llama.rope.freq_base").unwrap_or(10000.0),
            rms_eps: md_f32(content, "llama.attention.layer_norm_rms_epsilon")?,
            context_length: md_u32(content, "llama.context_length").unwrap_or(2048),
            tied_embeddings: !content.tensor_infos.contains_key("output.weight"),
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
        // norms: any layout of `hidden` values (they are read flattened)
        let expect_len = |name: &str| -> Result<()> {
            let got = shape(name)?;
            if got.iter().product::<usize>() != hidden {
                return bad(format!(
                    "tensor {name} has shape {got:?}, expected {hidden} values"
                ));
            }
            Ok(())
        };
        if !cfg.tied_embeddings {
            expect("output.weight", &[vocab, hidden])?;
        }
        expect_len("output_norm.weight")?;
        for i in 0..n_layers {
            for (m, dims) in layer_matrices(&cfg) {
                expect(&format!("blk.{i}.{m}.weight"), &dims)?;
            }
            expect_len(&format!("blk.{i}.attn_norm.weight"))?;
            expect_len(&format!("blk.{i}.ffn_norm.weight"))?;
        }
        Ok(cfg)
    }
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
    /// Loads a GGUF file (header checked with [`check_gguf_file`], configuration and tensor
    /// shapes with [`Config::from_gguf`]) and dequantizes every weight to f32.
    pub fn load(path: &Path) -> Result<Self> {
        let (content, file) = check_gguf_file(path)?;
        let cfg = Config::from_gguf(&content)?;
        let mut reader = std::io::BufReader::new(file);
        let dev = Device::Cpu;
        let mut get_q =
            |name: &str| -> Result<QTensor> { Ok(content.tensor(&mut reader, name, &dev)?) };
        let deq = |q: &QTensor| -> Result<Tensor> { Ok(q.dequantize(&dev)?.to_dtype(DType::F32)?) };
        let qembed = get_q("token_embd.weight")?;
        let embed = deq(&qembed)?;
        let (lm_head, q_lm_head) = if cfg.tied_embeddings {
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
        // from_gguf found every layer's tensors in the file, so this is not sized by a bare count
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
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
