//! SPEC.md section 3: the per-segment rotation.

use nalgebra::{DMatrix, SymmetricEigen};
use ndarray::{Array2, ArrayView2};

/// SPEC.md section 3 step 1: `C = sum_i x_i x_i^T`, accumulated in f64 from
/// the f32 rows `[n, D]` (rows in ascending order, products widened first).
pub fn scatter_matrix(rows: ArrayView2<f32>) -> Array2<f64> {
    let d = rows.ncols();
    let mut c = Array2::<f64>::zeros((d, d));
    for row in rows.rows() {
        for i in 0..d {
            let xi = f64::from(row[i]);
            for j in i..d {
                c[[i, j]] += xi * f64::from(row[j]);
            }
        }
    }
    // C is symmetric: fill the lower triangle from the upper one.
    for i in 0..d {
        for j in 0..i {
            c[[i, j]] = c[[j, i]];
        }
    }
    c
}

/// SPEC.md section 3: the rotation `R` (columns = eigenvectors of
/// `C = X^T X`, eigenvalues descending) in f64, before rounding to f16.
///
/// 1. `C` from [`scatter_matrix`];
/// 2. nalgebra `SymmetricEigen`; eigenpairs ordered by eigenvalue descending
///    with a stable sort of the solver's output order;
/// 3. each eigenvector negated if needed so that its component of largest
///    magnitude is positive (lowest index wins a magnitude tie);
/// 4. `R[i][j]` = component i of eigenvector j.
///
/// No rows, or `C = 0`, gives `R = I`.
pub fn fit_rotation_f64(rows: ArrayView2<f32>) -> Array2<f64> {
    let d = rows.ncols();
    let c = scatter_matrix(rows);
    if c.iter().all(|&v| v == 0.0) {
        return Array2::eye(d);
    }
    let eig = SymmetricEigen::new(DMatrix::from_fn(d, d, |i, j| c[[i, j]]));
    let mut order: Vec<usize> = (0..d).collect();
    // `sort_by` is stable: equal eigenvalues keep the solver's order.
    order.sort_by(|&a, &b| eig.eigenvalues[b].total_cmp(&eig.eigenvalues[a]));
    let mut r = Array2::<f64>::zeros((d, d));
    for (col, &k) in order.iter().enumerate() {
        let v = eig.eigenvectors.column(k);
        let mut lead = 0;
        for i in 1..d {
            if v[i].abs() > v[lead].abs() {
                lead = i; // strict `>`: the lowest index wins a tie
            }
        }
        let sign = if v[lead] < 0.0 { -1.0 } else { 1.0 };
        for i in 0..d {
            r[[i, col]] = sign * v[i];
        }
    }
    r
}

/// SPEC.md section 3 step 4: `R` stored row-major as f16, each element rounded once from
/// f64 to nearest-even (`rotation[i * D + j] = R[i][j]`).
pub fn fit_rotation(rows: ArrayView2<f32>) -> Vec<half::f16> {
    fit_rotation_f64(rows)
        .iter()
        .map(|&v| crate::round::f16_from_f64(v))
        .collect()
}
