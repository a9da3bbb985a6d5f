//! `CudaCache`: a batch of compressed caches kept on the device between decode steps
//! (issue 17; docs/GPU.md). Segments, block metadata, sink and update buffer live in
//! device buffers; appending a token copies only that token; attention runs for the
//! whole batch, each sequence with its own length and budget, in one launch sequence.
//!
//! # Swaps (the paper's heterogeneous double buffering, section 5.4; SPEC.md 10.4)
//!
//! A re-encoded segment from the background worker (or a buffer flush, or a close that
//! replaces several provisional segments) is swapped in in two steps:
//! - [`CudaCache::begin_swap`] validates the new segments, writes their bytes (records,
//!   rotations, block metadata) into the free part of each data buffer, which no
//!   descriptor points at (the second buffer), and keeps their descriptors on the host.
//!   Decode goes on: attention reads the current descriptors, so it still sees the old
//!   segments, and tokens can still be appended.
//! - [`CudaCache::commit_swap`], between two steps, switches with one small table update
//!   of that one sequence: its segment descriptors from the first replaced one on (96 B per
//!   segment and KV head), its block entries from the first replaced block on (24 B per
//!   block and KV head), its end of blocks, budget and dense row count, and, when a flush
//!   consumed buffer rows, the buffer rows appended since. The old segments' bytes become
//!   free room for the next swap. No other sequence's tables or any other segment's bytes move.
//!
//! Room for this is reserved at construction ([`CudaCacheOptions`]): dense rows for
//! appends, segment slots and block entries per sequence, and per data buffer the bytes of
//! `swap_tokens` tokens at the largest record size the head dimension allows. A swap or
//! append that does not fit is a typed error and leaves the cache as it was.
//!
//! On a device, every copy and launch goes to one stream, so the upload of a swap is
//! ordered between the launches of the surrounding decode steps rather than overlapped
//! with them (a second copy stream is not implemented); the decode steps between
//! `begin_swap` and `commit_swap` are not delayed by anything but that copy.

use super::device::{DataRoom, DeviceCache, Gpu};
use super::layout::{BlockRefDesc, HostTables, Reserve, SegHeadDesc};
use mosaickv_spec::{
    CompressConfig, CompressedCache, DenseRows, MosaicError, Result, Segment, Selection,
};
use std::sync::Arc;

/// Room a [`CudaCache`] reserves on the device for appends and swaps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CudaCacheOptions {
    /// Dense rows per sequence past its sink and update buffer, for appended tokens (a
    /// flush swap consumes buffer rows and frees them again).
    pub spare_rows: usize,
    /// Segment slots per sequence past its segments (a swap may add segments).
    pub spare_segments: usize,
    /// Block entries per (sequence, KV head) past its blocks (a swap may add blocks).
    pub spare_blocks: usize,
    /// Tokens the new segments of one pending swap may hold: every data buffer reserves
    /// their bytes at the largest record the head dimension allows (group size 1, every
    /// dim kept), block size 1 for the metadata.
    pub swap_tokens: usize,
    /// Segments one pending swap may bring (their rotations are reserved, `D x D` each side).
    pub swap_segments: usize,
}

/// Device and host bytes of a [`CudaCache`], counted separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaCacheMemory {
    /// Every device buffer, as requested from the driver: packed records, rotations,
    /// metadata, tables, dense rows, and all reserved room (whether in use or not).
    /// The scratch buffers of one `attend` call are freed when it returns.
    pub device_bytes: usize,
    /// Of `device_bytes`: the new segments of the swap in flight, already on the device
    /// and not yet read by attention (0 without a swap in flight).
    pub device_staged_bytes: usize,
    /// Of `device_bytes`: the segments the swap in flight replaces, still read by
    /// attention until the commit frees them (0 without a swap in flight).
    pub device_replaced_bytes: usize,
    /// Of `device_bytes`: data-buffer room no segment uses (the swap reserve left).
    pub device_free_bytes: usize,
    /// Every host byte the cache holds (vector contents, not allocator slack): the tables
    /// the launches are planned from, the mirror of the dense rows, the per-sequence
    /// bookkeeping (spans, configs, the reserve's free lists) and the swap in flight's
    /// descriptors.
    pub host_bytes: usize,
    /// Of `host_bytes`: the swap in flight's descriptors and block entries.
    pub host_staged_bytes: usize,
}

/// Free ranges of one data buffer (element offsets), first fit, coalesced.
#[derive(Debug, Clone)]
struct Arena {
    free: Vec<(usize, usize)>,
}

impl Arena {
    fn new(used: usize, cap: usize) -> Self {
        Self {
            free: if cap > used {
                vec![(used, cap - used)]
            } else {
                Vec::new()
            },
        }
    }

    fn alloc(&mut self, len: usize, align: usize) -> Option<usize> {
        if len == 0 {
            return Some(0);
        }
        for i in 0..self.free.len() {
            let (off, n) = self.free[i];
            let start = off.next_multiple_of(align);
            if start + len <= off + n {
                let tail = (start + len, off + n - start - len);
                let head = (off, start - off);
                self.free.remove(i);
                for r in [tail, head] {
                    if r.1 > 0 {
                        self.free.insert(i, r);
                    }
                }
                return Some(start);
            }
        }
        None
    }

    fn release(&mut self, off: usize, len: usize) {
        if len == 0 {
            return;
        }
        let i = self.free.partition_point(|&(o, _)| o < off);
        debug_assert!(i == 0 || self.free[i - 1].0 + self.free[i - 1].1 <= off);
        debug_assert!(i == self.free.len() || off + len <= self.free[i].0);
        self.free.insert(i, (off, len));
        if i + 1 < self.free.len() && off + len == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == off {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }

    fn free_total(&self) -> usize {
        self.free.iter().map(|r| r.1).sum()
    }
}

/// The five data arenas (packed keys, packed values, rotations, metadata bounds, scales).
#[derive(Debug, Clone)]
struct Arenas {
    pk: Arena,
    pv: Arena,
    rot: Arena,
    meta: Arena,
    scale: Arena,
}

/// The data ranges (element offset, length) of one (segment, KV head) in the five arenas;
/// rotations are one range, keys then values (as uploaded and as staged).
#[derive(Debug, Clone, Copy, Default)]
struct Ranges {
    pk: (usize, usize),
    pv: (usize, usize),
    rot: (usize, usize),
    meta: (usize, usize),
    scale: (usize, usize),
}

impl Ranges {
    fn of(s: &SegHeadDesc, d: usize) -> Self {
        let len = s.seg_len as usize;
        let blocks = len.div_ceil((s.block_size as usize).max(1));
        Ranges {
            pk: (s.key_rec_off as usize, len * s.key_rb as usize),
            pv: (s.val_rec_off as usize, len * s.val_rb as usize),
            rot: (
                s.key_rot_off as usize,
                d * (s.key_dt as usize + s.val_dt as usize),
            ),
            meta: (
                s.meta_off as usize,
                (blocks * s.key_dt as usize).next_multiple_of(8),
            ),
            scale: (s.scale_off as usize, blocks),
        }
    }

    /// Bytes of data on the device.
    fn bytes(&self) -> usize {
        self.pk.1 + self.pv.1 + 2 * self.rot.1 + 2 * self.meta.1 + 4 * self.scale.1
    }
}

/// A swap written to the device's free room and waiting for [`CudaCache::commit_swap`].
struct Pending {
    b: usize,
    first: usize,
    count: usize,
    consumed: usize,
    /// `[new segment][kv_heads]`, offsets into the data buffers.
    descs: Vec<SegHeadDesc>,
    /// The new segments' (start, len).
    spans: Vec<(usize, usize)>,
    /// The data ranges the new segments occupy (one set for the whole fragment).
    ranges: Ranges,
}

/// A batch of caches resident on the device.
pub struct CudaCache {
    gpu: Arc<Gpu>,
    dc: DeviceCache,
    arenas: Arenas,
    /// Per sequence: its config (budget rule) and its segments' (start, len).
    configs: Vec<CompressConfig>,
    spans: Vec<Vec<(usize, usize)>>,
    pending: Option<Pending>,
    /// Set when a device write failed half-way through a commit: the tables on the device
    /// no longer match the host's, so every later call is refused.
    poisoned: bool,
}

fn invalid(what: impl Into<String>) -> MosaicError {
    MosaicError::InvalidConfig(what.into())
}

/// The largest record bytes of head dimension `d` (SPEC.md 6: every dim kept, groups of
/// one, the largest of the three value dtypes: f16 for every `d >= 4`, where the 4 bytes of
/// an int8/int4 record's minimum and scale are less than what its codes save).
fn worst_record_bytes(d: usize) -> usize {
    mosaickv_spec::ValueDtype::ALL
        .iter()
        .map(|&dt| mosaickv_spec::layout::record_bytes_for(d, d, 1, dt))
        .max()
        .unwrap_or(0)
}

impl CudaCache {
    /// Uploads `caches` (same shape; lengths, budgets and configs may differ) with the
    /// room of `opts` reserved.
    pub fn new(gpu: Arc<Gpu>, caches: &[&CompressedCache], opts: CudaCacheOptions) -> Result<Self> {
        let reserve = Reserve {
            rows: opts.spare_rows,
            segments: opts.spare_segments,
            blocks: opts.spare_blocks,
        };
        let mut t = HostTables::build_reserved(caches, reserve)?;
        let (kv, d) = (t.kv_heads, t.head_dim);
        // Whole 8-byte metadata chunks, so that every range a segment frees is aligned.
        let meta_used = t.meta_min.len().next_multiple_of(8);
        t.meta_min.resize(meta_used, 0);
        t.meta_max.resize(meta_used, 0);
        let room = DataRoom {
            packed_k: opts.swap_tokens * kv * worst_record_bytes(d),
            packed_v: opts.swap_tokens * kv * worst_record_bytes(d),
            rot: opts.swap_segments * kv * 2 * d * d,
            meta: (opts.swap_tokens * kv * d).next_multiple_of(8),
            scale: opts.swap_tokens * kv,
        };
        let arenas = Arenas {
            pk: Arena::new(t.packed_k.len(), t.packed_k.len() + room.packed_k),
            pv: Arena::new(t.packed_v.len(), t.packed_v.len() + room.packed_v),
            rot: Arena::new(t.rot.len(), t.rot.len() + room.rot),
            meta: Arena::new(meta_used, meta_used + room.meta),
            scale: Arena::new(t.meta_scale.len(), t.meta_scale.len() + room.scale),
        };
        let mut dc = DeviceCache::upload_with_room(&gpu, t, room)?;
        // The data lives on the device only; the host keeps the tables and the dense rows.
        for v in [
            &mut dc.t.packed_k,
            &mut dc.t.packed_v,
            &mut dc.t.meta_min,
            &mut dc.t.meta_max,
        ] {
            *v = Vec::new();
        }
        dc.t.rot = Vec::new();
        dc.t.meta_scale = Vec::new();
        Ok(Self {
            gpu,
            dc,
            arenas,
            configs: caches.iter().map(|c| c.config.clone()).collect(),
            spans: caches
                .iter()
                .map(|c| c.segments.iter().map(|s| (s.start, s.len)).collect())
                .collect(),
            pending: None,
            poisoned: false,
        })
    }

    pub fn batch(&self) -> usize {
        self.dc.t.batch
    }

    fn usable(&self) -> Result<()> {
        if self.poisoned {
            return Err(MosaicError::BackendUnavailable(
                "CudaCache: a device write failed during a swap commit; rebuild the cache".into(),
            ));
        }
        Ok(())
    }

    /// Appends one token (f16 rows `[kv_heads][D]`) to sequence `b`'s update buffer on the
    /// device; only that token is copied. Allowed while a swap is in flight.
    pub fn append(&mut self, b: usize, key: &[half::f16], value: &[half::f16]) -> Result<()> {
        self.usable()?;
        let k: Vec<u16> = key.iter().map(|x| x.to_bits()).collect();
        let v: Vec<u16> = value.iter().map(|x| x.to_bits()).collect();
        self.dc.append_token(&self.gpu, b, &k, &v)
    }

    /// Whether a swap is in flight (begun, not yet committed or cancelled).
    pub fn swap_in_flight(&self) -> bool {
        self.pending.is_some()
    }

    /// Starts a swap of sequence `b`: its segments `first..first + count` and the first
    /// `consumed` rows of its update buffer are to be replaced by `segments`, which must
    /// cover exactly those tokens (a re-encoded segment: `count` 1, `consumed` 0; a buffer
    /// flush into the open segment: the open segment, the flushed rows; a close: the
    /// provisional segments it covers). Buffer rows may be consumed only by a swap that
    /// reaches the last segment. The new segments are validated as a cache (SPEC.md 6-7)
    /// and their bytes written into the free room of the data buffers; attention keeps
    /// reading the current segments until [`CudaCache::commit_swap`]. On any error nothing
    /// the cache attends changes.
    pub fn begin_swap(
        &mut self,
        b: usize,
        first: usize,
        count: usize,
        segments: Vec<Segment>,
        consumed: usize,
    ) -> Result<()> {
        self.usable()?;
        if self.pending.is_some() {
            return Err(invalid(
                "CudaCache: a swap is already in flight; commit or cancel it first",
            ));
        }
        let t = &self.dc.t;
        if b >= t.batch {
            return Err(MosaicError::ShapeMismatch {
                what: "swapped sequence",
                expected: format!("< {}", t.batch),
                got: b.to_string(),
            });
        }
        let spans = &self.spans[b];
        let used = spans.len();
        if first + count > used {
            return Err(MosaicError::ShapeMismatch {
                what: "swapped segments",
                expected: format!("a range inside the sequence's {used} segments"),
                got: format!("{first}..{}", first + count),
            });
        }
        let buffered = (t.dense_count[b] - t.sink_rows[b]) as usize;
        if consumed > buffered || (consumed > 0 && first + count != used) {
            return Err(MosaicError::ShapeMismatch {
                what: "consumed buffer rows",
                expected: format!(
                    "at most the {buffered} buffered rows, by a swap that reaches the last segment"
                ),
                got: format!(
                    "{consumed} rows, segments {first}..{} of {used}",
                    first + count
                ),
            });
        }
        if segments.is_empty() {
            return Err(MosaicError::ShapeMismatch {
                what: "swapped-in segments",
                expected: "at least one".into(),
                got: "none".into(),
            });
        }
        let start = match spans.get(first) {
            Some(&(s, _)) => s,
            None => spans
                .last()
                .map(|&(s, l)| s + l)
                .unwrap_or(t.sink_rows[b] as usize),
        };
        let removed: usize = spans[first..first + count].iter().map(|s| s.1).sum();
        let covered: usize = segments.iter().map(|s| s.len).sum();
        if segments[0].start != start || covered != removed + consumed {
            return Err(MosaicError::ShapeMismatch {
                what: "swapped-in segments",
                expected: format!("tokens {start}..{}", start + removed + consumed),
                got: format!(
                    "tokens {}..{}",
                    segments[0].start,
                    segments[0].start + covered
                ),
            });
        }
        let n_new = segments.len();
        let slots = (t.seg_base[b + 1] - t.seg_base[b]) as usize;
        if used - count + n_new > slots {
            return Err(invalid(format!(
                "CudaCache: sequence {b} would have {} segments; {slots} slots are reserved",
                used - count + n_new
            )));
        }
        // The new segments as a cache of their own (starts moved to follow the sink), so
        // the one validator (spec crate) and the one table builder check and lay them out.
        let kv = t.kv_heads;
        let sink = t.sink_rows[b] as usize;
        let row = kv * t.head_dim;
        let spans_new: Vec<(usize, usize)> = segments.iter().map(|s| (s.start, s.len)).collect();
        let mut tmp = CompressedCache::new(
            mosaickv_spec::KvShape::new(kv, t.q_heads, t.head_dim)?,
            self.configs[b].clone(),
        );
        tmp.sink = DenseRows {
            tokens: sink,
            keys: vec![half::f16::ZERO; sink * row],
            values: vec![half::f16::ZERO; sink * row],
        };
        tmp.segments = segments;
        for s in &mut tmp.segments {
            s.start = s.start.wrapping_sub(start).wrapping_add(sink);
        }
        let frag = HostTables::build(&[&tmp])?;
        drop(tmp);
        // Block entries per KV head after the swap must fit the reserved entries.
        for j in 0..kv {
            let bj = b * kv + j;
            let cap = (t.block_base[bj + 1] - t.block_base[bj]) as usize;
            let now = (t.block_end[bj] - t.block_base[bj]) as usize;
            let slot0 = t.seg_base[b] as usize;
            let p = t.seg_first_block[(slot0 + first) * kv + j] as usize;
            let after: usize = if first + count < used {
                now - t.seg_first_block[(slot0 + first + count) * kv + j] as usize
            } else {
                0
            };
            let fb = (frag.block_end[j] - frag.block_base[j]) as usize;
            if p + fb + after > cap {
                return Err(invalid(format!(
                    "CudaCache: sequence {b} head {j} would have {} blocks; {cap} entries are reserved",
                    p + fb + after
                )));
            }
        }
        // Room in every data buffer, or nothing is taken.
        let mut meta_min = frag.meta_min.clone();
        let mut meta_max = frag.meta_max.clone();
        let meta_len = meta_min.len().next_multiple_of(8);
        meta_min.resize(meta_len, 0);
        meta_max.resize(meta_len, 0);
        let want = Ranges {
            pk: (0, frag.packed_k.len()),
            pv: (0, frag.packed_v.len()),
            rot: (0, frag.rot.len()),
            meta: (0, meta_len),
            scale: (0, frag.meta_scale.len()),
        };
        let mut a = self.arenas.clone();
        let full = |what: &str| {
            invalid(format!(
                "CudaCache: the swap reserve of the {what} buffer is too small for this swap"
            ))
        };
        let ranges = Ranges {
            pk: (
                a.pk.alloc(want.pk.1, 4).ok_or_else(|| full("packed key"))?,
                want.pk.1,
            ),
            pv: (
                a.pv.alloc(want.pv.1, 4)
                    .ok_or_else(|| full("packed value"))?,
                want.pv.1,
            ),
            rot: (
                a.rot.alloc(want.rot.1, 1).ok_or_else(|| full("rotation"))?,
                want.rot.1,
            ),
            meta: (
                a.meta.alloc(meta_len, 8).ok_or_else(|| full("metadata"))?,
                meta_len,
            ),
            scale: (
                a.scale
                    .alloc(want.scale.1, 1)
                    .ok_or_else(|| full("scale"))?,
                want.scale.1,
            ),
        };
        // Only the new segments' bytes move, into room no descriptor points at.
        let gpu = &*self.gpu;
        let dc = &mut self.dc;
        gpu.write(&mut dc.packed_k, ranges.pk.0, &frag.packed_k)?;
        gpu.write(&mut dc.packed_v, ranges.pv.0, &frag.packed_v)?;
        gpu.write(&mut dc.rot, ranges.rot.0, &frag.rot)?;
        gpu.write(&mut dc.meta_min, ranges.meta.0, &meta_min)?;
        gpu.write(&mut dc.meta_max, ranges.meta.0, &meta_max)?;
        gpu.write(&mut dc.meta_scale, ranges.scale.0, &frag.meta_scale)?;
        let descs = frag
            .seg
            .iter()
            .map(|s| SegHeadDesc {
                key_rec_off: s.key_rec_off + ranges.pk.0 as i64,
                val_rec_off: s.val_rec_off + ranges.pv.0 as i64,
                key_rot_off: s.key_rot_off + ranges.rot.0 as i64,
                val_rot_off: s.val_rot_off + ranges.rot.0 as i64,
                meta_off: s.meta_off + ranges.meta.0 as i64,
                scale_off: s.scale_off + ranges.scale.0 as i64,
                ..*s
            })
            .collect();
        self.arenas = a;
        self.pending = Some(Pending {
            b,
            first,
            count,
            consumed,
            descs,
            spans: spans_new,
            ranges,
        });
        Ok(())
    }

    /// Drops the swap in flight; its room is free again. Nothing attention reads changes.
    pub fn cancel_swap(&mut self) {
        if let Some(p) = self.pending.take() {
            self.release(&p.ranges);
        }
    }

    fn release(&mut self, r: &Ranges) {
        let a = &mut self.arenas;
        a.pk.release(r.pk.0, r.pk.1);
        a.pv.release(r.pv.0, r.pv.1);
        a.rot.release(r.rot.0, r.rot.1);
        a.meta.release(r.meta.0, r.meta.1);
        a.scale.release(r.scale.0, r.scale.1);
    }

    /// Switches to the swap in flight between two decode steps: one small table update of
    /// its sequence (see the module docs); the replaced segments' room is freed.
    pub fn commit_swap(&mut self) -> Result<()> {
        self.usable()?;
        let p = self
            .pending
            .take()
            .ok_or_else(|| invalid("CudaCache: no swap in flight to commit"))?;
        match self.switch(&p) {
            Ok(freed) => {
                for r in freed {
                    self.release(&r);
                }
                Ok(())
            }
            Err(e) => {
                self.poisoned = true;
                Err(e)
            }
        }
    }

    /// The table update of a commit; returns the replaced segments' data ranges.
    fn switch(&mut self, p: &Pending) -> Result<Vec<Ranges>> {
        let gpu = &*self.gpu;
        let t = &mut self.dc.t;
        let (kv, d, b) = (t.kv_heads, t.head_dim, p.b);
        let slot0 = t.seg_base[b] as usize;
        let used = self.spans[b].len();
        let n_new = p.spans.len();
        let new_used = used - p.count + n_new;
        let slots = (t.seg_base[b + 1] as usize) - slot0;
        // Segment descriptors from `first` on: the new ones, then the segments after the
        // replaced ones, then zero slots up to the old count.
        let old = |s: usize| &t.seg[(slot0 + s) * kv..(slot0 + s + 1) * kv];
        let freed: Vec<Ranges> = (p.first..p.first + p.count)
            .flat_map(|s| old(s).iter().map(|x| Ranges::of(x, d)).collect::<Vec<_>>())
            .collect();
        let mut descs: Vec<SegHeadDesc> = p.descs.clone();
        for s in p.first + p.count..used {
            descs.extend_from_slice(old(s));
        }
        let tail = used.max(new_used) - p.first;
        descs.resize(tail * kv, SegHeadDesc::default());
        let d0 = (slot0 + p.first) * kv;
        t.seg[d0..d0 + descs.len()].copy_from_slice(&descs);
        // Block entries of each KV head from the first replaced segment's first block on.
        for j in 0..kv {
            let bj = b * kv + j;
            let base = t.block_base[bj] as usize;
            let pos = t.seg_first_block[(slot0 + p.first) * kv + j] as usize;
            let old_end = (t.block_end[bj] as usize) - base;
            let mut list: Vec<BlockRefDesc> = Vec::new();
            for s in p.first..new_used {
                let desc = &t.seg[(slot0 + s) * kv + j];
                t.seg_first_block[(slot0 + s) * kv + j] = (pos + list.len()) as i64;
                let (len, bs) = (desc.seg_len as usize, desc.block_size as usize);
                for blk in 0..len.div_ceil(bs) {
                    list.push(BlockRefDesc {
                        gseg: (slot0 + s) as i32,
                        block: blk as i32,
                        start: (blk * bs) as i32,
                        len: (len - blk * bs).min(bs) as i32,
                    });
                }
            }
            let new_end = pos + list.len();
            // Unused slots start at the end (where a swap that adds a segment puts it).
            for s in new_used..slots {
                t.seg_first_block[(slot0 + s) * kv + j] = new_end as i64;
            }
            list.resize(
                old_end.max(new_end) - pos,
                BlockRefDesc {
                    gseg: slot0 as i32,
                    ..Default::default()
                },
            );
            let lens: Vec<i32> = list.iter().map(|x| x.len).collect();
            t.blocks[base + pos..base + pos + list.len()].copy_from_slice(&list);
            t.block_lens[base + pos..base + pos + lens.len()].copy_from_slice(&lens);
            t.block_end[bj] = (base + new_end) as i64;
            gpu.write(
                &mut self.dc.blocks,
                (base + pos) * 16,
                bytemuck::cast_slice::<_, u8>(&list),
            )?;
            gpu.write(&mut self.dc.block_lens, base + pos, &lens)?;
            gpu.write(&mut self.dc.block_end, bj, &[t.block_end[bj]])?;
        }
        gpu.write(
            &mut self.dc.seg,
            d0 * std::mem::size_of::<SegHeadDesc>(),
            bytemuck::cast_slice::<_, u8>(&descs),
        )?;
        // Buffer rows consumed by a flush: the rows appended after them move to the front.
        if p.consumed > 0 {
            let row = kv * d;
            let r0 = t.dense_base[b] as usize + t.sink_rows[b] as usize;
            let count = t.dense_count[b] as usize - t.sink_rows[b] as usize;
            let keep = count - p.consumed;
            t.dense_k
                .copy_within((r0 + p.consumed) * row..(r0 + count) * row, r0 * row);
            t.dense_v
                .copy_within((r0 + p.consumed) * row..(r0 + count) * row, r0 * row);
            gpu.write(
                &mut self.dc.dense_k,
                r0 * row,
                &t.dense_k[r0 * row..(r0 + keep) * row],
            )?;
            gpu.write(
                &mut self.dc.dense_v,
                r0 * row,
                &t.dense_v[r0 * row..(r0 + keep) * row],
            )?;
            t.dense_count[b] -= p.consumed as i32;
            gpu.write(&mut self.dc.dense_count, b, &[t.dense_count[b]])?;
        }
        // The sequence's spans, segment count, budget (SPEC 8.3 over its segment tokens).
        let spans = &mut self.spans[b];
        spans.splice(p.first..p.first + p.count, p.spans.iter().copied());
        t.seg_used[b] = new_used as i32;
        let seg_tokens: usize = spans.iter().map(|s| s.1).sum();
        t.budget[b] = self.configs[b].budget_tokens(seg_tokens) as i64;
        gpu.write(&mut self.dc.budget, b, &[t.budget[b]])?;
        self.recompute_bounds();
        Ok(freed)
    }

    /// `max_blocks_selected` from the current segments (it bounds the attention's work items).
    fn recompute_bounds(&mut self) {
        let t = &mut self.dc.t;
        let kv = t.kv_heads;
        let mut most = 0usize;
        for b in 0..t.batch {
            let slot0 = t.seg_base[b] as usize;
            let used = t.seg_used[b] as usize;
            let sizes = (slot0 * kv..(slot0 + used) * kv).map(|i| t.seg[i].block_size as usize);
            let (bmin, bmax) = sizes.fold((usize::MAX, 1), |(lo, hi), s| (lo.min(s), hi.max(s)));
            if bmin != usize::MAX {
                most = most.max((t.budget[b] as usize + bmax) / bmin + used);
            }
        }
        t.max_blocks_selected = most;
    }

    fn check_queries(&self, queries: &[f32]) -> Result<()> {
        self.usable()?;
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
        mosaickv_spec::rules::queries_in_range(queries.chunks(t.head_dim.max(1)), t.head_dim)
    }

    /// One decode step for the whole batch: queries `[batch][q_heads][D]` in, outputs
    /// `[batch][q_heads][D]` out (SPEC.md 8 and 9 on the device), each sequence over its
    /// own segments, dense rows and budget.
    pub fn attend(&self, queries: &[f32]) -> Result<Vec<f32>> {
        self.check_queries(queries)?;
        let q = self.gpu.up(queries)?;
        let out = self.dc.attend(&self.gpu, &q)?;
        let mut v = self.gpu.down(&out)?;
        v.truncate(queries.len());
        Ok(v)
    }

    /// [`CudaCache::attend`] for queries already on the device (a serving loop's, produced
    /// there by the model), output left on the device: no host round trip.
    pub fn attend_device(
        &self,
        queries: &super::device::Buf<f32>,
    ) -> Result<super::device::Buf<f32>> {
        self.usable()?;
        let t = &self.dc.t;
        let want = t.batch * t.q_heads * t.head_dim;
        if queries.len() != want {
            return Err(MosaicError::ShapeMismatch {
                what: "batched queries on the device",
                expected: format!("{want} values"),
                got: queries.len().to_string(),
            });
        }
        self.dc.attend(&self.gpu, queries)
    }

    /// SPEC.md 8 on the device for the whole batch: each sequence's selection, as
    /// (segment index in that sequence, block) pairs per KV head.
    pub fn select(&self, queries: &[f32]) -> Result<Vec<Selection>> {
        self.check_queries(queries)?;
        let q = self.gpu.up(queries)?;
        let (_, sel, count) = self.dc.select(&self.gpu, &q)?;
        let (sel, count) = self.dc.download_selection(&self.gpu, &sel, &count)?;
        let t = &self.dc.t;
        Ok((0..t.batch)
            .map(|b| Selection {
                per_head: (0..t.kv_heads)
                    .map(|j| {
                        let bj = b * t.kv_heads + j;
                        let b0 = t.block_base[bj] as usize;
                        (0..count[bj] as usize)
                            .map(|i| {
                                let br = t.blocks[b0 + sel[b0 + i] as usize];
                                ((br.gseg - t.seg_base[b]) as u32, br.block as u32)
                            })
                            .collect()
                    })
                    .collect(),
            })
            .collect())
    }

    pub fn memory(&self) -> CudaCacheMemory {
        let t = &self.dc.t;
        let a = &self.arenas;
        let host_tables = t.packed_k.len()
            + t.packed_v.len()
            + 2 * t.rot.len()
            + t.meta_min.len()
            + t.meta_max.len()
            + 4 * t.meta_scale.len()
            + std::mem::size_of_val(&t.seg[..])
            + 4 * t.seg_batch.len()
            + 4 * t.seg_base.len()
            + std::mem::size_of_val(&t.blocks[..])
            + 4 * t.block_owner.len()
            + 8 * t.block_base.len()
            + 8 * t.block_end.len()
            + 4 * t.block_lens.len()
            + 8 * t.seg_first_block.len()
            + 2 * t.dense_k.len()
            + 2 * t.dense_v.len()
            + 8 * t.dense_base.len()
            + 4 * t.dense_count.len()
            + 4 * t.dense_capacity.len()
            + 8 * t.budget.len()
            + 4 * t.seg_used.len()
            + 4 * t.sink_rows.len();
        // Bookkeeping: segment spans, the arenas' free lists, the per-sequence configs.
        let spans: usize = self.spans.iter().map(|s| 16 * s.len()).sum::<usize>()
            + 16 * [&a.pk, &a.pv, &a.rot, &a.meta, &a.scale]
                .iter()
                .map(|x| x.free.len())
                .sum::<usize>()
            + self
                .configs
                .iter()
                .map(|c| {
                    let channels = match &c.channels {
                        mosaickv_spec::ChannelPolicy::LossThreshold {
                            retentions,
                            group_sizes,
                            ..
                        } => {
                            std::mem::size_of_val(&retentions[..])
                                + std::mem::size_of_val(&group_sizes[..])
                        }
                        mosaickv_spec::ChannelPolicy::Fixed { .. } => 0,
                    };
                    std::mem::size_of::<CompressConfig>()
                        + std::mem::size_of_val(&c.block_sizes[..])
                        + std::mem::size_of_val(&c.value_dtypes[..])
                        + channels
                })
                .sum::<usize>();
        let (staged, replaced, host_staged) = match &self.pending {
            Some(p) => {
                let kv = t.kv_heads;
                let slot0 = t.seg_base[p.b] as usize;
                let replaced: usize = t.seg
                    [(slot0 + p.first) * kv..(slot0 + p.first + p.count) * kv]
                    .iter()
                    .map(|s| Ranges::of(s, t.head_dim).bytes())
                    .sum();
                (
                    p.ranges.bytes(),
                    replaced,
                    std::mem::size_of_val(&p.descs[..]) + 16 * p.spans.len(),
                )
            }
            None => (0, 0, 0),
        };
        let free = a.pk.free_total()
            + a.pv.free_total()
            + 2 * a.rot.free_total()
            + 2 * a.meta.free_total()
            + 4 * a.scale.free_total();
        CudaCacheMemory {
            device_bytes: self.dc.device_bytes(),
            device_staged_bytes: staged,
            device_replaced_bytes: replaced,
            device_free_bytes: free,
            host_bytes: host_tables + spans + host_staged,
            host_staged_bytes: host_staged,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Arena;

    #[test]
    fn arena_allocates_first_fit_and_coalesces() {
        let mut a = Arena::new(10, 100);
        assert_eq!(a.alloc(20, 8), Some(16));
        assert_eq!(a.free_total(), 70);
        assert_eq!(a.alloc(100, 1), None);
        a.release(16, 20);
        assert_eq!(a.free, vec![(10, 90)]);
        a.release(0, 10);
        assert_eq!(a.free, vec![(0, 100)]);
        assert_eq!(a.alloc(100, 1), Some(0));
        assert!(a.free.is_empty());
    }
}
