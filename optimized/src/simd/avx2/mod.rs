//! The AVX2 + FMA + F16C (+ POPCNT) kernels, `std::arch`, one file per concern. Callers
//! hold a SIMD [`crate::simd::Path`] (detected at run time) before calling anything here.
//! Depends only on `simd::common`; the AVX-512 layer borrows [`hsum4_i32`] from here.

pub mod convert;
pub mod expand;
pub mod memory;
pub mod pages;
pub mod quant;
pub mod rotate;
pub mod score;
pub mod softmax;
pub mod span;
pub mod tiles;
pub mod weights;

use half::f16;
use std::arch::x86_64::*;

#[target_feature(enable = "avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)))
}

#[target_feature(enable = "avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn load_ph(p: *const f16) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// The four i32 lane sums of `a[0..4]` as one xmm `[sum a0, sum a1, sum a2, sum a3]`
/// (three `vphaddd` and one add instead of four separate reductions).
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
#[inline]
pub(crate) unsafe fn hsum4_i32(a: &[__m256i; 4]) -> __m128i {
    let s01 = _mm256_hadd_epi32(a[0], a[1]);
    let s23 = _mm256_hadd_epi32(a[2], a[3]);
    let s = _mm256_hadd_epi32(s01, s23);
    _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s))
}
