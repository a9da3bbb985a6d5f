//! What the SPEC.md section 11.1 energy loss sees of a long prompt's K/V, and what it misses.
//!
//! cargo run --release -p mosaickv-engine --example long_keys -- \
//!     --model qwen2.5-1.5b --prefill ~/.cache/mosaickv/prefills/<key>.mkvp [--stride 4]
//!
//! Reads a stored prefill (`mosaickv eval` keeps one per long prompt). Per layer, KV head and
//! side: fits the section 3 rotation on every row, then for each (dtype, r) candidate at g = 1
//! (section 11.2's retentions 1/8 .. 6/8) measures on every `stride`-th row
//! - the energy loss of section 11.1 (what the default rule compares with its threshold);
//! - the same error relative to the rows' spread around their mean, `sum ||x - x^||^2 /
//!   sum ||x - mean||^2` ("centred"): softmax ignores what every key shares (q . mean is one
//!   constant per query), so for keys this is the fraction of what attention can tell apart.
//!
//! Prints the candidate each rule picks (the energy rule at 0.005 K / 0.02 V, every dtype and
//! f16 only; the key loss against the spread at 0.005 and 0.01, SPEC.md section 11.1 since
//! 2026-12-05), with both losses, and the share of the key energy the mean carries.

use clap::Parser;
use mosaickv_engine::{resolve_model, store::read_stored, Model};
use mosaickv_reference::rotation::fit_rotation;
use mosaickv_reference::topr::{rotate_row_f64, select_row};
use mosaickv_spec::layout::{dequantize, quantize_values};
use mosaickv_spec::{RecordLayout, ValueDtype};
use ndarray::s;
use std::path::PathBuf;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "qwen2.5-1.5b")]
    model: String,
    #[arg(long)]
    prefill: PathBuf,
    /// Measure every stride-th row (the rotation is fitted on every row).
    #[arg(long, default_value_t = 4)]
    stride: usize,
    /// Only these layers (comma-separated), default all.
    #[arg(long, value_delimiter = ',')]
    layers: Vec<usize>,
}

struct Cand {
    dtype: ValueDtype,
    r: usize,
    g: usize,
    bytes: usize,
    err: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let model = Model::load(&resolve_model(Some(std::path::Path::new(&args.model)))?)?;
    let pre = read_stored(&args.prefill, &model)?;
    let (n, kvh, d) = pre.keys[0].dim();
    println!(
        "prefill: {n} tokens, {} layers, {kvh} KV heads, head_dim {d}",
        pre.keys.len()
    );
    let layers: Vec<usize> = if args.layers.is_empty() {
        (0..pre.keys.len()).collect()
    } else {
        args.layers.clone()
    };
    println!("layer head side | mean share | rules: shipped; f16 only; K against its spread at the K threshold; at twice it (each: dt r/g B energy centred)");
    let mut sums = [0f64; 4];
    for &l in &layers {
        for h in 0..kvh {
            for (side, x, thr) in [("K", &pre.keys[l], 0.005), ("V", &pre.values[l], 0.02)] {
                let rows = x.slice(s![.., h, ..]).to_owned();
                let rot = fit_rotation(rows.view());
                let mut cands = Vec::new();
                for dtype in [ValueDtype::F16, ValueDtype::Int8, ValueDtype::Int4] {
                    for g in [1usize, 2, 4] {
                        for f in 1..=6 {
                            let r = ((f * d).div_ceil(8).div_ceil(g) * g).min(d);
                            let layout = RecordLayout {
                                head_dim: d,
                                kept_dims: d,
                                r,
                                group_size: g,
                                dtype,
                                code_bits: 0,
                            };
                            cands.push(Cand {
                                dtype,
                                r,
                                g,
                                bytes: layout.record_bytes(),
                                err: 0.0,
                            });
                        }
                    }
                }
                let mut mean = vec![0f64; d];
                let mut energy = 0f64;
                let picked: Vec<usize> = (0..n).step_by(args.stride).collect();
                let mut rotated = Vec::with_capacity(picked.len());
                for &t in &picked {
                    let row: Vec<f32> = rows.row(t).to_vec();
                    let xr = rotate_row_f64(&row, &rot);
                    for j in 0..d {
                        mean[j] += xr[j];
                    }
                    energy += xr.iter().map(|v| v * v).sum::<f64>();
                    rotated.push(xr);
                }
                let m = picked.len() as f64;
                let mean_sq: f64 = mean.iter().map(|v| (v / m) * (v / m)).sum::<f64>() * m;
                let centred = energy - mean_sq;
                for c in cands.iter_mut() {
                    let layout = RecordLayout {
                        head_dim: d,
                        kept_dims: d,
                        r: c.r,
                        group_size: c.g,
                        dtype: c.dtype,
                        code_bits: 0,
                    };
                    let mut codes = vec![0u8; c.r];
                    for xr in &rotated {
                        let (y, kept) = select_row(xr, &layout);
                        let kept: Vec<bool> = (0..d).map(|j| kept[j / c.g]).collect();
                        let kv: Vec<half::f16> =
                            (0..d).filter(|&j| kept[j]).map(|j| y[j]).collect();
                        let dec: Vec<f64> = if c.dtype == ValueDtype::F16 {
                            kv.iter().map(|v| v.to_f64()).collect()
                        } else {
                            let p = quantize_values(&kv, c.dtype, &mut codes);
                            codes.iter().map(|&k| f64::from(dequantize(p, k))).collect()
                        };
                        let mut i = 0;
                        for j in 0..d {
                            if kept[j] {
                                // f16 rounding is left out of the energy loss (section 11.1)
                                if c.dtype != ValueDtype::F16 {
                                    c.err += (xr[j] - dec[i]).powi(2);
                                }
                                i += 1;
                            } else {
                                c.err += xr[j] * xr[j];
                            }
                        }
                    }
                }
                let choose = |f16_only: bool, den: f64, thr: f64| {
                    let ok: Vec<&Cand> = cands
                        .iter()
                        .filter(|c| !f16_only || c.dtype == ValueDtype::F16)
                        .collect();
                    let pass = ok
                        .iter()
                        .filter(|c| c.err / den <= thr)
                        .min_by(|a, b| a.bytes.cmp(&b.bytes).then(a.err.total_cmp(&b.err)));
                    let c = pass.copied().unwrap_or_else(|| {
                        ok.iter()
                            .min_by(|a, b| a.err.total_cmp(&b.err))
                            .copied()
                            .expect("candidates")
                    });
                    let text = format!(
                        "{:>4} {:>3}/{} {:>3} {:.4} {:.4}",
                        c.dtype.name(),
                        c.r,
                        c.g,
                        c.bytes,
                        c.err / energy,
                        c.err / centred
                    );
                    (text, c.bytes)
                };
                let mut totals = Vec::new();
                let mut line = format!("{l:>5} {h:>4} {side:>4} | {:>6.3}", mean_sq / energy);
                // the rule as shipped, f16 only, and keys measured against their spread
                let rules: Vec<(bool, f64, f64)> = if side == "K" {
                    vec![
                        (false, energy, thr),
                        (true, energy, thr),
                        (false, centred, thr),
                        (false, centred, 2.0 * thr),
                    ]
                } else {
                    vec![
                        (false, energy, thr),
                        (true, energy, thr),
                        (false, energy, thr),
                        (false, energy, thr),
                    ]
                };
                for (f16_only, den, t) in rules {
                    let (text, bytes) = choose(f16_only, den, t);
                    totals.push(bytes);
                    line.push_str(" | ");
                    line.push_str(&text);
                }
                println!("{line}");
                for (i, b) in totals.iter().enumerate() {
                    sums[i] += *b as f64;
                }
            }
        }
    }
    let per = (layers.len() * kvh) as f64;
    println!(
        "record bytes per token and layer (K+V, summed over KV heads), mean over these layers: energy rule {:.1}, f16 only {:.1}, K spread at 0.005 {:.1}, K spread at 0.01 {:.1}",
        sums[0] / per * kvh as f64,
        sums[1] / per * kvh as f64,
        sums[2] / per * kvh as f64,
        sums[3] / per * kvh as f64
    );
    Ok(())
}
