//! Where a MosaicKV decode step's time goes, stage by stage (issue 38), beside what its bytes
//! and arithmetic allow:
//!
//!     profile_stages [--context 131072] [--config default] [--steps 40] [--json]
//!
//! One layer of Llama-3.1-8B shape (8 KV heads, 32 query heads, head_dim 128) at `--context`
//! tokens: the compare tool's synthetic K/V (`synthetic::structured_kv`, seed 42) compressed
//! with `--config` (a name of the compare tool, or a JSON file). Then `--steps` rounds of one
//! plain step (`packed_attention`, no clock read) and one profiled step
//! (`packed_attention_profiled`), each on fresh perturbed queries, on the detected CPU path
//! and the rayon pool (`RAYON_NUM_THREADS`). Prints per stage: mean time per step (wall for the
//! phases, thread time summed over threads for the stages inside them), the bytes the stage
//! reads, its arithmetic, and the time those bytes take at the probed read bandwidth.
//! Bytes and arithmetic are counted on the first query set's selection.

use clap::Parser;
use mosaickv_benches::{median, read_bandwidth_gbps, resolve_config, step_work};
use mosaickv_optimized::attention::{
    packed_attention, packed_attention_profiled, MosaicScratch, SelectionSource,
};
use mosaickv_optimized::profile::StepProfile;
use mosaickv_optimized::{OptimizedMosaicCache, Path};
use mosaickv_reference::synthetic;
use mosaickv_spec::{KvCache, KvShape};
use ndarray::Array2;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::error::Error;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "A MosaicKV decode step's time by stage, beside its bytes and arithmetic")]
struct Args {
    /// Tokens in the cache.
    #[arg(long, default_value_t = 131072, value_parser = at_least_one)]
    context: usize,
    /// Configuration: a name of the compare tool (default, paper, ...) or a JSON file.
    #[arg(long, default_value = "default")]
    config: String,
    /// Rounds of one plain and one profiled step (after 5 warm-up rounds).
    #[arg(long, default_value_t = 40, value_parser = at_least_one)]
    steps: usize,
    /// Also print the numbers as one JSON object.
    #[arg(long)]
    json: bool,
}

fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s:?} is not a whole number of at least 1")),
    }
}

fn main() {
    let pool = mosaickv_benches::setup_pool();
    eprintln!(
        "rayon: {} threads, {pool} pool",
        rayon::current_num_threads()
    );
    if let Err(e) = run(Args::parse()) {
        eprintln!("profile_stages: {e}");
        std::process::exit(1);
    }
}

fn run(a: Args) -> Result<(), Box<dyn Error>> {
    let shape = KvShape::new(8, 32, 128)?;
    let config = resolve_config(&a.config, shape.head_dim)?;
    let path = Path::detect();
    let threads = rayon::current_num_threads();
    eprintln!(
        "profile_stages: {} tokens, config {}, path {}, {threads} threads; compressing...",
        a.context,
        a.config,
        path.name()
    );
    let (keys, values) = synthetic::structured_kv(a.context, shape.kv_heads, shape.head_dim, 42);
    let mut cache = OptimizedMosaicCache::new(shape, config.config.clone())?;
    let t = Instant::now();
    cache.prefill(keys.view(), values.view())?;
    eprintln!("compressed in {:.1} s", t.elapsed().as_secs_f64());
    let c = cache.compressed().clone();
    let base: Vec<Array2<f32>> = (0..8)
        .map(|i| synthetic::queries(shape.q_heads, shape.head_dim, &keys, 1000 + i))
        .collect();
    drop((keys, values));
    let gbps = read_bandwidth_gbps(1 << 30, 5);
    let mut sc = MosaicScratch::default();
    let mut out = vec![0f32; shape.q_heads * shape.head_dim];
    let sel = packed_attention(
        path,
        &c,
        base[0].as_slice().expect("contiguous"),
        SelectionSource::Compute,
        true,
        None,
        &mut sc,
    )?
    .expect("a computed selection");
    let stages = step_work(&c, &sel);

    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut q = base[0].clone();
    let mut plain = Vec::new();
    let mut prof = StepProfile::default();
    for i in 0..a.steps + 5 {
        for (j, profiled) in [false, true].into_iter().enumerate() {
            let b = &base[(2 * i + j) % base.len()];
            for (x, &y) in q.iter_mut().zip(b.iter()) {
                *x = y + 0.01 * rng.gen_range(-1.0f32..1.0);
            }
            let qs = q.as_slice().expect("contiguous");
            if !profiled {
                let t = Instant::now();
                packed_attention(
                    path,
                    &c,
                    qs,
                    SelectionSource::Compute,
                    false,
                    Some(&mut out),
                    &mut sc,
                )?;
                if i >= 5 {
                    plain.push(t.elapsed().as_secs_f64());
                }
            } else if i >= 5 {
                packed_attention_profiled(path, &c, qs, &mut out, &mut sc, &mut prof)?;
            } else {
                packed_attention_profiled(
                    path,
                    &c,
                    qs,
                    &mut out,
                    &mut sc,
                    &mut StepProfile::default(),
                )?;
            }
        }
    }
    let plain_ms = median(&plain) * 1e3;
    let n = prof.steps as f64;
    let ms = |x: std::time::Duration| x.as_secs_f64() * 1e3 / n;
    let total_bytes: f64 = stages.iter().map(|w| w.bytes as f64).sum();
    let at_bw = |bytes: f64| bytes / (gbps * 1e9) * 1e3;

    println!(
        "{} tokens, config {}, {} path, {threads} threads; probed read bandwidth {gbps:.1} GB/s; \
         {} profiled steps",
        a.context,
        a.config,
        path.name(),
        prof.steps
    );
    println!(
        "step: {plain_ms:.2} ms plain (median), {:.2} ms profiled (mean); {:.2} MB read, \
         {:.2} ms at the probed bandwidth ({:.0} % of it reached by the plain step)",
        ms(prof.wall()),
        total_bytes / 1e6,
        at_bw(total_bytes),
        100.0 * at_bw(total_bytes) / plain_ms
    );
    println!();
    println!("| phase (wall) | ms per step | share |");
    println!("|---|---:|---:|");
    let wall = ms(prof.wall());
    for (name, t) in [
        (
            "SPEC 8: rotate, score, select (heads in parallel)",
            prof.select_wall,
        ),
        ("work units planned", prof.plan_wall),
        (
            "SPEC 9 over the selected blocks (units in parallel)",
            prof.units_wall,
        ),
        (
            "dense rows, merge, back-rotation (heads in parallel)",
            prof.merge_wall,
        ),
    ] {
        println!("| {name} | {:.2} | {:.0} % |", ms(t), 100.0 * ms(t) / wall);
    }
    println!();
    println!(
        "| stage | thread ms per step | MB read | M multiply-adds | ms at {gbps:.1} GB/s | GB/s reached | G multiply-adds/s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    for w in stages {
        let t = w.stage.map(|stage| ms(prof.thread_time(stage)));
        let (bytes, fmas) = (w.bytes as f64, w.multiply_adds as f64);
        let cell = |f: &dyn Fn(f64) -> String| t.map_or("-".into(), f);
        println!(
            "| {} | {} | {:.2} | {:.1} | {:.2} | {} | {} |",
            w.name,
            cell(&|t| format!("{t:.2}")),
            bytes / 1e6,
            fmas / 1e6,
            at_bw(bytes),
            cell(&|t| format!("{:.1}", bytes / (t * 1e-3) / 1e9)),
            cell(&|t| format!("{:.1}", fmas / (t * 1e-3) / 1e9)),
        );
        rows.push(serde_json::json!({
            "stage": w.name, "thread_ms": t, "bytes": bytes, "multiply_adds": fmas,
        }));
    }
    if a.json {
        let j = serde_json::json!({
            "context": a.context, "config": a.config, "path": path.name(), "threads": threads,
            "probe_gbps": gbps, "plain_step_ms": plain_ms, "profiled_step_ms": wall,
            "steps": prof.steps,
            "phases_ms": {
                "select": ms(prof.select_wall), "plan": ms(prof.plan_wall),
                "units": ms(prof.units_wall), "merge": ms(prof.merge_wall),
            },
            "stages": rows,
        });
        println!("{j}");
    }
    Ok(())
}
