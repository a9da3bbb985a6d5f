//! A decode step in a loop, for profilers (`perf record -p PID`): the compare tool's 131K
//! synthetic layer (Llama-3.1-8B shape, `synthetic::structured_kv`, seed 42) compressed with
//! the shipped default, then `packed_attention` over 8 query sets for SECONDS (default 5),
//! on the cache as built and on a clone of it, twice, and `KvCache::attend`; each prints its
//! mean ms per step. "ready" on stderr marks the end of the setup.
//!
//! `cargo run --release -p mosaickv-benches --example step_loop -- 20`

use mosaickv_optimized::attention::{packed_attention, MosaicScratch, SelectionSource};
use mosaickv_optimized::{OptimizedMosaicCache, Path};
use mosaickv_reference::synthetic;
use mosaickv_spec::{CompressConfig, CompressedCache, KvCache, KvShape};
use ndarray::Array2;
use std::time::Instant;

fn run(label: &str, c: &CompressedCache, qs: &[Array2<f32>], secs: f64) {
    let mut sc = MosaicScratch::default();
    let mut out = vec![0f32; 32 * 128];
    let path = Path::detect();
    let t = Instant::now();
    let mut n = 0;
    while t.elapsed().as_secs_f64() < secs {
        let q = qs[n % qs.len()].as_slice().expect("contiguous");
        packed_attention(
            path,
            c,
            q,
            SelectionSource::Compute,
            false,
            Some(&mut out),
            &mut sc,
        )
        .expect("attention");
        n += 1;
    }
    let ms = t.elapsed().as_secs_f64() * 1e3 / n as f64;
    eprintln!("{label}: {n} steps, {ms:.3} ms/step");
}

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(5.0);
    let shape = KvShape::new(8, 32, 128).expect("shape");
    let (keys, values) = synthetic::structured_kv(131072, 8, 128, 42);
    let mut cache = OptimizedMosaicCache::new(shape, CompressConfig::default()).expect("cache");
    cache.prefill(keys.view(), values.view()).expect("prefill");
    let qs: Vec<Array2<f32>> = (0..8)
        .map(|i| synthetic::queries(32, 128, &keys, 1000 + i))
        .collect();
    let copy = cache.compressed().clone();
    eprintln!("ready");
    for _ in 0..2 {
        let mut out = Array2::<f32>::zeros((32, 128));
        let t = Instant::now();
        let mut n = 0;
        while t.elapsed().as_secs_f64() < secs {
            cache
                .attend(qs[n % qs.len()].view(), out.view_mut())
                .expect("attend");
            n += 1;
        }
        let ms = t.elapsed().as_secs_f64() * 1e3 / n as f64;
        eprintln!("KvCache::attend: {n} steps, {ms:.3} ms/step");
        run(
            "packed_attention, cache as built",
            cache.compressed(),
            &qs,
            secs,
        );
        run("packed_attention, a clone", &copy, &qs, secs);
    }
}
