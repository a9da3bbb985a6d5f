//! Generated segments and `min_segment_len` (SPEC.md sections 2 and 10.3):
//! 8,192 generated tokens after a 1,024-token prompt, D = 64, 2 KV heads,
//! 8 query heads, for the default and the paper's configuration, rows from
//! `synthetic::structured_kv` (no drift) and `synthetic::drifting_kv`, at
//! several `min_segment_len` (64 = one flush is the rule without a minimum).
//! Prints per run: generated segments, rotation bytes per generated token
//! (dense f16 row: 512 B), device bytes per token, and the relative L2 error
//! of attention against full attention (mean and standard deviation over 16
//! query sets whose needles lie in the generated tokens).
//!
//! ```text
//! cargo run --release -p mosaickv-optimized --example segment_lengths [-- 64,1024,4096,16384]
//! ```

use mosaickv_optimized::OptimizedMosaicCache;
use mosaickv_reference::metrics::{full_attention, rel_l2};
use mosaickv_reference::synthetic::{drifting_kv, queries, structured_kv};
use mosaickv_spec::{CompressConfig, KvCache, KvShape, SegmentState};
use ndarray::{s, Array2};

const PROMPT: usize = 1024;
const GENERATED: usize = 8192;
const QUERY_SETS: u64 = 16;

fn main() {
    let mins: Vec<usize> = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "64,1024,4096,16384".into())
        .split(',')
        .map(|x| x.parse().expect("min_segment_len values, comma-separated"))
        .collect();
    let shape = KvShape::new(2, 8, 64).unwrap();
    let (kv, d) = (shape.kv_heads, shape.head_dim);
    for (name, base) in [
        ("default", CompressConfig::default()),
        ("paper_fixed", CompressConfig::paper_fixed()),
    ] {
        // 0 = no drift (structured_kv).
        for drift in [0.0f64, 4096.0, 1024.0] {
            let n = PROMPT + GENERATED;
            let (k, v) = if drift == 0.0 {
                structured_kv(n, kv, d, 7)
            } else {
                drifting_kv(n, kv, d, 7, drift)
            };
            let generated_keys = k.slice(s![PROMPT.., .., ..]).to_owned();
            let query_sets: Vec<Array2<f32>> = (0..QUERY_SETS)
                .map(|i| queries(shape.q_heads, d, &generated_keys, 100 + i))
                .collect();
            for &min in &mins {
                let cfg = CompressConfig {
                    min_segment_len: min,
                    ..base.clone()
                };
                let mut cache = OptimizedMosaicCache::new(shape, cfg).unwrap();
                cache
                    .prefill(k.slice(s![..PROMPT, .., ..]), v.slice(s![..PROMPT, .., ..]))
                    .unwrap();
                for t in PROMPT..n {
                    cache
                        .append(k.slice(s![t, .., ..]), v.slice(s![t, .., ..]))
                        .unwrap();
                }
                let errors: Vec<f64> = query_sets
                    .iter()
                    .map(|q| {
                        let mut out = Array2::zeros((shape.q_heads, d));
                        cache.attend(q.view(), out.view_mut()).unwrap();
                        rel_l2(
                            out.view(),
                            full_attention(k.view(), v.view(), q.view()).view(),
                        )
                    })
                    .collect();
                let mean = errors.iter().sum::<f64>() / errors.len() as f64;
                let sd = (errors.iter().map(|e| (e - mean).powi(2)).sum::<f64>()
                    / errors.len() as f64)
                    .sqrt();
                let c = cache.compressed();
                let gen: Vec<_> = c.segments.iter().filter(|s| s.start >= PROMPT).collect();
                let closed = gen
                    .iter()
                    .filter(|s| s.state == SegmentState::Closed)
                    .count();
                let rotation: usize = gen
                    .iter()
                    .flat_map(|s| &s.heads)
                    .map(|h| 4 * (h.strategy.key.rotation.len() + h.strategy.value.rotation.len()))
                    .sum();
                println!(
                    "{name:<11} drift {drift:>6} min {min:>5}: {:>3} generated segments ({closed:>3} closed), \
                     rotation {:>6.1} B/generated token, cache {:>6.1} B/token, attention rel L2 {mean:.3} (sd {sd:.3})",
                    gen.len(),
                    rotation as f64 / GENERATED as f64,
                    cache.memory().bytes_per_token(),
                );
            }
        }
    }
}
