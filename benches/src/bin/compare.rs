//! Side-by-side decode attention: full (dense f16), Quest (10 % tokens) and MosaicKV
//! (paper_fixed: 10 % tokens, 25 % channels) on one layer of Llama-3.1-8B shape, plus the
//! reference's packed attention at the largest context, and the machine's read bandwidth.
//!
//! `cargo run --release -p mosaickv-benches --bin compare -- [--contexts 8192,32768,131072] [--json]`

use clap::Parser;
use mosaickv_benches::{exact_full_attention, median, read_bandwidth_gbps, rel_l2};
use mosaickv_optimized::{CpuBackend, DenseF16Cache, OptimizedMosaicCache, QuestF16Cache};
use mosaickv_reference::{synthetic, ReferenceBackend};
use mosaickv_spec::{Backend, CompressConfig, KvCache, KvShape, SegmentState};
use ndarray::{Array2, Array3};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "MosaicKV vs full vs Quest decode attention, one layer of Llama-3.1-8B shape")]
struct Args {
    /// Context lengths (tokens), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "8192,32768,131072")]
    contexts: Vec<usize>,
    /// Print one JSON object per (method, context) instead of the table.
    #[arg(long)]
    json: bool,
    /// Timed decode steps per method (after warm-up), at least.
    #[arg(long, default_value_t = 41)]
    steps: usize,
    /// Keep timing a method's steps until they add up to this many seconds (a 2.5 ms step
    /// would otherwise be timed over 0.1 s, where one short disturbance moves the median;
    /// the reference's steps are exempt).
    #[arg(long, default_value_t = 1.0)]
    min_seconds: f64,
    /// Warm-up steps per method.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Timed steps of the reference's packed attention (largest context only; 0 = skip).
    #[arg(long, default_value_t = 3)]
    reference_steps: usize,
    /// Query samples used for the error against exact f64 full attention.
    #[arg(long, default_value_t = 3)]
    error_samples: usize,
    /// Methods to run (full,quest,mosaic; also mosaic-vblocks: the same 10 % tokens and 25 %
    /// channels with the default block-size rule, blocks of 16/32/64 by key variance, SPEC
    /// 11.3; mosaic-int8 and mosaic-int4: paper_fixed() with int8 / int4 retained values, SPEC
    /// 6); the speedup columns need full and quest.
    #[arg(long, value_delimiter = ',', default_value = "full,quest,mosaic")]
    methods: Vec<String>,
    /// Bytes of the bandwidth probe buffer.
    #[arg(long, default_value_t = 1 << 30)]
    bandwidth_bytes: usize,
}

struct Row {
    method: String,
    context: usize,
    median_us: f64,
    bytes_read: usize,
    kv_bytes_per_token: f64,
    rel_error: f64,
    build_s: f64,
    steps: usize,
}

/// Times at least `steps` decode steps after `warmup`, and more until the timed steps add up
/// to `min_seconds`, with a fresh perturbed query per step. Returns the median (µs) and the
/// number of timed steps.
fn time_steps(
    mut step: impl FnMut(&Array2<f32>),
    base: &[Array2<f32>],
    warmup: usize,
    steps: usize,
    min_seconds: f64,
    seed: u64,
) -> (f64, usize) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut samples = Vec::with_capacity(steps);
    let mut q = base[0].clone();
    let mut timed = 0.0;
    let mut i = 0;
    while i < warmup + steps || timed < min_seconds {
        let b = &base[i % base.len()];
        for (x, &y) in q.iter_mut().zip(b.iter()) {
            *x = y + 0.01 * rng.gen_range(-1.0f32..1.0);
        }
        let t = Instant::now();
        step(&q);
        let dt = t.elapsed().as_secs_f64();
        if i >= warmup {
            samples.push(dt * 1e6);
            timed += dt;
        }
        i += 1;
    }
    (median(&samples), samples.len())
}

/// Bytes a MosaicKV step reads: all block metadata, K rotations of every segment
/// (queries are rotated per segment), V rotations of segments with a selected block,
/// the selected K and V records, and the dense sink + buffer rows.
fn mosaic_bytes(cache: &OptimizedMosaicCache, q: &Array2<f32>) -> usize {
    let c = cache.compressed();
    let d = c.shape.head_dim;
    let sel = CpuBackend::new().select(c, q.view()).expect("select");
    let mut bytes = c.sink.bytes() + c.buffer.bytes();
    for (h, blocks) in sel.per_head.iter().enumerate() {
        let mut touched = vec![false; c.segments.len()];
        for &(s, b) in blocks {
            let seg = &c.segments[s as usize];
            let hs = &seg.heads[h];
            let bs = hs.strategy.block_size;
            let n = (seg.len - b as usize * bs).min(bs);
            bytes += n
                * (hs.strategy.key.layout.record_bytes() + hs.strategy.value.layout.record_bytes());
            touched[s as usize] = true;
        }
        for (s, seg) in c.segments.iter().enumerate() {
            let hs = &seg.heads[h];
            bytes += hs.meta.bytes() + 4 * d * hs.strategy.key.layout.kept_dims;
            if touched[s] {
                bytes += 4 * d * hs.strategy.value.layout.kept_dims;
            }
        }
    }
    bytes
}

fn main() {
    let args = Args::parse();
    let shape = KvShape::new(8, 32, 128).expect("shape");
    let backend = CpuBackend::new();
    eprintln!(
        "backend {}, {} rayon threads; measuring read bandwidth ({} MiB buffer)...",
        backend.name(),
        rayon::current_num_threads(),
        args.bandwidth_bytes >> 20
    );
    // The machine may be shared: the probe runs before every context and the best is kept.
    let mut bw = read_bandwidth_gbps(args.bandwidth_bytes, 7);
    eprintln!("read bandwidth: {bw:.2} GB/s");
    let largest = args.contexts.iter().copied().max().unwrap_or(0);
    let mut rows: Vec<Row> = Vec::new();
    for (ci, &ctx) in args.contexts.iter().enumerate() {
        if ci > 0 {
            let b = read_bandwidth_gbps(args.bandwidth_bytes, 5);
            eprintln!("read bandwidth: {b:.2} GB/s");
            bw = bw.max(b);
        }
        let t = Instant::now();
        let (keys, values) = synthetic::structured_kv(ctx, shape.kv_heads, shape.head_dim, 42);
        let nbase = 8;
        let base: Vec<Array2<f32>> = (0..nbase)
            .map(|i| synthetic::queries(shape.q_heads, shape.head_dim, &keys, 1000 + i as u64))
            .collect();
        let ns = args.error_samples.min(nbase);
        let exact: Vec<Array2<f32>> = base[..ns]
            .iter()
            .map(|q| exact_full_attention(keys.view(), values.view(), q.view()))
            .collect();
        eprintln!(
            "[{ctx}] data + {ns} exact references: {:.1} s",
            t.elapsed().as_secs_f64()
        );
        let err = |c: &mut dyn KvCache| -> f64 {
            let mut s = 0.0;
            for (q, e) in base[..ns].iter().zip(&exact) {
                let mut out = Array2::zeros((shape.q_heads, shape.head_dim));
                c.attend(q.view(), out.view_mut()).expect("attend");
                s += rel_l2(out.view(), e.view());
            }
            s / ns.max(1) as f64
        };
        let run =
            |name: &str, c: &mut dyn KvCache, build_s: f64, bytes: usize, rows: &mut Vec<Row>| {
                let mut out = Array2::zeros((shape.q_heads, shape.head_dim));
                let (us, steps) = time_steps(
                    |q| c.attend(q.view(), out.view_mut()).expect("attend"),
                    &base,
                    args.warmup,
                    args.steps,
                    args.min_seconds,
                    7,
                );
                let m = c.memory();
                let e = err(c);
                eprintln!("[{ctx}] {name}: {us:.0} us/step, err {e:.4}");
                rows.push(Row {
                    method: name.into(),
                    context: ctx,
                    median_us: us,
                    bytes_read: bytes,
                    kv_bytes_per_token: m.bytes_per_token(),
                    rel_error: e,
                    build_s,
                    steps,
                });
            };
        let want = |m: &str| args.methods.iter().any(|x| x == m);
        if want("full") {
            let t = Instant::now();
            let mut full = DenseF16Cache::new(shape).expect("cache");
            full.prefill(keys.view(), values.view()).expect("prefill");
            let b = full.bytes_per_step();
            run("full", &mut full, t.elapsed().as_secs_f64(), b, &mut rows);
        }
        if want("quest") {
            let t = Instant::now();
            let mut quest = QuestF16Cache::new(shape, 0.10).expect("cache");
            quest.prefill(keys.view(), values.view()).expect("prefill");
            let b = quest.bytes_per_step();
            run("quest", &mut quest, t.elapsed().as_secs_f64(), b, &mut rows);
        }
        // Builds a MosaicKV cache of this context, reports its segments and block sizes.
        let build_mosaic = |name: &str, cfg: CompressConfig| {
            let t = Instant::now();
            let mut m = OptimizedMosaicCache::new(shape, cfg).expect("cache");
            m.prefill(keys.view(), values.view()).expect("prefill");
            let build = t.elapsed().as_secs_f64();
            let segs = &m.compressed().segments;
            let closed = segs
                .iter()
                .filter(|s| s.state == SegmentState::Closed)
                .count();
            let mut sizes: Vec<usize> = segs
                .iter()
                .flat_map(|s| s.heads.iter().map(|h| h.strategy.block_size))
                .collect();
            sizes.sort_unstable();
            sizes.dedup();
            eprintln!(
                "[{ctx}] {name} prefill: {build:.1} s, {} segments ({closed} closed), block sizes {sizes:?}",
                segs.len()
            );
            (m, build)
        };
        if want("mosaic-vblocks") {
            let cfg = CompressConfig {
                block_sizes: CompressConfig::default().block_sizes,
                ..CompressConfig::paper_fixed()
            };
            let (mut m, build) = build_mosaic("mosaic-vblocks", cfg);
            let b = mosaic_bytes(&m, &base[0]);
            run("mosaic-vblocks", &mut m, build, b, &mut rows);
        }
        // paper_fixed() with its retained values stored as int8 / int4 (SPEC.md section 6).
        for (name, dtype) in [
            ("mosaic-int8", mosaickv_spec::ValueDtype::Int8),
            ("mosaic-int4", mosaickv_spec::ValueDtype::Int4),
        ] {
            if want(name) {
                let cfg = CompressConfig {
                    value_dtypes: vec![dtype],
                    ..CompressConfig::paper_fixed()
                };
                let (mut m, build) = build_mosaic(name, cfg);
                let b = mosaic_bytes(&m, &base[0]);
                run(name, &mut m, build, b, &mut rows);
            }
        }
        if !want("mosaic") {
            continue;
        }
        let (mut mosaic, build) = build_mosaic("mosaic", CompressConfig::paper_fixed());
        let b = mosaic_bytes(&mosaic, &base[0]);
        run("mosaic", &mut mosaic, build, b, &mut rows);
        if ctx == largest && args.reference_steps > 0 {
            let rb = ReferenceBackend;
            let c = mosaic.compressed();
            let mut out = Array2::zeros((shape.q_heads, shape.head_dim));
            let (us, _) = time_steps(
                |q| {
                    rb.attend(c, q.view(), out.view_mut())
                        .expect("reference attend")
                },
                &base,
                1,
                args.reference_steps,
                0.0,
                9,
            );
            let mut e = 0.0;
            for (q, ex) in base[..ns].iter().zip(&exact) {
                rb.attend(c, q.view(), out.view_mut())
                    .expect("reference attend");
                e += rel_l2(out.view(), ex.view());
            }
            eprintln!("[{ctx}] mosaic-reference: {us:.0} us/step");
            rows.push(Row {
                method: "mosaic-reference".into(),
                context: ctx,
                median_us: us,
                bytes_read: b,
                kv_bytes_per_token: c.memory().bytes_per_token(),
                rel_error: e / ns.max(1) as f64,
                build_s: 0.0,
                steps: args.reference_steps,
            });
        }
        drop::<(Array3<f32>, Array3<f32>)>((keys, values));
    }
    let b = read_bandwidth_gbps(args.bandwidth_bytes, 5);
    eprintln!("read bandwidth: {b:.2} GB/s");
    bw = bw.max(b);
    // Report.
    let find = |m: &str, ctx: usize| {
        rows.iter()
            .find(|r| r.method == m && r.context == ctx)
            .map(|r| r.median_us)
    };
    // The table goes to stdout, or to stderr under --json (so one run yields both).
    let table = |line: String| {
        if args.json {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    };
    {
        table(format!(
            "backend {} | threads {} | measured read bandwidth {:.2} GB/s (best of all probes)",
            backend.name(),
            rayon::current_num_threads(),
            bw
        ));
        table(format!(
            "{:<17} {:>8} {:>11} {:>10} {:>7} {:>7} {:>9} {:>8} {:>8} {:>9} {:>8}",
            "method",
            "context",
            "median_us",
            "MB_read",
            "GB/s",
            "bw_frac",
            "B/token",
            "x_full",
            "x_quest",
            "rel_err",
            "build_s"
        ));
    }
    for r in &rows {
        let gbps = r.bytes_read as f64 / (r.median_us * 1e-6) / 1e9;
        let vs_full = find("full", r.context).map(|f| f / r.median_us);
        let vs_quest = find("quest", r.context).map(|f| f / r.median_us);
        let vs_mosaic = find("mosaic", r.context).map(|f| r.median_us / f);
        if args.json {
            let mut o = json!({
                "method": r.method, "context": r.context, "median_us": r.median_us, "bytes_read": r.bytes_read,
                "gbps": gbps, "bandwidth_fraction": gbps / bw, "measured_bandwidth_gbps": bw,
                "kv_bytes_per_token": r.kv_bytes_per_token, "speedup_vs_full": vs_full, "speedup_vs_quest": vs_quest,
                "rel_error_vs_full": r.rel_error, "build_s": r.build_s, "steps": r.steps, "backend": backend.name(),
                "threads": rayon::current_num_threads(),
            });
            if r.method == "mosaic-reference" {
                o["optimized_speedup_over_reference"] = json!(vs_mosaic);
            }
            println!("{o}");
        }
        {
            table(format!(
                "{:<17} {:>8} {:>11.0} {:>10.1} {:>7.2} {:>7.2} {:>9.1} {:>8.2} {:>8.2} {:>9.4} {:>8.1}",
                r.method,
                r.context,
                r.median_us,
                r.bytes_read as f64 / 1e6,
                gbps,
                gbps / bw,
                r.kv_bytes_per_token,
                vs_full.unwrap_or(f64::NAN),
                vs_quest.unwrap_or(f64::NAN),
                r.rel_error,
                r.build_s
            ));
            if r.method == "mosaic-reference" {
                table(format!(
                    "  optimized packed attention is {:.1}x faster than the reference's",
                    vs_mosaic.unwrap_or(f64::NAN)
                ));
            }
        }
    }
}
