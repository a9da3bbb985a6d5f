//! Does a loss predict attention error? (issue 15, SPEC.md section 11.1.)
//!
//! On real K/V of the model (a dense prefill of RULER-like task prompts), for every KV head of
//! the chosen layers and every `(r, g)` candidate of the default policy, this compresses one
//! side of the prompt's segment (tokens after the sink, up to the held-out tail) with the
//! reference backend and measures, over the held-out queries (the prompt's last `--held-out`
//! positions, attending to the context before them, as a decode step would), the attention
//! output's relative L2 error (SPEC.md section 16) and the KL of the attention distribution.
//! The query statistics come from the context's own queries only. It prints Spearman rank
//! correlations between each loss and each measured error, pooled over all (layer, head,
//! candidate) points, and the mean of the per-head correlations.
//!
//! cargo run --release -p mosaickv-engine --example loss_rank -- --length 2048

use clap::Parser;
use mosaickv_engine::{resolve_model, suite, Model};
use mosaickv_reference::loss::{errors, key_loss, quadratic, value_loss};
use mosaickv_reference::rotation::fit_rotation;
use mosaickv_reference::side_loss;
use mosaickv_spec::layout::trim_rotation;
use mosaickv_spec::{rules, CompressConfig, KvShape, QueryStats, Side, SideStrategy};
use mosaickv_tasks::Task;
use ndarray::{s, Array2};
use std::path::PathBuf;

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Parser)]
struct Args {
    /// Prompt length in tokens (task prompts sized to fit).
    #[arg(long, default_value_t = 2048)]
    length: usize,
    /// Tasks, comma separated (names of `mosaickv-tasks`).
    #[arg(long, default_value = "niah_single_noise,vt_noex")]
    tasks: String,
    /// Layers to measure, comma separated.
    #[arg(long, default_value = "0,3,6,9,12,15,18,21,24,27")]
    layers: String,
    /// Held-out query positions at the end of each prompt.
    #[arg(long, default_value_t = 64)]
    held_out: usize,
    /// Context positions whose queries give the value weights.
    #[arg(long, default_value_t = 64)]
    sample: usize,
    /// Model: a known name (`smollm2-135m`, `qwen2.5-1.5b`, fetched on first use) or a GGUF
    /// file; SmolLM2-135M-Instruct without it.
    #[arg(long)]
    model: Option<PathBuf>,
}

/// One (layer, head, candidate) point: losses and measured errors.
struct Point {
    group: usize,
    /// Record bytes of the candidate.
    bytes: usize,
    losses: Vec<f64>,
    measured: Vec<f64>,
}

const KEY_LOSSES: [&str; 4] = [
    "energy (today)",
    "attention (SPEC 11.1.1): sum w eMe / (D sum w)",
    "relative (SPEC 11.1.1 until 2026-12-03): sum eMe / sum kMk",
    "temperature, unweighted: mean eMe / D",
];
const VALUE_LOSSES: [&str; 4] = [
    "energy (today)",
    "attention (SPEC 11.1.1): |sum w e|^2 / O^2",
    "relative weighted: sum w|e|^2 / sum w|v|^2",
    "incoherent: sum u|e|^2 / O^2",
];
const MEASURES: [&str; 2] = ["attn output rel L2", "attn KL"];

/// `sum_t e_t^T M e_t / sum_t k_t^T M k_t`: the query-weighted relative key error (SPEC 11.1.1's
/// key loss until 2026-12-03; it did not rank across heads on Qwen, docs/ACCURACY.md).
fn relative(k: ndarray::ArrayView2<f32>, e: &[Vec<f64>], m: &[f64]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, et) in k.rows().into_iter().zip(e) {
        let x: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        num += quadratic(m, et);
        den += quadratic(m, &x);
    }
    if den == 0.0 {
        0.0
    } else {
        num / den
    }
}

fn ranks(x: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[a].total_cmp(&x[b]));
    let mut r = vec![0f64; x.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && x[idx[j + 1]] == x[idx[i]] {
            j += 1;
        }
        let avg = (i + j) as f64 / 2.0;
        for &k in &idx[i..=j] {
            r[k] = avg;
        }
        i = j + 1;
    }
    r
}

fn spearman(a: &[f64], b: &[f64]) -> f64 {
    let (ra, rb) = (ranks(a), ranks(b));
    let n = ra.len() as f64;
    let (ma, mb) = (ra.iter().sum::<f64>() / n, rb.iter().sum::<f64>() / n);
    let (mut sab, mut saa, mut sbb) = (0.0, 0.0, 0.0);
    for (x, y) in ra.iter().zip(&rb) {
        sab += (x - ma) * (y - mb);
        saa += (x - ma) * (x - ma);
        sbb += (y - mb) * (y - mb);
    }
    if saa == 0.0 || sbb == 0.0 {
        f64::NAN
    } else {
        sab / (saa * sbb).sqrt()
    }
}

/// Softmax probabilities of `q` (length D) over `keys` rows, f64.
fn probs(q: &[f32], keys: &Array2<f64>) -> Vec<f64> {
    let d = q.len();
    let scale = 1.0 / (d as f64).sqrt();
    let z: Vec<f64> = keys
        .rows()
        .into_iter()
        .map(|k| k.iter().zip(q).map(|(a, &b)| a * f64::from(b)).sum::<f64>() * scale)
        .collect();
    let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = z.iter().map(|x| (x - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

fn output(p: &[f64], values: &Array2<f64>) -> Vec<f64> {
    let mut o = vec![0f64; values.ncols()];
    for (pt, v) in p.iter().zip(values.rows()) {
        for (oi, vi) in o.iter_mut().zip(v) {
            *oi += pt * vi;
        }
    }
    o
}

fn kl(p: &[f64], q: &[f64]) -> f64 {
    p.iter()
        .zip(q)
        .filter(|(a, _)| **a > 0.0)
        .map(|(a, b)| a * (a / b.max(1e-300)).ln())
        .sum()
}

/// Mean over held-out positions of the group's `||o - o_full||_F / ||o_full||_F`, and mean KL.
fn measure(
    queries: &[Vec<Vec<f32>>], // [position][group head] -> D
    keys: &Array2<f64>,
    values: &Array2<f64>,
    full: &[Vec<(Vec<f64>, Vec<f64>)>], // exact (p, o) per position and head
) -> (f64, f64) {
    let mut rel = 0.0;
    let mut kls = 0.0;
    let mut count = 0.0;
    for (qs, fs) in queries.iter().zip(full) {
        let (mut num, mut den) = (0.0, 0.0);
        for (q, (pf, of)) in qs.iter().zip(fs) {
            let p = probs(q, keys);
            let o = output(&p, values);
            num += o
                .iter()
                .zip(of)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f64>();
            den += of.iter().map(|b| b * b).sum::<f64>();
            kls += kl(pf, &p);
            count += 1.0;
        }
        rel += if den == 0.0 { 0.0 } else { (num / den).sqrt() };
    }
    (rel / queries.len() as f64, kls / count)
}

fn main() -> BoxResult<()> {
    let args = Args::parse();
    let model = Model::load(&resolve_model(args.model.as_deref())?)?;
    let cfg = model.config().clone();
    let layers: Vec<usize> = args
        .layers
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()?;
    let tasks: Vec<Task> = args
        .tasks
        .split(',')
        .map(|s| Task::from_name(s.trim()))
        .collect::<Result<_, _>>()?;
    let config = CompressConfig::default();
    let (kv, g, d) = (cfg.kv_heads, cfg.q_heads / cfg.kv_heads, cfg.head_dim);
    let shape = KvShape::new(kv, cfg.q_heads, d)?;
    let candidates = rules::candidates(&config, d);
    let sink = config.sink_tokens;
    let mut key_points = Vec::new();
    let mut value_points = Vec::new();
    let mut group = 0;
    for (ti, task) in tasks.iter().enumerate() {
        let (_, ids) = suite::task_sample(&model, *task, args.length, ti as u64)?;
        let pre = model.prefill_with_queries(&ids)?;
        let n = ids.len();
        let ctx = n - args.held_out;
        eprintln!("{}: {n} tokens, context {ctx}", task.name());
        for &l in &layers {
            let (keys, values, queries) = (&pre.keys[l], &pre.values[l], &pre.queries[l]);
            let stats = QueryStats::from_queries(
                &shape,
                keys.slice(s![..ctx, .., ..]),
                values.slice(s![..ctx, .., ..]),
                queries.slice(s![..ctx, .., ..]),
                args.sample,
            )?;
            for h in 0..kv {
                let k = keys.slice(s![sink..ctx, h, ..]).to_owned();
                let v = values.slice(s![sink..ctx, h, ..]).to_owned();
                let kfull = keys.slice(s![..ctx, h, ..]).mapv(f64::from);
                let vfull = values.slice(s![..ctx, h, ..]).mapv(f64::from);
                let held: Vec<Vec<Vec<f32>>> = (ctx..n)
                    .map(|p| {
                        (h * g..(h + 1) * g)
                            .map(|qh| queries.slice(s![p, qh, ..]).to_vec())
                            .collect()
                    })
                    .collect();
                let full: Vec<Vec<(Vec<f64>, Vec<f64>)>> = held
                    .iter()
                    .map(|qs| {
                        qs.iter()
                            .map(|q| {
                                let p = probs(q, &kfull);
                                let o = output(&p, &vfull);
                                (p, o)
                            })
                            .collect()
                    })
                    .collect();
                let (w, u) = stats.weights(h, sink, ctx - sink).expect("covered");
                let o2 = stats.output_sq[h];
                let ones = vec![1.0; ctx - sink];
                let m = stats.moment(h);
                let kr = fit_rotation(k.view());
                let vr = fit_rotation(v.view());
                for layout in &candidates {
                    // Keys compressed, values exact.
                    let side = SideStrategy {
                        layout: *layout,
                        rotation: trim_rotation(&kr, d, layout.kept_dims),
                        fit_loss: 0.0,
                        coding: Vec::new(),
                    };
                    let e = errors(k.view(), &side)?;
                    let mut approx = kfull.clone();
                    for (t, et) in e.iter().enumerate() {
                        for i in 0..d {
                            approx[[sink + t, i]] -= et[i];
                        }
                    }
                    let (rel, klv) = measure(&held, &approx, &vfull, &full);
                    key_points.push(Point {
                        group,
                        bytes: layout.record_bytes(),
                        losses: vec![
                            side_loss(k.view(), &side, Side::Key),
                            key_loss(&e, m, &w),
                            relative(k.view(), &e, m),
                            key_loss(&e, m, &ones),
                        ],
                        measured: vec![rel, klv],
                    });
                    // Values compressed, keys exact.
                    let side = SideStrategy {
                        layout: *layout,
                        rotation: trim_rotation(&vr, d, layout.kept_dims),
                        fit_loss: 0.0,
                        coding: Vec::new(),
                    };
                    let e = errors(v.view(), &side)?;
                    let mut approx = vfull.clone();
                    for (t, et) in e.iter().enumerate() {
                        for i in 0..d {
                            approx[[sink + t, i]] -= et[i];
                        }
                    }
                    let (rel, klv) = measure(&held, &kfull, &approx, &full);
                    let (mut num, mut den) = (0.0, 0.0);
                    for ((et, vt), &wt) in e.iter().zip(v.rows()).zip(&w) {
                        num += wt * et.iter().map(|x| x * x).sum::<f64>();
                        den += wt * vt.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>();
                    }
                    value_points.push(Point {
                        group,
                        bytes: layout.record_bytes(),
                        losses: vec![
                            side_loss(v.view(), &side, Side::Value),
                            value_loss(&e, &w, o2),
                            num / den,
                            e.iter()
                                .zip(&u)
                                .map(|(et, ut)| ut * et.iter().map(|x| x * x).sum::<f64>())
                                .sum::<f64>()
                                / o2,
                        ],
                        measured: vec![rel, klv],
                    });
                }
                group += 1;
            }
            eprintln!("  layer {l} done");
        }
    }
    println!(
        "model {}, tasks {}, prompt length {}, layers {}, {} KV heads, {} candidates, \
         held-out {}, sample {}",
        resolve_model(args.model.as_deref())?
            .file_name()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_default(),
        args.tasks,
        args.length,
        args.layers,
        kv,
        candidates.len(),
        args.held_out,
        args.sample
    );
    for (side, names, points, measures) in [
        ("K", &KEY_LOSSES[..], &key_points, &MEASURES[..]),
        ("V", &VALUE_LOSSES[..], &value_points, &MEASURES[..1]),
    ] {
        println!("\n{side} side, {} points:", points.len());
        println!("| loss | measure | Spearman pooled | mean Spearman per head |");
        println!("|---|---|---|---|");
        for (li, name) in names.iter().enumerate() {
            for (mi, mname) in measures.iter().enumerate() {
                let a: Vec<f64> = points.iter().map(|p| p.losses[li]).collect();
                let b: Vec<f64> = points.iter().map(|p| p.measured[mi]).collect();
                let pooled = spearman(&a, &b);
                let mut per = Vec::new();
                for gi in 0..group {
                    let (a, b): (Vec<f64>, Vec<f64>) = points
                        .iter()
                        .filter(|p| p.group == gi)
                        .map(|p| (p.losses[li], p.measured[mi]))
                        .unzip();
                    let r = spearman(&a, &b);
                    if r.is_finite() {
                        per.push(r);
                    }
                }
                let mean = per.iter().sum::<f64>() / per.len().max(1) as f64;
                println!("| {name} | {mname} | {pooled:.3} | {mean:.3} |");
            }
        }
    }
    // A first calibration: per (layer, head), the cheapest candidate whose loss is at most the
    // threshold (else the lowest loss), as SPEC 11.2 chooses; mean record bytes and mean
    // measured error of the choices, for the energy loss and the attention loss.
    let dense = 2 * d;
    for (side, points, grid_e, grid_a) in [
        (
            "K",
            &key_points,
            [0.001, 0.002, 0.005, 0.01, 0.02, 0.05],
            ATT_K_GRID,
        ),
        (
            "V",
            &value_points,
            [0.005, 0.01, 0.02, 0.05, 0.1, 0.2],
            ATT_V_GRID,
        ),
    ] {
        println!(
            "\n{side} side, cheapest candidate under a threshold, mean over {group} heads \
             (record bytes of f16 dense: {dense}):"
        );
        println!("| loss | threshold | mean record bytes | mean attn output rel L2 | worst head |");
        println!("|---|---|---|---|---|");
        for (li, name, grid) in [(0, "energy", &grid_e[..]), (1, "attention", &grid_a[..])] {
            for &thr in grid {
                let (mut bytes, mut err, mut worst) = (0.0, 0.0, 0f64);
                for gi in 0..group {
                    let cands: Vec<&Point> = points.iter().filter(|p| p.group == gi).collect();
                    let pick = cands
                        .iter()
                        .filter(|p| p.losses[li] <= thr)
                        .min_by(|a, b| {
                            a.bytes
                                .cmp(&b.bytes)
                                .then(a.losses[li].total_cmp(&b.losses[li]))
                        })
                        .or_else(|| {
                            cands.iter().min_by(|a, b| {
                                a.losses[li]
                                    .total_cmp(&b.losses[li])
                                    .then(a.bytes.cmp(&b.bytes))
                            })
                        })
                        .expect("candidates");
                    bytes += pick.bytes as f64;
                    err += pick.measured[0];
                    worst = worst.max(pick.measured[0]);
                }
                let gn = group as f64;
                println!(
                    "| {name} | {thr} | {:.1} | {:.4} | {worst:.4} |",
                    bytes / gn,
                    err / gn
                );
            }
        }
    }
    Ok(())
}

/// Key thresholds in squared logit error (softmax units), SPEC 11.1.1.
const ATT_K_GRID: [f64; 8] = [1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0];
const ATT_V_GRID: [f64; 8] = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3];
