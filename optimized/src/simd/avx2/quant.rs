//! SPEC.md section 6, int8/int4 records: codes unpacked with 16-byte nibble splits,
//! then placed by a `pshufb` table (eight dims per bitmap byte), widened, scaled and offset
//! by the record's minimum in one FMA, and masked to the kept dims by a lane-mask table.

use crate::simd::codes::{unpack_codes_scalar, CODE_SLACK, QUANT_SIMD_MAX_R};
use crate::simd::path::Path;
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

/// Lane masks: for a bitmap byte, all ones in each of the 8 i32 lanes whose bit is set.
static LANE_MASK: [[i32; 8]; 256] = {
    let mut t = [[0i32; 8]; 256];
    let mut b = 0;
    while b < 256 {
        let mut lane = 0;
        while lane < 8 {
            if (b >> lane) & 1 == 1 {
                t[b][lane] = -1;
            }
            lane += 1;
        }
        b += 1;
    }
    t
};

/// The `r` codes of a quantized record (code bytes `v`) as one byte each into `out`
/// (`out.len() >= r + CODE_SLACK`; the slack is zeroed). int4: 16 packed bytes at a time,
/// low and high nibbles split and interleaved (`punpck{l,h}bw`).
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn unpack_codes(dtype: ValueDtype, v: &[u8], r: usize, out: &mut [u8]) {
    debug_assert!(out.len() >= r + CODE_SLACK && r <= QUANT_SIMD_MAX_R);
    match dtype {
        ValueDtype::Int4 => {
            let packed = r.div_ceil(2);
            // A padded copy, so that every 16-byte load stays inside it.
            let mut local = [0u8; QUANT_SIMD_MAX_R / 2 + 16];
            local[..packed].copy_from_slice(&v[..packed]);
            let low = _mm_set1_epi8(0x0f);
            let mut i = 0;
            while 2 * i < r {
                let p = _mm_loadu_si128(local.as_ptr().add(i) as *const __m128i);
                let lo = _mm_and_si128(p, low);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(p), low);
                let o = out.as_mut_ptr().add(2 * i);
                _mm_storeu_si128(o as *mut __m128i, _mm_unpacklo_epi8(lo, hi));
                _mm_storeu_si128(o.add(16) as *mut __m128i, _mm_unpackhi_epi8(lo, hi));
                i += 16;
            }
        }
        ValueDtype::Int8 => out[..r].copy_from_slice(&v[..r]),
        _ => unpack_codes_scalar(dtype, v, r, out),
    }
    // Codes past r (an odd r's unused nibble, the copy's zeros) are cleared.
    out[r..r + CODE_SLACK].fill(0);
}

/// Expands one int8/int4 record of any group size to a dense row of `row.len()` floats
/// (`>= dt`, a multiple of 8): `m + code * s` at the kept dims (the product exact, one
/// rounding in the add, as in the scalar decode), 0 elsewhere. A g = 1 record's bitmap is
/// already one bit per dim; for g > 1 each kept group's bit is first spread over its g dims.
///
/// # Safety
/// AVX2, FMA, F16C and POPCNT available; `rec` is one whole record of `layout`
/// (`r <= QUANT_SIMD_MAX_R`, `dt <= QUANT_SIMD_MAX_R`); `row.len() >= dt` and a multiple of 8.
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn expand_q(rec: &[u8], layout: &RecordLayout, row: &mut [f32]) {
    if layout.group_size == 1 {
        return expand_q_bits(rec, rec, layout, row);
    }
    let mut dims = [0u8; QUANT_SIMD_MAX_R / 8];
    spread_groups(rec, layout, &mut dims);
    expand_q_bits(&dims, rec, layout, row)
}

/// Each bitmap byte's 8 bits, every bit repeated `G` times (little-endian: bit `i` of the
/// byte becomes bits `G i .. G (i + 1)` of the entry).
const fn spread_table<const G: usize>() -> [u64; 256] {
    let mut t = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        let mut i = 0;
        while i < 8 {
            if (b >> i) & 1 == 1 {
                t[b] |= ((1u64 << G) - 1) << (G * i);
            }
            i += 1;
        }
        b += 1;
    }
    t
}

static SPREAD2: [u64; 256] = spread_table::<2>();
static SPREAD4: [u64; 256] = spread_table::<4>();

/// A record's group bitmap as one bit per dim (`dims`, little-endian bytes: byte c = dims
/// 8c .. 8c + 8; `dims` zeroed and at least `kept_dims / 8` rounded up long). g = 2 and 4
/// take a table per bitmap byte (2 and 4 dim bytes each), g = 8 one 0xff byte per bit, any
/// other g the bit-by-bit loop.
pub(crate) fn spread_groups(rec: &[u8], layout: &RecordLayout, dims: &mut [u8]) {
    let (g, groups) = (layout.group_size, layout.groups());
    let bytes = groups.div_ceil(8);
    match g {
        2 | 4 => {
            let table = if g == 2 { &SPREAD2 } else { &SPREAD4 };
            for (i, &b) in rec[..bytes].iter().enumerate() {
                let w = table[b as usize].to_le_bytes();
                let end = (g * (i + 1)).min(dims.len());
                dims[g * i..end].copy_from_slice(&w[..end - g * i]);
            }
        }
        8 => {
            for grp in 0..groups {
                dims[grp] = if (rec[grp / 8] >> (grp % 8)) & 1 == 1 {
                    0xff
                } else {
                    0
                };
            }
        }
        _ => {
            for grp in 0..groups {
                if (rec[grp / 8] >> (grp % 8)) & 1 == 1 {
                    for dim in grp * g..(grp + 1) * g {
                        dims[dim / 8] |= 1 << (dim % 8);
                    }
                }
            }
        }
    }
}

/// [`expand_q`] given the record's kept dims as one bit per dim (`bits`, little-endian bytes:
/// byte c = dims 8c .. 8c + 8).
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
unsafe fn expand_q_bits(bits: &[u8], rec: &[u8], layout: &RecordLayout, row: &mut [f32]) {
    Path::Avx2.ran();
    let (dt, r) = (layout.kept_dims, layout.r);
    // int8 codes are read from the record itself, 8 at a time while 8 remain, then from a
    // zero-padded copy of the last 8; int4 codes are unpacked to one byte each first.
    let stored = &rec[layout.values_offset()..];
    let int8 = layout.dtype == ValueDtype::Int8;
    let mut codes = [0u8; QUANT_SIMD_MAX_R + CODE_SLACK];
    let (mut direct, mut t0, mut tail) = (0usize, 0usize, [0u8; 16]);
    if int8 {
        direct = (r + 1).saturating_sub(8); // offsets below this have 8 codes left
        t0 = r.saturating_sub(8);
        for (t, &c) in tail.iter_mut().zip(&stored[t0..r]) {
            *t = c;
        }
    } else {
        unpack_codes(layout.dtype, stored, r, &mut codes);
    }
    // The minimum and scale, two f16 after the bitmap, widened together (exact).
    let o = layout.bitmap_bytes();
    let ms = u32::from_le_bytes([rec[o], rec[o + 1], rec[o + 2], rec[o + 3]]);
    let ms = _mm_cvtph_ps(_mm_cvtsi32_si128(ms as i32));
    let min = _mm256_broadcastss_ps(ms);
    let scale = _mm256_broadcastss_ps(_mm_movehdup_ps(ms));
    let chunks = dt.div_ceil(8);
    let mut off = 0usize;
    for c in 0..chunks {
        let byte = bits[c] as usize;
        let at = if !int8 {
            codes.as_ptr().add(off)
        } else if off < direct {
            stored.as_ptr().add(off)
        } else {
            tail.as_ptr().add(off - t0)
        };
        let v = _mm_loadl_epi64(at as *const __m128i);
        let m = _mm_loadl_epi64(EXPAND_LUT8[byte].as_ptr() as *const __m128i);
        let e = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(v, m));
        // `code * s` is exact in f32, so the fused multiply-add rounds once, like the
        // scalar `m + code * s`.
        let x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(e), scale, min);
        let kept = _mm256_loadu_si256(LANE_MASK[byte].as_ptr() as *const __m256i);
        _mm256_storeu_ps(
            row.as_mut_ptr().add(8 * c),
            _mm256_and_ps(x, _mm256_castsi256_ps(kept)),
        );
        off = (off + byte.count_ones() as usize).min(r);
    }
    row[8 * chunks..].fill(0.0);
}
