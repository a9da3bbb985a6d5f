//! GGUF files built byte by byte for tests: a tiny llama model that loads and runs, and the
//! pieces to write what candle's writer never would (huge lengths, bad offsets, zero heads).
#![allow(dead_code)]

use half::f16;

/// GGUF metadata value types.
pub const T_U32: u32 = 4;
pub const T_I32: u32 = 5;
pub const T_F32: u32 = 6;
pub const T_STRING: u32 = 8;
pub const T_ARRAY: u32 = 9;
/// ggml tensor types.
pub const F32: u32 = 0;
pub const Q4_1: u32 = 3;

/// A length-prefixed GGUF string.
pub fn string(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

/// A GGUF version 3 file under construction.
#[derive(Clone, Default)]
pub struct Gguf {
    kvs: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_tensors: u64,
    data: Vec<u8>,
}

impl Gguf {
    /// A metadata pair whose value (type `ty`) is already encoded in `payload`.
    pub fn kv(&mut self, key: &str, ty: u32, payload: &[u8]) -> &mut Self {
        self.kvs.extend(string(key));
        self.kvs.extend(ty.to_le_bytes());
        self.kvs.extend_from_slice(payload);
        self.n_kv += 1;
        self
    }

    pub fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.kv(key, T_U32, &v.to_le_bytes())
    }

    pub fn kv_f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.kv(key, T_F32, &v.to_le_bytes())
    }

    pub fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
        self.kv(key, T_STRING, &string(v))
    }

    pub fn kv_strs(&mut self, key: &str, vs: &[&str]) -> &mut Self {
        let mut p = T_STRING.to_le_bytes().to_vec();
        p.extend((vs.len() as u64).to_le_bytes());
        for s in vs {
            p.extend(string(s));
        }
        self.kv(key, T_ARRAY, &p)
    }

    pub fn kv_i32s(&mut self, key: &str, vs: &[i32]) -> &mut Self {
        let mut p = T_I32.to_le_bytes().to_vec();
        p.extend((vs.len() as u64).to_le_bytes());
        for v in vs {
            p.extend(v.to_le_bytes());
        }
        self.kv(key, T_ARRAY, &p)
    }

    /// A tensor info with the given dimensions (GGUF order: fastest-varying first), type and
    /// offset into the data section; no data is added.
    pub fn tensor_info(&mut self, name: &str, dims: &[u64], dtype: u32, offset: u64) -> &mut Self {
        self.infos.extend(string(name));
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(dtype.to_le_bytes());
        self.infos.extend(offset.to_le_bytes());
        self.n_tensors += 1;
        self
    }

    /// A tensor with its data, appended to the data section (padded to 32 bytes).
    pub fn tensor(&mut self, name: &str, dims: &[u64], dtype: u32, data: &[u8]) -> &mut Self {
        let offset = self.data.len() as u64;
        self.tensor_info(name, dims, dtype, offset);
        self.data.extend_from_slice(data);
        self.data.resize(self.data.len().next_multiple_of(32), 0);
        self
    }

    /// The file: header, metadata, tensor infos, padding to 32, tensor data.
    pub fn bytes(&self) -> Vec<u8> {
        self.bytes_with_counts(self.n_tensors, self.n_kv)
    }

    /// As [`Gguf::bytes`] with the header's tensor and metadata counts replaced.
    pub fn bytes_with_counts(&self, n_tensors: u64, n_kv: u64) -> Vec<u8> {
        let mut v = b"GGUF".to_vec();
        v.extend(3u32.to_le_bytes());
        v.extend(n_tensors.to_le_bytes());
        v.extend(n_kv.to_le_bytes());
        v.extend_from_slice(&self.kvs);
        v.extend_from_slice(&self.infos);
        v.resize(v.len().next_multiple_of(32), 0);
        v.extend_from_slice(&self.data);
        v
    }
}

/// The shape of a tiny llama model, and what its metadata claims.
#[derive(Clone, Debug)]
pub struct Tiny {
    pub hidden: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    /// Layers whose tensors are written.
    pub layers: usize,
    /// `llama.attention.head_count` (default `q_heads`).
    pub meta_heads: Option<u32>,
    /// `llama.attention.head_count_kv` (default `kv_heads`).
    pub meta_kv_heads: Option<u32>,
    /// `llama.block_count` (default `layers`).
    pub meta_blocks: Option<u32>,
    /// `general.alignment`, when set.
    pub alignment: Option<u32>,
    /// `general.architecture`: `llama` (default) or `qwen2` (its keys, its pre-tokenizer).
    pub arch: &'static str,
    /// Write `attn_q/k/v.bias` (F32) in every layer.
    pub biases: bool,
    /// `rope.freq_base` (default 10000).
    pub rope_base: f32,
    /// `attention.layer_norm_rms_epsilon` (default 1e-5).
    pub rms_eps: f32,
    /// `context_length` (default 256).
    pub context: u32,
}

impl Default for Tiny {
    /// hidden 32, one query and one KV head of 32 dims, ffn 32, one layer (about 6 KB).
    fn default() -> Self {
        Self {
            hidden: 32,
            q_heads: 1,
            kv_heads: 1,
            ffn: 32,
            layers: 1,
            meta_heads: None,
            meta_kv_heads: None,
            meta_blocks: None,
            alignment: None,
            arch: "llama",
            biases: false,
            rope_base: 10000.0,
            rms_eps: 1e-5,
            context: 256,
        }
    }
}

/// The tiny model's vocabulary: the three control tokens and five letters.
pub const VOCAB: [&str; 8] = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "a",
    "b",
    "c",
    "d",
    "e",
];

/// A chat template with the structure the engine's tokenizer accepts.
pub fn chat_template() -> String {
    [
        "<|im_start|>system\nYou are tiny.<|im_end|>\n",
        "'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'",
        "'<|im_start|>assistant\n'",
    ]
    .concat()
}

/// Q4_1 blocks for `n` weights (a multiple of 32), deterministic from `seed`.
pub fn q4_1_data(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut out = Vec::with_capacity(n / 32 * 20);
    for _ in 0..n / 32 {
        out.extend(f16::from_f32(0.02).to_le_bytes());
        out.extend(f16::from_f32(-0.15).to_le_bytes());
        for _ in 0..16 {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            out.push((s >> 56) as u8);
        }
    }
    out
}

fn ones_f32(n: usize) -> Vec<u8> {
    (0..n).flat_map(|_| 1f32.to_le_bytes()).collect()
}

impl Tiny {
    pub fn head_dim(&self) -> usize {
        self.hidden / self.q_heads
    }

    /// The model as a GGUF builder (tied embeddings; matrices Q4_1, norms F32).
    pub fn gguf(&self) -> Gguf {
        let (h, hd, f) = (self.hidden as u64, self.head_dim() as u64, self.ffn as u64);
        let (q, kv) = (self.q_heads as u64 * hd, self.kv_heads as u64 * hd);
        let mut g = Gguf::default();
        let a = self.arch;
        let k = |s: &str| format!("{a}.{s}");
        let pre = if a == "qwen2" { "qwen2" } else { "smollm" };
        g.kv_str("general.architecture", a)
            .kv_u32(&k("embedding_length"), self.hidden as u32)
            .kv_u32(
                &k("attention.head_count"),
                self.meta_heads.unwrap_or(self.q_heads as u32),
            )
            .kv_u32(
                &k("attention.head_count_kv"),
                self.meta_kv_heads.unwrap_or(self.kv_heads as u32),
            )
            .kv_u32(
                &k("block_count"),
                self.meta_blocks.unwrap_or(self.layers as u32),
            )
            .kv_u32(&k("feed_forward_length"), self.ffn as u32)
            .kv_u32(&k("context_length"), self.context)
            .kv_u32(&k("rope.dimension_count"), hd as u32)
            .kv_f32(&k("rope.freq_base"), self.rope_base)
            .kv_f32(&k("attention.layer_norm_rms_epsilon"), self.rms_eps)
            .kv_str("tokenizer.ggml.model", "gpt2")
            .kv_str("tokenizer.ggml.pre", pre)
            .kv_strs("tokenizer.ggml.tokens", &VOCAB)
            .kv_i32s("tokenizer.ggml.token_type", &[3, 3, 3, 1, 1, 1, 1, 1])
            .kv_strs("tokenizer.ggml.merges", &[])
            .kv_str("tokenizer.chat_template", &chat_template());
        if let Some(a) = self.alignment {
            g.kv_u32("general.alignment", a);
        }
        let v = VOCAB.len() as u64;
        let mut seed = 0;
        let mut mat = |g: &mut Gguf, name: &str, rows: u64, cols: u64| {
            seed += 1;
            g.tensor(
                name,
                &[cols, rows],
                Q4_1,
                &q4_1_data((rows * cols) as usize, seed),
            );
        };
        mat(&mut g, "token_embd.weight", v, h);
        g.tensor("output_norm.weight", &[h], F32, &ones_f32(self.hidden));
        for i in 0..self.layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            mat(&mut g, &p("attn_q"), q, h);
            mat(&mut g, &p("attn_k"), kv, h);
            mat(&mut g, &p("attn_v"), kv, h);
            mat(&mut g, &p("attn_output"), h, q);
            mat(&mut g, &p("ffn_gate"), f, h);
            mat(&mut g, &p("ffn_up"), f, h);
            mat(&mut g, &p("ffn_down"), h, f);
            g.tensor(&p("attn_norm"), &[h], F32, &ones_f32(self.hidden));
            g.tensor(&p("ffn_norm"), &[h], F32, &ones_f32(self.hidden));
            if self.biases {
                for (m, n) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
                    let b: Vec<u8> = (0..n)
                        .flat_map(|j| (0.5 - (j % 7) as f32 * 0.15).to_le_bytes())
                        .collect();
                    g.tensor(&format!("blk.{i}.{m}.bias"), &[n], F32, &b);
                }
            }
        }
        g
    }

    /// Writes the model into `dir` and returns its path.
    pub fn write(&self, dir: &std::path::Path, name: &str) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, self.gguf().bytes()).unwrap();
        p
    }
}
