//! SPEC.md section 6, g = 1: record expansion by a `pshufb` table, eight dims per bitmap byte.

use crate::simd::common::f16_bits_to_f32;
use crate::simd::path::Path;
use std::arch::x86_64::*;

/// pshufb masks: for a bitmap byte, where each of the 8 output f16 lanes takes its value from.
static EXPAND_LUT: [[u8; 16]; 256] = {
    let mut t = [[0x80u8; 16]; 256];
    let mut b = 0;
    while b < 256 {
        let mut k = 0u8;
        let mut lane = 0;
        while lane < 8 {
            if (b >> lane) & 1 == 1 {
                t[b][2 * lane] = 2 * k;
                t[b][2 * lane + 1] = 2 * k + 1;
                k += 1;
            }
            lane += 1;
        }
        b += 1;
    }
    t
};

/// g = 1 record expansion: per bitmap byte, one 16-byte load, pshufb, cvtph2ps.
/// `after` = readable bytes after the record's values (in the same allocation).
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn expand_g1(rec: &[u8], bb: usize, r: usize, dt: usize, after: usize, out: &mut [f32]) {
    Path::Avx2.ran();
    if after < 16 {
        return expand_g1_tail(rec, bb, r, dt, out);
    }
    expand_g1_from(rec, rec.as_ptr().add(bb), r, dt, out)
}

#[target_feature(enable = "avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn expand_g1_from(rec: &[u8], src: *const u8, r: usize, dt: usize, out: &mut [f32]) {
    let chunks = dt.div_ceil(8);
    let mut off = 0usize;
    for c in 0..chunks {
        let byte = *rec.get_unchecked(c) as usize; // the bitmap is little-endian words: byte c = dims 8c..8c+8
        let v = _mm_loadu_si128(src.add(2 * off) as *const __m128i);
        let m = _mm_loadu_si128(EXPAND_LUT[byte].as_ptr() as *const __m128i);
        _mm256_storeu_ps(
            out.as_mut_ptr().add(8 * c),
            _mm256_cvtph_ps(_mm_shuffle_epi8(v, m)),
        );
        off += byte.count_ones() as usize;
        if off > r {
            off = r;
        }
    }
    for x in out.iter_mut().skip(8 * chunks) {
        *x = 0.0;
    }
}

/// The last records of a buffer: the values are copied to a padded local first.
#[cold]
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
unsafe fn expand_g1_tail(rec: &[u8], bb: usize, r: usize, dt: usize, out: &mut [f32]) {
    let mut local = [0u8; 16 + 2 * 256];
    if 2 * r + 16 <= local.len() {
        local[..2 * r].copy_from_slice(&rec[bb..bb + 2 * r]);
        return expand_g1_from(rec, local.as_ptr(), r, dt, out);
    }
    // Too large for the local copy: scalar, bounds-checked.
    out.fill(0.0);
    let mut k = 0;
    for dim in 0..dt {
        if (rec[dim / 8] >> (dim % 8)) & 1 == 1 && k < r {
            out[dim] = f16_bits_to_f32(u16::from_le_bytes([rec[bb + 2 * k], rec[bb + 2 * k + 1]]));
            k += 1;
        }
    }
}
