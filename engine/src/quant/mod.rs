//! Decode-step matrix-vector products on the GGUF's own block-quantized weights.
//!
//! A decode step multiplies one activation vector by every weight matrix, so its cost is reading
//! the weights. Keeping them in the file's block formats (Q4_1: 20 bytes per 32 weights, Q8_0:
//! 34 bytes) instead of f32 (128 bytes) reads 5x fewer bytes. The activation is quantized to
//! 8 bits per block of 32 (llama.cpp's Q8_1: scale `d = max|x| / 127`, `s = d * sum(q)`), and
//! each block's dot product runs on integers, as in llama.cpp's `ggml_vec_dot_q4_1_q8_1` and
//! `ggml_vec_dot_q8_0_q8_0`:
//!
//! * Q4_1 weight `w = d_w * q + m_w` (q in 0..16):
//!   `sum(w * x) ~= d_w * d_x * sum(q * q_x) + m_w * s_x`;
//! * Q8_0 weight `w = d_w * q`: `sum(w * x) ~= d_w * d_x * sum(q * q_x)`.
//!
//! The k-quant weights of Q4_K_M files (Q4_K, Q6_K: blocks of 256) keep their blocks too, and
//! are multiplied by kernels of this crate against the activation quantized to Q8_K (ggml's
//! rule: per block of 256 `d = max / -128` with the sign of the largest |x|, `q = round(x / d)`
//! capped at 127, and the sums of each 16 `q`):
//!
//! * Q4_K (144 bytes: `d`, `dmin`, 8 6-bit scales and 8 6-bit mins, 256 nibbles), weight
//!   `w = d * sc_j * q - dmin * m_j` in sub-block j of 32:
//!   `sum(w * x) ~= d_x * (d * sum_j sc_j * sum(q * q_x) - dmin * sum_j m_j * sum(q_x))`;
//! * Q6_K (210 bytes: 4 low and 2 high bits of 256 6-bit `q`, 16 i8 scales, `d`), weight
//!   `w = d * sc_s * (q - 32)` in sub-block s of 16:
//!   `sum(w * x) ~= d_x * d * sum_s sc_s * (sum(q * q_x) - 32 * sum(q_x))`.
//!
//! Weights in any other ggml block format go through candle's quantized matmul (`QMatMul`).
//! Weights stored as f32/f16 are quantized to Q8_0 at load. Every product, single vector or
//! batch, runs through one dispatch ([`QMatrix::matmul_batch`]): output rows are split over
//! rayon, each task calls the row kernel of the matrix's format for each activation.
//!
//! | concern | where |
//! |---|---|
//! | the block formats: byte layouts, parsing, Q5_0 -> Q8_0, k-quant dequantization | `formats.rs` |
//! | the matrices and their one product dispatch ([`QMatrix`], [`RowStack`]) | `matrix.rs` |
//! | the row kernels (portable, AVX2, AVX-512 VNNI) and the quantized activations | `mosaickv_optimized::simd` (`weights.rs`, `ggml.rs`, and their ISA files) |
//!
//! The kernels run on the workspace's one CPU path ([`path`], `mosaickv_optimized::Path::detect`,
//! which `MOSAICKV_FORCE_PORTABLE` and `MOSAICKV_FORCE_AVX2` reach; candle's own k-quant kernels
//! are compiled in only when the whole build targets AVX2, which this workspace does not); the
//! portable scalar kernels are the oracle of the tests.

mod formats;
mod matrix;
#[cfg(test)]
mod tests;

pub(crate) use formats::KFormat;
pub(crate) use matrix::{QMatrix, RowStack};
pub(crate) use mosaickv_optimized::simd::ggml::QVec;
use mosaickv_optimized::Path;

/// The CPU path of the weight products: the workspace's one detection
/// (`mosaickv_optimized::Path::detect`), decided once per process.
pub(crate) fn path() -> Path {
    static DETECTED: std::sync::OnceLock<Path> = std::sync::OnceLock::new();
    *DETECTED.get_or_init(Path::detect)
}

/// The name of the weight kernels [`path`] runs, as `cpu_paths` names the paths (the AVX-512
/// path multiplies k-quant rows with VNNI, Q4_1 and Q8_0 rows with the AVX2 kernels).
pub fn kernel_name() -> &'static str {
    match path() {
        Path::Avx512 => "avx512 (vnni)",
        p => p.name(),
    }
}

/// Every path this CPU runs, slowest first (for the tests and the timing).
#[cfg(test)]
pub(crate) fn available_paths() -> Vec<Path> {
    Path::ALL
        .into_iter()
        .filter(|p| p.runs_here() && *p as u8 <= path() as u8)
        .collect()
}
