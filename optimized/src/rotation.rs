//! SPEC.md section 3: the rotation fit (scatter matrix, eigenvectors, f16 storage) and the
//! f64 rotation of rows that SPEC 5 and the loss of SPEC 11 start from.
//!
//! Written for throughput but producing the spec's exact bytes: every f64 sum runs over the
//! same index in the same ascending order as the spec's definition, with separate multiply
//! and add (Rust never contracts to FMA).

use crate::round::f16_from_f64;
use half::f16;
use nalgebra::{DMatrix, SymmetricEigen};

/// SPEC 3 step 1: `C = sum_i x_i x_i^T` in f64, ascending i, `d x d` row-major.
pub fn covariance(rows: &[f32], d: usize) -> Vec<f64> {
    let mut c = vec![0f64; d * d];
    #[cfg(target_arch = "x86_64")]
    if crate::simd::Path::detect().runs_avx2() {
        // SAFETY: avx2 detected; the function only indexes within `rows` and `c`.
        unsafe { covariance_avx2(rows, d, &mut c) };
        mirror(&mut c, d);
        return c;
    }
    covariance_body(rows, d, &mut c);
    mirror(&mut c, d);
    c
}

#[inline(always)]
fn covariance_body(rows: &[f32], d: usize, c: &mut [f64]) {
    let mut x = vec![0f64; d];
    for row in rows.chunks_exact(d) {
        for (xi, &r) in x.iter_mut().zip(row) {
            *xi = r as f64;
        }
        for a in 0..d {
            let xa = x[a];
            let ca = &mut c[a * d..a * d + a + 1];
            for (cb, &xb) in ca.iter_mut().zip(&x[..=a]) {
                *cb += xa * xb;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn covariance_avx2(rows: &[f32], d: usize, c: &mut [f64]) {
    covariance_body(rows, d, c)
}

fn mirror(c: &mut [f64], d: usize) {
    for a in 0..d {
        for b in a + 1..d {
            c[a * d + b] = c[b * d + a];
        }
    }
}

/// SPEC 3 steps 2-4: eigenvectors of C sorted by eigenvalue descending (stable),
/// sign-normalized, as a row-major f16 `d x d` matrix (columns = eigenvectors), each
/// element rounded once from f64.
pub fn rotation_from_covariance(c: &[f64], d: usize) -> Vec<f16> {
    let mut r = vec![f16::ZERO; d * d];
    if c.iter().all(|&x| x == 0.0) {
        for i in 0..d {
            r[i * d + i] = f16::ONE;
        }
        return r;
    }
    let m = DMatrix::from_row_slice(d, d, c);
    let eig = SymmetricEigen::new(m);
    let vals = eig.eigenvalues;
    let vecs = eig.eigenvectors;
    let mut order: Vec<usize> = (0..d).collect();
    order.sort_by(|&a, &b| {
        vals[b]
            .partial_cmp(&vals[a])
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    for (j, &k) in order.iter().enumerate() {
        let col = vecs.column(k);
        let mut best = 0usize;
        for i in 1..d {
            if col[i].abs() > col[best].abs() {
                best = i;
            }
        }
        let s = if col[best] < 0.0 { -1.0 } else { 1.0 };
        for i in 0..d {
            r[i * d + j] = f16_from_f64(s * col[i]);
        }
    }
    r
}

/// SPEC 5 step 1 (and 11.1): `out[j] = sum_i R[i][j] x_i` in f64, ascending i, for `j < out.len()`.
/// `rot` is row-major `d x w` with `w = rot.len() / d` (`Dt` stored, `d` while fitting).
#[inline(always)]
fn rotate_f64_body(rot: &[f32], d: usize, x: &[f32], out: &mut [f64]) {
    let dims = out.len();
    let w = rot.len() / d;
    out.fill(0.0);
    for i in 0..d {
        let xi = x[i] as f64;
        let row = &rot[i * w..i * w + dims];
        for (o, &r) in out.iter_mut().zip(row) {
            *o += r as f64 * xi;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rotate_f64_avx2(rot: &[f32], d: usize, rows: &[f32], dims: usize, out: &mut [f64]) {
    for (x, o) in rows.chunks_exact(d).zip(out.chunks_exact_mut(dims)) {
        rotate_f64_body(rot, d, x, o);
    }
}

/// Rotates every row of `rows` (`[n][d]`) to its first `dims` rotated coordinates in f64.
/// `rot` is the stored f16 rotation widened to f32 (`spec::layout::rotation_f32`, exact),
/// once per call site rather than once per chunk of rows.
pub fn rotate_rows_f64(rot: &[f32], d: usize, rows: &[f32], dims: usize, out: &mut [f64]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::Path::detect().runs_avx2() {
        // SAFETY: avx2 detected; all indexing is bounds-checked slice access.
        unsafe { rotate_f64_avx2(rot, d, rows, dims, out) };
        return;
    }
    for (x, o) in rows.chunks_exact(d).zip(out.chunks_exact_mut(dims)) {
        rotate_f64_body(rot, d, x, o);
    }
}
