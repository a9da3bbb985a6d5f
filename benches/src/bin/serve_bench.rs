//! `serve_bench`: a load generator for `mosaickv serve` (issue 16).
//!
//! For each method in `--methods`, in one run and on the same prompts, it starts the server
//! in-process on 127.0.0.1 (any free port) with the same `--kv-budget`, runs `--clients`
//! concurrent streaming clients that send `--requests` completions in all (RULER needle
//! haystacks of `--prompt-tokens` tokens from the tasks crate, greedy, `--max-tokens` each), and
//! reports generated tokens per second, time to first token and time between tokens (p50, p99),
//! the peak KV bytes, the most sequences the budget admitted at once, and errors. From the
//! server's engine thread it also reports where its time went: decode tokens per second (the
//! tokens of batched decode steps over the engine seconds in those steps, the part of serving
//! the KV cache changes), the mean batch of a step, and the seconds spent prefilling prompts
//! (the same forward passes for every method). It prints a table and writes JSON (`--json`).
//!
//! Time between tokens is measured between consecutive streamed chunks of one request (a chunk
//! carries one token, or a few when text is held back for a partial character).
//!
//! ```text
//! cargo run --release -p mosaickv-benches --bin serve_bench -- \
//!     --methods full,mosaic --clients 8 --requests 16 --prompt-tokens 2048 --max-tokens 32 \
//!     --kv-budget 400M --json serve_bench.json
//! ```

use clap::Parser;
use futures_util::StreamExt;
use mosaickv_engine::{model_path, Method, Model};
use mosaickv_server::{ServeConfig, Server};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// Comma-separated methods, each run in turn on the same prompts.
    #[arg(long, default_value = "full,mosaic")]
    methods: String,
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Requests in all (spread over the clients).
    #[arg(long, default_value_t = 16)]
    requests: usize,
    /// Prompt length in tokens (needle haystacks, one per request seed).
    #[arg(long, default_value_t = 2048)]
    prompt_tokens: usize,
    /// Tokens each request generates: every request runs its full length (sent with
    /// `ignore_eos`) unless `--stop-at-eos`.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Let requests end at the model's end-of-sequence token (shorter, uneven requests).
    #[arg(long)]
    stop_at_eos: bool,
    /// KV budget: bytes, optionally with K, M or G (powers of 1024).
    #[arg(long, default_value = "400M")]
    kv_budget: String,
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    /// Queue capacity of the server (at least the number of clients, so none gets 429).
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Distinct prompts (request i uses prompt i mod this).
    #[arg(long, default_value_t = 4)]
    distinct_prompts: usize,
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    #[arg(long)]
    model: Option<std::path::PathBuf>,
}

fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some(c) if c.is_ascii_alphabetic() => {
            let m: usize = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                _ => return Err(format!("{s:?}: unknown suffix")),
            };
            (&t[..t.len() - 1], m)
        }
        _ => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is not a byte count"))
}

#[derive(Default)]
struct RequestStats {
    ttft: Option<f64>,
    gaps: Vec<f64>,
    tokens: usize,
    error: Option<String>,
}

async fn one_request(url: String, body: String) -> RequestStats {
    let mut st = RequestStats::default();
    let t0 = Instant::now();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(3600))
        .build()
        .expect("client");
    let r = match client
        .post(&url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => {
            st.error = Some(format!("send: {e}"));
            return st;
        }
    };
    if !r.status().is_success() {
        st.error = Some(format!("HTTP {}", r.status().as_u16()));
        return st;
    }
    let mut last: Option<Instant> = None;
    let mut buf = String::new();
    let mut stream = r.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else {
            st.error = Some("stream broke".into());
            return st;
        };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(i) = buf.find("\n\n") {
            let ev: String = buf.drain(..i + 2).collect();
            for line in ev.lines() {
                let Some(d) = line.strip_prefix("data: ") else {
                    continue;
                };
                if d == "[DONE]" {
                    return st;
                }
                let v: Value = serde_json::from_str(d).unwrap_or(Value::Null);
                if let Some(e) = v.get("error") {
                    st.error = Some(e.to_string());
                    continue;
                }
                let text = v["choices"][0]["text"].as_str().unwrap_or("");
                if !text.is_empty() {
                    let now = Instant::now();
                    match last {
                        None => st.ttft = Some((now - t0).as_secs_f64()),
                        Some(l) => st.gaps.push((now - l).as_secs_f64()),
                    }
                    last = Some(now);
                }
                if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                    st.tokens = n as usize;
                }
            }
        }
    }
    st.error
        .get_or_insert_with(|| "stream ended without [DONE]".into());
    st
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

fn main() {
    let a = Args::parse();
    let budget = parse_bytes(&a.kv_budget).unwrap_or_else(|e| {
        eprintln!("serve_bench: --kv-budget {e}");
        std::process::exit(2)
    });
    let path = model_path(a.model.as_deref()).unwrap_or_else(|e| {
        eprintln!("serve_bench: {e}");
        std::process::exit(1)
    });
    let model = Arc::new(Model::load(&path).unwrap_or_else(|e| {
        eprintln!("serve_bench: {e}");
        std::process::exit(1)
    }));
    // the same prompts for every method: chat-rendered needle haystacks plus the answer prefix
    let prompts: Vec<(String, usize)> = (0..a.distinct_prompts.max(1))
        .map(|seed| {
            let (s, ids) = mosaickv_engine::suite::task_sample(
                &model,
                mosaickv_tasks::Task::NiahSingleNoise,
                a.prompt_tokens,
                seed as u64,
            )
            .unwrap_or_else(|e| {
                eprintln!("serve_bench: prompt: {e}");
                std::process::exit(1)
            });
            let text = format!(
                "{}{}",
                model.tokenizer().chat.render(&s.context),
                s.answer_prefix
            );
            (text, ids.len())
        })
        .collect();
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let mut rows = Vec::new();
    for m in a.methods.split(',') {
        let method = Method::parse(m).unwrap_or_else(|e| {
            eprintln!("serve_bench: {e}");
            std::process::exit(2)
        });
        let cfg = ServeConfig {
            model_name: "bench".into(),
            method: method.clone(),
            kv_budget: budget,
            max_batch: a.max_batch,
            queue_capacity: a.queue,
        };
        eprintln!(
            "serve_bench: {method}: {} requests from {} clients",
            a.requests, a.clients
        );
        let row = rt.block_on(async {
            let server = Server::start(model.clone(), cfg, "127.0.0.1", 0)
                .await
                .unwrap_or_else(|e| {
                    eprintln!("serve_bench: {e}");
                    std::process::exit(1)
                });
            let url = format!("http://{}/v1/completions", server.addr());
            let next = Arc::new(AtomicUsize::new(0));
            let t0 = Instant::now();
            let mut handles = Vec::new();
            for _ in 0..a.clients {
                let (next, url, prompts) = (next.clone(), url.clone(), prompts.clone());
                let t0 = t0;
                let (requests, max_tokens, ignore_eos) = (a.requests, a.max_tokens, !a.stop_at_eos);
                handles.push(tokio::spawn(async move {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        if i >= requests {
                            return out;
                        }
                        let body = json!({"model": "bench", "prompt": prompts[i % prompts.len()].0,
                            "max_tokens": max_tokens, "temperature": 0, "stream": true,
                            "ignore_eos": ignore_eos})
                        .to_string();
                        let r = one_request(url.clone(), body).await;
                        // progress on stderr: one line per finished request
                        eprintln!(
                            "serve_bench: request {}/{requests} done ({} tokens{}), {:.0} s",
                            i + 1,
                            r.tokens,
                            r.error
                                .as_deref()
                                .map(|e| format!(", error: {e}"))
                                .unwrap_or_default(),
                            t0.elapsed().as_secs_f64()
                        );
                        out.push(r);
                    }
                }));
            }
            let mut all = Vec::new();
            for h in handles {
                all.extend(h.await.unwrap_or_default());
            }
            let wall = t0.elapsed().as_secs_f64();
            let stats = server.stats();
            server.shutdown();
            let tokens: usize = all.iter().map(|r| r.tokens).sum();
            let mut ttft: Vec<f64> = all.iter().filter_map(|r| r.ttft).collect();
            let mut tbt: Vec<f64> = all.iter().flat_map(|r| r.gaps.iter().copied()).collect();
            let errors: Vec<String> = all.iter().filter_map(|r| r.error.clone()).collect();
            json!({
                "method": method.to_string(),
                "requests": all.len(),
                "generated_tokens": tokens,
                "wall_s": wall,
                "tokens_per_s": tokens as f64 / wall,
                "ttft_p50_s": pct(&mut ttft, 0.5), "ttft_p99_s": pct(&mut ttft, 0.99),
                "tbt_p50_s": pct(&mut tbt, 0.5), "tbt_p99_s": pct(&mut tbt, 0.99),
                "peak_kv_bytes": stats.kv_peak,
                "max_admitted": stats.running_peak,
                "reservation_overruns": stats.reservation_overruns,
                // the engine thread's time: decode steps alone (the KV cache's share of
                // serving) and prompt prefills (the same forward passes for every method)
                "decode_steps": stats.decode_steps,
                "decode_tokens": stats.decode_tokens,
                "decode_s": stats.decode_s,
                "decode_tokens_per_s": stats.decode_tokens as f64 / stats.decode_s,
                "mean_batch": stats.decode_tokens as f64 / stats.decode_steps.max(1) as f64,
                "prefill_s": stats.prefill_s,
                "errors": errors.len(),
                "error_examples": errors.iter().take(3).collect::<Vec<_>>(),
            })
        });
        rows.push(row);
    }
    println!(
        "serve_bench: {} clients, {} requests, prompts of {} tokens (measured {:?}), max_tokens {}, KV budget {} bytes, max batch {}",
        a.clients,
        a.requests,
        a.prompt_tokens,
        prompts.iter().map(|p| p.1).collect::<Vec<_>>(),
        a.max_tokens,
        budget,
        a.max_batch
    );
    println!(
        "| method | tokens/s | decode tokens/s | mean batch | prefill s | decode s | TTFT p50 s | TTFT p99 s | TBT p50 s | TBT p99 s | peak KV bytes | max admitted | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {:.2} | {:.2} | {:.2} | {:.1} | {:.1} | {:.2} | {:.2} | {:.3} | {:.3} | {} | {} | {} |",
            r["method"].as_str().unwrap_or(""),
            r["tokens_per_s"].as_f64().unwrap_or(f64::NAN),
            r["decode_tokens_per_s"].as_f64().unwrap_or(f64::NAN),
            r["mean_batch"].as_f64().unwrap_or(f64::NAN),
            r["prefill_s"].as_f64().unwrap_or(f64::NAN),
            r["decode_s"].as_f64().unwrap_or(f64::NAN),
            r["ttft_p50_s"].as_f64().unwrap_or(f64::NAN),
            r["ttft_p99_s"].as_f64().unwrap_or(f64::NAN),
            r["tbt_p50_s"].as_f64().unwrap_or(f64::NAN),
            r["tbt_p99_s"].as_f64().unwrap_or(f64::NAN),
            r["peak_kv_bytes"],
            r["max_admitted"],
            r["errors"],
        );
    }
    if let Some(p) = &a.json {
        let doc = json!({
            "clients": a.clients, "requests": a.requests, "prompt_tokens": a.prompt_tokens,
            "max_tokens": a.max_tokens, "ignore_eos": !a.stop_at_eos, "kv_budget": budget, "max_batch": a.max_batch,
            "rows": rows,
        });
        if let Err(e) = std::fs::write(p, serde_json::to_string_pretty(&doc).unwrap_or_default()) {
            eprintln!("serve_bench: {}: {e}", p.display());
            std::process::exit(1);
        }
    }
}
