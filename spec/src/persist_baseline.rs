//! The files of the baseline caches (SPEC.md sections 15.5 and 15.6).
//!
//! - Full and Quest keep nothing but the f16 rows (Quest's page bounds are recomputed from
//!   them exactly), so their file is the dense baseline file `dense.mkv` of section 15.5 with
//!   the method recorded in its manifest.
//! - Naive 2-D keeps only its masked channels and kvq8 / kvq4 only ggml blocks, neither of
//!   which a dense file can hold: their file is a baseline cache file (section 15.6), the same
//!   header and section framing as every MosaicKV file, a manifest of kind 18, then
//!   the method's sections.
//!
//! As in [`crate::persist`], loading never panics and never trusts a length; each file is
//! validated ([`BaselineFile::validate`]) before it is written and after it is read, so a
//! written file always loads, and a reader handed another kind of file names what it found.

use crate::cache::DenseRows;
use crate::config::KvShape;
use crate::error::{MosaicError, Result};
use crate::persist::{
    as_format_error, bad, dense_payload, expect_kind, io_err, json, kind, parse_dense, parse_json,
    read_sections, small, with_path, write_file, Buf, Cursor, DenseManifest,
};
use half::f16;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

/// Which baseline cache a file holds, with the parameters it was built with (SPEC.md
/// section 12). Serialized in the manifest as `{"method": "quest", "token_rate": 0.2,
/// "min_budget_tokens": 256}` (the budget floor of section 8.3; omitted when 0).
#[allow(clippy::derive_partial_eq_without_eq)]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "method", rename_all = "lowercase", deny_unknown_fields)]
pub enum BaselineMethod {
    Full,
    Quest {
        token_rate: f64,
        #[serde(default, skip_serializing_if = "is_zero")]
        min_budget_tokens: usize,
    },
    Naive2d {
        token_rate: f64,
        retention: f64,
        #[serde(default, skip_serializing_if = "is_zero")]
        min_budget_tokens: usize,
    },
    Kvq8,
    Kvq4,
}

fn is_zero(x: &usize) -> bool {
    *x == 0
}

impl BaselineMethod {
    /// The method name of SPEC.md section 12 (`full`, `quest`, `naive2d`, `kvq8`, `kvq4`).
    pub fn name(&self) -> &'static str {
        match self {
            BaselineMethod::Full => "full",
            BaselineMethod::Quest { .. } => "quest",
            BaselineMethod::Naive2d { .. } => "naive2d",
            BaselineMethod::Kvq8 => "kvq8",
            BaselineMethod::Kvq4 => "kvq4",
        }
    }

    /// `token_rate` and `retention` in (0, 1], as the caches require.
    fn validate(&self) -> Result<()> {
        let rate =
            |what: &str, x: f64| crate::rules::fraction(&format!("{} {what}", self.name()), x);
        match *self {
            BaselineMethod::Quest { token_rate, .. } => rate("token_rate", token_rate),
            BaselineMethod::Naive2d {
                token_rate,
                retention,
                ..
            } => rate("token_rate", token_rate).and(rate("retention", retention)),
            _ => Ok(()),
        }
    }
}

/// A naive 2-D cache (SPEC.md section 12): per KV head the key and value channel masks
/// (ascending dims, `kept` each) once the first rows fixed them, and the f16 rows of the
/// masked channels, `[token][kv head][kept]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Naive2dFile {
    pub shape: KvShape,
    pub token_rate: f64,
    pub retention: f64,
    /// The budget floor of SPEC.md section 8.3 (0: none).
    pub min_budget_tokens: usize,
    /// `(key masks, value masks)`, one list per KV head; `None` before any row arrived.
    pub masks: Option<(Vec<Vec<usize>>, Vec<Vec<usize>>)>,
    pub rows: DenseRows,
}

impl Naive2dFile {
    /// Channels kept per vector: `c = ceil(retention * head_dim)`, at least 1, at most
    /// `head_dim` (SPEC.md section 12).
    pub fn kept(&self) -> usize {
        kept_channels(self.retention, self.shape.head_dim)
    }
}

/// SPEC.md section 12 (naive 2-D): `c = ceil(retention * head_dim)` clamped to `1..=head_dim`.
pub fn kept_channels(retention: f64, head_dim: usize) -> usize {
    ((retention * head_dim as f64).ceil() as usize).clamp(1, head_dim)
}

/// ggml's block formats of the kvq baselines (SPEC.md section 12).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvqBlocks {
    /// `q8_0`: f16 scale, 32 int8; 34 bytes per 32 values.
    Q8_0,
    /// `q4_0`: f16 scale, 16 bytes of nibbles; 18 bytes per 32 values.
    Q4_0,
}

impl KvqBlocks {
    /// Values per block (ggml's `QK8_0` / `QK4_0`).
    pub const VALUES: usize = 32;

    /// Bytes of one block.
    pub const fn block_bytes(self) -> usize {
        match self {
            KvqBlocks::Q8_0 => 2 + Self::VALUES,
            KvqBlocks::Q4_0 => 2 + Self::VALUES / 2,
        }
    }

    fn method(self) -> BaselineMethod {
        match self {
            KvqBlocks::Q8_0 => BaselineMethod::Kvq8,
            KvqBlocks::Q4_0 => BaselineMethod::Kvq4,
        }
    }
}

/// A kvq8 / kvq4 cache (SPEC.md section 12): the ggml blocks of every K and V row in
/// llama.cpp's order (token, KV head, block), `tokens * kv_heads * head_dim / 32` blocks each.
#[derive(Debug, Clone, PartialEq)]
pub struct KvqFile {
    pub shape: KvShape,
    pub format: KvqBlocks,
    /// Whether the rows were rotated by llama.cpp's Hadamard before quantization (SPEC.md
    /// section 12); the blocks are read back under the same rotation.
    pub rotated: bool,
    pub tokens: usize,
    pub keys: Vec<u8>,
    pub values: Vec<u8>,
}

/// A baseline cache as its file holds it.
#[derive(Debug, Clone, PartialEq)]
pub enum BaselineFile {
    /// A dense baseline file (SPEC.md section 15.5): `method` is `Full` or `Quest`, or `None`
    /// in the input file `mosaickv compress` writes.
    Dense {
        shape: KvShape,
        method: Option<BaselineMethod>,
        rows: DenseRows,
    },
    /// A naive 2-D baseline cache file (section 15.6).
    Naive2d(Naive2dFile),
    /// A kvq8 / kvq4 baseline cache file (section 15.6).
    Kvq(KvqFile),
}

impl BaselineFile {
    /// The method recorded in the file (`None`: the CLI's dense input file).
    pub fn method(&self) -> Option<BaselineMethod> {
        match self {
            BaselineFile::Dense { method, .. } => *method,
            BaselineFile::Naive2d(f) => Some(BaselineMethod::Naive2d {
                token_rate: f.token_rate,
                retention: f.retention,
                min_budget_tokens: f.min_budget_tokens,
            }),
            BaselineFile::Kvq(f) => Some(f.format.method()),
        }
    }

    /// What the file is, in words, for messages (`a quest baseline file (dense.mkv, ...)`).
    pub fn describe(&self) -> String {
        describe_method(self.method())
    }

    /// SPEC.md sections 15.5-15.6, validation: the shape (`KvShape::new`), the method's
    /// parameters, and the method's rows; see each arm.
    pub fn validate(&self) -> Result<()> {
        let shape = match self {
            BaselineFile::Dense { shape, .. } => shape,
            BaselineFile::Naive2d(f) => &f.shape,
            BaselineFile::Kvq(f) => &f.shape,
        };
        KvShape::new(shape.kv_heads, shape.q_heads, shape.head_dim)?;
        if let Some(m) = self.method() {
            m.validate()?;
        }
        match self {
            BaselineFile::Dense {
                shape,
                method,
                rows,
            } => validate_dense_file(shape, *method, rows),
            BaselineFile::Naive2d(f) => validate_naive2d(f),
            BaselineFile::Kvq(f) => validate_kvq(f),
        }
    }
}

/// Dense file: the method absent, `full` or `quest` (with its parameters in range); the rows
/// `tokens * kv_heads * head_dim` finite f16 keys and as many values.
fn validate_dense_file(
    shape: &KvShape,
    method: Option<BaselineMethod>,
    rows: &DenseRows,
) -> Result<()> {
    match method {
        None | Some(BaselineMethod::Full) => {}
        Some(m @ BaselineMethod::Quest { .. }) => m.validate()?,
        Some(m) => {
            return Err(MosaicError::InvalidConfig(format!(
                "a dense baseline file holds a full or quest cache, not {}",
                m.name()
            )))
        }
    }
    crate::check::validate_dense(shape, rows, "dense rows")
}

/// Naive 2-D: masks absent exactly while no row is held; else per side `kv_heads` masks of
/// exactly `kept` strictly ascending dims below `head_dim`; `tokens * kv_heads * kept` finite
/// f16 keys and as many values.
fn validate_naive2d(f: &Naive2dFile) -> Result<()> {
    let (kv, d, c) = (f.shape.kv_heads, f.shape.head_dim, f.kept());
    match &f.masks {
        None if f.rows.tokens > 0 => {
            return Err(MosaicError::ShapeMismatch {
                what: "naive2d channel masks",
                expected: format!("masks for the {} rows held", f.rows.tokens),
                got: "none".into(),
            })
        }
        None => {}
        // A cache fixes its masks with its first rows; masks without rows would make the
        // next prefill keep them instead of fitting its own.
        Some(_) if f.rows.tokens == 0 => {
            return Err(MosaicError::ShapeMismatch {
                what: "naive2d channel masks",
                expected: "none before any row".into(),
                got: format!("{} heads' masks", f.shape.kv_heads),
            })
        }
        Some((km, vm)) => {
            for (side, masks) in [("key", km), ("value", vm)] {
                if masks.len() != kv {
                    return Err(MosaicError::ShapeMismatch {
                        what: "naive2d channel masks",
                        expected: format!("{kv} {side} masks (one per KV head)"),
                        got: masks.len().to_string(),
                    });
                }
                for (h, m) in masks.iter().enumerate() {
                    let ascending = m.windows(2).all(|w| w[0] < w[1]);
                    if m.len() != c || !ascending || m.last().is_some_and(|&x| x >= d) {
                        return Err(MosaicError::ShapeMismatch {
                            what: "naive2d channel masks",
                            expected: format!(
                                "{c} strictly ascending dims below {d} per {side} mask"
                            ),
                            got: format!("head {h}: {m:?}"),
                        });
                    }
                }
            }
        }
    }
    let masked = KvShape {
        head_dim: c,
        ..f.shape
    };
    crate::check::validate_dense(&masked, &f.rows, "naive2d masked rows")
}

/// kvq: `head_dim` a multiple of 32; `tokens * kv_heads * head_dim / 32` blocks per side;
/// each block as ggml's quantizer writes it: a finite f16 scale (q8_0: not negative, since
/// `d = amax / 127`), q8_0 quants in [-127, 127].
fn validate_kvq(f: &KvqFile) -> Result<()> {
    if f.rotated && crate::kvq::key_rotation_block(f.shape.head_dim).is_none() {
        return Err(bad(format!(
            "kvq blocks: rotated at head_dim {}, which llama.cpp's rotation leaves unrotated (not a multiple of 64)",
            f.shape.head_dim
        )));
    }
    let (s, bb) = (&f.shape, f.format.block_bytes());
    if s.head_dim % KvqBlocks::VALUES != 0 {
        return Err(MosaicError::InvalidConfig(format!(
            "{}: head_dim {} is not a multiple of the block length {}",
            f.format.method().name(),
            s.head_dim,
            KvqBlocks::VALUES
        )));
    }
    let want = f
        .tokens
        .checked_mul(s.kv_heads * s.head_dim / KvqBlocks::VALUES)
        .and_then(|b| b.checked_mul(bb));
    for (what, bytes) in [("kvq key blocks", &f.keys), ("kvq value blocks", &f.values)] {
        if want != Some(bytes.len()) {
            return Err(MosaicError::ShapeMismatch {
                what,
                expected: match want {
                    Some(n) => format!("{n} bytes for {} tokens", f.tokens),
                    None => format!("{} tokens (too many)", f.tokens),
                },
                got: format!("{} bytes", bytes.len()),
            });
        }
        for (b, block) in bytes.chunks_exact(bb).enumerate() {
            let d = f16::from_le_bytes([block[0], block[1]]);
            if !d.is_finite() {
                return Err(MosaicError::NonFinite {
                    what,
                    index: b * KvqBlocks::VALUES,
                });
            }
            if f.format == KvqBlocks::Q8_0
                && (d.is_sign_negative() || block[2..].iter().any(|&q| q as i8 == i8::MIN))
            {
                return Err(bad(format!(
                    "{what}: block {b} is not as ggml's q8_0 quantizer writes it \
                     (negative scale or a quant of -128)"
                )));
            }
        }
    }
    Ok(())
}

fn describe_method(m: Option<BaselineMethod>) -> String {
    match m {
        None => {
            "a dense baseline file (the dense.mkv of `mosaickv compress`, no baseline recorded)"
                .into()
        }
        Some(BaselineMethod::Full) => "a full baseline file (dense.mkv)".into(),
        Some(BaselineMethod::Quest { token_rate, .. }) => {
            format!("a quest baseline file (dense.mkv, token_rate {token_rate})")
        }
        Some(BaselineMethod::Naive2d {
            token_rate,
            retention,
            ..
        }) => format!("a naive2d baseline file (token_rate {token_rate}, retention {retention})"),
        Some(k @ (BaselineMethod::Kvq8 | BaselineMethod::Kvq4)) => {
            format!("a {} baseline file", k.name())
        }
    }
}

/// What a file's verified sections are, in words: its first section's kind and, for a
/// baseline file whose manifest parses, the method recorded in it.
pub(crate) fn describe_sections(sections: &[(u32, &[u8])]) -> String {
    match sections.first() {
        Some((kind::MANIFEST, _)) => "a compressed cache (cache.mkv)".into(),
        Some((kind::DENSE_MANIFEST, p)) => match parse_json::<DenseManifest>(p, "") {
            Ok(m) => describe_method(m.baseline),
            Err(_) => "a dense baseline file (dense.mkv)".into(),
        },
        Some((kind::BASELINE_MANIFEST, p)) => match parse_json::<BaselineManifest>(p, "") {
            Ok(m) => describe_method(Some(m.baseline)),
            Err(_) => "a baseline cache file".into(),
        },
        Some((k, _)) => format!("a file whose first section is of kind {k}"),
        None => "a file without sections".into(),
    }
}

/// The manifest of a baseline cache file (section 15.6, kind 18).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct BaselineManifest {
    shape: KvShape,
    baseline: BaselineMethod,
    /// kvq: the rows were Hadamard-rotated before quantization (SPEC.md section 12, llama.cpp
    /// since 2026-04); absent (false) in files of the unrotated format and of other methods.
    #[serde(default, skip_serializing_if = "is_false")]
    rotated: bool,
}

fn is_false(x: &bool) -> bool {
    !*x
}

const SAVED_ROLE: &str = "baseline cache: the dense f16 K/V of a full or quest cache";

// ---------------------------------------------------------------- writing

/// Writes a baseline cache in the format of SPEC.md section 15.5 (Full, Quest) or 15.6
/// (naive 2-D, kvq), validated first ([`BaselineFile::validate`]) so that it always loads.
pub fn write_baseline(w: &mut impl Write, file: &BaselineFile) -> Result<()> {
    file.validate()?;
    match file {
        BaselineFile::Dense {
            shape,
            method,
            rows,
        } => {
            let m = DenseManifest {
                shape: *shape,
                role: match method {
                    None => crate::persist::DENSE_ROLE.to_string(),
                    Some(_) => SAVED_ROLE.to_string(),
                },
                baseline: *method,
            };
            write_file(
                w,
                &[
                    (kind::DENSE_MANIFEST, json(&m)?),
                    (kind::DENSE_ROWS, dense_payload(rows)),
                ],
            )
        }
        BaselineFile::Naive2d(f) => {
            let m = BaselineManifest {
                shape: f.shape,
                baseline: file.method().expect("a naive2d file has a method"),
                rotated: false,
            };
            let mut b = Buf::default();
            match &f.masks {
                None => {
                    b.u32(0);
                    b.u32(small(f.kept(), "kept channels")?);
                }
                Some((km, vm)) => {
                    b.u32(small(f.shape.kv_heads, "kv_heads")?);
                    b.u32(small(f.kept(), "kept channels")?);
                    for mask in km.iter().chain(vm) {
                        for &i in mask {
                            b.u32(small(i, "mask dim")?);
                        }
                    }
                }
            }
            write_file(
                w,
                &[
                    (kind::BASELINE_MANIFEST, json(&m)?),
                    (kind::CHANNEL_MASKS, b.0),
                    (kind::MASKED_ROWS, dense_payload(&f.rows)),
                ],
            )
        }
        BaselineFile::Kvq(f) => {
            let m = BaselineManifest {
                shape: f.shape,
                baseline: f.format.method(),
                rotated: f.rotated,
            };
            let mut b = Buf::default();
            b.u64(f.tokens);
            b.0.extend_from_slice(&f.keys);
            b.0.extend_from_slice(&f.values);
            write_file(
                w,
                &[
                    (kind::BASELINE_MANIFEST, json(&m)?),
                    (kind::KVQ_BLOCKS, b.0),
                ],
            )
        }
    }
}

// ---------------------------------------------------------------- reading

fn expect_count(sections: &[(u32, &[u8])], n: usize, what: &str) -> Result<()> {
    if sections.len() != n {
        return Err(bad(format!(
            "{what} has {} sections, expected {n}",
            sections.len()
        )));
    }
    Ok(())
}

fn shape_of(s: KvShape) -> Result<KvShape> {
    let shape = KvShape::new(s.kv_heads, s.q_heads, s.head_dim).map_err(as_format_error)?;
    if shape != s {
        return Err(bad("manifest shape does not validate"));
    }
    Ok(shape)
}

/// The dense file of section 15.5: manifest (kind 16, the optional `baseline` record), rows
/// (kind 17).
pub(crate) fn parse_dense_file(
    sections: &[(u32, &[u8])],
) -> Result<(KvShape, Option<BaselineMethod>, DenseRows)> {
    expect_kind(sections, 0, kind::DENSE_MANIFEST, "dense manifest")?;
    let m: DenseManifest = parse_json(sections[0].1, "dense manifest")?;
    let shape = shape_of(m.shape)?;
    expect_count(sections, 2, "dense file")?;
    expect_kind(sections, 1, kind::DENSE_ROWS, "dense rows")?;
    let rows = parse_dense(sections[1].1, &shape, "dense rows")?;
    validate_dense_file(&shape, m.baseline, &rows).map_err(as_format_error)?;
    Ok((shape, m.baseline, rows))
}

fn parse_masks(
    payload: &[u8],
    shape: &KvShape,
    kept: usize,
) -> Result<Option<(Vec<Vec<usize>>, Vec<Vec<usize>>)>> {
    let mut c = Cursor::new(payload, "channel masks");
    let heads = c.u32()? as usize;
    let stored_kept = c.u32()? as usize;
    if stored_kept != kept {
        return Err(bad(format!(
            "channel masks: {stored_kept} channels per mask, the manifest's retention gives {kept}"
        )));
    }
    if heads == 0 {
        c.finish()?;
        return Ok(None);
    }
    if heads != shape.kv_heads {
        return Err(bad(format!(
            "channel masks: {heads} heads, the manifest says {} (or 0 before any row)",
            shape.kv_heads
        )));
    }
    let n = heads
        .checked_mul(2)
        .and_then(|x| x.checked_mul(kept))
        .ok_or_else(|| bad("channel masks: size overflows"))?;
    let raw = c.array(n, 4, "mask dims")?;
    c.finish()?;
    let dims: Vec<usize> = raw
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
        .collect();
    let mut masks = dims.chunks(kept.max(1)).map(<[usize]>::to_vec);
    let km: Vec<Vec<usize>> = masks.by_ref().take(heads).collect();
    let vm: Vec<Vec<usize>> = masks.collect();
    Ok(Some((km, vm)))
}

/// The baseline cache file of section 15.6: manifest (kind 18), then masks (19) and masked
/// rows (20) for naive 2-D, or blocks (21) for kvq.
fn parse_baseline_file(sections: &[(u32, &[u8])]) -> Result<BaselineFile> {
    expect_kind(sections, 0, kind::BASELINE_MANIFEST, "baseline manifest")?;
    let m: BaselineManifest = parse_json(sections[0].1, "baseline manifest")?;
    let shape = shape_of(m.shape)?;
    m.baseline.validate().map_err(as_format_error)?;
    if m.rotated {
        let kvq = matches!(m.baseline, BaselineMethod::Kvq8 | BaselineMethod::Kvq4);
        if !kvq || crate::kvq::key_rotation_block(shape.head_dim).is_none() {
            return Err(bad(format!(
                "baseline manifest: rotated {} at head_dim {} (only kvq rows whose head_dim is a multiple of 64 are rotated)",
                m.baseline.name(),
                shape.head_dim
            )));
        }
    }
    let file = match m.baseline {
        BaselineMethod::Naive2d {
            token_rate,
            retention,
            min_budget_tokens,
        } => {
            expect_count(sections, 3, "naive2d file")?;
            let kept = kept_channels(retention, shape.head_dim);
            expect_kind(sections, 1, kind::CHANNEL_MASKS, "channel masks")?;
            let masks = parse_masks(sections[1].1, &shape, kept)?;
            expect_kind(sections, 2, kind::MASKED_ROWS, "masked rows")?;
            let masked = KvShape {
                head_dim: kept,
                ..shape
            };
            let rows = parse_dense(sections[2].1, &masked, "masked rows")?;
            BaselineFile::Naive2d(Naive2dFile {
                shape,
                token_rate,
                retention,
                min_budget_tokens,
                masks,
                rows,
            })
        }
        BaselineMethod::Kvq8 | BaselineMethod::Kvq4 => {
            let format = if m.baseline == BaselineMethod::Kvq8 {
                KvqBlocks::Q8_0
            } else {
                KvqBlocks::Q4_0
            };
            expect_count(sections, 2, "kvq file")?;
            expect_kind(sections, 1, kind::KVQ_BLOCKS, "kvq blocks")?;
            let mut c = Cursor::new(sections[1].1, "kvq blocks");
            let tokens = c.size("tokens")?;
            if shape.head_dim % KvqBlocks::VALUES != 0 {
                return Err(bad(format!(
                    "kvq blocks: head_dim {} is not a multiple of {}",
                    shape.head_dim,
                    KvqBlocks::VALUES
                )));
            }
            let per_token =
                shape.kv_heads * shape.head_dim / KvqBlocks::VALUES * format.block_bytes();
            let n = tokens
                .checked_mul(per_token)
                .ok_or_else(|| bad(format!("kvq blocks: {tokens} tokens overflow")))?;
            let keys = c.array(n, 1, "key blocks")?.to_vec();
            let values = c.array(n, 1, "value blocks")?.to_vec();
            c.finish()?;
            BaselineFile::Kvq(KvqFile {
                shape,
                format,
                rotated: m.rotated,
                tokens,
                keys,
                values,
            })
        }
        other => {
            return Err(bad(format!(
                "baseline manifest: method {} belongs in a dense file (dense.mkv)",
                other.name()
            )))
        }
    };
    file.validate().map_err(as_format_error)?;
    Ok(file)
}

/// Reads any baseline cache file (SPEC.md sections 15.5-15.6): a dense file (with or without
/// a recorded method) or a baseline cache file. A compressed cache is `BadFormat` naming it.
/// Never panics; any defect is `BadFormat`.
pub fn read_baseline(bytes: &[u8]) -> Result<BaselineFile> {
    let sections = read_sections(bytes)?;
    match sections.first() {
        Some((kind::DENSE_MANIFEST, _)) => {
            let (shape, method, rows) = parse_dense_file(&sections)?;
            Ok(BaselineFile::Dense {
                shape,
                method,
                rows,
            })
        }
        Some((kind::BASELINE_MANIFEST, _)) => parse_baseline_file(&sections),
        _ => Err(bad(format!(
            "this is {}, not a baseline cache file",
            describe_sections(&sections)
        ))),
    }
}

/// Writes a baseline cache file at `path` (see [`write_baseline`]); I/O errors name the path.
pub fn save_baseline(path: &Path, file: &BaselineFile) -> Result<()> {
    let mut buf = Vec::new();
    write_baseline(&mut buf, file)?;
    crate::atomic::write_atomic(path, &buf).map_err(|e| io_err(&path.display().to_string(), e))
}

/// Reads a baseline cache file at `path` (see [`read_baseline`]) and checks that it holds
/// the method named `want` (`full`, `quest`, `naive2d`, `kvq8`, `kvq4`); another kind of
/// file is `BadFormat` naming what it is. `full` also takes the CLI's dense input file
/// (no method recorded): its rows are exactly a full cache's.
pub fn load_baseline(path: &Path, want: &str) -> Result<BaselineFile> {
    let bytes = crate::persist::read_file(path)?;
    let file = read_baseline(&bytes).map_err(|e| with_path(path, e))?;
    let ok = match file.method() {
        None => want == "full",
        Some(m) => m.name() == want,
    };
    if !ok {
        return Err(MosaicError::BadFormat(format!(
            "{}: this is {}, not a {want} baseline file",
            path.display(),
            file.describe()
        )));
    }
    Ok(file)
}

impl BaselineFile {
    /// The error for a file handed to a cache of another method: `BadFormat` naming both.
    pub fn not_a(&self, want: &str) -> MosaicError {
        MosaicError::BadFormat(format!(
            "this is {}, not a {want} baseline file",
            self.describe()
        ))
    }
}

/// Rows `[tokens][kv_heads][width]` of f16 as f32 arrays (exact), for rebuilding a cache by
/// `prefill`.
pub fn widen_rows(
    rows: &DenseRows,
    kv_heads: usize,
    width: usize,
) -> Result<(ndarray::Array3<f32>, ndarray::Array3<f32>)> {
    let dim = (rows.tokens, kv_heads, width);
    let widen = |v: &[f16]| {
        ndarray::Array3::from_shape_vec(dim, v.iter().map(|x| x.to_f32()).collect()).map_err(|e| {
            MosaicError::ShapeMismatch {
                what: "baseline rows",
                expected: format!("{dim:?}"),
                got: e.to_string(),
            }
        })
    };
    Ok((widen(&rows.keys)?, widen(&rows.values)?))
}
