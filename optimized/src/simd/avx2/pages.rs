//! SPEC.md section 12: Quest's page scores, mul, mul, max, add (bit-identical to portable).

use super::{hsum, load_ph};
use crate::simd::common::f16_bits_to_f32;
use crate::simd::path::Path;
use half::f16;
use std::arch::x86_64::*;

/// Lane sums of the Quest bound for N heads over the first `d8` dims of one block.
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn score_heads_f16<const N: usize>(
    q: *const f32,
    stride: usize,
    d8: usize,
    mxp: *const f16,
    mnp: *const f16,
    out: &mut [f32; 4],
) {
    let mut acc = [_mm256_setzero_ps(); N];
    let mut c = 0;
    while c < d8 {
        let mx = load_ph(mxp.add(c));
        let mn = load_ph(mnp.add(c));
        for k in 0..N {
            let qv = _mm256_loadu_ps(q.add(k * stride + c));
            // mul, mul, max, add (no FMA): bit-identical to the portable path.
            let t = _mm256_max_ps(_mm256_mul_ps(qv, mx), _mm256_mul_ps(qv, mn));
            acc[k] = _mm256_add_ps(acc[k], t);
        }
        c += 8;
    }
    for k in 0..N {
        out[k] = hsum(acc[k]);
    }
}

#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn score_pages_f16(
    q: &[f32],
    g: usize,
    stride: usize,
    dt: usize,
    min: &[f16],
    max: &[f16],
    out: &mut [f32],
) {
    Path::Avx2.ran();
    let d8 = dt / 8 * 8;
    for (b, o) in out.iter_mut().enumerate() {
        let mxp = max.as_ptr().add(b * dt);
        let mnp = min.as_ptr().add(b * dt);
        let mut best = f32::NEG_INFINITY;
        let mut h0 = 0;
        while h0 < g {
            let hn = (g - h0).min(4);
            let mut sums = [0f32; 4];
            let qp = q.as_ptr().add(h0 * stride);
            match hn {
                1 => score_heads_f16::<1>(qp, stride, d8, mxp, mnp, &mut sums),
                2 => score_heads_f16::<2>(qp, stride, d8, mxp, mnp, &mut sums),
                3 => score_heads_f16::<3>(qp, stride, d8, mxp, mnp, &mut sums),
                _ => score_heads_f16::<4>(qp, stride, d8, mxp, mnp, &mut sums),
            }
            for (k, &s0) in sums.iter().enumerate().take(hn) {
                let h = h0 + k;
                let mut s = s0;
                for j in d8..dt {
                    let qj = q[h * stride + j];
                    let x = qj * f16_bits_to_f32((*mxp.add(j)).to_bits());
                    let y = qj * f16_bits_to_f32((*mnp.add(j)).to_bits());
                    s += if x > y { x } else { y };
                }
                if h == 0 || s > best {
                    best = s;
                }
            }
            h0 += 4;
        }
        *o = best;
    }
}
