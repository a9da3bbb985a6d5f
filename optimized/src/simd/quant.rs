//! SPEC.md section 6, int8 and int4 records: expanding packed records (bitmap, f16 minimum
//! and scale, codes) to dense rotated rows of decoded values `m + code * s` (the product is
//! exact in f32 and the sum rounds once, so every path writes the same floats). The codes of
//! a record are first unpacked to one byte each (`avx2::quant::unpack_codes`; int4 is where
//! the work is), then placed at the bitmap's set bits.

use super::Path;
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
use mosaickv_spec::layout::{dequantize, read_code, record_quant};
use mosaickv_spec::{RecordLayout, ValueDtype};

/// Largest `r` the SIMD kernels unpack into their local code buffer; larger records take the
/// portable kernel.
pub const QUANT_SIMD_MAX_R: usize = 512;
/// Slack after the unpacked codes so that a kernel may load a whole register past the last one.
pub(crate) const CODE_SLACK: usize = 64;

/// The `r` codes of a quantized record's code bytes `v`, one byte each, into `out[..r]`.
pub(crate) fn unpack_codes_scalar(dtype: ValueDtype, v: &[u8], r: usize, out: &mut [u8]) {
    for (i, o) in out[..r].iter_mut().enumerate() {
        *o = read_code(dtype, v, i);
    }
}

impl Path {
    /// Expands `n` consecutive int8/int4 records (`layout`, `layout.record_bytes()` each,
    /// record 0 at `bytes[0]`) to dense rotated rows `[n][dp]` (`dp >= kept_dims`, a multiple
    /// of 8): `m + code * s` at the kept dims, 0 elsewhere. Records with `r` and `kept_dims` up
    /// to `QUANT_SIMD_MAX_R` take the path's kernel (any group size), larger ones the portable one.
    pub fn expand_records_q(
        self,
        bytes: &[u8],
        n: usize,
        layout: &RecordLayout,
        dp: usize,
        out: &mut [f32],
    ) {
        let rb = layout.record_bytes();
        let (bb, dt, r, g) = (
            layout.bitmap_bytes(),
            layout.kept_dims,
            layout.r,
            layout.group_size,
        );
        assert!(
            layout.dtype.is_quantized()
                && bytes.len() >= n * rb
                && out.len() >= n * dp
                && dp >= dt
                && dp % 8 == 0
                && bb % 4 == 0
        );
        #[cfg(target_arch = "x86_64")]
        if self != Path::Portable && r <= QUANT_SIMD_MAX_R && dt <= QUANT_SIMD_MAX_R {
            for t in 0..n {
                let rec = &bytes[t * rb..(t + 1) * rb];
                let row = &mut out[t * dp..(t + 1) * dp];
                // SAFETY: the path's features were detected; the record and row are in bounds
                // (asserted above) and the kernels read and write only inside them.
                unsafe {
                    if self == Path::Avx512 {
                        avx512::quant::expand_q(rec, layout, row)
                    } else {
                        avx2::quant::expand_q(rec, layout, row)
                    }
                }
            }
            return;
        }
        Path::Portable.ran();
        for t in 0..n {
            let rec = &bytes[t * rb..(t + 1) * rb];
            let row = &mut out[t * dp..(t + 1) * dp];
            row.fill(0.0);
            let p = record_quant(layout, rec);
            let v = &rec[layout.values_offset()..];
            let mut k = 0usize;
            for grp in 0..layout.groups() {
                if (rec[grp / 8] >> (grp % 8)) & 1 == 1 {
                    for dim in grp * g..(grp + 1) * g {
                        if k < r {
                            row[dim] = dequantize(p, read_code(layout.dtype, v, k));
                        }
                        k += 1;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode::pack_rotated;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Every SIMD expansion (AVX2, and AVX-512 where the machine has it) writes the portable
    /// kernel's floats bit for bit, for every group size the default policy uses, g = 8 and
    /// g = 4 with a truncated tail, head_dim 32, 64 and 128, `r` from 4 (fewer codes than one
    /// 8-byte load) to 81, int8 and int4.
    #[test]
    fn simd_expand_equals_portable_for_every_group_size() {
        let paths: Vec<Path> = [Path::Avx2, Path::Avx512]
            .into_iter()
            .filter(|p| p.runs_here())
            .collect();
        if paths.is_empty() {
            eprintln!("no AVX2 here: nothing to compare");
            return;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let n = 37usize;
        for dtype in [ValueDtype::Int8, ValueDtype::Int4] {
            for &(d, g, dt, r) in &[
                (64usize, 1usize, 64usize, 40usize),
                (64, 2, 64, 24),
                (64, 2, 64, 48),
                (64, 4, 48, 16),
                (64, 1, 64, 64),
                (64, 8, 64, 16),
                (64, 1, 64, 8),
                (32, 2, 32, 4),
                (128, 1, 128, 81),
                (128, 2, 128, 64),
                (128, 4, 96, 48),
            ] {
                let layout = RecordLayout {
                    head_dim: d,
                    kept_dims: dt,
                    r,
                    group_size: g,
                    dtype,
                };
                layout.validate().unwrap();
                let rows: Vec<f64> = (0..n * d).map(|_| rng.gen_range(-4.0..4.0)).collect();
                let packed = pack_rotated(&rows, d, &layout).unwrap();
                let dp = d;
                let mut slow = vec![2f32; n * dp];
                Path::Portable.expand_records_q(&packed.bytes, n, &layout, dp, &mut slow);
                for &path in &paths {
                    let mut fast = vec![1f32; n * dp];
                    path.expand_records_q(&packed.bytes, n, &layout, dp, &mut fast);
                    for (i, (a, b)) in fast.iter().zip(&slow).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{path:?} {layout:?} at {i}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}
