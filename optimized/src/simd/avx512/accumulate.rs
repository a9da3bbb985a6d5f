//! SPEC.md section 9, value side: f16 rows read in order ([`tile_accumulate_f16`]) and the
//! fused expansion + accumulation of packed value records ([`packed_accumulate`]).

use super::expand::{expand_word, iota16, load_values};
use super::{lanes16, ld_f16, ldm_f16};
use crate::simd::common::TILE;
use crate::simd::path::Path;
use half::f16;
use std::arch::x86_64::*;

/// N heads of [`tile_accumulate_f16`]: `N x ceil(dp / 16)` accumulators in registers, rows in
/// order, each row converted once per pass.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn tile_accumulate_f16_pass<const N: usize, const C: usize>(
    p: *const f32,
    dp: usize,
    rows: *const f16,
    stride: usize,
    n: usize,
    acc: *mut f32,
) {
    let mut m = [u16::MAX; C];
    for (c, x) in m.iter_mut().enumerate() {
        *x = lanes16(dp.saturating_sub(16 * c));
    }
    let mut a = [[_mm512_setzero_ps(); C]; N];
    for (h, ah) in a.iter_mut().enumerate() {
        for (c, x) in ah.iter_mut().enumerate() {
            *x = _mm512_maskz_loadu_ps(m[c], acc.add(h * dp + 16 * c));
        }
    }
    for t in 0..n {
        let row = rows.add(t * stride);
        let mut pv = [_mm512_setzero_ps(); N];
        for (h, x) in pv.iter_mut().enumerate() {
            *x = _mm512_set1_ps(*p.add(h * TILE + t));
        }
        for c in 0..C {
            let v = if m[c] == u16::MAX {
                ld_f16(row.add(16 * c))
            } else {
                ldm_f16(row.add(16 * c), m[c])
            };
            for h in 0..N {
                a[h][c] = _mm512_fmadd_ps(pv[h], v, a[h][c]);
            }
        }
    }
    for (h, ah) in a.iter().enumerate() {
        for (c, &x) in ah.iter().enumerate() {
            _mm512_mask_storeu_ps(acc.add(h * dp + 16 * c), m[c], x);
        }
    }
}

/// `acc_h += sum_t p[h * TILE + t] row_t` for `g` heads over `n <= TILE` f16 rows at `rows + t *
/// stride` (`dp <= 128` elements each): the rows are read in order (row by row, not column
/// chunk by column chunk across the tile), heads in passes that keep every accumulator in
/// registers. Per lane the same FMAs in the same order as the AVX2 kernel: the same bits.
///
/// # Safety
/// AVX-512 available; `dp <= 128`; `p` holds `g * TILE` floats, `acc` `g * dp`; row `t < n`
/// holds `dp` elements at `rows + t * stride`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn tile_accumulate_f16(
    p: *const f32,
    g: usize,
    dp: usize,
    rows: *const f16,
    stride: usize,
    n: usize,
    acc: *mut f32,
) {
    Path::Avx512.ran();
    // One pass of up to N heads with C chunks (N * C <= 24 accumulators); evaluates to N.
    macro_rules! pass {
        ($C:literal, $N:literal, $pp:expr, $ap:expr, $left:expr) => {{
            match $left.min($N) {
                1 => tile_accumulate_f16_pass::<1, $C>($pp, dp, rows, stride, n, $ap),
                2 => tile_accumulate_f16_pass::<2, $C>($pp, dp, rows, stride, n, $ap),
                3 => tile_accumulate_f16_pass::<3, $C>($pp, dp, rows, stride, n, $ap),
                _ => tile_accumulate_f16_pass::<4, $C>($pp, dp, rows, stride, n, $ap),
            }
            $N
        }};
    }
    let chunks = dp.div_ceil(16);
    let mut h0 = 0;
    while h0 < g {
        let (pp, ap) = (p.add(h0 * TILE), acc.add(h0 * dp));
        h0 += match chunks {
            0 | 1 => pass!(1, 4, pp, ap, g - h0),
            2 => pass!(2, 4, pp, ap, g - h0),
            3 => pass!(3, 4, pp, ap, g - h0),
            4 => pass!(4, 4, pp, ap, g - h0),
            5 => pass!(5, 4, pp, ap, g - h0),
            6 => pass!(6, 4, pp, ap, g - h0),
            7 => pass!(7, 3, pp, ap, g - h0),
            _ => pass!(8, 3, pp, ap, g - h0),
        };
    }
}

/// Largest number of 32-dim bitmap words [`packed_accumulate`] handles (`Dt <= 128`).
pub const FUSED_MAX_GROUPS: usize = 4;

/// Lane masks of the 16-float chunks `0 .. 2G` of a `dp`-wide row (chunks past `dp` get 0).
#[inline(always)]
fn chunk_masks<const G: usize>(dp: usize) -> [u16; 8] {
    let mut m = [0u16; 8];
    for (c, x) in m.iter_mut().enumerate().take(2 * G) {
        *x = lanes16(dp.saturating_sub(16 * c));
    }
    m
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[allow(clippy::too_many_arguments)]
unsafe fn packed_accumulate_n<const G: usize, const N: usize>(
    p: *const f32,
    dp: usize,
    bytes: *const u8,
    n: usize,
    rb: usize,
    bb: usize,
    r: usize,
    corr: *const f32,
    acc: *mut f32,
) {
    let iota = iota16();
    let cm = chunk_masks::<G>(dp);
    // The accumulators stay in registers for the whole tile (N * 2G of them), rescaled on load.
    let mut a = [[_mm512_setzero_ps(); 8]; N];
    for (h, ah) in a.iter_mut().enumerate() {
        let cv = _mm512_set1_ps(*corr.add(h));
        for (c, x) in ah.iter_mut().enumerate().take(2 * G) {
            *x = _mm512_mul_ps(_mm512_maskz_loadu_ps(cm[c], acc.add(h * dp + 16 * c)), cv);
        }
    }
    for t in 0..n {
        let rec = bytes.add(t * rb);
        let vall = load_values(rec.add(bb), r);
        let mut off = 0i16;
        for c in 0..G {
            let (lo, hi) = expand_word(rec, c, vall, iota, &mut off);
            for (h, ah) in a.iter_mut().enumerate() {
                let pv = _mm512_set1_ps(*p.add(h * TILE + t));
                ah[2 * c] = _mm512_fmadd_ps(pv, lo, ah[2 * c]);
                ah[2 * c + 1] = _mm512_fmadd_ps(pv, hi, ah[2 * c + 1]);
            }
        }
    }
    for (h, ah) in a.iter().enumerate() {
        for (c, &x) in ah.iter().enumerate().take(2 * G) {
            _mm512_mask_storeu_ps(acc.add(h * dp + 16 * c), cm[c], x);
        }
    }
}

/// Fused expansion + value accumulation (SPEC.md sections 6 and 9): `acc_h = corr[h] acc_h +
/// sum_t p[h * TILE + t] v_t` for `g` heads (`acc` `[g][dp]`), the values expanded in
/// registers. Per lane the same multiply and FMAs in the same order as the online-softmax
/// rescale, [`super::expand::expand_g1`] and the AVX2 tile accumulation, so the result is
/// bit-identical.
///
/// # Safety
/// AVX-512 F/BW/VL/VBMI2 available; `groups = ceil(dt / 32)` with `1 <= groups <=
/// FUSED_MAX_GROUPS`, `r <= 32`, `dt <= dp <= 32 * groups`, `bb >= 4 * groups`, `bb + 2 * r <=
/// rb`; `bytes` holds `n * rb` bytes, `p` `g * TILE` floats, `corr` `g`, `acc` `g * dp`;
/// `n <= TILE`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn packed_accumulate(
    p: *const f32,
    g: usize,
    dp: usize,
    groups: usize,
    bytes: *const u8,
    n: usize,
    rb: usize,
    bb: usize,
    r: usize,
    corr: *const f32,
    acc: *mut f32,
) {
    Path::Avx512.ran();
    // Heads per pass: the accumulators (heads x 2G registers) plus one expanded word must fit
    // the 32 vector registers; wider rows take fewer heads per pass (and expand again).
    macro_rules! heads {
        ($G:literal, $N:literal, $pp:expr, $cp:expr, $ap:expr, $left:expr) => {
            match $left.min($N) {
                1 => packed_accumulate_n::<$G, 1>($pp, dp, bytes, n, rb, bb, r, $cp, $ap),
                2 => packed_accumulate_n::<$G, 2>($pp, dp, bytes, n, rb, bb, r, $cp, $ap),
                3 => packed_accumulate_n::<$G, 3>($pp, dp, bytes, n, rb, bb, r, $cp, $ap),
                _ => packed_accumulate_n::<$G, 4>($pp, dp, bytes, n, rb, bb, r, $cp, $ap),
            }
        };
    }
    let per = if groups <= 3 { 4 } else { 3 };
    let mut h0 = 0;
    while h0 < g {
        let (pp, cp, ap) = (p.add(h0 * TILE), corr.add(h0), acc.add(h0 * dp));
        match groups {
            1 => heads!(1, 4, pp, cp, ap, g - h0),
            2 => heads!(2, 4, pp, cp, ap, g - h0),
            3 => heads!(3, 4, pp, cp, ap, g - h0),
            _ => heads!(4, 3, pp, cp, ap, g - h0),
        }
        h0 += per;
    }
}
