//! Result files: JSON written atomically (a reader never sees half a file).

use crate::error::{io, Result};
use serde::Serialize;
use std::path::Path;

/// Writes `value` as pretty JSON and a final newline to `path`, atomically.
pub fn write_json<T: Serialize + ?Sized>(path: &Path, value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    mosaickv_spec::atomic::write_atomic(path, (text + "\n").as_bytes()).map_err(|e| io(path, e))
}
