//! # mosaickv-optimized: the fast CPU backend
//!
//! - [`CpuBackend`]: every stage of [`mosaickv_spec::Backend`] (SPEC.md sections 3-9), byte-identical
//!   encode, exact selection rules, f32 attention with online softmax.
//! - [`OptimizedMosaicCache`]: the MosaicKV [`mosaickv_spec::KvCache`] with the section 10 lifecycle,
//!   parallel prefill encoding and allocation-free flash-decoding attention.
//! - [`LiveCache`]: the production cache manager: the same lifecycle with strategy fitting and
//!   re-encoding on a background worker (SPEC.md section 10.4), chunked prefill, host/device memory.
//! - [`DenseF16Cache`], [`QuestF16Cache`]: the section 12 baselines on the same kernels.
//!
//! Kernels: AVX-512 (F/BW/VL/VBMI2) for the hottest kernels, AVX2 + FMA + F16C via
//! `std::arch`, detected at run time, or a portable scalar path;
//! `MOSAICKV_FORCE_PORTABLE=1` (or the `portable()` constructors) forces the latter and
//! `MOSAICKV_FORCE_AVX2=1` stops at AVX2. [`Path::detect`] is the one place that reads them:
//! every kernel choice goes through a [`Path`], so a switch forces the encoder's kernels too
//! (the `portable()` constructors force the kernels their cache or backend owns; the encoder's
//! f64 helpers, which none owns, follow the switches and compute the same bits on every path),
//! and [`simd::kernels_ran`] reports which kernel layers ran (`examples/cpu_paths` prints it).
//! The kernels live in [`simd`], one file per SPEC step (see its module docs).
//!
//! # One module per SPEC step, named as in `mosaickv-reference`
//!
//! | module | SPEC.md |
//! |---|---|
//! | [`round`] | notation: f64 -> f16 round-to-nearest-even |
//! | [`rotation`] | 3 (rotation fit), the f64 rotation of rows |
//! | [`topr`] | 4-5 (group importances, per-vector top-r) |
//! | [`packed`] | 6 (record encode / decode) |
//! | [`coded`] | 6.1 (coded records: candidates, losses, encode, decode) |
//! | [`meta`] | 7 (block metadata) |
//! | [`select`] | 8 (rotated queries, block scores, top blocks under a token budget) |
//! | [`attention`] | 9 (PackedAttention: key logits, online softmax, values, merge) |
//! | [`mosaic`], [`live`] | 10 (segments, update buffer, close rule; the live cache) |
//! | [`strategy`] | 11 ((r, g, dtype) search, block size) |
//! | [`loss`] | 11.1 (attention loss) |
//! | [`baselines`] | 12 (Full, Quest, kvq) |
//! | [`turboquant`] | 12 (TurboQuant, vLLM's `turboquant_<preset>` cache) |
//! | [`backend`] | the `Backend` trait over the steps above |
//! | [`threads`] | (the CLI's rayon pool, its main thread a worker) |

// Index loops mirror the SPEC's formulas; kernels take many scalar geometry arguments.
#![allow(
    clippy::needless_range_loop,
    clippy::too_many_arguments,
    clippy::excessive_precision,
    clippy::manual_is_multiple_of
)]

pub mod attention;
pub mod backend;
pub mod baselines;
pub mod coded;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod live;
pub mod loss;
pub mod meta;
pub mod mosaic;
pub mod packed;
pub mod profile;
pub mod rotation;
pub mod round;
pub mod select;
pub mod simd;
pub mod strategy;
pub mod threads;
pub mod topr;
pub mod turboquant;

pub use backend::CpuBackend;

#[cfg(feature = "cuda")]
use mosaickv_spec::{
    CompressConfig, CompressedCache, MosaicError, RecordLayout, Result, ValueDtype,
};

/// SPEC.md section 6.1's coded records run on the reference and CPU backends; the CUDA
/// backend's kernels read bitmap records only, so it refuses a configuration that allows
/// coded records before anything is built, and no fit there silently drops the candidates the
/// SPEC lists.
#[cfg(feature = "cuda")]
pub(crate) fn refuse_coded_config(config: &CompressConfig) -> Result<()> {
    if config.value_dtypes.contains(&ValueDtype::Coded) {
        return Err(MosaicError::InvalidConfig(
            "value dtype `coded` (SPEC.md section 6.1) runs on the reference and CPU backends \
             only; the CUDA kernels read bitmap records (f16, int8, int4)"
                .into(),
        ));
    }
    Ok(())
}

/// [`refuse_coded_config`] for a record layout handed to the CUDA backend.
#[cfg(feature = "cuda")]
pub(crate) fn refuse_coded_layout(layout: &RecordLayout) -> Result<()> {
    if layout.dtype == ValueDtype::Coded {
        return Err(MosaicError::InvalidConfig(
            "coded records (SPEC.md section 6.1) run on the reference and CPU backends only, \
             not on the CUDA backend"
                .into(),
        ));
    }
    Ok(())
}

/// [`refuse_coded_config`] and [`refuse_coded_layout`] for a whole cache handed to the CUDA
/// backend.
#[cfg(feature = "cuda")]
pub(crate) fn refuse_coded_cache(cache: &CompressedCache) -> Result<()> {
    refuse_coded_config(&cache.config)?;
    for seg in &cache.segments {
        for head in &seg.heads {
            refuse_coded_layout(&head.strategy.key.layout)?;
            refuse_coded_layout(&head.strategy.value.layout)?;
        }
    }
    Ok(())
}
pub use baselines::{DenseF16Cache, QuestF16Cache, QUEST_PAGE};
pub use live::{Coverage, Holder, HostMemory, LiveCache, LiveStats, Mode, PrefillRule, WorkerHold};
pub use mosaic::{attend_scratch_bytes, OptimizedMosaicCache};
pub use simd::Path;
