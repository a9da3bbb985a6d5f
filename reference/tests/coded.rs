//! Coded records in the reference (SPEC.md sections 6.1, 11.1, 11.2, 13, 15).

use mosaickv_reference::metrics::rel_l2;
use mosaickv_reference::synthetic::{queries, structured_kv};
use mosaickv_reference::topr::{rotate_row_f64, round_kept};
use mosaickv_reference::{FullCache, MosaicCache, ReferenceBackend};
use mosaickv_spec::{
    Backend, ChannelPolicy, CompressConfig, KvCache, KvShape, MosaicError, Side, ValueDtype,
};
use ndarray::{s, Array2};

const D: usize = 64;

fn with_dtypes(dtypes: &[ValueDtype]) -> CompressConfig {
    CompressConfig {
        value_dtypes: dtypes.to_vec(),
        ..CompressConfig::default()
    }
}

fn coded_only() -> CompressConfig {
    with_dtypes(&[ValueDtype::Coded])
}

/// A coded side's records decode every dim to within half its step of the f16 rotated value
/// (the fit's ranges cover the rows), a 0-bit dim to its mid-range, and the fit loss is the
/// decoded rows' error over the side's denominator, below the threshold.
#[test]
fn coded_records_decode_within_half_a_step_and_the_loss_passes() {
    let (k, v) = structured_kv(600, 1, D, 5);
    for (side_name, x, threshold) in [(Side::Key, &k, 0.01), (Side::Value, &v, 0.02)] {
        let rows = x.slice(s![.., 0, ..]).to_owned();
        let side = ReferenceBackend
            .fit_side(rows.view(), side_name, &coded_only())
            .unwrap();
        let l = side.layout;
        assert_eq!(
            (l.dtype, l.r, l.kept_dims, l.group_size),
            (ValueDtype::Coded, D, D, 1)
        );
        assert_eq!(
            l.code_bits,
            side.coding
                .iter()
                .map(|c| usize::from(c.bits))
                .sum::<usize>()
        );
        assert!(
            l.code_bits < 8 * D,
            "a loss threshold above 0 needs fewer than 8 bits a dim"
        );
        assert_eq!(l.record_bytes(), l.code_bits.div_ceil(32) * 4);
        assert!(
            side.fit_loss <= threshold,
            "{side_name:?}: {}",
            side.fit_loss
        );
        let packed = ReferenceBackend.encode(rows.view(), &side).unwrap();
        assert_eq!(packed.bytes.len(), rows.nrows() * l.record_bytes());
        let decoded = ReferenceBackend.decode(&packed, &side).unwrap();
        let mut err = 0.0;
        let mut energy = 0.0;
        for (row, dec) in rows.rows().into_iter().zip(decoded.rows()) {
            let x = rotate_row_f64(&row.to_vec(), &side.rotation);
            let y = round_kept(&x, D);
            for j in 0..D {
                let c = side.coding[j];
                let d = f64::from(dec[j]);
                let bound = if c.bits == 0 {
                    // mid-range of the segment's values: the whole range is at most one step
                    f64::MAX
                } else {
                    c.scale.to_f64() / 2.0 * (1.0 + 1e-6)
                };
                assert!(
                    (d - y[j].to_f64()).abs() <= bound,
                    "dim {j}: {d} vs {}",
                    y[j]
                );
                err += (x[j] - d).powi(2);
                energy += x[j] * x[j];
            }
        }
        if side_name == Side::Value {
            // values: the loss is the decoded error over their energy (section 11.1)
            assert!((side.fit_loss - err / energy).abs() <= 1e-12 * (1.0 + err / energy));
        }
    }
}

/// The strategy takes a coded record where it is the cheapest candidate that passes, and a
/// bitmap record where one is cheaper (section 11.2): with both allowed, the chosen record is
/// never larger than either policy's alone, and its loss still passes.
#[test]
fn with_both_kinds_the_cheaper_passing_record_is_chosen() {
    let (k, _) = structured_kv(500, 1, D, 11);
    let rows = k.slice(s![.., 0, ..]).to_owned();
    let fit = |cfg: &CompressConfig| {
        ReferenceBackend
            .fit_side(rows.view(), Side::Key, cfg)
            .unwrap()
    };
    let bitmap = fit(&CompressConfig::default());
    let coded = fit(&coded_only());
    let both = fit(&with_dtypes(&[
        ValueDtype::F16,
        ValueDtype::Int8,
        ValueDtype::Int4,
        ValueDtype::Coded,
    ]));
    let rb = |s: &mosaickv_spec::SideStrategy| s.layout.record_bytes();
    assert_eq!(rb(&both), rb(&bitmap).min(rb(&coded)));
    assert!(both.fit_loss <= 0.01);
}

/// A cache of coded records attends close to full attention (the same bound the default's
/// records meet on these rows), its memory report counts the per-dim parameters, and it
/// saves and loads back to the same cache, bit for bit (SPEC.md section 15.3).
#[test]
fn a_coded_cache_attends_counts_its_bytes_and_round_trips_through_a_file() {
    let (n, kvh, qh) = (900, 2, 8);
    let (k, v) = structured_kv(n, kvh, D, 21);
    let shape = KvShape::new(kvh, qh, D).unwrap();
    let mut full = FullCache::new(shape);
    full.prefill(k.view(), v.view()).unwrap();
    let mut errs = Vec::new();
    // every token attended, so the error is the records' alone
    for cfg in [CompressConfig::default(), coded_only()] {
        let cfg = CompressConfig {
            token_rate: 1.0,
            ..cfg
        };
        let mut cache = MosaicCache::new(shape, cfg).unwrap();
        cache.prefill(k.view(), v.view()).unwrap();
        let q = queries(qh, D, &k, 3);
        let mut want = Array2::zeros((qh, D));
        let mut got = Array2::zeros((qh, D));
        full.attend(q.view(), want.view_mut()).unwrap();
        cache.attend(q.view(), got.view_mut()).unwrap();
        errs.push(rel_l2(got.view(), want.view()));
        let mem = cache.memory();
        let coding: usize = cache
            .compressed()
            .segments
            .iter()
            .flat_map(|s| &s.heads)
            .map(|h| 5 * (h.strategy.key.coding.len() + h.strategy.value.coding.len()))
            .sum();
        let scales: usize = cache
            .compressed()
            .segments
            .iter()
            .flat_map(|s| s.heads.iter().map(move |h| (s.len, h)))
            .map(|(len, h)| {
                len * (h.strategy.key.layout.scale_bytes() + h.strategy.value.layout.scale_bytes())
            })
            .sum();
        assert_eq!(mem.scales, scales + coding);
        if cache.compressed().config.value_dtypes == vec![ValueDtype::Coded] {
            assert!(coding > 0);
            assert_eq!(mem.bitmaps, 0);
            let dir = std::env::temp_dir().join(format!("mkv-coded-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("cache.mkv");
            cache.save(&path).unwrap();
            let (back, hk, hv) = mosaickv_spec::persist::load_cache(&path).unwrap();
            assert_eq!(&back, cache.compressed());
            assert_eq!(hk.len(), hv.len());
            // a coding that does not match its layout (a width of 3 bits) is refused by the
            // structural check every save and load runs, and nothing is written
            let mut bad = cache.compressed().clone();
            let side = &mut bad.segments[0].heads[0].strategy.key;
            side.coding[0].bits = 3;
            side.layout.code_bits += 3;
            let bad_path = dir.join("bad.mkv");
            let e = mosaickv_spec::persist::save_cache(&bad_path, &bad, &hk, &hv).unwrap_err();
            assert!(matches!(e, MosaicError::InvalidConfig(_)), "{e}");
            assert!(!bad_path.exists());
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
    eprintln!(
        "attention error: default records {}, coded {}",
        errs[0], errs[1]
    );
    assert!(
        errs[1] < 0.1,
        "coded attention error {} (default {})",
        errs[1],
        errs[0]
    );
}

/// The configuration rules: `coded` parses in a method string and a JSON file, needs the
/// loss-threshold policy, and the optimized backend refuses it by name (section 6.1).
#[test]
fn coded_is_refused_where_it_is_not_implemented() {
    let m: mosaickv_spec::Method = "mosaic-ref:dt=coded/int4".parse().unwrap();
    match m {
        mosaickv_spec::Method::Mosaic { config, .. } => {
            assert_eq!(
                config.value_dtypes,
                vec![ValueDtype::Coded, ValueDtype::Int4]
            )
        }
        other => panic!("{other:?}"),
    }
    let cfg = CompressConfig::from_json(r#"{"value_dtypes": ["coded"]}"#).unwrap();
    assert_eq!(cfg.value_dtypes, vec![ValueDtype::Coded]);
    let fixed = CompressConfig {
        channels: ChannelPolicy::Fixed {
            retention: 0.5,
            group_size: 1,
        },
        value_dtypes: vec![ValueDtype::Coded],
        ..CompressConfig::default()
    };
    assert!(matches!(
        fixed.validate(D),
        Err(MosaicError::InvalidConfig(_))
    ));
    assert!("mosaic-ref:dt=coded3"
        .parse::<mosaickv_spec::Method>()
        .is_err());
}

/// Generated tokens under coded strategies (SPEC.md sections 10.2-10.3): flushed with the
/// temporary strategy (codes clamped to the fitted ranges), segments closed and refitted, and
/// attention stays close to full attention over every token.
#[test]
fn generated_tokens_flush_and_close_under_coded_strategies() {
    let (n, kvh, qh) = (1200, 1, 4);
    let (k, v) = structured_kv(n, kvh, D, 8);
    let shape = KvShape::new(kvh, qh, D).unwrap();
    let cfg = CompressConfig {
        value_dtypes: vec![ValueDtype::Coded],
        token_rate: 1.0,
        min_segment_len: 128,
        max_segment_len: 256,
        ..CompressConfig::default()
    };
    let mut cache = MosaicCache::new(shape, cfg).unwrap();
    let mut full = FullCache::new(shape);
    let p = 300;
    cache
        .prefill(k.slice(s![..p, .., ..]), v.slice(s![..p, .., ..]))
        .unwrap();
    full.prefill(k.slice(s![..p, .., ..]), v.slice(s![..p, .., ..]))
        .unwrap();
    for t in p..n {
        cache
            .append(k.slice(s![t, .., ..]), v.slice(s![t, .., ..]))
            .unwrap();
        full.append(k.slice(s![t, .., ..]), v.slice(s![t, .., ..]))
            .unwrap();
    }
    let segs = &cache.compressed().segments;
    assert!(segs.len() >= 4, "{} segments", segs.len());
    assert!(segs
        .iter()
        .flat_map(|s| &s.heads)
        .all(|h| h.strategy.key.layout.dtype == ValueDtype::Coded));
    let q = queries(qh, D, &k, 9);
    let mut want = Array2::zeros((qh, D));
    let mut got = Array2::zeros((qh, D));
    full.attend(q.view(), want.view_mut()).unwrap();
    cache.attend(q.view(), got.view_mut()).unwrap();
    let e = rel_l2(got.view(), want.view());
    assert!(e < 0.15, "attention error {e}");
}
