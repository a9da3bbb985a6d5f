//! The online-softmax step of one tile, eight lanes (`exp256`: `fast_exp`'s polynomial).

use super::hsum;
use crate::simd::common::{fast_exp, EXP_LN2_HI, EXP_LN2_LO, EXP_POLY, TILE};
use crate::simd::path::Path;
use std::arch::x86_64::*;

#[target_feature(enable = "avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn exp256(x: __m256) -> __m256 {
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
        _mm256_set1_ps(88.0),
    );
    let n = _mm256_round_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let y = _mm256_fmadd_ps(
        p,
        _mm256_mul_ps(r, r),
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    let e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    );
    _mm256_mul_ps(y, _mm256_castsi256_ps(e))
}

/// Online softmax over one tile of `g` heads (see `Path::online_softmax`).
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn online_softmax(
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
    g: usize,
    dp: usize,
    logits: &mut [f32],
    n: usize,
    mut corr_out: Option<&mut [f32]>,
) {
    Path::Avx2.ran();
    let nn = _mm256_set1_ps(n as f32);
    let mask0 = _mm256_cmp_ps(
        _mm256_setr_ps(0., 1., 2., 3., 4., 5., 6., 7.),
        nn,
        _CMP_LT_OQ,
    );
    let mask1 = _mm256_cmp_ps(
        _mm256_setr_ps(8., 9., 10., 11., 12., 13., 14., 15.),
        nn,
        _CMP_LT_OQ,
    );
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    for h in 0..g {
        let lp = logits.as_mut_ptr().add(h * TILE);
        let a0 = _mm256_blendv_ps(ninf, _mm256_loadu_ps(lp), mask0);
        let a1 = _mm256_blendv_ps(ninf, _mm256_loadu_ps(lp.add(8)), mask1);
        let mx = _mm256_max_ps(a0, a1);
        let mx = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        let mx = _mm_max_ps(mx, _mm_movehl_ps(mx, mx));
        let mt = _mm_cvtss_f32(_mm_max_ss(mx, _mm_shuffle_ps(mx, mx, 1)));
        let m_old = m[h];
        let m_new = m_old.max(mt);
        let corr = if m_old == f32::NEG_INFINITY {
            0.0
        } else {
            fast_exp(m_old - m_new)
        };
        let mv = _mm256_set1_ps(m_new);
        let p0 = _mm256_and_ps(exp256(_mm256_sub_ps(a0, mv)), mask0);
        let p1 = _mm256_and_ps(exp256(_mm256_sub_ps(a1, mv)), mask1);
        _mm256_storeu_ps(lp, p0);
        _mm256_storeu_ps(lp.add(8), p1);
        l[h] = l[h] * corr + hsum(_mm256_add_ps(p0, p1));
        if let Some(c) = corr_out.as_deref_mut() {
            c[h] = corr;
        } else if corr != 1.0 {
            let cv = _mm256_set1_ps(corr);
            let a = &mut acc[h * dp..(h + 1) * dp];
            let mut c = 0;
            while c + 8 <= dp {
                _mm256_storeu_ps(
                    a.as_mut_ptr().add(c),
                    _mm256_mul_ps(_mm256_loadu_ps(a.as_ptr().add(c)), cv),
                );
                c += 8;
            }
            for x in a[c..].iter_mut() {
                *x *= corr;
            }
        }
        m[h] = m_new;
    }
}
