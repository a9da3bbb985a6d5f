//! `mosaickv eval`: the accuracy suite (issues 4, 14). RULER-style tasks at several lengths,
//! one shared dense prefill per prompt, then greedy decoding on each method's caches; a table
//! per task x length x method of accuracy (string_match_all) with its sample count and 95 %
//! Wilson interval, the paired difference against `full` on the same prompts (Newcombe's
//! interval, exact sign-test p-value), KV bytes per token (SPEC.md section 13) and mean
//! decode-step time. The headline pools the cells where `full` scores at least
//! `mosaickv_eval::report::HEADLINE_FULL_MIN`; the others are listed apart. The teacher-forced
//! KL against the full cache on natural text is reported beside it (`mosaickv_tasks::stats`,
//! docs/ACCURACY.md). The harness is `mosaickv-eval`; this module turns the arguments into its
//! inputs and prints what it returns.

use crate::error::CliError;
use crate::progress::{secs, Progress};
use mosaickv_engine::store::PrefillStore;
use mosaickv_engine::suite::default_suite;
use mosaickv_engine::Model;
use mosaickv_eval::suite::{lengths_fit, resolve_suite, Resolved, DEFAULT_METHODS};
use mosaickv_eval::{fidelity, llm, output, report, run_log_path, run_suite, RunLog};
use mosaickv_eval::{StorePrefills, SuiteRequest};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Tasks and suites (comma-separated): RULER's niah_single_1, niah_single_2, niah_single_3,
    /// niah_multikey_1, niah_multikey_2, niah_multikey_3, niah_multivalue, niah_multiquery, vt,
    /// cwe, fwe (suite `ruler`: all eleven); the earlier niah_single_noise, niah_multikey_noise,
    /// niah_multivalue_noise, niah_multiquery_noise, vt_noex, cwe_small (suite `noise`)
    /// [default: the model's default suite, `engine/src/suite.rs`].
    #[arg(long, value_delimiter = ',')]
    pub tasks: Option<Vec<String>>,
    /// Prompt lengths in tokens (prompt + answer budget fit each) [default: the model's suite].
    #[arg(long, value_delimiter = ',')]
    pub lengths: Option<Vec<usize>>,
    /// Samples per task and length [default: the model's suite].
    #[arg(long)]
    pub samples: Option<usize>,
    /// Tokens of natural text for the teacher-forced KL run, 0 for none [default: the model's
    /// suite].
    #[arg(long)]
    pub kl_length: Option<usize>,
    /// Methods (comma-separated): full, quest, quest-sink, naive2d, kvq8, kvq4, kvq8-norot,
    /// kvq4-norot, turboquant:<preset>, mosaic, mosaic-ref, with optional :key=value overrides
    /// (quest-sink, naive2d and mosaic-ref run on the f64 oracle: named only, never by default).
    #[arg(long, value_delimiter = ',', default_value = DEFAULT_METHODS)]
    pub methods: Vec<String>,
    /// Seed of the task generator (sample i uses seed + i).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the records as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw accuracy vs length per method (mean over tasks) into this SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Print every prediction (stderr).
    #[arg(long)]
    pub verbose: bool,
    /// A local GGUF file instead of the cached (or fetched) SmolLM2-135M-Instruct.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Store each prompt's dense prefill under $MOSAICKV_HOME/prefills and reuse it (every
    /// method, rerun and later run): `auto` for prompts of 4,096 tokens or more, `always`,
    /// `never`.
    #[arg(long, value_enum, default_value_t = StorePrefills::Auto)]
    pub store_prefills: StorePrefills,
    /// Measure every result again instead of resuming from the run log (the log keeps the old
    /// lines, other runs' included; the new results supersede them where measured).
    #[arg(long)]
    pub fresh: bool,
    /// Run nothing: report (tables, --json) the results an earlier or still running run with
    /// the same arguments and code has put in its run log; prompts not wholly in it are left
    /// out and named.
    #[arg(long, conflicts_with = "fresh")]
    pub report_only: bool,
}

impl Args {
    /// The suite these arguments ask for (what they leave out comes from the model's default
    /// suite).
    fn request(&self) -> SuiteRequest {
        SuiteRequest {
            tasks: self.tasks.clone(),
            lengths: self.lengths.clone(),
            samples: self.samples,
            kl_length: self.kl_length,
            methods: self.methods.clone(),
            seed: self.seed,
            verbose: self.verbose,
        }
    }
}

pub fn run(a: Args) -> Result<(), CliError> {
    let t0 = Instant::now();
    // bad method names fail before the model loads
    llm::parse_methods(&a.methods)?;
    let model_path = mosaickv_engine::resolve_model(a.model.as_deref())?;
    let model = Model::load(&model_path)?;
    let c = model.config();
    let defaults = default_suite(
        a.model.as_deref().and_then(|p| p.to_str()),
        (c.n_layers, c.q_heads, c.kv_heads, c.head_dim),
    );
    let Resolved {
        suite,
        kl_length,
        kl_positions,
    } = resolve_suite(&a.request(), defaults)?;
    lengths_fit(&model, &suite.lengths)?;
    eprintln!(
        "eval: {} (options not given: the default suite of {}), {} tasks x {:?} x {} samples, {} methods, KL over {} tokens",
        a.model
            .as_deref()
            .map_or("default model".into(), |p| p.display().to_string()),
        defaults.model,
        suite.tasks.len(),
        suite.lengths,
        suite.samples,
        suite.methods.len(),
        kl_length
    );
    let mut pb = Progress::stderr(
        "eval",
        suite.tasks.len() * suite.lengths.len() * suite.samples,
        suite.methods.len(),
    );
    let home = mosaickv_engine::default_home();
    let store = PrefillStore::new(&home, &model_path)?;
    let mut log = RunLog::open(&run_log_path(&home, &store, suite.seed), a.fresh)?;
    if a.report_only {
        eprintln!(
            "eval: report only: {} results in {}",
            log.len(),
            log.path().display()
        );
    } else if !log.is_empty() {
        eprintln!(
            "eval: resuming: {} results in the run log {} (runs of this model with the same code and seed; this run reuses those of its prompts and methods, --fresh ignores them)",
            log.len(),
            log.path().display()
        );
    } else {
        eprintln!(
            "eval: results are kept as they come in {}",
            log.path().display()
        );
    }
    let mut keep = a.store_prefills.keep(&store, Some(&mut log));
    keep.report_only = a.report_only;
    let records = run_suite(&model, &suite, &mut pb, keep)?;
    pb.finish();
    let forced = if kl_length > 0 && !a.report_only {
        let (text, source) = fidelity::natural_text(None)?;
        let tokens = fidelity::text_tokens(&model, &text, kl_length)?;
        eprintln!("eval: teacher-forced KL over the last {kl_positions} of {kl_length} tokens of {source}");
        fidelity::teacher_forced(&model, &tokens, kl_positions, &suite.methods, |m| {
            eprintln!("  {m}")
        })?
    } else {
        Vec::new()
    };
    print!("{}", report::table(&records));
    println!();
    print!(
        "{}",
        report::summary_table(&records, &report::summarize(&records, &forced))
    );
    let ruler = report::ruler_averages(&records);
    if !ruler.is_empty() {
        println!();
        print!("{}", report::ruler_table(&ruler));
    }
    eprintln!(
        "eval: {} in {}",
        records.len(),
        secs(t0.elapsed().as_secs_f64())
    );
    if let Some(p) = &a.json {
        output::write_json(p, &report::eval_json(&records, &forced))?;
    }
    if let Some(p) = &a.plot {
        report::plot_accuracy_vs_length(p, &suite, &records)?;
    }
    Ok(())
}
