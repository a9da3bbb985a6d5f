//! `mosaickv frontier`: the accuracy-memory frontier (issues 4, 14). Sweeps channel retention
//! for MosaicKV (fixed policy) and naive 2-D and the loss thresholds of MosaicKV's default
//! policy, plus every other baseline of SPEC.md section 12 (full, quest, quest-sink, kvq8,
//! kvq4) on the same prompts; for each: the suite's mean accuracy (with the headline cells'
//! pooled accuracy and Wilson interval) and the teacher-forced KL against the full cache, each
//! beside the KV bytes per token it reached. Writes a table, optional JSON, and two SVG plots.

use crate::cmd_eval::{self, Suite};
use crate::cmd_fidelity;
use crate::error::{io, CliError};
use crate::plot;
use mosaickv_engine::Method;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Channel retentions swept for mosaic (fixed policy, g = 1) and naive2d.
    #[arg(long, value_delimiter = ',', default_value = "0.25,0.375,0.5,0.625")]
    pub retentions: Vec<f64>,
    /// Loss thresholds `key_loss/value_loss` swept for mosaic's default (loss-threshold) policy.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.0025/0.01,0.005/0.02,0.01/0.03,0.02/0.05"
    )]
    pub thresholds: Vec<String>,
    /// More methods on the same prompts (comma-separated `Method` names, e.g.
    /// `mosaic:aloss=0.1/0.001` for the attention loss of SPEC.md section 11.1.1).
    #[arg(long, value_delimiter = ',')]
    pub extra: Vec<String>,
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
    #[arg(long, value_enum, default_value_t = cmd_eval::StorePrefills::Auto)]
    pub store_prefills: cmd_eval::StorePrefills,
    /// Ignore (and replace) the results of an earlier run instead of resuming from them
    /// (frontier shares `eval`'s run log: a method measured by either is not run again).
    #[arg(long)]
    pub fresh: bool,
}

/// One point of the frontier.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Point {
    pub method: String,
    pub family: String,
    pub retention: Option<f64>,
    pub accuracy: f64,
    pub accuracy_loss: Option<f64>,
    /// Pooled accuracy over the cells where full scores >= 0.8, with its Wilson interval.
    pub headline: Option<mosaickv_tasks::stats::Accuracy>,
    /// Paired difference against full over those cells.
    pub headline_vs_full: Option<mosaickv_tasks::stats::Paired>,
    /// Bytes per token in the accuracy runs (mean over samples).
    pub kv_bytes_per_token: f64,
    pub kl: f64,
    pub top1: f64,
    /// Bytes per token in the teacher-forced run.
    pub kl_bytes_per_token: f64,
}

pub fn run(a: Args) -> Result<(), CliError> {
    // quest-sink and naive2d exist only in the oracle: in a build without it they are left out
    let oracle = mosaickv_methods::has_oracle();
    let mut methods = vec![
        (Method::Full, "full", None),
        (Method::parse("quest")?, "quest", None),
    ];
    if oracle {
        methods.push((Method::parse("quest-sink")?, "quest-sink", None));
    }
    methods.push((Method::parse("kvq8")?, "kvq8", None));
    methods.push((Method::parse("kvq4")?, "kvq4", None));
    for &r in &a.retentions {
        methods.push((
            Method::parse(&format!("mosaic:ret={r}"))?,
            "mosaic (fixed)",
            Some(r),
        ));
        if oracle {
            methods.push((
                Method::parse(&format!("naive2d:ret={r}"))?,
                "naive2d",
                Some(r),
            ));
        }
    }
    for t in &a.thresholds {
        let (k, v) = t.split_once('/').ok_or_else(|| {
            CliError::Input(format!("--thresholds: {t:?} is not key_loss/value_loss"))
        })?;
        methods.push((
            Method::parse(&format!("mosaic:kloss={k}:vloss={v}"))?,
            "mosaic (loss threshold)",
            None,
        ));
    }
    for e in &a.extra {
        let m = Method::parse(e)?;
        let family = match &m {
            Method::Mosaic { config, .. } if !config.loss.is_energy() => "mosaic (attention loss)",
            _ => "other",
        };
        if !methods.iter().any(|x| x.0 == m) {
            methods.push((m, family, None));
        }
    }
    if !methods
        .iter()
        .any(|m| m.0 == Method::parse("mosaic").expect("mosaic parses"))
    {
        methods.push((Method::parse("mosaic")?, "mosaic (loss threshold)", None));
    }
    if a.samples == 0 || a.lengths.is_empty() {
        return Err(CliError::Input(
            "frontier needs at least one length and one sample".into(),
        ));
    }
    cmd_eval::no_repeats("--lengths", &a.lengths)?;
    let model_path = mosaickv_engine::resolve_model(a.model.as_deref())?;
    let model = mosaickv_engine::Model::load(&model_path)?;
    cmd_eval::lengths_fit(&model, &a.lengths)?;
    let suite = Suite {
        tasks: cmd_eval::parse_tasks(&a.tasks)?,
        lengths: a.lengths.clone(),
        samples: a.samples,
        methods: methods.iter().map(|m| m.0.clone()).collect(),
        seed: a.seed,
        verbose: false,
    };
    let mut pb = cmd_eval::Progress::stderr(
        "frontier",
        suite.tasks.len() * suite.lengths.len() * suite.samples,
        suite.methods.len(),
    );
    let home = mosaickv_engine::default_home();
    let store = mosaickv_engine::store::PrefillStore::new(&home, &model_path)?;
    let mut log = cmd_eval::RunLog::open(&cmd_eval::run_log_path(&home, &store, &suite), a.fresh)?;
    eprintln!(
        "frontier: {} earlier results with the same code in {} (--fresh ignores them)",
        log.len(),
        log.path().display()
    );
    let keep = cmd_eval::Keep {
        store: (a.store_prefills != cmd_eval::StorePrefills::Never).then_some(&store),
        store_from: match a.store_prefills {
            cmd_eval::StorePrefills::Auto => cmd_eval::STORE_FROM_TOKENS,
            _ => 0,
        },
        log: Some(&mut log),
    };
    let records = cmd_eval::run_suite(&model, &suite, &mut pb, keep)?;
    pb.finish();
    let summary = cmd_eval::summarize(&records, &[]);
    let (text, source) = cmd_fidelity::natural_text(None)?;
    let tokens = cmd_fidelity::text_tokens(&model, &text, a.kl_length)?;
    let forced = cmd_fidelity::teacher_forced(&model, &tokens, 64, &suite.methods, |m| {
        eprintln!("teacher-forced: {m}")
    })?;
    let mut points = Vec::new();
    for (m, family, ret) in &methods {
        let name = m.to_string();
        let s = summary.iter().find(|s| s.method == name).expect("summary");
        let f = forced.iter().find(|f| f.method == name).expect("forced");
        points.push(Point {
            method: name,
            family: family.to_string(),
            retention: *ret,
            accuracy: s.accuracy,
            accuracy_loss: s.accuracy_loss,
            headline: s.headline,
            headline_vs_full: s.headline_vs_full,
            kv_bytes_per_token: s.kv_bytes_per_token,
            kl: f.kl,
            top1: f.top1,
            kl_bytes_per_token: f.kv_bytes_per_token,
        });
    }
    println!(
        "Frontier: accuracy over {:?} x {:?} x {} samples; KL over the last 64 of {} tokens of {source}\n",
        a.tasks, a.lengths, a.samples, a.kl_length
    );
    println!("| method | headline accuracy [95 % CI] (n) | vs full: diff [95 % CI], lost-won, p | mean accuracy | loss vs full | KV B/token (suite) | KL | top-1 | KV B/token (KL run) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for p in &points {
        println!(
            "| {} | {} | {} | {:.3} | {} | {:.1} | {:.4} | {:.3} | {:.1} |",
            p.method,
            p.headline.map_or("-".into(), |h| cmd_eval::acc_cell(
                h.mean, h.low, h.high, h.n
            )),
            if p.method == "full" {
                "-".into()
            } else {
                cmd_eval::paired_cell(&p.headline_vs_full)
            },
            p.accuracy,
            p.accuracy_loss
                .map_or("-".into(), |v| format!("{:+.1} %", 100.0 * v)),
            p.kv_bytes_per_token,
            p.kl,
            p.top1,
            p.kl_bytes_per_token
        );
    }
    let series = |y: &dyn Fn(&Point) -> f64, x: &dyn Fn(&Point) -> f64| -> Vec<plot::Series> {
        let mut fams: Vec<&str> = Vec::new();
        for p in &points {
            if !fams.contains(&p.family.as_str()) {
                fams.push(&p.family);
            }
        }
        fams.iter()
            .map(|f| plot::Series {
                label: f.to_string(),
                points: points
                    .iter()
                    .filter(|p| p.family == *f)
                    .map(|p| (x(p), y(p)))
                    .collect(),
            })
            .collect()
    };
    plot::line_chart(
        &a.plot_accuracy,
        "Accuracy vs KV bytes per token",
        "KV bytes per token (all bytes counted)",
        "mean accuracy",
        &series(&|p| p.accuracy, &|p| p.kv_bytes_per_token),
        Some((0.0, 1.05)),
    )?;
    plot::line_chart(
        &a.plot_kl,
        "Teacher-forced KL vs KV bytes per token",
        "KV bytes per token (all bytes counted)",
        "mean KL(full || method), nats",
        &series(&|p| p.kl, &|p| p.kl_bytes_per_token),
        None,
    )?;
    if let Some(p) = &a.json {
        let s =
            serde_json::to_string_pretty(&points).map_err(|e| CliError::Input(e.to_string()))?;
        mosaickv_spec::atomic::write_atomic(p, (s + "\n").as_bytes()).map_err(|e| io(p, e))?;
    }
    Ok(())
}
