//! SPEC.md section 6.1's coded records on the CPU backend: a configuration that lists only
//! `coded` gives coded strategies in every cache kind (never a silent bitmap fit), and their
//! records decode to within half a step of the rows' rotated f16 values. Agreement with the
//! reference, byte for byte, is the conformance suite's (`conformance/tests/cpu.rs`,
//! `caches.rs`).

use mosaickv_optimized::{CpuBackend, LiveCache, Mode, OptimizedMosaicCache};
use mosaickv_reference::synthetic::structured_kv;
use mosaickv_spec::{
    Backend, ChannelPolicy, CompressConfig, KvCache, KvShape, MosaicError, Side, ValueDtype,
};
use ndarray::s;

fn coded_only() -> CompressConfig {
    CompressConfig {
        value_dtypes: vec![ValueDtype::Coded],
        ..CompressConfig::default()
    }
}

fn all_coded(c: &mosaickv_spec::CompressedCache) -> bool {
    !c.segments.is_empty()
        && c.segments.iter().all(|s| {
            s.heads.iter().all(|h| {
                h.strategy.key.layout.dtype == ValueDtype::Coded
                    && h.strategy.value.layout.dtype == ValueDtype::Coded
                    && h.strategy.key.coding.len() == h.strategy.key.layout.kept_dims
            })
        })
}

#[test]
fn a_coded_only_configuration_gives_coded_segments_in_every_cache() {
    let shape = KvShape::new(2, 4, 64).unwrap();
    let (k, v) = structured_kv(1200, 2, 64, 5);
    let mut o = OptimizedMosaicCache::new(shape, coded_only()).unwrap();
    o.prefill(k.view(), v.view()).unwrap();
    assert!(all_coded(o.compressed()));
    let mut live = LiveCache::new(shape, coded_only(), Mode::Sync).unwrap();
    live.prefill(k.slice(s![..700, .., ..]), v.slice(s![..700, .., ..]))
        .unwrap();
    for t in 700..1200 {
        live.append(k.slice(s![t, .., ..]), v.slice(s![t, .., ..]))
            .unwrap();
    }
    assert!(all_coded(live.compressed()));
    let q = ndarray::Array2::<f32>::ones((4, 64));
    let mut out = ndarray::Array2::<f32>::zeros((4, 64));
    live.attend(q.view(), out.view_mut()).unwrap();
    assert!(out.iter().all(|x| x.is_finite()));
}

#[test]
fn coded_records_decode_within_half_a_step() {
    let (k, _) = structured_kv(400, 1, 64, 9);
    let rows = k.slice(s![.., 0, ..]).to_owned();
    let cpu = CpuBackend::default();
    let side = cpu.fit_side(rows.view(), Side::Key, &coded_only()).unwrap();
    assert_eq!(side.layout.dtype, ValueDtype::Coded);
    let packed = cpu.encode(rows.view(), &side).unwrap();
    assert_eq!(packed.bytes.len(), 400 * side.layout.record_bytes());
    let decoded = cpu.decode(&packed, &side).unwrap();
    let dt = side.layout.kept_dims;
    let rot = mosaickv_spec::layout::rotation_f32(&side.rotation);
    for (i, row) in rows.rows().into_iter().enumerate() {
        for j in 0..dt {
            let x: f64 = (0..64)
                .map(|a| f64::from(row[a]) * f64::from(rot[a * dt + j]))
                .sum();
            let c = side.coding[j];
            // half a step (for a 0-bit dim, the half-range it spans is at most half the
            // ladder step, itself at most the segment's widest range) plus f16 rounding
            let bound = if c.bits == 0 {
                f64::INFINITY
            } else {
                c.scale.to_f64() / 2.0 + x.abs() * 1e-3 + 1e-6
            };
            let err = (f64::from(decoded[[i, j]]) - x).abs();
            assert!(err <= bound, "row {i} dim {j}: {err} > {bound}");
        }
    }
}

#[test]
fn coded_with_the_fixed_policy_is_refused() {
    let cfg = CompressConfig {
        value_dtypes: vec![ValueDtype::Coded],
        ..CompressConfig::paper_fixed()
    };
    assert!(matches!(cfg.channels, ChannelPolicy::Fixed { .. }));
    let shape = KvShape::new(1, 2, 64).unwrap();
    assert!(matches!(
        OptimizedMosaicCache::new(shape, cfg),
        Err(MosaicError::InvalidConfig(_))
    ));
}
