//! SPEC.md section 7: block metadata.

use crate::packed::decode_rows;
use mosaickv_spec::{BlockMeta, MosaicError, PackedRows, Result, SideStrategy};
use ndarray::ArrayView2;

/// SPEC.md section 7: per block of `b` consecutive tokens (last block may be
/// partial) and per dim `j < Dt`, `M_j = max` and `m_j = min` over the
/// block's decoded keys `k^` (zeros included), then stored as int8 with one
/// f32 scale per block, rounded outward ([`BlockMeta::push_block`]:
/// `qmin_j * s <= m_j`, `qmax_j * s >= M_j`). `decoded` is `[n, Dt]`.
pub fn block_meta_of_decoded(decoded: ArrayView2<f32>, block_size: usize) -> BlockMeta {
    let (n, dt) = (decoded.nrows(), decoded.ncols());
    let blocks = n.div_ceil(block_size);
    let mut meta = BlockMeta::empty(block_size, dt);
    let mut lo = vec![0f32; dt];
    let mut hi = vec![0f32; dt];
    for blk in 0..blocks {
        let first = blk * block_size;
        let end = (first + block_size).min(n);
        for j in 0..dt {
            lo[j] = decoded[[first, j]];
            hi[j] = decoded[[first, j]];
            for t in first + 1..end {
                lo[j] = lo[j].min(decoded[[t, j]]);
                hi[j] = hi[j].max(decoded[[t, j]]);
            }
        }
        meta.push_block(&lo, &hi, end - first);
    }
    meta
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
