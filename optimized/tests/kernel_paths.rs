//! Every SIMD kernel path against the portable one, on the inputs where the
//! paths differ most: odd `Dt` (16- and 32-lane tails), 1..9 blocks (the
//! AVX-512 score runs 4 blocks per pass plus single-block tails), GQA groups
//! 1..8 (heads in groups of 4). A path this CPU lacks is reported and skipped.

use half::f16;
use mosaickv_optimized::simd::{avx2_available, avx512_available, Path};
use mosaickv_spec::layout::{write_quantized, QuantParams};
use mosaickv_spec::{PackedRows, RecordLayout, ValueDtype};

fn paths() -> Vec<Path> {
    let mut p = Vec::new();
    if avx2_available() {
        p.push(Path::Avx2);
    } else {
        eprintln!("SKIPPED kernel_paths avx2: CPU lacks avx2/fma/f16c");
    }
    if avx512_available() {
        p.push(Path::Avx512);
    } else {
        eprintln!("SKIPPED kernel_paths avx512: CPU lacks avx512f/bw/vl/vbmi2");
    }
    p
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// Valid g = 1 records (SPEC.md section 6): `r` of `dt` bits set, f16 values, zero padding.
fn records(rng: &mut Rng, n: usize, dt: usize, r: usize) -> (Vec<u8>, usize, usize) {
    let bb = 4 * dt.div_ceil(32);
    let rb = (bb + 2 * r).div_ceil(4) * 4;
    let mut bytes = vec![0u8; n * rb];
    for t in 0..n {
        let mut kept = vec![false; dt];
        let mut set = 0;
        while set < r {
            let d = rng.below(dt);
            if !kept[d] {
                kept[d] = true;
                set += 1;
            }
        }
        for (d, _) in kept.iter().enumerate().filter(|(_, &k)| k) {
            bytes[t * rb + d / 8] |= 1 << (d % 8);
        }
        for k in 0..r {
            let h = f16::from_f32(4.0 * rng.unit()).to_bits().to_le_bytes();
            bytes[t * rb + bb + 2 * k..t * rb + bb + 2 * k + 2].copy_from_slice(&h);
        }
    }
    (bytes, bb, rb)
}

#[test]
fn expansion_is_bit_identical_on_every_path() {
    let mut rng = Rng(0x5eed_1234_abcd_ef01);
    for path in paths() {
        for dt in [
            8usize, 24, 40, 48, 60, 64, 72, 96, 100, 128, 160, 192, 250, 256,
        ] {
            for r in [0, 1, dt / 4, dt / 2, dt - 1, dt] {
                let n = 1 + rng.below(16);
                let (bytes, bb, rb) = records(&mut rng, n, dt, r);
                let dp = dt.div_ceil(8) * 8;
                let mut want = vec![f32::NAN; n * dp];
                let mut got = vec![f32::NAN; n * dp];
                Path::Portable.expand_records(&bytes, 0, n, rb, bb, 1, dt, r, dp, &mut want);
                path.expand_records(&bytes, 0, n, rb, bb, 1, dt, r, dp, &mut got);
                let same = want
                    .iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{path:?} dt {dt} r {r} n {n}: expansion differs");
            }
        }
    }
}

/// Valid g = 1 int8/int4 records of `layout` (SPEC.md section 6): r bits set, a random
/// minimum and scale (zero sometimes), random codes, zero padding.
fn quant_records(rng: &mut Rng, n: usize, layout: &RecordLayout) -> Vec<u8> {
    let (dt, r, rb, bb) = (
        layout.kept_dims,
        layout.r,
        layout.record_bytes(),
        layout.bitmap_bytes(),
    );
    let mut bytes = vec![0u8; n * rb];
    for rec in bytes.chunks_exact_mut(rb) {
        let mut kept = vec![false; dt];
        let mut set = 0;
        while set < r {
            let d = rng.below(dt);
            if !kept[d] {
                kept[d] = true;
                set += 1;
            }
        }
        for (d, _) in kept.iter().enumerate().filter(|(_, &k)| k) {
            rec[d / 8] |= 1 << (d % 8);
        }
        let zero = rng.below(8) == 0;
        let p = QuantParams {
            min: f16::from_f32(30.0 * rng.unit()),
            scale: if zero {
                f16::ZERO
            } else {
                f16::from_f32(rng.unit().abs() + 1e-3)
            },
        };
        let q = layout.dtype.qmax() as usize + 1;
        let codes: Vec<u8> = (0..r)
            .map(|_| if zero { 0 } else { rng.below(q) as u8 })
            .collect();
        write_quantized(layout.dtype, p, &codes, &mut rec[bb..]);
    }
    bytes
}

#[test]
fn quantized_expansion_is_bit_identical_on_every_path() {
    let mut rng = Rng(0x0123_4567_89ab_cdef);
    for path in paths() {
        for dtype in [ValueDtype::Int8, ValueDtype::Int4] {
            for dt in [
                8usize, 24, 40, 48, 60, 64, 72, 96, 100, 128, 160, 192, 250, 256,
            ] {
                for r in [1, 2, dt / 4, dt / 2 + 1, dt - 1, dt] {
                    let r = r.max(1);
                    let layout = RecordLayout {
                        head_dim: dt,
                        kept_dims: dt,
                        r,
                        group_size: 1,
                        dtype,
                        code_bits: 0,
                    };
                    let n = 1 + rng.below(16);
                    let bytes = quant_records(&mut rng, n, &layout);
                    PackedRows {
                        count: n,
                        bytes: bytes.clone(),
                    }
                    .validate(&layout)
                    .unwrap();
                    for dp in [dt.div_ceil(8) * 8, dt.div_ceil(8) * 8 + 8] {
                        let mut want = vec![f32::NAN; n * dp];
                        let mut got = vec![f32::NAN; n * dp];
                        Path::Portable.expand_records_q(&bytes, n, &layout, dp, &mut want);
                        path.expand_records_q(&bytes, n, &layout, dp, &mut got);
                        let same = want
                            .iter()
                            .zip(&got)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "{path:?} {dtype:?} dt {dt} r {r} n {n} dp {dp}: expansion differs"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn scores_agree_with_portable_within_score_rel() {
    let mut rng = Rng(0x0dd_ba11_5eed_0001);
    for path in paths() {
        for dt in [8usize, 16, 24, 40, 48, 60, 96, 100, 128, 256] {
            for g in [1, 2, 3, 4, 5, 8] {
                for blocks in 1..10 {
                    let stride = dt.div_ceil(8) * 8;
                    let q: Vec<f32> = (0..g * stride).map(|_| rng.unit()).collect();
                    // Bounds in [-127, 127] with min <= max: both positive, both negative, or
                    // straddling zero (the AVX-512 kernel's W uses max(|M|, |m|) = max(M, -m)).
                    let mx: Vec<i8> = (0..blocks * dt)
                        .map(|_| (rng.below(255) as i16 - 127) as i8)
                        .collect();
                    let mn: Vec<i8> = mx
                        .iter()
                        .map(|&m| (m as i16 - rng.below(64) as i16).max(-127) as i8)
                        .collect();
                    let scale: Vec<f32> = (0..blocks).map(|_| rng.unit().abs() * 0.01).collect();
                    let mut want = vec![f32::NAN; blocks];
                    let mut got = vec![f32::NAN; blocks];
                    Path::Portable.score_blocks(&q, g, stride, dt, &mn, &mx, &scale, &mut want);
                    path.score_blocks(&q, g, stride, dt, &mn, &mx, &scale, &mut got);
                    // f16 pages: Quest's bound on the same numbers.
                    let fx: Vec<f16> = mx.iter().map(|&x| f16::from_f32(x as f32 / 64.0)).collect();
                    let fn_: Vec<f16> =
                        mn.iter().map(|&x| f16::from_f32(x as f32 / 64.0)).collect();
                    let mut pwant = vec![f32::NAN; blocks];
                    let mut pgot = vec![f32::NAN; blocks];
                    Path::Portable.score_pages_f16(&q, g, stride, dt, &fn_, &fx, &mut pwant);
                    path.score_pages_f16(&q, g, stride, dt, &fn_, &fx, &mut pgot);
                    for b in 0..blocks {
                        // Scale of the sum: sum_j |q_j| max(|M_j|, |m_j|), max over heads (the page tolerance's base).
                        let base = |s: f32, div: f32| {
                            (0..g)
                                .map(|h| {
                                    (0..dt)
                                        .map(|j| {
                                            let m = (mx[b * dt + j] as f32)
                                                .abs()
                                                .max((mn[b * dt + j] as f32).abs());
                                            (q[h * stride + j] * m / div).abs()
                                        })
                                        .sum::<f32>()
                                })
                                .fold(0f32, f32::max)
                                * s
                        };
                        // MosaicKV's block scores are integer sums and the same f32 products
                        // on every path (SPEC 8.2): bit-identical.
                        assert!(
                            want[b].to_bits() == got[b].to_bits(),
                            "{path:?} dt {dt} g {g} blocks {blocks} block {b}: score {} vs portable {}",
                            got[b],
                            want[b]
                        );
                        let ptol = 6e-5 * base(1.0, 64.0) + 1e-30;
                        assert!(
                            (pwant[b] - pgot[b]).abs() <= ptol,
                            "{path:?} dt {dt} g {g} blocks {blocks} page {b}: score {} vs portable {}",
                            pgot[b],
                            pwant[b]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn rotated_queries_are_bit_identical_on_every_path() {
    // SPEC 8.1 on the stored f16 rotation: out[h][j] = f32(sum_i f64(R[i][j]) * f64(q_h[i])),
    // the sum over ascending i, product then sum (an f64 FMA rounds the same: the product of
    // two f32 values is exact). Every path, every row count (the SIMD kernels take rows in
    // passes of four or two), head dims past 256 (the f64 query copies then go to the heap),
    // and nothing written past dt.
    let mut rng = Rng(0x0f16_0f16_5eed_0001);
    for path in [Path::Portable].into_iter().chain(paths()) {
        for (d, dt) in [
            (32usize, 24usize),
            (64, 48),
            (64, 64),
            (80, 60),
            (128, 96),
            (128, 100),
            (128, 128),
            (256, 250),
            (300, 33),
            (320, 320),
        ] {
            for g in [1usize, 2, 3, 4, 5, 8] {
                let stride = dt.div_ceil(8) * 8 + 8;
                let rot: Vec<f16> = (0..d * dt).map(|_| f16::from_f32(rng.unit())).collect();
                let q: Vec<f32> = (0..g * d).map(|_| 3.0 * rng.unit()).collect();
                let mut got = vec![f32::NAN; g * stride];
                path.rotate_queries(&rot, d, &q, g, &mut got, stride);
                for h in 0..g {
                    for j in 0..dt {
                        let mut s = 0f64;
                        for i in 0..d {
                            s += f64::from(rot[i * dt + j].to_f32()) * f64::from(q[h * d + i]);
                        }
                        assert_eq!(
                            got[h * stride + j].to_bits(),
                            (s as f32).to_bits(),
                            "{path:?} d {d} dt {dt} g {g} row {h} j {j}"
                        );
                    }
                    assert!(got[h * stride + dt..(h + 1) * stride]
                        .iter()
                        .all(|x| x.is_nan()));
                }
            }
        }
    }
}

#[test]
fn back_rotation_from_the_f16_rotation_matches_dots_on_the_widened_one() {
    // SPEC 9's back-rotation: `back_rotate_f16` (f16 rows read in place on the SIMD paths)
    // adds to each output exactly what `Path::dot` on the widened row gives, bit for bit.
    let mut rng = Rng(0xbac0_0f16_5eed_0002);
    for path in [Path::Portable].into_iter().chain(paths()) {
        for (d, dt) in [
            (32usize, 24usize),
            (64, 64),
            (80, 60),
            (128, 100),
            (128, 128),
            (64, 13),
        ] {
            for g in [1usize, 2, 3, 4, 5, 7, 8] {
                let (as_, os) = (dt.div_ceil(8) * 8 + 8, d.div_ceil(8) * 8);
                let rot: Vec<f16> = (0..d * dt).map(|_| f16::from_f32(rng.unit())).collect();
                let wide: Vec<f32> = rot.iter().map(|x| x.to_f32()).collect();
                let acc: Vec<f32> = (0..g * as_).map(|_| 3.0 * rng.unit()).collect();
                let start: Vec<f32> = (0..g * os).map(|_| rng.unit()).collect();
                let mut got = start.clone();
                path.back_rotate_f16(&rot, d, &acc, as_, g, &mut got, os, &mut Vec::new());
                for k in 0..g {
                    for i in 0..d {
                        let want = start[k * os + i]
                            + path.dot(&wide[i * dt..(i + 1) * dt], &acc[k * as_..k * as_ + dt]);
                        assert_eq!(
                            got[k * os + i].to_bits(),
                            want.to_bits(),
                            "{path:?} d {d} dt {dt} g {g} head {k} row {i}"
                        );
                    }
                    // past d nothing written
                    assert_eq!(
                        &got[k * os + d..(k + 1) * os],
                        &start[k * os + d..(k + 1) * os]
                    );
                }
            }
        }
    }
}

/// `m`, `l`, acc rows and logits of a partial state after some tiles.
fn softmax_state(
    rng: &mut Rng,
    g: usize,
    dp: usize,
    fresh: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let m: Vec<f32> = (0..g)
        .map(|h| {
            if fresh || h % 3 == 2 {
                f32::NEG_INFINITY
            } else {
                4.0 * rng.unit()
            }
        })
        .collect();
    let l: Vec<f32> = m
        .iter()
        .map(|x| {
            if x.is_finite() {
                1.0 + rng.unit().abs()
            } else {
                0.0
            }
        })
        .collect();
    let acc: Vec<f32> = (0..g * dp)
        .map(|i| {
            if m[i / dp].is_finite() {
                rng.unit()
            } else {
                0.0
            }
        })
        .collect();
    (m, l, acc)
}

#[test]
fn fused_value_accumulation_matches_expand_then_accumulate() {
    // Path::packed_accumulate (values expanded in registers, accumulators rescaled on load) is
    // bit-identical to the AVX2 sequence it replaces: online-softmax rescale, expansion, tile
    // accumulation. The AVX-512 online softmax (factors out, accumulators untouched) gives the
    // same probabilities and max as the AVX2 online
    // softmax, and the same `l` up to the 16-lane sum's rounding.
    if !avx512_available() {
        eprintln!("SKIPPED fused_value_accumulation: CPU lacks avx512f/bw/vl/vbmi2");
        return;
    }
    let mut rng = Rng(0xf05e_d0ac_c0de_0003);
    for dt in [8usize, 24, 31, 32, 33, 60, 64, 72, 96, 100, 127, 128] {
        for r in [0usize, 1, dt.min(32) / 2, dt.min(32) - 1, dt.min(32)] {
            for g in [1usize, 2, 3, 4, 5, 7, 8] {
                let n = 1 + rng.below(16);
                let dp = dt.div_ceil(8) * 8;
                assert!(Path::Avx512.fused_packed(1, dt, r, dp));
                let (bytes, bb, rb) = records(&mut rng, n, dt, r);
                let fresh = rng.below(4) == 0;
                let (m0, l0, acc0) = softmax_state(&mut rng, g, dp, fresh);
                let logits: Vec<f32> = (0..g * 16).map(|_| 6.0 * rng.unit()).collect();
                // Want: the AVX2 path's online_update on the expanded tile.
                let (mut mw, mut lw, mut accw, mut lgw) =
                    (m0.clone(), l0.clone(), acc0.clone(), logits.clone());
                let mut tile = vec![0f32; n * dp];
                Path::Avx2.expand_records(&bytes, 0, n, rb, bb, 1, dt, r, dp, &mut tile);
                let mut st: Vec<f32> = mw.iter().chain(&lw).chain(&accw).copied().collect();
                mosaickv_optimized::attention::online_update(
                    Path::Avx2,
                    &mut st,
                    g,
                    dp,
                    &mut lgw,
                    n,
                    &tile,
                );
                mw.copy_from_slice(&st[..g]);
                lw.copy_from_slice(&st[g..2 * g]);
                accw.copy_from_slice(&st[2 * g..]);
                // Got: the AVX-512 softmax + packed_accumulate.
                let (mut mg, mut lg_, mut accg, mut lgg) =
                    (m0.clone(), l0.clone(), acc0.clone(), logits.clone());
                let mut corr = vec![f32::NAN; g];
                Path::Avx512.online_softmax(
                    &mut mg,
                    &mut lg_,
                    &mut [],
                    g,
                    dp,
                    &mut lgg,
                    n,
                    Some(&mut corr),
                );
                for h in 0..g {
                    assert_eq!(
                        mg[h].to_bits(),
                        mw[h].to_bits(),
                        "dt {dt} g {g} n {n}: m[{h}]"
                    );
                    let tol = 2e-6 * lw[h].abs();
                    assert!(
                        (lg_[h] - lw[h]).abs() <= tol,
                        "dt {dt} g {g} n {n}: l[{h}] {} vs {}",
                        lg_[h],
                        lw[h]
                    );
                    for t in 0..n {
                        let (a, b) = (lgg[h * 16 + t], lgw[h * 16 + t]);
                        assert_eq!(a.to_bits(), b.to_bits(), "dt {dt} g {g} n {n}: p[{h}][{t}]");
                    }
                }
                Path::Avx512.packed_accumulate(
                    &lgg,
                    g,
                    dp,
                    (&bytes, rb, bb),
                    n,
                    dt,
                    r,
                    &corr,
                    &mut accg,
                );
                for (i, (a, b)) in accg.iter().zip(&accw).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "dt {dt} r {r} g {g} n {n}: acc[{i}] {a} vs {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn online_softmax_paths_agree() {
    // The portable online softmax (scalar fast_exp) against the SIMD one (8-lane polynomial
    // with FMAs): same max, probabilities and rescaled state up to float rounding.
    let mut rng = Rng(0x50f7_3a8c_0000_0007);
    for path in paths() {
        for g in [1usize, 3, 4, 8] {
            for n in [1usize, 5, 15, 16] {
                let dp = 96;
                let fresh = rng.below(4) == 0;
                let (m0, l0, acc0) = softmax_state(&mut rng, g, dp, fresh);
                let logits: Vec<f32> = (0..g * 16).map(|_| 6.0 * rng.unit()).collect();
                let run = |p: Path| {
                    let (mut m, mut l, mut acc, mut lg) =
                        (m0.clone(), l0.clone(), acc0.clone(), logits.clone());
                    p.online_softmax(&mut m, &mut l, &mut acc, g, dp, &mut lg, n, None);
                    (m, l, acc, lg)
                };
                let (mw, lw, aw, pw) = run(Path::Portable);
                let (mg, lgot, ag, pg) = run(path);
                let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 * a.abs().max(b.abs()) + 1e-30;
                for h in 0..g {
                    assert_eq!(
                        mw[h].to_bits(),
                        mg[h].to_bits(),
                        "{path:?} g {g} n {n} m[{h}]"
                    );
                    assert!(close(lw[h], lgot[h]), "{path:?} g {g} n {n} l[{h}]");
                    for t in 0..n {
                        let i = h * 16 + t;
                        assert!(close(pw[i], pg[i]), "{path:?} g {g} n {n} p[{h}][{t}]");
                    }
                }
                for (i, (a, b)) in aw.iter().zip(&ag).enumerate() {
                    assert!(close(*a, *b), "{path:?} g {g} n {n} acc[{i}]");
                }
            }
        }
    }
}

/// Tile logits (f32 tiles and f16 rows) of every path against f64 dot products: `dp` with
/// 16-lane tails (dp % 16 = 8), 0..=16 tokens (4-token passes plus 1..3 tails), 1..9 heads
/// (groups of 4 plus tails). The paths sum in different orders (8 or 16 lanes, then trees), so
/// the bound is relative to `sum |q_j k_j|`: an f32 sum of at most 136 terms is off by at most
/// 136 * 2^-24 = 8.1e-6 of it, under the 1e-5 allowed; a wrong or missing term is far above.
#[test]
fn tile_logits_agree_with_portable() {
    use mosaickv_optimized::simd::TILE;
    let mut rng = Rng(0x7113_0001);
    for path in paths() {
        for dp in [8usize, 16, 24, 40, 96, 104, 128, 136] {
            for g in 1..=9 {
                let q: Vec<f32> = (0..g * dp).map(|_| rng.unit()).collect();
                let rows: Vec<f32> = (0..TILE * dp).map(|_| 4.0 * rng.unit()).collect();
                let rows16: Vec<f16> = rows.iter().map(|&x| f16::from_f32(x)).collect();
                let rows_h: Vec<f32> = rows16.iter().map(|x| x.to_f32()).collect();
                for n in 0..=TILE {
                    for (f16_rows, src) in [(false, &rows), (true, &rows_h)] {
                        let mut got = vec![f32::NAN; g * TILE];
                        if f16_rows {
                            path.tile_logits_f16(&q, g, dp, &rows16, dp, n, 0.5, &mut got);
                        } else {
                            path.tile_logits(&q, g, dp, &rows, n, 0.5, &mut got);
                        }
                        for h in 0..g {
                            for t in 0..n {
                                let (qh, kt) = (&q[h * dp..][..dp], &src[t * dp..][..dp]);
                                let want: f64 =
                                    qh.iter().zip(kt).map(|(&a, &b)| a as f64 * b as f64).sum();
                                let mag: f64 = qh
                                    .iter()
                                    .zip(kt)
                                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                                    .sum();
                                let x = got[h * TILE + t] as f64;
                                assert!(
                                    (x - 0.5 * want).abs() <= 1e-5 * 0.5 * mag + 1e-30,
                                    "{path:?} f16 {f16_rows} dp {dp} g {g} n {n} h {h} t {t}: {x} vs {}",
                                    0.5 * want
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Accumulation of f16 rows (dense and Quest values): the AVX-512 kernel reads the rows in
/// order with every accumulator in registers, the AVX2 one column chunk by column chunk; per
/// lane both run the same FMAs in the same order, so the sums must be bit-identical. Both are
/// also checked against f64 sums (1e-5 of the magnitude sum, 16 terms plus the start value).
#[test]
fn tile_accumulate_f16_paths_agree() {
    use mosaickv_optimized::simd::TILE;
    let ps = paths();
    let mut rng = Rng(0x00ac_cf16_0001);
    for dp in [8usize, 16, 24, 40, 96, 104, 128, 136] {
        for g in 1..=9 {
            let stride = dp + 8 * rng.below(3);
            let rows: Vec<f16> = (0..TILE * stride)
                .map(|_| f16::from_f32(4.0 * rng.unit()))
                .collect();
            let p: Vec<f32> = (0..g * TILE).map(|_| rng.unit().abs()).collect();
            let start: Vec<f32> = (0..g * dp).map(|_| rng.unit()).collect();
            for n in 0..=TILE {
                let mut outs = Vec::new();
                for &path in &ps {
                    let mut acc = start.clone();
                    path.tile_accumulate_f16(&p, g, dp, &rows, stride, n, &mut acc);
                    for h in 0..g {
                        for j in 0..dp {
                            let terms = (0..n)
                                .map(|t| p[h * TILE + t] as f64 * rows[t * stride + j].to_f64());
                            let want = start[h * dp + j] as f64 + terms.clone().sum::<f64>();
                            let mag =
                                (start[h * dp + j] as f64).abs() + terms.map(f64::abs).sum::<f64>();
                            let x = acc[h * dp + j] as f64;
                            assert!(
                                (x - want).abs() <= 1e-5 * mag + 1e-30,
                                "{path:?} dp {dp} g {g} n {n} h {h} j {j}: {x} vs {want}"
                            );
                        }
                    }
                    outs.push((path, acc));
                }
                for w in outs.windows(2) {
                    let same = w[0]
                        .1
                        .iter()
                        .zip(&w[1].1)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{:?} vs {:?}: dp {dp} g {g} n {n} differ",
                        w[0].0, w[1].0
                    );
                }
            }
        }
    }
}

/// The f16 key tile (AVX-512): expansion into halves, then logits widening each row as it is
/// loaded, must give exactly the f32 tile's values and logits (the expanded values are f16, the
/// widening is exact, and the logits kernels share their summation order).
#[test]
fn half_key_tile_matches_f32_tile() {
    use mosaickv_optimized::simd::TILE;
    if !avx512_available() {
        eprintln!("SKIPPED half_key_tile: CPU lacks avx512f/bw/vl/vbmi2");
        return;
    }
    let path = Path::Avx512;
    let mut rng = Rng(0x4a1f_711e_0001);
    let mut checked = 0;
    for dt in [8usize, 31, 32, 33, 60, 64, 96, 100, 128] {
        let dp = 32 * dt.div_ceil(32);
        for r in [0usize, 1, dt.min(32) / 2, dt.min(32)] {
            for g in [1usize, 3, 4, 5, 8] {
                let n = 1 + rng.below(TILE);
                if !path.half_tile(1, dt, r, dp) {
                    continue;
                }
                let (bytes, bb, rb) = records(&mut rng, n, dt, r);
                let q: Vec<f32> = (0..g * dp)
                    .map(|i| if i % dp < dt { rng.unit() } else { 0.0 })
                    .collect();
                let mut tile = vec![f32::NAN; n * dp];
                path.expand_records(&bytes, 0, n, rb, bb, 1, dt, r, dp, &mut tile);
                let mut half = vec![f16::NAN; n * dp];
                path.expand_records_h((&bytes, rb, bb), n, dt, r, dp, &mut half);
                for (i, (a, b)) in tile.iter().zip(&half).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_f32().to_bits(),
                        "dt {dt} r {r}: value {i}"
                    );
                }
                let mut want = vec![f32::NAN; g * TILE];
                let mut got = vec![f32::NAN; g * TILE];
                path.tile_logits(&q, g, dp, &tile, n, 0.3, &mut want);
                path.tile_logits_h(&q, g, dp, &half, n, 0.3, &mut got);
                for h in 0..g {
                    for t in 0..n {
                        let (a, b) = (got[h * TILE + t], want[h * TILE + t]);
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "dt {dt} r {r} g {g} n {n}: [{h}][{t}]"
                        );
                    }
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 50, "only {checked} geometries took the f16 tile");
}
