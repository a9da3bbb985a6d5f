//! SPEC.md sections 4-5: group importances and the per-vector top-r choice of kept groups
//! (most important first, ties by the lower index).

use half::f16;

/// SPEC 5 step 2: each group's importance, the f32 sum of its f16 values' squares in dim
/// order, into `imp`; returns the number of groups.
pub(crate) fn group_importances(y: &[f16], g: usize, imp: &mut [f32]) -> usize {
    importances_by(y.len(), g, imp, |j| y[j].to_f32())
}

/// [`group_importances`] of `n` values, value `j` (an f16, as f32: exact) given by `value`.
#[inline(always)]
pub(crate) fn importances_by(
    n: usize,
    g: usize,
    imp: &mut [f32],
    value: impl Fn(usize) -> f32,
) -> usize {
    let groups = n / g;
    for (k, s) in imp[..groups].iter_mut().enumerate() {
        let mut acc = 0f32;
        for j in k * g..(k + 1) * g {
            let f = value(j);
            acc += f * f;
        }
        *s = acc;
    }
    groups
}

/// SPEC 5 step 3's order of groups: higher importance first, ties to the lower index.
pub(crate) fn importance_order(imp: &[f32], a: &u16, b: &u16) -> std::cmp::Ordering {
    let (ia, ib) = (imp[*a as usize], imp[*b as usize]);
    ib.partial_cmp(&ia)
        .unwrap_or(std::cmp::Ordering::Equal)
        .then(a.cmp(b))
}

/// SPEC 5 steps 2-3: which groups a row keeps, from its f16-rounded rotated values `y` (length Dt).
/// Writes a keep flag per group into `keep`; `scratch` holds group indices.
pub(crate) fn select_groups(
    y: &[f16],
    g: usize,
    kept_groups: usize,
    imp: &mut [f32],
    order: &mut [u16],
    keep: &mut [bool],
) {
    let groups = group_importances(y, g, imp);
    if kept_groups >= groups {
        keep[..groups].fill(true);
        return;
    }
    for (k, o) in order.iter_mut().enumerate().take(groups) {
        *o = k as u16;
    }
    order[..groups].select_nth_unstable_by(kept_groups - 1, |a, b| importance_order(imp, a, b));
    keep[..groups].fill(false);
    for &k in &order[..kept_groups] {
        keep[k as usize] = true;
    }
}

/// SPEC 5 steps 2-3 for every kept-group count at once: the groups of a row's f16-rounded
/// rotated values (length Dt, given as their exact f64 values `yv`) ranked by importance,
/// most important first, ties by the lower index (the order [`select_groups`] uses). The
/// groups a record keeping `k` of them keeps are `order[..k]`: under this total order the `k`
/// largest form one set, the one `select_groups` finds.
///
/// The importances are sums of squares, so `+0` or positive (or NaN, only from a NaN value):
/// for those the order is that of the key `(!bits, index)`, sorted as integers, which is
/// what the comparator sort would give and several times cheaper; a NaN takes the comparator.
pub(crate) fn rank_groups(
    yv: &[f64],
    g: usize,
    imp: &mut [f32],
    order: &mut [u16],
    keys: &mut [u64],
) {
    // SPEC 5 step 2 from the f16 values held as f64 (`as f32` is exact for them).
    let groups = importances_by(yv.len(), g, imp, |j| yv[j] as f32);
    if imp[..groups].iter().all(|v| !v.is_nan()) {
        for (k, key) in keys[..groups].iter_mut().enumerate() {
            *key = (u64::from(!imp[k].to_bits()) << 16) | k as u64;
        }
        keys[..groups].sort_unstable();
        for (o, key) in order[..groups].iter_mut().zip(&keys[..groups]) {
            *o = *key as u16;
        }
        return;
    }
    for (k, o) in order[..groups].iter_mut().enumerate() {
        *o = k as u16;
    }
    order[..groups].sort_unstable_by(|a, b| importance_order(imp, a, b));
}
