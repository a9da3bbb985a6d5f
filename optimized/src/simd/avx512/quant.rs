//! SPEC.md section 6, int8/int4 records, any group size: codes loaded straight from the
//! record with masked loads that stay inside it (int8) or unpacked by the AVX2 kernel (int4),
//! then one `vpexpandb` per 64 dims places them at the kept dims (the bitmap's bits, spread
//! over their groups' dims by `pdep` where g > 1); 16 lanes at a time widened (`vpmovzxbd`),
//! converted, scaled, offset by the minimum and zeroed where not kept.

use super::{lanes16, lanes64};
use crate::simd::avx2::quant::{spread_groups, unpack_codes};
use crate::simd::codes::{SparsePlan, CODE_SLACK, QUANT_SIMD_MAX_R, SPARSE_MAX_CHUNKS};
use crate::simd::path::Path;
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
    // (Only int4 fills a buffer: zeroing one per int8 record cost 1.5 % of a decode step.)
    let mut codes_buf: [u8; QUANT_SIMD_MAX_R + CODE_SLACK];
    let codes = if int8 {
        stored.as_ptr()
    } else {
        codes_buf = [0u8; QUANT_SIMD_MAX_R + CODE_SLACK];
        unpack_codes(layout.dtype, stored, r, &mut codes_buf);
        codes_buf.as_ptr()
    };
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
            _mm512_loadu_si512(codes.add(off) as *const __m512i)
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
            let kept = (mask >> (16 * q)) as u16;
            let c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
            let x = _mm512_maskz_fmadd_ps(kept, c, scale, min);
            if base + 16 <= dp {
                _mm512_storeu_ps(row.as_mut_ptr().add(base), x);
            } else {
                _mm512_mask_storeu_ps(row.as_mut_ptr().add(base), lanes16(dp - base), x);
            }
        }
        off = (off + mask.count_ones() as usize).min(r);
    }
    let covered = (64 * dt.div_ceil(64)).min(dp);
    row[covered..].fill(0.0);
}

/// Value accumulation on packed int8/int4 records, kept dims only (SPEC.md sections 6 and 9):
/// `acc_t[plan.at(j, h)] += p[h * TILE + t] * v_t[j]` for every kept dim `j` of record `t`
/// (`t < n`), in token order, one FMA each. `acc_t` is head-minor, a padded slot of whole
/// registers per kept group ([`SparsePlan`]), so a kept group costs one to a few unmasked
/// 16-lane FMAs (loads and stores that forward), where the dense path expands the record to
/// all `Dt` dims and multiplies every dim for every head. The decoded value is `m + code * s`
/// (exact product, one rounding), the float the expansion writes, and each accumulator sees
/// the FMAs of the dense path in its order (which adds `p * 0 = +0` at the dims not kept), so
/// the result is the same bits.
///
/// # Safety
/// AVX-512 F/BW/VL/VBMI2 available; `layout` quantized with `r <= QUANT_SIMD_MAX_R`, `plan`
/// made for its group size; `bytes` holds `n` whole records; `p` holds `plan.heads * TILE`
/// floats, `n <= TILE`; `acc_t` holds `plan.len(layout.kept_dims)` floats.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt,bmi2"
)]
pub unsafe fn sparse_accumulate_q(
    p: *const f32,
    plan: &SparsePlan,
    bytes: &[u8],
    layout: &RecordLayout,
    n: usize,
    acc_t: *mut f32,
) {
    use crate::simd::common::TILE;
    Path::Avx512.ran();
    let (g, r, rb, bb) = (
        layout.group_size,
        layout.r,
        layout.record_bytes(),
        layout.bitmap_bytes(),
    );
    let (heads, chunks, stride) = (plan.heads, plan.chunks, plan.stride());
    let mut vidx = [_mm512_setzero_si512(); SPARSE_MAX_CHUNKS];
    let mut hidx = [_mm512_setzero_si512(); SPARSE_MAX_CHUNKS];
    for c in 0..chunks {
        vidx[c] = _mm512_loadu_si512(plan.vidx[c].as_ptr() as *const __m512i);
        hidx[c] = _mm512_loadu_si512(plan.hidx[c].as_ptr() as *const __m512i);
    }
    // This tile's probabilities token-major: lane h of row t is p[h * TILE + t].
    let mut pt = [0f32; 16 * TILE];
    for h in 0..heads {
        for t in 0..n {
            pt[16 * t + h] = *p.add(h * TILE + t);
        }
    }
    let mut codes = [0u8; QUANT_SIMD_MAX_R + CODE_SLACK];
    // Decoded values of one record, whole registers (stored and reloaded whole, so the
    // reloads forward from the stores), and one register of slack.
    let mut dv = [_mm512_setzero_ps(); QUANT_SIMD_MAX_R / 16 + 2];
    let int8 = layout.dtype == ValueDtype::Int8;
    let (words, groups) = (bb / 4, layout.kept_dims / g);
    for t in 0..n {
        let rec = &bytes[t * rb..(t + 1) * rb];
        let stored = &rec[layout.values_offset()..];
        let src: *const u8 = if int8 {
            stored.as_ptr()
        } else {
            unpack_codes(layout.dtype, stored, r, &mut codes);
            codes.as_ptr()
        };
        let ms = u32::from_le_bytes([rec[bb], rec[bb + 1], rec[bb + 2], rec[bb + 3]]);
        let ms = _mm_cvtph_ps(_mm_cvtsi32_si128(ms as i32));
        let min = _mm512_broadcastss_ps(ms);
        let scale = _mm512_broadcastss_ps(_mm_movehdup_ps(ms));
        let mut i = 0;
        while i < r {
            let c = _mm_maskz_loadu_epi8(lanes16(r - i), src.add(i) as *const i8);
            let x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c)), scale, min);
            dv[i / 16] = x;
            i += 16;
        }
        // Head of each lane; lanes past the span get 0 (their slot lanes stay 0).
        let prow = _mm512_loadu_ps(pt.as_ptr().add(16 * t));
        let mut pc = [_mm512_setzero_ps(); SPARSE_MAX_CHUNKS];
        for c in 0..chunks {
            pc[c] = _mm512_maskz_permutexvar_ps(plan.live[c], hidx[c], prow);
        }
        if chunks == 1 && r <= 16 {
            // One register of values, one per slot (the common case: few kept dims, up to 16
            // lanes of heads x dims per group): the lanes' value indices advance by g a group.
            let (vals, pc0, step) = (dv[0], pc[0], _mm512_set1_epi32(g as i32));
            let mut idx = vidx[0];
            let mut left = r / g;
            for w in 0..words {
                let mut bits = u32::from_le_bytes([
                    rec[4 * w],
                    rec[4 * w + 1],
                    rec[4 * w + 2],
                    rec[4 * w + 3],
                ]);
                if groups < 32 * (w + 1) {
                    bits &= ((1u64 << groups.saturating_sub(32 * w)) - 1) as u32;
                }
                while bits != 0 && left > 0 {
                    let a0 = acc_t.add((32 * w + bits.trailing_zeros() as usize) * 16);
                    bits &= bits - 1;
                    let v = _mm512_permutexvar_ps(idx, vals);
                    _mm512_storeu_ps(a0, _mm512_fmadd_ps(pc0, v, _mm512_loadu_ps(a0)));
                    idx = _mm512_add_epi32(idx, step);
                    left -= 1;
                }
            }
            continue;
        }
        let mut off = 0usize;
        for w in 0..words {
            let mut bits =
                u32::from_le_bytes([rec[4 * w], rec[4 * w + 1], rec[4 * w + 2], rec[4 * w + 3]]);
            // Bits past the last group are not read, nor more than r / g groups: a record
            // that broke the layout's invariants cannot make the kernel write out of bounds.
            if groups < 32 * (w + 1) {
                bits &= ((1u64 << groups.saturating_sub(32 * w)) - 1) as u32;
            }
            while bits != 0 && off + g <= r {
                let k = 32 * w + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let a0 = acc_t.add(k * stride);
                for c in 0..chunks {
                    // Values off + vbase + vidx[l] (< off + vbase + 16) of the record: from
                    // the register holding value off + vbase and the next one.
                    let at = off + plan.vbase[c];
                    let idx = _mm512_add_epi32(vidx[c], _mm512_set1_epi32((at % 16) as i32));
                    let v = _mm512_permutex2var_ps(dv[at / 16], idx, dv[at / 16 + 1]);
                    let a = _mm512_loadu_ps(a0.add(16 * c));
                    _mm512_storeu_ps(a0.add(16 * c), _mm512_fmadd_ps(pc[c], v, a));
                }
                off += g;
            }
        }
    }
}

/// One record's state in [`tile_logits_q`]: where its codes start (the record itself for
/// int8, an unpacked copy for int4), its minimum and scale, its bitmap's table spread (group
/// sizes other than 1, 2, 4 and 8), and the codes it has placed so far.
struct KeyRecord<'a> {
    rec: &'a [u8],
    codes: *const u8,
    min: __m512,
    scale: __m512,
    spread: [u8; QUANT_SIMD_MAX_R / 8],
    off: usize,
}

/// Query heads per pass of [`tile_logits_q`].
const HEADS_PER_PASS: usize = 6;

/// SPEC.md section 9, key side, on packed int8/int4 records of any group size, decoded in
/// registers: `out[h * TILE + t] = scale * (q_h . k^_t)` for `g` heads (`q` `[g][dp]`) and
/// the `n <= TILE` records in `bytes`. Four records x up to six heads per pass (the tile
/// route, [`super::logits::tile_logits`], runs four x four); per 64 dims each record's codes
/// are placed by one `vpexpandb` ([`expand_q`]'s decode), then 16 dims at a time widened,
/// decoded (`m + code * s`, zero where not kept) and multiplied into the accumulators. The
/// decoded values, the FMAs and their order, and the reductions are those of
/// [`expand_q`] followed by `tile_logits`, so the logits are the same bits; what goes is the
/// tile's store and reload.
///
/// # Safety
/// AVX-512 F/BW/VL/VBMI2, BMI2 (and the AVX2 set) available; `layout` int8/int4 with `r` and
/// `kept_dims` at most `QUANT_SIMD_MAX_R`; `bytes` holds `n` whole records, `n <= TILE`;
/// `q` holds `g * dp` floats, `dp >= kept_dims` a multiple of 8; `out` holds `g * TILE`.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt,bmi2"
)]
#[allow(clippy::too_many_arguments)]
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
    use crate::simd::common::TILE;
    Path::Avx512.ran();
    let rb = layout.record_bytes();
    let int8 = layout.dtype == ValueDtype::Int8;
    let spread_table = !matches!(layout.group_size, 1 | 2 | 4 | 8);
    let mut bufs = [[0u8; QUANT_SIMD_MAX_R + CODE_SLACK]; 4];
    let mut t = 0;
    while t < n {
        let tn = (n - t).min(4);
        // The pass's records, set up once for every head group.
        let mut recs: [KeyRecord; 4] = std::array::from_fn(|j| {
            let rec = &bytes[(t + j.min(tn - 1)) * rb..(t + j.min(tn - 1) + 1) * rb];
            KeyRecord {
                rec,
                codes: rec.as_ptr(),
                min: _mm512_setzero_ps(),
                scale: _mm512_setzero_ps(),
                spread: [0u8; QUANT_SIMD_MAX_R / 8],
                off: 0,
            }
        });
        for (j, kr) in recs.iter_mut().enumerate().take(tn) {
            let stored = &kr.rec[layout.values_offset()..];
            kr.codes = if int8 {
                stored.as_ptr()
            } else {
                // Zeroed first, as `expand_q` does: a record whose bitmap keeps more than
                // `r` dims places zeros past its codes on every path.
                bufs[j] = [0u8; QUANT_SIMD_MAX_R + CODE_SLACK];
                unpack_codes(layout.dtype, stored, layout.r, &mut bufs[j]);
                bufs[j].as_ptr()
            };
            if spread_table {
                spread_groups(kr.rec, layout, &mut kr.spread);
            }
            let o = layout.bitmap_bytes();
            let ms = u32::from_le_bytes([kr.rec[o], kr.rec[o + 1], kr.rec[o + 2], kr.rec[o + 3]]);
            let ms = _mm_cvtph_ps(_mm_cvtsi32_si128(ms as i32));
            kr.min = _mm512_broadcastss_ps(ms);
            kr.scale = _mm512_broadcastss_ps(_mm_movehdup_ps(ms));
        }
        let mut h0 = 0;
        while h0 < g {
            let (qp, op) = (q.as_ptr().add(h0 * dp), out.as_mut_ptr().add(h0 * TILE + t));
            macro_rules! pass {
                ($N:literal) => {
                    match tn {
                        1 => logits_q_pass::<$N, 1>(qp, dp, layout, int8, &mut recs, scale, op),
                        2 => logits_q_pass::<$N, 2>(qp, dp, layout, int8, &mut recs, scale, op),
                        3 => logits_q_pass::<$N, 3>(qp, dp, layout, int8, &mut recs, scale, op),
                        _ => logits_q_pass::<$N, 4>(qp, dp, layout, int8, &mut recs, scale, op),
                    }
                };
            }
            // Up to six heads per pass (24 accumulators, the four records' decoded chunks and
            // a query chunk fit the 32 registers), so a group of six (Qwen2.5's) decodes each
            // record once; a head's sums do not depend on the heads beside it, so the bits are
            // those of any grouping.
            match g - h0 {
                1 => pass!(1),
                2 => pass!(2),
                3 => pass!(3),
                4 => pass!(4),
                5 => pass!(5),
                _ => pass!(6),
            }
            h0 += HEADS_PER_PASS;
        }
        t += 4;
    }
}

/// T records x N heads of [`tile_logits_q`]: the loop of `logits::tile_logits_pass` over
/// 16-dim chunks, with each record's chunk decoded from its codes instead of loaded from a
/// tile.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt,bmi2"
)]
#[inline]
unsafe fn logits_q_pass<const N: usize, const T: usize>(
    q: *const f32,
    dp: usize,
    layout: &RecordLayout,
    int8: bool,
    recs: &mut [KeyRecord; 4],
    scale: f32,
    out: *mut f32,
) {
    use crate::simd::common::TILE;
    let (dt, r) = (layout.kept_dims, layout.r);
    let words = dt.div_ceil(64);
    let mut acc = [[_mm512_setzero_ps(); T]; N];
    for kr in recs.iter_mut().take(T) {
        kr.off = 0;
    }
    for w in 0..dp.div_ceil(64) {
        // Each record's dims 64 w .. 64 w + 64 as a bit mask and its codes placed there;
        // past the bitmap's words, zeros (the tile's zero fill).
        let mut mask = [0u64; T];
        let mut placed = [_mm512_setzero_si512(); T];
        if w < words {
            for j in 0..T {
                let kr = &mut recs[j];
                mask[j] = dim_word(layout, kr.rec, &kr.spread, w);
                let src = if int8 {
                    _mm512_maskz_loadu_epi8(lanes64(r - kr.off), kr.codes.add(kr.off) as *const i8)
                } else {
                    _mm512_loadu_si512(kr.codes.add(kr.off) as *const __m512i)
                };
                placed[j] = _mm512_maskz_expand_epi8(mask[j], src);
                kr.off = (kr.off + mask[j].count_ones() as usize).min(r);
            }
        }
        for part in 0..4 {
            let c = 64 * w + 16 * part;
            if c >= dp {
                break;
            }
            let live = lanes16(dp - c);
            let mut k = [_mm512_setzero_ps(); T];
            for j in 0..T {
                let b = match part {
                    0 => _mm512_castsi512_si128(placed[j]),
                    1 => _mm512_extracti32x4_epi32::<1>(placed[j]),
                    2 => _mm512_extracti32x4_epi32::<2>(placed[j]),
                    _ => _mm512_extracti32x4_epi32::<3>(placed[j]),
                };
                let kept = (mask[j] >> (16 * part)) as u16 & live;
                let cv = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
                k[j] = _mm512_maskz_fmadd_ps(kept, cv, recs[j].scale, recs[j].min);
            }
            for (h, ah) in acc.iter_mut().enumerate() {
                let qv = _mm512_maskz_loadu_ps(live, q.add(h * dp + c));
                for j in 0..T {
                    ah[j] = _mm512_fmadd_ps(qv, k[j], ah[j]);
                }
            }
        }
    }
    let sv = _mm_set1_ps(scale);
    for (h, ah) in acc.iter().enumerate() {
        let o = out.add(h * TILE);
        if T == 4 {
            _mm_storeu_ps(o, _mm_mul_ps(sv, super::hsum4(ah)));
        } else {
            for (j, &x) in ah.iter().enumerate() {
                *o.add(j) = scale * _mm512_reduce_add_ps(x);
            }
        }
    }
}
