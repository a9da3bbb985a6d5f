//! SPEC.md section 6, int8/int4 records, g = 1: codes unpacked with 16-byte nibble splits,
//! then placed by a `pshufb` table (eight dims per bitmap byte), widened and scaled.

use crate::simd::path::Path;
use crate::simd::quant::{unpack_codes_scalar, CODE_SLACK, QUANT_SIMD_MAX_R};
use mosaickv_spec::layout::record_scale;
use mosaickv_spec::{RecordLayout, ValueDtype};
use std::arch::x86_64::*;

/// pshufb masks: for a bitmap byte, which code each of the 8 output lanes takes (0x80: none).
static EXPAND_LUT8: [[u8; 16]; 256] = {
    let mut t = [[0x80u8; 16]; 256];
    let mut b = 0;
    while b < 256 {
        let mut k = 0u8;
        let mut lane = 0;
        while lane < 8 {
            if (b >> lane) & 1 == 1 {
                t[b][lane] = k;
                k += 1;
            }
            lane += 1;
        }
        b += 1;
    }
    t
};

/// The `r` codes of a quantized record (value bytes `v`) as one `i8` each into `out`
/// (`out.len() >= r + CODE_SLACK`; the slack is zeroed). int4: 16 packed bytes at a time,
/// low and high nibbles split, interleaved (`punpck{l,h}bw`) and sign-extended as
/// `(x ^ 8) - 8`.
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn unpack_codes(dtype: ValueDtype, v: &[u8], r: usize, out: &mut [i8]) {
    debug_assert!(out.len() >= r + CODE_SLACK && r <= QUANT_SIMD_MAX_R);
    match dtype {
        ValueDtype::Int4 => {
            let packed = r.div_ceil(2);
            // A padded copy, so that every 16-byte load stays inside it.
            let mut local = [0u8; QUANT_SIMD_MAX_R / 2 + 16];
            local[..packed].copy_from_slice(&v[..packed]);
            let low = _mm_set1_epi8(0x0f);
            let eight = _mm_set1_epi8(8);
            let mut i = 0;
            while 2 * i < r {
                let p = _mm_loadu_si128(local.as_ptr().add(i) as *const __m128i);
                let lo = _mm_and_si128(p, low);
                let hi = _mm_and_si128(_mm_srli_epi16(p, 4), low);
                let a = _mm_sub_epi8(_mm_xor_si128(_mm_unpacklo_epi8(lo, hi), eight), eight);
                let b = _mm_sub_epi8(_mm_xor_si128(_mm_unpackhi_epi8(lo, hi), eight), eight);
                _mm_storeu_si128(out.as_mut_ptr().add(2 * i) as *mut __m128i, a);
                _mm_storeu_si128(out.as_mut_ptr().add(2 * i + 16) as *mut __m128i, b);
                i += 16;
            }
            // Codes past r (the odd r's unused nibble and the copy's zeros) are cleared.
            out[r..r + CODE_SLACK].fill(0);
        }
        _ => {
            unpack_codes_scalar(dtype, v, r, out);
            out[r..r + CODE_SLACK].fill(0);
        }
    }
}

/// Expands one int8/int4 g = 1 record to a dense row of `row.len()` floats (`>= dt`, a
/// multiple of 8): `code * scale` at the set bits, 0 elsewhere.
///
/// # Safety
/// AVX2, FMA, F16C and POPCNT available; `rec` is one whole record of `layout` (g = 1,
/// `r <= QUANT_SIMD_MAX_R`); `row.len() >= dt` and a multiple of 8.
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn expand_q_g1(rec: &[u8], layout: &RecordLayout, row: &mut [f32]) {
    Path::Avx2.ran();
    let (dt, r) = (layout.kept_dims, layout.r);
    let mut codes = [0i8; QUANT_SIMD_MAX_R + CODE_SLACK];
    unpack_codes(layout.dtype, &rec[layout.values_offset()..], r, &mut codes);
    let scale = _mm256_set1_ps(record_scale(layout, rec).to_f32());
    let chunks = dt.div_ceil(8);
    let mut off = 0usize;
    for c in 0..chunks {
        let byte = rec[c] as usize; // little-endian words: byte c = dims 8c .. 8c + 8
        let v = _mm_loadl_epi64(codes.as_ptr().add(off) as *const __m128i);
        let m = _mm_loadl_epi64(EXPAND_LUT8[byte].as_ptr() as *const __m128i);
        let e = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(v, m));
        _mm256_storeu_ps(
            row.as_mut_ptr().add(8 * c),
            _mm256_mul_ps(_mm256_cvtepi32_ps(e), scale),
        );
        off = (off + byte.count_ones() as usize).min(r);
    }
    row[8 * chunks..].fill(0.0);
}
