//! SPEC.md section 3 step 1, incrementally: the open segment's covariance
//! `C += x x^T` accumulated flush by flush (f64, token order), bit-identical to
//! `rotation::covariance` over the same rows.

/// `C += sum_t x_t x_t^T` over rows `[n][d]`, lower triangle: for each row `a` of
/// `C` (kept in L1) the rows are added in token order, so every element sees
/// exactly the additions, in the order, of SPEC 3 step 1 (`rotation::covariance`).
#[inline(always)]
fn cov_add_body(c: &mut [f64], rows: &[f32], d: usize, xd: &mut [f64]) {
    for (o, &v) in xd.iter_mut().zip(rows) {
        *o = v as f64;
    }
    for a in 0..d {
        let ca = &mut c[a * d..a * d + a + 1];
        for x in xd.chunks_exact(d) {
            let xa = x[a];
            for (cb, &xb) in ca.iter_mut().zip(&x[..=a]) {
                *cb += xa * xb;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn cov_add_avx2(c: &mut [f64], rows: &[f32], d: usize, xd: &mut [f64]) {
    cov_add_body(c, rows, d, xd)
}

/// `C += x x^T` for every row of `rows` (`[n][d]`), in order, lower triangle only.
/// Bit-identical to accumulating the same rows with `rotation::covariance` (same
/// products, same order per element, no FMA contraction).
pub fn covariance_update(c: &mut [f64], rows: &[f32], d: usize) {
    let mut xd = vec![0f64; rows.len()];
    #[cfg(target_arch = "x86_64")]
    if crate::simd::Path::detect().runs_avx2() {
        // SAFETY: avx2 detected at run time; the body only uses bounds-checked slice access.
        unsafe { cov_add_avx2(c, rows, d, &mut xd) };
        return;
    }
    cov_add_body(c, rows, d, &mut xd);
}

/// The full symmetric matrix from its lower triangle (as `rotation::covariance` mirrors).
pub(super) fn mirrored(lower: &[f64], d: usize) -> Vec<f64> {
    let mut c = lower.to_vec();
    for a in 0..d {
        for b in a + 1..d {
            c[a * d + b] = c[b * d + a];
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rotation;

    #[test]
    fn covariance_update_matches_covariance() {
        let d = 16;
        let rows: Vec<f32> = (0..40 * d)
            .map(|i| ((i * 7919) % 113) as f32 / 17.0 - 3.0)
            .collect();
        let full = rotation::covariance(&rows, d);
        let mut c = vec![0f64; d * d];
        for chunk in rows.chunks(5 * d) {
            covariance_update(&mut c, chunk, d);
        }
        assert_eq!(mirrored(&c, d), full);
    }
}
