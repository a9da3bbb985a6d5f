//! The online-softmax step of one tile, one 16-lane register per head.

use super::{hmax4, hsum4, lanes16};
use crate::simd::common::{EXP_LN2_HI, EXP_LN2_LO, EXP_POLY, TILE};
use crate::simd::path::Path;
use std::arch::x86_64::*;

/// `exp(x)` on 16 lanes: the AVX2 kernel's polynomial (`simd::x86::exp256`), lane for lane the
/// same operations, hence the same values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn exp512(x: __m512) -> __m512 {
    let x = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(-87.0)),
        _mm512_set1_ps(88.0),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let y = _mm512_fmadd_ps(
        p,
        _mm512_mul_ps(r, r),
        _mm512_add_ps(r, _mm512_set1_ps(1.0)),
    );
    let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(n),
        _mm512_set1_epi32(127),
    ));
    _mm512_mul_ps(y, _mm512_castsi512_ps(e))
}

/// The online-softmax step of one tile (`Path::online_softmax` with `corr` given): for each
/// of `g` heads, the tile's `n` logits (`logits[h * TILE ..]`) become `exp(x - m_new)`, `l` and
/// `m` are updated, and `corr[h] = exp(m_old - m_new)` (0 for an empty state) is the factor
/// the accumulators still have to be scaled by. One 16-lane register per head.
///
/// # Safety
/// AVX-512 available; `m`, `l`, `corr` hold `g` floats, `logits` `g * TILE`; `n <= TILE = 16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn tile_softmax(
    m: *mut f32,
    l: *mut f32,
    g: usize,
    logits: *mut f32,
    n: usize,
    corr: *mut f32,
) {
    Path::Avx512.ran();
    let mut h0 = 0;
    while h0 < g {
        let (mp, lp, gp, cp) = (m.add(h0), l.add(h0), logits.add(h0 * TILE), corr.add(h0));
        match g - h0 {
            1 => tile_softmax_n::<1>(mp, lp, gp, n, cp),
            2 => tile_softmax_n::<2>(mp, lp, gp, n, cp),
            3 => tile_softmax_n::<3>(mp, lp, gp, n, cp),
            _ => tile_softmax_n::<4>(mp, lp, gp, n, cp),
        }
        h0 += 4;
    }
}

/// [`tile_softmax`] for `N <= 4` heads, written stage by stage over the heads so their
/// dependency chains (max tree, exps, sum tree) run side by side.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn tile_softmax_n<const N: usize>(
    m: *mut f32,
    l: *mut f32,
    logits: *mut f32,
    n: usize,
    corr: *mut f32,
) {
    // The N heads' reductions run side by side: one transposed max, one exp of the four
    // corrections, one transposed sum (lanes past N are -inf, or 0 after the exp).
    let mask = lanes16(n);
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut a = [ninf; 4];
    for (h, ah) in a.iter_mut().enumerate().take(N) {
        *ah = _mm512_mask_loadu_ps(ninf, mask, logits.add(h * TILE));
    }
    let hm = (1u8 << N) - 1;
    let m_old = _mm_mask_loadu_ps(_mm_set1_ps(f32::NEG_INFINITY), hm, m);
    let m_new = _mm_max_ps(m_old, hmax4(&a));
    let mut p = [_mm512_setzero_ps(); 4];
    for h in 0..N {
        let mh = _mm512_broadcastss_ps(_mm_permutevar_ps(m_new, _mm_set1_epi32(h as i32)));
        p[h] = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(a[h], mh)));
        _mm512_storeu_ps(logits.add(h * TILE), p[h]);
    }
    // corr = exp(m_old - m_new), 0 where m_old = -inf (nothing accumulated yet).
    let live = _mm_cmp_ps_mask::<_CMP_NEQ_OQ>(m_old, _mm_set1_ps(f32::NEG_INFINITY));
    let c = _mm_maskz_mov_ps(live, fast_exp4(_mm_sub_ps(m_old, m_new)));
    let l_new = _mm_fmadd_ps(_mm_maskz_loadu_ps(hm, l), c, hsum4(&p));
    _mm_mask_storeu_ps(corr, hm, c);
    _mm_mask_storeu_ps(l, hm, l_new);
    _mm_mask_storeu_ps(m, hm, m_new);
}

/// `simd::fast_exp` on four lanes, operation for operation (separate multiplies and adds, no
/// FMA), so the same bits as the scalar function the AVX2 softmax uses for its corrections.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn fast_exp4(x: __m128) -> __m128 {
    let x = _mm_min_ps(_mm_max_ps(x, _mm_set1_ps(-87.0)), _mm_set1_ps(88.0));
    let big = _mm_set1_ps(12_582_912.0);
    let n = _mm_sub_ps(
        _mm_add_ps(_mm_mul_ps(x, _mm_set1_ps(std::f32::consts::LOG2_E)), big),
        big,
    );
    let r = _mm_sub_ps(
        _mm_sub_ps(x, _mm_mul_ps(n, _mm_set1_ps(EXP_LN2_HI))),
        _mm_mul_ps(n, _mm_set1_ps(EXP_LN2_LO)),
    );
    let r2 = _mm_mul_ps(r, r);
    let mut p = _mm_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(c));
    }
    let y = _mm_add_ps(_mm_add_ps(_mm_mul_ps(p, r2), r), _mm_set1_ps(1.0));
    let e = _mm_slli_epi32::<23>(_mm_and_si128(
        _mm_castps_si128(_mm_add_ps(n, _mm_set1_ps(127.0 + 8_388_608.0))),
        _mm_set1_epi32(0x7f_ffff),
    ));
    _mm_mul_ps(y, _mm_castsi128_ps(e))
}
