//! The CLI's error: a library error (the harness's among them) or a problem with an input file.

use mosaickv_engine::EngineError;
use mosaickv_eval::EvalError;
use mosaickv_spec::MosaicError;
use std::fmt;
use std::path::Path;

/// Everything a subcommand can fail with; printed as one line by `main`.
#[derive(Debug)]
pub enum CliError {
    /// A MosaicKV error (bad input values, bad configuration, bad cache file, ...).
    Mosaic(MosaicError),
    /// An input file that is not what the command needs (dtype, ndim, .npy syntax).
    Input(String),
    /// The model engine failed (model file missing, truncated or not GGUF, fetch failed, ...).
    Engine(EngineError),
    /// The evaluation harness (`eval`, `fidelity`, `frontier`) failed.
    Eval(EvalError),
}

impl CliError {
    /// The message on one line (newlines folded to spaces), control characters escaped.
    pub fn one_line(&self) -> String {
        printable(
            &self
                .to_string()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" "),
        )
    }
}

/// `s` with every control character (a NUL byte from a file name or an input, an escape
/// sequence) written as `\u{..}`, so an error line is one line of plain text.
pub fn printable(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Mosaic(e) => write!(f, "{e}"),
            CliError::Input(m) => write!(f, "{m}"),
            CliError::Engine(e) => write!(f, "{e}"),
            CliError::Eval(e) => write!(f, "{e}"),
        }
    }
}

impl From<MosaicError> for CliError {
    fn from(e: MosaicError) -> Self {
        CliError::Mosaic(e)
    }
}

impl From<EngineError> for CliError {
    fn from(e: EngineError) -> Self {
        CliError::Engine(e)
    }
}

impl From<EvalError> for CliError {
    fn from(e: EvalError) -> Self {
        CliError::Eval(e)
    }
}

/// An I/O error on `path` as a `MosaicError::Io`.
pub fn io(path: &Path, e: std::io::Error) -> CliError {
    CliError::Mosaic(MosaicError::Io(format!("{}: {e}", path.display())))
}
