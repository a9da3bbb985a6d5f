//! `mosaickv frontier`: the accuracy-memory frontier (issues 4, 14), computed by
//! `mosaickv_eval::frontier`. Sweeps channel retention for MosaicKV (fixed policy) and naive
//! 2-D and the loss thresholds of MosaicKV's default policy, plus every other baseline of
//! SPEC.md section 12 (full, quest, quest-sink, kvq8, kvq4) on the same prompts; for each: the
//! suite's mean accuracy (with the headline cells' pooled accuracy and Wilson interval) and the
//! teacher-forced KL against the full cache, each beside the KV bytes per token it reached.
//! Writes a table, optional JSON, and two SVG plots.

use crate::error::CliError;
use crate::progress::Progress;
use mosaickv_engine::store::PrefillStore;
use mosaickv_eval::frontier::{self, KL_POSITIONS};
use mosaickv_eval::suite::{lengths_fit, parse_tasks};
use mosaickv_eval::{fidelity, output, report, run_log_path, run_suite, RunLog};
use mosaickv_eval::{StorePrefills, Suite};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Channel retentions swept for mosaic (fixed policy, g = 1) (and naive2d with
    /// --oracle-baselines).
    #[arg(long, value_delimiter = ',', default_value = "0.25,0.375,0.5,0.625")]
    pub retentions: Vec<f64>,
    /// Loss thresholds `key_loss/value_loss` swept for mosaic's default (loss-threshold) policy
    /// (the key loss against the keys' spread, SPEC.md section 11.1; the default is 0.01/0.02).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.005/0.01,0.01/0.02,0.02/0.03,0.04/0.05"
    )]
    pub thresholds: Vec<String>,
    /// More methods on the same prompts (comma-separated `Method` names, e.g.
    /// `mosaic:aloss=0.1/0.001` for the attention loss of SPEC.md section 11.1.1).
    #[arg(long, value_delimiter = ',')]
    pub extra: Vec<String>,
    /// Also sweep quest-sink and naive2d, which only the f64 oracle implements (slow; needs
    /// a build with the `oracle` feature, the default).
    #[arg(long)]
    pub oracle_baselines: bool,
    /// Tasks of the accuracy part.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "niah_single_noise,niah_multikey_noise,niah_multivalue_noise,niah_multiquery_noise"
    )]
    pub tasks: Vec<String>,
    /// Lengths of the accuracy part.
    #[arg(long, value_delimiter = ',', default_value = "1024")]
    pub lengths: Vec<usize>,
    /// Samples per task and length.
    #[arg(long, default_value_t = 3)]
    pub samples: usize,
    /// Seed of the task generator.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Text length (tokens) of the teacher-forced part; its last 64 positions are scored.
    #[arg(long, default_value_t = 2048)]
    pub kl_length: usize,
    /// SVG of accuracy vs bytes per token.
    #[arg(long, default_value = "docs/frontier_accuracy.svg")]
    pub plot_accuracy: PathBuf,
    /// SVG of teacher-forced KL vs bytes per token.
    #[arg(long, default_value = "docs/frontier_kl.svg")]
    pub plot_kl: PathBuf,
    /// Write the points as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// The model: a known name (`smollm2-135m`, `qwen2.5-1.5b`, `qwen2.5-0.5b`, fetched on first use) or a
    /// local GGUF file [default: SmolLM2-135M-Instruct].
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Store each prompt's dense prefill and reuse it (as `eval --store-prefills`).
    #[arg(long, value_enum, default_value_t = StorePrefills::Auto)]
    pub store_prefills: StorePrefills,
    /// Measure every result again instead of resuming from the run log (frontier shares
    /// `eval`'s run log, where a method measured by either is not run again; the log keeps
    /// the old lines, and the new results supersede them where measured).
    #[arg(long)]
    pub fresh: bool,
}

pub fn run(a: Args) -> Result<(), CliError> {
    let methods = frontier::methods(&a.retentions, &a.thresholds, &a.extra, a.oracle_baselines)?;
    frontier::check_suite(&a.lengths, a.samples)?;
    let model_path = mosaickv_engine::resolve_model(a.model.as_deref())?;
    let model = mosaickv_engine::Model::load(&model_path)?;
    lengths_fit(&model, &a.lengths)?;
    let suite = Suite {
        tasks: parse_tasks(&a.tasks)?,
        lengths: a.lengths.clone(),
        samples: a.samples,
        methods: methods.iter().map(|m| m.method.clone()).collect(),
        seed: a.seed,
        verbose: false,
    };
    let mut pb = Progress::stderr(
        "frontier",
        suite.tasks.len() * suite.lengths.len() * suite.samples,
        suite.methods.len(),
    );
    let home = mosaickv_engine::default_home();
    let store = PrefillStore::new(&home, &model_path)?;
    let mut log = RunLog::open(&run_log_path(&home, &store, suite.seed), a.fresh)?;
    eprintln!(
        "frontier: {} earlier results with the same code in {} (--fresh ignores them)",
        log.len(),
        log.path().display()
    );
    let keep = a.store_prefills.keep(&store, Some(&mut log));
    let records = run_suite(&model, &suite, &mut pb, keep)?;
    pb.finish();
    let summary = report::summarize(&records, &[]);
    let (text, source) = fidelity::natural_text(None)?;
    let tokens = fidelity::text_tokens(&model, &text, a.kl_length)?;
    let forced = fidelity::teacher_forced(&model, &tokens, KL_POSITIONS, &suite.methods, |m| {
        eprintln!("teacher-forced: {m}")
    })?;
    let points = frontier::points(&methods, &summary, &forced);
    print!(
        "{}",
        frontier::table(
            &points,
            &a.tasks,
            &a.lengths,
            a.samples,
            a.kl_length,
            &source
        )
    );
    frontier::plot(&points, &a.plot_accuracy, &a.plot_kl)?;
    if let Some(p) = &a.json {
        output::write_json(p, &points)?;
    }
    Ok(())
}
