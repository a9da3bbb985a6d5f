//! `mosaickv fidelity --length N [--methods ...]`: measures that do not depend on whether a
//! 135M model can solve a task (issue 4).
//!
//! 1. On one real prompt (a `niah_single_noise` prompt of N tokens, formerly named
//!    `niah_single_1`), per layer, each method's attention-output relative L2 error and
//!    recall@k against full attention (SPEC.md section 16), at the first few decode steps. The decode runs on the dense cache; every method's
//!    cache sees the same K/V and queries (`mosaickv_engine::probe`).
//! 2. Teacher-forced over the last 64 positions of a long natural text: each method's mean
//!    next-token KL divergence `KL(full || method)` and top-1 agreement against the full cache.

use crate::error::{io, CliError};
use crate::llm;
use mosaickv_engine::probe::{kl_and_top1, LayerProbe, ProbeLog};
use mosaickv_engine::{argmax, Caches, LayerKv, Method, Model};
use mosaickv_tasks::Task;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Long English texts present on most Linux machines, tried in order.
pub const TEXT_CANDIDATES: [&str; 3] = [
    "/usr/share/common-licenses/GPL-3",
    "/usr/share/common-licenses/Apache-2.0",
    "/usr/share/common-licenses/GPL-2",
];

/// Every baseline of SPEC.md section 12 and MosaicKV, as for `eval`.
const DEFAULT_METHODS: &str = if mosaickv_methods::has_oracle() {
    "quest,quest-sink,naive2d,kvq8,kvq4,mosaic"
} else {
    "quest,kvq8,kvq4,mosaic"
};

#[derive(clap::Args)]
pub struct Args {
    /// Prompt length in tokens (the niah prompt and the teacher-forced text prefix).
    #[arg(long, default_value_t = 2048)]
    pub length: usize,
    /// Methods compared with full attention (quest-sink and naive2d only in a build with the
    /// oracle, the default).
    #[arg(long, value_delimiter = ',', default_value = DEFAULT_METHODS)]
    pub methods: Vec<String>,
    /// Decode steps measured on the niah prompt.
    #[arg(long, default_value_t = 4)]
    pub steps: usize,
    /// k of recall@k.
    #[arg(long, default_value_t = 32)]
    pub recall_k: usize,
    /// Teacher-forced positions at the end of the text.
    #[arg(long, default_value_t = 64)]
    pub positions: usize,
    /// The natural text (default: the first of /usr/share/common-licenses/{GPL-3,Apache-2.0,GPL-2}
    /// that exists, else the Apache-2.0 text shipped in cli/assets).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Skip the per-layer niah part (only the teacher-forced one).
    #[arg(long)]
    pub no_layers: bool,
    /// Seed of the niah prompt.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// A local GGUF file instead of the cached (or fetched) SmolLM2-135M-Instruct.
    #[arg(long)]
    pub model: Option<PathBuf>,
}

/// Per layer and method, means over the measured decode steps.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayerRecord {
    pub layer: usize,
    pub method: String,
    pub rel_l2: f64,
    pub recall: f64,
}

/// Teacher-forced result of one method.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ForcedRecord {
    pub method: String,
    pub kl: f64,
    pub top1: f64,
    pub kv_bytes_per_token: f64,
    /// All layers' itemized memory (SPEC.md section 13) at the end of the run, for methods
    /// whose caches itemize it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<mosaickv_spec::MemoryReport>,
    pub positions: usize,
    pub tokens: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub length: usize,
    pub prompt_tokens: usize,
    pub recall_k: usize,
    pub layers: Vec<LayerRecord>,
    pub forced: Vec<ForcedRecord>,
    pub text: String,
}

/// Part 1: per-layer attention error and recall on a niah prompt.
pub fn layer_fidelity(
    model: &Model,
    ids: &[u32],
    methods: &[Method],
    steps: usize,
    recall_k: usize,
) -> Result<Vec<LayerRecord>, CliError> {
    let cfg = model.config().clone();
    let log = Arc::new(Mutex::new(ProbeLog::default()));
    let mut caches: Vec<Box<dyn LayerKv>> = Vec::with_capacity(cfg.n_layers);
    let mut per_method: Vec<Vec<Box<dyn mosaickv_engine::methods::ProbeKv>>> = methods
        .iter()
        .map(|m| m.new_probe_caches(&cfg))
        .collect::<Result<_, _>>()?;
    for layer in 0..cfg.n_layers {
        let ms = per_method.iter_mut().map(|v| v.remove(0)).collect();
        caches.push(Box::new(LayerProbe::new(
            layer,
            cfg.kv_heads,
            cfg.head_dim,
            ms,
            recall_k,
            log.clone(),
        )));
    }
    let pre = model.prefill(ids)?;
    pre.fill(&mut caches)?;
    log.lock().expect("probe log").enabled = true;
    let mut tok = argmax(&pre.logits);
    for pos in ids.len()..ids.len() + steps {
        let logits = model.decode_step(tok, pos, &mut caches)?;
        tok = argmax(&logits);
    }
    let log = log.lock().expect("probe log");
    let mut out = Vec::new();
    for layer in 0..cfg.n_layers {
        for (mi, m) in methods.iter().enumerate() {
            let rs: Vec<_> = log
                .records
                .iter()
                .filter(|r| r.layer == layer && r.method == mi)
                .collect();
            let n = rs.len().max(1) as f64;
            out.push(LayerRecord {
                layer,
                method: m.to_string(),
                rel_l2: rs.iter().map(|r| r.rel_l2).sum::<f64>() / n,
                recall: rs.iter().map(|r| r.recall).sum::<f64>() / n,
            });
        }
    }
    Ok(out)
}

/// The natural text: the explicit path, else the first candidate that exists, else the
/// Apache-2.0 text shipped in cli/assets, compiled into the binary.
pub fn natural_text(explicit: Option<&Path>) -> Result<(String, String), CliError> {
    if let Some(p) = explicit {
        return Ok((
            std::fs::read_to_string(p).map_err(|e| io(p, e))?,
            p.display().to_string(),
        ));
    }
    for c in TEXT_CANDIDATES {
        if let Ok(t) = std::fs::read_to_string(c) {
            return Ok((t, c.to_string()));
        }
    }
    Ok((
        include_str!("../assets/Apache-2.0.txt").to_string(),
        "built-in Apache-2.0 text (cli/assets)".into(),
    ))
}

/// Part 2: teacher-forced KL and top-1 agreement over the last `positions` tokens of `tokens`.
/// The first `tokens.len() - positions` tokens are prefilled once; each method then decodes the
/// remaining tokens (teacher forcing) from the shared prefill.
pub fn teacher_forced(
    model: &Model,
    tokens: &[u32],
    positions: usize,
    methods: &[Method],
    mut progress: impl FnMut(&Method),
) -> Result<Vec<ForcedRecord>, CliError> {
    if positions == 0 || tokens.len() <= positions {
        return Err(CliError::Input(format!(
            "teacher forcing needs more than {positions} tokens, got {}",
            tokens.len()
        )));
    }
    let split = tokens.len() - positions;
    // the attention loss (SPEC.md section 11.1) needs the prefill's query statistics; without
    // them its caches would fall back to the energy loss
    let pre = if methods.iter().any(|m| m.wants_query_stats()) {
        model.prefill_with_stats(&tokens[..split])?
    } else {
        model.prefill(&tokens[..split])?
    };
    type Run = (Vec<Vec<f32>>, f64, Option<mosaickv_spec::MemoryReport>);
    let run = |m: &Method| -> Result<Run, CliError> {
        let mut caches = m.new_caches(model.config())?;
        pre.fill(&mut caches)?;
        let mut logits = Vec::with_capacity(positions);
        for (i, &t) in tokens[split..].iter().enumerate() {
            logits.push(model.decode_step(t, split + i, &mut caches)?);
        }
        Ok((
            logits,
            llm::bytes_per_token(&caches),
            llm::memory_report(&caches),
        ))
    };
    // the logits of the last feed predict a token past the text; all `positions` feeds count
    let (full, _, _) = run(&Method::Full)?;
    let mut out = Vec::new();
    for m in methods {
        progress(m);
        let (lg, bytes, memory) = run(m)?;
        let (mut kl, mut top) = (0.0, 0usize);
        for (a, b) in full.iter().zip(&lg) {
            let (k, t) = kl_and_top1(a, b);
            kl += k;
            top += t as usize;
        }
        out.push(ForcedRecord {
            method: m.to_string(),
            kl: kl / positions as f64,
            top1: top as f64 / positions as f64,
            kv_bytes_per_token: bytes,
            memory,
            positions,
            tokens: tokens.len(),
        });
    }
    Ok(out)
}

/// Tokens of the natural text, cut to `length` (error if the text is shorter).
pub fn text_tokens(model: &Model, text: &str, length: usize) -> Result<Vec<u32>, CliError> {
    let ids = model.encode_raw(text)?;
    if ids.len() < length {
        return Err(CliError::Input(format!(
            "the natural text has {} tokens, fewer than --length {length}",
            ids.len()
        )));
    }
    Ok(ids[..length].to_vec())
}

pub fn run(a: Args) -> Result<(), CliError> {
    if a.steps == 0 || a.recall_k == 0 {
        return Err(CliError::Input(
            "--steps and --recall-k must be at least 1 (a mean over no steps, or recall@0, is no measurement)".into(),
        ));
    }
    let methods = llm::parse_methods(&a.methods)?;
    let model = llm::load_model(a.model.as_deref())?;
    let mut layers = Vec::new();
    let mut prompt_tokens = 0;
    if !a.no_layers {
        let (_, ids) = llm::task_sample(&model, Task::NiahSingleNoise, a.length, a.seed)?;
        prompt_tokens = ids.len();
        let context = model.config().context_length;
        if a.steps > context.saturating_sub(ids.len()) {
            return Err(CliError::Input(format!(
                "--steps {} after a prompt of {} tokens passes the context length {context}",
                a.steps,
                ids.len()
            )));
        }
        eprintln!(
            "fidelity: niah_single_noise prompt of {} tokens, {} decode steps",
            ids.len(),
            a.steps
        );
        layers = layer_fidelity(&model, &ids, &methods, a.steps, a.recall_k)?;
        println!("Per layer: attention-output relative L2 error / recall@{} vs full (mean over {} decode steps)\n", a.recall_k, a.steps);
        let mut head = String::from("| layer |");
        let mut rule = String::from("|---:|");
        for m in &methods {
            head += &format!(" {m} |");
            rule += "---:|";
        }
        println!("{head}\n{rule}");
        let nl = model.config().n_layers;
        for layer in 0..nl {
            let mut row = format!("| {layer} |");
            for m in &methods {
                let r = layers
                    .iter()
                    .find(|r| r.layer == layer && r.method == m.to_string())
                    .expect("record");
                row += &format!(" {:.3} / {:.2} |", r.rel_l2, r.recall);
            }
            println!("{row}");
        }
        let mut row = String::from("| mean |");
        for m in &methods {
            let rs: Vec<_> = layers
                .iter()
                .filter(|r| r.method == m.to_string())
                .collect();
            let n = rs.len().max(1) as f64;
            row += &format!(
                " {:.3} / {:.2} |",
                rs.iter().map(|r| r.rel_l2).sum::<f64>() / n,
                rs.iter().map(|r| r.recall).sum::<f64>() / n
            );
        }
        println!("{row}\n");
    }
    let (text, source) = natural_text(a.text.as_deref())?;
    let tokens = text_tokens(&model, &text, a.length)?;
    eprintln!(
        "fidelity: teacher forcing over the last {} of {} tokens of {source}",
        a.positions,
        tokens.len()
    );
    let forced = teacher_forced(&model, &tokens, a.positions, &methods, |m| {
        eprintln!("  {m}")
    })?;
    println!(
        "Teacher-forced, last {} positions of {} tokens of {source}\n",
        a.positions,
        tokens.len()
    );
    println!(
        "| method | mean KL(full‖method) | top-1 agreement | KV B/token |\n|---|---:|---:|---:|"
    );
    for r in &forced {
        println!(
            "| {} | {:.4} | {:.3} | {:.1} |",
            r.method, r.kl, r.top1, r.kv_bytes_per_token
        );
    }
    let itemized: Vec<_> = forced
        .iter()
        .filter_map(|r| r.memory.map(|m| (r, m)))
        .collect();
    if !itemized.is_empty() {
        println!("\nKV bytes per token, by kind (SPEC.md section 13; all layers, device bytes)\n");
        println!("| method | values | scales | bitmaps | padding | block meta | rotations | dense rows | headers | total | host rows (apart) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for (r, m) in itemized {
            let t = m.tokens.max(1) as f64;
            let per = |b: usize| format!("{:.1}", b as f64 / t);
            println!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.method,
                per(m.values),
                per(m.scales),
                per(m.bitmaps),
                per(m.padding),
                per(m.block_meta),
                per(m.rotations),
                per(m.dense),
                per(m.segment_headers),
                per(m.device_bytes()),
                per(m.host_rows)
            );
        }
    }
    if let Some(p) = &a.json {
        let rep = Report {
            length: a.length,
            prompt_tokens,
            recall_k: a.recall_k,
            layers,
            forced,
            text: source,
        };
        let s = serde_json::to_string_pretty(&rep).map_err(|e| CliError::Input(e.to_string()))?;
        mosaickv_spec::atomic::write_atomic(p, (s + "\n").as_bytes()).map_err(|e| io(p, e))?;
    }
    Ok(())
}
