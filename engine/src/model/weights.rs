//! Where the weights live: each matrix is kept in the GGUF's own blocks (for decode, see
//! `quant.rs`), and its f32 values, which prefill multiplies with, are either kept resident
//! (small models) or dequantized on each use (models whose f32 copy would not fit in memory
//! comfortably: Qwen2.5-1.5B's would take 7 GB, its blocks take 1.1 GB).

use crate::quant::KFormat;
use crate::Result;
use candle_core::quantized::{ggml_file::qtensor_from_ggml, QTensor};
use candle_core::{Device, Tensor};
use mosaickv_optimized::simd::amx::PackedBf16;
use rayon::prelude::*;
use std::sync::Arc;

/// A model keeps its f32 weights resident when they take at most this many bytes in all
/// (SmolLM2-135M: 0.54 GB, resident; Qwen2.5-1.5B: 7.1 GB, dequantized on use).
pub(super) const RESIDENT_F32_LIMIT: usize = 1 << 30;

/// Rows per dequantization task.
const DEQ_ROWS: usize = 64;

/// An f32 matrix for prefill, `[rows, cols]`, made of row-stacked parts (Q, K, V; gate, up).
pub(super) enum Dense {
    /// The f32 values, kept.
    Resident(Tensor),
    /// The parts' blocks, dequantized (rows split over rayon) each time the matrix is used.
    OnDemand(Vec<Arc<QTensor>>),
}

impl Dense {
    pub(super) fn new(parts: Vec<Arc<QTensor>>, resident: bool) -> Result<Self> {
        if !resident {
            return Ok(Self::OnDemand(parts));
        }
        let t = Self::OnDemand(parts).tensor()?;
        Ok(Self::Resident(t))
    }

    /// The matrix in f32, contiguous.
    pub(super) fn tensor(&self) -> Result<Tensor> {
        match self {
            Self::Resident(t) => Ok(t.clone()),
            Self::OnDemand(parts) => {
                let ts = parts
                    .iter()
                    .map(|q| dequantize_par(q))
                    .collect::<Result<Vec<_>>>()?;
                Ok(if ts.len() == 1 {
                    ts.into_iter().next().expect("one part")
                } else {
                    Tensor::cat(&ts, 0)?.contiguous()?
                })
            }
        }
    }

    /// The matrix as bf16 AMX tiles (`simd::amx`, prefill past `AMX_PREFILL_TOKENS`): a
    /// resident one packed from its f32 values; an on-demand one dequantized 16 rows at a
    /// time straight into the tiles (no f32 copy of the whole matrix), through
    /// [`Dense::tensor`] when a part's rows are not whole blocks.
    pub(super) fn pack_bf16(&self) -> Result<PackedBf16> {
        let parts = match self {
            Self::Resident(t) => {
                let (n, k) = t.dims2()?;
                return super::with_f32(t, |w| PackedBf16::new(w, n, k));
            }
            Self::OnDemand(parts) => parts,
        };
        let specs: Option<Vec<_>> = parts.iter().map(|q| row_bytes(q)).collect();
        let k = specs.as_ref().and_then(|s| s.first()).map_or(0, |s| s.1);
        let Some(specs) = specs.filter(|s| s.iter().all(|p| p.1 == k)) else {
            let t = self.tensor()?;
            let (n, k) = t.dims2()?;
            return super::with_f32(&t, |w| PackedBf16::new(w, n, k));
        };
        let raws = parts
            .iter()
            .map(|q| q.data())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let n = specs.iter().map(|s| s.0).sum();
        let dev = Device::Cpu;
        PackedBf16::from_rows(n, k, |j0, out: &mut [f32]| -> Result<()> {
            // the rows j0.. of the stacked parts, part by part
            let (mut j, mut done, mut first) = (j0, 0, 0);
            for (p, &(rows, _, rb)) in specs.iter().enumerate() {
                if j >= first + rows {
                    first += rows;
                    continue;
                }
                let count = (out.len() / k - done).min(first + rows - j);
                let raw = &raws[p][(j - first) * rb..(j - first + count) * rb];
                let o = &mut out[done * k..(done + count) * k];
                if let Some(format) = KFormat::of(parts[p].dtype()) {
                    format.dequantize(raw, o);
                } else {
                    let t = qtensor_from_ggml(parts[p].dtype(), raw, vec![count, k], &dev)?
                        .dequantize(&dev)?;
                    super::with_f32(&t, |v| o.copy_from_slice(v))?;
                }
                done += count;
                j += count;
                first += rows;
                if done * k == out.len() {
                    break;
                }
            }
            Ok(())
        })
    }

    pub(super) fn is_resident(&self) -> bool {
        matches!(self, Self::Resident(_))
    }

    pub(super) fn elem_count(&self) -> usize {
        match self {
            Self::Resident(t) => t.elem_count(),
            Self::OnDemand(parts) => parts.iter().map(|q| q.shape().elem_count()).sum(),
        }
    }
}

/// Bytes of one row of a 2-D block tensor, when its rows are whole blocks.
fn row_bytes(q: &QTensor) -> Option<(usize, usize, usize)> {
    let (rows, cols) = q.shape().dims2().ok()?;
    let (bs, ts) = (q.dtype().block_size(), q.dtype().type_size());
    (cols % bs == 0).then_some((rows, cols, cols / bs * ts))
}

/// Dequantizes a 2-D block tensor to f32, `DEQ_ROWS` rows per rayon task (candle's own
/// `dequantize` runs on one thread): Q4_K/Q6_K by [`KFormat::dequantize`] straight into the
/// output, other formats through candle per task.
pub(super) fn dequantize_par(q: &QTensor) -> Result<Tensor> {
    let dev = Device::Cpu;
    let Some((rows, cols, rb)) = row_bytes(q) else {
        return Ok(q.dequantize(&dev)?);
    };
    let raw = q.data()?;
    let mut out = vec![0f32; rows * cols];
    if let Some(format) = KFormat::of(q.dtype()) {
        // Q4_K/Q6_K: straight into `out` (candle's path copies each task's bytes into a new
        // tensor and its values out of one)
        out.par_chunks_mut(DEQ_ROWS * cols)
            .zip(raw.par_chunks(DEQ_ROWS * rb))
            .for_each(|(o, r)| format.dequantize(r, o));
        return Ok(Tensor::from_vec(out, (rows, cols), &dev)?);
    }
    out.par_chunks_mut(DEQ_ROWS * cols)
        .zip(raw.par_chunks(DEQ_ROWS * rb))
        .try_for_each(|(o, r)| -> Result<()> {
            let n = o.len() / cols;
            let t = qtensor_from_ggml(q.dtype(), r, vec![n, cols], &dev)?.dequantize(&dev)?;
            o.copy_from_slice(&t.flatten_all()?.to_vec1::<f32>()?);
            Ok(())
        })?;
    Ok(Tensor::from_vec(out, (rows, cols), &dev)?)
}

/// The token embedding `[vocab, hidden]`.
pub(super) enum Embedding {
    /// f32 values, kept.
    Resident(Tensor),
    /// The GGUF's blocks; each looked-up row is dequantized.
    Rows(Arc<QTensor>),
}

impl Embedding {
    pub(super) fn new(q: Arc<QTensor>, resident: bool) -> Result<Self> {
        if resident || row_bytes(&q).is_none() {
            return Ok(Self::Resident(dequantize_par(&q)?));
        }
        Ok(Self::Rows(q))
    }

    /// Rows `ids` (already checked against the vocabulary), `[ids.len(), hidden]`.
    pub(super) fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        let dev = Device::Cpu;
        match self {
            Self::Resident(t) => {
                let ids = Tensor::from_slice(ids, ids.len(), &dev)?;
                Ok(t.index_select(&ids, 0)?)
            }
            Self::Rows(q) => {
                let (_, cols, rb) = row_bytes(q).expect("checked in new");
                let raw = q.data()?;
                let mut out = vec![0f32; ids.len() * cols];
                if let Some(format) = KFormat::of(q.dtype()) {
                    for (o, &id) in out.chunks_mut(cols).zip(ids) {
                        format.dequantize(&raw[id as usize * rb..(id as usize + 1) * rb], o);
                    }
                    return Ok(Tensor::from_vec(out, (ids.len(), cols), &dev)?);
                }
                out.par_chunks_mut(cols).zip(ids.par_iter()).try_for_each(
                    |(o, &id)| -> Result<()> {
                        let r = &raw[id as usize * rb..(id as usize + 1) * rb];
                        let t = qtensor_from_ggml(q.dtype(), r, vec![1, cols], &dev)?
                            .dequantize(&dev)?;
                        o.copy_from_slice(&t.flatten_all()?.to_vec1::<f32>()?);
                        Ok(())
                    },
                )?;
                Ok(Tensor::from_vec(out, (ids.len(), cols), &dev)?)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;

    fn qt(rows: usize, cols: usize, dtype: GgmlDType) -> (Tensor, Arc<QTensor>) {
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 0.2)
            .collect();
        let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
        let q = Arc::new(QTensor::quantize(&t, dtype).unwrap());
        (t, q)
    }

    /// The parallel, row-split dequantization gives candle's own values exactly, and resident
    /// and on-demand matrices and embeddings agree bit for bit.
    #[test]
    fn row_split_dequantization_is_exact() {
        for dtype in [
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q4_1,
            GgmlDType::Q8_0,
        ] {
            // 200 rows: three full tasks and a partial one
            let (_, q) = qt(200, 512, dtype);
            let want = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let got = dequantize_par(&q).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(got, want, "{dtype:?}");
            let (_, q2) = qt(30, 512, dtype);
            let parts = vec![q.clone(), q2.clone()];
            let a = Dense::new(parts.clone(), true).unwrap();
            let b = Dense::new(parts, false).unwrap();
            assert!(a.is_resident() && !b.is_resident());
            assert_eq!(a.elem_count(), 230 * 512);
            assert_eq!(
                a.tensor().unwrap().to_vec2::<f32>().unwrap(),
                b.tensor().unwrap().to_vec2::<f32>().unwrap()
            );
            let ids = [0u32, 199, 7, 7, 64];
            let e1 = Embedding::new(q.clone(), true).unwrap();
            let e2 = Embedding::new(q.clone(), false).unwrap();
            let r1 = e1.rows(&ids).unwrap().to_vec2::<f32>().unwrap();
            let r2 = e2.rows(&ids).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(r1, r2);
            for (row, &id) in r1.iter().zip(&ids) {
                assert_eq!(row, &want[id as usize]);
            }
        }
    }
}
