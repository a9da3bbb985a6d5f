//! SPEC.md section 8.2: integer block scores, `vpmaddubsw` + `vpmaddwd`.

use super::hsum4_i32;
use crate::simd::common::combine_scores;
use crate::simd::path::Path;
use std::arch::x86_64::*;

/// SPEC 8.2 integer scores (see `portable_score_int`): 32 bytes per step with
/// `vpmaddubsw` (u8 query halves x i8 bounds; pair sums <= 2 * 127 * 128 never saturate)
/// and `vpmaddwd` by ones; `W` from `vpabsb`, `vpmaxub`, `vpsadbw`. The last partial
/// chunk of a row is copied to a zeroed local first (no read past the row).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn score_int<const N: usize>(
    pos: &[u8],
    neg: &[u8],
    qstride: usize,
    sq: &[f64; 4],
    dt: usize,
    min: &[i8],
    max: &[i8],
    scale: &[f32],
    first: bool,
    out: &mut [f32],
) {
    Path::Avx2.ran();
    let ones = _mm256_set1_epi16(1);
    let zero = _mm256_setzero_si256();
    let d32 = dt / 32 * 32;
    let (pp, np) = (pos.as_ptr(), neg.as_ptr());
    for (b, o) in out.iter_mut().enumerate() {
        let (mxp, mnp) = (max.as_ptr().add(b * dt), min.as_ptr().add(b * dt));
        let mut acc = [zero; N];
        let mut wacc = zero;
        let mut c = 0;
        while c < dt {
            let (mut tx, mut tn) = ([0i8; 32], [0i8; 32]);
            let (mx, mn) = if c < d32 {
                (
                    _mm256_loadu_si256(mxp.add(c) as *const __m256i),
                    _mm256_loadu_si256(mnp.add(c) as *const __m256i),
                )
            } else {
                tx[..dt - c].copy_from_slice(&max[b * dt + c..(b + 1) * dt]);
                tn[..dt - c].copy_from_slice(&min[b * dt + c..(b + 1) * dt]);
                (
                    _mm256_loadu_si256(tx.as_ptr() as *const __m256i),
                    _mm256_loadu_si256(tn.as_ptr() as *const __m256i),
                )
            };
            let w = _mm256_max_epu8(_mm256_abs_epi8(mx), _mm256_abs_epi8(mn));
            wacc = _mm256_add_epi64(wacc, _mm256_sad_epu8(w, zero));
            for h in 0..N {
                let p = _mm256_loadu_si256(pp.add(h * qstride + c) as *const __m256i);
                let n = _mm256_loadu_si256(np.add(h * qstride + c) as *const __m256i);
                let hi = _mm256_madd_epi16(_mm256_maddubs_epi16(p, mx), ones);
                let lo = _mm256_madd_epi16(_mm256_maddubs_epi16(n, mn), ones);
                acc[h] = _mm256_sub_epi32(_mm256_add_epi32(acc[h], hi), lo);
            }
            c += 32;
        }
        let ws = _mm_add_epi64(
            _mm256_castsi256_si128(wacc),
            _mm256_extracti128_si256::<1>(wacc),
        );
        let w = (_mm_cvtsi128_si64(ws) + _mm_extract_epi64::<1>(ws)) as i32;
        let mut d = [zero; 4];
        d[..N].copy_from_slice(&acc);
        let mut sums = [0i32; 4];
        _mm_storeu_si128(sums.as_mut_ptr() as *mut __m128i, hsum4_i32(&d));
        *o = combine_scores::<N>(&sums, w, sq, scale[b], first, *o);
    }
}
