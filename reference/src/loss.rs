//! SPEC.md section 11.1 (attention loss): the error attention will see in a
//! reconstruction, as opposed to the energy a strategy drops.
//!
//! Every function takes the original rows and their reconstruction as the
//! cache stores them (decoded, rotated back to the model basis), so whatever
//! the encoding loses (dropped channels, truncation, f16 or coarser rounding)
//! is counted. f64 throughout, sums in ascending order.

use crate::packed::{decode_rows, encode_rows};
use mosaickv_spec::query::LossContext;
use mosaickv_spec::{MosaicError, Result, SideStrategy};
use ndarray::ArrayView2;

/// The row as attention reads it, in the model basis: `x^_i = sum_{j<Dt}
/// R[i][j] k^_j`, f64, ascending j (`rotation` row-major `D x Dt`, `decoded`
/// the dense rotated row of section 6, zeros where not kept).
pub fn reconstruct(decoded: &[f32], rotation: &[half::f16]) -> Vec<f64> {
    let dt = decoded.len();
    let d = rotation.len() / dt.max(1);
    (0..d)
        .map(|i| {
            let mut s = 0f64;
            for j in 0..dt {
                s += rotation[i * dt + j].to_f64() * f64::from(decoded[j]);
            }
            s
        })
        .collect()
}

/// `e^T M e = sum_a e_a (sum_b M_ab e_b)`, ascending a and b (`M` row-major `D x D`).
pub fn quadratic(m: &[f64], e: &[f64]) -> f64 {
    let d = e.len();
    let mut s = 0f64;
    for a in 0..d {
        let mut row = 0f64;
        for b in 0..d {
            row += m[a * d + b] * e[b];
        }
        s += e[a] * row;
    }
    s
}

/// Per-row errors `e_t = x_t - x^_t` of rows `[n, D]` under `side`: encoded
/// (section 5-6), decoded and rotated back.
pub fn errors(rows: ArrayView2<f32>, side: &SideStrategy) -> Result<Vec<Vec<f64>>> {
    let packed = encode_rows(rows, side)?;
    let decoded = decode_rows(&packed, side)?;
    Ok(rows
        .rows()
        .into_iter()
        .zip(decoded.rows())
        .map(|(x, k)| {
            let k: Vec<f32> = k.iter().copied().collect();
            let xr = reconstruct(&k, &side.rotation);
            x.iter().zip(&xr).map(|(&a, &b)| f64::from(a) - b).collect()
        })
        .collect())
}

/// The segment's token weights `(w_t, u_t)` (SPEC.md section 11.1.1) from the
/// statistics; `ShapeMismatch` when they do not cover the segment's tokens.
pub fn segment_weights(ctx: &LossContext<'_>) -> Result<(Vec<f64>, Vec<f64>)> {
    ctx.stats
        .weights(ctx.head, ctx.start, ctx.len)
        .ok_or_else(|| MosaicError::ShapeMismatch {
            what: "query stats",
            expected: format!("weights for tokens {}..{}", ctx.start, ctx.start + ctx.len),
            got: format!("{} tokens", ctx.stats.tokens()),
        })
}

/// SPEC.md section 11.1.1, keys: `L_K = sum_t w_t (e_t^T M e_t) / (D sum_t
/// w_t)`, the squared logit error in softmax units: `E_q[(q.e_t)^2] / D` is
/// the mean squared error of the logit `q.k_t / sqrt(D)`, weighted by how much
/// attention token t gets (`w_t`, the mean prompt attention weight) over the
/// segment's errors `[n][D]`, with `M` the KV head's query second moment.
/// Sums over rows in order; 0 when `sum_t w_t` is 0.
pub fn key_loss(errors: &[Vec<f64>], moment: &[f64], weights: &[f64]) -> f64 {
    let d = errors.first().map_or(0, |e| e.len());
    let mut num = 0f64;
    let mut den = 0f64;
    for (e, &w) in errors.iter().zip(weights) {
        num += w * quadratic(moment, e);
        den += w;
    }
    if den == 0.0 {
        0.0
    } else {
        num / (d as f64 * den)
    }
}

/// SPEC.md section 11.1.1, values: `L_V = ||sum_t w_t e_t||^2 / O^2`, the
/// squared error the mean attention weights make of the segment's value
/// errors, relative to the mean squared output norm `O^2` of the KV head
/// (`se_i = sum_t w_t e_ti` over rows in order, then `sum_i se_i^2`). 0 when
/// `O^2 = 0`.
pub fn value_loss(errors: &[Vec<f64>], weights: &[f64], output_sq: f64) -> f64 {
    let d = errors.first().map_or(0, |e| e.len());
    let mut se = vec![0f64; d];
    for (e, &w) in errors.iter().zip(weights) {
        for i in 0..d {
            se[i] += w * e[i];
        }
    }
    let mut num = 0f64;
    for &v in &se {
        num += v * v;
    }
    if output_sq == 0.0 {
        0.0
    } else {
        num / output_sq
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::fit_side_with;
    use mosaickv_spec::{CompressConfig, LossPolicy, QueryStats, Side};
    use ndarray::Array2;

    #[test]
    fn quadratic_form_and_reconstruction() {
        let m = [2.0, 1.0, 1.0, 3.0];
        assert_eq!(quadratic(&m, &[1.0, -1.0]), 2.0 - 1.0 - 1.0 + 3.0);
        // R = [[0, 1], [1, 0]] stored D x Dt with Dt = 2: x^ = (k_1, k_0).
        let h =
            |v: &[f32]| -> Vec<half::f16> { v.iter().map(|&x| half::f16::from_f32(x)).collect() };
        assert_eq!(
            reconstruct(&[3.0, 5.0], &h(&[0.0, 1.0, 1.0, 0.0])),
            vec![5.0, 3.0]
        );
        // Dt = 1 keeps column 0 only: x^ = (0 * k_0, 1 * k_0).
        assert_eq!(reconstruct(&[3.0], &h(&[0.0, 1.0])), vec![0.0, 3.0]);
    }

    #[test]
    fn key_and_value_losses_follow_their_definitions() {
        let e = vec![vec![1.0, 0.0], vec![0.0, 2.0]];
        let m = [4.0, 0.0, 0.0, 1.0];
        // (1 * 4 + 3 * 4) / (2 * (1 + 3))
        assert_eq!(key_loss(&e, &m, &[1.0, 3.0]), 2.0);
        assert_eq!(key_loss(&e, &[0.0; 4], &[1.0, 3.0]), 0.0);
        assert_eq!(key_loss(&e, &m, &[0.0, 0.0]), 0.0);
        // ||(1 * 1, 3 * 2)||^2 / 37 = 1
        assert_eq!(value_loss(&e, &[1.0, 3.0], 37.0), 1.0);
        assert_eq!(value_loss(&e, &[1.0, 3.0], 0.0), 0.0);
    }

    /// Keys whose energy is spread over 8 dims while every query reads only 2 of them:
    /// the energy loss must keep most dims, the attention loss (which sees that the queries
    /// never look at the rest) takes the cheapest candidate that keeps the 2.
    #[test]
    fn queries_that_ignore_directions_make_them_cheap() {
        let (n, d) = (64, 8);
        let rows = Array2::from_shape_fn((n, d), |(t, i)| {
            let x = ((t * 7 + i * 13) % 17) as f32 / 17.0 - 0.5;
            if i < 2 {
                x * 4.0
            } else {
                x * (3.0 - i as f32 * 0.25)
            }
        });
        let mut moment = vec![0.0; d * d];
        moment[0] = 1.0;
        moment[d + 1] = 1.0;
        let stats = QueryStats {
            kv_heads: 1,
            head_dim: d,
            key_moment: moment,
            key_weight: vec![1.0; n],
            value_weight: vec![1.0; n],
            output_sq: vec![1.0],
        };
        let ctx = LossContext {
            stats: &stats,
            head: 0,
            start: 0,
            len: n,
        };
        // f16 values: the query weighting alone decides (quantization error would enter both);
        // a strict energy threshold, so that the energy rule needs every dim it can keep
        let mut cfg = CompressConfig {
            block_sizes: vec![16],
            value_dtypes: vec![mosaickv_spec::ValueDtype::F16],
            channels: mosaickv_spec::ChannelPolicy::LossThreshold {
                key_loss: 1e-4,
                value_loss: 1e-4,
                retentions: vec![0.125, 0.25, 0.375, 0.5, 0.625, 0.75],
                group_sizes: vec![1, 2, 4],
            },
            ..CompressConfig::default()
        };
        let energy = fit_side_with(rows.view(), Side::Key, &cfg, Some(ctx)).unwrap();
        cfg.loss = LossPolicy::Attention {
            key_loss: 1e-3,
            value_loss: 1e-3,
        };
        let attention = fit_side_with(rows.view(), Side::Key, &cfg, Some(ctx)).unwrap();
        let without = fit_side_with(rows.view(), Side::Key, &cfg, None).unwrap();
        assert_eq!(without, energy, "no statistics: the energy fallback");
        assert!(
            attention.layout.record_bytes() < energy.layout.record_bytes(),
            "attention {:?} vs energy {:?}",
            attention.layout,
            energy.layout
        );
        let e = errors(rows.view(), &attention).unwrap();
        assert!(key_loss(&e, &stats.key_moment, &stats.key_weight) <= 1e-3);
        // fit_loss stays the energy loss (section 10.3 compares energy losses).
        assert_eq!(
            attention.fit_loss,
            crate::side_loss(rows.view(), &attention, Side::Key)
        );
    }
}
