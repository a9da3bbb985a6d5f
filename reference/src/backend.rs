//! [`ReferenceBackend`]: the `Backend` trait, every stage delegated to the
//! plain function of its SPEC.md section.

use crate::{attention, meta, packed, select, strategy};
use mosaickv_spec::{
    Availability, Backend, BlockMeta, CompressConfig, CompressedCache, PackedRows, Result,
    Selection, Side, SideStrategy,
};
use ndarray::{Array2, ArrayView2, ArrayViewMut2};

/// The oracle backend: scalar code, f64 where SPEC.md says reference = f64.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceBackend;

impl Backend for ReferenceBackend {
    fn name(&self) -> &'static str {
        "reference"
    }

    fn availability(&self) -> Availability {
        Availability::Available
    }

    fn fit_side(
        &self,
        rows: ArrayView2<f32>,
        side: Side,
        config: &CompressConfig,
    ) -> Result<SideStrategy> {
        strategy::fit_side(rows, side, config)
    }

    fn fit_block_size(
        &self,
        keys: ArrayView2<f32>,
        key: &SideStrategy,
        config: &CompressConfig,
    ) -> Result<usize> {
        strategy::fit_block_size(keys, key, config)
    }

    fn encode(&self, rows: ArrayView2<f32>, side: &SideStrategy) -> Result<PackedRows> {
        packed::encode_rows(rows, side)
    }

    fn decode(&self, packed: &PackedRows, side: &SideStrategy) -> Result<Array2<f32>> {
        packed::decode_rows(packed, side)
    }

    fn block_meta(
        &self,
        keys: &PackedRows,
        key: &SideStrategy,
        block_size: usize,
    ) -> Result<BlockMeta> {
        meta::block_meta(keys, key, block_size)
    }

    fn rotate_queries(&self, queries: ArrayView2<f32>, key: &SideStrategy) -> Result<Array2<f32>> {
        select::rotate_queries(queries, key)
    }

    fn score_blocks(&self, meta: &BlockMeta, rotated_queries: ArrayView2<f32>) -> Result<Vec<f32>> {
        select::score_blocks(meta, rotated_queries)
    }

    fn select_blocks(
        &self,
        scores: &[f32],
        block_lens: &[usize],
        budget_tokens: usize,
    ) -> Result<Vec<u32>> {
        select::select_blocks(scores, block_lens, budget_tokens)
    }

    fn select(&self, cache: &CompressedCache, queries: ArrayView2<f32>) -> Result<Selection> {
        select::select(cache, queries)
    }

    fn attend_selected(
        &self,
        cache: &CompressedCache,
        queries: ArrayView2<f32>,
        selection: &Selection,
        out: ArrayViewMut2<f32>,
    ) -> Result<()> {
        attention::attend_selected(cache, queries, selection, out)
    }

    fn attend(
        &self,
        cache: &CompressedCache,
        queries: ArrayView2<f32>,
        out: ArrayViewMut2<f32>,
    ) -> Result<()> {
        attention::attend(cache, queries, out)
    }
}
