//! kvq8 / kvq4 (SPEC.md section 12): the optimized caches against the reference. The stored
//! blocks (ggml's `q8_0` / `q4_0` bytes) must be equal byte for byte, and so must the attention
//! output: both run ggml's one-row loop with the same f32 operations in the same order (the
//! logits' integer block sums are exact, every other step is the same sequence of f32
//! roundings), so the derived tolerance is zero.

use mosaickv_conformance::{queries, structured_kv};
use mosaickv_optimized::baselines::{KvqCache as OptKvq, KvqFormat as OptFormat};
use mosaickv_reference::baselines::{KvqCache as RefKvq, KvqFormat as RefFormat};
use mosaickv_spec::{KvCache, KvShape, MosaicError};
use ndarray::{s, Array2, Array3};

const FORMATS: [(RefFormat, OptFormat); 2] = [
    (RefFormat::Q8_0, OptFormat::Q8_0),
    (RefFormat::Q4_0, OptFormat::Q4_0),
];

fn pair(shape: KvShape, i: usize) -> (RefKvq, OptKvq) {
    (
        RefKvq::new(shape, FORMATS[i].0).unwrap(),
        OptKvq::new(shape, FORMATS[i].1).unwrap(),
    )
}

/// As [`pair`], llama.cpp's Hadamard rotation on (kvq8 / kvq4 as the registry builds them).
fn rotated_pair(shape: KvShape, i: usize) -> (RefKvq, OptKvq) {
    let (r, o) = pair(shape, i);
    (r.with_rotation(), o.with_rotation())
}

#[test]
fn same_bytes_memory_and_attention_as_the_reference() {
    // head_dim 192: a rotation block of 64 for K (three per head); 96: no rotation (llama.cpp's
    // rule), so the rotated cache is the unrotated one
    for (kv_heads, gqa, head_dim) in [(1, 1, 32), (3, 3, 64), (2, 6, 128), (2, 4, 96), (1, 2, 192)]
    {
        let shape = KvShape::new(kv_heads, kv_heads * gqa, head_dim).unwrap();
        let (n, gen) = (700, 40);
        let (k, v) = structured_kv(n + gen, kv_heads, head_dim, 11 + head_dim as u64);
        for (i, rotated) in (0..FORMATS.len()).flat_map(|i| [(i, false), (i, true)]) {
            let (mut r, mut o) = if rotated {
                rotated_pair(shape, i)
            } else {
                pair(shape, i)
            };
            assert_eq!(r.rotated(), rotated && head_dim % 64 == 0);
            assert_eq!(r.rotated(), o.rotated());
            r.prefill(k.slice(s![..n, .., ..]), v.slice(s![..n, .., ..]))
                .unwrap();
            o.prefill(k.slice(s![..n, .., ..]), v.slice(s![..n, .., ..]))
                .unwrap();
            for t in n..n + gen {
                let (kt, vt) = (k.slice(s![t, .., ..]), v.slice(s![t, .., ..]));
                r.append(kt, vt).unwrap();
                o.append(kt, vt).unwrap();
                if t % 13 == 0 || t == n + gen - 1 {
                    let q = queries(shape.q_heads, head_dim, t as u64);
                    let (mut a, mut b) = (
                        Array2::zeros((shape.q_heads, head_dim)),
                        Array2::zeros((shape.q_heads, head_dim)),
                    );
                    r.attend(q.view(), a.view_mut()).unwrap();
                    o.attend(q.view(), b.view_mut()).unwrap();
                    let (ab, bb): (Vec<u32>, Vec<u32>) = (
                        a.iter().map(|x| x.to_bits()).collect(),
                        b.iter().map(|x| x.to_bits()).collect(),
                    );
                    assert_eq!(
                        ab, bb,
                        "{:?} rotated {rotated} D={head_dim} t={t}",
                        FORMATS[i].0
                    );
                }
            }
            assert_eq!(r.key_bytes(), o.key_bytes().as_slice());
            assert_eq!(r.value_bytes(), o.value_bytes().as_slice());
            assert_eq!(r.memory(), o.memory());
            let per_token = 2 * kv_heads * head_dim / 32 * FORMATS[i].0.block_bytes();
            // the rotation is computed, not stored: the same bytes per token
            assert_eq!(r.memory().device_bytes(), (n + gen) * per_token);
            // the file keeps the rotation and reads back to the same output bits
            let file = o.to_file();
            let mut back = OptKvq::from_file(&file, FORMATS[i].1).unwrap();
            assert_eq!(back.rotated(), o.rotated());
            let q = queries(shape.q_heads, head_dim, 5);
            let (mut a, mut b) = (
                Array2::zeros((shape.q_heads, head_dim)),
                Array2::zeros((shape.q_heads, head_dim)),
            );
            o.attend(q.view(), a.view_mut()).unwrap();
            back.attend(q.view(), b.view_mut()).unwrap();
            assert_eq!(a, b);
        }
    }
}

#[test]
fn the_rotation_is_llama_cpps_hadamard_and_helps_q4_on_outlier_channels() {
    // H[i][j] = (-1)^popcount(i & j) / sqrt(n): the explicit product in f64 against the
    // transform, and twice the transform gives the input back
    for n in [64usize, 128, 256] {
        let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3).collect();
        let mut y = x.clone();
        mosaickv_reference::baselines::hadamard_rotate(&mut y, n);
        for (i, &yi) in y.iter().enumerate() {
            let e: f64 = (0..n)
                .map(|j| {
                    let sign = if (i & j).count_ones() % 2 == 0 {
                        1.0
                    } else {
                        -1.0
                    };
                    sign * x[j] as f64
                })
                .sum::<f64>()
                / (n as f64).sqrt();
            assert!((yi as f64 - e).abs() < 1e-5, "n={n} i={i}: {yi} vs {e}");
        }
        mosaickv_reference::baselines::hadamard_rotate(&mut y, n);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 1e-5);
        }
    }
    // keys with two large outlier channels per head: q4_0 of the raw rows loses the small
    // channels to the outliers' scale; rotated, the energy is spread over the block
    let shape = KvShape::new(2, 4, 128).unwrap();
    let (mut k, v) = structured_kv(300, 2, 128, 3);
    for t in 0..300 {
        for h in 0..2 {
            k[[t, h, 5]] *= 40.0;
            k[[t, h, 77]] *= 40.0;
        }
    }
    let q = queries(4, 128, 9);
    let mut exact = Array2::zeros((4, 128));
    let mut full = mosaickv_reference::FullCache::new(shape);
    full.prefill(k.view(), v.view()).unwrap();
    full.attend(q.view(), exact.view_mut()).unwrap();
    let err = |rotated: bool| {
        let (mut c, _) = if rotated {
            rotated_pair(shape, 1)
        } else {
            pair(shape, 1)
        };
        c.prefill(k.view(), v.view()).unwrap();
        let mut o = Array2::zeros((4, 128));
        c.attend(q.view(), o.view_mut()).unwrap();
        mosaickv_spec::metrics::rel_l2(o.view(), exact.view())
    };
    let (plain, rotated) = (err(false), err(true));
    println!("q4_0 on outlier keys: rel L2 {plain:.4} unrotated, {rotated:.4} rotated");
    assert!(rotated < plain, "{rotated} >= {plain}");
}

#[test]
fn awkward_values_quantize_to_the_same_bytes() {
    // ties of |x| (q4_0 keeps the first), exact halves (round half away from zero), zeros,
    // tiny values whose f16 scale underflows, negative zero, large values near the f16 limit
    let mut rows = Array3::<f32>::zeros((6, 1, 64));
    for i in 0..64 {
        rows[[0, 0, i]] = if i % 2 == 0 { 1.0 } else { -1.0 };
        rows[[1, 0, i]] = (i as f32 - 32.0) * 0.5;
        rows[[2, 0, i]] = 1e-9 * i as f32;
        rows[[3, 0, i]] = -0.0;
        rows[[4, 0, i]] = 65519.0 * 7.9 * if i == 5 { -1.0 } else { 0.01 * i as f32 };
        rows[[5, 0, i]] = 127.0 * (i as f32 / 63.0) + 0.5;
    }
    let shape = KvShape::new(1, 1, 64).unwrap();
    for i in 0..FORMATS.len() {
        let (mut r, mut o) = pair(shape, i);
        r.prefill(rows.view(), rows.view()).unwrap();
        o.prefill(rows.view(), rows.view()).unwrap();
        assert_eq!(
            r.key_bytes(),
            o.key_bytes().as_slice(),
            "{:?}",
            FORMATS[i].0
        );
    }
}

#[test]
fn bad_input_gives_the_same_error_and_leaves_both_caches_unchanged() {
    let shape = KvShape::new(2, 4, 64).unwrap();
    let (k, v) = structured_kv(20, 2, 64, 3);
    for i in 0..FORMATS.len() {
        let (mut r, mut o) = pair(shape, i);
        let mut big = k.clone();
        big[[3, 1, 40]] = 9e6; // the f16 scale of its block would overflow under both formats
        assert_eq!(
            r.prefill(big.view(), v.view()),
            o.prefill(big.view(), v.view())
        );
        assert_eq!((r.len(), o.len()), (0, 0));
        r.prefill(k.view(), v.view()).unwrap();
        o.prefill(k.view(), v.view()).unwrap();
        let before = (r.key_bytes().to_vec(), o.key_bytes());
        let mut nan = Array2::<f32>::zeros((2, 64));
        nan[[1, 3]] = f32::NAN;
        let good = Array2::<f32>::zeros((2, 64));
        let e = r.append(nan.view(), good.view());
        assert!(matches!(e, Err(MosaicError::NonFinite { .. })), "{e:?}");
        assert_eq!(e, o.append(nan.view(), good.view()));
        let mut huge = Array2::<f32>::zeros((2, 64));
        huge[[1, 33]] = -9e6;
        let e = r.append(good.view(), huge.view());
        assert_eq!(
            e,
            Err(MosaicError::NonFinite {
                what: "value (block scale beyond f16 range)",
                index: 96
            })
        );
        assert_eq!(e, o.append(good.view(), huge.view()));
        assert_eq!((r.key_bytes().to_vec(), o.key_bytes()), before);
        assert_eq!((r.len(), o.len()), (20, 20));
        let mut out = Array2::zeros((3, 64));
        let q = Array2::<f32>::zeros((3, 64));
        assert_eq!(
            r.attend(q.view(), out.view_mut()),
            o.attend(q.view(), out.view_mut())
        );
        let mut out = Array2::zeros((4, 64));
        let mut q = Array2::<f32>::zeros((4, 64));
        q[[2, 2]] = 2e7;
        let e = r.attend(q.view(), out.view_mut());
        assert!(matches!(e, Err(MosaicError::NonFinite { .. })), "{e:?}");
        assert_eq!(e, o.attend(q.view(), out.view_mut()));
    }
    assert_eq!(
        RefKvq::new(KvShape::new(1, 1, 80).unwrap(), RefFormat::Q8_0).map(|_| ()),
        OptKvq::new(KvShape::new(1, 1, 80).unwrap(), OptFormat::Q8_0).map(|_| ())
    );
}

/// ggml's own bytes (`engine/scripts/kvq_ggml_fixture.py`, libggml of llama-cpp-python 0.3.36):
/// f32 values, then q8_0 and q4_0 from `quantize_row_*_ref`, then q8_0 from the CPU backend's
/// SIMD `quantize_row_q8_0`.
fn ggml_fixture() -> (Vec<f32>, [Vec<u8>; 3]) {
    let text = include_str!("fixtures/kvq_ggml.txt");
    let mut lines = text.lines();
    let x = lines
        .next()
        .unwrap()
        .split(' ')
        .map(|h| f32::from_bits(u32::from_str_radix(h, 16).unwrap()))
        .collect();
    let mut bytes = || -> Vec<u8> {
        let l = lines.next().unwrap().as_bytes();
        l.chunks(2)
            .map(|c| u8::from_str_radix(std::str::from_utf8(c).unwrap(), 16).unwrap())
            .collect()
    };
    (x, [bytes(), bytes(), bytes()])
}

#[test]
fn both_caches_write_ggmls_reference_bytes() {
    let (x, [q8, q4, q8_cpu]) = ggml_fixture();
    // one KV head of head_dim 64: two blocks per row, rows in order = blocks in order
    let n = x.len() / 64;
    let rows = Array3::from_shape_vec((n, 1, 64), x).unwrap();
    let shape = KvShape::new(1, 1, 64).unwrap();
    for (i, want) in [(0, &q8), (1, &q4)] {
        let (mut r, mut o) = pair(shape, i);
        r.prefill(rows.view(), rows.view()).unwrap();
        o.prefill(rows.view(), rows.view()).unwrap();
        assert_eq!(r.key_bytes(), want.as_slice(), "{:?}", FORMATS[i].0);
        assert_eq!(o.key_bytes(), *want, "{:?}", FORMATS[i].0);
    }
    // llama.cpp's CPU backend writes q8_0 with its SIMD variant (id = 127 / amax, round half
    // to even): it differs from the reference only in the fixture's rounding-tie blocks
    // (every 8th block from the third: values (k + 1/2) * 2^e), in all of those, nowhere else
    let differing: Vec<usize> = (0..q8.len() / 34)
        .filter(|b| q8[b * 34..(b + 1) * 34] != q8_cpu[b * 34..(b + 1) * 34])
        .collect();
    let ties: Vec<usize> = (0..q8.len() / 34).filter(|b| b % 8 == 2).collect();
    assert_eq!(differing, ties);
}
