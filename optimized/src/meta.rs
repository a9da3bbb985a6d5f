//! SPEC.md section 7: block metadata (per block and kept dim, the int8 bounds of the
//! decoded keys and their scale).

use mosaickv_spec::BlockMeta;

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
