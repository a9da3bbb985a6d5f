//! SPEC.md section 11: the (r, g, dtype) search by the energy or attention loss and the
//! block-size search, with every candidate's loss equal to the reference's bit for bit.
//!
//! Written for throughput but producing the spec's exact bytes: every f64 sum runs over the
//! same index in the same ascending order as the spec's definition, with separate multiply
//! and add (Rust never contracts to FMA).

use crate::packed::*;
use crate::rotation::{covariance, rotate_rows_f64, rotation_from_covariance};
use crate::round::{f16_from_f64, f16_to_f64};
use crate::topr::*;
use mosaickv_spec::{rules, CompressConfig, RecordLayout, Result, Side, SideStrategy};
use rayon::prelude::*;

/// SPEC 11.1 terms `(dropped, total)` of one row `x` (`[d]`) with rotated coordinates `xr`
/// (at least `Dt` of them, f64), group `k` kept iff `kept(k)`: energies over `j < Dt`, plus the
/// truncated dims' energy `max(0, ||x||^2 - sum_{j<Dt} xr_j^2)` when `Dt < D` (as dropped).
/// For an int8/int4 layout `deq` holds the decoded kept values (ascending dims) and a kept
/// dim adds its quantization error `(xr_j - deq)^2` to `dropped`; for f16 `deq` is unused.
#[inline]
pub fn row_loss_terms(
    x: &[f32],
    xr: &[f64],
    layout: &RecordLayout,
    kept: impl Fn(usize) -> bool,
    deq: &[f32],
) -> (f64, f64) {
    let (dt, g) = (layout.kept_dims, layout.group_size);
    let quantized = layout.dtype.is_quantized();
    let (mut dropped, mut total) = (0f64, 0f64);
    let mut next = 0;
    for (j, &v) in xr[..dt].iter().enumerate() {
        let e = v * v;
        total += e;
        if !kept(j / g) {
            dropped += e;
        } else if quantized {
            let err = v - f64::from(deq[next]);
            dropped += err * err;
            next += 1;
        }
    }
    if dt < layout.head_dim {
        let energy: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let truncated = (energy - total).max(0.0);
        dropped += truncated;
        total += truncated;
    }
    (dropped, total)
}

/// SPEC 11.1's key denominator sums: `Q = sum_i ||x_i||^2` (per row ascending j, then rows in
/// order) and `m = sum_i x_i` (per model dim, rows in order), f64 of the f32 rows, and the row
/// count; the spread is `Q - ||m||^2 / n` (as the reference's `LossSums`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpreadSums {
    pub sq: f64,
    pub sum: Vec<f64>,
    pub rows: usize,
}

impl SpreadSums {
    /// The sums of rows `[n][d]`.
    pub fn of_rows(rows: &[f32], d: usize) -> Self {
        let mut s = Self::default();
        s.add_rows(rows, d);
        s
    }

    /// Adds rows `[n][d]` in order.
    pub fn add_rows(&mut self, rows: &[f32], d: usize) {
        if self.sum.is_empty() {
            self.sum = vec![0.0; d];
        }
        for x in rows.chunks_exact(d) {
            let mut q = 0f64;
            for (m, &v) in self.sum.iter_mut().zip(x) {
                let v = f64::from(v);
                q += v * v;
                *m += v;
            }
            self.sq += q;
            self.rows += 1;
        }
    }

    /// Adds another run of rows' sums (a flush's, onto the open segment's).
    pub fn add(&mut self, other: &Self) {
        if self.sum.is_empty() {
            self.sum = vec![0.0; other.sum.len()];
        }
        for (m, o) in self.sum.iter_mut().zip(&other.sum) {
            *m += o;
        }
        self.sq += other.sq;
        self.rows += other.rows;
    }

    /// `Q - ||m||^2 / n` (0 without rows).
    pub fn spread(&self) -> f64 {
        if self.rows == 0 {
            return 0.0;
        }
        let m2: f64 = self.sum.iter().map(|m| m * m).sum();
        self.sq - m2 / self.rows as f64
    }
}

/// Running SPEC 11.1 sums of one side: `(dropped, total)` and the spread sums.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LossSums {
    pub dropped: f64,
    pub total: f64,
    pub spread: SpreadSums,
}

impl LossSums {
    /// Adds another run of rows' sums.
    pub fn add(&mut self, other: &Self) {
        self.dropped += other.dropped;
        self.total += other.total;
        self.spread.add(&other.spread);
    }

    /// The side's loss (`spec::rules::side_loss`).
    pub fn loss(&self, side: Side) -> f64 {
        rules::side_loss(side, self.dropped, self.total, self.spread.spread())
    }
}

/// SPEC 11.1 sums `(dropped, total)` of rows `[n][d]` given their rotated coordinates
/// (`[n][w]` f64, `w >= Dt`) under `(Dt, r, g)`: kept groups chosen by SPEC 5 from the
/// f16-rounded values. The per-row terms are computed in parallel and added in row order,
/// as SPEC 11.1 says (and as the reference's `LossSums` does), so the sums are the
/// reference's bit for bit: a fold of per-chunk partial sums would round differently.
pub fn loss_sums_rotated(
    rows: &[f32],
    rot_rows: &[f64],
    w: usize,
    layout: &RecordLayout,
) -> (f64, f64) {
    let (d, dt, g) = (layout.head_dim, layout.kept_dims, layout.group_size);
    let terms: Vec<Vec<(f64, f64)>> = rot_rows
        .par_chunks(w * ROWS_PER_TASK)
        .zip(rows.par_chunks(d * ROWS_PER_TASK))
        .map(|(xr, x)| {
            let mut b = PackBufs::new(d);
            xr.chunks_exact(w)
                .zip(x.chunks_exact(d))
                .map(|(row, xrow)| {
                    for j in 0..dt {
                        b.y[j] = f16_from_f64(row[j]);
                    }
                    select_groups(
                        &b.y[..dt],
                        g,
                        layout.kept_groups(),
                        &mut b.imp,
                        &mut b.order,
                        &mut b.keep,
                    );
                    if layout.dtype.is_quantized() {
                        b.kv.clear();
                        for k in 0..layout.groups() {
                            if b.keep[k] {
                                b.kv.extend_from_slice(&b.y[k * g..(k + 1) * g]);
                            }
                        }
                        dequantize_kept(&b.kv, layout, &mut b.codes, &mut b.deq);
                    }
                    row_loss_terms(xrow, row, layout, |k| b.keep[k], &b.deq)
                })
                .collect()
        })
        .collect();
    let (mut dropped, mut total) = (0f64, 0f64);
    for (a, t) in terms.into_iter().flatten() {
        dropped += a;
        total += t;
    }
    (dropped, total)
}

/// Candidates evaluated side by side in [`candidate_losses`]: one per lane, each lane keeping
/// its own sum in dim order, so a lane adds exactly what [`row_loss_terms`] adds, in the same
/// order, and the lanes only share the loop (and, with AVX2, one vector register).
const LANES: usize = 4;

/// `2^52`: for `0 <= t < 2^52`, `(t + 2^52) - 2^52` is `t` rounded to an integer, ties to even
/// (the default rounding of the addition), so it is `t.round_ties_even()` without a call.
const ROUND_MAGIC: f64 = 4_503_599_627_370_496.0;

/// Up to [`LANES`] candidates of one group ranking and one kind (f16, or int8/int4).
struct LaneSet {
    /// Index into the rankings.
    ranking: usize,
    quantized: bool,
    /// The candidate of each lane; `None` pads the last set.
    cand: [Option<usize>; LANES],
    /// Kept groups of each lane (a padding lane keeps all: it adds nothing).
    kept: [usize; LANES],
    /// `qmax` of each lane's dtype (quantized sets).
    qmax: [u32; LANES],
}

/// One row's values for one Dt, shared by every ranking (and candidate) with that Dt.
struct RowValues {
    /// The row's f16-rounded rotated values (SPEC 5 step 1), as f64 (exact).
    yv: Vec<f64>,
    /// `sum_{j<Dt} xr_j^2` in dim order (SPEC 11.1's total before truncation).
    total: f64,
}

impl RowValues {
    /// Fills the values of row `xr` (rotated, f64) for `dt`; `e` holds `xr_j^2`.
    fn fill(&mut self, xr: &[f64], e: &[f64], dt: usize) {
        for (y, &x) in self.yv[..dt].iter_mut().zip(xr) {
            *y = f16_to_f64(f16_from_f64(x));
        }
        let mut total = 0f64;
        for &v in &e[..dt] {
            total += v;
        }
        self.total = total;
    }
}

/// One ranking's per-row tables, shared by every candidate with its `(Dt, g)`.
struct Ranked {
    imp: Vec<f32>,
    order: Vec<u16>,
    /// Sort keys of the ranking.
    keys: Vec<u64>,
    /// Per dim: the rank of its group in `order` (as f64, to compare in the vector loop); the
    /// dim is kept by a candidate keeping `k` groups iff its rank is below `k`.
    rank: Vec<f64>,
    /// Smallest and largest kept value when the first `k` groups of `order` are kept (index k).
    lo: Vec<f64>,
    hi: Vec<f64>,
}

impl Ranked {
    fn new(d: usize) -> Self {
        Self {
            imp: vec![0.0; d],
            order: vec![0; d],
            keys: vec![0; d],
            rank: vec![0.0; d],
            lo: vec![0.0; d + 1],
            hi: vec![0.0; d + 1],
        }
    }

    /// Fills the tables of a row with f16-rounded values `yv` (length Dt) for group size `g`.
    fn fill(&mut self, yv: &[f64], g: usize) {
        rank_groups(yv, g, &mut self.imp, &mut self.order, &mut self.keys);
        let groups = yv.len() / g;
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        self.lo[0] = lo;
        self.hi[0] = hi;
        for (i, &k) in self.order[..groups].iter().enumerate() {
            let k = k as usize;
            for j in k * g..(k + 1) * g {
                self.rank[j] = i as f64;
                lo = lo.min(yv[j]);
                hi = hi.max(yv[j]);
            }
            self.lo[i + 1] = lo;
            self.hi[i + 1] = hi;
        }
    }
}

/// SPEC 11.1's dropped energy of f16 candidates, one per lane: `sum_j` over the dims in order
/// of `e_j` where the dim is dropped (and `+0`, which leaves a non-negative sum unchanged,
/// where it is kept).
#[inline(always)]
fn dropped_f16_body(e: &[f64], rank: &[f64], kept: [f64; LANES]) -> [f64; LANES] {
    let mut acc = [0f64; LANES];
    for (&ej, &rj) in e.iter().zip(rank) {
        for l in 0..LANES {
            acc[l] += if rj < kept[l] { 0.0 } else { ej };
        }
    }
    acc
}

/// Each lane's quantization of SPEC.md section 6 for one row: the kept values' minimum
/// `lo`, the scale as f64 (`1` where the scale is 0: every kept value is then `lo`, code 0),
/// and as f32, the minimum as f32 (`m`, never -0), `qmax`, and the kept-group count.
#[derive(Clone, Copy)]
struct LaneQuant {
    lo: [f64; LANES],
    sd: [f64; LANES],
    sf: [f32; LANES],
    mf: [f32; LANES],
    q: [f64; LANES],
    kept: [f64; LANES],
}

/// SPEC 11.1's dropped energy of int8/int4 candidates, one per lane: `e_j` for a dropped dim,
/// `(xr_j - (m + c_j s))^2` for a kept one, with `c_j = round_half_even((y_j - m) / s)` as
/// [`quantize_values`] computes it and the decoded value as [`dequantize`] does (f32, one
/// rounding), summed in dim order.
#[inline(always)]
fn dropped_quant_body(
    xr: &[f64],
    e: &[f64],
    yv: &[f64],
    rank: &[f64],
    p: &LaneQuant,
) -> [f64; LANES] {
    let mut acc = [0f64; LANES];
    for j in 0..xr.len() {
        let (x, ej, y, rj) = (xr[j], e[j], yv[j], rank[j]);
        for l in 0..LANES {
            let t = (y - p.lo[l]) / p.sd[l];
            let c = ((t + ROUND_MAGIC) - ROUND_MAGIC).max(0.0).min(p.q[l]);
            let deq = p.mf[l] + (c as f32) * p.sf[l];
            let err = x - f64::from(deq);
            acc[l] += if rj < p.kept[l] { err * err } else { ej };
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dropped_f16_avx2(e: &[f64], rank: &[f64], kept: [f64; LANES]) -> [f64; LANES] {
    dropped_f16_body(e, rank, kept)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dropped_quant_avx2(
    xr: &[f64],
    e: &[f64],
    yv: &[f64],
    rank: &[f64],
    p: &LaneQuant,
) -> [f64; LANES] {
    dropped_quant_body(xr, e, yv, rank, p)
}

fn dropped_f16(avx2: bool, e: &[f64], rank: &[f64], kept: [f64; LANES]) -> [f64; LANES] {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: the caller detected avx2; the body only indexes within its slices.
        return unsafe { dropped_f16_avx2(e, rank, kept) };
    }
    let _ = avx2;
    dropped_f16_body(e, rank, kept)
}

fn dropped_quant(
    avx2: bool,
    xr: &[f64],
    e: &[f64],
    yv: &[f64],
    rank: &[f64],
    p: &LaneQuant,
) -> [f64; LANES] {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: as in `dropped_f16`.
        return unsafe { dropped_quant_avx2(xr, e, yv, rank, p) };
    }
    let _ = avx2;
    dropped_quant_body(xr, e, yv, rank, p)
}

/// The search's lane sets: candidates grouped by `(Dt, g)` ranking and kind, [`LANES`] a set.
fn lane_sets(cands: &[RecordLayout], ranking_of: &[usize], rankings: usize) -> Vec<LaneSet> {
    let mut sets = Vec::new();
    for r in 0..rankings {
        for quantized in [false, true] {
            let members: Vec<usize> = (0..cands.len())
                .filter(|&i| ranking_of[i] == r && cands[i].dtype.is_quantized() == quantized)
                .collect();
            for chunk in members.chunks(LANES) {
                let all = cands[chunk[0]].groups();
                let mut set = LaneSet {
                    ranking: r,
                    quantized,
                    cand: [None; LANES],
                    kept: [all; LANES],
                    qmax: [1; LANES],
                };
                for (l, &i) in chunk.iter().enumerate() {
                    let c = &cands[i];
                    set.cand[l] = Some(i);
                    set.kept[l] = c.kept_groups().min(c.groups());
                    if quantized {
                        set.qmax[l] = c.dtype.qmax();
                    }
                }
                sets.push(set);
            }
        }
    }
    sets
}

/// SPEC 11.1 losses of every candidate layout `cands` (one head dimension) of rows `[n][d]`
/// with rotated coordinates `rot_rows` (`[n][w]`, `w` at least every candidate's Dt): the
/// strategy search's inner loop. Equal bit for bit to [`loss_rotated`] per candidate: each
/// candidate's per-row terms are [`row_loss_terms`]'s, the same additions in the same order,
/// and the rows are added in row order. What it saves: each row's f16 rounding, group ranking
/// and total are computed once per `(Dt, g)` instead of once per candidate; a quantized
/// candidate's minimum and range come from running extremes over the ranked groups; and
/// [`LANES`] candidates run side by side, one per lane, so their sums' dependency chains
/// overlap (and vectorize under AVX2) instead of running one after another.
pub fn candidate_losses(
    rows: &[f32],
    rot_rows: &[f64],
    w: usize,
    cands: &[RecordLayout],
    side: Side,
) -> Vec<f64> {
    let avx2 = crate::simd::Path::detect().runs_avx2();
    candidate_losses_on(avx2, rows, rot_rows, w, cands, side)
}

/// [`candidate_losses`] with the lane loops compiled for AVX2 (`avx2`, detected by the
/// caller) or portable.
fn candidate_losses_on(
    avx2: bool,
    rows: &[f32],
    rot_rows: &[f64],
    w: usize,
    cands: &[RecordLayout],
    side: Side,
) -> Vec<f64> {
    let Some(d) = cands.first().map(|l| l.head_dim) else {
        return Vec::new();
    };
    let mut rankings: Vec<(usize, usize)> = Vec::new();
    let ranking_of: Vec<usize> = cands
        .iter()
        .map(|l| {
            let key = (l.kept_dims, l.group_size);
            rankings.iter().position(|&r| r == key).unwrap_or_else(|| {
                rankings.push(key);
                rankings.len() - 1
            })
        })
        .collect();
    let sets = lane_sets(cands, &ranking_of, rankings.len());
    // The distinct Dt of the rankings: a row's f16 values and total are computed once per Dt.
    let mut dts: Vec<usize> = Vec::new();
    let values_of: Vec<usize> = rankings
        .iter()
        .map(|&(dt, _)| {
            dts.iter().position(|&x| x == dt).unwrap_or_else(|| {
                dts.push(dt);
                dts.len() - 1
            })
        })
        .collect();
    let wmax = dts.iter().copied().max().unwrap_or(0);
    let truncating = dts.iter().any(|&dt| dt < d);
    let nc = cands.len();
    let terms: Vec<Vec<(f64, f64)>> = rot_rows
        .par_chunks(w * ROWS_PER_TASK)
        .zip(rows.par_chunks(d * ROWS_PER_TASK))
        .map(|(xr, x)| {
            let mut ranked: Vec<Ranked> = rankings.iter().map(|_| Ranked::new(d)).collect();
            let mut values: Vec<RowValues> = dts
                .iter()
                .map(|_| RowValues {
                    yv: vec![0.0; d],
                    total: 0.0,
                })
                .collect();
            let mut e = vec![0f64; d];
            let mut row_terms = vec![(0f64, 0f64); nc];
            let mut out = Vec::with_capacity(x.len() / d * nc);
            for (row, xrow) in xr.chunks_exact(w).zip(x.chunks_exact(d)) {
                for (ej, &v) in e.iter_mut().zip(&row[..wmax]) {
                    *ej = v * v;
                }
                for (&dt, v) in dts.iter().zip(values.iter_mut()) {
                    v.fill(row, &e, dt);
                }
                for ((&(dt, g), &vi), rk) in rankings.iter().zip(&values_of).zip(ranked.iter_mut())
                {
                    rk.fill(&values[vi].yv[..dt], g);
                }
                // SPEC 11.1's truncated energy: the row's energy beyond the first Dt dims.
                let energy = if truncating {
                    xrow.iter().map(|&v| f64::from(v) * f64::from(v)).sum()
                } else {
                    0.0
                };
                for set in &sets {
                    let rk = &ranked[set.ranking];
                    let rv = &values[values_of[set.ranking]];
                    let dt = rankings[set.ranking].0;
                    let kept = set.kept.map(|k| k as f64);
                    let dropped = if set.quantized {
                        let mut p = LaneQuant {
                            lo: [0.0; LANES],
                            sd: [1.0; LANES],
                            sf: [0.0; LANES],
                            mf: [0.0; LANES],
                            q: [0.0; LANES],
                            kept,
                        };
                        for l in 0..LANES {
                            let k = set.kept[l];
                            p.q[l] = f64::from(set.qmax[l]);
                            if k == 0 {
                                continue;
                            }
                            let (lo, hi) = (rk.lo[k], rk.hi[k]);
                            let s = mosaickv_spec::layout::quant_scale(hi - lo, set.qmax[l]);
                            p.lo[l] = lo;
                            p.mf[l] = (lo + 0.0) as f32;
                            if s.to_bits() != 0 {
                                p.sd[l] = s.to_f64();
                                p.sf[l] = s.to_f32();
                            }
                        }
                        dropped_quant(avx2, &row[..dt], &e[..dt], &rv.yv[..dt], &rk.rank[..dt], &p)
                    } else {
                        dropped_f16(avx2, &e[..dt], &rk.rank[..dt], kept)
                    };
                    let truncated = if dt < d {
                        (energy - rv.total).max(0.0)
                    } else {
                        0.0
                    };
                    for (l, c) in set.cand.iter().enumerate() {
                        if let Some(i) = *c {
                            row_terms[i] = if dt < d {
                                (dropped[l] + truncated, rv.total + truncated)
                            } else {
                                (dropped[l], rv.total)
                            };
                        }
                    }
                }
                out.extend_from_slice(&row_terms);
            }
            out
        })
        .collect();
    let mut sums = vec![(0f64, 0f64); nc];
    for chunk in &terms {
        for (i, t) in chunk.iter().enumerate() {
            let s = &mut sums[i % nc];
            s.0 += t.0;
            s.1 += t.1;
        }
    }
    let spread = key_spread(rows, d, side);
    sums.into_iter()
        .map(|(dropped, total)| rules::side_loss(side, dropped, total, spread))
        .collect()
}

/// SPEC 11.1: the loss of rows `[n][d]` given their rotated coordinates (see
/// [`loss_sums_rotated`]): keys against their spread, values against their energy.
pub fn loss_rotated(
    rows: &[f32],
    rot_rows: &[f64],
    w: usize,
    layout: &RecordLayout,
    side: Side,
) -> f64 {
    let (dropped, total) = loss_sums_rotated(rows, rot_rows, w, layout);
    let spread = key_spread(rows, layout.head_dim, side);
    rules::side_loss(side, dropped, total, spread)
}

/// The rows' spread where `side` uses it (keys); values divide by their energy, so it is not
/// computed for them.
fn key_spread(rows: &[f32], d: usize, side: Side) -> f64 {
    match side {
        Side::Key => SpreadSums::of_rows(rows, d).spread(),
        Side::Value => 0.0,
    }
}

/// SPEC 3, 4, 11: fits one side from rows `[n][d]`; also returns the rows' full rotated coordinates
/// so a caller that encodes the same rows does not rotate them twice.
pub fn fit_side_rotated(
    rows: &[f32],
    d: usize,
    side: Side,
    config: &CompressConfig,
) -> Result<(SideStrategy, Vec<f64>)> {
    fit_side_rotated_with(rows, d, side, config, None)
}

/// [`fit_side_rotated`] with the attention loss's statistics (SPEC.md section 11.1): under
/// `LossPolicy::Attention` with statistics the candidates are compared by their attention
/// loss ([`crate::loss`]) against its thresholds; `fit_loss` stays the energy loss.
pub fn fit_side_rotated_with(
    rows: &[f32],
    d: usize,
    side: Side,
    config: &CompressConfig,
    ctx: Option<mosaickv_spec::query::LossContext<'_>>,
) -> Result<(SideStrategy, Vec<f64>)> {
    config.validate(d)?;
    let c = covariance(rows, d);
    let rotation = rotation_from_covariance(&c, d);
    let rot = mosaickv_spec::layout::rotation_f32(&rotation);
    let n = rows.len() / d;
    let mut xr = vec![0f64; n * d];
    xr.par_chunks_mut(d * ROWS_PER_TASK)
        .zip(rows.par_chunks(d * ROWS_PER_TASK))
        .for_each(|(o, x)| rotate_rows_f64(&rot, d, x, d, o));
    let chosen = choose_side(rows, &xr, &rotation, d, side, config, ctx)?;
    Ok((chosen, xr))
}

/// SPEC 11.2: one side's strategy among every candidate, given the rows `[n][d]`, their
/// rotation `rotation` (`D x D`) and their rotated coordinates under it (`xr`, `[n][d]` f64):
/// the bitmap layouts of [`rules::candidates`] and, where `value_dtypes` lists `coded`, the
/// coded candidates of SPEC.md section 6.1 at its place ([`crate::coded::coded_candidates`]),
/// compared by their energy loss, or by their attention loss ([`crate::loss`]) under
/// `LossPolicy::Attention` with statistics; `fit_loss` is the chosen one's energy loss.
pub fn choose_side(
    rows: &[f32],
    xr: &[f64],
    rotation: &[half::f16],
    d: usize,
    side: Side,
    config: &CompressConfig,
    ctx: Option<mosaickv_spec::query::LossContext<'_>>,
) -> Result<SideStrategy> {
    let layouts = rules::candidates(config, d);
    for l in &layouts {
        l.validate()?;
    }
    let mut losses = candidate_losses(rows, xr, d, &layouts, side);
    let mut cands: Vec<SideStrategy> = layouts.iter().map(|&l| SideStrategy::bare(l)).collect();
    if let Some((at, coded)) = crate::coded::coded_candidates(xr, d, config, d) {
        let coded_losses = crate::coded::coded_losses(rows, xr, d, &coded, side);
        losses.splice(at..at, coded_losses);
        cands.splice(at..at, coded);
    }
    let layouts: Vec<RecordLayout> = cands.iter().map(|c| c.layout).collect();
    let k = match (mosaickv_spec::query::attention_config(config, ctx), ctx) {
        (Some(att), Some(ctx)) => {
            let attn = crate::loss::attention_losses(rows, xr, rotation, &cands, side, ctx)?;
            rules::choose_candidate(&layouts, &attn, side, &att)
        }
        _ => rules::choose_candidate(&layouts, &losses, side, config),
    };
    let chosen = &cands[k];
    Ok(SideStrategy {
        rotation: mosaickv_spec::layout::trim_rotation(rotation, d, chosen.layout.kept_dims),
        fit_loss: losses[k],
        ..chosen.clone()
    })
}

/// SPEC 11.1 sums for rows `[n][d]` under an existing strategy (`total = K + T` per row, rows
/// added in order).
pub fn loss_sums(rows: &[f32], side: &SideStrategy) -> LossSums {
    let (d, dt) = (side.layout.head_dim, side.layout.kept_dims);
    let n = rows.len() / d;
    let mut xr = vec![0f64; n * dt];
    let rot = mosaickv_spec::layout::rotation_f32(&side.rotation);
    xr.par_chunks_mut(dt * ROWS_PER_TASK)
        .zip(rows.par_chunks(d * ROWS_PER_TASK))
        .for_each(|(o, x)| rotate_rows_f64(&rot, d, x, dt, o));
    let (dropped, total) = if side.layout.dtype == mosaickv_spec::ValueDtype::Coded {
        coded_loss_sums(rows, &xr, side)
    } else {
        loss_sums_rotated(rows, &xr, dt, &side.layout)
    };
    LossSums {
        dropped,
        total,
        spread: SpreadSums::of_rows(rows, d),
    }
}

/// SPEC 6.1 and 11.1 sums `(dropped, total)` of rows `[n][d]` with rotated coordinates `xr`
/// (`[n][Dt]`) under a coded side: each row's terms
/// ([`crate::coded::coded_row_loss_terms`]) in parallel, added in row order.
fn coded_loss_sums(rows: &[f32], xr: &[f64], side: &SideStrategy) -> (f64, f64) {
    let (d, dt) = (side.layout.head_dim, side.layout.kept_dims);
    let terms: Vec<(f64, f64)> = xr
        .par_chunks(dt.max(1))
        .zip(rows.par_chunks(d))
        .map(|(r, x)| crate::coded::coded_row_loss_terms(x, r, side))
        .collect();
    let (mut dropped, mut total) = (0f64, 0f64);
    for (a, b) in terms {
        dropped += a;
        total += b;
    }
    (dropped, total)
}

/// SPEC 11.1 for rows `[n][d]` under an existing strategy of side `which`.
pub fn loss_rows(rows: &[f32], side: &SideStrategy, which: Side) -> f64 {
    loss_sums(rows, side).loss(which)
}

/// SPEC 11.3: the block size from dense decoded keys `[n][dt]`:
/// `V(b) = (mean over blocks of sum_j var_block(k_j)) / sum_j var_segment(k_j)` (population, f64).
pub fn block_size_dense(keys: &[f32], dt: usize, config: &CompressConfig) -> usize {
    let sizes = &config.block_sizes;
    if sizes.len() == 1 {
        return sizes[0];
    }
    let n = keys.len() / dt.max(1);
    // Sum over dims of the population variance of `rows` (`[m][dt]`).
    let var_sum = |rows: &[f32]| -> f64 {
        let m = (rows.len() / dt) as f64;
        let mut total = 0f64;
        for j in 0..dt {
            let mean = rows.chunks_exact(dt).map(|r| r[j] as f64).sum::<f64>() / m;
            total += rows
                .chunks_exact(dt)
                .map(|r| (r[j] as f64 - mean).powi(2))
                .sum::<f64>()
                / m;
        }
        total
    };
    let den = if n == 0 { 0.0 } else { var_sum(keys) };
    let mut chosen = sizes[0];
    for &b in sizes {
        let blocks = n.div_ceil(b);
        let total: f64 = (0..blocks)
            .map(|k| var_sum(&keys[k * b * dt..((k + 1) * b).min(n) * dt]))
            .sum();
        let num = if blocks == 0 {
            0.0
        } else {
            total / blocks as f64
        };
        let v = if den == 0.0 {
            if num == 0.0 {
                0.0
            } else {
                f64::INFINITY
            }
        } else {
            num / den
        };
        if v <= config.variance_threshold {
            chosen = b;
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;
    use mosaickv_spec::ValueDtype;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// The one-pass search gives every candidate's loss bit for bit as the per-candidate
    /// path, on both lane paths (AVX2 where the machine has it, and portable), on rows with
    /// ties (repeated values, so group importances tie), constant rows (a quantized record's
    /// range 0, scale 0), zero rows (total 0) and without, for every value dtype, head_dim
    /// 32, 64 and 128, and a truncating configuration.
    #[test]
    fn candidate_losses_equal_per_candidate_losses() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let avx2 = crate::simd::Path::detect().runs_avx2();
        let cases = [
            (64usize, 300usize, 0u8),
            (64, 257, 1),
            (32, 40, 1),
            (128, 133, 0),
            (64, 70, 2),
        ];
        for &(d, n, kind) in &cases {
            let rows: Vec<f32> = (0..n * d)
                .map(|i| match kind {
                    1 => [0.5f32, -0.5, 1.0, 0.0][(i * 7 + i / d) % 4],
                    // constant rows, every fifth one zero, the rest random
                    2 if (i / d) % 3 == 0 => ((i / d) % 5) as f32 * 0.25,
                    _ => rng.gen_range(-3.0f32..3.0),
                })
                .collect();
            for (trunc, side) in [
                (0.0, Side::Key),
                (0.25, Side::Key),
                (0.0, Side::Value),
                (0.25, Side::Value),
            ] {
                let config = CompressConfig {
                    value_dtypes: vec![ValueDtype::F16, ValueDtype::Int8, ValueDtype::Int4],
                    truncate_fraction: trunc,
                    ..CompressConfig::default()
                };
                let rotation = rotation_from_covariance(&covariance(&rows, d), d);
                let mut xr = vec![0f64; n * d];
                let rot = mosaickv_spec::layout::rotation_f32(&rotation);
                rotate_rows_f64(&rot, d, &rows, d, &mut xr);
                let cands = rules::candidates(&config, d);
                assert!(cands.len() > 20);
                let slow: Vec<f64> = cands
                    .iter()
                    .map(|l| loss_rotated(&rows, &xr, d, l, side))
                    .collect();
                for path in [false, avx2] {
                    let fast = candidate_losses_on(path, &rows, &xr, d, &cands, side);
                    for ((l, f), s) in cands.iter().zip(&fast).zip(&slow) {
                        assert_eq!(f.to_bits(), s.to_bits(), "avx2 {path}, {l:?}: {f} vs {s}");
                    }
                }
            }
        }
    }
}
