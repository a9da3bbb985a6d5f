//! # mosaickv-conformance: the reference against every backend
//!
//! One suite, written once over `&dyn Backend`, stamped out per backend with
//! [`conformance_suite!`]. Each check runs a stage on identical inputs in the
//! reference and in the candidate and compares: bytes and selections exactly,
//! floating outputs within [`tolerances`]. A backend that cannot run here is
//! reported as skipped with its reason, never as passed.
//!
//! Compression *quality* (how far MosaicKV is from full attention) is not
//! checked here; that lives in the reference's own tests.

pub mod tolerances;

use mosaickv_reference::ReferenceBackend;
use mosaickv_spec::{
    Availability, Backend, CompressConfig, CompressedCache, KvCache, KvShape, MosaicError,
    PackedRows, Selection, Side, SideStrategy,
};
use ndarray::{Array2, Array3, ArrayView2, Axis};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tolerances::*;

/// Outcome of one check: `Err` carries a human-readable description of the mismatch.
pub type Check = Result<(), String>;

/// Head dims the properties sweep (issue 3).
pub const HEAD_DIMS: [usize; 6] = [32, 64, 80, 96, 128, 256];
/// GQA ratios the properties sweep.
pub const GQA_RATIOS: [usize; 4] = [1, 3, 4, 8];

/// Returns the backend if it can run here, or the reason it cannot.
pub fn available(backend: Box<dyn Backend>) -> Result<Box<dyn Backend>, String> {
    match backend.availability() {
        Availability::Available => Ok(backend),
        Availability::Unavailable(reason) => Err(reason),
    }
}

/// Prints the standard skip line (tests then return early; the harness shows them as passed,
/// so the line is the record; `skipped_backends` in the CPU suite also lists them).
pub fn report_skip(backend: &str, test: &str, reason: &str) {
    eprintln!("SKIPPED {backend}::{test}: {reason}");
}

/// Rows `[n, d]` with structure: every direction of a random mixing matrix
/// with a decaying scale (a full-rank, decaying spectrum), two outlier
/// channels, and a little noise. Deterministic from `seed`.
pub fn structured_rows(n: usize, d: usize, seed: u64) -> Array2<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mix: Vec<f32> = (0..d * d)
        .map(|_| rng.gen_range(-1.0..1.0) / (d as f32).sqrt())
        .collect();
    let scale: Vec<f32> = (0..d).map(|c| 4.0 / (1.0 + c as f32)).collect();
    let out1 = rng.gen_range(0..d);
    let out2 = (out1 + d / 2) % d;
    let mut rows = Array2::zeros((n, d));
    let mut z = vec![0.0f32; d];
    for mut row in rows.axis_iter_mut(Axis(0)) {
        for (c, zc) in z.iter_mut().enumerate() {
            *zc = rng.gen_range(-1.0f32..1.0) * scale[c];
        }
        for j in 0..d {
            let mut v = rng.gen_range(-0.05f32..0.05);
            for (c, zc) in z.iter().enumerate() {
                v += zc * mix[c * d + j];
            }
            row[j] = v;
        }
        row[out1] += 6.0;
        row[out2] -= 3.0 * rng.gen_range(0.5f32..1.5);
    }
    rows
}

/// K/V `[tokens, kv_heads, head_dim]` built from [`structured_rows`], one seed per head and side.
pub fn structured_kv(
    tokens: usize,
    kv_heads: usize,
    head_dim: usize,
    seed: u64,
) -> (Array3<f32>, Array3<f32>) {
    let mut k = Array3::zeros((tokens, kv_heads, head_dim));
    let mut v = Array3::zeros((tokens, kv_heads, head_dim));
    for h in 0..kv_heads {
        let kr = structured_rows(
            tokens,
            head_dim,
            seed.wrapping_mul(31).wrapping_add(2 * h as u64),
        );
        let vr = structured_rows(
            tokens,
            head_dim,
            seed.wrapping_mul(31).wrapping_add(2 * h as u64 + 1),
        );
        k.index_axis_mut(Axis(1), h).assign(&kr);
        v.index_axis_mut(Axis(1), h).assign(&vr);
    }
    (k, v)
}

/// Queries `[q_heads, head_dim]`, uniform in [-1, 1) scaled by `2/sqrt(d)`: with `structured_kv` the
/// logits stay below 1 in magnitude at every head_dim the suite sweeps (the premises of `tolerances`).
pub fn queries(q_heads: usize, head_dim: usize, seed: u64) -> Array2<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x9e37_79b9);
    let s = 2.0 / (head_dim as f32).sqrt();
    Array2::from_shape_fn((q_heads, head_dim), |_| rng.gen_range(-1.0f32..1.0) * s)
}

/// Relative L2 distance `||a - b|| / ||b||` (0 when both are zero).
pub fn rel_l2(a: ArrayView2<f32>, b: ArrayView2<f32>) -> f64 {
    let mut num = 0.0f64;
    let mut den = 0.0f64;
    for (x, y) in a.iter().zip(b.iter()) {
        num += (*x as f64 - *y as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// SPEC 3, 11: the candidate's fitted side strategy matches the reference's:
/// identical layout (r, g, kept dims, dtype), rotation within `ROTATION_ABS`,
/// fit loss within `FIT_LOSS_ABS`. Only for rows with a separated spectrum.
pub fn check_fit_side(
    cand: &dyn Backend,
    rows: ArrayView2<f32>,
    side: Side,
    cfg: &CompressConfig,
) -> Check {
    let want = ReferenceBackend
        .fit_side(rows, side, cfg)
        .map_err(|e| format!("reference failed: {e}"))?;
    let got = cand
        .fit_side(rows, side, cfg)
        .map_err(|e| format!("candidate failed: {e}"))?;
    if want.layout != got.layout {
        return Err(format!(
            "layout differs: reference {:?}, candidate {:?}",
            want.layout, got.layout
        ));
    }
    if want.coding != got.coding {
        return Err(format!(
            "coding (SPEC 6.1) differs: reference {:?}, candidate {:?}",
            want.coding, got.coding
        ));
    }
    let d = rows.ncols();
    // The stored rotations are D x Dt (SPEC 3 step 4), with the same Dt (layouts compared above).
    let dt = want.layout.kept_dims;
    if got.rotation.len() != want.rotation.len() {
        return Err(format!(
            "rotation has {} elements, reference {}",
            got.rotation.len(),
            want.rotation.len()
        ));
    }
    // Eigenvalues of C = X^T X along the reference's columns; only columns
    // separated from their neighbours by >= 1e-3 of the largest eigenvalue
    // have a well-defined direction to compare (see ROTATION_ABS). The gap
    // below the last stored column is unknown when Dt < D, so that column
    // is not compared.
    let lambda: Vec<f64> = (0..dt)
        .map(|j| {
            rows.axis_iter(Axis(0))
                .map(|x| {
                    (0..d)
                        .map(|i| x[i] as f64 * want.rotation[i * dt + j].to_f64())
                        .sum::<f64>()
                        .powi(2)
                })
                .sum()
        })
        .collect();
    let top = lambda.iter().cloned().fold(f64::MIN_POSITIVE, f64::max);
    for j in 0..dt {
        let gap_lo = if j > 0 {
            lambda[j - 1] - lambda[j]
        } else {
            f64::INFINITY
        };
        let gap_hi = if j + 1 < dt {
            lambda[j] - lambda[j + 1]
        } else if dt < d {
            0.0
        } else {
            f64::INFINITY
        };
        if gap_lo.min(gap_hi) < 1e-3 * top {
            continue;
        }
        for i in 0..d {
            let (w, g) = (
                want.rotation[i * dt + j].to_f64(),
                got.rotation[i * dt + j].to_f64(),
            );
            let tol = ROTATION_ABS + crate::tolerances::f16_ulp(w.abs().max(g.abs()));
            if (w - g).abs() > tol {
                return Err(format!(
                    "rotation entry ({i}, {j}) differs by {:e} > {tol:e}",
                    (w - g).abs()
                ));
            }
        }
    }
    if (want.fit_loss - got.fit_loss).abs() > FIT_LOSS_ABS {
        return Err(format!("fit_loss {} vs {}", want.fit_loss, got.fit_loss));
    }
    Ok(())
}

/// SPEC 5-6: encoding the same rows with the same strategy gives the same bytes.
pub fn check_encode(cand: &dyn Backend, rows: ArrayView2<f32>, side: &SideStrategy) -> Check {
    let want = ReferenceBackend
        .encode(rows, side)
        .map_err(|e| format!("reference failed: {e}"))?;
    let got = cand
        .encode(rows, side)
        .map_err(|e| format!("candidate failed: {e}"))?;
    if want.count != got.count {
        return Err(format!("record count {} vs {}", want.count, got.count));
    }
    if let Some(i) = want.bytes.iter().zip(&got.bytes).position(|(a, b)| a != b) {
        let rb = side.layout.record_bytes();
        return Err(format!(
            "packed bytes differ first at byte {i} (record {}, offset {})",
            i / rb,
            i % rb
        ));
    }
    if want.bytes.len() != got.bytes.len() {
        return Err(format!(
            "packed length {} vs {}",
            want.bytes.len(),
            got.bytes.len()
        ));
    }
    Ok(())
}

/// SPEC 6: decoding is exact (f16 to f32), so outputs must be bit-identical.
pub fn check_decode(cand: &dyn Backend, packed: &PackedRows, side: &SideStrategy) -> Check {
    let want = ReferenceBackend
        .decode(packed, side)
        .map_err(|e| format!("reference failed: {e}"))?;
    let got = cand
        .decode(packed, side)
        .map_err(|e| format!("candidate failed: {e}"))?;
    if want.shape() != got.shape() {
        return Err(format!(
            "decoded shape {:?} vs {:?}",
            want.shape(),
            got.shape()
        ));
    }
    match want
        .iter()
        .zip(got.iter())
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        Some(i) => Err(format!("decoded value {i} differs")),
        None => Ok(()),
    }
}

/// SPEC 7: metadata is exact: the exact min/max of f16 values, quantized to int8 with one
/// f32 scale per block by a fully specified outward rounding, so every backend writes the same values.
pub fn check_block_meta(
    cand: &dyn Backend,
    keys: &PackedRows,
    side: &SideStrategy,
    block_size: usize,
) -> Check {
    let want = ReferenceBackend
        .block_meta(keys, side, block_size)
        .map_err(|e| format!("reference failed: {e}"))?;
    let got = cand
        .block_meta(keys, side, block_size)
        .map_err(|e| format!("candidate failed: {e}"))?;
    if want != got {
        return Err("block metadata differs".into());
    }
    Ok(())
}

/// SPEC 8.1: the rotated queries are the same f32 values as the reference's (f64 sums in
/// the reference's order, one rounding), bit for bit.
pub fn check_rotate_queries(
    cand: &dyn Backend,
    queries: ArrayView2<f32>,
    side: &SideStrategy,
) -> Check {
    let want = ReferenceBackend
        .rotate_queries(queries, side)
        .map_err(|e| format!("reference failed: {e}"))?;
    let got = cand
        .rotate_queries(queries, side)
        .map_err(|e| format!("candidate failed: {e}"))?;
    if want.shape() != got.shape() {
        return Err(format!("shape {:?} vs {:?}", want.shape(), got.shape()));
    }
    if let Some(((h, j), w)) = want
        .indexed_iter()
        .find(|&((h, j), w)| w.to_bits() != got[[h, j]].to_bits())
    {
        return Err(format!(
            "head {h} dim {j}: rotated query {} vs reference {w}",
            got[[h, j]]
        ));
    }
    Ok(())
}

/// SPEC 8.2: the block scores are the reference's bit for bit (integer sums on the int8
/// bounds and the int8-quantized query, then the same f64 products rounded once).
pub fn check_score(
    cand: &dyn Backend,
    meta: &mosaickv_spec::BlockMeta,
    rq: ArrayView2<f32>,
) -> Check {
    let want = ReferenceBackend
        .score_blocks(meta, rq)
        .map_err(|e| format!("reference failed: {e}"))?;
    let got = cand
        .score_blocks(meta, rq)
        .map_err(|e| format!("candidate failed: {e}"))?;
    if want.len() != got.len() {
        return Err(format!("{} scores vs {}", want.len(), got.len()));
    }
    if let Some(b) = (0..want.len()).find(|&b| want[b].to_bits() != got[b].to_bits()) {
        return Err(format!(
            "block {b}: score {} vs reference {}",
            got[b], want[b]
        ));
    }
    Ok(())
}

/// SPEC 8.3: identical scores give identical selections.
pub fn check_select(cand: &dyn Backend, scores: &[f32], lens: &[usize], budget: usize) -> Check {
    let want = ReferenceBackend
        .select_blocks(scores, lens, budget)
        .map_err(|e| format!("reference failed: {e}"))?;
    let got = cand
        .select_blocks(scores, lens, budget)
        .map_err(|e| format!("candidate failed: {e}"))?;
    if want != got {
        return Err(format!(
            "selection differs: reference {want:?}, candidate {got:?}"
        ));
    }
    Ok(())
}

/// SPEC 8 on a whole cache: rotated queries, scores and the top-k rule are exact, so the
/// selection must equal the reference's.
pub fn check_cache_select(
    cand: &dyn Backend,
    cache: &CompressedCache,
    queries: ArrayView2<f32>,
) -> Check {
    let want = ReferenceBackend
        .select(cache, queries)
        .map_err(|e| format!("reference failed: {e}"))?;
    let got = cand
        .select(cache, queries)
        .map_err(|e| format!("candidate failed: {e}"))?;
    if want != got {
        for (h, (w, c)) in want.per_head.iter().zip(&got.per_head).enumerate() {
            if w != c {
                return Err(format!("head {h}: selection {c:?} vs reference {w:?}"));
            }
        }
        return Err(format!(
            "{} heads vs {}",
            got.per_head.len(),
            want.per_head.len()
        ));
    }
    Ok(())
}

/// SPEC 9 for a given selection: output within `ATTEND_REL_L2` of the reference.
/// The output is poisoned with NaN first and must come back fully written.
pub fn check_attend_selected(
    cand: &dyn Backend,
    cache: &CompressedCache,
    queries: ArrayView2<f32>,
) -> Check {
    let sel: Selection = ReferenceBackend
        .select(cache, queries)
        .map_err(|e| format!("reference failed: {e}"))?;
    let shape = (cache.shape.q_heads, cache.shape.head_dim);
    let mut want = Array2::<f32>::from_elem(shape, f32::NAN);
    ReferenceBackend
        .attend_selected(cache, queries, &sel, want.view_mut())
        .map_err(|e| format!("reference failed: {e}"))?;
    let mut got = Array2::<f32>::from_elem(shape, f32::NAN);
    cand.attend_selected(cache, queries, &sel, got.view_mut())
        .map_err(|e| format!("candidate failed: {e}"))?;
    if let Some(i) = got.iter().position(|x| !x.is_finite()) {
        return Err(format!("output element {i} not written (or not finite)"));
    }
    let e = rel_l2(got.view(), want.view());
    if e > ATTEND_REL_L2 {
        return Err(format!("attention rel L2 {e:e} > {ATTEND_REL_L2:e}"));
    }
    Ok(())
}

/// Runs every stage check on one head's rows: fit (when the spectrum is
/// separated, i.e. enough rows), encode, decode, metadata, query rotation,
/// scores, selection.
pub fn check_stages(
    cand: &dyn Backend,
    tokens: usize,
    head_dim: usize,
    group: usize,
    seed: u64,
    cfg: &CompressConfig,
) -> Check {
    let rows = structured_rows(tokens, head_dim, seed);
    if tokens >= 4 * head_dim {
        check_fit_side(cand, rows.view(), Side::Key, cfg)
            .map_err(|e| format!("fit_side(K): {e}"))?;
        check_fit_side(cand, rows.view(), Side::Value, cfg)
            .map_err(|e| format!("fit_side(V): {e}"))?;
    }
    let side = ReferenceBackend
        .fit_side(rows.view(), Side::Key, cfg)
        .map_err(|e| e.to_string())?;
    check_encode(cand, rows.view(), &side).map_err(|e| format!("encode: {e}"))?;
    let packed = ReferenceBackend
        .encode(rows.view(), &side)
        .map_err(|e| e.to_string())?;
    check_decode(cand, &packed, &side).map_err(|e| format!("decode: {e}"))?;
    for &b in &cfg.block_sizes {
        check_block_meta(cand, &packed, &side, b).map_err(|e| format!("block_meta(b={b}): {e}"))?;
    }
    let b = cfg.block_sizes[0];
    let meta = ReferenceBackend
        .block_meta(&packed, &side, b)
        .map_err(|e| e.to_string())?;
    let q = queries(group, head_dim, seed);
    check_rotate_queries(cand, q.view(), &side).map_err(|e| format!("rotate_queries: {e}"))?;
    let rq = ReferenceBackend
        .rotate_queries(q.view(), &side)
        .map_err(|e| e.to_string())?;
    check_score(cand, &meta, rq.view()).map_err(|e| format!("score_blocks: {e}"))?;
    let scores = ReferenceBackend
        .score_blocks(&meta, rq.view())
        .map_err(|e| e.to_string())?;
    let lens: Vec<usize> = (0..meta.blocks()).map(|i| meta.block_len(i)).collect();
    let budget = cfg.budget_tokens(tokens);
    check_select(cand, &scores, &lens, budget).map_err(|e| format!("select_blocks: {e}"))?;
    Ok(())
}

/// Builds a reference MosaicCache from a prefill plus `appends` generated tokens.
pub fn reference_cache(
    shape: KvShape,
    cfg: &CompressConfig,
    prompt: usize,
    appends: usize,
    seed: u64,
) -> Result<CompressedCache, MosaicError> {
    let (k, v) = structured_kv(prompt + appends, shape.kv_heads, shape.head_dim, seed);
    let mut cache = mosaickv_reference::MosaicCache::new(shape, cfg.clone())?;
    cache.prefill(
        k.slice(ndarray::s![..prompt, .., ..]),
        v.slice(ndarray::s![..prompt, .., ..]),
    )?;
    for t in prompt..prompt + appends {
        cache.append(k.index_axis(Axis(0), t), v.index_axis(Axis(0), t))?;
    }
    Ok(cache.compressed().clone())
}

/// SPEC 8-9 on whole caches built by the reference: selection and attention.
pub fn check_cache_attention(
    cand: &dyn Backend,
    shape: KvShape,
    cfg: &CompressConfig,
    prompt: usize,
    appends: usize,
    seed: u64,
) -> Check {
    let cache = reference_cache(shape, cfg, prompt, appends, seed)
        .map_err(|e| format!("building cache: {e}"))?;
    let q = queries(shape.q_heads, shape.head_dim, seed);
    if cache.is_empty() {
        return check_same_error(cand, &cache, q.view(), Some(MosaicError::EmptyCache));
    }
    check_cache_select(cand, &cache, q.view()).map_err(|e| format!("select: {e}"))?;
    check_attend_selected(cand, &cache, q.view()).map_err(|e| format!("attend_selected: {e}"))
}

/// Bad input gives the same error in both backends (and, if given, the expected one).
pub fn check_same_error(
    cand: &dyn Backend,
    cache: &CompressedCache,
    queries: ArrayView2<f32>,
    expected: Option<MosaicError>,
) -> Check {
    let shape = (cache.shape.q_heads, cache.shape.head_dim);
    let mut o1 = Array2::<f32>::zeros(shape);
    let mut o2 = Array2::<f32>::zeros(shape);
    let want = ReferenceBackend.attend(cache, queries, o1.view_mut());
    let got = cand.attend(cache, queries, o2.view_mut());
    match (&want, &got) {
        (Err(a), Err(b)) if a == b => match expected {
            Some(e) if &e != a => Err(format!("both gave {a}, expected {e}")),
            _ => Ok(()),
        },
        _ => Err(format!("reference {want:?}, candidate {got:?}")),
    }
}

/// NaN/Inf in queries and in rows to encode give identical `NonFinite` errors.
pub fn check_nonfinite(
    cand: &dyn Backend,
    head_dim: usize,
    seed: u64,
    cfg: &CompressConfig,
) -> Check {
    let shape = KvShape::new(2, 4, head_dim).map_err(|e| e.to_string())?;
    let cache = reference_cache(shape, cfg, 40, 0, seed).map_err(|e| e.to_string())?;
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut q = queries(4, head_dim, seed);
        q[[1, head_dim / 2]] = bad;
        check_same_error(
            cand,
            &cache,
            q.view(),
            Some(MosaicError::NonFinite {
                what: "queries",
                index: head_dim + head_dim / 2,
            }),
        )
        .map_err(|e| format!("query {bad}: {e}"))?;
        let mut rows = structured_rows(20, head_dim, seed);
        rows[[7, 3]] = bad;
        let side = &cache.segments[0].heads[0].strategy.key;
        let want = ReferenceBackend.encode(rows.view(), side);
        let got = cand.encode(rows.view(), side);
        match (&want, &got) {
            (Err(MosaicError::NonFinite { .. }), Err(_)) if want == got => {}
            _ => {
                return Err(format!(
                    "encode with {bad}: reference {want:?}, candidate {got:?}"
                ))
            }
        }
    }
    Ok(())
}

/// SPEC 5, 14: rows whose elements fit f16 but whose rotation does not, and rows with an
/// element past f16, give the same result in both backends: equal bytes, or the same
/// `NonFinite` error naming the same value (`row * Dt + j`, the first in row order). The
/// overflows sit in the second and third 256-row chunk, so a parallel encoder that reports
/// any chunk's error instead of the first one's is caught.
pub fn check_large_finite(
    cand: &dyn Backend,
    head_dim: usize,
    seed: u64,
    cfg: &CompressConfig,
) -> Check {
    let shape = KvShape::new(1, 1, head_dim).map_err(|e| e.to_string())?;
    let cache = reference_cache(shape, cfg, 60, 0, seed).map_err(|e| e.to_string())?;
    let side = &cache.segments[0].heads[0].strategy.key;
    let dt = side.layout.kept_dims;
    let along = |c: f32, col: usize| -> Vec<f32> {
        (0..head_dim)
            .map(|i| c * side.rotation[i * dt + col].to_f32())
            .collect()
    };
    let mut rows = structured_rows(700, head_dim, seed);
    let mut set = |t: usize, v: Vec<f32>| {
        for (i, x) in v.into_iter().enumerate() {
            rows[[t, i]] = x;
        }
    };
    set(10, along(60000.0, 1)); // rotates to 60000 at dim 1: fits
    set(300, along(66000.0, 2)); // rotates to 66000 at dim 2: the first overflow
    set(650, along(70000.0, 0)); // a later overflow, in another chunk
    rows[[120, 1]] = 65519.0; // one element near the limit: its rotation spreads it
    let want = ReferenceBackend.encode(rows.view(), side);
    let got = cand.encode(rows.view(), side);
    let expected = MosaicError::NonFinite {
        what: mosaickv_spec::rules::ROTATED_OVERFLOW,
        index: 300 * dt + 2,
    };
    if want.as_ref().err() != Some(&expected) {
        return Err(format!("reference gave {want:?}, expected {expected:?}"));
    }
    if want != got {
        return Err(format!(
            "encode: reference {:?}, candidate {:?}",
            want.as_ref().err(),
            got.as_ref().err()
        ));
    }
    // Without the overflowing rows the same rows encode to the same bytes.
    for t in [300, 650] {
        for i in 0..head_dim {
            rows[[t, i]] = 0.5;
        }
    }
    check_encode(cand, rows.view(), side).map_err(|e| format!("large finite rows: {e}"))
}

/// SPEC 6, int8 and int4 records: encode writes the reference's bytes, decode its decoded
/// floats and block_meta its bounds, on rows built to reach every quantization rule: a
/// record whose kept values are all equal (zero scale, all codes 0), a `-0` minimum (stored
/// as `+0`), quotients that are exact half-integers (round half to even: 2.5 -> 2, 3.5 -> 4),
/// the extremes `M` (code `qmax`) and `m` (code 0), odd `r` for int4 (the last high nibble 0),
/// groups larger than 1, a truncated tail, subnormal and large magnitudes. The identity
/// rotation makes each stored f16 value the row's own element, so the rows spell out the
/// records.
pub fn check_quantized_rounding_rules(cand: &dyn Backend) -> Check {
    use mosaickv_spec::{RecordLayout, ValueDtype};
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    for dtype in [ValueDtype::Int8, ValueDtype::Int4] {
        let qmax = dtype.qmax() as f32;
        for &(d, dt, r, g) in &[
            (32usize, 32usize, 32usize, 1usize),
            (32, 24, 9, 1),
            (64, 48, 17, 1),
            (64, 64, 30, 2),
            (80, 60, 15, 5),
            (128, 96, 33, 1),
        ] {
            let layout = RecordLayout {
                head_dim: d,
                kept_dims: dt,
                r,
                group_size: g,
                dtype,
                code_bits: 0,
            };
            let mut rotation = vec![half::f16::ZERO; d * dt];
            for j in 0..dt {
                rotation[j * dt + j] = half::f16::ONE;
            }
            let side = SideStrategy {
                layout,
                rotation,
                fit_loss: 0.0,
                coding: Vec::new(),
            };
            let mut rows = Array2::<f32>::zeros((24, d));
            // Row 0: every value equal (a = 0: s = 0, all codes 0).
            rows.row_mut(0).fill(0.75);
            // Row 1: a -0 minimum among positive values.
            for (i, x) in rows.row_mut(1).iter_mut().enumerate() {
                *x = if i % 5 == 0 {
                    -0.0
                } else {
                    0.5 + i as f32 / 64.0
                };
            }
            // Row 2: m = 0, M = qmax (s = 1), and values on half-integers (ties) between.
            for (i, x) in rows.row_mut(2).iter_mut().enumerate() {
                *x = match i % 4 {
                    0 => 0.0,
                    1 => qmax,
                    2 => 2.5 + (i % 3) as f32,
                    _ => 1.5 + (i % 7) as f32 * (qmax - 2.0) / 7.0,
                };
            }
            // Row 3: a negative range with ties at a scale of 0.5 (m = -qmax / 2).
            for (i, x) in rows.row_mut(3).iter_mut().enumerate() {
                *x = -qmax / 2.0 + 0.25 * (i % 9) as f32 + if i % 2 == 0 { 0.0 } else { 0.75 };
            }
            // The rest: random magnitudes and signs, some large, some tiny (subnormal f16).
            for t in 4..24 {
                let scale = [1e-6f32, 0.01, 1.0, 30.0, 2000.0][t % 5];
                for x in rows.row_mut(t).iter_mut() {
                    *x = rng.gen_range(-1.0f32..1.0) * scale + if t % 3 == 0 { scale } else { 0.0 };
                }
            }
            let what = format!("{dtype:?} D={d} Dt={dt} r={r} g={g}");
            check_encode(cand, rows.view(), &side).map_err(|e| format!("{what}: encode: {e}"))?;
            let packed = ReferenceBackend
                .encode(rows.view(), &side)
                .map_err(|e| format!("{what}: reference encode: {e}"))?;
            check_decode(cand, &packed, &side).map_err(|e| format!("{what}: decode: {e}"))?;
            for b in [1usize, 5, 16] {
                check_block_meta(cand, &packed, &side, b)
                    .map_err(|e| format!("{what}: block_meta(b={b}): {e}"))?;
            }
        }
    }
    Ok(())
}

/// SPEC 6: a damaged int8/int4 record (a `-0` minimum, a non-finite scale, a non-zero code
/// under a zero scale) is `CorruptPacked` from decode and block_meta, the reference's error,
/// never a decoded value.
pub fn check_corrupt_quantized_records(cand: &dyn Backend) -> Check {
    use mosaickv_spec::ValueDtype;
    let rows = structured_rows(40, 64, 3);
    for dtype in [ValueDtype::Int8, ValueDtype::Int4] {
        let cfg = CompressConfig {
            value_dtypes: vec![dtype],
            ..CompressConfig::default()
        };
        let side = ReferenceBackend
            .fit_side(rows.view(), Side::Key, &cfg)
            .map_err(|e| e.to_string())?;
        if side.layout.dtype != dtype {
            return Err(format!(
                "fit_side chose {:?}, not {dtype:?}",
                side.layout.dtype
            ));
        }
        let good = ReferenceBackend
            .encode(rows.view(), &side)
            .map_err(|e| e.to_string())?;
        let o = side.layout.bitmap_bytes();
        let rb = side.layout.record_bytes();
        let damage: [(&str, fn(&mut [u8], usize)); 3] = [
            ("-0 minimum", |rec, o| {
                rec[o..o + 2].copy_from_slice(&half::f16::NEG_ZERO.to_le_bytes())
            }),
            ("infinite scale", |rec, o| {
                rec[o + 2..o + 4].copy_from_slice(&half::f16::INFINITY.to_le_bytes())
            }),
            ("code under a zero scale", |rec, o| {
                rec[o + 2..o + 4].copy_from_slice(&half::f16::ZERO.to_le_bytes());
                rec[o + 4] |= 1;
            }),
        ];
        for (what, f) in damage {
            let mut bad = good.clone();
            f(&mut bad.bytes[7 * rb..8 * rb], o);
            let want = ReferenceBackend.decode(&bad, &side).map(|_| ());
            if !matches!(want, Err(MosaicError::CorruptPacked(_))) {
                return Err(format!("{dtype:?} {what}: reference gave {want:?}"));
            }
            let got = cand.decode(&bad, &side).map(|_| ());
            if got != want {
                return Err(format!(
                    "{dtype:?} decode, {what}: {got:?}, reference {want:?}"
                ));
            }
            let want = ReferenceBackend.block_meta(&bad, &side, 16).map(|_| ());
            let got = cand.block_meta(&bad, &side, 16).map(|_| ());
            if got != want {
                return Err(format!(
                    "{dtype:?} block_meta, {what}: {got:?}, reference {want:?}"
                ));
            }
        }
    }
    Ok(())
}

/// SPEC 8.3: `+0.0` and `-0.0` scores tie (lower index first), like any equal scores.
pub fn check_signed_zero_ties(cand: &dyn Backend) -> Check {
    let scores = [0.0f32, -0.0, -0.0, 0.0, 0.25, -0.0, 0.0, -0.25, -0.0];
    let lens = [16usize, 16, 8, 16, 16, 16, 3, 16, 16];
    let total: usize = lens.iter().sum();
    for budget in 0..=total + 1 {
        check_select(cand, &scores, &lens, budget).map_err(|e| format!("budget {budget}: {e}"))?;
    }
    // The reference's own order, spelled out: 0.25 first, then the zeros by index.
    let picked = ReferenceBackend
        .select_blocks(&scores, &lens, 16 + 16 + 16)
        .map_err(|e| e.to_string())?;
    if picked != vec![0, 1, 4] {
        return Err(format!("reference picked {picked:?}, expected [0, 1, 4]"));
    }
    Ok(())
}

/// SPEC 11.2: a candidate's loss exactly equal to the threshold passes. For each candidate
/// the threshold is set to the reference's loss of that candidate (bit for bit), and the
/// backend must choose the same layout: the losses must be summed in the same order (SPEC
/// 11.1: rows in order), or a one-ulp difference flips the choice.
pub fn check_loss_at_threshold(cand: &dyn Backend, head_dim: usize, n: usize, seed: u64) -> Check {
    let rows = structured_rows(n, head_dim, seed);
    let mut cfg = CompressConfig::default();
    let rotation = mosaickv_reference::rotation::fit_rotation(rows.view());
    for side in [Side::Key, Side::Value] {
        for layout in mosaickv_spec::rules::candidates(&cfg.clone(), head_dim) {
            let strategy = SideStrategy {
                layout,
                rotation: mosaickv_spec::layout::trim_rotation(
                    &rotation,
                    head_dim,
                    layout.kept_dims,
                ),
                fit_loss: 0.0,
                coding: Vec::new(),
            };
            let loss = mosaickv_reference::side_loss(rows.view(), &strategy, side);
            if let mosaickv_spec::ChannelPolicy::LossThreshold {
                key_loss,
                value_loss,
                ..
            } = &mut cfg.channels
            {
                *key_loss = loss.min(1.0);
                *value_loss = loss.min(1.0);
            }
            check_fit_side(cand, rows.view(), side, &cfg).map_err(|e| {
                format!(
                    "{side:?}, threshold = loss of (r {}, g {}) = {loss:e}: {e}",
                    layout.r, layout.group_size
                )
            })?;
        }
    }
    Ok(())
}

/// The default configuration with f16 values only (the default's other parameters): the
/// f16 path beside the default's int4/int8/f16 in tests that compare the two.
pub fn f16_default() -> CompressConfig {
    CompressConfig {
        value_dtypes: vec![mosaickv_spec::ValueDtype::F16],
        ..CompressConfig::default()
    }
}

/// Stamps the conformance suite out for one backend:
/// `conformance_suite!(mod_name, || -> Box<dyn Backend> [, #[attr]...])`; the
/// attributes go on every test (e.g. an `ignore` when the backend's hardware
/// is absent, so the harness reports the tests as ignored, not passed).
/// A backend that is unavailable at run time makes every test print
/// `SKIPPED ... : reason` and return.
#[macro_export]
macro_rules! conformance_suite {
    ($name:ident, $make:expr $(, #[$attr:meta])*) => {
        mod $name {
            use super::*;
            use $crate::*;
            use mosaickv_spec::{Backend, CompressConfig, KvShape};
            use proptest::prelude::*;

            fn backend(test: &str) -> Option<Box<dyn Backend>> {
                let make: fn() -> Box<dyn Backend> = $make;
                match available(make()) {
                    Ok(b) => Some(b),
                    Err(reason) => {
                        report_skip(stringify!($name), test, &reason);
                        None
                    }
                }
            }

            fn configs() -> Vec<CompressConfig> {
                let mut small = CompressConfig::default();
                small.input_segment_len = 96;
                small.buffer_capacity = 64;
                small.max_segment_len = 256;
                small.min_segment_len = 128;
                // No budget floor, so that the selection stays a strict subset at these
                // small sizes (the default's floor of 256 is exercised by the default).
                small.min_budget_tokens = 0;
                small.value_dtypes = vec![mosaickv_spec::ValueDtype::F16];
                let mut fixed = CompressConfig::paper_fixed();
                fixed.input_segment_len = 80;
                fixed.buffer_capacity = 32;
                fixed.max_segment_len = 128;
                fixed.min_segment_len = 64;
                // Every value dtype (SPEC.md section 6): int8 under the loss rule (g = 1, 2, 4),
                // int4 under the fixed policy (g = 1, the SIMD kernels), and a mix the loss
                // rule chooses from.
                use mosaickv_spec::ValueDtype::{F16, Int4, Int8};
                // A floor that binds at some sizes and not at others (SPEC.md section 8.3).
                let int8 = CompressConfig { value_dtypes: vec![Int8], min_budget_tokens: 48, ..CompressConfig::default() };
                let int4 = CompressConfig { value_dtypes: vec![Int4], ..fixed.clone() };
                let mixed = CompressConfig { value_dtypes: vec![Int4, Int8, F16], ..small.clone() };
                // The default stores int4/int8/f16 (SPEC.md section 2); its f16-only variant
                // tests the f16 path on the default's other parameters.
                let f16_default = CompressConfig { value_dtypes: vec![F16], ..CompressConfig::default() };
                vec![CompressConfig::default(), f16_default, small, fixed, int8, int4, mixed]
            }

            /// SPEC.md section 6.1's coded records: beside the default's dtypes (the loss
            /// rule picks per segment, head and side), and alone on the small geometry.
            fn coded_configs() -> Vec<CompressConfig> {
                use mosaickv_spec::ValueDtype::Coded;
                let mut beside = CompressConfig::default();
                beside.value_dtypes.push(Coded);
                let only = CompressConfig { value_dtypes: vec![Coded], ..configs()[2].clone() };
                vec![beside, only]
            }

            /// The configurations a backend is held to: every value dtype on the CPU paths;
            /// the CUDA kernels read bitmap records only and refuse coded ones
            /// (`coded_records_refused_or_run`).
            fn configs_for(b: &dyn Backend) -> Vec<CompressConfig> {
                let mut c = configs();
                if !b.name().starts_with("cuda") {
                    c.extend(coded_configs());
                }
                c
            }

            $(#[$attr])*
            #[test]
            fn coded_records_refused_or_run() {
                let Some(b) = backend("coded_records_refused_or_run") else { return };
                let rows = $crate::structured_rows(300, 64, 3);
                for cfg in coded_configs() {
                    let got = b.fit_side(rows.view(), mosaickv_spec::Side::Key, &cfg);
                    if b.name().starts_with("cuda") {
                        assert!(
                            matches!(got, Err(mosaickv_spec::MosaicError::InvalidConfig(_))),
                            "{}: {got:?}", b.name()
                        );
                    } else {
                        $crate::check_fit_side(b.as_ref(), rows.view(), mosaickv_spec::Side::Key, &cfg)
                            .unwrap_or_else(|e| panic!("{e}"));
                    }
                }
            }

            $(#[$attr])*
            #[test]
            fn stages_every_head_dim() {
                let Some(b) = backend("stages_every_head_dim") else { return };
                for cfg in configs_for(b.as_ref()) {
                    for &d in &HEAD_DIMS {
                        for &n in &[0usize, 1, 15, 16, 17, 33, 127, 4 * d + 3] {
                            check_stages(b.as_ref(), n, d, 4, (d * 1000 + n) as u64, &cfg)
                                .unwrap_or_else(|e| panic!("D={d} n={n}: {e}"));
                        }
                    }
                }
            }

            $(#[$attr])*
            #[test]
            fn cache_attention_gqa_and_lengths() {
                let Some(b) = backend("cache_attention_gqa_and_lengths") else { return };
                for (ci, cfg) in configs_for(b.as_ref()).iter().enumerate() {
                    for &ratio in &GQA_RATIOS {
                        for &(prompt, appends) in &[(0usize, 0usize), (1, 0), (3, 2), (20, 0), (100, 37), (250, 200)] {
                            let shape = KvShape::new(2, 2 * ratio, 64).unwrap();
                            check_cache_attention(b.as_ref(), shape, cfg, prompt, appends, (ci * 100 + ratio) as u64)
                                .unwrap_or_else(|e| panic!("cfg {ci} gqa {ratio} prompt {prompt} appends {appends}: {e}"));
                        }
                    }
                }
            }

            $(#[$attr])*
            #[test]
            fn large_cache_attention() {
                let Some(b) = backend("large_cache_attention") else { return };
                let shape = KvShape::new(2, 8, 128).unwrap();
                let mut cfg = CompressConfig::default();
                cfg.input_segment_len = 1024;
                check_cache_attention(b.as_ref(), shape, &cfg, 3000, 130, 7).unwrap_or_else(|e| panic!("{e}"));
            }

            /// One segment with more selected blocks than a flash-decoding unit holds (51 blocks of
            /// 16 against units of 32): backends that split a segment's selection across work
            /// units must merge the parts before rotating back (SPEC 9).
            $(#[$attr])*
            #[test]
            fn split_segment_attention() {
                let Some(b) = backend("split_segment_attention") else { return };
                let shape = KvShape::new(1, 4, 64).unwrap();
                let mut cfg = CompressConfig::paper_fixed();
                cfg.input_segment_len = 8192;
                check_cache_attention(b.as_ref(), shape, &cfg, 8200, 3, 11).unwrap_or_else(|e| panic!("{e}"));
            }

            $(#[$attr])*
            #[test]
            fn nonfinite_inputs_same_error() {
                let Some(b) = backend("nonfinite_inputs_same_error") else { return };
                for &d in &[32usize, 80, 128] {
                    check_nonfinite(b.as_ref(), d, d as u64, &CompressConfig::default()).unwrap_or_else(|e| panic!("D={d}: {e}"));
                }
            }

            $(#[$attr])*
            #[test]
            fn large_finite_rows_same_error() {
                let Some(b) = backend("large_finite_rows_same_error") else { return };
                for &d in &[32usize, 64, 80, 128] {
                    for cfg in configs_for(b.as_ref()) {
                        check_large_finite(b.as_ref(), d, d as u64 + 5, &cfg).unwrap_or_else(|e| panic!("D={d}: {e}"));
                    }
                }
            }

            $(#[$attr])*
            #[test]
            fn quantized_rounding_rules() {
                let Some(b) = backend("quantized_rounding_rules") else { return };
                check_quantized_rounding_rules(b.as_ref()).unwrap_or_else(|e| panic!("{e}"));
            }

            $(#[$attr])*
            #[test]
            fn corrupt_quantized_records() {
                let Some(b) = backend("corrupt_quantized_records") else { return };
                check_corrupt_quantized_records(b.as_ref()).unwrap_or_else(|e| panic!("{e}"));
            }

            $(#[$attr])*
            #[test]
            fn select_signed_zero_ties() {
                let Some(b) = backend("select_signed_zero_ties") else { return };
                check_signed_zero_ties(b.as_ref()).unwrap_or_else(|e| panic!("{e}"));
            }

            $(#[$attr])*
            #[test]
            fn fit_side_loss_at_threshold() {
                let Some(b) = backend("fit_side_loss_at_threshold") else { return };
                for &(d, n) in &[(32usize, 300usize), (64, 700), (128, 600)] {
                    check_loss_at_threshold(b.as_ref(), d, n, d as u64).unwrap_or_else(|e| panic!("D={d}: {e}"));
                }
            }

            proptest! {
                #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
                $(#[$attr])*
            #[test]
                fn prop_stages(d_idx in 0usize..6, n in 0usize..300, group_idx in 0usize..4, seed in any::<u64>(), cfg_idx in 0usize..6) {
                    let Some(b) = backend("prop_stages") else { return Ok(()) };
                    let d = HEAD_DIMS[d_idx];
                    let cs = configs_for(b.as_ref());
                    let cfg = &cs[cfg_idx % cs.len()];
                    let r = check_stages(b.as_ref(), n, d, GQA_RATIOS[group_idx], seed, cfg);
                    prop_assert!(r.is_ok(), "{}", r.unwrap_err());
                }

                $(#[$attr])*
            #[test]
                fn prop_cache_attention(d_idx in 0usize..6, prompt in 0usize..400, appends in 0usize..150, ratio_idx in 0usize..4, kv in 1usize..3, seed in any::<u64>(), cfg_idx in 0usize..6) {
                    let Some(b) = backend("prop_cache_attention") else { return Ok(()) };
                    let shape = KvShape::new(kv, kv * GQA_RATIOS[ratio_idx], HEAD_DIMS[d_idx]).unwrap();
                    let cs = configs_for(b.as_ref());
                    let cfg = &cs[cfg_idx % cs.len()];
                    let r = check_cache_attention(b.as_ref(), shape, cfg, prompt, appends, seed);
                    prop_assert!(r.is_ok(), "{}", r.unwrap_err());
                }
            }

            /// quickcheck: identical scores give identical selections, for any scores and budgets.
            $(#[$attr])*
            #[test]
            fn quickcheck_select() {
                let Some(_) = backend("quickcheck_select") else { return };
                fn prop(scores: Vec<i8>, lens_seed: u8, budget: u16) -> bool {
                    let Some(b) = backend("quickcheck_select") else { return true };
                    // Small integer scores make ties frequent: the tie rule is what is tested.
                    let scores: Vec<f32> = scores.iter().map(|s| *s as f32 / 4.0).collect();
                    let lens: Vec<usize> = (0..scores.len()).map(|i| 1 + (i * 7 + lens_seed as usize) % 32).collect();
                    let total: usize = lens.iter().sum();
                    let budget = budget as usize % (total + 2);
                    check_select(b.as_ref(), &scores, &lens, budget).is_ok()
                }
                quickcheck::QuickCheck::new().tests(300).quickcheck(prop as fn(Vec<i8>, u8, u16) -> bool);
            }
        }
    };
}
