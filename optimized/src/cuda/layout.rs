//! Host-side tables that describe a batch of compressed caches to the kernels
//! (mirrors of `SegHead` and `BlockRef` in kernels/cuda/common.cuh).

use bytemuck::{Pod, Zeroable};
use mosaickv_spec::{CompressedCache, MosaicError, Result};

/// One (segment, KV head): offsets into the concatenated device buffers and both side layouts.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, Pod, Zeroable)]
pub struct SegHeadDesc {
    pub key_rec_off: i64,
    pub val_rec_off: i64,
    pub key_rot_off: i64,
    pub val_rot_off: i64,
    pub meta_off: i64,
    pub scale_off: i64,
    pub seg_len: i32,
    pub block_size: i32,
    pub key_dt: i32,
    pub key_r: i32,
    pub key_g: i32,
    pub key_rb: i32,
    pub val_dt: i32,
    pub val_r: i32,
    pub val_g: i32,
    pub val_rb: i32,
    /// Value dtype tags of the two sides (SPEC.md section 6: `F16 = 1`, `Int8 = 2`, `Int4 = 3`).
    pub key_dtype: i32,
    pub val_dtype: i32,
}
const _: () = assert!(std::mem::size_of::<SegHeadDesc>() == 96);

/// The kernels' dtype tag of a layout (`MKV_F16` / `MKV_INT8` / `MKV_INT4` in common.cuh,
/// the strategy's own tag).
pub fn dtype_tag(l: &mosaickv_spec::RecordLayout) -> i32 {
    use mosaickv_spec::ValueDtype;
    match l.dtype {
        ValueDtype::F16 => mosaickv_kernels::DTYPE_F16,
        ValueDtype::Int8 => mosaickv_kernels::DTYPE_INT8,
        ValueDtype::Int4 => mosaickv_kernels::DTYPE_INT4,
        // refused before any table is built (`refuse_coded_cache` in `build_reserved`, and in
        // every encode/decode entry): the kernels read bitmap records only (SPEC.md 6.1)
        ValueDtype::Coded => unreachable!("coded records never reach the CUDA tables"),
    }
}

/// One block of a KV head's global block order (SPEC.md section 8.3).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockRefDesc {
    pub gseg: i32,
    pub block: i32,
    pub start: i32,
    pub len: i32,
}
const _: () = assert!(std::mem::size_of::<BlockRefDesc>() == 16);

/// Everything a batch of caches needs on the device, flattened.
/// Sequence b's segments are `seg_base[b]..seg_base[b + 1]` (global segment
/// indices); `(b, j)` pairs are `bj = b * kv_heads + j`.
#[derive(Debug, Default, Clone)]
pub struct HostTables {
    pub kv_heads: usize,
    pub q_heads: usize,
    pub head_dim: usize,
    pub batch: usize,
    pub packed_k: Vec<u8>,
    pub packed_v: Vec<u8>,
    /// Rotations as f16 bits (SPEC.md section 3), keys then values per (segment, head).
    pub rot: Vec<u16>,
    /// Block metadata (SPEC.md 7): int8 bounds as bytes, one f32 scale per block.
    pub meta_min: Vec<u8>,
    pub meta_max: Vec<u8>,
    pub meta_scale: Vec<f32>,
    pub seg: Vec<SegHeadDesc>,
    pub seg_batch: Vec<i32>,
    pub seg_base: Vec<i32>,
    pub blocks: Vec<BlockRefDesc>,
    pub block_owner: Vec<i32>,
    pub block_base: Vec<i64>,
    /// `block_end[bj]`: end of bj's blocks; `block_base[bj + 1]` unless entries are reserved
    /// after them ([`Reserve::blocks`], zero-length, skipped by the kernels).
    pub block_end: Vec<i64>,
    pub block_lens: Vec<i32>,
    /// `seg_first_block[gseg * kv_heads + j]`: index (within bj's list) of the segment's block 0.
    pub seg_first_block: Vec<i64>,
    pub dense_k: Vec<u16>,
    pub dense_v: Vec<u16>,
    pub dense_base: Vec<i64>,
    pub dense_count: Vec<i32>,
    /// Rows reserved per sequence for dense rows (sink + buffer + the spare rows asked for).
    pub dense_capacity: Vec<i32>,
    pub budget: Vec<i64>,
    /// Segments of sequence b in use: slots `seg_base[b]..seg_base[b] + seg_used[b]`; the
    /// rest up to `seg_base[b + 1]` are reserved ([`Reserve::segments`], zero descriptors).
    pub seg_used: Vec<i32>,
    /// Sink rows of sequence b (its dense rows are the sink, then the update buffer).
    pub sink_rows: Vec<i32>,
    /// Upper bound on the work items of any bj for a given run length (see [`HostTables::max_items`]).
    pub max_blocks_selected: usize,
    pub max_segments: usize,
}

/// Room reserved in the tables for changes made on the device ([`super::CudaCache`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reserve {
    /// Zero dense rows after each sequence's sink and buffer rows, for appended tokens.
    pub rows: usize,
    /// Zero segment descriptors after each sequence's segments, for swaps that add segments.
    pub segments: usize,
    /// Zero-length block entries after each (sequence, KV head)'s blocks, for swaps that add blocks.
    pub blocks: usize,
}

impl HostTables {
    /// Builds the tables for `caches` (one per sequence; all of the same shape).
    /// Validates every packed record (SPEC.md section 6) before anything is uploaded.
    pub fn build(caches: &[&CompressedCache]) -> Result<Self> {
        Self::build_reserved(caches, Reserve::default())
    }

    /// [`HostTables::build`] with room reserved per sequence ([`Reserve`]): dense rows so
    /// tokens can be appended on the device one at a time, segment slots and block entries
    /// so a swap can change a sequence's segments in place ([`super::CudaCache`]).
    pub fn build_reserved(caches: &[&CompressedCache], reserve: Reserve) -> Result<Self> {
        for cache in caches {
            crate::refuse_coded_cache(cache)?;
        }
        let spare = reserve.rows;
        let first = caches.first().ok_or(MosaicError::EmptyCache)?;
        let shape = first.shape;
        let (kv, d) = (shape.kv_heads, shape.head_dim);
        let mut t = HostTables {
            kv_heads: kv,
            q_heads: shape.q_heads,
            head_dim: d,
            batch: caches.len(),
            ..Default::default()
        };
        t.seg_base.push(0);
        t.dense_base.push(0);
        let mut per_bj_blocks: Vec<Vec<BlockRefDesc>> = vec![Vec::new(); caches.len() * kv];
        for (b, c) in caches.iter().enumerate() {
            if c.shape != shape {
                return Err(MosaicError::ShapeMismatch {
                    what: "batch cache shape",
                    expected: format!("{shape:?}"),
                    got: format!("{:?}", c.shape),
                });
            }
            // The one structural validator (spec crate), as every backend runs it.
            c.validate_for_attention()?;
            if c.is_empty() {
                return Err(MosaicError::EmptyCache);
            }
            let gseg0 = t.seg_batch.len();
            let mut seg_tokens = 0usize;
            let mut bmin = usize::MAX;
            let mut bmax = 1usize;
            for (s, seg) in c.segments.iter().enumerate() {
                let gseg = gseg0 + s;
                t.seg_batch.push(b as i32);
                seg_tokens += seg.len;
                for (j, h) in seg.heads.iter().enumerate() {
                    let (kl, vl) = (&h.strategy.key.layout, &h.strategy.value.layout);
                    // What the kernels add to the spec's checks: their head_dim limit.
                    if kl.head_dim != d || vl.head_dim != d || d > mosaickv_kernels::MAX_HEAD_DIM {
                        return Err(MosaicError::ShapeMismatch {
                            what: "strategy head_dim",
                            expected: format!("{d} (at most {})", mosaickv_kernels::MAX_HEAD_DIM),
                            got: format!("{} / {}", kl.head_dim, vl.head_dim),
                        });
                    }
                    let bs = h.strategy.block_size;
                    let blocks = h.meta.blocks();
                    bmin = bmin.min(bs);
                    bmax = bmax.max(bs);
                    // Keep every meta chunk 8-element aligned.
                    while t.meta_min.len() % 8 != 0 {
                        t.meta_min.push(0);
                        t.meta_max.push(0);
                    }
                    let desc = SegHeadDesc {
                        key_rec_off: t.packed_k.len() as i64,
                        val_rec_off: t.packed_v.len() as i64,
                        key_rot_off: t.rot.len() as i64,
                        val_rot_off: (t.rot.len() + h.strategy.key.rotation.len()) as i64,
                        meta_off: t.meta_min.len() as i64,
                        scale_off: t.meta_scale.len() as i64,
                        seg_len: seg.len as i32,
                        block_size: bs as i32,
                        key_dt: kl.kept_dims as i32,
                        key_r: kl.r as i32,
                        key_g: kl.group_size as i32,
                        key_rb: kl.record_bytes() as i32,
                        val_dt: vl.kept_dims as i32,
                        val_r: vl.r as i32,
                        val_g: vl.group_size as i32,
                        val_rb: vl.record_bytes() as i32,
                        key_dtype: dtype_tag(kl),
                        val_dtype: dtype_tag(vl),
                    };
                    t.packed_k.extend_from_slice(&h.keys.bytes);
                    t.packed_v.extend_from_slice(&h.values.bytes);
                    t.rot
                        .extend_from_slice(bytemuck::cast_slice(&h.strategy.key.rotation));
                    t.rot
                        .extend_from_slice(bytemuck::cast_slice(&h.strategy.value.rotation));
                    t.meta_min.extend(h.meta.min.iter().map(|&x| x as u8));
                    t.meta_max.extend(h.meta.max.iter().map(|&x| x as u8));
                    t.meta_scale.extend_from_slice(&h.meta.scale);
                    t.seg.push(desc);
                    let list = &mut per_bj_blocks[b * kv + j];
                    t.seg_first_block.push(list.len() as i64);
                    for blk in 0..blocks {
                        list.push(BlockRefDesc {
                            gseg: gseg as i32,
                            block: blk as i32,
                            start: (blk * bs) as i32,
                            len: (seg.len - blk * bs).min(bs) as i32,
                        });
                    }
                }
            }
            t.seg_used.push(c.segments.len() as i32);
            for _ in 0..reserve.segments {
                t.seg_batch.push(b as i32);
                t.seg
                    .extend(std::iter::repeat_n(SegHeadDesc::default(), kv));
                for j in 0..kv {
                    t.seg_first_block
                        .push(per_bj_blocks[b * kv + j].len() as i64);
                }
            }
            t.max_segments = t.max_segments.max(c.segments.len() + reserve.segments);
            t.seg_base.push(t.seg_batch.len() as i32);
            t.sink_rows.push(c.sink.tokens as i32);
            let budget = c.config.budget_tokens(seg_tokens);
            t.budget.push(budget as i64);
            if bmin != usize::MAX {
                t.max_blocks_selected = t
                    .max_blocks_selected
                    .max((budget + bmax) / bmin + c.segments.len());
            }
            // Dense rows: the sink, then the update buffer.
            for rows in [&c.sink, &c.buffer] {
                if rows.keys.len() != rows.tokens * kv * d
                    || rows.values.len() != rows.tokens * kv * d
                {
                    return Err(MosaicError::ShapeMismatch {
                        what: "dense rows",
                        expected: format!("{} x {kv} x {d}", rows.tokens),
                        got: format!("{} / {}", rows.keys.len(), rows.values.len()),
                    });
                }
                t.dense_k.extend(rows.keys.iter().map(|x| x.to_bits()));
                t.dense_v.extend(rows.values.iter().map(|x| x.to_bits()));
            }
            let rows = c.sink.tokens + c.buffer.tokens;
            t.dense_k.extend(std::iter::repeat_n(0u16, spare * kv * d));
            t.dense_v.extend(std::iter::repeat_n(0u16, spare * kv * d));
            t.dense_count.push(rows as i32);
            t.dense_capacity.push((rows + spare) as i32);
            t.dense_base
                .push(t.dense_base.last().copied().unwrap_or(0) + (rows + spare) as i64);
        }
        t.dense_base.pop();
        t.block_base.push(0);
        for (bj, list) in per_bj_blocks.into_iter().enumerate() {
            let first_slot = t.seg_base[bj / kv];
            t.blocks.extend_from_slice(&list);
            t.block_end.push(t.blocks.len() as i64);
            // Reserved entries: zero length (the kernels skip them), in bj's first slot.
            t.blocks.extend(std::iter::repeat_n(
                BlockRefDesc {
                    gseg: first_slot,
                    ..Default::default()
                },
                reserve.blocks,
            ));
            let n = list.len() + reserve.blocks;
            t.block_owner.extend(std::iter::repeat_n(bj as i32, n));
            t.block_lens.extend(list.iter().map(|b| b.len));
            t.block_lens.extend(std::iter::repeat_n(0, reserve.blocks));
            t.block_base.push(t.blocks.len() as i64);
        }
        Ok(t)
    }

    /// Upper bound on the work items of one bj for runs of `per_item` blocks.
    pub fn max_items(&self, per_item: usize) -> usize {
        (self.max_blocks_selected.div_ceil(per_item.max(1)) + self.max_segments).max(1)
    }

    pub fn total_segments(&self) -> usize {
        self.seg_batch.len()
    }
}
