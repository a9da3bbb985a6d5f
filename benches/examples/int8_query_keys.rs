//! Design probe for issue 38 (not SPEC arithmetic, not used by any backend): what an int8
//! query would buy the SPEC 9 key logits on int8 key records, and what it would cost in
//! accuracy. `cargo run --release -p mosaickv-benches --example int8_query_keys`.
//!
//! Today every path computes `q . k^` in f32 from the f32 rotated query and the decoded key
//! `k^_d = m + code_d * s` (zero where not kept). On AVX-512 the decode (widen, convert, FMA)
//! costs more than the multiply-adds. With the query quantized to int8 (`q~ = qs * q8`, the
//! way llama.cpp's q8_0 K cache quantizes Q to q8_0 for its dot products), the logit is
//! `qs * (s * sum_kept q8_d code_d + m * sum_kept q8_d)`: two `vpdpbusd` per 64 dims and
//! query head on the codes as stored (placed by `vpexpandb`), no decode at all.
//!
//! The probe prints (1) the accuracy side: on Llama-3.1-8B-shaped synthetic keys and queries
//! (`synthetic::structured_kv`, `synthetic::queries`), rotated by each head's SVD rotation and
//! packed as the shipped default packs keys (int8, g 1, r 80), the logit error and the
//! attention-weight error that quantizing the rotated query adds (per head, and per block of
//! 32 dims as q8_0 does), beside the error the int8 key records already add; (2) the speed
//! side: single-thread ns per record on L1-resident records, the shipped fused f32 kernel
//! (`Path::tile_logits_q`) against an int8-query `vpdpbusd` kernel written here.

use mosaickv_optimized::packed::pack_rotated;
use mosaickv_optimized::simd::{Path, TILE};
use mosaickv_reference::rotation::fit_rotation_f64;
use mosaickv_reference::synthetic::{queries, structured_kv};
use mosaickv_spec::{RecordLayout, ValueDtype};
use std::hint::black_box;
use std::time::Instant;

const D: usize = 128;
const KV_HEADS: usize = 8;
const Q_PER_KV: usize = 4;

/// Decoded key record (the floats every path multiplies): `m + code * s` at kept dims.
fn decode(layout: &RecordLayout, rec: &[u8]) -> Vec<f32> {
    mosaickv_reference::packed::decode_record(layout, rec).expect("valid record")
}

/// `q` quantized to int8 with one absmax scale per `block` dims (round to nearest): the
/// dequantized query `qs * q8`.
fn quantize_query(q: &[f64], block: usize) -> Vec<f64> {
    let mut out = vec![0.0; q.len()];
    for (qc, oc) in q.chunks(block).zip(out.chunks_mut(block)) {
        let amax = qc.iter().fold(0f64, |a, &x| a.max(x.abs()));
        let s = if amax > 0.0 { amax / 127.0 } else { 1.0 };
        for (o, &x) in oc.iter_mut().zip(qc) {
            *o = (x / s).round().clamp(-127.0, 127.0) * s;
        }
    }
    out
}

fn softmax(l: &[f64]) -> Vec<f64> {
    let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = l.iter().map(|x| (x - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|x| x / z).collect()
}

/// Sum of |a - b| (attention weights: the total mass moved).
fn l1(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum()
}

fn accuracy(tokens: usize) {
    let (keys, _values) = structured_kv(tokens, KV_HEADS, D, 7);
    let qs = queries(KV_HEADS * Q_PER_KV, D, &keys, 8);
    let layout = RecordLayout {
        head_dim: D,
        kept_dims: D,
        r: 80,
        group_size: 1,
        dtype: ValueDtype::Int8,
    };
    let scale = 1.0 / (D as f64).sqrt();
    println!(
        "accuracy: {tokens} tokens x {KV_HEADS} KV heads x {Q_PER_KV} query heads, keys int8 g 1 r 80 (the default's key layout)"
    );
    println!(
        "| query | max |logit error| | mean |logit error| | attention mass moved (mean over heads) | worst head |"
    );
    println!("|---|---:|---:|---:|---:|");
    let variants: [(&str, usize); 3] = [
        ("f32 (today), records only", 0),
        ("int8, one scale per head", D),
        ("int8, one scale per 32 dims (q8_0)", 32),
    ];
    let mut rows = vec![(0f64, 0f64, 0f64, 0f64, 0usize); variants.len()];
    for j in 0..KV_HEADS {
        let k = keys.slice(ndarray::s![.., j, ..]);
        let rot = fit_rotation_f64(k.view());
        // Rotated keys y = R^T k, packed as the default packs them, and decoded.
        let mut y = vec![0f64; tokens * D];
        for t in 0..tokens {
            for c in 0..D {
                y[t * D + c] = (0..D).map(|i| f64::from(k[[t, i]]) * rot[[i, c]]).sum();
            }
        }
        let packed = pack_rotated(&y, D, &layout).expect("pack");
        let rb = layout.record_bytes();
        let dec: Vec<Vec<f32>> = (0..tokens)
            .map(|t| decode(&layout, &packed.bytes[t * rb..(t + 1) * rb]))
            .collect();
        for hq in 0..Q_PER_KV {
            let q = qs.row(j * Q_PER_KV + hq);
            let qr: Vec<f64> = (0..D)
                .map(|c| (0..D).map(|i| f64::from(q[i]) * rot[[i, c]]).sum())
                .collect();
            let exact: Vec<f64> = (0..tokens)
                .map(|t| scale * (0..D).map(|c| qr[c] * y[t * D + c]).sum::<f64>())
                .collect();
            let p_exact = softmax(&exact);
            for (vi, &(_, block)) in variants.iter().enumerate() {
                let qv = if block == 0 {
                    qr.clone()
                } else {
                    quantize_query(&qr, block)
                };
                let lg: Vec<f64> = (0..tokens)
                    .map(|t| scale * (0..D).map(|c| qv[c] * f64::from(dec[t][c])).sum::<f64>())
                    .collect();
                let err: Vec<f64> = lg.iter().zip(&exact).map(|(a, b)| (a - b).abs()).collect();
                let moved = l1(&softmax(&lg), &p_exact);
                let r = &mut rows[vi];
                r.0 = r.0.max(err.iter().cloned().fold(0.0, f64::max));
                r.1 += err.iter().sum::<f64>() / tokens as f64;
                r.2 += moved;
                r.3 = r.3.max(moved);
                r.4 += 1;
            }
        }
    }
    for ((name, _), r) in variants.iter().zip(&rows) {
        println!(
            "| {name} | {:.4} | {:.4} | {:.4} | {:.4} |",
            r.0,
            r.1 / r.4 as f64,
            r.2 / r.4 as f64,
            r.3
        );
    }
}

/// The int8-query key logits of `n <= TILE` int8 g = 1 records (`Dt` a multiple of 64, at
/// most 128) for 4 query heads: per 64 dims, the record's codes placed by `vpexpandb`, then
/// per head `vpdpbusd` on the codes and on a byte 1 at each kept dim.
///
/// # Safety
/// AVX-512 F/BW/VBMI2/VNNI; `bytes` holds `n` records of `layout`; `q8` holds `4 * dt` int8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,f16c")]
#[allow(clippy::needless_range_loop)]
unsafe fn int8_query_logits<const EXACT: bool>(
    q8: &[i8],
    qscale: &[f32; 4],
    bytes: &[u8],
    layout: &RecordLayout,
    n: usize,
    scale: f32,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (dt, r, rb, bb) = (
        layout.kept_dims,
        layout.r,
        layout.record_bytes(),
        layout.bitmap_bytes(),
    );
    let words = dt / 64;
    let mut qv = [[_mm512_setzero_si512(); 2]; 4];
    for h in 0..4 {
        for w in 0..words {
            qv[h][w] = _mm512_loadu_si512(q8.as_ptr().add(h * dt + 64 * w) as *const __m512i);
        }
    }
    let ones = _mm512_set1_epi8(1);
    let qs64 = _mm256_setr_pd(
        f64::from(qscale[0]),
        f64::from(qscale[1]),
        f64::from(qscale[2]),
        f64::from(qscale[3]),
    );
    let scale64 = _mm256_set1_pd(f64::from(scale));
    let mut lanes4 = [0f32; 4];
    for t in 0..n {
        let rec = &bytes[t * rb..(t + 1) * rb];
        let codes = rec.as_ptr().add(layout.values_offset());
        let mut ac = [_mm512_setzero_si512(); 4];
        let mut ak = [_mm512_setzero_si512(); 4];
        let mut off = 0usize;
        for w in 0..words {
            let mask = u64::from_le_bytes(rec[8 * w..8 * w + 8].try_into().unwrap());
            let lanes = if r - off >= 64 {
                u64::MAX
            } else {
                (1u64 << (r - off)) - 1
            };
            let src = _mm512_maskz_loadu_epi8(lanes, codes.add(off) as *const i8);
            let placed = _mm512_maskz_expand_epi8(mask, src);
            let kept = _mm512_maskz_mov_epi8(mask, ones);
            for h in 0..4 {
                ac[h] = _mm512_dpbusd_epi32(ac[h], placed, qv[h][w]);
                ak[h] = _mm512_dpbusd_epi32(ak[h], kept, qv[h][w]);
            }
            off = (off + mask.count_ones() as usize).min(r);
        }
        let ms = u32::from_le_bytes([rec[bb], rec[bb + 1], rec[bb + 2], rec[bb + 3]]);
        let ms = _mm_cvtph_ps(_mm_cvtsi32_si128(ms as i32));
        if EXACT {
            // The proposal's epilogue: I_c and I_k as exact i32 sums (eight reductions by one
            // transposition), then `s_q * (s * I_c + m * I_k) / sqrt(D)` in f64 per head.
            let half = |v: __m512i| {
                _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
            };
            let g1 = _mm256_hadd_epi32(
                _mm256_hadd_epi32(half(ac[0]), half(ac[1])),
                _mm256_hadd_epi32(half(ac[2]), half(ac[3])),
            );
            let g2 = _mm256_hadd_epi32(
                _mm256_hadd_epi32(half(ak[0]), half(ak[1])),
                _mm256_hadd_epi32(half(ak[2]), half(ak[3])),
            );
            let ic = _mm_add_epi32(
                _mm256_castsi256_si128(g1),
                _mm256_extracti128_si256::<1>(g1),
            );
            let ik = _mm_add_epi32(
                _mm256_castsi256_si128(g2),
                _mm256_extracti128_si256::<1>(g2),
            );
            // Four heads at once in f64: the products s * I_c and m * I_k are exact (an f16
            // times an integer below 2^24), so their sum rounds once however it is formed.
            let m64 = _mm256_set1_pd(f64::from(_mm_cvtss_f32(ms)));
            let s64 = _mm256_set1_pd(f64::from(_mm_cvtss_f32(_mm_movehdup_ps(ms))));
            let sum = _mm256_fmadd_pd(
                s64,
                _mm256_cvtepi32_pd(ic),
                _mm256_mul_pd(m64, _mm256_cvtepi32_pd(ik)),
            );
            let z = _mm256_mul_pd(_mm256_mul_pd(qs64, sum), scale64);
            _mm_storeu_ps(lanes4.as_mut_ptr(), _mm256_cvtpd_ps(z));
            for h in 0..4 {
                out[h * TILE + t] = lanes4[h];
            }
        } else {
            // Per lane s * codes-sum + m * kept-sum in f32, then one float reduction per head.
            let (m, s) = (
                _mm512_broadcastss_ps(ms),
                _mm512_broadcastss_ps(_mm_movehdup_ps(ms)),
            );
            for h in 0..4 {
                let f = _mm512_fmadd_ps(
                    s,
                    _mm512_cvtepi32_ps(ac[h]),
                    _mm512_mul_ps(m, _mm512_cvtepi32_ps(ak[h])),
                );
                out[h * TILE + t] = scale * qscale[h] * _mm512_reduce_add_ps(f);
            }
        }
    }
}

fn speed() {
    let path = Path::detect();
    let layout = RecordLayout {
        head_dim: D,
        kept_dims: D,
        r: 80,
        group_size: 1,
        dtype: ValueDtype::Int8,
    };
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let rows: Vec<f64> = (0..TILE * D)
        .map(|_| (rnd() % 10_000) as f64 / 1250.0 - 4.0)
        .collect();
    let keys = pack_rotated(&rows, D, &layout).expect("pack").bytes;
    let q: Vec<f32> = (0..4 * D)
        .map(|i| ((i * 7) % 11) as f32 * 0.1 - 0.5)
        .collect();
    let mut lg = vec![0f32; 4 * TILE];
    let reps = 200_000;
    let time = |label: &str, f: &mut dyn FnMut()| {
        f();
        let t = Instant::now();
        for _ in 0..reps {
            f();
        }
        let ns = t.elapsed().as_secs_f64() * 1e9 / (reps * TILE) as f64;
        println!("| {label} | {ns:.2} |");
        ns
    };
    println!("speed: {path:?} path, one thread, {TILE} L1-resident records, 4 query heads");
    println!("| kernel | ns per record |");
    println!("|---|---:|");
    if path.fused_keys_q(&layout) {
        time(
            "f32 query, records decoded in registers (`tile_logits_q`, today)",
            &mut || {
                path.tile_logits_q(&q, 4, D, &keys, &layout, TILE, 0.1, &mut lg);
                black_box(&lg);
            },
        );
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512vnni") && std::is_x86_feature_detected!("avx512vbmi2") {
        let mut q8 = vec![0i8; 4 * D];
        let mut qscale = [0f32; 4];
        for h in 0..4 {
            let amax = q[h * D..(h + 1) * D]
                .iter()
                .fold(0f32, |a, &x| a.max(x.abs()));
            qscale[h] = amax / 127.0;
            for d in 0..D {
                q8[h * D + d] = (q[h * D + d] / qscale[h]).round() as i8;
            }
        }
        let mut lq = vec![0f32; 4 * TILE];
        time(
            "int8 query, `vpdpbusd` on the codes, f32 epilogue (probe)",
            &mut || {
                // SAFETY: AVX-512 VNNI/VBMI2 detected above; 16 records of the layout.
                unsafe {
                    int8_query_logits::<false>(&q8, &qscale, &keys, &layout, TILE, 0.1, &mut lq)
                };
                black_box(&lq);
            },
        );
        let mut lx = vec![0f32; 4 * TILE];
        time(
            "int8 query, `vpdpbusd` on the codes, exact i32 sums + f64 epilogue (probe)",
            &mut || {
                // SAFETY: as above.
                unsafe {
                    int8_query_logits::<true>(&q8, &qscale, &keys, &layout, TILE, 0.1, &mut lx)
                };
                black_box(&lx);
            },
        );
        let apart = lq
            .iter()
            .zip(&lx)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!("the two epilogues: max |difference| {apart:.2e}");
        // The two agree to the query's quantization (a check of the probe kernel itself).
        let worst = lg
            .iter()
            .zip(&lq)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let big = lg.iter().fold(0f32, |a, x| a.max(x.abs()));
        println!(
            "probe kernel vs f32 kernel: max |difference| {worst:.4} (largest logit {big:.3})"
        );
    }
}

fn main() {
    speed();
    accuracy(4096);
}
