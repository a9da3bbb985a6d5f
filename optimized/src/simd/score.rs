//! SPEC.md section 8.2: MosaicKV's block scores, exact integer arithmetic on the int8
//! bounds and the int8-quantized query ([`quantize_query`]), then the f64 combination of
//! `common::combine_scores` (bit-identical on every path).

use super::common::combine_scores;
use super::Path;
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};

impl Path {
    /// SPEC.md section 8.2: `f32(max_h (scale[b] * s_q,h) * (I_hb + W_b / 2))` over the `g`
    /// query rows of `q` (`[g][stride]`, first `dt` entries used), each quantized to int8 by
    /// [`quantize_query`]; `I` and `W` are exact integer sums over the `[blocks][dt]` int8
    /// bounds `min`/`max`, the products f64 in the reference's order: every path, and the
    /// reference, give the same f32 scores.
    #[allow(clippy::too_many_arguments)]
    pub fn score_blocks(
        self,
        q: &[f32],
        g: usize,
        stride: usize,
        dt: usize,
        min: &[i8],
        max: &[i8],
        scale: &[f32],
        out: &mut [f32],
    ) {
        let blocks = out.len();
        assert!(
            min.len() == blocks * dt
                && max.len() == blocks * dt
                && scale.len() == blocks
                && q.len() >= (g - 1) * stride + dt
        );
        if dt > QMAX_DT {
            // Wider than the stack buffers (head_dim > 256): the portable kernel on heap buffers.
            let (mut pos, mut neg) = (vec![0u8; dt], vec![0u8; dt]);
            for h in 0..g {
                let sq = quantize_query(self, &q[h * stride..h * stride + dt], &mut pos, &mut neg);
                portable_score_int::<1>(&pos, &neg, dt, &[sq; 4], dt, min, max, scale, h == 0, out);
            }
        } else {
            let mut pos = [0u8; 4 * QMAX_DT];
            let mut neg = [0u8; 4 * QMAX_DT];
            let mut h0 = 0;
            while h0 < g {
                let hn = (g - h0).min(4);
                let mut sq = [0f64; 4];
                for k in 0..hn {
                    let r = k * QMAX_DT..(k + 1) * QMAX_DT;
                    let qh = &q[(h0 + k) * stride..(h0 + k) * stride + dt];
                    sq[k] = quantize_query(self, qh, &mut pos[r.clone()], &mut neg[r]);
                }
                let first = h0 == 0;
                let (p, n) = (&pos[..], &neg[..]);
                macro_rules! run {
                    ($f:ident) => {
                        match hn {
                            1 => $f::<1>(p, n, QMAX_DT, &sq, dt, min, max, scale, first, out),
                            2 => $f::<2>(p, n, QMAX_DT, &sq, dt, min, max, scale, first, out),
                            3 => $f::<3>(p, n, QMAX_DT, &sq, dt, min, max, scale, first, out),
                            _ => $f::<4>(p, n, QMAX_DT, &sq, dt, min, max, scale, first, out),
                        }
                    };
                }
                match self {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX-512 detected; every slice holds what the kernel reads (asserted
                    // above: `blocks * dt` bounds, `hn` quantized rows of `QMAX_DT >= dt` bytes).
                    Path::Avx512 => unsafe {
                        use avx512::score::score_int;
                        run!(score_int)
                    },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX2 detected; as above.
                    Path::Avx2 => unsafe {
                        use avx2::score::score_int;
                        run!(score_int)
                    },
                    _ => run!(portable_score_int),
                }
                h0 += 4;
            }
        }
    }
}

/// Widest `Dt` whose quantized queries [`Path::score_blocks`] keeps on the stack.
pub const QMAX_DT: usize = 256;

/// `round_ties_even` for `|x| < 2^51`, inline: adding and subtracting 1.5 * 2^52 rounds to an
/// integer in the default rounding mode (nearest, ties to even). The library call it replaces
/// was 1.7 % of a decode step.
#[inline(always)]
fn round_half_even(x: f64) -> f64 {
    const MAGIC: f64 = 6_755_399_441_055_744.0;
    (x + MAGIC) - MAGIC
}

/// SPEC.md section 8.2: quantizes one rotated query `q` (length `Dt`) to int8,
/// `a_j = round_half_even(q_j / s_q)` with `s_q = max_j |q_j| / 127` (f64), clamped to
/// `[-127, 127]`; writes `a_j` as two byte rows, `pos_j = max(a_j, 0)` and
/// `neg_j = max(-a_j, 0)` (zero past `Dt`), and returns `s_q` (0 for a zero query). On a SIMD
/// `path` the loop runs compiled for AVX2: the same operations, so the same values.
pub fn quantize_query(path: Path, q: &[f32], pos: &mut [u8], neg: &mut [u8]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if path.runs_avx2() {
        // SAFETY: a SIMD path: avx2 detected; the body only uses bounds-checked slices.
        return unsafe { quantize_avx2(q, pos, neg) };
    }
    quantize_body(q, pos, neg)
}

/// [`quantize_query`] compiled for AVX2: the same IEEE operations, vectorized (a scalar
/// `cvtss2sd` + `divsd` loop carried a false dependency through its register and was 3.5 %
/// of a decode step).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
unsafe fn quantize_avx2(q: &[f32], pos: &mut [u8], neg: &mut [u8]) -> f64 {
    quantize_body(q, pos, neg)
}

/// SPEC.md section 8.2's int8 query as the signed bytes `a_j` section 9's logits on int8/int4
/// key records multiply ([`Path::key_logits_q8`]): `q` (length `Dt`) into `out[..Dt]`, zero
/// past it; returns `s_q`. The same values as [`quantize_query`]'s `pos - neg`.
pub fn quantize_query_i8(path: Path, q: &[f32], out: &mut [i8]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if path.runs_avx2() {
        // SAFETY: a SIMD path: avx2 detected; the body only uses bounds-checked slices.
        return unsafe { quantize_i8_avx2(q, out) };
    }
    quantize_i8_body(q, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
unsafe fn quantize_i8_avx2(q: &[f32], out: &mut [i8]) -> f64 {
    quantize_i8_body(q, out)
}

#[inline(always)]
fn quantize_i8_body(q: &[f32], out: &mut [i8]) -> f64 {
    out.fill(0);
    let m = q.iter().fold(0f32, |m, &x| m.max(x.abs()));
    if m == 0.0 {
        return 0.0;
    }
    let s = f64::from(m) / 127.0;
    for (&x, o) in q.iter().zip(out.iter_mut()) {
        *o = round_half_even(f64::from(x) / s).clamp(-127.0, 127.0) as i8;
    }
    s
}

#[inline(always)]
fn quantize_body(q: &[f32], pos: &mut [u8], neg: &mut [u8]) -> f64 {
    pos.fill(0);
    neg.fill(0);
    let m = q.iter().fold(0f32, |m, &x| m.max(x.abs()));
    if m == 0.0 {
        return 0.0;
    }
    let s = f64::from(m) / 127.0;
    for ((&x, p), n) in q.iter().zip(pos.iter_mut()).zip(neg.iter_mut()) {
        let a = round_half_even(f64::from(x) / s).clamp(-127.0, 127.0) as i32;
        *p = a.max(0) as u8;
        *n = (-a).max(0) as u8;
    }
    s
}

/// `out[b] = max(out[b], f32(max_h (scale[b] * sq[h]) * (I_hb + W_b / 2)))` (f64 products;
/// `out[b]` overwritten when `first`)
/// for N quantized heads at `pos/neg[h * qstride ..]`: `I_hb = sum_j pos_hj max_bj - neg_hj
/// min_bj` (= `sum_j max(a_j max_bj, a_j min_bj)`), `W_b = sum_j max(|max_bj|, |min_bj|)`.
#[allow(clippy::too_many_arguments)]
fn portable_score_int<const N: usize>(
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
    Path::Portable.ran();
    for (b, o) in out.iter_mut().enumerate() {
        let (mx, mn) = (&max[b * dt..(b + 1) * dt], &min[b * dt..(b + 1) * dt]);
        let w: i32 = mx
            .iter()
            .zip(mn)
            .map(|(&x, &y)| i32::from(x).abs().max(i32::from(y).abs()))
            .sum();
        let sums: [i32; 4] = std::array::from_fn(|h| {
            if h >= N {
                return 0;
            }
            let (p, n) = (&pos[h * qstride..], &neg[h * qstride..]);
            let mut i_sum = 0i32;
            for j in 0..dt {
                i_sum += i32::from(p[j]) * i32::from(mx[j]) - i32::from(n[j]) * i32::from(mn[j]);
            }
            i_sum
        });
        *o = combine_scores::<N>(&sums, w, sq, scale[b], first, *o);
    }
}
