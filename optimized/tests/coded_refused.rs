//! SPEC.md section 6.1's coded records run on the reference backend only: every entry of the
//! optimized backend refuses them with a typed error, never a silent bitmap fit or a misread
//! record.

use mosaickv_optimized::{CpuBackend, LiveCache, Mode, OptimizedMosaicCache};
use mosaickv_reference::synthetic::structured_kv;
use mosaickv_reference::{MosaicCache, ReferenceBackend};
use mosaickv_spec::{Backend, CompressConfig, KvCache, KvShape, MosaicError, Side, ValueDtype};
use ndarray::s;

fn coded() -> CompressConfig {
    CompressConfig {
        value_dtypes: vec![ValueDtype::F16, ValueDtype::Coded],
        ..CompressConfig::default()
    }
}

fn refused<T: std::fmt::Debug>(r: mosaickv_spec::Result<T>) {
    match r {
        Err(MosaicError::InvalidConfig(m)) => assert!(m.contains("reference"), "{m}"),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[test]
fn the_optimized_backend_refuses_coded_records_everywhere() {
    let shape = KvShape::new(1, 2, 64).unwrap();
    refused(OptimizedMosaicCache::new(shape, coded()));
    refused(LiveCache::new(shape, coded(), Mode::Sync));
    let (k, v) = structured_kv(300, 1, 64, 2);
    let rows = k.slice(s![.., 0, ..]).to_owned();
    let cpu = CpuBackend::default();
    refused(cpu.fit_side(rows.view(), Side::Key, &coded()));
    // a coded strategy and cache fitted by the reference
    let cfg = CompressConfig {
        value_dtypes: vec![ValueDtype::Coded],
        ..CompressConfig::default()
    };
    let side = ReferenceBackend
        .fit_side(rows.view(), Side::Key, &cfg)
        .unwrap();
    assert_eq!(side.layout.dtype, ValueDtype::Coded);
    refused(cpu.encode(rows.view(), &side));
    let packed = ReferenceBackend.encode(rows.view(), &side).unwrap();
    refused(cpu.decode(&packed, &side));
    refused(cpu.block_meta(&packed, &side, 16));
    let mut cache = MosaicCache::new(shape, cfg).unwrap();
    cache.prefill(k.view(), v.view()).unwrap();
    let q = ndarray::Array2::<f32>::ones((2, 64));
    refused(cpu.select(cache.compressed(), q.view()));
}
