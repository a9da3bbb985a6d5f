//! Quick cross-check of the optimized backend against the reference on identical inputs
//! (the full suite is the conformance crate's job): strategies, packed bytes, metadata and
//! selections exactly equal; attention within `ATTEND_REL_L2_PEAKED` (the needle queries
//! of `synthetic::queries` make the softmax peaked; the bound is derived for this data in
//! `mosaickv_conformance::tolerances`).

use mosaickv_conformance::tolerances::ATTEND_REL_L2_PEAKED;
use mosaickv_optimized::{CpuBackend, OptimizedMosaicCache};
use mosaickv_reference::{synthetic, MosaicCache, ReferenceBackend};
use mosaickv_spec::{Backend, CompressConfig, KvCache, KvShape, Side};
use ndarray::{s, Array2};

#[test]
fn encode_meta_select_and_attend_agree() {
    let shape = KvShape::new(2, 8, 64).unwrap();
    let (k, v) = synthetic::structured_kv(1500, 2, 64, 3);
    let rb = ReferenceBackend;
    for cfg in [
        CompressConfig::paper_fixed(),
        CompressConfig {
            input_segment_len: 512,
            ..CompressConfig::default()
        },
    ] {
        for be in [CpuBackend::new(), CpuBackend::portable()] {
            let rows = k.slice(s![4..700, 1, ..]).to_owned();
            let a = be.fit_side(rows.view(), Side::Key, &cfg).unwrap();
            let b = rb.fit_side(rows.view(), Side::Key, &cfg).unwrap();
            assert_eq!(a.layout, b.layout);
            assert_eq!(a.rotation, b.rotation, "rotation bits");
            assert!(
                (a.fit_loss - b.fit_loss).abs() < 1e-9,
                "{} vs {}",
                a.fit_loss,
                b.fit_loss
            );
            let pa = be.encode(rows.view(), &b).unwrap();
            let pb = rb.encode(rows.view(), &b).unwrap();
            assert_eq!(pa, pb, "packed bytes");
            assert_eq!(
                be.block_meta(&pb, &b, 16).unwrap(),
                rb.block_meta(&pb, &b, 16).unwrap()
            );
            assert_eq!(
                be.fit_block_size(rows.view(), &b, &cfg).unwrap(),
                rb.fit_block_size(rows.view(), &b, &cfg).unwrap()
            );
        }
        let mut ours = OptimizedMosaicCache::new(shape, cfg.clone()).unwrap();
        let mut theirs = MosaicCache::new(shape, cfg.clone()).unwrap();
        ours.prefill(k.slice(s![..1200, .., ..]), v.slice(s![..1200, .., ..]))
            .unwrap();
        theirs
            .prefill(k.slice(s![..1200, .., ..]), v.slice(s![..1200, .., ..]))
            .unwrap();
        for t in 1200..1500 {
            ours.append(k.slice(s![t, .., ..]), v.slice(s![t, .., ..]))
                .unwrap();
            theirs
                .append(k.slice(s![t, .., ..]), v.slice(s![t, .., ..]))
                .unwrap();
        }
        let (a, b) = (ours.compressed(), theirs.compressed());
        assert_eq!(a.sink, b.sink, "sink");
        assert_eq!(a.buffer, b.buffer, "buffer");
        assert_eq!(a.segments.len(), b.segments.len(), "segment count");
        for (i, (x, y)) in a.segments.iter().zip(&b.segments).enumerate() {
            assert_eq!(
                (x.start, x.len, x.state),
                (y.start, y.len, y.state),
                "segment {i}"
            );
            for (h, (p, q)) in x.heads.iter().zip(&y.heads).enumerate() {
                assert_eq!(
                    p.strategy.key.layout, q.strategy.key.layout,
                    "seg {i} head {h} key layout"
                );
                assert_eq!(
                    p.strategy.key.rotation, q.strategy.key.rotation,
                    "seg {i} head {h} key rotation"
                );
                assert_eq!(
                    p.strategy.value.rotation, q.strategy.value.rotation,
                    "seg {i} head {h} value rotation"
                );
                assert_eq!(
                    p.strategy.block_size, q.strategy.block_size,
                    "seg {i} head {h} block"
                );
                assert!((p.strategy.key.fit_loss - q.strategy.key.fit_loss).abs() < 1e-9);
                assert_eq!(p.keys, q.keys, "seg {i} head {h} keys");
                assert_eq!(p.values, q.values, "seg {i} head {h} values");
                assert_eq!(p.meta, q.meta, "seg {i} head {h} meta");
            }
        }
        for seed in 0..5 {
            let q = synthetic::queries(8, 64, &k, seed);
            let sel = rb.select(theirs.compressed(), q.view()).unwrap();
            let mut o1 = Array2::zeros((8, 64));
            let mut o2 = Array2::zeros((8, 64));
            CpuBackend::new()
                .attend_selected(theirs.compressed(), q.view(), &sel, o1.view_mut())
                .unwrap();
            rb.attend_selected(theirs.compressed(), q.view(), &sel, o2.view_mut())
                .unwrap();
            let e = mosaickv_benches::rel_l2(o1.view(), o2.view());
            assert!(
                e <= ATTEND_REL_L2_PEAKED,
                "attention rel error {e:e} > {ATTEND_REL_L2_PEAKED:e}"
            );
            // Rotated queries, block scores and the top-k rule are bit-exact (SPEC 8.1-8.3),
            // so the selections must be equal, on every CPU path.
            for be in [CpuBackend::new(), CpuBackend::portable()] {
                let ours_sel = be.select(theirs.compressed(), q.view()).unwrap();
                assert_eq!(
                    ours_sel.per_head.len(),
                    sel.per_head.len(),
                    "seed {seed}: heads"
                );
                for (h, (a, b)) in ours_sel.per_head.iter().zip(&sel.per_head).enumerate() {
                    assert_eq!(
                        a, b,
                        "seed {seed} head {h}: selection differs from the reference"
                    );
                }
            }
        }
    }
}
