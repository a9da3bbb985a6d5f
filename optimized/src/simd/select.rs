//! SPEC.md section 8.3's order on blocks as one integer per block (the rank key), and the
//! filter that keeps the keys at or below a pivot. Dispatch and the portable kernel;
//! `avx512/select.rs`.

#[cfg(target_arch = "x86_64")]
use super::avx512;
use super::Path;

/// Key for the fused top-k: sorts by score descending, then index ascending (SPEC 8.3, 12).
#[inline]
pub fn rank_key(score: f32, index: u32) -> u64 {
    // NaN ranks as -inf; `+ 0.0` turns -0 into +0 and leaves every other value alone.
    let s = if score.is_nan() {
        f32::NEG_INFINITY
    } else {
        score + 0.0
    };
    let b = s.to_bits();
    // Monotone map f32 -> u32 (increasing: negative values have all bits flipped, positive
    // ones the sign bit set), then inverted for descending.
    let mono = b ^ (((b as i32 >> 31) as u32) | 0x8000_0000);
    ((!mono as u64) << 32) | index as u64
}

impl Path {
    /// The rank keys ([`rank_key`], index = position in `scores`) that are at most `pivot`,
    /// written to `out` (in any order on AVX-512, ascending index otherwise); returns how
    /// many. `out` holds at least `scores.len() + 16` keys; `scores.len() < 2^32`.
    pub fn filter_rank_keys(self, scores: &[f32], pivot: u64, out: &mut [u64]) -> usize {
        assert!(out.len() >= scores.len() + 16 && scores.len() <= u32::MAX as usize);
        #[cfg(target_arch = "x86_64")]
        if self == Path::Avx512 {
            // SAFETY: AVX-512 detected (the path); out holds n + 16 keys and n < 2^32
            // (asserted).
            return unsafe { avx512::select::filter_rank_keys(scores, pivot, out.as_mut_ptr()) };
        }
        Path::Portable.ran();
        let mut c = 0;
        for (i, &score) in scores.iter().enumerate() {
            let x = rank_key(score, i as u32);
            out[c] = x;
            c += usize::from(x <= pivot);
        }
        c
    }
}
