//! What every kernel layer shares: the tile size, and the scalar arithmetic that the SIMD
//! kernels reproduce lane for lane (exact f16 widening, the reduction tree of an 8-lane sum,
//! the `exp` polynomial, SPEC.md section 8.2's final f64 combination). A leaf: the portable,
//! AVX2 and AVX-512 layers import from here, and it imports none of them.

/// Tokens per attention tile (rows expanded to f32 and processed together).
pub const TILE: usize = 16;

/// Rounds up to a multiple of 8 (the f32 lanes of an AVX2 register): the padded width of
/// the rows and queries the kernels take.
#[inline]
pub fn pad8(x: usize) -> usize {
    x.div_ceil(8) * 8
}

/// Exact f16 -> f32 from the bit pattern (portable).
#[inline]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = if exp == 0 {
        if man == 0 {
            sign
        } else {
            // Subnormal: value = man * 2^-24, exact in f32.
            let v = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
    } else if exp == 31 {
        sign | 0x7f80_0000 | (man << 13)
    } else {
        sign | ((exp + 112) << 23) | (man << 13)
    };
    f32::from_bits(bits)
}

/// The reduction tree the AVX2 path uses: (hi128 + lo128), then movehl, then lane 1.
#[inline]
pub(crate) fn reduce8(a: &[f32; 8]) -> f32 {
    let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let t = [s[0] + s[2], s[1] + s[3]];
    t[0] + t[1]
}

/// `fast_exp`'s constants, shared by the SIMD versions (`exp256`, `avx512::exp512`), which must
/// stay lane for lane the same polynomial: `ln 2` split in a high part (exact in f32) and a
/// low correction, and the degree-5 coefficients of `(e^r - 1 - r) / r^2`, highest first.
pub(crate) const EXP_LN2_HI: f32 = 0.693_359_4;
pub(crate) const EXP_LN2_LO: f32 = -2.121_944_4e-4;
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    5.000_000_1e-1,
];

/// Fast `exp` (Cephes-style polynomial, ~2 ulp), branch- and cast-free so loops over it vectorize.
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    // Round to nearest integer: n is integral and |n| <= 127.
    let n = (x * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
    let r = x - n * EXP_LN2_HI - n * EXP_LN2_LO;
    let r2 = r * r;
    let c = EXP_POLY;
    let p = ((((c[0] * r + c[1]) * r + c[2]) * r + c[3]) * r + c[4]) * r + c[5];
    let y = p * r2 + r + 1.0;
    // 2^n: n + 127 + 2^23 holds the integer n + 127 in its mantissa bits.
    let e = ((n + (127.0 + 8_388_608.0)).to_bits() & 0x7f_ffff) << 23;
    y * f32::from_bits(e)
}

/// SPEC 8.2's last step for one block: `f32(max_h (s_b * sq[h]) * (I_h + W / 2))` in f64,
/// the reference's order of operations; the max with `prev` unless `first`.
#[inline(always)]
pub(crate) fn combine_scores<const N: usize>(
    sums: &[i32; 4],
    w: i32,
    sq: &[f64; 4],
    sb: f32,
    first: bool,
    prev: f32,
) -> f32 {
    let mut best = f64::NEG_INFINITY;
    for h in 0..N {
        best = best.max(f64::from(sb) * sq[h] * (f64::from(sums[h]) + 0.5 * f64::from(w)));
    }
    let v = best as f32;
    if first {
        v
    } else {
        prev.max(v)
    }
}

/// `x <- exp(x - shift)` for a slice whose entries are <= shift (softmax numerators).
///
/// Branch-free Cephes-style expf (range reduction by ln 2, degree-6 polynomial, exponent bits
/// assembled directly), so the loop vectorizes; relative error about 2e-7, like libm's expf.
#[inline(always)]
pub fn exp_shifted_in_place(xs: &mut [f32], shift: f32) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    for x in xs.iter_mut() {
        let v = (*x - shift).max(-87.0);
        let n = (v * LOG2E + ROUND) - ROUND;
        let r = v - n * LN2_HI - n * LN2_LO;
        let mut p = 1.987_569_1e-4f32;
        p = p * r + 1.398_199_9e-3;
        p = p * r + 8.333_452e-3;
        p = p * r + 4.166_579_6e-2;
        p = p * r + 1.666_666_5e-1;
        p = p * r + 5e-1;
        let e = p * r * r + r + 1.0;
        // 2^n: n + 127 + 2^23 holds the integer n + 127 in its mantissa bits (the same bits
        // as `(n as i32 + 127) << 23`, whose saturating cast kept the loop from vectorizing)
        let bits = ((n + (127.0 + 8_388_608.0)).to_bits() & 0x7f_ffff) << 23;
        *x = e * f32::from_bits(bits);
    }
}

/// The softmax numerators of a span's scores, `[group][m]` in place (`exp(score - max)` per
/// query head), with each head's max and sum: the part the portable and AVX2 span kernels of
/// the engine's dense attention share (inlined, so the AVX2 kernel compiles it for AVX2).
#[inline(always)]
pub(crate) fn span_softmax(scores: &mut [f32], group: usize, m: usize) -> (Vec<f32>, Vec<f32>) {
    let mut mx = vec![0f32; group];
    let mut sum = vec![0f32; group];
    for g in 0..group {
        let s = &mut scores[g * m..(g + 1) * m];
        let mg = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        exp_shifted_in_place(s, mg);
        mx[g] = mg;
        sum[g] = s.iter().sum();
    }
    (mx, sum)
}
