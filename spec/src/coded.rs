//! SPEC.md section 6.1: coded records ("transform coding" in the rotated basis).
//!
//! A coded side strategy gives every rotated dim `j < Dt` its own width `b_j` (0, 1, 2, 4 or
//! 8 bits), f16 offset `m_j` and f16 step `s_j`, fitted once per segment from one step size
//! `delta` shared by every dim ([`coding_for_step`]). A record is its codes alone, bit-packed
//! ([`pack_codes`]): no bitmap, no per-record minimum and scale. These functions are the one
//! host implementation of section 6.1's arithmetic, as [`crate::layout::quantize_values`] is of
//! section 6's.

use crate::layout::{quant_scale, QuantParams};
use half::f16;
use serde::{Deserialize, Serialize};

/// The widths a coded dim may take: each divides 8, so no code crosses a byte.
pub const WIDTHS: [u8; 5] = [0, 1, 2, 4, 8];

/// Ladder steps per halving of `delta` (SPEC.md section 6.1: `delta_k = span * 2^(-k / 8)`).
pub const LADDER_PER_OCTAVE: u32 = 8;

/// Ladder rungs: `k = 0 ..= LADDER_RUNGS - 1`, down to `span * 2^-12` (below it every dim of a
/// finite range is at 8 bits or spans it, so smaller steps change nothing more).
pub const LADDER_RUNGS: u32 = 12 * LADDER_PER_OCTAVE + 1;

/// Bytes of one dim's parameters as SPEC.md section 13 counts them: the width (one byte) and
/// the f16 offset and step.
pub const CODING_BYTES_PER_DIM: usize = 5;

/// One rotated dim of a coded side strategy (SPEC.md section 6.1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DimCode {
    /// Width of the dim's code: 0, 1, 2, 4 or 8 bits.
    pub bits: u8,
    /// The decoded value of code 0 (`+0`, never `-0`, for a zero).
    pub min: f16,
    /// The step between codes (`+0` for a 0-bit dim, which always decodes to `min`).
    pub scale: f16,
}

impl DimCode {
    /// The largest code, `2^bits - 1`.
    pub const fn qmax(self) -> u32 {
        (1u32 << self.bits) - 1
    }

    /// SPEC.md section 6.1 (decode): `m + c * s` in f32, rounded once, as section 6 step 4
    /// ([`crate::layout::dequantize`]); a 0-bit dim decodes to `m`.
    #[inline]
    pub fn decode(self, code: u8) -> f32 {
        crate::layout::dequantize(
            QuantParams {
                min: self.min,
                scale: self.scale,
            },
            code,
        )
    }

    /// SPEC.md section 6.1 (encode): `round_half_even((y - m) / s)` in f64, clamped to `[0,
    /// 2^b - 1]` (a later row may lie outside the range the segment was fitted on); 0 for a
    /// 0-bit dim or a zero step.
    #[inline]
    pub fn encode(self, y: f16) -> u8 {
        if self.bits == 0 || self.scale.to_bits() == 0 {
            return 0;
        }
        let q = f64::from(self.qmax());
        ((y.to_f64() - self.min.to_f64()) / self.scale.to_f64())
            .round_ties_even()
            .clamp(0.0, q) as u8
    }
}

/// SPEC.md section 6.1: the width whose levels at step `delta` span a range `a >= 0`: `L =
/// floor(a / delta) + 1` levels (f64), then the smallest of 0, 1, 2, 4, 8 bits with `2^b >= L`,
/// at most 8.
pub fn width_for(a: f64, delta: f64) -> u8 {
    let levels = (a / delta).floor() + 1.0;
    WIDTHS
        .iter()
        .copied()
        .find(|&b| f64::from(1u32 << b) >= levels)
        .unwrap_or(8)
}

/// SPEC.md section 6.1: a coded side's per-dim parameters for step `delta > 0`, from each
/// dim's smallest and largest f16 value over the segment's rows (`lo[j] <= hi[j]`, finite):
/// width [`width_for`]`(hi - lo, delta)`; for `b > 0`, `m = lo` and `s` =
/// [`quant_scale`]`(hi - lo, 2^b - 1)` (the widened dim's step shrinks to use its levels); for
/// `b = 0`, `m` = the f16 nearest to `(lo + hi) / 2` (f64) and `s = 0`.
pub fn coding_for_step(lo: &[f16], hi: &[f16], delta: f64) -> Vec<DimCode> {
    lo.iter()
        .zip(hi)
        .map(|(&l, &h)| {
            let a = h.to_f64() - l.to_f64();
            let bits = width_for(a, delta);
            if bits == 0 {
                DimCode {
                    bits,
                    min: mid_range(l, h),
                    scale: f16::ZERO,
                }
            } else {
                DimCode {
                    bits,
                    min: f16::from_f64(l.to_f64() + 0.0),
                    scale: quant_scale(a, (1u32 << bits) - 1),
                }
            }
        })
        .collect()
}

/// The f16 nearest to `(l + h) / 2` (exact in f64: two f16 values need at most 40 significant
/// bits), rounded once, ties to even, `+0` for a zero. Not `half`'s `from_f64`, which goes
/// through f32 on CPUs with F16C and could round twice (SPEC.md notation).
fn mid_range(l: f16, h: f16) -> f16 {
    let x = (l.to_f64() + h.to_f64()) / 2.0;
    if x == 0.0 {
        return f16::ZERO;
    }
    // The f16 values near x are the multiples of q = 2^(e - 10), e = floor(log2 |x|) clamped
    // below at -14 (subnormals share the smallest normal binade's quantum); x / q is exact.
    let e = (((x.to_bits() >> 52) & 0x7ff) as i32 - 1023).max(-14);
    let q = 2f64.powi(e - 10);
    // an f16 value (|x| <= 65504 as the mean of two finite f16), exact in f32 and in f16; a
    // mean that rounds to zero (e.g. -2^-25, half the smallest subnormal, ties to even) is
    // +0, never -0
    f16::from_f32(((x / q).round_ties_even() * q) as f32 + 0.0)
}

/// SPEC.md section 6.1: the ladder of steps a fit tries, `delta_k = span * 2^(-k / 8)` for `k =
/// 0 .. LADDER_RUNGS` (f64: `span * exp2(-k / 8)`), `span = max_j (hi_j - lo_j)`; empty when
/// `span = 0` (every dim constant: one coding, all widths 0).
pub fn ladder(lo: &[f16], hi: &[f16]) -> Vec<f64> {
    let span = lo
        .iter()
        .zip(hi)
        .map(|(l, h)| h.to_f64() - l.to_f64())
        .fold(0.0f64, f64::max);
    if span <= 0.0 {
        return Vec::new();
    }
    (0..LADDER_RUNGS)
        .map(|k| span * (-(f64::from(k)) / f64::from(LADDER_PER_OCTAVE)).exp2())
        .collect()
}

/// SPEC.md sections 6.1 and 11.2: the coded candidates of a segment whose rotated dims range
/// over `[lo_j, hi_j]` (f16, finite): one per distinct coding of the [`ladder`]
/// ([`coding_for_step`]), in ladder order, or the one all-0-bit coding when the ladder is
/// empty; each a side strategy of head dimension `head_dim` (`r = Dt = lo.len()`, `g = 1`)
/// without rotation or fit loss. Every backend's coded candidates come from here.
pub fn candidates(lo: &[f16], hi: &[f16], head_dim: usize) -> Vec<crate::SideStrategy> {
    let steps = ladder(lo, hi);
    let mut out: Vec<crate::SideStrategy> = Vec::new();
    for delta in if steps.is_empty() { vec![1.0] } else { steps } {
        let coding = coding_for_step(lo, hi, delta);
        if out.iter().any(|c| c.coding == coding) {
            continue;
        }
        let layout = crate::RecordLayout {
            head_dim,
            kept_dims: lo.len(),
            r: lo.len(),
            group_size: 1,
            dtype: crate::ValueDtype::Coded,
            code_bits: code_bits(&coding),
        };
        out.push(crate::SideStrategy {
            coding,
            ..crate::SideStrategy::bare(layout)
        });
    }
    out
}

/// The bits of one record under `coding`: `sum_j b_j`.
pub fn code_bits(coding: &[DimCode]) -> usize {
    coding.iter().map(|c| usize::from(c.bits)).sum()
}

/// SPEC.md section 6.1: the order codes are stored in: the dims of width 8 in ascending j,
/// then those of width 4, 2, 1 (0-bit dims store nothing).
pub fn code_order(coding: &[DimCode]) -> Vec<usize> {
    let mut order = Vec::with_capacity(coding.len());
    for b in [8u8, 4, 2, 1] {
        order.extend((0..coding.len()).filter(|&j| coding[j].bits == b));
    }
    order
}

/// SPEC.md section 6.1: writes codes (`codes[j]` for dim j, below `2^b_j`) into `out` (zeroed,
/// at least `ceil(code_bits / 8)` bytes), in [`code_order`], each at the next free bit,
/// least significant bit first within a byte.
pub fn pack_codes(coding: &[DimCode], codes: &[u8], out: &mut [u8]) {
    let mut bit = 0usize;
    for j in code_order(coding) {
        let b = usize::from(coding[j].bits);
        out[bit / 8] |= codes[j] << (bit % 8);
        bit += b;
    }
}

/// SPEC.md section 6.1: reads every dim's code back (0 for a 0-bit dim), the inverse of
/// [`pack_codes`].
pub fn unpack_codes(coding: &[DimCode], record: &[u8]) -> Vec<u8> {
    let mut codes = vec![0u8; coding.len()];
    let mut bit = 0usize;
    for j in code_order(coding) {
        let b = u32::from(coding[j].bits);
        let mask = ((1u32 << b) - 1) as u8;
        codes[j] = (record[bit / 8] >> (bit % 8)) & mask;
        bit += b as usize;
    }
    codes
}

/// Checks a coded side's per-dim parameters (SPEC.md section 6.1): `Dt` of them, widths in
/// [`WIDTHS`], finite offsets that are not `-0`, finite steps `>= +0`, a zero step for a 0-bit
/// dim, and `code_bits` equal to the widths' sum.
pub fn check_coding(coding: &[DimCode], kept_dims: usize, bits: usize) -> Result<(), String> {
    if coding.len() != kept_dims {
        return Err(format!("{} coded dims for Dt = {kept_dims}", coding.len()));
    }
    for (j, c) in coding.iter().enumerate() {
        if !WIDTHS.contains(&c.bits) {
            return Err(format!("dim {j}: width {} is not 0, 1, 2, 4 or 8", c.bits));
        }
        if !c.min.is_finite() || c.min.to_bits() == 0x8000 {
            return Err(format!(
                "dim {j}: offset {} is not finite (or is -0)",
                c.min
            ));
        }
        if !c.scale.is_finite() || c.scale.to_bits() & 0x8000 != 0 {
            return Err(format!("dim {j}: step {} is not finite and >= +0", c.scale));
        }
        if c.bits == 0 && c.scale.to_bits() != 0 {
            return Err(format!("dim {j}: a 0-bit dim with a non-zero step"));
        }
    }
    let sum = code_bits(coding);
    if sum != bits {
        return Err(format!("widths sum to {sum} bits, the layout says {bits}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widths_take_the_fewest_levels_that_span_the_range() {
        // L = floor(a / delta) + 1 levels.
        assert_eq!(width_for(0.0, 1.0), 0);
        assert_eq!(width_for(0.99, 1.0), 0);
        assert_eq!(width_for(1.0, 1.0), 1); // 2 levels
        assert_eq!(width_for(2.0, 1.0), 2); // 3 levels -> 4
        assert_eq!(width_for(3.5, 1.0), 2); // 4 levels
        assert_eq!(width_for(4.0, 1.0), 4); // 5 levels -> 16
        assert_eq!(width_for(15.9, 1.0), 4);
        assert_eq!(width_for(16.0, 1.0), 8);
        assert_eq!(width_for(1e9, 1.0), 8); // capped
    }

    #[test]
    fn codes_pack_widest_first_and_unpack_to_themselves() {
        let dim = |bits: u8| DimCode {
            bits,
            min: f16::ZERO,
            scale: if bits == 0 { f16::ZERO } else { f16::ONE },
        };
        let coding: Vec<DimCode> = [1u8, 8, 0, 4, 2, 4, 8, 1, 1]
            .iter()
            .map(|&b| dim(b))
            .collect();
        assert_eq!(code_order(&coding), vec![1, 6, 3, 5, 4, 0, 7, 8]);
        let codes = [1u8, 200, 0, 9, 3, 15, 7, 0, 1];
        let bits = code_bits(&coding);
        assert_eq!(bits, 29);
        let mut out = vec![0u8; bits.div_ceil(8)];
        pack_codes(&coding, &codes, &mut out);
        // byte 0: dim 1 (200); byte 1: dim 6 (7); byte 2: dim 3 (9) low nibble, dim 5 (15)
        // high; byte 3: dim 4 (3) bits 0-1, dim 0 (1) bit 2, dim 7 (0) bit 3, dim 8 (1) bit 4.
        assert_eq!(out, vec![200, 7, 9 | 15 << 4, 3 | 1 << 2 | 1 << 4]);
        assert_eq!(unpack_codes(&coding, &out), codes.to_vec());
    }

    #[test]
    fn a_fitted_coding_spans_its_rows_and_decodes_within_half_a_step() {
        let lo: Vec<f16> = [-3.0f32, 0.0, 5.0, 2.0]
            .iter()
            .map(|&x| f16::from_f32(x))
            .collect();
        let hi: Vec<f16> = [3.0f32, 0.01, 5.0, 2.5]
            .iter()
            .map(|&x| f16::from_f32(x))
            .collect();
        let steps = ladder(&lo, &hi);
        assert_eq!(steps.len(), LADDER_RUNGS as usize);
        assert_eq!(steps[0], 6.0);
        assert_eq!(steps[8], 3.0);
        let coding = coding_for_step(&lo, &hi, 0.1);
        assert_eq!(
            coding.iter().map(|c| c.bits).collect::<Vec<_>>(),
            vec![8, 0, 0, 4]
        );
        assert_eq!(coding[2].min.to_f32(), 5.0);
        check_coding(&coding, 4, 12).unwrap();
        for (j, c) in coding.iter().enumerate() {
            for x in [lo[j], hi[j]] {
                let err = (f64::from(c.decode(c.encode(x))) - x.to_f64()).abs();
                // within half a step, or half the range for a 0-bit dim (plus f16 rounding)
                let bound = if c.bits == 0 {
                    (hi[j].to_f64() - lo[j].to_f64()) / 2.0 + 1e-3
                } else {
                    c.scale.to_f64() / 2.0 + 1e-6
                };
                assert!(err <= bound, "dim {j}: {err} > {bound}");
            }
        }
        // A value outside the fitted range clamps to the nearest end.
        assert_eq!(coding[3].encode(f16::from_f32(9.0)), 15);
        assert_eq!(coding[3].encode(f16::from_f32(-9.0)), 0);
    }

    #[test]
    fn the_mid_range_is_rounded_once() {
        let f = f16::from_f32;
        assert_eq!(mid_range(f(1.0), f(3.0)), f(2.0));
        // +0, never -0
        assert_eq!(mid_range(f(-2.0), f(2.0)).to_bits(), 0);
        // 65504 and the smallest subnormal: the exact mean 32752 + 2^-25 needs 40 bits; rounded
        // once it is 32752
        assert_eq!(mid_range(f16::from_bits(1), f16::MAX), f(32752.0));
        // the mean of two neighbouring f16 is a tie: to the even one
        let (a, b) = (f16::from_bits(0x3c01), f16::from_bits(0x3c02));
        assert_eq!(mid_range(a, b), b);
        // a subnormal mean
        let (a, b) = (f16::from_bits(1), f16::from_bits(3));
        assert_eq!(mid_range(a, b), f16::from_bits(2));
        // a negative mean that rounds to zero is +0 (a -0 offset is refused by check_coding)
        let neg_tiny = f16::from_bits(0x8001);
        assert_eq!(mid_range(neg_tiny, f16::ZERO).to_bits(), 0);
        assert_eq!(mid_range(neg_tiny, f16::NEG_ZERO).to_bits(), 0);
    }

    #[test]
    fn bad_codings_are_refused() {
        let ok = DimCode {
            bits: 2,
            min: f16::ONE,
            scale: f16::ONE,
        };
        assert!(check_coding(&[ok], 1, 2).is_ok());
        assert!(check_coding(&[ok], 2, 2).is_err());
        assert!(check_coding(&[ok], 1, 3).is_err());
        assert!(check_coding(&[DimCode { bits: 3, ..ok }], 1, 3).is_err());
        assert!(check_coding(
            &[DimCode {
                min: f16::NAN,
                ..ok
            }],
            1,
            2
        )
        .is_err());
        assert!(check_coding(
            &[DimCode {
                min: f16::NEG_ZERO,
                ..ok
            }],
            1,
            2
        )
        .is_err());
        assert!(check_coding(
            &[DimCode {
                scale: f16::from_f32(-1.0),
                ..ok
            }],
            1,
            2
        )
        .is_err());
        assert!(check_coding(&[DimCode { bits: 0, ..ok }], 1, 0).is_err());
    }
}
