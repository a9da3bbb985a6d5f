//! Which record layouts does a configuration pick on real K/V, and where do the bytes go?
//! (issue 15: the fixed costs and the per-record costs at the shipped default.)
//!
//! Prefills RULER-like task prompts with the model (dense), compresses every layer's K/V with
//! the optimized CPU backend under the configuration, and prints, per side, how often each
//! `(r, g, dtype)` was chosen (over layers x KV heads x prompts) with its record bytes, and the
//! memory report by kind (SPEC.md section 13), per token and layer.
//!
//! cargo run --release -p mosaickv-engine --example layouts -- --length 2048
//! cargo run --release -p mosaickv-engine --example layouts -- --config my.json

use clap::Parser;
use mosaickv_engine::{resolve_model, suite, Model};
use mosaickv_optimized::OptimizedMosaicCache;
use mosaickv_spec::{CompressConfig, KvCache, KvShape, MemoryReport, RecordLayout};
use mosaickv_tasks::Task;
use std::collections::BTreeMap;
use std::path::PathBuf;

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Parser)]
struct Args {
    /// Prompt length in tokens (task prompts sized to fit).
    #[arg(long, default_value_t = 2048)]
    length: usize,
    /// Tasks, comma separated (names of `mosaickv-tasks`).
    #[arg(long, default_value = "niah_single_noise,niah_multikey_noise")]
    tasks: String,
    /// Prompts per task (seeds 0..n).
    #[arg(long, default_value_t = 2)]
    samples: u64,
    /// A configuration JSON file (SPEC.md section 2); the default configuration without it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Model: a known name (`smollm2-135m`, `qwen2.5-1.5b`) or a GGUF file.
    #[arg(long)]
    model: Option<PathBuf>,
}

fn key(l: &RecordLayout) -> String {
    format!(
        "r={:>3} g={} {:?} ({} B)",
        l.r,
        l.group_size,
        l.dtype,
        l.record_bytes()
    )
}

fn main() -> BoxResult<()> {
    let args = Args::parse();
    let model = Model::load(&resolve_model(args.model.as_deref())?)?;
    let cfg = model.config().clone();
    let config = match &args.config {
        Some(p) => CompressConfig::from_json(&std::fs::read_to_string(p)?)?,
        None => CompressConfig::default(),
    };
    let shape = KvShape::new(cfg.kv_heads, cfg.q_heads, cfg.head_dim)?;
    let tasks: Vec<Task> = args
        .tasks
        .split(',')
        .map(|s| Task::from_name(s.trim()))
        .collect::<Result<_, _>>()?;
    let mut counts: [BTreeMap<String, usize>; 2] = Default::default();
    let mut blocks: BTreeMap<usize, usize> = BTreeMap::new();
    // coded sides (SPEC.md section 6.1): how many dims get each width
    let mut widths: [BTreeMap<u8, usize>; 2] = Default::default();
    let mut sum = MemoryReport::default();
    for task in &tasks {
        for seed in 0..args.samples {
            let (_, ids) = suite::task_sample(&model, *task, args.length, seed)?;
            let pre = model.prefill(&ids)?;
            eprintln!("{} seed {seed}: {} tokens", task.name(), ids.len());
            for l in 0..cfg.n_layers {
                let (k, v) = (pre.keys[l].view(), pre.values[l].view());
                let mut c = OptimizedMosaicCache::new(shape, config.clone())?;
                c.prefill(k, v)?;
                for seg in &c.compressed().segments {
                    for h in &seg.heads {
                        *counts[0].entry(key(&h.strategy.key.layout)).or_default() += 1;
                        *counts[1].entry(key(&h.strategy.value.layout)).or_default() += 1;
                        *blocks.entry(h.strategy.block_size).or_default() += 1;
                        for (w, side) in widths.iter_mut().zip([&h.strategy.key, &h.strategy.value])
                        {
                            for c in &side.coding {
                                *w.entry(c.bits).or_default() += 1;
                            }
                        }
                    }
                }
                sum += c.memory();
            }
        }
    }
    for (name, c) in ["keys", "values"].iter().zip(&counts) {
        let total: usize = c.values().sum();
        println!("\n{name}: layouts chosen (of {total} head segments)");
        let mut v: Vec<_> = c.iter().collect();
        v.sort_by(|a, b| b.1.cmp(a.1));
        for (k, n) in v {
            println!(
                "  {k:<32} {n:>5}  {:5.1} %",
                100.0 * *n as f64 / total as f64
            );
        }
    }
    println!("\nblock sizes: {blocks:?}");
    for (name, w) in ["keys", "values"].iter().zip(&widths) {
        if !w.is_empty() {
            println!("coded {name}: dims per width (bits: count) {w:?}");
        }
    }
    let t = sum.tokens.max(1) as f64;
    println!(
        "\nB/token per layer: values {:.1}, scales {:.1}, bitmaps {:.1}, padding {:.1}, block meta {:.1}, rotations {:.1}, dense rows {:.1}, headers {:.1}; total {:.1} (dense f16 {})",
        sum.values as f64 / t,
        sum.scales as f64 / t,
        sum.bitmaps as f64 / t,
        sum.padding as f64 / t,
        sum.block_meta as f64 / t,
        sum.rotations as f64 / t,
        sum.dense as f64 / t,
        sum.segment_headers as f64 / t,
        sum.device_bytes() as f64 / t,
        4 * cfg.kv_heads * cfg.head_dim
    );
    Ok(())
}
