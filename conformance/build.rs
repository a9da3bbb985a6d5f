//! Looks for the CUDA driver library on the build machine. Where there is none,
//! the CUDA conformance tests are compiled as `#[ignore]` (reported as ignored,
//! never as passed); `scripts/gpu-check.sh` runs them with `--include-ignored`
//! on the GPU machine, where the binaries built here are carried.
//!
//! The same for the CPU kernel paths: where the build machine's CPU lacks AVX2
//! or AVX-512 (checked here, at build time, on the machine that runs the
//! tests), those stamps of the suite are compiled `#[ignore]`.

use std::path::Path;

fn main() {
    println!("cargo:rustc-check-cfg=cfg(mosaickv_no_cuda_driver)");
    println!("cargo:rustc-check-cfg=cfg(mosaickv_no_avx2)");
    println!("cargo:rustc-check-cfg=cfg(mosaickv_no_avx512)");
    #[cfg(target_arch = "x86_64")]
    let (avx2, avx512) = {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("popcnt");
        let avx512 = avx2
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vbmi2");
        (avx2, avx512)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let (avx2, avx512) = (false, false);
    if !avx2 {
        println!("cargo:rustc-cfg=mosaickv_no_avx2");
    }
    if !avx512 {
        println!("cargo:rustc-cfg=mosaickv_no_avx512");
    }
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
