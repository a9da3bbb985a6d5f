//! Side-by-side decode attention: full (dense f16), Quest and MosaicKV, per configuration.
//!
//! `cargo run --release -p mosaickv-benches --bin compare -- [--config default,paper]
//! [--contexts 8192,32768,131072] [--model smollm2 --task niah_single_noise] [--json]`
//!
//! What runs, per context:
//! - **full**: `DenseF16Cache` (f16 K/V, every token), once per context;
//! - per `--config` (in the order given; by default `default` then `paper`):
//!   - **quest**: `QuestF16Cache` with that configuration's `token_rate` and budget floor
//!     `min_budget_tokens` (SPEC.md section 8.3), so both read the same number of tokens;
//!   - **mosaic**: `OptimizedMosaicCache` with that configuration;
//!   - **mosaic-reference** (largest context only, `--reference-steps` > 0): the reference's
//!     packed attention on the same compressed cache.
//!
//! A configuration is `default` (`CompressConfig::default()`, the shipped default:
//! loss-threshold channels, value dtypes f16/int8/int4, 20 % tokens with a 256-token floor),
//! `paper` (`CompressConfig::paper_fixed()`: 10 % tokens, 25 % f16 channels, no floor),
//! `paper-vblocks` / `paper-int8` / `paper-int4` (the paper's setting with the default block
//! sizes / int8 / int4 retained values), or a JSON file in the format of
//! `mosaickv compress --config`.
//!
//! The K/V are either synthetic (one layer of Llama-3.1-8B shape from
//! `synthetic::structured_kv`) or, with `--model`, real: the model's dense prefill of a task
//! prompt (`--task`), every layer, with the model's own queries of the prompt's last 8
//! positions (held out of the cache) as the decode queries; a step then attends every layer,
//! and the strategy mix the loss threshold picks on real caches is printed and put in the JSON.
//!
//! Per (method, context) it prints the median step time, the bytes a step reads and the
//! bandwidth that reaches (bytes / time) beside the machine's measured read bandwidth, the KV
//! bytes per token (every device byte), the error against exact f64 attention, and the
//! prefill (cache construction) time.

use clap::Parser;
use mosaickv_benches::{
    exact_full_attention, median, read_bandwidth_gbps, rel_l2, resolve_configs, step_work,
    LabeledConfig,
};
use mosaickv_optimized::turboquant::TurboQuantCache;
use mosaickv_optimized::{CpuBackend, DenseF16Cache, OptimizedMosaicCache, QuestF16Cache};
use mosaickv_reference::{synthetic, ReferenceBackend};
use mosaickv_spec::turboquant::TurboQuantPreset;
use mosaickv_spec::{
    Backend, CompressedCache, KvCache, KvShape, LossPolicy, QueryStats, SegmentState,
};
use ndarray::{s, Array2, Array3};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::error::Error;
use std::time::Instant;

type BoxResult<T> = Result<T, Box<dyn Error>>;

#[derive(Parser, Debug)]
#[command(
    about = "MosaicKV vs full vs Quest decode attention, per configuration",
    long_about = "MosaicKV vs full (dense f16) vs Quest decode attention. Per context: full once, \
then per --config (in order) Quest at that configuration's token rate and budget floor, and \
MosaicKV with that configuration. Synthetic K/V of one Llama-3.1-8B layer by default; with \
--model, the model's real K/V and queries of a task prompt, every layer (the strategy mix the \
loss threshold picks on real caches is printed). --model is this tool's way to time decode steps on \
the strategy mix of real caches (decode_loop runs on synthetic drifting K/V)."
)]
struct Args {
    /// Configurations, comma-separated or repeated, in output order: default
    /// (CompressConfig::default(), the shipped default), paper (CompressConfig::paper_fixed()),
    /// paper-vblocks, paper-int8, paper-int4 (the paper's setting with blocks of 16/32/64 by
    /// key variance / int8 / int4 retained values), or a JSON config file as
    /// `mosaickv compress --config` reads it.
    #[arg(long, value_delimiter = ',', default_value = "default,paper")]
    config: Vec<String>,
    /// Context lengths (tokens), comma-separated. With --model: prompt lengths (the cache holds
    /// the task prompt minus the 8 held-out query positions; the row says how many tokens).
    #[arg(long, value_delimiter = ',', default_value = "8192,32768,131072")]
    contexts: Vec<usize>,
    /// Real K/V: a model (a known name, smollm2-135m or qwen2.5-1.5b, or a GGUF path) whose
    /// dense prefill of a --task prompt gives every layer's K/V and the decode queries.
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// The task whose prompt --model prefills (a name of mosaickv-tasks).
    #[arg(long, default_value = "niah_single_noise")]
    task: String,
    /// Print one JSON object per (method, config, context) on stdout; the table then goes to
    /// stderr.
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
    /// Methods to run: full, quest, mosaic (quest and mosaic once per --config), turboquant
    /// (vLLM's `turboquant_4bit_nc`, every token attended, the optimized cache); the speedup
    /// columns need full and quest. (The former mosaic-vblocks / mosaic-int8 / mosaic-int4
    /// are now --config paper-vblocks / paper-int8 / paper-int4.)
    #[arg(long, value_delimiter = ',', default_value = "full,quest,mosaic")]
    methods: Vec<String>,
    /// Bytes of the bandwidth probe buffer.
    #[arg(long, default_value_t = 1 << 30)]
    bandwidth_bytes: usize,
}

/// Query sets per context (each timed step perturbs one of them).
const NBASE: usize = 8;

/// The K/V of one context: one layer (synthetic) or every layer of a model.
struct Data {
    shape: KvShape,
    /// Cached tokens.
    tokens: usize,
    /// Per layer: keys and values `[tokens, kv_heads, head_dim]`.
    layers: Vec<(Array3<f32>, Array3<f32>)>,
    /// Per layer, the query statistics of the attention loss (model K/V only).
    stats: Vec<Option<QueryStats>>,
    /// `[sample][layer]` queries `[q_heads, head_dim]`.
    base: Vec<Vec<Array2<f32>>>,
}

struct Row {
    method: String,
    config: Option<usize>,
    context: usize,
    layers: usize,
    median_us: f64,
    bytes_read: usize,
    kv_bytes_per_token: f64,
    rel_error: f64,
    prefill_s: f64,
    steps: usize,
    /// The read-bandwidth probe taken just before this context.
    probe_gbps: f64,
    token_rate: Option<f64>,
    min_budget_tokens: Option<usize>,
    strategy_mix: Option<Value>,
}

/// Times at least `steps` decode steps after `warmup`, and more until the timed steps add up
/// to `min_seconds`, with fresh perturbed queries per step (one query set per layer). Returns
/// the median (µs) and the number of timed steps.
fn time_steps(
    mut step: impl FnMut(&[Array2<f32>]) -> BoxResult<()>,
    base: &[Vec<Array2<f32>>],
    warmup: usize,
    steps: usize,
    min_seconds: f64,
    seed: u64,
) -> BoxResult<(f64, usize)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut samples = Vec::with_capacity(steps);
    let mut q = base[0].clone();
    let mut timed = 0.0;
    let mut i = 0;
    while i < warmup + steps || timed < min_seconds {
        let b = &base[i % base.len()];
        for (ql, bl) in q.iter_mut().zip(b) {
            for (x, &y) in ql.iter_mut().zip(bl.iter()) {
                *x = y + 0.01 * rng.gen_range(-1.0f32..1.0);
            }
        }
        let t = Instant::now();
        step(&q)?;
        let dt = t.elapsed().as_secs_f64();
        if i >= warmup {
            samples.push(dt * 1e6);
            timed += dt;
        }
        i += 1;
    }
    Ok((median(&samples), samples.len()))
}

/// Bytes a MosaicKV step reads from the cache ([`step_work`]'s stages): all block metadata,
/// K rotations of every segment, V rotations of segments with a selected block, the selected
/// K and V records, and the dense sink + buffer rows.
fn mosaic_bytes(c: &CompressedCache, q: &Array2<f32>) -> BoxResult<usize> {
    let sel = CpuBackend::new().select(c, q.view())?;
    Ok(step_work(c, &sel)
        .iter()
        .filter(|w| w.from_cache)
        .map(|w| w.bytes)
        .sum())
}

/// The strategy mix of compressed caches: per side, the share of (segment token, head)
/// pairs stored at each `(r, g, dtype)`, and the share at each block size, as JSON and as
/// one line of text.
fn strategy_mix(caches: &[&CompressedCache]) -> (Value, String) {
    let mut sides: [BTreeMap<(usize, usize, &'static str), usize>; 2] = Default::default();
    let mut blocks: BTreeMap<usize, usize> = BTreeMap::new();
    let mut total = 0usize;
    for c in caches {
        for seg in &c.segments {
            for hs in &seg.heads {
                for (side, st) in [&hs.strategy.key, &hs.strategy.value].iter().enumerate() {
                    let l = &st.layout;
                    *sides[side]
                        .entry((l.r, l.group_size, l.dtype.name()))
                        .or_default() += seg.len;
                }
                *blocks.entry(hs.strategy.block_size).or_default() += seg.len;
                total += seg.len;
            }
        }
    }
    let share = |n: usize| n as f64 / total.max(1) as f64;
    let mut text = Vec::new();
    let mut obj = serde_json::Map::new();
    for (name, m) in ["key", "value"].iter().zip(&sides) {
        let mut v: Vec<_> = m.iter().collect();
        v.sort_by(|a, b| b.1.cmp(a.1));
        obj.insert(
            name.to_string(),
            Value::Array(
                v.iter()
                    .map(
                        |((r, g, dt), n)| json!({"r": r, "g": g, "dtype": dt, "share": share(**n)}),
                    )
                    .collect(),
            ),
        );
        let parts: Vec<String> = v
            .iter()
            .map(|((r, g, dt), n)| format!("r{r} g{g} {dt} {:.0}%", 100.0 * share(**n)))
            .collect();
        text.push(format!(
            "{} {}",
            if *name == "key" { "K" } else { "V" },
            parts.join(", ")
        ));
    }
    obj.insert(
        "block_size".into(),
        Value::Array(
            blocks
                .iter()
                .map(|(b, n)| json!({"block_size": b, "share": share(*n)}))
                .collect(),
        ),
    );
    let bparts: Vec<String> = blocks
        .iter()
        .map(|(b, n)| format!("{b}: {:.0}%", 100.0 * share(*n)))
        .collect();
    text.push(format!("blocks {}", bparts.join(", ")));
    (Value::Object(obj), text.join("; "))
}

/// One synthetic layer of Llama-3.1-8B shape and its query sets.
fn synthetic_data(ctx: usize) -> BoxResult<Data> {
    let shape = KvShape::new(8, 32, 128)?;
    let (keys, values) = synthetic::structured_kv(ctx, shape.kv_heads, shape.head_dim, 42);
    let base = (0..NBASE)
        .map(|i| {
            vec![synthetic::queries(
                shape.q_heads,
                shape.head_dim,
                &keys,
                1000 + i as u64,
            )]
        })
        .collect();
    Ok(Data {
        shape,
        tokens: ctx,
        layers: vec![(keys, values)],
        stats: vec![None],
        base,
    })
}

/// The model's K/V of every layer for a `task` prompt of about `length` tokens: the cache is
/// the prompt but its last [`NBASE`] positions, whose queries are the decode queries.
fn model_data(
    model: &mosaickv_engine::Model,
    task: mosaickv_tasks::Task,
    length: usize,
    with_stats: bool,
) -> BoxResult<Data> {
    let c = model.config();
    let shape = KvShape::new(c.kv_heads, c.q_heads, c.head_dim)?;
    let (_, ids) = mosaickv_engine::suite::task_sample(model, task, length, 0)?;
    if ids.len() <= NBASE + 1 {
        return Err(format!("a prompt of {} tokens is too short", ids.len()).into());
    }
    let t = Instant::now();
    let pre = model.prefill_with_queries(&ids)?;
    let n = ids.len() - NBASE;
    eprintln!(
        "[{n}] model prefill of {} tokens ({} layers): {:.1} s",
        ids.len(),
        pre.keys.len(),
        t.elapsed().as_secs_f64()
    );
    let mut layers = Vec::new();
    let mut stats = Vec::new();
    for l in 0..pre.keys.len() {
        let (k, v) = (
            pre.keys[l].slice(s![..n, .., ..]),
            pre.values[l].slice(s![..n, .., ..]),
        );
        stats.push(if with_stats {
            Some(QueryStats::from_queries(
                &shape,
                k,
                v,
                pre.queries[l].slice(s![..n, .., ..]),
                mosaickv_engine::STATS_SAMPLE,
            )?)
        } else {
            None
        });
        layers.push((k.to_owned(), v.to_owned()));
    }
    let base = (n..n + NBASE)
        .map(|p| {
            pre.queries
                .iter()
                .map(|q| q.slice(s![p, .., ..]).to_owned())
                .collect()
        })
        .collect();
    Ok(Data {
        shape,
        tokens: n,
        layers,
        stats,
        base,
    })
}

/// Mean over the first `exact.len()` query sets of the error of `attend` against exact
/// attention, pooled over layers (the squared errors and norms of every layer summed).
fn mean_error(
    data: &Data,
    exact: &[Vec<Array2<f32>>],
    mut attend: impl FnMut(usize, &Array2<f32>, &mut Array2<f32>) -> BoxResult<()>,
) -> BoxResult<f64> {
    let mut s = 0.0;
    for (qs, es) in data.base.iter().zip(exact) {
        let (mut num, mut den) = (0.0, 0.0);
        for (l, (q, e)) in qs.iter().zip(es).enumerate() {
            let mut out = Array2::zeros((data.shape.q_heads, data.shape.head_dim));
            attend(l, q, &mut out)?;
            let r = rel_l2(out.view(), e.view());
            let en: f64 = e.iter().map(|x| (*x as f64).powi(2)).sum();
            num += r * r * en;
            den += en;
        }
        s += if den > 0.0 { (num / den).sqrt() } else { 0.0 };
    }
    Ok(s / exact.len().max(1) as f64)
}

/// How rayon's global pool was set up ([`mosaickv_benches::setup_pool`]), for the JSON lines.
static POOL: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

fn main() {
    let pool = mosaickv_benches::setup_pool();
    POOL.set(pool).expect("set once");
    if let Err(e) = run(Args::parse()) {
        eprintln!("compare: error: {e}");
        std::process::exit(2);
    }
}

fn run(args: Args) -> BoxResult<()> {
    for m in &args.methods {
        match m.as_str() {
            "full" | "quest" | "mosaic" | "turboquant" => {}
            "mosaic-vblocks" | "mosaic-int8" | "mosaic-int4" => {
                return Err(format!(
                    "--methods {m} is now --config {}",
                    m.replacen("mosaic", "paper", 1)
                )
                .into())
            }
            _ => {
                return Err(
                    format!("unknown method {m:?} (full, quest, mosaic, turboquant)").into(),
                )
            }
        }
    }
    let want = |m: &str| args.methods.iter().any(|x| x == m);
    if args.steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    if let Some(c) = args.contexts.iter().find(|&&c| c <= NBASE) {
        return Err(format!("--contexts {c}: at least {} tokens", NBASE + 1).into());
    }
    let model = match &args.model {
        Some(p) => {
            let path = mosaickv_engine::resolve_model(Some(p))?;
            eprintln!("loading {}", path.display());
            Some(mosaickv_engine::Model::load(&path)?)
        }
        None => None,
    };
    let task = mosaickv_tasks::Task::from_name(&args.task).map_err(|e| format!("{e:?}"))?;
    let head_dim = model.as_ref().map_or(128, |m| m.config().head_dim);
    let configs: Vec<LabeledConfig> = resolve_configs(&args.config, head_dim)?;
    let with_stats = configs
        .iter()
        .any(|c| matches!(c.config.loss, LossPolicy::Attention { .. }));
    let backend = CpuBackend::new();
    eprintln!(
        "backend {}, {} rayon threads ({} pool); configs {}; measuring read bandwidth ({} MiB buffer)...",
        backend.name(),
        rayon::current_num_threads(),
        POOL.get().copied().unwrap_or("default"),
        args.config.join(", "),
        args.bandwidth_bytes >> 20
    );
    // The machine may be shared: the probe runs before every context and the best is kept.
    let mut bw = 0f64;
    let largest = args.contexts.iter().copied().max().unwrap_or(0);
    let mut rows: Vec<Row> = Vec::new();
    let mut source = String::from("synthetic structured_kv, Llama-3.1-8B layer shape");
    for (ci, &ctx) in args.contexts.iter().enumerate() {
        let probe = read_bandwidth_gbps(args.bandwidth_bytes, if ci == 0 { 7 } else { 5 });
        eprintln!("read bandwidth: {probe:.2} GB/s");
        bw = bw.max(probe);
        let t = Instant::now();
        let data = match &model {
            Some(m) => {
                source = format!(
                    "{} real K/V, {} prompt, all {} layers",
                    args.model
                        .as_ref()
                        .map_or(String::new(), |p| p.display().to_string()),
                    args.task,
                    m.config().n_layers
                );
                model_data(m, task, ctx, with_stats)?
            }
            None => synthetic_data(ctx)?,
        };
        let shape = data.shape;
        let n = data.tokens;
        let nl = data.layers.len();
        let ns = args.error_samples.min(NBASE);
        let exact: Vec<Vec<Array2<f32>>> = data.base[..ns]
            .iter()
            .map(|qs| {
                qs.iter()
                    .zip(&data.layers)
                    .map(|(q, (k, v))| exact_full_attention(k.view(), v.view(), q.view()))
                    .collect()
            })
            .collect();
        eprintln!(
            "[{n}] data + {ns} exact references: {:.1} s",
            t.elapsed().as_secs_f64()
        );
        let row = |method: &str, config: Option<usize>| Row {
            method: method.into(),
            config,
            context: n,
            layers: nl,
            median_us: 0.0,
            bytes_read: 0,
            kv_bytes_per_token: 0.0,
            rel_error: 0.0,
            prefill_s: 0.0,
            steps: 0,
            probe_gbps: probe,
            token_rate: config.map(|i| configs[i].config.token_rate),
            min_budget_tokens: config.map(|i| configs[i].config.min_budget_tokens),
            strategy_mix: None,
        };
        // Times a method's caches (one per layer), fills in its row.
        let measure = |caches: &mut [Box<dyn KvCache>], mut r: Row| -> BoxResult<Row> {
            let mut out = Array2::zeros((shape.q_heads, shape.head_dim));
            let (us, steps) = time_steps(
                |q| {
                    for (c, ql) in caches.iter_mut().zip(q) {
                        c.attend(ql.view(), out.view_mut())?;
                    }
                    Ok(())
                },
                &data.base,
                args.warmup,
                args.steps,
                args.min_seconds,
                7,
            )?;
            r.median_us = us;
            r.steps = steps;
            r.kv_bytes_per_token = caches.iter().map(|c| c.memory().bytes_per_token()).sum();
            r.rel_error = mean_error(&data, &exact, |l, q, o| {
                Ok(caches[l].attend(q.view(), o.view_mut())?)
            })?;
            let cfg = r.config.map_or("", |i| configs[i].label.as_str());
            eprintln!(
                "[{n}] {} {cfg}: {us:.0} us/step, err {:.4}",
                r.method, r.rel_error
            );
            Ok(r)
        };
        if want("full") {
            let t = Instant::now();
            let mut caches: Vec<Box<dyn KvCache>> = Vec::new();
            let mut bytes = 0;
            for (k, v) in &data.layers {
                let mut c = DenseF16Cache::new(shape)?;
                c.prefill(k.view(), v.view())?;
                bytes += c.bytes_per_step();
                caches.push(Box::new(c));
            }
            let mut r = row("full", None);
            r.prefill_s = t.elapsed().as_secs_f64();
            r.bytes_read = bytes;
            rows.push(measure(&mut caches, r)?);
        }
        if want("turboquant") {
            // vLLM's 4bit_nc slots; a step reads every slot once
            let t = Instant::now();
            let mut caches: Vec<Box<dyn KvCache>> = Vec::new();
            let mut bytes = 0;
            for (k, v) in &data.layers {
                let mut c = TurboQuantCache::new(shape, TurboQuantPreset::Bit4Nc)?;
                c.prefill(k.view(), v.view())?;
                bytes += c.slots().len();
                caches.push(Box::new(c));
            }
            let mut r = row("turboquant:4bit_nc", None);
            r.prefill_s = t.elapsed().as_secs_f64();
            r.bytes_read = bytes;
            rows.push(measure(&mut caches, r)?);
        }
        for (i, lc) in configs.iter().enumerate() {
            let cfg = &lc.config;
            if want("quest") {
                let t = Instant::now();
                let mut caches: Vec<Box<dyn KvCache>> = Vec::new();
                let mut bytes = 0;
                for (k, v) in &data.layers {
                    let mut c = QuestF16Cache::new(shape, cfg.token_rate)?
                        .with_min_budget_tokens(cfg.min_budget_tokens);
                    c.prefill(k.view(), v.view())?;
                    bytes += c.bytes_per_step();
                    caches.push(Box::new(c));
                }
                let mut r = row("quest", Some(i));
                r.prefill_s = t.elapsed().as_secs_f64();
                r.bytes_read = bytes;
                rows.push(measure(&mut caches, r)?);
            }
            if !want("mosaic") {
                continue;
            }
            let t = Instant::now();
            let mut mosaics = Vec::new();
            for ((k, v), st) in data.layers.iter().zip(&data.stats) {
                let mut m = OptimizedMosaicCache::new(shape, cfg.clone())?;
                m.set_query_stats(st.clone())?;
                m.prefill(k.view(), v.view())?;
                mosaics.push(m);
            }
            let prefill_s = t.elapsed().as_secs_f64();
            let compressed: Vec<&CompressedCache> =
                mosaics.iter().map(|m| m.compressed()).collect();
            let (mix, mix_text) = strategy_mix(&compressed);
            let segs = compressed.iter().map(|c| c.segments.len()).sum::<usize>();
            let closed = compressed
                .iter()
                .flat_map(|c| &c.segments)
                .filter(|s| s.state == SegmentState::Closed)
                .count();
            eprintln!(
                "[{n}] mosaic {} prefill: {prefill_s:.1} s, {segs} segments ({closed} closed), loss {}; {mix_text}",
                lc.label,
                mosaics[0].loss_in_use()
            );
            let mut bytes = 0;
            for (c, q) in compressed.iter().zip(&data.base[0]) {
                bytes += mosaic_bytes(c, q)?;
            }
            // The reference runs on clones of the same compressed caches.
            let refs: Vec<CompressedCache> = if ctx == largest && args.reference_steps > 0 {
                compressed.iter().map(|c| (*c).clone()).collect()
            } else {
                Vec::new()
            };
            let mut r = row("mosaic", Some(i));
            r.prefill_s = prefill_s;
            r.bytes_read = bytes;
            r.strategy_mix = Some(mix.clone());
            let mut caches: Vec<Box<dyn KvCache>> = mosaics
                .into_iter()
                .map(|m| Box::new(m) as Box<dyn KvCache>)
                .collect();
            let r = measure(&mut caches, r)?;
            let mosaic_bpt = r.kv_bytes_per_token;
            rows.push(r);
            drop(caches);
            if !refs.is_empty() {
                let rb = ReferenceBackend;
                let mut out = Array2::zeros((shape.q_heads, shape.head_dim));
                let (us, steps) = time_steps(
                    |q| {
                        for (c, ql) in refs.iter().zip(q) {
                            rb.attend(c, ql.view(), out.view_mut())?;
                        }
                        Ok(())
                    },
                    &data.base,
                    1,
                    args.reference_steps,
                    0.0,
                    9,
                )?;
                let e = mean_error(&data, &exact, |l, q, o| {
                    Ok(rb.attend(&refs[l], q.view(), o.view_mut())?)
                })?;
                eprintln!("[{n}] mosaic-reference {}: {us:.0} us/step", lc.label);
                let mut r = row("mosaic-reference", Some(i));
                r.median_us = us;
                r.steps = steps;
                r.bytes_read = bytes;
                r.kv_bytes_per_token = mosaic_bpt;
                r.rel_error = e;
                r.strategy_mix = Some(mix);
                rows.push(r);
            }
        }
    }
    let b = read_bandwidth_gbps(args.bandwidth_bytes, 5);
    eprintln!("read bandwidth: {b:.2} GB/s");
    bw = bw.max(b);
    report(&args, &configs, &rows, bw, &source, backend.name());
    Ok(())
}

/// Prints the table (stdout, or stderr under --json) grouped by configuration, default
/// first as given, and under --json one object per row on stdout.
fn report(
    args: &Args,
    configs: &[LabeledConfig],
    rows: &[Row],
    bw: f64,
    source: &str,
    backend: &str,
) {
    let find = |m: &str, cfg: Option<usize>, ctx: usize| {
        rows.iter()
            .find(|r| r.method == m && r.context == ctx && (m == "full" || r.config == cfg))
            .map(|r| r.median_us)
    };
    let table = |line: String| {
        if args.json {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    };
    let threads = rayon::current_num_threads();
    table(format!(
        "backend {backend} | threads {threads} | {source} | measured read bandwidth {bw:.2} GB/s (best of all probes)"
    ));
    let gbps = |r: &Row| r.bytes_read as f64 / (r.median_us * 1e-6) / 1e9;
    let header = || {
        format!(
            "{:<17} {:>8} {:>11} {:>9} {:>7} {:>8} {:>7} {:>9} {:>7} {:>8} {:>8} {:>9}",
            "method",
            "context",
            "median_us",
            "MB_read",
            "GB/s",
            "probe",
            "bw_frac",
            "B/token",
            "x_full",
            "x_quest",
            "rel_err",
            "prefill_s"
        )
    };
    for (ci, lc) in configs.iter().enumerate() {
        let c = &lc.config;
        table(format!(
            "\nconfig {}: token_rate {}, min_budget_tokens {}, channels {}, value_dtypes {:?}, block_sizes {:?}",
            lc.label,
            c.token_rate,
            c.min_budget_tokens,
            serde_json::to_string(&c.channels).unwrap_or_default(),
            c.value_dtypes.iter().map(|d| d.name()).collect::<Vec<_>>(),
            c.block_sizes
        ));
        table(header());
        for r in rows
            .iter()
            .filter(|r| r.config == Some(ci) || r.config.is_none())
        {
            let vs_full = find("full", None, r.context).map(|f| f / r.median_us);
            let vs_quest = find("quest", Some(ci), r.context).map(|f| f / r.median_us);
            table(format!(
                "{:<17} {:>8} {:>11.0} {:>9.1} {:>7.2} {:>8.2} {:>7.2} {:>9.1} {:>7.2} {:>8.2} {:>8.4} {:>9.2}",
                r.method,
                r.context,
                r.median_us,
                r.bytes_read as f64 / 1e6,
                gbps(r),
                r.probe_gbps,
                gbps(r) / bw,
                r.kv_bytes_per_token,
                vs_full.unwrap_or(f64::NAN),
                vs_quest.unwrap_or(f64::NAN),
                r.rel_error,
                r.prefill_s
            ));
            if r.method == "mosaic-reference" {
                let m = find("mosaic", Some(ci), r.context).unwrap_or(f64::NAN);
                table(format!(
                    "  optimized packed attention is {:.1}x faster than the reference's",
                    r.median_us / m
                ));
            }
        }
    }
    if !args.json {
        return;
    }
    for r in rows {
        let vs_full = find("full", None, r.context).map(|f| f / r.median_us);
        let vs_quest = r
            .config
            .and_then(|ci| find("quest", Some(ci), r.context))
            .map(|f| f / r.median_us);
        let mut o = json!({
            "method": r.method,
            "config": r.config.map(|i| configs[i].label.clone()),
            "context": r.context,
            "layers": r.layers,
            "median_us": r.median_us,
            "bytes_read": r.bytes_read,
            "gbps": gbps(r),
            "probe_gbps": r.probe_gbps,
            "measured_bandwidth_gbps": bw,
            "bandwidth_fraction": gbps(r) / bw,
            "kv_bytes_per_token": r.kv_bytes_per_token,
            "speedup_vs_full": vs_full,
            "speedup_vs_quest": vs_quest,
            "rel_error_vs_full": r.rel_error,
            "prefill_s": r.prefill_s,
            "steps": r.steps,
            "token_rate": r.token_rate,
            "min_budget_tokens": r.min_budget_tokens,
            "source": source,
            "backend": backend,
            "threads": rayon::current_num_threads(),
            "pool": POOL.get().copied().unwrap_or("default"),
        });
        if let Some(m) = &r.strategy_mix {
            o["strategy_mix"] = m.clone();
        }
        if r.method == "mosaic-reference" {
            o["optimized_speedup_over_reference"] = json!(r
                .config
                .and_then(|ci| find("mosaic", Some(ci), r.context))
                .map(|m| r.median_us / m));
        }
        println!("{o}");
    }
}
