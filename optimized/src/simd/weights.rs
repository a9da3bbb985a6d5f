//! The engine's decode-step matrix products on ggml weight blocks, one weight row against
//! quantized activations ([`QVec`], [`Q8K`]): Q4_1 and Q8_0 rows against Q8_1 (llama.cpp's
//! `ggml_vec_dot_q4_1_q8_1`, `ggml_vec_dot_q8_0_q8_0`), Q4_K and Q6_K rows against Q8_K, `N`
//! activations at once (the row unpacked once for all). Dispatch and the portable kernels,
//! which are the oracle of the tests; `avx2/weights.rs`, `avx512/weights.rs` (VNNI, k-quants;
//! its Q4_1 and Q8_0 rows run the AVX2 kernels). Each result is the same bits whatever `N`.

use super::ggml::{f16_at, q4_k_scales, QVec, Q4_K_BYTES, Q6_K_BYTES, Q8K, QK, QK_K};
use super::Path;
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};

impl Path {
    /// A Q4_1 row (per block 16 nibble bytes in ggml order and `[d, m]`) dotted with `x`.
    #[inline]
    pub fn dot_q4_1(self, qs: &[u8], dm: &[[f32; 2]], x: &QVec) -> f32 {
        match self {
            Path::Portable => {
                Path::Portable.ran();
                dot_q4_1_portable(qs, dm, x)
            }
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 | Path::Avx512 => {
                Path::Avx2.ran();
                // SAFETY: a SIMD path means avx2 and fma were detected; the kernel checks the
                // slice lengths.
                unsafe { avx2::weights::dot_q4_1(qs, dm, x) }
            }
        }
    }

    /// A Q8_0 row (per block 32 i8 and `d`) dotted with `x`.
    #[inline]
    pub fn dot_q8_0(self, qs: &[i8], d: &[f32], x: &QVec) -> f32 {
        match self {
            Path::Portable => {
                Path::Portable.ran();
                dot_q8_0_portable(qs, d, x)
            }
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 | Path::Avx512 => {
                Path::Avx2.ran();
                // SAFETY: as in `dot_q4_1`.
                unsafe { avx2::weights::dot_q8_0(qs, d, x) }
            }
        }
    }

    /// A Q4_K row (ggml blocks of 144 bytes) dotted with `N` Q8_K activations.
    #[inline]
    pub fn dot_q4_k<const N: usize>(self, row: &[u8], xs: [&Q8K; N]) -> [f32; N] {
        match self {
            Path::Portable => {
                Path::Portable.ran();
                xs.map(|x| dot_q4_k_portable(row, x))
            }
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => {
                Path::Avx2.ran();
                // SAFETY: as in `dot_q4_1`.
                unsafe { avx2::weights::dot_q4_k(row, xs) }
            }
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 => {
                Path::Avx512.ran();
                // SAFETY: `Avx512` is detected with avx512f, avx512bw and avx512vnni; the
                // kernel checks the slice lengths.
                unsafe { avx512::weights::dot_q4_k(row, xs) }
            }
        }
    }

    /// A Q6_K row (ggml blocks of 210 bytes) dotted with `N` Q8_K activations.
    #[inline]
    pub fn dot_q6_k<const N: usize>(self, row: &[u8], xs: [&Q8K; N]) -> [f32; N] {
        match self {
            Path::Portable => {
                Path::Portable.ran();
                xs.map(|x| dot_q6_k_portable(row, x))
            }
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => {
                Path::Avx2.ran();
                // SAFETY: as in `dot_q4_1`.
                unsafe { avx2::weights::dot_q6_k(row, xs) }
            }
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 => {
                Path::Avx512.ran();
                // SAFETY: as in `dot_q4_k`.
                unsafe { avx512::weights::dot_q6_k(row, xs) }
            }
        }
    }
}

/// Q4_K row (ggml blocks of 144 bytes) x Q8_K activation. Sub-block j of 32 (scale `s[j]`, min
/// `m[j]`) is the low nibbles of bytes 32 * (j / 2) .. + 32 for even j, the high nibbles for odd.
fn dot_q4_k_portable(row: &[u8], x: &Q8K) -> f32 {
    let mut sum = 0f32;
    for (b, blk) in row.chunks_exact(Q4_K_BYTES).enumerate() {
        let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
        let (s, m) = q4_k_scales(&blk[4..16]);
        let qs = &blk[16..];
        let xq = &x.qs[b * QK_K..(b + 1) * QK_K];
        let bs = &x.bsums[b * 16..(b + 1) * 16];
        let (mut qsum, mut msum) = (0i32, 0i32);
        for j in 0..8 {
            let bytes = &qs[32 * (j / 2)..32 * (j / 2) + 32];
            let shift = 4 * (j % 2);
            let dot: i32 = bytes
                .iter()
                .zip(&xq[32 * j..32 * j + 32])
                .map(|(&q, &v)| ((q >> shift) & 0x0F) as i32 * v as i32)
                .sum();
            qsum += s[j] as i32 * dot;
            msum += m[j] as i32 * (bs[2 * j] as i32 + bs[2 * j + 1] as i32);
        }
        sum += x.d[b] * (d * qsum as f32 - dmin * msum as f32);
    }
    sum
}

/// Q6_K row (ggml blocks of 210 bytes) x Q8_K activation. In each half h of 128 values, value
/// `128 h + 32 k + l` (k in 0..4, l in 0..32) takes its low 4 bits from byte `64 h + l` (k = 0, 2)
/// or `64 h + 32 + l` (k = 1, 3) of `ql` (low nibble for k < 2, high for k >= 2), and its top 2
/// bits from bits `2 k, 2 k + 1` of byte `32 h + l` of `qh`; sub-block s of 16 has scale `sc[s]`.
fn dot_q6_k_portable(row: &[u8], x: &Q8K) -> f32 {
    let mut sum = 0f32;
    for (b, blk) in row.chunks_exact(Q6_K_BYTES).enumerate() {
        let (ql, qh, sc) = (&blk[..128], &blk[128..192], &blk[192..208]);
        let d = f16_at(blk, 208);
        let xq = &x.qs[b * QK_K..(b + 1) * QK_K];
        let bs = &x.bsums[b * 16..(b + 1) * 16];
        let mut sub = [0i32; 16];
        for h in 0..2 {
            for k in 0..4 {
                for l in 0..32 {
                    let lo = ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2)) & 0x0F;
                    let hi = (qh[32 * h + l] >> (2 * k)) & 3;
                    let i = 128 * h + 32 * k + l;
                    sub[i / 16] += (lo | hi << 4) as i32 * xq[i] as i32;
                }
            }
        }
        let isum: i32 = (0..16)
            .map(|s| sc[s] as i8 as i32 * (sub[s] - 32 * bs[s] as i32))
            .sum();
        sum += x.d[b] * d * isum as f32;
    }
    sum
}

fn dot_q4_1_portable(qs: &[u8], dm: &[[f32; 2]], x: &QVec) -> f32 {
    let mut sum = 0f32;
    for (b, &[d, m]) in dm.iter().enumerate() {
        let q = &qs[b * 16..(b + 1) * 16];
        let xq = &x.qs[b * QK..(b + 1) * QK];
        let mut acc = 0i32;
        for j in 0..16 {
            acc += (q[j] & 0x0F) as i32 * xq[j] as i32 + (q[j] >> 4) as i32 * xq[j + 16] as i32;
        }
        sum += d * x.d[b] * acc as f32 + m * x.s[b];
    }
    sum
}

fn dot_q8_0_portable(qs: &[i8], d: &[f32], x: &QVec) -> f32 {
    let mut sum = 0f32;
    for (b, &db) in d.iter().enumerate() {
        let acc: i32 = qs[b * QK..(b + 1) * QK]
            .iter()
            .zip(&x.qs[b * QK..(b + 1) * QK])
            .map(|(&a, &c)| a as i32 * c as i32)
            .sum();
        sum += db * x.d[b] * acc as f32;
    }
    sum
}
