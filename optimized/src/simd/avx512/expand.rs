//! SPEC.md section 6, g = 1: one `vpexpandw` per 32 dims, into f32 rows ([`expand_g1`]) or
//! f16 rows ([`expand_g1_h`]); [`expand_word`] is shared with the fused value accumulation.

use super::lanes16;
use crate::simd::path::Path;
use half::f16;
use std::arch::x86_64::*;

/// A record's `r <= 32` f16 values as one register (lanes past `r` zero). A masked load only
/// when `r < 32` (on Zen 4 a masked 512-bit load costs more than a plain one even with every
/// lane enabled: a 16-lane tile-logits kernel took 11.5 ns per token with masked loads, 10.2
/// with plain ones, in `kernel_cost`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
pub(super) unsafe fn load_values(p: *const u8, r: usize) -> __m512i {
    if r >= 32 {
        _mm512_loadu_si512(p as *const __m512i)
    } else {
        _mm512_maskz_loadu_epi16((1u32 << r) - 1, p as *const i16)
    }
}

/// Expands `n` g = 1 records (`rb` bytes each, bitmap of `bb` bytes, `r` f16 values) to
/// dense rows of `dp` floats at `out + t * dp`. Dims past `dt` come out 0 (their bits are 0 in
/// a valid record). Reads only inside each record's bitmap and values (masked loads).
///
/// # Safety
/// AVX-512 F/BW/VL/VBMI2 available; `bytes` holds `n * rb` bytes; `out` holds `n * dp` floats;
/// `dp >= dt`, `dp <= 32 * ceil(dt / 32)`, `bb + 2 * r <= rb`, `bb >= 4 * ceil(dt / 32)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn expand_g1(
    bytes: *const u8,
    n: usize,
    rb: usize,
    bb: usize,
    r: usize,
    dt: usize,
    dp: usize,
    out: *mut f32,
) {
    Path::Avx512.ran();
    let groups = dt.div_ceil(32);
    if r <= 32 && dp == 32 * groups {
        // All values fit one register: one load per record, independent of the bitmap; group
        // c's values are lanes off_c.. of it (`vpermw` by iota + off_c), so no load address
        // waits for a popcount.
        let iota = iota16();
        for t in 0..n {
            let rec = bytes.add(t * rb);
            let row = out.add(t * dp);
            let vall = load_values(rec.add(bb), r);
            let mut off = 0i16;
            for c in 0..groups {
                let (lo, hi) = expand_word(rec, c, vall, iota, &mut off);
                _mm512_storeu_ps(row.add(32 * c), lo);
                _mm512_storeu_ps(row.add(32 * c + 16), hi);
            }
        }
        return;
    }
    for t in 0..n {
        let rec = bytes.add(t * rb);
        let src = rec.add(bb) as *const i16;
        let row = out.add(t * dp);
        let mut off = 0usize;
        for c in 0..groups {
            // Little-endian u32 bitmap word c: dims 32c .. 32c + 32.
            let mask = u32::from_le((rec.add(4 * c) as *const u32).read_unaligned());
            let avail = r - off;
            let lm = if avail >= 32 {
                u32::MAX
            } else {
                (1u32 << avail) - 1
            };
            let v = _mm512_maskz_loadu_epi16(lm, src.add(off));
            let e = _mm512_maskz_expand_epi16(mask, v);
            let lo = _mm512_cvtph_ps(_mm512_castsi512_si256(e));
            let hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(e));
            let base = 32 * c;
            if base + 32 <= dp {
                _mm512_storeu_ps(row.add(base), lo);
                _mm512_storeu_ps(row.add(base + 16), hi);
            } else {
                _mm512_mask_storeu_ps(row.add(base), lanes16(dp - base), lo);
                if dp > base + 16 {
                    _mm512_mask_storeu_ps(row.add(base + 16), lanes16(dp - base - 16), hi);
                }
            }
            off = (off + mask.count_ones() as usize).min(r);
        }
    }
}

/// [`expand_g1`] into f16 rows of `32 * groups` halves (`r <= 32`, `dp = 32 * groups`): each
/// expanded word is stored as it is, the conversion to f32 left to the loads of
/// [`super::logits::tile_logits`].
///
/// # Safety
/// As [`expand_g1`] with `r <= 32` and `dp = 32 * groups`; `out` holds `n * 32 * groups` halves.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn expand_g1_h(
    bytes: *const u8,
    n: usize,
    rb: usize,
    bb: usize,
    r: usize,
    groups: usize,
    out: *mut f16,
) {
    Path::Avx512.ran();
    let iota = iota16();
    for t in 0..n {
        let rec = bytes.add(t * rb);
        let row = out.add(t * 32 * groups) as *mut __m512i;
        let vall = load_values(rec.add(bb), r);
        let mut off = 0i16;
        for c in 0..groups {
            _mm512_storeu_si512(row.add(c), expand_word_h(rec, c, vall, iota, &mut off));
        }
    }
}

/// One record's values, expanded by bitmap word `c`, as 32 f16 lanes (dims `32c .. 32c + 32`).
/// `vall` holds the record's `r <= 32` values; `off` is the number of values before word `c`
/// and is advanced past it.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn expand_word_h(
    rec: *const u8,
    c: usize,
    vall: __m512i,
    iota: __m512i,
    off: &mut i16,
) -> __m512i {
    let mask = u32::from_le((rec.add(4 * c) as *const u32).read_unaligned());
    // Word 0's values start at lane 0: no permute.
    let src = if c == 0 {
        vall
    } else {
        _mm512_permutexvar_epi16(_mm512_add_epi16(iota, _mm512_set1_epi16(*off)), vall)
    };
    *off += mask.count_ones() as i16;
    _mm512_maskz_expand_epi16(mask, src)
}

/// [`expand_word_h`] widened to two f32 registers (dims `32c .. 32c + 16` and `32c + 16 ..
/// 32c + 32`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
pub(super) unsafe fn expand_word(
    rec: *const u8,
    c: usize,
    vall: __m512i,
    iota: __m512i,
    off: &mut i16,
) -> (__m512, __m512) {
    let e = expand_word_h(rec, c, vall, iota, off);
    (
        _mm512_cvtph_ps(_mm512_castsi512_si256(e)),
        _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(e)),
    )
}

/// Word lanes `0, 1, ..., 31` (the `vpermw` index base of [`expand_word`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
pub(super) fn iota16() -> __m512i {
    _mm512_set_epi16(
        31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9,
        8, 7, 6, 5, 4, 3, 2, 1, 0,
    )
}
