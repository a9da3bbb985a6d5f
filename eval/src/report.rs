//! What a suite's records become (issues 4, 14): the per-cell table with each cell's Wilson
//! interval and paired difference against `full`, the per-method summary whose headline pools
//! the cells where `full` scores at least [`HEADLINE_FULL_MIN`], RULER's average, `eval`'s JSON
//! and its accuracy-vs-length plot.

use crate::error::Result;
use crate::fidelity::ForcedRecord;
use crate::plot;
use crate::suite::{Record, Suite};
use mosaickv_tasks::stats::{paired, Accuracy, Paired};
use mosaickv_tasks::Task;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The headline pools the cells where `full` scores at least this: a cell that full attention
/// fails carries no information about a compression method.
pub const HEADLINE_FULL_MIN: f64 = 0.8;

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
    /// Host-side bytes per token (the f32 rows of open segments), mean over the method's
    /// cells; null when a cell's is unknown (run log lines written before it was recorded).
    pub host_bytes_per_token: Option<f64>,
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

/// One [`Summary`] per method, in the records' order; `forced` gives the KL columns.
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
                host_bytes_per_token: records
                    .iter()
                    .filter(|r| &r.method == m)
                    .map(|r| r.host_bytes_per_token)
                    .collect::<Option<Vec<f64>>>()
                    .map(|v| v.iter().sum::<f64>() / v.len().max(1) as f64),
                decode_ms: mean(m, &|r| r.decode_ms),
                kl: f.map(|f| f.kl),
                top1: f.map(|f| f.top1),
            }
        })
        .collect()
}

/// Host bytes per token: `-` where unknown (results from before it was recorded).
fn host_cell(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.1}"))
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
        "| task | length | method | accuracy [95 % CI] (n) | vs full: diff [95 % CI], lost-won, p | KV B/token | host B/token | decode ms/step |\n|---|---:|---|---:|---:|---:|---:|---:|\n",
    );
    for r in records {
        s += &format!(
            "| {} | {} | {} | {} | {} | {:.1} | {} | {:.1} |\n",
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
            host_cell(r.host_bytes_per_token),
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
    s += "| method | headline accuracy [95 % CI] (n) | vs full: diff [95 % CI], lost-won, p | mean accuracy, all cells | loss vs full | KV B/token | host B/token | decode ms/step | KL(full‖method) | top-1 |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    let opt = |x: Option<f64>, digits: usize| x.map_or("-".into(), |v| format!("{v:.digits$}"));
    for m in sum {
        s += &format!(
            "| {} | {} | {} | {:.3} | {} | {:.1} | {} | {:.1} | {} | {} |\n",
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
            host_cell(m.host_bytes_per_token),
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

/// One [`RulerAverage`] per method and length of the records that ran a RULER task.
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

/// RULER's averages as Markdown.
pub fn ruler_table(rows: &[RulerAverage]) -> String {
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

/// What `eval --json` writes: the records, the summary, RULER's averages and the
/// teacher-forced results.
pub fn eval_json(records: &[Record], forced: &[ForcedRecord]) -> serde_json::Value {
    serde_json::json!({
        "records": records,
        "summary": summarize(records, forced),
        "ruler_average": ruler_averages(records),
        "forced": forced,
    })
}

/// `eval --plot`: accuracy vs prompt length, one line per method (mean over tasks), as SVG.
pub fn plot_accuracy_vs_length(path: &Path, suite: &Suite, records: &[Record]) -> Result<()> {
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
        path,
        "Accuracy vs length (mean over tasks)",
        "prompt length (tokens)",
        "accuracy",
        &series,
        Some((0.0, 1.05)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

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
            host_bytes_per_token: Some(0.5),
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
}
