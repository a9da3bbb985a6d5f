//! SPEC.md section 12: Quest's page bound on f16 page metadata (f32; AVX2 and portable bit
//! for bit, AVX-512 within the conformance tolerance).

use super::common::{f16_bits_to_f32, reduce8};
use super::Path;
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
use half::f16;

impl Path {
    /// Quest's page bound on f16 page metadata (SPEC.md section 12): `sum_j max(q_j M_j, q_j m_j)`,
    /// max over the `g` query rows of `q` (`[g][stride]`, first `dt` entries used). `min`/`max`
    /// are `[pages][dt]`. Bit-identical across paths.
    pub fn score_pages_f16(
        self,
        q: &[f32],
        g: usize,
        stride: usize,
        dt: usize,
        min: &[f16],
        max: &[f16],
        out: &mut [f32],
    ) {
        let blocks = out.len();
        assert!(
            min.len() == blocks * dt
                && max.len() == blocks * dt
                && q.len() >= (g - 1) * stride + dt
        );
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: detected features; sizes asserted above.
            Path::Avx512 if dt <= avx512::pages::SCORE_MAX_DT => unsafe {
                avx512::pages::score_pages_f16(
                    q,
                    g,
                    stride,
                    dt,
                    min.as_ptr(),
                    max.as_ptr(),
                    None,
                    out,
                )
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: detected features; sizes asserted above.
            Path::Avx2 | Path::Avx512 => unsafe {
                avx2::pages::score_pages_f16(q, g, stride, dt, min, max, out)
            },
            _ => portable_score_pages_f16(q, g, stride, dt, min, max, out),
        }
    }
}

fn portable_score_pages_f16(
    q: &[f32],
    g: usize,
    stride: usize,
    dt: usize,
    min: &[f16],
    max: &[f16],
    out: &mut [f32],
) {
    Path::Portable.ran();
    let d8 = dt / 8 * 8;
    let mut mx = vec![0f32; dt];
    let mut mn = vec![0f32; dt];
    for (b, o) in out.iter_mut().enumerate() {
        for j in 0..dt {
            mx[j] = f16_bits_to_f32(max[b * dt + j].to_bits());
            mn[j] = f16_bits_to_f32(min[b * dt + j].to_bits());
        }
        let mut best = f32::NEG_INFINITY;
        for h in 0..g {
            let qh = &q[h * stride..h * stride + dt];
            let mut acc = [0f32; 8];
            for c in (0..d8).step_by(8) {
                for l in 0..8 {
                    let a = qh[c + l] * mx[c + l];
                    let bb = qh[c + l] * mn[c + l];
                    acc[l] += if a > bb { a } else { bb };
                }
            }
            let mut s = reduce8(&acc);
            for j in d8..dt {
                let a = qh[j] * mx[j];
                let bb = qh[j] * mn[j];
                s += if a > bb { a } else { bb };
            }
            if h == 0 || s > best {
                best = s;
            }
        }
        *o = best;
    }
}
