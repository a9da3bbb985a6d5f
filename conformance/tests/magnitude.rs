//! SPEC.md section 14 on whole caches: finite inputs too large for f16 are refused the same
//! way by every MosaicKV cache (the reference `MosaicCache`, `OptimizedMosaicCache` on each
//! CPU path, `LiveCache` synchronous and asynchronous), in prompt rows, sink rows, buffer
//! rows, and rows whose elements fit f16 but whose norm does not (they could overflow once
//! rotated); and a refused input leaves the cache exactly as it was.

use mosaickv_conformance::{queries, structured_kv};
use mosaickv_optimized::{LiveCache, Mode, OptimizedMosaicCache};
use mosaickv_reference::MosaicCache;
use mosaickv_spec::rules::{ROW_KEY, ROW_KEYS, ROW_VALUE, ROW_VALUES};
use mosaickv_spec::{CompressConfig, KvCache, KvShape, MosaicError};
use ndarray::{s, Array2, Array3, Axis};

fn shape() -> KvShape {
    KvShape::new(2, 4, 32).unwrap()
}

fn config() -> CompressConfig {
    CompressConfig {
        input_segment_len: 64,
        buffer_capacity: 16,
        block_sizes: vec![8, 16],
        max_segment_len: 64,
        min_segment_len: 32,
        ..CompressConfig::default()
    }
}

fn caches() -> Vec<(&'static str, Box<dyn KvCache>)> {
    let (sh, cfg) = (shape(), config());
    vec![
        (
            "reference",
            Box::new(MosaicCache::new(sh, cfg.clone()).unwrap()),
        ),
        (
            "optimized",
            Box::new(OptimizedMosaicCache::new(sh, cfg.clone()).unwrap()),
        ),
        (
            "optimized-portable",
            Box::new(OptimizedMosaicCache::portable(sh, cfg.clone()).unwrap()),
        ),
        (
            "live-sync",
            Box::new(LiveCache::new(sh, cfg.clone(), Mode::Sync).unwrap()),
        ),
        (
            "live-async",
            Box::new(LiveCache::new(sh, cfg, Mode::Async).unwrap()),
        ),
    ]
}

fn nonfinite(what: &'static str, index: usize) -> MosaicError {
    MosaicError::NonFinite { what, index }
}

/// Attention output of every query head for a fixed query (the cache's observable state).
fn attend(c: &mut dyn KvCache, seed: u64) -> Result<Array2<f32>, MosaicError> {
    let sh = c.shape();
    let q = queries(sh.q_heads, sh.head_dim, seed);
    let mut out = Array2::zeros((sh.q_heads, sh.head_dim));
    c.attend(q.view(), out.view_mut())?;
    Ok(out)
}

/// Element `[t, h, i]` of `[tokens, kv, d]` as a flat index.
fn flat(t: usize, h: usize, i: usize) -> usize {
    let sh = shape();
    (t * sh.kv_heads + h) * sh.head_dim + i
}

#[test]
fn prompt_rows_beyond_f16_are_refused_alike() {
    let sh = shape();
    let d = sh.head_dim;
    let (k, v) = structured_kv(200, sh.kv_heads, d, 3);
    type Craft = fn(&mut Array3<f32>, &mut Array3<f32>);
    let cases: Vec<(&str, Craft, MosaicError)> = vec![
        (
            "sink key element 65520",
            |k, _| k[[1, 0, 5]] = 65520.0,
            nonfinite(ROW_KEYS, flat(1, 0, 0)),
        ),
        (
            "sink value element -70000",
            |_, v| v[[2, 1, 0]] = -70000.0,
            nonfinite(ROW_VALUES, flat(2, 1, 0)),
        ),
        (
            "segment key element 65520",
            |k, _| k[[150, 1, 31]] = 65520.0,
            nonfinite(ROW_KEYS, flat(150, 1, 0)),
        ),
        (
            "segment key row of small elements, norm 65534",
            |k, _| k.slice_mut(s![90, 0, ..]).fill(11585.3),
            nonfinite(ROW_KEYS, flat(90, 0, 0)),
        ),
        (
            "segment value row norm past 65472, keys fine",
            |_, v| v.slice_mut(s![120, 1, ..]).fill(-11600.0),
            nonfinite(ROW_VALUES, flat(120, 1, 0)),
        ),
        (
            "keys are checked before values",
            |k, v| {
                v[[3, 0, 0]] = 1e6;
                k[[199, 1, 0]] = 1e6;
            },
            nonfinite(ROW_KEYS, flat(199, 1, 0)),
        ),
    ];
    for (name, craft, expected) in cases {
        let (mut kb, mut vb) = (k.clone(), v.clone());
        craft(&mut kb, &mut vb);
        for (cache_name, mut c) in caches() {
            let e = c.prefill(kb.view(), vb.view());
            assert_eq!(e, Err(expected.clone()), "{name}: {cache_name}");
            assert_eq!(
                c.len(),
                0,
                "{name}: {cache_name} kept tokens after an error"
            );
            // Nothing was stored: the valid prompt still goes in.
            c.prefill(k.view(), v.view())
                .unwrap_or_else(|e| panic!("{name}: {cache_name}: valid prefill after error: {e}"));
            assert_eq!(c.len(), 200);
        }
    }
    // The limit itself: a row of norm exactly 65472 (one element 65472) is stored.
    let (mut kb, vb) = (k.clone(), v.clone());
    kb.slice_mut(s![100, 0, ..]).fill(0.0);
    kb[[100, 0, 7]] = 65472.0;
    for (cache_name, mut c) in caches() {
        c.prefill(kb.view(), vb.view())
            .unwrap_or_else(|e| panic!("{cache_name}: norm 65472 refused: {e}"));
        let out = attend(c.as_mut(), 1).unwrap();
        assert!(out.iter().all(|x| x.is_finite()), "{cache_name}");
    }
}

#[test]
fn appended_rows_beyond_f16_are_refused_alike_and_lose_nothing() {
    let sh = shape();
    let d = sh.head_dim;
    let (k, v) = structured_kv(400, sh.kv_heads, d, 9);
    let mut cs = caches();
    // A short prompt (2 tokens: the sink is not full yet) so that appends reach the sink,
    // the buffer, flushes and segment closes.
    for (_, c) in cs.iter_mut() {
        c.prefill(k.slice(s![..2, .., ..]), v.slice(s![..2, .., ..]))
            .unwrap();
    }
    let bad_key = |t: usize| {
        let mut x = k.index_axis(Axis(0), t).to_owned();
        x[[1, 3]] = 65520.0;
        x
    };
    let bad_value_norm = |t: usize| {
        let mut x = v.index_axis(Axis(0), t).to_owned();
        x.slice_mut(s![0, ..]).fill(11600.0); // elements fit f16, the norm does not
        x
    };
    let mut before: Vec<Array2<f32>> = Vec::new();
    for t in 2..400 {
        // Every 7th step (the sink at t = 2, then buffer positions and flush points), first
        // try a bad key and a bad value: every cache refuses them the same way, unchanged.
        if t % 7 == 2 || t % 16 == 0 {
            before.clear();
            for (_, c) in cs.iter_mut() {
                before.push(attend(c.as_mut(), t as u64).unwrap());
            }
            for (i, (name, c)) in cs.iter_mut().enumerate() {
                let len = c.len();
                let e = c.append(bad_key(t).view(), v.index_axis(Axis(0), t));
                assert_eq!(e, Err(nonfinite(ROW_KEY, d)), "{name} at {t}");
                let e = c.append(k.index_axis(Axis(0), t), bad_value_norm(t).view());
                assert_eq!(e, Err(nonfinite(ROW_VALUE, 0)), "{name} at {t}");
                assert_eq!(c.len(), len, "{name} at {t}: length changed");
                let after = attend(c.as_mut(), t as u64).unwrap();
                // (The asynchronous cache may apply a worker result in between: a swap of
                // equivalent encodings, SPEC 10.4, not a change of content.)
                if *name != "live-async" {
                    assert_eq!(after, before[i], "{name} at {t}: output changed");
                }
            }
        }
        for (name, c) in cs.iter_mut() {
            c.append(k.index_axis(Axis(0), t), v.index_axis(Axis(0), t))
                .unwrap_or_else(|e| panic!("{name} at {t}: {e}"));
        }
    }
    let lens: Vec<usize> = cs.iter().map(|(_, c)| c.len()).collect();
    assert!(lens.iter().all(|&l| l == 400), "{lens:?}");
}

/// SPEC.md section 14: a finite query row whose norm is beyond 2^64 is `NonFinite`
/// (`rules::ROW_QUERY`) on every cache, MosaicKV and baselines, reference and optimized,
/// with the flat index of the row's first element; a row of norm 2^63 is attended to a
/// finite output everywhere. (Before the rule, a query of norm 1e37 overflowed the
/// optimized backend's f32 logits into a NaN output while the f64 reference answered.)
#[test]
fn queries_beyond_the_attention_range_are_refused_alike() {
    use mosaickv_optimized::{DenseF16Cache, QuestF16Cache};
    use mosaickv_reference::{FullCache, Naive2dCache, QuestCache};
    use mosaickv_spec::rules::ROW_QUERY;
    let sh = shape();
    let (k, v) = structured_kv(200, sh.kv_heads, sh.head_dim, 3);
    let mut all = caches();
    all.push(("full", Box::new(FullCache::new(sh))));
    all.push(("dense-f16", Box::new(DenseF16Cache::new(sh).unwrap())));
    all.push(("quest", Box::new(QuestCache::new(sh, 0.2).unwrap())));
    all.push(("quest-f16", Box::new(QuestF16Cache::new(sh, 0.2).unwrap())));
    all.push((
        "naive2d",
        Box::new(Naive2dCache::new(sh, 0.2, 0.5).unwrap()),
    ));
    for (name, c) in all.iter_mut() {
        c.prefill(k.view(), v.view()).unwrap();
        let base = queries(sh.q_heads, sh.head_dim, 7);
        let unit = |h: usize| {
            let r = base.row(h);
            let n = r.iter().map(|x| x * x).sum::<f32>().sqrt();
            r.mapv(|x| x / n)
        };
        let mut out = Array2::zeros((sh.q_heads, sh.head_dim));
        // every element of row 2 scaled so that its norm is 2^64 * (1 + 2^-20): refused
        let mut q = base.clone();
        q.row_mut(2)
            .assign(&(unit(2) * (2f32.powi(64) * (1.0 + 2f32.powi(-20)))));
        let e = c.attend(q.view(), out.view_mut()).unwrap_err();
        assert_eq!(e, nonfinite(ROW_QUERY, 2 * sh.head_dim), "{name}");
        // norm 2^63 (every logit far beyond what softmax can tell apart, but representable)
        let mut q = base.clone();
        q.row_mut(1).assign(&(unit(1) * 2f32.powi(63)));
        c.attend(q.view(), out.view_mut())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(out.iter().all(|x| x.is_finite()), "{name}: {out:?}");
    }
}
