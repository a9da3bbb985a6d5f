//! SPEC.md section 6: expanding packed records (bitmap + f16 values) to dense rotated rows,
//! into f32 tiles ([`Path::expand_records`]) or, on the AVX-512 path, f16 tiles
//! ([`Path::expand_records_h`]).

use super::common::{f16_bits_to_f32, TILE};
use super::Path;
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
use half::f16;

/// Widest f16 key tile row ([`Path::half_tile`]).
pub const HALF_TILE_MAX_DP: usize = 128;

impl Path {
    /// Expands packed records (SPEC.md section 6, f16 values) to dense rotated rows
    /// `[n][dp]` (`dp >= kept_dims`, multiple of 8; zeros at dims not kept).
    /// `bytes` holds `n` consecutive records of `rb` bytes starting at record 0;
    /// `tail` bytes of readable slack follow them in the underlying buffer; each record's
    /// bitmap is `bb` bytes (whole little-endian u32 words), its values follow.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn expand_records(
        self,
        bytes: &[u8],
        tail: usize,
        n: usize,
        rb: usize,
        bb: usize,
        g: usize,
        dt: usize,
        r: usize,
        dp: usize,
        out: &mut [f32],
    ) {
        assert!(
            bytes.len() >= n * rb
                && out.len() >= n * dp
                && dp >= dt
                && dp % 8 == 0
                && bb % 4 == 0
                && 8 * bb >= dt.div_ceil(g)
                && bb + 2 * r <= rb
        );
        #[cfg(target_arch = "x86_64")]
        if self == Path::Avx512 && g == 1 && dp <= 32 * dt.div_ceil(32) {
            // SAFETY: AVX-512 detected; records, rows and the bitmap bytes read are in bounds
            // (asserted above and in the condition).
            unsafe {
                avx512::expand::expand_g1(bytes.as_ptr(), n, rb, bb, r, dt, dp, out.as_mut_ptr())
            };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self != Path::Portable && g == 1 {
            for t in 0..n {
                let rec = &bytes[t * rb..(t + 1) * rb];
                // Bytes readable after this record's values: the rest of the record, later records, slack.
                let after = (rb - bb - 2 * r) + (n - 1 - t) * rb + tail;
                // SAFETY: detected features; the record and `out` row are in bounds (asserted above).
                unsafe {
                    avx2::expand::expand_g1(rec, bb, r, dt, after, &mut out[t * dp..(t + 1) * dp])
                };
            }
            return;
        }
        Path::Portable.ran();
        for t in 0..n {
            let rec = &bytes[t * rb..(t + 1) * rb];
            let row = &mut out[t * dp..(t + 1) * dp];
            row.fill(0.0);
            let mut k = 0usize;
            let vals = &rec[bb..bb + 2 * r];
            for w in 0..bb / 4 {
                let mut bits =
                    u32::from_le_bytes(rec[4 * w..4 * w + 4].try_into().expect("4 bytes"));
                while bits != 0 {
                    let grp = 32 * w + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    for e in 0..g {
                        if k >= r {
                            break;
                        }
                        let dim = grp * g + e;
                        if dim < dt {
                            row[dim] =
                                f16_bits_to_f32(u16::from_le_bytes([vals[2 * k], vals[2 * k + 1]]));
                        }
                        k += 1;
                    }
                }
            }
        }
    }

    /// Whether keys of this geometry go through an f16 tile ([`Path::expand_records_h`] then
    /// [`Path::tile_logits_h`]): the AVX-512 path, g = 1 records with `r <= 32` and rows of
    /// whole 32-dim words (`dp = 32 * ceil(dt / 32) <= HALF_TILE_MAX_DP`). The expanded values
    /// are f16 anyway, so the tile holds exactly what an f32 tile holds in half the bytes (one
    /// 64-byte store per 32 dims instead of two conversions and two stores): -3.6 % per 131K
    /// decode step in an in-process A/B.
    #[inline]
    pub fn half_tile(self, group_size: usize, dt: usize, r: usize, dp: usize) -> bool {
        self == Path::Avx512
            && group_size == 1
            && r <= 32
            && dt > 0
            && dp == 32 * dt.div_ceil(32)
            && dp <= HALF_TILE_MAX_DP
    }

    /// [`Path::expand_records`] (g = 1) into f16 rows of `dp` halves. Only where
    /// [`Path::half_tile`] holds.
    #[inline]
    pub fn expand_records_h(
        self,
        records: (&[u8], usize, usize),
        n: usize,
        dt: usize,
        r: usize,
        dp: usize,
        out: &mut [f16],
    ) {
        let (bytes, rb, bb) = records;
        assert!(
            self.half_tile(1, dt, r, dp)
                && n <= TILE
                && bytes.len() >= n * rb
                && bb >= dp / 8
                && bb + 2 * r <= rb
                && out.len() >= n * dp
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512 detected (half_tile); records and rows in bounds (asserted above).
        unsafe {
            avx512::expand::expand_g1_h(bytes.as_ptr(), n, rb, bb, r, dp / 32, out.as_mut_ptr())
        }
    }
}
