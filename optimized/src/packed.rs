//! SPEC.md section 6: packing rotated rows into records (bitmap, kept values in f16 or
//! int8/int4 with their minimum and scale; section 6.1's coded records through
//! [`crate::coded`]) and decoding them back.
//!
//! Written for throughput but producing the spec's exact bytes: every f64 sum runs over the
//! same index in the same ascending order as the spec's definition, with separate multiply
//! and add (Rust never contracts to FMA).

use crate::rotation::rotate_rows_f64;
use crate::round::f16_from_f64;
use crate::topr::*;
use half::f16;
use mosaickv_spec::layout::{
    dequantize, quantize_values, read_code, record_quant, write_quantized,
};
use mosaickv_spec::{
    rules, MosaicError, PackedRows, RecordLayout, Result, SideStrategy, ValueDtype,
};
use rayon::prelude::*;

/// Rows per rayon task when encoding.
pub(crate) const ROWS_PER_TASK: usize = 256;

/// Packs one record (SPEC.md section 6) from a row's rotated coordinates (at least Dt of them).
/// Returns the first rotated dim whose kept value overflows f16 (SPEC.md section 14), if any;
/// the record's bytes are then meaningless and the caller reports the error. Int8/int4 records
/// get their scale and codes from [`mosaickv_spec::layout::quantize_values`] (the one host
/// implementation of the rounding) over the kept f16 values.
pub(crate) fn pack_record(
    x: &[f64],
    layout: &RecordLayout,
    out: &mut [u8],
    b: &mut PackBufs,
) -> Option<usize> {
    let dt = layout.kept_dims;
    let g = layout.group_size;
    for j in 0..dt {
        b.y[j] = f16_from_f64(x[j]);
    }
    select_groups(
        &b.y[..dt],
        g,
        layout.kept_groups(),
        &mut b.imp,
        &mut b.order,
        &mut b.keep,
    );
    out.fill(0);
    let mut overflow = None;
    b.kv.clear();
    for k in 0..layout.groups() {
        if b.keep[k] {
            out[k / 8] |= 1 << (k % 8);
            for (j, &v) in (k * g..).zip(&b.y[k * g..(k + 1) * g]) {
                if !v.is_finite() && overflow.is_none() {
                    overflow = Some(j);
                }
                b.kv.push(v);
            }
        }
    }
    let bb = layout.bitmap_bytes();
    if layout.dtype.is_quantized() {
        if overflow.is_none() {
            let codes = &mut b.codes[..layout.r];
            let params = quantize_values(&b.kv, layout.dtype, codes);
            write_quantized(layout.dtype, params, codes, &mut out[bb..]);
        }
    } else {
        for (o, v) in out[bb..bb + 2 * layout.r].chunks_exact_mut(2).zip(&b.kv) {
            o.copy_from_slice(&v.to_le_bytes());
        }
    }
    overflow
}

/// SPEC 6: the decoded values of a row's kept f16 values `kv` (ascending dims) under an
/// int8/int4 layout, `m + code * s` (one f32 rounding), into `out`; the codes go to `codes`.
pub fn dequantize_kept(kv: &[f16], layout: &RecordLayout, codes: &mut [u8], out: &mut Vec<f32>) {
    let codes = &mut codes[..kv.len()];
    let p = quantize_values(kv, layout.dtype, codes);
    out.clear();
    out.extend(codes.iter().map(|&c| dequantize(p, c)));
}

/// SPEC 6: the decoded kept values of a (valid) int8/int4 record, ascending dims, into `out`.
pub fn record_dequantized(rec: &[u8], layout: &RecordLayout, out: &mut Vec<f32>) {
    let p = record_quant(layout, rec);
    let v = &rec[layout.values_offset()..];
    out.clear();
    out.extend((0..layout.r).map(|i| dequantize(p, read_code(layout.dtype, v, i))));
}

/// The first overflow of rows packed in chunks of [`ROWS_PER_TASK`]: `(row in chunk, dim)`
/// per chunk, in chunk order, turned into SPEC.md section 14's error (flat index
/// `row * Dt + dim`, the first in row order, as the reference reports it).
pub(crate) fn first_overflow(
    per_chunk: Vec<Option<(usize, usize)>>,
    layout: &RecordLayout,
) -> Result<()> {
    let first = per_chunk
        .into_iter()
        .enumerate()
        .find_map(|(c, o)| o.map(|(i, j)| (c * ROWS_PER_TASK + i, j)));
    match first {
        Some((row, j)) => Err(rules::rotated_overflow(row, j, layout.kept_dims)),
        None => Ok(()),
    }
}

/// Per-thread buffers for packing.
pub(crate) struct PackBufs {
    pub(crate) y: Vec<f16>,
    pub(crate) imp: Vec<f32>,
    pub(crate) order: Vec<u16>,
    pub(crate) keep: Vec<bool>,
    /// The kept f16 values of the row, ascending dims.
    pub(crate) kv: Vec<f16>,
    /// Their int8/int4 codes.
    pub(crate) codes: Vec<u8>,
    /// Their decoded values (the loss of a quantized layout).
    pub(crate) deq: Vec<f32>,
}

impl PackBufs {
    pub(crate) fn new(d: usize) -> Self {
        Self {
            y: vec![f16::ZERO; d],
            imp: vec![0.0; d],
            order: vec![0; d],
            keep: vec![false; d],
            kv: Vec::with_capacity(d),
            codes: vec![0; d],
            deq: Vec::with_capacity(d),
        }
    }
}

/// One record of `side` (SPEC.md section 6, or 6.1 for a coded side) from a row's rotated
/// coordinates: [`pack_record`] or [`crate::coded::pack_coded_record`].
#[inline]
fn pack_side_record(
    x: &[f64],
    side: &SideStrategy,
    out: &mut [u8],
    b: &mut PackBufs,
) -> Option<usize> {
    if side.layout.dtype == ValueDtype::Coded {
        crate::coded::pack_coded_record(x, side, out, &mut b.codes)
    } else {
        pack_record(x, &side.layout, out, b)
    }
}

/// Packs rows whose rotated coordinates are given (`[n][stride]`, stride >= Dt), in parallel,
/// under `side`'s layout (and coding; its rotation is not read). A kept value beyond the f16
/// range is `NonFinite` (SPEC.md section 14).
pub fn pack_rotated(rot_rows: &[f64], stride: usize, side: &SideStrategy) -> Result<PackedRows> {
    let layout = &side.layout;
    let n = rot_rows.len() / stride.max(1);
    let rb = layout.record_bytes();
    // A coded side whose dims are all 0-bit has 0-byte records: each packs into one scratch
    // byte (still checked for overflow), dropped at the end.
    let rbx = rb.max(1);
    let mut bytes = vec![0u8; n * rbx];
    let d = layout.head_dim;
    let overflows: Vec<Option<(usize, usize)>> = bytes
        .par_chunks_mut(rbx * ROWS_PER_TASK)
        .zip(rot_rows.par_chunks(stride * ROWS_PER_TASK))
        .map(|(out, x)| {
            let mut b = PackBufs::new(d);
            let mut first = None;
            for (i, (o, row)) in out
                .chunks_exact_mut(rbx)
                .zip(x.chunks_exact(stride))
                .enumerate()
            {
                let bad = pack_side_record(row, side, &mut o[..rb], &mut b);
                if let (None, Some(j)) = (first, bad) {
                    first = Some((i, j));
                }
            }
            first
        })
        .collect();
    first_overflow(overflows, layout)?;
    bytes.truncate(n * rb);
    Ok(PackedRows { count: n, bytes })
}

/// SPEC 5-6: rotate and pack rows `[n][d]` with a side strategy (parallel over row chunks).
/// A kept value beyond the f16 range is `NonFinite` (SPEC.md section 14).
pub fn encode_rows(rows: &[f32], side: &SideStrategy) -> Result<PackedRows> {
    let layout = side.layout;
    let d = layout.head_dim;
    let dt = layout.kept_dims;
    let n = rows.len() / d;
    let rb = layout.record_bytes();
    // 0-byte records (an all-0-bit coded side) pack into one scratch byte each, as above.
    let rbx = rb.max(1);
    let mut bytes = vec![0u8; n * rbx];
    let rot = mosaickv_spec::layout::rotation_f32(&side.rotation);
    let overflows: Vec<Option<(usize, usize)>> = bytes
        .par_chunks_mut(rbx * ROWS_PER_TASK)
        .zip(rows.par_chunks(d * ROWS_PER_TASK))
        .map(|(out, x)| {
            let mut b = PackBufs::new(d);
            let mut xr = vec![0f64; x.len() / d * dt];
            rotate_rows_f64(&rot, d, x, dt, &mut xr);
            let mut first = None;
            for (i, (o, row)) in out
                .chunks_exact_mut(rbx)
                .zip(xr.chunks_exact(dt))
                .enumerate()
            {
                let bad = pack_side_record(row, side, &mut o[..rb], &mut b);
                if let (None, Some(j)) = (first, bad) {
                    first = Some((i, j));
                }
            }
            first
        })
        .collect();
    first_overflow(overflows, &layout)?;
    bytes.truncate(n * rb);
    Ok(PackedRows { count: n, bytes })
}

/// SPEC 6 (6.1 for a coded side): decodes records to dense rotated rows `[n][Dt]` (validating
/// them first).
pub fn decode_rows(packed: &PackedRows, side: &SideStrategy) -> Result<Vec<f32>> {
    packed.validate(&side.layout)?;
    let out = decode_trusted(packed, side);
    if let Some(i) = out.iter().position(|x| !x.is_finite()) {
        return Err(MosaicError::NonFinite {
            what: "decoded values",
            index: i,
        });
    }
    Ok(out)
}

/// SPEC 6 (6.1 for a coded side) decode of records this crate wrote itself (no validation, no
/// finiteness check).
pub fn decode_trusted(packed: &PackedRows, side: &SideStrategy) -> Vec<f32> {
    let layout = &side.layout;
    let dt = layout.kept_dims;
    let dp = dt.div_ceil(8) * 8;
    let mut tmp = vec![0f32; packed.count * dp];
    if layout.dtype == ValueDtype::Coded {
        crate::coded::expand_coded(
            &packed.bytes,
            packed.count,
            layout.record_bytes(),
            &side.coding,
            dp,
            &mut tmp,
        );
    } else if layout.dtype.is_quantized() {
        crate::simd::Path::Portable.expand_records_q(
            &packed.bytes,
            packed.count,
            layout,
            dp,
            &mut tmp,
        );
    } else {
        crate::simd::Path::Portable.expand_records(
            &packed.bytes,
            0,
            packed.count,
            layout.record_bytes(),
            layout.bitmap_bytes(),
            layout.group_size,
            dt,
            layout.r,
            dp,
            &mut tmp,
        );
    }
    let mut out = vec![0f32; packed.count * dt];
    for (o, t) in out
        .chunks_exact_mut(dt.max(1))
        .zip(tmp.chunks_exact(dp.max(1)))
    {
        o.copy_from_slice(&t[..dt]);
    }
    out
}
