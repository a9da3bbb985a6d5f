//! SPEC.md section 10.3's close on the worker: a closed segment's own strategy
//! (SPEC 3 rotation, SPEC 4/11 choice of `(r, g)`, block size) fitted from the
//! covariance accumulated while it was open, and its records re-encoded with
//! it, as `mosaic::encode_segment` does from the rows.

use super::covariance::mirrored;
use crate::{meta, packed, rotation, strategy};
use mosaickv_spec::{CompressConfig, HeadSegment, Result, Side, SideStrategy, Strategy};
use rayon::prelude::*;

/// SPEC 3, 4, 11 for one side from an accumulated covariance: what
/// `strategy::fit_side_rotated` computes from the rows, with `C` given.
fn fit_side_from_cov(
    rows: &[f32],
    lower: &[f64],
    d: usize,
    side: Side,
    config: &CompressConfig,
) -> Result<(SideStrategy, Vec<f64>)> {
    let rotation = rotation::rotation_from_covariance(&mirrored(lower, d), d);
    let rot = mosaickv_spec::layout::rotation_f32(&rotation);
    let n = rows.len() / d;
    let mut xr = vec![0f64; n * d];
    xr.par_chunks_mut(d * 256)
        .zip(rows.par_chunks(d * 256))
        .for_each(|(o, x)| rotation::rotate_rows_f64(&rot, d, x, d, o));
    let chosen = strategy::choose_side(rows, &xr, &rotation, d, side, config, None)?;
    Ok((chosen, xr))
}

/// SPEC 10.3 close: the segment's own strategy, its records and metadata (as `mosaic::encode_segment`).
pub(super) fn finalize_head(
    keys: &[f32],
    values: &[f32],
    ck: &[f64],
    cv: &[f64],
    d: usize,
    config: &CompressConfig,
) -> Result<HeadSegment> {
    let (ks, kr) = fit_side_from_cov(keys, ck, d, Side::Key, config)?;
    let packed_k = packed::pack_rotated(&kr, d, &ks)?;
    drop(kr);
    let (vs, vr) = fit_side_from_cov(values, cv, d, Side::Value, config)?;
    let packed_v = packed::pack_rotated(&vr, d, &vs)?;
    drop(vr);
    let dense = packed::decode_trusted(&packed_k, &ks);
    let block_size = strategy::block_size_dense(&dense, ks.layout.kept_dims, config);
    let meta = meta::block_meta_dense(&dense, ks.layout.kept_dims, block_size);
    Ok(HeadSegment {
        strategy: Strategy {
            key: ks,
            value: vs,
            block_size,
        },
        keys: packed_k,
        values: packed_v,
        meta,
    })
}
