//! Shared helpers of the benchmarks: memory bandwidth, exact f64 attention, statistics.

use ndarray::{Array2, ArrayView2, ArrayView3};
use rayon::prelude::*;
use std::time::Instant;

/// Measured read bandwidth in GB/s (1e9 bytes/s): best of `reps` multi-threaded
/// passes summing a buffer of `bytes` bytes (u64 words, 4 accumulators per thread).
pub fn read_bandwidth_gbps(bytes: usize, reps: usize) -> f64 {
    let n = bytes / 8;
    let buf: Vec<u64> = (0..n as u64)
        .into_par_iter()
        .map(|i| i.wrapping_mul(0x9e37_79b9))
        .collect();
    let mut best = 0f64;
    for _ in 0..reps {
        let t = Instant::now();
        let s: u64 = buf
            .par_chunks(1 << 16)
            .map(|c| {
                let mut a = [0u64; 4];
                for w in c.chunks_exact(4) {
                    for k in 0..4 {
                        a[k] = a[k].wrapping_add(w[k]);
                    }
                }
                a.iter().fold(0u64, |x, y| x.wrapping_add(*y))
            })
            .reduce(|| 0, |a, b| a.wrapping_add(b));
        let dt = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.max(bytes as f64 / dt / 1e9);
    }
    best
}

/// Exact attention in f64 over every token of f32 K/V `[n, kv, d]` for queries `[q_heads, d]`
/// (parallel over query heads), rounded to f32.
pub fn exact_full_attention(
    keys: ArrayView3<f32>,
    values: ArrayView3<f32>,
    q: ArrayView2<f32>,
) -> Array2<f32> {
    let (n, kv, d) = keys.dim();
    let qh = q.nrows();
    let g = qh / kv;
    let rows: Vec<Vec<f32>> = (0..qh)
        .into_par_iter()
        .map(|h| {
            let j = h / g;
            let z: Vec<f64> = (0..n)
                .map(|t| {
                    let k = keys.slice(ndarray::s![t, j, ..]);
                    k.iter()
                        .zip(q.row(h))
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let mut acc = vec![0f64; d];
            let mut s = 0f64;
            for (t, &zt) in z.iter().enumerate() {
                let p = (zt - m).exp();
                s += p;
                for (a, &v) in acc
                    .iter_mut()
                    .zip(values.slice(ndarray::s![t, j, ..]).iter())
                {
                    *a += p * v as f64;
                }
            }
            acc.iter().map(|a| (a / s) as f32).collect()
        })
        .collect();
    Array2::from_shape_fn((qh, d), |(h, i)| rows[h][i])
}

/// `||a - b|| / ||b||` over all elements (0 when both are 0).
pub fn rel_l2(a: ArrayView2<f32>, b: ArrayView2<f32>) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b.iter())
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    if den == 0.0 {
        if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (num / den).sqrt()
    }
}

/// Median of samples (sorted copy).
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    if v.is_empty() {
        return f64::NAN;
    }
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        0.5 * (v[m - 1] + v[m])
    }
}
