//! SPEC.md section 9's online softmax over one tile of logits: the running maximum and sum of
//! each query head, the logits turned into probabilities, the rescale factor of the
//! accumulators. Dispatch and the portable kernel; `avx2/softmax.rs`, `avx512/softmax.rs`.

#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
use super::{fast_exp, Path, TILE};

impl Path {
    /// SPEC 9's online softmax over one tile (the softmax half of `attention::online_update`) for `g` heads with running max `m`, sum `l`,
    /// accumulators `acc` (`[g][dp]`): logits become probabilities, the state is rescaled.
    /// With `corr` given, the accumulators are left alone (`acc` may be empty) and `corr[h]` gets
    /// the factor they must be scaled by before this tile's values are added. The 16-lane kernel
    /// on [`Path::Avx512`] (one register per head), the AVX2 kernel on [`Path::Avx2`], plain Rust
    /// on [`Path::Portable`] (so the forced-portable run tests it).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn online_softmax(
        self,
        m: &mut [f32],
        l: &mut [f32],
        acc: &mut [f32],
        g: usize,
        dp: usize,
        logits: &mut [f32],
        n: usize,
        mut corr: Option<&mut [f32]>,
    ) {
        #[cfg(target_arch = "x86_64")]
        if self != Path::Portable {
            assert!(
                m.len() >= g
                    && l.len() >= g
                    && (acc.len() >= g * dp || corr.as_ref().is_some_and(|c| c.len() >= g))
                    && logits.len() >= g * TILE
                    && n <= TILE
            );
            let mut local = [0f32; 64];
            if self == Path::Avx512 && (corr.is_some() || g <= local.len()) {
                let c = match corr.as_deref_mut() {
                    Some(c) => &mut c[..g],
                    None => &mut local[..g],
                };
                // SAFETY: AVX-512 detected; m, l, c hold g floats and logits g * TILE (asserted).
                unsafe {
                    avx512::softmax::tile_softmax(
                        m.as_mut_ptr(),
                        l.as_mut_ptr(),
                        g,
                        logits.as_mut_ptr(),
                        n,
                        c.as_mut_ptr(),
                    )
                };
                if corr.is_none() {
                    for (a, &c) in acc[..g * dp].chunks_exact_mut(dp.max(1)).zip(&local[..g]) {
                        if c != 1.0 {
                            a.iter_mut().for_each(|x| *x *= c);
                        }
                    }
                }
                return;
            }
            // SAFETY: a SIMD path means avx2/fma/f16c were detected; logits hold g * TILE floats
            // (asserted), other accesses are checked.
            unsafe { avx2::softmax::online_softmax(m, l, acc, g, dp, logits, n, corr) };
            return;
        }
        Path::Portable.ran();
        online_softmax_body(m, l, acc, g, dp, logits, n, corr)
    }
}

/// Written over fixed 16-wide arrays so the compiler vectorizes the max, the exps and the sum.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn online_softmax_body(
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
    g: usize,
    dp: usize,
    logits: &mut [f32],
    n: usize,
    mut corr_out: Option<&mut [f32]>,
) {
    for h in 0..g {
        let lg: &mut [f32; TILE] = (&mut logits[h * TILE..(h + 1) * TILE])
            .try_into()
            .expect("TILE logits");
        for x in lg[n..].iter_mut() {
            *x = f32::NEG_INFINITY;
        }
        let mut mx = [f32::NEG_INFINITY; 8];
        for i in 0..TILE {
            mx[i % 8] = if lg[i] > mx[i % 8] { lg[i] } else { mx[i % 8] };
        }
        let mt = mx.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let m_old = m[h];
        let m_new = m_old.max(mt);
        let corr = if m_old == f32::NEG_INFINITY {
            0.0
        } else {
            fast_exp(m_old - m_new)
        };
        let mut sums = [0f32; 8];
        for i in 0..TILE {
            let p = if lg[i] == f32::NEG_INFINITY {
                0.0
            } else {
                fast_exp(lg[i] - m_new)
            };
            lg[i] = p;
            sums[i % 8] += p;
        }
        let sum: f32 = sums.iter().sum();
        l[h] = l[h] * corr + sum;
        if let Some(c) = corr_out.as_deref_mut() {
            c[h] = corr;
        } else if corr != 1.0 {
            for a in &mut acc[h * dp..(h + 1) * dp] {
                *a *= corr;
            }
        }
        m[h] = m_new;
    }
}
