//! [`OptimizedMosaicCache`]: the MosaicKV cache with the SPEC.md section 10
//! lifecycle, parallel encoding, and allocation-free decode attention.

use crate::attention::{packed_attention, scratch_bytes_for, MosaicScratch, SelectionSource};
use crate::backend::contig;
use crate::simd::Path;
use crate::{meta, packed, strategy};
use mosaickv_spec::query::{LossContext, QueryStats};
use mosaickv_spec::{
    rules, validate, CompressConfig, CompressedCache, HeadSegment, KvCache, KvShape, MemoryReport,
    MosaicError, Result, Segment, SegmentState, Side, Strategy,
};
use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2};
use rayon::prelude::*;

/// Scratch bytes one decode step of packed attention needs for a cache of
/// `tokens` tokens under `config` (upper bound; per-thread tile buffers of
/// `4 * (2 * 16 * pad8(head_dim) + 16 * group)` bytes come on top).
pub fn attend_scratch_bytes(shape: &KvShape, config: &CompressConfig, tokens: usize) -> usize {
    let seg_tokens = tokens.saturating_sub(config.sink_tokens);
    let nseg = seg_tokens.div_ceil(config.input_segment_len.max(1)).max(1) + 1;
    let bmin = config.block_sizes.first().copied().unwrap_or(1).max(1);
    let blocks = seg_tokens.div_ceil(bmin) + nseg;
    let selected = config.budget_tokens(seg_tokens).div_ceil(bmin) + nseg;
    scratch_bytes_for(
        shape.kv_heads,
        shape.group(),
        shape.head_dim,
        nseg,
        blocks,
        selected,
    )
}

/// Encodes one head's segment rows (SPEC 10.1: fit, encode, metadata).
/// `ctx`: the attention loss's statistics for a prompt segment (SPEC.md section 11.1).
pub(crate) fn encode_segment(
    keys: &[f32],
    values: &[f32],
    d: usize,
    config: &CompressConfig,
    ctx: Option<LossContext<'_>>,
) -> Result<HeadSegment> {
    let (ks, kr) = strategy::fit_side_rotated_with(keys, d, Side::Key, config, ctx)?;
    let packed_k = packed::pack_rotated(&kr, d, &ks)?;
    drop(kr);
    let (vs, vr) = strategy::fit_side_rotated_with(values, d, Side::Value, config, ctx)?;
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

/// SPEC 10.2 step 1 when the cache has no segment at all: each head's temporary
/// strategy fitted on the buffer rows (`[n][kv][d]`), heads in order (the first
/// head's error wins, as in the reference).
pub(crate) fn first_strategies(
    keys: &[f32],
    values: &[f32],
    kv: usize,
    d: usize,
    config: &CompressConfig,
) -> Result<Vec<Strategy>> {
    let n = keys.len() / (kv * d).max(1);
    first_error_in_order(
        (0..kv)
            .into_par_iter()
            .map(|h| {
                let k = gather(keys, kv, d, h, 0, n);
                let v = gather(values, kv, d, h, 0, n);
                let (ks, _) = strategy::fit_side_rotated(&k, d, Side::Key, config)?;
                let (vs, _) = strategy::fit_side_rotated(&v, d, Side::Value, config)?;
                let packed = packed::encode_rows(&k, &ks)?;
                let dense = packed::decode_trusted(&packed, &ks);
                let block_size = strategy::block_size_dense(&dense, ks.layout.kept_dims, config);
                Ok(Strategy {
                    key: ks,
                    value: vs,
                    block_size,
                })
            })
            .collect(),
    )
}

/// Gathers head `h`'s rows `[t0, t1)` from `[tokens][kv][d]` data into `[n][d]`.
fn gather(data: &[f32], kv: usize, d: usize, h: usize, t0: usize, t1: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity((t1 - t0) * d);
    for t in t0..t1 {
        let o = (t * kv + h) * d;
        out.extend_from_slice(&data[o..o + d]);
    }
    out
}

/// The MosaicKV cache of one layer on the CPU: a [`CompressedCache`] plus the
/// host-side f32 rows the lifecycle needs and reusable attention scratch.
#[derive(Debug)]
pub struct OptimizedMosaicCache {
    path: Path,
    cache: CompressedCache,
    /// f32 rows of the update buffer, `[tokens][kv][d]` (SPEC 10.2).
    buf_k: Vec<f32>,
    buf_v: Vec<f32>,
    /// f32 rows of the open segment, `[tokens][kv][d]`.
    open_k: Vec<f32>,
    open_v: Vec<f32>,
    /// Running SPEC 11.1 loss sums of the open rows under the temporary strategy, per head
    /// and side (K then V).
    open_loss: Vec<[strategy::LossSums; 2]>,
    scratch: MosaicScratch,
    out_tmp: Vec<f32>,
    /// The layer's query statistics for the attention loss (SPEC.md section 11.1), if given.
    query_stats: Option<QueryStats>,
}

impl OptimizedMosaicCache {
    /// An empty cache; the config is validated against the shape.
    pub fn new(shape: KvShape, config: CompressConfig) -> Result<Self> {
        Self::with_path(shape, config, Path::detect())
    }

    /// An empty cache using the portable kernels.
    pub fn portable(shape: KvShape, config: CompressConfig) -> Result<Self> {
        Self::with_path(shape, config, Path::Portable)
    }

    fn with_path(shape: KvShape, config: CompressConfig, path: Path) -> Result<Self> {
        KvShape::new(shape.kv_heads, shape.q_heads, shape.head_dim)?;
        config.validate(shape.head_dim)?;
        Ok(Self {
            path,
            cache: CompressedCache::new(shape, config),
            buf_k: Vec::new(),
            buf_v: Vec::new(),
            open_k: Vec::new(),
            open_v: Vec::new(),
            open_loss: Vec::new(),
            scratch: MosaicScratch::default(),
            out_tmp: Vec::new(),
            query_stats: None,
        })
    }

    /// The loss strategies are chosen by (SPEC.md section 11.1), as the manifest reports it.
    pub fn loss_in_use(&self) -> &'static str {
        mosaickv_spec::query::loss_in_use(&self.cache.config, self.query_stats.is_some())
    }

    /// The compressed data (SPEC.md section 9's cache).
    pub fn compressed(&self) -> &CompressedCache {
        &self.cache
    }

    /// Which kernels run ("cpu-avx2" / "cpu-portable").
    pub fn backend_name(&self) -> &'static str {
        match self.path {
            Path::Avx2 => "cpu-avx2",
            Path::Avx512 => "cpu-avx512",
            Path::Portable => "cpu-portable",
        }
    }

    fn open_segment(&self) -> Option<usize> {
        match self.cache.segments.last() {
            Some(s) if s.state == SegmentState::Open => Some(self.cache.segments.len() - 1),
            _ => None,
        }
    }

    /// SPEC 10.2 flush of a full buffer, then the SPEC 10.3 close rule.
    ///
    /// Every fallible step (fitting, encoding, the close's re-encoding: a kept
    /// rotated value beyond f16 is `NonFinite`) runs before the first mutation,
    /// in the reference's order (heads ascending, keys before values), so an
    /// error leaves the cache as it was and names the same element.
    fn flush(&mut self) -> Result<()> {
        let shape = self.cache.shape;
        let (kv, d) = (shape.kv_heads, shape.head_dim);
        let n = self.cache.buffer.tokens;
        let config = self.cache.config.clone();
        let start = self.cache.sink.tokens + self.cache.segment_tokens();
        let (bk, bv) = (&self.buf_k, &self.buf_v);
        let open = self.open_segment();
        // 1. The temporary strategy per head: the open segment's, else the last
        //    segment's (cloned: it becomes the new open segment's), else fitted on the
        //    buffer rows. The open segment's is only borrowed, so a flush into an open
        //    segment copies no rotation.
        let new_open: Option<Vec<Strategy>> = match (open, self.cache.segments.last()) {
            (Some(_), _) => None,
            (None, Some(last)) => Some(last.heads.iter().map(|h| h.strategy.clone()).collect()),
            (None, None) => Some(first_strategies(bk, bv, kv, d, &config)?),
        };
        let strategies: Vec<&Strategy> = match (&new_open, open) {
            (Some(st), _) => st.iter().collect(),
            (None, Some(i)) => self.cache.segments[i]
                .heads
                .iter()
                .map(|h| &h.strategy)
                .collect(),
            (None, None) => unreachable!("a strategy was fitted above"),
        };
        // 2. The buffer encoded with it, the new rows' loss sums (SPEC 11.1).
        type Part = (
            mosaickv_spec::PackedRows,
            mosaickv_spec::PackedRows,
            Vec<f32>,
            [strategy::LossSums; 2],
        );
        let parts: Vec<Part> = first_error_in_order(
            strategies
                .par_iter()
                .enumerate()
                .map(|(h, st)| {
                    let k = gather(bk, kv, d, h, 0, n);
                    let v = gather(bv, kv, d, h, 0, n);
                    let pk = packed::encode_rows(&k, &st.key)?;
                    let pv = packed::encode_rows(&v, &st.value)?;
                    let dense = packed::decode_trusted(&pk, &st.key);
                    Ok((
                        pk,
                        pv,
                        dense,
                        [
                            strategy::loss_sums(&k, &st.key),
                            strategy::loss_sums(&v, &st.value),
                        ],
                    ))
                })
                .collect(),
        )?;
        let old_len = open.map_or(0, |i| self.cache.segments[i].len);
        let mut open_loss = if open.is_some() {
            self.open_loss.clone()
        } else {
            vec![Default::default(); kv]
        };
        for (h, p) in parts.iter().enumerate() {
            for s in 0..2 {
                open_loss[h][s].add(&p.3[s]);
            }
        }
        // 3. The close rule (SPEC 10.3); closing fits and encodes the segment's own strategy.
        let new_len = old_len + n;
        let margin = config.segment_loss_margin;
        let drifted = new_len >= config.min_segment_len
            && strategies.iter().zip(&open_loss).any(|(st, sums)| {
                sums[0].loss(Side::Key) > st.key.fit_loss + margin
                    || sums[1].loss(Side::Value) > st.value.fit_loss + margin
            });
        let closed: Option<Vec<HeadSegment>> = if new_len >= config.max_segment_len || drifted {
            let (ok, ov) = (&self.open_k, &self.open_v);
            Some(first_error_in_order(
                (0..kv)
                    .into_par_iter()
                    .map(|h| {
                        let mut k = gather(ok, kv, d, h, 0, old_len);
                        k.extend(gather(bk, kv, d, h, 0, n));
                        let mut v = gather(ov, kv, d, h, 0, old_len);
                        v.extend(gather(bv, kv, d, h, 0, n));
                        encode_segment(&k, &v, d, &config, None)
                    })
                    .collect(),
            )?)
        } else {
            None
        };

        drop(strategies);

        // Commit (infallible from here on).
        if let Some(strategies) = new_open {
            let heads = strategies
                .into_iter()
                .map(|strategy| HeadSegment {
                    meta: mosaickv_spec::BlockMeta::empty(
                        strategy.block_size,
                        strategy.key.layout.kept_dims,
                    ),
                    strategy,
                    keys: Default::default(),
                    values: Default::default(),
                })
                .collect();
            self.cache.segments.push(Segment {
                start,
                len: 0,
                state: SegmentState::Open,
                heads,
            });
            self.open_k.clear();
            self.open_v.clear();
        }
        let seg = self.cache.segments.last_mut().expect("an open segment");
        match closed {
            Some(heads) => {
                seg.heads = heads;
                seg.state = SegmentState::Closed;
                self.open_k = Vec::new();
                self.open_v = Vec::new();
                self.open_loss.clear();
            }
            None => {
                for (hs, (pk, pv, dense, _)) in seg.heads.iter_mut().zip(parts) {
                    hs.keys.bytes.extend_from_slice(&pk.bytes);
                    hs.keys.count += pk.count;
                    hs.values.bytes.extend_from_slice(&pv.bytes);
                    hs.values.count += pv.count;
                    let b = hs.strategy.block_size;
                    let dt = hs.strategy.key.layout.kept_dims;
                    if old_len % b == 0 {
                        let m = meta::block_meta_dense(&dense, dt, b);
                        debug_assert_eq!(m.tokens, n);
                        hs.meta.append(&m);
                    } else {
                        let all = packed::decode_trusted(&hs.keys, &hs.strategy.key);
                        hs.meta = meta::block_meta_dense(&all, dt, b);
                    }
                }
                self.open_k.extend_from_slice(&self.buf_k);
                self.open_v.extend_from_slice(&self.buf_v);
                self.open_loss = open_loss;
            }
        }
        seg.len = new_len;
        self.cache.buffer.clear();
        self.buf_k.clear();
        self.buf_v.clear();
        Ok(())
    }
}

/// The results of per-head work in head order, or the first head's error: rayon's
/// `collect::<Result<_>>` may return any failing item's error, and SPEC.md section 14
/// wants the same error (and index) on every backend.
pub(crate) fn first_error_in_order<T>(results: Vec<Result<T>>) -> Result<Vec<T>> {
    results.into_iter().collect()
}

impl KvCache for OptimizedMosaicCache {
    fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        let s = self.cache.shape;
        self.cache.shape = KvShape::new(s.kv_heads, q_heads, s.head_dim)?;
        Ok(())
    }
    fn attended(&self, queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>> {
        crate::select::attended_tokens(&self.cache, queries).map(Some)
    }
    fn compressed(&self) -> Option<&CompressedCache> {
        Some(&self.cache)
    }
    /// The host rows of SPEC.md section 15.3: the open segment's, then the buffer's.
    fn save(&mut self, path: &std::path::Path) -> Result<()> {
        let keys = [self.open_k.as_slice(), self.buf_k.as_slice()].concat();
        let values = [self.open_v.as_slice(), self.buf_v.as_slice()].concat();
        mosaickv_spec::persist::save_cache(path, &self.cache, &keys, &values)
    }
    /// Gives (or with `None` removes) the layer's query statistics, used by the prompt
    /// segments' strategies (`prefill`) when the configuration's loss is `attention` (SPEC.md
    /// section 11.1); checked against the shape, nothing changes on error.
    fn set_query_stats(&mut self, stats: Option<QueryStats>) -> Result<()> {
        if let Some(st) = &stats {
            st.validate(&self.cache.shape)?;
        }
        self.query_stats = stats;
        Ok(())
    }

    fn shape(&self) -> KvShape {
        self.cache.shape
    }

    fn len(&self) -> usize {
        self.cache.len()
    }

    /// SPEC 10.1: sink, then closed prompt segments, encoded in parallel over (segment, head).
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<()> {
        let shape = self.cache.shape;
        validate::prompt_kv(&shape, &keys, &values)?;
        if !self.cache.is_empty() {
            return Err(MosaicError::AlreadyPrefilled(self.cache.len()));
        }
        let (kv, d) = (shape.kv_heads, shape.head_dim);
        let n = keys.shape()[0];
        let kdata: Vec<f32> = keys.iter().copied().collect();
        let vdata: Vec<f32> = values.iter().copied().collect();
        let config = self.cache.config.clone();
        let (s, split) = rules::prompt_segments(n, config.sink_tokens, config.input_segment_len);
        // SPEC 14: every row's norm within f16's range (keys, then values).
        rules::rows_storable(rules::ROW_KEYS, &kdata, d)?;
        rules::rows_storable(rules::ROW_VALUES, &vdata, d)?;
        let bounds: Vec<(usize, usize)> = split.iter().map(|&(a, len)| (a, a + len)).collect();
        let jobs: Vec<(usize, usize)> = (0..bounds.len())
            .flat_map(|i| (0..kv).map(move |h| (i, h)))
            .collect();
        let encoded = first_error_in_order(
            jobs.par_iter()
                .map(|&(i, h)| {
                    let (a, b) = bounds[i];
                    let ctx = self.query_stats.as_ref().map(|stats| LossContext {
                        stats,
                        head: h,
                        start: a,
                        len: b - a,
                    });
                    encode_segment(
                        &gather(&kdata, kv, d, h, a, b),
                        &gather(&vdata, kv, d, h, a, b),
                        d,
                        &config,
                        ctx,
                    )
                })
                .collect(),
        )?;
        let mut it = encoded.into_iter();
        let mut sink = mosaickv_spec::DenseRows::default();
        for t in 0..s {
            sink.push(
                kdata[t * kv * d..(t + 1) * kv * d].iter().copied(),
                vdata[t * kv * d..(t + 1) * kv * d].iter().copied(),
            );
        }
        self.cache.sink = sink;
        for &(a, b) in &bounds {
            let heads: Vec<HeadSegment> = it.by_ref().take(kv).collect();
            self.cache.segments.push(Segment {
                start: a,
                len: b - a,
                state: SegmentState::Closed,
                heads,
            });
        }
        Ok(())
    }

    /// SPEC 10.2-10.3.
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<()> {
        let shape = self.cache.shape;
        validate::token_kv(&shape, &key, &value)?;
        rules::rows_storable(rules::ROW_KEY, &contig(&key), shape.head_dim)?;
        rules::rows_storable(rules::ROW_VALUE, &contig(&value), shape.head_dim)?;
        if self.cache.len() < self.cache.config.sink_tokens {
            self.cache
                .sink
                .push(key.iter().copied(), value.iter().copied());
            return Ok(());
        }
        self.cache
            .buffer
            .push(key.iter().copied(), value.iter().copied());
        self.buf_k.extend(key.iter().copied());
        self.buf_v.extend(value.iter().copied());
        if self.cache.buffer.tokens >= self.cache.config.buffer_capacity {
            if let Err(e) = self.flush() {
                // The flush mutated nothing (SPEC 14): take the token back out.
                let row = shape.kv_heads * shape.head_dim;
                self.cache.buffer.pop(row);
                self.buf_k.truncate(self.buf_k.len() - row);
                self.buf_v.truncate(self.buf_v.len() - row);
                return Err(e);
            }
        }
        Ok(())
    }

    fn attend(&mut self, queries: ArrayView2<f32>, mut out: ArrayViewMut2<f32>) -> Result<()> {
        let shape = self.cache.shape;
        validate::queries(&shape, &queries, out.shape())?;
        if self.cache.is_empty() {
            return Err(MosaicError::EmptyCache);
        }
        let q = contig(&queries);
        match out.as_slice_mut() {
            Some(o) => {
                packed_attention(
                    self.path,
                    &self.cache,
                    &q,
                    SelectionSource::Compute,
                    false,
                    Some(o),
                    &mut self.scratch,
                )?;
            }
            None => {
                self.out_tmp.resize(shape.q_heads * shape.head_dim, 0.0);
                packed_attention(
                    self.path,
                    &self.cache,
                    &q,
                    SelectionSource::Compute,
                    false,
                    Some(&mut self.out_tmp),
                    &mut self.scratch,
                )?;
                for (dst, &src) in out.iter_mut().zip(self.out_tmp.iter()) {
                    *dst = src;
                }
            }
        }
        Ok(())
    }

    fn memory(&self) -> MemoryReport {
        let mut m = self.cache.memory();
        m.host_rows =
            4 * (self.buf_k.len() + self.buf_v.len() + self.open_k.len() + self.open_v.len());
        m
    }
}
