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
            t => Err(MosaicError::CorruptPacked(format!(
                "unknown value dtype tag {t}"
            ))),
        }
    }
}

/// Byte layout of one packed K or V record (SPEC.md section 6): a bitmap of
/// `ceil(groups / 32)` little-endian `u32` words, then `r` values in ascending
/// channel order, then zero padding up to a multiple of 4 bytes.
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

/// Bytes of bitmap for `groups` groups: whole little-endian `u32` words.
pub const fn bitmap_bytes_for(groups: usize) -> usize {
    4 * groups.div_ceil(32)
}

/// 64-bit views of a bitmap of `groups` groups ([`bitmap_word`] reads them; the
/// last one may cover only 4 stored bytes).
pub const fn bitmap_words_for(groups: usize) -> usize {
    groups.div_ceil(64)
}

/// Size in bytes of one record: bitmap, values, padding to 4 bytes.
pub const fn record_bytes_for(
    kept_dims: usize,
    r: usize,
    group_size: usize,
    value_size: usize,
) -> usize {
    let raw = bitmap_bytes_for(kept_dims / group_size) + r * value_size;
    raw.div_ceil(4) * 4
}

// The paper's example (SPEC.md section 6): D = 128 with the bottom 25 % truncated
// (96 eligible channels), g = 1, r = 32, f16: 12 B bitmap + 64 B values = 76 B.
const _: () = assert!(record_bytes_for(96, 32, 1, 2) == 76);
// No truncation: 128 channels, r = 32: 16 + 64 = 80 B.
const _: () = assert!(record_bytes_for(128, 32, 1, 2) == 80);
// D = 64, 48 eligible, r = 16: 8 B bitmap + 32 B values.
const _: () = assert!(record_bytes_for(48, 16, 1, 2) == 40);
// Odd sizes pad: D = 80, 60 eligible, r = 9 -> 8 + 18 = 26 -> 28.
const _: () = assert!(record_bytes_for(60, 9, 1, 2) == 28);

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
    /// 64-bit views of the bitmap (for [`bitmap_word`]).
    pub fn bitmap_words(&self) -> usize {
        bitmap_words_for(self.groups())
    }
    /// Stored bitmap bytes (whole `u32` words); the values start here.
    pub fn bitmap_bytes(&self) -> usize {
        bitmap_bytes_for(self.groups())
    }
    pub fn value_bytes(&self) -> usize {
        self.r * self.dtype.size_bytes()
    }
    pub fn record_bytes(&self) -> usize {
        record_bytes_for(
            self.kept_dims,
            self.r,
            self.group_size,
            self.dtype.size_bytes(),
        )
    }
    pub fn padding_bytes(&self) -> usize {
        self.record_bytes() - self.bitmap_bytes() - self.value_bytes()
    }
}

/// K or V half of a segment strategy (SPEC.md sections 3, 4, 11).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SideStrategy {
    pub layout: RecordLayout,
    /// The first `Dt` columns of the orthogonal rotation R, `head_dim x kept_dims`, row-major:
    /// `rotation[i * Dt + j] = R[i][j]` (SPEC.md section 3). Column j is the j-th principal
    /// direction; a row x is stored as `x'_j = (R^T x)_j`, `j < Dt`. The truncated columns
    /// are never used after the fit, so they are not stored.
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
        if self.rotation.len() != d * self.layout.kept_dims {
            return Err(MosaicError::ShapeMismatch {
                what: "rotation",
                expected: format!("{d}x{} (D x Dt)", self.layout.kept_dims),
                got: format!("{} elements", self.rotation.len()),
            });
        }
        if let Some(i) = self.rotation.iter().position(|x| !x.is_finite()) {
            return Err(MosaicError::NonFinite {
                what: "rotation",
                index: i,
            });
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
            check_record(layout, self.record(layout, i))
                .map_err(|m| MosaicError::CorruptPacked(format!("record {i}: {m}")))?;
        }
        Ok(())
    }
}

/// The stored rotation (SPEC.md section 3 step 4): the first `dt` columns of the row-major
/// `d x d` matrix `full`, row-major `d x dt`.
pub fn trim_rotation(full: &[f32], d: usize, dt: usize) -> Vec<f32> {
    full.chunks_exact(d)
        .flat_map(|row| row[..dt].iter().copied())
        .collect()
}

/// Reads bits `64 w .. 64 w + 64` of a record's bitmap (bits past the stored
/// bitmap read as 0).
#[inline]
pub fn bitmap_word(layout: &RecordLayout, record: &[u8], w: usize) -> u64 {
    let end = layout.bitmap_bytes().min(8 * w + 8);
    let mut b = [0u8; 8];
    b[..end - 8 * w].copy_from_slice(&record[8 * w..end]);
    u64::from_le_bytes(b)
}

/// Whether group `k` (< the layout's groups) is kept: bit `k mod 8` of bitmap byte `k / 8`
/// (the same bit as bit `k mod 32` of little-endian word `k / 32`).
#[inline]
pub fn bitmap_bit(record: &[u8], k: usize) -> bool {
    (record[k / 8] >> (k % 8)) & 1 == 1
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
        let word = bitmap_word(layout, rec, w);
        let valid_bits = (groups - 64 * w).min(64);
        if valid_bits < 64 && word >> valid_bits != 0 {
            return Err(format!("bitmap bit set past group {groups}"));
        }
        ones += word.count_ones() as usize;
    }
    if ones != layout.kept_groups() {
        return Err(format!(
            "bitmap popcount {ones}, expected {}",
            layout.kept_groups()
        ));
    }
    let pad_start = layout.bitmap_bytes() + layout.value_bytes();
    if rec[pad_start..].iter().any(|&b| b != 0) {
        return Err("non-zero padding".into());
    }
    Ok(())
}

/// Per-block, per-channel bounds of a segment's decoded rotated keys
/// (SPEC.md section 7), stored as int8 with one f32 scale per block.
///
/// `min` and `max` are `[blocks][kept_dims]`, row-major; `scale` is
/// `[blocks]`. Block `b`'s bounds are `min[b][j] * scale[b] <= m_j` and
/// `max[b][j] * scale[b] >= M_j` (exactly, in real arithmetic), where `m_j`
/// and `M_j` are the exact min and max over the block's decoded keys; see
/// [`BlockMeta::push_block`] for the rounding.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct BlockMeta {
    pub block_size: usize,
    pub kept_dims: usize,
    pub tokens: usize,
    pub min: Vec<i8>,
    pub max: Vec<i8>,
    pub scale: Vec<f32>,
}

/// SPEC.md section 7: the scale of one block from `a = max_j max(|m_j|, |M_j|)`:
/// the smallest f32 `s` with `127 * s >= a` (exact; `127 * s` of an f32 is
/// exact in f64), i.e. `a / 127` rounded up to f32. `a = 0` gives 0.
pub fn meta_scale(a: f64) -> f32 {
    if a <= 0.0 {
        return 0.0;
    }
    let mut s = (a / 127.0) as f32;
    // The f64 quotient rounded to nearest f32 is within one f32 step of the
    // answer; these two loops make it exactly the smallest s with 127 s >= a.
    while 127.0 * f64::from(s) < a {
        s = f32::from_bits(s.to_bits() + 1);
    }
    while s > 0.0 && 127.0 * f64::from(f32::from_bits(s.to_bits() - 1)) >= a {
        s = f32::from_bits(s.to_bits() - 1);
    }
    s
}

/// SPEC.md section 7: `ceil(hi / s)` (f64), raised by one if `q * s < hi`,
/// clamped to [-127, 127]. `s > 0`.
pub fn meta_quant_max(hi: f64, s: f64) -> i8 {
    let mut q = (hi / s).ceil();
    if q * s < hi {
        q += 1.0;
    }
    q.clamp(-127.0, 127.0) as i8
}

/// SPEC.md section 7: `floor(lo / s)` (f64), lowered by one if `q * s > lo`,
/// clamped to [-127, 127]. `s > 0`.
pub fn meta_quant_min(lo: f64, s: f64) -> i8 {
    let mut q = (lo / s).floor();
    if q * s > lo {
        q -= 1.0;
    }
    q.clamp(-127.0, 127.0) as i8
}

impl BlockMeta {
    /// Empty metadata (no block yet) for `kept_dims` dims and blocks of `block_size`.
    pub fn empty(block_size: usize, kept_dims: usize) -> Self {
        Self {
            block_size,
            kept_dims,
            tokens: 0,
            min: Vec::new(),
            max: Vec::new(),
            scale: Vec::new(),
        }
    }
    pub fn blocks(&self) -> usize {
        self.tokens.div_ceil(self.block_size.max(1))
    }
    /// Tokens in block `i` (the last block may be partial).
    pub fn block_len(&self, i: usize) -> usize {
        (self.tokens - i * self.block_size).min(self.block_size)
    }
    /// Device bytes: `2 * blocks * kept_dims` (i8 min and max) + `4 * blocks` (f32 scales).
    pub fn bytes(&self) -> usize {
        self.min.len() + self.max.len() + 4 * self.scale.len()
    }

    /// SPEC.md section 7: appends one block of `len` tokens from its exact
    /// per-dim bounds `lo[j] = m_j`, `hi[j] = M_j` (finite, `lo[j] <= hi[j]`,
    /// `kept_dims` each): scale `s` = [`meta_scale`] of the largest magnitude,
    /// `qmax_j` = [`meta_quant_max`], `qmin_j` = [`meta_quant_min`]; `s = 0`
    /// stores all zeros. Afterwards `qmin_j * s <= m_j` and `qmax_j * s >= M_j`.
    pub fn push_block(&mut self, lo: &[f32], hi: &[f32], len: usize) {
        debug_assert!(lo.len() == self.kept_dims && hi.len() == self.kept_dims);
        let a = lo
            .iter()
            .chain(hi)
            .fold(0.0f64, |a, &x| a.max(f64::from(x).abs()));
        let s = meta_scale(a);
        self.scale.push(s);
        if s == 0.0 {
            self.min.resize(self.min.len() + lo.len(), 0);
            self.max.resize(self.max.len() + hi.len(), 0);
        } else {
            let sd = f64::from(s);
            self.min
                .extend(lo.iter().map(|&x| meta_quant_min(f64::from(x), sd)));
            self.max
                .extend(hi.iter().map(|&x| meta_quant_max(f64::from(x), sd)));
        }
        self.tokens += len;
    }

    /// Appends `other`'s blocks (same block size and dims); `self` must end on a block boundary.
    pub fn append(&mut self, other: &BlockMeta) {
        self.min.extend_from_slice(&other.min);
        self.max.extend_from_slice(&other.max);
        self.scale.extend_from_slice(&other.scale);
        self.tokens += other.tokens;
    }

    /// Internal consistency: `block_size > 0`, `blocks * kept_dims` min and
    /// max values, `blocks` scales, every scale finite and `>= 0`, every
    /// quantized bound in [-127, 127] with `min <= max`.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let n = self.blocks() * self.kept_dims;
        if self.block_size == 0
            || self.min.len() != n
            || self.max.len() != n
            || self.scale.len() != self.blocks()
        {
            return Err(format!(
                "expected {n} min and max values and {} scales (block_size > 0), got {} min, {} max, {} scales, block_size {}",
                self.blocks(),
                self.min.len(),
                self.max.len(),
                self.scale.len(),
                self.block_size
            ));
        }
        if let Some(b) = self
            .scale
            .iter()
            .position(|s| !(s.is_finite() && *s >= 0.0))
        {
            return Err(format!(
                "block {b}: scale {} is not finite and >= 0",
                self.scale[b]
            ));
        }
        if let Some(i) = self
            .min
            .iter()
            .zip(&self.max)
            .position(|(&lo, &hi)| lo == i8::MIN || hi == i8::MIN || lo > hi)
        {
            return Err(format!(
                "value {i}: quantized bounds [{}, {}] are not in [-127, 127] with min <= max",
                self.min[i], self.max[i]
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every magnitude the bounds can take (f16 values, zeros, subnormals) and
    /// random mixtures: the stored bounds enclose the exact ones, the scale is
    /// the smallest f32 with `127 s >= a`, and the i8 range is respected.
    #[test]
    fn quantized_bounds_enclose_the_exact_ones() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for case in 0..4000 {
            let dt = 1 + (next() % 20) as usize;
            let mag = [1e-7f32, 6e-5, 0.01, 1.0, 300.0, 65504.0][case % 6];
            let mut lo = Vec::new();
            let mut hi = Vec::new();
            for _ in 0..dt {
                let v = |n: u64| {
                    let x = ((n % 20001) as f32 / 10000.0 - 1.0) * mag;
                    half::f16::from_f32(if n % 7 == 0 { 0.0 } else { x }).to_f32()
                };
                let (a, b) = (v(next()), v(next()));
                lo.push(a.min(b));
                hi.push(a.max(b));
            }
            let mut m = BlockMeta::empty(16, dt);
            m.push_block(&lo, &hi, 16);
            m.validate().unwrap();
            let s = f64::from(m.scale[0]);
            let a = lo
                .iter()
                .chain(&hi)
                .fold(0f64, |a, &x| a.max(f64::from(x).abs()));
            assert!(127.0 * s >= a);
            if s > 0.0 {
                let below = f64::from(f32::from_bits(m.scale[0].to_bits() - 1));
                assert!(127.0 * below < a, "scale not the smallest");
            } else {
                assert_eq!(a, 0.0);
            }
            for j in 0..dt {
                assert!(
                    f64::from(m.min[j]) * s <= f64::from(lo[j]),
                    "case {case} dim {j}"
                );
                assert!(
                    f64::from(m.max[j]) * s >= f64::from(hi[j]),
                    "case {case} dim {j}"
                );
                assert!(m.min[j] != i8::MIN && m.max[j] != i8::MIN);
            }
        }
        let mut m = BlockMeta::empty(4, 3);
        m.push_block(&[0.0, -0.0, 0.0], &[0.0, 0.0, 0.0], 2);
        assert_eq!(
            (m.scale[0], m.min.clone(), m.max.clone(), m.tokens),
            (0.0, vec![0; 3], vec![0; 3], 2)
        );
        assert_eq!(m.bytes(), 3 + 3 + 4);
        // The largest magnitude maps to exactly +-127.
        let mut m = BlockMeta::empty(4, 2);
        m.push_block(&[-2.0, 0.5], &[1.0, 0.5], 4);
        assert_eq!((m.min[0], m.max[1]), (-127, 32));
    }
}
