//! The accuracy-memory frontier (issues 4, 14): channel retention swept for MosaicKV (fixed
//! policy) and, with `--oracle-baselines`, naive 2-D, the loss thresholds of MosaicKV's default
//! policy, plus the other baselines of SPEC.md section 12 (full, quest, kvq8, kvq4; quest-sink
//! with `--oracle-baselines`) on the same prompts;
//! for each: the suite's mean accuracy (with the headline cells' pooled accuracy and Wilson
//! interval) and the teacher-forced KL against the full cache, each beside the KV bytes per
//! token it reached. A table and two SVG plots.

use crate::error::{EvalError, Result};
use crate::fidelity::ForcedRecord;
use crate::plot;
use crate::report::{acc_cell, paired_cell, Summary};
use crate::suite::no_repeats;
use mosaickv_engine::Method;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Teacher-forced positions scored at the end of the frontier's text.
pub const KL_POSITIONS: usize = 64;

/// One method of the sweep: the method, the family it is drawn with, the retention it sweeps.
#[derive(Debug, Clone, PartialEq)]
pub struct Swept {
    pub method: Method,
    pub family: &'static str,
    pub retention: Option<f64>,
}

/// The methods of a frontier, in order: full, quest, (quest-sink,) kvq8, kvq4, mosaic at each
/// retention (fixed policy, g = 1) (with naive2d at the same), mosaic at each
/// `key_loss/value_loss` threshold, the `extra` method strings not already there, and mosaic's
/// default when none of these is it. quest-sink and naive2d, which only the f64 oracle
/// implements, are in it only with `oracle_baselines` (an error in a build without the oracle).
pub fn methods(
    retentions: &[f64],
    thresholds: &[String],
    extra: &[String],
    oracle_baselines: bool,
) -> Result<Vec<Swept>> {
    let swept = |method, family, retention| Swept {
        method,
        family,
        retention,
    };
    // quest-sink and naive2d exist only in the oracle: swept only when asked for
    if oracle_baselines && !mosaickv_methods::has_oracle() {
        return Err(EvalError::Input(
            "quest-sink and naive2d need the oracle (a build with the `oracle` feature)".into(),
        ));
    }
    let oracle = oracle_baselines;
    let mut methods = vec![
        swept(Method::Full, "full", None),
        swept(Method::parse("quest")?, "quest", None),
    ];
    if oracle {
        methods.push(swept(Method::parse("quest-sink")?, "quest-sink", None));
    }
    methods.push(swept(Method::parse("kvq8")?, "kvq8", None));
    methods.push(swept(Method::parse("kvq4")?, "kvq4", None));
    for &r in retentions {
        methods.push(swept(
            Method::parse(&format!("mosaic:ret={r}"))?,
            "mosaic (fixed)",
            Some(r),
        ));
        if oracle {
            methods.push(swept(
                Method::parse(&format!("naive2d:ret={r}"))?,
                "naive2d",
                Some(r),
            ));
        }
    }
    for t in thresholds {
        let (k, v) = t.split_once('/').ok_or_else(|| {
            EvalError::Input(format!("--thresholds: {t:?} is not key_loss/value_loss"))
        })?;
        methods.push(swept(
            Method::parse(&format!("mosaic:kloss={k}:vloss={v}"))?,
            "mosaic (loss threshold)",
            None,
        ));
    }
    for e in extra {
        let m = Method::parse(e)?;
        let family = match &m {
            Method::Mosaic { config, .. } if !config.loss.is_energy() => "mosaic (attention loss)",
            _ => "other",
        };
        if !methods.iter().any(|x| x.method == m) {
            methods.push(swept(m, family, None));
        }
    }
    if !methods
        .iter()
        .any(|m| m.method == Method::parse("mosaic").expect("mosaic parses"))
    {
        methods.push(swept(
            Method::parse("mosaic")?,
            "mosaic (loss threshold)",
            None,
        ));
    }
    Ok(methods)
}

/// The accuracy part has at least one length and one sample, and no length twice.
pub fn check_suite(lengths: &[usize], samples: usize) -> Result<()> {
    if samples == 0 || lengths.is_empty() {
        return Err(EvalError::Input(
            "frontier needs at least one length and one sample".into(),
        ));
    }
    no_repeats("--lengths", lengths)
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

/// One point per swept method, from the suite's summary and the teacher-forced results (each
/// must hold every method).
pub fn points(methods: &[Swept], summary: &[Summary], forced: &[ForcedRecord]) -> Vec<Point> {
    let mut points = Vec::new();
    for Swept {
        method: m,
        family,
        retention: ret,
    } in methods
    {
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
    points
}

/// The frontier as Markdown (what `frontier` prints): a line naming the suite (`tasks` x
/// `lengths` x `samples`) and the KL run (the last [`KL_POSITIONS`] of `kl_length` tokens of
/// `source`), then one row per point.
pub fn table(
    points: &[Point],
    tasks: &[String],
    lengths: &[usize],
    samples: usize,
    kl_length: usize,
    source: &str,
) -> String {
    let mut out = format!(
        "Frontier: accuracy over {tasks:?} x {lengths:?} x {samples} samples; KL over the last {KL_POSITIONS} of {kl_length} tokens of {source}\n\n"
    );
    out += "| method | headline accuracy [95 % CI] (n) | vs full: diff [95 % CI], lost-won, p | mean accuracy | loss vs full | KV B/token (suite) | KL | top-1 | KV B/token (KL run) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for p in points {
        out += &format!(
            "| {} | {} | {} | {:.3} | {} | {:.1} | {:.4} | {:.3} | {:.1} |\n",
            p.method,
            p.headline
                .map_or("-".into(), |h| acc_cell(h.mean, h.low, h.high, h.n)),
            if p.method == "full" {
                "-".into()
            } else {
                paired_cell(&p.headline_vs_full)
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
    out
}

/// The two plots, one line per family: accuracy vs bytes per token into `accuracy`, the
/// teacher-forced KL vs bytes per token into `kl` (SVG).
pub fn plot(points: &[Point], accuracy: &Path, kl: &Path) -> Result<()> {
    let series = |y: &dyn Fn(&Point) -> f64, x: &dyn Fn(&Point) -> f64| -> Vec<plot::Series> {
        let mut fams: Vec<&str> = Vec::new();
        for p in points {
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
        accuracy,
        "Accuracy vs KV bytes per token",
        "KV bytes per token (all bytes counted)",
        "mean accuracy",
        &series(&|p| p.accuracy, &|p| p.kv_bytes_per_token),
        Some((0.0, 1.05)),
    )?;
    plot::line_chart(
        kl,
        "Teacher-forced KL vs KV bytes per token",
        "KV bytes per token (all bytes counted)",
        "mean KL(full || method), nats",
        &series(&|p| p.kl, &|p| p.kl_bytes_per_token),
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_lists_the_baselines_then_retentions_thresholds_and_extras_once() {
        let extra = ["kvq8".into(), "mosaic:aloss=0.1/0.001".into()];
        let oracle = mosaickv_methods::has_oracle();
        for with_oracle in [false, true] {
            let m = methods(&[0.5], &["0.01/0.03".into()], &extra, with_oracle);
            if with_oracle && !oracle {
                assert!(m.is_err(), "oracle baselines in a build without the oracle");
                continue;
            }
            let m = m.unwrap();
            let mut families = vec!["full", "quest"];
            if with_oracle {
                families.push("quest-sink");
            }
            families.extend(["kvq8", "kvq4", "mosaic (fixed)"]);
            if with_oracle {
                families.push("naive2d");
            }
            // the extra kvq8 is there already; mosaic's default is added last
            families.extend([
                "mosaic (loss threshold)",
                "mosaic (attention loss)",
                "mosaic (loss threshold)",
            ]);
            assert_eq!(m.iter().map(|s| s.family).collect::<Vec<_>>(), families);
            let swept: Vec<_> = m.iter().filter_map(|s| s.retention).collect();
            assert_eq!(
                swept,
                if with_oracle {
                    vec![0.5, 0.5]
                } else {
                    vec![0.5]
                }
            );
            assert_eq!(m.last().unwrap().method, Method::parse("mosaic").unwrap());
        }
    }

    #[test]
    fn bad_thresholds_and_suites_are_refused() {
        let e = methods(&[], &["x".into()], &[], false).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--thresholds: \"x\" is not key_loss/value_loss"
        );
        assert!(check_suite(&[512], 0).is_err());
        assert!(check_suite(&[], 1).is_err());
        let e = check_suite(&[512, 1024, 512], 1).unwrap_err();
        assert_eq!(e.to_string(), "--lengths: 512 is given twice");
        check_suite(&[512, 1024], 1).unwrap();
    }
}
