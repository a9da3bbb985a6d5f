//! Strategy fitting, encoding and block metadata (SPEC.md sections 3-7, 11),
//! written for throughput but producing the spec's exact bytes: every f64 sum
//! runs over the same index in the same ascending order as the spec's
//! definition, with separate multiply and add (Rust never contracts to FMA).

use half::f16;
use mosaickv_spec::layout::{
    dequantize, quantize_values, read_code, record_quant, write_quantized,
};
use mosaickv_spec::{
    rules, BlockMeta, CompressConfig, MosaicError, PackedRows, RecordLayout, Result, Side,
    SideStrategy,
};
use nalgebra::{DMatrix, SymmetricEigen};
use rayon::prelude::*;

/// Rows per rayon task when encoding.
const ROWS_PER_TASK: usize = 256;

/// f64 -> f16 rounded once, to nearest, ties to even (SPEC 5 step 1). `half::f16::from_f64`
/// goes through f32 on F16C machines (two roundings), so this is done on the bits.
/// Zeros keep their sign, |x| >= 65520 gives +-Inf, NaN stays NaN.
#[inline]
pub fn f16_from_f64(x: f64) -> f16 {
    let b = x.to_bits();
    let sign = ((b >> 48) & 0x8000) as u16;
    let a = b & 0x7fff_ffff_ffff_ffff;
    if a >= 0x7ff0_0000_0000_0000 {
        return f16::from_f64(x); // Inf / NaN: no rounding involved
    }
    if f64::from_bits(a) >= 65520.0 {
        return f16::from_bits(sign | 0x7c00);
    }
    let e = (a >> 52) as i32 - 1023;
    if e >= -14 {
        let mant = a & ((1u64 << 52) - 1);
        let mut h = (((e + 15) as u64) << 10) | (mant >> 42);
        let rem = mant & ((1u64 << 42) - 1);
        let half = 1u64 << 41;
        if rem > half || (rem == half && h & 1 == 1) {
            h += 1; // a carry into the exponent is the correct next binade
        }
        f16::from_bits(sign | h as u16)
    } else {
        // Subnormal f16 range: multiples of 2^-24 (the scaling is exact).
        let m = (f64::from_bits(a) * 16_777_216.0).round_ties_even();
        f16::from_bits(sign | m as u16)
    }
}

/// The exact f64 value of an f16, from its bits (what `half`'s `to_f64` gives, without its
/// runtime dispatch, so it inlines into the loss search's loops).
#[inline]
pub fn f16_to_f64(h: f16) -> f64 {
    let b = h.to_bits();
    let sign = u64::from(b >> 15) << 63;
    let exp = (b >> 10) & 0x1f;
    let mant = u64::from(b & 0x3ff);
    match exp {
        // zero and subnormals: mant * 2^-24 (exact)
        0 => {
            let m = (mant as f64) * (1.0 / 16_777_216.0);
            if sign != 0 {
                -m
            } else {
                m
            }
        }
        0x1f if mant == 0 => f64::from_bits(sign | 0x7ff0_0000_0000_0000),
        0x1f => f64::NAN,
        _ => f64::from_bits(sign | (u64::from(exp) + 1008) << 52 | mant << 42),
    }
}

/// SPEC 3 step 1: `C = sum_i x_i x_i^T` in f64, ascending i, `d x d` row-major.
pub fn covariance(rows: &[f32], d: usize) -> Vec<f64> {
    let mut c = vec![0f64; d * d];
    #[cfg(target_arch = "x86_64")]
    if crate::simd::Path::detect().runs_avx2() {
        // SAFETY: avx2 detected; the function only indexes within `rows` and `c`.
        unsafe { covariance_avx2(rows, d, &mut c) };
        mirror(&mut c, d);
        return c;
    }
    covariance_body(rows, d, &mut c);
    mirror(&mut c, d);
    c
}

#[inline(always)]
fn covariance_body(rows: &[f32], d: usize, c: &mut [f64]) {
    let mut x = vec![0f64; d];
    for row in rows.chunks_exact(d) {
        for (xi, &r) in x.iter_mut().zip(row) {
            *xi = r as f64;
        }
        for a in 0..d {
            let xa = x[a];
            let ca = &mut c[a * d..a * d + a + 1];
            for (cb, &xb) in ca.iter_mut().zip(&x[..=a]) {
                *cb += xa * xb;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn covariance_avx2(rows: &[f32], d: usize, c: &mut [f64]) {
    covariance_body(rows, d, c)
}

fn mirror(c: &mut [f64], d: usize) {
    for a in 0..d {
        for b in a + 1..d {
            c[a * d + b] = c[b * d + a];
        }
    }
}

/// SPEC 3 steps 2-4: eigenvectors of C sorted by eigenvalue descending (stable),
/// sign-normalized, as a row-major f16 `d x d` matrix (columns = eigenvectors), each
/// element rounded once from f64.
pub fn rotation_from_covariance(c: &[f64], d: usize) -> Vec<f16> {
    let mut r = vec![f16::ZERO; d * d];
    if c.iter().all(|&x| x == 0.0) {
        for i in 0..d {
            r[i * d + i] = f16::ONE;
        }
        return r;
    }
    let m = DMatrix::from_row_slice(d, d, c);
    let eig = SymmetricEigen::new(m);
    let vals = eig.eigenvalues;
    let vecs = eig.eigenvectors;
    let mut order: Vec<usize> = (0..d).collect();
    order.sort_by(|&a, &b| {
        vals[b]
            .partial_cmp(&vals[a])
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    for (j, &k) in order.iter().enumerate() {
        let col = vecs.column(k);
        let mut best = 0usize;
        for i in 1..d {
            if col[i].abs() > col[best].abs() {
                best = i;
            }
        }
        let s = if col[best] < 0.0 { -1.0 } else { 1.0 };
        for i in 0..d {
            r[i * d + j] = f16_from_f64(s * col[i]);
        }
    }
    r
}

/// SPEC 5 step 1 (and 11.1): `out[j] = sum_i R[i][j] x_i` in f64, ascending i, for `j < out.len()`.
/// `rot` is row-major `d x w` with `w = rot.len() / d` (`Dt` stored, `d` while fitting).
#[inline(always)]
fn rotate_f64_body(rot: &[f32], d: usize, x: &[f32], out: &mut [f64]) {
    let dims = out.len();
    let w = rot.len() / d;
    out.fill(0.0);
    for i in 0..d {
        let xi = x[i] as f64;
        let row = &rot[i * w..i * w + dims];
        for (o, &r) in out.iter_mut().zip(row) {
            *o += r as f64 * xi;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rotate_f64_avx2(rot: &[f32], d: usize, rows: &[f32], dims: usize, out: &mut [f64]) {
    for (x, o) in rows.chunks_exact(d).zip(out.chunks_exact_mut(dims)) {
        rotate_f64_body(rot, d, x, o);
    }
}

/// Rotates every row of `rows` (`[n][d]`) to its first `dims` rotated coordinates in f64.
/// `rot` is the stored f16 rotation widened to f32 (`spec::layout::rotation_f32`, exact),
/// once per call site rather than once per chunk of rows.
pub fn rotate_rows_f64(rot: &[f32], d: usize, rows: &[f32], dims: usize, out: &mut [f64]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::Path::detect().runs_avx2() {
        // SAFETY: avx2 detected; all indexing is bounds-checked slice access.
        unsafe { rotate_f64_avx2(rot, d, rows, dims, out) };
        return;
    }
    for (x, o) in rows.chunks_exact(d).zip(out.chunks_exact_mut(dims)) {
        rotate_f64_body(rot, d, x, o);
    }
}

/// SPEC 5 step 2: each group's importance, the f32 sum of its f16 values' squares in dim
/// order, into `imp`; returns the number of groups.
fn group_importances(y: &[f16], g: usize, imp: &mut [f32]) -> usize {
    importances_by(y.len(), g, imp, |j| y[j].to_f32())
}

/// [`group_importances`] of `n` values, value `j` (an f16, as f32: exact) given by `value`.
#[inline(always)]
fn importances_by(n: usize, g: usize, imp: &mut [f32], value: impl Fn(usize) -> f32) -> usize {
    let groups = n / g;
    for (k, s) in imp[..groups].iter_mut().enumerate() {
        let mut acc = 0f32;
        for j in k * g..(k + 1) * g {
            let f = value(j);
            acc += f * f;
        }
        *s = acc;
    }
    groups
}

/// SPEC 5 step 3's order of groups: higher importance first, ties to the lower index.
fn importance_order(imp: &[f32], a: &u16, b: &u16) -> std::cmp::Ordering {
    let (ia, ib) = (imp[*a as usize], imp[*b as usize]);
    ib.partial_cmp(&ia)
        .unwrap_or(std::cmp::Ordering::Equal)
        .then(a.cmp(b))
}

/// SPEC 5 steps 2-3: which groups a row keeps, from its f16-rounded rotated values `y` (length Dt).
/// Writes a keep flag per group into `keep`; `scratch` holds group indices.
fn select_groups(
    y: &[f16],
    g: usize,
    kept_groups: usize,
    imp: &mut [f32],
    order: &mut [u16],
    keep: &mut [bool],
) {
    let groups = group_importances(y, g, imp);
    if kept_groups >= groups {
        keep[..groups].fill(true);
        return;
    }
    for (k, o) in order.iter_mut().enumerate().take(groups) {
        *o = k as u16;
    }
    order[..groups].select_nth_unstable_by(kept_groups - 1, |a, b| importance_order(imp, a, b));
    keep[..groups].fill(false);
    for &k in &order[..kept_groups] {
        keep[k as usize] = true;
    }
}

/// Packs one record (SPEC.md section 6) from a row's rotated coordinates (at least Dt of them).
/// Returns the first rotated dim whose kept value overflows f16 (SPEC.md section 14), if any;
/// the record's bytes are then meaningless and the caller reports the error. Int8/int4 records
/// get their scale and codes from [`mosaickv_spec::layout::quantize_values`] (the one host
/// implementation of the rounding) over the kept f16 values.
fn pack_record(
    x: &[f64],
    layout: &RecordLayout,
    out: &mut [u8],
    b: &mut PackBufs,
) -> Option<usize> {
    let dt = layout.kept_dims;
    let g = layout.group_size;
    for j in 0..dt {
        b.y[j] = f16_from_f64(x[j]);
    }
    select_groups(
        &b.y[..dt],
        g,
        layout.kept_groups(),
        &mut b.imp,
        &mut b.order,
        &mut b.keep,
    );
    out.fill(0);
    let mut overflow = None;
    b.kv.clear();
    for k in 0..layout.groups() {
        if b.keep[k] {
            out[k / 8] |= 1 << (k % 8);
            for (j, &v) in (k * g..).zip(&b.y[k * g..(k + 1) * g]) {
                if !v.is_finite() && overflow.is_none() {
                    overflow = Some(j);
                }
                b.kv.push(v);
            }
        }
    }
    let bb = layout.bitmap_bytes();
    if layout.dtype.is_quantized() {
        if overflow.is_none() {
            let codes = &mut b.codes[..layout.r];
            let params = quantize_values(&b.kv, layout.dtype, codes);
            write_quantized(layout.dtype, params, codes, &mut out[bb..]);
        }
    } else {
        for (o, v) in out[bb..bb + 2 * layout.r].chunks_exact_mut(2).zip(&b.kv) {
            o.copy_from_slice(&v.to_le_bytes());
        }
    }
    overflow
}

/// SPEC 6: the decoded values of a row's kept f16 values `kv` (ascending dims) under an
/// int8/int4 layout, `m + code * s` (one f32 rounding), into `out`; the codes go to `codes`.
pub fn dequantize_kept(kv: &[f16], layout: &RecordLayout, codes: &mut [u8], out: &mut Vec<f32>) {
    let codes = &mut codes[..kv.len()];
    let p = quantize_values(kv, layout.dtype, codes);
    out.clear();
    out.extend(codes.iter().map(|&c| dequantize(p, c)));
}

/// SPEC 6: the decoded kept values of a (valid) int8/int4 record, ascending dims, into `out`.
pub fn record_dequantized(rec: &[u8], layout: &RecordLayout, out: &mut Vec<f32>) {
    let p = record_quant(layout, rec);
    let v = &rec[layout.values_offset()..];
    out.clear();
    out.extend((0..layout.r).map(|i| dequantize(p, read_code(layout.dtype, v, i))));
}

/// The first overflow of rows packed in chunks of [`ROWS_PER_TASK`]: `(row in chunk, dim)`
/// per chunk, in chunk order, turned into SPEC.md section 14's error (flat index
/// `row * Dt + dim`, the first in row order, as the reference reports it).
fn first_overflow(per_chunk: Vec<Option<(usize, usize)>>, layout: &RecordLayout) -> Result<()> {
    let first = per_chunk
        .into_iter()
        .enumerate()
        .find_map(|(c, o)| o.map(|(i, j)| (c * ROWS_PER_TASK + i, j)));
    match first {
        Some((row, j)) => Err(rules::rotated_overflow(row, j, layout.kept_dims)),
        None => Ok(()),
    }
}

/// Per-thread buffers for packing.
struct PackBufs {
    y: Vec<f16>,
    imp: Vec<f32>,
    order: Vec<u16>,
    keep: Vec<bool>,
    /// The kept f16 values of the row, ascending dims.
    kv: Vec<f16>,
    /// Their int8/int4 codes.
    codes: Vec<u8>,
    /// Their decoded values (the loss of a quantized layout).
    deq: Vec<f32>,
}

impl PackBufs {
    fn new(d: usize) -> Self {
        Self {
            y: vec![f16::ZERO; d],
            imp: vec![0.0; d],
            order: vec![0; d],
            keep: vec![false; d],
            kv: Vec::with_capacity(d),
            codes: vec![0; d],
            deq: Vec::with_capacity(d),
        }
    }
}

/// Packs rows whose rotated coordinates are given (`[n][stride]`, stride >= Dt), in parallel.
/// A kept value beyond the f16 range is `NonFinite` (SPEC.md section 14).
pub fn pack_rotated(rot_rows: &[f64], stride: usize, layout: &RecordLayout) -> Result<PackedRows> {
    let n = rot_rows.len() / stride.max(1);
    let rb = layout.record_bytes();
    let mut bytes = vec![0u8; n * rb];
    let d = layout.head_dim;
    let overflows: Vec<Option<(usize, usize)>> = bytes
        .par_chunks_mut(rb * ROWS_PER_TASK)
        .zip(rot_rows.par_chunks(stride * ROWS_PER_TASK))
        .map(|(out, x)| {
            let mut b = PackBufs::new(d);
            let mut first = None;
            for (i, (o, row)) in out
                .chunks_exact_mut(rb)
                .zip(x.chunks_exact(stride))
                .enumerate()
            {
                let bad = pack_record(row, layout, o, &mut b);
                if let (None, Some(j)) = (first, bad) {
                    first = Some((i, j));
                }
            }
            first
        })
        .collect();
    first_overflow(overflows, layout)?;
    Ok(PackedRows { count: n, bytes })
}

/// SPEC 5-6: rotate and pack rows `[n][d]` with a side strategy (parallel over row chunks).
/// A kept value beyond the f16 range is `NonFinite` (SPEC.md section 14).
pub fn encode_rows(rows: &[f32], side: &SideStrategy) -> Result<PackedRows> {
    let layout = side.layout;
    let d = layout.head_dim;
    let dt = layout.kept_dims;
    let n = rows.len() / d;
    let rb = layout.record_bytes();
    let mut bytes = vec![0u8; n * rb];
    let rot = mosaickv_spec::layout::rotation_f32(&side.rotation);
    let overflows: Vec<Option<(usize, usize)>> = bytes
        .par_chunks_mut(rb * ROWS_PER_TASK)
        .zip(rows.par_chunks(d * ROWS_PER_TASK))
        .map(|(out, x)| {
            let mut b = PackBufs::new(d);
            let mut xr = vec![0f64; x.len() / d * dt];
            rotate_rows_f64(&rot, d, x, dt, &mut xr);
            let mut first = None;
            for (i, (o, row)) in out
                .chunks_exact_mut(rb)
                .zip(xr.chunks_exact(dt))
                .enumerate()
            {
                let bad = pack_record(row, &layout, o, &mut b);
                if let (None, Some(j)) = (first, bad) {
                    first = Some((i, j));
                }
            }
            first
        })
        .collect();
    first_overflow(overflows, &layout)?;
    Ok(PackedRows { count: n, bytes })
}

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

/// SPEC 5 steps 2-3 for every kept-group count at once: the groups of a row's f16-rounded
/// rotated values (length Dt, given as their exact f64 values `yv`) ranked by importance,
/// most important first, ties by the lower index (the order [`select_groups`] uses). The
/// groups a record keeping `k` of them keeps are `order[..k]`: under this total order the `k`
/// largest form one set, the one `select_groups` finds.
///
/// The importances are sums of squares, so `+0` or positive (or NaN, only from a NaN value):
/// for those the order is that of the key `(!bits, index)`, sorted as integers, which is
/// what the comparator sort would give and several times cheaper; a NaN takes the comparator.
fn rank_groups(yv: &[f64], g: usize, imp: &mut [f32], order: &mut [u16], keys: &mut [u64]) {
    // SPEC 5 step 2 from the f16 values held as f64 (`as f32` is exact for them).
    let groups = importances_by(yv.len(), g, imp, |j| yv[j] as f32);
    if imp[..groups].iter().all(|v| !v.is_nan()) {
        for (k, key) in keys[..groups].iter_mut().enumerate() {
            *key = (u64::from(!imp[k].to_bits()) << 16) | k as u64;
        }
        keys[..groups].sort_unstable();
        for (o, key) in order[..groups].iter_mut().zip(&keys[..groups]) {
            *o = *key as u16;
        }
        return;
    }
    for (k, o) in order[..groups].iter_mut().enumerate() {
        *o = k as u16;
    }
    order[..groups].sort_unstable_by(|a, b| importance_order(imp, a, b));
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
) -> Vec<f64> {
    let avx2 = crate::simd::Path::detect().runs_avx2();
    candidate_losses_on(avx2, rows, rot_rows, w, cands)
}

/// [`candidate_losses`] with the lane loops compiled for AVX2 (`avx2`, detected by the
/// caller) or portable.
fn candidate_losses_on(
    avx2: bool,
    rows: &[f32],
    rot_rows: &[f64],
    w: usize,
    cands: &[RecordLayout],
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
    sums.into_iter().map(loss_of).collect()
}

/// SPEC 11.1: `dropped / total`, 0 when the denominator is 0.
pub fn loss_of(sums: (f64, f64)) -> f64 {
    if sums.1 == 0.0 {
        0.0
    } else {
        sums.0 / sums.1
    }
}

/// SPEC 11.1: relative dropped energy of rows `[n][d]` given their rotated coordinates
/// (see [`loss_sums_rotated`]).
pub fn loss_rotated(rows: &[f32], rot_rows: &[f64], w: usize, layout: &RecordLayout) -> f64 {
    loss_of(loss_sums_rotated(rows, rot_rows, w, layout))
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
    let cands = rules::candidates(config, d);
    for l in &cands {
        l.validate()?;
    }
    let losses = candidate_losses(rows, &xr, d, &cands);
    let k = match (mosaickv_spec::query::attention_config(config, ctx), ctx) {
        (Some(att), Some(ctx)) => {
            let attn = crate::loss::attention_losses(rows, &xr, &rotation, &cands, side, ctx)?;
            rules::choose_candidate(&cands, &attn, side, &att)
        }
        _ => rules::choose_candidate(&cands, &losses, side, config),
    };
    Ok((
        SideStrategy {
            layout: cands[k],
            rotation: mosaickv_spec::layout::trim_rotation(&rotation, d, cands[k].kept_dims),
            fit_loss: losses[k],
        },
        xr,
    ))
}

/// SPEC 11.1 sums `(dropped, total)` for rows `[n][d]` under an existing strategy
/// (`total = K + T` per row, rows added in order).
pub fn loss_sums(rows: &[f32], side: &SideStrategy) -> (f64, f64) {
    let (d, dt) = (side.layout.head_dim, side.layout.kept_dims);
    let n = rows.len() / d;
    let mut xr = vec![0f64; n * dt];
    let rot = mosaickv_spec::layout::rotation_f32(&side.rotation);
    xr.par_chunks_mut(dt * ROWS_PER_TASK)
        .zip(rows.par_chunks(d * ROWS_PER_TASK))
        .for_each(|(o, x)| rotate_rows_f64(&rot, d, x, dt, o));
    loss_sums_rotated(rows, &xr, dt, &side.layout)
}

/// SPEC 11.1 for rows `[n][d]` under an existing strategy.
pub fn loss_rows(rows: &[f32], side: &SideStrategy) -> f64 {
    loss_of(loss_sums(rows, side))
}

/// SPEC 6: decodes records to dense rotated rows `[n][Dt]` (validating them first).
pub fn decode_rows(packed: &PackedRows, layout: &RecordLayout) -> Result<Vec<f32>> {
    packed.validate(layout)?;
    let out = decode_trusted(packed, layout);
    if let Some(i) = out.iter().position(|x| !x.is_finite()) {
        return Err(MosaicError::NonFinite {
            what: "decoded values",
            index: i,
        });
    }
    Ok(out)
}

/// SPEC 6 decode of records this crate wrote itself (no validation, no finiteness check).
pub fn decode_trusted(packed: &PackedRows, layout: &RecordLayout) -> Vec<f32> {
    let dt = layout.kept_dims;
    let dp = dt.div_ceil(8) * 8;
    let mut tmp = vec![0f32; packed.count * dp];
    if layout.dtype.is_quantized() {
        crate::simd::Path::Portable.expand_records_q(
            &packed.bytes,
            packed.count,
            layout,
            dp,
            &mut tmp,
        );
    } else {
        crate::simd::Path::Portable.expand_records(
            &packed.bytes,
            0,
            packed.count,
            layout.record_bytes(),
            layout.bitmap_bytes(),
            layout.group_size,
            dt,
            layout.r,
            dp,
            &mut tmp,
        );
    }
    let mut out = vec![0f32; packed.count * dt];
    for (o, t) in out
        .chunks_exact_mut(dt.max(1))
        .zip(tmp.chunks_exact(dp.max(1)))
    {
        o.copy_from_slice(&t[..dt]);
    }
    out
}

/// SPEC 7: block min/max over dense decoded keys `[n][dt]`, stored as int8
/// bounds with one f32 scale per block, rounded outward ([`BlockMeta::push_block`]).
pub fn block_meta_dense(keys: &[f32], dt: usize, block_size: usize) -> BlockMeta {
    let n = keys.len() / dt.max(1);
    let blocks = n.div_ceil(block_size);
    let mut meta = BlockMeta::empty(block_size, dt);
    meta.min.reserve(blocks * dt);
    meta.max.reserve(blocks * dt);
    meta.scale.reserve(blocks);
    let mut lo = vec![0f32; dt];
    let mut hi = vec![0f32; dt];
    for b in 0..blocks {
        let rows = &keys[b * block_size * dt..((b + 1) * block_size).min(n) * dt];
        lo.fill(f32::INFINITY);
        hi.fill(f32::NEG_INFINITY);
        for row in rows.chunks_exact(dt) {
            for j in 0..dt {
                lo[j] = lo[j].min(row[j]);
                hi[j] = hi[j].max(row[j]);
            }
        }
        meta.push_block(&lo, &hi, rows.len() / dt.max(1));
    }
    meta
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

    /// The bit-level f16 -> f64 conversion is `half`'s, for every f16 (NaN for NaN).
    #[test]
    fn f16_to_f64_is_exact_for_every_f16() {
        for b in 0..=u16::MAX {
            let h = f16::from_bits(b);
            let (ours, theirs) = (f16_to_f64(h), h.to_f64());
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{b:#x}");
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{b:#x}");
            }
        }
    }

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
            for trunc in [0.0, 0.25] {
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
                    .map(|l| loss_rotated(&rows, &xr, d, l))
                    .collect();
                for path in [false, avx2] {
                    let fast = candidate_losses_on(path, &rows, &xr, d, &cands);
                    for ((l, f), s) in cands.iter().zip(&fast).zip(&slow) {
                        assert_eq!(f.to_bits(), s.to_bits(), "avx2 {path}, {l:?}: {f} vs {s}");
                    }
                }
            }
        }
    }
}
