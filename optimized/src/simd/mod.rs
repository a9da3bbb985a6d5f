//! Inner kernels with three implementations, chosen at run time: AVX-512
//! (F/BW/VL/VBMI2/VNNI, `avx512`, for the hottest kernels; the rest as
//! AVX2), AVX2 + FMA + F16C (`avx2`, `std::arch`), and a portable scalar path
//! written in 8-lane arrays.
//!
//! [`Path::rotate_queries`] and [`Path::score_blocks`] (MosaicKV's selection)
//! are bit-identical on every path: the rotated query is summed in f64 in
//! the reference's order, and the block score is exact integer arithmetic
//! on the int8 bounds and the int8-quantized query (SPEC.md section 8),
//! followed by the same f32 products. Quest's page scores
//! ([`Path::score_pages_f16`]) are f32: AVX2 and portable agree bit for bit,
//! the AVX-512 kernel uses FMA and 16 lanes and is held to the conformance
//! tolerance. Attention kernels may use FMA (their outputs are compared with
//! a tolerance).
//!
//! # Where each step lives
//!
//! One file per concern, each holding the [`Path`] methods of that concern (the dispatch)
//! and the portable kernels; the ISA layers have a file of the same name:
//!
//! | concern | dispatch + portable | AVX2 | AVX-512 |
//! |---|---|---|---|
//! | path choice and CPU detection | `path.rs` | | |
//! | tile size, `pad8`, shared scalar arithmetic (f16 widening, `exp`, SPEC 8.2's combination) | `common.rs` | | |
//! | SPEC 6 bitmap expansion | `expand.rs` | `avx2/expand.rs` | `avx512/expand.rs` |
//! | SPEC 6 int8/int4 expansion (code unpacking); SPEC 9 straight from int8/int4 records (key logits, values at the kept dims) | `quant.rs` | `avx2/quant.rs` | `avx512/quant.rs` |
//! | int8/int4 kernel limits, scalar code unpacking, the sparse-values plan | `codes.rs` | | |
//! | SPEC 8.1 query rotation | `rotate.rs` | `avx2/rotate.rs` | `avx512/rotate.rs` |
//! | SPEC 8.2 block scores | `score.rs` | `avx2/score.rs` | `avx512/score.rs` |
//! | SPEC 8.3 rank keys and the selection filter (`crate::select::top_blocks`) | `select.rs` | | `avx512/select.rs` |
//! | SPEC 9 key logits | `logits.rs` | `avx2/tiles.rs` | `avx512/logits.rs` |
//! | SPEC 9 online softmax | `softmax.rs` | `avx2/softmax.rs` | `avx512/softmax.rs` |
//! | SPEC 9 value accumulation | `accumulate.rs` | `avx2/tiles.rs` | `avx512/accumulate.rs` |
//! | SPEC 12 Quest page scores | `pages.rs` | `avx2/pages.rs` | `avx512/pages.rs` |
//! | f16 -> f32 rows | `convert.rs` | `avx2/convert.rs` | |
//! | prefetch, huge pages | `memory.rs` | `avx2/memory.rs` | |
//! | the engine's ggml weight-row products (Q4_1, Q8_0, Q4_K, Q6_K) | `weights.rs` | `avx2/weights.rs` | `avx512/weights.rs` |
//! | ggml block sizes, quantized activations (Q8_1, Q8_K), k-quant scale unpacking | `ggml.rs` | | |
//! | the engine's dense f16 attention over a token span | `span.rs` | `avx2/span.rs` | |
//!
//! Imports run one way: the dispatch files use `avx512`, `avx2`, `codes`, `ggml` and `common`;
//! `avx512` uses `avx2` (reduction and code-unpacking helpers), `codes`, `ggml` and `common`; `avx2`
//! uses only `codes`, `ggml` and `common`; `codes`, `ggml`, `common` and `path` use nothing here. Nothing
//! here imports the crate's algorithm modules (`select`, `attention`, ...), which call the
//! kernels through [`Path`].

mod accumulate;
pub mod amx;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub(crate) mod codes;
pub(crate) mod common;
mod convert;
mod expand;
pub mod ggml;
mod logits;
mod memory;
mod pages;
mod path;
mod quant;
mod rotate;
mod score;
mod select;
mod softmax;
mod span;
mod weights;

pub use codes::{SparsePlan, QUANT_SIMD_MAX_R};
pub use common::{exp_shifted_in_place, f16_bits_to_f32, fast_exp, pad8, TILE};
pub use expand::HALF_TILE_MAX_DP;
pub use memory::advise_huge_pages;
pub use path::{
    avx2_available, avx2_features, avx512_available, avx512_features, kernels_ran, Path,
    FORCE_AVX2, FORCE_PORTABLE,
};
pub use quant::q8_stride;
pub use score::{quantize_query, quantize_query_i8, QMAX_DT};
pub use select::rank_key;
pub use span::SpanPartial;
