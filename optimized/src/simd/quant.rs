//! SPEC.md section 6, int8 and int4 records: expanding packed records (bitmap, f16 minimum
//! and scale, codes) to dense rotated rows of decoded values `m + code * s` (the product is
//! exact in f32 and the sum rounds once, so every path writes the same floats). The codes of
//! a record are first unpacked to one byte each (`avx2::quant::unpack_codes`; int4 is where
//! the work is), then placed at the bitmap's set bits.

use super::codes::{SparsePlan, QUANT_SIMD_MAX_R, SPARSE_MAX_CHUNKS, SPARSE_MAX_HEADS};
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
use super::{Path, TILE};
use mosaickv_spec::layout::{dequantize, key_logit_q8, read_code, record_quant};
use mosaickv_spec::{RecordLayout, ValueDtype};

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

impl Path {
    /// Whether [`Path::sparse_accumulate_q`] takes value records of `layout` for `heads` query
    /// heads per KV head: records that keep at most half of their `Dt` dims (past that,
    /// expanding every dim and multiplying it is as fast), within the kernels' limits. AVX-512:
    /// int8/int4 records (its f16 records of `g` 1 take the fused kernel,
    /// [`Path::packed_accumulate`]), up to 16 heads and `g * heads <= 128`; AVX2: int8/int4
    /// records of `g <= 8` and f16 records of `2 <= g <= 8`, up to 8 heads.
    #[inline]
    pub fn sparse_values(self, layout: &RecordLayout, heads: usize) -> bool {
        let sparse = layout.r <= QUANT_SIMD_MAX_R && 2 * layout.r <= layout.kept_dims;
        cfg!(target_arch = "x86_64")
            && sparse
            && match self {
                Path::Avx512 => {
                    layout.dtype.is_quantized()
                        && (1..=SPARSE_MAX_HEADS).contains(&heads)
                        && layout.group_size * heads <= 16 * SPARSE_MAX_CHUNKS
                }
                // (f16 records of g = 1: a read-modify-write of a register per kept dim costs
                // more than the dense tile's FMAs on their exact widening; kernel_cost,
                // PERFORMANCE.md section 1)
                Path::Avx2 => {
                    let g = layout.group_size;
                    (1..=8).contains(&heads)
                        && (1..=8).contains(&g)
                        && (layout.dtype.is_quantized()
                            || (layout.dtype == ValueDtype::F16 && g >= 2))
                }
                _ => false,
            }
    }

    /// The head-minor accumulator's plan for [`Path::sparse_accumulate_q`] on value records of
    /// `layout` and `heads` heads (registers of 16 floats on AVX-512, 8 on AVX2), or `None`
    /// where [`Path::sparse_values`] does not hold.
    pub fn sparse_plan(self, layout: &RecordLayout, heads: usize) -> Option<SparsePlan> {
        if !self.sparse_values(layout, heads) {
            return None;
        }
        let lanes = if self == Path::Avx512 { 16 } else { 8 };
        SparsePlan::new(layout.group_size, heads, lanes)
    }

    /// SPEC.md section 9, value side, on packed records at their kept dims only:
    /// `acc_t[plan.at(j, h)] += p[h * TILE + t] * v_t[j]` for the kept dims `j` of the `n`
    /// records in `bytes` (token order, one FMA each), `v_t[j]` the record's decoded value
    /// (`m + code * s` for int8/int4, the f16 widened). The same bits as expanding the records
    /// ([`Path::expand_records_q`], [`Path::expand_records`]) and accumulating the expanded tile
    /// with FMAs. Only where [`Path::sparse_values`] holds, with the plan of
    /// [`Path::sparse_plan`].
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
                && plan.lanes == if self == Path::Avx512 { 16 } else { 8 }
                && n <= TILE
                && p.len() >= plan.heads * TILE
                && bytes.len() >= n * layout.record_bytes()
                && acc_t.len() >= plan.len(layout.kept_dims)
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `sparse_values` holds (the path's features detected, the kernel's limits)
        // and the sizes are asserted above; the kernels read no bitmap bit past group Dt / g
        // nor more than r / g groups, so they write inside `acc_t`.
        unsafe {
            if self == Path::Avx512 {
                avx512::quant::sparse_accumulate_q(
                    p.as_ptr(),
                    plan,
                    bytes,
                    layout,
                    n,
                    acc_t.as_mut_ptr(),
                )
            } else {
                avx2::quant::sparse_accumulate(
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
}

/// Bytes per query head of the int8 queries [`Path::key_logits_q8`] reads: `Dt` rounded up
/// to 64 (whole 64-byte loads on AVX-512), zero past `Dt`.
#[inline]
pub fn q8_stride(kept_dims: usize) -> usize {
    kept_dims.div_ceil(64).max(1) * 64
}

impl Path {
    /// SPEC.md section 9, logits on int8/int4 key records against the int8 query of section
    /// 8.2: for the `n <= TILE` records in `bytes` (`layout`, record 0 at `bytes[0]`) and `g`
    /// query heads, `out[h * TILE + t] = f32((s_q[h] * (s * I_c + m * I_k)) * inv_sqrt_d)`,
    /// `I_c = sum_kept a_hj c_j`, `I_k = sum_kept a_hj`, with `a_hj = q8[h * qs + j]` (`qs` =
    /// [`q8_stride`]`(Dt)`, zero past `Dt`) and `s_q[h] = sq[h]` from
    /// [`super::score::quantize_query_i8`]. The sums are exact integers and the epilogue is
    /// `spec::layout::key_logit_q8`'s, so every path writes the same bits. AVX-512:
    /// `vpdpbusd` on the codes placed by `vpexpandb`; AVX2: `vpmaddwd` on codes placed by
    /// `pshufb`; portable (and records past `QUANT_SIMD_MAX_R`): integer loops.
    #[allow(clippy::too_many_arguments)]
    pub fn key_logits_q8(
        self,
        q8: &[i8],
        qs: usize,
        sq: &[f64],
        g: usize,
        bytes: &[u8],
        layout: &RecordLayout,
        n: usize,
        inv_sqrt_d: f64,
        out: &mut [f32],
    ) {
        assert!(
            layout.dtype.is_quantized()
                && n <= TILE
                && qs >= q8_stride(layout.kept_dims)
                && q8.len() >= g * qs
                && sq.len() >= g
                && bytes.len() >= n * layout.record_bytes()
                && out.len() >= g * TILE
        );
        #[cfg(target_arch = "x86_64")]
        if self != Path::Portable
            && layout.r <= QUANT_SIMD_MAX_R
            && layout.kept_dims <= QUANT_SIMD_MAX_R
        {
            // SAFETY: the path's features were detected; the sizes are asserted above and the
            // kernels read inside the records and the `g * qs` query bytes, and write `g * TILE`
            // logits.
            unsafe {
                if self == Path::Avx512 {
                    avx512::quant::key_logits_q8(q8, qs, sq, g, bytes, layout, n, inv_sqrt_d, out)
                } else {
                    avx2::quant::key_logits_q8(q8, qs, sq, g, bytes, layout, n, inv_sqrt_d, out)
                }
            }
            return;
        }
        Path::Portable.ran();
        let rb = layout.record_bytes();
        let gs = layout.group_size;
        for t in 0..n {
            let rec = &bytes[t * rb..(t + 1) * rb];
            let p = record_quant(layout, rec);
            let v = &rec[layout.values_offset()..];
            for h in 0..g {
                let a = &q8[h * qs..(h + 1) * qs];
                let (mut ic, mut ik) = (0i32, 0i32);
                let mut k = 0usize;
                for grp in 0..layout.groups() {
                    if (rec[grp / 8] >> (grp % 8)) & 1 == 1 {
                        for dim in grp * gs..(grp + 1) * gs {
                            if k < layout.r {
                                let aj = i32::from(a[dim]);
                                ic += aj * i32::from(read_code(layout.dtype, v, k));
                                ik += aj;
                            }
                            k += 1;
                        }
                    }
                }
                out[h * TILE + t] = key_logit_q8(sq[h], p, ic, ik, inv_sqrt_d);
            }
        }
    }
}

impl Path {
    /// Whether [`Path::kept_accumulate_q`] takes value records of `layout`: the AVX2 path
    /// (AVX-512 has [`Path::sparse_accumulate_q`]), int8/int4 records that keep at most half of
    /// their `Dt` dims, within the SIMD kernels' limits.
    #[inline]
    pub fn kept_values_q(self, layout: &RecordLayout) -> bool {
        cfg!(target_arch = "x86_64")
            && self == Path::Avx2
            && layout.dtype.is_quantized()
            && layout.r <= QUANT_SIMD_MAX_R
            && 2 * layout.r <= layout.kept_dims
    }

    /// SPEC.md section 9, value side, on packed int8/int4 records, at their kept dims only:
    /// `acc[h * dp + j] += p[h * TILE + t] * v^_t[j]` (tokens in order, one FMA each) into the
    /// dense accumulator `[g][dp]`. The same bits as [`Path::expand_records_q`] then
    /// [`Path::tile_accumulate`]. Only where [`Path::kept_values_q`] holds.
    #[allow(clippy::too_many_arguments)]
    pub fn kept_accumulate_q(
        self,
        p: &[f32],
        g: usize,
        dp: usize,
        bytes: &[u8],
        layout: &RecordLayout,
        n: usize,
        acc: &mut [f32],
    ) {
        assert!(
            self.kept_values_q(layout)
                && n <= TILE
                && bytes.len() >= n * layout.record_bytes()
                && p.len() >= g * TILE
                && acc.len() >= g * dp
                && dp >= layout.kept_dims
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `kept_values_q` holds (AVX2 detected, the kernel's limits) and the sizes are
        // asserted above; the kernel adds at most r / g groups, each below group Dt / g, so it
        // writes inside `acc`.
        unsafe {
            avx2::quant::kept_accumulate_q(p, g, dp, bytes, layout, n, acc)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packed::pack_rotated;
    use mosaickv_spec::{SideStrategy, ValueDtype};
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
                    code_bits: 0,
                };
                layout.validate().unwrap();
                let rows: Vec<f64> = (0..n * d).map(|_| rng.gen_range(-4.0..4.0)).collect();
                let packed = pack_rotated(&rows, d, &SideStrategy::bare(layout)).unwrap();
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
    /// (spans of one to eight registers, uneven ones included), int8 and int4 (AVX2: up to 8
    /// heads, and f16 at g >= 2), over several tiles with accumulators that start nonzero, on every
    /// path this CPU has.
    #[test]
    fn sparse_accumulate_equals_expand_then_accumulate() {
        for path in [Path::Avx512, Path::Avx2] {
            if path.runs_here() {
                sparse_equals_dense_on(path);
            } else {
                eprintln!("no {path:?} here: nothing to compare");
            }
        }
    }

    /// [`Path::sparse_accumulate_q`] against expanding the same records and accumulating the
    /// tile densely, on `path`: the same bits at every (dim, head), dead lanes 0, over three
    /// tiles with rescales between them. int8 and int4 records; on AVX2 also f16 records.
    fn sparse_equals_dense_on(path: Path) {
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        let n = TILE;
        let mut cases = 0;
        let dtypes: &[ValueDtype] = if path == Path::Avx2 {
            &[ValueDtype::Int8, ValueDtype::Int4, ValueDtype::F16]
        } else {
            &[ValueDtype::Int8, ValueDtype::Int4]
        };
        for &dtype in dtypes {
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
                // f16 at g 1 (the paper configuration's layout; AVX-512 only) and Qwen's six heads
                (128, 1, 96, 32, 4),
                (128, 4, 128, 32, 6),
                (64, 8, 64, 32, 8),
                // r past 64: the kernel's larger local buffers
                (256, 2, 256, 96, 4),
                (256, 1, 200, 100, 2),
            ] {
                let layout = RecordLayout {
                    head_dim: d,
                    kept_dims: dt,
                    r,
                    group_size: g,
                    dtype,
                    code_bits: 0,
                };
                layout.validate().unwrap();
                let Some(plan) = path.sparse_plan(&layout, heads) else {
                    // AVX2 takes at most 8 heads, and f16 records of g >= 2
                    let f16_g1 = dtype == ValueDtype::F16 && g == 1;
                    assert!(
                        path == Path::Avx2 && (heads > 8 || f16_g1),
                        "{layout:?} {heads}"
                    );
                    continue;
                };
                let rows: Vec<f64> = (0..n * d).map(|_| rng.gen_range(-4.0..4.0)).collect();
                let packed = pack_rotated(&rows, d, &SideStrategy::bare(layout)).unwrap();
                let p: Vec<f32> = (0..heads * TILE).map(|_| rng.gen_range(0.0..1.0)).collect();
                let dp = crate::simd::pad8(dt);
                // Dense: expanded tile, FMAs over every dim.
                let mut tile = vec![0f32; n * dp];
                if dtype == ValueDtype::F16 {
                    let (rb, bb) = (layout.record_bytes(), layout.bitmap_bytes());
                    path.expand_records(&packed.bytes, 0, n, rb, bb, g, dt, r, dp, &mut tile);
                } else {
                    path.expand_records_q(&packed.bytes, n, &layout, dp, &mut tile);
                }
                let start: Vec<f32> = (0..heads * dp).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let mut dense = start.clone();
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
                    path.tile_accumulate(&p, heads, dp, &tile, n, &mut dense);
                    path.sparse_accumulate_q(&p, &plan, &packed.bytes, &layout, n, &mut sparse);
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
                            "{path:?} {layout:?} heads {heads} h {h} j {j}: {a} vs {b}"
                        );
                    }
                }
                cases += 1;
            }
        }
        // AVX-512: 14 layouts x int8/int4; AVX2: 13 (not 16 heads) x int8/int4, 9 (nor g 1)
        // x f16
        assert_eq!(cases, if path == Path::Avx2 { 35 } else { 28 }, "{path:?}");
    }

    /// The layouts the fused AVX2 kernels are checked on: every group size the default
    /// policy uses and g = 8, `Dt` not a multiple of 8 (60) and truncated, `r` from 4 to
    /// `Dt`, int8 and int4.
    fn fused_layouts() -> Vec<RecordLayout> {
        let mut v = Vec::new();
        for dtype in [ValueDtype::Int8, ValueDtype::Int4] {
            for &(d, g, dt, r) in &[
                (128usize, 1usize, 128usize, 80usize),
                (128, 1, 128, 96),
                (128, 4, 128, 16),
                (128, 2, 96, 32),
                (128, 8, 128, 64),
                (64, 1, 64, 7),
                (64, 4, 48, 4),
                (64, 1, 64, 64),
                (80, 4, 60, 28),
                (80, 1, 60, 9),
                (32, 2, 32, 4),
            ] {
                let layout = RecordLayout {
                    head_dim: d,
                    kept_dims: dt,
                    r,
                    group_size: g,
                    dtype,
                    code_bits: 0,
                };
                layout.validate().unwrap();
                v.push(layout);
            }
        }
        v
    }

    /// SPEC 9's logits on int8/int4 key records: every SIMD path writes the portable
    /// kernel's bits (exact integer sums, the same f64 epilogue), for 1 to 9 heads (passes of
    /// four and a remainder), odd and even record counts, every layout of `fused_layouts`;
    /// and the portable logits are the int8 query times the decoded keys up to the query's
    /// quantization (at most `s_q / 2` per kept dim times `|k^_j|`).
    #[test]
    fn key_logits_q8_equal_on_every_path_and_match_the_decoded_keys() {
        let mut rng = ChaCha8Rng::seed_from_u64(13);
        let paths: Vec<Path> = Path::ALL.into_iter().filter(|p| p.runs_here()).collect();
        for layout in fused_layouts() {
            let d = layout.head_dim;
            let dt = layout.kept_dims;
            let rows: Vec<f64> = (0..TILE * d).map(|_| rng.gen_range(-4.0..4.0)).collect();
            let packed = pack_rotated(&rows, d, &SideStrategy::bare(layout)).unwrap();
            let qs = q8_stride(dt);
            let inv = mosaickv_spec::layout::inv_sqrt_d(d);
            for (g, n) in [
                (1, 16),
                (1, 13),
                (2, 15),
                (3, 15),
                (4, 16),
                (6, 1),
                (7, 16),
                (8, 11),
                (9, 7),
                (12, 9),
                (16, 16),
            ] {
                let qf: Vec<f32> = (0..g * dt).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let mut q8 = vec![0i8; g * qs];
                let mut sq = vec![0f64; g];
                for h in 0..g {
                    let qh = &qf[h * dt..(h + 1) * dt];
                    sq[h] = crate::simd::quantize_query_i8(
                        Path::Portable,
                        qh,
                        &mut q8[h * qs..(h + 1) * qs],
                    );
                }
                let mut want = vec![7f32; g * TILE];
                Path::Portable.key_logits_q8(
                    &q8,
                    qs,
                    &sq,
                    g,
                    &packed.bytes,
                    &layout,
                    n,
                    inv,
                    &mut want,
                );
                for &path in &paths {
                    let mut got = vec![7f32; g * TILE];
                    path.key_logits_q8(&q8, qs, &sq, g, &packed.bytes, &layout, n, inv, &mut got);
                    for h in 0..g {
                        for t in 0..n {
                            let (a, b) = (got[h * TILE + t], want[h * TILE + t]);
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "{path:?} {layout:?} g {g} h {h} t {t}: {a} vs {b}"
                            );
                        }
                    }
                }
                // Against the decoded keys: the int8 query's dot product, and the f32 query's
                // within the query's quantization error.
                let mut dec = vec![0f32; TILE * dt.next_multiple_of(8)];
                let dp = dt.next_multiple_of(8);
                Path::Portable.expand_records_q(&packed.bytes, n, &layout, dp, &mut dec);
                for h in 0..g {
                    for t in 0..n {
                        let k = &dec[t * dp..t * dp + dt];
                        let int8: f64 = (0..dt)
                            .map(|j| f64::from(q8[h * qs + j]) * f64::from(k[j]))
                            .sum::<f64>()
                            * sq[h]
                            * inv;
                        let exact: f64 = (0..dt)
                            .map(|j| f64::from(qf[h * dt + j]) * f64::from(k[j]))
                            .sum::<f64>()
                            * inv;
                        let bound: f64 =
                            (0..dt).map(|j| f64::from(k[j]).abs()).sum::<f64>() * sq[h] / 2.0 * inv;
                        let z = f64::from(want[h * TILE + t]);
                        assert!(
                            (z - int8).abs() <= 1e-5 * (1.0 + int8.abs()),
                            "{layout:?} h {h} t {t}: {z} vs {int8}"
                        );
                        assert!(
                            (z - exact).abs() <= bound + 1e-5,
                            "{layout:?} h {h} t {t}: {z} vs {exact} (bound {bound})"
                        );
                    }
                }
            }
        }
    }

    /// The AVX2 value accumulation at the kept dims gives the bits of expanding the records
    /// and accumulating the tile, over several tiles with a nonzero starting accumulator.
    #[test]
    fn kept_accumulate_equals_expand_then_accumulate() {
        if !Path::Avx2.runs_here() {
            eprintln!("no AVX2 here: nothing to compare");
            return;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(14);
        let mut cases = 0;
        for layout in fused_layouts() {
            if !Path::Avx2.kept_values_q(&layout) {
                assert!(2 * layout.r > layout.kept_dims, "{layout:?}");
                continue;
            }
            let d = layout.head_dim;
            for (g, n) in [(1, 16), (3, 13), (4, 16), (7, 1)] {
                let dp = crate::simd::pad8(layout.kept_dims);
                let start: Vec<f32> = (0..g * dp).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let (mut dense, mut kept) = (start.clone(), start);
                for _tile in 0..3 {
                    let rows: Vec<f64> = (0..TILE * d).map(|_| rng.gen_range(-4.0..4.0)).collect();
                    let packed = pack_rotated(&rows, d, &SideStrategy::bare(layout)).unwrap();
                    let p: Vec<f32> = (0..g * TILE).map(|_| rng.gen_range(0.0..1.0)).collect();
                    let mut tile = vec![0f32; TILE * dp];
                    Path::Avx2.expand_records_q(&packed.bytes, n, &layout, dp, &mut tile);
                    Path::Avx2.tile_accumulate(&p, g, dp, &tile, n, &mut dense);
                    Path::Avx2.kept_accumulate_q(&p, g, dp, &packed.bytes, &layout, n, &mut kept);
                }
                for (i, (a, b)) in kept.iter().zip(&dense).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{layout:?} g {g} at {i}: {a} vs {b}"
                    );
                }
                cases += 1;
            }
        }
        assert_eq!(cases, 4 * 16);
    }

    /// A record whose bitmap keeps more groups than `r` allows (corrupt: `validate` refuses
    /// it) neither crashes the fused kernels nor makes them read or write past their buffers:
    /// they stop at `r` codes.
    #[test]
    fn fused_kernels_stop_at_r_on_an_overfull_bitmap() {
        if !Path::Avx2.runs_here() {
            return;
        }
        for dtype in [ValueDtype::Int8, ValueDtype::Int4] {
            let layout = RecordLayout {
                head_dim: 64,
                kept_dims: 64,
                r: 8,
                group_size: 1,
                dtype,
                code_bits: 0,
            };
            let mut rec = vec![0u8; layout.record_bytes() * 2];
            let rb = layout.record_bytes();
            for t in 0..2 {
                rec[t * rb..t * rb + 8].fill(0xff); // 64 bits set, r = 8
                rec[t * rb + 8..t * rb + 12].copy_from_slice(&[0, 0x3c, 0, 0x3c]);
                // m = s = 1
            }
            let q8 = vec![1i8; 64];
            for path in [Path::Avx2, Path::Avx512] {
                if path.runs_here() {
                    let mut out = vec![0f32; TILE];
                    path.key_logits_q8(&q8, 64, &[1.0], 1, &rec, &layout, 2, 1.0, &mut out);
                    assert!(out[..2].iter().all(|x| x.is_finite()), "{out:?}");
                }
            }
            let p = vec![1f32; TILE];
            let mut acc = vec![0f32; 64];
            Path::Avx2.kept_accumulate_q(&p, 1, 64, &rec, &layout, 2, &mut acc);
            assert_eq!(acc.iter().filter(|&&x| x != 0.0).count(), 8, "{acc:?}");
            // the sparse kernels (r = 8 of 64 kept dims: sparse; g = 2, every one of the 32
            // groups' bits set) stop at r too
            let grouped = RecordLayout {
                group_size: 2,
                ..layout
            };
            let rb = grouped.record_bytes();
            let mut rec = vec![0u8; 2 * rb];
            for t in 0..2 {
                rec[t * rb..t * rb + 4].fill(0xff);
                rec[t * rb + 4..t * rb + 8].copy_from_slice(&[0, 0x3c, 0, 0x3c]);
            }
            for path in [Path::Avx2, Path::Avx512] {
                if path.runs_here() {
                    let plan = path.sparse_plan(&grouped, 1).unwrap();
                    let mut acc_t = vec![0f32; plan.len(64)];
                    path.sparse_accumulate_q(&p, &plan, &rec, &grouped, 2, &mut acc_t);
                    let kept = (0..64).filter(|&j| acc_t[plan.at(j, 0)] != 0.0).count();
                    assert_eq!(kept, 8, "{path:?} {acc_t:?}");
                }
            }
        }
    }
}
