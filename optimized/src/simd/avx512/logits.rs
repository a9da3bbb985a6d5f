//! SPEC.md section 9, key side: tile logits, four tokens x four heads per pass, on f32 or f16 rows.

use super::{hsum4, lanes16, ld_f16, ldm_f16};
use crate::simd::common::TILE;
use crate::simd::path::Path;
use half::f16;
use std::arch::x86_64::*;

/// Rows of a tile the logits kernel reads 16 at a time as f32: f32 rows as they are, f16
/// rows widened as they are loaded (exactly, so both give the same logits for the same values).
pub trait TileRow: Copy {
    /// 16 elements at `p`, as f32.
    ///
    /// # Safety
    /// AVX-512 F available (callers are `#[target_feature]` kernels); 16 elements readable.
    unsafe fn load16(p: *const Self) -> __m512;
    /// The first lanes of `k` at `p`, the others 0; reads only those lanes.
    ///
    /// # Safety
    /// As [`TileRow::load16`], for the lanes of `k`.
    unsafe fn load16_masked(p: *const Self, k: u16) -> __m512;
}

impl TileRow for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn load16_masked(p: *const f32, k: u16) -> __m512 {
        _mm512_maskz_loadu_ps(k, p)
    }
}

impl TileRow for f16 {
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> __m512 {
        ld_f16(p)
    }
    #[inline(always)]
    unsafe fn load16_masked(p: *const f16, k: u16) -> __m512 {
        ldm_f16(p, k)
    }
}

/// T tokens x N heads of [`tile_logits`]: `4 N` (T = 4) accumulators, each query chunk loaded
/// once for the T tokens; the T sums of a head come out of one [`super::hsum4`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn tile_logits_pass<R: TileRow, const N: usize, const T: usize>(
    q: *const f32,
    dp: usize,
    rows: *const R,
    stride: usize,
    scale: f32,
    out: *mut f32,
) {
    let mut acc = [[_mm512_setzero_ps(); T]; N];
    let d16 = dp / 16 * 16;
    let mut c = 0;
    while c < dp {
        let mut k = [_mm512_setzero_ps(); T];
        let m = lanes16(dp - c);
        for (j, kj) in k.iter_mut().enumerate() {
            let p = rows.add(j * stride + c);
            *kj = if c < d16 {
                R::load16(p)
            } else {
                R::load16_masked(p, m)
            };
        }
        for (h, ah) in acc.iter_mut().enumerate() {
            let qp = q.add(h * dp + c);
            let qv = if c < d16 {
                _mm512_loadu_ps(qp)
            } else {
                _mm512_maskz_loadu_ps(m, qp)
            };
            for j in 0..T {
                ah[j] = _mm512_fmadd_ps(qv, k[j], ah[j]);
            }
        }
        c += 16;
    }
    let sv = _mm_set1_ps(scale);
    for (h, ah) in acc.iter().enumerate() {
        let o = out.add(h * TILE);
        if T == 4 {
            _mm_storeu_ps(o, _mm_mul_ps(sv, hsum4(ah)));
        } else {
            for (j, &x) in ah.iter().enumerate() {
                *o.add(j) = scale * _mm512_reduce_add_ps(x);
            }
        }
    }
}

/// Logits `out[h * TILE + t] = scale * q_h . row_t` for `g` heads (`q` `[g][dp]`) and
/// `n <= TILE` rows at `rows + t * stride` (`dp` elements each, f32 or f16): four tokens x up
/// to four heads per pass, 16 lanes per FMA. The sums run in a different order than the AVX2
/// kernel's (16 lanes, then a tree), so the logits agree to rounding, not bit for bit; f16
/// rows give exactly the logits of the same values as f32 rows.
///
/// # Safety
/// AVX-512 available; `q` holds `g * dp` floats, `out` `(g - 1) * TILE + n`; row `t < n`
/// holds `dp` elements at `rows + t * stride`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn tile_logits<R: TileRow>(
    q: *const f32,
    g: usize,
    dp: usize,
    rows: *const R,
    stride: usize,
    n: usize,
    scale: f32,
    out: *mut f32,
) {
    Path::Avx512.ran();
    macro_rules! pass {
        ($N:literal, $qp:expr, $rp:expr, $op:expr, $left:expr) => {
            match $left {
                1 => tile_logits_pass::<R, $N, 1>($qp, dp, $rp, stride, scale, $op),
                2 => tile_logits_pass::<R, $N, 2>($qp, dp, $rp, stride, scale, $op),
                3 => tile_logits_pass::<R, $N, 3>($qp, dp, $rp, stride, scale, $op),
                _ => tile_logits_pass::<R, $N, 4>($qp, dp, $rp, stride, scale, $op),
            }
        };
    }
    let mut h0 = 0;
    while h0 < g {
        let (qp, op) = (q.add(h0 * dp), out.add(h0 * TILE));
        let mut t = 0;
        while t < n {
            let (rp, o) = (rows.add(t * stride), op.add(t));
            match g - h0 {
                1 => pass!(1, qp, rp, o, n - t),
                2 => pass!(2, qp, rp, o, n - t),
                3 => pass!(3, qp, rp, o, n - t),
                _ => pass!(4, qp, rp, o, n - t),
            }
            t += 4;
        }
        h0 += 4;
    }
}
