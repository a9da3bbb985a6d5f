//! Compiles every kernel with NVRTC for compute_90 to PTX, warnings as errors.
//! NVRTC has no -Werror option, so a non-empty compile log fails the test.
//! Runs when `MOSAICKV_NVRTC` names a libnvrtc (CI installs the pinned wheel
//! `nvidia-cuda-nvrtc==13.0.88` and sets it); otherwise prints "skipped: ...".

use mosaickv_kernels::nvrtc::{Nvrtc, NVRTC_ENV};
use mosaickv_kernels::{entry_points, KERNELS};

fn nvrtc() -> Option<Nvrtc> {
    match std::env::var_os(NVRTC_ENV).filter(|v| !v.is_empty()) {
        None => {
            println!("skipped: {NVRTC_ENV} is not set (CI sets it to the pinned NVRTC wheel's libnvrtc.so.13)");
            None
        }
        // Set but broken is a failure, not a skip.
        Some(p) => Some(Nvrtc::load(&p).unwrap_or_else(|e| panic!("{NVRTC_ENV}={p:?}: {e}"))),
    }
}

#[test]
fn every_kernel_compiles_for_sm90_without_warnings() {
    let Some(nv) = nvrtc() else { return };
    println!(
        "NVRTC {:?} from {}",
        nv.version().unwrap(),
        nv.path().display()
    );
    for (file, src, entries) in KERNELS {
        let out = nv
            .compile_kernel(file, src, "compute_90")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            out.log.is_empty(),
            "{file}: NVRTC warnings (treated as errors):\n{}",
            out.log
        );
        for e in *entries {
            assert!(
                out.ptx.contains(&format!(".entry {e}(")),
                "{file}: PTX lacks entry {e}"
            );
        }
        println!(
            "{file}: {} bytes of PTX, entries {entries:?}",
            out.ptx.len()
        );
    }
    assert_eq!(entry_points().count(), 12);
}

#[test]
fn a_warning_fails_the_check() {
    // The check above relies on NVRTC reporting warnings in the log: prove it does.
    let Some(nv) = nvrtc() else { return };
    let src = "extern \"C\" __global__ void k(float* p) { int unused = 3; p[0] = 1.0f; }";
    let out = nv
        .compile_kernel("warn.cu", src, "compute_90")
        .expect("compiles");
    assert!(
        !out.log.is_empty(),
        "expected a warning for an unused variable"
    );
}

#[test]
fn a_broken_kernel_is_an_error_with_its_log() {
    let Some(nv) = nvrtc() else { return };
    let err = nv
        .compile_kernel(
            "bad.cu",
            "extern \"C\" __global__ void k() { undefined_fn(); }",
            "compute_90",
        )
        .unwrap_err();
    assert!(err.contains("undefined_fn"), "{err}");
}

#[test]
fn every_kernel_compiles_to_an_sm90_cubin() {
    // What the backend loads first on a device (Nvrtc::compile_for_device): device code for
    // the real architecture, so the driver never JIT-compiles PTX of a newer ISA than it reads.
    let Some(nv) = nvrtc() else { return };
    for (file, src, _) in KERNELS {
        let out = nv
            .compile_kernel(file, src, "sm_90")
            .unwrap_or_else(|e| panic!("{e}"));
        let cubin = out.cubin.as_deref().expect("sm_90 gives a CUBIN");
        assert_eq!(&cubin[..4], b"\x7fELF", "{file}: CUBIN is an ELF image");
        assert!(out.log.is_empty(), "{file}: NVRTC warnings:\n{}", out.log);
        // A driver of the same CUDA version as NVRTC also takes the PTX fallback.
        let (a, b) = nv.version().unwrap();
        let same = nv
            .compile_for_device(file, src, (9, 0), 1000 * a + 10 * b)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(same.cubin.is_some(), "{file}: {}", same.what);
    }
}
