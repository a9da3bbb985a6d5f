//! The selection filter of `select::top_blocks` (SPEC.md section 8.3), sixteen scores per step.

use super::lanes16;
use crate::simd::path::Path;
use std::arch::x86_64::*;

/// The selection filter of `select::top_blocks`: writes the rank keys (`simd::rank_key`) of
/// the scores whose key is at most `pivot` to `out`, in any order, and returns how many. Sixteen
/// scores per step: the keys' two 32-bit halves (inverted monotone score, index) are compared
/// with the pivot's, the kept lanes compressed and interleaved into 64-bit keys.
///
/// # Safety
/// AVX-512 F available; `out` holds `scores.len() + 16` keys; `scores.len() < 2^32`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn filter_rank_keys(scores: &[f32], pivot: u64, out: *mut u64) -> usize {
    Path::Avx512.ran();
    let n = scores.len();
    let ph = _mm512_set1_epi32((pivot >> 32) as u32 as i32);
    let pl = _mm512_set1_epi32(pivot as u32 as i32);
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let sign = _mm512_set1_epi32(i32::MIN);
    // Little-endian u64 key j = (index_j, inverted_j): dword 2j from `a` (indices), 2j + 1 from
    // `b` (inverted monotone scores, table entries 16..).
    let lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    let hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    let mut idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let mut c = 0;
    let mut i = 0;
    while i < n {
        let m = lanes16(n - i);
        // rank_key: NaN ranks as -inf, -0 as +0 (`+ 0.0`), then the monotone map, inverted.
        let s = _mm512_add_ps(
            _mm512_maskz_loadu_ps(m, scores.as_ptr().add(i)),
            _mm512_setzero_ps(),
        );
        let s = _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(s, s), ninf);
        let b = _mm512_castps_si512(s);
        let mono = _mm512_xor_si512(b, _mm512_or_si512(_mm512_srai_epi32::<31>(b), sign));
        let inv = _mm512_xor_si512(mono, _mm512_set1_epi32(-1));
        let keep = (_mm512_cmplt_epu32_mask(inv, ph)
            | (_mm512_cmpeq_epu32_mask(inv, ph) & _mm512_cmple_epu32_mask(idx, pl)))
            & m;
        let ci = _mm512_maskz_compress_epi32(keep, idx);
        let cs = _mm512_maskz_compress_epi32(keep, inv);
        _mm512_storeu_si512(
            out.add(c) as *mut __m512i,
            _mm512_permutex2var_epi32(ci, lo, cs),
        );
        _mm512_storeu_si512(
            out.add(c + 8) as *mut __m512i,
            _mm512_permutex2var_epi32(ci, hi, cs),
        );
        c += keep.count_ones() as usize;
        idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
        i += 16;
    }
    c
}
