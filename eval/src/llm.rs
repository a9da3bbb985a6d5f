//! The model-driven pieces the harness shares with the CLI's `generate` and `serve`: loading
//! the model, parsing method lists, greedy decoding on a method's caches, task prompts and
//! budgets.

use crate::error::Result;
use mosaickv_engine::{argmax, resolve_model, Caches, LayerKv, Method, Model, Prefill};
use std::path::Path;
use std::time::Instant;

/// Finds (or fetches) and loads the model: `--model NAME` names a known model
/// (`smollm2-135m`, `qwen2.5-1.5b`, `qwen2.5-0.5b`; fetched into the cache directory on first use),
/// `--model PATH` a local GGUF file; without it, SmolLM2-135M-Instruct.
pub fn load_model(explicit: Option<&Path>) -> Result<Model> {
    let path = resolve_model(explicit)?;
    Ok(Model::load(&path)?)
}

/// Parses a comma-separated method list (see [`Method`] for the names).
pub fn parse_methods(list: &[String]) -> Result<Vec<Method>> {
    Ok(list
        .iter()
        .map(|s| Method::parse(s))
        .collect::<mosaickv_spec::Result<_>>()?)
}

/// What one greedy decode on one method produced.
#[derive(Debug, Clone)]
pub struct Decoded {
    pub ids: Vec<u32>,
    /// Wall time of each `decode_step` (seconds).
    pub step_s: Vec<f64>,
    /// Device bytes per cached token, averaged over layers, at the end of the decode.
    pub bytes_per_token: f64,
    /// Host-side bytes (full-precision rows kept for background compression, and a live
    /// cache's covariance accumulators: `MemoryReport::host_bytes`), all layers.
    pub host_bytes: usize,
}

/// Greedy decode from a shared prefill: the method's caches take the prompt K/V, then up to
/// `max_new` tokens are generated (stopping after an end-of-sequence token, not included in
/// the returned ids). `on_token` sees each generated id.
pub fn decode_greedy(
    model: &Model,
    pre: &Prefill,
    method: &Method,
    max_new: usize,
    mut on_token: impl FnMut(u32),
) -> Result<Decoded> {
    let mut caches = method.new_caches(model.config())?;
    pre.fill(&mut caches)?;
    let mut ids = Vec::new();
    let mut step_s = Vec::new();
    let mut logits = pre.logits.clone();
    let mut pos = pre.len();
    while ids.len() < max_new {
        let next = argmax(&logits);
        if model.is_eos(next) {
            break;
        }
        ids.push(next);
        on_token(next);
        if ids.len() == max_new {
            break;
        }
        let t = Instant::now();
        logits = model.decode_step(next, pos, &mut caches)?;
        step_s.push(t.elapsed().as_secs_f64());
        pos += 1;
    }
    Ok(Decoded {
        ids,
        step_s,
        bytes_per_token: bytes_per_token(&caches),
        host_bytes: caches.iter().map(|c| c.host_bytes()).sum(),
    })
}

/// Device bytes per cached token, averaged over layers (0 for empty caches).
pub fn bytes_per_token(caches: &[Box<dyn LayerKv>]) -> f64 {
    let bytes: usize = caches.iter().map(|c| c.bytes()).sum();
    let tokens: usize = caches.iter().map(|c| c.len()).sum();
    if tokens == 0 {
        0.0
    } else {
        bytes as f64 / tokens as f64
    }
}

/// The itemized memory of all layers together (SPEC.md section 13), where every layer has one.
pub fn memory_report(caches: &[Box<dyn LayerKv>]) -> Option<mosaickv_spec::MemoryReport> {
    let mut sum = mosaickv_spec::MemoryReport::default();
    for c in caches {
        sum += c.memory_report()?;
    }
    Some(sum)
}

pub use mosaickv_engine::suite::{answer_budget, task_sample};
