//! SPEC.md section 8.1: rotating the query into a segment's key coordinates, f64 sums in
//! the reference's order (bit-identical on every path).

use super::score::QMAX_DT;
use super::Path;
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
use half::f16;

impl Path {
    /// SPEC.md section 8.1: `out[j] = f32(sum_i R[i][j] * q[i])` for `j < out.len()`, the sum
    /// in f64 over ascending i (product, then sum, or an FMA, which rounds the same since the
    /// f64 product of two f32 values is exact), as the reference computes it, so
    /// every path gives the same f32 values (the block score quantizes them). `rot` is the
    /// stored `d x dt` row-major rotation (`dt = out.len()`).
    #[inline]
    pub fn rotate_query(self, rot: &[f32], d: usize, q: &[f32], out: &mut [f32]) {
        let dt = out.len();
        assert!(rot.len() == d * dt && q.len() >= d && dt <= d);
        let mut stack = [0f64; QMAX_DT];
        let mut heap = Vec::new();
        let acc: &mut [f64] = if dt <= QMAX_DT {
            &mut stack[..dt]
        } else {
            heap.resize(dt, 0.0);
            &mut heap
        };
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: detected features; slice bounds asserted above.
            Path::Avx512 => unsafe {
                avx512::rotate::rotate_queries_f64::<1>(rot, d, dt, q.as_ptr(), acc.as_mut_ptr())
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: detected features; slice bounds asserted above.
            Path::Avx2 => unsafe { avx2::rotate::rotate_query_f64(rot, d, q, acc) },
            _ => {
                Path::Portable.ran();
                for i in 0..d {
                    let qi = f64::from(q[i]);
                    for (a, &r) in acc.iter_mut().zip(&rot[i * dt..(i + 1) * dt]) {
                        *a += f64::from(r) * qi;
                    }
                }
            }
        }
        for (o, &a) in out.iter_mut().zip(acc.iter()) {
            *o = a as f32;
        }
    }

    /// [`Path::rotate_query`] for `g` query rows (`q` `[g][d]`) into `out` rows `stride` apart
    /// (`out[h * stride ..][..dt]`, `dt = rot.len() / d`); the same f32 values row by row.
    pub fn rotate_queries(
        self,
        rot: &[f32],
        d: usize,
        q: &[f32],
        g: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let dt = rot.len() / d.max(1);
        assert!(
            rot.len() == d * dt
                && q.len() >= g * d
                && dt <= stride
                && (g == 0 || out.len() >= (g - 1) * stride + dt)
        );
        #[cfg(target_arch = "x86_64")]
        if self == Path::Avx512 && dt <= QMAX_DT {
            let mut acc = [0f64; 4 * QMAX_DT];
            let mut h0 = 0;
            while h0 < g {
                let n = (g - h0).min(4);
                let qp = q[h0 * d..].as_ptr();
                // SAFETY: AVX-512 detected; rot is d x dt, q holds n rows of d from h0, acc
                // holds 4 * QMAX_DT >= n * dt (all asserted above).
                unsafe {
                    use avx512::rotate::rotate_queries_f64 as rq;
                    let ap = acc.as_mut_ptr();
                    match n {
                        1 => rq::<1>(rot, d, dt, qp, ap),
                        2 => rq::<2>(rot, d, dt, qp, ap),
                        3 => rq::<3>(rot, d, dt, qp, ap),
                        _ => rq::<4>(rot, d, dt, qp, ap),
                    }
                }
                for k in 0..n {
                    let o = &mut out[(h0 + k) * stride..][..dt];
                    for (o, &a) in o.iter_mut().zip(&acc[k * dt..(k + 1) * dt]) {
                        *o = a as f32;
                    }
                }
                h0 += n;
            }
            return;
        }
        for h in 0..g {
            self.rotate_query(rot, d, &q[h * d..(h + 1) * d], &mut out[h * stride..][..dt]);
        }
    }
    /// [`Path::rotate_queries`] on the stored f16 rotation (`d x dt` row-major, `dt =
    /// rot.len() / d`): the same f32 values. The SIMD paths read the f16 elements in place
    /// (widened exactly, each once per block of columns for all the rows); the portable path
    /// widens the rotation into `scratch` first.
    #[allow(clippy::too_many_arguments)]
    pub fn rotate_queries_f16(
        self,
        rot: &[f16],
        d: usize,
        q: &[f32],
        g: usize,
        out: &mut [f32],
        stride: usize,
        scratch: &mut Vec<f32>,
    ) {
        let dt = rot.len() / d.max(1);
        assert!(
            rot.len() == d * dt
                && q.len() >= g * d
                && dt <= stride
                && (g == 0 || out.len() >= (g - 1) * stride + dt)
        );
        #[cfg(target_arch = "x86_64")]
        if self != Path::Portable && d <= avx2::rotate::ROTATE_F16_MAX_D {
            // Rows per pass: four on AVX-512 (16 sums in 32 registers), two on AVX2.
            let per = if self == Path::Avx512 { 4 } else { 2 };
            let mut stack = [0f64; 4 * QMAX_DT];
            let mut heap = Vec::new();
            let acc: &mut [f64] = if per * dt <= stack.len() {
                &mut stack[..per * dt]
            } else {
                heap.resize(per * dt, 0.0);
                &mut heap
            };
            let mut h0 = 0;
            while h0 < g {
                let n = (g - h0).min(per);
                let qp = q[h0 * d..].as_ptr();
                let (rp, ap) = (rot.as_ptr(), acc.as_mut_ptr());
                // SAFETY: the path's features were detected; rot is d x dt f16, q holds n rows
                // of d from h0, acc holds per * dt >= n * dt f64, d <= ROTATE_F16_MAX_D (both
                // layers' limit).
                unsafe {
                    use avx2::rotate::rotate_queries_f16 as r2;
                    use avx512::rotate::rotate_queries_f16 as r5;
                    match (self, n) {
                        (Path::Avx512, 1) => r5::<1>(rp, d, dt, qp, ap),
                        (Path::Avx512, 2) => r5::<2>(rp, d, dt, qp, ap),
                        (Path::Avx512, 3) => r5::<3>(rp, d, dt, qp, ap),
                        (Path::Avx512, _) => r5::<4>(rp, d, dt, qp, ap),
                        (_, 1) => r2::<1>(rp, d, dt, qp, ap),
                        _ => r2::<2>(rp, d, dt, qp, ap),
                    }
                }
                for k in 0..n {
                    let o = &mut out[(h0 + k) * stride..][..dt];
                    for (o, &a) in o.iter_mut().zip(&acc[k * dt..(k + 1) * dt]) {
                        *o = a as f32;
                    }
                }
                h0 += n;
            }
            return;
        }
        mosaickv_spec::layout::widen_rotation(rot, scratch);
        self.rotate_queries(scratch, d, q, g, out, stride);
    }
}
