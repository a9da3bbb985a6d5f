//! Scale layouts for quantized retained elements (issue 15), measured on real K/V.
//!
//! cargo run --release -p mosaickv-engine --example quant_layouts -- --tokens 2048
//!
//! Prefills SmolLM2 on a filler prompt; per layer, KV head and side, fits the SPEC.md
//! section 3 rotation on the layer's rows, keeps the top r rotated values per row (section 5,
//! g = 1) and quantizes them with each candidate scale layout. Prints, per option, the mean
//! relative reconstruction error `sum ||x'_kept - dequant||^2 / sum ||x||^2` (quantization
//! error only; the dropped energy is the same for every option at one r) and the total
//! relative error with the dropped energy, with the record bytes each option costs. The
//! "sym"/"asym" options round their scale to the nearest f16 and clamp; "SPEC" is the
//! shipped rule (`spec::layout::quantize_values`: smallest f16 scale, f16 inputs).

use clap::Parser;
use mosaickv_engine::{model_path, Model};
use mosaickv_reference::rotation::fit_rotation;
use mosaickv_reference::topr::{rotate_row_f64, select_row};
use mosaickv_spec::layout::{dequantize, quantize_values};
use mosaickv_spec::{RecordLayout, ValueDtype};
use ndarray::s;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 2048)]
    tokens: usize,
}

/// Symmetric quantization of `v` with one scale per `group` consecutive values.
fn sym(v: &[f64], qmax: f64, group: usize) -> f64 {
    let mut err = 0.0;
    for c in v.chunks(group) {
        let a = c.iter().fold(0f64, |a, x| a.max(x.abs()));
        let s = half::f16::from_f64(a / qmax)
            .to_f64()
            .max(if a > 0.0 { 1e-12 } else { 0.0 });
        for &x in c {
            let q = if s == 0.0 {
                0.0
            } else {
                (x / s).round_ties_even().clamp(-qmax, qmax)
            };
            err += (x - q * s).powi(2);
        }
    }
    err
}

/// Asymmetric (scale and zero point, min/max) with one pair per `group` values; `levels` codes.
fn asym(v: &[f64], levels: f64, group: usize) -> f64 {
    let mut err = 0.0;
    for c in v.chunks(group) {
        let lo = c.iter().cloned().fold(f64::INFINITY, f64::min);
        let hi = c.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lo16 = half::f16::from_f64(lo).to_f64();
        let s = half::f16::from_f64((hi - lo16) / (levels - 1.0)).to_f64();
        for &x in c {
            let q = if s == 0.0 {
                0.0
            } else {
                ((x - lo16) / s).round_ties_even().clamp(0.0, levels - 1.0)
            };
            err += (x - (lo16 + q * s)).powi(2);
        }
    }
    err
}

/// SPEC.md section 6 as implemented: the kept values rounded to f16 (section 5), then
/// `quantize_values` and `dequantize`; the error is against the f64 rotated values.
fn spec_err(v: &[f64], dtype: ValueDtype) -> f64 {
    let y: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f64(x)).collect();
    let mut codes = vec![0u8; y.len()];
    let p = quantize_values(&y, dtype, &mut codes);
    v.iter()
        .zip(&codes)
        .map(|(&x, &c)| (x - f64::from(dequantize(p, c))).powi(2))
        .sum()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let model = Model::load(&model_path(None)?)?;
    let filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. \
        Rivers run to the sea, and the sea does not fill up. Clouds drift over the quiet hills. \
        A farmer counted his sheep at dusk, then went inside to light the fire and read a book. \
        In 1843 the census listed 7,211 souls; the mill paid 3 shillings a day. Why? Nobody knew. ";
    let per = model.encode_raw(filler)?.len();
    let mut ids = model.encode_raw(&filler.repeat(args.tokens / per + 2))?;
    ids.truncate(args.tokens);
    let pre = model.prefill(&ids)?;
    let layers = pre.keys.len();
    let (_, kvh, d) = pre.keys[0].dim();
    // (name, value bits, scale bytes per record as a function of r)
    type Opt = (
        &'static str,
        Box<dyn Fn(&[f64]) -> f64>,
        Box<dyn Fn(usize) -> usize>,
    );
    let opts: Vec<Opt> = vec![
        (
            "f16",
            Box::new(|v: &[f64]| {
                v.iter()
                    .map(|&x| (x - half::f16::from_f64(x).to_f64()).powi(2))
                    .sum()
            }),
            Box::new(|r| 2 * r),
        ),
        (
            "int8 sym/record",
            Box::new(|v| sym(v, 127.0, usize::MAX)),
            Box::new(|r| r + 2),
        ),
        (
            "int8 sym/32",
            Box::new(|v| sym(v, 127.0, 32)),
            Box::new(|r| r + 2 * r.div_ceil(32)),
        ),
        (
            "int8 asym/record",
            Box::new(|v| asym(v, 256.0, usize::MAX)),
            Box::new(|r| r + 4),
        ),
        (
            "int4 sym/record",
            Box::new(|v| sym(v, 7.0, usize::MAX)),
            Box::new(|r| r.div_ceil(2) + 2),
        ),
        (
            "int4 sym/32",
            Box::new(|v| sym(v, 7.0, 32)),
            Box::new(|r| r.div_ceil(2) + 2 * r.div_ceil(32)),
        ),
        (
            "int4 sym/16",
            Box::new(|v| sym(v, 7.0, 16)),
            Box::new(|r| r.div_ceil(2) + 2 * r.div_ceil(16)),
        ),
        (
            "int4 asym/record",
            Box::new(|v| asym(v, 16.0, usize::MAX)),
            Box::new(|r| r.div_ceil(2) + 4),
        ),
        (
            "int4 asym/32",
            Box::new(|v| asym(v, 16.0, 32)),
            Box::new(|r| r.div_ceil(2) + 4 * r.div_ceil(32)),
        ),
        // The shipped rule (SPEC.md section 6), through the one host implementation.
        (
            "int8 SPEC",
            Box::new(|v| spec_err(v, ValueDtype::Int8)),
            Box::new(|r| r + 4),
        ),
        (
            "int4 SPEC",
            Box::new(|v| spec_err(v, ValueDtype::Int4)),
            Box::new(|r| r.div_ceil(2) + 4),
        ),
    ];
    for side in ["K", "V"] {
        for frac in [0.25, 0.5, 0.75, 1.0] {
            let r = ((frac * d as f64).ceil() as usize).min(d);
            let layout = RecordLayout {
                head_dim: d,
                kept_dims: d,
                r,
                group_size: 1,
                dtype: ValueDtype::F16,
                code_bits: 0,
            };
            let mut qerr = vec![0f64; opts.len()];
            let (mut dropped, mut total) = (0f64, 0f64);
            for l in 0..layers {
                let x = if side == "K" {
                    &pre.keys[l]
                } else {
                    &pre.values[l]
                };
                for h in 0..kvh {
                    let rows = x.slice(s![.., h, ..]).to_owned();
                    let rot = fit_rotation(rows.view());
                    for row in rows.rows() {
                        let row: Vec<f32> = row.to_vec();
                        let xr = rotate_row_f64(&row, &rot);
                        let (_, kept) = select_row(&xr, &layout);
                        let kv: Vec<f64> = (0..d).filter(|&j| kept[j]).map(|j| xr[j]).collect();
                        total += xr.iter().map(|v| v * v).sum::<f64>();
                        dropped += (0..d)
                            .filter(|&j| !kept[j])
                            .map(|j| xr[j] * xr[j])
                            .sum::<f64>();
                        for (o, e) in opts.iter().zip(qerr.iter_mut()) {
                            *e += (o.1)(&kv);
                        }
                    }
                }
            }
            let bitmap = 4 * d.div_ceil(32);
            for (o, e) in opts.iter().zip(&qerr) {
                println!(
                    "{side} r={r:3} {:18} record {:4} B  quant err {:.5}  total (with dropped {:.5}) {:.5}",
                    o.0,
                    (bitmap + (o.2)(r)).div_ceil(4) * 4,
                    e / total,
                    dropped / total,
                    (e + dropped) / total
                );
            }
        }
    }
    println!(
        "# {layers} layers x {kvh} KV heads, D = {d}, {} tokens",
        args.tokens
    );
    Ok(())
}
