//! Bytes per record that SPEC.md section 11.1's thresholds allow under different record codings,
//! measured on a stored long prefill (issue 37: "what makes MosaicKV win at equal bytes").
//!
//! cargo run --release -p mosaickv-engine --example quant_schemes -- \
//!     --model qwen2.5-1.5b --prefill ~/.cache/mosaickv/prefills/<key>.mkvp [--stride 4]
//!
//! Per layer, KV head and side, the prompt's rows (the 4 sink tokens left out, as the cache keeps
//! them dense) are one segment: the section 3 rotation is fitted on them, and every `stride`-th
//! row is coded by each scheme below. The loss is section 11.1's (keys: error over the keys'
//! spread about their mean; values: error over their energy), the thresholds the default's
//! (0.01 K, 0.02 V). Each scheme's cheapest passing setting is taken (the lowest-loss one if none
//! passes) and its record bytes summed over heads and sides: bytes per token and layer, records
//! only (the key block metadata, rotations and sink are the same for every scheme and left out).
//!
//! - `bitmap`: SPEC 6 as shipped: per-vector top-r with a bitmap, f16/int8/int4 with one minimum
//!   and scale per record, g = 1, 2, 4, r = 1/8 .. 6/8 of D (the default's candidates).
//! - `bitmap-c`: the same after subtracting the segment's mean row (top-r, quantization and
//!   decode on `x - mean`; dropped dims decode to the mean).
//! - `prefix`: the first r rotated dims (the rotation orders them by energy), no bitmap, the same
//!   per-record int8/int4 quantization, r = 16 .. D in steps of 16.
//! - `prefix-c`: the same after subtracting the segment's mean row (decoded back; dropped dims
//!   decode to the mean, not 0).
//! - `alloc`: transform coding: the segment's mean subtracted, one step size `delta` shared by
//!   every rotated dim, and per dim the fewest bits whose 2^b levels at that step span the dim's
//!   range over the segment (0 bits: the dim decodes to its mid-range; at most 8 bits, where the
//!   dim's step grows to range/255). No per-record header and no bitmap: the record is the codes
//!   bit-packed, `ceil(sum_j b_j / 8)` bytes. `delta` is the largest (bisection) that passes.
//! - `alloc-p2`: the same with every width rounded up to 1, 2, 4 or 8 bits (codes a SIMD kernel
//!   unpacks without shifts across bytes), each dim's step shrunk to use the levels it gains.

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
    /// Measure every stride-th row (the rotation and the dims' ranges use every row).
    #[arg(long, default_value_t = 4)]
    stride: usize,
    /// Only these layers (comma-separated), default all.
    #[arg(long, value_delimiter = ',')]
    layers: Vec<usize>,
    #[arg(long, default_value_t = 0.01)]
    key_loss: f64,
    #[arg(long, default_value_t = 0.02)]
    value_loss: f64,
    /// Print one line per layer, head and side.
    #[arg(long)]
    verbose: bool,
}

const SINK: usize = 4;

/// A coded setting: its record bytes and its squared error summed over the measured rows.
#[derive(Clone, Copy)]
struct Setting {
    bytes: usize,
    err: f64,
    what: (&'static str, usize, usize),
}

fn pick(settings: &[Setting], den: f64, thr: f64) -> Setting {
    let pass = settings
        .iter()
        .filter(|c| c.err / den <= thr)
        .min_by(|a, b| a.bytes.cmp(&b.bytes).then(a.err.total_cmp(&b.err)));
    *pass.unwrap_or_else(|| {
        settings
            .iter()
            .min_by(|a, b| a.err.total_cmp(&b.err))
            .expect("settings")
    })
}

fn f16r(v: f64) -> half::f16 {
    half::f16::from_f64(v)
}

/// Squared error of per-record quantization of `vals` (f64, already f16-representable or not).
fn record_err(vals: &[f64], dtype: ValueDtype, codes: &mut Vec<u8>) -> f64 {
    let kv: Vec<half::f16> = vals.iter().map(|&v| f16r(v)).collect();
    if dtype == ValueDtype::F16 {
        return vals
            .iter()
            .zip(&kv)
            .map(|(a, b)| (a - b.to_f64()).powi(2))
            .sum();
    }
    codes.resize(kv.len(), 0);
    let p = quantize_values(&kv, dtype, codes);
    vals.iter()
        .zip(codes.iter())
        .map(|(a, &c)| (a - f64::from(dequantize(p, c))).powi(2))
        .sum()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let model = Model::load(&resolve_model(Some(std::path::Path::new(&args.model)))?)?;
    let pre = read_stored(&args.prefill, &model)?;
    let (n, kvh, d) = pre.keys[0].dim();
    println!(
        "prefill: {n} tokens, {} layers, {kvh} KV heads, head_dim {d}; thresholds K {} (spread) V {} (energy)",
        pre.keys.len(),
        args.key_loss,
        args.value_loss
    );
    let layers: Vec<usize> = if args.layers.is_empty() {
        (0..pre.keys.len()).collect()
    } else {
        args.layers.clone()
    };
    let names = [
        "bitmap", "bitmap-c", "prefix", "prefix-c", "alloc", "alloc-p2",
    ];
    let mut totals = [[0f64; 6]; 2];
    for &l in &layers {
        for h in 0..kvh {
            for (si, (side, x)) in [("K", &pre.keys[l]), ("V", &pre.values[l])]
                .into_iter()
                .enumerate()
            {
                let thr = if si == 0 {
                    args.key_loss
                } else {
                    args.value_loss
                };
                let rows = x.slice(s![SINK.., h, ..]).to_owned();
                let rot = fit_rotation(rows.view());
                let all: Vec<Vec<f64>> = (0..rows.nrows())
                    .map(|t| rotate_row_f64(&rows.row(t).to_vec(), &rot))
                    .collect();
                let (mut lo, mut hi, mut mean) =
                    (vec![f64::MAX; d], vec![f64::MIN; d], vec![0f64; d]);
                for xr in &all {
                    for j in 0..d {
                        lo[j] = lo[j].min(xr[j]);
                        hi[j] = hi[j].max(xr[j]);
                        mean[j] += xr[j] / all.len() as f64;
                    }
                }
                let picked: Vec<&Vec<f64>> = all.iter().step_by(args.stride).collect();
                let energy: f64 = picked
                    .iter()
                    .map(|xr| xr.iter().map(|v| v * v).sum::<f64>())
                    .sum();
                let spread: f64 = picked
                    .iter()
                    .map(|xr| {
                        xr.iter()
                            .zip(&mean)
                            .map(|(v, m)| (v - m).powi(2))
                            .sum::<f64>()
                    })
                    .sum();
                let den = if si == 0 && spread > 0.0 {
                    spread
                } else {
                    energy
                };
                let mut codes = Vec::new();
                let mut chosen = [None; 6];

                // bitmap: SPEC 6 as shipped, and bitmap-c on the centred rows
                for (k, centred) in [(0usize, false), (1, true)] {
                    let mut set = Vec::new();
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
                                let mut err = 0.0;
                                for xr in &picked {
                                    let xc: Vec<f64> = (0..d)
                                        .map(|j| if centred { xr[j] - mean[j] } else { xr[j] })
                                        .collect();
                                    let xr = &xc;
                                    let (y, kept) = select_row(xr, &layout);
                                    let idx: Vec<usize> = (0..d).filter(|&j| kept[j / g]).collect();
                                    let vals: Vec<f64> =
                                        idx.iter().map(|&j| y[j].to_f64()).collect();
                                    // the f16 rounding of y, then the record's quantization
                                    err += idx
                                        .iter()
                                        .map(|&j| (xr[j] - y[j].to_f64()).powi(2))
                                        .sum::<f64>();
                                    err += record_err(&vals, dtype, &mut codes);
                                    err += (0..d)
                                        .filter(|&j| !kept[j / g])
                                        .map(|j| xr[j] * xr[j])
                                        .sum::<f64>();
                                }
                                set.push(Setting {
                                    bytes: layout.record_bytes(),
                                    err,
                                    what: (dtype.name(), r, g),
                                });
                            }
                        }
                    }
                    chosen[k] = Some(pick(&set, den, thr));
                }

                // prefix and prefix-c
                for (k, centred) in [(2usize, false), (3, true)] {
                    let mut set = Vec::new();
                    for dtype in [ValueDtype::F16, ValueDtype::Int8, ValueDtype::Int4] {
                        for r in (16..=d).step_by(16) {
                            let mut err = 0.0;
                            for xr in &picked {
                                let c: Vec<f64> = (0..d)
                                    .map(|j| if centred { xr[j] - mean[j] } else { xr[j] })
                                    .collect();
                                err += record_err(&c[..r], dtype, &mut codes);
                                err += c[r..].iter().map(|v| v * v).sum::<f64>();
                            }
                            let v = match dtype {
                                ValueDtype::F16 => 2 * r,
                                ValueDtype::Int8 => 4 + r,
                                ValueDtype::Int4 => 4 + r.div_ceil(2),
                                ValueDtype::Coded => unreachable!("bitmap schemes only"),
                            };
                            set.push(Setting {
                                bytes: v.div_ceil(4) * 4,
                                err,
                                what: (dtype.name(), r, 1),
                            });
                        }
                    }
                    chosen[k] = Some(pick(&set, den, thr));
                }

                // alloc: one step for every dim, bits per dim from the dim's range
                let alloc = |delta: f64, pow2: bool| -> Setting {
                    let mut bits = 0usize;
                    let mut err = 0.0;
                    let plan: Vec<(usize, f64)> = (0..d)
                        .map(|j| {
                            let range = hi[j] - lo[j];
                            let levels = (range / delta).floor() + 1.0;
                            let b = if levels <= 1.0 {
                                0
                            } else {
                                (levels.log2().ceil() as usize).min(8)
                            };
                            // alloc-p2: widths 1, 2, 4 or 8 only (SIMD-friendly unpacking),
                            // the step shrunk to use the extra levels
                            let b = if pow2 && b > 0 {
                                b.next_power_of_two()
                            } else {
                                b
                            };
                            let step = if b == 8 && levels > 256.0 {
                                range / 255.0
                            } else if pow2 && b > 0 {
                                delta.min(range / ((1usize << b) - 1) as f64)
                            } else {
                                delta
                            };
                            (b, step)
                        })
                        .collect();
                    for &(b, _) in &plan {
                        bits += b;
                    }
                    for xr in &picked {
                        for j in 0..d {
                            let (b, step) = plan[j];
                            let dec = if b == 0 {
                                0.5 * (lo[j] + hi[j])
                            } else {
                                let c = ((xr[j] - lo[j]) / step)
                                    .round()
                                    .clamp(0.0, ((1usize << b) - 1) as f64);
                                lo[j] + c * step
                            };
                            err += (xr[j] - dec).powi(2);
                        }
                    }
                    Setting {
                        bytes: bits.div_ceil(8),
                        err,
                        what: ("alloc", bits, 0),
                    }
                };
                for (k, pow2) in [(4usize, false), (5, true)] {
                    let span = (0..d).map(|j| hi[j] - lo[j]).fold(0.0, f64::max).max(1e-30);
                    let (mut a, mut b) = (span * 1e-6, span * 2.0);
                    let mut best = alloc(a, pow2);
                    for _ in 0..40 {
                        let m = (a * b).sqrt();
                        let s = alloc(m, pow2);
                        if s.err / den <= thr {
                            best = s;
                            a = m;
                        } else {
                            b = m;
                        }
                    }
                    chosen[k] = Some(best);
                }

                let mut line = format!("{l:>3} {h} {side} |");
                for (k, c) in chosen.iter().enumerate() {
                    let c = c.expect("chosen");
                    totals[si][k] += c.bytes as f64;
                    line.push_str(&format!(
                        " {}={}:{}/{} {}B {:.4} |",
                        names[k],
                        c.what.0,
                        c.what.1,
                        c.what.2,
                        c.bytes,
                        c.err / den
                    ));
                }
                if args.verbose {
                    println!("{line}");
                }
            }
        }
    }
    let per = layers.len() as f64;
    println!(
        "scheme     | K B/token/layer | V B/token/layer | records B/token/layer (all {kvh} heads)"
    );
    for k in 0..6 {
        println!(
            "{:<10} | {:>15.1} | {:>15.1} | {:>8.1}",
            names[k],
            totals[0][k] / per,
            totals[1][k] / per,
            (totals[0][k] + totals[1][k]) / per
        );
    }
    Ok(())
}
