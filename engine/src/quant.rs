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
//! The AVX2 kernels are chosen at run time (candle's own k-quant kernels are compiled in only
//! when the whole build targets AVX2, which this workspace does not); a portable scalar kernel
//! is the fallback and the oracle of the tests.

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use half::f16;
use rayon::prelude::*;
use std::sync::Arc;

/// Elements per block (Q4_1, Q8_0 and the Q8_1 activation).
pub(crate) const QK: usize = 32;
/// Elements per k-quant block (Q4_K, Q6_K and the Q8_K activation).
pub(crate) const QK_K: usize = 256;

/// Size of one ggml block in bytes.
const Q4_1_BYTES: usize = 20;
const Q8_0_BYTES: usize = 34;
const Q5_0_BYTES: usize = 22;
const Q4_K_BYTES: usize = 144;
const Q6_K_BYTES: usize = 210;

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
    /// so the same values bit for bit; the layouts are those of `dot_q4_k_portable` and
    /// `dot_q6_k_portable`.
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

/// A weight matrix `[rows, cols]` (row-major, `cols % 32 == 0`) in a block format.
#[derive(Debug, Clone)]
pub(crate) enum QMatrix {
    /// Per block: 16 bytes of nibbles in ggml order (byte j: low nibble = element j, high
    /// nibble = element j + 16) and `[d, m]`.
    Q4_1 {
        rows: usize,
        cols: usize,
        qs: Vec<u8>,
        dm: Vec<[f32; 2]>,
    },
    /// Per block: 32 signed bytes and `d`.
    Q8_0 {
        rows: usize,
        cols: usize,
        qs: Vec<i8>,
        d: Vec<f32>,
    },
    /// Q4_K or Q6_K blocks in ggml's byte layout (`cols % 256 == 0`), read in place from the
    /// tensor candle loaded (the prefill's dequantization reads the same bytes, so they are held
    /// once).
    KQuant {
        rows: usize,
        cols: usize,
        format: KFormat,
        q: Arc<QTensor>,
    },
    /// Another ggml block format, multiplied by candle's `QMatMul` (see the module doc).
    Ggml {
        rows: usize,
        cols: usize,
        q: Arc<QTensor>,
        mm: QMatMul,
    },
}

/// One product's view of a matrix's rows, for the row kernels.
enum Rows<'a> {
    Q4_1 {
        qs: &'a [u8],
        dm: &'a [[f32; 2]],
        nb: usize,
    },
    Q8_0 {
        qs: &'a [i8],
        d: &'a [f32],
        cols: usize,
    },
    KQuant {
        raw: &'a [u8],
        format: KFormat,
        row_bytes: usize,
    },
}

impl Rows<'_> {
    /// Row `r` dotted with each of the `N` activations `xs`; each result is the same bit for bit
    /// whatever `N`.
    #[inline]
    fn dot<const N: usize>(&self, r: usize, xs: [&QVec; N], kernel: Kernel) -> [f32; N] {
        match *self {
            Self::Q4_1 { qs, dm, nb } => {
                let (q, s) = (
                    &qs[r * nb * 16..(r + 1) * nb * 16],
                    &dm[r * nb..(r + 1) * nb],
                );
                xs.map(|x| kernel.dot_q4_1(q, s, x))
            }
            Self::Q8_0 { qs, d, cols } => {
                let nb = cols / QK;
                let (q, s) = (&qs[r * cols..(r + 1) * cols], &d[r * nb..(r + 1) * nb]);
                xs.map(|x| kernel.dot_q8_0(q, s, x))
            }
            Self::KQuant {
                raw,
                format,
                row_bytes,
            } => {
                let row = &raw[r * row_bytes..(r + 1) * row_bytes];
                kernel.dot_k(format, row, xs.map(|x| &x.k))
            }
        }
    }
}

impl QMatrix {
    pub(crate) fn rows(&self) -> usize {
        match self {
            Self::Q4_1 { rows, .. }
            | Self::Q8_0 { rows, .. }
            | Self::KQuant { rows, .. }
            | Self::Ggml { rows, .. } => *rows,
        }
    }

    pub(crate) fn cols(&self) -> usize {
        match self {
            Self::Q4_1 { cols, .. }
            | Self::Q8_0 { cols, .. }
            | Self::KQuant { cols, .. }
            | Self::Ggml { cols, .. } => *cols,
        }
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Self::Q4_1 { qs, dm, .. } => qs.len() + dm.len() * 8,
            Self::Q8_0 { qs, d, .. } => qs.len() + d.len() * 4,
            Self::KQuant { q, .. } | Self::Ggml { q, .. } => q.storage_size_in_bytes(),
        }
    }

    /// A 2-D block-quantized tensor `[rows, cols]` kept in its own blocks: Q4_K/Q6_K (with
    /// `cols % 256 == 0`) for this crate's kernels, any other block format for candle's
    /// `QMatMul`. `None` for f32/f16 tensors (not block formats) or another rank.
    pub(crate) fn ggml(q: Arc<QTensor>) -> Option<Self> {
        use candle_core::quantized::GgmlDType;
        if matches!(q.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) {
            return None;
        }
        let (rows, cols) = q.shape().dims2().ok()?;
        if let Some(format) = KFormat::of(q.dtype()) {
            let size_ok = q.storage_size_in_bytes() == rows * cols / QK_K * format.block_bytes();
            // the bytes must be readable in place (CPU storage)
            let cpu = q
                .data()
                .is_ok_and(|d| matches!(d, std::borrow::Cow::Borrowed(_)));
            if cols % QK_K == 0 && rows > 0 && size_ok && cpu {
                return Some(Self::KQuant {
                    rows,
                    cols,
                    format,
                    q,
                });
            }
        }
        let mm = QMatMul::from_arc(q.clone()).ok()?;
        Some(Self::Ggml { rows, cols, q, mm })
    }

    /// Parses raw ggml Q4_1 blocks (`d: f16, m: f16, qs: [u8; 16]`) of a `[rows, cols]` matrix.
    pub(crate) fn from_q4_1_bytes(raw: &[u8], rows: usize, cols: usize) -> Option<Self> {
        let nb = Self::blocks(rows, cols)?;
        if raw.len() != nb * Q4_1_BYTES {
            return None;
        }
        let mut qs = Vec::with_capacity(nb * 16);
        let mut dm = Vec::with_capacity(nb);
        for b in raw.chunks_exact(Q4_1_BYTES) {
            let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
            let m = f16::from_le_bytes([b[2], b[3]]).to_f32();
            dm.push([d, m]);
            qs.extend_from_slice(&b[4..]);
        }
        Some(Self::Q4_1 { rows, cols, qs, dm })
    }

    /// Parses raw ggml Q8_0 blocks (`d: f16, qs: [i8; 32]`) of a `[rows, cols]` matrix.
    pub(crate) fn from_q8_0_bytes(raw: &[u8], rows: usize, cols: usize) -> Option<Self> {
        let nb = Self::blocks(rows, cols)?;
        if raw.len() != nb * Q8_0_BYTES {
            return None;
        }
        let mut qs = Vec::with_capacity(nb * QK);
        let mut d = Vec::with_capacity(nb);
        for b in raw.chunks_exact(Q8_0_BYTES) {
            d.push(f16::from_le_bytes([b[0], b[1]]).to_f32());
            qs.extend(b[2..].iter().map(|&v| v as i8));
        }
        Some(Self::Q8_0 { rows, cols, qs, d })
    }

    /// Parses raw ggml Q5_0 blocks (`d: f16, qh: [u8; 4], qs: [u8; 16]`, 22 bytes; value `j`
    /// is `d * (q_j - 16)` with `q_j` the 5-bit code: low nibble of `qs[j]` (j < 16) or high
    /// nibble of `qs[j - 16]`, fifth bit `j` of the little-endian `qh`) into Q8_0 blocks with the
    /// same `d` and `q_j - 16` in [-16, 15] as the int8: the same weights exactly, read by the
    /// Q8_0 kernels of every CPU path (Qwen2.5-Coder-0.5B stores most of its matrices as Q5_0).
    pub(crate) fn from_q5_0_bytes(raw: &[u8], rows: usize, cols: usize) -> Option<Self> {
        let nb = Self::blocks(rows, cols)?;
        if raw.len() != nb * Q5_0_BYTES {
            return None;
        }
        let mut qs = Vec::with_capacity(nb * QK);
        let mut d = Vec::with_capacity(nb);
        for b in raw.chunks_exact(Q5_0_BYTES) {
            d.push(f16::from_le_bytes([b[0], b[1]]).to_f32());
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let nib = &b[6..22];
            for j in 0..QK {
                let low = if j < 16 {
                    nib[j] & 0x0f
                } else {
                    nib[j - 16] >> 4
                };
                let high = (((qh >> j) & 1) as u8) << 4;
                qs.push((low | high) as i8 - 16);
            }
        }
        Some(Self::Q8_0 { rows, cols, qs, d })
    }

    /// Quantizes an f32 matrix to Q8_0 (ggml's rule: `d = max|w| / 127`, `q = round(w / d)`).
    pub(crate) fn q8_0_from_f32(w: &[f32], rows: usize, cols: usize) -> Option<Self> {
        let nb = Self::blocks(rows, cols)?;
        if w.len() != rows * cols {
            return None;
        }
        let mut qs = vec![0i8; nb * QK];
        let mut d = vec![0f32; nb];
        for ((src, dst), db) in w
            .chunks_exact(QK)
            .zip(qs.chunks_exact_mut(QK))
            .zip(d.iter_mut())
        {
            *db = quantize_block(src, dst).0;
        }
        Some(Self::Q8_0 { rows, cols, qs, d })
    }

    /// Stacks matrices with the same format and column count along the rows.
    #[cfg(test)]
    pub(crate) fn vstack(parts: Vec<QMatrix>) -> Option<Self> {
        let mut it = parts.into_iter();
        let mut acc = it.next()?;
        for p in it {
            if acc.append(p).is_some() {
                return None;
            }
        }
        Some(acc)
    }

    /// Appends `p`'s rows when it has the same own format (Q4_1 or Q8_0) and width; otherwise
    /// hands `p` back unchanged.
    fn append(&mut self, p: QMatrix) -> Option<QMatrix> {
        match (self, p) {
            (
                Self::Q4_1 { rows, cols, qs, dm },
                Self::Q4_1 {
                    rows: r2,
                    cols: c2,
                    qs: q2,
                    dm: d2,
                },
            ) if *cols == c2 => {
                *rows += r2;
                qs.extend_from_slice(&q2);
                dm.extend_from_slice(&d2);
                None
            }
            (
                Self::Q8_0 { rows, cols, qs, d },
                Self::Q8_0 {
                    rows: r2,
                    cols: c2,
                    qs: q2,
                    d: d2,
                },
            ) if *cols == c2 => {
                *rows += r2;
                qs.extend_from_slice(&q2);
                d.extend_from_slice(&d2);
                None
            }
            (_, p) => Some(p),
        }
    }

    fn blocks(rows: usize, cols: usize) -> Option<usize> {
        (cols % QK == 0 && cols > 0 && rows > 0).then_some(rows * cols / QK)
    }

    /// The row view of a matrix with its own kernels; `None` for `Ggml`.
    fn row_view(&self) -> candle_core::Result<Option<Rows<'_>>> {
        Ok(match self {
            Self::Q4_1 { qs, dm, cols, .. } => Some(Rows::Q4_1 {
                qs,
                dm,
                nb: cols / QK,
            }),
            Self::Q8_0 { qs, d, cols, .. } => Some(Rows::Q8_0 { qs, d, cols: *cols }),
            Self::KQuant {
                q, cols, format, ..
            } => {
                let raw = match q.data()? {
                    std::borrow::Cow::Borrowed(raw) => raw,
                    // `ggml` only builds `KQuant` over CPU storage, which lends its bytes
                    std::borrow::Cow::Owned(_) => unreachable!("KQuant over CPU storage"),
                };
                Some(Rows::KQuant {
                    raw,
                    format: *format,
                    row_bytes: cols / QK_K * format.block_bytes(),
                })
            }
            Self::Ggml { .. } => None,
        })
    }

    /// `out[r] = sum_c self[r, c] * x[c]`; `xq` is `x` as quantized by [`QVec::quantize`].
    /// The single-vector case of [`QMatrix::matmul_batch`].
    /// Panics if the shapes differ (callers build both from the model's config).
    pub(crate) fn matvec(&self, x: &[f32], xq: &QVec, out: &mut [f32]) -> candle_core::Result<()> {
        self.matmul_batch(x, std::slice::from_ref(xq), out)
    }

    /// [`QMatrix::matvec`] with a chosen kernel (tests compare the kernels). Panics on `Ggml`.
    #[cfg(test)]
    pub(crate) fn matvec_with(&self, x: &QVec, out: &mut [f32], kernel: Kernel) {
        let rows = self.row_view().unwrap().expect("a format with own kernels");
        self.product(&rows, std::slice::from_ref(x), out, kernel);
    }

    /// The product of a decode step over many sequences (`[batch, cols]` times the transposed
    /// weight): `out[b * rows + r] = sum_c self[r, c] * x[b * cols + c]`; `xq[b]` is row `b` of
    /// `x` as quantized by [`QVec::quantize`]. Output rows are split over rayon; each weight row
    /// is read once for the whole batch (it stays in cache while every activation is dotted with
    /// it), so the weight bytes a step reads do not grow with the batch. Every entry is one call
    /// of the format's row kernel on one activation, whatever the batch, so row `b` equals the
    /// single-vector product of `x[b]` bit for bit. `Ggml` runs candle's QMatMul on the
    /// `[batch, cols]` tensor (it quantizes each row on its own and runs the same `vec_dot` per
    /// row and weight row as for one row, so the same holds).
    /// Panics if the shapes differ (callers build both from the model's config).
    pub(crate) fn matmul_batch(
        &self,
        x: &[f32],
        xq: &[QVec],
        out: &mut [f32],
    ) -> candle_core::Result<()> {
        let (rows, cols) = (self.rows(), self.cols());
        let batch = xq.len();
        assert_eq!(x.len(), batch * cols, "activation length");
        assert_eq!(out.len(), batch * rows, "output length");
        if batch == 0 {
            return Ok(());
        }
        match self.row_view()? {
            Some(view) => self.product(&view, xq, out, Kernel::detect()),
            None => {
                let Self::Ggml { mm, .. } = self else {
                    unreachable!("only Ggml lacks a row view")
                };
                let y = mm
                    .forward(&Tensor::from_slice(x, (batch, cols), &Device::Cpu)?)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                out.copy_from_slice(&y);
            }
        }
        Ok(())
    }

    /// The one dispatch of every own-kernel product: output rows in parallel chunks, each row
    /// dotted with every activation. One activation writes `out` in place; a batch fills a
    /// `[rows][batch]` scratch first (each task owns whole rows) and transposes it.
    fn product(&self, view: &Rows<'_>, xq: &[QVec], out: &mut [f32], kernel: Kernel) {
        let (rows, cols, batch) = (self.rows(), self.cols(), xq.len());
        assert!(xq.iter().all(|x| x.len() == cols), "activation length");
        assert_eq!(out.len(), batch * rows, "output length");
        if matches!(view, Rows::KQuant { .. }) {
            assert!(
                xq.iter().all(|x| x.k.d.len() * QK_K == cols),
                "activation not quantized to Q8_K"
            );
        }
        // enough chunks to balance the threads, large enough to amortize the task overhead
        let chunk = (rows / (8 * rayon::current_num_threads().max(1))).clamp(16, 512);
        if batch == 1 {
            let x = &xq[0];
            out.par_chunks_mut(chunk).enumerate().for_each(|(ci, o)| {
                for (i, y) in o.iter_mut().enumerate() {
                    [*y] = view.dot(ci * chunk + i, [x], kernel);
                }
            });
            return;
        }
        let mut by_row = vec![0f32; rows * batch];
        by_row
            .par_chunks_mut(chunk * batch)
            .enumerate()
            .for_each(|(ci, o)| {
                for (i, ys) in o.chunks_exact_mut(batch).enumerate() {
                    let r = ci * chunk + i;
                    // four activations per kernel call, the rest one by one
                    let mut quads = ys.chunks_exact_mut(4);
                    let mut xs = xq.chunks_exact(4);
                    for (y, x) in (&mut quads).zip(&mut xs) {
                        let y: &mut [f32; 4] = y.try_into().expect("4");
                        *y = view.dot(r, [&x[0], &x[1], &x[2], &x[3]], kernel);
                    }
                    for (y, x) in quads.into_remainder().iter_mut().zip(xs.remainder()) {
                        [*y] = view.dot(r, [x], kernel);
                    }
                }
            });
        for (r, ys) in by_row.chunks_exact(batch).enumerate() {
            for (b, &y) in ys.iter().enumerate() {
                out[b * rows + r] = y;
            }
        }
    }
}

/// Matrices stacked along the rows (Q, K, V; gate, up), one product writing each part's rows
/// in turn. Adjacent parts in the same own format are merged into one matrix.
#[derive(Debug, Clone)]
pub(crate) struct RowStack(Vec<QMatrix>);

impl RowStack {
    pub(crate) fn new(parts: Vec<QMatrix>) -> Option<Self> {
        let cols = parts.first()?.cols();
        let mut out: Vec<QMatrix> = Vec::with_capacity(parts.len());
        for p in parts {
            if p.cols() != cols {
                return None;
            }
            match out.last_mut() {
                Some(last) => {
                    if let Some(p) = last.append(p) {
                        out.push(p);
                    }
                }
                None => out.push(p),
            }
        }
        Some(Self(out))
    }

    pub(crate) fn rows(&self) -> usize {
        self.0.iter().map(QMatrix::rows).sum()
    }

    pub(crate) fn bytes(&self) -> usize {
        self.0.iter().map(QMatrix::bytes).sum()
    }

    /// As [`QMatrix::matvec`], `out` of length [`RowStack::rows`].
    pub(crate) fn matvec(&self, x: &[f32], xq: &QVec, out: &mut [f32]) -> candle_core::Result<()> {
        assert_eq!(out.len(), self.rows(), "output length");
        let mut rest = out;
        for m in &self.0 {
            let (o, r) = rest.split_at_mut(m.rows());
            m.matvec(x, xq, o)?;
            rest = r;
        }
        Ok(())
    }

    /// As [`QMatrix::matmul_batch`], `out` `[batch, RowStack::rows]`: each part's product is
    /// written into its columns of every output row.
    pub(crate) fn matmul_batch(
        &self,
        x: &[f32],
        xq: &[QVec],
        out: &mut [f32],
    ) -> candle_core::Result<()> {
        let (rows, batch) = (self.rows(), xq.len());
        assert_eq!(out.len(), batch * rows, "output length");
        if let [m] = self.0.as_slice() {
            return m.matmul_batch(x, xq, out);
        }
        let mut off = 0;
        let mut part = Vec::new();
        for m in &self.0 {
            let pr = m.rows();
            part.resize(batch * pr, 0.0);
            m.matmul_batch(x, xq, &mut part)?;
            for (o, p) in out.chunks_exact_mut(rows).zip(part.chunks_exact(pr)) {
                o[off..off + pr].copy_from_slice(p);
            }
            off += pr;
        }
        Ok(())
    }
}

/// An activation vector quantized to 8 bits per block of 32 (llama.cpp's Q8_1), and, when its
/// length is a multiple of 256, also per block of 256 (Q8_K, for the k-quant weights). Quantized
/// once per layer input and reused by every matrix that multiplies it (Q, K, V; gate, up).
#[derive(Debug, Clone, Default)]
pub(crate) struct QVec {
    qs: Vec<i8>,
    /// Per block scale `d = max|x| / 127`.
    d: Vec<f32>,
    /// Per block `d * sum(q)`.
    s: Vec<f32>,
    /// The Q8_K copy; empty when the length is not a multiple of 256.
    k: Q8K,
}

/// An activation in Q8_K blocks of 256 (structure of arrays).
#[derive(Debug, Clone, Default)]
pub(crate) struct Q8K {
    /// 256 values per block, in -128..=127.
    qs: Vec<i8>,
    /// Per block scale: `x ~= d * q`.
    d: Vec<f32>,
    /// Per block the 16 sums of 16 consecutive `q`.
    bsums: Vec<i16>,
}

impl Q8K {
    /// ggml's `quantize_row_q8_K` rule, as candle writes it: `d = max / -128` where `max` is the
    /// value of largest magnitude (the first one on ties), `q = min(round(x / d), 127)` (half
    /// away from zero); an all-zero block gets `d = 0`, `q = 0`.
    fn quantize(&mut self, x: &[f32]) {
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
    pub(crate) fn len(&self) -> usize {
        self.qs.len()
    }

    /// Quantizes `x` (length a multiple of 32), reusing the buffers.
    pub(crate) fn quantize(&mut self, x: &[f32]) {
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
fn quantize_block(src: &[f32], dst: &mut [i8]) -> (f32, i32) {
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

/// Which dot-product kernels run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 (F/BW/VNNI) for the k-quant rows; the Q4_1 and Q8_0 rows as [`Kernel::Avx2`].
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Kernel {
    /// The kernel of the workspace's one CPU path (`mosaickv_optimized::Path::detect`, which
    /// `MOSAICKV_FORCE_PORTABLE` and `MOSAICKV_FORCE_AVX2` reach): portable, AVX2, or AVX-512
    /// where the CPU also has VNNI (these kernels' `vpdpbusd`). Decided once per process.
    pub(crate) fn detect() -> Self {
        static DETECTED: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| match mosaickv_optimized::Path::detect() {
            #[cfg(target_arch = "x86_64")]
            mosaickv_optimized::Path::Avx512 if is_x86_feature_detected!("avx512vnni") => {
                Self::Avx512
            }
            #[cfg(target_arch = "x86_64")]
            mosaickv_optimized::Path::Avx2 | mosaickv_optimized::Path::Avx512 => Self::Avx2,
            _ => Self::Portable,
        })
    }

    /// The kernel's name, as `cpu_paths` names the paths.
    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => "avx512 (vnni)",
        }
    }

    /// Every kernel this CPU runs, slowest first (for the tests and the timing).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Self> {
        let mut k = vec![Self::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            match Self::detect() {
                Self::Avx512 => k.extend([Self::Avx2, Self::Avx512]),
                Self::Avx2 => k.push(Self::Avx2),
                Self::Portable => {}
            }
        }
        k
    }

    #[inline]
    fn dot_q4_1(self, qs: &[u8], dm: &[[f32; 2]], x: &QVec) -> f32 {
        match self {
            Self::Portable => dot_q4_1_portable(qs, dm, x),
            // SAFETY: `Avx2` and `Avx512` are only constructed by `detect` (or `available`)
            // after checking avx2 and fma; slice lengths are checked inside.
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 | Self::Avx512 => unsafe { avx2::dot_q4_1(qs, dm, x) },
        }
    }

    #[inline]
    fn dot_q8_0(self, qs: &[i8], d: &[f32], x: &QVec) -> f32 {
        match self {
            Self::Portable => dot_q8_0_portable(qs, d, x),
            // SAFETY: as in `dot_q4_1`.
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 | Self::Avx512 => unsafe { avx2::dot_q8_0(qs, d, x) },
        }
    }

    /// A k-quant row dotted with `N` activations at once (the weight unpacked once for all).
    #[inline]
    fn dot_k<const N: usize>(self, format: KFormat, row: &[u8], xs: [&Q8K; N]) -> [f32; N] {
        match (self, format) {
            (Self::Portable, KFormat::Q4K) => xs.map(|x| dot_q4_k_portable(row, x)),
            (Self::Portable, KFormat::Q6K) => xs.map(|x| dot_q6_k_portable(row, x)),
            // SAFETY: as in `dot_q4_1`.
            #[cfg(target_arch = "x86_64")]
            (Self::Avx2, KFormat::Q4K) => unsafe { avx2::dot_q4_k(row, xs) },
            // SAFETY: as in `dot_q4_1`.
            #[cfg(target_arch = "x86_64")]
            (Self::Avx2, KFormat::Q6K) => unsafe { avx2::dot_q6_k(row, xs) },
            // SAFETY: `Avx512` is only constructed after checking avx512f, avx512bw and
            // avx512vnni; slice lengths are checked inside.
            #[cfg(target_arch = "x86_64")]
            (Self::Avx512, KFormat::Q4K) => unsafe { avx512::dot_q4_k(row, xs) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            (Self::Avx512, KFormat::Q6K) => unsafe { avx512::dot_q6_k(row, xs) },
        }
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The 8 scales and 8 mins of a Q4_K block from its 12 packed bytes: 6 bits each; the first
/// four of each in the low 6 bits of bytes 0..4 (scales) and 4..8 (mins), the last four in the
/// nibbles of bytes 8..12 with their top 2 bits in the top bits of bytes 0..8.
fn q4_k_scales(sc: &[u8]) -> ([u8; 8], [u8; 8]) {
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
fn check_k_activations(nb: usize, xs: &[&Q8K]) {
    for x in xs {
        assert!(x.qs.len() == nb * QK_K && x.d.len() == nb && x.bsums.len() == nb * 16);
    }
}

/// [`q4_k_scales`] with word operations (ggml's `kmask` form): the 12 bytes as three
/// little-endian u32, returned as four u32 whose 16 bytes are the 8 scales then the 8 mins.
#[inline(always)]
fn q4_k_scales_words(sc: &[u8]) -> [u32; 4] {
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{QVec, Q4_K_BYTES, Q6_K_BYTES, Q8K, QK, QK_K};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Q4_1 row x Q8_1 activation. Safety: the CPU has avx2 and fma.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_q4_1(qs: &[u8], dm: &[[f32; 2]], x: &QVec) -> f32 {
        let nb = dm.len();
        assert!(qs.len() == nb * 16 && x.qs.len() == nb * QK && x.d.len() == nb && x.s.len() == nb);
        let mask = _mm_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut macc = 0f32;
        let (qp, xp) = (qs.as_ptr(), x.qs.as_ptr());
        let mut b = 0;
        // SAFETY (all loads): b < nb, and the asserts above bound every offset by the lengths.
        while b + 1 < nb {
            let p0 = _mm_loadu_si128(qp.add(b * 16) as *const __m128i);
            let p1 = _mm_loadu_si128(qp.add(b * 16 + 16) as *const __m128i);
            let w0 = _mm256_set_m128i(
                _mm_and_si128(_mm_srli_epi16(p0, 4), mask),
                _mm_and_si128(p0, mask),
            );
            let w1 = _mm256_set_m128i(
                _mm_and_si128(_mm_srli_epi16(p1, 4), mask),
                _mm_and_si128(p1, mask),
            );
            let x0 = _mm256_loadu_si256(xp.add(b * QK) as *const __m256i);
            let x1 = _mm256_loadu_si256(xp.add(b * QK + QK) as *const __m256i);
            // u8 (0..15) x i8 (-127..127) pairs: |sum| <= 2 * 15 * 127, no i16 saturation
            let s0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), ones));
            let s1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w1, x1), ones));
            let ([d0, m0], [d1, m1]) = (*dm.get_unchecked(b), *dm.get_unchecked(b + 1));
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0 * *x.d.get_unchecked(b)), s0, acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d1 * *x.d.get_unchecked(b + 1)), s1, acc1);
            macc += m0 * *x.s.get_unchecked(b) + m1 * *x.s.get_unchecked(b + 1);
            b += 2;
        }
        if b < nb {
            let p0 = _mm_loadu_si128(qp.add(b * 16) as *const __m128i);
            let w0 = _mm256_set_m128i(
                _mm_and_si128(_mm_srli_epi16(p0, 4), mask),
                _mm_and_si128(p0, mask),
            );
            let x0 = _mm256_loadu_si256(xp.add(b * QK) as *const __m256i);
            let s0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), ones));
            let [d0, m0] = dm[b];
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0 * x.d[b]), s0, acc0);
            macc += m0 * x.s[b];
        }
        hsum(_mm256_add_ps(acc0, acc1)) + macc
    }

    /// Q8_0 row x Q8 activation. Safety: the CPU has avx2 and fma.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_q8_0(qs: &[i8], d: &[f32], x: &QVec) -> f32 {
        let nb = d.len();
        assert!(qs.len() == nb * QK && x.qs.len() == nb * QK && x.d.len() == nb);
        let ones = _mm256_set1_epi16(1);
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let (qp, xp) = (qs.as_ptr(), x.qs.as_ptr());
        // sign trick: |w| (unsigned) x sign(w) * x (signed); activations are in -127..=127, so
        // sign(w) * x never overflows, and |w| = 128 for w = -128 reads correctly as unsigned
        let mut b = 0;
        // SAFETY (all loads): b < nb, and the asserts above bound every offset by the lengths.
        while b < nb {
            let w = _mm256_loadu_si256(qp.add(b * QK) as *const __m256i);
            let v = _mm256_loadu_si256(xp.add(b * QK) as *const __m256i);
            let s = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(v, w));
            let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
            let sc = _mm256_set1_ps(*d.get_unchecked(b) * *x.d.get_unchecked(b));
            if b % 2 == 0 {
                acc0 = _mm256_fmadd_ps(sc, s, acc0);
            } else {
                acc1 = _mm256_fmadd_ps(sc, s, acc1);
            }
            b += 1;
        }
        hsum(_mm256_add_ps(acc0, acc1))
    }

    /// Q4_K row x `N` Q8_K activations (the layout of `dot_q4_k_portable`). Per block: the
    /// nibbles of each 32 bytes, unpacked once, against the 64 bytes of each activation they
    /// multiply, `maddubs` (u8 0..15 x i8: pair sums within i16), `madd` by the sub-block scale
    /// into i32, then one float multiply-add per block; the mins term is a scalar sum over the 8
    /// sub-blocks. Each activation's result goes through the same operations in the same order
    /// whatever `N`, so it is the same bit for bit.
    /// Safety: the CPU has avx2 and fma.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_q4_k<const N: usize>(row: &[u8], xs: [&Q8K; N]) -> [f32; N] {
        let nb = row.len() / Q4_K_BYTES;
        assert_eq!(row.len(), nb * Q4_K_BYTES);
        super::check_k_activations(nb, &xs);
        let mask = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut mins = [0f32; N];
        for b in 0..nb {
            let blk = &row[b * Q4_K_BYTES..(b + 1) * Q4_K_BYTES];
            let (d, dmin) = (super::f16_at(blk, 0), super::f16_at(blk, 2));
            let (s, m) = super::q4_k_scales(&blk[4..16]);
            let mut isum = [_mm256_setzero_si256(); N];
            let qp = blk.as_ptr().add(16);
            // SAFETY (loads): 4 x 32 bytes of the block's 128 nibble bytes; 8 x 32 activation
            // bytes of block b, inside the asserted lengths
            for j in 0..4 {
                let w = _mm256_loadu_si256(qp.add(32 * j) as *const __m256i);
                let lo = _mm256_and_si256(w, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
                let (s0, s1) = (
                    _mm256_set1_epi16(s[2 * j] as i16),
                    _mm256_set1_epi16(s[2 * j + 1] as i16),
                );
                for (x, isum) in xs.iter().zip(isum.iter_mut()) {
                    let xp = x.qs.as_ptr().add(b * QK_K + 64 * j);
                    let x0 = _mm256_loadu_si256(xp as *const __m256i);
                    let x1 = _mm256_loadu_si256(xp.add(32) as *const __m256i);
                    let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), s0);
                    let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), s1);
                    *isum = _mm256_add_epi32(*isum, _mm256_add_epi32(p0, p1));
                }
            }
            for i in 0..N {
                let x = xs[i];
                let bs = &x.bsums[b * 16..(b + 1) * 16];
                let msum: i32 = (0..8)
                    .map(|j| m[j] as i32 * (bs[2 * j] as i32 + bs[2 * j + 1] as i32))
                    .sum();
                let dx = x.d[b];
                mins[i] += dx * dmin * msum as f32;
                acc[i] =
                    _mm256_fmadd_ps(_mm256_set1_ps(dx * d), _mm256_cvtepi32_ps(isum[i]), acc[i]);
            }
        }
        std::array::from_fn(|i| hsum(acc[i]) - mins[i])
    }

    /// Q6_K row x `N` Q8_K activations (the layout of `dot_q6_k_portable`). Per half block:
    /// the 6-bit values of four groups of 32 assembled once from `ql` and `qh` by shifts and
    /// masks (no bit crosses a byte after the mask), `maddubs` against each activation (u8 0..63
    /// x i8), `madd` by the two sub-block scales of the group into i32. The `-32` offset is
    /// taken out with the activation's block sums. The same bit for bit whatever `N`.
    /// Safety: the CPU has avx2 and fma.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_q6_k<const N: usize>(row: &[u8], xs: [&Q8K; N]) -> [f32; N] {
        let nb = row.len() / Q6_K_BYTES;
        assert_eq!(row.len(), nb * Q6_K_BYTES);
        super::check_k_activations(nb, &xs);
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..nb {
            let blk = &row[b * Q6_K_BYTES..(b + 1) * Q6_K_BYTES];
            let d = super::f16_at(blk, 208);
            let sc = &blk[192..208];
            let mut isum = [_mm256_setzero_si256(); N];
            // SAFETY (loads): ql bytes 0..128, qh bytes 128..192 of the block; 8 x 32
            // activation bytes of block b, inside the asserted lengths
            for h in 0..2 {
                let lp = blk.as_ptr().add(64 * h);
                let ql0 = _mm256_loadu_si256(lp as *const __m256i);
                let ql1 = _mm256_loadu_si256(lp.add(32) as *const __m256i);
                let qh = _mm256_loadu_si256(blk.as_ptr().add(128 + 32 * h) as *const __m256i);
                let groups = [
                    _mm256_or_si256(
                        _mm256_and_si256(ql0, m4),
                        _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(ql1, m4),
                        _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                        _mm256_and_si256(qh, m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                        _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
                    ),
                ];
                for (k, q) in groups.into_iter().enumerate() {
                    let s = 8 * h + 2 * k;
                    // low 128 bits: sub-block s, high: s + 1
                    let scale = _mm256_set_m128i(
                        _mm_set1_epi16(sc[s + 1] as i8 as i16),
                        _mm_set1_epi16(sc[s] as i8 as i16),
                    );
                    for (x, isum) in xs.iter().zip(isum.iter_mut()) {
                        let xp = x.qs.as_ptr().add(b * QK_K + 128 * h + 32 * k);
                        let v = _mm256_loadu_si256(xp as *const __m256i);
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, v), scale);
                        *isum = _mm256_add_epi32(*isum, p);
                    }
                }
            }
            for i in 0..N {
                let x = xs[i];
                let bs = &x.bsums[b * 16..(b + 1) * 16];
                let offset: i32 = (0..16).map(|s| sc[s] as i8 as i32 * bs[s] as i32).sum();
                let isum =
                    _mm256_sub_epi32(isum[i], _mm256_setr_epi32(32 * offset, 0, 0, 0, 0, 0, 0, 0));
                acc[i] =
                    _mm256_fmadd_ps(_mm256_set1_ps(x.d[b] * d), _mm256_cvtepi32_ps(isum), acc[i]);
            }
        }
        std::array::from_fn(|i| hsum(acc[i]))
    }
}

/// The k-quant rows on AVX-512: the AVX2 kernels' arithmetic on 64 weights per instruction,
/// with VNNI's `dpwssd` (i16 pairs x i16 scales, summed into i32) fusing the scale
/// multiply-add that AVX2 does with `madd` + `add`.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Q4_K_BYTES, Q6_K_BYTES, Q8K, QK_K};
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
    /// Safety: the CPU has avx512f, avx512bw and avx512vnni.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
    pub(super) unsafe fn dot_q4_k<const N: usize>(row: &[u8], xs: [&Q8K; N]) -> [f32; N] {
        let nb = row.len() / Q4_K_BYTES;
        assert_eq!(row.len(), nb * Q4_K_BYTES);
        super::check_k_activations(nb, &xs);
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
            let (d, dmin) = (super::f16_at(blk, 0), super::f16_at(blk, 2));
            let [w0, w1, w2, w3] = super::q4_k_scales_words(&blk[4..16]);
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
                acc[i] =
                    _mm512_fmadd_ps(_mm512_set1_ps(dx * d), _mm512_cvtepi32_ps(isum[i]), acc[i]);
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
    /// Safety: the CPU has avx512f, avx512bw and avx512vnni.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
    pub(super) unsafe fn dot_q6_k<const N: usize>(row: &[u8], xs: [&Q8K; N]) -> [f32; N] {
        let nb = row.len() / Q6_K_BYTES;
        assert_eq!(row.len(), nb * Q6_K_BYTES);
        super::check_k_activations(nb, &xs);
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
            let d = super::f16_at(blk, 208);
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

    fn kernels() -> Vec<Kernel> {
        Kernel::available()
    }

    /// Random Q4_1 blocks in ggml byte layout.
    fn q4_1_bytes(rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
        let mut raw = Vec::new();
        for _ in 0..rows * cols / QK {
            raw.extend(f16::from_f32(0.01 + 0.02 * rng(seed).abs()).to_le_bytes());
            raw.extend(f16::from_f32(-0.1 * rng(seed).abs()).to_le_bytes());
            raw.extend((0..16).map(|_| ((rng(seed) + 1.0) * 127.9) as u8));
        }
        raw
    }

    fn dequant(m: &QMatrix) -> Vec<f32> {
        match m {
            QMatrix::Q4_1 { qs, dm, .. } => {
                let mut w = Vec::new();
                for (b, &[d, mn]) in dm.iter().enumerate() {
                    let q = &qs[b * 16..(b + 1) * 16];
                    w.extend(q.iter().map(|&v| d * (v & 15) as f32 + mn));
                    w.extend(q.iter().map(|&v| d * (v >> 4) as f32 + mn));
                }
                w
            }
            QMatrix::Q8_0 { qs, d, .. } => qs
                .iter()
                .enumerate()
                .map(|(i, &q)| d[i / QK] * q as f32)
                .collect(),
            QMatrix::KQuant { q, .. } | QMatrix::Ggml { q, .. } => q
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap(),
        }
    }

    /// Every kernel against the f64 product of the dequantized weights with the f32 activation:
    /// the only difference allowed is the 8-bit activation rounding (|err| <= d_x / 2 per element).
    fn check(m: &QMatrix, seed: &mut u64) {
        let (rows, cols) = (m.rows(), m.cols());
        let w = dequant(m);
        let x: Vec<f32> = (0..cols)
            .map(|i| rng(seed) * if i % 7 == 0 { 8.0 } else { 1.0 })
            .collect();
        let mut xq = QVec::default();
        xq.quantize(&x);
        for kernel in kernels() {
            let mut out = vec![0f32; rows];
            m.matvec_with(&xq, &mut out, kernel);
            for r in 0..rows {
                let row = &w[r * cols..(r + 1) * cols];
                let exact: f64 = row.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
                let bound: f64 = row
                    .iter()
                    .enumerate()
                    .map(|(c, &a)| a.abs() as f64 * xq.d[c / QK] as f64 * 0.5)
                    .sum::<f64>()
                    * 1.01
                    + 1e-4;
                assert!(
                    (out[r] as f64 - exact).abs() <= bound,
                    "{kernel:?} row {r}: {} vs {exact} (bound {bound})",
                    out[r]
                );
            }
        }
    }

    #[test]
    fn q4_1_matvec_matches_dequantized_product() {
        let mut seed = 3;
        for (rows, cols) in [(1, 32), (5, 64), (37, 96), (130, 576), (600, 1536)] {
            let raw = q4_1_bytes(rows, cols, &mut seed);
            let m = QMatrix::from_q4_1_bytes(&raw, rows, cols).unwrap();
            check(&m, &mut seed);
        }
    }

    #[test]
    fn q8_0_matvec_matches_dequantized_product() {
        let mut seed = 5;
        for (rows, cols) in [(1, 32), (3, 64), (37, 96), (700, 576)] {
            let mut w: Vec<f32> = (0..rows * cols).map(|_| rng(&mut seed)).collect();
            w[0] = -1.5; // a block whose extreme is negative (q = -127)
            let m = QMatrix::q8_0_from_f32(&w, rows, cols).unwrap();
            check(&m, &mut seed);
        }
    }

    #[test]
    fn kernels_agree_on_extreme_values() {
        // q = -128 in a weight (ggml never writes it, but the format allows it) and saturated
        // activations: the AVX2 sign trick must still give the exact integer sum.
        let (rows, cols) = (2, 64);
        let mut raw = Vec::new();
        for b in 0..rows * cols / QK {
            raw.extend(f16::from_f32(0.5).to_le_bytes());
            raw.extend((0..QK).map(|j| if (j + b) % 3 == 0 { 0x80u8 } else { 0x7F }));
        }
        let m = QMatrix::from_q8_0_bytes(&raw, rows, cols).unwrap();
        let x: Vec<f32> = (0..cols)
            .map(|j| if j % 2 == 0 { 1.0 } else { -1.0 })
            .collect();
        let mut xq = QVec::default();
        xq.quantize(&x);
        let mut want = vec![0f32; rows];
        m.matvec_with(&xq, &mut want, Kernel::Portable);
        let w = dequant(&m);
        for r in 0..rows {
            let exact: f32 = w[r * cols..(r + 1) * cols]
                .iter()
                .zip(&x)
                .map(|(a, b)| a * b)
                .sum();
            assert!(
                (want[r] - exact).abs() < 1e-3,
                "portable row {r}: {} vs {exact}",
                want[r]
            );
        }
        let mut got = vec![0f32; rows];
        m.matvec_with(&xq, &mut got, Kernel::detect());
        for r in 0..rows {
            assert!(
                (got[r] - want[r]).abs() <= 1e-5 * want[r].abs().max(1.0),
                "row {r}: {} vs {}",
                got[r],
                want[r]
            );
        }
    }

    /// Q5_0 blocks become Q8_0 blocks holding exactly the same weights: every weight equals
    /// candle's dequantization of the Q5_0 tensor (an implementation independent of ours), and
    /// crafted blocks with every 5-bit code and fifth bit reach every int8 value in [-16, 15].
    #[test]
    fn q5_0_converts_to_q8_0_exactly() {
        use candle_core::quantized::GgmlDType;
        let mut seed = 11u64;
        let (rows, cols) = (3, 128);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng(&mut seed)).collect();
        let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, GgmlDType::Q5_0).unwrap();
        let theirs: Vec<f32> = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let m = QMatrix::from_q5_0_bytes(&q.data().unwrap(), rows, cols).unwrap();
        assert!(matches!(m, QMatrix::Q8_0 { .. }));
        assert_eq!(dequant(&m), theirs);
        // every code: value j of the block is q_j - 16 with q_j = (j + 7 b) mod 32
        let mut raw = Vec::new();
        for b in 0..2usize {
            raw.extend(f16::from_f32(1.0).to_le_bytes());
            let code = |j: usize| ((j + 7 * b) % 32) as u8;
            let qh: u32 = (0..QK).map(|j| u32::from(code(j) >> 4) << j).sum();
            raw.extend(qh.to_le_bytes());
            raw.extend((0..16).map(|j| (code(j) & 0x0f) | ((code(j + 16) & 0x0f) << 4)));
        }
        let m = QMatrix::from_q5_0_bytes(&raw, 1, 64).unwrap();
        let want: Vec<f32> = (0..2usize)
            .flat_map(|b| (0..QK).map(move |j| ((j + 7 * b) % 32) as f32 - 16.0))
            .collect();
        assert_eq!(dequant(&m), want);
        assert!(QMatrix::from_q5_0_bytes(&raw[..43], 1, 64).is_none());
    }

    /// A k-quant matrix ([rows, cols], cols a multiple of 256) from random weights.
    fn kquant(
        rows: usize,
        cols: usize,
        dtype: candle_core::quantized::GgmlDType,
        seed: &mut u64,
    ) -> QMatrix {
        let w: Vec<f32> = (0..rows * cols).map(|_| rng(seed) * 0.1).collect();
        let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
        QMatrix::ggml(Arc::new(QTensor::quantize(&t, dtype).unwrap())).unwrap()
    }

    /// Q4_K and Q6_K, every kernel, against the f64 product of their dequantized weights
    /// (candle's dequantization, an implementation independent of ours): the activation is
    /// rounded to 8 bits per block of 256 (Q8_K), so each element is off by at most max|x| over
    /// its block / 128 / 2 (and 1/127 where 127 caps the rounding). Also against candle's own
    /// product (`QMatMul`: its Q8_K rounding and its `vec_dot`), which must agree to float
    /// rounding, since both round the activation the same way.
    #[test]
    fn kquant_matvec_matches_dequantized_product() {
        use candle_core::quantized::GgmlDType;
        let mut seed = 11;
        for dtype in [GgmlDType::Q4K, GgmlDType::Q6K] {
            for (rows, cols) in [(1, 256), (37, 512), (300, 1536)] {
                let m = kquant(rows, cols, dtype, &mut seed);
                assert!(
                    matches!(m, QMatrix::KQuant { .. }),
                    "{dtype:?}: own kernels"
                );
                assert_eq!((m.rows(), m.cols()), (rows, cols));
                let w = dequant(&m);
                let mut x: Vec<f32> = (0..cols)
                    .map(|i| rng(&mut seed) * if i % 7 == 0 { 8.0 } else { 1.0 })
                    .collect();
                x[3] = -20.0; // a block whose extreme is negative (q = 127 after the sign flip)
                let mut xq = QVec::default();
                xq.quantize(&x);
                let QMatrix::KQuant { q, .. } = &m else {
                    unreachable!()
                };
                let candle = QMatMul::from_arc(q.clone())
                    .unwrap()
                    .forward(&Tensor::from_slice(&x, (1, cols), &Device::Cpu).unwrap())
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                for kernel in kernels() {
                    let mut out = vec![0f32; rows];
                    m.matvec_with(&xq, &mut out, kernel);
                    for r in 0..rows {
                        let row = &w[r * cols..(r + 1) * cols];
                        let exact: f64 =
                            row.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let bound: f64 = row
                            .iter()
                            .enumerate()
                            .map(|(c, &a)| {
                                let blk = &x[c / 256 * 256..(c / 256 + 1) * 256];
                                let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                                a.abs() as f64 * amax as f64 / 127.0 * 0.5
                            })
                            .sum::<f64>()
                            * 1.01
                            + 1e-4;
                        assert!(
                            (out[r] as f64 - exact).abs() <= bound,
                            "{dtype:?} {kernel:?} row {r}: {} vs {exact} (bound {bound})",
                            out[r]
                        );
                        let scale: f32 = row.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
                        assert!(
                            (out[r] - candle[r]).abs() <= 1e-5 * scale + 1e-6,
                            "{dtype:?} {kernel:?} row {r}: {} vs candle {}",
                            out[r],
                            candle[r]
                        );
                    }
                }
            }
        }
    }

    /// Raw k-quant blocks at the edges of their ranges (every 4- and 6-bit value, the largest
    /// scales and mins, negative Q6_K scales) against activations that round to -128 and 127:
    /// the AVX2 and AVX-512 kernels give the portable kernels' integer sums (no i16 saturation, no bit
    /// taken from the wrong byte), and the portable ones the dequantized product.
    #[test]
    fn kquant_kernels_agree_on_extreme_blocks() {
        use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType};
        let mut seed = 21u64;
        let (rows, cols) = (6, 512);
        for (dtype, bytes) in [(GgmlDType::Q4K, Q4_K_BYTES), (GgmlDType::Q6K, Q6_K_BYTES)] {
            let mut raw = Vec::new();
            for b in 0..rows * cols / QK_K {
                let mut blk: Vec<u8> = (0..bytes)
                    .map(|i| match b % 3 {
                        0 => 0xFF,
                        1 => (i * 37 + b) as u8,
                        _ => ((rng(&mut seed) + 1.0) * 127.9) as u8,
                    })
                    .collect();
                // finite f16 scales: 0.01 and 0.02 (Q4_K: d, dmin; Q6_K: d)
                let (d, at) = (
                    f16::from_f32(0.01).to_le_bytes(),
                    if bytes == Q4_K_BYTES { 0 } else { 208 },
                );
                blk[at..at + 2].copy_from_slice(&d);
                if bytes == Q4_K_BYTES {
                    blk[2..4].copy_from_slice(&f16::from_f32(0.02).to_le_bytes());
                }
                raw.extend(blk);
            }
            let q = qtensor_from_ggml(dtype, &raw, vec![rows, cols], &Device::Cpu).unwrap();
            let m = QMatrix::ggml(Arc::new(q)).unwrap();
            let w = dequant(&m);
            // +-1 everywhere: the first value of each block sets d, so -128 or +127 appear
            let x: Vec<f32> = (0..cols)
                .map(|j| if (j / 3) % 2 == 0 { 1.0 } else { -1.0 })
                .collect();
            let mut xq = QVec::default();
            xq.quantize(&x);
            assert!(xq.k.qs.contains(&-128) || xq.k.qs.contains(&127));
            // the activation as the kernels see it: d * q per Q8_K block
            let xd: Vec<f64> = (0..cols)
                .map(|i| xq.k.d[i / QK_K] as f64 * xq.k.qs[i] as f64)
                .collect();
            let mut want = vec![0f32; rows];
            m.matvec_with(&xq, &mut want, Kernel::Portable);
            for r in 0..rows {
                let exact: f64 = w[r * cols..(r + 1) * cols]
                    .iter()
                    .zip(&xd)
                    .map(|(&a, &b)| a as f64 * b)
                    .sum();
                assert!(
                    (want[r] as f64 - exact).abs() <= 1e-4 * exact.abs().max(1.0),
                    "{dtype:?} portable row {r}: {} vs {exact}",
                    want[r]
                );
            }
            for kernel in kernels() {
                let mut got = vec![0f32; rows];
                m.matvec_with(&xq, &mut got, kernel);
                for r in 0..rows {
                    assert!(
                        (got[r] - want[r]).abs() <= 1e-5 * want[r].abs().max(1.0),
                        "{dtype:?} {kernel:?} row {r}: {} vs {}",
                        got[r],
                        want[r]
                    );
                }
            }
        }
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

    /// Every row of the batched product equals the single-vector product bit for bit (the batch
    /// decode's equality with single decode rests on it), for Q4_1, Q8_0, the k-quants through
    /// candle's QMatMul and a mixed [`RowStack`], and awkward batches.
    #[test]
    fn matmul_batch_equals_matvec_per_row() {
        use candle_core::quantized::GgmlDType;
        let mut seed = 77u64;
        let (rows, cols) = (37, 512);
        let q41 = QMatrix::from_q4_1_bytes(&q4_1_bytes(rows, cols, &mut seed), rows, cols).unwrap();
        let w: Vec<f32> = (0..rows * cols).map(|_| rng(&mut seed)).collect();
        let q80 = QMatrix::q8_0_from_f32(&w, rows, cols).unwrap();
        let q4k = kquant(rows, cols, GgmlDType::Q4K, &mut seed);
        let q6k = kquant(rows, cols, GgmlDType::Q6K, &mut seed);
        let stack = RowStack::new(vec![q41.clone(), q6k.clone(), q80.clone()]).unwrap();
        let singles: Vec<RowStack> = [&q41, &q80, &q4k, &q6k]
            .into_iter()
            .map(|m| RowStack::new(vec![m.clone()]).unwrap())
            .collect();
        for m in singles.iter().chain([&stack]) {
            let rows = m.rows();
            for batch in [1usize, 2, 5] {
                let x: Vec<f32> = (0..batch * cols).map(|_| 3.0 * rng(&mut seed)).collect();
                let xs: Vec<QVec> = x
                    .chunks_exact(cols)
                    .map(|x| {
                        let mut q = QVec::default();
                        q.quantize(x);
                        q
                    })
                    .collect();
                let mut out = vec![0f32; batch * rows];
                m.matmul_batch(&x, &xs, &mut out).unwrap();
                for (b, xq) in xs.iter().enumerate() {
                    let mut one = vec![0f32; rows];
                    m.matvec(&x[b * cols..(b + 1) * cols], xq, &mut one)
                        .unwrap();
                    let got = &out[b * rows..(b + 1) * rows];
                    assert!(
                        got.iter()
                            .zip(&one)
                            .all(|(a, c)| a.to_bits() == c.to_bits()),
                        "batch {batch}, row {b}"
                    );
                }
            }
        }
    }

    /// A stack of mixed formats writes each part's rows where the parts alone would.
    #[test]
    fn row_stack_concatenates_parts() {
        use candle_core::quantized::GgmlDType;
        let mut seed = 13;
        let cols = 512;
        let a = QMatrix::from_q4_1_bytes(&q4_1_bytes(5, cols, &mut seed), 5, cols).unwrap();
        let b = QMatrix::from_q4_1_bytes(&q4_1_bytes(3, cols, &mut seed), 3, cols).unwrap();
        let c = kquant(7, cols, GgmlDType::Q6K, &mut seed);
        let d = QMatrix::from_q4_1_bytes(&q4_1_bytes(2, cols, &mut seed), 2, cols).unwrap();
        let x: Vec<f32> = (0..cols).map(|_| rng(&mut seed)).collect();
        let mut xq = QVec::default();
        xq.quantize(&x);
        let mut want = Vec::new();
        for m in [&a, &b, &c, &d] {
            let mut o = vec![0f32; m.rows()];
            m.matvec(&x, &xq, &mut o).unwrap();
            want.extend(o);
        }
        let s = RowStack::new(vec![a.clone(), b.clone(), c.clone(), d.clone()]).unwrap();
        // a and b merge; c (another format) and d stay apart
        assert_eq!(s.0.len(), 3);
        assert_eq!(s.rows(), 17);
        assert_eq!(s.bytes(), a.bytes() + b.bytes() + c.bytes() + d.bytes());
        let mut got = vec![0f32; 17];
        s.matvec(&x, &xq, &mut got).unwrap();
        assert_eq!(got, want);
        let narrow = QMatrix::from_q4_1_bytes(&q4_1_bytes(1, 256, &mut seed), 1, 256).unwrap();
        assert!(RowStack::new(vec![a, narrow]).is_none());
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert!(QMatrix::from_q4_1_bytes(&[0; 20], 1, 31).is_none());
        assert!(QMatrix::from_q4_1_bytes(&[0; 19], 1, 32).is_none());
        assert!(QMatrix::from_q8_0_bytes(&[0; 33], 1, 32).is_none());
        assert!(QMatrix::q8_0_from_f32(&[0.0; 31], 1, 32).is_none());
        let a = QMatrix::q8_0_from_f32(&[0.0; 32], 1, 32).unwrap();
        let b = QMatrix::q8_0_from_f32(&[0.0; 64], 1, 64).unwrap();
        assert!(QMatrix::vstack(vec![a.clone(), b]).is_none());
        let s = QMatrix::vstack(vec![a.clone(), a]).unwrap();
        assert_eq!((s.rows(), s.cols()), (2, 32));
    }
}

#[cfg(test)]
mod timing {
    use super::*;

    /// `cargo test --release -p mosaickv-engine quant::timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn matvec_throughput() {
        let (rows, cols) = (3072, 576);
        let raw: Vec<u8> = (0..rows * cols / QK * 20)
            .map(|i| (i * 7919 % 251) as u8 & 0x3F)
            .collect();
        let m = QMatrix::from_q4_1_bytes(&raw, rows, cols).unwrap();
        let w: Vec<f32> = (0..49152 * 576)
            .map(|i| ((i * 31 % 97) as f32 - 48.0) / 50.0)
            .collect();
        let lm = QMatrix::q8_0_from_f32(&w, 49152, 576).unwrap();
        let x: Vec<f32> = (0..576).map(|i| (i as f32).sin()).collect();
        let mut xq = QVec::default();
        xq.quantize(&x);
        for (name, m) in [("q4_1 3072x576", &m), ("q8_0 49152x576", &lm)] {
            let mut out = vec![0f32; m.rows()];
            for kernel in [Kernel::Portable, Kernel::detect()] {
                let reps = 200;
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    m.matvec_with(&xq, &mut out, kernel);
                }
                let s = t.elapsed().as_secs_f64() / reps as f64;
                eprintln!(
                    "{name} {kernel:?}: {:.3} ms, {:.1} GB/s",
                    s * 1e3,
                    m.bytes() as f64 / s / 1e9
                );
            }
        }
    }
}

#[cfg(test)]
mod kquant_timing {
    use super::*;
    use candle_core::quantized::GgmlDType;

    /// Qwen2.5-1.5B's decode matrices: candle's `QMatMul` (its Q8_K rounding and `vec_dot`, as
    /// built here) against this crate's kernels, interleaved in one process.
    /// `cargo test --release -p mosaickv-engine quant::kquant_timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn kquant_matvec_throughput() {
        for (name, rows, cols, dtype) in [
            ("gate+up Q4_K 17920x1536", 17920, 1536, GgmlDType::Q4K),
            ("down Q6_K 1536x8960", 1536, 8960, GgmlDType::Q6K),
            ("down Q4_K 1536x8960", 1536, 8960, GgmlDType::Q4K),
            ("LM head rows Q6_K 32768x1536", 32768, 1536, GgmlDType::Q6K),
        ] {
            let w: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 31 % 97) as f32 - 48.0) / 500.0)
                .collect();
            let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
            let q = Arc::new(QTensor::quantize(&t, dtype).unwrap());
            let m = QMatrix::ggml(q.clone()).unwrap();
            let mm = QMatMul::from_arc(q).unwrap();
            let x: Vec<f32> = (0..cols).map(|i| (i as f32).sin()).collect();
            let xt = Tensor::from_slice(&x, (1, cols), &Device::Cpu).unwrap();
            let mut xq = QVec::default();
            let mut out = vec![0f32; rows];
            let reps = 20;
            let kernels = Kernel::available();
            let mut best = vec![f64::INFINITY; 1 + kernels.len()];
            for _ in 0..3 {
                let t0 = std::time::Instant::now();
                for _ in 0..reps {
                    let y = mm.forward(&xt).unwrap().flatten_all().unwrap();
                    std::hint::black_box(y.to_vec1::<f32>().unwrap());
                }
                best[0] = best[0].min(t0.elapsed().as_secs_f64() / reps as f64);
                for (i, &kernel) in kernels.iter().enumerate() {
                    let t0 = std::time::Instant::now();
                    for _ in 0..reps {
                        xq.quantize(&x);
                        m.matvec_with(&xq, &mut out, kernel);
                    }
                    best[i + 1] = best[i + 1].min(t0.elapsed().as_secs_f64() / reps as f64);
                }
            }
            // a prefill chunk of 64 tokens through the batched product
            let xb: Vec<f32> = (0..64 * cols).map(|i| (i as f32 * 0.37).sin()).collect();
            let xbq: Vec<QVec> = xb
                .chunks_exact(cols)
                .map(|x| {
                    let mut q = QVec::default();
                    q.quantize(x);
                    q
                })
                .collect();
            let mut ob = vec![0f32; 64 * rows];
            let t0 = std::time::Instant::now();
            m.matmul_batch(&xb, &xbq, &mut ob).unwrap();
            let batch_s = t0.elapsed().as_secs_f64();
            let wf = t.t().unwrap();
            let xbt = Tensor::from_slice(&xb, (64, cols), &Device::Cpu).unwrap();
            let t0 = std::time::Instant::now();
            std::hint::black_box(xbt.matmul(&wf).unwrap());
            let f32_s = t0.elapsed().as_secs_f64();
            let gmac = |s: f64| 64.0 * (rows * cols) as f64 / s / 1e9;
            eprintln!(
                "{name}: batch of 64 {:.1} ms, {:.1} GMAC/s; f32 GEMM (weights already f32) \
                 {:.1} ms, {:.1} GMAC/s",
                batch_s * 1e3,
                gmac(batch_s),
                f32_s * 1e3,
                gmac(f32_s)
            );
            let gb = |s: f64| m.bytes() as f64 / s / 1e9;
            let ours: Vec<String> = kernels
                .iter()
                .zip(&best[1..])
                .map(|(k, &t)| format!("{k:?} {:.2} ms ({:.1} GB/s)", t * 1e3, gb(t)))
                .collect();
            eprintln!(
                "{name} ({:.1} MB): candle QMatMul {:.2} ms ({:.1} GB/s); ours: {}; {} threads",
                m.bytes() as f64 / 1e6,
                best[0] * 1e3,
                gb(best[0]),
                ours.join(", "),
                rayon::current_num_threads()
            );
        }
    }
}
