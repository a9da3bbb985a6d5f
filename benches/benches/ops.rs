//! Criterion benches per operation and backend, named `<backend>/<op>/<context>`.
//! Small sample counts so `cargo bench -p mosaickv-benches` finishes in minutes.

use criterion::{criterion_group, criterion_main, Criterion};
use mosaickv_optimized::{CpuBackend, DenseF16Cache, OptimizedMosaicCache, QuestF16Cache};
use mosaickv_reference::{synthetic, ReferenceBackend};
use mosaickv_spec::{Backend, CompressConfig, KvCache, KvShape, Side};
use ndarray::{s, Array2};
use std::time::Duration;

fn ops(c: &mut Criterion) {
    let shape = KvShape::new(8, 32, 128).unwrap();
    let ctx = 8192;
    let (k, v) = synthetic::structured_kv(ctx, 8, 128, 42);
    let q = synthetic::queries(32, 128, &k, 7);
    let cfg = CompressConfig::paper_fixed();
    let mut g = c.benchmark_group("ops");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let backends: Vec<Box<dyn Backend>> = vec![
        Box::new(CpuBackend::new()),
        Box::new(CpuBackend::portable()),
    ];
    let rows = k.slice(s![..4096, 0, ..]).to_owned();
    let mut mosaic = OptimizedMosaicCache::new(shape, cfg.clone()).unwrap();
    mosaic.prefill(k.view(), v.view()).unwrap();
    for be in &backends {
        let name = be.name();
        let side = be.fit_side(rows.view(), Side::Key, &cfg).unwrap();
        g.bench_function(format!("{name}/encode/4096"), |b| {
            b.iter(|| be.encode(rows.view(), &side).unwrap())
        });
        g.bench_function(format!("{name}/score_select/{ctx}"), |b| {
            b.iter(|| be.select(mosaic.compressed(), q.view()).unwrap())
        });
        let sel = be.select(mosaic.compressed(), q.view()).unwrap();
        let mut out = Array2::zeros((32, 128));
        g.bench_function(format!("{name}/packed_attention/{ctx}"), |b| {
            b.iter(|| {
                be.attend_selected(mosaic.compressed(), q.view(), &sel, out.view_mut())
                    .unwrap()
            })
        });
    }
    let rb = ReferenceBackend;
    let sel = rb.select(mosaic.compressed(), q.view()).unwrap();
    let mut out = Array2::zeros((32, 128));
    g.bench_function(format!("reference/packed_attention/{ctx}"), |b| {
        b.iter(|| {
            rb.attend_selected(mosaic.compressed(), q.view(), &sel, out.view_mut())
                .unwrap()
        })
    });
    g.bench_function(format!("cpu/mosaic_cache_attend/{ctx}"), |b| {
        b.iter(|| mosaic.attend(q.view(), out.view_mut()).unwrap())
    });
    let mut full = DenseF16Cache::new(shape).unwrap();
    full.prefill(k.view(), v.view()).unwrap();
    g.bench_function(format!("cpu/full_attention/{ctx}"), |b| {
        b.iter(|| full.attend(q.view(), out.view_mut()).unwrap())
    });
    let mut quest = QuestF16Cache::new(shape, 0.1).unwrap();
    quest.prefill(k.view(), v.view()).unwrap();
    g.bench_function(format!("cpu/quest/{ctx}"), |b| {
        b.iter(|| quest.attend(q.view(), out.view_mut()).unwrap())
    });
    g.finish();
}

/// The strategy search at the shipped default (SPEC 11: every candidate's loss, then the
/// choice) on one head's 4,096 keys and values, head_dim 64 (SmolLM2) and 128 (Qwen, Llama).
fn fit(c: &mut Criterion) {
    let cfg = CompressConfig::default();
    let mut g = c.benchmark_group("fit");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    let be = CpuBackend::new();
    for d in [64usize, 128] {
        let (k, v) = synthetic::structured_kv(4096, 1, d, 42);
        let (k, v) = (
            k.slice(s![.., 0, ..]).to_owned(),
            v.slice(s![.., 0, ..]).to_owned(),
        );
        g.bench_function(format!("cpu/fit_side_default/key/4096x{d}"), |b| {
            b.iter(|| be.fit_side(k.view(), Side::Key, &cfg).unwrap())
        });
        g.bench_function(format!("cpu/fit_side_default/value/4096x{d}"), |b| {
            b.iter(|| be.fit_side(v.view(), Side::Value, &cfg).unwrap())
        });
    }
    g.finish();
}

/// SPEC 6.1's coded records decoded to f32 rows (`coded::expand_coded`, what the CPU backend
/// does to every selected tile before its logits and values): 4,096 records of head_dim 64 with
/// SmolLM2's key widths (9 dims of 8 bits, 53 of 4, 2 of 2: 36 B a record), widths falling with
/// the dim (code order is dim order, the usual case) and the same widths shuffled.
fn coded(c: &mut Criterion) {
    use mosaickv_optimized::coded::expand_coded;
    use mosaickv_spec::coded::DimCode;
    let mut g = c.benchmark_group("coded");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let (n, d) = (4096usize, 64usize);
    let sorted: Vec<u8> = [8u8; 9].into_iter().chain([4; 53]).chain([2; 2]).collect();
    // a fixed permutation (multiplication by 37 mod 64 is a bijection)
    let shuffled: Vec<u8> = (0..d).map(|j| sorted[(j * 37) % d]).collect();
    for (name, bits) in [("sorted", sorted), ("shuffled", shuffled)] {
        let coding: Vec<DimCode> = bits
            .iter()
            .enumerate()
            .map(|(j, &b)| DimCode {
                bits: b,
                min: half::f16::from_f32(-0.5 - j as f32 / 64.0),
                scale: half::f16::from_f32(if b == 0 { 0.0 } else { 1.0 / f32::from(b) }),
            })
            .collect();
        let rb = bits
            .iter()
            .map(|&b| usize::from(b))
            .sum::<usize>()
            .div_ceil(8);
        let records: Vec<u8> = (0..n * rb)
            .map(|i| (i * 2_654_435_761usize >> 7) as u8)
            .collect();
        let mut out = vec![0f32; n * d];
        g.bench_function(format!("cpu/expand_coded/{name}/{n}x{d}"), |b| {
            b.iter(|| expand_coded(&records, n, rb, &coding, d, &mut out))
        });
    }
    g.finish();
}

criterion_group!(benches, ops, fit, coded);
criterion_main!(benches);
