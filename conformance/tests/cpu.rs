//! The conformance suite stamped out for the optimized CPU backend: the run-time
//! detected SIMD path, then each kernel path forced (portable, AVX2, AVX-512),
//! so a CPU with AVX-512 still tests the AVX2 kernels. A path the build
//! machine's CPU lacks is compiled `#[ignore]` (build.rs), i.e. reported as
//! ignored, never as passed. CI additionally runs the whole workspace with
//! `MOSAICKV_FORCE_PORTABLE=1`.

use mosaickv_conformance::conformance_suite;
use mosaickv_optimized::{CpuBackend, Path};

conformance_suite!(cpu_detected, || Box::new(CpuBackend::new()));
conformance_suite!(cpu_portable, || Box::new(CpuBackend::portable()));
conformance_suite!(
    cpu_avx2,
    || Box::new(CpuBackend::forced(Path::Avx2)),
    #[cfg_attr(mosaickv_no_avx2, ignore = "the build machine's CPU lacks AVX2/FMA/F16C")]
);
conformance_suite!(
    cpu_avx512,
    || Box::new(CpuBackend::forced(Path::Avx512)),
    #[cfg_attr(
        mosaickv_no_avx512,
        ignore = "the build machine's CPU lacks AVX-512 F/BW/VL/VBMI2"
    )]
);
