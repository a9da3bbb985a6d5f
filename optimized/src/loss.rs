//! SPEC.md section 11.1.1 (attention loss), for throughput: each candidate's
//! records are packed from the segment's rotated rows (computed once, not per
//! candidate), decoded and rotated back in parallel, and every row's terms are
//! computed with the spec's operation order (f64, ascending indices, separate
//! multiply and add), then added in row order, so the losses equal the
//! reference's bit for bit and both backends choose the same strategy. The
//! per-row sums of one row run side by side (the d sums of `e = x - R k^`, the
//! d sums of `M e`) rather than one after another: each sum still adds the same
//! terms in the same order, so this changes the speed, not the bits.

use crate::packed;
use mosaickv_spec::query::LossContext;
use mosaickv_spec::{MosaicError, PackedRows, Result, Side, SideStrategy};
use rayon::prelude::*;

/// Rows per rayon task.
const ROWS_PER_TASK: usize = 256;

/// `e = x - R k^` of one row: `e_i = x_i - sum_j R_ij k_j` in f64, ascending j, for all i at
/// once. `rot_t` is `R` transposed (`[dt][d]`, f64), so step j adds one contiguous column to
/// every `e_i`: each `e_i` sees the same products added in the same order as the scalar form
/// `s = 0; for j { s += R_ij * k_j }; e_i = x_i - s`, while the d independent sums run side by
/// side (and vectorize) instead of one dependent chain per i.
#[inline(always)]
fn row_error_body(x: &[f32], k: &[f32], rot_t: &[f64], e: &mut [f64]) {
    let d = e.len();
    e.fill(0.0);
    for (j, &kj) in k.iter().enumerate() {
        let kj = f64::from(kj);
        for (s, &rij) in e.iter_mut().zip(&rot_t[j * d..(j + 1) * d]) {
            *s += rij * kj;
        }
    }
    for (s, &xi) in e.iter_mut().zip(x) {
        *s = f64::from(xi) - *s;
    }
}

/// `v^T M v = sum_a v_a t_a` with `t_a = sum_b M_ab v_b`, ascending a and b. `m_t` is `M`
/// transposed, so the `t_a` are built side by side, column b at step b (the same additions per
/// `t_a` as the row form); `t` is scratch of length d.
#[inline(always)]
fn quadratic_body(m_t: &[f64], v: &[f64], t: &mut [f64]) -> f64 {
    let d = v.len();
    t.fill(0.0);
    for (b, &vb) in v.iter().enumerate() {
        for (ta, &mab) in t.iter_mut().zip(&m_t[b * d..(b + 1) * d]) {
            *ta += mab * vb;
        }
    }
    let mut q = 0f64;
    for (&va, &ta) in v.iter().zip(t.iter()) {
        q += va * ta;
    }
    q
}

/// What every task of one loss shares: the head dimension, the rotation's first `Dt` columns
/// transposed (`[Dt][d]`, f64) and, for keys, the query moment transposed (`[d][d]`).
#[derive(Clone, Copy)]
struct Shared<'a> {
    d: usize,
    rot_t: &'a [f64],
    m_t: Option<&'a [f64]>,
}

/// One task's rows: the errors `[rows][d]` of `x` (`[rows][d]`) against their decoded `k`
/// (`[rows][dt]`), and for keys each row's `e^T M e` into `terms`.
#[inline(always)]
fn task_body(c: Shared<'_>, x: &[f32], k: &[f32], out: &mut [f64], terms: &mut [f64]) {
    let dt = c.rot_t.len() / c.d;
    let mut t = vec![0f64; c.d];
    for (((e, x), k), q) in out
        .chunks_exact_mut(c.d)
        .zip(x.chunks_exact(c.d))
        .zip(k.chunks_exact(dt))
        .zip(terms.iter_mut())
    {
        row_error_body(x, k, c.rot_t, e);
        if let Some(m_t) = c.m_t {
            *q = quadratic_body(m_t, e, &mut t);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn task_avx512(c: Shared<'_>, x: &[f32], k: &[f32], out: &mut [f64], terms: &mut [f64]) {
    task_body(c, x, k, out, terms)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn task_avx2(c: Shared<'_>, x: &[f32], k: &[f32], out: &mut [f64], terms: &mut [f64]) {
    task_body(c, x, k, out, terms)
}

/// [`task_body`] compiled for the detected path (the same operations and order on every path:
/// separate multiplies and adds, no FMA, so the bits do not depend on it).
fn task(
    path: crate::simd::Path,
    c: Shared<'_>,
    x: &[f32],
    k: &[f32],
    out: &mut [f64],
    terms: &mut [f64],
) {
    #[cfg(target_arch = "x86_64")]
    match path {
        // SAFETY: the path's features were detected; all indexing is bounds-checked.
        crate::simd::Path::Avx512 => return unsafe { task_avx512(c, x, k, out, terms) },
        crate::simd::Path::Avx2 => return unsafe { task_avx2(c, x, k, out, terms) },
        crate::simd::Path::Portable => {}
    }
    let _ = path;
    task_body(c, x, k, out, terms)
}

/// `[rows][cols]` row-major (f32 or f64) as `[cols][rows]` f64.
fn transposed<T: Copy + Into<f64>>(m: &[T], rows: usize, cols: usize) -> Vec<f64> {
    let mut t = vec![0f64; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            t[j * rows + i] = m[i * cols + j].into();
        }
    }
    t
}

/// The weights of the segment's rows, `ShapeMismatch` when the statistics do not cover them.
fn row_weights(ctx: &LossContext<'_>, n: usize) -> Result<Vec<f64>> {
    let (w, _) =
        ctx.stats
            .weights(ctx.head, ctx.start, n)
            .ok_or_else(|| MosaicError::ShapeMismatch {
                what: "query stats",
                expected: format!("weights for tokens {}..{}", ctx.start, ctx.start + n),
                got: format!("{} tokens", ctx.stats.tokens()),
            })?;
    Ok(w)
}

/// The loss of rows `[n][d]` packed as `packed` (under `side`): decode, rotate back with
/// `rot_t` (the first `Dt` columns of the rotation, transposed: `[Dt][d]` f64), then the key
/// or value form. `m_t` is the transposed query moment for keys, `None` for values.
fn loss_of_packed(
    rows: &[f32],
    packed: &PackedRows,
    side: &SideStrategy,
    rot_t: &[f64],
    m_t: Option<&[f64]>,
    w: &[f64],
    output_sq: f64,
) -> f64 {
    let (d, dt) = (side.layout.head_dim, side.layout.kept_dims);
    let n = rows.len() / d;
    let dense = packed::decode_trusted(packed, side);
    let path = crate::simd::Path::detect();
    // Every row's error (and key term) in parallel; the sums below run over the rows in order.
    let mut errors = vec![0f64; n * d];
    let mut terms = vec![0f64; n];
    errors
        .par_chunks_mut(d * ROWS_PER_TASK)
        .zip(terms.par_chunks_mut(ROWS_PER_TASK))
        .zip(rows.par_chunks(d * ROWS_PER_TASK))
        .zip(dense.par_chunks(dt * ROWS_PER_TASK))
        .for_each(|(((out, q), x), k)| task(path, Shared { d, rot_t, m_t }, x, k, out, q));
    match m_t {
        Some(_) => {
            let (mut num, mut den) = (0f64, 0f64);
            for (q, &wt) in terms.iter().zip(w) {
                num += wt * q;
                den += wt;
            }
            if den == 0.0 {
                0.0
            } else {
                num / (d as f64 * den)
            }
        }
        None => {
            let mut se = vec![0f64; d];
            for (e, &wt) in errors.chunks_exact(d).zip(w) {
                for i in 0..d {
                    se[i] += wt * e[i];
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
    }
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
    let w = row_weights(&ctx, rows.len() / d)?;
    let packed = packed::encode_rows(rows, side_strategy)?;
    let rot_t = transposed(&side_strategy.rotation, d, dt);
    let m_t = (side == Side::Key).then(|| transposed(ctx.stats.moment(ctx.head), d, d));
    let o2 = ctx.stats.output_sq[ctx.head];
    Ok(loss_of_packed(
        rows,
        &packed,
        side_strategy,
        &rot_t,
        m_t.as_deref(),
        &w,
        o2,
    ))
}

/// The attention loss of every candidate (in parallel), rotation `rotation` (`D x D`), with
/// `xr` the rows' rotated coordinates under it (`[n][D]` f64, as `rotation::rotate_rows_f64`
/// writes them). A candidate's records are packed from the first `Dt` of them
/// (`packed::pack_rotated`): the same bytes as `packed::encode_rows` with the trimmed
/// rotation, whose coordinate j is the same sum, without rotating every row again per
/// candidate. Each loss equals [`attention_loss`] of that candidate bit for bit.
pub fn attention_losses(
    rows: &[f32],
    xr: &[f64],
    rotation: &[half::f16],
    candidates: &[SideStrategy],
    side: Side,
    ctx: LossContext<'_>,
) -> Result<Vec<f64>> {
    let Some(d) = candidates.first().map(|c| c.layout.head_dim) else {
        return Ok(Vec::new());
    };
    let n = rows.len() / d;
    let w = row_weights(&ctx, n)?;
    // column j of the rotation at rows j*d..(j+1)*d: a candidate's Dt columns are a prefix
    let rot_t = transposed(rotation, d, d);
    let m_t = (side == Side::Key).then(|| transposed(ctx.stats.moment(ctx.head), d, d));
    let o2 = ctx.stats.output_sq[ctx.head];
    candidates
        .par_iter()
        .map(|cand| {
            let packed = packed::pack_rotated(xr, d, cand)?;
            let rt = &rot_t[..cand.layout.kept_dims * d];
            Ok(loss_of_packed(
                rows,
                &packed,
                cand,
                rt,
                m_t.as_deref(),
                &w,
                o2,
            ))
        })
        .collect::<Vec<_>>()
        .into_iter()
        .collect()
}
