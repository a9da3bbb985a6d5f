//! The backend contract: every stage on its own, and the composed cache (SPEC.md sections 3-12).

use crate::cache::{CompressedCache, MemoryReport};
use crate::config::{CompressConfig, KvShape};
use crate::error::Result;
use crate::layout::{BlockMeta, PackedRows, SideStrategy, Strategy};
use ndarray::{Array2, ArrayView2, ArrayView3, ArrayViewMut2};

/// Whether a backend can run on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Availability {
    Available,
    /// Why it cannot run (no GPU, no driver, CPU lacks a feature, ...).
    Unavailable(String),
}

/// Which of K or V a side strategy is fitted for (they use different loss thresholds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Key,
    Value,
}

/// The blocks chosen for one decode step: for each KV head, the selected
/// blocks as `(segment index, block index within the segment)`, ascending.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Selection {
    pub per_head: Vec<Vec<(u32, u32)>>,
}

/// One implementation of every MosaicKV stage. The reference backend is the
/// oracle; others must agree with it within `conformance`'s tolerances.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    fn availability(&self) -> Availability;

    /// SPEC 3, 4, 11: rotation + `(r, g)` for one side of one head's segment rows `[n, D]`.
    fn fit_side(
        &self,
        rows: ArrayView2<f32>,
        side: Side,
        config: &CompressConfig,
    ) -> Result<SideStrategy>;

    /// SPEC 11.3: the block size for a segment's keys under a fitted key strategy.
    fn fit_block_size(
        &self,
        keys: ArrayView2<f32>,
        key: &SideStrategy,
        config: &CompressConfig,
    ) -> Result<usize>;

    /// SPEC 11: the whole strategy of one head's segment.
    fn fit_strategy(
        &self,
        keys: ArrayView2<f32>,
        values: ArrayView2<f32>,
        config: &CompressConfig,
    ) -> Result<Strategy> {
        let key = self.fit_side(keys, Side::Key, config)?;
        let value = self.fit_side(values, Side::Value, config)?;
        let block_size = self.fit_block_size(keys, &key, config)?;
        Ok(Strategy {
            key,
            value,
            block_size,
        })
    }

    /// SPEC 5, 6: rotate rows `[n, D]` and pack each one's top-r groups.
    fn encode(&self, rows: ArrayView2<f32>, side: &SideStrategy) -> Result<PackedRows>;

    /// SPEC 6: unpack records to dense rotated rows `[n, kept_dims]` (zeros where not kept).
    fn decode(&self, packed: &PackedRows, side: &SideStrategy) -> Result<Array2<f32>>;

    /// SPEC 7: block min/max of packed keys.
    fn block_meta(
        &self,
        keys: &PackedRows,
        key: &SideStrategy,
        block_size: usize,
    ) -> Result<BlockMeta>;

    /// SPEC 8.1: `q' = R^T q` for queries `[m, D]`, truncated to `kept_dims` columns.
    fn rotate_queries(&self, queries: ArrayView2<f32>, key: &SideStrategy) -> Result<Array2<f32>>;

    /// SPEC 8.2: Quest bound per block for rotated queries `[group, kept_dims]`, max over the group.
    fn score_blocks(&self, meta: &BlockMeta, rotated_queries: ArrayView2<f32>) -> Result<Vec<f32>>;

    /// SPEC 8.3: top-k blocks by score under a token budget; indices ascending.
    fn select_blocks(
        &self,
        scores: &[f32],
        block_lens: &[usize],
        budget_tokens: usize,
    ) -> Result<Vec<u32>>;

    /// SPEC 8: the selection of a whole cache for queries `[q_heads, D]`.
    fn select(&self, cache: &CompressedCache, queries: ArrayView2<f32>) -> Result<Selection>;

    /// SPEC 9: attention over sink + selected blocks + buffer, written to `out` `[q_heads, D]`.
    fn attend_selected(
        &self,
        cache: &CompressedCache,
        queries: ArrayView2<f32>,
        selection: &Selection,
        out: ArrayViewMut2<f32>,
    ) -> Result<()>;

    /// SPEC 8 + 9: one decode step's attention.
    fn attend(
        &self,
        cache: &CompressedCache,
        queries: ArrayView2<f32>,
        out: ArrayViewMut2<f32>,
    ) -> Result<()> {
        let selection = self.select(cache, queries)?;
        self.attend_selected(cache, queries, &selection, out)
    }
}

/// A whole layer's KV cache for decode: the object a model's attention talks to.
/// Implemented by MosaicKV and by every baseline (full, Quest, naive 2-D).
pub trait KvCache: Send {
    fn shape(&self) -> KvShape;
    /// Tokens held.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// SPEC 10.1: the prompt's K/V `[tokens, kv_heads, head_dim]`; only on an empty cache.
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<()>;
    /// SPEC 10.2: one token's K/V `[kv_heads, head_dim]`.
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<()>;
    /// Decode attention for queries `[q_heads, head_dim]` into `out` `[q_heads, head_dim]`,
    /// `softmax(q.k / sqrt(head_dim))` over the tokens the method attends.
    fn attend(&mut self, queries: ArrayView2<f32>, out: ArrayViewMut2<f32>) -> Result<()>;
    /// Every byte held, itemized.
    fn memory(&self) -> MemoryReport;
    /// The most device bytes `memory()` can report after at most `more` further `append`s,
    /// from the cache's state now (SPEC.md section 13); `None` when the cache cannot bound it
    /// better than its method's worst case (the default).
    fn device_bytes_bound(&self, _more: usize) -> Option<usize> {
        None
    }
    /// The layer's query statistics for the attention loss (SPEC.md section 11.1), before
    /// `prefill`. Caches that do not use them (the baselines) accept and ignore them.
    fn set_query_stats(&mut self, _stats: Option<crate::query::QueryStats>) -> Result<()> {
        Ok(())
    }
    /// Sets the query head count attention expects (SPEC.md section 1: the GQA group belongs to
    /// the queries, not to the stored cache); `KvShape::new` checks it. Nothing else changes.
    fn set_q_heads(&mut self, q_heads: usize) -> Result<()>;
    /// The token indices attended per query head for queries `[q_heads, head_dim]` (SPEC.md
    /// section 16's recall@k); `None` when every token is attended.
    fn attended(&self, queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>>;
    /// The compressed cache of a MosaicKV cache (segments, strategies, configuration); `None`
    /// for the baselines.
    fn compressed(&self) -> Option<&CompressedCache> {
        None
    }
    /// SPEC.md section 15: writes the cache's file atomically (15.7): `cache.mkv` (15.3) for
    /// MosaicKV, a dense file (15.5) for full and Quest, a baseline cache file (15.6) for
    /// naive 2-D, Quest-sink and kvq.
    fn save(&mut self, path: &std::path::Path) -> Result<()>;
}
