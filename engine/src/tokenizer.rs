//! Tokenizer and chat template built from the GGUF metadata.
//!
//! Both models say `tokenizer.ggml.model = gpt2` (byte-level BPE with the file's merges); the
//! pre-tokenizer is named by `tokenizer.ggml.pre`:
//!
//! * `smollm` (SmolLM2): llama.cpp maps it to the regex pair `\p{N}` (every digit its own piece)
//!   followed by the GPT-2 regex; that is exactly Hugging Face's
//!   `Sequence[Digits(individual_digits), ByteLevel(use_regex)]`, which is what SmolLM2's own
//!   `tokenizer.json` declares.
//! * `qwen2` (Qwen2.5): one Llama-3-style regex ([`QWEN2_SPLIT`], contractions, letters with
//!   one leading non-letter, single digits `\p{N}`, punctuation runs, newlines, spaces), the
//!   split Qwen2.5's `tokenizer.json` declares and llama.cpp's `LLAMA_VOCAB_PRE_TYPE_QWEN2`
//!   uses, then byte-level mapping without its own regex. Qwen's `tokenizer.json` also asks for
//!   NFC normalization, which llama.cpp does not apply; we follow llama.cpp (the golden
//!   reference), which only differs on text that is not already NFC.
//!
//! No prefix space. BOS only when `tokenizer.ggml.add_bos_token` is true (neither model).
//! Control and user-defined tokens (`<|im_start|>` etc.) are added tokens, so they are
//! recognised inside text.

use crate::{EngineError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use serde_json::{json, Map, Value as Json};

/// The Qwen2 pre-tokenizer split, as in Qwen2.5's `tokenizer.json` (`Split`, `Isolated`).
pub const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The chat template, reduced to the one structure both models use: ChatML turns
/// (`<|im_start|>role\ncontent<|im_end|>\n`), a default system turn when the conversation has
/// none, and `<|im_start|>assistant\n` as the generation prompt.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    /// Default system message, read from the template text.
    pub system: String,
    /// The template text from the GGUF, verbatim.
    pub source: String,
}

impl ChatTemplate {
    /// Checks that `source` is such a template and reads its default system message: the text
    /// of the first string literal `'<|im_start|>system\n...<|im_end|>...'` (one with no quote in
    /// between, so not a turn assembled from `messages[0]`). The template may spell the newlines
    /// in its literals as they are (SmolLM2) or as the escape `\n` (Qwen2.5).
    fn from_source(source: &str) -> Result<Self> {
        let bad = |why: &str| {
            EngineError::Format(format!(
                "unexpected tokenizer.chat_template ({why}): {source}"
            ))
        };
        // a needle written with real newlines, and with the escape
        let spellings = |s: &str| [s.to_string(), s.replace('\n', "\\n")];
        let system = spellings("<|im_start|>system\n")
            .iter()
            .find_map(|start| {
                source.match_indices(start.as_str()).find_map(|(i, _)| {
                    let body = &source[i + start.len()..];
                    let j = body.find("<|im_end|>")?;
                    let text = &body[..j];
                    (!text.contains(['\'', '"', '{', '}', '\\'])).then_some(text)
                })
            })
            .ok_or_else(|| bad("no default system turn"))?;
        // the turn format, as SmolLM2 (`message['role']`) or Qwen2.5 (`message.role`) spell it
        let turns = [
            "'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'",
            "'<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n'",
        ];
        if !turns
            .iter()
            .flat_map(|t| spellings(t))
            .any(|t| source.contains(&t))
        {
            return Err(bad(&format!("missing {:?}", turns[0])));
        }
        let gen = "'<|im_start|>assistant\n'";
        if !spellings(gen).iter().any(|g| source.contains(g.as_str())) {
            return Err(bad(&format!("missing {gen:?}")));
        }
        Ok(Self {
            system: system.to_string(),
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
    /// Prepended to every encoding when `tokenizer.ggml.add_bos_token` is true.
    pub bos: Option<u32>,
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
        let pre_tokenizer = match pre.as_str() {
            "smollm" => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
            ]}),
            "qwen2" => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
            ]}),
            _ => {
                return Err(EngineError::Format(format!(
                    "tokenizer.ggml.pre {pre}, only smollm and qwen2 are supported"
                )))
            }
        };
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
            "pre_tokenizer": pre_tokenizer,
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
        let add_bos = match c.metadata.get("tokenizer.ggml.add_bos_token") {
            Some(v) => v.to_bool().map_err(fmt)?,
            None => false,
        };
        let bos = if add_bos {
            let id = meta(c, "tokenizer.ggml.bos_token_id")?
                .to_u32()
                .map_err(fmt)?;
            if id as usize >= names.len() {
                return Err(EngineError::Format(format!(
                    "tokenizer.ggml.bos_token_id {id} outside the vocabulary"
                )));
            }
            Some(id)
        } else {
            None
        };
        Ok(Self {
            inner,
            chat,
            eos_ids,
            bos,
        })
    }

    /// Encodes text as is (control tokens written in the text are recognised), after the BOS
    /// token when the GGUF asks for one.
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        Ok(self
            .bos
            .into_iter()
            .chain(enc.get_ids().iter().copied())
            .collect())
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
