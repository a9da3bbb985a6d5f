//! Issue 13 item 9: a forced CPU path forces every kernel. `MOSAICKV_FORCE_PORTABLE=1` runs
//! portable kernels only and `MOSAICKV_FORCE_AVX2=1` no AVX-512 kernel, in the encoder, the
//! caches, `LiveCache` and the kernels alike: `simd::kernels_ran` records which kernel
//! layers actually ran. The forced runs are child processes (the record is per process) of
//! this test binary, running `kernels_follow_the_detected_path` under the switch; the
//! `.ci/run` passes that set a switch for the whole suite run that test under it directly.

#[path = "../examples/cpu_paths/workload.rs"]
mod workload;

use mosaickv_optimized::simd::{kernels_ran, Path, FORCE_AVX2, FORCE_PORTABLE};
use std::process::Command;

/// Whether a kernel of layer `ran` may run when the path is `path`.
fn allowed(path: Path, ran: Path) -> bool {
    match ran {
        Path::Portable => true,
        Path::Avx2 => path != Path::Portable,
        Path::Avx512 => path == Path::Avx512,
    }
}

/// In this process, under whatever switches it has: every kernel layer that ran is one the
/// detected path allows, and the detected path's own layer ran.
#[test]
fn kernels_follow_the_detected_path() {
    let path = Path::detect();
    workload::run().unwrap();
    let ran = kernels_ran();
    let names: Vec<&str> = ran.iter().map(|p| p.name()).collect();
    println!("kernels ran: {}", names.join(" "));
    for &r in &ran {
        assert!(
            allowed(path, r),
            "{} kernels ran on path {:?} (all that ran: {names:?})",
            r.name(),
            path
        );
    }
    assert!(
        ran.contains(&path),
        "path {path:?} ran none of its kernels: {names:?}"
    );
}

/// The layers `kernels_follow_the_detected_path` ran in a child process with exactly the
/// switch `var` set to 1.
fn run_forced(var: &str) -> Vec<String> {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "kernels_follow_the_detected_path", "--nocapture"])
        .args(["--test-threads", "1"])
        .env_remove(FORCE_PORTABLE)
        .env_remove(FORCE_AVX2)
        .env(var, "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child under {var}=1 failed:\n{text}");
    let line = text
        .lines()
        .find_map(|l| l.split_once("kernels ran: ").map(|(_, names)| names))
        .unwrap_or_else(|| panic!("the child under {var}=1 did not run the workload:\n{text}"));
    line.split_whitespace().map(str::to_owned).collect()
}

#[test]
fn force_portable_runs_only_portable_kernels() {
    assert_eq!(run_forced(FORCE_PORTABLE), ["portable"]);
}

#[test]
fn force_avx2_runs_no_avx512_kernel() {
    let ran = run_forced(FORCE_AVX2);
    assert!(!ran.iter().any(|r| r == "avx512"), "{ran:?}");
    assert_eq!(
        ran.iter().any(|r| r == "avx2"),
        Path::Avx2.runs_here(),
        "{ran:?}"
    );
}
