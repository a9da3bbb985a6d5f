//! The ggml block formats the engine reads from GGUF files: the byte layouts of Q4_1, Q8_0,
//! Q5_0 (converted to Q8_0 exactly) and the k-quants Q4_K and Q6_K, and the k-quants'
//! dequantization (the prefill's f32 weights).

use mosaickv_optimized::simd::ggml::{f16_at, q4_k_scales, Q4_K_BYTES, Q6_K_BYTES, QK_K};

/// Size of one ggml block in bytes.
pub(crate) const Q4_1_BYTES: usize = 20;
pub(crate) const Q8_0_BYTES: usize = 34;
pub(crate) const Q5_0_BYTES: usize = 22;

/// The k-quant block formats this crate multiplies itself (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KFormat {
    Q4K,
    Q6K,
}

impl KFormat {
    pub(crate) fn of(dtype: candle_core::quantized::GgmlDType) -> Option<Self> {
        use candle_core::quantized::GgmlDType;
        match dtype {
            GgmlDType::Q4K => Some(Self::Q4K),
            GgmlDType::Q6K => Some(Self::Q6K),
            _ => None,
        }
    }

    pub(crate) fn block_bytes(self) -> usize {
        match self {
            Self::Q4K => Q4_K_BYTES,
            Self::Q6K => Q6_K_BYTES,
        }
    }

    /// The f32 values of whole blocks (`out.len() == 256 * blocks`), with the arithmetic of
    /// ggml's and candle's dequantization (`(d * sc) * q - dmin * m`, `(d * sc) * (q - 32)`),
    /// so the same values bit for bit; the layouts are those of the portable kernels of
    /// `mosaickv_optimized::Path::dot_q4_k` and `dot_q6_k`.
    pub(crate) fn dequantize(self, blocks: &[u8], out: &mut [f32]) {
        assert_eq!(
            blocks.len() * QK_K,
            out.len() * self.block_bytes(),
            "block count"
        );
        for (blk, y) in blocks
            .chunks_exact(self.block_bytes())
            .zip(out.chunks_exact_mut(QK_K))
        {
            match self {
                Self::Q4K => {
                    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                    let (s, m) = q4_k_scales(&blk[4..16]);
                    for (j, y) in y.chunks_exact_mut(32).enumerate() {
                        let bytes = &blk[16 + 32 * (j / 2)..16 + 32 * (j / 2) + 32];
                        let (d1, m1) = (d * s[j] as f32, dmin * m[j] as f32);
                        let shift = 4 * (j % 2);
                        for (y, &q) in y.iter_mut().zip(bytes) {
                            *y = d1 * ((q >> shift) & 0x0F) as f32 - m1;
                        }
                    }
                }
                Self::Q6K => {
                    let (ql, qh, sc) = (&blk[..128], &blk[128..192], &blk[192..208]);
                    let d = f16_at(blk, 208);
                    for (i, y) in y.iter_mut().enumerate() {
                        let (h, k, l) = (i / 128, i % 128 / 32, i % 32);
                        let lo = ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2)) & 0x0F;
                        let hi = (qh[32 * h + l] >> (2 * k)) & 3;
                        let q = (lo | hi << 4) as i8 - 32;
                        *y = d * sc[i / 16] as i8 as f32 * q as f32;
                    }
                }
            }
        }
    }
}
