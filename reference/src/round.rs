//! Rounding f64 to f16 (SPEC.md notation: "f16 is IEEE binary16 with
//! round-to-nearest-even").
//!
//! `half::f16::from_f64` goes through f32 on x86 machines with F16C, which
//! rounds twice and can differ from a single correct rounding when the f32
//! lands exactly on an f16 midpoint. The oracle rounds once, here.

use half::f16;

/// Largest finite f16, 65504.
pub const F16_MAX: f64 = 65504.0;

/// Magnitudes at or above this round to +-Inf in f16 (midpoint of 65504 and 2^16).
pub use mosaickv_spec::rules::F16_OVERFLOW;

/// `x` rounded once to the nearest f16, ties to even; +-Inf past the f16
/// range (|x| >= 65520, the midpoint between 65504 and 2^16); NaN stays NaN.
///
/// Method: let `e = floor(log2 |x|)`, clamped below at -14 (the f16
/// subnormal range shares the quantum of the smallest normal binade). The
/// f16 values near x are the multiples of `q = 2^(e - 10)`; `x / q` is exact
/// (a power-of-two scaling), so rounding it to an integer with ties to even
/// and scaling back is the one correct rounding.
pub fn f16_from_f64(x: f64) -> f16 {
    if !x.is_finite() {
        return f16::from_f64(x);
    }
    if x.abs() >= F16_OVERFLOW {
        return if x > 0.0 {
            f16::INFINITY
        } else {
            f16::NEG_INFINITY
        };
    }
    if x == 0.0 {
        return f16::from_f64(x); // keeps the sign of zero
    }
    let biased = ((x.to_bits() >> 52) & 0x7ff) as i32;
    let e = (biased - 1023).max(-14); // f64 subnormals are far below 2^-24 and round to 0 anyway
    let q = 2f64.powi(e - 10);
    let rounded = (x / q).round_ties_even() * q;
    // `rounded` is an f16 value, exactly representable in f32 and f16: no second rounding.
    f16::from_f32(rounded as f32)
}

/// Widens an f16 exactly.
#[inline]
pub fn f16_to_f64(x: f16) -> f64 {
    f64::from(x.to_f32())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_rounding_matches_exhaustive_neighbours() {
        // For every finite f16 a and its successor b, the midpoint and points just
        // around it must round to the right neighbour (ties to even).
        for bits in 0u16..0x7bff {
            let a = f16::from_bits(bits);
            let b = f16::from_bits(bits + 1);
            let (fa, fb) = (f16_to_f64(a), f16_to_f64(b));
            let mid = 0.5 * (fa + fb);
            let even = if bits % 2 == 0 { a } else { b };
            assert_eq!(f16_from_f64(mid).to_bits(), even.to_bits(), "tie at {mid}");
            let below = mid - (fb - fa) * 1e-9;
            let above = mid + (fb - fa) * 1e-9;
            assert_eq!(f16_from_f64(below).to_bits(), a.to_bits());
            assert_eq!(f16_from_f64(above).to_bits(), b.to_bits());
            assert_eq!(f16_from_f64(-above).to_bits(), (-b).to_bits());
        }
        assert_eq!(f16_from_f64(65519.99), f16::MAX);
        assert!(f16_from_f64(65520.0).is_infinite());
    }
}
