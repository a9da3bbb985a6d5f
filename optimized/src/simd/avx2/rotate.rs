//! SPEC.md section 8.1: the query rotation's f64 sums, four lanes by f64 FMAs (exact products).

use crate::simd::path::Path;
use std::arch::x86_64::*;

/// SPEC 8.1's sums for `N <= 2` query rows (`qd`, widened to f64, rows `d` apart) straight
/// from the stored f16 rotation (widened exactly by F16C, no f32 copy): columns in blocks of 16
/// (four 4-lane f64 chunks), `N` rows per block, 8 independent sums in registers. `acc[h][j] =
/// sum_i f64(R[i][j]) * qd_h[i]` over ascending i by FMAs, which round as mul-then-add since
/// the f64 product of two f32 values is exact: the reference's sums bit for bit.
///
/// # Safety
/// AVX2, FMA, F16C available; `rot` holds `d * dt` f16, `qd` `N * d` f64, `acc` `N * dt`.
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn rotate_queries<const N: usize>(
    rot: *const half::f16,
    d: usize,
    dt: usize,
    qd: *const f64,
    acc: *mut f64,
) {
    Path::Avx2.ran();
    let rot = rot as *const u16;
    let mut c = 0;
    while c < dt {
        let w = (dt - c).min(16);
        let mut a = [[_mm256_setzero_pd(); 4]; N];
        let mut tail = [0u16; 16];
        for i in 0..d {
            let mut row = rot.add(i * dt + c);
            if w < 16 {
                // The last, narrower block: its columns copied, the rest zero.
                std::ptr::copy_nonoverlapping(row, tail.as_mut_ptr(), w);
                row = tail.as_ptr();
            }
            let mut r = [_mm256_setzero_pd(); 4];
            for (k, rk) in r.iter_mut().enumerate() {
                let h4 = _mm_loadl_epi64(row.add(4 * k) as *const __m128i);
                *rk = _mm256_cvtps_pd(_mm_cvtph_ps(h4));
            }
            for (h, ah) in a.iter_mut().enumerate() {
                let qv = _mm256_set1_pd(*qd.add(h * d + i));
                for k in 0..4 {
                    ah[k] = _mm256_fmadd_pd(r[k], qv, ah[k]);
                }
            }
        }
        let mut out = [0f64; 16];
        for (h, ah) in a.iter().enumerate() {
            for k in 0..4 {
                _mm256_storeu_pd(out.as_mut_ptr().add(4 * k), ah[k]);
            }
            std::ptr::copy_nonoverlapping(out.as_ptr(), acc.add(h * dt + c), w);
        }
        c += 16;
    }
}
