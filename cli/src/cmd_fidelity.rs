//! `mosaickv fidelity --length N [--methods ...]`: measures that do not depend on whether a
//! 135M model can solve a task (issue 4), computed by `mosaickv_eval::fidelity`:
//!
//! 1. On one real prompt (a `niah_single_noise` prompt of N tokens, formerly named
//!    `niah_single_1`), per layer, each method's attention-output relative L2 error and
//!    recall@k against full attention (SPEC.md section 16), at the first few decode steps.
//! 2. Teacher-forced over the last 64 positions of a long natural text: each method's mean
//!    next-token KL divergence `KL(full || method)` and top-1 agreement against the full cache.

use crate::error::CliError;
use mosaickv_eval::fidelity::{self, Report, DEFAULT_METHODS};
use mosaickv_eval::{llm, output};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Prompt length in tokens (the niah prompt and the teacher-forced text prefix).
    #[arg(long, default_value_t = 2048)]
    pub length: usize,
    /// Methods compared with full attention (quest-sink and naive2d, which run on the f64
    /// oracle, only when named, in a build with the oracle, the default).
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
    /// that exists, else the Apache-2.0 text shipped in eval/assets).
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

pub fn run(a: Args) -> Result<(), CliError> {
    fidelity::check_measures(a.steps, a.recall_k)?;
    let methods = llm::parse_methods(&a.methods)?;
    let model = llm::load_model(a.model.as_deref())?;
    let mut layers = Vec::new();
    let mut prompt_tokens = 0;
    if !a.no_layers {
        let ids = fidelity::niah_prompt(&model, a.length, a.seed, a.steps)?;
        prompt_tokens = ids.len();
        eprintln!(
            "fidelity: niah_single_noise prompt of {} tokens, {} decode steps",
            ids.len(),
            a.steps
        );
        layers = fidelity::layer_fidelity(&model, &ids, &methods, a.steps, a.recall_k)?;
        print!(
            "{}",
            fidelity::layer_table(
                &layers,
                &methods,
                model.config().n_layers,
                a.recall_k,
                a.steps
            )
        );
    }
    let (text, source) = fidelity::natural_text(a.text.as_deref())?;
    let tokens = fidelity::text_tokens(&model, &text, a.length)?;
    eprintln!(
        "fidelity: teacher forcing over the last {} of {} tokens of {source}",
        a.positions,
        tokens.len()
    );
    let forced = fidelity::teacher_forced(&model, &tokens, a.positions, &methods, |m| {
        eprintln!("  {m}")
    })?;
    print!(
        "{}",
        fidelity::forced_table(&forced, a.positions, tokens.len(), &source)
    );
    if let Some(p) = &a.json {
        let rep = Report {
            length: a.length,
            prompt_tokens,
            recall_k: a.recall_k,
            layers,
            forced,
            text: source,
        };
        output::write_json(p, &rep)?;
    }
    Ok(())
}
