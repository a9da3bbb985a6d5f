//! The layering of issue 39, checked from the manifests: the spec crate is the ground floor of
//! every backend, and the user-facing crates (`engine`, `server`, `eval`, `cli`) reach the f64
//! oracle (`mosaickv-reference`) only through a feature named `oracle`. `.ci/run` checks the
//! same with `cargo tree -e normal`.

use std::path::Path;

/// The lines of one `[section]` of a manifest (comments dropped).
fn section(manifest: &str, name: &str) -> Vec<String> {
    let mut inside = false;
    let mut out = Vec::new();
    for line in manifest.lines() {
        let t = line.trim();
        if t.starts_with('[') {
            inside = t == format!("[{name}]");
            continue;
        }
        if inside && !t.is_empty() && !t.starts_with('#') {
            out.push(t.to_string());
        }
    }
    out
}

fn manifest(krate: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(krate)
        .join("Cargo.toml");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn user_facing_crates_reach_the_oracle_only_through_a_feature_named_oracle() {
    for krate in ["engine", "server", "eval", "cli"] {
        let m = manifest(krate);
        for dep in section(&m, "dependencies") {
            assert!(
                !dep.starts_with("mosaickv-reference"),
                "{krate}: mosaickv-reference is a normal dependency: {dep}"
            );
            assert!(
                !dep.contains("oracle"),
                "{krate}: a normal dependency turns the oracle on: {dep}"
            );
        }
        for feature in section(&m, "features") {
            let (name, value) = feature.split_once('=').expect("name = [...]");
            if value.contains("oracle") || value.contains("mosaickv-reference") {
                assert!(
                    name.trim() == "oracle" || value.trim() == "[\"oracle\"]",
                    "{krate}: feature {name} reaches the oracle but is not named oracle"
                );
            }
        }
    }
}

#[test]
fn the_spec_crate_is_under_every_backend_and_front_end() {
    for krate in [
        "reference",
        "optimized",
        "methods",
        "engine",
        "server",
        "eval",
        "cli",
    ] {
        let deps = section(&manifest(krate), "dependencies");
        assert!(
            deps.iter().any(|d| d.starts_with("mosaickv-spec")),
            "{krate} does not depend on mosaickv-spec"
        );
    }
}

#[test]
fn the_parser_reads_real_sections() {
    // a renamed or misread section would let the checks above pass vacuously
    assert!(section(&manifest("engine"), "dependencies")
        .iter()
        .any(|d| d.starts_with("mosaickv-methods")));
    assert!(section(&manifest("cli"), "features")
        .iter()
        .any(|f| f.starts_with("oracle")));
}
