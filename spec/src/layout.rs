//! Strategies and the packed byte layout (SPEC.md sections 3-7).

use crate::error::{MosaicError, Result};
use half::f16;
use serde::{Deserialize, Serialize};

/// Element type of the retained values in a packed record.
///
/// Only `F16` exists today; the tag is stored so quantized values can come later
/// without a format break.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum ValueDtype {
    F16 = 1,
}

impl ValueDtype {
    pub const fn size_bytes(self) -> usize {
        match self {
            ValueDtype::F16 => 2,
        }
    }

    pub fn from_tag(tag: u8) -> Result<Self> {
        match tag {
            1 => Ok(ValueDtype::F16),
            t => Err(MosaicError::CorruptPacked(format!("unknown value dtype tag {t}"))),
        }
    }
}

/// Byte layout of one packed K or V record (SPEC.md section 6):
/// `bitmap_words` little-endian `u64` words, then `r` values in ascending
/// channel order, then zero padding up to a multiple of 8 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RecordLayout {
    /// Full head dimension D.
    pub head_dim: usize,
    /// Leading rotated channels eligible for top-r (D minus the truncated tail).
    pub kept_dims: usize,
    /// Retained elements per vector (a multiple of `group_size`).
    pub r: usize,
    /// Element group size g: one bitmap bit per g adjacent channels.
    pub group_size: usize,
    pub dtype: ValueDtype,
}

/// Words of bitmap for `groups` groups.
pub const fn bitmap_words_for(groups: usize) -> usize {
    groups.div_ceil(64)
}

/// Size in bytes of one record: bitmap words, values, padding to 8 bytes.
pub const fn record_bytes_for(kept_dims: usize, r: usize, group_size: usize, value_size: usize) -> usize {
    let raw = 8 * bitmap_words_for(kept_dims / group_size) + r * value_size;
    raw.div_ceil(8) * 8
}

// The paper's example (SPEC.md section 6): D = 128 with the bottom 25 % truncated
// (96 eligible channels), g = 1, r = 32, f16: 16 B bitmap + 64 B values = 80 B.
const _: () = assert!(record_bytes_for(96, 32, 1, 2) == 80);
// D = 64, 48 eligible, r = 16: 8 B bitmap + 32 B values.
const _: () = assert!(record_bytes_for(48, 16, 1, 2) == 40);
// Odd sizes pad: D = 80, 60 eligible, r = 10 -> 8 + 20 = 28 -> 32.
const _: () = assert!(record_bytes_for(60, 10, 1, 2) == 32);

impl RecordLayout {
    /// Checks the layout's invariants (SPEC.md section 6).
    pub fn validate(&self) -> Result<()> {
        let g = self.group_size;
        if g == 0 || self.head_dim % g != 0 {
            return Err(MosaicError::GroupSizeNotDivisor {
                head_dim: self.head_dim,
                group_size: g,
            });
        }
        if self.kept_dims == 0 || self.kept_dims > self.head_dim || self.kept_dims % g != 0 {
            return Err(MosaicError::InvalidConfig(format!(
                "kept_dims {} must be a positive multiple of g={} and <= head_dim {}",
                self.kept_dims, g, self.head_dim
            )));
        }
        if self.r == 0 || self.r % g != 0 || self.r > self.kept_dims {
            return Err(MosaicError::RetentionOutOfRange {
                r: self.r,
                group_size: g,
                kept_dims: self.kept_dims,
            });
        }
        Ok(())
    }
    pub fn groups(&self) -> usize {
        self.kept_dims / self.group_size
    }
    pub fn kept_groups(&self) -> usize {
        self.r / self.group_size
    }
    pub fn bitmap_words(&self) -> usize {
        bitmap_words_for(self.groups())
    }
    pub fn bitmap_bytes(&self) -> usize {
        8 * self.bitmap_words()
    }
    pub fn value_bytes(&self) -> usize {
        self.r * self.dtype.size_bytes()
    }
    pub fn record_bytes(&self) -> usize {
        record_bytes_for(self.kept_dims, self.r, self.group_size, self.dtype.size_bytes())
    }
    pub fn padding_bytes(&self) -> usize {
        self.record_bytes() - self.bitmap_bytes() - self.value_bytes()
    }
}

/// K or V half of a segment strategy (SPEC.md sections 3, 4, 11).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SideStrategy {
    pub layout: RecordLayout,
    /// Orthogonal rotation R, `head_dim x head_dim`, row-major: `rotation[i * D + j] = R[i][j]`.
    /// Column j is the j-th principal direction; a row x is stored as `x' = R^T x`.
    pub rotation: Vec<f32>,
    /// Relative dropped energy of the rows this strategy was fitted on (SPEC.md section 10).
    pub fit_loss: f64,
}

impl SideStrategy {
    pub fn head_dim(&self) -> usize {
        self.layout.head_dim
    }

    /// Checks the layout and the rotation's size and finiteness.
    pub fn validate(&self) -> Result<()> {
        self.layout.validate()?;
        let d = self.layout.head_dim;
        if self.rotation.len() != d * d {
            return Err(MosaicError::ShapeMismatch {
                what: "rotation",
                expected: format!("{d}x{d}"),
                got: format!("{} elements", self.rotation.len()),
            });
        }
        if let Some(i) = self.rotation.iter().position(|x| !x.is_finite()) {
            return Err(MosaicError::NonFinite { what: "rotation", index: i });
        }
        Ok(())
    }
}

/// A segment's strategy for one KV head: K side, V side, block size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Strategy {
    pub key: SideStrategy,
    pub value: SideStrategy,
    pub block_size: usize,
}

/// `count` packed records of one layout, contiguous (record i at `i * record_bytes`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PackedRows {
    pub count: usize,
    pub bytes: Vec<u8>,
}

impl PackedRows {
    /// Record `i`'s bytes.
    pub fn record<'a>(&'a self, layout: &RecordLayout, i: usize) -> &'a [u8] {
        let rb = layout.record_bytes();
        &self.bytes[i * rb..(i + 1) * rb]
    }

    /// Checks the byte length and, for every record, the bitmap invariants
    /// (popcount = r/g, no bit past the last group, zero padding). Values are
    /// not checked here: a non-finite value is caught where it is decoded.
    pub fn validate(&self, layout: &RecordLayout) -> Result<()> {
        let rb = layout.record_bytes();
        if self.bytes.len() != self.count * rb {
            return Err(MosaicError::CorruptPacked(format!(
                "{} bytes for {} records of {} bytes",
                self.bytes.len(),
                self.count,
                rb
            )));
        }
        for i in 0..self.count {
            check_record(layout, self.record(layout, i)).map_err(|m| MosaicError::CorruptPacked(format!("record {i}: {m}")))?;
        }
        Ok(())
    }
}

/// Reads bitmap word `w` of a record.
#[inline]
pub fn bitmap_word(record: &[u8], w: usize) -> u64 {
    u64::from_le_bytes(record[8 * w..8 * w + 8].try_into().expect("8 bytes"))
}

/// Reads value `i` of a record (f16 layout).
#[inline]
pub fn record_value(layout: &RecordLayout, record: &[u8], i: usize) -> f16 {
    let o = layout.bitmap_bytes() + 2 * i;
    f16::from_le_bytes([record[o], record[o + 1]])
}

fn check_record(layout: &RecordLayout, rec: &[u8]) -> std::result::Result<(), String> {
    let groups = layout.groups();
    let mut ones = 0usize;
    for w in 0..layout.bitmap_words() {
        let word = bitmap_word(rec, w);
        let valid_bits = (groups - 64 * w).min(64);
        if valid_bits < 64 && word >> valid_bits != 0 {
            return Err(format!("bitmap bit set past group {groups}"));
        }
        ones += word.count_ones() as usize;
    }
    if ones != layout.kept_groups() {
        return Err(format!("bitmap popcount {ones}, expected {}", layout.kept_groups()));
    }
    let pad_start = layout.bitmap_bytes() + layout.value_bytes();
    if rec[pad_start..].iter().any(|&b| b != 0) {
        return Err("non-zero padding".into());
    }
    Ok(())
}

/// Per-block, per-channel min and max of a segment's decoded rotated keys
/// (SPEC.md section 7). `min` and `max` are `[blocks][kept_dims]`, row-major.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct BlockMeta {
    pub block_size: usize,
    pub kept_dims: usize,
    pub tokens: usize,
    pub min: Vec<f16>,
    pub max: Vec<f16>,
}

impl BlockMeta {
    pub fn blocks(&self) -> usize {
        self.tokens.div_ceil(self.block_size.max(1))
    }
    /// Tokens in block `i` (the last block may be partial).
    pub fn block_len(&self, i: usize) -> usize {
        (self.tokens - i * self.block_size).min(self.block_size)
    }
    pub fn bytes(&self) -> usize {
        2 * (self.min.len() + self.max.len())
    }
}
