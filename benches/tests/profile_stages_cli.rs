//! `profile_stages` end to end on a small cache: its tables and JSON are there, the stage
//! times are positive where the step runs the stage, and the bytes it counts are those of
//! the cache's records (non-zero for the key and value records a step reads).

use std::process::Command;

#[test]
fn profile_stages_prints_every_stage() {
    let out = Command::new(env!("CARGO_BIN_EXE_profile_stages"))
        .args(["--context", "6000", "--steps", "2", "--json"])
        .output()
        .expect("run profile_stages");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for row in [
        "| SPEC 8: rotate, score, select (heads in parallel) |",
        "| SPEC 8.1 rotate queries |",
        "| SPEC 8.2 block scores |",
        "| SPEC 9 key logits |",
        "| SPEC 9 values |",
        "| SPEC 9 merge + back-rotation |",
    ] {
        assert!(stdout.contains(row), "{row} missing:\n{stdout}");
    }
    let json: serde_json::Value = stdout
        .lines()
        .find(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .expect("a JSON line");
    assert_eq!(json["steps"], 2);
    assert!(json["plain_step_ms"].as_f64().unwrap() > 0.0);
    for stage in json["stages"].as_array().unwrap() {
        let name = stage["stage"].as_str().unwrap();
        if name == "SPEC 9 key logits" || name == "SPEC 9 values" {
            assert!(stage["bytes"].as_f64().unwrap() > 0.0, "{name}");
            assert!(stage["thread_ms"].as_f64().unwrap() > 0.0, "{name}");
        }
    }
}

#[test]
fn profile_stages_refuses_an_unknown_config() {
    let out = Command::new(env!("CARGO_BIN_EXE_profile_stages"))
        .args(["--context", "600", "--config", "no-such-config"])
        .output()
        .expect("run profile_stages");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no-such-config"), "{err}");
}

#[test]
fn profile_stages_refuses_zero_steps_and_tokens() {
    for args in [["--steps", "0"], ["--context", "0"]] {
        let out = Command::new(env!("CARGO_BIN_EXE_profile_stages"))
            .args(args)
            .output()
            .expect("run profile_stages");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }
}
