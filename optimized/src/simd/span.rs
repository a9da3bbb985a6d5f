//! The engine's dense attention (its full f16 KV cache, `mosaickv-engine`'s `FullKv`) over one
//! (KV head, token span): per query head the span's max score, the sum of `exp(score - max)`
//! and the exp-weighted sum of values, merged by the caller (flash-decoding). Dispatch and
//! the portable kernel; `avx2/span.rs`.

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::common::span_softmax;
use super::Path;
use half::f16;
use half::slice::HalfFloatSliceExt;

/// The partial of one span: per query head the max score, the sum of `exp(score - max)`
/// (`[group]` each), and the exp-weighted sum of values (`[group][d]`).
pub type SpanPartial = (Vec<f32>, Vec<f32>, Vec<f32>);

impl Path {
    /// One (KV head, token span) of dense attention: `keys`/`values` the span's f16 rows
    /// (`d` each), `qg` the group's `group` queries (`[group][d]`, already scaled by
    /// `1 / sqrt(d)`). The AVX2/FMA/F16C kernel on either SIMD path where `d % 8 == 0` and
    /// `d <= 256`, the portable one otherwise.
    pub fn span_partial(
        self,
        keys: &[f16],
        values: &[f16],
        qg: &[f32],
        group: usize,
        d: usize,
    ) -> SpanPartial {
        #[cfg(target_arch = "x86_64")]
        if self != Path::Portable && d % 8 == 0 && d <= 256 {
            // SAFETY: a SIMD path means avx2, fma and f16c were detected; the kernel asserts
            // the slice lengths and d.
            return unsafe { avx2::span::span_partial(keys, values, qg, group, d) };
        }
        Path::Portable.ran();
        span_partial_portable(keys, values, qg, group, d)
    }
}

/// [`Path::span_partial`], portable: per query head of the group, the span's
/// max score, sum of `exp(score - max)` and the exp-weighted sum of values.
/// `keys`/`values`: the span's rows (`head_dim` each), `qg`: the group's scaled queries.
#[inline(always)]
fn span_partial_portable(
    keys: &[f16],
    values: &[f16],
    qg: &[f32],
    group: usize,
    d: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let m = keys.len() / d;
    let mut buf = vec![0f32; m * d];
    keys.convert_to_f32_slice(&mut buf);
    let mut scores = vec![0f32; group * m];
    for (i, krow) in buf.chunks_exact(d).enumerate() {
        for g in 0..group {
            scores[g * m + i] = dot(&qg[g * d..(g + 1) * d], krow);
        }
    }
    let (mx, sum) = span_softmax(&mut scores, group, m);
    values.convert_to_f32_slice(&mut buf);
    let mut acc = vec![0f32; group * d];
    for (i, vrow) in buf.chunks_exact(d).enumerate() {
        for g in 0..group {
            let p = scores[g * m + i];
            for (a, &v) in acc[g * d..(g + 1) * d].iter_mut().zip(vrow) {
                *a += p * v;
            }
        }
    }
    (mx, sum, acc)
}

/// Dot product with 8 independent accumulators (vectorizes well).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, ra) = a.split_at(a.len() / 8 * 8);
    let (cb, rb) = b.split_at(ca.len());
    for (x, y) in ca.chunks_exact(8).zip(cb.chunks_exact(8)) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SIMD span kernels against the portable one (the oracle) on awkward span lengths,
    /// group sizes and head dims (head dims the AVX2 kernel refuses run the portable one on
    /// every path); reported as skipped where the CPU has no SIMD path.
    #[test]
    fn span_kernels_agree() {
        #[cfg(target_arch = "x86_64")]
        {
            let mut seed = 9u64;
            let mut rnd = || {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
            };
            let cases = [
                (1, 3, 64),
                (7, 1, 8),
                (33, 3, 64),
                (513, 4, 128),
                (100, 2, 24),
                (5, 3, 256),
            ];
            let paths: Vec<Path> = Path::ALL.into_iter().filter(|p| p.runs_here()).collect();
            if paths.len() < 2 {
                eprintln!("span_kernels_agree: no SIMD path on this CPU, skipped");
            }
            for (m, group, d) in cases {
                let k: Vec<f16> = (0..m * d).map(|_| f16::from_f32(3.0 * rnd())).collect();
                let v: Vec<f16> = (0..m * d).map(|_| f16::from_f32(rnd())).collect();
                let q: Vec<f32> = (0..group * d).map(|_| rnd()).collect();
                let want = Path::Portable.span_partial(&k, &v, &q, group, d);
                for &path in &paths[1..] {
                    let got = path.span_partial(&k, &v, &q, group, d);
                    let close = |a: &[f32], b: &[f32]| {
                        a.len() == b.len()
                            && a.iter()
                                .zip(b)
                                .all(|(x, y)| (x - y).abs() <= 1e-4 * y.abs().max(1.0))
                    };
                    let case = format!("{path:?}, m {m} group {group} d {d}");
                    assert!(close(&got.0, &want.0), "max, {case}");
                    assert!(close(&got.1, &want.1), "sum, {case}");
                    assert!(close(&got.2, &want.2), "values, {case}");
                }
            }
        }
    }
}
