//! Notation (SPEC.md section 2): f64 -> f16 rounded once, to nearest, ties to even, and
//! the exact f16 -> f64 widening; the reference's `round.rs`.

use half::f16;

/// f64 -> f16 rounded once, to nearest, ties to even (SPEC 5 step 1). `half::f16::from_f64`
/// goes through f32 on F16C machines (two roundings), so this is done on the bits.
/// Zeros keep their sign, |x| >= 65520 gives +-Inf, NaN stays NaN.
#[inline]
pub fn f16_from_f64(x: f64) -> f16 {
    let b = x.to_bits();
    let sign = ((b >> 48) & 0x8000) as u16;
    let a = b & 0x7fff_ffff_ffff_ffff;
    if a >= 0x7ff0_0000_0000_0000 {
        return f16::from_f64(x); // Inf / NaN: no rounding involved
    }
    if f64::from_bits(a) >= 65520.0 {
        return f16::from_bits(sign | 0x7c00);
    }
    let e = (a >> 52) as i32 - 1023;
    if e >= -14 {
        let mant = a & ((1u64 << 52) - 1);
        let mut h = (((e + 15) as u64) << 10) | (mant >> 42);
        let rem = mant & ((1u64 << 42) - 1);
        let half = 1u64 << 41;
        if rem > half || (rem == half && h & 1 == 1) {
            h += 1; // a carry into the exponent is the correct next binade
        }
        f16::from_bits(sign | h as u16)
    } else {
        // Subnormal f16 range: multiples of 2^-24 (the scaling is exact).
        let m = (f64::from_bits(a) * 16_777_216.0).round_ties_even();
        f16::from_bits(sign | m as u16)
    }
}

/// The exact f64 value of an f16, from its bits (what `half`'s `to_f64` gives, without its
/// runtime dispatch, so it inlines into the loss search's loops).
#[inline]
pub fn f16_to_f64(h: f16) -> f64 {
    let b = h.to_bits();
    let sign = u64::from(b >> 15) << 63;
    let exp = (b >> 10) & 0x1f;
    let mant = u64::from(b & 0x3ff);
    match exp {
        // zero and subnormals: mant * 2^-24 (exact)
        0 => {
            let m = (mant as f64) * (1.0 / 16_777_216.0);
            if sign != 0 {
                -m
            } else {
                m
            }
        }
        0x1f if mant == 0 => f64::from_bits(sign | 0x7ff0_0000_0000_0000),
        0x1f => f64::NAN,
        _ => f64::from_bits(sign | (u64::from(exp) + 1008) << 52 | mant << 42),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bit-level f16 -> f64 conversion is `half`'s, for every f16 (NaN for NaN).
    #[test]
    fn f16_to_f64_is_exact_for_every_f16() {
        for b in 0..=u16::MAX {
            let h = f16::from_bits(b);
            let (ours, theirs) = (f16_to_f64(h), h.to_f64());
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{b:#x}");
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{b:#x}");
            }
        }
    }
}
