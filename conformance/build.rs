//! Looks for the CUDA driver library on the build machine. Where there is none,
//! the CUDA conformance tests are compiled as `#[ignore]` (reported as ignored,
//! never as passed); `scripts/gpu-check.sh` runs them with `--include-ignored`
//! on the GPU machine, where the binaries built here are carried.

use std::path::Path;

fn main() {
    println!("cargo:rustc-check-cfg=cfg(mosaickv_no_cuda_driver)");
    println!("cargo:rerun-if-env-changed=LD_LIBRARY_PATH");
    let mut dirs: Vec<String> = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/cuda/lib64",
        "/usr/lib/wsl/lib",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Ok(p) = std::env::var("LD_LIBRARY_PATH") {
        dirs.extend(p.split(':').filter(|d| !d.is_empty()).map(String::from));
    }
    let found = dirs
        .iter()
        .any(|d| Path::new(d).join("libcuda.so.1").exists());
    if !found {
        println!("cargo:rustc-cfg=mosaickv_no_cuda_driver");
    }
}
