//! The run log: every (prompt, method) result of a suite, one JSON line each, appended as it is
//! measured, so that a run stopped anywhere loses nothing and a rerun resumes.

use crate::error::{io, Result};
use mosaickv_engine::store::PrefillStore;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// One method's result on one prompt, as the run log keeps it (one JSON line each).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Done {
    pub task: String,
    pub length: usize,
    pub seed: u64,
    pub method: String,
    pub score: f64,
    pub bytes_per_token: f64,
    /// Host-side bytes per cached token (the f32 rows a MosaicKV cache keeps for its open
    /// segment, SPEC.md section 13's `host_rows`), over layers like `bytes_per_token`; absent
    /// from lines written before it was recorded (2026-12-07), unknown there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_bytes_per_token: Option<f64>,
    /// Sum of the decode steps' wall times (s) and their count.
    pub step_s: f64,
    pub steps: usize,
    pub prompt_tokens: usize,
    /// The generated text (trimmed).
    pub text: String,
}

/// The results of a run so far, appended one line per method and prompt as they finish, so
/// that a run stopped anywhere (a session's end, a kill) loses nothing already measured and a
/// rerun with the same arguments goes on where it stopped.
pub struct RunLog {
    path: PathBuf,
    file: std::fs::File,
    done: BTreeMap<(String, usize, u64, String), Done>,
}

impl RunLog {
    /// Opens the log at `path`, reading what it holds. With `fresh` nothing already there is
    /// read (this run measures every result again), but nothing is removed either: the log is
    /// shared by every run of the model with the same code and seed (other tasks, lengths,
    /// methods), and a later line supersedes an earlier one with the same key when the log is
    /// next read, so the fresh results replace the old ones only where they were measured.
    pub fn open(path: &Path, fresh: bool) -> Result<Self> {
        if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(d).map_err(|e| io(d, e))?;
        }
        let mut done = BTreeMap::new();
        if !fresh {
            if let Ok(text) = std::fs::read_to_string(path) {
                // a line cut short by a kill is skipped (that method runs again)
                for d in text
                    .lines()
                    .filter_map(|l| serde_json::from_str::<Done>(l).ok())
                {
                    done.insert((d.task.clone(), d.length, d.seed, d.method.clone()), d);
                }
            }
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| io(path, e))?;
        // a line cut short by a kill gets its end, so the next result starts a line of its own
        let len = file.metadata().map_err(|e| io(path, e))?.len();
        if len > 0 {
            let mut last = [0u8; 1];
            let mut r = std::fs::File::open(path).map_err(|e| io(path, e))?;
            std::io::Seek::seek(&mut r, std::io::SeekFrom::Start(len - 1))
                .and_then(|_| std::io::Read::read_exact(&mut r, &mut last))
                .map_err(|e| io(path, e))?;
            if last[0] != b'\n' {
                file.write_all(b"\n").map_err(|e| io(path, e))?;
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            done,
        })
    }

    /// The result of `method` on the prompt `(task, length, seed)`, when the log has it.
    pub fn get(&self, task: &str, length: usize, seed: u64, method: &str) -> Option<&Done> {
        self.done
            .get(&(task.to_string(), length, seed, method.to_string()))
    }

    /// Appends a result (written and synced before this returns).
    pub fn push(&mut self, d: Done) -> Result<()> {
        let line = serde_json::to_string(&d)? + "\n";
        self.file
            .write_all(line.as_bytes())
            .and_then(|_| self.file.sync_data())
            .map_err(|e| io(&self.path, e))?;
        self.done
            .insert((d.task.clone(), d.length, d.seed, d.method.clone()), d);
        Ok(())
    }

    /// Results already there.
    pub fn len(&self) -> usize {
        self.done.len()
    }

    pub fn is_empty(&self) -> bool {
        self.done.is_empty()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The run log of a suite with generator seed `seed` on the model of `store`:
/// `$MOSAICKV_HOME/runs/eval-KEY.jsonl`, KEY a hash of the model's identity, the code the
/// results depend on (`mosaickv_engine::store::RESULTS_CODE`), the seed and, on a CPU whose
/// long prefills multiply in bf16 on AMX tiles, that. Results inside are
/// keyed by task, length, seed and method, so a rerun with the same arguments resumes, and one
/// that adds a method, a length or samples reuses what the earlier run measured (`eval` and
/// `frontier` share it).
pub fn run_log_path(home: &Path, store: &PrefillStore, seed: u64) -> PathBuf {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"mosaickv eval run log v1\0");
    h.update(store.model_id().as_bytes());
    h.update([0]);
    h.update(mosaickv_engine::store::RESULTS_CODE.as_bytes());
    h.update(seed.to_le_bytes());
    // long prompts' prefill products on this CPU (bf16 on AMX tiles, or f32)
    if mosaickv_engine::long_prefill_products() != "f32" {
        h.update(mosaickv_engine::long_prefill_products().as_bytes());
    }
    let d = h.finalize();
    let key: String = d[..8].iter().map(|b| format!("{b:02x}")).collect();
    home.join("runs").join(format!("eval-{key}.jsonl"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_run_log_keeps_results_across_opens_and_skips_a_cut_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("runs").join("eval-x.jsonl");
        let d = |method: &str, score: f64| Done {
            task: "vt".into(),
            length: 4096,
            seed: 3,
            method: method.into(),
            score,
            bytes_per_token: 300.0,
            host_bytes_per_token: Some(12.0),
            step_s: 1.5,
            steps: 30,
            prompt_tokens: 4000,
            text: "VAR A".into(),
        };
        let mut log = RunLog::open(&path, false).unwrap();
        assert!(log.is_empty());
        log.push(d("full", 1.0)).unwrap();
        log.push(d("mosaic", 0.5)).unwrap();
        drop(log);
        // a kill in the middle of a line leaves half a line: skipped on the next open
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"{\"task\": \"vt\", \"len").unwrap();
        drop(f);
        let mut log = RunLog::open(&path, false).unwrap();
        assert_eq!(log.len(), 2);
        assert_eq!(log.get("vt", 4096, 3, "mosaic"), Some(&d("mosaic", 0.5)));
        assert_eq!(log.get("vt", 4096, 4, "mosaic"), None);
        log.push(d("kvq4", 0.0)).unwrap();
        drop(log);
        assert_eq!(RunLog::open(&path, false).unwrap().len(), 3);
        // --fresh: nothing is read and nothing removed; what it measures again supersedes
        // the old line, the results it does not measure (another run's) stay
        let before = std::fs::read(&path).unwrap();
        let mut log = RunLog::open(&path, true).unwrap();
        assert!(log.is_empty());
        log.push(d("mosaic", 1.0)).unwrap();
        drop(log);
        assert!(std::fs::read(&path).unwrap().starts_with(&before));
        let log = RunLog::open(&path, false).unwrap();
        assert_eq!(log.len(), 3);
        assert_eq!(log.get("vt", 4096, 3, "mosaic"), Some(&d("mosaic", 1.0)));
        assert_eq!(log.get("vt", 4096, 3, "kvq4"), Some(&d("kvq4", 0.0)));
    }
}
