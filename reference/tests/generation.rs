//! Long generation through the reference `MosaicCache` (SPEC.md section 10.3):
//! drifting, real-model-like rows (`synthetic::drifting_kv`) after a
//! 1,024-token prompt must not cascade into short generated segments.
//! `optimized/tests/generation.rs` checks the same on the optimized caches;
//! the bound is the one stated there: every generated segment but the last is
//! at least `min_segment_len` long, so their rotations cost at most
//! `2 * D / min_segment_len` of a dense f16 row per generated token (1/8 at
//! D = 64 and the default 1,024), where the rule without a minimum closed every 64 tokens.

use mosaickv_reference::synthetic::drifting_kv;
use mosaickv_reference::MosaicCache;
use mosaickv_spec::{CompressConfig, KvCache, KvShape, SegmentState};
use ndarray::s;

const PROMPT: usize = 1024;
const GENERATED: usize = 8192;

#[test]
fn long_generation_segments_stay_bounded() {
    let shape = KvShape::new(2, 8, 64).unwrap();
    let (kv, d) = (shape.kv_heads, shape.head_dim);
    let (keys, values) = drifting_kv(PROMPT + GENERATED, kv, d, 7, 1024.0);
    for (name, cfg) in [
        ("default", CompressConfig::default()),
        ("paper_fixed", CompressConfig::paper_fixed()),
        // The paper's 65,536 cap, out of reach: the loss rule alone closes.
        (
            "uncapped",
            CompressConfig {
                max_segment_len: 65_536,
                ..CompressConfig::default()
            },
        ),
    ] {
        let mut cache = MosaicCache::new(shape, cfg.clone()).unwrap();
        cache
            .prefill(
                keys.slice(s![..PROMPT, .., ..]),
                values.slice(s![..PROMPT, .., ..]),
            )
            .unwrap();
        for t in PROMPT..PROMPT + GENERATED {
            cache
                .append(keys.slice(s![t, .., ..]), values.slice(s![t, .., ..]))
                .unwrap();
        }
        let c = cache.compressed();
        let generated: Vec<_> = c.segments.iter().filter(|s| s.start >= PROMPT).collect();
        let lens: Vec<usize> = generated.iter().map(|s| s.len).collect();
        for seg in &generated[..generated.len() - 1] {
            assert_eq!(seg.state, SegmentState::Closed, "{name}: {lens:?}");
            assert!(seg.len >= cfg.min_segment_len, "{name}: {lens:?}");
        }
        let max_segments = GENERATED.div_ceil(cfg.min_segment_len);
        assert!(generated.len() <= max_segments, "{name}: {lens:?}");
        let rotation_bytes: usize = generated
            .iter()
            .flat_map(|s| &s.heads)
            .map(|h| 4 * (h.strategy.key.rotation.len() + h.strategy.value.rotation.len()))
            .sum();
        let per_token = rotation_bytes as f64 / GENERATED as f64;
        let dense_row = (4 * kv * d) as f64;
        assert!(
            per_token <= dense_row * 2.0 * d as f64 / cfg.min_segment_len as f64,
            "{name}: {per_token} rotation B per generated token, dense row {dense_row}: {lens:?}"
        );
        let closed = generated
            .iter()
            .filter(|s| s.state == SegmentState::Closed)
            .count();
        assert!(closed > 0, "{name}: no generated segment closed: {lens:?}");
        eprintln!(
            "{name} reference: {} generated segments ({closed} closed), lengths {lens:?}, \
             {per_token:.1} rotation B per generated token (dense f16 row {dense_row} B)",
            generated.len()
        );
    }
}
