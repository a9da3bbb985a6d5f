//! SPEC.md section 16: quality measures, written once: `fidelity`, the conformance suite and the
//! benches measure every backend with them (measurement, not a backend stage).

use ndarray::{Array2, ArrayView2, ArrayView3};

/// SPEC.md section 16: `||o - o_full||_F / ||o_full||_F` over all query
/// heads, f64; 0 when both are 0, +Inf when only the reference is 0.
/// Panics if the shapes differ (a caller bug, not input data).
pub fn rel_l2(out: ArrayView2<f32>, reference: ArrayView2<f32>) -> f64 {
    assert_eq!(out.shape(), reference.shape(), "rel_l2: shapes differ");
    let mut diff = 0.0f64;
    let mut norm = 0.0f64;
    for (&o, &r) in out.iter().zip(reference.iter()) {
        let e = f64::from(o) - f64::from(r);
        diff += e * e;
        norm += f64::from(r) * f64::from(r);
    }
    if norm == 0.0 {
        if diff == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (diff / norm).sqrt()
    }
}

/// Exact attention probabilities `[q_heads, tokens]`, f64 on the f32 inputs
/// (no f16 rounding): `softmax_t(q_h . k_{t,j} / sqrt(D))`, `j = h / G`.
/// `keys` is `[tokens, kv_heads, D]`, `queries` `[q_heads, D]`.
pub fn full_attention_probs(keys: ArrayView3<f32>, queries: ArrayView2<f32>) -> Array2<f64> {
    let (n, kvh, d) = keys.dim();
    let q_heads = queries.nrows();
    let g = q_heads / kvh;
    let scale = 1.0 / (d as f64).sqrt();
    let mut probs = Array2::<f64>::zeros((q_heads, n));
    for h in 0..q_heads {
        let j = h / g;
        let mut z_max = f64::NEG_INFINITY;
        for t in 0..n {
            let mut s = 0.0;
            for i in 0..d {
                s += f64::from(queries[[h, i]]) * f64::from(keys[[t, j, i]]);
            }
            probs[[h, t]] = s * scale;
            z_max = z_max.max(s * scale);
        }
        let mut denom = 0.0;
        for t in 0..n {
            probs[[h, t]] = (probs[[h, t]] - z_max).exp();
            denom += probs[[h, t]];
        }
        for t in 0..n {
            probs[[h, t]] /= denom;
        }
    }
    probs
}

/// Exact attention output `[q_heads, D]` (f64 on the f32 inputs, rounded to f32).
pub fn full_attention(
    keys: ArrayView3<f32>,
    values: ArrayView3<f32>,
    queries: ArrayView2<f32>,
) -> Array2<f32> {
    let probs = full_attention_probs(keys, queries);
    let (n, kvh, d) = values.dim();
    let g = queries.nrows() / kvh;
    Array2::from_shape_fn((queries.nrows(), d), |(h, i)| {
        let mut o = 0.0;
        for t in 0..n {
            o += probs[[h, t]] * f64::from(values[[t, h / g, i]]);
        }
        o as f32
    })
}

/// SPEC.md section 16: recall@k. For each query head h, the `k` tokens of
/// highest exact probability `probs[h]` (ties: lower token) and the fraction
/// of them in `attended[h]`; the mean over heads. `k` is capped at the token
/// count; `k = 0` or no heads gives 1.0 (nothing to miss).
pub fn recall_at_k(attended: &[Vec<usize>], probs: ArrayView2<f64>, k: usize) -> f64 {
    assert_eq!(
        attended.len(),
        probs.nrows(),
        "recall_at_k: one attended set per query head"
    );
    let k = k.min(probs.ncols());
    if k == 0 || attended.is_empty() {
        return 1.0;
    }
    let mut sum = 0.0;
    for (h, set) in attended.iter().enumerate() {
        let mut order: Vec<usize> = (0..probs.ncols()).collect();
        order.sort_by(|&a, &b| probs[[h, b]].total_cmp(&probs[[h, a]])); // stable: ties keep the lower token
        let mut is_attended = vec![false; probs.ncols()];
        for &t in set {
            if t < is_attended.len() {
                is_attended[t] = true;
            }
        }
        let hits = order[..k].iter().filter(|&&t| is_attended[t]).count();
        sum += hits as f64 / k as f64;
    }
    sum / attended.len() as f64
}
