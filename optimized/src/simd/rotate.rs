//! SPEC.md section 8.1: rotating the query into a segment's key coordinates, f64 sums in
//! the reference's order (bit-identical on every path).

use super::Path;
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
use half::f16;

/// Query rows whose f64 copies fit on the stack (four rows of a 256-dim head).
const STACK_F64: usize = 4 * 256;

impl Path {
    /// SPEC.md section 8.1 for `g` query rows (`q` `[g][d]`) on the stored f16 rotation
    /// (`rot`, `d x dt` row-major, `dt = rot.len() / d`): `out[h * stride + j] =
    /// f32(sum_i f64(R[i][j]) * f64(q_h[i]))` for `j < dt`, the sum over ascending i (product,
    /// then sum, or an FMA, which rounds the same since the f64 product of two f32 values is
    /// exact), as the reference computes it, so every path gives the same f32 values (the
    /// block score quantizes them). Nothing past `dt` in a row is written.
    ///
    /// The SIMD paths read the f16 elements in place, each widened once per block of columns
    /// for up to four rows (AVX-512) or two (AVX2); the portable loop is the formula itself.
    pub fn rotate_queries(
        self,
        rot: &[f16],
        d: usize,
        q: &[f32],
        g: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let dt = rot.len() / d.max(1);
        assert!(
            rot.len() == d * dt
                && dt <= d
                && q.len() >= g * d
                && dt <= stride
                && (g == 0 || out.len() >= (g - 1) * stride + dt)
        );
        // Rows per pass: four on AVX-512 (16 sums in 32 registers), two on AVX2, one portable.
        let per = match self {
            Path::Avx512 => 4,
            Path::Avx2 => 2,
            _ => 1,
        };
        // The pass's query rows widened to f64 once, and its sums.
        let mut stack = [0f64; 2 * STACK_F64];
        let mut heap = Vec::new();
        let buf: &mut [f64] = if per * d <= STACK_F64 {
            &mut stack[..2 * per * d]
        } else {
            heap.resize(2 * per * d, 0.0);
            &mut heap
        };
        let (qd, acc) = buf.split_at_mut(per * d);
        let mut h0 = 0;
        while h0 < g {
            let n = (g - h0).min(per);
            for (x, &y) in qd.iter_mut().zip(&q[h0 * d..(h0 + n) * d]) {
                *x = f64::from(y);
            }
            match self {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the path's features were detected; rot is d x dt f16, qd holds n
                // rows of d, acc holds per * d >= n * dt f64 (dt <= d, asserted above).
                Path::Avx512 | Path::Avx2 => unsafe {
                    use avx2::rotate::rotate_queries as r2;
                    use avx512::rotate::rotate_queries as r5;
                    let (rp, qp, ap) = (rot.as_ptr(), qd.as_ptr(), acc.as_mut_ptr());
                    match (self, n) {
                        (Path::Avx512, 1) => r5::<1>(rp, d, dt, qp, ap),
                        (Path::Avx512, 2) => r5::<2>(rp, d, dt, qp, ap),
                        (Path::Avx512, 3) => r5::<3>(rp, d, dt, qp, ap),
                        (Path::Avx512, _) => r5::<4>(rp, d, dt, qp, ap),
                        (_, 1) => r2::<1>(rp, d, dt, qp, ap),
                        _ => r2::<2>(rp, d, dt, qp, ap),
                    }
                },
                _ => {
                    Path::Portable.ran();
                    let acc = &mut acc[..dt];
                    acc.fill(0.0);
                    for (i, &qi) in qd[..d].iter().enumerate() {
                        for (a, r) in acc.iter_mut().zip(&rot[i * dt..(i + 1) * dt]) {
                            *a += f64::from(r.to_f32()) * qi;
                        }
                    }
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
    }
}
