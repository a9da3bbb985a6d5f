//! SPEC.md section 12: Quest's page scores, `q+ M + q- m` by two FMAs, four pages per pass.

use super::{hsums, lanes16, ld_f16, ldm_f16};
use crate::simd::path::Path;
use half::f16;
use std::arch::x86_64::*;

/// Widest `Dt` the score kernels keep `q+` / `q-` for on the stack (callers fall back above it).
pub const SCORE_MAX_DT: usize = 256;

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
            Path::Avx512.ran();
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
