//! SPEC.md section 9 on tiles: key logits and value accumulation on f32 tiles or stored f16
//! rows (one macro, two row types), and the f32 dot product.

use super::{hsum, load_ph};
use crate::simd::common::TILE;
use crate::simd::path::Path;
use half::f16;
use std::arch::x86_64::*;

#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    Path::Avx2.ran();
    let n = a.len();
    let n8 = n / 8 * 8;
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i < n8 {
        acc = _mm256_fmadd_ps(
            _mm256_loadu_ps(a.as_ptr().add(i)),
            _mm256_loadu_ps(b.as_ptr().add(i)),
            acc,
        );
        i += 8;
    }
    let mut s = hsum(acc);
    for j in n8..n {
        s += a[j] * b[j];
    }
    s
}

/// SPEC 9's back-rotation of `g` heads from the stored f16 rotation: `out[k * os + i] +=
/// dot(R[i][..dt], acc[k * as_ ..][..dt])` for every row `i < d` of `rot` (`d x dt`,
/// row-major), each row's f16 elements widened once per pass of up to four heads; per head
/// the FMAs, the reduction and the scalar tail of [`dot`] on the widened row, in its order:
/// the same bits.
///
/// # Safety
/// AVX2, FMA, F16C available; `rot` holds `d * dt` f16, `acc` `(g - 1) * as_ + dt` floats,
/// `out` `(g - 1) * os + d`.
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn back_rotate_f16(
    rot: *const f16,
    d: usize,
    dt: usize,
    acc: *const f32,
    as_: usize,
    g: usize,
    out: *mut f32,
    os: usize,
) {
    Path::Avx2.ran();
    let mut h0 = 0;
    while h0 < g {
        let (ap, op) = (acc.add(h0 * as_), out.add(h0 * os));
        match g - h0 {
            1 => back_rotate_pass::<1>(rot, d, dt, ap, as_, op, os),
            2 => back_rotate_pass::<2>(rot, d, dt, ap, as_, op, os),
            3 => back_rotate_pass::<3>(rot, d, dt, ap, as_, op, os),
            _ => back_rotate_pass::<4>(rot, d, dt, ap, as_, op, os),
        }
        h0 += 4;
    }
}

#[target_feature(enable = "avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn back_rotate_pass<const N: usize>(
    rot: *const f16,
    d: usize,
    dt: usize,
    acc: *const f32,
    as_: usize,
    out: *mut f32,
    os: usize,
) {
    let n8 = dt / 8 * 8;
    for i in 0..d {
        let row = rot.add(i * dt);
        let mut a = [_mm256_setzero_ps(); N];
        let mut j = 0;
        while j < n8 {
            let r = load_ph(row.add(j));
            for (k, ak) in a.iter_mut().enumerate() {
                *ak = _mm256_fmadd_ps(r, _mm256_loadu_ps(acc.add(k * as_ + j)), *ak);
            }
            j += 8;
        }
        for (k, &ak) in a.iter().enumerate() {
            let mut s = hsum(ak);
            for j in n8..dt {
                s += (*row.add(j)).to_f32() * *acc.add(k * as_ + j);
            }
            *out.add(k * os + i) += s;
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn ld_f32(p: *const f32) -> __m256 {
    _mm256_loadu_ps(p)
}

macro_rules! tile_kernels {
    ($logits:ident, $accum:ident, $logits_n:ident, $accum_n:ident, $t:ty, $load:ident) => {
        #[target_feature(enable = "avx2,fma,f16c,popcnt")]
        unsafe fn $logits_n<const N: usize>(
            q: *const f32,
            dp: usize,
            rows: *const $t,
            stride: usize,
            n: usize,
            scale: f32,
            out: *mut f32,
        ) {
            // Two tokens per pass: 2N independent FMA chains hide the FMA latency.
            let mut t = 0;
            while t + 2 <= n {
                let (r0, r1) = (rows.add(t * stride), rows.add((t + 1) * stride));
                let mut a0 = [_mm256_setzero_ps(); N];
                let mut a1 = [_mm256_setzero_ps(); N];
                let mut c = 0;
                while c < dp {
                    let k0 = $load(r0.add(c));
                    let k1 = $load(r1.add(c));
                    for h in 0..N {
                        let qv = _mm256_loadu_ps(q.add(h * dp + c));
                        a0[h] = _mm256_fmadd_ps(qv, k0, a0[h]);
                        a1[h] = _mm256_fmadd_ps(qv, k1, a1[h]);
                    }
                    c += 8;
                }
                for h in 0..N {
                    *out.add(h * TILE + t) = scale * hsum(a0[h]);
                    *out.add(h * TILE + t + 1) = scale * hsum(a1[h]);
                }
                t += 2;
            }
            if t < n {
                let row = rows.add(t * stride);
                let mut acc = [_mm256_setzero_ps(); N];
                let mut c = 0;
                while c < dp {
                    let k = $load(row.add(c));
                    for h in 0..N {
                        acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(h * dp + c)), k, acc[h]);
                    }
                    c += 8;
                }
                for h in 0..N {
                    *out.add(h * TILE + t) = scale * hsum(acc[h]);
                }
            }
        }

        #[target_feature(enable = "avx2,fma,f16c,popcnt")]
        unsafe fn $accum_n<const N: usize>(
            p: *const f32,
            dp: usize,
            rows: *const $t,
            stride: usize,
            n: usize,
            acc: *mut f32,
        ) {
            // Two 8-wide column chunks per pass: 2N independent FMA chains.
            let mut c = 0;
            while c + 16 <= dp {
                let mut a = [_mm256_setzero_ps(); N];
                let mut b = [_mm256_setzero_ps(); N];
                for h in 0..N {
                    a[h] = _mm256_loadu_ps(acc.add(h * dp + c));
                    b[h] = _mm256_loadu_ps(acc.add(h * dp + c + 8));
                }
                for t in 0..n {
                    let v0 = $load(rows.add(t * stride + c));
                    let v1 = $load(rows.add(t * stride + c + 8));
                    for h in 0..N {
                        let pv = _mm256_set1_ps(*p.add(h * TILE + t));
                        a[h] = _mm256_fmadd_ps(pv, v0, a[h]);
                        b[h] = _mm256_fmadd_ps(pv, v1, b[h]);
                    }
                }
                for h in 0..N {
                    _mm256_storeu_ps(acc.add(h * dp + c), a[h]);
                    _mm256_storeu_ps(acc.add(h * dp + c + 8), b[h]);
                }
                c += 16;
            }
            while c < dp {
                let mut a = [_mm256_setzero_ps(); N];
                for h in 0..N {
                    a[h] = _mm256_loadu_ps(acc.add(h * dp + c));
                }
                for t in 0..n {
                    let v = $load(rows.add(t * stride + c));
                    for h in 0..N {
                        a[h] = _mm256_fmadd_ps(_mm256_set1_ps(*p.add(h * TILE + t)), v, a[h]);
                    }
                }
                for h in 0..N {
                    _mm256_storeu_ps(acc.add(h * dp + c), a[h]);
                }
                c += 8;
            }
        }

        /// Logits of `g` heads (`q` `[g][dp]`) against `n` rows at `rows + t * stride` (dp elements each).
        #[target_feature(enable = "avx2,fma,f16c,popcnt")]
        pub unsafe fn $logits(
            q: &[f32],
            g: usize,
            dp: usize,
            rows: *const $t,
            stride: usize,
            n: usize,
            scale: f32,
            out: &mut [f32],
        ) {
            Path::Avx2.ran();
            let mut h0 = 0;
            while h0 < g {
                let (qp, op) = (q.as_ptr().add(h0 * dp), out.as_mut_ptr().add(h0 * TILE));
                match g - h0 {
                    1 => $logits_n::<1>(qp, dp, rows, stride, n, scale, op),
                    2 => $logits_n::<2>(qp, dp, rows, stride, n, scale, op),
                    3 => $logits_n::<3>(qp, dp, rows, stride, n, scale, op),
                    _ => $logits_n::<4>(qp, dp, rows, stride, n, scale, op),
                }
                h0 += 4;
            }
        }

        /// `acc_h += sum_t p[h][t] row_t` for `g` heads.
        #[target_feature(enable = "avx2,fma,f16c,popcnt")]
        pub unsafe fn $accum(
            p: &[f32],
            g: usize,
            dp: usize,
            rows: *const $t,
            stride: usize,
            n: usize,
            acc: &mut [f32],
        ) {
            Path::Avx2.ran();
            let mut h0 = 0;
            while h0 < g {
                let (pp, ap) = (p.as_ptr().add(h0 * TILE), acc.as_mut_ptr().add(h0 * dp));
                match g - h0 {
                    1 => $accum_n::<1>(pp, dp, rows, stride, n, ap),
                    2 => $accum_n::<2>(pp, dp, rows, stride, n, ap),
                    3 => $accum_n::<3>(pp, dp, rows, stride, n, ap),
                    _ => $accum_n::<4>(pp, dp, rows, stride, n, ap),
                }
                h0 += 4;
            }
        }
    };
}

tile_kernels!(
    tile_logits_p,
    tile_accumulate_p,
    tl_f32,
    ta_f32,
    f32,
    ld_f32
);
tile_kernels!(
    tile_logits_f16,
    tile_accumulate_f16,
    tl_f16,
    ta_f16,
    f16,
    load_ph
);

#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn tile_logits(
    q: &[f32],
    g: usize,
    dp: usize,
    rows: &[f32],
    n: usize,
    scale: f32,
    out: &mut [f32],
) {
    tile_logits_p(q, g, dp, rows.as_ptr(), dp, n, scale, out)
}

#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn tile_accumulate(
    p: &[f32],
    g: usize,
    dp: usize,
    rows: &[f32],
    n: usize,
    acc: &mut [f32],
) {
    tile_accumulate_p(p, g, dp, rows.as_ptr(), dp, n, acc)
}
