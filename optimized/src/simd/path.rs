//! Which implementation of the inner kernels runs ([`Path`]) and the CPU feature detection
//! behind it. The bottom of the kernel layers: it depends on nothing else in `simd`.

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

impl Path {
    /// The fastest path this CPU supports, unless `MOSAICKV_FORCE_PORTABLE=1` (portable) or
    /// `MOSAICKV_FORCE_AVX2=1` (AVX2 even where AVX-512 exists).
    pub fn detect() -> Path {
        let set = |name: &str| std::env::var(name).map(|v| v == "1").unwrap_or(false);
        if set("MOSAICKV_FORCE_PORTABLE") {
            return Path::Portable;
        }
        if avx512_available() && !set("MOSAICKV_FORCE_AVX2") {
            Path::Avx512
        } else if avx2_available() {
            Path::Avx2
        } else {
            Path::Portable
        }
    }
}

/// Whether AVX-512 F, BW, VL, VBMI2 and VNNI are available on top of [`avx2_available`].
pub fn avx512_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx2_available()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vbmi2")
            && is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether AVX2, FMA, F16C and POPCNT are all available on this CPU.
pub fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("popcnt")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
