//! The attention loss (SPEC.md section 11.1): the reference and the optimized
//! backend compute the same loss for every candidate, bit for bit, and the
//! three MosaicKV caches given the same query statistics choose the same
//! strategies; without statistics they fall back to the energy loss.

use mosaickv_conformance::{queries, structured_kv};
use mosaickv_optimized::{LiveCache, Mode, OptimizedMosaicCache};
use mosaickv_reference::MosaicCache;
use mosaickv_spec::query::LossContext;
use mosaickv_spec::{
    rules, CompressConfig, CompressedCache, KvCache, KvShape, LossPolicy, QueryStats, Side,
    SideStrategy, ValueDtype,
};
use ndarray::{s, Array3};

const SHAPE: (usize, usize, usize) = (2, 6, 64);

fn config() -> CompressConfig {
    CompressConfig {
        input_segment_len: 96,
        buffer_capacity: 64,
        max_segment_len: 256,
        min_segment_len: 128,
        // Tight enough that these structured rows (which the energy loss lets go with the
        // cheapest candidate) need more channels under the attention loss.
        loss: LossPolicy::Attention {
            key_loss: 1e-5,
            value_loss: 1e-5,
        },
        ..CompressConfig::default()
    }
}

/// Prompt K/V and prefill queries whose energy sits in a few dims (so `M` is far from
/// isotropic and the attention loss ranks candidates unlike the energy loss).
fn prompt(n: usize, seed: u64) -> (Array3<f32>, Array3<f32>, QueryStats) {
    let (kv, qh, d) = SHAPE;
    let shape = KvShape::new(kv, qh, d).unwrap();
    let (k, v) = structured_kv(n, kv, d, seed);
    let mut q = Array3::zeros((n, qh, d));
    for t in 0..n {
        let row = queries(qh, d, seed + 7 * t as u64);
        for h in 0..qh {
            for i in 0..d {
                let boost = if i % 8 == h % 8 { 6.0 } else { 0.3 };
                q[[t, h, i]] = row[[h, i]] * boost;
            }
        }
    }
    let stats = QueryStats::from_queries(&shape, k.view(), v.view(), q.view(), 16).unwrap();
    (k, v, stats)
}

/// [`config`] with SPEC.md section 6.1's coded records beside the default's dtypes.
fn coded_config() -> CompressConfig {
    let mut c = config();
    c.value_dtypes.push(ValueDtype::Coded);
    c
}

fn strategies(c: &CompressedCache) -> Vec<(usize, usize, String)> {
    c.segments
        .iter()
        .flat_map(|s| {
            s.heads.iter().map(move |h| {
                (
                    s.start,
                    s.len,
                    format!(
                        "{:?} {:?} {:?} {:?} {}",
                        h.strategy.key.layout,
                        h.strategy.value.layout,
                        h.strategy.key.coding,
                        h.strategy.value.coding,
                        h.strategy.block_size
                    ),
                )
            })
        })
        .collect()
}

#[test]
fn every_candidate_loss_is_bit_identical() {
    let (k, v, stats) = prompt(300, 3);
    let d = SHAPE.2;
    let cfg = coded_config();
    let mut coded_seen = 0;
    for h in 0..SHAPE.0 {
        for (side, rows) in [(Side::Key, &k), (Side::Value, &v)] {
            let rows = rows.slice(s![4..300, h, ..]).to_owned();
            let flat: Vec<f32> = rows.iter().copied().collect();
            let rotation = mosaickv_reference::rotation::fit_rotation(rows.view());
            let ctx = LossContext {
                stats: &stats,
                head: h,
                start: 4,
                len: 296,
            };
            // the rows' rotated coordinates, as the strategy search computes them once
            let mut xr = vec![0f64; flat.len()];
            mosaickv_optimized::rotation::rotate_rows_f64(
                &mosaickv_spec::layout::rotation_f32(&rotation),
                d,
                &flat,
                d,
                &mut xr,
            );
            // every candidate, the coded ones (SPEC 6.1) at their place: the reference's list,
            // which the optimized backend's coded candidates match
            let rotated: Vec<Vec<f64>> = xr.chunks_exact(d).map(|r| r.to_vec()).collect();
            let cands = mosaickv_reference::strategy::side_candidates(&rotated, &cfg, d);
            let (at, coded) = mosaickv_optimized::coded::coded_candidates(&xr, d, &cfg, d).unwrap();
            assert!(!coded.is_empty());
            assert_eq!(
                &cands[at..at + coded.len()],
                &coded[..],
                "head {h} {side:?}"
            );
            assert_eq!(cands.len(), rules::candidates(&cfg, d).len() + coded.len());
            coded_seen += coded.len();
            let opt = mosaickv_optimized::loss::attention_losses(
                &flat, &xr, &rotation, &cands, side, ctx,
            )
            .unwrap();
            let mut distinct = std::collections::BTreeSet::new();
            for (cand, o) in cands.iter().zip(&opt) {
                let layout = cand.layout;
                let st = SideStrategy {
                    rotation: mosaickv_spec::layout::trim_rotation(&rotation, d, layout.kept_dims),
                    ..cand.clone()
                };
                let r = mosaickv_reference::strategy::attention_loss(rows.view(), &st, side, ctx)
                    .unwrap();
                // the one-candidate form (its own encode) agrees with the batched one
                let single =
                    mosaickv_optimized::loss::attention_loss(&flat, &st, side, ctx).unwrap();
                assert_eq!(
                    single.to_bits(),
                    o.to_bits(),
                    "head {h} {side:?} {layout:?}"
                );
                assert_eq!(r.to_bits(), o.to_bits(), "head {h} {side:?} {layout:?}");
                assert!(r.is_finite() && r >= 0.0);
                distinct.insert(r.to_bits());
            }
            assert!(distinct.len() > cands.len() / 2, "losses barely differ");
            // the energy losses of the coded candidates, batched, equal the reference's
            let energy = mosaickv_optimized::coded::coded_losses(&flat, &xr, d, &coded, side);
            for (cand, e) in coded.iter().zip(&energy) {
                let st = SideStrategy {
                    rotation: mosaickv_spec::layout::trim_rotation(
                        &rotation,
                        d,
                        cand.layout.kept_dims,
                    ),
                    ..cand.clone()
                };
                let r = mosaickv_reference::strategy::side_loss(rows.view(), &st, side);
                assert_eq!(
                    r.to_bits(),
                    e.to_bits(),
                    "head {h} {side:?} energy {:?}",
                    cand.layout
                );
            }
        }
    }
    assert!(coded_seen >= 8, "{coded_seen} coded candidates");
}

#[test]
fn caches_choose_the_same_strategies_with_statistics() {
    let (kv, qh, d) = SHAPE;
    let shape = KvShape::new(kv, qh, d).unwrap();
    for (n, seed, config) in [
        (300usize, 1u64, config()),
        (1000, 2, config()),
        (40, 3, config()),
        (300, 4, coded_config()),
        (1000, 5, coded_config()),
    ] {
        let config = || config.clone();
        let (k, v, stats) = prompt(n, seed);
        let mut r = MosaicCache::new(shape, config()).unwrap();
        let mut o = OptimizedMosaicCache::new(shape, config()).unwrap();
        let mut l = LiveCache::new(shape, config(), Mode::Sync).unwrap();
        let mut energy = MosaicCache::new(shape, config()).unwrap();
        for c in [&mut r as &mut dyn KvCache, &mut o, &mut l] {
            c.set_query_stats(Some(stats.clone())).unwrap();
            c.prefill(k.view(), v.view()).unwrap();
        }
        energy.prefill(k.view(), v.view()).unwrap();
        assert_eq!(r.loss_in_use(), "attention");
        assert_eq!(o.loss_in_use(), "attention");
        assert_eq!(l.loss_in_use(), "attention");
        assert_eq!(
            energy.loss_in_use(),
            "energy (fallback: no query statistics)"
        );
        let want = strategies(r.compressed());
        if config().value_dtypes.contains(&ValueDtype::Coded) {
            // coded candidates are chosen somewhere (else they would go untested here)
            assert!(
                want.iter().any(|w| w.2.contains("Coded")),
                "n = {n}: {want:?}"
            );
        }
        assert_eq!(want, strategies(o.compressed()), "optimized, n = {n}");
        assert_eq!(want, strategies(l.compressed()), "live, n = {n}");
        if n >= 300 {
            // The statistics change what is chosen (else this test could not fail).
            assert_ne!(want, strategies(energy.compressed()), "n = {n}");
        }
    }
}

#[test]
fn bad_statistics_are_refused_and_change_nothing() {
    let (kv, qh, d) = SHAPE;
    let shape = KvShape::new(kv, qh, d).unwrap();
    let (_, _, stats) = prompt(50, 4);
    let mut wrong = stats.clone();
    wrong.key_moment.pop();
    let mut nan = stats.clone();
    nan.key_moment[3] = f64::NAN;
    for bad in [wrong, nan] {
        let mut r = MosaicCache::new(shape, config()).unwrap();
        let mut o = OptimizedMosaicCache::new(shape, config()).unwrap();
        let mut l = LiveCache::new(shape, config(), Mode::Sync).unwrap();
        for c in [&mut r as &mut dyn KvCache, &mut o, &mut l] {
            assert!(c.set_query_stats(Some(bad.clone())).is_err());
        }
        assert_eq!(r.loss_in_use(), "energy (fallback: no query statistics)");
        assert_eq!(o.loss_in_use(), "energy (fallback: no query statistics)");
        assert_eq!(l.loss_in_use(), "energy (fallback: no query statistics)");
    }
}
