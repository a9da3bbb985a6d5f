//! Stored prefills (issue 36): the dense prefill of a prompt, computed once and kept under
//! `$MOSAICKV_HOME/prefills/`, so that every method, rerun and later run of a long-context
//! suite decodes from it instead of paying the prefill again (at 32K tokens a prefill is
//! minutes to a quarter of an hour on two cores; decoding one method is far less).
//!
//! A stored prefill is keyed by the sha256 of: the model's identity (a known model's pinned
//! sha256, else the file's canonical path, size and modification time), the prompt's token
//! ids, whether query statistics were computed, `MOSAICKV_PREFILL_CODE` (`build.rs`: a hash
//! of the forward pass's code and of the Cargo.lock entries of candle, gemm and half) and, past
//! `AMX_PREFILL_TOKENS`, the products' kind (bf16 on AMX tiles or f32). It holds exactly what
//! [`Model::prefill`] / [`Model::prefill_with_stats`] return (f32 keys and values per layer,
//! the last position's logits, the query statistics), so a method decodes from it bit for bit
//! as from a fresh prefill.
//!
//! File: `MKVPFX01`, a u64 header length, a JSON header, the arrays little-endian in order
//! (per layer keys then values `[tokens][kv_heads][head_dim]` f32; logits f32; per layer the
//! query statistics' four f64 arrays), then a CRC-32 of everything after the magic. Written
//! atomically (`mosaickv_spec::atomic`). A file that does not check out (truncated, another
//! shape, a bad checksum) is a miss: the prefill is computed again and the file replaced.

use crate::model::{Model, Prefill};
use crate::{EngineError, Result};
use mosaickv_spec::query::QueryStats;
use ndarray::Array3;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"MKVPFX01";

/// The code a prefill's numbers depend on (`build.rs`).
pub const PREFILL_CODE: &str = env!("MOSAICKV_PREFILL_CODE");
/// The code an evaluation's results depend on (`build.rs`): the key of a run log.
pub const RESULTS_CODE: &str = env!("MOSAICKV_RESULTS_CODE");

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Header {
    key: String,
    layers: usize,
    tokens: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    stats: bool,
}

/// Where stored prefills live, for one model.
#[derive(Debug, Clone)]
pub struct PrefillStore {
    dir: PathBuf,
    model_id: String,
}

/// Where a prefill came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Read from the store.
    Stored,
    /// Computed now (and stored).
    Computed,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> EngineError + '_ {
    move |source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl PrefillStore {
    /// The store under `home` (`$MOSAICKV_HOME`) for the model file at `model_path`.
    pub fn new(home: &Path, model_path: &Path) -> Result<Self> {
        let meta = std::fs::metadata(model_path).map_err(io(model_path))?;
        let name = model_path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("");
        let model_id = match crate::KNOWN_MODELS
            .iter()
            .find(|m| m.file_name == name && m.size == meta.len())
        {
            Some(m) => format!("sha256:{}", m.sha256),
            None => {
                let canon = std::fs::canonicalize(model_path).map_err(io(model_path))?;
                let mtime = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_nanos());
                format!("file:{}:{}:{mtime}", canon.display(), meta.len())
            }
        };
        Ok(Self {
            dir: home.join("prefills"),
            model_id,
        })
    }

    /// The key of a prompt's prefill (module doc).
    pub fn key(&self, ids: &[u32], stats: bool) -> String {
        let mut h = Sha256::new();
        h.update(b"mosaickv prefill v1\0");
        h.update(self.model_id.as_bytes());
        h.update([0, u8::from(stats)]);
        h.update(PREFILL_CODE.as_bytes());
        if ids.len() > crate::model::AMX_PREFILL_TOKENS {
            // bf16 products on AMX tiles, or f32 (`Model::prefill_weights`)
            h.update(crate::model::long_prefill_products().as_bytes());
        }
        h.update((ids.len() as u64).to_le_bytes());
        for t in ids {
            h.update(t.to_le_bytes());
        }
        let d = h.finalize();
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The file that holds (or would hold) the prefill of `key`.
    pub fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.mkvp"))
    }

    /// The prompt's prefill: read from the store when a valid file is there, else computed
    /// with `model` and stored. `stats`: with the query statistics of SPEC.md section 11.1.
    pub fn prefill(&self, model: &Model, ids: &[u32], stats: bool) -> Result<(Prefill, Origin)> {
        let key = self.key(ids, stats);
        let path = self.path(&key);
        if path.is_file() {
            if let Ok(p) = read(&path, &key, model, ids.len(), stats) {
                return Ok((p, Origin::Stored));
            }
            // damaged or of another shape: computed again below, and replaced
        }
        let p = if stats {
            model.prefill_with_stats(ids)?
        } else {
            model.prefill(ids)?
        };
        std::fs::create_dir_all(&self.dir).map_err(io(&self.dir))?;
        write(&path, &key, model, &p, stats)?;
        Ok((p, Origin::Computed))
    }

    /// The model's identity as the keys use it (module doc).
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// The directory files are stored in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// A `Write` that also feeds a CRC-32.
struct Crc<W> {
    inner: W,
    crc: crc32fast::Hasher,
}

impl<W: Write> Write for Crc<W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(b)?;
        self.crc.update(&b[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes `xs` little-endian (`le`: the value's bytes), in chunks of 64K values.
fn put<T: Copy, const N: usize>(
    w: &mut impl Write,
    xs: &[T],
    le: fn(T) -> [u8; N],
) -> std::io::Result<()> {
    for c in xs.chunks(1 << 16) {
        let b: Vec<u8> = c.iter().flat_map(|&x| le(x)).collect();
        w.write_all(&b)?;
    }
    Ok(())
}

fn write(path: &Path, key: &str, model: &Model, p: &Prefill, stats: bool) -> Result<()> {
    let c = model.config();
    let header = Header {
        key: key.to_string(),
        layers: p.keys.len(),
        tokens: p.len(),
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        vocab: p.logits.len(),
        stats,
    };
    let json = serde_json::to_vec(&header).map_err(|e| EngineError::Invalid(e.to_string()))?;
    let pending = mosaickv_spec::atomic::Pending::prepare(path, |f| {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
        w.write_all(MAGIC)?;
        let mut w = Crc {
            inner: w,
            crc: crc32fast::Hasher::new(),
        };
        w.write_all(&(json.len() as u64).to_le_bytes())?;
        w.write_all(&json)?;
        for (k, v) in p.keys.iter().zip(&p.values) {
            for a in [k, v] {
                let s = a.as_standard_layout();
                put(
                    &mut w,
                    s.as_slice().expect("standard layout"),
                    f32::to_le_bytes,
                )?;
            }
        }
        put(&mut w, &p.logits, f32::to_le_bytes)?;
        if stats {
            for q in &p.query_stats {
                for xs in [&q.key_moment, &q.key_weight, &q.value_weight, &q.output_sq] {
                    put(&mut w, xs, f64::to_le_bytes)?;
                }
            }
        }
        let crc = w.crc.clone().finalize();
        let mut inner = w.inner;
        inner.write_all(&crc.to_le_bytes())?;
        inner.flush()
    })
    .map_err(io(path))?;
    pending.commit().map_err(io(path))
}

/// A stored prefill read by its path alone (for measurements on a stored prompt): the key,
/// token count and statistics flag come from the file's own header, the shape is checked
/// against `model` and the checksum as for any read.
pub fn read_stored(path: &Path, model: &Model) -> Result<Prefill> {
    let bad = |m: &str| EngineError::Format(format!("{}: {m}", path.display()));
    let mut r = std::io::BufReader::new(std::fs::File::open(path).map_err(io(path))?);
    let mut head = [0u8; 16];
    r.read_exact(&mut head).map_err(io(path))?;
    if &head[..8] != MAGIC {
        return Err(bad("not a stored prefill"));
    }
    let hl = u64::from_le_bytes(head[8..].try_into().expect("8"));
    if hl > 1 << 16 {
        return Err(bad("header too long"));
    }
    let mut json = vec![0u8; hl as usize];
    r.read_exact(&mut json).map_err(io(path))?;
    let h: Header = serde_json::from_slice(&json).map_err(|_| bad("bad header"))?;
    read(path, &h.key, model, h.tokens, h.stats)
}

struct CrcRead<R> {
    inner: R,
    crc: crc32fast::Hasher,
}

impl<R: Read> CrcRead<R> {
    fn exact(&mut self, n: usize) -> std::io::Result<Vec<u8>> {
        let mut b = vec![0u8; n];
        self.inner.read_exact(&mut b)?;
        self.crc.update(&b);
        Ok(b)
    }
    /// `n` little-endian values (`le`: a value from its bytes), in chunks of 64K values.
    fn values<T, const N: usize>(
        &mut self,
        n: usize,
        le: fn([u8; N]) -> T,
    ) -> std::io::Result<Vec<T>> {
        let mut out = Vec::with_capacity(n);
        let mut left = n;
        while left > 0 {
            let m = left.min(1 << 16);
            let b = self.exact(N * m)?;
            out.extend(
                b.chunks_exact(N)
                    .map(|c| le(c.try_into().expect("N bytes"))),
            );
            left -= m;
        }
        Ok(out)
    }
}

fn read(path: &Path, key: &str, model: &Model, tokens: usize, stats: bool) -> Result<Prefill> {
    let bad = |m: &str| EngineError::Format(format!("{}: {m}", path.display()));
    let c = model.config();
    let want = Header {
        key: key.to_string(),
        layers: c.n_layers,
        tokens,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        vocab: c.vocab,
        stats,
    };
    let per_layer = tokens
        .checked_mul(c.kv_heads * c.head_dim)
        .ok_or_else(|| bad("too large"))?;
    // the exact size the header implies, checked before anything large is read
    let d2 = c.kv_heads * c.head_dim * c.head_dim;
    let stats_bytes = if stats {
        c.n_layers * 8 * (d2 + 2 * tokens * c.kv_heads + c.kv_heads)
    } else {
        0
    };
    let file = std::fs::File::open(path).map_err(io(path))?;
    let len = file.metadata().map_err(io(path))?.len() as usize;
    let mut r = std::io::BufReader::with_capacity(1 << 20, file);
    let mut magic = [0u8; 8];
    r.read_exact(&mut magic).map_err(io(path))?;
    if &magic != MAGIC {
        return Err(bad("not a stored prefill"));
    }
    let mut r = CrcRead {
        inner: r,
        crc: crc32fast::Hasher::new(),
    };
    let hl = u64::from_le_bytes(r.exact(8).map_err(io(path))?.try_into().expect("8"));
    if hl > 1 << 16 {
        return Err(bad("header too long"));
    }
    let header: Header = serde_json::from_slice(&r.exact(hl as usize).map_err(io(path))?)
        .map_err(|_| bad("bad header"))?;
    if header != want {
        return Err(bad("another prompt, model or shape"));
    }
    let expect = 8 + 8 + hl as usize + 4 * (2 * c.n_layers * per_layer + c.vocab) + stats_bytes + 4;
    if len != expect {
        return Err(bad("wrong size"));
    }
    let shape = (tokens, c.kv_heads, c.head_dim);
    let mut keys = Vec::with_capacity(c.n_layers);
    let mut values = Vec::with_capacity(c.n_layers);
    for _ in 0..c.n_layers {
        for out in [&mut keys, &mut values] {
            let v = r.values(per_layer, f32::from_le_bytes).map_err(io(path))?;
            out.push(Array3::from_shape_vec(shape, v).map_err(|_| bad("shape"))?);
        }
    }
    let logits = r.values(c.vocab, f32::from_le_bytes).map_err(io(path))?;
    let mut query_stats = Vec::new();
    if stats {
        for _ in 0..c.n_layers {
            query_stats.push(QueryStats {
                kv_heads: c.kv_heads,
                head_dim: c.head_dim,
                key_moment: r.values(d2, f64::from_le_bytes).map_err(io(path))?,
                key_weight: r
                    .values(tokens * c.kv_heads, f64::from_le_bytes)
                    .map_err(io(path))?,
                value_weight: r
                    .values(tokens * c.kv_heads, f64::from_le_bytes)
                    .map_err(io(path))?,
                output_sq: r.values(c.kv_heads, f64::from_le_bytes).map_err(io(path))?,
            });
        }
    }
    let crc = r.crc.clone().finalize();
    let mut stored = [0u8; 4];
    r.inner.read_exact(&mut stored).map_err(io(path))?;
    if u32::from_le_bytes(stored) != crc {
        return Err(bad("checksum mismatch"));
    }
    Ok(Prefill {
        keys,
        values,
        logits,
        queries: Vec::new(),
        query_stats,
    })
}
