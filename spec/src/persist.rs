//! The on-disk format of a compressed cache (SPEC.md section 15).
//!
//! A file is a [`FileHeader`] followed by `section_count` sections, each a
//! [`SectionHeader`] and its payload. Everything is little-endian. The exact
//! byte layout of every section is written out in SPEC.md section 15; this
//! module is its only writer and reader.
//!
//! Loading never panics and never trusts a length: every read is bounds
//! checked with checked arithmetic, allocations are capped by the bytes that
//! remain, every CRC-32 is verified, and the parsed cache is validated
//! structurally (layouts, packed records, token counts) before it is
//! returned. Any failure is [`MosaicError::BadFormat`] (or `CorruptPacked`
//! for records that break SPEC.md section 6).

use crate::cache::{CompressedCache, DenseRows, HeadSegment, Segment, SegmentState};
use crate::config::{CompressConfig, KvShape};
use crate::error::{MosaicError, Result};
use crate::layout::{BlockMeta, PackedRows, RecordLayout, SideStrategy, Strategy, ValueDtype};
use half::f16;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

/// The file's first eight bytes.
pub const MAGIC: [u8; 8] = *b"MOSAICKV";
/// The format version this build writes and reads.
/// Version 7 (SPEC.md section 11.1): a key side's `fit_loss` is its loss against the keys'
/// spread about their mean (was against their energy); the drift rule of section 10.3
/// compares it with the open rows' loss of the same form, so a version-6 file, whose key
/// `fit_loss` is of the other form, is refused rather than continued with a mismatched rule.
/// Version 6 (SPEC.md sections 3, 15): rotations stored as f16 (2 bytes per element, was f32);
/// a version-5 file's f32 rotation would be misread as twice as many f16 values, so it is
/// refused.
/// Version 5 (SPEC.md section 8.3): the manifest's configuration carries `min_budget_tokens`;
/// a version-4 file, written before the budget floor existed, is refused rather than read
/// with a budget it was not written for.
/// Version 4 (SPEC.md sections 6, 15): value dtypes `int8` (tag 2) and `int4` (tag 3) beside
/// `f16` (tag 1), records of quantized sides carrying an f16 scale after the bitmap.
/// Version 3: record bitmaps in whole u32 words, records padded to 4 bytes. Version 2 added
/// int8 block bounds with an f32 scale per block (section 7). Files of versions 1 to 4 are
/// refused (a version-3 reader would misread a quantized record as f16 values).
pub const FORMAT_VERSION: u32 = 7;

/// File header (SPEC.md section 15.1), 24 bytes at offset 0.
///
/// `header_crc` is the CRC-32 of bytes `0..16` (magic, version, section count);
/// `reserved` must be 0. The struct documents the layout; bytes are written
/// and read field by field, little-endian.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileHeader {
    pub magic: [u8; 8],
    pub version: u32,
    pub section_count: u32,
    pub header_crc: u32,
    pub reserved: u32,
}

/// Section header (SPEC.md section 15.2), 16 bytes before every payload.
///
/// `crc` is the CRC-32 of the 4 little-endian bytes of `kind`, the 8 of
/// `length`, then the `length` payload bytes, so a flipped kind or length is
/// caught as surely as a flipped payload byte.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectionHeader {
    pub kind: u32,
    pub crc: u32,
    pub length: u64,
}

const FILE_HEADER_BYTES: usize = 24;
const SECTION_HEADER_BYTES: usize = 16;
const _: () = assert!(std::mem::size_of::<FileHeader>() == FILE_HEADER_BYTES);
const _: () = assert!(std::mem::size_of::<SectionHeader>() == SECTION_HEADER_BYTES);

/// Section kinds (SPEC.md section 15.3).
pub mod kind {
    /// JSON: shape, configuration, segment list. Always first in a cache file.
    pub const MANIFEST: u32 = 1;
    /// Sink rows (f16).
    pub const SINK_ROWS: u32 = 2;
    /// Update-buffer rows (f16).
    pub const BUFFER_ROWS: u32 = 3;
    /// One (segment, KV head): strategy, packed K, packed V, block metadata.
    pub const HEAD_SEGMENT: u32 = 4;
    /// Host-side f32 rows of the open segment and the buffer.
    pub const HOST_ROWS: u32 = 5;
    /// JSON: shape and role of a dense baseline file. Always first in a dense file.
    pub const DENSE_MANIFEST: u32 = 16;
    /// The dense f16 rows of a dense baseline file.
    pub const DENSE_ROWS: u32 = 17;
    /// JSON: shape and method of a naive 2-D or kvq baseline cache file (SPEC.md section
    /// 15.6). Always first in such a file.
    pub const BASELINE_MANIFEST: u32 = 18;
    /// The naive 2-D baseline's channel masks per KV head.
    pub const CHANNEL_MASKS: u32 = 19;
    /// The naive 2-D baseline's f16 rows of the masked channels.
    pub const MASKED_ROWS: u32 = 20;
    /// The kvq8 / kvq4 baseline's ggml blocks.
    pub const KVQ_BLOCKS: u32 = 21;
}

pub(crate) fn bad(msg: impl Into<String>) -> MosaicError {
    MosaicError::BadFormat(msg.into())
}

pub(crate) fn io_err(what: &str, e: std::io::Error) -> MosaicError {
    MosaicError::Io(format!("{what}: {e}"))
}

// ---------------------------------------------------------------- manifest

/// One segment's entry in the manifest section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SegmentEntry {
    start: usize,
    len: usize,
    state: SegmentState,
}

/// The manifest section of a cache file (JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Manifest {
    shape: KvShape,
    config: CompressConfig,
    segments: Vec<SegmentEntry>,
}

/// The manifest section of a dense baseline file (JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DenseManifest {
    pub(crate) shape: KvShape,
    pub(crate) role: String,
    /// Which baseline cache the rows are (SPEC.md section 15.5): absent in the input file
    /// `mosaickv compress` writes, `full` or `quest` in a baseline cache's saved file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) baseline: Option<crate::persist_baseline::BaselineMethod>,
}

pub(crate) const DENSE_ROLE: &str =
    "baseline input: dense f16 K/V, not part of the compressed cache";

// ---------------------------------------------------------------- writing

/// Little-endian payload builder.
#[derive(Default)]
pub(crate) struct Buf(pub(crate) Vec<u8>);

impl Buf {
    pub(crate) fn u32(&mut self, x: u32) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, x: usize) {
        self.0.extend_from_slice(&(x as u64).to_le_bytes());
    }
    fn f64(&mut self, x: f64) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn f32s(&mut self, xs: &[f32]) {
        self.0.reserve(4 * xs.len());
        for x in xs {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
    }
    fn i8s(&mut self, xs: &[i8]) {
        self.0.extend(xs.iter().map(|&x| x as u8));
    }
    pub(crate) fn f16s(&mut self, xs: &[f16]) {
        self.0.reserve(2 * xs.len());
        for x in xs {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
    }
}

pub(crate) fn small(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x).map_err(|_| {
        MosaicError::InvalidConfig(format!("{what} {x} does not fit the format's u32 field"))
    })
}

fn section_crc(kind: u32, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&kind.to_le_bytes());
    h.update(&(payload.len() as u64).to_le_bytes());
    h.update(payload);
    h.finalize()
}

pub(crate) fn write_file(w: &mut impl Write, sections: &[(u32, Vec<u8>)]) -> Result<()> {
    let count = small(sections.len(), "section count")?;
    let mut head = Vec::with_capacity(FILE_HEADER_BYTES);
    head.extend_from_slice(&MAGIC);
    head.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    head.extend_from_slice(&count.to_le_bytes());
    let crc = crc32fast::hash(&head);
    head.extend_from_slice(&crc.to_le_bytes());
    head.extend_from_slice(&0u32.to_le_bytes());
    w.write_all(&head)
        .map_err(|e| io_err("writing the file header", e))?;
    for (k, payload) in sections {
        let mut sh = Vec::with_capacity(SECTION_HEADER_BYTES);
        sh.extend_from_slice(&k.to_le_bytes());
        sh.extend_from_slice(&section_crc(*k, payload).to_le_bytes());
        sh.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        w.write_all(&sh)
            .map_err(|e| io_err("writing a section header", e))?;
        w.write_all(payload)
            .map_err(|e| io_err("writing a section", e))?;
    }
    w.flush().map_err(|e| io_err("flushing", e))
}

pub(crate) fn dense_payload(rows: &DenseRows) -> Vec<u8> {
    let mut b = Buf::default();
    b.u64(rows.tokens);
    b.f16s(&rows.keys);
    b.f16s(&rows.values);
    b.0
}

fn side_payload(b: &mut Buf, s: &SideStrategy) -> Result<()> {
    let l = &s.layout;
    b.u32(small(l.head_dim, "head_dim")?);
    b.u32(small(l.kept_dims, "kept_dims")?);
    b.u32(small(l.r, "r")?);
    b.u32(small(l.group_size, "group_size")?);
    b.u32(l.dtype as u32);
    // reserved for bitmap sides; a coded side's `code_bits` (SPEC.md sections 6.1, 15.3)
    b.u32(small(l.code_bits, "code_bits")?);
    b.f64(s.fit_loss);
    b.f16s(&s.rotation);
    if l.dtype == ValueDtype::Coded {
        b.0.extend(s.coding.iter().map(|c| c.bits));
        b.f16s(&s.coding.iter().map(|c| c.min).collect::<Vec<_>>());
        b.f16s(&s.coding.iter().map(|c| c.scale).collect::<Vec<_>>());
    }
    Ok(())
}

fn head_payload(seg: usize, head: usize, h: &HeadSegment) -> Result<Vec<u8>> {
    let mut b = Buf::default();
    b.u32(small(seg, "segment index")?);
    b.u32(small(head, "head index")?);
    b.u64(h.strategy.block_size);
    side_payload(&mut b, &h.strategy.key)?;
    side_payload(&mut b, &h.strategy.value)?;
    for rows in [&h.keys, &h.values] {
        b.u64(rows.count);
        b.u64(rows.bytes.len());
        b.0.extend_from_slice(&rows.bytes);
    }
    let m = &h.meta;
    b.u64(m.block_size);
    b.u64(m.kept_dims);
    b.u64(m.tokens);
    b.u64(m.min.len());
    b.i8s(&m.min);
    b.u64(m.max.len());
    b.i8s(&m.max);
    b.u64(m.scale.len());
    b.f32s(&m.scale);
    Ok(b.0)
}

pub(crate) fn json<T: Serialize>(x: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(x)
        .map_err(|e| MosaicError::InvalidConfig(format!("manifest does not serialize: {e}")))
}

/// Writes `cache` and its host rows in the format of SPEC.md section 15.
///
/// `host_keys` / `host_values` are the f32 rows `[tokens][kv_heads][head_dim]`
/// of the open segment followed by the buffer; both empty, or exactly that
/// many tokens. The cache is validated first (the same checks as
/// [`read_cache`]), so a file this writes always loads.
pub fn write_cache(
    w: &mut impl Write,
    cache: &CompressedCache,
    host_keys: &[f32],
    host_values: &[f32],
) -> Result<()> {
    validate_structure(cache, host_keys, host_values)?;
    cache.check_records_finite()?;
    cache.check_block_bounds()?;
    let manifest = Manifest {
        shape: cache.shape,
        config: cache.config.clone(),
        segments: cache
            .segments
            .iter()
            .map(|s| SegmentEntry {
                start: s.start,
                len: s.len,
                state: s.state,
            })
            .collect(),
    };
    let mut sections = vec![
        (kind::MANIFEST, json(&manifest)?),
        (kind::SINK_ROWS, dense_payload(&cache.sink)),
        (kind::BUFFER_ROWS, dense_payload(&cache.buffer)),
    ];
    for (si, seg) in cache.segments.iter().enumerate() {
        for (hi, h) in seg.heads.iter().enumerate() {
            sections.push((kind::HEAD_SEGMENT, head_payload(si, hi, h)?));
        }
    }
    let row = cache.shape.kv_heads * cache.shape.head_dim;
    let mut b = Buf::default();
    b.u64(host_keys.len() / row);
    b.f32s(host_keys);
    b.f32s(host_values);
    sections.push((kind::HOST_ROWS, b.0));
    write_file(w, &sections)
}

/// Writes a dense baseline file: the f16 K/V rows `[tokens][kv_heads][head_dim]`
/// of a whole prompt, for the full / Quest / naive 2-D baselines (SPEC.md
/// section 15.5). It is not a compressed cache; [`read_cache`] refuses it.
pub fn write_dense(w: &mut impl Write, shape: &KvShape, rows: &DenseRows) -> Result<()> {
    crate::check::validate_dense(shape, rows, "dense rows")?;
    let manifest = DenseManifest {
        shape: *shape,
        role: DENSE_ROLE.to_string(),
        baseline: None,
    };
    write_file(
        w,
        &[
            (kind::DENSE_MANIFEST, json(&manifest)?),
            (kind::DENSE_ROWS, dense_payload(rows)),
        ],
    )
}

// ---------------------------------------------------------------- reading

/// Bounds-checked little-endian reader over one payload.
pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    what: &'a str,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(bytes: &'a [u8], what: &'a str) -> Self {
        Self {
            bytes,
            pos: 0,
            what,
        }
    }
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(bad(format!(
                "{}: needs {n} more bytes at offset {}, only {} left",
                self.what,
                self.pos,
                self.remaining()
            )));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub(crate) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    /// A u64 count or length as usize.
    pub(crate) fn size(&mut self, field: &str) -> Result<usize> {
        let x = self.u64()?;
        usize::try_from(x)
            .map_err(|_| bad(format!("{}: {field} {x} does not fit in memory", self.what)))
    }
    fn f64(&mut self) -> Result<f64> {
        Ok(f64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    /// `n` elements of `size` bytes, checked against the remaining bytes before allocating.
    pub(crate) fn array(&mut self, n: usize, size: usize, field: &str) -> Result<&'a [u8]> {
        let len = n
            .checked_mul(size)
            .ok_or_else(|| bad(format!("{}: {field} count {n} overflows", self.what)))?;
        self.take(len)
    }
    fn f32s(&mut self, n: usize, field: &str) -> Result<Vec<f32>> {
        let raw = self.array(n, 4, field)?;
        Ok(raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }
    fn i8s(&mut self, n: usize, field: &str) -> Result<Vec<i8>> {
        Ok(self.array(n, 1, field)?.iter().map(|&x| x as i8).collect())
    }
    pub(crate) fn f16s(&mut self, n: usize, field: &str) -> Result<Vec<f16>> {
        let raw = self.array(n, 2, field)?;
        Ok(raw
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]))
            .collect())
    }
    pub(crate) fn finish(&self) -> Result<()> {
        if self.remaining() != 0 {
            return Err(bad(format!(
                "{}: {} unexpected trailing bytes",
                self.what,
                self.remaining()
            )));
        }
        Ok(())
    }
}

/// Splits a file into verified `(kind, payload)` sections.
/// The checks of the 24-byte file header (SPEC.md section 15.1) that need nothing after it:
/// magic, version, header checksum, reserved field. Returns the section count.
fn check_file_header(bytes: &[u8]) -> Result<u32> {
    if bytes.len() < 8 || bytes[..8] != MAGIC {
        return Err(bad(
            "not a MosaicKV file (the magic bytes `MOSAICKV` are missing)",
        ));
    }
    let mut c = Cursor::new(bytes, "file header");
    c.take(8)?;
    let version = c.u32()?;
    if version != FORMAT_VERSION {
        return Err(bad(format!(
            "unsupported format version {version} (this build reads version {FORMAT_VERSION})"
        )));
    }
    let count = c.u32()?;
    let crc = c.u32()?;
    let reserved = c.u32()?;
    // Fuzz builds (cargo-fuzz sets `cfg(fuzzing)`) skip both checksums, so that mutated
    // inputs reach the section decoders instead of stopping here.
    if !cfg!(fuzzing) && crc32fast::hash(&bytes[..16]) != crc {
        return Err(bad("file header checksum mismatch"));
    }
    if reserved != 0 {
        return Err(bad("file header reserved field is not zero"));
    }
    Ok(count)
}

/// Reads a MosaicKV file whole for the `load_*` functions, but only a regular file, and
/// only once its 24-byte header has passed [`check_file_header`]: a device (`/dev/zero`),
/// a pipe or a file that is not ours is refused before anything is allocated, and what is
/// read is bounded by the file's size as it was when opened.
pub(crate) fn read_file(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let name = path.display().to_string();
    // checked before opening too: opening a named pipe with no writer blocks
    let before = std::fs::metadata(path).map_err(|e| io_err(&name, e))?;
    if !before.is_file() {
        return Err(bad(format!(
            "{name}: not a regular file (a MosaicKV file is read from disk whole)"
        )));
    }
    let file = std::fs::File::open(path).map_err(|e| io_err(&name, e))?;
    let meta = file.metadata().map_err(|e| io_err(&name, e))?;
    if !meta.is_file() {
        return Err(bad(format!(
            "{name}: not a regular file (a MosaicKV file is read from disk whole)"
        )));
    }
    let size = usize::try_from(meta.len())
        .map_err(|_| bad(format!("{name}: {} bytes do not fit in memory", meta.len())))?;
    let mut bytes = Vec::with_capacity(FILE_HEADER_BYTES.min(size));
    let mut limited = file.take(meta.len());
    (&mut limited)
        .take(FILE_HEADER_BYTES as u64)
        .read_to_end(&mut bytes)
        .map_err(|e| io_err(&name, e))?;
    // (a file shorter than the header fails here too: truncated, or not ours)
    check_file_header(&bytes).map_err(|e| with_path(path, e))?;
    bytes.reserve_exact(size - bytes.len());
    limited
        .read_to_end(&mut bytes)
        .map_err(|e| io_err(&name, e))?;
    Ok(bytes)
}

pub(crate) fn read_sections(bytes: &[u8]) -> Result<Vec<(u32, &[u8])>> {
    let count = check_file_header(bytes)?;
    let mut c = Cursor::new(bytes, "file header");
    c.take(FILE_HEADER_BYTES)?;
    // Each section needs at least its header, which bounds the allocation.
    let count = usize::try_from(count).map_err(|_| bad("section count does not fit"))?;
    if count > c.remaining() / SECTION_HEADER_BYTES {
        return Err(bad(format!(
            "truncated: header announces {count} sections, only {} bytes follow",
            c.remaining()
        )));
    }
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let k = c
            .u32()
            .map_err(|_| bad(format!("truncated in the header of section {i}")))?;
        let crc = c
            .u32()
            .map_err(|_| bad(format!("truncated in the header of section {i}")))?;
        let len = c
            .u64()
            .map_err(|_| bad(format!("truncated in the header of section {i}")))?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= c.remaining())
            .ok_or_else(|| {
                bad(format!(
                    "truncated: section {i} announces {len} bytes, {} remain",
                    c.remaining()
                ))
            })?;
        let payload = c.take(len)?;
        if !cfg!(fuzzing) && section_crc(k, payload) != crc {
            return Err(bad(format!("checksum mismatch in section {i} (kind {k})")));
        }
        out.push((k, payload));
    }
    if c.remaining() != 0 {
        return Err(bad(format!(
            "{} trailing bytes after the last section",
            c.remaining()
        )));
    }
    Ok(out)
}

pub(crate) fn expect_kind(
    sections: &[(u32, &[u8])],
    i: usize,
    want: u32,
    name: &str,
) -> Result<()> {
    match sections.get(i) {
        None => Err(bad(format!("missing {name} section (section {i})"))),
        Some((k, _)) if *k != want => Err(bad(format!(
            "section {i} is kind {k}, expected {name} (kind {want})"
        ))),
        Some(_) => Ok(()),
    }
}

pub(crate) fn parse_json<'de, T: Deserialize<'de>>(payload: &'de [u8], what: &str) -> Result<T> {
    // Every JSON section is an object of named fields; serde would also read a struct from an
    // array (fields by position), which no writer produces.
    match serde_json::from_slice::<serde_json::Value>(payload) {
        Ok(serde_json::Value::Object(_)) | Err(_) => {}
        Ok(other) => {
            return Err(bad(format!(
                "{what}: a JSON object was expected, not {}",
                crate::config::json_kind(&other)
            )))
        }
    }
    serde_json::from_slice(payload).map_err(|e| bad(format!("{what}: {e}")))
}

pub(crate) fn parse_dense(payload: &[u8], shape: &KvShape, what: &str) -> Result<DenseRows> {
    let mut c = Cursor::new(payload, what);
    let tokens = c.size("tokens")?;
    let n = tokens
        .checked_mul(shape.kv_heads)
        .and_then(|x| x.checked_mul(shape.head_dim))
        .ok_or_else(|| bad(format!("{what}: {tokens} tokens overflow")))?;
    let keys = c.f16s(n, "keys")?;
    let values = c.f16s(n, "values")?;
    c.finish()?;
    Ok(DenseRows {
        tokens,
        keys,
        values,
    })
}

fn parse_side(c: &mut Cursor, shape: &KvShape) -> Result<SideStrategy> {
    let head_dim = c.u32()? as usize;
    let kept_dims = c.u32()? as usize;
    let r = c.u32()? as usize;
    let group_size = c.u32()? as usize;
    let tag = c.u32()?;
    let dtype = u8::try_from(tag)
        .map_err(|_| bad(format!("unknown value dtype tag {tag}")))
        .and_then(|t| {
            ValueDtype::from_tag(t).map_err(|_| bad(format!("unknown value dtype tag {tag}")))
        })?;
    // reserved (0) for bitmap sides; a coded side's `code_bits` (SPEC.md section 15.3)
    let code_bits = c.u32()? as usize;
    if dtype != ValueDtype::Coded && code_bits != 0 {
        return Err(bad(format!("{}: reserved field is not zero", c.what)));
    }
    let fit_loss = c.f64()?;
    if head_dim != shape.head_dim {
        return Err(bad(format!(
            "{}: head_dim {head_dim}, the manifest says {}",
            c.what, shape.head_dim
        )));
    }
    // The stored rotation is D x Dt (SPEC.md section 3 step 4).
    let n = head_dim
        .checked_mul(kept_dims)
        .ok_or_else(|| bad("rotation size overflows"))?;
    let rotation = c.f16s(n, "rotation")?;
    let coding = if dtype == ValueDtype::Coded {
        let widths = c.array(kept_dims, 1, "coded widths")?.to_vec();
        let mins = c.f16s(kept_dims, "coded offsets")?;
        let steps = c.f16s(kept_dims, "coded steps")?;
        widths
            .into_iter()
            .zip(mins)
            .zip(steps)
            .map(|((bits, min), scale)| crate::coded::DimCode { bits, min, scale })
            .collect()
    } else {
        Vec::new()
    };
    Ok(SideStrategy {
        layout: RecordLayout {
            head_dim,
            kept_dims,
            r,
            group_size,
            dtype,
            code_bits,
        },
        rotation,
        fit_loss,
        coding,
    })
}

fn parse_head(payload: &[u8], shape: &KvShape, seg: usize, head: usize) -> Result<HeadSegment> {
    let what = format!("segment {seg} head {head}");
    let mut c = Cursor::new(payload, &what);
    let (s, h) = (c.u32()? as usize, c.u32()? as usize);
    if (s, h) != (seg, head) {
        return Err(bad(format!(
            "{what}: section is labelled segment {s} head {h}"
        )));
    }
    let block_size = c.size("block_size")?;
    let key = parse_side(&mut c, shape)?;
    let value = parse_side(&mut c, shape)?;
    let mut packed = || -> Result<PackedRows> {
        let count = c.size("record count")?;
        let len = c.size("record bytes")?;
        let bytes = c.take(len)?.to_vec();
        Ok(PackedRows { count, bytes })
    };
    let keys = packed()?;
    let values = packed()?;
    let meta_block = c.size("meta block_size")?;
    let meta_kept = c.size("meta kept_dims")?;
    let meta_tokens = c.size("meta tokens")?;
    let n_min = c.size("meta min count")?;
    let min = c.i8s(n_min, "meta min")?;
    let n_max = c.size("meta max count")?;
    let max = c.i8s(n_max, "meta max")?;
    let n_scale = c.size("meta scale count")?;
    let scale = c.f32s(n_scale, "meta scale")?;
    c.finish()?;
    Ok(HeadSegment {
        strategy: Strategy {
            key,
            value,
            block_size,
        },
        keys,
        values,
        meta: BlockMeta {
            block_size: meta_block,
            kept_dims: meta_kept,
            tokens: meta_tokens,
            min,
            max,
            scale,
        },
    })
}

/// Turns a validation error of a loaded file into `BadFormat` (keeping `CorruptPacked`).
pub(crate) fn as_format_error(e: MosaicError) -> MosaicError {
    match e {
        MosaicError::BadFormat(_) | MosaicError::CorruptPacked(_) => e,
        other => bad(format!("invalid content: {other}")),
    }
}

/// Reads a cache file (SPEC.md section 15): the cache, then the host key and
/// value rows (both empty when the file has none). Never panics; any defect
/// is `BadFormat` or `CorruptPacked`.
pub fn read_cache(bytes: &[u8]) -> Result<(CompressedCache, Vec<f32>, Vec<f32>)> {
    let sections = read_sections(bytes)?;
    if let Some((kind::DENSE_MANIFEST | kind::BASELINE_MANIFEST, _)) = sections.first() {
        return Err(bad(format!(
            "this is {}, not a compressed cache",
            crate::persist_baseline::describe_sections(&sections)
        )));
    }
    expect_kind(&sections, 0, kind::MANIFEST, "manifest")?;
    let m: Manifest = parse_json(sections[0].1, "manifest")?;
    let shape = KvShape::new(m.shape.kv_heads, m.shape.q_heads, m.shape.head_dim)
        .map_err(as_format_error)?;
    if shape != m.shape {
        return Err(bad("manifest shape does not validate"));
    }
    m.config.validate(shape.head_dim).map_err(as_format_error)?;
    let heads_total = m
        .segments
        .len()
        .checked_mul(shape.kv_heads)
        .and_then(|x| x.checked_add(4))
        .ok_or_else(|| bad("segment count overflows"))?;
    if sections.len() != heads_total {
        return Err(bad(format!(
            "{} sections, expected {heads_total} for {} segments of {} heads",
            sections.len(),
            m.segments.len(),
            shape.kv_heads
        )));
    }
    expect_kind(&sections, 1, kind::SINK_ROWS, "sink rows")?;
    let sink = parse_dense(sections[1].1, &shape, "sink rows")?;
    expect_kind(&sections, 2, kind::BUFFER_ROWS, "buffer rows")?;
    let buffer = parse_dense(sections[2].1, &shape, "buffer rows")?;
    let mut segments = Vec::with_capacity(m.segments.len());
    let mut next = 3;
    for (si, e) in m.segments.iter().enumerate() {
        let mut heads = Vec::with_capacity(shape.kv_heads);
        for hi in 0..shape.kv_heads {
            expect_kind(&sections, next, kind::HEAD_SEGMENT, "head segment")?;
            heads.push(parse_head(sections[next].1, &shape, si, hi)?);
            next += 1;
        }
        segments.push(Segment {
            start: e.start,
            len: e.len,
            state: e.state,
            heads,
        });
    }
    expect_kind(&sections, next, kind::HOST_ROWS, "host rows")?;
    let mut c = Cursor::new(sections[next].1, "host rows");
    let host_tokens = c.size("tokens")?;
    let n = host_tokens
        .checked_mul(shape.kv_heads)
        .and_then(|x| x.checked_mul(shape.head_dim))
        .ok_or_else(|| bad("host rows: token count overflows"))?;
    let host_keys = c.f32s(n, "keys")?;
    let host_values = c.f32s(n, "values")?;
    c.finish()?;
    let cache = CompressedCache {
        shape,
        config: m.config,
        sink,
        segments,
        buffer,
    };
    validate_structure(&cache, &host_keys, &host_values).map_err(as_format_error)?;
    cache.check_records_finite()?;
    cache.check_block_bounds()?;
    Ok((cache, host_keys, host_values))
}

/// Reads a dense baseline file written by [`write_dense`] (or a full / quest cache's file,
/// SPEC.md section 15.5): its shape and rows, validated as
/// [`crate::persist_baseline::BaselineFile::validate`] says.
pub fn read_dense(bytes: &[u8]) -> Result<(KvShape, DenseRows)> {
    let sections = read_sections(bytes)?;
    if let Some((kind::MANIFEST | kind::BASELINE_MANIFEST, _)) = sections.first() {
        return Err(bad(format!(
            "this is {}, not a dense baseline file",
            crate::persist_baseline::describe_sections(&sections)
        )));
    }
    let (shape, _, rows) = crate::persist_baseline::parse_dense_file(&sections)?;
    Ok((shape, rows))
}

// ---------------------------------------------------------------- structure

/// Checks a cache's structure (SPEC.md section 15.4): everything
/// [`CompressedCache::validate`] checks, then the host rows' token count.
/// Called by [`write_cache`] and [`read_cache`].
pub fn validate_structure(
    cache: &CompressedCache,
    host_keys: &[f32],
    host_values: &[f32],
) -> Result<()> {
    cache.validate()?;
    let shape = &cache.shape;
    let open = match cache.segments.last() {
        Some(s) if s.state == SegmentState::Open => s.len,
        _ => 0,
    };
    let row = shape.kv_heads * shape.head_dim; // no overflow: KvShape::new checked it
    let expected = (open + cache.buffer.tokens).saturating_mul(row);
    if host_keys.len() != host_values.len()
        || !(host_keys.is_empty() || host_keys.len() == expected)
    {
        return Err(MosaicError::ShapeMismatch {
            what: "host rows",
            expected: format!(
                "none, or {} open-segment + buffer tokens ({expected} keys and values)",
                open + cache.buffer.tokens
            ),
            got: format!("{} keys, {} values", host_keys.len(), host_values.len()),
        });
    }
    Ok(())
}

// ---------------------------------------------------------------- paths

/// Writes a cache file at `path` (see [`write_cache`]); I/O errors name the path.
pub fn save_cache(
    path: &Path,
    cache: &CompressedCache,
    host_keys: &[f32],
    host_values: &[f32],
) -> Result<()> {
    let mut buf = Vec::new();
    write_cache(&mut buf, cache, host_keys, host_values)?;
    crate::atomic::write_atomic(path, &buf).map_err(|e| io_err(&path.display().to_string(), e))
}

/// Reads a cache file at `path` (see [`read_cache`]); errors name the path.
pub fn load_cache(path: &Path) -> Result<(CompressedCache, Vec<f32>, Vec<f32>)> {
    let bytes = read_file(path)?;
    read_cache(&bytes).map_err(|e| with_path(path, e))
}

/// Writes a dense baseline file at `path` (see [`write_dense`]).
pub fn save_dense(path: &Path, shape: &KvShape, rows: &DenseRows) -> Result<()> {
    let mut buf = Vec::new();
    write_dense(&mut buf, shape, rows)?;
    crate::atomic::write_atomic(path, &buf).map_err(|e| io_err(&path.display().to_string(), e))
}

/// Reads a dense baseline file at `path` (see [`read_dense`]).
pub fn load_dense(path: &Path) -> Result<(KvShape, DenseRows)> {
    let bytes = read_file(path)?;
    read_dense(&bytes).map_err(|e| with_path(path, e))
}

pub(crate) fn with_path(path: &Path, e: MosaicError) -> MosaicError {
    match e {
        MosaicError::BadFormat(m) => MosaicError::BadFormat(format!("{}: {m}", path.display())),
        MosaicError::CorruptPacked(m) => {
            MosaicError::CorruptPacked(format!("{}: {m}", path.display()))
        }
        other => other,
    }
}
