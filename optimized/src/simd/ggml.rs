//! What the ggml weight kernels of every layer share: the block sizes, the quantized
//! activations (llama.cpp's Q8_1 per block of 32, ggml's Q8_K per block of 256) and the
//! scalar unpacking of k-quant block headers. The engine's decode-step matrix products
//! (`mosaickv-engine`'s `quant`) multiply its GGUF weights through [`crate::simd::Path`]'s
//! `dot_*` methods against these activations. A leaf like `common`: the dispatch
//! (`weights.rs`) and the AVX2 and AVX-512 layers import from here, and it imports none of them.

use half::f16;

/// Elements per block (Q4_1, Q8_0 and the Q8_1 activation).
pub const QK: usize = 32;
/// Elements per k-quant block (Q4_K, Q6_K and the Q8_K activation).
pub const QK_K: usize = 256;
/// Bytes of one Q4_K block (`d`, `dmin`, 12 bytes of 6-bit scales and mins, 128 of nibbles).
pub const Q4_K_BYTES: usize = 144;
/// Bytes of one Q6_K block (128 low-nibble bytes, 64 high-bit bytes, 16 i8 scales, `d`).
pub const Q6_K_BYTES: usize = 210;

/// An activation vector quantized to 8 bits per block of 32 (llama.cpp's Q8_1), and, when its
/// length is a multiple of 256, also per block of 256 (Q8_K, for the k-quant weights). Quantized
/// once per layer input and reused by every matrix that multiplies it (Q, K, V; gate, up).
#[derive(Debug, Clone, Default)]
pub struct QVec {
    pub qs: Vec<i8>,
    /// Per block scale `d = max|x| / 127`.
    pub d: Vec<f32>,
    /// Per block `d * sum(q)`.
    pub s: Vec<f32>,
    /// The Q8_K copy; empty when the length is not a multiple of 256.
    pub k: Q8K,
}

/// An activation in Q8_K blocks of 256 (structure of arrays).
#[derive(Debug, Clone, Default)]
pub struct Q8K {
    /// 256 values per block, in -128..=127.
    pub qs: Vec<i8>,
    /// Per block scale: `x ~= d * q`.
    pub d: Vec<f32>,
    /// Per block the 16 sums of 16 consecutive `q`.
    pub bsums: Vec<i16>,
}

impl Q8K {
    /// ggml's `quantize_row_q8_K` rule, as candle writes it: `d = max / -128` where `max` is the
    /// value of largest magnitude (the first one on ties), `q = min(round(x / d), 127)` (half
    /// away from zero); an all-zero block gets `d = 0`, `q = 0`.
    pub fn quantize(&mut self, x: &[f32]) {
        let nb = x.len() / QK_K;
        self.qs.resize(nb * QK_K, 0);
        self.d.resize(nb, 0.0);
        self.bsums.resize(nb * QK_K / 16, 0);
        for (b, src) in x.chunks_exact(QK_K).enumerate() {
            let (mut amax, mut max) = (0f32, 0f32);
            for &v in src {
                if amax < v.abs() {
                    amax = v.abs();
                    max = v;
                }
            }
            let dst = &mut self.qs[b * QK_K..(b + 1) * QK_K];
            if amax == 0.0 {
                self.d[b] = 0.0;
                dst.fill(0);
            } else {
                let iscale = -128.0 / max;
                for (q, &v) in dst.iter_mut().zip(src) {
                    *q = (iscale * v).round().min(127.0) as i8;
                }
                self.d[b] = 1.0 / iscale;
            }
            for (s, q) in self.bsums[b * 16..(b + 1) * 16]
                .iter_mut()
                .zip(dst.chunks_exact(16))
            {
                *s = q.iter().map(|&v| v as i16).sum();
            }
        }
    }
}

impl QVec {
    pub fn len(&self) -> usize {
        self.qs.len()
    }

    /// Quantizes `x` (length a multiple of 32), reusing the buffers.
    pub fn quantize(&mut self, x: &[f32]) {
        assert_eq!(
            x.len() % QK,
            0,
            "activation length must be a multiple of 32"
        );
        let nb = x.len() / QK;
        self.qs.resize(x.len(), 0);
        self.d.resize(nb, 0.0);
        self.s.resize(nb, 0.0);
        for (b, (src, dst)) in x
            .chunks_exact(QK)
            .zip(self.qs.chunks_exact_mut(QK))
            .enumerate()
        {
            let (d, sum) = quantize_block(src, dst);
            self.d[b] = d;
            self.s[b] = d * sum as f32;
        }
        let k_len = if x.len() % QK_K == 0 { x.len() } else { 0 };
        self.k.quantize(&x[..k_len]);
    }
}

/// Quantizes 32 values to i8 in -127..=127 with `d = max|x| / 127`; returns `(d, sum(q))`.
pub fn quantize_block(src: &[f32], dst: &mut [i8]) -> (f32, i32) {
    let amax = src.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in dst.iter_mut().zip(src) {
        let r = (v * id).round().clamp(-127.0, 127.0) as i8;
        *q = r;
        sum += r as i32;
    }
    (d, sum)
}

/// The little-endian f16 at byte `at` of `b`, as f32 (exact).
pub fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// [`f16_at`] by the F16C instruction, for the SIMD kernels: inlined into them (their
/// `target_feature` lists include `f16c`), where `half`'s `to_f32` checks the CPU and calls
/// out of line on every block (15 % of a Qwen decode step's samples before, 2026-12-05). The
/// same value: f16 -> f32 is exact either way.
///
/// # Safety
/// The CPU has F16C.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "f16c")]
pub unsafe fn f16_at_f16c(b: &[u8], at: usize) -> f32 {
    use std::arch::x86_64::{_mm_cvtph_ps, _mm_cvtsi32_si128, _mm_cvtss_f32};
    let bits = u16::from_le_bytes([b[at], b[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// The 8 scales and 8 mins of a Q4_K block from its 12 packed bytes: 6 bits each; the first
/// four of each in the low 6 bits of bytes 0..4 (scales) and 4..8 (mins), the last four in the
/// nibbles of bytes 8..12 with their top 2 bits in the top bits of bytes 0..8.
pub fn q4_k_scales(sc: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut s, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        s[j] = sc[j] & 63;
        m[j] = sc[j + 4] & 63;
        s[j + 4] = (sc[j + 8] & 0x0F) | ((sc[j] >> 6) << 4);
        m[j + 4] = (sc[j + 8] >> 4) | ((sc[j + 4] >> 6) << 4);
    }
    (s, m)
}

/// Panics unless every Q8_K activation has `nb` blocks (the k-quant kernels' bounds).
#[cfg(target_arch = "x86_64")]
pub(crate) fn check_k_activations(nb: usize, xs: &[&Q8K]) {
    for x in xs {
        assert!(x.qs.len() == nb * QK_K && x.d.len() == nb && x.bsums.len() == nb * 16);
    }
}

/// [`q4_k_scales`] with word operations (ggml's `kmask` form): the 12 bytes as three
/// little-endian u32, returned as four u32 whose 16 bytes are the 8 scales then the 8 mins.
#[inline(always)]
pub(crate) fn q4_k_scales_words(sc: &[u8]) -> [u32; 4] {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let w = |i: usize| u32::from_le_bytes([sc[4 * i], sc[4 * i + 1], sc[4 * i + 2], sc[4 * i + 3]]);
    let (a, b, c) = (w(0), w(1), w(2));
    [
        a & LOW6,
        (c & LOW4) | (((a >> 6) & LOW2) << 4),
        b & LOW6,
        ((c >> 4) & LOW4) | (((b >> 6) & LOW2) << 4),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    /// The word form of the Q4_K scale unpacking gives the byte form's scales and mins.
    #[test]
    fn q4_k_scale_forms_agree() {
        let mut seed = 5u64;
        for t in 0..4000 {
            let sc: [u8; 12] = std::array::from_fn(|i| match t {
                0 => 0xFF,
                1 => 0,
                _ => ((rng(&mut seed) + 1.0) * 127.99) as u8 ^ i as u8,
            });
            let (s, m) = q4_k_scales(&sc);
            let words = q4_k_scales_words(&sc);
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            assert_eq!(&bytes[..8], &s, "scales of {sc:?}");
            assert_eq!(&bytes[8..], &m, "mins of {sc:?}");
        }
    }
}
