//! The conformance suite stamped out for the CUDA backend (issue 6), behind this crate's
//! `cuda` feature: `cargo test --release -p mosaickv-conformance --features cuda`.
//!
//! One `CudaBackend` is shared by every test (its context and NVRTC-compiled kernels are
//! built once; the suite constructs a backend per proptest and quickcheck case). Where it
//! cannot run (no driver, no device, no NVRTC), every test prints
//! `SKIPPED cuda::<test>: <reason>` and returns: skipped, never counted as a device pass.
#![cfg(feature = "cuda")]

use mosaickv_conformance::conformance_suite;
use mosaickv_optimized::cuda::CudaBackend;
use mosaickv_spec::{
    Availability, Backend, BlockMeta, CompressConfig, CompressedCache, MosaicError, PackedRows,
    Result, Selection, Side, SideStrategy,
};
use ndarray::{Array2, ArrayView2, ArrayViewMut2};
use std::sync::OnceLock;

/// The shared backend, or why there is none (the reason of `CudaBackend::new`, or of the
/// context / kernel compilation when the driver loads but no device works).
fn shared() -> &'static std::result::Result<CudaBackend, String> {
    static SHARED: OnceLock<std::result::Result<CudaBackend, String>> = OnceLock::new();
    SHARED.get_or_init(|| {
        let b = CudaBackend::new().map_err(|e| e.to_string())?;
        match b.availability() {
            Availability::Available => Ok(b),
            Availability::Unavailable(reason) => Err(reason),
        }
    })
}

/// Delegates to the shared backend; every call is `BackendUnavailable` when there is none.
struct SharedCuda;

impl SharedCuda {
    fn get(&self) -> Result<&'static CudaBackend> {
        shared()
            .as_ref()
            .map_err(|r| MosaicError::BackendUnavailable(r.clone()))
    }
}

impl Backend for SharedCuda {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn availability(&self) -> Availability {
        match shared() {
            Ok(b) => b.availability(),
            Err(r) => Availability::Unavailable(r.clone()),
        }
    }
    fn fit_side(
        &self,
        rows: ArrayView2<f32>,
        side: Side,
        config: &CompressConfig,
    ) -> Result<SideStrategy> {
        self.get()?.fit_side(rows, side, config)
    }
    fn fit_block_size(
        &self,
        keys: ArrayView2<f32>,
        key: &SideStrategy,
        config: &CompressConfig,
    ) -> Result<usize> {
        self.get()?.fit_block_size(keys, key, config)
    }
    fn encode(&self, rows: ArrayView2<f32>, side: &SideStrategy) -> Result<PackedRows> {
        self.get()?.encode(rows, side)
    }
    fn decode(&self, packed: &PackedRows, side: &SideStrategy) -> Result<Array2<f32>> {
        self.get()?.decode(packed, side)
    }
    fn block_meta(
        &self,
        keys: &PackedRows,
        key: &SideStrategy,
        block_size: usize,
    ) -> Result<BlockMeta> {
        self.get()?.block_meta(keys, key, block_size)
    }
    fn rotate_queries(&self, queries: ArrayView2<f32>, key: &SideStrategy) -> Result<Array2<f32>> {
        self.get()?.rotate_queries(queries, key)
    }
    fn score_blocks(&self, meta: &BlockMeta, rotated_queries: ArrayView2<f32>) -> Result<Vec<f32>> {
        self.get()?.score_blocks(meta, rotated_queries)
    }
    fn select_blocks(
        &self,
        scores: &[f32],
        block_lens: &[usize],
        budget_tokens: usize,
    ) -> Result<Vec<u32>> {
        self.get()?.select_blocks(scores, block_lens, budget_tokens)
    }
    fn select(&self, cache: &CompressedCache, queries: ArrayView2<f32>) -> Result<Selection> {
        self.get()?.select(cache, queries)
    }
    fn attend_selected(
        &self,
        cache: &CompressedCache,
        queries: ArrayView2<f32>,
        selection: &Selection,
        out: ArrayViewMut2<f32>,
    ) -> Result<()> {
        self.get()?.attend_selected(cache, queries, selection, out)
    }
    fn attend(
        &self,
        cache: &CompressedCache,
        queries: ArrayView2<f32>,
        out: ArrayViewMut2<f32>,
    ) -> Result<()> {
        self.get()?.attend(cache, queries, out)
    }
}

conformance_suite!(
    cuda,
    || Box::new(SharedCuda),
    #[cfg_attr(
        mosaickv_no_cuda_driver,
        ignore = "no CUDA driver (libcuda.so.1) on the build machine; scripts/gpu-check.sh runs these with --include-ignored"
    )]
);

/// Without a device the stamp must report a reason (so the suite skips, never passes silently).
#[test]
fn unavailable_has_a_reason() {
    match SharedCuda.availability() {
        Availability::Available => println!("CUDA available: the suite above ran on the device"),
        Availability::Unavailable(r) => {
            assert!(
                !r.trim().is_empty(),
                "an unavailable CUDA backend must say why"
            );
            assert!(matches!(
                SharedCuda.select_blocks(&[1.0], &[1], 1),
                Err(MosaicError::BackendUnavailable(_))
            ));
            eprintln!("SKIPPED cuda (whole suite): {r}");
        }
    }
}

#[path = "cuda_cache/mod.rs"]
mod cuda_cache_checks;

mod cuda_cache {
    //! `CudaCache` on the device against the reference (`cuda_cache/mod.rs`, the same checks
    //! as the emulated stamp): prefill, appends across buffer flushes, a batch of different
    //! lengths, a double-buffered swap, bad input. Skipped (with `SKIPPED`) without a device.
    use super::cuda_cache_checks as checks;
    use mosaickv_optimized::cuda::device::Gpu;
    use std::sync::Arc;

    fn gpu(test: &str) -> Option<Arc<Gpu>> {
        match super::shared().as_ref().map(|b| b.gpu()) {
            Ok(Ok(g)) => Some(g),
            Ok(Err(e)) => {
                eprintln!("SKIPPED cuda::cuda_cache::{test}: {e}");
                None
            }
            Err(r) => {
                eprintln!("SKIPPED cuda::cuda_cache::{test}: {r}");
                None
            }
        }
    }

    #[test]
    #[cfg_attr(
        mosaickv_no_cuda_driver,
        ignore = "no CUDA driver (libcuda.so.1) on the build machine; scripts/gpu-check.sh runs these with --include-ignored"
    )]
    fn prefill_appends_and_flushes_match_the_reference() {
        if let Some(g) = gpu("prefill_appends_and_flushes_match_the_reference") {
            checks::prefill_appends_and_flushes_match_the_reference(g);
        }
    }

    #[test]
    #[cfg_attr(
        mosaickv_no_cuda_driver,
        ignore = "no CUDA driver (libcuda.so.1) on the build machine; scripts/gpu-check.sh runs these with --include-ignored"
    )]
    fn live_batch_follows_the_background_worker() {
        if let Some(g) = gpu("live_batch_follows_the_background_worker") {
            checks::live_batch_follows_the_background_worker(g);
        }
    }

    #[test]
    #[cfg_attr(
        mosaickv_no_cuda_driver,
        ignore = "no CUDA driver (libcuda.so.1) on the build machine; scripts/gpu-check.sh runs these with --include-ignored"
    )]
    fn a_reencoded_segment_swaps_in_without_stopping_decode() {
        if let Some(g) = gpu("a_reencoded_segment_swaps_in_without_stopping_decode") {
            checks::a_reencoded_segment_swaps_in_without_stopping_decode(g);
        }
    }

    #[test]
    #[cfg_attr(
        mosaickv_no_cuda_driver,
        ignore = "no CUDA driver (libcuda.so.1) on the build machine; scripts/gpu-check.sh runs these with --include-ignored"
    )]
    fn bad_input_is_a_typed_error_and_keeps_the_cache() {
        if let Some(g) = gpu("bad_input_is_a_typed_error_and_keeps_the_cache") {
            checks::bad_input_is_a_typed_error_and_keeps_the_cache(g);
        }
    }

    #[test]
    #[cfg_attr(
        mosaickv_no_cuda_driver,
        ignore = "no CUDA driver (libcuda.so.1) on the build machine; scripts/gpu-check.sh runs these with --include-ignored"
    )]
    fn swaps_that_change_the_segment_count_move_the_later_segments() {
        if let Some(g) = gpu("swaps_that_change_the_segment_count_move_the_later_segments") {
            checks::swaps_that_change_the_segment_count_move_the_later_segments(g);
        }
    }
}
