//! Decode-loop benchmark of the live cache (SPEC.md section 10.4, issue 5).
//!
//! `cargo run --release -p mosaickv-benches --bin decode_loop -- [--context 32768] [--steps 1024] [--shape llama|smol]`
//!
//! Times one decode step (`append` + `attend`) on a cache prefilled with
//! `--context` tokens, for:
//! - **static** (no compression work at all): at every step, the cache the
//!   live run holds at that step (sink, segments, buffer) taken as a prefix of
//!   the final cache of a finished run; `append` only pushes the token into the
//!   buffer, and the next prefix is cut outside the timed step at each flush
//!   boundary. Same kernel (`packed_attention`), same cache size, no encode, no
//!   worker.
//! - **live-async**: [`LiveCache`] in `Mode::Async`: the fast-path flush on the
//!   decode thread, covariance/loss/close/re-encode on the worker thread.
//! - **sync-close**: [`OptimizedMosaicCache`]: the same lifecycle with closing
//!   done inline on the decode thread (what the worker removes from the decode path).
//!
//! Keys and values drift (their principal directions rotate with the token
//! index) and the generated tokens use other directions than the prompt, so
//! generated segments close by the loss rule every few hundred tokens: a
//! pessimistic load for the worker. Also reports the incremental
//! covariance update cost per token.

use clap::Parser;
use mosaickv_optimized::attention::{packed_attention, MosaicScratch, SelectionSource};
use mosaickv_optimized::live::covariance_update;
use mosaickv_optimized::{LiveCache, Mode, OptimizedMosaicCache, Path};
use mosaickv_spec::{CompressConfig, CompressedCache, KvCache, KvShape};
use ndarray::{Array2, Array3};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

#[derive(Parser, Debug)]
struct Args {
    /// Prompt tokens in the cache before decoding.
    #[arg(long, default_value_t = 32768)]
    context: usize,
    /// Decode steps timed per run.
    #[arg(long, default_value_t = 1024)]
    steps: usize,
    /// `llama` = 8 KV heads / 32 query heads / D = 128; `smol` = SmolLM2-135M's 3 / 9 / 64.
    #[arg(long, default_value = "llama")]
    shape: String,
    /// Tokens per radian of the KV directions' drift (smaller = more segment closes).
    #[arg(long, default_value_t = 600.0)]
    drift: f32,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

/// Drifting low-rank KV with noise, tokens `t0 .. t0 + n`: `[n, kv, d]`.
struct Gen {
    a: Vec<f32>,
    b: Vec<f32>,
    rng: ChaCha8Rng,
    drift: f32,
    kv: usize,
    d: usize,
}

const RANK: usize = 8;

impl Gen {
    fn new(kv: usize, d: usize, drift: f32, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let a = (0..RANK * d).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let b = (0..RANK * d).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        Self {
            a,
            b,
            rng,
            drift,
            kv,
            d,
        }
    }

    fn token(&mut self, t: usize, scale: f32, out: &mut [f32]) {
        let d = self.d;
        let th = t as f32 / self.drift;
        let (c, s) = (th.cos(), th.sin());
        for h in 0..self.kv {
            let w: Vec<f32> = (0..RANK)
                .map(|k| self.rng.gen_range(-1.0f32..1.0) * scale / (1 + k) as f32)
                .collect();
            let o = &mut out[h * d..(h + 1) * d];
            for (j, x) in o.iter_mut().enumerate() {
                let mut v = 0.05 * self.rng.gen_range(-1.0f32..1.0);
                for (k, wk) in w.iter().enumerate() {
                    v += wk * (c * self.a[k * d + j] + s * self.b[((k + h) % RANK) * d + j]);
                }
                *x = v;
            }
        }
    }

    fn rows(&mut self, t0: usize, n: usize) -> (Array3<f32>, Array3<f32>) {
        let (kv, d) = (self.kv, self.d);
        let mut k = Array3::zeros((n, kv, d));
        let mut v = Array3::zeros((n, kv, d));
        for t in 0..n {
            self.token(
                t0 + t,
                2.0,
                k.slice_mut(ndarray::s![t, .., ..])
                    .as_slice_mut()
                    .expect("contiguous"),
            );
            self.token(
                t0 + t,
                1.0,
                v.slice_mut(ndarray::s![t, .., ..])
                    .as_slice_mut()
                    .expect("contiguous"),
            );
        }
        (k, v)
    }
}

/// The baseline without compression work: at every step the cache a live run
/// would hold (sink, segments, buffer), taken as a prefix of the final cache of
/// a finished run, so its compressed data appears for free. `append` only pushes
/// the token into the buffer; at a flush boundary the next prefix is cut from
/// the final cache outside the timed step.
struct Static {
    full: CompressedCache,
    cache: CompressedCache,
    scratch: MosaicScratch,
    path: Path,
}

/// `full` with its segments cut at segment token `end` (a flush boundary, hence a block boundary).
fn prefix(full: &CompressedCache, end: usize) -> CompressedCache {
    let mut c = full.clone();
    c.buffer.clear();
    c.segments.retain(|s| s.start < end);
    if let Some(s) = c.segments.last_mut() {
        let len = end - s.start;
        if len < s.len {
            s.len = len;
            for h in &mut s.heads {
                h.keys
                    .bytes
                    .truncate(len * h.strategy.key.layout.record_bytes());
                h.keys.count = len;
                h.values
                    .bytes
                    .truncate(len * h.strategy.value.layout.record_bytes());
                h.values.count = len;
                let keep = len.div_ceil(h.meta.block_size) * h.meta.kept_dims;
                h.meta.min.truncate(keep);
                h.meta.max.truncate(keep);
                h.meta.scale.truncate(len.div_ceil(h.meta.block_size));
                h.meta.tokens = len;
            }
        }
    }
    c
}

impl Static {
    /// Untimed: the cache before step `i` has `i / cap` flushes in segments.
    fn prepare(&mut self, context: usize, i: usize) {
        let cap = self.full.config.buffer_capacity;
        if i.checked_rem(cap) == Some(0) {
            self.cache = prefix(&self.full, context + i);
        }
    }

    fn step(&mut self, k: &[f32], v: &[f32], q: &[f32], out: &mut [f32]) {
        self.cache.buffer.push(k.iter().copied(), v.iter().copied());
        packed_attention(
            self.path,
            &self.cache,
            q,
            SelectionSource::Compute,
            false,
            Some(out),
            &mut self.scratch,
        )
        .expect("attention");
    }
}

struct Summary {
    median: f64,
    mean: f64,
    p99: f64,
    max: f64,
}

fn summarize(mut us: Vec<f64>) -> Summary {
    us.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    let n = us.len();
    Summary {
        median: us[n / 2],
        mean: us.iter().sum::<f64>() / n as f64,
        p99: us[((n as f64 * 0.99).ceil() as usize).min(n) - 1],
        max: us[n - 1],
    }
}

fn view2(x: &[f32], kv: usize, d: usize) -> ndarray::ArrayView2<'_, f32> {
    ndarray::ArrayView2::from_shape((kv, d), x).expect("row")
}

fn main() {
    let pool = mosaickv_benches::setup_pool();
    eprintln!(
        "rayon: {} threads, {pool} pool",
        rayon::current_num_threads()
    );
    let args = Args::parse();
    let shape = match args.shape.as_str() {
        "smol" => KvShape::new(3, 9, 64).expect("shape"),
        _ => KvShape::new(8, 32, 128).expect("shape"),
    };
    let (kv, d) = (shape.kv_heads, shape.head_dim);
    let config = CompressConfig::default();
    let mut gen = Gen::new(kv, d, args.drift, args.seed);
    println!(
        "decode_loop: context {} tokens, {} steps, shape kv {} / q {} / D {}, default config, drift {} tokens/rad, rayon threads {}",
        args.context,
        args.steps,
        kv,
        shape.q_heads,
        d,
        args.drift,
        rayon::current_num_threads()
    );
    let t = Instant::now();
    let (pk, pv) = gen.rows(0, args.context);
    // Generated tokens come from other directions than the prompt (a topic change), drifting
    // on: the prompt's strategy stops fitting at once, and later segments close every few
    // hundred tokens by the loss rule.
    let mut gen2 = Gen::new(kv, d, args.drift, args.seed + 100);
    let (gk, gv) = gen2.rows(args.context, args.steps);
    let mut qrng = ChaCha8Rng::seed_from_u64(args.seed + 1);
    let qs: Vec<Array2<f32>> = (0..64)
        .map(|_| Array2::from_shape_fn((shape.q_heads, d), |_| qrng.gen_range(-1.0f32..1.0)))
        .collect();

    let mut live = LiveCache::new(shape, config.clone(), Mode::Async).expect("live");
    live.prefill(pk.view(), pv.view()).expect("prefill");
    let mut sync = OptimizedMosaicCache::new(shape, config.clone()).expect("sync");
    sync.prefill(pk.view(), pv.view()).expect("prefill");
    drop((pk, pv));
    println!(
        "setup (data + 2 prefills): {:.1} s; kernels {}",
        t.elapsed().as_secs_f64(),
        sync.backend_name()
    );

    let mut out = Array2::<f32>::zeros((shape.q_heads, d));
    let row = kv * d;
    let gk = gk.as_slice().expect("contiguous").to_vec();
    let gv = gv.as_slice().expect("contiguous").to_vec();
    let tok = |t: usize| (&gk[t * row..(t + 1) * row], &gv[t * row..(t + 1) * row]);

    // 1. sync-close: the whole run, closes inline on the decode thread.
    let half = args.steps / 2;
    let mut t_sync = Vec::new();
    for i in 0..2 * half {
        let (k, v) = tok(i);
        let s = Instant::now();
        sync.append(view2(k, kv, d), view2(v, kv, d))
            .expect("append");
        sync.attend(qs[i % 64].view(), out.view_mut())
            .expect("attend");
        t_sync.push(s.elapsed().as_secs_f64() * 1e6);
    }
    // (its final cache, minus its last, partial buffer, is what the static baseline cuts prefixes from)
    let mut stat = Static {
        full: sync.compressed().clone(),
        cache: sync.compressed().clone(),
        scratch: MosaicScratch::default(),
        path: Path::detect(),
    };
    // 2. static and live-async in halves, static / live / static / live; the live worker is
    // drained (untimed) before each static half so its backlog never runs during a baseline step.
    let mut t_static = Vec::new();
    let mut t_live = Vec::new();
    let mut backlog = Vec::new();
    for part in 0..2 {
        let range = part * half..(part + 1) * half;
        for i in range.clone() {
            let (k, v) = tok(i);
            let q = qs[i % 64].as_slice().expect("q");
            stat.prepare(args.context, i);
            let s = Instant::now();
            stat.step(k, v, q, out.as_slice_mut().expect("out"));
            t_static.push(s.elapsed().as_secs_f64() * 1e6);
        }
        for i in range {
            let (k, v) = tok(i);
            let s = Instant::now();
            live.append(view2(k, kv, d), view2(v, kv, d))
                .expect("append");
            live.attend(qs[i % 64].view(), out.view_mut())
                .expect("attend");
            t_live.push(s.elapsed().as_secs_f64() * 1e6);
        }
        backlog.push(live.stats().in_flight);
        let s = Instant::now();
        live.drain().expect("drain");
        backlog.push((s.elapsed().as_secs_f64() * 1e3) as u64);
    }
    let st = live.stats();
    let same = live.compressed() == sync.compressed();

    println!("\nper decode step (append + attend), microseconds:");
    println!(
        "{:<12} {:>9} {:>9} {:>9} {:>9}",
        "run", "median", "mean", "p99", "max"
    );
    let f = summarize(t_static);
    let l = summarize(t_live);
    let y = summarize(t_sync);
    for (name, s) in [("static", &f), ("live-async", &l), ("sync-close", &y)] {
        println!(
            "{:<12} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
            name, s.median, s.mean, s.p99, s.max
        );
    }
    println!(
        "live vs static: median {:+.1} %, mean {:+.1} %; sync-close vs static: median {:+.1} %, mean {:+.1} %",
        100.0 * (l.median / f.median - 1.0),
        100.0 * (l.mean / f.mean - 1.0),
        100.0 * (y.median / f.median - 1.0),
        100.0 * (y.mean / f.mean - 1.0),
    );
    let seg = live.compressed().segments.len();
    println!(
        "live: {} flushes, {} closes, {} re-encodes; worker busy {:.1} ms ({:.1} us/token, closes {:.1} ms); backlog at the end of each half: {} / {} flushes (drained in {} / {} ms); {} segments; equal to the sync cache: {}",
        st.flushes,
        st.closes,
        st.reencodes,
        st.worker_ns as f64 / 1e6,
        st.worker_ns as f64 / 1e3 / (2 * half) as f64,
        st.close_ns as f64 / 1e6,
        backlog[0],
        backlog[2],
        backlog[1],
        backlog[3],
        seg,
        same
    );
    let m = live.memory();
    println!(
        "memory: device {:.1} MiB ({:.1} B/token, dense f16 {:.0}), host rows {:.2} MiB, worker covariance {:.2} MiB",
        m.device_bytes() as f64 / (1 << 20) as f64,
        m.bytes_per_token(),
        mosaickv_spec::MemoryReport::dense_f16_bytes_per_token(&shape),
        m.host_rows as f64 / (1 << 20) as f64,
        live.host_memory().covariance as f64 / (1 << 20) as f64
    );

    // Incremental covariance: C += x x^T (lower triangle, f64) for every head and side,
    // as the worker does it: one flush (buffer_capacity tokens) at a time.
    let cap = config.buffer_capacity;
    let flushes = (2 * half / cap).max(1);
    let reps = flushes * cap;
    let mut covs = vec![vec![0f64; d * d]; 2 * kv];
    let heads = |x: &[f32], h: usize| -> Vec<f32> {
        x.chunks_exact(row)
            .flat_map(|t| t[h * d..(h + 1) * d].iter().copied())
            .collect()
    };
    let batches: Vec<Vec<Vec<f32>>> = (0..flushes)
        .map(|f| {
            let (k, v) = (
                &gk[f * cap * row..(f + 1) * cap * row],
                &gv[f * cap * row..(f + 1) * cap * row],
            );
            (0..kv).flat_map(|h| [heads(k, h), heads(v, h)]).collect()
        })
        .collect();
    let s = Instant::now();
    for b in &batches {
        for (c, rows) in covs.iter_mut().zip(b) {
            covariance_update(c, rows, d);
        }
    }
    let ns = s.elapsed().as_nanos() as f64 / reps as f64;
    std::hint::black_box(&covs);
    println!(
        "covariance update: {:.0} ns per token ({} heads x K,V), {:.0} ns per head and side (D = {d})",
        ns,
        kv,
        ns / (2 * kv) as f64
    );
}
