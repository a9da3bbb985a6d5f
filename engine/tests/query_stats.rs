//! The engine's query statistics for the attention loss (SPEC.md section 11.1.1), on the real
//! model: `prefill_with_stats` collects one `QueryStats` per layer, equal to what
//! `QueryStats::from_queries` makes of the captured queries, and `Prefill::fill` hands them to
//! the caches, so an `aloss` method chooses its prompt strategies by the attention loss.

use mosaickv_engine::suite::task_sample;
use mosaickv_engine::{model_path, Caches, Method, Model};
use mosaickv_spec::{KvShape, QueryStats};
use mosaickv_tasks::Task;

#[test]
fn prefill_collects_statistics_and_fill_uses_them() {
    let model = Model::load(&model_path(None).expect("model")).expect("load model");
    let c = model.config().clone();
    let (_, ids) = task_sample(&model, Task::NiahSingleNoise, 512, 0).unwrap();
    let pre = model.prefill_with_stats(&ids).unwrap();
    let plain = model.prefill_with_queries(&ids).unwrap();
    assert_eq!(pre.query_stats.len(), c.n_layers);
    assert!(plain.query_stats.is_empty() && model.prefill(&ids).unwrap().queries.is_empty());
    let shape = KvShape::new(c.kv_heads, c.q_heads, c.head_dim).unwrap();
    for l in [0, c.n_layers - 1] {
        let want = QueryStats::from_queries(
            &shape,
            plain.keys[l].view(),
            plain.values[l].view(),
            plain.queries[l].view(),
            mosaickv_engine::STATS_SAMPLE,
        )
        .unwrap();
        assert_eq!(pre.query_stats[l], want, "layer {l}");
        assert_eq!(want.tokens(), ids.len());
        // The weights of each KV head are probabilities averaged over queries: they sum to 1.
        for h in 0..c.kv_heads {
            let (w, _) = want.weights(h, 0, ids.len()).unwrap();
            assert!((w.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        }
    }
    // Loose thresholds (the attention loss lets every head take a cheap candidate) against
    // the same thresholds without statistics (the energy fallback keeps more channels).
    let attention = Method::parse("mosaic:aloss=100/100").unwrap();
    assert!(attention.wants_query_stats());
    assert!(!Method::parse("mosaic").unwrap().wants_query_stats());
    let bytes = |p: &mosaickv_engine::Prefill| -> usize {
        let mut caches = attention.new_caches(model.config()).unwrap();
        p.fill(&mut caches).unwrap();
        caches.iter().map(|c| c.bytes()).sum()
    };
    let (with, without) = (bytes(&pre), bytes(&plain));
    assert!(with < without, "{with} vs {without} bytes");
}
