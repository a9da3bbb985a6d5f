//! The compare tool's configuration selection and its JSON rows, on a tiny synthetic context
//! with one timed step (no timing is checked: only which rows exist and what they carry).

use serde_json::Value;
use std::process::{Command, Output};

/// Runs `compare` on a 300-token context with one step of everything and a 1 MiB probe
/// (and the reference's 3 default steps unless `extra` says otherwise).
fn compare(extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_compare"))
        .args([
            "--contexts",
            "300",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--min-seconds",
            "0",
            "--error-samples",
            "1",
            "--bandwidth-bytes",
            "1048576",
            "--json",
        ])
        .args(extra)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .expect("run compare")
}

fn rows(out: &Output) -> Vec<Value> {
    assert!(
        out.status.success(),
        "compare failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

fn num(r: &Value, k: &str) -> f64 {
    r[k].as_f64()
        .unwrap_or_else(|| panic!("{k} missing or not a number in {r}"))
}

/// Bytes a Quest step reads at 300 tokens of the 8 x 128 layer: all page min/max (19 pages)
/// plus K and V of `ceil(budget / 16)` pages.
fn quest_bytes(budget_tokens: usize) -> f64 {
    let (kv, d, pages) = (8, 128, 300usize.div_ceil(16));
    (2 * 2 * pages * d * kv + budget_tokens.div_ceil(16) * 16 * 4 * d * kv) as f64
}

#[test]
fn default_then_paper_with_every_field() {
    let rows = rows(&compare(&["--reference-steps", "1"]));
    let key: Vec<(String, Value)> = rows
        .iter()
        .map(|r| {
            (
                r["method"].as_str().unwrap().to_string(),
                r["config"].clone(),
            )
        })
        .collect();
    let want: Vec<(String, Value)> = [
        ("full", Value::Null),
        ("quest", "default".into()),
        ("mosaic", "default".into()),
        ("mosaic-reference", "default".into()),
        ("quest", "paper".into()),
        ("mosaic", "paper".into()),
        ("mosaic-reference", "paper".into()),
    ]
    .into_iter()
    .map(|(m, c)| (m.to_string(), c))
    .collect();
    assert_eq!(key, want);
    for r in &rows {
        assert_eq!(num(r, "context"), 300.0);
        assert_eq!(num(r, "layers"), 1.0);
        for k in [
            "median_us",
            "bytes_read",
            "gbps",
            "probe_gbps",
            "measured_bandwidth_gbps",
            "kv_bytes_per_token",
        ] {
            assert!(num(r, k) > 0.0, "{k} in {r}");
        }
        // GB/s is the bytes a step reads over its median time.
        let g = num(r, "bytes_read") / (num(r, "median_us") * 1e-6) / 1e9;
        assert!((num(r, "gbps") - g).abs() <= 1e-9 * g, "{r}");
        assert!(num(r, "measured_bandwidth_gbps") >= num(r, "probe_gbps"));
        assert!(num(r, "rel_error_vs_full") >= 0.0);
        if r["method"] != "mosaic-reference" {
            assert!(num(r, "prefill_s") > 0.0, "{r}");
        }
    }
    // Dense f16: every K and V element, 4 B per (token, head, dim pair) of K and V.
    assert_eq!(num(&rows[0], "bytes_read"), (300 * 8 * 128 * 4) as f64);
    assert_eq!(num(&rows[0], "kv_bytes_per_token"), 4096.0);
    // Quest runs at the configuration's rate and floor: 256 tokens (the default's floor, above
    // ceil(0.2 * 300) = 60) against ceil(0.1 * 300) = 30 for the paper's setting.
    let (qd, qp) = (&rows[1], &rows[4]);
    assert_eq!(
        (num(qd, "token_rate"), num(qd, "min_budget_tokens")),
        (0.2, 256.0)
    );
    assert_eq!(
        (num(qp, "token_rate"), num(qp, "min_budget_tokens")),
        (0.1, 0.0)
    );
    assert_eq!(num(qd, "bytes_read"), quest_bytes(256));
    assert_eq!(num(qp, "bytes_read"), quest_bytes(30));
    // The two MosaicKV configurations differ: the paper's keeps f16 values only.
    let mix = |r: &Value, side: &str| r["strategy_mix"][side].as_array().unwrap().clone();
    for r in [&rows[2], &rows[5]] {
        for side in ["key", "value"] {
            let s: f64 = mix(r, side).iter().map(|e| num(e, "share")).sum();
            assert!((s - 1.0).abs() < 1e-9, "{side} shares sum to {s}");
        }
    }
    for e in mix(&rows[5], "key").iter().chain(&mix(&rows[5], "value")) {
        assert_eq!(e["dtype"], "f16");
        assert_eq!(num(e, "r"), 32.0, "25 % of head_dim 128: {e}");
    }
    assert_ne!(
        num(&rows[2], "kv_bytes_per_token"),
        num(&rows[5], "kv_bytes_per_token")
    );
    // The reference row is timed on the same compressed cache.
    assert_eq!(num(&rows[3], "bytes_read"), num(&rows[2], "bytes_read"));
    assert!(num(&rows[3], "optimized_speedup_over_reference") > 0.0);
}

#[test]
fn config_file_and_named_variants() {
    let dir = std::env::temp_dir().join(format!("mkv-compare-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("half.json");
    std::fs::write(&file, r#"{"token_rate": 0.5, "min_budget_tokens": 0}"#).unwrap();
    let f = file.to_str().unwrap();
    let rows = rows(&compare(&[
        "--config",
        &format!("paper-int4,{f}"),
        "--methods",
        "quest,mosaic",
        "--reference-steps",
        "0",
    ]));
    let names: Vec<(&str, &str)> = rows
        .iter()
        .map(|r| (r["method"].as_str().unwrap(), r["config"].as_str().unwrap()))
        .collect();
    assert_eq!(
        names,
        [
            ("quest", "paper-int4"),
            ("mosaic", "paper-int4"),
            ("quest", f),
            ("mosaic", f)
        ]
    );
    assert_eq!(num(&rows[2], "token_rate"), 0.5);
    assert_eq!(num(&rows[2], "bytes_read"), quest_bytes(150));
    for e in rows[1]["strategy_mix"]["value"].as_array().unwrap() {
        assert_eq!(e["dtype"], "int4");
    }
    // Without full in the run there is no speedup against it.
    assert!(rows[1]["speedup_vs_full"].is_null());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    for (args, says) in [
        (vec!["--config", "no-such-config"], "neither one of"),
        (vec!["--config", "default,default"], "given twice"),
        (vec!["--methods", "mosaic-int8"], "--config paper-int8"),
        (vec!["--methods", "dense"], "unknown method"),
        (vec!["--contexts", "0"], "at least 9 tokens"),
        (vec!["--steps", "0"], "at least 1"),
    ] {
        // Bare arguments: each is refused before any data is made.
        let out = Command::new(env!("CARGO_BIN_EXE_compare"))
            .args(&args)
            .output()
            .expect("run compare");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}
