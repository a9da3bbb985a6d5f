//! SPEC.md section 8.1: the query rotation's f64 sums, four lanes, no FMA.

use crate::simd::path::Path;
use std::arch::x86_64::*;

/// `acc[j] += f64(R[i][j]) * f64(q[i])` over ascending i, 4 f64 lanes (mul then add, no
/// FMA: bit-identical to the portable loop and to the reference).
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
pub unsafe fn rotate_query_f64(rot: &[f32], d: usize, q: &[f32], acc: &mut [f64]) {
    Path::Avx2.ran();
    let dt = acc.len();
    let d4 = dt / 4 * 4;
    for i in 0..d {
        let qi = f64::from(q[i]);
        let qv = _mm256_set1_pd(qi);
        let row = rot.as_ptr().add(i * dt);
        let mut j = 0;
        while j < d4 {
            let a = acc.as_mut_ptr().add(j);
            let r = _mm256_cvtps_pd(_mm_loadu_ps(row.add(j)));
            _mm256_storeu_pd(a, _mm256_add_pd(_mm256_loadu_pd(a), _mm256_mul_pd(r, qv)));
            j += 4;
        }
        for j in d4..dt {
            acc[j] += f64::from(*row.add(j)) * qi;
        }
    }
}
