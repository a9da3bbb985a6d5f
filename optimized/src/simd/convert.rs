//! f16 -> f32 widening of stored rows (the dense tiles of the baselines and of dense rows).

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::common::f16_bits_to_f32;
use super::Path;
use half::f16;

impl Path {
    /// f16 -> f32, exact.
    #[inline]
    pub fn f16_to_f32(self, src: &[f16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len());
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Path::Avx2` is only constructed after run-time detection of avx2/fma/f16c.
            Path::Avx2 | Path::Avx512 => unsafe { avx2::convert::f16_to_f32(src, dst) },
            _ => {
                Path::Portable.ran();
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = f16_bits_to_f32(s.to_bits());
                }
            }
        }
    }
}
