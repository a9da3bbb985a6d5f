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
//! Weights in the other ggml block formats (Q4_K, Q6_K, ...) keep their blocks and go through
//! candle's quantized matmul (`QMatMul`: the activation quantized to the format's dot-product
//! type, Q8_K for the k-quants, then ggml's `vec_dot`, AVX2 where candle has it). Weights
//! stored as f32/f16 are quantized to Q8_0 at load. Rows are split over rayon.
//! The AVX2 kernels are chosen at run time; a portable scalar kernel is the fallback and the
//! oracle of the tests.

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use half::f16;
use rayon::prelude::*;
use std::sync::Arc;

/// Elements per block (all formats here).
pub(crate) const QK: usize = 32;

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
    /// Another ggml block format, multiplied by candle's `QMatMul` (see the module doc).
    Ggml {
        rows: usize,
        cols: usize,
        q: Arc<QTensor>,
        mm: QMatMul,
    },
}

/// Size of one ggml block in bytes.
const Q4_1_BYTES: usize = 20;
const Q8_0_BYTES: usize = 34;

impl QMatrix {
    pub(crate) fn rows(&self) -> usize {
        match self {
            Self::Q4_1 { rows, .. } | Self::Q8_0 { rows, .. } | Self::Ggml { rows, .. } => *rows,
        }
    }

    pub(crate) fn cols(&self) -> usize {
        match self {
            Self::Q4_1 { cols, .. } | Self::Q8_0 { cols, .. } | Self::Ggml { cols, .. } => *cols,
        }
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Self::Q4_1 { qs, dm, .. } => qs.len() + dm.len() * 8,
            Self::Q8_0 { qs, d, .. } => qs.len() + d.len() * 4,
            Self::Ggml { q, .. } => q.storage_size_in_bytes(),
        }
    }

    /// A 2-D block-quantized tensor `[rows, cols]` kept in its own blocks, for candle's
    /// `QMatMul`. `None` for f32/f16 tensors (not block formats) or another rank.
    pub(crate) fn ggml(q: Arc<QTensor>) -> Option<Self> {
        use candle_core::quantized::GgmlDType;
        if matches!(q.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) {
            return None;
        }
        let (rows, cols) = q.shape().dims2().ok()?;
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

    /// `out[r] = sum_c self[r, c] * x[c]`; `xq` is `x` as quantized by [`QVec::quantize`]
    /// (used by the Q4_1/Q8_0 kernels; `Ggml` quantizes `x` itself).
    /// Panics if the shapes differ (callers build both from the model's config).
    pub(crate) fn matvec(&self, x: &[f32], xq: &QVec, out: &mut [f32]) -> candle_core::Result<()> {
        if let Self::Ggml { cols, mm, .. } = self {
            assert_eq!(x.len(), *cols, "activation length");
            let y = mm
                .forward(&Tensor::from_slice(x, (1, *cols), &Device::Cpu)?)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            out.copy_from_slice(&y);
            return Ok(());
        }
        self.matvec_with(xq, out, Kernel::detect());
        Ok(())
    }

    /// The Q4_1/Q8_0 product with a chosen kernel. Panics on `Ggml` (see [`QMatrix::matvec`]).
    pub(crate) fn matvec_with(&self, x: &QVec, out: &mut [f32], kernel: Kernel) {
        let (rows, cols) = (self.rows(), self.cols());
        assert_eq!(x.len(), cols, "activation length");
        assert_eq!(out.len(), rows, "output length");
        let nb = cols / QK;
        // enough chunks to balance the threads, large enough to amortize the task overhead
        let chunk = (rows / (8 * rayon::current_num_threads().max(1))).clamp(16, 512);
        out.par_chunks_mut(chunk).enumerate().for_each(|(ci, o)| {
            let r0 = ci * chunk;
            for (i, y) in o.iter_mut().enumerate() {
                let r = r0 + i;
                *y = match self {
                    Self::Q4_1 { qs, dm, .. } => {
                        let (q, s) = (
                            &qs[r * nb * 16..(r + 1) * nb * 16],
                            &dm[r * nb..(r + 1) * nb],
                        );
                        kernel.dot_q4_1(q, s, x)
                    }
                    Self::Q8_0 { qs, d, .. } => {
                        let (q, s) = (&qs[r * cols..(r + 1) * cols], &d[r * nb..(r + 1) * nb]);
                        kernel.dot_q8_0(q, s, x)
                    }
                    Self::Ggml { .. } => unreachable!("Ggml matrices multiply in matvec"),
                };
            }
        });
    }

    /// The batched product of a decode step over many sequences (`[batch, cols]` times the
    /// transposed weight): `out[b * rows + r] = sum_c self[r, c] * x[b * cols + c]`; `xq[b]` is
    /// row `b` of `x` as quantized by [`QVec::quantize`]. For Q4_1/Q8_0 each weight row is read
    /// once for the whole batch (it stays in cache while every activation is dotted with it), so
    /// the weight bytes a step reads do not grow with the batch; every entry is the kernel call
    /// [`QMatrix::matvec`] makes. `Ggml` runs candle's QMatMul once on the `[batch, cols]`
    /// tensor (it quantizes each row on its own and runs the same `vec_dot` per row and weight
    /// row as for one row). So row `b` equals `matvec(x[b])` bit for bit in every format.
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
        assert!(xq.iter().all(|x| x.len() == cols), "activation length");
        assert_eq!(out.len(), batch * rows, "output length");
        if batch == 0 {
            return Ok(());
        }
        if let Self::Ggml { mm, .. } = self {
            let y = mm
                .forward(&Tensor::from_slice(x, (batch, cols), &Device::Cpu)?)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            out.copy_from_slice(&y);
            return Ok(());
        }
        let kernel = Kernel::detect();
        let nb = cols / QK;
        let chunk = (rows / (8 * rayon::current_num_threads().max(1))).clamp(16, 512);
        // [rows][batch] in parallel row chunks, then transposed into [batch][rows]
        let mut by_row = vec![0f32; rows * batch];
        by_row
            .par_chunks_mut(chunk * batch)
            .enumerate()
            .for_each(|(ci, o)| {
                let r0 = ci * chunk;
                for (i, ys) in o.chunks_exact_mut(batch).enumerate() {
                    let r = r0 + i;
                    for (y, x) in ys.iter_mut().zip(xq) {
                        *y = match self {
                            Self::Q4_1 { qs, dm, .. } => kernel.dot_q4_1(
                                &qs[r * nb * 16..(r + 1) * nb * 16],
                                &dm[r * nb..(r + 1) * nb],
                                x,
                            ),
                            Self::Q8_0 { qs, d, .. } => kernel.dot_q8_0(
                                &qs[r * cols..(r + 1) * cols],
                                &d[r * nb..(r + 1) * nb],
                                x,
                            ),
                            Self::Ggml { .. } => unreachable!("Ggml returned above"),
                        };
                    }
                }
            });
        for (r, ys) in by_row.chunks_exact(batch).enumerate() {
            for (b, &y) in ys.iter().enumerate() {
                out[b * rows + r] = y;
            }
        }
        Ok(())
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

/// An activation vector quantized to 8 bits per block of 32 (llama.cpp's Q8_1).
#[derive(Debug, Clone, Default)]
pub(crate) struct QVec {
    qs: Vec<i8>,
    /// Per block scale `d = max|x| / 127`.
    d: Vec<f32>,
    /// Per block `d * sum(q)`.
    s: Vec<f32>,
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
}

impl Kernel {
    /// The fastest kernel this CPU runs.
    pub(crate) fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Self::Avx2;
        }
        Self::Portable
    }

    #[inline]
    fn dot_q4_1(self, qs: &[u8], dm: &[[f32; 2]], x: &QVec) -> f32 {
        match self {
            Self::Portable => dot_q4_1_portable(qs, dm, x),
            // SAFETY: `Avx2` is only constructed by `detect` after checking avx2 and fma;
            // slice lengths are checked inside.
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => unsafe { avx2::dot_q4_1(qs, dm, x) },
        }
    }

    #[inline]
    fn dot_q8_0(self, qs: &[i8], d: &[f32], x: &QVec) -> f32 {
        match self {
            Self::Portable => dot_q8_0_portable(qs, d, x),
            // SAFETY: as in `dot_q4_1`.
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => unsafe { avx2::dot_q8_0(qs, d, x) },
        }
    }
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
    use super::{QVec, QK};
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
        let mut k = vec![Kernel::Portable];
        if Kernel::detect() != Kernel::Portable {
            k.push(Kernel::detect());
        }
        k
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
            QMatrix::Ggml { q, .. } => q
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

    /// Q4_K and Q6_K through candle's QMatMul against the f64 product of their dequantized
    /// weights: the activation is rounded to 8 bits per block of 256 (Q8_K), so each element is
    /// off by at most max|x| over its block / 127 / 2.
    #[test]
    fn kquant_matvec_matches_dequantized_product() {
        use candle_core::quantized::GgmlDType;
        let mut seed = 11;
        for dtype in [GgmlDType::Q4K, GgmlDType::Q6K] {
            for (rows, cols) in [(1, 256), (37, 512), (300, 1536)] {
                let m = kquant(rows, cols, dtype, &mut seed);
                assert_eq!((m.rows(), m.cols()), (rows, cols));
                let w = dequant(&m);
                let x: Vec<f32> = (0..cols)
                    .map(|i| rng(&mut seed) * if i % 7 == 0 { 8.0 } else { 1.0 })
                    .collect();
                let mut xq = QVec::default();
                xq.quantize(&x);
                let mut out = vec![0f32; rows];
                m.matvec(&x, &xq, &mut out).unwrap();
                for r in 0..rows {
                    let row = &w[r * cols..(r + 1) * cols];
                    let exact: f64 = row.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
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
                        "{dtype:?} row {r}: {} vs {exact} (bound {bound})",
                        out[r]
                    );
                }
            }
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
