//! SPEC.md section 10: the cache lifecycle (sink, prompt segments, update
//! buffer, open segment with a temporary strategy, close rule), synchronous.

use crate::attention::{attend, attended_tokens};
use crate::meta::block_meta_of_decoded;
use crate::packed::{decode_rows, encode_rows};
use crate::select::select;
use crate::strategy::{fit_strategy_with, LossSums};
use half::f16;
use mosaickv_spec::query::{loss_in_use, LossContext, QueryStats};
use mosaickv_spec::rules::{rows_storable, ROW_KEY, ROW_KEYS, ROW_VALUE, ROW_VALUES};
use mosaickv_spec::validate::{finite, prompt_kv, token_kv};
use mosaickv_spec::{
    CompressConfig, CompressedCache, HeadSegment, KvCache, KvShape, MemoryReport, MosaicError,
    Result, Segment, SegmentState, Side, Strategy,
};
use ndarray::{s, Array2, ArrayView2, ArrayView3, ArrayViewMut2};

/// SPEC.md section 10.1's split (written once, in the spec crate).
pub use mosaickv_spec::rules::prompt_segments;

/// One head's segment built from its f32 rows `[n, D]` with `strategy`
/// (SPEC.md sections 5-7).
fn build_head(
    keys: ArrayView2<f32>,
    values: ArrayView2<f32>,
    strategy: Strategy,
) -> Result<HeadSegment> {
    let packed_keys = encode_rows(keys, &strategy.key)?;
    let packed_values = encode_rows(values, &strategy.value)?;
    let decoded = decode_rows(&packed_keys, &strategy.key)?;
    let meta = block_meta_of_decoded(decoded.view(), strategy.block_size);
    Ok(HeadSegment {
        strategy,
        keys: packed_keys,
        values: packed_values,
        meta,
    })
}

/// The MosaicKV cache of one layer, synchronous (SPEC.md section 10).
///
/// Holds the device-side [`CompressedCache`] and, on the host, the f32 rows
/// of the open segment's tokens followed by the buffer's tokens
/// (`[tokens][kv_heads][head_dim]`), plus the running loss sums of the open
/// segment under its temporary strategy (section 10.3, per head, K then V).
#[derive(Debug, Clone)]
pub struct MosaicCache {
    compressed: CompressedCache,
    host_keys: Vec<f32>,
    host_values: Vec<f32>,
    open_loss: Vec<[LossSums; 2]>,
    /// The layer's query statistics for the attention loss (SPEC.md section 11.1), if given.
    query_stats: Option<QueryStats>,
}

impl MosaicCache {
    /// An empty cache; the shape and the configuration are validated.
    pub fn new(shape: KvShape, config: CompressConfig) -> Result<Self> {
        let shape = KvShape::new(shape.kv_heads, shape.q_heads, shape.head_dim)?;
        config.validate(shape.head_dim)?;
        Ok(Self {
            compressed: CompressedCache::new(shape, config),
            host_keys: Vec::new(),
            host_values: Vec::new(),
            open_loss: Vec::new(),
            query_stats: None,
        })
    }

    /// The loss strategies are chosen by: `energy`, `attention`, or the energy fallback
    /// when the attention loss was asked for without statistics (SPEC.md section 11.1).
    pub fn loss_in_use(&self) -> &'static str {
        loss_in_use(&self.compressed.config, self.query_stats.is_some())
    }

    /// The loss context of head `h`'s segment of tokens `start..start + len`.
    fn loss_ctx(&self, h: usize, start: usize, len: usize) -> Option<LossContext<'_>> {
        self.query_stats.as_ref().map(|stats| LossContext {
            stats,
            head: h,
            start,
            len,
        })
    }

    /// The device-side state.
    pub fn compressed(&self) -> &CompressedCache {
        &self.compressed
    }

    /// Sets the query head count attention expects (SPEC.md section 1: the GQA group
    /// belongs to the queries, not to the stored cache); `KvShape::new` checks it.
    /// Nothing else changes.
    pub fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        let s = self.compressed.shape;
        self.compressed.shape = KvShape::new(s.kv_heads, q_heads, s.head_dim)?;
        Ok(())
    }

    /// Host f32 keys and values `[tokens][kv_heads][head_dim]`: the open
    /// segment's tokens, then the buffer's.
    pub fn host_rows(&self) -> (&[f32], &[f32]) {
        (&self.host_keys, &self.host_values)
    }

    fn row_len(&self) -> usize {
        self.compressed.shape.kv_heads * self.compressed.shape.head_dim
    }

    fn open_len(&self) -> usize {
        match self.compressed.segments.last() {
            Some(seg) if seg.state == SegmentState::Open => seg.len,
            _ => 0,
        }
    }

    /// Host rows of head `h` for host tokens `first..first + n`, as `[n, D]`.
    fn host_head_rows(
        keys: &[f32],
        shape: &KvShape,
        first: usize,
        n: usize,
        h: usize,
    ) -> Array2<f32> {
        let d = shape.head_dim;
        Array2::from_shape_fn((n, d), |(t, i)| {
            keys[((first + t) * shape.kv_heads + h) * d + i]
        })
    }

    /// Rebuilds a cache from its parts, validating that they agree: the
    /// compressed cache's whole structure ([`CompressedCache::validate`]: the
    /// sink rule, the buffer below capacity, at most the last segment open),
    /// the open segment's length a multiple of `buffer_capacity` below
    /// `max_segment_len`, host rows of exactly the open segment's and buffer's
    /// tokens, finite and within the row-norm rule (SPEC 14), and the buffer's
    /// f16 rows equal to the rounded host rows.
    pub fn from_parts(
        compressed: CompressedCache,
        host_keys: Vec<f32>,
        host_values: Vec<f32>,
    ) -> Result<Self> {
        compressed.validate()?;
        let shape = compressed.shape;
        let cfg = &compressed.config;
        // The parts come from a file (or a caller who built them): a disagreement is a bad
        // cache, reported as `BadFormat` in the optimized backend's words.
        let bad = |m: String| Err(MosaicError::BadFormat(m));
        // (`validate` checked the sink rule and the buffer below capacity.)
        let open_len = match compressed.segments.last() {
            Some(seg) if seg.state == SegmentState::Open => seg.len,
            _ => 0,
        };
        if open_len % cfg.buffer_capacity != 0 || open_len >= cfg.max_segment_len {
            return bad(format!("open segment of {open_len} tokens is not a whole number of flushes below max_segment_len"));
        }
        let host_tokens = open_len + compressed.buffer.tokens;
        let want = host_tokens * shape.kv_heads * shape.head_dim;
        if host_keys.len() != want || host_values.len() != want {
            return Err(MosaicError::ShapeMismatch {
                what: "host rows",
                expected: format!("{want} keys and values"),
                got: format!("{} keys, {} values", host_keys.len(), host_values.len()),
            });
        }
        finite("host keys", host_keys.iter())?;
        finite("host values", host_values.iter())?;
        // They are re-encoded when the open segment closes: the append rule (SPEC 14).
        let d = shape.head_dim;
        rows_storable("host keys (row norm beyond f16 range)", &host_keys, d)?;
        rows_storable("host values (row norm beyond f16 range)", &host_values, d)?;
        let buffer_from = open_len * shape.kv_heads * shape.head_dim;
        let rounded = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
        if rounded(&host_keys[buffer_from..]) != compressed.buffer.keys
            || rounded(&host_values[buffer_from..]) != compressed.buffer.values
        {
            return bad("buffer rows differ from the host rows".into());
        }
        // The open segment's records are its host rows encoded with its strategies (SPEC 10.2,
        // 15.4): a file whose two copies disagree would switch answers when the segment
        // closes and is re-encoded from the host rows. Cost: one encode of the open segment.
        if let Some(seg) = compressed.segments.last().filter(|_| open_len > 0) {
            for (h, head) in seg.heads.iter().enumerate() {
                let st = &head.strategy;
                for (side, host, stored, name) in [
                    (&st.key, &host_keys, &head.keys, "keys"),
                    (&st.value, &host_values, &head.values, "values"),
                ] {
                    let rows = Self::host_head_rows(host, &shape, 0, open_len, h);
                    if encode_rows(rows.view(), side)?.bytes != stored.bytes {
                        return bad(format!(
                            "the open segment's packed {name} of head {h} are not its host rows encoded with its strategy"
                        ));
                    }
                }
            }
        }
        let mut cache = Self {
            compressed,
            host_keys,
            host_values,
            open_loss: Vec::new(),
            query_stats: None,
        };
        if open_len > 0 {
            cache.open_loss = cache.loss_sums_of(0, open_len, &[], &cache.open_strategies());
        }
        Ok(cache)
    }

    fn open_strategies(&self) -> Vec<Strategy> {
        match self.compressed.segments.last() {
            Some(seg) if seg.state == SegmentState::Open => {
                seg.heads.iter().map(|h| h.strategy.clone()).collect()
            }
            _ => Vec::new(),
        }
    }

    /// `base` (or zeros) plus the loss terms of host tokens `first..first+n`
    /// under `strategies`, row by row (SPEC.md section 11.1 sums).
    fn loss_sums_of(
        &self,
        first: usize,
        n: usize,
        base: &[[LossSums; 2]],
        strategies: &[Strategy],
    ) -> Vec<[LossSums; 2]> {
        let shape = self.compressed.shape;
        let mut out = Vec::with_capacity(shape.kv_heads);
        for (h, st) in strategies.iter().enumerate() {
            let mut sums = base.get(h).cloned().unwrap_or_default();
            let keys = Self::host_head_rows(&self.host_keys, &shape, first, n, h);
            let values = Self::host_head_rows(&self.host_values, &shape, first, n, h);
            for t in 0..n {
                sums[0].add_row(keys.row(t).as_slice().expect("standard layout"), &st.key);
                sums[1].add_row(
                    values.row(t).as_slice().expect("standard layout"),
                    &st.value,
                );
            }
            out.push(sums);
        }
        out
    }

    /// SPEC.md sections 10.2 and 10.3: flush the full buffer into the open
    /// segment (opening one if needed), then apply the close rule. Every
    /// fallible step runs before the first mutation.
    fn flush(&mut self) -> Result<()> {
        let shape = self.compressed.shape;
        let cfg = self.compressed.config.clone();
        let cap = self.compressed.buffer.tokens;
        let open_len = self.open_len();
        let is_open = open_len > 0;

        // Step 1: the temporary strategy per head.
        let strategies: Vec<Strategy> = if is_open {
            self.open_strategies()
        } else if let Some(last) = self.compressed.segments.last() {
            last.heads.iter().map(|h| h.strategy.clone()).collect()
        } else {
            let mut fitted = Vec::with_capacity(shape.kv_heads);
            for h in 0..shape.kv_heads {
                let k = Self::host_head_rows(&self.host_keys, &shape, open_len, cap, h);
                let v = Self::host_head_rows(&self.host_values, &shape, open_len, cap, h);
                fitted.push(fit_strategy_with(k.view(), v.view(), &cfg, None)?);
            }
            fitted
        };

        // Step 2: the buffer rows encoded with it; their blocks' metadata.
        // A generated segment's length is a multiple of buffer_capacity, itself
        // a multiple of the block size, so the new rows form whole new blocks
        // and appending their metadata equals rebuilding it.
        let mut new_parts = Vec::with_capacity(shape.kv_heads);
        for (h, st) in strategies.iter().enumerate() {
            let k = Self::host_head_rows(&self.host_keys, &shape, open_len, cap, h);
            let v = Self::host_head_rows(&self.host_values, &shape, open_len, cap, h);
            new_parts.push(build_head(k.view(), v.view(), st.clone())?);
        }
        let base = if is_open {
            self.open_loss.clone()
        } else {
            Vec::new()
        };
        let sums = self.loss_sums_of(open_len, cap, &base, &strategies);

        // Step 3: the close rule of section 10.3.
        let new_len = open_len + cap;
        let drifted = new_len >= cfg.min_segment_len
            && strategies.iter().zip(&sums).any(|(st, s)| {
                s[0].loss(Side::Key) > st.key.fit_loss + cfg.segment_loss_margin
                    || s[1].loss(Side::Value) > st.value.fit_loss + cfg.segment_loss_margin
            });
        let close = new_len >= cfg.max_segment_len || drifted;
        let closed_heads = if close {
            let mut heads = Vec::with_capacity(shape.kv_heads);
            for h in 0..shape.kv_heads {
                let k = Self::host_head_rows(&self.host_keys, &shape, 0, new_len, h);
                let v = Self::host_head_rows(&self.host_values, &shape, 0, new_len, h);
                // Generated segments are fitted by the energy loss (SPEC.md section 11.1).
                let own = fit_strategy_with(k.view(), v.view(), &cfg, None)?;
                heads.push(build_head(k.view(), v.view(), own)?);
            }
            Some(heads)
        } else {
            None
        };

        // Commit (infallible from here on).
        if !is_open {
            let start = self.compressed.len() - cap;
            let heads = strategies
                .iter()
                .map(|st| HeadSegment {
                    strategy: st.clone(),
                    keys: Default::default(),
                    values: Default::default(),
                    meta: mosaickv_spec::BlockMeta::empty(st.block_size, st.key.layout.kept_dims),
                })
                .collect();
            self.compressed.segments.push(Segment {
                start,
                len: 0,
                state: SegmentState::Open,
                heads,
            });
        }
        let seg = self
            .compressed
            .segments
            .last_mut()
            .expect("an open segment");
        match closed_heads {
            Some(heads) => {
                seg.heads = heads;
                seg.state = SegmentState::Closed;
                self.host_keys.clear();
                self.host_values.clear();
                self.open_loss.clear();
            }
            None => {
                for (head, part) in seg.heads.iter_mut().zip(new_parts) {
                    head.keys.count += part.keys.count;
                    head.keys.bytes.extend_from_slice(&part.keys.bytes);
                    head.values.count += part.values.count;
                    head.values.bytes.extend_from_slice(&part.values.bytes);
                    head.meta.append(&part.meta);
                }
                self.open_loss = sums;
            }
        }
        seg.len = new_len;
        self.compressed.buffer.clear();
        Ok(())
    }

    /// SPEC.md section 9's attended set as token indices, per query head.
    pub fn attended_tokens(&self, queries: ArrayView2<f32>) -> Result<Vec<Vec<usize>>> {
        let shape = self.compressed.shape;
        mosaickv_spec::validate::queries(&shape, &queries, &[shape.q_heads, shape.head_dim])?;
        if self.compressed.is_empty() {
            return Err(MosaicError::EmptyCache);
        }
        let selection = select(&self.compressed, queries)?;
        attended_tokens(&self.compressed, &selection)
    }
}

impl KvCache for MosaicCache {
    fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        MosaicCache::set_q_heads(self, q_heads)
    }
    fn attended(&self, queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>> {
        MosaicCache::attended_tokens(self, queries).map(Some)
    }
    fn compressed(&self) -> Option<&CompressedCache> {
        Some(MosaicCache::compressed(self))
    }
    fn save(&mut self, path: &std::path::Path) -> Result<()> {
        let (k, v) = self.host_rows();
        mosaickv_spec::persist::save_cache(path, MosaicCache::compressed(self), k, v)
    }
    /// Gives (or with `None` removes) the layer's query statistics, used by the prompt
    /// segments' strategies (`prefill`) when the configuration's loss is `attention` (SPEC.md
    /// section 11.1); generated segments keep the energy loss.
    /// Checked against the shape (`ShapeMismatch`, `NonFinite`); nothing changes on error.
    fn set_query_stats(&mut self, stats: Option<QueryStats>) -> Result<()> {
        if let Some(st) = &stats {
            st.validate(&self.compressed.shape)?;
        }
        self.query_stats = stats;
        Ok(())
    }

    fn shape(&self) -> KvShape {
        self.compressed.shape
    }

    fn len(&self) -> usize {
        self.compressed.len()
    }

    /// SPEC.md section 10.1.
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<()> {
        if !self.compressed.is_empty() {
            return Err(MosaicError::AlreadyPrefilled(self.compressed.len()));
        }
        let shape = self.compressed.shape;
        prompt_kv(&shape, &keys, &values)?;
        let cfg = self.compressed.config.clone();
        let n = keys.shape()[0];
        let (sink_len, bounds) = prompt_segments(n, cfg.sink_tokens, cfg.input_segment_len);
        // SPEC.md section 14: every row's norm within f16's range (keys, then values).
        let d = shape.head_dim;
        rows_storable(ROW_KEYS, &keys.iter().copied().collect::<Vec<f32>>(), d)?;
        rows_storable(ROW_VALUES, &values.iter().copied().collect::<Vec<f32>>(), d)?;
        let mut sink = mosaickv_spec::DenseRows::default();
        for t in 0..sink_len {
            sink.push(
                keys.slice(s![t, .., ..]).iter().copied(),
                values.slice(s![t, .., ..]).iter().copied(),
            );
        }
        let mut segments = Vec::with_capacity(bounds.len());
        for (start, len) in bounds {
            let mut heads = Vec::with_capacity(shape.kv_heads);
            for h in 0..shape.kv_heads {
                let k = keys.slice(s![start..start + len, h, ..]).to_owned();
                let v = values.slice(s![start..start + len, h, ..]).to_owned();
                let strategy =
                    fit_strategy_with(k.view(), v.view(), &cfg, self.loss_ctx(h, start, len))?;
                heads.push(build_head(k.view(), v.view(), strategy)?);
            }
            segments.push(Segment {
                start,
                len,
                state: SegmentState::Closed,
                heads,
            });
        }
        self.compressed.sink = sink;
        self.compressed.segments = segments;
        Ok(())
    }

    /// SPEC.md section 10.2 (and 10.3 at each flush).
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<()> {
        let shape = self.compressed.shape;
        token_kv(&shape, &key, &value)?;
        let d = shape.head_dim;
        rows_storable(ROW_KEY, &key.iter().copied().collect::<Vec<f32>>(), d)?;
        rows_storable(ROW_VALUE, &value.iter().copied().collect::<Vec<f32>>(), d)?;
        if self.compressed.len() < self.compressed.config.sink_tokens {
            self.compressed
                .sink
                .push(key.iter().copied(), value.iter().copied());
            return Ok(());
        }
        self.compressed
            .buffer
            .push(key.iter().copied(), value.iter().copied());
        self.host_keys.extend(key.iter().copied());
        self.host_values.extend(value.iter().copied());
        if self.compressed.buffer.tokens == self.compressed.config.buffer_capacity {
            if let Err(e) = self.flush() {
                // The flush mutated nothing; take the token back out.
                let row = self.row_len();
                self.compressed.buffer.pop(row);
                self.host_keys.truncate(self.host_keys.len() - row);
                self.host_values.truncate(self.host_values.len() - row);
                return Err(e);
            }
        }
        Ok(())
    }

    /// SPEC.md sections 8 and 9 via the reference backend.
    fn attend(&mut self, queries: ArrayView2<f32>, out: ArrayViewMut2<f32>) -> Result<()> {
        attend(&self.compressed, queries, out)
    }

    /// SPEC.md section 13, with the host f32 rows.
    fn memory(&self) -> MemoryReport {
        let mut m = self.compressed.memory();
        m.host_rows = 4 * (self.host_keys.len() + self.host_values.len());
        m
    }
}
