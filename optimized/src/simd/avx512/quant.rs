//! SPEC.md section 6, int8/int4 records, g = 1: codes unpacked by the AVX2 kernel, then one
//! `vpexpandb` per 64 dims places them at the bitmap's set bits; 16 lanes at a time widened
//! (`vpmovzxbd`), converted, scaled, offset by the minimum and zeroed where not kept.

use super::lanes16;
use crate::simd::avx2::quant::unpack_codes;
use crate::simd::path::Path;
use crate::simd::quant::{CODE_SLACK, QUANT_SIMD_MAX_R};
use mosaickv_spec::layout::{bitmap_word, record_quant};
use mosaickv_spec::RecordLayout;
use std::arch::x86_64::*;

/// Expands one int8/int4 g = 1 record to a dense row of `row.len()` floats (`>= dt`, a
/// multiple of 8): `m + code * s` at the set bits (product exact, one rounding in the add),
/// 0 elsewhere.
///
/// # Safety
/// AVX-512 F/BW/VL/VBMI2 (and the AVX2 set) available; `rec` is one whole record of
/// `layout` (g = 1, `r <= QUANT_SIMD_MAX_R`); `row.len() >= dt` and a multiple of 8.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn expand_q_g1(rec: &[u8], layout: &RecordLayout, row: &mut [f32]) {
    Path::Avx512.ran();
    let (dt, r, dp) = (layout.kept_dims, layout.r, row.len());
    let mut codes = [0u8; QUANT_SIMD_MAX_R + CODE_SLACK];
    unpack_codes(layout.dtype, &rec[layout.values_offset()..], r, &mut codes);
    let p = record_quant(layout, rec);
    let scale = _mm512_set1_ps(p.scale.to_f32());
    let min = _mm512_set1_ps(p.min.to_f32());
    let mut off = 0usize;
    let mut placed = [0u8; 64];
    for w in 0..dt.div_ceil(64) {
        // Bits 64w .. 64w + 64 of the bitmap, read only from its stored bytes.
        let mask = bitmap_word(layout, rec, w);
        let src = _mm512_loadu_si512(codes.as_ptr().add(off) as *const __m512i);
        _mm512_storeu_si512(
            placed.as_mut_ptr() as *mut __m512i,
            _mm512_maskz_expand_epi8(mask, src),
        );
        for q in 0..4 {
            let base = 64 * w + 16 * q;
            if base >= dp {
                break;
            }
            let b = _mm_loadu_si128(placed.as_ptr().add(16 * q) as *const __m128i);
            // `code * s` is exact in f32: the FMA rounds once, like the scalar decode.
            let x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)), scale, min);
            let kept = (mask >> (16 * q)) as u16;
            _mm512_mask_storeu_ps(
                row.as_mut_ptr().add(base),
                lanes16(dp - base),
                _mm512_maskz_mov_ps(kept, x),
            );
        }
        off = (off + mask.count_ones() as usize).min(r);
    }
    let covered = (64 * dt.div_ceil(64)).min(dp);
    row[covered..].fill(0.0);
}
