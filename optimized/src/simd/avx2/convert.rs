//! f16 -> f32 rows, eight lanes per `vcvtph2ps`.

use super::load_ph;
use crate::simd::common::f16_bits_to_f32;
use crate::simd::path::Path;
use half::f16;
use std::arch::x86_64::*;

#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    Path::Avx2.ran();
    let n = src.len();
    let n8 = n / 8 * 8;
    let mut i = 0;
    while i < n8 {
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), load_ph(src.as_ptr().add(i)));
        i += 8;
    }
    for j in n8..n {
        dst[j] = f16_bits_to_f32(src[j].to_bits());
    }
}
