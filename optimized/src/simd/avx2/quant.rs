//! SPEC.md section 6, int8/int4 records: codes unpacked with 16-byte nibble splits,
//! then placed by a `pshufb` table (eight dims per bitmap byte), widened, scaled and offset
//! by the record's minimum in one FMA, and masked to the kept dims by a lane-mask table.

use super::hsum;
use crate::simd::codes::{unpack_codes_scalar, CODE_SLACK, QUANT_SIMD_MAX_R};
use crate::simd::common::TILE;
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

/// One int8/int4 record ready to be decoded eight dims at a time in registers (SPEC 6's
/// `m + code * s` at the kept dims, 0 elsewhere): its kept dims as one bit per dim, its
/// minimum and scale broadcast, and where its codes are read. int8 codes are read from the
/// records' bytes (8 at a time, which may run past the record but not past the slice; the
/// slice's last record copies its codes, zero-padded), int4 codes are unpacked one byte each.
struct Decoder {
    /// The record's bitmap (g = 1, `Dt` a multiple of 8) or `spread`.
    bits: *const u8,
    spread: [u8; QUANT_SIMD_MAX_R / 8],
    min: __m256,
    scale: __m256,
    /// Code `i` is the byte at `at + i`: in the records' bytes, or in `codes`.
    at: *const u8,
    r: usize,
    codes: [u8; QUANT_SIMD_MAX_R + CODE_SLACK],
}

impl Decoder {
    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    unsafe fn new() -> Self {
        Decoder {
            bits: std::ptr::null(),
            spread: [0; QUANT_SIMD_MAX_R / 8],
            min: _mm256_setzero_ps(),
            scale: _mm256_setzero_ps(),
            at: std::ptr::null(),
            r: 0,
            codes: [0; QUANT_SIMD_MAX_R + CODE_SLACK],
        }
    }

    /// Points the decoder at the record of `layout` at `bytes[at..]` (a whole record, `r` and
    /// `kept_dims` at most `QUANT_SIMD_MAX_R`).
    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    #[inline]
    unsafe fn load(&mut self, bytes: &[u8], at: usize, layout: &RecordLayout) {
        let rec = &bytes[at..at + layout.record_bytes()];
        let (dt, r) = (layout.kept_dims, layout.r);
        if layout.group_size == 1 && dt % 8 == 0 {
            self.bits = rec.as_ptr();
        } else {
            let nb = dt.div_ceil(8);
            if layout.group_size == 1 {
                self.spread[..nb].copy_from_slice(&rec[..nb]);
            } else {
                self.spread[..nb].fill(0);
                spread_groups(rec, layout, &mut self.spread);
            }
            // Bits past Dt (in the last bitmap byte) are never set in a valid record;
            // cleared anyway so that no lane past Dt is decoded.
            if dt % 8 != 0 {
                self.spread[nb - 1] &= (1u8 << (dt % 8)) - 1;
            }
            self.bits = self.spread.as_ptr();
        }
        let vo = layout.values_offset();
        self.r = r;
        if layout.dtype == ValueDtype::Int8 && at + vo + r + 8 <= bytes.len() {
            // an 8-byte load at any offset up to r stays inside the slice
            self.at = rec[vo..].as_ptr();
        } else {
            if layout.dtype == ValueDtype::Int8 {
                self.codes[..r].copy_from_slice(&rec[vo..vo + r]);
                self.codes[r..r + 8].fill(0);
            } else {
                unpack_codes(layout.dtype, &rec[vo..], r, &mut self.codes);
            }
            self.at = self.codes.as_ptr();
        }
        let o = layout.bitmap_bytes();
        let ms = u32::from_le_bytes([rec[o], rec[o + 1], rec[o + 2], rec[o + 3]]);
        let ms = _mm_cvtph_ps(_mm_cvtsi32_si128(ms as i32));
        self.min = _mm256_broadcastss_ps(ms);
        self.scale = _mm256_broadcastss_ps(_mm_movehdup_ps(ms));
    }

    /// Dims `8c .. 8c + 8` decoded, `off` being the number of kept dims before them (at most
    /// `r`); returns them and the offset of the next chunk.
    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    #[inline]
    unsafe fn chunk(&self, c: usize, off: usize) -> (__m256, usize) {
        let byte = *self.bits.add(c) as usize;
        let v = _mm_loadl_epi64(self.at.add(off) as *const __m128i);
        let m = _mm_loadl_epi64(EXPAND_LUT8[byte].as_ptr() as *const __m128i);
        let e = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(v, m));
        // the same fused multiply-add and mask as `expand_q_bits`: the same floats
        let x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(e), self.scale, self.min);
        let kept = _mm256_loadu_si256(LANE_MASK[byte].as_ptr() as *const __m256i);
        let next = (off + byte.count_ones() as usize).min(self.r);
        (_mm256_and_ps(x, _mm256_castsi256_ps(kept)), next)
    }
}

/// SPEC 9 key logits straight from `n` int8/int4 records (`layout`, record 0 at `bytes[0]`):
/// `out[h * TILE + t] = scale * (q_h . k^_t)` for `g` heads (`q` `[g][dp]`, `dp` a multiple of
/// 8 and at least `kept_dims`). Each record is decoded in registers as `expand_q` writes it
/// and multiplied as `tiles::tile_logits` multiplies the expanded tile (per head and token one
/// FMA chain over the dims in order, then the same horizontal sum), so the logits are the same
/// bits, without the tile's store and reload. Heads up to six at a time, two records per pass.
///
/// # Safety
/// AVX2, FMA, F16C and POPCNT available; `layout` is int8/int4 with `r` and `kept_dims` at
/// most `QUANT_SIMD_MAX_R`; `bytes` holds `n` records; `n <= TILE`; `q.len() >= g * dp`;
/// `out.len() >= g * TILE`; `dp >= kept_dims`, a multiple of 8.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn tile_logits_q(
    q: &[f32],
    g: usize,
    dp: usize,
    bytes: &[u8],
    layout: &RecordLayout,
    n: usize,
    scale: f32,
    out: &mut [f32],
) {
    Path::Avx2.ran();
    let mut dec = [Decoder::new(), Decoder::new()];
    let mut h0 = 0;
    while h0 < g {
        let (qp, op) = (q.as_ptr().add(h0 * dp), out.as_mut_ptr().add(h0 * TILE));
        // Up to six heads per pass (12 accumulators, two decoded chunks and a query chunk fit
        // the 16 registers), so a group of six (Qwen2.5's) decodes each record once; a head's
        // sums do not depend on the heads beside it, so the bits are those of any grouping.
        match g - h0 {
            1 => logits_q_n::<1>(qp, dp, bytes, layout, n, scale, op, &mut dec),
            2 => logits_q_n::<2>(qp, dp, bytes, layout, n, scale, op, &mut dec),
            3 => logits_q_n::<3>(qp, dp, bytes, layout, n, scale, op, &mut dec),
            4 => logits_q_n::<4>(qp, dp, bytes, layout, n, scale, op, &mut dec),
            5 => logits_q_n::<5>(qp, dp, bytes, layout, n, scale, op, &mut dec),
            _ => logits_q_n::<6>(qp, dp, bytes, layout, n, scale, op, &mut dec),
        }
        h0 += 6;
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
unsafe fn logits_q_n<const N: usize>(
    q: *const f32,
    dp: usize,
    bytes: &[u8],
    layout: &RecordLayout,
    n: usize,
    scale: f32,
    out: *mut f32,
    dec: &mut [Decoder; 2],
) {
    let rb = layout.record_bytes();
    let chunks = layout.kept_dims.div_ceil(8);
    let mut t = 0;
    while t + 2 <= n {
        dec[0].load(bytes, t * rb, layout);
        dec[1].load(bytes, (t + 1) * rb, layout);
        let mut a0 = [_mm256_setzero_ps(); N];
        let mut a1 = [_mm256_setzero_ps(); N];
        let (mut o0, mut o1) = (0, 0);
        for c in 0..chunks {
            let (k0, n0) = dec[0].chunk(c, o0);
            let (k1, n1) = dec[1].chunk(c, o1);
            (o0, o1) = (n0, n1);
            for h in 0..N {
                let qv = _mm256_loadu_ps(q.add(h * dp + 8 * c));
                a0[h] = _mm256_fmadd_ps(qv, k0, a0[h]);
                a1[h] = _mm256_fmadd_ps(qv, k1, a1[h]);
            }
        }
        // the expanded tile's zero chunks past Dt, multiplied as `tile_logits` does
        let zero = _mm256_setzero_ps();
        for c in chunks..dp / 8 {
            for h in 0..N {
                let qv = _mm256_loadu_ps(q.add(h * dp + 8 * c));
                a0[h] = _mm256_fmadd_ps(qv, zero, a0[h]);
                a1[h] = _mm256_fmadd_ps(qv, zero, a1[h]);
            }
        }
        for h in 0..N {
            *out.add(h * TILE + t) = scale * hsum(a0[h]);
            *out.add(h * TILE + t + 1) = scale * hsum(a1[h]);
        }
        t += 2;
    }
    if t < n {
        dec[0].load(bytes, t * rb, layout);
        let mut a = [_mm256_setzero_ps(); N];
        let mut o = 0;
        for c in 0..chunks {
            let (k, next) = dec[0].chunk(c, o);
            o = next;
            for h in 0..N {
                a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(h * dp + 8 * c)), k, a[h]);
            }
        }
        let zero = _mm256_setzero_ps();
        for c in chunks..dp / 8 {
            for h in 0..N {
                a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(h * dp + 8 * c)), zero, a[h]);
            }
        }
        for h in 0..N {
            *out.add(h * TILE + t) = scale * hsum(a[h]);
        }
    }
}

/// SPEC 9 values straight from `n` int8/int4 records (`layout`, record 0 at `bytes[0]`),
/// at their kept dims only: `acc[h * dp + j] += p[h * TILE + t] * v^_t[j]` for the kept dims
/// `j` of each record, tokens in order, one FMA each. A dim a record does not keep adds
/// `p * 0` in the dense accumulation, which leaves the (never `-0`) sum as it is, so `acc`
/// gets the same bits as expanding the tile and accumulating it (`tiles::tile_accumulate`).
/// Each record's `r` values are decoded once (`m + code * s`), then added group by group.
///
/// # Safety
/// AVX2, FMA, F16C and POPCNT available; `layout` is int8/int4 with `r` at most
/// `QUANT_SIMD_MAX_R`; `bytes` holds `n` records; `n <= TILE`; `p.len() >= g * TILE`;
/// `acc.len() >= g * dp`, `dp >= kept_dims`.
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn kept_accumulate_q(
    p: &[f32],
    g: usize,
    dp: usize,
    bytes: &[u8],
    layout: &RecordLayout,
    n: usize,
    acc: &mut [f32],
) {
    Path::Avx2.ran();
    match layout.group_size {
        1 => kept_accumulate_g::<1>(p, g, dp, bytes, layout, n, acc),
        2 => kept_accumulate_g::<2>(p, g, dp, bytes, layout, n, acc),
        4 => kept_accumulate_g::<4>(p, g, dp, bytes, layout, n, acc),
        8 => kept_accumulate_g::<8>(p, g, dp, bytes, layout, n, acc),
        _ => kept_accumulate_g::<0>(p, g, dp, bytes, layout, n, acc),
    }
}

/// [`kept_accumulate_q`] for group size `G` (0: any, read from the layout).
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
unsafe fn kept_accumulate_g<const G: usize>(
    p: &[f32],
    g: usize,
    dp: usize,
    bytes: &[u8],
    layout: &RecordLayout,
    n: usize,
    acc: &mut [f32],
) {
    let gs = if G == 0 { layout.group_size } else { G };
    let (r, rb, bb) = (layout.r, layout.record_bytes(), layout.bitmap_bytes());
    let (words, groups, vo) = (bb / 4, layout.kept_dims / gs, layout.values_offset());
    let int8 = layout.dtype == ValueDtype::Int8;
    let mut codes = [0u8; QUANT_SIMD_MAX_R + CODE_SLACK];
    // the decoded values, whole registers
    let mut dv = [0f32; QUANT_SIMD_MAX_R + 8];
    let ap = acc.as_mut_ptr();
    for t in 0..n {
        let rec = &bytes[t * rb..(t + 1) * rb];
        // int8 codes read in place while an 8-byte load past the last one stays in the slice
        let src = if int8 && t * rb + vo + r + 8 <= bytes.len() {
            rec[vo..].as_ptr()
        } else {
            if int8 {
                codes[..r].copy_from_slice(&rec[vo..vo + r]);
                codes[r..r + 8].fill(0);
            } else {
                unpack_codes(layout.dtype, &rec[vo..], r, &mut codes);
            }
            codes.as_ptr()
        };
        let ms = u32::from_le_bytes([rec[bb], rec[bb + 1], rec[bb + 2], rec[bb + 3]]);
        let ms = _mm_cvtph_ps(_mm_cvtsi32_si128(ms as i32));
        let min = _mm256_broadcastss_ps(ms);
        let scale = _mm256_broadcastss_ps(_mm_movehdup_ps(ms));
        let mut i = 0;
        while i < r {
            let c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(src.add(i) as *const __m128i));
            let x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), scale, min);
            _mm256_storeu_ps(dv.as_mut_ptr().add(i), x);
            i += 8;
        }
        let pt = p.as_ptr().add(t);
        let mut off = 0usize;
        for w in 0..words {
            let mut bits =
                u32::from_le_bytes([rec[4 * w], rec[4 * w + 1], rec[4 * w + 2], rec[4 * w + 3]]);
            // Bits past the last group are not read, nor more than r / g groups: a record
            // that broke the layout's invariants cannot make the kernel write out of bounds.
            if groups < 32 * (w + 1) {
                bits &= ((1u64 << groups.saturating_sub(32 * w)) - 1) as u32;
            }
            while bits != 0 && off + gs <= r {
                let a0 = ap.add((32 * w + bits.trailing_zeros() as usize) * gs);
                bits &= bits - 1;
                let v = dv.as_ptr().add(off);
                match G {
                    4 => {
                        let v = _mm_loadu_ps(v);
                        for h in 0..g {
                            let (a, ph) = (a0.add(h * dp), _mm_broadcast_ss(&*pt.add(h * TILE)));
                            _mm_storeu_ps(a, _mm_fmadd_ps(ph, v, _mm_loadu_ps(a)));
                        }
                    }
                    8 => {
                        let v = _mm256_loadu_ps(v);
                        for h in 0..g {
                            let (a, ph) = (a0.add(h * dp), _mm256_broadcast_ss(&*pt.add(h * TILE)));
                            _mm256_storeu_ps(a, _mm256_fmadd_ps(ph, v, _mm256_loadu_ps(a)));
                        }
                    }
                    _ => {
                        for h in 0..g {
                            add_scaled(a0.add(h * dp), *pt.add(h * TILE), v, gs);
                        }
                    }
                }
                off += gs;
            }
        }
    }
}

/// `a[i] += p * v[i]` for `i < len`, one FMA each (eight, four, then one lane at a time).
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn add_scaled(a: *mut f32, p: f32, v: *const f32, len: usize) {
    let mut i = 0;
    while i + 8 <= len {
        let x = _mm256_fmadd_ps(
            _mm256_set1_ps(p),
            _mm256_loadu_ps(v.add(i)),
            _mm256_loadu_ps(a.add(i)),
        );
        _mm256_storeu_ps(a.add(i), x);
        i += 8;
    }
    if i + 4 <= len {
        let x = _mm_fmadd_ps(
            _mm_set1_ps(p),
            _mm_loadu_ps(v.add(i)),
            _mm_loadu_ps(a.add(i)),
        );
        _mm_storeu_ps(a.add(i), x);
        i += 4;
    }
    while i < len {
        let x = _mm_fmadd_ss(_mm_set_ss(p), _mm_load_ss(v.add(i)), _mm_load_ss(a.add(i)));
        _mm_store_ss(a.add(i), x);
        i += 1;
    }
}
