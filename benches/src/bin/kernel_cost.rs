//! Single-thread cost of each decode-step kernel on L1/L2-resident data, in ns per unit:
//! `kernel_cost` (uses the run-time detected path; `MOSAICKV_FORCE_AVX2=1` / `MOSAICKV_FORCE_PORTABLE=1`
//! select the others; `kernel_cost TEXT` runs only the lines whose label contains TEXT).
//! Separates arithmetic cost from memory cost: multiply by the units of a
//! step (blocks scored, records expanded, tokens attended) to get the step's compute floor.

use half::f16;
use mosaickv_optimized::simd::{Path, TILE};
use std::hint::black_box;
use std::time::Instant;

/// Times `f` (`reps` runs after one warm-up) and prints ns per unit, unless the command line
/// names a filter (`kernel_cost key_logits`) that `label` does not contain (then 0, not run).
fn time(label: &str, units: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    if let Some(filter) = std::env::args().nth(1) {
        if !label.contains(filter.as_str()) {
            return 0.0;
        }
    }
    f();
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    let ns = t.elapsed().as_secs_f64() * 1e9 / (reps * units) as f64;
    println!("{label:<34} {ns:8.2} ns/unit");
    ns
}

fn main() {
    let path = Path::detect();
    println!("path {path:?}");
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let (g, dt, r, dp) = (4usize, 96usize, 32usize, 96usize);
    // Score: 512 blocks of int8 metadata (100 KB, L2).
    let blocks = 512;
    let mn: Vec<i8> = (0..blocks * dt).map(|_| -((rnd() % 127) as i8)).collect();
    let mx: Vec<i8> = (0..blocks * dt).map(|_| (rnd() % 127) as i8).collect();
    let sc: Vec<f32> = (0..blocks).map(|_| 0.01).collect();
    let q: Vec<f32> = (0..g * dp)
        .map(|_| (rnd() % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let mut out = vec![0f32; blocks];
    time("score_blocks (per block, g=4)", blocks, 2000, || {
        path.score_blocks(&q, g, dp, dt, &mn, &mx, &sc, &mut out);
        black_box(&out);
    });
    // Records: 16 g=1 records, r of dt bits set.
    let bb = 4 * dt.div_ceil(32);
    let rb = bb + 2 * r;
    let mut bytes = vec![0u8; TILE * rb + 64];
    for t in 0..TILE {
        let mut set = 0;
        while set < r {
            let d = (rnd() % dt as u64) as usize;
            let (w, b) = (d / 8, d % 8);
            if bytes[t * rb + w] & (1 << b) == 0 {
                bytes[t * rb + w] |= 1 << b;
                set += 1;
            }
        }
        for k in 0..r {
            let h = f16::from_f32(0.5).to_bits().to_le_bytes();
            bytes[t * rb + bb + 2 * k] = h[0];
            bytes[t * rb + bb + 2 * k + 1] = h[1];
        }
    }
    let mut tile = vec![0f32; TILE * dp];
    time("expand_records (per record)", TILE, 200_000, || {
        path.expand_records(&bytes, 64, TILE, rb, bb, 1, dt, r, dp, &mut tile);
        black_box(&tile);
    });
    let mut lg = vec![0f32; g * TILE];
    time("tile_logits (per token, g=4, 96)", TILE, 200_000, || {
        path.tile_logits(&q, g, dp, &tile, TILE, 0.1, &mut lg);
        black_box(&lg);
    });
    if path.half_tile(1, dt, r, dp) {
        let mut half = vec![f16::ZERO; TILE * dp];
        time(
            "expand_records_h (per record, f16 tile)",
            TILE,
            200_000,
            || {
                path.expand_records_h((&bytes, rb, bb), TILE, dt, r, dp, &mut half);
                black_box(&half);
            },
        );
        time("tile_logits_h (per token, f16 tile)", TILE, 200_000, || {
            path.tile_logits_h(&q, g, dp, &half, TILE, 0.1, &mut lg);
            black_box(&lg);
        });
    }
    let mut acc = vec![0f32; g * dp];
    let p: Vec<f32> = (0..g * TILE).map(|i| 1e-3 * i as f32).collect();
    time("tile_accumulate (per token)", TILE, 200_000, || {
        path.tile_accumulate(&p, g, dp, &tile, TILE, &mut acc);
        black_box(&acc);
    });
    if path.fused_packed(1, dt, r, dp) {
        let (mut m, mut l, mut corr) = (vec![0f32; g], vec![0f32; g], vec![0f32; g]);
        let lg0: Vec<f32> = (0..g * TILE).map(|i| (i % 13) as f32 * 0.1).collect();
        // The softmax step as the fused path runs it: factors out, accumulators untouched.
        let softmax = |m: &mut [f32], l: &mut [f32], lg: &mut [f32], corr: &mut [f32]| {
            path.online_softmax(m, l, &mut [], g, dp, lg, TILE, Some(corr));
        };
        time("online_softmax (per token, g=4)", TILE, 200_000, || {
            lg.copy_from_slice(&lg0);
            softmax(&mut m, &mut l, &mut lg, &mut corr);
            black_box(&lg);
        });
        // One tile of the whole packed step as packed_attention runs it: expansion (to an f16
        // tile where the path has one), logits, softmax, fused values.
        let half_keys = path.half_tile(1, dt, r, dp);
        let mut half = vec![f16::ZERO; TILE * dp];
        time(
            "packed tile, all kernels (per token)",
            TILE,
            100_000,
            || {
                if half_keys {
                    path.expand_records_h((&bytes, rb, bb), TILE, dt, r, dp, &mut half);
                    path.tile_logits_h(&q, g, dp, &half, TILE, 0.1, &mut lg);
                } else {
                    path.expand_records(&bytes, 64, TILE, rb, bb, 1, dt, r, dp, &mut tile);
                    path.tile_logits(&q, g, dp, &tile, TILE, 0.1, &mut lg);
                }
                softmax(&mut m, &mut l, &mut lg, &mut corr);
                path.packed_accumulate(&lg, g, dp, (&bytes, rb, bb), TILE, dt, r, &corr, &mut acc);
                black_box(&acc);
            },
        );
        time("packed_accumulate (per token)", TILE, 200_000, || {
            path.packed_accumulate(
                &p,
                g,
                dp,
                (&bytes, rb, bb),
                TILE,
                dt,
                r,
                &[1.0; 4],
                &mut acc,
            );
            black_box(&acc);
        });
    }
    quantized_records(path, &mut rnd);
    // Dense f16 rows, d = 128 (full attention's inner loop).
    let d = 128;
    let rows: Vec<f16> = (0..TILE * d)
        .map(|i| f16::from_f32((i % 7) as f32 * 0.1))
        .collect();
    let q128: Vec<f32> = (0..g * d).map(|i| (i % 5) as f32 * 0.1).collect();
    if path.fused_f16(d) {
        time("tile_logits_f16 (per token, 128)", TILE, 200_000, || {
            path.tile_logits_f16(&q128, g, d, &rows, d, TILE, 0.1, &mut lg);
            black_box(&lg);
        });
        let mut acc = vec![0f32; g * d];
        time("tile_accumulate_f16 (per token)", TILE, 200_000, || {
            path.tile_accumulate_f16(&p, g, d, &rows, d, TILE, &mut acc);
            black_box(&acc);
        });
    }
    // Top-k: 8,192 block scores of one KV head at 131,072 tokens, 10 % of the tokens in blocks of 16.
    let n = 8192;
    let scores: Vec<f32> = (0..n)
        .map(|_| (rnd() % 100_000) as f32 / 1000.0 - 50.0)
        .collect();
    let (mut keys, mut sel) = (Vec::new(), Vec::new());
    time("top_blocks (per score, n=8192, 10 %)", n, 2000, || {
        mosaickv_optimized::select::top_blocks(
            path,
            &scores,
            |_| 16,
            n * 16 / 10,
            n / 10 + 9,
            &mut keys,
            &mut sel,
        );
        black_box(&sel);
    });
}

/// int8 records of the shipped default at 131,072 tokens (`profile_stages`: keys Dt 128, g 1,
/// r 80; values Dt 128, g 4, r 16; 4 query heads per KV head): the tile kernels (expand, then
/// logits or accumulation) beside the kernels that read the records directly: the SPEC 9
/// integer key logits (`key_logits_q8`, every path) and the values at their kept dims where
/// the path has it (`sparse_accumulate_q`; AVX2 also `kept_accumulate_q`), and the paper
/// configuration's f16 values.
fn quantized_records(path: Path, rnd: &mut impl FnMut() -> u64) {
    use mosaickv_optimized::packed::pack_rotated;
    use mosaickv_spec::{RecordLayout, ValueDtype};
    let (g, d) = (4usize, 128usize);
    let rows: Vec<f64> = (0..TILE * d)
        .map(|_| (rnd() % 10_000) as f64 / 1250.0 - 4.0)
        .collect();
    let layout = |group_size, r| RecordLayout {
        head_dim: d,
        kept_dims: d,
        r,
        group_size,
        dtype: ValueDtype::Int8,
        code_bits: 0,
    };
    let (kl, vl) = (layout(1, 80), layout(4, 16));
    let side = mosaickv_spec::SideStrategy::bare;
    let keys = pack_rotated(&rows, d, &side(kl))
        .expect("valid key layout")
        .bytes;
    let values = pack_rotated(&rows, d, &side(vl))
        .expect("valid value layout")
        .bytes;
    let q: Vec<f32> = (0..g * d).map(|i| (i % 5) as f32 * 0.1).collect();
    let (mut tile, mut lg) = (vec![0f32; TILE * d], vec![0f32; g * TILE]);
    time("int8 keys r=80: expand_records_q", TILE, 100_000, || {
        path.expand_records_q(&keys, TILE, &kl, d, &mut tile);
        black_box(&tile);
    });
    time("tile_logits (per token, g=4, 128)", TILE, 100_000, || {
        path.tile_logits(&q, g, d, &tile, TILE, 0.1, &mut lg);
        black_box(&lg);
    });
    time(
        "int8 keys r=80: expand + tile_logits",
        TILE,
        100_000,
        || {
            path.expand_records_q(&keys, TILE, &kl, d, &mut tile);
            path.tile_logits(&q, g, d, &tile, TILE, 0.1, &mut lg);
            black_box(&lg);
        },
    );
    // SPEC 9 on int8/int4 keys: the integer logits of the int8 query, on the codes as stored
    let qs = mosaickv_optimized::simd::q8_stride(d);
    let quantize = |heads: usize, qf: &[f32]| {
        let mut q8 = vec![0i8; heads * qs];
        let sq: Vec<f64> = (0..heads)
            .map(|h| {
                let row = &qf[h * d..(h + 1) * d];
                mosaickv_optimized::simd::quantize_query_i8(
                    path,
                    row,
                    &mut q8[h * qs..(h + 1) * qs],
                )
            })
            .collect();
        (q8, sq)
    };
    let inv = mosaickv_spec::layout::inv_sqrt_d(d);
    let (q8, sq) = quantize(g, &q);
    time("int8 keys r=80: key_logits_q8", TILE, 100_000, || {
        path.key_logits_q8(&q8, qs, &sq, g, &keys, &kl, TILE, inv, &mut lg);
        black_box(&lg);
    });
    time("int8 keys r=80: key_logits_q8 g=1", TILE, 100_000, || {
        path.key_logits_q8(&q8, qs, &sq, 1, &keys, &kl, TILE, inv, &mut lg);
        black_box(&lg);
    });
    // Qwen2.5-Coder-1.5B's group: 6 query heads per KV head
    let q6: Vec<f32> = (0..6 * d).map(|i| (i % 7) as f32 * 0.1).collect();
    let (q8_6, sq6) = quantize(6, &q6);
    let mut lg6 = vec![0f32; 6 * TILE];
    time("int8 keys r=80: key_logits_q8 g=6", TILE, 100_000, || {
        path.key_logits_q8(&q8_6, qs, &sq6, 6, &keys, &kl, TILE, inv, &mut lg6);
        black_box(&lg6);
    });
    // Qwen2.5-Coder-0.5B's group: 7 query heads per KV head; 8 (Llama-3-70B's)
    for heads in [7usize, 8] {
        let qh: Vec<f32> = (0..heads * d).map(|i| (i % 7) as f32 * 0.1).collect();
        let (q8h, sqh) = quantize(heads, &qh);
        let mut lgh = vec![0f32; heads * TILE];
        let label = format!("int8 keys r=80: key_logits_q8 g={heads}");
        time(&label, TILE, 100_000, || {
            path.key_logits_q8(&q8h, qs, &sqh, heads, &keys, &kl, TILE, inv, &mut lgh);
            black_box(&lgh);
        });
    }
    let p: Vec<f32> = (0..g * TILE).map(|i| 1e-3 * i as f32).collect();
    let mut acc = vec![0f32; g * d];
    time(
        "int8 values g=4 r=16: expand + accumulate",
        TILE,
        100_000,
        || {
            path.expand_records_q(&values, TILE, &vl, d, &mut tile);
            path.tile_accumulate(&p, g, d, &tile, TILE, &mut acc);
            black_box(&acc);
        },
    );
    if path.kept_values_q(&vl) {
        time(
            "int8 values g=4 r=16: kept_accumulate_q",
            TILE,
            100_000,
            || {
                path.kept_accumulate_q(&p, g, d, &values, &vl, TILE, &mut acc);
                black_box(&acc);
            },
        );
    }
    if let Some(plan) = path.sparse_plan(&vl, g) {
        let mut acc_t = vec![0f32; plan.len(d)];
        time(
            "int8 values g=4 r=16: sparse_accumulate_q",
            TILE,
            100_000,
            || {
                path.sparse_accumulate_q(&p, &plan, &values, &vl, TILE, &mut acc_t);
                black_box(&acc_t);
            },
        );
    }
    // Qwen2.5-Coder-0.5B's most common value layout on its real cache at 8K (int4, g 2, r 16
    // of Dt 64; seven query heads per KV head): at the kept dims into the dense accumulator
    // (AVX2's `kept_accumulate_q`: one scalar FMA per dim and head) or the head-minor one
    let (d7, h7) = (64usize, 7usize);
    let ql = RecordLayout {
        head_dim: d7,
        kept_dims: d7,
        r: 16,
        group_size: 2,
        dtype: ValueDtype::Int4,
        code_bits: 0,
    };
    let rows7: Vec<f64> = (0..TILE * d7)
        .map(|_| (rnd() % 10_000) as f64 / 1250.0 - 4.0)
        .collect();
    let values7 = pack_rotated(&rows7, d7, &side(ql))
        .expect("valid int4 layout")
        .bytes;
    let p7: Vec<f32> = (0..h7 * TILE).map(|i| 1e-3 * i as f32).collect();
    let mut acc7 = vec![0f32; h7 * d7];
    if path.kept_values_q(&ql) {
        time(
            "int4 values g=2 r=16 of 64, 7 heads: kept_accumulate_q",
            TILE,
            100_000,
            || {
                path.kept_accumulate_q(&p7, h7, d7, &values7, &ql, TILE, &mut acc7);
                black_box(&acc7);
            },
        );
    }
    if let Some(plan) = path.sparse_plan(&ql, h7) {
        let mut acc_t = vec![0f32; plan.len(d7)];
        time(
            "int4 values g=2 r=16 of 64, 7 heads: sparse_accumulate_q",
            TILE,
            100_000,
            || {
                path.sparse_accumulate_q(&p7, &plan, &values7, &ql, TILE, &mut acc_t);
                black_box(&acc_t);
            },
        );
    }
    // The paper configuration's values (f16, g 1, r 32 of Dt 96): expanded and accumulated
    // densely, or at their kept dims where the path has it (AVX2)
    let (dt, r) = (96usize, 32usize);
    let hl = RecordLayout {
        head_dim: d,
        kept_dims: dt,
        r,
        group_size: 1,
        dtype: ValueDtype::F16,
        code_bits: 0,
    };
    let half_values = pack_rotated(&rows, d, &side(hl))
        .expect("valid f16 layout")
        .bytes;
    let (rb, bb) = (hl.record_bytes(), hl.bitmap_bytes());
    time(
        "f16 values g=1 r=32 of 96: expand + accumulate",
        TILE,
        100_000,
        || {
            path.expand_records(&half_values, 0, TILE, rb, bb, 1, dt, r, dt, &mut tile);
            path.tile_accumulate(&p, g, dt, &tile, TILE, &mut acc);
            black_box(&acc);
        },
    );
    if let Some(plan) = path.sparse_plan(&hl, g) {
        let mut acc_t = vec![0f32; plan.len(dt)];
        time(
            "f16 values g=1 r=32 of 96: sparse_accumulate_q",
            TILE,
            100_000,
            || {
                path.sparse_accumulate_q(&p, &plan, &half_values, &hl, TILE, &mut acc_t);
                black_box(&acc_t);
            },
        );
    }
}
