//! # mosaickv-kernels: the CUDA sources of the MosaicKV GPU backend
//!
//! Plain CUDA C (`kernels/cuda/*.cu`, raw-pointer `extern "C"` entry points, no
//! framework), embedded as strings so every crate builds on a machine with no
//! CUDA at all; `optimized`'s `cuda` module compiles them with NVRTC on first
//! use. Section numbers refer to `spec/SPEC.md`:
//!
//! | file | entry points | SPEC.md |
//! |---|---|---|
//! | `encode.cu` | `mkv_encode`, `mkv_decode`, `mkv_block_meta` | 5, 6, 7 |
//! | `select.cu` | `mkv_rotate_queries`, `mkv_score_blocks`, `mkv_select_topk`, `mkv_plan_items`, `mkv_page_meta`, `mkv_page_score` | 8.1-8.3, 12 (Quest) |
//! | `attention.cu` | `mkv_packed_attention`, `mkv_dense_decode`, `mkv_merge` | 9, 12 (full, Quest) |
//!
//! Every `.cu` includes `common.cuh` (f16 conversions, bitmap helpers, the
//! `SegHead` / `BlockRef` structs), passed to NVRTC as a named header.
//! [`nvrtc`] loads `libnvrtc` from a given path and compiles a source to PTX (or
//! CUBIN). Feature `emulated` adds [`emu`]: every kernel compiled as host C++ and run
//! on a CPU emulation of the CUDA execution model (testing infrastructure).

#[cfg(feature = "emulated")]
pub mod emu;
pub mod nvrtc;

/// Helpers and shared structs, `#include "common.cuh"` in every kernel file.
pub const COMMON_CUH: &str = include_str!("../cuda/common.cuh");
/// SPEC.md 5-7: encode, decode, block metadata.
pub const ENCODE_CU: &str = include_str!("../cuda/encode.cu");
/// SPEC.md 8 and Quest's page selection.
pub const SELECT_CU: &str = include_str!("../cuda/select.cu");
/// SPEC.md 9 (PackedAttention), dense decode, partial merge.
pub const ATTENTION_CU: &str = include_str!("../cuda/attention.cu");

/// Headers every kernel file may include: `(name, source)`.
pub const HEADERS: &[(&str, &str)] = &[("common.cuh", COMMON_CUH)];

/// Every kernel file: `(file name, source, entry points)`.
pub const KERNELS: &[(&str, &str, &[&str])] = &[
    (
        "encode.cu",
        ENCODE_CU,
        &["mkv_encode", "mkv_decode", "mkv_block_meta"],
    ),
    (
        "select.cu",
        SELECT_CU,
        &[
            "mkv_rotate_queries",
            "mkv_score_blocks",
            "mkv_select_topk",
            "mkv_plan_items",
            "mkv_page_meta",
            "mkv_page_score",
        ],
    ),
    (
        "attention.cu",
        ATTENTION_CU,
        &["mkv_packed_attention", "mkv_dense_decode", "mkv_merge"],
    ),
];

/// Threads per block `mkv_packed_attention` is compiled for (`MKV_ATT_THREADS`).
pub const ATT_THREADS: u32 = 128;
/// Token slots per tile of `mkv_packed_attention` (`MKV_ATT_TILE`).
pub const ATT_TILE: usize = 64;
/// Threads per block of `mkv_dense_decode` (`MKV_DENSE_THREADS`).
pub const DENSE_THREADS: u32 = 128;
/// Query heads per thread block of `mkv_dense_decode` (`MKV_DENSE_GC`).
pub const DENSE_HEAD_CHUNK: usize = 4;
/// Threads per block of `mkv_select_topk` (`MKV_SELECT_THREADS`).
pub const SELECT_THREADS: u32 = 1024;
/// Largest head_dim the kernels support (`MKV_MAX_D`).
pub const MAX_HEAD_DIM: usize = 256;

/// Options every kernel is compiled with, besides the architecture.
pub const NVRTC_OPTIONS: &[&str] = &["--std=c++17"];

/// Dynamic shared memory of `mkv_encode` for head_dim `d`, `groups = Dt / g`, `dt` kept dims:
/// the row (f32), the group importances (f32) and keep flags (i32), the rotated f16 row, and
/// one code byte per kept dim (int8 / int4 records; unused for f16).
pub fn encode_smem_bytes(d: usize, dt: usize, groups: usize) -> usize {
    4 * d + 4 * groups + 4 * groups + 2 * dt + dt
}

/// The value dtype tag the kernels take (`MKV_F16`, `MKV_INT8`, `MKV_INT4` in common.cuh):
/// the strategy's tag (SPEC.md section 6), `F16 = 1`, `Int8 = 2`, `Int4 = 3`.
pub const DTYPE_F16: i32 = 1;
/// See [`DTYPE_F16`].
pub const DTYPE_INT8: i32 = 2;
/// See [`DTYPE_F16`].
pub const DTYPE_INT4: i32 = 3;

/// Dynamic shared memory of `mkv_packed_attention` for a GQA group `g` and head_dim `d`.
/// `sq`, `so` `[g][d]`, the tile's weights `[g][ATT_TILE]`, four `[g]` scalars (running max,
/// sum, rescale factor, the int8 query's max) and the tile's expanded value rows
/// `[ATT_TILE][d]`, all f32.
pub fn packed_attention_smem_bytes(g: usize, d: usize) -> usize {
    4 * (2 * g * d + g * ATT_TILE + 4 * g + ATT_TILE * d)
}

/// Names every entry point must carry in its file; used by tests to check the table.
pub fn entry_points() -> impl Iterator<Item = (&'static str, &'static str)> {
    KERNELS
        .iter()
        .flat_map(|(file, _, entries)| entries.iter().map(move |e| (*file, *e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_entry_point_is_an_extern_c_global_in_its_file() {
        for (file, src, entries) in KERNELS {
            for e in *entries {
                let decl = src.contains(&format!("__global__ void {e}("))
                    || src.contains(&format!("\n{e}("));
                assert!(decl, "{file} lacks entry point {e}");
            }
            let declared = src.matches("extern \"C\" __global__").count();
            assert_eq!(
                declared,
                entries.len(),
                "{file}: entry point list out of date"
            );
        }
    }

    #[test]
    fn every_file_includes_only_known_headers() {
        for (file, src, _) in KERNELS {
            for line in src
                .lines()
                .filter(|l| l.trim_start().starts_with("#include"))
            {
                let name = line.split('"').nth(1).unwrap_or("");
                assert!(
                    HEADERS.iter().any(|(h, _)| *h == name),
                    "{file} includes unknown header {line}"
                );
            }
        }
    }

    #[test]
    fn shared_memory_sizes_fit_the_device_for_llama_shapes() {
        // the default 48 KiB at Llama's GQA group of 4; past it the launch opts in, up to
        // the 227 KiB of an sm_90 block
        assert!(packed_attention_smem_bytes(4, 128) <= 48 * 1024);
        assert!(packed_attention_smem_bytes(32, 128) <= 227 * 1024);
        assert!(packed_attention_smem_bytes(32, MAX_HEAD_DIM) <= 227 * 1024);
        assert!(encode_smem_bytes(256, 256, 256) <= 48 * 1024);
    }
}
