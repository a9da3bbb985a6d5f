//! SPEC.md section 10 (lifecycle), section 9's special case, and section 14 (bad input).

mod common;

use common::random_rows;
use mosaickv_reference::lifecycle::prompt_segments;
use mosaickv_reference::metrics::rel_l2;
use mosaickv_reference::synthetic::{queries, structured_kv};
use mosaickv_reference::{
    side_loss, FullCache, MosaicCache, Naive2dCache, QuestCache, ReferenceBackend,
};
use mosaickv_spec::{
    Backend, ChannelPolicy, CompressConfig, KvCache, KvShape, MosaicError, SegmentState, Side,
};
use ndarray::{s, Array2, Array3, Axis};

fn small_config() -> CompressConfig {
    CompressConfig {
        input_segment_len: 64,
        buffer_capacity: 16,
        block_sizes: vec![8, 16],
        max_segment_len: 1024,
        ..CompressConfig::default()
    }
}

/// Every token is in exactly one place: sink, one segment, or the buffer;
/// segments are contiguous after the sink; host rows hold the open segment and buffer.
fn assert_accounting(cache: &MosaicCache) {
    let c = cache.compressed();
    let shape = c.shape;
    let mut next = c.sink.tokens;
    let mut open = 0;
    for (i, seg) in c.segments.iter().enumerate() {
        assert_eq!(seg.start, next, "segment {i} start");
        assert!(seg.len > 0);
        for h in &seg.heads {
            assert_eq!(h.keys.count, seg.len);
            assert_eq!(h.values.count, seg.len);
            assert_eq!(h.meta.tokens, seg.len);
        }
        if seg.state == SegmentState::Open {
            assert_eq!(i + 1, c.segments.len(), "only the last segment may be open");
            open = seg.len;
        }
        next += seg.len;
    }
    assert_eq!(next + c.buffer.tokens, cache.len());
    assert_eq!(
        c.sink.tokens + c.segment_tokens() + c.buffer.tokens,
        cache.len()
    );
    let (hk, hv) = cache.host_rows();
    let want = (open + c.buffer.tokens) * shape.kv_heads * shape.head_dim;
    assert_eq!((hk.len(), hv.len()), (want, want));
    assert_eq!(cache.memory().host_rows, 8 * want);
}

#[test]
fn prompt_segment_boundaries() {
    // Hand-written expectations, sink 4, L_in 64 (SPEC.md 10.1).
    let cases: Vec<(usize, usize, Vec<(usize, usize)>)> = vec![
        (0, 0, vec![]),
        (1, 1, vec![]),
        (4, 4, vec![]),
        (5, 4, vec![(4, 1)]),
        (4 + 63, 4, vec![(4, 63)]),
        (4 + 64, 4, vec![(4, 64)]),
        (4 + 127, 4, vec![(4, 127)]),
        (4 + 128, 4, vec![(4, 64), (68, 64)]),
        (4 + 2 * 64 + 5, 4, vec![(4, 64), (68, 69)]),
        (4 + 3 * 64 + 63, 4, vec![(4, 64), (68, 64), (132, 127)]),
    ];
    let shape = KvShape::new(2, 4, 16).unwrap();
    for (n, sink, segs) in cases {
        assert_eq!(prompt_segments(n, 4, 64), (sink, segs.clone()), "n = {n}");
        let (k, v) = structured_kv(n, 2, 16, n as u64);
        let mut cache = MosaicCache::new(shape, small_config()).unwrap();
        cache.prefill(k.view(), v.view()).unwrap();
        let c = cache.compressed();
        assert_eq!(c.sink.tokens, sink, "n = {n}");
        let got: Vec<(usize, usize)> = c.segments.iter().map(|s| (s.start, s.len)).collect();
        assert_eq!(got, segs, "n = {n}");
        assert!(c.segments.iter().all(|s| s.state == SegmentState::Closed));
        assert_eq!(c.buffer.tokens, 0);
        assert_accounting(&cache);
    }
}

#[test]
fn appends_fill_sink_then_buffer_and_flush() {
    let shape = KvShape::new(2, 4, 16).unwrap();
    let cfg = small_config();
    let (k, v) = structured_kv(300, 2, 16, 11);
    for prompt in [0usize, 2, 4, 70] {
        let mut cache = MosaicCache::new(shape, cfg.clone()).unwrap();
        cache
            .prefill(k.slice(s![..prompt, .., ..]), v.slice(s![..prompt, .., ..]))
            .unwrap();
        for t in prompt..300 {
            cache
                .append(k.index_axis(Axis(0), t), v.index_axis(Axis(0), t))
                .unwrap();
            assert_eq!(cache.len(), t + 1);
            assert_accounting(&cache);
            let c = cache.compressed();
            assert_eq!(c.sink.tokens, 4.min(t + 1));
            assert!(c.buffer.tokens < cfg.buffer_capacity);
        }
        // Host rows equal the original f32 rows of their tokens.
        let c = cache.compressed();
        let (hk, _) = cache.host_rows();
        let host_tokens = hk.len() / 32;
        let first = 300 - host_tokens;
        let want: Vec<f32> = k.slice(s![first.., .., ..]).iter().copied().collect();
        assert_eq!(hk, &want[..]);
        assert!(c.segments.last().is_some());
    }
}

/// Rows `[n, D]` from the span of `basis` (rank x D) with small noise.
fn subspace_rows(n: usize, basis: &Array2<f32>, seed: u64) -> Array2<f32> {
    let coef = random_rows(n, basis.nrows(), 1.0, seed);
    let noise = random_rows(n, basis.ncols(), 0.01, seed + 1);
    coef.dot(basis) + noise
}

#[test]
fn generated_segment_closes_at_first_drifted_flush() {
    let (first_drifted, close) = check_drift_close(16);
    assert_eq!(close, first_drifted);
}

/// SPEC.md 10.3: a drifted segment shorter than `min_segment_len` stays open;
/// it closes at the first flush at which it is long enough (here 8 flushes,
/// past the first drifted one).
#[test]
fn generated_segment_close_waits_for_min_segment_len() {
    let (first_drifted, close) = check_drift_close(128);
    assert!(
        first_drifted < 8,
        "the data must drift before the minimum length: flush {first_drifted}"
    );
    assert_eq!(close, 8);
}

/// Generates rows that drift to a new subspace mid-flush after a prompt,
/// with `min_segment_len` as given, and checks flush by flush that the open
/// segment closes exactly at the flush the rule of SPEC.md 10.3, computed
/// independently here, names. Returns (first flush whose loss exceeds the
/// margin, the flush that closed).
fn check_drift_close(min_segment_len: usize) -> (usize, usize) {
    let d = 32;
    let shape = KvShape::new(1, 2, d).unwrap();
    let cfg = CompressConfig {
        channels: ChannelPolicy::Fixed {
            retention: 0.25,
            group_size: 1,
        },
        input_segment_len: 64,
        buffer_capacity: 16,
        block_sizes: vec![16],
        max_segment_len: 4096,
        min_segment_len,
        sink_tokens: 4,
        ..CompressConfig::default()
    };
    let basis_a = random_rows(4, d, 1.0, 1);
    let basis_b = random_rows(4, d, 1.0, 2);
    let prompt_n = 4 + 64;
    let drift_at = prompt_n + 5 * 16 + 7; // mid-flush: the close waits for a flush
    let total = drift_at + 20 * 16;
    let mut rows_k = Array2::<f32>::zeros((total, d));
    rows_k
        .slice_mut(s![..drift_at, ..])
        .assign(&subspace_rows(drift_at, &basis_a, 10));
    rows_k
        .slice_mut(s![drift_at.., ..])
        .assign(&subspace_rows(total - drift_at, &basis_b, 20));
    let rows_v = rows_k.mapv(|x| 0.5 * x);
    let k3 = rows_k.clone().insert_axis(Axis(1));
    let v3 = rows_v.clone().insert_axis(Axis(1));

    // Expected close flush, computed independently: the temporary strategy is
    // the prompt segment's (fitted on its rows); flush f covers generated
    // tokens prompt_n .. prompt_n + 16 f.
    let strategy = ReferenceBackend
        .fit_strategy(
            rows_k.slice(s![4..prompt_n, ..]),
            rows_v.slice(s![4..prompt_n, ..]),
            &cfg,
        )
        .unwrap();
    let mut first_drifted = None;
    let mut expected = None;
    for f in 1..=(total - prompt_n) / 16 {
        let end = prompt_n + 16 * f;
        let lk = side_loss(
            rows_k.slice(s![prompt_n..end, ..]),
            &strategy.key,
            Side::Key,
        );
        let lv = side_loss(
            rows_v.slice(s![prompt_n..end, ..]),
            &strategy.value,
            Side::Value,
        );
        if lk > strategy.key.fit_loss + cfg.segment_loss_margin
            || lv > strategy.value.fit_loss + cfg.segment_loss_margin
        {
            first_drifted.get_or_insert(f);
            if 16 * f >= min_segment_len {
                expected = Some(f);
                break;
            }
        }
    }
    let first_drifted = first_drifted.expect("the data must drift");
    let expected = expected.expect("the drift must trigger a close");
    assert!(
        prompt_n + 16 * first_drifted > drift_at,
        "the loss must exceed the margin only after the drift"
    );

    let mut cache = MosaicCache::new(shape, cfg.clone()).unwrap();
    cache
        .prefill(
            k3.slice(s![..prompt_n, .., ..]),
            v3.slice(s![..prompt_n, .., ..]),
        )
        .unwrap();
    assert_eq!(cache.compressed().segments[0].heads[0].strategy, strategy);
    for t in prompt_n..total {
        cache
            .append(k3.index_axis(Axis(0), t), v3.index_axis(Axis(0), t))
            .unwrap();
        let generated = t + 1 - prompt_n;
        if generated % 16 != 0 {
            continue;
        }
        let f = generated / 16;
        let seg = &cache.compressed().segments[1];
        if f < expected {
            assert_eq!(
                seg.state,
                SegmentState::Open,
                "flush {f} must not close (expected {expected})"
            );
            assert_eq!(
                seg.heads[0].strategy, strategy,
                "open segment uses the temporary strategy"
            );
        } else {
            assert_eq!(
                seg.state,
                SegmentState::Closed,
                "flush {expected} must close"
            );
            assert_eq!(seg.len, 16 * expected);
            // The closed segment has its own strategy, fitted on its rows.
            let own = ReferenceBackend
                .fit_strategy(
                    rows_k.slice(s![prompt_n..prompt_n + seg.len, ..]),
                    rows_v.slice(s![prompt_n..prompt_n + seg.len, ..]),
                    &cfg,
                )
                .unwrap();
            assert_eq!(seg.heads[0].strategy, own);
            if f == expected {
                assert_eq!(cache.host_rows().0.len(), 0, "host rows dropped at close");
            }
            if cache.compressed().segments.len() > 2 {
                // The next segment's temporary strategy is the closed one's.
                assert_eq!(cache.compressed().segments[2].heads[0].strategy, own);
            }
        }
        assert_accounting(&cache);
    }
    (first_drifted, expected)
}

#[test]
fn generated_segment_closes_at_max_len() {
    let shape = KvShape::new(2, 2, 16).unwrap();
    let cfg = CompressConfig {
        buffer_capacity: 16,
        block_sizes: vec![16],
        max_segment_len: 48,
        segment_loss_margin: 1.0, // only the length can close a segment
        input_segment_len: 64,
        ..CompressConfig::default()
    };
    let (k, v) = structured_kv(4 + 64 + 200, 2, 16, 5);
    let mut cache = MosaicCache::new(shape, cfg).unwrap();
    cache
        .prefill(k.slice(s![..68, .., ..]), v.slice(s![..68, .., ..]))
        .unwrap();
    for t in 68..268 {
        cache
            .append(k.index_axis(Axis(0), t), v.index_axis(Axis(0), t))
            .unwrap();
        assert_accounting(&cache);
        let c = cache.compressed();
        for seg in &c.segments[1..] {
            match seg.state {
                SegmentState::Closed => assert_eq!(seg.len, 48),
                SegmentState::Open => assert!(seg.len < 48 && seg.len % 16 == 0),
            }
        }
    }
    // 200 generated tokens: 4 closed segments of 48 (192), 8 in the buffer.
    let c = cache.compressed();
    let generated: Vec<(usize, SegmentState)> =
        c.segments[1..].iter().map(|s| (s.len, s.state)).collect();
    assert_eq!(generated, vec![(48, SegmentState::Closed); 4]);
    assert_eq!(c.buffer.tokens, 8);
}

#[test]
fn lossless_setting_equals_full_attention_up_to_f16() {
    // r = D, g = 1, no truncation, token_rate 1: every token attended, every
    // rotated element kept. The only differences from FullCache are storage
    // rounding: Full keeps f16(k), Mosaic keeps f16(R^T k) with R stored in f32.
    // Bound: each stored element has relative error <= u = 2^-11 (f16), so
    // |q . (k - k_stored)| <= u ||q|| ||k|| per cache, plus the f32 rotation's
    // deviation from orthogonality (<= D * 2^-24 relative). With eps_t the
    // resulting logit difference bound for token t, softmax weights change by
    // at most a factor e^(2 eps), so per head
    //   ||o_m - o_f|| <= (e^(2 eps) - 1) max||v|| + (2u + D 2^-24) max||v||.
    let d = 32;
    let shape = KvShape::new(2, 4, d).unwrap();
    let cfg = CompressConfig {
        channels: ChannelPolicy::Fixed {
            retention: 1.0,
            group_size: 1,
        },
        truncate_fraction: 0.0,
        token_rate: 1.0,
        input_segment_len: 64,
        buffer_capacity: 16,
        block_sizes: vec![16],
        max_segment_len: 64,
        ..CompressConfig::default()
    };
    let n = 300;
    let (k, v) = structured_kv(n, 2, d, 3);
    let q = queries(4, d, &k, 4);
    let mut mosaic = MosaicCache::new(shape, cfg).unwrap();
    let mut full = FullCache::new(shape);
    mosaic
        .prefill(k.slice(s![..150, .., ..]), v.slice(s![..150, .., ..]))
        .unwrap();
    full.prefill(k.slice(s![..150, .., ..]), v.slice(s![..150, .., ..]))
        .unwrap();
    for t in 150..n {
        mosaic
            .append(k.index_axis(Axis(0), t), v.index_axis(Axis(0), t))
            .unwrap();
        full.append(k.index_axis(Axis(0), t), v.index_axis(Axis(0), t))
            .unwrap();
    }
    assert!(
        mosaic
            .compressed()
            .segments
            .iter()
            .any(|s| s.state == SegmentState::Open)
            || mosaic.compressed().segments.len() > 3
    );
    let (mut om, mut of) = (Array2::<f32>::zeros((4, d)), Array2::<f32>::zeros((4, d)));
    mosaic.attend(q.view(), om.view_mut()).unwrap();
    full.attend(q.view(), of.view_mut()).unwrap();
    let u = 2f64.powi(-11);
    let u_r = d as f64 * 2f64.powi(-24);
    let mut worst_ratio = 0.0f64;
    for h in 0..4 {
        let j = h / 2;
        let qn = q
            .row(h)
            .iter()
            .map(|&x| f64::from(x).powi(2))
            .sum::<f64>()
            .sqrt();
        let max_k = (0..n)
            .map(|t| {
                k.slice(s![t, j, ..])
                    .iter()
                    .map(|&x| f64::from(x).powi(2))
                    .sum::<f64>()
                    .sqrt()
            })
            .fold(0.0, f64::max);
        let max_v = (0..n)
            .map(|t| {
                v.slice(s![t, j, ..])
                    .iter()
                    .map(|&x| f64::from(x).powi(2))
                    .sum::<f64>()
                    .sqrt()
            })
            .fold(0.0, f64::max);
        let eps = (2.0 * u + u_r) * qn * max_k / (d as f64).sqrt();
        let bound = ((2.0 * eps).exp() - 1.0) * max_v + (2.0 * u + u_r) * max_v;
        let diff = om
            .row(h)
            .iter()
            .zip(of.row(h))
            .map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(
            diff <= bound,
            "head {h}: ||o_m - o_f|| = {diff:e} > bound {bound:e}"
        );
        worst_ratio = worst_ratio.max(diff / bound);
    }
    println!(
        "lossless: rel_l2 {:.3e}, worst diff/bound {:.3}",
        rel_l2(om.view(), of.view()),
        worst_ratio
    );
}

fn attend_of(cache: &mut dyn KvCache, q: &Array2<f32>) -> Array2<f32> {
    let shape = cache.shape();
    let mut out = Array2::<f32>::zeros((shape.q_heads, shape.head_dim));
    cache.attend(q.view(), out.view_mut()).unwrap();
    out
}

#[test]
fn bad_input_is_rejected_and_changes_nothing() {
    let d = 16;
    let shape = KvShape::new(2, 4, d).unwrap();
    let cfg = small_config();
    let (k, v) = structured_kv(100, 2, d, 1);
    let q = queries(4, d, &k, 2);
    let mut caches: Vec<Box<dyn KvCache>> = vec![
        Box::new(MosaicCache::new(shape, cfg.clone()).unwrap()),
        Box::new(FullCache::new(shape)),
        Box::new(QuestCache::new(shape, 0.1).unwrap()),
        Box::new(Naive2dCache::new(shape, 0.1, 0.5).unwrap()),
    ];
    for cache in caches.iter_mut() {
        // Empty cache.
        let mut out = Array2::<f32>::zeros((4, d));
        assert_eq!(
            cache.attend(q.view(), out.view_mut()),
            Err(MosaicError::EmptyCache)
        );
        cache
            .prefill(k.slice(s![..80, .., ..]), v.slice(s![..80, .., ..]))
            .unwrap();
        // 15 appends: the next one fills the MosaicKV buffer and flushes.
        for t in 80..95 {
            cache
                .append(k.index_axis(Axis(0), t), v.index_axis(Axis(0), t))
                .unwrap();
        }
        let before_mem = cache.memory();
        let before_len = cache.len();
        let before_out = attend_of(cache.as_mut(), &q);

        assert_eq!(
            cache.prefill(k.view(), v.view()),
            Err(MosaicError::AlreadyPrefilled(95))
        );
        let mut nan_key = k.index_axis(Axis(0), 95).to_owned();
        nan_key[[1, 3]] = f32::NAN;
        assert!(matches!(
            cache.append(nan_key.view(), v.index_axis(Axis(0), 95)),
            Err(MosaicError::NonFinite { .. })
        ));
        let mut inf_val = v.index_axis(Axis(0), 95).to_owned();
        inf_val[[0, 0]] = f32::INFINITY;
        assert!(matches!(
            cache.append(k.index_axis(Axis(0), 95), inf_val.view()),
            Err(MosaicError::NonFinite { .. })
        ));
        let huge = k.index_axis(Axis(0), 95).mapv(|x| x * 1e6);
        assert!(matches!(
            cache.append(huge.view(), v.index_axis(Axis(0), 95)),
            Err(MosaicError::NonFinite { .. })
        ));
        let wrong = Array2::<f32>::zeros((2, d + 1));
        assert!(matches!(
            cache.append(wrong.view(), wrong.view()),
            Err(MosaicError::ShapeMismatch { .. })
        ));
        let mut nan_q = q.clone();
        nan_q[[2, 2]] = f32::NEG_INFINITY;
        let mut out = Array2::<f32>::zeros((4, d));
        assert!(matches!(
            cache.attend(nan_q.view(), out.view_mut()),
            Err(MosaicError::NonFinite { .. })
        ));
        let bad_q = Array2::<f32>::zeros((3, d));
        assert!(matches!(
            cache.attend(bad_q.view(), out.view_mut()),
            Err(MosaicError::ShapeMismatch { .. })
        ));
        let mut bad_out = Array2::<f32>::zeros((4, d - 1));
        assert!(matches!(
            cache.attend(q.view(), bad_out.view_mut()),
            Err(MosaicError::ShapeMismatch { .. })
        ));

        assert_eq!(cache.memory(), before_mem);
        assert_eq!(cache.len(), before_len);
        assert_eq!(attend_of(cache.as_mut(), &q), before_out);
    }
    // Prefill shape errors on a fresh cache.
    let mut cache = MosaicCache::new(shape, cfg.clone()).unwrap();
    let wrong = Array3::<f32>::zeros((10, 3, d));
    assert!(matches!(
        cache.prefill(wrong.view(), wrong.view()),
        Err(MosaicError::ShapeMismatch { .. })
    ));
    let mut nan_k = k.clone();
    nan_k[[50, 1, 1]] = f32::NAN;
    assert!(matches!(
        cache.prefill(nan_k.view(), v.view()),
        Err(MosaicError::NonFinite { .. })
    ));
    assert!(cache.is_empty());
    // Configuration errors.
    let bad_g = CompressConfig {
        channels: ChannelPolicy::Fixed {
            retention: 0.25,
            group_size: 3,
        },
        ..CompressConfig::default()
    };
    assert_eq!(
        MosaicCache::new(shape, bad_g).err(),
        Some(MosaicError::GroupSizeNotDivisor {
            head_dim: 16,
            group_size: 3
        })
    );
    assert!(matches!(
        MosaicCache::new(
            KvShape {
                kv_heads: 2,
                q_heads: 3,
                head_dim: 16
            },
            cfg
        ),
        Err(MosaicError::GqaMismatch { .. })
    ));
    assert!(QuestCache::new(shape, 0.0).is_err());
    assert!(Naive2dCache::new(shape, 0.1, 1.5).is_err());
}

#[test]
fn from_parts_round_trips_and_rejects_inconsistency() {
    let shape = KvShape::new(2, 4, 16).unwrap();
    let (k, v) = structured_kv(130, 2, 16, 8);
    let q = queries(4, 16, &k, 9);
    let mut cache = MosaicCache::new(shape, small_config()).unwrap();
    cache
        .prefill(k.slice(s![..70, .., ..]), v.slice(s![..70, .., ..]))
        .unwrap();
    for t in 70..130 {
        cache
            .append(k.index_axis(Axis(0), t), v.index_axis(Axis(0), t))
            .unwrap();
    }
    let (hk, hv) = cache.host_rows();
    let mut copy =
        MosaicCache::from_parts(cache.compressed().clone(), hk.to_vec(), hv.to_vec()).unwrap();
    assert_eq!(attend_of(&mut copy, &q), attend_of(&mut cache, &q));
    assert_eq!(copy.memory(), cache.memory());
    // Appending the same token to both keeps them identical (the open segment's loss sums were rebuilt).
    for t in 0..40 {
        let (kt, vt) = (
            k.index_axis(Axis(0), t % 130),
            v.index_axis(Axis(0), (t * 7) % 130),
        );
        cache.append(kt, vt).unwrap();
        copy.append(kt, vt).unwrap();
    }
    assert_eq!(copy.compressed(), cache.compressed());
    // Inconsistent parts.
    let (hk, hv) = cache.host_rows();
    assert!(
        MosaicCache::from_parts(cache.compressed().clone(), hk[1..].to_vec(), hv.to_vec()).is_err()
    );
    let mut corrupt = cache.compressed().clone();
    corrupt.segments[0].heads[1].keys.bytes[0] ^= 0xff;
    assert!(matches!(
        MosaicCache::from_parts(corrupt, hk.to_vec(), hv.to_vec()),
        Err(MosaicError::CorruptPacked(_))
    ));
    let mut gap = cache.compressed().clone();
    gap.segments[1].start += 1;
    assert!(matches!(
        MosaicCache::from_parts(gap, hk.to_vec(), hv.to_vec()),
        Err(MosaicError::ShapeMismatch { .. })
    ));
}

/// Issue 40, class 5: host rows of the open segment that are not what its records encode
/// (a crafted file with valid checksums) are `BadFormat` on load, not a cache that switches
/// answers when the segment closes.
#[test]
fn from_parts_rejects_host_rows_that_differ_from_the_open_segment() {
    let shape = KvShape::new(2, 4, 16).unwrap();
    let (k, v) = structured_kv(130, 2, 16, 8);
    let mut cache = MosaicCache::new(shape, small_config()).unwrap();
    cache
        .prefill(k.slice(s![..70, .., ..]), v.slice(s![..70, .., ..]))
        .unwrap();
    for t in 70..130 {
        cache
            .append(k.index_axis(Axis(0), t), v.index_axis(Axis(0), t))
            .unwrap();
    }
    let seg = cache.compressed().segments.last().unwrap();
    assert_eq!(
        seg.state,
        SegmentState::Open,
        "the test needs an open segment"
    );
    let (hk, hv) = cache.host_rows();
    // the untouched parts load
    MosaicCache::from_parts(cache.compressed().clone(), hk.to_vec(), hv.to_vec()).unwrap();
    for side in 0..2 {
        let (mut k2, mut v2) = (hk.to_vec(), hv.to_vec());
        let x = if side == 0 { &mut k2 } else { &mut v2 };
        x[3] = -x[3] + 0.5; // token 0 of the open segment, head 0
        let e = MosaicCache::from_parts(cache.compressed().clone(), k2, v2).unwrap_err();
        assert!(
            matches!(&e, MosaicError::BadFormat(m) if m.contains("open segment")),
            "{e:?}"
        );
    }
}
