//! A real reference cache with an open segment, a buffer and host rows
//! survives the on-disk format (SPEC.md section 15) bit for bit, and
//! attention on the loaded cache equals attention on the original.

use mosaickv_reference::MosaicCache;
use mosaickv_spec::persist::{read_cache, write_cache};
use mosaickv_spec::{CompressConfig, KvCache, KvShape, SegmentState};
use ndarray::{Array2, Array3};

fn data(n: usize, kv: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n * kv * d)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let noise = ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
            ((i % d) as f32 * 0.37 + (i / (kv * d)) as f32 * 0.01).sin() + 0.3 * noise
        })
        .collect()
}

#[test]
fn open_segment_buffer_and_host_rows_round_trip() {
    let (kv, q, d) = (2, 4, 16);
    let shape = KvShape::new(kv, q, d).unwrap();
    let config = CompressConfig {
        buffer_capacity: 32,
        block_sizes: vec![16, 32],
        max_segment_len: 256,
        input_segment_len: 64,
        ..CompressConfig::default()
    };
    let mut cache = MosaicCache::new(shape, config).unwrap();
    let n = 150;
    let k = Array3::from_shape_vec((n, kv, d), data(n, kv, d, 1)).unwrap();
    let v = Array3::from_shape_vec((n, kv, d), data(n, kv, d, 2)).unwrap();
    cache.prefill(k.view(), v.view()).unwrap();
    let m = 75; // two flushes into an open segment, 11 tokens left in the buffer
    let ak = Array3::from_shape_vec((m, kv, d), data(m, kv, d, 3)).unwrap();
    let av = Array3::from_shape_vec((m, kv, d), data(m, kv, d, 4)).unwrap();
    for t in 0..m {
        cache
            .append(
                ak.index_axis(ndarray::Axis(0), t),
                av.index_axis(ndarray::Axis(0), t),
            )
            .unwrap();
    }
    let (hk, hv) = cache.host_rows();
    assert!(!hk.is_empty(), "the test needs host rows");
    assert!(
        cache.compressed().buffer.tokens > 0,
        "the test needs a buffer"
    );
    let last = cache.compressed().segments.last().unwrap();
    assert_eq!(
        last.state,
        SegmentState::Open,
        "the test needs an open segment"
    );
    assert_eq!(
        hk.len(),
        (last.len + cache.compressed().buffer.tokens) * kv * d
    );

    let mut bytes = Vec::new();
    write_cache(&mut bytes, cache.compressed(), hk, hv).unwrap();
    let (c2, hk2, hv2) = read_cache(&bytes).unwrap();
    assert_eq!(&c2, cache.compressed());
    assert_eq!((hk2.as_slice(), hv2.as_slice()), (hk, hv));
    let mut loaded = MosaicCache::from_parts(c2, hk2, hv2).unwrap();

    let queries = Array2::from_shape_vec((q, d), data(1, q, d, 5)).unwrap();
    let mut a = Array2::zeros((q, d));
    let mut b = Array2::zeros((q, d));
    cache.attend(queries.view(), a.view_mut()).unwrap();
    loaded.attend(queries.view(), b.view_mut()).unwrap();
    assert_eq!(a, b);

    // The loaded cache keeps working: appending more tokens behaves the same.
    for t in 0..30 {
        let (kt, vt) = (
            ak.index_axis(ndarray::Axis(0), t),
            av.index_axis(ndarray::Axis(0), t),
        );
        cache.append(kt, vt).unwrap();
        loaded.append(kt, vt).unwrap();
    }
    assert_eq!(cache.compressed(), loaded.compressed());
}
