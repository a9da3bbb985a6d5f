//! SPEC.md section 11.1.1 (attention loss), for throughput: each candidate's
//! rows are encoded, decoded and rotated back in parallel, and every row's
//! terms are computed with the spec's operation order (f64, ascending
//! indices, separate multiply and add), then added in row order, so the
//! losses equal the reference's bit for bit and both backends choose the
//! same strategy.

use crate::encode;
use mosaickv_spec::query::LossContext;
use mosaickv_spec::{MosaicError, RecordLayout, Result, Side, SideStrategy};
use rayon::prelude::*;

/// Rows per rayon task.
const ROWS_PER_TASK: usize = 256;

/// `e = x - R k^` of one row (f64, ascending j), written to `e`.
fn row_error(x: &[f32], k: &[f32], rot: &[f32], e: &mut [f64]) {
    let dt = k.len();
    for i in 0..x.len() {
        let r = &rot[i * dt..(i + 1) * dt];
        let mut s = 0f64;
        for (&rij, &kj) in r.iter().zip(k) {
            s += f64::from(rij) * f64::from(kj);
        }
        e[i] = f64::from(x[i]) - s;
    }
}

/// `v^T M v = sum_a v_a (sum_b M_ab v_b)`, ascending a and b.
fn quadratic(m: &[f64], v: &[f64]) -> f64 {
    let d = v.len();
    let mut q = 0f64;
    for a in 0..d {
        let mut t = 0f64;
        for (&mab, &vb) in m[a * d..(a + 1) * d].iter().zip(v) {
            t += mab * vb;
        }
        q += v[a] * t;
    }
    q
}

/// SPEC.md section 11.1.1's attention loss of `side_strategy` on one head's
/// segment rows `[n][d]`: keys `sum w e^T M e / (D sum w)`, values `||sum w
/// e||^2 / O^2` (0 on a zero denominator). The statistics must cover the
/// segment (`ShapeMismatch` otherwise).
pub fn attention_loss(
    rows: &[f32],
    side_strategy: &SideStrategy,
    side: Side,
    ctx: LossContext<'_>,
) -> Result<f64> {
    let layout = side_strategy.layout;
    let (d, dt) = (layout.head_dim, layout.kept_dims);
    let n = rows.len() / d;
    let (w, _) =
        ctx.stats
            .weights(ctx.head, ctx.start, n)
            .ok_or_else(|| MosaicError::ShapeMismatch {
                what: "query stats",
                expected: format!("weights for tokens {}..{}", ctx.start, ctx.start + n),
                got: format!("{} tokens", ctx.stats.tokens()),
            })?;
    let packed = encode::encode_rows(rows, side_strategy)?;
    let dense = encode::decode_trusted(&packed, &layout);
    let rot = &side_strategy.rotation;
    // Every row's error in parallel; the sums below run over the rows in order.
    let mut errors = vec![0f64; n * d];
    errors
        .par_chunks_mut(d * ROWS_PER_TASK)
        .zip(rows.par_chunks(d * ROWS_PER_TASK))
        .zip(dense.par_chunks(dt * ROWS_PER_TASK))
        .for_each(|((out, x), k)| {
            for ((e, x), k) in out
                .chunks_exact_mut(d)
                .zip(x.chunks_exact(d))
                .zip(k.chunks_exact(dt))
            {
                row_error(x, k, rot, e);
            }
        });
    Ok(match side {
        Side::Key => {
            let m = ctx.stats.moment(ctx.head);
            let terms: Vec<f64> = errors.par_chunks(d).map(|e| quadratic(m, e)).collect();
            let (mut num, mut den) = (0f64, 0f64);
            for (q, &wt) in terms.iter().zip(&w) {
                num += wt * q;
                den += wt;
            }
            if den == 0.0 {
                0.0
            } else {
                num / (d as f64 * den)
            }
        }
        Side::Value => {
            let mut se = vec![0f64; d];
            for (e, &wt) in errors.chunks_exact(d).zip(&w) {
                for i in 0..d {
                    se[i] += wt * e[i];
                }
            }
            let mut num = 0f64;
            for &v in &se {
                num += v * v;
            }
            let o2 = ctx.stats.output_sq[ctx.head];
            if o2 == 0.0 {
                0.0
            } else {
                num / o2
            }
        }
    })
}

/// The attention loss of every candidate (in parallel), rotation `rotation` (`D x D`).
pub fn attention_losses(
    rows: &[f32],
    rotation: &[f32],
    candidates: &[RecordLayout],
    side: Side,
    ctx: LossContext<'_>,
) -> Result<Vec<f64>> {
    let d = candidates.first().map_or(0, |l| l.head_dim);
    candidates
        .par_iter()
        .map(|layout| {
            let st = SideStrategy {
                layout: *layout,
                rotation: mosaickv_spec::layout::trim_rotation(rotation, d, layout.kept_dims),
                fit_loss: 0.0,
            };
            attention_loss(rows, &st, side, ctx)
        })
        .collect::<Vec<_>>()
        .into_iter()
        .collect()
}
