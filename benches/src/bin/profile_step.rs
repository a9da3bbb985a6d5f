//! Repeats one method's decode step for profiling:
//! `profile_step <full|quest|mosaic|mosaic-default> <context> <steps>`.
//! `full`, `quest` and `mosaic` (the paper's fixed setting) use cheap pseudo-random data so
//! setup is fast; `mosaic-default` is `CompressConfig::default()` on the compare tool's
//! structured K/V and queries (`synthetic::structured_kv`), where the loss threshold picks
//! the strategy mix it picks there (int8 keys at g = 1, int8 values at g = 4).

use mosaickv_optimized::{DenseF16Cache, OptimizedMosaicCache, QuestF16Cache};
use mosaickv_spec::{CompressConfig, KvCache, KvShape};
use ndarray::{Array2, Array3};
use std::time::Instant;

fn main() {
    let pool = mosaickv_benches::setup_pool();
    eprintln!(
        "rayon: {} threads, {pool} pool",
        rayon::current_num_threads()
    );
    let a: Vec<String> = std::env::args().collect();
    let method = a.get(1).map(String::as_str).unwrap_or("full");
    let ctx: usize = a.get(2).and_then(|s| s.parse().ok()).unwrap_or(32768);
    let steps: usize = a.get(3).and_then(|s| s.parse().ok()).unwrap_or(100);
    let shape = KvShape::new(8, 32, 128).unwrap();
    let mut x = 0x1234_5678u64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let (k, v) = if method == "mosaic-default" {
        mosaickv_reference::synthetic::structured_kv(ctx, 8, 128, 42)
    } else {
        let k = Array3::from_shape_fn((ctx, 8, 128), |(_, _, j)| {
            rnd() * if j < 16 { 4.0 } else { 1.0 }
        });
        (k, Array3::from_shape_fn((ctx, 8, 128), |_| rnd()))
    };
    let mut c: Box<dyn KvCache> = match method {
        "full" => Box::new(DenseF16Cache::new(shape).unwrap()),
        "quest" => Box::new(QuestF16Cache::new(shape, 0.1).unwrap()),
        "mosaic-default" => {
            Box::new(OptimizedMosaicCache::new(shape, CompressConfig::default()).unwrap())
        }
        _ => Box::new(OptimizedMosaicCache::new(shape, CompressConfig::paper_fixed()).unwrap()),
    };
    c.prefill(k.view(), v.view()).unwrap();
    eprintln!(
        "{method} {ctx}: memory per token {:.1} B: {:?}",
        c.memory().bytes_per_token(),
        c.memory()
    );
    let mut out = Array2::zeros((32, 128));
    // Eight query sets, cycled, so consecutive steps select different blocks (as in decode).
    let qs: Vec<Array2<f32>> = if method == "mosaic-default" {
        (0..8)
            .map(|i| mosaickv_reference::synthetic::queries(32, 128, &k, 7 + i))
            .collect()
    } else {
        (0..8)
            .map(|_| Array2::from_shape_fn((32, 128), |_| rnd()))
            .collect()
    };
    let mut times = Vec::with_capacity(steps);
    let t = Instant::now();
    for i in 0..steps {
        let s = Instant::now();
        c.attend(qs[i % qs.len()].view(), out.view_mut()).unwrap();
        times.push(s.elapsed().as_secs_f64() * 1e6);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "{method} {ctx}: {:.0} us/step mean, {:.0} median",
        t.elapsed().as_secs_f64() * 1e6 / steps as f64,
        times.get(steps / 2).copied().unwrap_or(0.0)
    );
}
