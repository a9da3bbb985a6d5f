//! Strategies and the packed byte layout (SPEC.md sections 3-7).

use crate::error::{MosaicError, Result};
use half::f16;
use serde::{Deserialize, Serialize};

/// Element type of the retained values in a packed record (SPEC.md section 6).
///
/// `F16` stores each kept value as IEEE binary16. `Int8` and `Int4` store per record the
/// smallest kept value `m` and a scale `s` (both f16) and per kept value an unsigned code
/// (`[0, 255]`, `[0, 15]`), written by [`quantize_values`]; the decoded value is
/// `m + code * s` rounded once to f32 ([`dequantize`]).
///
/// `Coded` is not a per-value type but a record kind (SPEC.md section 6.1): no bitmap and no
/// per-record minimum and scale; every rotated dim has a code of its own width, offset and
/// step, fitted per segment ([`DimCode`], [`SideStrategy::coding`]). The reference backend
/// implements it; the optimized and CUDA backends refuse it (`InvalidConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[repr(u8)]
pub enum ValueDtype {
    F16 = 1,
    Int8 = 2,
    Int4 = 3,
    Coded = 4,
}

impl ValueDtype {
    /// The bitmap records' dtypes (SPEC.md section 6), in tag order.
    pub const ALL: [ValueDtype; 3] = [ValueDtype::F16, ValueDtype::Int8, ValueDtype::Int4];

    /// Bytes of `r` stored values (SPEC.md section 6): `2 r` (f16), `r` (int8),
    /// `ceil(r / 2)` (int4, two codes per byte). A coded record's bytes depend on its
    /// segment's widths ([`RecordLayout::value_bytes`]); here 0.
    pub const fn values_bytes(self, r: usize) -> usize {
        match self {
            ValueDtype::F16 => 2 * r,
            ValueDtype::Int8 => r,
            ValueDtype::Int4 => r.div_ceil(2),
            ValueDtype::Coded => 0,
        }
    }

    /// Bytes of the per-record minimum and scale: 0 (f16, coded), 4 (two f16, int8 and int4).
    pub const fn scale_bytes(self) -> usize {
        match self {
            ValueDtype::F16 | ValueDtype::Coded => 0,
            ValueDtype::Int8 | ValueDtype::Int4 => 4,
        }
    }

    /// Largest code: 255 (int8), 15 (int4); 0 for f16 (not quantized) and coded (per dim).
    pub const fn qmax(self) -> u32 {
        match self {
            ValueDtype::F16 | ValueDtype::Coded => 0,
            ValueDtype::Int8 => 255,
            ValueDtype::Int4 => 15,
        }
    }

    /// Whether records carry a per-record minimum, scale and codes (int8, int4: SPEC.md
    /// section 6's quantized bitmap records). False for f16 and for coded records.
    pub const fn is_quantized(self) -> bool {
        matches!(self, ValueDtype::Int8 | ValueDtype::Int4)
    }

    /// Whether records of this kind have a bitmap and kept values (SPEC.md section 6): every
    /// kind but coded (section 6.1).
    pub const fn is_bitmap(self) -> bool {
        !matches!(self, ValueDtype::Coded)
    }

    /// The name used in configuration files and reports: `f16`, `int8`, `int4`, `coded`.
    pub const fn name(self) -> &'static str {
        match self {
            ValueDtype::F16 => "f16",
            ValueDtype::Int8 => "int8",
            ValueDtype::Int4 => "int4",
            ValueDtype::Coded => "coded",
        }
    }

    pub fn from_tag(tag: u8) -> Result<Self> {
        match tag {
            1 => Ok(ValueDtype::F16),
            2 => Ok(ValueDtype::Int8),
            3 => Ok(ValueDtype::Int4),
            4 => Ok(ValueDtype::Coded),
            t => Err(MosaicError::CorruptPacked(format!(
                "unknown value dtype tag {t}"
            ))),
        }
    }
}

/// SPEC.md section 6: the scale of a quantized record from the range `a = M - m` of its kept
/// f16 values (exact in f64): the smallest f16 `s > 0` with `qmax * s >= a` (exact: `qmax * s`
/// of an f16 is exact in f64), found from the nearest f16 to `a / qmax` and corrected by whole
/// f16 steps; `a = 0` gives 0. `a <= 2 * 65504` (the values are finite f16), so
/// `s <= 131008 / 15` never overflows.
pub fn quant_scale(a: f64, qmax: u32) -> f16 {
    if a <= 0.0 {
        return f16::ZERO;
    }
    let q = f64::from(qmax);
    let mut s = f16::from_f64(a / q);
    // `from_f64` may round twice (through f32); either way it is within a step or two of
    // the answer, and these loops make it exactly the smallest f16 with `qmax * s >= a`.
    while q * s.to_f64() < a {
        s = f16::from_bits(s.to_bits() + 1);
    }
    while s.to_bits() > 0 && q * f16::from_bits(s.to_bits() - 1).to_f64() >= a {
        s = f16::from_bits(s.to_bits() - 1);
    }
    s
}

/// A quantized record's offset and step (SPEC.md section 6): decoded value `m + code * s`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuantParams {
    /// The smallest kept f16 value of the record.
    pub min: f16,
    /// The step, [`quant_scale`] of the record's range.
    pub scale: f16,
}

/// SPEC.md section 6: the decoded value of `code`: `m + code * s` in f32, rounded once
/// (`code * s` is exact in f32: at most 8 + 11 significant bits), so a fused multiply-add
/// gives the same float.
#[inline]
pub fn dequantize(p: QuantParams, code: u8) -> f32 {
    p.min.to_f32() + f32::from(code) * p.scale.to_f32()
}

/// SPEC.md section 9, logits on int8/int4 key records: `f32((s_q * (s * I_c + m * I_k)) *
/// inv_sqrt_d)` in f64 in that order, from the exact integer sums `I_c = sum_kept a_j c_j` and
/// `I_k = sum_kept a_j` of the record's codes `c_j` against the int8 query `a_j` (section 8.2,
/// scale `s_q`), the record's f16 minimum `m` and scale `s`, and `inv_sqrt_d` from
/// [`inv_sqrt_d`]. Both products are exact in f64 (an f16 times an integer below 2^24), so
/// every backend, fused multiply-adds or not, gets the same f32. The one host implementation
/// of the f64 part; the SIMD and CUDA kernels do the same operations in their lanes.
#[inline]
pub fn key_logit_q8(s_q: f64, p: QuantParams, ic: i32, ik: i32, inv_sqrt_d: f64) -> f32 {
    let sum =
        f64::from(p.scale.to_f32()) * f64::from(ic) + f64::from(p.min.to_f32()) * f64::from(ik);
    ((s_q * sum) * inv_sqrt_d) as f32
}

/// SPEC.md section 9: `1 / sqrt(D)` in f64 (`1.0 / sqrt(f64(D))`, both IEEE operations
/// correctly rounded), the logit scale [`key_logit_q8`] takes.
#[inline]
pub fn inv_sqrt_d(head_dim: usize) -> f64 {
    1.0 / (head_dim as f64).sqrt()
}

/// SPEC.md section 6: the quantized form of a record's kept f16 values `y` (finite):
/// `m = min_i y_i`, `M = max_i y_i`, the scale `s` of [`quant_scale`] for `a = M - m`
/// (f64, exact), and the codes `c_i = round_half_even((y_i - m) / s)` (f64; `y_i - m` is
/// exact), clamped to `[0, qmax]` (never needed: `0 <= y_i - m <= a <= qmax * s`); all codes 0
/// when `s = 0`. `qmax` from the dtype (int8 or int4). This is the one implementation every
/// host backend calls, like [`BlockMeta::push_block`].
pub fn quantize_values(y: &[f16], dtype: ValueDtype, codes: &mut [u8]) -> QuantParams {
    debug_assert!(dtype.is_quantized() && codes.len() == y.len());
    let qmax = dtype.qmax();
    let lo = y.iter().fold(f64::INFINITY, |a, v| a.min(v.to_f64()));
    let hi = y.iter().fold(f64::NEG_INFINITY, |a, v| a.max(v.to_f64()));
    if y.is_empty() {
        return QuantParams {
            min: f16::ZERO,
            scale: f16::ZERO,
        };
    }
    // `lo` is one of the f16 values (exact); +0 for a zero minimum, so a record never stores -0.
    let min = f16::from_f64(lo + 0.0);
    let scale = quant_scale(hi - lo, qmax);
    if scale.to_bits() == 0 {
        codes.fill(0);
    } else {
        let sd = scale.to_f64();
        let q = f64::from(qmax);
        for (c, v) in codes.iter_mut().zip(y) {
            *c = ((v.to_f64() - lo) / sd).round_ties_even().clamp(0.0, q) as u8;
        }
    }
    QuantParams { min, scale }
}

/// SPEC.md section 6: writes a quantized record's minimum, scale and codes at `out[0..]`:
/// `m` and `s` as f16 little-endian, then the codes: int8 one byte each, int4 two per byte
/// (code `i` in byte `i / 2`, the low nibble for even `i`, the high nibble for odd `i`; an odd
/// `r` leaves the last high nibble 0).
pub fn write_quantized(dtype: ValueDtype, p: QuantParams, codes: &[u8], out: &mut [u8]) {
    out[..2].copy_from_slice(&p.min.to_le_bytes());
    out[2..4].copy_from_slice(&p.scale.to_le_bytes());
    let v = &mut out[4..];
    match dtype {
        ValueDtype::Int8 => v[..codes.len()].copy_from_slice(codes),
        ValueDtype::Int4 => {
            for (i, &c) in codes.iter().enumerate() {
                let nib = c & 0x0f;
                if i % 2 == 0 {
                    v[i / 2] = nib;
                } else {
                    v[i / 2] |= nib << 4;
                }
            }
        }
        ValueDtype::F16 | ValueDtype::Coded => {
            unreachable!("{} records have no record scale", dtype.name())
        }
    }
}

/// Reads code `i` of a quantized record's code bytes `v` (after the minimum and scale).
#[inline]
pub fn read_code(dtype: ValueDtype, v: &[u8], i: usize) -> u8 {
    match dtype {
        ValueDtype::Int8 => v[i],
        ValueDtype::Int4 => (v[i / 2] >> (4 * (i % 2))) & 0x0f,
        ValueDtype::F16 | ValueDtype::Coded => unreachable!("not a bitmap code: {}", dtype.name()),
    }
}

/// Byte layout of one packed K or V record (SPEC.md section 6): a bitmap of
/// `ceil(groups / 32)` little-endian `u32` words, then (int8 and int4) the f16 minimum and
/// scale, then
/// `r` values in ascending channel order, then zero padding up to a multiple of 4 bytes.
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
    /// Coded records only (SPEC.md section 6.1): the bits of one record's codes, the sum of
    /// its segment's per-dim widths; 0 for every bitmap layout.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub code_bits: usize,
}

fn is_zero(x: &usize) -> bool {
    *x == 0
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

/// Size in bytes of one record: bitmap, scale, values, padding to 4 bytes.
pub const fn record_bytes_for(
    kept_dims: usize,
    r: usize,
    group_size: usize,
    dtype: ValueDtype,
) -> usize {
    let raw =
        bitmap_bytes_for(kept_dims / group_size) + dtype.scale_bytes() + dtype.values_bytes(r);
    raw.div_ceil(4) * 4
}

// The paper's example (SPEC.md section 6): D = 128 with the bottom 25 % truncated
// (96 eligible channels), g = 1, r = 32, f16: 12 B bitmap + 64 B values = 76 B.
const _: () = assert!(record_bytes_for(96, 32, 1, ValueDtype::F16) == 76);
// No truncation: 128 channels, r = 32: 16 + 64 = 80 B.
const _: () = assert!(record_bytes_for(128, 32, 1, ValueDtype::F16) == 80);
// D = 64, 48 eligible, r = 16: 8 B bitmap + 32 B values.
const _: () = assert!(record_bytes_for(48, 16, 1, ValueDtype::F16) == 40);
// Odd sizes pad: D = 80, 60 eligible, r = 9 -> 8 + 18 = 26 -> 28.
const _: () = assert!(record_bytes_for(60, 9, 1, ValueDtype::F16) == 28);
// int8, D = 128, r = 64: 16 B bitmap + 4 B minimum and scale + 64 B codes = 84 B (f16: 144 B).
const _: () = assert!(record_bytes_for(128, 64, 1, ValueDtype::Int8) == 84);
// int4, D = 64, r = 48: 8 B bitmap + 4 B + 24 B codes = 36 B (f16: 104 B).
const _: () = assert!(record_bytes_for(64, 48, 1, ValueDtype::Int4) == 36);
// int4 with an odd r: D = 64, r = 9: 8 + 4 + 5 = 17 -> 20 B.
const _: () = assert!(record_bytes_for(64, 9, 1, ValueDtype::Int4) == 20);

impl RecordLayout {
    /// Checks the layout's invariants (SPEC.md section 6).
    pub fn validate(&self) -> Result<()> {
        let g = self.group_size;
        if self.dtype == ValueDtype::Coded {
            // SPEC.md section 6.1: every rotated dim has a code (r = Dt, g = 1), of at most
            // 8 bits.
            if self.kept_dims == 0
                || self.kept_dims > self.head_dim
                || g != 1
                || self.r != self.kept_dims
                || self.code_bits > 8 * self.kept_dims
            {
                return Err(MosaicError::InvalidConfig(format!(
                    "coded layout (D {}, Dt {}, r {}, g {}, {} code bits): needs 0 < Dt <= D, \
                     g = 1, r = Dt and at most 8 bits per dim (SPEC.md section 6.1)",
                    self.head_dim, self.kept_dims, self.r, g, self.code_bits
                )));
            }
            return Ok(());
        }
        if self.code_bits != 0 {
            return Err(MosaicError::InvalidConfig(format!(
                "a {} layout has no code bits (got {})",
                self.dtype.name(),
                self.code_bits
            )));
        }
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
    /// Stored bitmap bytes (whole `u32` words); the values start here. 0 for coded records.
    #[inline]
    pub fn bitmap_bytes(&self) -> usize {
        if self.dtype == ValueDtype::Coded {
            return 0;
        }
        bitmap_bytes_for(self.groups())
    }
    /// Bytes of the stored values (codes for int8/int4, without the scale; a coded record's
    /// bit-packed codes, `ceil(code_bits / 8)`).
    #[inline]
    pub fn value_bytes(&self) -> usize {
        if self.dtype == ValueDtype::Coded {
            return self.code_bits.div_ceil(8);
        }
        self.dtype.values_bytes(self.r)
    }
    /// Bytes of the per-record minimum and scale (0 for f16, 4 for int8/int4).
    #[inline]
    pub fn scale_bytes(&self) -> usize {
        self.dtype.scale_bytes()
    }
    /// Offset of the first stored value: after the bitmap, the minimum and the scale.
    #[inline]
    pub fn values_offset(&self) -> usize {
        self.bitmap_bytes() + self.scale_bytes()
    }
    #[inline]
    pub fn record_bytes(&self) -> usize {
        if self.dtype == ValueDtype::Coded {
            return self.code_bits.div_ceil(32) * 4;
        }
        record_bytes_for(self.kept_dims, self.r, self.group_size, self.dtype)
    }
    pub fn padding_bytes(&self) -> usize {
        self.record_bytes() - self.bitmap_bytes() - self.scale_bytes() - self.value_bytes()
    }
}

/// K or V half of a segment strategy (SPEC.md sections 3, 4, 11).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SideStrategy {
    pub layout: RecordLayout,
    /// The first `Dt` columns of the orthogonal rotation R, `head_dim x kept_dims`, row-major:
    /// `rotation[i * Dt + j] = R[i][j]` (SPEC.md section 3). Column j is the j-th principal
    /// direction; a row x is stored as `x'_j = (R^T x)_j`, `j < Dt`. The truncated columns
    /// are never used after the fit, so they are not stored. Elements are f16 (rounded once
    /// from the f64 eigenvectors); every stage widens them to f32/f64 exactly.
    pub rotation: Vec<f16>,
    /// Relative dropped energy (with the quantization error of an int8/int4 layout) of the
    /// rows this strategy was fitted on (SPEC.md sections 10, 11.1).
    pub fit_loss: f64,
    /// A coded layout's per-dim widths, offsets and steps (SPEC.md section 6.1), `Dt` of
    /// them; empty for every bitmap layout.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub coding: Vec<crate::coded::DimCode>,
}

impl SideStrategy {
    /// A bitmap layout (SPEC.md section 6) as a side strategy without rotation, fit loss or
    /// coding: what encoding already-rotated rows reads.
    pub fn bare(layout: RecordLayout) -> Self {
        Self {
            layout,
            rotation: Vec::new(),
            fit_loss: 0.0,
            coding: Vec::new(),
        }
    }

    pub fn head_dim(&self) -> usize {
        self.layout.head_dim
    }

    /// Checks the layout and the rotation's size and finiteness.
    pub fn validate(&self) -> Result<()> {
        self.layout.validate()?;
        if self.layout.dtype == ValueDtype::Coded {
            crate::coded::check_coding(&self.coding, self.layout.kept_dims, self.layout.code_bits)
                .map_err(|m| MosaicError::InvalidConfig(format!("coded side strategy: {m}")))?;
        } else if !self.coding.is_empty() {
            return Err(MosaicError::InvalidConfig(format!(
                "a {} side strategy has no per-dim coding (got {} dims)",
                self.layout.dtype.name(),
                self.coding.len()
            )));
        }
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
        // A fitted column is a unit vector rounded to f16; a longer one (a crafted file)
        // could make a later flush overflow f16 (SPEC.md section 14).
        let dt = self.layout.kept_dims;
        let max = rotation_column_norm_max(d);
        let max_sq = max * max;
        for j in 0..dt {
            let mut sq = 0f64;
            for i in 0..d {
                let r = self.rotation[i * dt + j].to_f64();
                sq += r * r;
            }
            if !(sq <= max_sq) {
                return Err(MosaicError::InvalidConfig(format!(
                    "rotation column {j} has norm {:.6}, above {max:.6} \
                     (a fitted column is a unit vector rounded to f16, SPEC.md section 3)",
                    sq.sqrt()
                )));
            }
        }
        Ok(())
    }
}

/// The largest norm a stored rotation column of `head_dim` entries may have (SPEC.md
/// sections 3, 14): a unit vector rounded to f16 entry by entry (relative error at most
/// 2^-11 for a normal entry, absolute error at most 2^-25 for a subnormal one) has norm at
/// most `1 + 2^-11 + sqrt(D) 2^-25`.
pub fn rotation_column_norm_max(head_dim: usize) -> f64 {
    1.0 + 2f64.powi(-11) + (head_dim as f64).sqrt() * 2f64.powi(-25)
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
    /// (popcount = r/g, no bit past the last group, zero padding) and, for int8/int4, the
    /// minimum and scale (finite, not -0, scale >= 0), zero codes under a zero scale and a
    /// zero unused nibble. f16 values are not checked here: a non-finite value is caught
    /// where it is decoded.
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
pub fn trim_rotation<T: Copy>(full: &[T], d: usize, dt: usize) -> Vec<T> {
    full.chunks_exact(d)
        .flat_map(|row| row[..dt].iter().copied())
        .collect()
}

/// A stored rotation's elements widened to f32 (exact), into `out` (cleared first): what the
/// f32 kernels (query rotation, value back-rotation) read.
pub fn widen_rotation(rotation: &[f16], out: &mut Vec<f32>) {
    use half::slice::HalfFloatSliceExt;
    out.clear();
    out.resize(rotation.len(), 0.0);
    rotation.convert_to_f32_slice(out);
}

/// A stored rotation widened to f32 (exact), as a new vector.
pub fn rotation_f32(rotation: &[f16]) -> Vec<f32> {
    let mut v = Vec::new();
    widen_rotation(rotation, &mut v);
    v
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

/// The minimum and scale of a quantized record (int8/int4 layout): the two f16 after the bitmap.
#[inline]
pub fn record_quant(layout: &RecordLayout, record: &[u8]) -> QuantParams {
    let o = layout.bitmap_bytes();
    QuantParams {
        min: f16::from_le_bytes([record[o], record[o + 1]]),
        scale: f16::from_le_bytes([record[o + 2], record[o + 3]]),
    }
}

fn check_record(layout: &RecordLayout, rec: &[u8]) -> std::result::Result<(), String> {
    if layout.dtype == ValueDtype::Coded {
        // SPEC.md section 6.1: any code of its width is valid; the bits past the last code
        // and the padding bytes are zero.
        let bits = layout.code_bits;
        if bits % 8 != 0 && rec[bits / 8] >> (bits % 8) != 0 {
            return Err("non-zero bits after the last code".into());
        }
        if rec[bits.div_ceil(8)..].iter().any(|&b| b != 0) {
            return Err("non-zero padding".into());
        }
        return Ok(());
    }
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
    if layout.dtype.is_quantized() {
        let p = record_quant(layout, rec);
        if !(p.scale.is_finite() && p.scale.to_bits() & 0x8000 == 0) {
            return Err(format!("scale {} is not finite and >= +0", p.scale));
        }
        if !p.min.is_finite() || p.min.to_bits() == 0x8000 {
            return Err(format!("minimum {} is not finite (or is -0)", p.min));
        }
        let v = &rec[layout.values_offset()..];
        for i in 0..layout.r {
            if p.scale.to_bits() == 0 && read_code(layout.dtype, v, i) != 0 {
                return Err(format!("code {i} is non-zero under a zero scale"));
            }
        }
        if layout.dtype == ValueDtype::Int4 && layout.r % 2 == 1 && v[layout.r / 2] >> 4 != 0 {
            return Err("non-zero unused nibble".into());
        }
    }
    let pad_start = layout.values_offset() + layout.value_bytes();
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

/// The largest magnitude a decoded key element can have: `65504 + 255 * 65504` (an int8
/// record's minimum plus its largest code times its scale, both f16; section 6).
pub const DECODED_KEY_MAX: f64 = 65504.0 + 255.0 * 65504.0;

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
        // A decoded key element is an f16 (<= 65504) or `m + c s` with `|m|, s <= 65504` and
        // `c <= 255` (section 6): at most DECODED_KEY_MAX, so no block written by section 7
        // has a larger scale than meta_scale of it, and a larger one would only inflate the
        // block scores of section 8.2 towards f32 overflow.
        let most = meta_scale(DECODED_KEY_MAX);
        if let Some(b) = self
            .scale
            .iter()
            .position(|s| !(s.is_finite() && *s >= 0.0 && *s <= most))
        {
            return Err(format!(
                "block {b}: scale {} is not finite and in [0, {most}]",
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

    #[test]
    fn rotation_columns_longer_than_a_rounded_unit_vector_are_refused() {
        let (d, dt) = (4, 2);
        let side = |col1: [f32; 4]| SideStrategy {
            layout: RecordLayout {
                head_dim: d,
                kept_dims: dt,
                r: 1,
                group_size: 1,
                dtype: ValueDtype::F16,
                code_bits: 0,
            },
            // column 0 = e_0, column 1 = col1 (row-major D x Dt)
            rotation: (0..d)
                .flat_map(|i| [if i == 0 { 1.0 } else { 0.0 }, col1[i]])
                .map(f16::from_f32)
                .collect(),
            fit_loss: 0.0,
            coding: Vec::new(),
        };
        // unit columns, and a unit vector rounded to f16 entry by entry, are accepted
        assert!(side([0.0, 1.0, 0.0, 0.0]).validate().is_ok());
        let h = 0.5f32.sqrt(); // rounds to 0.70703125: norm 0.99990
        assert!(side([0.0, h, h, 0.0]).validate().is_ok());
        // one f16 step above 1 (1 + 2^-10) is past 1 + 2^-11 + sqrt(D) 2^-25
        let e = side([0.0, 1.0009765625, 0.0, 0.0]).validate().unwrap_err();
        assert!(
            matches!(e, MosaicError::InvalidConfig(ref m) if m.contains("rotation column 1")),
            "{e}"
        );
        // a crafted column of large finite entries
        assert!(side([0.0, 60000.0, 0.0, 0.0]).validate().is_err());
    }

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

    /// SPEC.md section 6 quantization: `m` is the smallest value, the scale the smallest f16
    /// with `qmax * s >= M - m`, every code the nearest (ties to even) to `(y - m) / s`, so the
    /// decoded `m + code * s` is within `s / 2` (plus its one f32 rounding) of the f16 value;
    /// the bytes read back and pass the record check.
    #[test]
    fn quantized_values_round_trip_within_half_a_step() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for case in 0..3000 {
            let dtype = [ValueDtype::Int8, ValueDtype::Int4][case % 2];
            let r = 1 + (next() % 40) as usize;
            let mag = [6e-8f32, 1e-4, 0.3, 7.0, 900.0, 65504.0][case % 6];
            let shift = if case % 3 == 0 { mag * 0.5 } else { 0.0 };
            let y: Vec<f16> = (0..r)
                .map(|_| {
                    let n = next();
                    let x = ((n % 20001) as f32 / 10000.0 - 1.0) * mag + shift;
                    f16::from_f32(if n % 11 == 0 {
                        0.0
                    } else {
                        x.clamp(-65504.0, 65504.0)
                    })
                })
                .collect();
            let mut codes = vec![0u8; r];
            let p = quantize_values(&y, dtype, &mut codes);
            let q = f64::from(dtype.qmax());
            let lo = y.iter().fold(f64::INFINITY, |a, v| a.min(v.to_f64()));
            let hi = y.iter().fold(f64::NEG_INFINITY, |a, v| a.max(v.to_f64()));
            assert_eq!(p.min.to_f64(), lo);
            let sd = p.scale.to_f64();
            assert!(q * sd >= hi - lo, "case {case}");
            if hi > lo {
                let below = f16::from_bits(p.scale.to_bits() - 1).to_f64();
                assert!(q * below < hi - lo, "case {case}: scale not the smallest");
            } else {
                assert_eq!(p.scale.to_bits(), 0);
            }
            for (&c, v) in codes.iter().zip(&y) {
                assert!(u32::from(c) <= dtype.qmax());
                let deq = f64::from(dequantize(p, c));
                let exact = lo + f64::from(c) * sd;
                assert!(
                    (deq - exact).abs() <= exact.abs() * 2f64.powi(-24),
                    "one f32 rounding"
                );
                assert!(
                    (deq - v.to_f64()).abs() <= sd / 2.0 + exact.abs() * 2f64.powi(-24),
                    "case {case}"
                );
            }
            let layout = RecordLayout {
                head_dim: 64,
                kept_dims: 64,
                r,
                group_size: 1,
                dtype,
                code_bits: 0,
            };
            let mut rec = vec![0u8; layout.record_bytes()];
            for k in 0..r {
                rec[k / 8] |= 1 << (k % 8);
            }
            write_quantized(dtype, p, &codes, &mut rec[layout.bitmap_bytes()..]);
            check_record(&layout, &rec).unwrap();
            assert_eq!(record_quant(&layout, &rec), p);
            let v = &rec[layout.values_offset()..];
            for (i, &c) in codes.iter().enumerate() {
                assert_eq!(read_code(dtype, v, i), c);
            }
        }
        // Ties go to even: with m = 0 and s = 1 (int4, M = 15), 2.5 -> 2 and 3.5 -> 4.
        let y = [15.0f32, 2.5, 3.5, 0.0].map(f16::from_f32);
        let mut c = [0u8; 4];
        let p = quantize_values(&y, ValueDtype::Int4, &mut c);
        assert_eq!((p.min.to_f32(), p.scale.to_f32()), (0.0, 1.0));
        assert_eq!(c, [15, 2, 4, 0]);
        // A -0 minimum is stored as +0.
        let p = quantize_values(&[f16::NEG_ZERO, f16::ONE], ValueDtype::Int8, &mut [0; 2]);
        assert_eq!(p.min.to_bits(), 0);
    }

    /// A quantized record with a code under a zero scale, a negative or non-finite scale, a
    /// non-finite or -0 minimum, or a set unused nibble is rejected.
    #[test]
    fn bad_quantized_records_are_rejected() {
        let layout = |dtype, r| RecordLayout {
            head_dim: 8,
            kept_dims: 8,
            r,
            group_size: 1,
            dtype,
            code_bits: 0,
        };
        let good = |l: &RecordLayout| {
            let mut rec = vec![0u8; l.record_bytes()];
            rec[0] = (1u16 << l.r).wrapping_sub(1) as u8;
            rec[6..8].copy_from_slice(&f16::ONE.to_le_bytes());
            rec
        };
        let i8l = layout(ValueDtype::Int8, 3);
        let i4l = layout(ValueDtype::Int4, 3);
        check_record(&i8l, &good(&i8l)).unwrap();
        check_record(&i4l, &good(&i4l)).unwrap();
        let mut r = good(&i4l);
        r[9] = 0xff; // any code is valid, but the unused high nibble of code 3's byte is not
        assert!(check_record(&i4l, &r).is_err());
        r[9] = 0x0f;
        check_record(&i4l, &r).unwrap();
        let mut r = good(&i8l);
        r[6..8].copy_from_slice(&f16::ZERO.to_le_bytes());
        r[9] = 1; // a code under a zero scale
        assert!(check_record(&i8l, &r).is_err());
        for bad in [f16::NEG_ONE, f16::INFINITY, f16::NAN, f16::NEG_ZERO] {
            let mut r = good(&i8l);
            r[6..8].copy_from_slice(&bad.to_le_bytes());
            assert!(check_record(&i8l, &r).is_err(), "scale {bad}");
        }
        for bad in [f16::INFINITY, f16::NAN, f16::NEG_ZERO] {
            let mut r = good(&i8l);
            r[4..6].copy_from_slice(&bad.to_le_bytes());
            assert!(check_record(&i8l, &r).is_err(), "min {bad}");
        }
    }
}
