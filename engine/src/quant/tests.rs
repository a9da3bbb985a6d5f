//! The weight products against the dequantized weights, the paths against each other, the
//! batch against single vectors; and two ignored timings (`--ignored --nocapture`).

use super::*;
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use half::f16;
use mosaickv_optimized::simd::ggml::{Q4_K_BYTES, Q6_K_BYTES, QK, QK_K};
use mosaickv_optimized::Path;
use std::sync::Arc;

fn rng(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
}

fn kernels() -> Vec<Path> {
    available_paths()
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
    m.matvec_with(&xq, &mut want, Path::Portable);
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
    m.matvec_with(&xq, &mut got, path());
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
        m.matvec_with(&xq, &mut want, Path::Portable);
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
#[cfg(test)]
mod timing {
    use super::*;
    use mosaickv_optimized::simd::ggml::QK;
    use mosaickv_optimized::Path;

    /// `cargo test --release -p mosaickv-engine quant::tests::timing -- --ignored --nocapture`
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
            for kernel in [Path::Portable, path()] {
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
    /// `cargo test --release -p mosaickv-engine quant::tests::kquant_timing -- --ignored --nocapture`
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
            let kernels = available_paths();
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
