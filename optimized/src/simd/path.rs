//! Which implementation of the inner kernels runs ([`Path`]) and the CPU feature detection
//! behind it, and the record of which kernel layers ran ([`kernels_ran`]). The bottom of the
//! kernel layers: it depends on nothing else in `simd`.

use std::sync::atomic::{AtomicU8, Ordering};

/// Which implementation of the inner kernels runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// `std::arch` AVX2, FMA and F16C, detected at run time.
    Avx2,
    /// AVX-512 F/BW/VL/VBMI2/VNNI on top of [`Path::Avx2`], detected at run time: bitmap
    /// expansion, key logits on the expanded tile, the fused value accumulation, the online
    /// softmax, block and page scores, the selection filter, the query rotation and the
    /// baselines' f16 value accumulation (`simd::avx512`); everything else as `Avx2`.
    Avx512,
    /// Plain Rust, no target features beyond the build's baseline.
    Portable,
}

/// The environment switch that makes [`Path::detect`] return [`Path::Portable`].
pub const FORCE_PORTABLE: &str = "MOSAICKV_FORCE_PORTABLE";
/// The environment switch that caps [`Path::detect`] at [`Path::Avx2`].
pub const FORCE_AVX2: &str = "MOSAICKV_FORCE_AVX2";

impl Path {
    /// Every path, slowest first.
    pub const ALL: [Path; 3] = [Path::Portable, Path::Avx2, Path::Avx512];

    /// The one place that decides which kernels run: the fastest path this CPU supports,
    /// unless `MOSAICKV_FORCE_PORTABLE=1` (portable) or `MOSAICKV_FORCE_AVX2=1` (AVX2 even
    /// where AVX-512 exists). Every kernel choice goes through a `Path`: the caches and
    /// backends made by `new()` hold this one, and the encode helpers that have no owner
    /// (`rotation::covariance`, `rotation::rotate_rows_f64`, `live::covariance_update`) call it.
    pub fn detect() -> Path {
        let set = |name: &str| std::env::var(name).is_ok_and(|v| v == "1");
        Path::detect_with(set(FORCE_PORTABLE), set(FORCE_AVX2))
    }

    /// [`Path::detect`] with the two switches given instead of read from the environment.
    pub fn detect_with(force_portable: bool, force_avx2: bool) -> Path {
        if force_portable {
            Path::Portable
        } else if !force_avx2 && Path::Avx512.runs_here() {
            Path::Avx512
        } else if Path::Avx2.runs_here() {
            Path::Avx2
        } else {
            Path::Portable
        }
    }

    /// Whether this CPU has every feature the path's kernels use.
    pub fn runs_here(self) -> bool {
        match self {
            Path::Portable => true,
            Path::Avx2 => avx2_available(),
            Path::Avx512 => avx512_available(),
        }
    }

    /// `"portable"`, `"avx2"` or `"avx512"`.
    pub fn name(self) -> &'static str {
        match self {
            Path::Portable => "portable",
            Path::Avx2 => "avx2",
            Path::Avx512 => "avx512",
        }
    }

    /// Whether code compiled for AVX2 (`#[target_feature]` builds of scalar loops) runs on
    /// this path: on both SIMD paths. Records the layer that runs (see [`kernels_ran`]).
    #[inline]
    pub(crate) fn runs_avx2(self) -> bool {
        let simd = self != Path::Portable;
        if simd {
            Path::Avx2.ran();
        } else {
            Path::Portable.ran();
        }
        simd
    }

    /// Records that a kernel of this layer ran (see [`kernels_ran`]): one relaxed load of a
    /// read-mostly byte, and a store only the first time, so hot kernels can afford it.
    #[inline(always)]
    pub(crate) fn ran(self) {
        let bit = 1u8 << self as u8;
        if RAN.load(Ordering::Relaxed) & bit == 0 {
            RAN.fetch_or(bit, Ordering::Relaxed);
        }
    }
}

/// One bit per [`Path`] whose kernels have run in this process.
static RAN: AtomicU8 = AtomicU8::new(0);

/// The kernel layers that have run in this process so far, slowest first:
/// [`Path::Portable`] once a portable kernel ran, [`Path::Avx2`] once an AVX2 one did (the
/// AVX-512 path runs AVX2 kernels where it has none of its own, and some geometries take
/// portable kernels on every path), [`Path::Avx512`] once an AVX-512 one did. A forced path
/// shows here as the only SIMD layer that ran (tests/forced_paths.rs, `examples/cpu_paths`).
pub fn kernels_ran() -> Vec<Path> {
    let bits = RAN.load(Ordering::Relaxed);
    Path::ALL
        .into_iter()
        .filter(|&p| bits & (1u8 << p as u8) != 0)
        .collect()
}

/// `[(name, present)]` for the CPU features each SIMD path needs.
macro_rules! features {
    ($($f:tt),*) => {
        [$(($f, {
            #[cfg(target_arch = "x86_64")]
            let present = is_x86_feature_detected!($f);
            #[cfg(not(target_arch = "x86_64"))]
            let present = false;
            present
        })),*]
    };
}

/// What [`Path::Avx2`] needs.
pub fn avx2_features() -> [(&'static str, bool); 4] {
    features!("avx2", "fma", "f16c", "popcnt")
}

/// What [`Path::Avx512`] needs on top of [`avx2_features`].
pub fn avx512_features() -> [(&'static str, bool); 6] {
    features!(
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512vbmi2",
        "avx512vnni",
        "bmi2"
    )
}

/// Whether AVX-512 F, BW, VL, VBMI2 and VNNI (and BMI2, which every AVX-512 CPU has) are
/// available on top of [`avx2_available`].
pub fn avx512_available() -> bool {
    avx2_available() && avx512_features().iter().all(|f| f.1)
}

/// Whether AVX2, FMA, F16C and POPCNT are all available on this CPU.
pub fn avx2_available() -> bool {
    avx2_features().iter().all(|f| f.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_cap_the_detected_path() {
        for avx2 in [false, true] {
            assert_eq!(Path::detect_with(true, avx2), Path::Portable);
        }
        assert_ne!(Path::detect_with(false, true), Path::Avx512);
        let best = Path::detect_with(false, false);
        assert!(best.runs_here());
        // The fastest path that runs here: nothing faster in ALL (slowest first) runs.
        let i = Path::ALL.iter().position(|&p| p == best).unwrap();
        assert!(Path::ALL[i + 1..].iter().all(|p| !p.runs_here()));
    }
}
