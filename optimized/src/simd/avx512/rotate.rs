//! SPEC.md section 8.1: the query rotation's f64 sums by f64 FMAs (exact products).

use crate::simd::path::Path;
use std::arch::x86_64::*;

/// SPEC.md section 8.1's sums for `N <= 4` query rows (`qd`, widened to f64, rows `d` apart)
/// straight from the stored f16 rotation (widened exactly, no f32 copy of it): `acc[h][j] =
/// sum_i f64(R[i][j]) * qd_h[i]` over ascending i, `acc` rows `dt` apart. Columns in blocks of
/// 32 (four 8-lane f64 chunks), all `N` rows per block, so each element is loaded and widened
/// once and feeds `N` FMAs, 16 independent sums in registers. The f64 product of two f32
/// values is exact, so `fma(r, q, a)` rounds as `a + r * q` does: the reference's sums bit for
/// bit.
///
/// # Safety
/// AVX-512 available; `rot` holds `d * dt` f16, `qd` `N * d` f64, `acc` `N * dt`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn rotate_queries<const N: usize>(
    rot: *const half::f16,
    d: usize,
    dt: usize,
    qd: *const f64,
    acc: *mut f64,
) {
    Path::Avx512.ran();
    let rot = rot as *const u16;
    let mut c = 0;
    while c < dt {
        let mut m = [0u8; 4];
        for (k, mk) in m.iter_mut().enumerate() {
            let lo = c + 8 * k;
            *mk = if lo >= dt {
                0
            } else if dt - lo >= 8 {
                0xff
            } else {
                (1u8 << (dt - lo)) - 1
            };
        }
        let mut a = [[_mm512_setzero_pd(); 4]; N];
        for i in 0..d {
            let row = rot.add(i * dt + c);
            let mut r = [_mm512_setzero_pd(); 4];
            for k in 0..4 {
                // Masked-off chunks past `dt` read nothing (wrapping_add: never dereferenced).
                let p = row.wrapping_add(8 * k) as *const i16;
                let h8 = if m[k] == 0xff {
                    _mm_loadu_si128(p as *const __m128i)
                } else {
                    _mm_maskz_loadu_epi16(m[k], p)
                };
                r[k] = _mm512_cvtps_pd(_mm256_cvtph_ps(h8));
            }
            for (h, ah) in a.iter_mut().enumerate() {
                let qv = _mm512_set1_pd(*qd.add(h * d + i));
                for k in 0..4 {
                    ah[k] = _mm512_fmadd_pd(r[k], qv, ah[k]);
                }
            }
        }
        for (h, ah) in a.iter().enumerate() {
            for k in 0..4 {
                _mm512_mask_storeu_pd(acc.add(h * dt).wrapping_add(c + 8 * k), m[k], ah[k]);
            }
        }
        c += 32;
    }
}
