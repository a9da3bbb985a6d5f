//! SPEC.md sections 4 (channel truncation) and 5 (per-vector top-r).

use crate::round::f16_from_f64;
use half::f16;
use mosaickv_spec::RecordLayout;

/// SPEC.md section 5 step 1 (before f16 rounding), over the rotation's
/// columns: `x'_j = sum_i R[i][j] * x_i`, f64, ascending i, R's f16 values
/// widened. `rotation` is row-major `D x W` (`W = rotation.len() / D`: `Dt`
/// for a stored strategy, `D` for the full R while fitting).
pub fn rotate_row_f64(row: &[f32], rotation: &[f16]) -> Vec<f64> {
    let d = row.len();
    let w = rotation.len() / d.max(1);
    let mut out = vec![0.0f64; w];
    for i in 0..d {
        let xi = f64::from(row[i]);
        for j in 0..w {
            // For each j the terms are added in ascending i, as SPEC.md says.
            out[j] += rotation[i * w + j].to_f64() * xi;
        }
    }
    out
}

/// SPEC.md section 5 step 1: `y_j = f16(x'_j)` for `j < Dt`.
pub fn round_kept(rotated: &[f64], kept_dims: usize) -> Vec<f16> {
    rotated[..kept_dims]
        .iter()
        .map(|&v| f16_from_f64(v))
        .collect()
}

/// SPEC.md section 5 step 2: `I_k = sum_{j in group k} f32(y_j)^2`, f32, ascending j.
pub fn group_importance(y: &[f16], group_size: usize) -> Vec<f32> {
    let groups = y.len() / group_size;
    let mut imp = vec![0.0f32; groups];
    for k in 0..groups {
        for j in k * group_size..(k + 1) * group_size {
            let v = y[j].to_f32();
            imp[k] += v * v;
        }
    }
    imp
}

/// SPEC.md section 5 step 3: which groups are kept — the `kept_groups`
/// largest importances, ties to the lower group index.
pub fn top_groups(importance: &[f32], kept_groups: usize) -> Vec<bool> {
    let mut order: Vec<usize> = (0..importance.len()).collect();
    // Stable sort by importance descending: equal importances stay in ascending index order.
    order.sort_by(|&a, &b| importance[b].total_cmp(&importance[a]));
    let mut kept = vec![false; importance.len()];
    for &k in order.iter().take(kept_groups) {
        kept[k] = true;
    }
    kept
}

/// SPEC.md section 5, steps 1-3 for one rotated row: the f16 values `y`
/// of dims `0..Dt` and the kept-group mask.
pub fn select_row(rotated: &[f64], layout: &RecordLayout) -> (Vec<f16>, Vec<bool>) {
    let y = round_kept(rotated, layout.kept_dims);
    let imp = group_importance(&y, layout.group_size);
    let kept = top_groups(&imp, layout.kept_groups());
    (y, kept)
}
