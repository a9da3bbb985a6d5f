//! Saving a file without ever losing the one it replaces (SPEC.md section 15.7).
//!
//! Every file this project writes for a user (cache files, the dense baseline input, the
//! manifest, result JSON, `.npy` outputs) goes through [`write_atomic`] or, when several
//! files must change together, [`Pending`]: the bytes go to a temporary file in the target's
//! own directory (so that the final rename stays on one file system), the temporary file is
//! flushed to disk (`fsync`), then renamed over the target, and the directory is synced so
//! that the rename itself survives a crash. A failure at any point before the rename (a full
//! disk, a file-size limit, an I/O error, a kill) leaves the previous file byte for byte as
//! it was, and removes the temporary file (except after a kill, which leaves a hidden
//! `.NAME.*.tmp` beside it).
//!
//! The temporary file is made by the `tempfile` crate (`Builder::tempfile_in`); a replaced
//! file keeps its permission bits, a new one gets `0o666` less the process's umask, as
//! `std::fs::write` would give it.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// A file written and synced under a temporary name, not yet renamed over its target.
/// Dropping it without [`Pending::commit`] removes the temporary file and leaves the target
/// untouched.
#[derive(Debug)]
pub struct Pending {
    file: tempfile::NamedTempFile,
    dest: PathBuf,
}

fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

impl Pending {
    /// Writes the target's new contents with `write` into a temporary file beside `path`
    /// and syncs it. The target is not touched.
    pub fn prepare(
        path: &Path,
        write: impl FnOnce(&mut File) -> io::Result<()>,
    ) -> io::Result<Pending> {
        let name = path
            .file_name()
            .ok_or_else(|| io::Error::other("the path names no file"))?;
        let mut prefix = std::ffi::OsString::from(".");
        prefix.push(name);
        prefix.push(".");
        let mut builder = tempfile::Builder::new();
        builder.prefix(&prefix).suffix(".tmp");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = match std::fs::metadata(path) {
                Ok(m) if m.is_file() => m.permissions().mode() & 0o7777,
                _ => 0o666, // the umask applies at creation
            };
            builder.permissions(std::fs::Permissions::from_mode(mode));
        }
        let mut file = builder.tempfile_in(parent_of(path))?;
        write(file.as_file_mut())?;
        file.as_file_mut().flush()?;
        file.as_file().sync_all()?;
        Ok(Pending {
            file,
            dest: path.to_path_buf(),
        })
    }

    /// Renames the temporary file over the target, then syncs the directory.
    pub fn commit(self) -> io::Result<()> {
        let dest = self.dest;
        self.file.persist(&dest).map_err(|e| e.error)?;
        // The rename is durable once the directory is synced; a file system that cannot
        // sync a directory (some network ones) has still renamed the file.
        if let Ok(dir) = File::open(parent_of(&dest)) {
            let _ = dir.sync_all();
        }
        Ok(())
    }
}

/// Replaces `path` with `bytes`: written in full and synced under a temporary name, then
/// renamed (module doc). On error the previous file is unchanged.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    Pending::prepare(path, |f| f.write_all(bytes))?.commit()
}

/// Replaces every `(path, bytes)` together as far as a file system allows: all are written
/// and synced first, and only if every one succeeded are they renamed, in order. A failure
/// while writing leaves every target unchanged; a failed rename (rare: the temporary files
/// are in the targets' own directories) stops there and reports it.
pub fn write_all_atomic(files: &[(&Path, &[u8])]) -> io::Result<()> {
    let pending = files
        .iter()
        .map(|(p, b)| Pending::prepare(p, |f| f.write_all(b)))
        .collect::<io::Result<Vec<_>>>()?;
    pending.into_iter().try_for_each(Pending::commit)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "mkv-atomic-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn entries(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let d = dir();
        let p = d.join("cache.mkv");
        std::fs::write(&p, b"the good old contents").unwrap();
        let e = Pending::prepare(&p, |f| {
            f.write_all(b"half of the new")?;
            Err(io::Error::other("injected failure"))
        })
        .unwrap_err();
        assert_eq!(e.to_string(), "injected failure");
        assert_eq!(std::fs::read(&p).unwrap(), b"the good old contents");
        assert_eq!(entries(&d), vec!["cache.mkv".to_string()]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_prepared_file_changes_nothing_until_committed() {
        let d = dir();
        let p = d.join("a.json");
        std::fs::write(&p, b"old").unwrap();
        let pending = Pending::prepare(&p, |f| f.write_all(b"new")).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
        pending.commit().unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        assert_eq!(entries(&d), vec!["a.json".to_string()]);
        // dropped without commit: removed, target kept
        drop(Pending::prepare(&p, |f| f.write_all(b"newer")).unwrap());
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        assert_eq!(entries(&d), vec!["a.json".to_string()]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn one_failure_among_several_files_changes_none() {
        let d = dir();
        let a = d.join("a");
        std::fs::write(&a, b"A").unwrap();
        let missing = d.join("no-such-dir").join("b");
        write_all_atomic(&[(&a, b"A2"), (&missing, b"B2")]).unwrap_err();
        assert_eq!(std::fs::read(&a).unwrap(), b"A");
        assert_eq!(entries(&d), vec!["a".to_string()]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn a_replaced_file_keeps_its_permissions() {
        use std::os::unix::fs::PermissionsExt;
        let d = dir();
        let p = d.join("f");
        std::fs::write(&p, b"x").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
        write_atomic(&p, b"y").unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o640);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
