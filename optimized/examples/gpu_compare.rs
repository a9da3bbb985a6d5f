//! GPU decode attention, side by side (issue 6): full attention over a dense f16 cache,
//! Quest (SPEC.md section 12) and MosaicKV (SPEC.md sections 8-9) for one layer of
//! Llama-3.1-8B shape (32 query heads, 8 KV heads, head_dim 128), plus the device's
//! copy bandwidth measured in the same run. MosaicKV runs in each configuration of
//! `--config` (default `default,paper`):
//! - `default`: `CompressConfig::default()` (20 % of the tokens, channels and value dtypes
//!   int4/int8/f16 chosen by the loss rule: quantized records on the device); rows
//!   `mosaic_default`, `cudacache_default`, `cc_swap_default`, beside Quest at the same
//!   token rate (`quest_default`);
//! - `paper`: `CompressConfig::paper_fixed()` (10 % of the tokens, 25 % of the channels,
//!   f16 values); rows `mosaic`, `cudacache`, `cc_swap`, beside Quest at `--token-rate`
//!   (default 0.10, the paper's; row `quest`).
//!
//! ```text
//! cargo run --release -p mosaickv-optimized --features cuda --example gpu_compare -- \
//!     [--contexts 32768,131072,524288,1048576] [--batch 1,8] [--steps 20] [--warmup 3] \
//!     [--config default,paper] [--json FILE] [--deadline-s SECONDS] [--exact-max N] \
//!     [--dump-dir DIR] [--build-only]
//! ```
//!
//! `--deadline-s S`: before each context, its cost is estimated from the previous one
//! (linear in tokens); contexts that would end past S seconds are skipped and listed.
//! `--dump-dir DIR`: writes the smallest context's batch-1 K/V (f16), query and dense
//! result for `scripts/sdpa_peer.py --check DIR`. `--build-only`: host side only, no GPU.
//!
//! Data: `mosaickv_reference::synthetic::structured_kv` at the largest context, generated
//! once; every context is a prefix of it (the generator is sequential, so a prefix is what
//! a shorter run would give). Each context's MosaicKV cache is built from scratch with
//! `OptimizedMosaicCache::prefill` (rayon, all cores) per configuration. A batch of B repeats the sequence B
//! times on the device (same cache contents, one query set per sequence).
//!
//! Timing: CUDA events around each decode step (selection, attention and merge, including
//! the per-step scratch allocations of the API), median of `--steps` after `--warmup`.
//! Errors: relative L2 of the whole `[batch][32][128]` output against the dense device
//! result (`rel_error_vs_full`); the dense result itself is checked against an f64 CPU
//! computation on the same f16 data (`check_error` of the `full` rows, sequence 0, contexts
//! up to `--exact-max`, default 131072) and the
//! device MosaicKV result against the CPU `OptimizedMosaicCache` on the same compressed
//! cache (`check_error` of the `mosaic` rows, sequence 0).
//!
//! Without a usable GPU it prints one line saying why and exits with status 1.

use half::f16;
use mosaickv_optimized::cuda::device::{DenseDevice, DeviceCache, Gpu, QuestDevice, QUEST_PAGE};
use mosaickv_optimized::cuda::{CudaBackend, CudaCache, CudaCacheOptions};
use mosaickv_optimized::{CpuBackend, OptimizedMosaicCache};
use mosaickv_reference::synthetic;
use mosaickv_spec::{Backend, CompressConfig, KvCache, KvShape};
use ndarray::{s, Array2, Array3, ArrayView3};
use rayon::prelude::*;
use std::io::Write;
use std::time::Instant;

const KV_HEADS: usize = 8;
const Q_HEADS: usize = 32;
const HEAD_DIM: usize = 128;
/// Query sets per sequence (steps cycle through them; set 0 gives the errors).
const QUERY_SETS: usize = 2;
/// Tokens the query generator looks at (a strided sample of the context: its cost is
/// linear in the tokens it reads, and 1M-token scans per query would dominate the run).
const QUERY_SAMPLE: usize = 8192;

struct Args {
    contexts: Vec<usize>,
    batches: Vec<usize>,
    steps: usize,
    warmup: usize,
    json: Option<String>,
    token_rate: f64,
    bandwidth_mib: usize,
    deadline_s: Option<f64>,
    exact_max: usize,
    dump_dir: Option<String>,
    build_only: bool,
    /// MosaicKV configurations, in `--config` order.
    configs: Vec<MosaicConfig>,
}

/// One MosaicKV configuration of the run: its name and the suffix of its rows' methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MosaicConfig {
    /// `CompressConfig::default()`: rows `*_default`.
    Default,
    /// `CompressConfig::paper_fixed()`: rows `mosaic`, `cudacache`, `cc_swap`, `quest`.
    Paper,
}

impl MosaicConfig {
    fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "default" => Ok(Self::Default),
            "paper" => Ok(Self::Paper),
            o => Err(format!("--config: {o:?} is neither default nor paper")),
        }
    }
    fn config(self) -> CompressConfig {
        match self {
            Self::Default => CompressConfig::default(),
            Self::Paper => CompressConfig::paper_fixed(),
        }
    }
    fn name(self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::Paper => "paper",
        }
    }
    /// The methods of this configuration's rows: (quest, mosaic, cudacache, cc_swap).
    fn methods(self) -> [&'static str; 4] {
        match self {
            Self::Default => [
                "quest_default",
                "mosaic_default",
                "cudacache_default",
                "cc_swap_default",
            ],
            Self::Paper => ["quest", "mosaic", "cudacache", "cc_swap"],
        }
    }
}

const USAGE: &str = "usage: gpu_compare [--contexts N,..] [--batch B,..] [--steps N] [--warmup N] \
[--config default,paper] [--json FILE] [--token-rate F] [--bandwidth-mib N] [--deadline-s S] [--exact-max N] \
[--dump-dir DIR] [--build-only]";

fn parse_count(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mul) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1024),
        Some('m' | 'M') => (&t[..t.len() - 1], 1024 * 1024),
        _ => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("not a positive count: {s:?}"))
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        contexts: vec![32768, 131072, 524288, 1048576],
        batches: vec![1, 8],
        steps: 20,
        warmup: 3,
        json: None,
        token_rate: 0.10,
        bandwidth_mib: 1024,
        deadline_s: None,
        exact_max: 131072,
        dump_dir: None,
        build_only: false,
        configs: vec![MosaicConfig::Default, MosaicConfig::Paper],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        if flag == "--build-only" {
            a.build_only = true;
            continue;
        }
        let val = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let list = |v: &str| v.split(',').map(parse_count).collect::<Result<Vec<_>, _>>();
        let float = |v: &str| {
            v.parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| format!("{flag}: not a positive number: {v:?}"))
        };
        match flag.as_str() {
            "--contexts" => a.contexts = list(&val)?,
            "--batch" => a.batches = list(&val)?,
            "--steps" => a.steps = parse_count(&val)?,
            "--warmup" => a.warmup = val.parse().map_err(|_| format!("--warmup: {val:?}"))?,
            "--json" => a.json = Some(val),
            "--token-rate" => a.token_rate = float(&val)?.min(1.0),
            "--bandwidth-mib" => a.bandwidth_mib = parse_count(&val)?,
            "--deadline-s" => a.deadline_s = Some(float(&val)?),
            "--dump-dir" => a.dump_dir = Some(val),
            "--exact-max" => a.exact_max = parse_count(&val)?,
            "--config" => {
                let mut c: Vec<MosaicConfig> = Vec::new();
                for x in val.split(',') {
                    let m = MosaicConfig::parse(x)?;
                    if !c.contains(&m) {
                        c.push(m);
                    }
                }
                a.configs = c;
            }
            _ => return Err(format!("unknown argument {flag:?}; {USAGE}")),
        }
    }
    a.contexts.sort_unstable();
    a.contexts.dedup();
    if a.contexts[0] < 2 * QUEST_PAGE {
        return Err(format!(
            "contexts must be at least {} tokens",
            2 * QUEST_PAGE
        ));
    }
    Ok(a)
}

/// One line on stderr, then exit 1 (no panic, no backtrace).
fn fail(msg: impl std::fmt::Display) -> ! {
    let line = msg.to_string().replace('\n', " ");
    eprintln!("gpu_compare: {line}");
    std::process::exit(1)
}

trait OrFail<T> {
    fn or_fail(self, what: &str) -> T;
}
impl<T, E: std::fmt::Display> OrFail<T> for Result<T, E> {
    fn or_fail(self, what: &str) -> T {
        self.unwrap_or_else(|e| fail(format!("{what}: {e}")))
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (f64::from(g) - f64::from(w)).powi(2);
        den += f64::from(w).powi(2);
    }
    if got.len() != want.len() {
        return f64::NAN;
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// The device stream (this benchmark runs on a GPU only, never on the emulation).
fn stream(gpu: &Gpu) -> &std::sync::Arc<cudarc::driver::CudaStream> {
    gpu.stream()
        .unwrap_or_else(|| fail("gpu_compare needs a CUDA device, not the emulation"))
}

/// The device allocation of a buffer of this (device) executor.
fn dev<T: mosaickv_optimized::cuda::device::Elem>(
    b: &mut mosaickv_optimized::cuda::device::Buf<T>,
) -> &mut cudarc::driver::CudaSlice<T> {
    b.cuda_mut()
        .unwrap_or_else(|| fail("gpu_compare needs a CUDA device buffer"))
}

fn event(gpu: &Gpu) -> cudarc::driver::CudaEvent {
    stream(gpu)
        .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
        .or_fail_dbg("record event")
}

trait OrFailDbg<T> {
    fn or_fail_dbg(self, what: &str) -> T;
}
impl<T, E: std::fmt::Debug> OrFailDbg<T> for Result<T, E> {
    fn or_fail_dbg(self, what: &str) -> T {
        self.unwrap_or_else(|e| fail(format!("{what}: {e:?}")))
    }
}

/// Device copy bandwidth in GB/s (bytes read + bytes written per second) of a
/// device-to-device copy of `mib` MiB, best of 10 after 2 warm-up copies.
fn copy_bandwidth(gpu: &Gpu, mib: usize) -> f64 {
    let n = mib << 20;
    let mut src = gpu.zeros::<u8>(n).or_fail("bandwidth buffer");
    let mut dst = gpu.zeros::<u8>(n).or_fail("bandwidth buffer");
    let (src, dst) = (dev(&mut src).clone(), dev(&mut dst));
    let mut best = f64::INFINITY;
    for i in 0..12 {
        let s = event(gpu);
        stream(gpu)
            .memcpy_dtod(&src, dst)
            .or_fail_dbg("device-to-device copy");
        let e = event(gpu);
        let ms = f64::from(s.elapsed_ms(&e).or_fail_dbg("event time"));
        if i >= 2 {
            best = best.min(ms);
        }
    }
    2.0 * n as f64 / (best * 1e-3) / 1e9
}

/// Median device time (us, CUDA events) and median host wall time (us) of one decode step.
fn time_steps(
    gpu: &Gpu,
    warmup: usize,
    steps: usize,
    mut step: impl FnMut(usize) -> mosaickv_spec::Result<mosaickv_optimized::cuda::device::Buf<f32>>,
) -> (f64, f64) {
    for i in 0..warmup {
        drop(step(i).or_fail("decode step"));
    }
    gpu.sync().or_fail("synchronize");
    let (mut dev, mut wall) = (Vec::new(), Vec::new());
    for i in 0..steps {
        let t = Instant::now();
        let s = event(gpu);
        let out = step(i).or_fail("decode step");
        let e = event(gpu);
        let ms = f64::from(s.elapsed_ms(&e).or_fail_dbg("event time"));
        wall.push(t.elapsed().as_secs_f64() * 1e6);
        dev.push(ms * 1e3);
        drop(out);
    }
    (median(&mut dev), median(&mut wall))
}

/// f16 bits of `[n][kv][d]` rows, row-major (the DenseDevice layout of one sequence).
fn to_f16_bits(x: ArrayView3<f32>) -> Vec<u16> {
    let flat: Vec<f32> = x.iter().copied().collect();
    flat.par_iter()
        .map(|&v| f16::from_f32(v).to_bits())
        .collect()
}

/// Exact (f64) GQA attention of `q` `[q_heads][d]` over f16 bits `[n][kv][d]`.
fn exact_attention(k: &[u16], v: &[u16], n: usize, q: &[f32]) -> Vec<f32> {
    let (kv, d, g) = (KV_HEADS, HEAD_DIM, Q_HEADS / KV_HEADS);
    let scale = 1.0 / (d as f64).sqrt();
    let lut: Vec<f64> = (0..=u16::MAX)
        .map(|b| f64::from(f16::from_bits(b).to_f32()))
        .collect();
    let f = |b: u16| lut[b as usize];
    (0..Q_HEADS)
        .into_par_iter()
        .flat_map_iter(|h| {
            let j = h / g;
            let qh = &q[h * d..(h + 1) * d];
            let logits: Vec<f64> = (0..n)
                .map(|t| {
                    let row = &k[(t * kv + j) * d..(t * kv + j + 1) * d];
                    scale
                        * row
                            .iter()
                            .zip(qh)
                            .map(|(&a, &b)| f(a) * f64::from(b))
                            .sum::<f64>()
                })
                .collect();
            let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mut acc = vec![0.0f64; d];
            let mut den = 0.0;
            for (t, &l) in logits.iter().enumerate() {
                let w = (l - m).exp();
                den += w;
                let row = &v[(t * kv + j) * d..(t * kv + j + 1) * d];
                for (a, &b) in acc.iter_mut().zip(row) {
                    *a += w * f(b);
                }
            }
            acc.into_iter().map(move |a| (a / den) as f32)
        })
        .collect()
}

/// Bytes one MosaicKV step reads for one sequence and query (as the CPU compare tool
/// counts them): all block metadata and K rotations, V rotations of segments with a
/// selected block, the selected K and V records, and the dense sink + buffer rows.
fn mosaic_bytes(cache: &OptimizedMosaicCache, q: &Array2<f32>) -> usize {
    let c = cache.compressed();
    let d = c.shape.head_dim;
    let sel = CpuBackend::new()
        .select(c, q.view())
        .or_fail("host selection for the byte count");
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

struct Row {
    method: &'static str,
    context: usize,
    batch: usize,
    median_us: f64,
    wall_us: f64,
    bytes_read: usize,
    kv_bytes_per_token: f64,
    rel_error_vs_full: f64,
    /// `full`: against f64 on the CPU; `mosaic`: against the CPU backend; else NaN.
    check_error: f64,
}

fn num(x: f64) -> String {
    if x.is_finite() {
        format!("{x}")
    } else {
        "null".into()
    }
}

fn json_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// Everything built on the host for one context (shared by every batch size).
struct HostContext {
    n: usize,
    k16: Vec<u16>,
    v16: Vec<u16>,
    /// One MosaicKV cache per `--config`, in that order.
    mosaics: Vec<(MosaicConfig, OptimizedMosaicCache)>,
    /// `queries[set][b]`, each `[q_heads][d]`.
    queries: Vec<Vec<Array2<f32>>>,
    /// f64 attention of sequence 0, query set 0 (empty above `--exact-max`).
    exact0: Vec<f32>,
    build_s: f64,
}

fn build_context(
    keys: &Array3<f32>,
    values: &Array3<f32>,
    n: usize,
    max_batch: usize,
    args: &Args,
) -> HostContext {
    let exact_max = args.exact_max;
    let shape = KvShape::new(KV_HEADS, Q_HEADS, HEAD_DIM).or_fail("shape");
    let t = Instant::now();
    let kp = keys.slice(s![..n, .., ..]);
    let vp = values.slice(s![..n, .., ..]);
    let (k16, v16) = rayon::join(|| to_f16_bits(kp), || to_f16_bits(vp));
    let stride = n.div_ceil(QUERY_SAMPLE);
    let sample = kp.slice(s![..;stride, .., ..]).to_owned();
    let queries: Vec<Vec<Array2<f32>>> = (0..QUERY_SETS)
        .map(|set| {
            (0..max_batch)
                .into_par_iter()
                .map(|b| {
                    synthetic::queries(Q_HEADS, HEAD_DIM, &sample, 1000 + (set * 64 + b) as u64)
                })
                .collect()
        })
        .collect();
    let mut prefills = Vec::new();
    let mosaics = args
        .configs
        .iter()
        .map(|&mc| {
            let t_mosaic = Instant::now();
            let mut mosaic =
                OptimizedMosaicCache::new(shape, mc.config()).or_fail("MosaicKV cache");
            mosaic.prefill(kp, vp).or_fail("MosaicKV prefill");
            let segs = mosaic.compressed().segments.len();
            let quantized = mosaic
                .compressed()
                .segments
                .iter()
                .flat_map(|s| &s.heads)
                .flat_map(|h| [&h.strategy.key.layout, &h.strategy.value.layout])
                .filter(|l| l.dtype.is_quantized())
                .count();
            prefills.push(format!(
                "{} {:.1} s, {segs} segments, {quantized} quantized sides of {}",
                mc.name(),
                t_mosaic.elapsed().as_secs_f64(),
                2 * segs * KV_HEADS
            ));
            (mc, mosaic)
        })
        .collect();
    let q0: Vec<f32> = queries[0][0].iter().copied().collect();
    let exact0 = if n <= exact_max {
        exact_attention(&k16, &v16, n, &q0)
    } else {
        Vec::new()
    };
    let build_s = t.elapsed().as_secs_f64();
    eprintln!(
        "[{n}] host build {build_s:.1} s (MosaicKV prefill: {})",
        prefills.join("; ")
    );
    HostContext {
        n,
        k16,
        v16,
        mosaics,
        queries,
        exact0,
        build_s,
    }
}

/// Writes the smallest context's batch-1 data for `scripts/sdpa_peer.py`'s cross-check.
fn dump(dir: &str, h: &HostContext, full_out: &[f32]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let p = |name: &str| std::path::Path::new(dir).join(name);
    std::fs::write(p("k.f16"), bytemuck_u16(&h.k16))?;
    std::fs::write(p("v.f16"), bytemuck_u16(&h.v16))?;
    let q: Vec<f32> = h.queries[0][0].iter().copied().collect();
    std::fs::write(p("q.f32"), bytemuck_f32(&q))?;
    std::fs::write(p("full.f32"), bytemuck_f32(&full_out[..Q_HEADS * HEAD_DIM]))?;
    std::fs::write(
        p("meta.json"),
        format!(
            "{{\"context\": {}, \"kv_heads\": {KV_HEADS}, \"q_heads\": {Q_HEADS}, \"head_dim\": {HEAD_DIM}, \"layout\": \"[n][kv][d] little-endian\"}}\n",
            h.n
        ),
    )
}

fn bytemuck_u16(x: &[u16]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn bytemuck_f32(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn run_batch(
    gpu: &Gpu,
    backend: &CudaBackend,
    h: &HostContext,
    batch: usize,
    args: &Args,
    dump_dir: Option<&str>,
) -> Vec<Row> {
    let (n, kv, d) = (h.n, KV_HEADS, HEAD_DIM);
    let seq = n * kv * d;
    // Dense f16 caches [batch][n][kv][d]: sequence 0 uploaded, then copied on the device.
    let mut dk = gpu.zeros::<u16>(batch * seq).or_fail("dense K allocation");
    let mut dv = gpu.zeros::<u16>(batch * seq).or_fail("dense V allocation");
    stream(gpu)
        .memcpy_htod(&h.k16, &mut dev(&mut dk).slice_mut(0..seq))
        .or_fail_dbg("dense K upload");
    stream(gpu)
        .memcpy_htod(&h.v16, &mut dev(&mut dv).slice_mut(0..seq))
        .or_fail_dbg("dense V upload");
    for b in 1..batch {
        let (src, mut dst) = dev(&mut dk).split_at_mut(b * seq);
        stream(gpu)
            .memcpy_dtod(&src.slice(0..seq), &mut dst.slice_mut(0..seq))
            .or_fail_dbg("dense K copy");
        let (src, mut dst) = dev(&mut dv).split_at_mut(b * seq);
        stream(gpu)
            .memcpy_dtod(&src.slice(0..seq), &mut dst.slice_mut(0..seq))
            .or_fail_dbg("dense V copy");
    }
    let dense = DenseDevice {
        batch,
        n,
        kv_heads: kv,
        q_heads: Q_HEADS,
        head_dim: d,
        k: dk,
        v: dv,
    };
    let qs: Vec<mosaickv_optimized::cuda::device::Buf<f32>> = (0..QUERY_SETS)
        .map(|set| {
            let flat: Vec<f32> = h.queries[set][..batch]
                .iter()
                .flat_map(|q| q.iter().copied())
                .collect();
            gpu.up(&flat).or_fail("query upload")
        })
        .collect();
    gpu.sync().or_fail("synchronize after upload");

    let (w, s) = (args.warmup, args.steps);
    let (full_us, full_wall) =
        time_steps(gpu, w, s, |i| dense.attend_full(gpu, &qs[i % QUERY_SETS]));
    let down = |r: mosaickv_spec::Result<mosaickv_optimized::cuda::device::Buf<f32>>,
                what: &str| { gpu.down(&r.or_fail(what)).or_fail(what) };
    let full_out = down(dense.attend_full(gpu, &qs[0]), "full attention");
    let one = Q_HEADS * d;
    let full_check = if h.exact0.is_empty() {
        f64::NAN
    } else {
        rel_l2(&full_out[..one], &h.exact0)
    };
    if let Some(dir) = dump_dir {
        dump(dir, h, &full_out).or_fail("--dump-dir");
    }
    let full_bpt = (4 * kv * d) as f64;
    let row = |method, median_us, wall_us, bytes_read, bpt, err, check| Row {
        method,
        context: n,
        batch,
        median_us,
        wall_us,
        bytes_read,
        kv_bytes_per_token: bpt,
        rel_error_vs_full: err,
        check_error: check,
    };
    let mut rows = vec![row(
        "full",
        full_us,
        full_wall,
        batch * seq * 4,
        full_bpt,
        0.0,
        full_check,
    )];
    // Per configuration: Quest at its token rate, MosaicKV on a DeviceCache, then the same
    // cache as a CudaCache (appends and a swap).
    for (mc, mosaic) in &h.mosaics {
        let [m_quest, m_mosaic, m_cc, m_swap] = mc.methods();
        let rate = match mc {
            MosaicConfig::Paper => args.token_rate,
            MosaicConfig::Default => mosaic.compressed().config.token_rate,
        };
        let quest = QuestDevice::new(gpu, &dense, rate).or_fail("Quest page metadata");
        let caches: Vec<&mosaickv_spec::CompressedCache> = vec![mosaic.compressed(); batch];
        let dc: DeviceCache = backend.upload(&caches).or_fail("MosaicKV upload");
        gpu.sync().or_fail("synchronize after upload");
        let (quest_us, quest_wall) = time_steps(gpu, w, s, |i| {
            quest.attend(gpu, &dense, &qs[i % QUERY_SETS])
        });
        let (mosaic_us, mosaic_wall) =
            time_steps(gpu, w, s, |i| dc.attend(gpu, &qs[i % QUERY_SETS]));
        let quest_out = down(quest.attend(gpu, &dense, &qs[0]), "Quest attention");
        let mosaic_out = down(dc.attend(gpu, &qs[0]), "MosaicKV attention");
        drop(dc);
        let cc = cudacache_rows(gpu, backend, mosaic, batch, &qs, &mosaic_out, args);
        let mut cpu = Array2::<f32>::zeros((Q_HEADS, d));
        CpuBackend::new()
            .attend(mosaic.compressed(), h.queries[0][0].view(), cpu.view_mut())
            .or_fail("CPU MosaicKV attention");
        let mosaic_check = rel_l2(&mosaic_out[..one], cpu.as_slice().unwrap_or(&[]));
        let meta_pt = (4 * kv * d) as f64 / QUEST_PAGE as f64;
        let quest_tokens = (quest.budget_pages * QUEST_PAGE).min(n);
        let quest_bytes = batch * kv * (quest.pages * 4 * d + quest_tokens * 4 * d);
        let mosaic_read: usize = h.queries[0][..batch]
            .iter()
            .map(|q| mosaic_bytes(mosaic, q))
            .sum();
        // Every byte of the cache per token, the int8/int4 records' minimum and scale included.
        let mpt = mosaic.compressed().memory().bytes_per_token();
        rows.push(row(
            m_quest,
            quest_us,
            quest_wall,
            quest_bytes,
            full_bpt + meta_pt,
            rel_l2(&quest_out, &full_out),
            f64::NAN,
        ));
        rows.push(row(
            m_mosaic,
            mosaic_us,
            mosaic_wall,
            mosaic_read,
            mpt,
            rel_l2(&mosaic_out, &full_out),
            mosaic_check,
        ));
        rows.push(row(
            m_cc,
            cc.step_us,
            cc.step_wall,
            mosaic_read,
            mpt,
            rel_l2(&cc.out0, &full_out),
            cc.check,
        ));
        rows.push(row(
            m_swap,
            cc.swap_us,
            cc.swap_wall,
            cc.swap_bytes,
            mpt,
            f64::NAN,
            f64::NAN,
        ));
    }
    rows
}

/// What [`cudacache_rows`] measured.
struct CcResult {
    /// A decode step: one token appended per sequence (only that token copied), then the
    /// batch's attention with queries and output on the device.
    step_us: f64,
    step_wall: f64,
    /// The output before any append (the cache equals the configuration's MosaicKV cache at that point).
    out0: Vec<f32>,
    /// rel L2 of `out0` against the DeviceCache result on the same cache.
    check: f64,
    /// `begin_swap` + `commit_swap` of sequence 0's last segment (re-encoded: here the
    /// same segment again), CUDA events around both; bytes moved to the device.
    swap_us: f64,
    swap_wall: f64,
    swap_bytes: usize,
}

/// `CudaCache` at this batch size (issue 17): decode steps with appends, and a segment swap.
fn cudacache_rows(
    gpu: &Gpu,
    backend: &CudaBackend,
    mosaic: &OptimizedMosaicCache,
    batch: usize,
    qs: &[mosaickv_optimized::cuda::device::Buf<f32>],
    mosaic0: &[f32],
    args: &Args,
) -> CcResult {
    let c = mosaic.compressed();
    let last = c
        .segments
        .len()
        .checked_sub(1)
        .unwrap_or_else(|| fail("CudaCache: the MosaicKV cache has no segment"));
    let seg = c.segments[last].clone();
    let opts = CudaCacheOptions {
        spare_rows: args.warmup + args.steps + 1,
        spare_segments: 0,
        spare_blocks: 0,
        swap_tokens: seg.len,
        swap_segments: 1,
    };
    let gpu_arc = backend.gpu().or_fail("GPU");
    let mut cc = CudaCache::new(gpu_arc, &vec![c; batch], opts).or_fail("CudaCache upload");
    let out0 = gpu
        .down(&cc.attend_device(&qs[0]).or_fail("CudaCache attention"))
        .or_fail("download");
    let check = rel_l2(&out0, mosaic0);
    // One token row per step: the first buffered (or sink) row again.
    let d = c.shape.head_dim;
    let row = c.shape.kv_heads * d;
    let src = if c.buffer.tokens > 0 {
        &c.buffer
    } else {
        &c.sink
    };
    let (tk, tv) = (src.keys[..row].to_vec(), src.values[..row].to_vec());
    let (step_us, step_wall) = time_steps(gpu, args.warmup, args.steps, |i| {
        for b in 0..batch {
            cc.append(b, &tk, &tv)?;
        }
        cc.attend_device(&qs[i % QUERY_SETS])
    });
    let before = gpu
        .down(&cc.attend_device(&qs[0]).or_fail("CudaCache attention"))
        .or_fail("download");
    let (mut dev, mut wall) = (Vec::new(), Vec::new());
    let mut swap_bytes = 0;
    for rep in 0..6 {
        let copy = seg.clone();
        gpu.sync().or_fail("synchronize");
        let t = Instant::now();
        let s = event(gpu);
        cc.begin_swap(0, last, 1, vec![copy], 0)
            .or_fail("CudaCache begin_swap");
        swap_bytes = cc.memory().device_staged_bytes;
        cc.commit_swap().or_fail("CudaCache commit_swap");
        let e = event(gpu);
        let ms = f64::from(s.elapsed_ms(&e).or_fail_dbg("event time"));
        if rep > 0 {
            dev.push(ms * 1e3);
            wall.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let after = gpu
        .down(&cc.attend_device(&qs[0]).or_fail("CudaCache attention"))
        .or_fail("download");
    if after != before {
        fail(format!(
            "CudaCache: swapping a segment in for itself changed the output (rel L2 {:.2e})",
            rel_l2(&after, &before)
        ));
    }
    CcResult {
        step_us,
        step_wall,
        out0,
        check,
        swap_us: median(&mut dev),
        swap_wall: median(&mut wall),
        swap_bytes,
    }
}

/// The configuration a row's method belongs to (`none` for the dense row).
fn config_of(method: &str) -> &'static str {
    if method == "full" {
        "none"
    } else if method.ends_with("_default") {
        "default"
    } else {
        "paper"
    }
}

fn main() {
    let args = parse_args().unwrap_or_else(|e| {
        eprintln!("gpu_compare: {e}");
        std::process::exit(2)
    });
    let start = Instant::now();
    // The device first: without one, say so in one line before any long host work.
    let device = if args.build_only {
        None
    } else {
        let backend = CudaBackend::new().unwrap_or_else(|e| fail(format!("no usable GPU: {e}")));
        if let Err(e) = backend.gpu() {
            fail(format!("no usable GPU: {e}"));
        }
        Some(backend)
    };
    let json_path = args.json.clone().unwrap_or_else(|| {
        let dir = std::env::var("OUT").unwrap_or_else(|_| ".".into());
        format!("{dir}/gpu_compare.json")
    });
    let mut json = if args.build_only {
        None
    } else {
        Some(std::fs::File::create(&json_path).or_fail(&format!("cannot write {json_path}")))
    };
    let (name, bw) = match &device {
        Some(b) => {
            let gpu = &*b.gpu().or_fail("GPU");
            let bw = copy_bandwidth(gpu, args.bandwidth_mib);
            eprintln!(
                "device {} ({}, {} SMs); copy bandwidth {bw:.0} GB/s (read + write, {} MiB dtod)",
                gpu.name, gpu.arch, gpu.sms, args.bandwidth_mib
            );
            (gpu.name.clone(), bw)
        }
        None => ("none (--build-only)".to_string(), f64::NAN),
    };
    let largest = *args.contexts.last().unwrap_or(&0);
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let t = Instant::now();
    let (keys, values) = synthetic::structured_kv(largest, KV_HEADS, HEAD_DIM, 42);
    eprintln!(
        "structured_kv({largest}): {:.1} s; {} rayon threads",
        t.elapsed().as_secs_f64(),
        rayon::current_num_threads()
    );
    let mut rows: Vec<Row> = Vec::new();
    let mut skipped: Vec<usize> = Vec::new();
    let mut last_cost: Option<(usize, f64)> = None;
    for (ci, &ctx) in args.contexts.iter().enumerate() {
        if let (Some(deadline), Some((prev_n, prev_s))) = (args.deadline_s, last_cost) {
            let estimate = prev_s * ctx as f64 / prev_n as f64;
            let elapsed = start.elapsed().as_secs_f64();
            if elapsed + estimate > deadline {
                eprintln!(
                    "[{ctx}] skipped: estimated {estimate:.0} s more (at {elapsed:.0} s) passes --deadline-s {deadline}"
                );
                skipped.extend_from_slice(&args.contexts[ci..]);
                break;
            }
        }
        let t_ctx = Instant::now();
        let h = build_context(&keys, &values, ctx, max_batch, &args);
        if let Some(b) = &device {
            let gpu = &*b.gpu().or_fail("GPU");
            for (bi, &batch) in args.batches.iter().enumerate() {
                let dump_dir = (ci == 0 && bi == 0 && batch == 1)
                    .then_some(args.dump_dir.as_deref())
                    .flatten();
                let t = Instant::now();
                let new = run_batch(gpu, b, &h, batch, &args, dump_dir);
                for r in &new {
                    eprintln!(
                        "[{ctx} x{batch}] {:<17} {:>10.1} us (wall {:>10.1} us)  err vs full {:.2e}",
                        r.method, r.median_us, r.wall_us, r.rel_error_vs_full
                    );
                }
                eprintln!(
                    "[{ctx} x{batch}] device part {:.1} s",
                    t.elapsed().as_secs_f64()
                );
                let find = |m: &str| new.iter().find(|r| r.method == m).map(|r| r.median_us);
                // Each MosaicKV row against the Quest row of its own configuration.
                let quest_of = |m: &str| {
                    if m.ends_with("_default") {
                        "quest_default"
                    } else {
                        "quest"
                    }
                };
                if let Some(f) = json.as_mut() {
                    for r in &new {
                        let gbps = r.bytes_read as f64 / (r.median_us * 1e-6) / 1e9;
                        let line = format!(
                            "{{\"method\": {}, \"context\": {}, \"batch\": {}, \"config\": {}, \"median_us\": {}, \"wall_us\": {}, \"bytes_read\": {}, \"gbps\": {}, \"bandwidth_fraction\": {}, \"measured_bandwidth_gbps\": {}, \"kv_bytes_per_token\": {}, \"speedup_vs_full\": {}, \"speedup_vs_quest\": {}, \"rel_error_vs_full\": {}, \"check_error\": {}, \"check\": {}, \"build_s\": {}, \"steps\": {}, \"device\": {}}}",
                            json_str(r.method),
                            r.context,
                            r.batch,
                            json_str(config_of(r.method)),
                            num(r.median_us),
                            num(r.wall_us),
                            r.bytes_read,
                            num(gbps),
                            num(gbps / bw),
                            num(bw),
                            num(r.kv_bytes_per_token),
                            num(find("full").map_or(f64::NAN, |x| x / r.median_us)),
                            num(find(quest_of(r.method)).map_or(f64::NAN, |x| x / r.median_us)),
                            num(r.rel_error_vs_full),
                            num(r.check_error),
                            json_str(match r.method {
                                "full" => "rel L2 vs f64 CPU attention on the same f16 data, sequence 0",
                                "mosaic" | "mosaic_default" => "rel L2 vs CPU backend on the same compressed cache, sequence 0",
                                "cudacache" | "cudacache_default" => "rel L2 vs the mosaic row's DeviceCache on the same cache, whole batch, before the appends",
                                "cc_swap" | "cc_swap_default" => "bytes_read: bytes written to the device by begin_swap (a segment re-encoded as itself); the output after the swaps is checked bit-equal",
                                _ => "none",
                            }),
                            num(h.build_s),
                            args.steps,
                            json_str(&name),
                        );
                        writeln!(f, "{line}").or_fail(&format!("cannot write {json_path}"));
                    }
                    f.flush().or_fail(&format!("cannot write {json_path}"));
                }
                rows.extend(new);
            }
        }
        drop(h);
        last_cost = Some((ctx, t_ctx.elapsed().as_secs_f64()));
    }
    let bw_end = match &device {
        Some(b) => copy_bandwidth(&b.gpu().or_fail("GPU"), args.bandwidth_mib),
        None => f64::NAN,
    };
    // The table (bw_frac against the first probe, as in the JSON).
    println!(
        "device {name} | copy bandwidth {bw:.0} GB/s at start, {bw_end:.0} GB/s at end (read + write) | {} host threads | {:.0} s",
        rayon::current_num_threads(),
        start.elapsed().as_secs_f64()
    );
    println!(
        "{:<17} {:>8} {:>5} {:>10} {:>10} {:>9} {:>7} {:>7} {:>8} {:>8} {:>9} {:>9}",
        "method",
        "context",
        "batch",
        "median_us",
        "MB_read",
        "GB/s",
        "bw_frac",
        "B/tok",
        "x_full",
        "x_quest",
        "err_full",
        "check"
    );
    for r in &rows {
        let find = |m: &str| {
            rows.iter()
                .find(|x| x.method == m && x.context == r.context && x.batch == r.batch)
                .map_or(f64::NAN, |x| x.median_us / r.median_us)
        };
        let gbps = r.bytes_read as f64 / (r.median_us * 1e-6) / 1e9;
        println!(
            "{:<17} {:>8} {:>5} {:>10.1} {:>10.1} {:>9.1} {:>7.3} {:>7.0} {:>8.2} {:>8.2} {:>9.2e} {:>9.2e}",
            r.method,
            r.context,
            r.batch,
            r.median_us,
            r.bytes_read as f64 / 1e6,
            gbps,
            gbps / bw,
            r.kv_bytes_per_token,
            find("full"),
            find(if r.method.ends_with("_default") { "quest_default" } else { "quest" }),
            r.rel_error_vs_full,
            r.check_error
        );
    }
    if !skipped.is_empty() {
        println!("skipped contexts (--deadline-s): {skipped:?}");
    }
    if json.is_some() {
        eprintln!("JSON lines: {json_path}");
    }
    drop::<(Array3<f32>, Array3<f32>)>((keys, values));
}
