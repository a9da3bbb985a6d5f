//! Measures that do not depend on whether a small model can solve a task (issue 4):
//!
//! 1. On one real prompt (a `niah_single_noise` prompt, formerly named `niah_single_1`), per
//!    layer, each method's attention-output relative L2 error and recall@k against full
//!    attention (SPEC.md section 16), at the first few decode steps ([`layer_fidelity`]). The
//!    decode runs on the dense cache; every method's cache sees the same K/V and queries
//!    (`mosaickv_engine::probe`).
//! 2. Teacher-forced over the last positions of a long natural text: each method's mean
//!    next-token KL divergence `KL(full || method)` and top-1 agreement against the full cache
//!    ([`teacher_forced`]; `eval` reports it beside accuracy, `frontier` beside memory).

use crate::error::{io, EvalError, Result};
use crate::llm;
use mosaickv_engine::probe::{kl_and_top1, LayerProbe, ProbeLog};
use mosaickv_engine::{argmax, Caches, LayerKv, Method, Model};
use mosaickv_tasks::Task;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// The default methods of `fidelity`: those of `eval` (full is the reference each is measured
/// against); `quest-sink` and `naive2d`, oracle-only, run when named.
pub const DEFAULT_METHODS: &str = "quest,kvq8,kvq4,mosaic";

/// Long English texts present on most Linux machines, tried in order.
pub const TEXT_CANDIDATES: [&str; 3] = [
    "/usr/share/common-licenses/GPL-3",
    "/usr/share/common-licenses/Apache-2.0",
    "/usr/share/common-licenses/GPL-2",
];

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

/// What `fidelity --json` writes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub length: usize,
    pub prompt_tokens: usize,
    pub recall_k: usize,
    pub layers: Vec<LayerRecord>,
    pub forced: Vec<ForcedRecord>,
    pub text: String,
}

/// `steps` decode steps and recall@`recall_k` are measurements (at least 1 each).
pub fn check_measures(steps: usize, recall_k: usize) -> Result<()> {
    if steps == 0 || recall_k == 0 {
        return Err(EvalError::Input(
            "--steps and --recall-k must be at least 1 (a mean over no steps, or recall@0, is no measurement)".into(),
        ));
    }
    Ok(())
}

/// The prompt of part 1: a `niah_single_noise` prompt of `length` tokens from `seed`, checked
/// to leave room for `steps` decode steps in the model's context.
pub fn niah_prompt(model: &Model, length: usize, seed: u64, steps: usize) -> Result<Vec<u32>> {
    let (_, ids) = llm::task_sample(model, Task::NiahSingleNoise, length, seed)?;
    let context = model.config().context_length;
    if steps > context.saturating_sub(ids.len()) {
        return Err(EvalError::Input(format!(
            "--steps {} after a prompt of {} tokens passes the context length {context}",
            steps,
            ids.len()
        )));
    }
    Ok(ids)
}

/// Part 1: per-layer attention error and recall on a niah prompt.
pub fn layer_fidelity(
    model: &Model,
    ids: &[u32],
    methods: &[Method],
    steps: usize,
    recall_k: usize,
) -> Result<Vec<LayerRecord>> {
    let cfg = model.config().clone();
    let log = Arc::new(Mutex::new(ProbeLog::default()));
    let mut caches: Vec<Box<dyn LayerKv>> = Vec::with_capacity(cfg.n_layers);
    let mut per_method: Vec<Vec<Box<dyn mosaickv_engine::methods::ProbeKv>>> = methods
        .iter()
        .map(|m| m.new_probe_caches(&cfg))
        .collect::<mosaickv_engine::Result<_>>()?;
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

/// Part 1 as Markdown: per layer, each method's `rel_l2 / recall`, then their means over
/// layers (what `fidelity` prints; a blank line after).
pub fn layer_table(
    layers: &[LayerRecord],
    methods: &[Method],
    n_layers: usize,
    recall_k: usize,
    steps: usize,
) -> String {
    let mut out = format!("Per layer: attention-output relative L2 error / recall@{recall_k} vs full (mean over {steps} decode steps)\n\n");
    let mut head = String::from("| layer |");
    let mut rule = String::from("|---:|");
    for m in methods {
        head += &format!(" {m} |");
        rule += "---:|";
    }
    out += &format!("{head}\n{rule}\n");
    for layer in 0..n_layers {
        let mut row = format!("| {layer} |");
        for m in methods {
            let r = layers
                .iter()
                .find(|r| r.layer == layer && r.method == m.to_string())
                .expect("record");
            row += &format!(" {:.3} / {:.2} |", r.rel_l2, r.recall);
        }
        out += &format!("{row}\n");
    }
    let mut row = String::from("| mean |");
    for m in methods {
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
    out += &format!("{row}\n\n");
    out
}

/// The natural text and a name for it: the explicit path, else the first of
/// [`TEXT_CANDIDATES`] that exists, else the Apache-2.0 text shipped in eval/assets, compiled
/// into the binary.
pub fn natural_text(explicit: Option<&Path>) -> Result<(String, String)> {
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
        "built-in Apache-2.0 text (eval/assets)".into(),
    ))
}

/// Part 2: teacher-forced KL and top-1 agreement over the last `positions` tokens of `tokens`.
/// The first `tokens.len() - positions` tokens are prefilled once; each method then decodes the
/// remaining tokens (teacher forcing) from the shared prefill. `progress` sees each method as
/// it starts.
pub fn teacher_forced(
    model: &Model,
    tokens: &[u32],
    positions: usize,
    methods: &[Method],
    mut progress: impl FnMut(&Method),
) -> Result<Vec<ForcedRecord>> {
    if positions == 0 || tokens.len() <= positions {
        return Err(EvalError::Input(format!(
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
    let run = |m: &Method| -> Result<Run> {
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
pub fn text_tokens(model: &Model, text: &str, length: usize) -> Result<Vec<u32>> {
    let ids = model.encode_raw(text)?;
    if ids.len() < length {
        return Err(EvalError::Input(format!(
            "the natural text has {} tokens, fewer than --length {length}",
            ids.len()
        )));
    }
    Ok(ids[..length].to_vec())
}

/// Part 2 as Markdown: KL, top-1 agreement and bytes per token of each method over the last
/// `positions` of `tokens` tokens of the text named `source`, then the itemized memory of the
/// methods whose caches itemize it (what `fidelity` prints).
pub fn forced_table(
    forced: &[ForcedRecord],
    positions: usize,
    tokens: usize,
    source: &str,
) -> String {
    let mut out =
        format!("Teacher-forced, last {positions} positions of {tokens} tokens of {source}\n\n");
    out +=
        "| method | mean KL(full‖method) | top-1 agreement | KV B/token |\n|---|---:|---:|---:|\n";
    for r in forced {
        out += &format!(
            "| {} | {:.4} | {:.3} | {:.1} |\n",
            r.method, r.kl, r.top1, r.kv_bytes_per_token
        );
    }
    let itemized: Vec<_> = forced
        .iter()
        .filter_map(|r| r.memory.map(|m| (r, m)))
        .collect();
    if !itemized.is_empty() {
        out += "\nKV bytes per token, by kind (SPEC.md section 13; all layers, device bytes)\n\n";
        out += "| method | values | scales | bitmaps | padding | block meta | rotations | dense rows | headers | total | host rows (apart) | host scratch (apart) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
        for (r, m) in itemized {
            let t = m.tokens.max(1) as f64;
            let per = |b: usize| format!("{:.1}", b as f64 / t);
            out += &format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
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
                per(m.host_rows),
                per(m.host_scratch)
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_forced_table_is_markdown_with_a_heading() {
        let r = |method: &str, kl: f64| ForcedRecord {
            method: method.into(),
            kl,
            top1: 0.875,
            kv_bytes_per_token: 768.0,
            memory: None,
            positions: 8,
            tokens: 400,
        };
        let t = forced_table(&[r("full", 0.0), r("kvq8", 0.01234)], 8, 400, "GPL-3");
        assert_eq!(
            t,
            "Teacher-forced, last 8 positions of 400 tokens of GPL-3\n\n\
             | method | mean KL(full‖method) | top-1 agreement | KV B/token |\n\
             |---|---:|---:|---:|\n\
             | full | 0.0000 | 0.875 | 768.0 |\n\
             | kvq8 | 0.0123 | 0.875 | 768.0 |\n"
        );
    }

    /// The by-kind table itemizes a report per token, the host rows and the covariance scratch
    /// in their own columns beside the device total (which counts neither).
    #[test]
    fn the_by_kind_table_shows_host_rows_and_scratch_apart() {
        let m = mosaickv_spec::MemoryReport {
            tokens: 100,
            values: 10_000,
            bitmaps: 1_600,
            rotations: 400,
            host_rows: 2_500,
            host_scratch: 65_536,
            ..Default::default()
        };
        let r = ForcedRecord {
            method: "mosaic".into(),
            kl: 0.05,
            top1: 0.9,
            kv_bytes_per_token: 120.0,
            memory: Some(m),
            positions: 8,
            tokens: 100,
        };
        let t = forced_table(&[r], 8, 100, "x");
        assert!(
            t.contains("| total | host rows (apart) | host scratch (apart) |"),
            "{t}"
        );
        assert!(
            t.contains("| mosaic | 100.0 | 0.0 | 16.0 | 0.0 | 0.0 | 4.0 | 0.0 | 0.0 | 120.0 | 25.0 | 655.4 |"),
            "{t}"
        );
    }

    #[test]
    fn zero_steps_or_recall_k_is_no_measurement() {
        assert!(check_measures(0, 32).is_err());
        assert!(check_measures(4, 0).is_err());
        check_measures(4, 32).unwrap();
    }
}
