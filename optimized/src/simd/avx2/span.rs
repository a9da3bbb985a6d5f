//! The AVX2/FMA/F16C kernel of the engine's dense attention over one token span
//! (`simd/span.rs`).

use crate::simd::common::span_softmax;
use half::f16;
use std::arch::x86_64::*;

/// `Path::span_partial` with AVX2/FMA/F16C: each f16 row is converted once into registers, then
/// shared by the group's query heads (scores) or added into each head's accumulator (values).
///
/// # Safety
/// The CPU has avx2, fma and f16c; `d % 8 == 0`, `d <= 256`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn span_partial(
    keys: &[f16],
    values: &[f16],
    qg: &[f32],
    group: usize,
    d: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    crate::simd::Path::Avx2.ran();
    let m = keys.len() / d;
    let nv = d / 8;
    assert!(d % 8 == 0 && nv <= 32);
    assert!(keys.len() == m * d && values.len() == m * d && qg.len() == group * d);
    let mut row = [_mm256_setzero_ps(); 32];
    let mut scores = vec![0f32; group * m];
    let (kp, vp, qp) = (
        keys.as_ptr() as *const u16,
        values.as_ptr() as *const u16,
        qg.as_ptr(),
    );
    // SAFETY (every pointer access below): t < m, j < nv, g < group, and the asserts bound each
    // offset by the slice lengths.
    for t in 0..m {
        for (j, r) in row[..nv].iter_mut().enumerate() {
            *r = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(t * d + 8 * j) as *const __m128i));
        }
        for g in 0..group {
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut j = 0;
            while j + 1 < nv {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(g * d + 8 * j)), row[j], a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(g * d + 8 * j + 8)), row[j + 1], a1);
                j += 2;
            }
            if j < nv {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(g * d + 8 * j)), row[j], a0);
            }
            let v = _mm256_add_ps(a0, a1);
            let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            let h = _mm_add_ss(h, _mm_movehdup_ps(h));
            *scores.get_unchecked_mut(g * m + t) = _mm_cvtss_f32(h);
        }
    }
    let (mx, sum) = span_softmax(&mut scores, group, m);
    let mut acc = vec![0f32; group * d];
    let ap = acc.as_mut_ptr();
    for t in 0..m {
        for (j, r) in row[..nv].iter_mut().enumerate() {
            *r = _mm256_cvtph_ps(_mm_loadu_si128(vp.add(t * d + 8 * j) as *const __m128i));
        }
        for g in 0..group {
            let p = _mm256_set1_ps(*scores.get_unchecked(g * m + t));
            for (j, r) in row[..nv].iter().enumerate() {
                let a = ap.add(g * d + 8 * j);
                _mm256_storeu_ps(a, _mm256_fmadd_ps(p, *r, _mm256_loadu_ps(a)));
            }
        }
    }
    (mx, sum, acc)
}
