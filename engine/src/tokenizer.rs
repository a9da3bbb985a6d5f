//! Tokenizer and chat template built from the GGUF metadata.
//!
//! The GGUF says `tokenizer.ggml.model = gpt2`, `tokenizer.ggml.pre = smollm`. llama.cpp maps
//! `smollm` to the regex pair `\p{N}` (every digit its own piece) followed by the GPT-2 regex;
//! that is exactly Hugging Face's `Sequence[Digits(individual_digits), ByteLevel(use_regex)]`,
//! which is what SmolLM2's own `tokenizer.json` declares. No prefix space, no BOS. Control tokens
//! (`<|im_start|>` etc.) are added tokens, so they are recognised inside text.

use crate::{EngineError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use serde_json::{json, Map, Value as Json};

/// The chat template, reduced to the one structure SmolLM2 uses.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    /// Default system message, read from the template text.
    pub system: String,
    /// The template text from the GGUF, verbatim.
    pub source: String,
}

impl ChatTemplate {
    fn from_source(source: &str) -> Result<Self> {
        let bad = |why: &str| {
            EngineError::Format(format!(
                "unexpected tokenizer.chat_template ({why}): {source}"
            ))
        };
        let start = "<|im_start|>system\n";
        let i = source
            .find(start)
            .ok_or_else(|| bad("no default system turn"))?
            + start.len();
        let j = source[i..]
            .find("<|im_end|>")
            .ok_or_else(|| bad("system turn not closed"))?
            + i;
        for needle in [
            "'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'",
            "'<|im_start|>assistant\n'",
        ] {
            if !source.contains(needle) {
                return Err(bad(&format!("missing {needle:?}")));
            }
        }
        Ok(Self {
            system: source[i..j].to_string(),
            source: source.to_string(),
        })
    }

    /// One user turn with the default system message and the generation prompt.
    pub fn render(&self, prompt: &str) -> String {
        self.render_with_system(&self.system, prompt)
    }

    pub fn render_with_system(&self, system: &str, prompt: &str) -> String {
        format!("<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
    }
}

/// Tokenizer + chat template + end-of-sequence ids.
pub struct Tok {
    pub(crate) inner: tokenizers::Tokenizer,
    pub chat: ChatTemplate,
    /// `<|im_end|>` and `<|endoftext|>` (and the GGUF's eos id).
    pub eos_ids: Vec<u32>,
}

fn meta<'a>(c: &'a Content, key: &str) -> Result<&'a Value> {
    c.metadata
        .get(key)
        .ok_or_else(|| EngineError::Format(format!("GGUF metadata lacks {key}")))
}

impl Tok {
    pub fn from_gguf(c: &Content) -> Result<Self> {
        let fmt = |e: candle_core::Error| EngineError::Format(e.to_string());
        let model = meta(c, "tokenizer.ggml.model")?.to_string().map_err(fmt)?;
        if model != "gpt2" {
            return Err(EngineError::Format(format!(
                "tokenizer.ggml.model {model}, only gpt2 (byte-level BPE) is supported"
            )));
        }
        let pre = meta(c, "tokenizer.ggml.pre")?.to_string().map_err(fmt)?;
        if pre != "smollm" {
            return Err(EngineError::Format(format!(
                "tokenizer.ggml.pre {pre}, only smollm is supported"
            )));
        }
        let tokens = meta(c, "tokenizer.ggml.tokens")?.to_vec().map_err(fmt)?;
        let types = meta(c, "tokenizer.ggml.token_type")?
            .to_vec()
            .map_err(fmt)?;
        let merges = meta(c, "tokenizer.ggml.merges")?.to_vec().map_err(fmt)?;
        let mut vocab = Map::new();
        let mut added = Vec::new();
        let mut names = Vec::with_capacity(tokens.len());
        for (id, t) in tokens.iter().enumerate() {
            let s = t.to_string().map_err(fmt)?.clone();
            let ty = types
                .get(id)
                .map(|v| v.to_i32())
                .transpose()
                .map_err(fmt)?
                .unwrap_or(1);
            // llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte
            if ty == 3 || ty == 4 {
                added.push(
                    json!({"id": id, "content": s, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": ty == 3}),
                );
            }
            vocab.insert(s.clone(), json!(id));
            names.push(s);
        }
        let merges: Vec<Json> = merges
            .iter()
            .map(|m| m.to_string().map(|s| Json::String(s.clone())))
            .collect::<Result<_, _>>()
            .map_err(fmt)?;
        let spec = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
            ]},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges}
        });
        let inner: tokenizers::Tokenizer = spec
            .to_string()
            .parse()
            .map_err(|e: tokenizers::Error| EngineError::Tokenizer(e.to_string()))?;
        let chat = ChatTemplate::from_source(
            meta(c, "tokenizer.chat_template")?
                .to_string()
                .map_err(fmt)?,
        )?;
        let mut eos_ids = Vec::new();
        for name in ["<|im_end|>", "<|endoftext|>"] {
            let id = names
                .iter()
                .position(|n| n == name)
                .ok_or_else(|| EngineError::Format(format!("vocab lacks {name}")))?;
            eos_ids.push(id as u32);
        }
        if let Some(v) = c.metadata.get("tokenizer.ggml.eos_token_id") {
            let id = v.to_u32().map_err(fmt)?;
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        Ok(Self {
            inner,
            chat,
            eos_ids,
        })
    }

    /// Encodes text as is (control tokens written in the text are recognised; no BOS).
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text (control tokens are kept in the text).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
