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
use std::io::Write;
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
pub fn run_suite(model: &Model, s: &Suite, pb: &mut Progress) -> Result<Vec<Record>, CliError> {
    let mut acc: BTreeMap<(usize, usize, usize), Acc> = BTreeMap::new();
    for (ti, &task) in s.tasks.iter().enumerate() {
        for (li, &length) in s.lengths.iter().enumerate() {
            for i in 0..s.samples {
                let seed = s.seed + i as u64;
                pb.set_message(format!("{task} {length} #{i}: prefill"));
                let (sample, ids) = llm::task_sample(model, task, length, seed)?;
                // Query statistics only when a method uses them (SPEC.md section 11.1).
                let pre = if s.methods.iter().any(|m| m.wants_query_stats()) {
                    model.prefill_with_stats(&ids)?
                } else {
                    model.prefill(&ids)?
                };
                for (mi, m) in s.methods.iter().enumerate() {
                    pb.set_message(format!("{task} {length} #{i}: {m}"));
                    let d = llm::decode_greedy(model, &pre, m, llm::answer_budget(task), |_| {})?;
                    let text = model.decode(&d.ids)?;
                    let score = string_match_all(&text, &sample.answers);
                    if s.verbose {
                        pb.say(format!(
                            "{task} {length} seed {seed} {m}: {score:.2} {:?} (answers {:?})",
                            text.trim(),
                            sample.answers
                        ));
                    }
                    let a = acc.entry((ti, li, mi)).or_default();
                    a.score += score;
                    a.bytes += d.bytes_per_token;
                    a.step_s += d.step_s.iter().sum::<f64>();
                    a.steps += d.step_s.len();
                    a.n += 1;
                    a.prompt += ids.len() as f64;
                    pb.inc();
                }
                pb.prompt_done(&format!("{task} {length} #{i}"));
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
    start: Instant,
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
            start: Instant::now(),
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

    /// Every method finished on prompt `what`: the plain line, when there is no bar.
    pub fn prompt_done(&mut self, what: &str) {
        self.done += 1;
        let line = format!(
            "{}: prompt {}/{} done ({what}), {} elapsed",
            self.label,
            self.done,
            self.prompts,
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
    let mut pb = Progress::stderr(
        "eval",
        suite.tasks.len() * suite.lengths.len() * suite.samples,
        suite.methods.len(),
    );
    let records = run_suite(&model, &suite, &mut pb)?;
    pb.finish();
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
            p.prompt_done(what);
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
        assert!(lines[0].ends_with(" s elapsed"), "{out}");
        assert_eq!(lines[2], "a verbose prediction");
    }
}
