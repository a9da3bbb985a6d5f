//! The optimized backend's own invariants (no reference dependency): encode/decode
//! consistency against a naive f64 rotation, SIMD vs portable agreement, attention
//! against a naive f64 computation, lifecycle shape, errors.

use half::f16;
use mosaickv_optimized::simd::Path;
use mosaickv_optimized::{
    select, simd, CpuBackend, DenseF16Cache, OptimizedMosaicCache, QuestF16Cache,
};
use mosaickv_spec::{
    Backend, ChannelPolicy, CompressConfig, KvCache, KvShape, MosaicError, SegmentState, Side,
};
use ndarray::{Array2, Array3};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Low-rank-ish keys/values with a few strong directions, like real KV.
fn kv(n: usize, kv_heads: usize, d: usize, seed: u64) -> (Array3<f32>, Array3<f32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let basis: Vec<f32> = (0..8 * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let mut gen = |scale: f32| {
        Array3::from_shape_fn((n, kv_heads, d), |(_, _, _)| 0.0f32).mapv(|_: f32| 0.0) + {
            let mut a = Array3::<f32>::zeros((n, kv_heads, d));
            for t in 0..n {
                for h in 0..kv_heads {
                    let c: Vec<f32> = (0..8)
                        .map(|k| rng.gen_range(-1.0f32..1.0) * scale / (1 + k) as f32)
                        .collect();
                    for j in 0..d {
                        let mut x = 0.05 * rng.gen_range(-1.0f32..1.0);
                        for k in 0..8 {
                            x += c[k] * basis[k * d + j];
                        }
                        a[[t, h, j]] = x;
                    }
                }
            }
            a
        }
    };
    let k = gen(2.0);
    let v = gen(1.0);
    (k, v)
}

fn queries(q_heads: usize, d: usize, seed: u64) -> Array2<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Array2::from_shape_fn((q_heads, d), |_| rng.gen_range(-1.0f32..1.0))
}

/// Naive f64 attention of query head rows over f16-rounded K/V `[n, kv, d]`.
fn naive_full(
    k: &Array3<f32>,
    v: &Array3<f32>,
    q: &Array2<f32>,
    shape: &KvShape,
    tokens: &[usize],
) -> Array2<f32> {
    let d = shape.head_dim;
    let r = |x: f32| f16::from_f32(x).to_f64();
    let mut out = Array2::zeros((shape.q_heads, d));
    for h in 0..shape.q_heads {
        let j = h / shape.group();
        let z: Vec<f64> = tokens
            .iter()
            .map(|&t| {
                (0..d)
                    .map(|i| q[[h, i]] as f64 * r(k[[t, j, i]]))
                    .sum::<f64>()
                    / (d as f64).sqrt()
            })
            .collect();
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = z.iter().map(|x| (x - m).exp()).collect();
        let s: f64 = p.iter().sum();
        for i in 0..d {
            out[[h, i]] = (tokens
                .iter()
                .zip(&p)
                .map(|(&t, p)| p * r(v[[t, j, i]]))
                .sum::<f64>()
                / s) as f32;
        }
    }
    out
}

fn rel(a: &Array2<f32>, b: &Array2<f32>) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

fn lossless_config() -> CompressConfig {
    CompressConfig {
        token_rate: 1.0,
        truncate_fraction: 0.0,
        channels: ChannelPolicy::Fixed {
            retention: 1.0,
            group_size: 1,
        },
        input_segment_len: 64,
        ..CompressConfig::paper_fixed()
    }
}

/// Naive single rounding to f16: scale to the binade's quantum, round ties-even, scale back.
fn round_once(x: f64) -> f16 {
    if x == 0.0 {
        return f16::from_f32(x as f32);
    }
    let e = (x.abs().log2().floor() as i32).max(-14);
    let q = 2f64.powi(e - 10);
    f16::from_f32(((x / q).round_ties_even() * q) as f32)
}

#[test]
fn decode_of_encode_is_f16_of_naive_rotation_top_r() {
    let d = 64;
    let (k, _) = kv(200, 1, d, 1);
    let rows = k.index_axis(ndarray::Axis(1), 0).to_owned();
    let be = CpuBackend::new();
    let cfg = CompressConfig::paper_fixed();
    let st = be.fit_side(rows.view(), Side::Key, &cfg).unwrap();
    let l = st.layout;
    assert_eq!((l.kept_dims, l.r, l.group_size), (48, 16, 1));
    let packed = be.encode(rows.view(), &st).unwrap();
    packed.validate(&l).unwrap();
    let dec = be.decode(&packed, &st).unwrap();
    for t in 0..200 {
        // Naive: rotate in f64, round to f16, keep the 16 largest magnitudes (ties: lower dim).
        let y: Vec<f16> = (0..l.kept_dims)
            .map(|j| {
                round_once(
                    (0..d)
                        .map(|i| st.rotation[i * l.kept_dims + j].to_f64() * rows[[t, i]] as f64)
                        .sum(),
                )
            })
            .collect();
        let mut idx: Vec<usize> = (0..l.kept_dims).collect();
        idx.sort_by(|&a, &b| {
            (y[b].to_f32().powi(2))
                .partial_cmp(&y[a].to_f32().powi(2))
                .unwrap()
                .then(a.cmp(&b))
        });
        for j in 0..l.kept_dims {
            let kept = idx[..l.r].contains(&j);
            let want = if kept { y[j].to_f32() } else { 0.0 };
            assert_eq!(dec[[t, j]].to_bits(), want.to_bits(), "row {t} dim {j}");
        }
    }
    // The stored columns (D x Dt) are orthonormal to f16 precision: each stored entry is
    // r (1 + delta), |delta| <= u = 2^-11 (or off by <= 2^-25 when subnormal), so a column
    // product moves by at most (2u + u^2) sum_i |r_ia r_ib| <= 2u + u^2 (Cauchy-Schwarz),
    // plus 2 D 2^-25 for subnormal entries, from the f64 eigenvectors' 0 or 1.
    let dt = l.kept_dims;
    assert_eq!(st.rotation.len(), d * dt);
    let u = 2f64.powi(-11);
    let tol = 2.0 * u + u * u + 2.0 * d as f64 * 2f64.powi(-25) + 1e-12;
    for a in 0..dt {
        for b in 0..dt {
            let s: f64 = (0..d)
                .map(|i| st.rotation[i * dt + a].to_f64() * st.rotation[i * dt + b].to_f64())
                .sum();
            assert!(
                (s - if a == b { 1.0 } else { 0.0 }).abs() < tol,
                "{a} {b} {s}"
            );
        }
    }
}

#[test]
fn simd_and_portable_agree_on_scores_and_selections() {
    let Ok(simd) = CpuBackend::avx2() else {
        eprintln!("skipped: CPU lacks avx2/fma/f16c");
        return;
    };
    let port = CpuBackend::portable();
    let shape = KvShape::new(2, 8, 128).unwrap();
    let (k, v) = kv(3000, 2, 128, 7);
    let mut cfg = CompressConfig::paper_fixed();
    cfg.input_segment_len = 1024;
    let mut c = OptimizedMosaicCache::new(shape, cfg).unwrap();
    c.prefill(k.view(), v.view()).unwrap();
    for s in 0..10 {
        let q = queries(8, 128, 100 + s);
        let a = simd.select(c.compressed(), q.view()).unwrap();
        let b = port.select(c.compressed(), q.view()).unwrap();
        assert_eq!(a, b);
        let seg = &c.compressed().segments[0].heads[0];
        let rq = simd
            .rotate_queries(q.slice(ndarray::s![0..4, ..]), &seg.strategy.key)
            .unwrap();
        let rq2 = port
            .rotate_queries(q.slice(ndarray::s![0..4, ..]), &seg.strategy.key)
            .unwrap();
        assert_eq!(rq, rq2);
        let sa = simd.score_blocks(&seg.meta, rq.view()).unwrap();
        let sb = port.score_blocks(&seg.meta, rq.view()).unwrap();
        assert_eq!(
            sa.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            sb.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let mut oa = Array2::zeros((8, 128));
        let mut ob = Array2::zeros((8, 128));
        simd.attend(c.compressed(), q.view(), oa.view_mut())
            .unwrap();
        port.attend(c.compressed(), q.view(), ob.view_mut())
            .unwrap();
        assert!(rel(&oa, &ob) < 1e-5, "{}", rel(&oa, &ob));
    }
}

#[test]
fn score_is_an_upper_bound_of_packed_logits() {
    let be = CpuBackend::new();
    let shape = KvShape::new(1, 3, 80).unwrap();
    let (k, v) = kv(500, 1, 80, 3);
    let mut c = OptimizedMosaicCache::new(shape, CompressConfig::default()).unwrap();
    c.prefill(k.view(), v.view()).unwrap();
    let hs = &c.compressed().segments[0].heads[0];
    let q = queries(3, 80, 9);
    let rq = be.rotate_queries(q.view(), &hs.strategy.key).unwrap();
    let scores = be.score_blocks(&hs.meta, rq.view()).unwrap();
    let dec = be.decode(&hs.keys, &hs.strategy.key).unwrap();
    for (t, row) in dec.rows().into_iter().enumerate() {
        for g in 0..3 {
            let dot: f32 = row.iter().zip(rq.row(g)).map(|(a, b)| a * b).sum();
            assert!(dot <= scores[t / hs.strategy.block_size] + 1e-3);
        }
    }
}

/// SPEC 8.3 by its words: blocks taken in `order` while fewer than `budget` tokens are taken,
/// returned ascending.
fn take_in_order(order: &[usize], lens: &[usize], budget: usize) -> Vec<u32> {
    let mut want = Vec::new();
    let mut taken = 0;
    for &i in order {
        if taken >= budget {
            break;
        }
        taken += lens[i];
        want.push(i as u32);
    }
    want.sort();
    want
}

#[test]
fn top_blocks_matches_full_sort() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for trial in 0..200 {
        let n = rng.gen_range(1..300);
        let scores: Vec<f32> = (0..n)
            .map(|_| (rng.gen_range(0..20) as f32) - 10.0)
            .collect(); // many ties
        let lens: Vec<usize> = (0..n)
            .map(|_| [16usize, 32, 64, 5][rng.gen_range(0..4)])
            .collect();
        let budget = rng.gen_range(0..n * 20);
        let got = CpuBackend::new()
            .select_blocks(&scores, &lens, budget)
            .unwrap();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).unwrap().then(a.cmp(&b)));
        assert_eq!(got, take_in_order(&order, &lens, budget), "trial {trial}");
    }
    assert!(simd::rank_key(-0.0, 1) > simd::rank_key(0.0, 0));
}

/// The sampled-pivot and uniform-length paths of `top_blocks` (n >= 2048) against a full sort:
/// uniform and mixed lengths, heavy ties, NaN and signed zeros, sorted and reversed score runs
/// (a sample that misses the top keys must fall back, not lose blocks).
#[test]
fn top_blocks_large_matches_full_sort() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for trial in 0..120 {
        let n = rng.gen_range(2048..20_000);
        let layout = trial % 6;
        // The positions top_blocks samples (256 evenly strided), for the adversarial layout.
        let sampled: std::collections::HashSet<usize> = (0..256).map(|j| j * n / 256).collect();
        let scores: Vec<f32> = (0..n)
            .map(|i| match layout {
                0 => rng.gen_range(-50.0..50.0),
                1 => (rng.gen_range(0..7) as f32) - 3.0,
                2 => i as f32, // ascending: the best blocks are the last ones
                3 => [f32::NAN, -0.0, 0.0, 1.0, -1.0][rng.gen_range(0..5)],
                // Only the sampled positions score high: the pivot keeps too few, fallback.
                4 if sampled.contains(&i) => 100.0,
                4 => rng.gen_range(-50.0..50.0),
                // Half NaN (ranks as -inf), the cut inside the tier of signed zeros.
                _ => match i % 10 {
                    0 => 1.0,
                    1 | 3 | 5 | 7 | 9 => f32::NAN,
                    2 | 6 => -0.0,
                    _ => 0.0,
                },
            })
            .collect();
        let uniform = trial % 3 != 0 || layout == 5;
        let lens: Vec<usize> = (0..n)
            .map(|i| {
                if layout == 5 || (uniform && i % 997 != 996) {
                    16
                } else {
                    [16usize, 32, 5, 16][rng.gen_range(0..4)]
                }
            })
            .collect();
        let budget = if layout == 5 {
            // Uniform 16-token blocks, k = n / 5 <= n / 4: the sampled filter runs, and the
            // 10 % of 1.0 scores leave the cut among the zeros, next to the NaNs.
            16 * (n / 5)
        } else {
            rng.gen_range(1..n * 16 / 3)
        };
        let bmin = lens.iter().copied().min().unwrap();
        // Every path this CPU has (the AVX-512 one filters 16 scores per step).
        let mut results = Vec::new();
        for path in [Path::Portable, Path::Avx2, Path::Avx512] {
            let have = match path {
                Path::Avx2 => mosaickv_optimized::simd::avx2_available(),
                Path::Avx512 => mosaickv_optimized::simd::avx512_available(),
                _ => true,
            };
            if !have {
                continue;
            }
            let mut keys = Vec::new();
            let mut got = Vec::new();
            select::top_blocks(
                path,
                &scores,
                |i| lens[i],
                budget,
                budget.div_ceil(bmin),
                &mut keys,
                &mut got,
            );
            results.push((path, got));
        }
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| simd::rank_key(scores[i], i as u32));
        let want = take_in_order(&order, &lens, budget);
        for (path, got) in &results {
            assert_eq!(got, &want, "{path:?} trial {trial} n {n} budget {budget}");
        }
    }
}

#[test]
fn lossless_mosaic_equals_full_attention() {
    for (kvh, qh, d) in [(2, 8, 64), (1, 3, 80), (3, 3, 32)] {
        let shape = KvShape::new(kvh, qh, d).unwrap();
        let n = 203;
        let (k, v) = kv(n, kvh, d, 11);
        let q = queries(qh, d, 12);
        let all: Vec<usize> = (0..n).collect();
        let want = naive_full(&k, &v, &q, &shape, &all);
        let mut m = OptimizedMosaicCache::new(shape, lossless_config()).unwrap();
        m.prefill(k.view(), v.view()).unwrap();
        let mut dense = DenseF16Cache::new(shape).unwrap();
        dense.prefill(k.view(), v.view()).unwrap();
        let mut quest = QuestF16Cache::new(shape, 1.0).unwrap();
        quest.prefill(k.view(), v.view()).unwrap();
        for (name, c) in [
            ("mosaic", &mut m as &mut dyn KvCache),
            ("dense", &mut dense),
            ("quest", &mut quest),
        ] {
            let mut out = Array2::from_elem((qh, d), f32::NAN);
            c.attend(q.view(), out.view_mut()).unwrap();
            let e = rel(&out, &want);
            // f16 storage of rotated rows adds ~2^-11 relative error; f32 accumulation ~1e-6.
            let bound = if name == "mosaic" { 3e-3 } else { 1e-5 };
            assert!(e < bound, "{name} {kvh}/{qh}/{d}: {e}");
        }
    }
}

#[test]
fn quest_attends_its_budget_of_pages() {
    let shape = KvShape::new(1, 1, 32).unwrap();
    let n = 16 * 20 + 3;
    let (k, v) = kv(n, 1, 32, 21);
    let q = queries(1, 32, 22);
    let mut quest = QuestF16Cache::new(shape, 0.1).unwrap();
    quest.prefill(k.view(), v.view()).unwrap();
    // P = ceil(ceil(0.1 * 323) / 16) = ceil(33/16) = 3: the last page plus the 2 best others.
    assert_eq!(quest.budget_pages(n), 3);
    let r = |x: f32| f16::from_f32(x).to_f32();
    let mut scored: Vec<(f32, usize)> = (0..20)
        .map(|p| {
            let s = (0..32)
                .map(|j| {
                    let vals: Vec<f32> = (p * 16..p * 16 + 16).map(|t| r(k[[t, 0, j]])).collect();
                    let (lo, hi) = vals
                        .iter()
                        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| {
                            (a.min(x), b.max(x))
                        });
                    (q[[0, j]] * hi).max(q[[0, j]] * lo)
                })
                .sum::<f32>();
            (s, p)
        })
        .collect();
    scored.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
    let mut tokens: Vec<usize> = scored[..2]
        .iter()
        .flat_map(|&(_, p)| p * 16..p * 16 + 16)
        .collect();
    tokens.extend(320..n);
    let want = naive_full(&k, &v, &q, &shape, &tokens);
    let mut out = Array2::zeros((1, 32));
    quest.attend(q.view(), out.view_mut()).unwrap();
    assert!(rel(&out, &want) < 1e-5, "{}", rel(&out, &want));
}

#[test]
fn lifecycle_segments_and_appends() {
    let shape = KvShape::new(2, 4, 32).unwrap();
    let mut cfg = CompressConfig::paper_fixed();
    cfg.input_segment_len = 100;
    cfg.max_segment_len = 128;
    let (k, v) = kv(700, 2, 32, 31);
    let mut c = OptimizedMosaicCache::new(shape, cfg.clone()).unwrap();
    c.prefill(
        k.slice(ndarray::s![..250, .., ..]),
        v.slice(ndarray::s![..250, .., ..]),
    )
    .unwrap();
    // 4 sink + 246 tokens -> 2 segments: 100 and 146.
    let segs: Vec<(usize, usize)> = c
        .compressed()
        .segments
        .iter()
        .map(|s| (s.start, s.len))
        .collect();
    assert_eq!(segs, vec![(4, 100), (104, 146)]);
    for t in 250..700 {
        c.append(
            k.slice(ndarray::s![t, .., ..]),
            v.slice(ndarray::s![t, .., ..]),
        )
        .unwrap();
    }
    let cc = c.compressed();
    assert_eq!(cc.len(), 700);
    assert!(cc.buffer.tokens < cfg.buffer_capacity);
    let mut pos = cc.sink.tokens;
    for s in &cc.segments {
        assert_eq!(s.start, pos);
        pos += s.len;
        for h in &s.heads {
            assert_eq!(h.keys.count, s.len);
            h.keys.validate(&h.strategy.key.layout).unwrap();
            assert_eq!(h.meta.tokens, s.len);
        }
        if s.state == SegmentState::Open {
            assert!(s.len < cfg.max_segment_len);
        }
    }
    assert_eq!(pos + cc.buffer.tokens, 700);
    // Generated segments never exceed max_segment_len.
    assert!(cc.segments[2..]
        .iter()
        .all(|s| s.len <= 128 && s.len % 64 == 0));
    // A closed generated segment equals encoding its rows from scratch.
    let be = CpuBackend::new();
    if let Some(s) = cc.segments[2..]
        .iter()
        .find(|s| s.state == SegmentState::Closed)
    {
        let rows = k
            .slice(ndarray::s![s.start..s.start + s.len, 0, ..])
            .to_owned();
        let st = be.fit_side(rows.view(), Side::Key, &cfg).unwrap();
        assert_eq!(st, s.heads[0].strategy.key);
        assert_eq!(be.encode(rows.view(), &st).unwrap(), s.heads[0].keys);
    }
    let q = queries(4, 32, 5);
    let mut out = Array2::zeros((4, 32));
    c.attend(q.view(), out.view_mut()).unwrap();
    let mut o2 = Array2::zeros((4, 32));
    be.attend(c.compressed(), q.view(), o2.view_mut()).unwrap();
    assert!(rel(&out, &o2) < 1e-6);
    assert!(out.iter().all(|x| x.is_finite()));
}

#[test]
fn errors_are_typed_and_do_not_mutate() {
    let shape = KvShape::new(1, 2, 16).unwrap();
    let mut c = OptimizedMosaicCache::new(shape, CompressConfig::paper_fixed()).unwrap();
    let mut out = Array2::zeros((2, 16));
    assert_eq!(
        c.attend(queries(2, 16, 1).view(), out.view_mut()),
        Err(MosaicError::EmptyCache)
    );
    let (mut k, v) = kv(30, 1, 16, 2);
    k[[3, 0, 5]] = f32::NAN;
    assert!(matches!(
        c.prefill(k.view(), v.view()),
        Err(MosaicError::NonFinite { .. })
    ));
    assert_eq!(c.len(), 0);
    k[[3, 0, 5]] = 0.5;
    c.prefill(k.view(), v.view()).unwrap();
    assert!(matches!(
        c.prefill(k.view(), v.view()),
        Err(MosaicError::AlreadyPrefilled(30))
    ));
    let bad = Array2::<f32>::zeros((1, 15));
    assert!(matches!(
        c.append(bad.view(), bad.view()),
        Err(MosaicError::ShapeMismatch { .. })
    ));
    assert_eq!(c.len(), 30);
    let mut q = queries(2, 16, 3);
    q[[1, 1]] = f32::INFINITY;
    assert!(matches!(
        c.attend(q.view(), out.view_mut()),
        Err(MosaicError::NonFinite { .. })
    ));
    let mut bad_cache = c.compressed().clone();
    bad_cache.segments[0].heads[0].keys.bytes[..8].fill(0xff); // bits past the 12 groups
    let be = CpuBackend::new();
    assert!(matches!(
        be.attend(&bad_cache, queries(2, 16, 4).view(), out.view_mut()),
        Err(MosaicError::CorruptPacked(_))
    ));
}

#[test]
fn scratch_size_is_reported_and_names_say_path() {
    let shape = KvShape::new(8, 32, 128).unwrap();
    let b =
        mosaickv_optimized::attend_scratch_bytes(&shape, &CompressConfig::paper_fixed(), 131072);
    assert!(b > 0 && b < 64 << 20, "{b}");
    assert_eq!(CpuBackend::portable().name(), "cpu-portable");
}

#[test]
fn f64_to_f16_rounds_once_ties_to_even() {
    use mosaickv_optimized::round::f16_from_f64;
    for bits in (0u16..0x7bff).step_by(3) {
        let (a, b) = (f16::from_bits(bits), f16::from_bits(bits + 1));
        let (fa, fb) = (a.to_f64(), b.to_f64());
        let mid = 0.5 * (fa + fb);
        let even = if bits % 2 == 0 { a } else { b };
        assert_eq!(f16_from_f64(mid).to_bits(), even.to_bits(), "tie {mid}");
        let eps = (fb - fa) * 1e-9;
        assert_eq!(f16_from_f64(mid - eps).to_bits(), a.to_bits());
        assert_eq!(f16_from_f64(mid + eps).to_bits(), b.to_bits());
        assert_eq!(f16_from_f64(-(mid + eps)).to_bits(), (-b).to_bits());
        assert_eq!(f16_from_f64(fa).to_bits(), a.to_bits());
    }
    assert_eq!(f16_from_f64(-1e-30).to_bits(), 0x8000);
    assert_eq!(f16_from_f64(65519.99), f16::MAX);
    assert!(f16_from_f64(65520.0).is_infinite());
}

#[test]
fn sink_and_buffer_only_cache_is_exact_dense_attention() {
    let shape = KvShape::new(2, 4, 32).unwrap();
    let (k, v) = kv(40, 2, 32, 41);
    let q = queries(4, 32, 42);
    for n in [1usize, 3, 4, 10, 40] {
        let mut c = OptimizedMosaicCache::new(shape, CompressConfig::paper_fixed()).unwrap();
        for t in 0..n {
            c.append(
                k.slice(ndarray::s![t, .., ..]),
                v.slice(ndarray::s![t, .., ..]),
            )
            .unwrap();
        }
        assert!(c.compressed().segments.is_empty());
        let mut out = Array2::from_elem((4, 32), f32::NAN);
        c.attend(q.view(), out.view_mut()).unwrap();
        let all: Vec<usize> = (0..n).collect();
        let e = rel(&out, &naive_full(&k, &v, &q, &shape, &all));
        assert!(e < 1e-5, "n = {n}: {e}");
        let sel = CpuBackend::new().select(c.compressed(), q.view()).unwrap();
        assert!(sel.per_head.iter().all(|s| s.is_empty()));
    }
}

/// SPEC 14, dense baselines: an element that rounds to an infinite f16 is refused as
/// `NonFinite` with its flat index, on prefill and on append, and the cache keeps
/// what it had (the reference's `FullCache`/`QuestCache` refuse the same inputs).
#[test]
fn dense_baselines_refuse_values_beyond_f16() {
    let shape = KvShape::new(2, 2, 16).unwrap();
    let (k, v) = kv(40, 2, 16, 90);
    let mut caches: Vec<Box<dyn KvCache>> = vec![
        Box::new(DenseF16Cache::new(shape).unwrap()),
        Box::new(QuestF16Cache::new(shape, 0.2).unwrap()),
    ];
    for c in caches.iter_mut() {
        let mut big = k.clone();
        big[[3, 1, 5]] = 7e4; // finite in f32, +Inf in f16
        assert_eq!(
            c.prefill(big.view(), v.view()),
            Err(MosaicError::NonFinite {
                what: "keys (beyond f16 range)",
                index: (3 * 2 + 1) * 16 + 5
            })
        );
        assert_eq!(c.len(), 0);
        c.prefill(k.view(), v.view()).unwrap();
        let q = queries(2, 16, 91);
        let mut before = Array2::zeros((2, 16));
        c.attend(q.view(), before.view_mut()).unwrap();
        let mut row = v.index_axis(ndarray::Axis(0), 0).to_owned();
        row[[0, 2]] = -65520.0;
        assert_eq!(
            c.append(k.index_axis(ndarray::Axis(0), 0), row.view()),
            Err(MosaicError::NonFinite {
                what: "value (beyond f16 range)",
                index: 2
            })
        );
        assert_eq!(c.len(), 40);
        let mut after = Array2::zeros((2, 16));
        c.attend(q.view(), after.view_mut()).unwrap();
        assert_eq!(before, after);
    }
}

/// `set_q_heads`: the GQA group comes with the queries (SPEC 1); a bad count is
/// refused (`GqaMismatch`) and changes nothing.
#[test]
fn set_q_heads_changes_only_the_group() {
    let (k, v) = kv(300, 2, 16, 92);
    let wide = KvShape::new(2, 8, 16).unwrap();
    let mut fixed = DenseF16Cache::new(wide).unwrap();
    let mut moved = DenseF16Cache::new(KvShape::new(2, 2, 16).unwrap()).unwrap();
    fixed.prefill(k.view(), v.view()).unwrap();
    moved.prefill(k.view(), v.view()).unwrap();
    assert_eq!(
        moved.set_q_heads(3),
        Err(MosaicError::GqaMismatch {
            q_heads: 3,
            kv_heads: 2
        })
    );
    assert_eq!(moved.shape().q_heads, 2);
    moved.set_q_heads(8).unwrap();
    let q = queries(8, 16, 93);
    let (mut a, mut b) = (Array2::zeros((8, 16)), Array2::zeros((8, 16)));
    fixed.attend(q.view(), a.view_mut()).unwrap();
    moved.attend(q.view(), b.view_mut()).unwrap();
    assert_eq!(a, b);
}

/// The profiled step (issue 38's stage profile) computes the plain step's output bit for bit,
/// on every path this CPU runs, with quantized and f16 records (the default's loss threshold
/// picks a mix); it counts one step and charges time to the stages a step runs.
#[test]
fn profiled_step_equals_the_plain_step() {
    use mosaickv_optimized::attention::{
        packed_attention, packed_attention_profiled, MosaicScratch, SelectionSource,
    };
    use mosaickv_optimized::profile::{Stage, StepProfile};
    let shape = KvShape::new(2, 8, 64).unwrap();
    let (k, v) = kv(3000, 2, 64, 11);
    for config in [CompressConfig::default(), CompressConfig::paper_fixed()] {
        let mut c = OptimizedMosaicCache::new(shape, config).unwrap();
        c.prefill(k.view(), v.view()).unwrap();
        let q = queries(8, 64, 12);
        let qs = q.as_slice().unwrap();
        for path in Path::ALL.into_iter().filter(|p| p.runs_here()) {
            let mut sc = MosaicScratch::default();
            let (mut want, mut got) = (vec![0f32; 8 * 64], vec![0f32; 8 * 64]);
            let src = SelectionSource::Compute;
            packed_attention(
                path,
                c.compressed(),
                qs,
                src,
                false,
                Some(&mut want),
                &mut sc,
            )
            .unwrap();
            let mut p = StepProfile::default();
            packed_attention_profiled(path, c.compressed(), qs, &mut got, &mut sc, &mut p).unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&want), bits(&got), "{path:?}");
            assert_eq!(p.steps, 1);
            assert!(p.units_wall > std::time::Duration::ZERO, "{path:?}: {p:?}");
            for stage in [Stage::Rotate, Stage::Score, Stage::KeyLogits, Stage::Values] {
                assert!(
                    p.thread_time(stage) > std::time::Duration::ZERO,
                    "{stage:?}: {p:?}"
                );
            }
        }
    }
}
