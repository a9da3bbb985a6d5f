//! `mosaickv eval`: the accuracy suite (issue 4). RULER-style tasks at several lengths, one
//! shared dense prefill per prompt, then greedy decoding on each method's caches; a table per
//! task x length x method of accuracy (string_match_all), accuracy loss vs full (SPEC.md
//! section 16), KV bytes per token (SPEC.md section 13) and mean decode-step time.

use crate::error::{io, CliError};
use crate::{llm, plot};
use indicatif::{ProgressBar, ProgressStyle};
use mosaickv_engine::{Method, Model};
use mosaickv_tasks::{string_match_all, Task};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

/// The default suite: every task at 1K and 2K tokens, 2 samples each (about 10 minutes on 2
/// cores; docs/ACCURACY.md).
pub const DEFAULT_TASKS: &str =
    "niah_single_1,niah_multikey,niah_multivalue,niah_multiquery,vt,cwe";
pub const DEFAULT_LENGTHS: &str = "1024,2048";
pub const DEFAULT_SAMPLES: usize = 2;
pub const DEFAULT_METHODS: &str = "full,quest,naive2d,mosaic";

#[derive(clap::Args)]
pub struct Args {
    /// Tasks (comma-separated): niah_single_1, niah_multikey, niah_multivalue, niah_multiquery, vt, cwe.
    #[arg(long, value_delimiter = ',', default_value = DEFAULT_TASKS)]
    pub tasks: Vec<String>,
    /// Prompt lengths in tokens (prompt + answer budget fit each).
    #[arg(long, value_delimiter = ',', default_value = DEFAULT_LENGTHS)]
    pub lengths: Vec<usize>,
    /// Samples per task and length.
    #[arg(long, default_value_t = DEFAULT_SAMPLES)]
    pub samples: usize,
    /// Methods (comma-separated): full, quest, naive2d, mosaic, mosaic-ref, with optional :key=value overrides.
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
}

/// One cell of the table.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub task: String,
    pub length: usize,
    pub method: String,
    /// Mean string_match_all over the samples.
    pub accuracy: f64,
    /// `1 - accuracy / accuracy(full)` (SPEC.md section 16); null without a `full` run or
    /// when full scored 0.
    pub accuracy_loss: Option<f64>,
    /// Device bytes per cached token at the end of decoding, mean over layers and samples.
    pub kv_bytes_per_token: f64,
    /// Mean wall time of one decode step (all 30 layers), ms.
    pub decode_ms: f64,
    pub samples: usize,
    /// Mean prompt tokens.
    pub prompt_tokens: f64,
}

/// What to run.
pub struct Suite {
    pub tasks: Vec<Task>,
    pub lengths: Vec<usize>,
    pub samples: usize,
    pub methods: Vec<Method>,
    pub seed: u64,
    pub verbose: bool,
}

#[derive(Default)]
struct Acc {
    score: f64,
    bytes: f64,
    step_s: f64,
    steps: usize,
    n: usize,
    prompt: f64,
}

/// Runs the suite; records in task, length, method order.
pub fn run_suite(model: &Model, s: &Suite, pb: &ProgressBar) -> Result<Vec<Record>, CliError> {
    let mut acc: BTreeMap<(usize, usize, usize), Acc> = BTreeMap::new();
    for (ti, &task) in s.tasks.iter().enumerate() {
        for (li, &length) in s.lengths.iter().enumerate() {
            for i in 0..s.samples {
                let seed = s.seed + i as u64;
                pb.set_message(format!("{task} {length} #{i}: prefill"));
                let (sample, ids) = llm::task_sample(model, task, length, seed)?;
                let pre = model.prefill(&ids)?;
                for (mi, m) in s.methods.iter().enumerate() {
                    pb.set_message(format!("{task} {length} #{i}: {m}"));
                    let d = llm::decode_greedy(model, &pre, m, llm::answer_budget(task), |_| {})?;
                    let text = model.decode(&d.ids)?;
                    let score = string_match_all(&text, &sample.answers);
                    if s.verbose {
                        say(
                            pb,
                            format!(
                                "{task} {length} seed {seed} {m}: {score:.2} {:?} (answers {:?})",
                                text.trim(),
                                sample.answers
                            ),
                        );
                    }
                    let a = acc.entry((ti, li, mi)).or_default();
                    a.score += score;
                    a.bytes += d.bytes_per_token;
                    a.step_s += d.step_s.iter().sum::<f64>();
                    a.steps += d.step_s.len();
                    a.n += 1;
                    a.prompt += ids.len() as f64;
                    pb.inc(1);
                }
            }
        }
    }
    let full = s.methods.iter().position(|m| *m == Method::Full);
    let mut out = Vec::new();
    for (ti, &task) in s.tasks.iter().enumerate() {
        for (li, &length) in s.lengths.iter().enumerate() {
            let full_acc = full.map(|f| acc[&(ti, li, f)].score / acc[&(ti, li, f)].n as f64);
            for (mi, m) in s.methods.iter().enumerate() {
                let a = &acc[&(ti, li, mi)];
                let accuracy = a.score / a.n as f64;
                out.push(Record {
                    task: task.name().to_string(),
                    length,
                    method: m.to_string(),
                    accuracy,
                    accuracy_loss: full_acc.filter(|&f| f > 0.0).map(|f| 1.0 - accuracy / f),
                    kv_bytes_per_token: a.bytes / a.n as f64,
                    decode_ms: if a.steps > 0 {
                        1e3 * a.step_s / a.steps as f64
                    } else {
                        0.0
                    },
                    samples: a.n,
                    prompt_tokens: a.prompt / a.n as f64,
                });
            }
        }
    }
    Ok(out)
}

/// Per method, over the whole suite: mean accuracy, loss vs full (of the means), mean bytes per
/// token, mean decode ms.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub method: String,
    pub accuracy: f64,
    pub accuracy_loss: Option<f64>,
    pub kv_bytes_per_token: f64,
    pub decode_ms: f64,
}

pub fn summarize(records: &[Record]) -> Vec<Summary> {
    let mut methods: Vec<String> = Vec::new();
    for r in records {
        if !methods.contains(&r.method) {
            methods.push(r.method.clone());
        }
    }
    let mean = |m: &str, f: &dyn Fn(&Record) -> f64| {
        let v: Vec<f64> = records.iter().filter(|r| r.method == m).map(f).collect();
        v.iter().sum::<f64>() / v.len().max(1) as f64
    };
    let full_acc = methods
        .iter()
        .any(|m| m == "full")
        .then(|| mean("full", &|r| r.accuracy));
    methods
        .iter()
        .map(|m| {
            let accuracy = mean(m, &|r| r.accuracy);
            Summary {
                method: m.clone(),
                accuracy,
                accuracy_loss: full_acc.filter(|&f| f > 0.0).map(|f| 1.0 - accuracy / f),
                kv_bytes_per_token: mean(m, &|r| r.kv_bytes_per_token),
                decode_ms: mean(m, &|r| r.decode_ms),
            }
        })
        .collect()
}

fn pct(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{:+.1} %", 100.0 * v))
}

/// The table as Markdown (what `eval` prints).
pub fn table(records: &[Record]) -> String {
    let mut s = String::from(
        "| task | length | method | accuracy | loss vs full | KV B/token | decode ms/step |\n|---|---:|---|---:|---:|---:|---:|\n",
    );
    for r in records {
        s += &format!(
            "| {} | {} | {} | {:.3} | {} | {:.1} | {:.1} |\n",
            r.task,
            r.length,
            r.method,
            r.accuracy,
            pct(r.accuracy_loss),
            r.kv_bytes_per_token,
            r.decode_ms
        );
    }
    s
}

/// The per-method summary as Markdown.
pub fn summary_table(sum: &[Summary]) -> String {
    let mut s = String::from(
        "| method | mean accuracy | loss vs full | KV B/token | decode ms/step |\n|---|---:|---:|---:|---:|\n",
    );
    for m in sum {
        s += &format!(
            "| {} | {:.3} | {} | {:.1} | {:.1} |\n",
            m.method,
            m.accuracy,
            pct(m.accuracy_loss),
            m.kv_bytes_per_token,
            m.decode_ms
        );
    }
    s
}

/// A line above the progress bar (plain stderr when the bar is hidden, e.g. not a terminal).
pub fn say(pb: &ProgressBar, msg: String) {
    if pb.is_hidden() {
        eprintln!("{msg}");
    } else {
        pb.println(msg);
    }
}

pub fn progress_bar(len: u64) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} (eta {eta}) {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb
}

pub fn parse_tasks(names: &[String]) -> Result<Vec<Task>, CliError> {
    names
        .iter()
        .map(|n| Task::from_name(n.trim()).map_err(|e| CliError::Input(e.to_string())))
        .collect()
}

pub fn run(a: Args) -> Result<(), CliError> {
    let suite = Suite {
        tasks: parse_tasks(&a.tasks)?,
        lengths: a.lengths.clone(),
        samples: a.samples,
        methods: llm::parse_methods(&a.methods)?,
        seed: a.seed,
        verbose: a.verbose,
    };
    if suite.tasks.is_empty()
        || suite.lengths.is_empty()
        || suite.samples == 0
        || suite.methods.is_empty()
    {
        return Err(CliError::Input(
            "eval needs at least one task, length, sample and method".into(),
        ));
    }
    let t0 = Instant::now();
    let model = llm::load_model(a.model.as_deref())?;
    let pb = progress_bar(
        (suite.tasks.len() * suite.lengths.len() * suite.samples * suite.methods.len()) as u64,
    );
    let records = run_suite(&model, &suite, &pb)?;
    pb.finish_and_clear();
    print!("{}", table(&records));
    println!();
    print!("{}", summary_table(&summarize(&records)));
    eprintln!(
        "eval: {} in {}",
        records.len(),
        llm::secs(t0.elapsed().as_secs_f64())
    );
    if let Some(p) = &a.json {
        let text =
            serde_json::to_string_pretty(&records).map_err(|e| CliError::Input(e.to_string()))?;
        std::fs::write(p, text + "\n").map_err(|e| io(p, e))?;
    }
    if let Some(p) = &a.plot {
        let series: Vec<plot::Series> = suite
            .methods
            .iter()
            .map(|m| {
                let label = m.to_string();
                let points = suite
                    .lengths
                    .iter()
                    .map(|&l| {
                        let v: Vec<f64> = records
                            .iter()
                            .filter(|r| r.method == label && r.length == l)
                            .map(|r| r.accuracy)
                            .collect();
                        (l as f64, v.iter().sum::<f64>() / v.len().max(1) as f64)
                    })
                    .collect();
                plot::Series { label, points }
            })
            .collect();
        plot::line_chart(
            p,
            "Accuracy vs length (mean over tasks)",
            "prompt length (tokens)",
            "accuracy",
            &series,
            Some((0.0, 1.05)),
        )?;
    }
    Ok(())
}
