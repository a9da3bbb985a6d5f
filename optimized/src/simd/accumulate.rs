//! SPEC.md section 9, value side: `acc_h += sum_t p_ht v_t` over a tile, on expanded f32
//! tiles, stored f16 rows or (AVX-512) packed value records expanded in registers.

use super::common::TILE;
use super::Path;
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
use half::f16;

impl Path {
    /// `acc_h += sum_t p[h*TILE + t] * rows_t` for `h < g`; acc is `[g][dp]`.
    #[inline]
    pub fn tile_accumulate(
        self,
        p: &[f32],
        g: usize,
        dp: usize,
        rows: &[f32],
        n: usize,
        acc: &mut [f32],
    ) {
        assert!(
            acc.len() >= g * dp
                && rows.len() >= n * dp
                && p.len() >= g * TILE
                && n <= TILE
                && dp % 8 == 0
        );
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: detected features; sizes asserted above.
            Path::Avx2 | Path::Avx512 => unsafe {
                avx2::tiles::tile_accumulate(p, g, dp, rows, n, acc)
            },
            _ => {
                Path::Portable.ran();
                for h in 0..g {
                    let a = &mut acc[h * dp..(h + 1) * dp];
                    for t in 0..n {
                        let pt = p[h * TILE + t];
                        for (x, &v) in a.iter_mut().zip(&rows[t * dp..(t + 1) * dp]) {
                            *x += pt * v;
                        }
                    }
                }
            }
        }
    }

    /// Whether the fused f16-row tile kernels apply (SIMD paths, `d` a multiple of 8).
    #[inline]
    pub fn fused_f16(self, d: usize) -> bool {
        self != Path::Portable && d % 8 == 0
    }

    /// [`Path::tile_accumulate`] reading f16 rows directly. Only when [`Path::fused_f16`] holds.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn tile_accumulate_f16(
        self,
        p: &[f32],
        g: usize,
        dp: usize,
        rows: &[f16],
        stride: usize,
        n: usize,
        acc: &mut [f32],
    ) {
        assert!(
            self.fused_f16(dp)
                && n <= TILE
                && (n == 0 || rows.len() >= (n - 1) * stride + dp)
                && acc.len() >= g * dp
                && p.len() >= g * TILE
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in tile_logits_f16.
        unsafe {
            // Rows in order, accumulators in registers: slower on L1-resident rows (13.5 vs
            // 9.7 ns per token) but dense decode at 131K tokens 14 % and Quest 9.5 % faster
            // (in-process A/B): streamed rows want to be read in address order.
            if self == Path::Avx512 && dp <= 128 {
                avx512::accumulate::tile_accumulate_f16(
                    p.as_ptr(),
                    g,
                    dp,
                    rows.as_ptr(),
                    stride,
                    n,
                    acc.as_mut_ptr(),
                )
            } else {
                avx2::tiles::tile_accumulate_f16(p, g, dp, rows.as_ptr(), stride, n, acc)
            }
        }
    }

    /// Whether [`Path::packed_accumulate`] applies: the AVX-512 path,
    /// g = 1 bitmaps, `r <= 32` values, `Dt <= 128`, tile rows `dp <= 32 * ceil(Dt / 32)`.
    #[inline]
    pub fn fused_packed(self, group_size: usize, dt: usize, r: usize, dp: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self == Path::Avx512
                && group_size == 1
                && r <= 32
                && (1..=32 * avx512::accumulate::FUSED_MAX_GROUPS).contains(&dt)
                && (dt..=32 * dt.div_ceil(32)).contains(&dp)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (group_size, dt, r, dp);
            false
        }
    }

    /// `acc_h = corr[h] * acc_h` (the online-softmax rescale), then [`Path::expand_records`]
    /// (g = 1) followed by [`Path::tile_accumulate`], the values expanded in registers;
    /// bit-identical to the rescale and AVX2 tile accumulation. Only where
    /// [`Path::fused_packed`] holds.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn packed_accumulate(
        self,
        p: &[f32],
        g: usize,
        dp: usize,
        records: (&[u8], usize, usize),
        n: usize,
        dt: usize,
        r: usize,
        corr: &[f32],
        acc: &mut [f32],
    ) {
        let (bytes, rb, bb) = records;
        assert!(
            self.fused_packed(1, dt, r, dp)
                && n <= TILE
                && bytes.len() >= n * rb
                && bb >= 4 * dt.div_ceil(32)
                && bb + 2 * r <= rb
                && p.len() >= g * TILE
                && corr.len() >= g
                && acc.len() >= g * dp
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512 detected (fused_packed); geometry and lengths asserted above.
        unsafe {
            avx512::accumulate::packed_accumulate(
                p.as_ptr(),
                g,
                dp,
                dt.div_ceil(32),
                bytes.as_ptr(),
                n,
                rb,
                bb,
                r,
                corr.as_ptr(),
                acc.as_mut_ptr(),
            )
        }
    }
}
