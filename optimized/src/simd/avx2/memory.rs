//! Software prefetch.

use crate::simd::path::Path;
use std::arch::x86_64::*;

/// Hints cache lines into the cache (`prefetcht2`: on the AMD Zen 4 machine
/// we measured, T2 made the MosaicKV step 9-12 % faster than T0 in three alternating
/// pairs of `profile_step mosaic 131072 300`, and NTA was no better than T0).
/// Every line from the one holding `ptr` to the one holding `ptr + len - 1`.
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn prefetch(ptr: *const u8, len: usize) {
    Path::Avx2.ran();
    let end = ptr as usize + len;
    let mut line = ptr as usize & !63;
    while line < end {
        _mm_prefetch(line as *const i8, _MM_HINT_T2);
        line += 64;
    }
}
