//! SPEC.md section 8.1: the query rotation's f64 sums by f64 FMAs (exact products).

use crate::simd::path::Path;
use std::arch::x86_64::*;

/// [`rotate_queries_f64`] for `dt <= 128`, reading the rotation in address order: each row
/// is read whole (all `ceil(dt / 8)` f64 chunks of it) while `K` query rows keep every column
/// sum in registers (`K * C <= 24`), heads in passes of K. A column-chunk-first order reads
/// the rows in strided pieces, which the hardware prefetchers follow badly on streamed data.
/// Per column the same FMAs over ascending i: the same sums.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
unsafe fn rotate_rows_in_order(
    rot: *const f32,
    d: usize,
    dt: usize,
    n: usize,
    q: *const f32,
    acc: *mut f64,
) {
    // One pass of up to K query rows from row h0 with C chunks; evaluates to K.
    macro_rules! pass {
        ($C:literal, $K:literal, $h0:expr) => {{
            let (q, acc) = (q.add($h0 * d), acc.add($h0 * dt));
            match (n - $h0).min($K) {
                1 => rotate_rows_pass::<$C, 1>(rot, d, dt, q, acc),
                2 => rotate_rows_pass::<$C, 2>(rot, d, dt, q, acc),
                3 => rotate_rows_pass::<$C, 3>(rot, d, dt, q, acc),
                _ => rotate_rows_pass::<$C, 4>(rot, d, dt, q, acc),
            }
            $K
        }};
    }
    let chunks = dt.div_ceil(8);
    let mut h0 = 0;
    while h0 < n {
        h0 += if chunks <= 4 {
            pass!(4, 4, h0)
        } else if chunks <= 8 {
            pass!(8, 3, h0)
        } else if chunks <= 12 {
            pass!(12, 2, h0)
        } else {
            pass!(16, 1, h0)
        };
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn rotate_rows_pass<const C: usize, const K: usize>(
    rot: *const f32,
    d: usize,
    dt: usize,
    q: *const f32,
    acc: *mut f64,
) {
    let mut m = [0u8; C];
    for (k, mk) in m.iter_mut().enumerate() {
        let lo = 8 * k;
        *mk = if lo >= dt {
            0
        } else if dt - lo >= 8 {
            0xff
        } else {
            (1u8 << (dt - lo)) - 1
        };
    }
    let mut a = [[_mm512_setzero_pd(); C]; K];
    for i in 0..d {
        let row = rot.add(i * dt);
        let mut qv = [_mm512_setzero_pd(); K];
        for (h, x) in qv.iter_mut().enumerate() {
            *x = _mm512_set1_pd(f64::from(*q.add(h * d + i)));
        }
        for k in 0..C {
            if m[k] == 0 {
                continue;
            }
            // Masked-off columns past `dt` read nothing (wrapping_add: never dereferenced there).
            let p = row.wrapping_add(8 * k);
            let r = _mm512_cvtps_pd(if m[k] == 0xff {
                _mm256_loadu_ps(p)
            } else {
                _mm256_maskz_loadu_ps(m[k], p)
            });
            for h in 0..K {
                a[h][k] = _mm512_fmadd_pd(r, qv[h], a[h][k]);
            }
        }
    }
    for (h, ah) in a.iter().enumerate() {
        for k in 0..C {
            if m[k] != 0 {
                _mm512_mask_storeu_pd(acc.add(h * dt + 8 * k), m[k], ah[k]);
            }
        }
    }
}

/// SPEC.md section 8.1's sums for `N` queries (`q` rows `d` apart): `acc[h][j] = sum_i
/// f64(R[i][j]) * f64(q_h[i])` over ascending i, `R` the stored `d x dt` rotation, `acc` rows
/// `dt` apart. Up to `dt = 128` the rotation is read row by row ([`rotate_rows_in_order`],
/// 1.2 % faster decode steps at 131K tokens than the column-chunk order below, in-process
/// A/B); wider rotations go four 8-column chunks per pass, each rotation row loaded and
/// widened once for all N rows, 4N independent chains in registers. The f64 product of two f32 values
/// is exact, so `fma(r, q, a)` rounds exactly as `a + r * q` does: the reference's sums bit
/// for bit.
///
/// # Safety
/// AVX-512 available; `rot` holds `d * dt` floats, `q` `(N - 1) * d + d`, `acc` `N * dt`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn rotate_queries_f64<const N: usize>(
    rot: &[f32],
    d: usize,
    dt: usize,
    q: *const f32,
    acc: *mut f64,
) {
    Path::Avx512.ran();
    if dt <= 128 {
        rotate_rows_in_order(rot.as_ptr(), d, dt, N, q, acc);
        return;
    }
    let mut c = 0;
    while c < dt {
        let mut a = [[_mm512_setzero_pd(); 4]; N];
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
        for i in 0..d {
            let row = rot.as_ptr().add(i * dt + c);
            let mut r = [_mm512_setzero_pd(); 4];
            for k in 0..4 {
                // Masked-off chunks past `dt` read nothing (wrapping_add: the address may lie
                // past the slice, and is never dereferenced there).
                let p = row.wrapping_add(8 * k);
                r[k] = _mm512_cvtps_pd(if m[k] == 0xff {
                    _mm256_loadu_ps(p)
                } else {
                    _mm256_maskz_loadu_ps(m[k], p)
                });
            }
            for (h, ah) in a.iter_mut().enumerate() {
                let qv = _mm512_set1_pd(f64::from(*q.add(h * d + i)));
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

/// Most rotation rows (head dims) [`rotate_queries_f16`] takes (its queries are widened to
/// f64 once, on the stack).
pub const ROTATE_F16_MAX_D: usize = 256;

/// [`rotate_queries_f64`] reading the stored f16 rotation itself (SPEC 8.1 widens it exactly,
/// so no f32 copy of it is made): columns in blocks of 32 (four 8-lane f64 chunks), all `N <= 4`
/// query rows per block, so each element is loaded and widened once and feeds `N` FMAs, 16
/// independent sums in registers. Per column the same FMAs over ascending i as
/// [`rotate_queries_f64`]: the same sums.
///
/// # Safety
/// AVX-512 available; `rot` holds `d * dt` f16, `q` `(N - 1) * d + d` floats, `acc` `N * dt`;
/// `d <= ROTATE_F16_MAX_D`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn rotate_queries_f16<const N: usize>(
    rot: *const half::f16,
    d: usize,
    dt: usize,
    q: *const f32,
    acc: *mut f64,
) {
    Path::Avx512.ran();
    let mut qd = [0f64; 4 * ROTATE_F16_MAX_D];
    for h in 0..N {
        for i in 0..d {
            qd[h * d + i] = f64::from(*q.add(h * d + i));
        }
    }
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
                let qv = _mm512_set1_pd(qd[h * d + i]);
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
