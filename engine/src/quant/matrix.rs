//! The weight matrices of a decode step in their block formats, and the one dispatch of their
//! products ([`QMatrix::matmul_batch`]): output rows split over rayon, each row dotted with
//! every activation by the format's row kernel on the path [`super::path`] chose.

use super::formats::{KFormat, Q4_1_BYTES, Q5_0_BYTES, Q8_0_BYTES};
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use half::f16;
use mosaickv_optimized::simd::ggml::{quantize_block, QVec, QK, QK_K};
use mosaickv_optimized::Path;
use rayon::prelude::*;
use std::sync::Arc;

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
    fn dot<const N: usize>(&self, r: usize, xs: [&QVec; N], path: Path) -> [f32; N] {
        match *self {
            Self::Q4_1 { qs, dm, nb } => {
                let (q, s) = (
                    &qs[r * nb * 16..(r + 1) * nb * 16],
                    &dm[r * nb..(r + 1) * nb],
                );
                xs.map(|x| path.dot_q4_1(q, s, x))
            }
            Self::Q8_0 { qs, d, cols } => {
                let nb = cols / QK;
                let (q, s) = (&qs[r * cols..(r + 1) * cols], &d[r * nb..(r + 1) * nb]);
                xs.map(|x| path.dot_q8_0(q, s, x))
            }
            Self::KQuant {
                raw,
                format,
                row_bytes,
            } => {
                let row = &raw[r * row_bytes..(r + 1) * row_bytes];
                let xs = xs.map(|x| &x.k);
                match format {
                    KFormat::Q4K => path.dot_q4_k(row, xs),
                    KFormat::Q6K => path.dot_q6_k(row, xs),
                }
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

    /// [`QMatrix::matvec`] on a chosen path (tests compare the kernels). Panics on `Ggml`.
    #[cfg(test)]
    pub(crate) fn matvec_with(&self, x: &QVec, out: &mut [f32], path: Path) {
        let rows = self.row_view().unwrap().expect("a format with own kernels");
        self.product(&rows, std::slice::from_ref(x), out, path);
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
            Some(view) => self.product(&view, xq, out, super::path()),
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
    fn product(&self, view: &Rows<'_>, xq: &[QVec], out: &mut [f32], path: Path) {
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
                    [*y] = view.dot(ci * chunk + i, [x], path);
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
                        *y = view.dot(r, [&x[0], &x[1], &x[2], &x[3]], path);
                    }
                    for (y, x) in quads.into_remainder().iter_mut().zip(xs.remainder()) {
                        [*y] = view.dot(r, [x], path);
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
pub(crate) struct RowStack(pub(super) Vec<QMatrix>);

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
