//! Whole-cache agreement: the reference `MosaicCache` (the oracle for where
//! segments begin and end) against the optimized `OptimizedMosaicCache`, and
//! the reference baselines against the optimized ones, replaying the same
//! operation sequences.

use mosaickv_conformance::{queries, rel_l2, structured_kv, tolerances::ATTEND_REL_L2};
use mosaickv_optimized::{DenseF16Cache, OptimizedMosaicCache, QuestF16Cache};
use mosaickv_reference::{FullCache, MosaicCache, QuestCache};
use mosaickv_spec::{CompressConfig, KvCache, KvShape, MosaicError};
use ndarray::{s, Array2, Axis};
use proptest::prelude::*;

/// Replays prefill(prompt) then `appends` appends, attending every `every` steps;
/// returns the worst relative error seen between `a` and `b` outputs.
fn replay(
    a: &mut dyn KvCache,
    b: &mut dyn KvCache,
    shape: KvShape,
    prompt: usize,
    appends: usize,
    every: usize,
    seed: u64,
) -> Result<f64, String> {
    let (k, v) = structured_kv(prompt + appends, shape.kv_heads, shape.head_dim, seed);
    let ra = a.prefill(k.slice(s![..prompt, .., ..]), v.slice(s![..prompt, .., ..]));
    let rb = b.prefill(k.slice(s![..prompt, .., ..]), v.slice(s![..prompt, .., ..]));
    if ra != rb {
        return Err(format!("prefill: {ra:?} vs {rb:?}"));
    }
    let mut worst = 0.0f64;
    for t in prompt..=prompt + appends {
        if (t - prompt) % every == 0 {
            let q = queries(shape.q_heads, shape.head_dim, seed + t as u64);
            let mut oa = Array2::from_elem((shape.q_heads, shape.head_dim), f32::NAN);
            let mut ob = Array2::from_elem((shape.q_heads, shape.head_dim), f32::NAN);
            let ea = a.attend(q.view(), oa.view_mut());
            let eb = b.attend(q.view(), ob.view_mut());
            match (ea, eb) {
                (Ok(()), Ok(())) => {
                    if ob.iter().any(|x| !x.is_finite()) {
                        return Err(format!("step {t}: output not fully written"));
                    }
                    worst = worst.max(rel_l2(ob.view(), oa.view()));
                }
                (Err(x), Err(y)) if x == y => {}
                (x, y) => return Err(format!("step {t}: attend {x:?} vs {y:?}")),
            }
        }
        if t < prompt + appends {
            let ra = a.append(k.index_axis(Axis(0), t), v.index_axis(Axis(0), t));
            let rb = b.append(k.index_axis(Axis(0), t), v.index_axis(Axis(0), t));
            if ra != rb {
                return Err(format!("append {t}: {ra:?} vs {rb:?}"));
            }
        }
        if a.len() != b.len() {
            return Err(format!("len {} vs {}", a.len(), b.len()));
        }
    }
    Ok(worst)
}

fn small_config() -> CompressConfig {
    let mut cfg = CompressConfig::default();
    cfg.input_segment_len = 96;
    cfg.buffer_capacity = 64;
    cfg.max_segment_len = 256;
    cfg.min_segment_len = 128;
    cfg
}

/// Segment boundaries, states and every strategy parameter must be identical.
fn same_structure(r: &MosaicCache, o: &OptimizedMosaicCache) -> Result<(), String> {
    let (a, b) = (r.compressed(), o.compressed());
    if a.sink.tokens != b.sink.tokens || a.buffer.tokens != b.buffer.tokens {
        return Err(format!(
            "sink/buffer {}/{} vs {}/{}",
            a.sink.tokens, a.buffer.tokens, b.sink.tokens, b.buffer.tokens
        ));
    }
    let bounds = |c: &mosaickv_spec::CompressedCache| {
        c.segments
            .iter()
            .map(|s| (s.start, s.len, s.state))
            .collect::<Vec<_>>()
    };
    if bounds(a) != bounds(b) {
        return Err(format!("segments {:?} vs {:?}", bounds(a), bounds(b)));
    }
    for (i, (sa, sb)) in a.segments.iter().zip(&b.segments).enumerate() {
        for (h, (ha, hb)) in sa.heads.iter().zip(&sb.heads).enumerate() {
            if ha.strategy.key.layout != hb.strategy.key.layout
                || ha.strategy.value.layout != hb.strategy.value.layout
                || ha.strategy.key.coding != hb.strategy.key.coding
                || ha.strategy.value.coding != hb.strategy.value.coding
                || ha.strategy.block_size != hb.strategy.block_size
            {
                return Err(format!("segment {i} head {h}: strategy parameters differ"));
            }
        }
    }
    Ok(())
}

#[test]
fn mosaic_lifecycle_matches_reference() {
    for (ci, cfg) in [
        small_config(),
        CompressConfig::default(),
        {
            let mut c = CompressConfig::paper_fixed();
            c.input_segment_len = 64;
            c.buffer_capacity = 32;
            c.max_segment_len = 96;
            c.min_segment_len = 64;
            c
        },
        {
            // int4 and int8 values chosen by the loss rule (SPEC.md sections 6, 11.2).
            let mut c = small_config();
            c.value_dtypes = vec![
                mosaickv_spec::ValueDtype::Int4,
                mosaickv_spec::ValueDtype::Int8,
            ];
            c
        },
        {
            // SPEC.md section 6.1's coded records beside the bitmap dtypes, chosen by the
            // loss rule.
            let mut c = small_config();
            c.value_dtypes.push(mosaickv_spec::ValueDtype::Coded);
            c
        },
    ]
    .into_iter()
    .enumerate()
    {
        for &(prompt, appends) in &[
            (0usize, 0usize),
            (0, 70),
            (3, 1),
            (5, 200),
            (300, 300),
            (1000, 129),
        ] {
            let shape = KvShape::new(2, 6, 64).unwrap();
            let mut r = MosaicCache::new(shape, cfg.clone()).unwrap();
            let mut o = OptimizedMosaicCache::new(shape, cfg.clone()).unwrap();
            let worst = replay(
                &mut r,
                &mut o,
                shape,
                prompt,
                appends,
                17,
                (ci * 10 + prompt) as u64,
            )
            .unwrap_or_else(|e| panic!("cfg {ci} prompt {prompt} appends {appends}: {e}"));
            same_structure(&r, &o)
                .unwrap_or_else(|e| panic!("cfg {ci} prompt {prompt} appends {appends}: {e}"));
            assert!(
                worst <= ATTEND_REL_L2,
                "cfg {ci} prompt {prompt}: attention rel error {worst:e}"
            );
        }
    }
}

#[test]
fn baselines_match_reference() {
    let shape = KvShape::new(2, 8, 128).unwrap();
    let mut rf = FullCache::new(shape);
    let mut of = DenseF16Cache::new(shape).unwrap();
    let e = replay(&mut rf, &mut of, shape, 700, 40, 9, 1).unwrap();
    assert!(e <= ATTEND_REL_L2, "full: {e:e}");
    let mut rq = QuestCache::new(shape, 0.1).unwrap();
    let mut oq = QuestF16Cache::new(shape, 0.1).unwrap();
    let e = replay(&mut rq, &mut oq, shape, 700, 40, 9, 2).unwrap();
    assert!(e <= ATTEND_REL_L2, "quest: {e:e}");
}

#[test]
fn bad_input_same_error_and_cache_unchanged() {
    let shape = KvShape::new(2, 4, 32).unwrap();
    let cfg = small_config();
    let mut r = MosaicCache::new(shape, cfg.clone()).unwrap();
    let mut o = OptimizedMosaicCache::new(shape, cfg).unwrap();
    let (k, v) = structured_kv(200, 2, 32, 3);
    r.prefill(k.view(), v.view()).unwrap();
    o.prefill(k.view(), v.view()).unwrap();
    let before = (o.len(), o.memory(), o.compressed().clone());
    let mut bad = k.index_axis(Axis(0), 0).to_owned();
    bad[[1, 5]] = f32::NAN;
    let er = r.append(bad.view(), v.index_axis(Axis(0), 0));
    let eo = o.append(bad.view(), v.index_axis(Axis(0), 0));
    assert!(matches!(er, Err(MosaicError::NonFinite { .. })), "{er:?}");
    assert_eq!(er, eo);
    assert_eq!(er, r.append(bad.view(), v.index_axis(Axis(0), 0)));
    assert_eq!(
        before,
        (o.len(), o.memory(), o.compressed().clone()),
        "a failed append changed the cache"
    );
    let ep = o.prefill(k.view(), v.view());
    assert_eq!(ep, r.prefill(k.view(), v.view()));
    assert!(matches!(ep, Err(MosaicError::AlreadyPrefilled(_))));
    let wrong = Array2::<f32>::zeros((3, 32));
    let mut out = Array2::<f32>::zeros((4, 32));
    assert_eq!(
        o.attend(wrong.view(), out.view_mut()),
        r.attend(wrong.view(), out.view_mut())
    );
    let mut empty = OptimizedMosaicCache::new(shape, small_config()).unwrap();
    let q = queries(4, 32, 1);
    assert_eq!(
        empty.attend(q.view(), out.view_mut()),
        Err(MosaicError::EmptyCache)
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    /// Any prefill length and append count (odd segment lengths included):
    /// identical boundaries and strategies, attention within tolerance.
    #[test]
    fn prop_lifecycle(prompt in 0usize..500, appends in 0usize..300, l_in in 17usize..130, ratio in prop::sample::select(vec![1usize, 3, 4, 8]), seed in any::<u64>()) {
        let mut cfg = small_config();
        cfg.input_segment_len = l_in;
        let shape = KvShape::new(1, ratio, 32).unwrap();
        let mut r = MosaicCache::new(shape, cfg.clone()).unwrap();
        let mut o = OptimizedMosaicCache::new(shape, cfg).unwrap();
        let worst = replay(&mut r, &mut o, shape, prompt, appends, 31, seed);
        prop_assert!(worst.is_ok(), "{}", worst.unwrap_err());
        let s = same_structure(&r, &o);
        prop_assert!(s.is_ok(), "{}", s.unwrap_err());
        prop_assert!(worst.unwrap() <= ATTEND_REL_L2);
    }
}
