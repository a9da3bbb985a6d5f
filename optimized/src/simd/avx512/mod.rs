//! AVX-512 (F, BW, VL, VBMI2, VNNI) versions of the kernels where it pays on
//! the machine we measured (AMD Zen 4, which runs 512-bit arithmetic on
//! 256-bit units): bitmap expansion, the value side of packed attention, the
//! logits of an expanded key tile, the online-softmax step, MosaicKV's block
//! scores, Quest's page scores, the baselines' f16 value accumulation and the
//! query rotation. Every other kernel of [`crate::simd::Path::Avx512`] is the
//! AVX2 one. Measured and not kept (docs/PERFORMANCE-HISTORY.md): 16-lane tile
//! accumulation on stored f32 tiles (no faster); 16-lane logits on streamed
//! f16 rows (faster on L1-resident rows, slower for dense decode); fused
//! expansion + logits kernels (21-23 ns per token against 17.7 for expansion
//! then tile logits; later, with four tokens per pass, 16.4 against 14.5).
//!
//! What changes against AVX2:
//! - Expansion (SPEC.md section 6, g = 1): one `vpexpandw` per 32 dims places
//!   the packed f16 values at the set bits of the bitmap, instead of one
//!   table-driven `pshufb` per 8 dims. Keys are expanded into an f16 tile
//!   ([`expand::expand_g1_h`]: one 64-byte store per 32 dims, no conversion), which
//!   the logits widen as they load it.
//! - Key logits on the expanded tile: four tokens x four heads per pass, so each
//!   query chunk is loaded once per four tokens and a head's four sums come out
//!   of one transposed reduction ([`logits::tile_logits`], on f32 or f16 rows).
//! - Online softmax: the four heads' maxima and sums by transposed reductions,
//!   the rescale factors by a 4-lane copy of the scalar `fast_exp`.
//! - Dense / Quest value accumulation on f16 rows: rows read in address order
//!   with every accumulator in registers ([`accumulate::tile_accumulate_f16`]).
//! - Value accumulation (SPEC.md section 9): each value record is expanded in
//!   registers and multiplied straight into accumulators that stay in
//!   registers for the whole tile, rescaled by the online-softmax factor on
//!   load ([`accumulate::packed_accumulate`], with [`softmax::tile_softmax`] giving the
//!   factors); no expanded tile is stored. Lane for lane the same operations as the AVX2
//!   sequence, so the same bits.
//! - Block scores (SPEC.md section 8.2, exact integers): `vpdpbusd` sums four
//!   u8 x i8 products per i32 lane in one instruction, where AVX2 needs
//!   `vpmaddubsw` + `vpmaddwd` + `vpaddd`; same integers, same f64 products.
//! - Query rotation (SPEC.md section 8.1): the rotation read row by row, each
//!   widened row shared by up to 4 query rows, f64 FMAs (exact products, so the
//!   same sums).
//! - Quest's page scores (SPEC.md section 12, f32): `max(q M, q m) = q+ M +
//!   q- m` for `M >= m` (`q+ = max(q, 0)`, `q- = min(q, 0)`), two FMAs per lane
//!   instead of mul, mul, max, add, 4 pages per pass; the same bound, only the
//!   rounding differs (FMA, 16-lane sums).
//! - int8/int4 records ([`quant::expand_q`], SPEC.md sections 5 and 6): every group size in
//!   one kernel, group bits spread by `pdep`, codes placed by `vpexpandb`. Value records
//!   with few kept dims are not expanded at all: [`quant::sparse_accumulate_q`] decodes
//!   only the kept groups and accumulates them into a head-minor accumulator
//!   ([`crate::simd::codes::SparsePlan`]), the same FMAs in the same order as expansion +
//!   accumulation, so the same bits.
//!
//! Callers hold [`crate::simd::Path::Avx512`] (which [`crate::simd::Path::runs_here`] checks)
//! before calling anything here.
//!
//! One file per concern; this module holds the helpers they share. Depends on
//! `simd::common` and on the AVX2 layer's `hsum4_i32`, never on the dispatch layer.

use half::f16;
use std::arch::x86_64::*;

/// Defines `$name(a) -> [op a0, op a1, op a2, op a3]` (one xmm): the horizontal reductions of
/// four registers by one transposition (about 13 shuffles and `$op`s instead of 4 separate
/// reductions of ~8 each), `$op512` / `$op256` / `$op128` the operation at each width.
macro_rules! transposed_reduce4 {
    ($(#[$doc:meta])* $name:ident, $op512:ident, $op256:ident, $op128:ident) => {
        $(#[$doc])*
        #[target_feature(
            enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt"
        )]
        #[inline]
        unsafe fn $name(a: &[__m512]) -> __m128 {
            let t0 = $op512(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
            let t1 = $op512(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
            let u = $op512(
                _mm512_shuffle_ps::<0x44>(t0, t1),
                _mm512_shuffle_ps::<0xEE>(t0, t1),
            );
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(u)));
            let v = $op256(_mm512_castps512_ps256(u), hi);
            $op128(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v))
        }
    };
}

transposed_reduce4!(
    /// The four horizontal sums of `a[0..4]`, as one xmm `[sum a0, sum a1, sum a2, sum a3]`.
    hsum4, _mm512_add_ps, _mm256_add_ps, _mm_add_ps
);
transposed_reduce4!(
    /// The four horizontal maxima of `a[0..4]`, as one xmm.
    hmax4, _mm512_max_ps, _mm256_max_ps, _mm_max_ps
);

pub mod accumulate;
pub mod expand;
pub mod logits;
pub mod pages;
pub mod quant;
pub mod rotate;
pub mod score;
pub mod select;
pub mod softmax;
pub mod weights;

/// Lane mask of the first `n` of 16 lanes.
#[inline(always)]
fn lanes16(n: usize) -> u16 {
    if n >= 16 {
        u16::MAX
    } else {
        (1u16 << n) - 1
    }
}

/// Lane mask of the first `n` of 64 lanes.
#[inline(always)]
fn lanes64(n: usize) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}

/// Horizontal sums of `N` accumulators into `out[..N]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn hsums<const N: usize>(a: &[__m512; N], out: &mut [f32; 4]) {
    if N == 4 {
        _mm_storeu_ps(out.as_mut_ptr(), hsum4(a));
    } else {
        for k in 0..N {
            out[k] = _mm512_reduce_add_ps(a[k]);
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn ld_f16(p: *const f16) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn ldm_f16(p: *const f16, k: u16) -> __m512 {
    _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p as *const i16))
}
