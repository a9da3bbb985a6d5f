//! AVX-512 VNNI kernels of the k-quant weight-row products (`simd/weights.rs`): Q4_K and
//! Q6_K rows against Q8_K activations (`vpdpbusd`).

use crate::simd::ggml::{
    check_k_activations, f16_at_f16c, q4_k_scales_words, Q4_K_BYTES, Q6_K_BYTES, Q8K, QK_K,
};
use std::arch::x86_64::*;

/// The `permutexvar` index tables of the scale lookups, one i16 lane per entry, built at
/// compile time: lane `l` of group `j` holds `base + j * per_group + (l % wrap) / div`.
const fn lane_table<const G: usize>(
    base: usize,
    per_group: usize,
    wrap: usize,
    div: usize,
) -> [[i16; 32]; G] {
    let mut t = [[0i16; 32]; G];
    let mut j = 0;
    while j < G {
        let mut l = 0;
        while l < 32 {
            t[j][l] = (base + j * per_group + (l % wrap) / div) as i16;
            l += 1;
        }
        j += 1;
    }
    t
}

/// Q4_K: chunk j's 32 lanes take scale 2 j (lower half) and 2 j + 1 (upper).
static Q4_K_SCALE_LANES: [[i16; 32]; 4] = lane_table(0, 2, 32, 16);
/// Q4_K: block sum s (i16 lane s, repeated in the upper half) takes min 8 + s / 2 (the 8
/// mins follow the 8 scales; two 16-element sums per 32-element sub-block).
static Q4_K_MIN_LANES: [[i16; 32]; 1] = lane_table(8, 0, 16, 2);
/// Q6_K: group g of 64 values (32 i16 lanes of 2 values) takes scale 4 g + lane / 8.
static Q6_K_SCALE_LANES: [[i16; 32]; 4] = lane_table(0, 4, 32, 8);

/// Safety: the CPU has avx512f.
#[target_feature(enable = "avx512f")]
unsafe fn load_lanes(lanes: &[i16; 32]) -> __m512i {
    // SAFETY: 64 bytes, the whole array
    _mm512_loadu_si512(lanes.as_ptr() as *const _)
}

/// Q4_K row x `N` Q8_K activations (the layout of `dot_q4_k_portable`). Each 32 nibble
/// bytes j, unpacked once into 64 values (low nibbles: sub-block 2j, high: 2j + 1), meet the
/// 64 activation bytes they multiply in one `maddubs` (u8 0..15 x i8, pair sums within i16)
/// and one `dpwssd` by the two sub-block scales; one float multiply-add per block. The mins
/// term, `dmin * sum_j m_j * (sum of sub-block j's q_x)`, is a vector `madd` of the block
/// sums by the mins, kept in float lanes. The same bit for bit whatever `N`.
/// Safety: the CPU has avx512f, avx512bw, avx512vnni, avx2 and f16c (the AVX-512 path requires them).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(crate) unsafe fn dot_q4_k<const N: usize>(row: &[u8], xs: [&Q8K; N]) -> [f32; N] {
    let nb = row.len() / Q4_K_BYTES;
    assert_eq!(row.len(), nb * Q4_K_BYTES);
    check_k_activations(nb, &xs);
    let mask = _mm512_set1_epi8(0x0F);
    // lower 256 bits: the low nibbles, upper: the high nibbles
    let shift = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
    // i16 lanes of the 16 unpacked scales (0..8) and mins (8..16) that each product needs
    let index: [__m512i; 4] = std::array::from_fn(|j| load_lanes(&Q4_K_SCALE_LANES[j]));
    let min_index = load_lanes(&Q4_K_MIN_LANES[0]);
    let mut acc = [_mm512_setzero_ps(); N];
    let mut mins = [_mm256_setzero_ps(); N];
    for b in 0..nb {
        let blk = &row[b * Q4_K_BYTES..(b + 1) * Q4_K_BYTES];
        let (d, dmin) = (f16_at_f16c(blk, 0), f16_at_f16c(blk, 2));
        let [w0, w1, w2, w3] = q4_k_scales_words(&blk[4..16]);
        let sm = _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(_mm_setr_epi32(
            w0 as i32, w1 as i32, w2 as i32, w3 as i32,
        )));
        let m16 = _mm512_castsi512_si256(_mm512_permutexvar_epi16(min_index, sm));
        let mut isum = [_mm512_setzero_si512(); N];
        let qp = blk.as_ptr().add(16);
        // SAFETY (loads): 4 x 32 bytes of the block's 128 nibble bytes; 4 x 64 activation
        // bytes of block b, inside the asserted lengths
        for j in 0..4 {
            let w = _mm256_loadu_si256(qp.add(32 * j) as *const __m256i);
            let q = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(w), shift), mask);
            let scale = _mm512_permutexvar_epi16(index[j], sm);
            for (x, isum) in xs.iter().zip(isum.iter_mut()) {
                let xp = x.qs.as_ptr().add(b * QK_K + 64 * j);
                let v = _mm512_loadu_si512(xp as *const _);
                *isum = _mm512_dpwssd_epi32(*isum, _mm512_maddubs_epi16(q, v), scale);
            }
        }
        for i in 0..N {
            let x = xs[i];
            let dx = x.d[b];
            let bs = _mm256_loadu_si256(x.bsums.as_ptr().add(b * 16) as *const __m256i);
            let msum = _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, m16));
            mins[i] = _mm256_fmadd_ps(_mm256_set1_ps(dx * dmin), msum, mins[i]);
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(dx * d), _mm512_cvtepi32_ps(isum[i]), acc[i]);
        }
    }
    std::array::from_fn(|i| {
        _mm512_reduce_add_ps(acc[i]) - _mm512_reduce_add_ps(_mm512_zextps256_ps512(mins[i]))
    })
}

/// Q6_K row x `N` Q8_K activations (the layout of `dot_q6_k_portable`). Per half block h:
/// the 64 `ql` bytes give the low 4 bits of values `128 h .. + 64` (low nibbles) and
/// `128 h + 64 .. + 64` (high nibbles); the 32 `qh` bytes, broadcast to both halves and
/// shifted by a different count in each, their top 2 bits. Each 64 values meet their 64
/// contiguous activation bytes in one `maddubs` (u8 0..63 x i8) and one `dpwssd` by their
/// four sub-block scales (`permutexvar` of the block's 16 scales). The `-32` offset,
/// `32 * sum_s sc_s * bsum_s`, is subtracted from the block's integer sum as a vector.
/// The same bit for bit whatever `N`.
/// Safety: the CPU has avx512f, avx512bw, avx512vnni, avx2 and f16c (the AVX-512 path requires them).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(crate) unsafe fn dot_q6_k<const N: usize>(row: &[u8], xs: [&Q8K; N]) -> [f32; N] {
    let nb = row.len() / Q6_K_BYTES;
    assert_eq!(row.len(), nb * Q6_K_BYTES);
    check_k_activations(nb, &xs);
    let m4 = _mm512_set1_epi8(0x0F);
    let m30 = _mm512_set1_epi8(0x30);
    // shift counts per 256-bit half: values k = 0 | k = 1 (left), k = 2 | k = 3 (right)
    let halves = |lo: i16, hi: i16| {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_set1_epi16(lo)),
            _mm256_set1_epi16(hi),
        )
    };
    let (left, right) = (halves(4, 2), halves(0, 2));
    let index: [__m512i; 4] = std::array::from_fn(|g| load_lanes(&Q6_K_SCALE_LANES[g]));
    let mut acc = [_mm512_setzero_ps(); N];
    for b in 0..nb {
        let blk = &row[b * Q6_K_BYTES..(b + 1) * Q6_K_BYTES];
        let d = f16_at_f16c(blk, 208);
        // SAFETY (loads): ql bytes 0..128, qh bytes 128..192, scales 192..208 of the
        // block; 4 x 64 activation bytes and 16 block sums of block b, inside the asserted
        // lengths
        let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.as_ptr().add(192) as *const _));
        let sc = _mm512_zextsi256_si512(sc16);
        let mut isum = [_mm512_setzero_si512(); N];
        for i in 0..N {
            let bs = _mm256_loadu_si256(xs[i].bsums.as_ptr().add(b * 16) as *const __m256i);
            let offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);
            isum[i] = _mm512_sub_epi32(isum[i], _mm512_zextsi256_si512(offset));
        }
        for h in 0..2 {
            let ql = _mm512_loadu_si512(blk.as_ptr().add(64 * h) as *const _);
            let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                blk.as_ptr().add(128 + 32 * h) as *const __m256i
            ));
            let groups = [
                _mm512_or_si512(
                    _mm512_and_si512(ql, m4),
                    _mm512_and_si512(_mm512_sllv_epi16(qh, left), m30),
                ),
                _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
                    _mm512_and_si512(_mm512_srlv_epi16(qh, right), m30),
                ),
            ];
            for (k, q) in groups.into_iter().enumerate() {
                let g = 2 * h + k;
                let scale = _mm512_permutexvar_epi16(index[g], sc);
                for (x, isum) in xs.iter().zip(isum.iter_mut()) {
                    let xp = x.qs.as_ptr().add(b * QK_K + 64 * g);
                    let v = _mm512_loadu_si512(xp as *const _);
                    *isum = _mm512_dpwssd_epi32(*isum, _mm512_maddubs_epi16(q, v), scale);
                }
            }
        }
        for i in 0..N {
            let dd = _mm512_set1_ps(xs[i].d[b] * d);
            acc[i] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(isum[i]), acc[i]);
        }
    }
    std::array::from_fn(|i| _mm512_reduce_add_ps(acc[i]))
}
