//! SPEC.md section 6, int8/int4 records: codes unpacked with 16-byte nibble splits,
//! then placed by a `pshufb` table (eight dims per bitmap byte), widened, scaled and offset
//! by the record's minimum in one FMA, and masked to the kept dims by a lane-mask table.
//! SPEC 9 on the records as stored: the integer key logits ([`key_logits_q8`]) and the values
//! at their kept dims, into a head-minor accumulator ([`sparse_accumulate`], int8/int4 and
//! f16) or, past its eight heads, the dense one ([`kept_accumulate_q`]).

use crate::simd::codes::{
    group_word, unpack_codes_scalar, SparsePlan, CODE_SLACK, QUANT_SIMD_MAX_R, SPARSE_MAX_CHUNKS,
};
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
            // (no bit past the last group; no more than r / g groups taken below)
            let mut bits = group_word(rec, w, groups);
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

/// SPEC.md section 9, value side, at the kept dims only, into the head-minor accumulator of
/// `plan` (8-lane registers, [`SparsePlan`]): `acc_t[plan.at(j, h)] += p[h * TILE + t] *
/// v_t[j]` for every kept dim `j` of record `t < n`, in token order, one FMA each; `v_t[j]`
/// is the decoded value (`m + code * s` for int8/int4, the f16 widened), the float the
/// expansion writes. A kept group costs one FMA per register of its slot (its `g` values and
/// `heads` probabilities spread over the lanes by `vpermps`), where the dense path multiplies
/// every dim for every head; each accumulator sees the dense path's FMAs in its order (which
/// adds `p * 0` at the dims not kept and leaves the sum as it is), so the result is the same
/// bits as expanding the records and accumulating the tile (`tiles::tile_accumulate`).
///
/// # Safety
/// AVX2, FMA, F16C and POPCNT available; `layout` int8/int4/f16 with `r <= QUANT_SIMD_MAX_R`,
/// `1 <= g <= 8`; `plan` made for `g`, at most 8 heads, 8 lanes; `bytes` holds `n` whole
/// records; `p` holds `plan.heads * TILE` floats, `n <= TILE`; `acc_t` holds
/// `plan.len(layout.kept_dims)` floats.
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn sparse_accumulate(
    p: *const f32,
    plan: &SparsePlan,
    bytes: &[u8],
    layout: &RecordLayout,
    n: usize,
    acc_t: *mut f32,
) {
    Path::Avx2.ran();
    match layout.group_size {
        1 => sparse_accumulate_g::<1>(p, plan, bytes, layout, n, acc_t),
        2 => sparse_accumulate_g::<2>(p, plan, bytes, layout, n, acc_t),
        4 => sparse_accumulate_g::<4>(p, plan, bytes, layout, n, acc_t),
        _ => sparse_accumulate_g::<0>(p, plan, bytes, layout, n, acc_t),
    }
}

/// [`sparse_accumulate`] for group size `G` (0: any other up to 8, read from the layout).
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
unsafe fn sparse_accumulate_g<const G: usize>(
    p: *const f32,
    plan: &SparsePlan,
    bytes: &[u8],
    layout: &RecordLayout,
    n: usize,
    acc_t: *mut f32,
) {
    let g = if G == 0 { layout.group_size } else { G };
    let (r, rb, bb, vo) = (
        layout.r,
        layout.record_bytes(),
        layout.bitmap_bytes(),
        layout.values_offset(),
    );
    let (words, groups) = (bb / 4, layout.kept_dims / g);
    let (heads, chunks, stride) = (plan.heads, plan.chunks, plan.stride());
    let half = layout.dtype == ValueDtype::F16;
    let int8 = layout.dtype == ValueDtype::Int8;
    // Per register of a slot: which of the group's decoded values (< g <= 8) and which head's
    // probability each lane takes, and its live lanes (the others multiply 0 into their 0).
    let mut vsel = [_mm256_setzero_si256(); SPARSE_MAX_CHUNKS];
    let mut hsel = [_mm256_setzero_si256(); SPARSE_MAX_CHUNKS];
    let mut live = [_mm256_setzero_ps(); SPARSE_MAX_CHUNKS];
    for c in 0..chunks {
        let (mut v, mut h, mut m) = ([0i32; 8], [0i32; 8], [0i32; 8]);
        for l in 0..8 {
            v[l] = plan.vbase[c] as i32 + plan.vidx[c][l];
            h[l] = plan.hidx[c][l];
            m[l] = -(((plan.live[c] >> l) & 1) as i32);
        }
        vsel[c] = _mm256_loadu_si256(v.as_ptr() as *const __m256i);
        hsel[c] = _mm256_loadu_si256(h.as_ptr() as *const __m256i);
        live[c] = _mm256_castsi256_ps(_mm256_loadu_si256(m.as_ptr() as *const __m256i));
    }
    // This tile's probabilities token-major: lane h of row t is p[h * TILE + t].
    let mut pt = [0f32; 8 * TILE];
    for h in 0..heads {
        for t in 0..n {
            pt[8 * t + h] = *p.add(h * TILE + t);
        }
    }
    // A record's values with the slack to load a whole register past the last: f16 halves
    // (2 r bytes, 16 after) or codes one byte each (int4 unpacked; int8 copied near the end).
    let mut local = [0u8; 2 * QUANT_SIMD_MAX_R + CODE_SLACK];
    for t in 0..n {
        let at = t * rb;
        let rec = &bytes[at..at + rb];
        let src: *const u8 = if half {
            if at + vo + 2 * r + 16 <= bytes.len() {
                rec.as_ptr().add(vo)
            } else {
                local[..2 * r].copy_from_slice(&rec[vo..vo + 2 * r]);
                local[2 * r..2 * r + 16].fill(0);
                local.as_ptr()
            }
        } else if int8 && at + vo + r + 8 <= bytes.len() {
            rec.as_ptr().add(vo)
        } else {
            if int8 {
                local[..r].copy_from_slice(&rec[vo..vo + r]);
                local[r..r + 8].fill(0);
            } else {
                unpack_codes(layout.dtype, &rec[vo..], r, &mut local);
            }
            local.as_ptr()
        };
        let (min, scale) = if half {
            (_mm256_setzero_ps(), _mm256_setzero_ps())
        } else {
            let ms = u32::from_le_bytes([rec[bb], rec[bb + 1], rec[bb + 2], rec[bb + 3]]);
            let ms = _mm_cvtph_ps(_mm_cvtsi32_si128(ms as i32));
            (
                _mm256_broadcastss_ps(ms),
                _mm256_broadcastss_ps(_mm_movehdup_ps(ms)),
            )
        };
        let prow = _mm256_loadu_ps(pt.as_ptr().add(8 * t));
        let mut pc = [_mm256_setzero_ps(); SPARSE_MAX_CHUNKS];
        for c in 0..chunks {
            pc[c] = _mm256_and_ps(_mm256_permutevar8x32_ps(prow, hsel[c]), live[c]);
        }
        let mut off = 0usize;
        for w in 0..words {
            // (no bit past the last group; no more than r / g groups taken below)
            let mut bits = group_word(rec, w, groups);
            while bits != 0 && off + g <= r {
                let slot = acc_t.add((32 * w + bits.trailing_zeros() as usize) * stride);
                bits &= bits - 1;
                // the group's g values, spread over each register's lanes
                let vd = decode8(half, src, off, scale, min);
                for c in 0..chunks {
                    let a = slot.add(8 * c);
                    let v = _mm256_permutevar8x32_ps(vd, vsel[c]);
                    _mm256_storeu_ps(a, _mm256_fmadd_ps(pc[c], v, _mm256_loadu_ps(a)));
                }
                off += g;
            }
        }
    }
}

/// A record's decoded values `i..i + 8` from its f16 halves or one-byte codes at `src`
/// (`m + code * s`, one rounding); past `r`, the slack's (never accumulated).
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn decode8(half: bool, src: *const u8, i: usize, scale: __m256, min: __m256) -> __m256 {
    if half {
        _mm256_cvtph_ps(_mm_loadu_si128(src.add(2 * i) as *const __m128i))
    } else {
        let c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(src.add(i) as *const __m128i));
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), scale, min)
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

/// For a dims byte, its 8 dims as 8 bytes: 1 where the dim is kept, 0 elsewhere.
static KEPT_BYTES: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        let mut lane = 0;
        while lane < 8 {
            if (b >> lane) & 1 == 1 {
                t[b] |= 1u64 << (8 * lane);
            }
            lane += 1;
        }
        b += 1;
    }
    t
};

/// SPEC.md section 9, logits on int8/int4 key records against the int8 query of section 8.2:
/// for the `n <= TILE` records in `bytes` and `g` heads, `out[h * TILE + t] = f32((s_q[h] *
/// (s * I_c + m * I_k)) * inv_sqrt_d)` with `I_c = sum_kept a_hj c_j`, `I_k = sum_kept a_hj`
/// (`q8` `[g][qs]` bytes, `a_hj` at `q8[h * qs + j]`, zero past `Dt`). Per 16 dims the record's
/// codes are placed by two `pshufb` (eight dims per bitmap byte, as [`expand_q`] places
/// them); per 32 dims they are made signed (`c - 128`) and multiplied into i16 pair sums by
/// `vpmaddubsw` on their magnitudes against the query bytes carrying their signs, which cannot
/// saturate (`2 * 128 * 127 < 2^15`; on the unsigned codes it could: `2 * 255 * 127 > 2^15`),
/// then widened into i32 sums by `vpmaddwd`; the kept dims' query sum by `vpmaddubsw` on a
/// byte 1 per kept dim ([`logits_q8_heads`]). The sums are exact integers, and the f64 epilogue is
/// `spec::layout::key_logit_q8`'s operations (exact products, one rounding each), so the
/// logits are the bits of every other path.
///
/// # Safety
/// AVX2, FMA, F16C and POPCNT available; `layout` is int8/int4 with `r` and `kept_dims` at
/// most `QUANT_SIMD_MAX_R`; `bytes` holds `n` records, `n <= TILE`; `q8` holds `g * qs`
/// bytes, `qs` a multiple of 64 at least `kept_dims` ([`crate::simd::q8_stride`]); `sq` holds `g`
/// scales; `out` holds `g * TILE`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn key_logits_q8(
    q8: &[i8],
    qs: usize,
    sq: &[f64],
    g: usize,
    bytes: &[u8],
    layout: &RecordLayout,
    n: usize,
    inv_sqrt_d: f64,
    out: &mut [f32],
) {
    Path::Avx2.ran();
    // Up to eight heads per pass over the records (a fixed count: the sums stay in registers,
    // or past six heads partly in L1), since each pass places each record's codes again: seven
    // heads (Qwen2.5-Coder-0.5B) took 48-56 ns per record in one pass, 68-72 in passes of six
    // and one (`kernel_cost`, Zen 3).
    let mut h0 = 0;
    while h0 < g {
        let hn = (g - h0).min(PASS_Q8);
        let mut sqv = [0f64; 8];
        sqv[..hn].copy_from_slice(&sq[h0..h0 + hn]);
        // The pass's query rows, read in place (`qs` is a multiple of 64, zero past Dt).
        let a = (
            q8.as_ptr().add(h0 * qs),
            qs,
            &sqv,
            bytes,
            layout,
            n,
            inv_sqrt_d,
            out.as_mut_ptr().add(h0 * TILE),
        );
        match hn {
            1 => logits_q8_heads::<1>(a),
            2 => logits_q8_heads::<2>(a),
            3 => logits_q8_heads::<3>(a),
            4 => logits_q8_heads::<4>(a),
            5 => logits_q8_heads::<5>(a),
            6 => logits_q8_heads::<6>(a),
            7 => logits_q8_heads::<7>(a),
            _ => logits_q8_heads::<8>(a),
        }
        h0 += PASS_Q8;
    }
}

/// The arguments of [`logits_q8_heads`]: the pass's query rows as i16 (`QUANT_SIMD_MAX_R`
/// apart), their scales, the records, `1 / sqrt(D)`, and the first head's logits (heads
/// `TILE` apart).
type HeadsArgs<'a> = (
    *const i8,
    usize,
    &'a [f64; 8],
    &'a [u8],
    &'a RecordLayout,
    usize,
    f64,
    *mut f32,
);

/// Sixteen dims of a record placed by two `pshufb` (eight dims per bitmap byte): the codes at
/// their dims (0 elsewhere) and a byte 1 per kept dim. `off` advances past the codes taken.
/// `CLAMP`: each load's offset is clamped to `r`, for a record whose bitmap keeps more dims
/// than it has codes (corrupt); a record that keeps at most `r` reads at most `r + 16` bytes
/// from `cp` without it.
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn place16<const CLAMP: bool>(
    bits: *const u8,
    c: usize,
    cp: *const u8,
    off: &mut usize,
    r: usize,
) -> (__m128i, __m128i) {
    let (b0, b1) = (*bits.add(2 * c) as usize, *bits.add(2 * c + 1) as usize);
    let clamp = |o: usize| if CLAMP { o.min(r) } else { o };
    // The running offset is a chain of adds only.
    let o1 = *off + b0.count_ones() as usize;
    let v0 = _mm_loadu_si128(cp.add(clamp(*off)) as *const __m128i);
    let p0 = _mm_shuffle_epi8(
        v0,
        _mm_loadu_si128(EXPAND_LUT8[b0].as_ptr() as *const __m128i),
    );
    let v1 = _mm_loadu_si128(cp.add(clamp(o1)) as *const __m128i);
    let p1 = _mm_shuffle_epi8(
        v1,
        _mm_loadu_si128(EXPAND_LUT8[b1].as_ptr() as *const __m128i),
    );
    *off = o1 + b1.count_ones() as usize;
    let kept = _mm_set_epi64x(KEPT_BYTES[b1] as i64, KEPT_BYTES[b0] as i64);
    (_mm_unpacklo_epi64(p0, p1), kept)
}

/// Set bits in the `n` bytes at `p` (whole words read where they fit).
#[inline]
unsafe fn popcount_bytes(p: *const u8, n: usize) -> usize {
    let mut k = 0;
    let mut i = 0;
    while i + 8 <= n {
        k += (p.add(i) as *const u64).read_unaligned().count_ones() as usize;
        i += 8;
    }
    while i < n {
        k += (*p.add(i)).count_ones() as usize;
        i += 1;
    }
    k
}

/// One record's integer sums for `N` heads (`ac[h]`: i32 lanes summing to `S_h = sum_kept
/// a_hj (c_j - 128)`; `ak[h]`: i16 lanes summing to `I_k`), 32 dims a step, for
/// [`logits_q8_heads`].
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn record_sums<const N: usize, const CLAMP: bool>(
    bits: *const u8,
    cp: *const u8,
    r: usize,
    chunks: usize,
    q8: *const i8,
    qs: usize,
) -> ([__m256i; N], [__m256i; N]) {
    let ones = _mm256_set1_epi16(1);
    let mut ac = [_mm256_setzero_si256(); N];
    let mut ak = [_mm256_setzero_si256(); N];
    let mut off = 0usize;
    let mut c = 0;
    while c < chunks {
        let (p0, k0) = place16::<CLAMP>(bits, c, cp, &mut off, r);
        let (p1, k1) = if c + 1 < chunks {
            place16::<CLAMP>(bits, c + 1, cp, &mut off, r)
        } else {
            (_mm_setzero_si128(), _mm_setzero_si128())
        };
        let placed = _mm256_set_m128i(p1, p0);
        let kept = _mm256_set_m128i(k1, k0);
        // c - 128 where kept (a 0x80 flips the code's top bit), 0 elsewhere
        let signed = _mm256_xor_si256(placed, _mm256_slli_epi16::<7>(kept));
        let mag = _mm256_abs_epi8(signed);
        for j in 0..N {
            let qv = _mm256_loadu_si256(q8.add(j * qs + 16 * c) as *const __m256i);
            let prod = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(qv, signed));
            ac[j] = _mm256_add_epi32(ac[j], _mm256_madd_epi16(prod, ones));
            ak[j] = _mm256_add_epi16(ak[j], _mm256_maddubs_epi16(kept, qv));
        }
        c += 2;
    }
    (ac, ak)
}

/// [`key_logits_q8`] for `N <= PASS_Q8` heads over the `n` records, 32 dims at a time: the
/// placed codes become signed (`c - 128`, 0 where not kept) so that `vpmaddubsw` on their
/// magnitudes against the query bytes carrying their signs (llama.cpp's q8_0 route) cannot
/// saturate (`2 * 128 * 127 < 2^15`); `S = sum_kept a_j (c_j - 128)`, and the kept dims' query
/// sum `I_k` by `vpmaddubsw` on a byte 1 per kept dim (pairs at most 254, added in i16 over the
/// blocks), so `I_c = S + 128 I_k`, exactly. The records' exact sums are kept for the tile and
/// the f64 epilogue runs after the last record, out of the placement's way (together with the
/// unclamped loads: 37-38 -> 34-36 ns per record for four heads, `kernel_cost`, Zen 3).
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
unsafe fn logits_q8_heads<const N: usize>(a: HeadsArgs<'_>) {
    let (q8, qs, sq, bytes, layout, n, inv_sqrt_d, out) = a;
    let (dt, r, rb) = (layout.kept_dims, layout.r, layout.record_bytes());
    let chunks = dt.div_ceil(16);
    let nb = dt.div_ceil(8);
    // (each a division: once per call, not per record)
    let (vo, bb) = (layout.values_offset(), layout.bitmap_bytes());
    // A g = 1 record whose Dt is a multiple of 8 is read in place: its bitmap bytes are its
    // dims (two per chunk stay inside the 4-byte words), its int8 codes are read 16 at a time
    // where that stays inside `bytes`.
    let bits_in_place = layout.group_size == 1 && dt % 8 == 0;
    let mut dims = [0u8; QUANT_SIMD_MAX_R / 8 + 2];
    let mut codes = [0u8; QUANT_SIMD_MAX_R + CODE_SLACK];
    let ones = _mm256_set1_epi16(1);
    // per record: (I_c, I_k) of each group of four heads, and the f16 minimum and scale
    let mut sums = [[(_mm_setzero_si128(), _mm_setzero_si128()); 2]; TILE];
    let mut mss = [0u32; TILE];
    for t in 0..n {
        let at = t * rb;
        let rec = &bytes[at..at + rb];
        let bits: *const u8 = if bits_in_place {
            rec.as_ptr()
        } else {
            // One bit per dim, bits past Dt cleared, a zero byte after the last so that every
            // chunk reads two bytes.
            dims.fill(0);
            if layout.group_size == 1 {
                dims[..nb].copy_from_slice(&rec[..nb]);
            } else {
                spread_groups(rec, layout, &mut dims);
            }
            if dt % 8 != 0 {
                dims[nb - 1] &= (1u8 << (dt % 8)) - 1;
            }
            dims.as_ptr()
        };
        let cp: *const u8 = if layout.dtype == ValueDtype::Int8 && at + vo + r + 16 <= bytes.len() {
            rec.as_ptr().add(vo)
        } else {
            // (zeroes the slack past r: a 16-byte load at any offset up to r reads zeros)
            unpack_codes(layout.dtype, &rec[vo..], r, &mut codes);
            codes.as_ptr()
        };
        // the bytes the chunks read keep at most r dims: no load can pass r + 16
        let (ac, ak) = if popcount_bytes(bits, 2 * chunks) <= r {
            record_sums::<N, false>(bits, cp, r, chunks, q8, qs)
        } else {
            record_sums::<N, true>(bits, cp, r, chunks, q8, qs)
        };
        for k in 0..N.div_ceil(4) {
            let (mut hc, mut hk) = ([_mm256_setzero_si256(); 4], [_mm256_setzero_si256(); 4]);
            for j in 4 * k..N.min(4 * k + 4) {
                hc[j - 4 * k] = ac[j];
                hk[j - 4 * k] = _mm256_madd_epi16(ak[j], ones);
            }
            let ik = super::hsum4_i32(&hk);
            let ic = _mm_add_epi32(super::hsum4_i32(&hc), _mm_slli_epi32::<7>(ik));
            sums[t][k] = (ic, ik);
        }
        mss[t] = u32::from_le_bytes([rec[bb], rec[bb + 1], rec[bb + 2], rec[bb + 3]]);
    }
    let inv = _mm256_set1_pd(inv_sqrt_d);
    for t in 0..n {
        let ms = _mm_cvtph_ps(_mm_cvtsi32_si128(mss[t] as i32));
        let mut lanes = [0f32; 8];
        for (k, chunk) in lanes.chunks_exact_mut(4).enumerate().take(N.div_ceil(4)) {
            let (ic, ik) = sums[t][k];
            let z = logit_epilogue(ic, ik, ms, _mm256_loadu_pd(sq.as_ptr().add(4 * k)), inv);
            _mm_storeu_ps(chunk.as_mut_ptr(), z);
        }
        for (j, &x) in lanes.iter().enumerate().take(N) {
            *out.add(j * TILE + t) = x;
        }
    }
}

/// Query heads per pass of AVX-512's integer key logits on records of more than 64 dims:
/// Qwen2.5-Coder-1.5B's group of six in one pass, so each record is placed once.
pub(crate) const HEADS_Q8: usize = 6;

/// Query heads per pass of AVX2's integer key logits ([`HEADS_Q8`] is AVX-512's for records
/// of more than 64 dims).
const PASS_Q8: usize = 8;

/// SPEC 9's f64 epilogue for four heads (`spec::layout::key_logit_q8`, lane for lane): from
/// the exact sums `ic`, `ik`, the record's f16 minimum and scale `ms` (widened, lanes 0 and 1),
/// the heads' `s_q` and `1 / sqrt(D)`: `f32((s_q * (s * I_c + m * I_k)) * inv)`. The products
/// are exact, so the fused multiply-add rounds the sum once, as the host's add does.
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
#[inline]
pub(crate) unsafe fn logit_epilogue(
    ic: __m128i,
    ik: __m128i,
    ms: __m128,
    sq: __m256d,
    inv: __m256d,
) -> __m128 {
    let m64 = _mm256_set1_pd(f64::from(_mm_cvtss_f32(ms)));
    let s64 = _mm256_set1_pd(f64::from(_mm_cvtss_f32(_mm_movehdup_ps(ms))));
    let sum = _mm256_fmadd_pd(
        s64,
        _mm256_cvtepi32_pd(ic),
        _mm256_mul_pd(m64, _mm256_cvtepi32_pd(ik)),
    );
    _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_mul_pd(sq, sum), inv))
}
