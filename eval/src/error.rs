//! The harness's error: a library error, an input the harness cannot use, or a JSON failure.

use mosaickv_engine::EngineError;
use mosaickv_spec::MosaicError;
use std::path::Path;

/// Everything the harness can fail with. The message is the underlying error's own (the CLI
/// prints it as one line).
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// A MosaicKV error (a bad method string, an I/O error on a result file, ...).
    #[error(transparent)]
    Mosaic(#[from] MosaicError),
    /// The model engine failed (model file missing or damaged, a prefill or decode step).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Arguments the harness cannot run (an empty suite, a repeated entry, a length past the
    /// context, a text too short, a plot with no points, ...).
    #[error("{0}")]
    Input(String),
    /// Results that could not be written as JSON.
    #[error("{0}")]
    Json(#[from] serde_json::Error),
}

/// The harness's result.
pub type Result<T> = std::result::Result<T, EvalError>;

/// An I/O error on `path` as a `MosaicError::Io`.
pub fn io(path: &Path, e: std::io::Error) -> EvalError {
    EvalError::Mosaic(MosaicError::Io(format!("{}: {e}", path.display())))
}
