//! SPEC.md section 6, int8/int4 records, any group size: codes loaded straight from the
//! record with masked loads that stay inside it (int8) or unpacked by the AVX2 kernel (int4),
//! then one `vpexpandb` per 64 dims places them at the kept dims (the bitmap's bits, spread
//! over their groups' dims by `pdep` where g > 1); 16 lanes at a time widened (`vpmovzxbd`),
//! converted, scaled, offset by the minimum and zeroed where not kept.

use super::{lanes16, lanes64};
use crate::simd::avx2::quant::{spread_groups, unpack_codes, HEADS_Q8};
use crate::simd::codes::{group_word, SparsePlan, CODE_SLACK, QUANT_SIMD_MAX_R, SPARSE_MAX_CHUNKS};
use crate::simd::common::TILE;
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

/// Dims `64 w .. 64 w + 64` of a record of group size `g` and `bb` bitmap bytes
/// (`RecordLayout::bitmap_bytes`, a division: the callers compute it once per call) as one bit
/// per dim: the bitmap's own bits for g = 1, each group's bit repeated over its g dims (`pdep`
/// onto every g-th bit, times `2^g - 1`) for g = 2, 4 and 8, the table spread otherwise.
#[inline(always)]
unsafe fn dim_word(g: usize, bb: usize, rec: &[u8], spread: &[u8], w: usize) -> u64 {
    match g {
        1 => stored_word(rec, bb, w),
        2 | 4 | 8 => {
            let per = 64 / g; // groups per 64 dims, a divisor of 64
            let first = w * per;
            let bits = stored_word(rec, bb, first / 64) >> (first % 64);
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
    let (bb, vo) = (layout.bitmap_bytes(), layout.values_offset());
    let mut spread = [0u8; QUANT_SIMD_MAX_R / 8];
    if !matches!(g, 1 | 2 | 4 | 8) {
        spread_groups(rec, layout, &mut spread);
    }
    let (dt, r, dp) = (layout.kept_dims, layout.r, row.len());
    // int8 codes are read straight from the record (masked loads); int4 ones are unpacked to
    // one byte each first.
    let stored = &rec[vo..];
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
    let o = bb;
    let ms = u32::from_le_bytes([rec[o], rec[o + 1], rec[o + 2], rec[o + 3]]);
    let ms = _mm_cvtph_ps(_mm_cvtsi32_si128(ms as i32));
    let min = _mm512_broadcastss_ps(ms);
    let scale = _mm512_broadcastss_ps(_mm_movehdup_ps(ms));
    let mut off = 0usize;
    for w in 0..dt.div_ceil(64) {
        let mask = dim_word(g, bb, rec, &spread, w);
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
    Path::Avx512.ran();
    // The local buffers sized for the record's r (zeroed at every call, once per tile): the
    // common few-kept-dims records take the small ones.
    if layout.r <= 64 {
        sparse_accumulate_q_buf::<{ 64 / 16 + 2 }, { 64 + CODE_SLACK }>(
            p, plan, bytes, layout, n, acc_t,
        )
    } else {
        sparse_accumulate_q_buf::<{ QUANT_SIMD_MAX_R / 16 + 2 }, { QUANT_SIMD_MAX_R + CODE_SLACK }>(
            p, plan, bytes, layout, n, acc_t,
        )
    }
}

/// [`sparse_accumulate_q`] with `DV` registers of decoded values and `CODES` bytes of unpacked
/// codes (`DV >= r / 16 + 2`, `CODES >= r + CODE_SLACK`).
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt,bmi2"
)]
unsafe fn sparse_accumulate_q_buf<const DV: usize, const CODES: usize>(
    p: *const f32,
    plan: &SparsePlan,
    bytes: &[u8],
    layout: &RecordLayout,
    n: usize,
    acc_t: *mut f32,
) {
    let (g, r, rb, bb) = (
        layout.group_size,
        layout.r,
        layout.record_bytes(),
        layout.bitmap_bytes(),
    );
    let vo = layout.values_offset();
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
    let mut codes = [0u8; CODES];
    // Decoded values of one record, whole registers (stored and reloaded whole, so the
    // reloads forward from the stores), and one register of slack.
    let mut dv = [_mm512_setzero_ps(); DV];
    let int8 = layout.dtype == ValueDtype::Int8;
    let (words, groups) = (bb / 4, layout.kept_dims / g);
    for t in 0..n {
        let rec = &bytes[t * rb..(t + 1) * rb];
        let stored = &rec[vo..];
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
            // (no bit past the last group; no more than r / g groups taken below)
            let mut bits = group_word(rec, w, groups);
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

/// SPEC.md section 9, logits on int8/int4 key records against the int8 query of section 8.2,
/// any group size: for the `n <= TILE` records in `bytes` and `g` heads, `out[h * TILE + t] =
/// f32((s_q[h] * (s * I_c + m * I_k)) * inv_sqrt_d)` with `I_c = sum_kept a_hj c_j` and `I_k =
/// sum_kept a_hj` (`q8` `[g][qs]` bytes, zero past `Dt`). Per 64 dims each record's codes are
/// placed by one `vpexpandb` ([`expand_q`]'s placement), the first `r` kept dims marked by a
/// byte 1 (`pdep` of the code lanes onto the dims), and per head two `vpdpbusd` (unsigned
/// codes times signed query bytes, four products per i32 lane) add them into exact i32 sums.
/// Up to six heads per pass (eight where Dt <= 64); with at most four, two records at a time,
/// their 16 sums reduced by one transposition tree and one 8-lane f64 epilogue; otherwise one
/// record at a time, four heads per reduction. The epilogue is `spec::layout::key_logit_q8`'s operations lane for
/// lane: the bits of every other path.
///
/// # Safety
/// AVX-512 F/BW/VL/VBMI2/VNNI, BMI2 (and the AVX2 set) available; `layout` int8/int4 with `r`
/// and `kept_dims` at most `QUANT_SIMD_MAX_R`; `bytes` holds `n` whole records, `n <= TILE`;
/// `q8` holds `g * qs` bytes with `qs >= kept_dims` rounded up to 64; `sq` holds `g` scales;
/// `out` holds `g * TILE`.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt,bmi2"
)]
#[allow(clippy::too_many_arguments)]
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
    Path::Avx512.ran();
    // Up to six heads per pass over the records, eight where Dt <= 64 (fixed counts, so the
    // sums and, for Dt <= 128, the query rows stay in registers: 3 N registers at Dt <= 64, 4 N
    // at Dt <= 128); each pass places each record's codes again. (Qwen2.5-Coder-0.5B's seven
    // heads per KV head at Dt <= 64 take one pass, not six and one.)
    let pass = if layout.kept_dims <= 64 { 8 } else { HEADS_Q8 };
    let mut h0 = 0;
    while h0 < g {
        let mut sqv = [0f64; 8];
        let hn = (g - h0).min(pass);
        sqv[..hn].copy_from_slice(&sq[h0..h0 + hn]);
        let (qp, op) = (q8.as_ptr().add(h0 * qs), out.as_mut_ptr().add(h0 * TILE));
        let a = (qp, qs, &sqv, bytes, layout, n, inv_sqrt_d, op);
        macro_rules! words {
            ($N:literal) => {
                match layout.kept_dims.div_ceil(64) {
                    1 => logits_q8_heads::<$N, 1>(a),
                    2 => logits_q8_heads::<$N, 2>(a),
                    _ => logits_q8_heads::<$N, 0>(a),
                }
            };
        }
        match hn {
            1 => words!(1),
            2 => words!(2),
            3 => words!(3),
            4 => words!(4),
            5 => words!(5),
            6 => words!(6),
            7 => logits_q8_heads::<7, 1>(a),
            _ => logits_q8_heads::<8, 1>(a),
        }
        h0 += pass;
    }
}

/// The arguments of [`logits_q8_heads`]: `N` query rows at `q` (`qs` bytes apart), their
/// scales, the records, `1 / sqrt(D)`, and the logits of the first head at `out` (heads `TILE`
/// apart).
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

/// [`key_logits_q8`] for `N <= 8` heads over the `n` records (`N <= HEADS_Q8` unless `W == 1`);
/// `W` the 64-dim words of `Dt` (1 or 2, whose query rows are held in registers), or 0 for any
/// `Dt` (rows loaded per word).
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt,bmi2"
)]
unsafe fn logits_q8_heads<const N: usize, const W: usize>(a: HeadsArgs<'_>) {
    let (q, qs, sq, bytes, layout, n, inv_sqrt_d, out) = a;
    let (r, rb) = (layout.r, layout.record_bytes());
    let words = if W == 0 {
        layout.kept_dims.div_ceil(64)
    } else {
        W
    };
    let int8 = layout.dtype == ValueDtype::Int8;
    // (each a division: once per call, not per record)
    let (gsz, bb, vo) = (
        layout.group_size,
        layout.bitmap_bytes(),
        layout.values_offset(),
    );
    let spread_table = !matches!(gsz, 1 | 2 | 4 | 8);
    let mut buf = [0u8; QUANT_SIMD_MAX_R + CODE_SLACK];
    let mut spread = [0u8; QUANT_SIMD_MAX_R / 8];
    let ones = _mm512_set1_epi8(1);
    let mut qv = [[_mm512_setzero_si512(); 2]; N];
    if W > 0 {
        for (j, row) in qv.iter_mut().enumerate() {
            for (w, x) in row.iter_mut().enumerate().take(W) {
                *x = _mm512_loadu_si512(q.add(j * qs + 64 * w) as *const __m512i);
            }
        }
    }
    let inv = _mm256_set1_pd(inv_sqrt_d);
    let half =
        |v: __m512i| _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v));
    // A record's exact sums `I_c`, `I_k` per head (16 lanes each) and its f16 minimum and
    // scale (widened).
    macro_rules! sums {
        ($t:expr) => {{
            let t = $t;
            let rec = &bytes[t * rb..(t + 1) * rb];
            let codes = if int8 {
                rec[vo..].as_ptr()
            } else {
                // (zeroes the slack past r, so a 64-byte load at any offset up to r reads zeros)
                unpack_codes(layout.dtype, &rec[vo..], r, &mut buf);
                buf.as_ptr()
            };
            if spread_table {
                spread = [0u8; QUANT_SIMD_MAX_R / 8];
                spread_groups(rec, layout, &mut spread);
            }
            let mut ac = [_mm512_setzero_si512(); N];
            let mut ak = [_mm512_setzero_si512(); N];
            let mut off = 0usize;
            for w in 0..words {
                let mask = dim_word(gsz, bb, rec, &spread, w);
                let lanes = lanes64(r - off);
                let src = if int8 {
                    // masked: no byte past the record's r codes is read
                    _mm512_maskz_loadu_epi8(lanes, codes.add(off) as *const i8)
                } else {
                    _mm512_loadu_si512(codes.add(off) as *const __m512i)
                };
                let placed = _mm512_maskz_expand_epi8(mask, src);
                // the dims of the record's first r codes (all of a valid record's kept dims)
                let kept = _mm512_maskz_mov_epi8(_pdep_u64(lanes, mask), ones);
                off = (off + mask.count_ones() as usize).min(r);
                for j in 0..N {
                    let qj = if W > 0 {
                        qv[j][w]
                    } else {
                        _mm512_loadu_si512(q.add(j * qs + 64 * w) as *const __m512i)
                    };
                    ac[j] = _mm512_dpbusd_epi32(ac[j], placed, qj);
                    ak[j] = _mm512_dpbusd_epi32(ak[j], kept, qj);
                }
            }
            let o = bb;
            let ms = u32::from_le_bytes([rec[o], rec[o + 1], rec[o + 2], rec[o + 3]]);
            (ac, ak, _mm_cvtph_ps(_mm_cvtsi32_si128(ms as i32)))
        }};
    }
    let mut t = 0;
    if N <= 4 {
        // Two records at a time: their 16 sums (4 heads x I_c, I_k x 2 records, heads past N
        // zero) reduced together by a transposition tree, and one 8-lane f64 epilogue.
        let z = _mm512_setzero_si512();
        let sq8 = _mm512_castpd256_pd512(_mm256_loadu_pd(sq.as_ptr()));
        let sq8 = _mm512_insertf64x4::<1>(sq8, _mm256_loadu_pd(sq.as_ptr()));
        let inv8 = _mm512_set1_pd(inv_sqrt_d);
        while t + 2 <= n {
            let (ac0, ak0, ms0) = sums!(t);
            let (ac1, ak1, ms1) = sums!(t + 1);
            let pad = |v: &[__m512i; N]| {
                std::array::from_fn::<__m512i, 4, _>(|j| if j < N { v[j] } else { z })
            };
            let (a, b, c, d) = (pad(&ac0), pad(&ak0), pad(&ac1), pad(&ak1));
            // [x0+x2, y0+y2, x1+x3, y1+y3] per 128-bit lane
            let u = |x: __m512i, y: __m512i| {
                _mm512_add_epi32(_mm512_unpacklo_epi32(x, y), _mm512_unpackhi_epi32(x, y))
            };
            // [x, y, z, w] partial sums per 128-bit lane
            let v = |u0: __m512i, u1: __m512i| {
                _mm512_add_epi32(_mm512_unpacklo_epi64(u0, u1), _mm512_unpackhi_epi64(u0, u1))
            };
            let va = v(u(a[0], a[1]), u(a[2], a[3]));
            let vb = v(u(b[0], b[1]), u(b[2], b[3]));
            let vc = v(u(c[0], c[1]), u(c[2], c[3]));
            let vd = v(u(d[0], d[1]), u(d[2], d[3]));
            // sums over the four 128-bit lanes: [va, vb, vc, vd] totals, one per lane
            let w = |x: __m512i, y: __m512i| {
                _mm512_add_epi32(
                    _mm512_shuffle_i32x4::<0b10_00_10_00>(x, y),
                    _mm512_shuffle_i32x4::<0b11_01_11_01>(x, y),
                )
            };
            let f = w(w(va, vb), w(vc, vd));
            // [I_c record 0, I_c record 1] and [I_k record 0, I_k record 1], four heads each
            let ic = _mm512_castsi512_si256(_mm512_shuffle_i32x4::<0b00_00_10_00>(f, f));
            let ik = _mm512_castsi512_si256(_mm512_shuffle_i32x4::<0b00_00_11_01>(f, f));
            let both = |x0: f32, x1: f32| {
                _mm512_insertf64x4::<1>(
                    _mm512_castpd256_pd512(_mm256_set1_pd(f64::from(x0))),
                    _mm256_set1_pd(f64::from(x1)),
                )
            };
            let m8 = both(_mm_cvtss_f32(ms0), _mm_cvtss_f32(ms1));
            let s8 = both(
                _mm_cvtss_f32(_mm_movehdup_ps(ms0)),
                _mm_cvtss_f32(_mm_movehdup_ps(ms1)),
            );
            // s * I_c + m * I_k (exact products, one rounding), times s_q, times 1/sqrt(D)
            let sum = _mm512_fmadd_pd(
                s8,
                _mm512_cvtepi32_pd(ic),
                _mm512_mul_pd(m8, _mm512_cvtepi32_pd(ik)),
            );
            let zs = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_mul_pd(sq8, sum), inv8));
            let mut lanes8 = [0f32; 8];
            _mm256_storeu_ps(lanes8.as_mut_ptr(), zs);
            for j in 0..N {
                *out.add(j * TILE + t) = lanes8[j];
                *out.add(j * TILE + t + 1) = lanes8[4 + j];
            }
            t += 2;
        }
    }
    while t < n {
        let (ac, ak, ms) = sums!(t);
        let mut lanes4 = [0f32; 8];
        for (k, chunk) in lanes4.chunks_exact_mut(4).enumerate().take(N.div_ceil(4)) {
            let (mut hc, mut hk) = ([_mm256_setzero_si256(); 4], [_mm256_setzero_si256(); 4]);
            for j in 4 * k..N.min(4 * k + 4) {
                hc[j - 4 * k] = half(ac[j]);
                hk[j - 4 * k] = half(ak[j]);
            }
            let (ic, ik) = (
                crate::simd::avx2::hsum4_i32(&hc),
                crate::simd::avx2::hsum4_i32(&hk),
            );
            let sqv = _mm256_loadu_pd(sq.as_ptr().add(4 * k));
            let z = crate::simd::avx2::quant::logit_epilogue(ic, ik, ms, sqv, inv);
            _mm_storeu_ps(chunk.as_mut_ptr(), z);
        }
        for (j, &x) in lanes4.iter().enumerate().take(N) {
            *out.add(j * TILE + t) = x;
        }
        t += 1;
    }
}
