//! AVX2 + FMA kernels of the ggml weight-row products (`simd/weights.rs`): Q4_1 and Q8_0
//! rows against Q8_1 activations, Q4_K and Q6_K rows against Q8_K ones.

use crate::simd::ggml::{
    check_k_activations, f16_at_f16c, q4_k_scales, QVec, Q4_K_BYTES, Q6_K_BYTES, Q8K, QK, QK_K,
};
use std::arch::x86_64::*;

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Q4_1 row x Q8_1 activation. Safety: the CPU has avx2 and fma.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn dot_q4_1(qs: &[u8], dm: &[[f32; 2]], x: &QVec) -> f32 {
    let nb = dm.len();
    assert!(qs.len() == nb * 16 && x.qs.len() == nb * QK && x.d.len() == nb && x.s.len() == nb);
    let mask = _mm_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut macc = 0f32;
    let (qp, xp) = (qs.as_ptr(), x.qs.as_ptr());
    let mut b = 0;
    // SAFETY (all loads): b < nb, and the asserts above bound every offset by the lengths.
    while b + 1 < nb {
        let p0 = _mm_loadu_si128(qp.add(b * 16) as *const __m128i);
        let p1 = _mm_loadu_si128(qp.add(b * 16 + 16) as *const __m128i);
        let w0 = _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16(p0, 4), mask),
            _mm_and_si128(p0, mask),
        );
        let w1 = _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16(p1, 4), mask),
            _mm_and_si128(p1, mask),
        );
        let x0 = _mm256_loadu_si256(xp.add(b * QK) as *const __m256i);
        let x1 = _mm256_loadu_si256(xp.add(b * QK + QK) as *const __m256i);
        // u8 (0..15) x i8 (-127..127) pairs: |sum| <= 2 * 15 * 127, no i16 saturation
        let s0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), ones));
        let s1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w1, x1), ones));
        let ([d0, m0], [d1, m1]) = (*dm.get_unchecked(b), *dm.get_unchecked(b + 1));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0 * *x.d.get_unchecked(b)), s0, acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d1 * *x.d.get_unchecked(b + 1)), s1, acc1);
        macc += m0 * *x.s.get_unchecked(b) + m1 * *x.s.get_unchecked(b + 1);
        b += 2;
    }
    if b < nb {
        let p0 = _mm_loadu_si128(qp.add(b * 16) as *const __m128i);
        let w0 = _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16(p0, 4), mask),
            _mm_and_si128(p0, mask),
        );
        let x0 = _mm256_loadu_si256(xp.add(b * QK) as *const __m256i);
        let s0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), ones));
        let [d0, m0] = dm[b];
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0 * x.d[b]), s0, acc0);
        macc += m0 * x.s[b];
    }
    hsum(_mm256_add_ps(acc0, acc1)) + macc
}

/// Q8_0 row x Q8 activation. Safety: the CPU has avx2 and fma.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn dot_q8_0(qs: &[i8], d: &[f32], x: &QVec) -> f32 {
    let nb = d.len();
    assert!(qs.len() == nb * QK && x.qs.len() == nb * QK && x.d.len() == nb);
    let ones = _mm256_set1_epi16(1);
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let (qp, xp) = (qs.as_ptr(), x.qs.as_ptr());
    // sign trick: |w| (unsigned) x sign(w) * x (signed); activations are in -127..=127, so
    // sign(w) * x never overflows, and |w| = 128 for w = -128 reads correctly as unsigned
    let mut b = 0;
    // SAFETY (all loads): b < nb, and the asserts above bound every offset by the lengths.
    while b < nb {
        let w = _mm256_loadu_si256(qp.add(b * QK) as *const __m256i);
        let v = _mm256_loadu_si256(xp.add(b * QK) as *const __m256i);
        let s = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(v, w));
        let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
        let sc = _mm256_set1_ps(*d.get_unchecked(b) * *x.d.get_unchecked(b));
        if b % 2 == 0 {
            acc0 = _mm256_fmadd_ps(sc, s, acc0);
        } else {
            acc1 = _mm256_fmadd_ps(sc, s, acc1);
        }
        b += 1;
    }
    hsum(_mm256_add_ps(acc0, acc1))
}

/// Q4_K row x `N` Q8_K activations (the layout of `dot_q4_k_portable`). Per block: the
/// nibbles of each 32 bytes, unpacked once, against the 64 bytes of each activation they
/// multiply, `maddubs` (u8 0..15 x i8: pair sums within i16), `madd` by the sub-block scale
/// into i32, then one float multiply-add per block; the mins term is a scalar sum over the 8
/// sub-blocks. Each activation's result goes through the same operations in the same order
/// whatever `N`, so it is the same bit for bit.
/// Safety: the CPU has avx2, fma and f16c.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_k<const N: usize>(row: &[u8], xs: [&Q8K; N]) -> [f32; N] {
    let nb = row.len() / Q4_K_BYTES;
    assert_eq!(row.len(), nb * Q4_K_BYTES);
    check_k_activations(nb, &xs);
    let mask = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); N];
    let mut mins = [0f32; N];
    for b in 0..nb {
        let blk = &row[b * Q4_K_BYTES..(b + 1) * Q4_K_BYTES];
        let (d, dmin) = (f16_at_f16c(blk, 0), f16_at_f16c(blk, 2));
        let (s, m) = q4_k_scales(&blk[4..16]);
        let mut isum = [_mm256_setzero_si256(); N];
        let qp = blk.as_ptr().add(16);
        // SAFETY (loads): 4 x 32 bytes of the block's 128 nibble bytes; 8 x 32 activation
        // bytes of block b, inside the asserted lengths
        for j in 0..4 {
            let w = _mm256_loadu_si256(qp.add(32 * j) as *const __m256i);
            let lo = _mm256_and_si256(w, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
            let (s0, s1) = (
                _mm256_set1_epi16(s[2 * j] as i16),
                _mm256_set1_epi16(s[2 * j + 1] as i16),
            );
            for (x, isum) in xs.iter().zip(isum.iter_mut()) {
                let xp = x.qs.as_ptr().add(b * QK_K + 64 * j);
                let x0 = _mm256_loadu_si256(xp as *const __m256i);
                let x1 = _mm256_loadu_si256(xp.add(32) as *const __m256i);
                let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), s0);
                let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), s1);
                *isum = _mm256_add_epi32(*isum, _mm256_add_epi32(p0, p1));
            }
        }
        for i in 0..N {
            let x = xs[i];
            let bs = &x.bsums[b * 16..(b + 1) * 16];
            let msum: i32 = (0..8)
                .map(|j| m[j] as i32 * (bs[2 * j] as i32 + bs[2 * j + 1] as i32))
                .sum();
            let dx = x.d[b];
            mins[i] += dx * dmin * msum as f32;
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dx * d), _mm256_cvtepi32_ps(isum[i]), acc[i]);
        }
    }
    std::array::from_fn(|i| hsum(acc[i]) - mins[i])
}

/// Q6_K row x `N` Q8_K activations (the layout of `dot_q6_k_portable`). Per half block:
/// the 6-bit values of four groups of 32 assembled once from `ql` and `qh` by shifts and
/// masks (no bit crosses a byte after the mask), `maddubs` against each activation (u8 0..63
/// x i8), `madd` by the two sub-block scales of the group into i32. The `-32` offset is
/// taken out with the activation's block sums. The same bit for bit whatever `N`.
/// Safety: the CPU has avx2, fma and f16c.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q6_k<const N: usize>(row: &[u8], xs: [&Q8K; N]) -> [f32; N] {
    let nb = row.len() / Q6_K_BYTES;
    assert_eq!(row.len(), nb * Q6_K_BYTES);
    check_k_activations(nb, &xs);
    let m4 = _mm256_set1_epi8(0x0F);
    let m30 = _mm256_set1_epi8(0x30);
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..nb {
        let blk = &row[b * Q6_K_BYTES..(b + 1) * Q6_K_BYTES];
        let d = f16_at_f16c(blk, 208);
        let sc = &blk[192..208];
        let mut isum = [_mm256_setzero_si256(); N];
        // SAFETY (loads): ql bytes 0..128, qh bytes 128..192 of the block; 8 x 32
        // activation bytes of block b, inside the asserted lengths
        for h in 0..2 {
            let lp = blk.as_ptr().add(64 * h);
            let ql0 = _mm256_loadu_si256(lp as *const __m256i);
            let ql1 = _mm256_loadu_si256(lp.add(32) as *const __m256i);
            let qh = _mm256_loadu_si256(blk.as_ptr().add(128 + 32 * h) as *const __m256i);
            let groups = [
                _mm256_or_si256(
                    _mm256_and_si256(ql0, m4),
                    _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(ql1, m4),
                    _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                    _mm256_and_si256(qh, m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                    _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
                ),
            ];
            for (k, q) in groups.into_iter().enumerate() {
                let s = 8 * h + 2 * k;
                // low 128 bits: sub-block s, high: s + 1
                let scale = _mm256_set_m128i(
                    _mm_set1_epi16(sc[s + 1] as i8 as i16),
                    _mm_set1_epi16(sc[s] as i8 as i16),
                );
                for (x, isum) in xs.iter().zip(isum.iter_mut()) {
                    let xp = x.qs.as_ptr().add(b * QK_K + 128 * h + 32 * k);
                    let v = _mm256_loadu_si256(xp as *const __m256i);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, v), scale);
                    *isum = _mm256_add_epi32(*isum, p);
                }
            }
        }
        for i in 0..N {
            let x = xs[i];
            let bs = &x.bsums[b * 16..(b + 1) * 16];
            let offset: i32 = (0..16).map(|s| sc[s] as i8 as i32 * bs[s] as i32).sum();
            let isum =
                _mm256_sub_epi32(isum[i], _mm256_setr_epi32(32 * offset, 0, 0, 0, 0, 0, 0, 0));
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(x.d[b] * d), _mm256_cvtepi32_ps(isum), acc[i]);
        }
    }
    std::array::from_fn(|i| hsum(acc[i]))
}
