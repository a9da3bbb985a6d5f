//! SPEC.md section 8.2: integer block scores by `vpdpbusd`, four blocks per pass.

use crate::simd::avx2::hsum4_i32;
use crate::simd::common::combine_scores;
use crate::simd::path::Path;
use std::arch::x86_64::*;

/// SPEC.md section 8.2 integer block scores (see `simd::portable_score_int`), 32 dims per
/// step with `vpdpbusd` (AVX-512 VNNI on 256-bit registers: 4 u8 x i8 products summed into
/// each i32 lane, exact, no saturation). Blocks go four at a time ([`score_int_x4`]: each
/// query load serves four blocks, the f64 combination runs on four blocks per register);
/// the last `blocks % 4` one at a time. The last partial chunk of a row is a masked load
/// (nothing past the row is read).
///
/// # Safety
/// AVX-512 (with VNNI) available; `min`/`max` hold `out.len() * dt` bytes, `scale`
/// `out.len()` floats; `pos`/`neg` hold N rows of `qstride >= 32 * ceil(dt / 32)` bytes,
/// zero past `dt`; every bound is in `[-127, 127]` (SPEC.md section 7, checked on load).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn score_int<const N: usize>(
    pos: &[u8],
    neg: &[u8],
    qstride: usize,
    sq: &[f64; 4],
    dt: usize,
    min: &[i8],
    max: &[i8],
    scale: &[f32],
    first: bool,
    out: &mut [f32],
) {
    Path::Avx512.ran();
    let quads = out.len() / 4;
    for i in 0..quads {
        let b = 4 * i;
        score_int_x4::<N>(
            pos.as_ptr(),
            neg.as_ptr(),
            qstride,
            sq,
            dt,
            max.as_ptr().add(b * dt),
            min.as_ptr().add(b * dt),
            scale.as_ptr().add(b),
            first,
            out.as_mut_ptr().add(b),
        );
    }
    let b0 = 4 * quads;
    score_int_x1::<N>(
        pos,
        neg,
        qstride,
        sq,
        dt,
        &min[b0 * dt..],
        &max[b0 * dt..],
        &scale[b0..],
        first,
        &mut out[b0..],
    );
}

/// Bounds `max`/`min` of the 32-dim chunk at `c` of a `dt`-wide row (a masked load for the
/// last partial chunk).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn bound_chunk(mxp: *const i8, mnp: *const i8, dt: usize, c: usize) -> (__m256i, __m256i) {
    if dt - c >= 32 {
        (
            _mm256_loadu_si256(mxp.add(c) as *const __m256i),
            _mm256_loadu_si256(mnp.add(c) as *const __m256i),
        )
    } else {
        let k = (1u32 << (dt - c)) - 1;
        (
            _mm256_maskz_loadu_epi8(k, mxp.add(c)),
            _mm256_maskz_loadu_epi8(k, mnp.add(c)),
        )
    }
}

/// Four consecutive blocks of [`score_int`]. `I = sum pos max + sum neg (-min)` in one
/// accumulator per (block, head) (`-min` fits i8: bounds are never -128); `W` by `vpdpbusd`
/// of `max(|max|, |min|)` with ones. The sums are transposed so that each register holds one
/// head's (or W's) four blocks, then `(s_b * s_q) * (I + 0.5 W)` (the FMA is exact: `0.5 W`
/// and the sum are exact in f64), the max over heads and the f32 rounding run on four blocks
/// at once: per lane the scalar combination's operations, so the same bits.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn score_int_x4<const N: usize>(
    pp: *const u8,
    np: *const u8,
    qstride: usize,
    sq: &[f64; 4],
    dt: usize,
    mxp: *const i8,
    mnp: *const i8,
    scale: *const f32,
    first: bool,
    out: *mut f32,
) {
    let zero = _mm256_setzero_si256();
    let ones = _mm256_set1_epi8(1);
    let mut acc = [[zero; N]; 4];
    let mut wacc = [zero; 4];
    let mut c = 0;
    while c < dt {
        let mut mx = [zero; 4];
        let mut nmn = [zero; 4];
        for b in 0..4 {
            let (x, n) = bound_chunk(mxp.add(b * dt), mnp.add(b * dt), dt, c);
            // max(|max|, |min|) = max(max, -min) for min <= max (both >= 0 when both bounds
            // are >= 0, -min when both are <= 0, either when they straddle 0): one signed max
            // instead of two abs and an unsigned max, and the result is >= 0.
            let neg = _mm256_sub_epi8(zero, n);
            let w = _mm256_max_epi8(x, neg);
            wacc[b] = _mm256_dpbusd_epi32(wacc[b], w, ones);
            mx[b] = x;
            nmn[b] = neg;
        }
        for h in 0..N {
            let p = _mm256_loadu_si256(pp.add(h * qstride + c) as *const __m256i);
            let n = _mm256_loadu_si256(np.add(h * qstride + c) as *const __m256i);
            for b in 0..4 {
                acc[b][h] = _mm256_dpbusd_epi32(acc[b][h], p, mx[b]);
                acc[b][h] = _mm256_dpbusd_epi32(acc[b][h], n, nmn[b]);
            }
        }
        c += 32;
    }
    // Lanes are blocks from here on.
    let w = _mm256_cvtepi32_pd(hsum4_i32(&wacc));
    let sb = _mm256_cvtps_pd(_mm_loadu_ps(scale));
    let half = _mm256_set1_pd(0.5);
    let mut best = _mm256_set1_pd(f64::NEG_INFINITY);
    for h in 0..N {
        let i = hsum4_i32(&[acc[0][h], acc[1][h], acc[2][h], acc[3][h]]);
        let t = _mm256_fmadd_pd(half, w, _mm256_cvtepi32_pd(i));
        let v = _mm256_mul_pd(_mm256_mul_pd(sb, _mm256_set1_pd(sq[h])), t);
        best = _mm256_max_pd(best, v);
    }
    let v = _mm256_cvtpd_ps(best);
    let v = if first {
        v
    } else {
        _mm_max_ps(_mm_loadu_ps(out), v)
    };
    _mm_storeu_ps(out, v);
}

/// One block at a time (the last `blocks % 4` of [`score_int`]).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
unsafe fn score_int_x1<const N: usize>(
    pos: &[u8],
    neg: &[u8],
    qstride: usize,
    sq: &[f64; 4],
    dt: usize,
    min: &[i8],
    max: &[i8],
    scale: &[f32],
    first: bool,
    out: &mut [f32],
) {
    let zero = _mm256_setzero_si256();
    let (pp, np) = (pos.as_ptr(), neg.as_ptr());
    for (b, o) in out.iter_mut().enumerate() {
        let (mxp, mnp) = (max.as_ptr().add(b * dt), min.as_ptr().add(b * dt));
        let mut hi = [zero; 4];
        let mut lo = [zero; 4];
        let mut wacc = zero;
        let mut c = 0;
        while c < dt {
            let (mx, mn) = bound_chunk(mxp, mnp, dt, c);
            let w = _mm256_max_epu8(_mm256_abs_epi8(mx), _mm256_abs_epi8(mn));
            wacc = _mm256_add_epi64(wacc, _mm256_sad_epu8(w, zero));
            for h in 0..N {
                let p = _mm256_loadu_si256(pp.add(h * qstride + c) as *const __m256i);
                let n = _mm256_loadu_si256(np.add(h * qstride + c) as *const __m256i);
                hi[h] = _mm256_dpbusd_epi32(hi[h], p, mx);
                lo[h] = _mm256_dpbusd_epi32(lo[h], n, mn);
            }
            c += 32;
        }
        let ws = _mm_add_epi64(
            _mm256_castsi256_si128(wacc),
            _mm256_extracti128_si256::<1>(wacc),
        );
        let w = (_mm_cvtsi128_si64(ws) + _mm_extract_epi64::<1>(ws)) as i32;
        let mut d = [zero; 4];
        for h in 0..N {
            d[h] = _mm256_sub_epi32(hi[h], lo[h]);
        }
        let mut sums = [0i32; 4];
        _mm_storeu_si128(sums.as_mut_ptr() as *mut __m128i, hsum4_i32(&d));
        *o = combine_scores::<N>(&sums, w, sq, scale[b], first, *o);
    }
}
