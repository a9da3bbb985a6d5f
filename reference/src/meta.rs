//! SPEC.md section 7: block metadata.

use crate::packed::decode_rows;
use crate::round::f16_from_f64;
use mosaickv_spec::{BlockMeta, MosaicError, PackedRows, Result, SideStrategy};
use ndarray::ArrayView2;

/// SPEC.md section 7: per block of `b` consecutive tokens (last block may be
/// partial) and per dim `j < Dt`, `M_j = max` and `m_j = min` over the
/// block's decoded keys `k^` (zeros included), stored f16 (exact: decoded
/// values are f16 or 0). `decoded` is `[n, Dt]`.
pub fn block_meta_of_decoded(decoded: ArrayView2<f32>, block_size: usize) -> BlockMeta {
    let (n, dt) = (decoded.nrows(), decoded.ncols());
    let blocks = n.div_ceil(block_size);
    let mut min = Vec::with_capacity(blocks * dt);
    let mut max = Vec::with_capacity(blocks * dt);
    for blk in 0..blocks {
        let first = blk * block_size;
        let end = (first + block_size).min(n);
        for j in 0..dt {
            let mut lo = decoded[[first, j]];
            let mut hi = decoded[[first, j]];
            for t in first + 1..end {
                lo = lo.min(decoded[[t, j]]);
                hi = hi.max(decoded[[t, j]]);
            }
            min.push(f16_from_f64(f64::from(lo)));
            max.push(f16_from_f64(f64::from(hi)));
        }
    }
    BlockMeta {
        block_size,
        kept_dims: dt,
        tokens: n,
        min,
        max,
    }
}

/// SPEC.md section 7 on packed keys: decode, then [`block_meta_of_decoded`].
pub fn block_meta(keys: &PackedRows, key: &SideStrategy, block_size: usize) -> Result<BlockMeta> {
    if block_size == 0 {
        return Err(MosaicError::InvalidConfig(
            "block size must be positive".into(),
        ));
    }
    let decoded = decode_rows(keys, key)?;
    Ok(block_meta_of_decoded(decoded.view(), block_size))
}
