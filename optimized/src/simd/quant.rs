//! SPEC.md section 6, int8 and int4 records: expanding packed records (bitmap, f16 minimum
//! and scale, codes) to dense rotated rows of decoded values `m + code * s` (the product is
//! exact in f32 and the sum rounds once, so every path writes the same floats). The codes of
//! a record are first unpacked to one byte each (`avx2::quant::unpack_codes`; int4 is where
//! the work is), then placed at the bitmap's set bits.

#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
use super::{Path, TILE};
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

/// Most query heads per KV head [`Path::sparse_accumulate_q`] takes.
pub const SPARSE_MAX_HEADS: usize = 16;
/// Most 16-lane registers a kept group's slot spans (`g * heads <= 16 * SPARSE_MAX_CHUNKS`).
pub const SPARSE_MAX_CHUNKS: usize = 8;

/// The head-minor accumulator of the sparse value accumulation for one group size `g` and
/// `heads` query heads: one slot of whole 16-lane registers per group of `g` dims, lane `e <
/// g * heads` of a slot being dim `e / heads` of the group and head `e % heads`; the lanes past
/// that stay 0. Per register `c` of a slot: the first decoded value its lanes read (`vbase`),
/// each lane's value offset from it (`vidx`, < 16) and head (`hidx`), the live lanes (`live`).
#[derive(Clone, Debug)]
pub struct SparsePlan {
    pub g: usize,
    pub heads: usize,
    pub chunks: usize,
    pub vbase: [usize; SPARSE_MAX_CHUNKS],
    pub vidx: [[i32; 16]; SPARSE_MAX_CHUNKS],
    pub hidx: [[i32; 16]; SPARSE_MAX_CHUNKS],
    pub live: [u16; SPARSE_MAX_CHUNKS],
}

impl SparsePlan {
    /// The plan for group size `g` and `heads` heads, or `None` past the kernel's limits.
    pub fn new(g: usize, heads: usize) -> Option<Self> {
        let span = g * heads;
        if !(1..=SPARSE_MAX_HEADS).contains(&heads) || g == 0 || span > 16 * SPARSE_MAX_CHUNKS {
            return None;
        }
        let chunks = span.div_ceil(16);
        let mut plan = SparsePlan {
            g,
            heads,
            chunks,
            vbase: [0; SPARSE_MAX_CHUNKS],
            vidx: [[0; 16]; SPARSE_MAX_CHUNKS],
            hidx: [[0; 16]; SPARSE_MAX_CHUNKS],
            live: [0; SPARSE_MAX_CHUNKS],
        };
        for c in 0..chunks {
            plan.vbase[c] = 16 * c / heads;
            for l in 0..16 {
                let e = (16 * c + l).min(span - 1);
                plan.vidx[c][l] = (e / heads - plan.vbase[c]) as i32;
                plan.hidx[c][l] = (e % heads) as i32;
            }
            let lanes = (span - 16 * c).min(16);
            plan.live[c] = ((1u32 << lanes) - 1) as u16;
        }
        Some(plan)
    }

    /// Floats of one group's slot.
    #[inline]
    pub fn stride(&self) -> usize {
        16 * self.chunks
    }

    /// Floats of the accumulator for `kept_dims` dims.
    #[inline]
    pub fn len(&self, kept_dims: usize) -> usize {
        kept_dims.div_ceil(self.g) * self.stride()
    }

    /// Where dim `j`, head `h` lives in the accumulator.
    #[inline]
    pub fn at(&self, j: usize, h: usize) -> usize {
        (j / self.g) * self.stride() + (j % self.g) * self.heads + h
    }

    /// `acc_t *= corr[head]` lane by lane, when some factor is not 1: per element the
    /// multiply the dense path's rescale makes (which skips heads whose factor is 1, and `x *
    /// 1 = x`); dead lanes are 0 and stay 0.
    pub fn rescale(&self, acc_t: &mut [f32], corr: &[f32]) {
        if corr[..self.heads].iter().all(|&c| c == 1.0) {
            return;
        }
        let mut pattern = [[1f32; 16]; SPARSE_MAX_CHUNKS];
        for (c, pat) in pattern.iter_mut().enumerate().take(self.chunks) {
            for (l, x) in pat.iter_mut().enumerate() {
                *x = corr[self.hidx[c][l] as usize];
            }
        }
        for slot in acc_t.chunks_exact_mut(self.stride()) {
            for (reg, pat) in slot.chunks_exact_mut(16).zip(&pattern) {
                for (x, &c) in reg.iter_mut().zip(pat) {
                    *x *= c;
                }
            }
        }
    }
}

impl Path {
    /// Whether [`Path::sparse_accumulate_q`] takes value records of `layout` for `heads` query
    /// heads per KV head: the AVX-512 path, int8/int4 records that keep at most half of their
    /// `Dt` dims (past that, expanding every dim and multiplying it is as fast), and the
    /// kernel's limits on `heads` and on `g * heads`.
    #[inline]
    pub fn sparse_values(self, layout: &RecordLayout, heads: usize) -> bool {
        cfg!(target_arch = "x86_64")
            && self == Path::Avx512
            && layout.dtype.is_quantized()
            && layout.r <= QUANT_SIMD_MAX_R
            && 2 * layout.r <= layout.kept_dims
            && (1..=SPARSE_MAX_HEADS).contains(&heads)
            && layout.group_size * heads <= 16 * SPARSE_MAX_CHUNKS
    }

    /// SPEC.md section 9, value side, on packed int8/int4 records: `acc_t[plan.at(j, h)] +=
    /// p[h * TILE + t] * v_t[j]` for the kept dims `j` of the `n` records in `bytes` (token
    /// order, one FMA each). The same bits as expanding the records
    /// ([`Path::expand_records_q`]) and accumulating the expanded tile with FMAs. Only where
    /// [`Path::sparse_values`] holds, with `plan` made for the layout's group size.
    pub fn sparse_accumulate_q(
        self,
        p: &[f32],
        plan: &SparsePlan,
        bytes: &[u8],
        layout: &RecordLayout,
        n: usize,
        acc_t: &mut [f32],
    ) {
        assert!(
            self.sparse_values(layout, plan.heads)
                && plan.g == layout.group_size
                && n <= TILE
                && p.len() >= plan.heads * TILE
                && bytes.len() >= n * layout.record_bytes()
                && acc_t.len() >= plan.len(layout.kept_dims)
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `sparse_values` holds (AVX-512 detected, the kernel's limits) and the sizes
        // are asserted above; the kernel reads no bitmap bit past group Dt / g nor more than
        // r / g groups, so it writes inside `acc_t`.
        unsafe {
            avx512::quant::sparse_accumulate_q(
                p.as_ptr(),
                plan,
                bytes,
                layout,
                n,
                acc_t.as_mut_ptr(),
            )
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

    /// The sparse value accumulation gives the bits of expanding the records and
    /// accumulating the expanded tile (the dense path), for g = 1, 2, 4 and 8, 1 to 16 heads
    /// (spans of one to eight 16-lane chunks, uneven ones included), int8 and int4, over
    /// several tiles with accumulators that start nonzero.
    #[test]
    fn sparse_accumulate_equals_expand_then_accumulate() {
        if !Path::Avx512.runs_here() {
            eprintln!("no AVX-512 here: nothing to compare");
            return;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        let n = TILE;
        let mut cases = 0;
        for dtype in [ValueDtype::Int8, ValueDtype::Int4] {
            for &(d, g, dt, r, heads) in &[
                (64usize, 1usize, 64usize, 8usize, 3usize),
                (64, 4, 64, 16, 3),
                (64, 2, 48, 24, 6),
                (128, 4, 128, 16, 4),
                (128, 1, 128, 64, 4),
                (128, 4, 96, 48, 7),
                (128, 8, 128, 64, 16),
                (128, 2, 128, 32, 1),
                (32, 4, 32, 8, 5),
            ] {
                let layout = RecordLayout {
                    head_dim: d,
                    kept_dims: dt,
                    r,
                    group_size: g,
                    dtype,
                };
                layout.validate().unwrap();
                assert!(Path::Avx512.sparse_values(&layout, heads), "{layout:?}");
                let rows: Vec<f64> = (0..n * d).map(|_| rng.gen_range(-4.0..4.0)).collect();
                let packed = pack_rotated(&rows, d, &layout).unwrap();
                let p: Vec<f32> = (0..heads * TILE).map(|_| rng.gen_range(0.0..1.0)).collect();
                let dp = crate::attend::pad8(dt);
                // Dense: expanded tile, FMAs over every dim.
                let mut tile = vec![0f32; n * dp];
                Path::Avx512.expand_records_q(&packed.bytes, n, &layout, dp, &mut tile);
                let start: Vec<f32> = (0..heads * dp).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let mut dense = start.clone();
                let plan = SparsePlan::new(g, heads).unwrap();
                let mut sparse = vec![0f32; plan.len(dt)];
                for h in 0..heads {
                    for j in 0..dt {
                        sparse[plan.at(j, h)] = start[h * dp + j];
                    }
                }
                let corr: Vec<f32> = (0..heads)
                    .map(|h| if h % 2 == 0 { 1.0 } else { 0.75 })
                    .collect();
                for _tile in 0..3 {
                    // The dense path's rescale (online_softmax), then the tile's FMAs.
                    for (h, &c) in corr.iter().enumerate() {
                        if c != 1.0 {
                            dense[h * dp..(h + 1) * dp].iter_mut().for_each(|x| *x *= c);
                        }
                    }
                    plan.rescale(&mut sparse, &corr);
                    Path::Avx512.tile_accumulate(&p, heads, dp, &tile, n, &mut dense);
                    Path::Avx512.sparse_accumulate_q(
                        &p,
                        &plan,
                        &packed.bytes,
                        &layout,
                        n,
                        &mut sparse,
                    );
                }
                // Lanes past each slot's span stay 0.
                for (e, &x) in sparse.iter().enumerate() {
                    if e % plan.stride() >= g * heads {
                        assert_eq!(x.to_bits(), 0, "{layout:?} heads {heads} dead lane {e}");
                    }
                }
                for h in 0..heads {
                    for j in 0..dt {
                        let (a, b) = (sparse[plan.at(j, h)], dense[h * dp + j]);
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{layout:?} heads {heads} h {h} j {j}: {a} vs {b}"
                        );
                    }
                }
                cases += 1;
            }
        }
        assert_eq!(cases, 18);
    }
}
