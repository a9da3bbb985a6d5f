//! SPEC.md section 9, key side: the logits `scale * q . k` of a tile of rows, on expanded f32
//! tiles, stored f16 rows or (AVX-512) f16 tiles; and the plain f32 dot product.

use super::common::{reduce8, TILE};
use super::Path;
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
use half::f16;

impl Path {
    /// `out[h*TILE + t] = scale * (q_h . rows_t)` for `t < n`, `h < g`; `q` is `[g][dp]`, rows `[n][dp]`.
    #[inline]
    pub fn tile_logits(
        self,
        q: &[f32],
        g: usize,
        dp: usize,
        rows: &[f32],
        n: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        assert!(
            q.len() >= g * dp
                && rows.len() >= n * dp
                && out.len() >= g * TILE
                && n <= TILE
                && dp % 8 == 0
        );
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: detected features; sizes asserted above.
            Path::Avx512 => unsafe {
                avx512::logits::tile_logits(
                    q.as_ptr(),
                    g,
                    dp,
                    rows.as_ptr(),
                    dp,
                    n,
                    scale,
                    out.as_mut_ptr(),
                )
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: detected features; sizes asserted above.
            Path::Avx2 => unsafe { avx2::tiles::tile_logits(q, g, dp, rows, n, scale, out) },
            _ => {
                for h in 0..g {
                    for t in 0..n {
                        out[h * TILE + t] =
                            scale * dot8(&q[h * dp..(h + 1) * dp], &rows[t * dp..(t + 1) * dp]);
                    }
                }
            }
        }
    }

    /// [`Path::tile_logits`] reading f16 rows `rows[t * stride ..][..dp]` directly. Only when
    /// [`Path::fused_f16`] holds.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn tile_logits_f16(
        self,
        q: &[f32],
        g: usize,
        dp: usize,
        rows: &[f16],
        stride: usize,
        n: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        assert!(
            self.fused_f16(dp)
                && n <= TILE
                && (n == 0 || rows.len() >= (n - 1) * stride + dp)
                && q.len() >= g * dp
                && out.len() >= g * TILE
        );
        // The AVX-512 path too: a 16-lane, four-token version (as `avx512::tile_logits`) was
        // faster on L1-resident rows (11.4 vs 12.6 ns per token in `kernel_cost`) but not on
        // streamed rows: dense decode at 131K tokens 24 % slower with the column-ordered value
        // accumulation, 2.5 % slower with the row-ordered one; one- and two-token versions were
        // slower still (in-process A/B, docs/PERFORMANCE-HISTORY.md).
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx2/fma/f16c detected (fused_f16); every row read lies inside `rows` (asserted).
        unsafe {
            avx2::tiles::tile_logits_f16(q, g, dp, rows.as_ptr(), stride, n, scale, out)
        }
    }

    /// [`Path::tile_logits`] on an f16 tile (`n` rows of `dp` halves). Only where
    /// [`Path::half_tile`] holds for the tile's geometry.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn tile_logits_h(
        self,
        q: &[f32],
        g: usize,
        dp: usize,
        rows: &[f16],
        n: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        assert!(
            self == Path::Avx512
                && n <= TILE
                && rows.len() >= n * dp
                && q.len() >= g * dp
                && out.len() >= g * TILE
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512 detected; sizes asserted above.
        unsafe {
            let (qp, op) = (q.as_ptr(), out.as_mut_ptr());
            avx512::logits::tile_logits(qp, g, dp, rows.as_ptr(), dp, n, scale, op)
        }
    }

    /// `sum_i a_i b_i` (f32; FMA on the AVX2 path).
    #[inline]
    pub fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: detected features; equal lengths asserted.
            Path::Avx2 | Path::Avx512 => unsafe { avx2::tiles::dot(a, b) },
            _ => dot8(a, b),
        }
    }
}

impl Path {
    /// SPEC 9's back-rotation of `g` heads' value sums: `out[k * os + i] += dot(R[i],
    /// acc[k * as_ ..][..dt])` for the rows `i < d` of the stored f16 rotation `rot` (`d x dt`),
    /// each head's dot as [`Path::dot`] computes it on the widened row (the same bits). The
    /// SIMD paths read the f16 rows in place, each once per four heads; otherwise the
    /// rotation is widened into `scratch` first.
    #[allow(clippy::too_many_arguments)]
    pub fn back_rotate_f16(
        self,
        rot: &[f16],
        d: usize,
        acc: &[f32],
        as_: usize,
        g: usize,
        out: &mut [f32],
        os: usize,
        scratch: &mut Vec<f32>,
    ) {
        let dt = rot.len() / d.max(1);
        assert!(
            rot.len() == d * dt
                && (g == 0 || (acc.len() >= (g - 1) * as_ + dt && out.len() >= (g - 1) * os + d))
        );
        #[cfg(target_arch = "x86_64")]
        if self != Path::Portable {
            // SAFETY: a SIMD path has AVX2/FMA/F16C; sizes asserted above.
            unsafe {
                avx2::tiles::back_rotate_f16(
                    rot.as_ptr(),
                    d,
                    dt,
                    acc.as_ptr(),
                    as_,
                    g,
                    out.as_mut_ptr(),
                    os,
                )
            };
            return;
        }
        mosaickv_spec::layout::widen_rotation(rot, scratch);
        for k in 0..g {
            let a = &acc[k * as_..k * as_ + dt];
            for (i, o) in out[k * os..k * os + d].iter_mut().enumerate() {
                *o += self.dot(&scratch[i * dt..(i + 1) * dt], a);
            }
        }
    }
}

/// 8-lane dot product, lanes reduced in a fixed tree (portable).
#[inline]
fn dot8(a: &[f32], b: &[f32]) -> f32 {
    Path::Portable.ran();
    let n8 = a.len() / 8 * 8;
    let mut acc = [0f32; 8];
    for (ca, cb) in a[..n8].chunks_exact(8).zip(b[..n8].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut s = reduce8(&acc);
    for i in n8..a.len() {
        s += a[i] * b[i];
    }
    s
}
