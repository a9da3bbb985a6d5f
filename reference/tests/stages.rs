//! Stage-by-stage tests of the reference (SPEC.md sections 3-8).

mod common;

use common::{identity_side, random_rows, rng};
use half::f16;
use mosaickv_reference::round::f16_from_f64;
use mosaickv_reference::synthetic::structured_kv;
use mosaickv_reference::topr::rotate_row_f64;
use mosaickv_reference::{fit_rotation_f64, ReferenceBackend};
use mosaickv_spec::layout::{bitmap_bit, bitmap_word, record_value};
use mosaickv_spec::{Backend, BlockMeta, ChannelPolicy, CompressConfig, MosaicError, Side};
use ndarray::{s, Array2};
use rand::Rng;

/// `max |R^T R - I|` of an f64 matrix.
fn orthogonality_error(r: &Array2<f64>) -> f64 {
    let d = r.nrows();
    let mut worst = 0.0f64;
    for a in 0..d {
        for b in 0..d {
            let mut dot = 0.0;
            for i in 0..d {
                dot += r[[i, a]] * r[[i, b]];
            }
            let want = if a == b { 1.0 } else { 0.0 };
            worst = worst.max((dot - want).abs());
        }
    }
    worst
}

/// SPEC.md 3 step 3: the component of largest magnitude (lowest index on ties) is positive.
fn assert_sign_rule(r: &Array2<f64>) {
    let d = r.nrows();
    for j in 0..d {
        let mut lead = 0;
        for i in 1..d {
            if r[[i, j]].abs() > r[[lead, j]].abs() {
                lead = i;
            }
        }
        assert!(
            r[[lead, j]] > 0.0,
            "column {j}: leading component {} not positive",
            r[[lead, j]]
        );
    }
}

#[test]
fn rotations_are_orthogonal_sorted_and_signed() {
    for &d in &[8usize, 64, 80, 128, 256] {
        let n = 300;
        let random = random_rows(n, d, 1.0, d as u64);
        let (k, _) = structured_kv(n, 1, d, 7 + d as u64);
        let structured = k.slice(s![.., 0, ..]).to_owned();
        // Rank-deficient rows (n < D for 256) exercise repeated zero eigenvalues.
        for rows in [random, structured] {
            let r = fit_rotation_f64(rows.view());
            let err = orthogonality_error(&r);
            assert!(err < 1e-9, "D={d}: |R^T R - I|_max = {err:e}");
            assert_sign_rule(&r);
            // Eigenvalues descending: the energy of the rows along column j, ||X r_j||^2.
            let energy: Vec<f64> = (0..d)
                .map(|j| {
                    rows.rows()
                        .into_iter()
                        .map(|x| {
                            let p: f64 = (0..d).map(|i| f64::from(x[i]) * r[[i, j]]).sum();
                            p * p
                        })
                        .sum()
                })
                .collect();
            for j in 1..d {
                assert!(
                    energy[j] <= energy[j - 1] * (1.0 + 1e-9) + 1e-9,
                    "D={d}: energies not descending at {j}"
                );
            }
        }
    }
}

#[test]
fn zero_and_empty_rows_give_identity() {
    for &d in &[4usize, 80] {
        let zeros = Array2::<f32>::zeros((10, d));
        let empty = Array2::<f32>::zeros((0, d));
        for rows in [zeros, empty] {
            let r = fit_rotation_f64(rows.view());
            assert_eq!(r, Array2::<f64>::eye(d));
        }
    }
}

#[test]
fn records_have_popcount_r_over_g_and_round_trip() {
    let b = ReferenceBackend;
    for &(d, g, retention, trunc) in &[
        (64usize, 1usize, 0.25, 0.25),
        (80, 2, 0.375, 0.25),
        (128, 4, 0.5, 0.0),
        (256, 1, 0.125, 0.25),
    ] {
        let cfg = CompressConfig {
            truncate_fraction: trunc,
            channels: ChannelPolicy::Fixed {
                retention,
                group_size: g,
            },
            ..CompressConfig::default()
        };
        let (k, _) = structured_kv(100, 1, d, d as u64);
        let rows = k.slice(s![.., 0, ..]).to_owned();
        let side = b.fit_side(rows.view(), Side::Key, &cfg).unwrap();
        let l = side.layout;
        assert_eq!(l.r % g, 0);
        let packed = b.encode(rows.view(), &side).unwrap();
        let decoded = b.decode(&packed, &side).unwrap();
        assert_eq!(decoded.shape(), &[100, l.kept_dims]);
        for t in 0..100 {
            let rec = packed.record(&l, t);
            let ones: u32 = (0..l.bitmap_words())
                .map(|w| bitmap_word(&l, rec, w).count_ones())
                .sum();
            assert_eq!(ones as usize, l.r / g, "popcount");
            let x: Vec<f32> = rows.row(t).to_vec();
            let rotated = rotate_row_f64(&x, &side.rotation);
            // Values in ascending dim order, equal to f16(rotated) at kept dims, 0 elsewhere.
            let mut next = 0;
            for grp in 0..l.groups() {
                let kept = bitmap_bit(rec, grp);
                for j in grp * g..(grp + 1) * g {
                    if kept {
                        let want = f16_from_f64(rotated[j]);
                        assert_eq!(record_value(&l, rec, next), want);
                        assert_eq!(decoded[[t, j]], want.to_f32());
                        next += 1;
                    } else {
                        assert_eq!(decoded[[t, j]], 0.0);
                    }
                }
            }
            assert_eq!(next, l.r);
            // Kept groups have importance >= every dropped group's.
            let imp = |grp: usize| -> f32 {
                (grp * g..(grp + 1) * g)
                    .map(|j| f16_from_f64(rotated[j]).to_f32().powi(2))
                    .sum()
            };
            let (mut lo_kept, mut hi_dropped) = (f32::INFINITY, f32::NEG_INFINITY);
            for grp in 0..l.groups() {
                if bitmap_bit(rec, grp) {
                    lo_kept = lo_kept.min(imp(grp));
                } else {
                    hi_dropped = hi_dropped.max(imp(grp));
                }
            }
            assert!(lo_kept >= hi_dropped);
        }
    }
}

#[test]
fn top_r_ties_keep_the_lower_group() {
    // D = 8, g = 2, r = 4 (2 groups of 4), identity rotation.
    // Group importances: g0 = 1+1 = 2, g1 = 0, g2 = 1+1 = 2, g3 = 4.
    // g3 is kept; g0 and g2 tie, the lower index g0 wins.
    let side = identity_side(8, 8, 4, 2);
    let rows =
        Array2::from_shape_vec((1, 8), vec![1.0, 1.0, 0.0, 0.0, 1.0, -1.0, 2.0, 0.0]).unwrap();
    let packed = ReferenceBackend.encode(rows.view(), &side).unwrap();
    let rec = packed.record(&side.layout, 0);
    assert_eq!(bitmap_word(&side.layout, rec, 0), 0b1001);
    let vals: Vec<f32> = (0..4)
        .map(|i| record_value(&side.layout, rec, i).to_f32())
        .collect();
    assert_eq!(vals, vec![1.0, 1.0, 2.0, 0.0]);
    assert_eq!(rec.len(), 12); // 4 B bitmap + 8 B values
                               // g = 1, all equal magnitudes: the lowest r dims are kept.
    let side = identity_side(8, 8, 3, 1);
    let rows =
        Array2::from_shape_vec((1, 8), vec![-2.0, 2.0, 2.0, -2.0, 2.0, 2.0, 2.0, 2.0]).unwrap();
    let packed = ReferenceBackend.encode(rows.view(), &side).unwrap();
    assert_eq!(
        bitmap_word(&side.layout, packed.record(&side.layout, 0), 0),
        0b111
    );
}

#[test]
fn record_layout_matches_spec_examples() {
    // SPEC.md 6: D = 80, Dt = 60, r = 9 -> 8 + 18 = 26 -> 28 bytes, zero padded.
    let side = identity_side(80, 60, 9, 1);
    let rows = random_rows(3, 80, 1.0, 5);
    let packed = ReferenceBackend.encode(rows.view(), &side).unwrap();
    assert_eq!(packed.bytes.len(), 3 * 28);
    for t in 0..3 {
        assert_eq!(&packed.record(&side.layout, t)[26..], &[0, 0]);
    }
    // D = 128, Dt = 96, r = 32 (the paper's shape): 12 B bitmap (3 u32 words) + 64 B values.
    let side = identity_side(128, 96, 32, 1);
    let packed = ReferenceBackend
        .encode(random_rows(2, 128, 1.0, 6).view(), &side)
        .unwrap();
    assert_eq!(packed.bytes.len(), 2 * 76);
}

#[test]
fn corrupted_records_are_rejected() {
    let b = ReferenceBackend;
    let side = identity_side(64, 48, 16, 1);
    let rows = random_rows(4, 64, 1.0, 9);
    let good = b.encode(rows.view(), &side).unwrap();
    assert!(b.decode(&good, &side).is_ok());
    let is_corrupt =
        |r: mosaickv_spec::Result<Array2<f32>>| matches!(r, Err(MosaicError::CorruptPacked(_)));
    // A cleared bitmap bit: popcount 15.
    let mut bad = good.clone();
    let word = bitmap_word(&side.layout, bad.record(&side.layout, 1), 0);
    let first = word.trailing_zeros() as usize;
    bad.bytes[40 + first / 8] ^= 1 << (first % 8);
    assert!(is_corrupt(b.decode(&bad, &side)));
    // A bit past group Dt/g = 48.
    let mut bad = good.clone();
    bad.bytes[2 * 40 + 7] |= 0x80;
    assert!(is_corrupt(b.decode(&bad, &side)));
    // Truncated bytes.
    let mut bad = good.clone();
    bad.bytes.pop();
    assert!(is_corrupt(b.decode(&bad, &side)));
    // A non-finite stored value is NonFinite.
    let mut bad = good.clone();
    let inf = f16::INFINITY.to_le_bytes();
    bad.bytes[8] = inf[0];
    bad.bytes[9] = inf[1];
    assert!(matches!(
        b.decode(&bad, &side),
        Err(MosaicError::NonFinite { .. })
    ));
    // With padding: D = 80, Dt = 60, r = 10 -> 4 bytes of padding.
    let side = identity_side(80, 60, 10, 1);
    let mut bad = b.encode(random_rows(2, 80, 1.0, 3).view(), &side).unwrap();
    bad.bytes[31] = 1;
    assert!(is_corrupt(b.decode(&bad, &side)));
}

#[test]
fn block_score_bounds_every_key_of_its_block() {
    let b = ReferenceBackend;
    let mut r = rng(42);
    for case in 0..12 {
        let d = [16usize, 64, 80][case % 3];
        let n = 1 + r.gen_range(0..200);
        let block = [1usize, 16, 32, 7][case % 4];
        let cfg = CompressConfig::default();
        let (k, _) = structured_kv(n, 1, d, case as u64);
        let rows = if case % 2 == 0 {
            k.slice(s![.., 0, ..]).to_owned()
        } else {
            random_rows(n, d, 3.0, case as u64)
        };
        let side = b.fit_side(rows.view(), Side::Key, &cfg).unwrap();
        let packed = b.encode(rows.view(), &side).unwrap();
        let meta: BlockMeta = b.block_meta(&packed, &side, block).unwrap();
        let decoded = b.decode(&packed, &side).unwrap();
        let queries = random_rows(3, d, 2.0, 100 + case as u64);
        let rq = b.rotate_queries(queries.view(), &side).unwrap();
        let scores = b.score_blocks(&meta, rq.view()).unwrap();
        assert_eq!(scores.len(), n.div_ceil(block));
        assert_eq!(meta.scale.len(), scores.len());
        for (blk, &score) in scores.iter().enumerate() {
            let sc = f64::from(meta.scale[blk]);
            for t in blk * block..((blk + 1) * block).min(n) {
                // Section 7: the int8 bounds times the block scale enclose every decoded value.
                for j in 0..meta.kept_dims {
                    let x = f64::from(decoded[[t, j]]);
                    let (lo, hi) = (
                        meta.min[blk * meta.kept_dims + j],
                        meta.max[blk * meta.kept_dims + j],
                    );
                    assert!(
                        f64::from(lo) * sc <= x && x <= f64::from(hi) * sc,
                        "case {case} block {blk} token {t} dim {j}"
                    );
                }
                for m in 0..3 {
                    let mut dot = 0.0f64;
                    let mut mag = 0.0f64;
                    for j in 0..meta.kept_dims {
                        let p = f64::from(rq[[m, j]]) * f64::from(decoded[[t, j]]);
                        dot += p;
                        mag += p.abs();
                    }
                    // f32 rounding of the score: allow 1e-6 of the terms' magnitude.
                    assert!(
                        dot <= f64::from(score) + 1e-6 * mag + 1e-30,
                        "case {case} block {blk} token {t}: {dot} > {score}"
                    );
                }
            }
        }
    }
}

#[test]
fn top_k_ties_and_budget() {
    let b = ReferenceBackend;
    let lens = [16usize; 4];
    // Blocks 1 and 2 tie at 3.0: block 1 (lower index) is taken first.
    assert_eq!(
        b.select_blocks(&[1.0, 3.0, 3.0, 2.0], &lens, 16).unwrap(),
        vec![1]
    );
    assert_eq!(
        b.select_blocks(&[1.0, 3.0, 3.0, 2.0], &lens, 17).unwrap(),
        vec![1, 2]
    );
    assert_eq!(
        b.select_blocks(&[1.0, 3.0, 3.0, 2.0], &lens, 33).unwrap(),
        vec![1, 2, 3]
    );
    assert_eq!(b.select_blocks(&[5.0; 4], &lens, 20).unwrap(), vec![0, 1]);
    assert_eq!(
        b.select_blocks(&[5.0; 4], &lens, 0).unwrap(),
        Vec::<u32>::new()
    );
    // Variable block lengths: taken while fewer than B tokens are taken (overshoot < one block).
    assert_eq!(
        b.select_blocks(&[5.0, 4.0, 3.0, 2.0], &[16, 64, 32, 16], 20)
            .unwrap(),
        vec![0, 1]
    );
    assert_eq!(
        b.select_blocks(&[2.0, 4.0, 3.0, 5.0], &[16, 64, 32, 16], 16)
            .unwrap(),
        vec![3]
    );
    assert_eq!(
        b.select_blocks(&[2.0, 4.0, 3.0, 5.0], &[16, 64, 32, 16], 17)
            .unwrap(),
        vec![1, 3]
    );
    // A budget above the total takes everything.
    assert_eq!(
        b.select_blocks(&[1.0, 2.0], &[3, 5], 100).unwrap(),
        vec![0, 1]
    );
    // Bad input.
    assert!(matches!(
        b.select_blocks(&[1.0], &[1, 2], 1),
        Err(MosaicError::ShapeMismatch { .. })
    ));
    assert!(matches!(
        b.select_blocks(&[f32::NAN], &[1], 1),
        Err(MosaicError::NonFinite { .. })
    ));
    // Property: taken >= min(B, total), and dropping the last-taken block leaves < B.
    let mut r = rng(3);
    for _ in 0..200 {
        let nb = 1 + r.gen_range(0..20);
        let scores: Vec<f32> = (0..nb).map(|_| r.gen_range(0..4) as f32).collect();
        let lens: Vec<usize> = (0..nb)
            .map(|_| [16, 32, 64, 5][r.gen_range(0..4)])
            .collect();
        let total: usize = lens.iter().sum();
        let budget = r.gen_range(0..total + 10);
        let chosen = b.select_blocks(&scores, &lens, budget).unwrap();
        let taken: usize = chosen.iter().map(|&i| lens[i as usize]).sum();
        assert!(taken >= budget.min(total));
        assert!(chosen.windows(2).all(|w| w[0] < w[1]));
        // The last block taken (lowest score, highest index among equals) was
        // taken while fewer than B tokens were taken: overshoot < one block.
        if let Some(&last) = chosen.iter().min_by(|&&a, &&b| {
            scores[a as usize]
                .total_cmp(&scores[b as usize])
                .then(b.cmp(&a))
        }) {
            assert!(
                taken - lens[last as usize] < budget,
                "taken {taken}, last block {last}, budget {budget}"
            );
        }
        // Every unchosen block scores <= every chosen block (ties: unchosen has the higher index).
        for u in 0..nb as u32 {
            if chosen.contains(&u) {
                continue;
            }
            for &c in &chosen {
                let (su, sc) = (scores[u as usize], scores[c as usize]);
                assert!(
                    su < sc || (su == sc && u > c),
                    "unchosen {u} beats chosen {c}"
                );
            }
        }
    }
}
