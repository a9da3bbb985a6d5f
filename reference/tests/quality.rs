//! Compression quality on structured synthetic data: default MosaicKV vs the
//! naive 2-D baseline at no fewer bytes per token (SPEC.md sections 12, 13, 16).

use mosaickv_reference::metrics::{full_attention_probs, recall_at_k, rel_l2};
use mosaickv_reference::synthetic::{queries, structured_kv};
use mosaickv_reference::{FullCache, MosaicCache, Naive2dCache};
use mosaickv_spec::{CompressConfig, KvCache, KvShape};
use ndarray::{s, Array2, Axis};

fn attend(cache: &mut dyn KvCache, q: &Array2<f32>) -> Array2<f32> {
    let shape = cache.shape();
    let mut out = Array2::<f32>::zeros((shape.q_heads, shape.head_dim));
    cache.attend(q.view(), out.view_mut()).unwrap();
    out
}

/// Default MosaicKV (with `token_rate = rate`) vs naive 2-D at no fewer bytes/token and the
/// same token rate; asserts `mosaic error < margin * naive error`.
fn compare(d: usize, rate: f64, margin: f64) {
    let (n, kvh, qh) = (4096usize, 2usize, 8usize);
    let shape = KvShape::new(kvh, qh, d).unwrap();
    let (k, v) = structured_kv(n, kvh, d, 2024 + d as u64);
    let prompt = n - 100; // the last 100 tokens arrive by append (one flush + buffer)
    let mut mosaic = MosaicCache::new(
        shape,
        CompressConfig {
            token_rate: rate,
            ..CompressConfig::default()
        },
    )
    .unwrap();
    let mut full = FullCache::new(shape);
    mosaic
        .prefill(k.slice(s![..prompt, .., ..]), v.slice(s![..prompt, .., ..]))
        .unwrap();
    full.prefill(k.slice(s![..prompt, .., ..]), v.slice(s![..prompt, .., ..]))
        .unwrap();
    for t in prompt..n {
        mosaic
            .append(k.index_axis(Axis(0), t), v.index_axis(Axis(0), t))
            .unwrap();
        full.append(k.index_axis(Axis(0), t), v.index_axis(Axis(0), t))
            .unwrap();
    }
    let mosaic_bpt = mosaic.memory().bytes_per_token();
    // The smallest naive retention whose bytes/token are at least MosaicKV's.
    let mut naive = None;
    for c in 1..=d {
        let mut cand = Naive2dCache::new(shape, rate, c as f64 / d as f64).unwrap();
        cand.prefill(k.slice(s![..prompt, .., ..]), v.slice(s![..prompt, .., ..]))
            .unwrap();
        for t in prompt..n {
            cand.append(k.index_axis(Axis(0), t), v.index_axis(Axis(0), t))
                .unwrap();
        }
        if cand.memory().bytes_per_token() >= mosaic_bpt {
            naive = Some((c, cand));
            break;
        }
    }
    let (c, mut naive) = naive.expect("a naive retention reaching MosaicKV's bytes");
    let naive_bpt = naive.memory().bytes_per_token();
    let dense_bpt = (4 * kvh * d) as f64;
    let (mut err_m, mut err_n, mut rec_m, mut rec_n) = (0.0, 0.0, 0.0, 0.0);
    let steps = 4;
    for step in 0..steps {
        let q = queries(qh, d, &k, 77 + step);
        let o_full = attend(&mut full, &q);
        err_m += rel_l2(attend(&mut mosaic, &q).view(), o_full.view()) / steps as f64;
        err_n += rel_l2(attend(&mut naive, &q).view(), o_full.view()) / steps as f64;
        let probs = full_attention_probs(k.view(), q.view());
        rec_m += recall_at_k(&mosaic.attended_tokens(q.view()).unwrap(), probs.view(), 32)
            / steps as f64;
        rec_n +=
            recall_at_k(&naive.attended_tokens(q.view()).unwrap(), probs.view(), 32) / steps as f64;
    }
    println!(
        "D={d} token_rate {rate}: mosaic rel_l2 {err_m:.4} recall@32 {rec_m:.3} at {mosaic_bpt:.1} B/token; \
         naive (c={c}/{d}) rel_l2 {err_n:.4} recall@32 {rec_n:.3} at {naive_bpt:.1} B/token; dense f16 {dense_bpt} B/token"
    );
    let strategies: Vec<String> = mosaic.compressed().segments[0]
        .heads
        .iter()
        .map(|h| {
            format!(
                "K r={} g={} V r={} g={} b={}",
                h.strategy.key.layout.r,
                h.strategy.key.layout.group_size,
                h.strategy.value.layout.r,
                h.strategy.value.layout.group_size,
                h.strategy.block_size
            )
        })
        .collect();
    println!("D={d}: prompt segment strategies {strategies:?}");
    assert!(mosaic_bpt < dense_bpt, "MosaicKV must compress");
    assert!(
        err_m < margin * err_n,
        "D={d}, rate {rate}: mosaic error {err_m} not below {margin} x naive {err_n}"
    );
}

// Channel side alone (every token attended): the rotation + per-vector top-r
// must clearly beat one fixed channel mask at the same bytes.
#[test]
fn channel_compression_beats_naive_2d_at_equal_bytes_d64() {
    compare(64, 1.0, 0.7);
}

#[test]
fn channel_compression_beats_naive_2d_at_equal_bytes_d128() {
    compare(128, 1.0, 0.7);
}

// Default configuration (token rate 0.10, loss-threshold channels, variance
// rule for b). Measured 2026-11-29: D=64 mosaic 0.35 vs naive 0.62 (0.56x);
// D=128 mosaic 0.15 vs naive 0.55 (0.26x). Asserted: below 0.7x naive.
#[test]
fn default_mosaic_beats_naive_2d_d64() {
    compare(64, 0.10, 0.7);
}

#[test]
fn default_mosaic_beats_naive_2d_d128() {
    compare(128, 0.10, 0.7);
}
