//! Running a suite (issues 4, 14): RULER-style tasks at several lengths, one shared dense
//! prefill per prompt (stored and reused when asked), then greedy decoding on each method's
//! caches; one [`Record`] per task x length x method. Results go to a [`RunLog`] as they are
//! measured, and a rerun takes them from there.

use crate::error::{EvalError, Result};
use crate::llm;
use crate::runlog::{Done, RunLog};
use mosaickv_engine::store::PrefillStore;
use mosaickv_engine::suite::DefaultSuite;
use mosaickv_engine::{Method, Model};
use mosaickv_tasks::stats::{paired, Accuracy, Paired};
use mosaickv_tasks::{string_match_all, Task};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The default methods of `eval`: the baselines of SPEC.md section 12 that have an optimized
/// implementation, and MosaicKV's default. `quest-sink` and `naive2d` exist only in the f64
/// oracle (`mosaickv-reference`, the `oracle` feature): they run when named, never by default.
pub const DEFAULT_METHODS: &str = "full,quest,kvq8,kvq4,mosaic";

/// When a suite stores prefills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum StorePrefills {
    /// Prompts of [`STORE_FROM_TOKENS`] tokens or more.
    Auto,
    Always,
    Never,
}

/// `--store-prefills auto` stores prompts from this length on: a prefill there costs tens of
/// seconds to minutes, far more than reading its file.
pub const STORE_FROM_TOKENS: usize = 4096;

impl StorePrefills {
    /// What a suite keeps under this choice: prefills in `store` (from [`STORE_FROM_TOKENS`]
    /// tokens for `Auto`, every prompt for `Always`, none for `Never`), results in `log`.
    pub fn keep<'a>(self, store: &'a PrefillStore, log: Option<&'a mut RunLog>) -> Keep<'a> {
        Keep {
            store: (self != StorePrefills::Never).then_some(store),
            store_from: match self {
                StorePrefills::Auto => STORE_FROM_TOKENS,
                _ => 0,
            },
            log,
            report_only: false,
        }
    }
}

/// One cell of the table.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub task: String,
    pub length: usize,
    pub method: String,
    /// Mean string_match_all over the samples.
    pub accuracy: f64,
    /// The 95 % Wilson interval of `accuracy` (`mosaickv_tasks::stats`).
    pub accuracy_low: f64,
    pub accuracy_high: f64,
    /// Per-sample scores, sample i from seed `seed + i` (the same prompts for every method).
    pub scores: Vec<f64>,
    /// Paired difference against `full` on the same prompts; null without a `full` run.
    pub vs_full: Option<Paired>,
    /// `1 - accuracy / accuracy(full)` (SPEC.md section 16); null without a `full` run or
    /// when full scored 0.
    pub accuracy_loss: Option<f64>,
    /// Device bytes per cached token at the end of decoding, mean over layers and samples.
    pub kv_bytes_per_token: f64,
    /// Host-side bytes per cached token at the end of decoding (the f32 rows of open
    /// segments, SPEC.md section 13's `host_rows`; 0 for caches that keep none), mean over
    /// layers and samples; null when a sample's result predates this figure (run log lines
    /// before 2026-12-07). Every byte a cache holds is `kv_bytes_per_token` plus this.
    pub host_bytes_per_token: Option<f64>,
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

/// A suite as a command line asks for it: what is not given comes from the model's default
/// suite ([`resolve_suite`]).
#[derive(Debug, Clone, Default)]
pub struct SuiteRequest {
    /// Task and suite names (`ruler`, `noise` expand in place).
    pub tasks: Option<Vec<String>>,
    pub lengths: Option<Vec<usize>>,
    pub samples: Option<usize>,
    /// Tokens of natural text for the teacher-forced KL run, 0 for none.
    pub kl_length: Option<usize>,
    /// Method strings (`Method::parse`).
    pub methods: Vec<String>,
    pub seed: u64,
    pub verbose: bool,
}

/// A resolved request: the suite, and the teacher-forced KL run beside it.
pub struct Resolved {
    pub suite: Suite,
    /// Tokens of natural text of the KL run (0: none).
    pub kl_length: usize,
    /// Positions scored at the end of that text.
    pub kl_positions: usize,
}

/// Where [`run_suite`] keeps and finds what outlives it.
#[derive(Default)]
pub struct Keep<'a> {
    /// Stored prefills, for prompts of at least `store_from` tokens.
    pub store: Option<&'a PrefillStore>,
    pub store_from: usize,
    /// The run log: results are appended to it and read back from it.
    pub log: Option<&'a mut RunLog>,
    /// Report only what the run log holds: a prompt with any method missing from it is left
    /// out (for every method, so the pairing with `full` stays on the same prompts) and
    /// named, not run.
    pub report_only: bool,
}

/// What [`run_suite`] reports while it runs (a progress bar, plain lines, nothing: `()`).
/// Every method does nothing unless implemented.
pub trait Observer {
    /// What runs now (`"vt 1024 #0: prefill (1000 tokens)"`).
    fn set_message(&mut self, _msg: String) {}
    /// One method finished on the current prompt (run now or read back from the run log).
    fn inc(&mut self) {}
    /// Every method finished on prompt `what` (`ran`: run now, not read back from a run log).
    fn prompt_done(&mut self, _what: &str, _ran: bool) {}
    /// A line to show (each prediction, with `Suite::verbose`).
    fn say(&mut self, _msg: String) {}
}

/// Reports nothing.
impl Observer for () {}

#[derive(Default)]
struct Acc {
    scores: Vec<f64>,
    bytes: f64,
    /// Sum of the samples' host bytes per token, and how many samples had one.
    host: f64,
    host_known: usize,
    step_s: f64,
    steps: usize,
    n: usize,
    prompt: f64,
}

impl Acc {
    fn add(&mut self, d: &Done) {
        self.scores.push(d.score);
        self.bytes += d.bytes_per_token;
        if let Some(h) = d.host_bytes_per_token {
            self.host += h;
            self.host_known += 1;
        }
        self.step_s += d.step_s;
        self.steps += d.steps;
        self.n += 1;
        self.prompt += d.prompt_tokens as f64;
    }
}

/// Runs the suite; records in task, length, method order. With a run log, a (prompt, method)
/// already in it is not run again, and each new result is appended as soon as it is measured;
/// a prompt whose every method is in the log is not even generated or prefilled.
pub fn run_suite(
    model: &Model,
    s: &Suite,
    pb: &mut dyn Observer,
    mut keep: Keep,
) -> Result<Vec<Record>> {
    let mut acc: BTreeMap<(usize, usize, usize), Acc> = BTreeMap::new();
    let names: Vec<String> = s.methods.iter().map(|m| m.to_string()).collect();
    for (ti, &task) in s.tasks.iter().enumerate() {
        for (li, &length) in s.lengths.iter().enumerate() {
            for i in 0..s.samples {
                let seed = s.seed + i as u64;
                let what = format!("{task} {length} #{i}");
                let known = |log: &Option<&mut RunLog>, m: &str| {
                    log.as_ref()
                        .and_then(|l| l.get(task.name(), length, seed, m))
                        .cloned()
                };
                let todo: Vec<usize> = (0..s.methods.len())
                    .filter(|&mi| known(&keep.log, &names[mi]).is_none())
                    .collect();
                let mut ran = false;
                if keep.report_only && !todo.is_empty() {
                    pb.say(format!("{what}: not (wholly) in the run log, left out"));
                    continue;
                }
                if !todo.is_empty() {
                    ran = true;
                    pb.set_message(format!("{what}: prompt"));
                    let (sample, ids) = llm::task_sample(model, task, length, seed)?;
                    // Query statistics only when a method uses them (SPEC.md section 11.1).
                    let stats = s.methods.iter().any(|m| m.wants_query_stats());
                    pb.set_message(format!("{what}: prefill ({} tokens)", ids.len()));
                    let pre = match keep.store.filter(|_| ids.len() >= keep.store_from) {
                        Some(store) => store.prefill(model, &ids, stats)?.0,
                        None if stats => model.prefill_with_stats(&ids)?,
                        None => model.prefill(&ids)?,
                    };
                    for &mi in &todo {
                        let m = &s.methods[mi];
                        pb.set_message(format!("{what}: {m}"));
                        let d =
                            llm::decode_greedy(model, &pre, m, llm::answer_budget(task), |_| {})?;
                        let text = model.decode(&d.ids)?;
                        let score = string_match_all(&text, &sample.answers);
                        if s.verbose {
                            pb.say(format!(
                                "{task} {length} seed {seed} {m}: {score:.2} {:?} (answers {:?})",
                                text.trim(),
                                sample.answers
                            ));
                        }
                        let done = Done {
                            task: task.name().to_string(),
                            length,
                            seed,
                            method: names[mi].clone(),
                            score,
                            bytes_per_token: d.bytes_per_token,
                            // over layers and tokens as `bytes_per_token`: each layer's cache
                            // holds the prompt and every token a decode step appended
                            host_bytes_per_token: Some(
                                d.host_bytes as f64
                                    / (model.config().n_layers * (ids.len() + d.step_s.len()))
                                        .max(1) as f64,
                            ),
                            step_s: d.step_s.iter().sum::<f64>(),
                            steps: d.step_s.len(),
                            prompt_tokens: ids.len(),
                            text: text.trim().to_string(),
                        };
                        if let Some(log) = keep.log.as_deref_mut() {
                            log.push(done)?;
                        } else {
                            let a = acc.entry((ti, li, mi)).or_default();
                            a.add(&done);
                        }
                        pb.inc();
                    }
                }
                if let Some(log) = keep.log.as_deref() {
                    for (mi, name) in names.iter().enumerate() {
                        let d = log
                            .get(task.name(), length, seed, name)
                            .expect("every method of the prompt is in the log now");
                        acc.entry((ti, li, mi)).or_default().add(d);
                        if !todo.contains(&mi) {
                            pb.inc();
                        }
                    }
                }
                pb.prompt_done(&what, ran);
            }
        }
    }
    let full = s.methods.iter().position(|m| *m == Method::Full);
    let mut out = Vec::new();
    for (ti, &task) in s.tasks.iter().enumerate() {
        for (li, &length) in s.lengths.iter().enumerate() {
            let full_scores = full.and_then(|f| acc.get(&(ti, li, f)).map(|a| a.scores.clone()));
            for (mi, m) in s.methods.iter().enumerate() {
                // no prompt of this cell measured (only with `report_only`)
                let Some(a) = acc.get(&(ti, li, mi)) else {
                    continue;
                };
                let acc_ci = Accuracy::of(&a.scores);
                let accuracy = acc_ci.mean;
                let full_acc = full_scores.as_ref().map(|f| Accuracy::of(f).mean);
                out.push(Record {
                    task: task.name().to_string(),
                    length,
                    method: m.to_string(),
                    accuracy,
                    accuracy_low: acc_ci.low,
                    accuracy_high: acc_ci.high,
                    scores: a.scores.clone(),
                    vs_full: full_scores.as_ref().map(|f| paired(&a.scores, f)),
                    accuracy_loss: full_acc.filter(|&f| f > 0.0).map(|f| 1.0 - accuracy / f),
                    kv_bytes_per_token: a.bytes / a.n as f64,
                    host_bytes_per_token: (a.host_known == a.n).then(|| a.host / a.n as f64),
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

/// Task names and suite names (`ruler`, `noise`), each suite expanded in place.
pub fn parse_tasks(names: &[String]) -> Result<Vec<Task>> {
    Task::parse_list(names).map_err(|e| EvalError::Input(e.to_string()))
}

/// What `eval` runs: the explicit arguments over the model's default suite.
pub fn resolve_suite(a: &SuiteRequest, defaults: &DefaultSuite) -> Result<Resolved> {
    let tasks = match &a.tasks {
        Some(t) => parse_tasks(t)?,
        None => defaults.tasks.to_vec(),
    };
    let suite = Suite {
        tasks,
        lengths: a
            .lengths
            .clone()
            .unwrap_or_else(|| defaults.lengths.to_vec()),
        samples: a.samples.unwrap_or(defaults.samples),
        methods: llm::parse_methods(&a.methods)?,
        seed: a.seed,
        verbose: a.verbose,
    };
    if suite.tasks.is_empty()
        || suite.lengths.is_empty()
        || suite.samples == 0
        || suite.methods.is_empty()
    {
        return Err(EvalError::Input(
            "eval needs at least one task, length, sample and method".into(),
        ));
    }
    // a repeated cell or method would count the same prompts twice in the pooled headline
    no_repeats("--lengths", &suite.lengths)?;
    no_repeats("--tasks", &suite.tasks)?;
    no_repeats(
        "--methods",
        &suite
            .methods
            .iter()
            .map(|m| m.to_string())
            .collect::<Vec<_>>(),
    )?;
    Ok(Resolved {
        suite,
        kl_length: a.kl_length.unwrap_or(defaults.kl_length),
        kl_positions: defaults.kl_positions,
    })
}

/// An option's list with an entry given twice is refused (it would be run, and counted, twice).
pub fn no_repeats<T: PartialEq + std::fmt::Debug>(option: &str, items: &[T]) -> Result<()> {
    for (i, x) in items.iter().enumerate() {
        if items[..i].contains(x) {
            return Err(EvalError::Input(format!("{option}: {x:?} is given twice")));
        }
    }
    Ok(())
}

/// Every prompt length fits the model's context (checked before any prompt is built: a huge
/// length would build a prompt of millions of tokens first).
pub fn lengths_fit(model: &Model, lengths: &[usize]) -> Result<()> {
    let context = model.config().context_length;
    match lengths.iter().find(|&&n| n == 0 || n >= context) {
        Some(n) => Err(EvalError::Input(format!(
            "--lengths {n}: a prompt length must be between 1 and the context length {context} (exclusive)"
        ))),
        None => Ok(()),
    }
}
