//! `CudaCache`: a batch of compressed caches kept on the device between decode steps
//! (issue 17, partly: see docs/GPU.md). Segments, block metadata, sink and update
//! buffer live in device buffers; appending a token copies only that token; attention
//! runs for the whole batch in one launch sequence. Swapping in a re-encoded segment is
//! a re-upload of the batch's tables ([`CudaCache::replace`]), not yet the paper's
//! double-buffered swap that keeps decode running.

use super::device::{Buf, DeviceCache, Gpu};
use super::layout::HostTables;
use mosaickv_spec::{CompressedCache, MosaicError, Result};
use std::sync::Arc;

/// Device and host bytes of a [`CudaCache`], counted separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaCacheMemory {
    /// Every device buffer (packed records, rotations, metadata, tables, dense rows
    /// including the spare rows reserved for appends).
    pub device_bytes: usize,
    /// The host copy of the tables the launches are planned from (`HostTables`).
    pub host_bytes: usize,
}

/// A batch of caches resident on the device.
pub struct CudaCache {
    gpu: Arc<Gpu>,
    dc: DeviceCache,
    spare: usize,
}

impl CudaCache {
    /// Uploads `caches` (same shape) with `spare` dense rows reserved per sequence for
    /// [`CudaCache::append`].
    pub fn new(gpu: Arc<Gpu>, caches: &[&CompressedCache], spare: usize) -> Result<Self> {
        let t = HostTables::build_with_spare(caches, spare)?;
        let dc = DeviceCache::upload(&gpu, t)?;
        Ok(Self { gpu, dc, spare })
    }

    pub fn batch(&self) -> usize {
        self.dc.t.batch
    }

    /// Appends one token (f16 rows `[kv_heads][D]`) to sequence `b`'s update buffer on the
    /// device; only that token is copied.
    pub fn append(&mut self, b: usize, key: &[half::f16], value: &[half::f16]) -> Result<()> {
        let k: Vec<u16> = key.iter().map(|x| x.to_bits()).collect();
        let v: Vec<u16> = value.iter().map(|x| x.to_bits()).collect();
        self.dc.append_token(&self.gpu, b, &k, &v)
    }

    /// Replaces the device state with `caches` (e.g. after the background worker
    /// re-encoded a segment): a full re-upload, keeping the old state if it fails.
    pub fn replace(&mut self, caches: &[&CompressedCache]) -> Result<()> {
        if caches.len() != self.batch() {
            return Err(MosaicError::ShapeMismatch {
                what: "replacement batch",
                expected: self.batch().to_string(),
                got: caches.len().to_string(),
            });
        }
        let t = HostTables::build_with_spare(caches, self.spare)?;
        self.dc = DeviceCache::upload(&self.gpu, t)?;
        Ok(())
    }

    /// One decode step for the whole batch: queries `[batch][q_heads][D]` in, outputs
    /// `[batch][q_heads][D]` out (SPEC.md 8 and 9 on the device).
    pub fn attend(&self, queries: &[f32]) -> Result<Vec<f32>> {
        let t = &self.dc.t;
        let want = t.batch * t.q_heads * t.head_dim;
        if queries.len() != want {
            return Err(MosaicError::ShapeMismatch {
                what: "batched queries",
                expected: format!("{want} values"),
                got: queries.len().to_string(),
            });
        }
        mosaickv_spec::validate::finite("queries", queries.iter())?;
        let q: Buf<f32> = self.gpu.up(queries)?;
        let out = self.dc.attend(&self.gpu, &q)?;
        let mut v = self.gpu.down(&out)?;
        v.truncate(want);
        Ok(v)
    }

    pub fn memory(&self) -> CudaCacheMemory {
        let t = &self.dc.t;
        let host_bytes = t.packed_k.len()
            + t.packed_v.len()
            + 4 * t.rot.len()
            + t.meta_min.len()
            + t.meta_max.len()
            + 4 * t.meta_scale.len()
            + std::mem::size_of_val(&t.seg[..])
            + 4 * t.seg_batch.len()
            + 4 * t.seg_base.len()
            + std::mem::size_of_val(&t.blocks[..])
            + 4 * t.block_owner.len()
            + 8 * t.block_base.len()
            + 4 * t.block_lens.len()
            + 8 * t.seg_first_block.len()
            + 2 * t.dense_k.len()
            + 2 * t.dense_v.len()
            + 8 * t.dense_base.len()
            + 4 * t.dense_count.len()
            + 4 * t.dense_capacity.len()
            + 8 * t.budget.len();
        CudaCacheMemory {
            device_bytes: self.dc.device_bytes(),
            host_bytes,
        }
    }
}
