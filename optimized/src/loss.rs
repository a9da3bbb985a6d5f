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

/// Per-row term: keys `e^T M e`, values `||e||^2`, with `e = x - R k^`.
fn row_term(x: &[f32], k: &[f32], rot: &[f32], m: Option<&[f64]>, e: &mut [f64]) -> f64 {
    let (d, dt) = (x.len(), k.len());
    for i in 0..d {
        let r = &rot[i * dt..(i + 1) * dt];
        let mut s = 0f64;
        for (&rij, &kj) in r.iter().zip(k) {
            s += f64::from(rij) * f64::from(kj);
        }
        e[i] = f64::from(x[i]) - s;
    }
    match m {
        Some(m) => {
            let mut q = 0f64;
            for a in 0..d {
                let row = &m[a * d..(a + 1) * d];
                let mut t = 0f64;
                for (&mab, &eb) in row.iter().zip(e.iter()) {
                    t += mab * eb;
                }
                q += e[a] * t;
            }
            q
        }
        None => {
            let mut ee = 0f64;
            for &v in e.iter() {
                ee += v * v;
            }
            ee
        }
    }
}

/// SPEC.md section 11.1.1's attention loss of `side_strategy` on one head's
/// segment rows `[n][d]`: keys `sum w e^T M e / (D sum w)`, values `sum u
/// ||e||^2 / O^2` (0 on a zero denominator). The statistics must cover the
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
    let (w, u) = ctx
        .stats
        .weights(ctx.head, ctx.start, n)
        .ok_or_else(|| MosaicError::ShapeMismatch {
            what: "query stats",
            expected: format!("weights for tokens {}..{}", ctx.start, ctx.start + n),
            got: format!("{} tokens", ctx.stats.tokens()),
        })?;
    let packed = encode::encode_rows(rows, side_strategy)?;
    let dense = encode::decode_trusted(&packed, &layout);
    let m = match side {
        Side::Key => Some(ctx.stats.moment(ctx.head)),
        Side::Value => None,
    };
    let rot = &side_strategy.rotation;
    let mut terms = vec![0f64; n];
    terms
        .par_chunks_mut(ROWS_PER_TASK)
        .zip(rows.par_chunks(d * ROWS_PER_TASK))
        .zip(dense.par_chunks(dt * ROWS_PER_TASK))
        .for_each(|((out, x), k)| {
            let mut e = vec![0f64; d];
            for ((o, x), k) in out.iter_mut().zip(x.chunks_exact(d)).zip(k.chunks_exact(dt)) {
                *o = row_term(x, k, rot, m, &mut e);
            }
        });
    Ok(match side {
        Side::Key => {
            let (mut num, mut den) = (0f64, 0f64);
            for (a, &wt) in terms.iter().zip(&w) {
                num += wt * a;
                den += wt;
            }
            if den == 0.0 {
                0.0
            } else {
                num / (d as f64 * den)
            }
        }
        Side::Value => {
            let mut num = 0f64;
            for (a, &ut) in terms.iter().zip(&u) {
                num += ut * a;
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
