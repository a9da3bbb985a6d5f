//! `mosaickv eval`: the accuracy suite (issues 4, 14). RULER-style tasks at several lengths,
//! one shared dense prefill per prompt, then greedy decoding on each method's caches; a table
//! per task x length x method of accuracy (string_match_all) with its sample count and 95 %
//! Wilson interval, the paired difference against `full` on the same prompts (Newcombe's
//! interval, exact sign-test p-value), KV bytes per token (SPEC.md section 13) and mean
//! decode-step time. The headline pools the cells where `full` scores at least
//! [`HEADLINE_FULL_MIN`]; the others are listed apart. The teacher-forced KL against the full
//! cache on natural text is reported beside it (`mosaickv_tasks::stats`, docs/ACCURACY.md).

use crate::cmd_fidelity::{self, ForcedRecord};
use crate::error::{io, CliError};
use crate::{llm, plot};
use indicatif::{ProgressBar, ProgressStyle};
use mosaickv_engine::store::PrefillStore;
use mosaickv_engine::suite::{default_suite, DefaultSuite};
use mosaickv_engine::{Method, Model};
use mosaickv_tasks::stats::{paired, Accuracy, Paired};
use mosaickv_tasks::{string_match_all, Task};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The default methods: every baseline of SPEC.md section 12 and MosaicKV's default; without
/// the oracle (`--no-default-features`), the baselines it alone implements (quest-sink,
/// naive2d) are left out.
pub const DEFAULT_METHODS: &str = if mosaickv_methods::has_oracle() {
    "full,quest,quest-sink,naive2d,kvq8,kvq4,mosaic"
} else {
    "full,quest,kvq8,kvq4,mosaic"
};

/// The headline pools the cells where `full` scores at least this: a cell that full attention
/// fails carries no information about a compression method.
pub const HEADLINE_FULL_MIN: f64 = 0.8;

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
    /// Methods (comma-separated): full, quest, quest-sink, naive2d, kvq8, kvq4, mosaic,
    /// mosaic-ref, with optional :key=value overrides.
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
    /// Ignore (and replace) the results of an earlier run with the same arguments instead of
    /// resuming from them.
    #[arg(long)]
    pub fresh: bool,
}

/// When `eval` stores prefills.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum StorePrefills {
    /// Prompts of [`STORE_FROM_TOKENS`] tokens or more.
    Auto,
    Always,
    Never,
}

/// `--store-prefills auto` stores prompts from this length on: a prefill there costs tens of
/// seconds to minutes, far more than reading its file.
pub const STORE_FROM_TOKENS: usize = 4096;

/// One method's result on one prompt, as the run log keeps it (one JSON line each).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Done {
    pub task: String,
    pub length: usize,
    pub seed: u64,
    pub method: String,
    pub score: f64,
    pub bytes_per_token: f64,
    /// Sum of the decode steps' wall times (s) and their count.
    pub step_s: f64,
    pub steps: usize,
    pub prompt_tokens: usize,
    /// The generated text (trimmed).
    pub text: String,
}

/// The results of a run so far, appended one line per method and prompt as they finish, so
/// that a run stopped anywhere (a session's end, a kill) loses nothing already measured and a
/// rerun with the same arguments goes on where it stopped.
pub struct RunLog {
    path: PathBuf,
    file: std::fs::File,
    done: BTreeMap<(String, usize, u64, String), Done>,
}

impl RunLog {
    /// Opens (or, with `fresh`, replaces) the log at `path`, reading what it holds.
    pub fn open(path: &Path, fresh: bool) -> Result<Self, CliError> {
        if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(d).map_err(|e| io(d, e))?;
        }
        let mut done = BTreeMap::new();
        if !fresh {
            if let Ok(text) = std::fs::read_to_string(path) {
                // a line cut short by a kill is skipped (that method runs again)
                for d in text
                    .lines()
                    .filter_map(|l| serde_json::from_str::<Done>(l).ok())
                {
                    done.insert((d.task.clone(), d.length, d.seed, d.method.clone()), d);
                }
            }
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(!fresh)
            .write(true)
            .truncate(fresh)
            .open(path)
            .map_err(|e| io(path, e))?;
        // a line cut short by a kill gets its end, so the next result starts a line of its own
        let len = file.metadata().map_err(|e| io(path, e))?.len();
        if !fresh && len > 0 {
            let mut last = [0u8; 1];
            let mut r = std::fs::File::open(path).map_err(|e| io(path, e))?;
            std::io::Seek::seek(&mut r, std::io::SeekFrom::Start(len - 1))
                .and_then(|_| std::io::Read::read_exact(&mut r, &mut last))
                .map_err(|e| io(path, e))?;
            if last[0] != b'\n' {
                file.write_all(b"\n").map_err(|e| io(path, e))?;
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            done,
        })
    }

    fn get(&self, task: &str, length: usize, seed: u64, method: &str) -> Option<&Done> {
        self.done
            .get(&(task.to_string(), length, seed, method.to_string()))
    }

    fn push(&mut self, d: Done) -> Result<(), CliError> {
        let line = serde_json::to_string(&d).map_err(|e| CliError::Input(e.to_string()))? + "\n";
        self.file
            .write_all(line.as_bytes())
            .and_then(|_| self.file.sync_data())
            .map_err(|e| io(&self.path, e))?;
        self.done
            .insert((d.task.clone(), d.length, d.seed, d.method.clone()), d);
        Ok(())
    }

    /// Results already there.
    pub fn len(&self) -> usize {
        self.done.len()
    }

    pub fn is_empty(&self) -> bool {
        self.done.is_empty()
    }

    pub fn path(&self) -> &Path {
        &self.path
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

/// Where [`run_suite`] keeps and finds what outlives it.
#[derive(Default)]
pub struct Keep<'a> {
    /// Stored prefills, for prompts of at least `store_from` tokens.
    pub store: Option<&'a PrefillStore>,
    pub store_from: usize,
    /// The run log: results are appended to it and read back from it.
    pub log: Option<&'a mut RunLog>,
}

#[derive(Default)]
struct Acc {
    scores: Vec<f64>,
    bytes: f64,
    step_s: f64,
    steps: usize,
    n: usize,
    prompt: f64,
}

impl Acc {
    fn add(&mut self, d: &Done) {
        self.scores.push(d.score);
        self.bytes += d.bytes_per_token;
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
    pb: &mut Progress,
    mut keep: Keep,
) -> Result<Vec<Record>, CliError> {
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
            let full_scores = full.map(|f| acc[&(ti, li, f)].scores.clone());
            for (mi, m) in s.methods.iter().enumerate() {
                let a = &acc[&(ti, li, mi)];
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

/// Per method, over the whole suite: the headline (cells where `full` scores at least
/// [`HEADLINE_FULL_MIN`], their samples pooled), the mean over every cell, loss vs full (of the
/// means), mean bytes per token, mean decode ms, and the teacher-forced KL when it was run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub method: String,
    /// Pooled accuracy over the headline cells with its Wilson interval; null when no cell
    /// qualifies (or without a `full` run).
    pub headline: Option<Accuracy>,
    /// Paired difference against `full` over the headline cells' samples.
    pub headline_vs_full: Option<Paired>,
    /// Mean accuracy over every cell.
    pub accuracy: f64,
    pub accuracy_loss: Option<f64>,
    pub kv_bytes_per_token: f64,
    pub decode_ms: f64,
    /// Teacher-forced `KL(full || method)` on natural text, and top-1 agreement.
    pub kl: Option<f64>,
    pub top1: Option<f64>,
}

/// The `(task, length)` cells where `full` scores at least [`HEADLINE_FULL_MIN`] (none without
/// a `full` run).
pub fn headline_cells(records: &[Record]) -> Vec<(String, usize)> {
    records
        .iter()
        .filter(|r| r.method == "full" && r.accuracy >= HEADLINE_FULL_MIN)
        .map(|r| (r.task.clone(), r.length))
        .collect()
}

pub fn summarize(records: &[Record], forced: &[ForcedRecord]) -> Vec<Summary> {
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
    let cells = headline_cells(records);
    let pooled = |m: &str| -> Vec<f64> {
        cells
            .iter()
            .flat_map(|(t, l)| {
                records
                    .iter()
                    .filter(move |r| r.method == m && &r.task == t && r.length == *l)
                    .flat_map(|r| r.scores.iter().copied())
            })
            .collect()
    };
    let full_pooled = pooled("full");
    methods
        .iter()
        .map(|m| {
            let accuracy = mean(m, &|r| r.accuracy);
            let mine = pooled(m);
            let f = forced.iter().find(|f| &f.method == m);
            Summary {
                method: m.clone(),
                headline: (!mine.is_empty()).then(|| Accuracy::of(&mine)),
                headline_vs_full: (!mine.is_empty() && mine.len() == full_pooled.len())
                    .then(|| paired(&mine, &full_pooled)),
                accuracy,
                accuracy_loss: full_acc.filter(|&f| f > 0.0).map(|f| 1.0 - accuracy / f),
                kv_bytes_per_token: mean(m, &|r| r.kv_bytes_per_token),
                decode_ms: mean(m, &|r| r.decode_ms),
                kl: f.map(|f| f.kl),
                top1: f.map(|f| f.top1),
            }
        })
        .collect()
}

fn pct(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{:+.1} %", 100.0 * v))
}

/// `0.800 [0.490, 0.943] (n=10)`.
pub fn acc_cell(mean: f64, low: f64, high: f64, n: usize) -> String {
    format!("{mean:.3} [{low:.3}, {high:.3}] (n={n})")
}

/// `-0.300 [-0.571, -0.033], 3-0, p=0.250`: difference, interval, samples lost-won, p-value.
pub fn paired_cell(p: &Option<Paired>) -> String {
    match p {
        None => "-".into(),
        Some(p) => format!(
            "{:+.3} [{:+.3}, {:+.3}], {}-{}, p={:.3}",
            p.diff, p.low, p.high, p.worse, p.better, p.p_value
        ),
    }
}

/// The table as Markdown (what `eval` prints).
pub fn table(records: &[Record]) -> String {
    let mut s = String::from(
        "| task | length | method | accuracy [95 % CI] (n) | vs full: diff [95 % CI], lost-won, p | KV B/token | decode ms/step |\n|---|---:|---|---:|---:|---:|---:|\n",
    );
    for r in records {
        s += &format!(
            "| {} | {} | {} | {} | {} | {:.1} | {:.1} |\n",
            r.task,
            r.length,
            r.method,
            acc_cell(r.accuracy, r.accuracy_low, r.accuracy_high, r.samples),
            if r.method == "full" {
                "-".into()
            } else {
                paired_cell(&r.vs_full)
            },
            r.kv_bytes_per_token,
            r.decode_ms
        );
    }
    s
}

/// The per-method summary as Markdown: the headline over the cells where full scores at least
/// [`HEADLINE_FULL_MIN`], then the other cells named apart, then the all-cell means and KL.
pub fn summary_table(records: &[Record], sum: &[Summary]) -> String {
    let cells = headline_cells(records);
    let names = |cs: &[(String, usize)]| -> String {
        cs.iter()
            .map(|(t, l)| format!("{t} {l}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut others: Vec<(String, usize)> = Vec::new();
    for r in records.iter().filter(|r| r.method == "full") {
        if !cells.contains(&(r.task.clone(), r.length)) {
            others.push((r.task.clone(), r.length));
        }
    }
    let mut s = format!(
        "Headline: the {} cells where full scores >= {HEADLINE_FULL_MIN} ({}), samples pooled; paired with full on the same prompts.\n\n",
        cells.len(),
        if cells.is_empty() { "none".into() } else { names(&cells) }
    );
    s += "| method | headline accuracy [95 % CI] (n) | vs full: diff [95 % CI], lost-won, p | mean accuracy, all cells | loss vs full | KV B/token | decode ms/step | KL(full‖method) | top-1 |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    let opt = |x: Option<f64>, digits: usize| x.map_or("-".into(), |v| format!("{v:.digits$}"));
    for m in sum {
        s += &format!(
            "| {} | {} | {} | {:.3} | {} | {:.1} | {:.1} | {} | {} |\n",
            m.method,
            m.headline
                .map_or("-".into(), |a| acc_cell(a.mean, a.low, a.high, a.n)),
            if m.method == "full" {
                "-".into()
            } else {
                paired_cell(&m.headline_vs_full)
            },
            m.accuracy,
            pct(m.accuracy_loss),
            m.kv_bytes_per_token,
            m.decode_ms,
            opt(m.kl, 4),
            opt(m.top1, 3),
        );
    }
    s += &format!(
        "\nCells where full scores < {HEADLINE_FULL_MIN} (no information about a compression method; in the table above only in the all-cell mean): {}\n",
        if others.is_empty() { "none".into() } else { names(&others) }
    );
    s
}

/// Progress of a suite on stderr. On a terminal, indicatif's bar; anywhere else (a log
/// file, CI) indicatif hides the bar, so one plain line per finished prompt instead, e.g.
/// `eval: prompt 3/24 done (vt 1024 #0), 2 min 5 s elapsed`.
pub struct Progress {
    bar: ProgressBar,
    /// Where the plain lines go when the bar is hidden.
    plain: Option<Box<dyn Write>>,
    /// The command's name, first word of each plain line.
    label: &'static str,
    prompts: usize,
    done: usize,
    /// Prompts run in this process (not read back from a run log) and their time.
    ran: usize,
    ran_s: f64,
    start: Instant,
    last: Instant,
}

impl Progress {
    /// A bar over `prompts x methods` runs on stderr, or plain lines there when stderr is not
    /// a terminal.
    pub fn stderr(label: &'static str, prompts: usize, methods: usize) -> Self {
        let bar = ProgressBar::new((prompts * methods) as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "{elapsed_precise} [{bar:30}] {pos}/{len} (eta {eta}) {msg}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        if bar.is_hidden() {
            Self::plain(label, prompts, Box::new(std::io::stderr()))
        } else {
            Self::with(bar, None, label, prompts)
        }
    }

    /// Plain lines into `out` (no bar).
    pub fn plain(label: &'static str, prompts: usize, out: Box<dyn Write>) -> Self {
        Self::with(ProgressBar::hidden(), Some(out), label, prompts)
    }

    fn with(
        bar: ProgressBar,
        plain: Option<Box<dyn Write>>,
        label: &'static str,
        prompts: usize,
    ) -> Self {
        Self {
            bar,
            plain,
            label,
            prompts,
            done: 0,
            ran: 0,
            ran_s: 0.0,
            start: Instant::now(),
            last: Instant::now(),
        }
    }

    /// What runs now (shown beside the bar).
    pub fn set_message(&self, msg: String) {
        self.bar.set_message(msg);
    }

    /// One method finished on the current prompt.
    pub fn inc(&self) {
        self.bar.inc(1);
    }

    /// Every method finished on prompt `what` (`ran`: run now, not read back from a run
    /// log): the plain line, when there is no bar, with the time elapsed and an estimate of
    /// the time left (the mean time of the prompts run now, times the prompts left).
    pub fn prompt_done(&mut self, what: &str, ran: bool) {
        self.done += 1;
        let now = Instant::now();
        if ran {
            self.ran += 1;
            self.ran_s += (now - self.last).as_secs_f64();
        }
        self.last = now;
        let left = self.prompts.saturating_sub(self.done);
        let eta = if self.ran > 0 && left > 0 {
            format!(
                ", about {} left",
                llm::secs(self.ran_s / self.ran as f64 * left as f64)
            )
        } else {
            String::new()
        };
        let line = format!(
            "{}: prompt {}/{} {} ({what}), {} elapsed{eta}",
            self.label,
            self.done,
            self.prompts,
            if ran {
                "done"
            } else {
                "resumed from the run log"
            },
            llm::secs(self.start.elapsed().as_secs_f64())
        );
        if let Some(w) = &mut self.plain {
            // Progress is best effort: a closed stderr does not stop the suite.
            let _ = writeln!(w, "{line}");
        }
    }

    /// A line above the bar, or a plain line.
    pub fn say(&mut self, msg: String) {
        match &mut self.plain {
            Some(w) => {
                let _ = writeln!(w, "{msg}");
            }
            None => self.bar.println(msg),
        }
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// RULER's average (`mosaickv_tasks::ruler_average`: the mean over tasks of each task's mean
/// score) per method and length, over the RULER tasks of the run, when it ran any.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RulerAverage {
    pub method: String,
    pub length: usize,
    /// RULER tasks averaged (the suite `ruler` has 11; RULER's published average has 13).
    pub tasks: usize,
    pub average: f64,
    /// The same average of `full`, and this method's as a fraction of it.
    pub full: Option<f64>,
    pub of_full: Option<f64>,
}

pub fn ruler_averages(records: &[Record]) -> Vec<RulerAverage> {
    let mut keys: Vec<(String, usize)> = Vec::new();
    for r in records {
        if !keys.contains(&(r.method.clone(), r.length)) {
            keys.push((r.method.clone(), r.length));
        }
    }
    let avg = |method: &str, length: usize| -> Option<(usize, f64)> {
        let per: Vec<(Task, f64)> = records
            .iter()
            .filter(|r| r.method == method && r.length == length)
            .filter_map(|r| {
                Task::from_name(&r.task)
                    .ok()
                    .filter(|t| Task::ruler().contains(t))
                    .map(|t| (t, r.accuracy))
            })
            .collect();
        mosaickv_tasks::ruler_average(&per).map(|a| (per.len(), a))
    };
    keys.iter()
        .filter_map(|(m, l)| {
            let (tasks, average) = avg(m, *l)?;
            let full = avg("full", *l).map(|f| f.1);
            Some(RulerAverage {
                method: m.clone(),
                length: *l,
                tasks,
                average,
                full,
                of_full: full.filter(|&f| f > 0.0).map(|f| average / f),
            })
        })
        .collect()
}

fn ruler_table(rows: &[RulerAverage]) -> String {
    let mut out = String::from(
        "RULER average (mean over RULER's tasks of each task's accuracy; 11 synthetic tasks at most, RULER publishes 13 with qa_1/qa_2):\n\n| method | length | tasks | RULER average | of full |\n|---|---:|---:|---:|---:|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {:.3} | {} |\n",
            r.method,
            r.length,
            r.tasks,
            r.average,
            r.of_full
                .map_or("-".into(), |x| format!("{:.1} %", 100.0 * x))
        ));
    }
    out
}

/// The run log of `suite` on the model of `store`: `$MOSAICKV_HOME/runs/eval-KEY.jsonl`, KEY a
/// hash of the model's identity, the code the results depend on
/// (`mosaickv_engine::store::RESULTS_CODE`) and the seed. Results inside are keyed by task,
/// length, seed and method, so a rerun with the same arguments resumes, and one that adds a
/// method, a length or samples reuses what the earlier run measured.
pub fn run_log_path(home: &Path, store: &PrefillStore, suite: &Suite) -> PathBuf {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"mosaickv eval run log v1\0");
    h.update(store.model_id().as_bytes());
    h.update([0]);
    h.update(mosaickv_engine::store::RESULTS_CODE.as_bytes());
    h.update(suite.seed.to_le_bytes());
    let d = h.finalize();
    let key: String = d[..8].iter().map(|b| format!("{b:02x}")).collect();
    home.join("runs").join(format!("eval-{key}.jsonl"))
}

/// Task names and suite names (`ruler`, `noise`), each suite expanded in place.
pub fn parse_tasks(names: &[String]) -> Result<Vec<Task>, CliError> {
    Task::parse_list(names).map_err(|e| CliError::Input(e.to_string()))
}

/// What `eval` runs: the explicit arguments over the model's default suite.
pub fn resolve_suite(a: &Args, defaults: &DefaultSuite) -> Result<(Suite, usize, usize), CliError> {
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
        return Err(CliError::Input(
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
    Ok((
        suite,
        a.kl_length.unwrap_or(defaults.kl_length),
        defaults.kl_positions,
    ))
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
    let (suite, kl_length, kl_positions) = resolve_suite(&a, defaults)?;
    lengths_fit(&model, &suite.lengths)?;
    eprintln!(
        "eval: {} (default suite of {}), {} tasks x {:?} x {} samples, {} methods, KL over {} tokens",
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
    let mut log = RunLog::open(&run_log_path(&home, &store, &suite), a.fresh)?;
    if !log.is_empty() {
        eprintln!(
            "eval: resuming: {} results of an earlier run with the same arguments and code in {} (--fresh ignores them)",
            log.len(),
            log.path().display()
        );
    } else {
        eprintln!(
            "eval: results are kept as they come in {}",
            log.path().display()
        );
    }
    let keep = Keep {
        store: (a.store_prefills != StorePrefills::Never).then_some(&store),
        store_from: match a.store_prefills {
            StorePrefills::Auto => STORE_FROM_TOKENS,
            _ => 0,
        },
        log: Some(&mut log),
    };
    let records = run_suite(&model, &suite, &mut pb, keep)?;
    pb.finish();
    let forced = if kl_length > 0 {
        let (text, source) = cmd_fidelity::natural_text(None)?;
        let tokens = cmd_fidelity::text_tokens(&model, &text, kl_length)?;
        eprintln!("eval: teacher-forced KL over the last {kl_positions} of {kl_length} tokens of {source}");
        cmd_fidelity::teacher_forced(&model, &tokens, kl_positions, &suite.methods, |m| {
            eprintln!("  {m}")
        })?
    } else {
        Vec::new()
    };
    print!("{}", table(&records));
    println!();
    print!("{}", summary_table(&records, &summarize(&records, &forced)));
    let ruler = ruler_averages(&records);
    if !ruler.is_empty() {
        println!();
        print!("{}", ruler_table(&ruler));
    }
    eprintln!(
        "eval: {} in {}",
        records.len(),
        llm::secs(t0.elapsed().as_secs_f64())
    );
    if let Some(p) = &a.json {
        let text = serde_json::to_string_pretty(&serde_json::json!({
            "records": records,
            "summary": summarize(&records, &forced),
            "ruler_average": ruler,
            "forced": forced,
        }))
        .map_err(|e| CliError::Input(e.to_string()))?;
        mosaickv_spec::atomic::write_atomic(p, (text + "\n").as_bytes()).map_err(|e| io(p, e))?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A `Write` whose bytes the test reads back.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn record(task: &str, method: &str, scores: &[f64], full: &[f64]) -> Record {
        let a = Accuracy::of(scores);
        Record {
            task: task.into(),
            length: 1024,
            method: method.into(),
            accuracy: a.mean,
            accuracy_low: a.low,
            accuracy_high: a.high,
            scores: scores.to_vec(),
            vs_full: Some(paired(scores, full)),
            accuracy_loss: None,
            kv_bytes_per_token: 1.0,
            decode_ms: 1.0,
            samples: scores.len(),
            prompt_tokens: 1000.0,
        }
    }

    #[test]
    fn headline_pools_only_cells_where_full_scores_at_least_0_8() {
        let good_full = [1.0, 1.0, 1.0, 1.0, 0.0];
        let bad_full = [0.0, 1.0, 0.0, 0.0, 0.0];
        let m_good = [1.0, 0.0, 1.0, 0.0, 0.0];
        let m_bad = [1.0, 1.0, 1.0, 1.0, 1.0];
        let records = vec![
            record("niah_single_1", "full", &good_full, &good_full),
            record("niah_single_1", "mosaic", &m_good, &good_full),
            record("vt", "full", &bad_full, &bad_full),
            record("vt", "mosaic", &m_bad, &bad_full),
        ];
        assert_eq!(
            headline_cells(&records),
            vec![("niah_single_1".to_string(), 1024)]
        );
        let sum = summarize(&records, &[]);
        let m = sum.iter().find(|s| s.method == "mosaic").unwrap();
        // only niah_single_1's five samples: 2/5, paired 2 lost, 0 won against full
        let h = m.headline.unwrap();
        assert_eq!((h.mean, h.n), (0.4, 5));
        let p = m.headline_vs_full.unwrap();
        assert_eq!((p.worse, p.better), (2, 0));
        assert!((p.diff + 0.4).abs() < 1e-12);
        // the all-cell mean still averages both cells
        assert!((m.accuracy - 0.7).abs() < 1e-12);
        let text = summary_table(&records, &sum);
        assert!(text.contains("Cells where full scores < 0.8"), "{text}");
        assert!(text.contains(": vt 1024"), "{text}");
        assert!(text.contains("0.400 ["), "{text}");
        let t = table(&records);
        assert!(t.contains("(n=5)") && t.contains("2-0, p=0.500"), "{t}");
    }

    #[test]
    fn the_run_log_keeps_results_across_opens_and_skips_a_cut_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("runs").join("eval-x.jsonl");
        let d = |method: &str, score: f64| Done {
            task: "vt".into(),
            length: 4096,
            seed: 3,
            method: method.into(),
            score,
            bytes_per_token: 300.0,
            step_s: 1.5,
            steps: 30,
            prompt_tokens: 4000,
            text: "VAR A".into(),
        };
        let mut log = RunLog::open(&path, false).unwrap();
        assert!(log.is_empty());
        log.push(d("full", 1.0)).unwrap();
        log.push(d("mosaic", 0.5)).unwrap();
        drop(log);
        // a kill in the middle of a line leaves half a line: skipped on the next open
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"{\"task\": \"vt\", \"len").unwrap();
        drop(f);
        let mut log = RunLog::open(&path, false).unwrap();
        assert_eq!(log.len(), 2);
        assert_eq!(log.get("vt", 4096, 3, "mosaic"), Some(&d("mosaic", 0.5)));
        assert_eq!(log.get("vt", 4096, 4, "mosaic"), None);
        log.push(d("kvq4", 0.0)).unwrap();
        drop(log);
        assert_eq!(RunLog::open(&path, false).unwrap().len(), 3);
        // --fresh: nothing is read, the file is replaced
        let log = RunLog::open(&path, true).unwrap();
        assert!(log.is_empty());
        drop(log);
        assert_eq!(std::fs::read(&path).unwrap().len(), 0);
    }

    #[test]
    fn plain_progress_prints_one_line_per_finished_prompt() {
        let buf = Shared::default();
        let mut p = Progress::plain("eval", 2, Box::new(buf.clone()));
        let text = |b: &Shared| String::from_utf8(b.0.lock().unwrap().clone()).unwrap();
        for (i, what) in ["vt 1024 #0", "vt 1024 #1"].iter().enumerate() {
            p.set_message(format!("{what}: prefill"));
            for _ in 0..3 {
                p.inc();
            }
            assert_eq!(
                text(&buf).lines().count(),
                i,
                "a line before the prompt finished"
            );
            p.prompt_done(what, true);
        }
        p.say("a verbose prediction".into());
        p.finish();
        let out = text(&buf);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{out}");
        assert!(
            lines[0].starts_with("eval: prompt 1/2 done (vt 1024 #0), "),
            "{out}"
        );
        assert!(
            lines[1].starts_with("eval: prompt 2/2 done (vt 1024 #1), "),
            "{out}"
        );
        assert!(
            lines[0].contains(" s elapsed, about ") && lines[0].ends_with(" s left"),
            "{out}"
        );
        assert!(
            lines[1].ends_with(" s elapsed"),
            "the last prompt has nothing left: {out}"
        );
        assert_eq!(lines[2], "a verbose prediction");
    }
}

/// An option's list with an entry given twice is refused (it would be run, and counted, twice).
pub fn no_repeats<T: PartialEq + std::fmt::Debug>(
    option: &str,
    items: &[T],
) -> Result<(), CliError> {
    for (i, x) in items.iter().enumerate() {
        if items[..i].contains(x) {
            return Err(CliError::Input(format!("{option}: {x:?} is given twice")));
        }
    }
    Ok(())
}

/// Every prompt length fits the model's context (checked before any prompt is built: a huge
/// length would build a prompt of millions of tokens first).
pub fn lengths_fit(model: &mosaickv_engine::Model, lengths: &[usize]) -> Result<(), CliError> {
    let context = model.config().context_length;
    match lengths.iter().find(|&&n| n == 0 || n >= context) {
        Some(n) => Err(CliError::Input(format!(
            "--lengths {n}: a prompt length must be between 1 and the context length {context} (exclusive)"
        ))),
        None => Ok(()),
    }
}
