//! SPEC.md section 11: strategy generation (loss, `(r, g)`, block size).

use crate::loss;
use crate::packed::{decode_rows, dequantized_kept, encode_rows, kept_values};
use crate::rotation::fit_rotation;
use crate::topr::{rotate_row_f64, round_kept, select_row};
use mosaickv_spec::coded::{self, DimCode};
use mosaickv_spec::layout::trim_rotation;
use mosaickv_spec::query::{attention_config, LossContext};
use mosaickv_spec::rules;
use mosaickv_spec::validate::finite;
use mosaickv_spec::{f16, CompressConfig, RecordLayout, Result, Side, SideStrategy, Strategy};
use ndarray::ArrayView2;

/// Running sums of SPEC.md section 11.1's loss: `dropped = sum_i sum_{j not
/// kept} x'_ij^2` and `total = sum_i ||x'_i||^2`, and for the key side's
/// denominator `Q = sum_i ||x_i||^2` and `m = sum_i x_i` (model basis, f32 rows),
/// rows added in order. Adding rows one at a time gives bit-for-bit the sums of
/// [`side_loss`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LossSums {
    pub dropped: f64,
    pub total: f64,
    pub sq: f64,
    pub sum: Vec<f64>,
    pub rows: usize,
}

impl LossSums {
    /// Adds one original row and its rotation (f64, at least `Dt` dims, before f16 rounding)
    /// under `side`'s layout (and coding); the rotation itself is not read.
    pub fn add_rotated(&mut self, row: &[f32], rotated: &[f64], side: &SideStrategy) {
        let (dropped, total) = if side.layout.dtype.is_bitmap() {
            row_loss_terms(row, rotated, &side.layout)
        } else {
            coded_row_loss_terms(row, rotated, side)
        };
        self.dropped += dropped;
        self.total += total;
        if self.sum.is_empty() {
            self.sum = vec![0.0; row.len()];
        }
        let mut sq = 0.0;
        for (m, &x) in self.sum.iter_mut().zip(row) {
            let x = f64::from(x);
            sq += x * x;
            *m += x;
        }
        self.sq += sq;
        self.rows += 1;
    }

    /// Adds one original row, rotated with `side`'s R.
    pub fn add_row(&mut self, row: &[f32], side: &SideStrategy) {
        self.add_rotated(row, &rotate_row_f64(row, &side.rotation), side);
    }

    /// The rows' spread about their mean, `Q - ||m||^2 / n` (0 without rows).
    pub fn spread(&self) -> f64 {
        if self.rows == 0 {
            return 0.0;
        }
        let m2: f64 = self.sum.iter().map(|m| m * m).sum();
        self.sq - m2 / self.rows as f64
    }

    /// The side's loss (`spec::rules::side_loss`): keys against their spread, values
    /// against their energy.
    pub fn loss(&self, side: Side) -> f64 {
        rules::side_loss(side, self.dropped, self.total, self.spread())
    }
}

/// SPEC.md section 11.1 for one row `x` and its rotation `x'` (f64, at least
/// `Dt` dims): `(sum_{j < Dt} e_j + T, sum_{j < Dt} x'_j^2 + T)`, ascending j,
/// where `e_j = x'_j^2` for a dropped dim, `(x'_j - deq_j)^2` for a kept dim of an
/// int8/int4 layout (`deq_j` the decoded value, section 6) and 0 for a kept f16 dim,
/// and `T` is the energy of the truncated dims, `max(0, ||x||^2 - sum_{j <
/// Dt} x'_j^2)` (R is orthogonal), and 0 when `Dt = D`. The kept set is
/// section 5's, chosen on the f16-rounded values; the energies use the f64
/// values before rounding.
pub fn row_loss_terms(row: &[f32], rotated: &[f64], layout: &RecordLayout) -> (f64, f64) {
    debug_assert!(
        layout.dtype.is_bitmap(),
        "coded layouts: coded_row_loss_terms"
    );
    let (y, kept) = select_row(rotated, layout);
    let g = layout.group_size;
    // Decoded kept values in ascending dim order (only quantized layouts use them).
    let deq = if layout.dtype.is_quantized() {
        dequantized_kept(&kept_values(&y, &kept, g), layout)
    } else {
        Vec::new()
    };
    let mut next = 0;
    let mut dropped = 0.0;
    let mut total = 0.0;
    for (j, &v) in rotated[..layout.kept_dims].iter().enumerate() {
        let e = v * v;
        total += e;
        if !kept[j / g] {
            dropped += e;
        } else if layout.dtype.is_quantized() {
            let err = v - f64::from(deq[next]);
            dropped += err * err;
            next += 1;
        }
    }
    if layout.kept_dims < layout.head_dim {
        let energy: f64 = row.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        let truncated = (energy - total).max(0.0);
        dropped += truncated;
        total += truncated;
    }
    (dropped, total)
}

/// SPEC.md sections 6.1 and 11.1 for a coded side: as [`row_loss_terms`], with every dim
/// `j < Dt` kept and `e_j = (x'_j - d_j)^2`, `d_j` its decoded value.
pub fn coded_row_loss_terms(row: &[f32], rotated: &[f64], side: &SideStrategy) -> (f64, f64) {
    let dt = side.layout.kept_dims;
    let y = round_kept(rotated, dt);
    let mut dropped = 0.0;
    let mut total = 0.0;
    for (j, &v) in rotated[..dt].iter().enumerate() {
        let c = side.coding[j];
        let err = v - f64::from(c.decode(c.encode(y[j])));
        total += v * v;
        dropped += err * err;
    }
    if dt < side.layout.head_dim {
        let energy: f64 = row.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        let truncated = (energy - total).max(0.0);
        dropped += truncated;
        total += truncated;
    }
    (dropped, total)
}

/// SPEC.md section 11.1: `loss = sum_i (dropped energy of row i) / D`, `D` the key rows'
/// spread about their mean or the value rows' energy `sum_i ||x'_i||^2`, for rows `[n, D]`
/// under `strategy` (0 when the denominator is 0).
pub fn side_loss(rows: ArrayView2<f32>, strategy: &SideStrategy, side: Side) -> f64 {
    let mut sums = LossSums::default();
    for row in rows.rows() {
        let row: Vec<f32> = row.iter().copied().collect();
        sums.add_row(&row, strategy);
    }
    sums.loss(side)
}

/// SPEC.md sections 6.1 and 11.2: one side's candidates for rows whose rotations (with the
/// full R, f64) are `rotated`: the policy's bitmap layouts
/// ([`mosaickv_spec::rules::candidates`]) and, where `value_dtypes` lists `coded`, at its place
/// ([`mosaickv_spec::rules::coded_candidates_at`]), one coded candidate per step of the ladder
/// ([`mosaickv_spec::coded::candidates`]) in ladder order, repeats dropped. Each comes as a side
/// strategy without its rotation (`rotation` empty) or fit loss.
pub fn side_candidates(
    rotated: &[Vec<f64>],
    config: &CompressConfig,
    head_dim: usize,
) -> Vec<SideStrategy> {
    let bare = |layout: RecordLayout, coding: Vec<DimCode>| SideStrategy {
        layout,
        rotation: Vec::new(),
        fit_loss: 0.0,
        coding,
    };
    let mut out: Vec<SideStrategy> = rules::candidates(config, head_dim)
        .into_iter()
        .map(|l| bare(l, Vec::new()))
        .collect();
    let Some(at) = rules::coded_candidates_at(config, head_dim) else {
        return out;
    };
    let dt = config.kept_dims(head_dim, 1);
    let rounded: Vec<Vec<f16>> = rotated.iter().map(|x| round_kept(x, dt)).collect();
    if rounded.iter().flatten().any(|y| !y.is_finite()) {
        return out; // an overflowing row: no range to code (encoding it is `NonFinite`)
    }
    let mut lo = vec![f16::INFINITY; dt];
    let mut hi = vec![f16::NEG_INFINITY; dt];
    for y in &rounded {
        for j in 0..dt {
            if y[j].to_f64() < lo[j].to_f64() {
                lo[j] = y[j];
            }
            if y[j].to_f64() > hi[j].to_f64() {
                hi[j] = y[j];
            }
        }
    }
    if rounded.is_empty() {
        lo.fill(f16::ZERO);
        hi.fill(f16::ZERO);
    }
    let coded_side = coded::candidates(&lo, &hi, head_dim);
    out.splice(at..at, coded_side);
    out
}

/// SPEC.md section 11.2: chooses among the candidates ([`side_candidates`]), given the rows
/// and their rotations with the full R (f64, all D dims). Each candidate's loss is section
/// 11.1's, rows added in order; the pick is [`mosaickv_spec::rules::choose_candidate`] (the
/// rule is data, written once in the spec crate). Returns the candidate (rotation not
/// filled in) and its (energy) loss.
pub fn choose_layout(
    rows: ArrayView2<f32>,
    rotated: &[Vec<f64>],
    side: Side,
    config: &CompressConfig,
    head_dim: usize,
) -> (SideStrategy, f64) {
    let candidates = side_candidates(rotated, config, head_dim);
    let losses = energy_losses(rows, rotated, side, &candidates);
    let layouts: Vec<RecordLayout> = candidates.iter().map(|c| c.layout).collect();
    let k = rules::choose_candidate(&layouts, &losses, side, config);
    (candidates[k].clone(), losses[k])
}

/// Section 11.1's loss of each candidate (keys against their spread), rows added in order.
fn energy_losses(
    rows: ArrayView2<f32>,
    rotated: &[Vec<f64>],
    side: Side,
    candidates: &[SideStrategy],
) -> Vec<f64> {
    candidates
        .iter()
        .map(|cand| {
            let mut sums = LossSums::default();
            for (row, rot) in rows.rows().into_iter().zip(rotated) {
                let row: Vec<f32> = row.iter().copied().collect();
                sums.add_rotated(&row, rot, cand);
            }
            sums.loss(side)
        })
        .collect()
}

/// SPEC.md section 11.1.1 (attention loss) of one candidate on one head's
/// segment rows: the key loss with the head's query moment and the mean
/// attention weights `w`, or the value loss with `w` and `O^2`. The statistics must cover
/// the segment (`ShapeMismatch` otherwise).
pub fn attention_loss(
    rows: ArrayView2<f32>,
    side_strategy: &SideStrategy,
    side: Side,
    ctx: LossContext<'_>,
) -> Result<f64> {
    let (w, _) = loss::segment_weights(&ctx)?;
    let e = loss::errors(rows, side_strategy)?;
    Ok(match side {
        Side::Key => loss::key_loss(&e, ctx.stats.moment(ctx.head), &w),
        Side::Value => loss::value_loss(&e, &w, ctx.stats.output_sq[ctx.head]),
    })
}

/// SPEC.md sections 3, 4, 11.1, 11.2: one side's strategy for rows `[n, D]`:
/// rotation fitted on the rows, then `(r, g)` chosen with that rotation
/// (the loss uses R as stored, f32); `fit_loss` is the chosen candidate's energy loss.
pub fn fit_side(
    rows: ArrayView2<f32>,
    side: Side,
    config: &CompressConfig,
) -> Result<SideStrategy> {
    fit_side_with(rows, side, config, None)
}

/// [`fit_side`] with the attention loss's statistics (SPEC.md section 11.1):
/// under `LossPolicy::Attention` with statistics, the candidates are compared
/// by their attention loss against its thresholds; `fit_loss` stays the
/// chosen candidate's energy loss (the drift rule of section 10.3 compares
/// energy losses). Without statistics this is [`fit_side`] (the fallback).
pub fn fit_side_with(
    rows: ArrayView2<f32>,
    side: Side,
    config: &CompressConfig,
    ctx: Option<LossContext<'_>>,
) -> Result<SideStrategy> {
    let d = rows.ncols();
    config.validate(d)?;
    finite("rows", rows.iter())?;
    let rotation = fit_rotation(rows);
    let rotated: Vec<Vec<f64>> = rows
        .rows()
        .into_iter()
        .map(|row| {
            let row: Vec<f32> = row.iter().copied().collect();
            rotate_row_f64(&row, &rotation)
        })
        .collect();
    let candidates = side_candidates(&rotated, config, d);
    let energy = energy_losses(rows, &rotated, side, &candidates);
    let layouts: Vec<RecordLayout> = candidates.iter().map(|c| c.layout).collect();
    let k = match (attention_config(config, ctx), ctx) {
        (Some(att), Some(ctx)) => {
            let mut losses = Vec::with_capacity(candidates.len());
            for cand in &candidates {
                let st = SideStrategy {
                    rotation: trim_rotation(&rotation, d, cand.layout.kept_dims),
                    ..cand.clone()
                };
                losses.push(attention_loss(rows, &st, side, ctx)?);
            }
            rules::choose_candidate(&layouts, &losses, side, &att)
        }
        _ => rules::choose_candidate(&layouts, &energy, side, config),
    };
    let chosen = &candidates[k];
    Ok(SideStrategy {
        rotation: trim_rotation(&rotation, d, chosen.layout.kept_dims),
        fit_loss: energy[k],
        ..chosen.clone()
    })
}

/// SPEC.md section 11.3: `V(b) = mean over blocks of sum_{j<Dt}
/// var_block(k^_j) / sum_{j<Dt} var_segment(k^_j)` for decoded keys
/// `[n, Dt]` (population variances, f64; 0/0 counts as 0).
pub fn block_variance(decoded: ArrayView2<f32>, block_size: usize) -> f64 {
    let (n, dt) = (decoded.nrows(), decoded.ncols());
    if n == 0 {
        return 0.0;
    }
    let blocks = n.div_ceil(block_size);
    let mut sum_var = 0.0;
    for blk in 0..blocks {
        let first = blk * block_size;
        let end = (first + block_size).min(n);
        let len = (end - first) as f64;
        for j in 0..dt {
            let mut mean = 0.0;
            for t in first..end {
                mean += f64::from(decoded[[t, j]]);
            }
            mean /= len;
            let mut var = 0.0;
            for t in first..end {
                let dev = f64::from(decoded[[t, j]]) - mean;
                var += dev * dev;
            }
            sum_var += var / len;
        }
    }
    let mean_var = sum_var / blocks as f64;
    // Denominator: the whole segment's variance, sum over dims of the
    // population variance of k^_j over all n tokens.
    let mut total_var = 0.0;
    for j in 0..dt {
        let mut mean = 0.0;
        for t in 0..n {
            mean += f64::from(decoded[[t, j]]);
        }
        mean /= n as f64;
        let mut var = 0.0;
        for t in 0..n {
            let dev = f64::from(decoded[[t, j]]) - mean;
            var += dev * dev;
        }
        total_var += var / n as f64;
    }
    if total_var == 0.0 {
        0.0
    } else {
        mean_var / total_var
    }
}

/// SPEC.md section 11.3: the largest candidate block size with
/// `V(b) <= variance_threshold`; the smallest candidate if none passes.
pub fn fit_block_size(
    keys: ArrayView2<f32>,
    key: &SideStrategy,
    config: &CompressConfig,
) -> Result<usize> {
    config.validate(keys.ncols())?;
    let packed = encode_rows(keys, key)?;
    let decoded = decode_rows(&packed, key)?;
    let mut chosen = config.block_sizes[0];
    for &b in &config.block_sizes {
        if block_variance(decoded.view(), b) <= config.variance_threshold {
            chosen = chosen.max(b);
        }
    }
    Ok(chosen)
}

/// SPEC.md section 11: the whole strategy of one head's segment.
pub fn fit_strategy(
    keys: ArrayView2<f32>,
    values: ArrayView2<f32>,
    config: &CompressConfig,
) -> Result<Strategy> {
    fit_strategy_with(keys, values, config, None)
}

/// [`fit_strategy`] with the attention loss's statistics ([`fit_side_with`]).
pub fn fit_strategy_with(
    keys: ArrayView2<f32>,
    values: ArrayView2<f32>,
    config: &CompressConfig,
    ctx: Option<LossContext<'_>>,
) -> Result<Strategy> {
    let key = fit_side_with(keys, Side::Key, config, ctx)?;
    let value = fit_side_with(values, Side::Value, config, ctx)?;
    let block_size = fit_block_size(keys, &key, config)?;
    Ok(Strategy {
        key,
        value,
        block_size,
    })
}
