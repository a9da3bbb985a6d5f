//! Memory hints: software prefetch of streamed rows and transparent huge pages.

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::Path;

impl Path {
    /// Software prefetch of every cache line `data` touches (SIMD paths; a no-op on the
    /// portable path).
    #[inline]
    pub fn prefetch<T>(self, data: &[T]) {
        #[cfg(target_arch = "x86_64")]
        if self != Path::Portable {
            // SAFETY: prefetch hints never fault and read nothing.
            unsafe {
                avx2::memory::prefetch(data.as_ptr() as *const u8, std::mem::size_of_val(data))
            }
        }
    }
}

/// Asks the kernel to back `[ptr, ptr + bytes)` with transparent huge pages (Linux,
/// `madvise(MADV_HUGEPAGE)`; a no-op elsewhere) for `len` elements at `ptr`, which must lie in
/// one live allocation. Call it before the memory is first
/// touched. Decode steps stream hundreds of MB through 4 KiB pages otherwise, and TLB
/// misses halve the bandwidth at 131K tokens.
pub fn advise_huge_pages<T>(ptr: *const T, len: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = ptr as usize;
        let end = start + len * std::mem::size_of::<T>();
        let a = start.div_ceil(HUGE) * HUGE;
        let b = end / HUGE * HUGE;
        if b > a {
            // SAFETY: the caller passes a range of one live allocation; MADV_HUGEPAGE only changes
            // how the kernel backs those pages, never their contents or validity.
            unsafe {
                libc::madvise(a as *mut libc::c_void, b - a, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}
