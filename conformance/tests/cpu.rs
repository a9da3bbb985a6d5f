//! The conformance suite stamped out for the optimized CPU backend, once with
//! the run-time detected SIMD path and once with the portable path forced.
//! CI additionally runs the whole workspace with `MOSAICKV_FORCE_PORTABLE=1`.

use mosaickv_conformance::conformance_suite;
use mosaickv_optimized::CpuBackend;

conformance_suite!(cpu_detected, || Box::new(CpuBackend::new()));
conformance_suite!(cpu_portable, || Box::new(CpuBackend::portable()));
