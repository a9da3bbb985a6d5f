//! SPEC.md section 6: the packed record (encode and decode).

use crate::topr::{rotate_row_f64, round_kept, select_row};
use half::f16;
use mosaickv_spec::coded::{self, DimCode};
use mosaickv_spec::layout::{
    bitmap_bit, dequantize, quantize_values, read_code, record_quant, record_value, write_quantized,
};
use mosaickv_spec::rules;
use mosaickv_spec::validate::finite;
use mosaickv_spec::{MosaicError, PackedRows, RecordLayout, Result, SideStrategy, ValueDtype};
use ndarray::{Array2, ArrayView2};

/// Checks that rows `[n, D]` match the strategy's `D` and are finite.
pub fn check_rows(rows: &ArrayView2<f32>, side: &SideStrategy, what: &'static str) -> Result<()> {
    side.validate()?;
    if rows.ncols() != side.head_dim() {
        return Err(MosaicError::ShapeMismatch {
            what,
            expected: format!("[rows, {}]", side.head_dim()),
            got: format!("{:?}", rows.shape()),
        });
    }
    finite(what, rows.iter())
}

/// SPEC.md sections 5 and 6: one row's record, appended to `out`.
///
/// `| bitmap: W little-endian u32 words | r kept values, f16 LE, ascending dim | zero pad to 4 |`
/// for f16; int8/int4: `| bitmap | f16 minimum, f16 scale | r codes (1 byte / half a byte
/// each) | pad |`
/// ([`mosaickv_spec::layout::quantize_values`] from the kept f16 values).
///
/// A kept value that overflows f16 (|x'| >= 65520) is `NonFinite`: it could
/// not be stored, and SPEC.md section 14 forbids non-finite decoded values.
/// The first overflowing rotated dim is always kept (its f16 importance is
/// +Inf, and ties go to the lower group), so the first kept overflow found
/// here is the row's first overflowing rotated value.
///
/// On overflow the error's index is the rotated dim `j` of this row; [`encode_rows`]
/// makes it the flat index `row * Dt + j` (SPEC.md section 14). `out` is left as it was.
pub fn encode_row(row: &[f32], side: &SideStrategy, out: &mut Vec<u8>) -> Result<()> {
    let layout = &side.layout;
    let rotated = rotate_row_f64(row, &side.rotation);
    if layout.dtype == ValueDtype::Coded {
        return encode_coded_row(&rotated, side, out);
    }
    let (y, kept) = select_row(&rotated, layout);
    let start = out.len();
    let mut words = vec![0u32; layout.bitmap_bytes() / 4];
    for (k, &is_kept) in kept.iter().enumerate() {
        if is_kept {
            words[k / 32] |= 1u32 << (k % 32);
        }
    }
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
    let kept_values = kept_values(&y, &kept, layout.group_size);
    if let Some(j) = kept_dims_of(&kept, layout.group_size)
        .zip(&kept_values)
        .find_map(|(j, v)| (!v.is_finite()).then_some(j))
    {
        out.truncate(start);
        return Err(rules::rotated_overflow(0, j, layout.kept_dims));
    }
    if layout.dtype.is_quantized() {
        let mut codes = vec![0u8; layout.r];
        let params = quantize_values(&kept_values, layout.dtype, &mut codes);
        out.resize(start + layout.record_bytes(), 0);
        write_quantized(
            layout.dtype,
            params,
            &codes,
            &mut out[start + layout.bitmap_bytes()..],
        );
    } else {
        for v in kept_values {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.resize(start + layout.record_bytes(), 0);
    }
    Ok(())
}

/// SPEC.md section 6.1: a coded record: `y_j = f16(x'_j)` for every `j < Dt` (an overflow
/// is `NonFinite`, as for section 6), each dim's code ([`DimCode::encode`]), packed widest
/// first ([`coded::pack_codes`]), zero padding to a multiple of 4 bytes.
fn encode_coded_row(rotated: &[f64], side: &SideStrategy, out: &mut Vec<u8>) -> Result<()> {
    let layout = &side.layout;
    let y = round_kept(rotated, layout.kept_dims);
    if let Some(j) = y.iter().position(|v| !v.is_finite()) {
        return Err(rules::rotated_overflow(0, j, layout.kept_dims));
    }
    let codes: Vec<u8> = side
        .coding
        .iter()
        .zip(&y)
        .map(|(c, &v)| c.encode(v))
        .collect();
    let start = out.len();
    out.resize(start + layout.record_bytes(), 0);
    coded::pack_codes(&side.coding, &codes, &mut out[start..]);
    Ok(())
}

/// SPEC.md section 6.1: a coded record's decoded rotated row (every dim `m_j + c_j s_j`, one
/// f32 rounding; a 0-bit dim `m_j`).
pub fn decode_coded(coding: &[DimCode], record: &[u8]) -> Vec<f32> {
    coded::unpack_codes(coding, record)
        .into_iter()
        .zip(coding)
        .map(|(c, d)| d.decode(c))
        .collect()
}

/// The kept rotated dims in ascending order (group by group).
pub fn kept_dims_of(kept: &[bool], g: usize) -> impl Iterator<Item = usize> + '_ {
    kept.iter()
        .enumerate()
        .filter(|(_, &k)| k)
        .flat_map(move |(k, _)| k * g..(k + 1) * g)
}

/// The f16 values `y` of the kept dims, ascending (what section 6 stores, or quantizes).
pub fn kept_values(y: &[f16], kept: &[bool], g: usize) -> Vec<f16> {
    kept_dims_of(kept, g).map(|j| y[j]).collect()
}

/// SPEC.md section 6: the decoded kept values of a row as attention reads them: the f16
/// values themselves, or `m + code * s` (one f32 rounding) for int8/int4.
pub fn dequantized_kept(kept_values: &[f16], layout: &RecordLayout) -> Vec<f32> {
    if !layout.dtype.is_quantized() {
        return kept_values.iter().map(|v| v.to_f32()).collect();
    }
    let mut codes = vec![0u8; kept_values.len()];
    let params = quantize_values(kept_values, layout.dtype, &mut codes);
    codes.iter().map(|&c| dequantize(params, c)).collect()
}

/// SPEC.md sections 5 and 6: every row of `[n, D]` packed, record i at `i * record_bytes`.
pub fn encode_rows(rows: ArrayView2<f32>, side: &SideStrategy) -> Result<PackedRows> {
    check_rows(&rows, side, "rows")?;
    let mut bytes = Vec::with_capacity(rows.nrows() * side.layout.record_bytes());
    for (i, row) in rows.rows().into_iter().enumerate() {
        let row: Vec<f32> = row.iter().copied().collect();
        encode_row(&row, side, &mut bytes).map_err(|e| match e {
            MosaicError::NonFinite { what, index } if what == rules::ROTATED_OVERFLOW => {
                rules::rotated_overflow(i, index, side.layout.kept_dims)
            }
            other => other,
        })?;
    }
    Ok(PackedRows {
        count: rows.nrows(),
        bytes,
    })
}

/// SPEC.md section 6, decode of one (already validated) record: the dense
/// rotated row `k^` of length Dt, the stored value at kept dims, 0 elsewhere
/// (for int8/int4 the stored value is `m + code * s`, rounded once to f32); a coded record
/// (section 6.1) decodes every dim from its own offset and step.
pub fn decode_record(side: &SideStrategy, record: &[u8]) -> Result<Vec<f32>> {
    let layout = &side.layout;
    if layout.dtype == ValueDtype::Coded {
        let out = decode_coded(&side.coding, record);
        if let Some(j) = out.iter().position(|v| !v.is_finite()) {
            return Err(MosaicError::NonFinite {
                what: "decoded value",
                index: j,
            });
        }
        return Ok(out);
    }
    let g = layout.group_size;
    let mut out = vec![0.0f32; layout.kept_dims];
    let value = |i: usize| -> f32 {
        if layout.dtype.is_quantized() {
            let codes = &record[layout.values_offset()..];
            dequantize(
                record_quant(layout, record),
                read_code(layout.dtype, codes, i),
            )
        } else {
            record_value(layout, record, i).to_f32()
        }
    };
    let mut next = 0; // index of the next stored value
    for k in 0..layout.groups() {
        if bitmap_bit(record, k) {
            for j in k * g..(k + 1) * g {
                let v = value(next);
                if !v.is_finite() {
                    return Err(MosaicError::NonFinite {
                        what: "decoded value",
                        index: next,
                    });
                }
                out[j] = v;
                next += 1;
            }
        }
    }
    Ok(out)
}

/// SPEC.md section 6: all records decoded to `[n, Dt]`, after
/// `PackedRows::validate` (a bad record is `CorruptPacked`).
pub fn decode_rows(packed: &PackedRows, side: &SideStrategy) -> Result<Array2<f32>> {
    side.validate()?;
    let layout = &side.layout;
    packed.validate(layout)?;
    let mut out = Array2::<f32>::zeros((packed.count, layout.kept_dims));
    for i in 0..packed.count {
        let row = decode_record(side, packed.record(layout, i))?;
        for (j, v) in row.into_iter().enumerate() {
            out[[i, j]] = v;
        }
    }
    Ok(out)
}
