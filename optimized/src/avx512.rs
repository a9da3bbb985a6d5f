//! AVX-512 (F, BW, VL, VBMI2, VNNI) versions of the kernels where it pays on
//! the machine we measured (AMD Zen 4, which runs 512-bit arithmetic on
//! 256-bit units): bitmap expansion, MosaicKV's block scores and Quest's page
//! scores. Every other kernel of [`crate::simd::Path::Avx512`] is the AVX2
//! one; 16-lane tile logits / accumulation were written, measured with the
//! `kernel_cost` tool (docs/PERFORMANCE.md) no faster for f32 tiles and
//! 10-20 % slower for f16 rows, and removed.
//!
//! What changes against AVX2:
//! - Expansion (SPEC.md section 6, g = 1): one `vpexpandw` per 32 dims places
//!   the packed f16 values at the set bits of the bitmap, instead of one
//!   table-driven `pshufb` per 8 dims.
//! - Block scores (SPEC.md section 8.2, exact integers): `vpdpbusd` sums four
//!   u8 x i8 products per i32 lane in one instruction, where AVX2 needs
//!   `vpmaddubsw` + `vpmaddwd` + `vpaddd`; same integers, same f64 products.
//! - Quest's page scores (SPEC.md section 12, f32): `max(q M, q m) = q+ M +
//!   q- m` for `M >= m` (`q+ = max(q, 0)`, `q- = min(q, 0)`), two FMAs per lane
//!   instead of mul, mul, max, add, 4 pages per pass; the same bound, only the
//!   rounding differs (FMA, 16-lane sums).
//!
//! Callers check [`crate::simd::avx512_available`] before calling anything here.

use half::f16;
use std::arch::x86_64::*;

/// Widest `Dt` the score kernels keep `q+` / `q-` for on the stack (callers fall back above it).
pub const SCORE_MAX_DT: usize = 256;

/// Lane mask of the first `n` of 16 lanes.
#[inline(always)]
fn lanes16(n: usize) -> u16 {
    if n >= 16 {
        u16::MAX
    } else {
        (1u16 << n) - 1
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
    let groups = dt.div_ceil(32);
    if r <= 32 && dp == 32 * groups {
        // All values fit one register: one load per record, independent of the bitmap; group
        // c's values are lanes off_c.. of it (`vpermw` by iota + off_c), so no load address
        // waits for a popcount.
        let iota = _mm512_set_epi16(
            31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10,
            9, 8, 7, 6, 5, 4, 3, 2, 1, 0,
        );
        let lr = if r >= 32 { u32::MAX } else { (1u32 << r) - 1 };
        for t in 0..n {
            let rec = bytes.add(t * rb);
            let row = out.add(t * dp);
            let vall = _mm512_maskz_loadu_epi16(lr, rec.add(bb) as *const i16);
            let mut off = 0i16;
            for c in 0..groups {
                let mask = u32::from_le((rec.add(4 * c) as *const u32).read_unaligned());
                let idx = _mm512_add_epi16(iota, _mm512_set1_epi16(off));
                let e = _mm512_maskz_expand_epi16(mask, _mm512_permutexvar_epi16(idx, vall));
                _mm512_storeu_ps(row.add(32 * c), _mm512_cvtph_ps(_mm512_castsi512_si256(e)));
                _mm512_storeu_ps(
                    row.add(32 * c + 16),
                    _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(e)),
                );
                off += mask.count_ones() as i16;
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

/// The four horizontal sums of `a[0..4]`, as one xmm `[sum a0, sum a1, sum a2, sum a3]`
/// (about 13 shuffles and adds instead of 4 separate reductions of ~8 each).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn hsum4(a: &[__m512]) -> __m128 {
    let t0 = _mm512_add_ps(
        _mm512_unpacklo_ps(a[0], a[1]),
        _mm512_unpackhi_ps(a[0], a[1]),
    );
    let t1 = _mm512_add_ps(
        _mm512_unpacklo_ps(a[2], a[3]),
        _mm512_unpackhi_ps(a[2], a[3]),
    );
    let u = _mm512_add_ps(
        _mm512_shuffle_ps::<0x44>(t0, t1),
        _mm512_shuffle_ps::<0xEE>(t0, t1),
    );
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(u)));
    let v = _mm256_add_ps(_mm512_castps512_ps256(u), hi);
    _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v))
}

/// Horizontal sums of `N` accumulators into `out[..N]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn hsums<const N: usize>(a: &[__m512; N], out: &mut [f32; 4]) {
    if N == 4 {
        _mm_storeu_ps(out.as_mut_ptr(), hsum4(a));
    } else {
        for k in 0..N {
            out[k] = _mm512_reduce_add_ps(a[k]);
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn ld_f16(p: *const f16) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn ldm_f16(p: *const f16, k: u16) -> __m512 {
    _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p as *const i16))
}

macro_rules! score_kernel_512 {
    ($name:ident, $heads:ident, $t:ty, $load:ident, $loadm:ident) => {
        /// Sums of the bound for N heads over B consecutive blocks (`qp`/`qn`:
        /// `[N][SCORE_MAX_DT]`), into `out[b][k]`. B blocks share every load of `q`, so the
        /// loop is bound by the FMAs (2 per dim, head and block), not by loads.
        #[target_feature(
            enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt"
        )]
        #[inline]
        unsafe fn $heads<const N: usize, const B: usize>(
            qp: *const f32,
            qn: *const f32,
            dt: usize,
            mxp: *const $t,
            mnp: *const $t,
            out: &mut [[f32; 4]; 4],
        ) {
            let mut acc = [[_mm512_setzero_ps(); N]; B];
            let d16 = dt / 16 * 16;
            let mut c = 0;
            while c < dt {
                let m = lanes16(dt - c);
                let mut mx = [_mm512_setzero_ps(); B];
                let mut mn = [_mm512_setzero_ps(); B];
                for b in 0..B {
                    if c < d16 {
                        mx[b] = $load(mxp.add(b * dt + c));
                        mn[b] = $load(mnp.add(b * dt + c));
                    } else {
                        mx[b] = $loadm(mxp.add(b * dt + c), m);
                        mn[b] = $loadm(mnp.add(b * dt + c), m);
                    }
                }
                for k in 0..N {
                    let o = k * SCORE_MAX_DT + c;
                    let (pv, nv) = (_mm512_loadu_ps(qp.add(o)), _mm512_loadu_ps(qn.add(o)));
                    for b in 0..B {
                        acc[b][k] = _mm512_fmadd_ps(pv, mx[b], acc[b][k]);
                        acc[b][k] = _mm512_fmadd_ps(nv, mn[b], acc[b][k]);
                    }
                }
                c += 16;
            }
            for b in 0..B {
                hsums::<N>(&acc[b], &mut out[b]);
            }
        }

        /// `out[b] = max_h sum_j (q+_hj max[b][j] + q-_hj min[b][j])` over the `g` query rows
        /// of `q` (`[g][stride]`, first `dt` used), times `scale[b]` when given.
        ///
        /// # Safety
        /// AVX-512 available; `dt <= SCORE_MAX_DT`; `min`/`max` hold `out.len() * dt`
        /// elements, `scale` (if any) `out.len()`; `q` holds `(g - 1) * stride + dt` floats.
        #[target_feature(
            enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt"
        )]
        pub unsafe fn $name(
            q: &[f32],
            g: usize,
            stride: usize,
            dt: usize,
            min: *const $t,
            max: *const $t,
            scale: Option<&[f32]>,
            out: &mut [f32],
        ) {
            let mut qp = [0f32; 4 * SCORE_MAX_DT];
            let mut qn = [0f32; 4 * SCORE_MAX_DT];
            let blocks = out.len();
            let mut h0 = 0;
            while h0 < g {
                let hn = (g - h0).min(4);
                for k in 0..hn {
                    for j in 0..dt {
                        let x = q[(h0 + k) * stride + j];
                        qp[k * SCORE_MAX_DT + j] = x.max(0.0);
                        qn[k * SCORE_MAX_DT + j] = x.min(0.0);
                    }
                }
                let (pp, np) = (qp.as_ptr(), qn.as_ptr());
                let mut b = 0;
                while b < blocks {
                    let nb = if blocks - b >= 4 { 4 } else { 1 };
                    let (mxp, mnp) = (max.add(b * dt), min.add(b * dt));
                    let mut sums = [[0f32; 4]; 4];
                    match (hn, nb) {
                        (1, 4) => $heads::<1, 4>(pp, np, dt, mxp, mnp, &mut sums),
                        (2, 4) => $heads::<2, 4>(pp, np, dt, mxp, mnp, &mut sums),
                        (3, 4) => $heads::<3, 4>(pp, np, dt, mxp, mnp, &mut sums),
                        (4, 4) => $heads::<4, 4>(pp, np, dt, mxp, mnp, &mut sums),
                        (1, _) => $heads::<1, 1>(pp, np, dt, mxp, mnp, &mut sums),
                        (2, _) => $heads::<2, 1>(pp, np, dt, mxp, mnp, &mut sums),
                        (3, _) => $heads::<3, 1>(pp, np, dt, mxp, mnp, &mut sums),
                        _ => $heads::<4, 1>(pp, np, dt, mxp, mnp, &mut sums),
                    }
                    for (i, s) in sums.iter().enumerate().take(nb) {
                        let o = &mut out[b + i];
                        let mut best = if h0 == 0 { s[0] } else { o.max(s[0]) };
                        for &x in &s[1..hn] {
                            best = best.max(x);
                        }
                        *o = best;
                    }
                    b += nb;
                }
                h0 += 4;
            }
            if let Some(scale) = scale {
                for (o, &s) in out.iter_mut().zip(scale) {
                    *o *= s;
                }
            }
        }
    };
}

score_kernel_512!(score_pages_f16, score_heads_f16, f16, ld_f16, ldm_f16);

/// SPEC.md section 8.2 integer block scores (see `simd::portable_score_int`), 32 dims per
/// step with `vpdpbusd` (AVX-512 VNNI on 256-bit registers: 4 u8 x i8 products summed into
/// each i32 lane, exact, no saturation) for `pos . max` and `neg . min`; `W` from `vpabsb`,
/// `vpmaxub`, `vpsadbw`; the last partial chunk of a row is a masked load (nothing past the
/// row is read).
///
/// # Safety
/// AVX-512 (with VNNI) available; `min`/`max` hold `out.len() * dt` bytes; `pos`/`neg` hold
/// N rows of `qstride >= 32 * ceil(dt / 32)` bytes, zero past `dt`.
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
    let zero = _mm256_setzero_si256();
    let (pp, np) = (pos.as_ptr(), neg.as_ptr());
    for (b, o) in out.iter_mut().enumerate() {
        let (mxp, mnp) = (max.as_ptr().add(b * dt), min.as_ptr().add(b * dt));
        let mut hi = [zero; 4];
        let mut lo = [zero; 4];
        let mut wacc = zero;
        let mut c = 0;
        while c < dt {
            let k: u32 = if dt - c >= 32 {
                u32::MAX
            } else {
                (1u32 << (dt - c)) - 1
            };
            let mx = _mm256_maskz_loadu_epi8(k, mxp.add(c));
            let mn = _mm256_maskz_loadu_epi8(k, mnp.add(c));
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
        _mm_storeu_si128(
            sums.as_mut_ptr() as *mut __m128i,
            crate::simd::x86::hsum4_i32(&d),
        );
        *o = crate::simd::combine_scores::<N>(&sums, w, sq, scale[b], first, *o);
    }
}

/// SPEC.md section 8.1's sums for one query: `acc[j] = sum_i f64(R[i][j]) * f64(q[i])` over
/// ascending i (mul then add, no FMA: the reference's values bit for bit), `R` the stored
/// `d x dt` rotation. Four 8-column chunks per pass keep four independent add chains in
/// registers (the AVX2 version reloads its accumulators every row).
///
/// # Safety
/// AVX-512 available; `rot` holds `d * acc.len()` floats, `q` at least `d`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn rotate_query_f64(rot: &[f32], d: usize, q: &[f32], acc: &mut [f64]) {
    let dt = acc.len();
    let mut c = 0;
    while c < dt {
        let mut a = [_mm512_setzero_pd(); 4];
        let mut m = [0u8; 4];
        for (k, mk) in m.iter_mut().enumerate() {
            let lo = c + 8 * k;
            *mk = if lo >= dt {
                0
            } else if dt - lo >= 8 {
                0xff
            } else {
                (1u8 << (dt - lo)) - 1
            };
        }
        for i in 0..d {
            let qv = _mm512_set1_pd(f64::from(*q.get_unchecked(i)));
            let row = rot.as_ptr().add(i * dt + c);
            for k in 0..4 {
                // Masked-off chunks past `dt` read nothing (wrapping_add: the address may lie
                // past the slice, and is never dereferenced there).
                let r = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m[k], row.wrapping_add(8 * k)));
                a[k] = _mm512_add_pd(a[k], _mm512_mul_pd(r, qv));
            }
        }
        for k in 0..4 {
            _mm512_mask_storeu_pd(acc.as_mut_ptr().wrapping_add(c + 8 * k), m[k], a[k]);
        }
        c += 32;
    }
}
