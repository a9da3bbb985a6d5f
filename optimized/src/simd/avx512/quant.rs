//! SPEC.md section 6, int8/int4 records, any group size: codes loaded straight from the
//! record with masked loads that stay inside it (int8) or unpacked by the AVX2 kernel (int4),
//! then one `vpexpandb` per 64 dims places them at the kept dims (the bitmap's bits, spread
//! over their groups' dims by `pdep` where g > 1); 16 lanes at a time widened (`vpmovzxbd`),
//! converted, scaled, offset by the minimum and zeroed where not kept.

use super::{lanes16, lanes64};
use crate::simd::avx2::quant::{spread_groups, unpack_codes};
use crate::simd::path::Path;
use crate::simd::quant::{CODE_SLACK, QUANT_SIMD_MAX_R};
use mosaickv_spec::{RecordLayout, ValueDtype};
use std::arch::x86_64::*;

/// Bits `64 w .. 64 w + 64` of a record's bitmap (`bb` stored bytes, a multiple of 4: whole
/// u32 words), read only from its stored bytes (bits past them 0): what
/// `mosaickv_spec::layout::bitmap_word` reads, without its byte copy (a call and a stalled
/// reload here).
#[inline(always)]
fn stored_word(rec: &[u8], bb: usize, w: usize) -> u64 {
    let at = 8 * w;
    if bb >= at + 8 {
        u64::from_le_bytes(rec[at..at + 8].try_into().unwrap())
    } else if bb >= at + 4 {
        u64::from(u32::from_le_bytes(rec[at..at + 4].try_into().unwrap()))
    } else {
        0
    }
}

/// Dims `64 w .. 64 w + 64` of a record as one bit per dim: the bitmap's own bits for g = 1,
/// each group's bit repeated over its g dims (`pdep` onto every g-th bit, times `2^g - 1`)
/// for g = 2, 4 and 8, the table spread otherwise.
#[inline(always)]
unsafe fn dim_word(layout: &RecordLayout, rec: &[u8], spread: &[u8], w: usize) -> u64 {
    let g = layout.group_size;
    match g {
        1 => stored_word(rec, layout.bitmap_bytes(), w),
        2 | 4 | 8 => {
            let per = 64 / g; // groups per 64 dims, a divisor of 64
            let first = w * per;
            let bits = stored_word(rec, layout.bitmap_bytes(), first / 64) >> (first % 64);
            let every = match g {
                2 => 0x5555_5555_5555_5555u64,
                4 => 0x1111_1111_1111_1111,
                _ => 0x0101_0101_0101_0101,
            };
            _pdep_u64(bits, every) * ((1u64 << g) - 1)
        }
        // `spread` holds QUANT_SIMD_MAX_R / 8 >= 8 w + 8 bytes (dt <= QUANT_SIMD_MAX_R).
        _ => u64::from_le_bytes(spread[8 * w..8 * w + 8].try_into().unwrap()),
    }
}

/// Expands one int8/int4 record of any group size to a dense row of `row.len()` floats
/// (`>= dt`, a multiple of 8): `m + code * s` at the kept dims (product exact, one rounding in
/// the add), 0 elsewhere.
///
/// # Safety
/// AVX-512 F/BW/VL/VBMI2, BMI2 (and the AVX2 set) available; `rec` is one whole record of
/// `layout` (`r <= QUANT_SIMD_MAX_R`, `dt <= QUANT_SIMD_MAX_R`); `row.len() >= dt` and a
/// multiple of 8.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt,bmi2"
)]
pub unsafe fn expand_q(rec: &[u8], layout: &RecordLayout, row: &mut [f32]) {
    Path::Avx512.ran();
    let g = layout.group_size;
    let mut spread = [0u8; QUANT_SIMD_MAX_R / 8];
    if !matches!(g, 1 | 2 | 4 | 8) {
        spread_groups(rec, layout, &mut spread);
    }
    let (dt, r, dp) = (layout.kept_dims, layout.r, row.len());
    // int8 codes are read straight from the record (masked loads); int4 ones are unpacked to
    // one byte each first.
    let stored = &rec[layout.values_offset()..];
    let int8 = layout.dtype == ValueDtype::Int8;
    let mut codes = [0u8; QUANT_SIMD_MAX_R + CODE_SLACK];
    if !int8 {
        unpack_codes(layout.dtype, stored, r, &mut codes);
    }
    // The record's minimum and scale, two f16 after the bitmap, widened together (exact).
    let o = layout.bitmap_bytes();
    let ms = u32::from_le_bytes([rec[o], rec[o + 1], rec[o + 2], rec[o + 3]]);
    let ms = _mm_cvtph_ps(_mm_cvtsi32_si128(ms as i32));
    let min = _mm512_broadcastss_ps(ms);
    let scale = _mm512_broadcastss_ps(_mm_movehdup_ps(ms));
    let mut off = 0usize;
    for w in 0..dt.div_ceil(64) {
        let mask = dim_word(layout, rec, &spread, w);
        let src = if int8 {
            _mm512_maskz_loadu_epi8(lanes64(r - off), stored.as_ptr().add(off) as *const i8)
        } else {
            _mm512_loadu_si512(codes.as_ptr().add(off) as *const __m512i)
        };
        let placed = _mm512_maskz_expand_epi8(mask, src);
        // Sixteen dims at a time, taken from the register (no store and reload).
        let quarters = [
            _mm512_castsi512_si128(placed),
            _mm512_extracti32x4_epi32::<1>(placed),
            _mm512_extracti32x4_epi32::<2>(placed),
            _mm512_extracti32x4_epi32::<3>(placed),
        ];
        for (q, &b) in quarters.iter().enumerate() {
            let base = 64 * w + 16 * q;
            if base >= dp {
                break;
            }
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
