//! The one error enum of the project (SPEC.md section 14).

use thiserror::Error;

/// Every fallible MosaicKV operation returns this error. Bad input never
/// panics and never mutates a cache: validation happens before any state
/// changes.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum MosaicError {
    /// An input array holds NaN or +-Inf.
    #[error("non-finite value in {what} at flat index {index}")]
    NonFinite { what: &'static str, index: usize },
    /// An array does not have the shape the operation needs.
    #[error("shape mismatch for {what}: expected {expected}, got {got}")]
    ShapeMismatch {
        what: &'static str,
        expected: String,
        got: String,
    },
    /// `head_dim` is not a multiple of the element group size `g`.
    #[error("head_dim {head_dim} is not divisible by group size {group_size}")]
    GroupSizeNotDivisor { head_dim: usize, group_size: usize },
    /// The per-vector retained count `r` is outside `g..=kept_dims` or not a multiple of `g`.
    #[error("retained count r={r} out of range (must be a multiple of g={group_size} in {group_size}..={kept_dims})")]
    RetentionOutOfRange {
        r: usize,
        group_size: usize,
        kept_dims: usize,
    },
    /// Attention was asked of a cache with no tokens.
    #[error("the cache is empty")]
    EmptyCache,
    /// `q_heads` is not a positive multiple of `kv_heads`.
    #[error("q_heads {q_heads} is not a positive multiple of kv_heads {kv_heads}")]
    GqaMismatch { q_heads: usize, kv_heads: usize },
    /// A configuration file names a key the configuration does not have.
    #[error("unknown configuration key `{0}`")]
    UnknownConfigKey(String),
    /// A configuration value is out of its allowed range.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// `prefill` was called on a cache that already holds tokens.
    #[error("prefill called on a cache that already holds {0} tokens")]
    AlreadyPrefilled(usize),
    /// Packed bytes that violate the layout of SPEC.md section 6.
    #[error("corrupt packed data: {0}")]
    CorruptPacked(String),
    /// A file or directory that is not a valid MosaicKV cache of this version.
    #[error("bad cache file: {0}")]
    BadFormat(String),
    /// An I/O error, with the path or operation that failed.
    #[error("i/o error: {0}")]
    Io(String),
    /// The backend cannot run on this machine (no GPU, no driver, ...).
    #[error("backend unavailable: {0}")]
    BackendUnavailable(String),
}

/// Result alias used across the workspace.
pub type Result<T> = std::result::Result<T, MosaicError>;
