//! Reading f32 / f16 `.npy` arrays and writing f32 ones.

use crate::error::{io, CliError};
use ndarray::{Array2, Array3, ArrayD, IxDyn};
use npyz::{DType, NpyFile, Order, WriterBuilder};
use std::io::BufReader;
use std::path::Path;

/// Reads `path` as an f32 array; `<f4`/`>f4` as is, `<f2`/`>f2` widened exactly.
pub fn read(path: &Path, what: &str) -> Result<ArrayD<f32>, CliError> {
    let file = std::fs::File::open(path).map_err(|e| io(path, e))?;
    let bad = |m: String| CliError::Input(format!("{what} {}: {m}", path.display()));
    let file = native_order_as_explicit(file).map_err(|e| io(path, e))?;
    let npy = NpyFile::new(BufReader::new(file))
        .map_err(|e| bad(format!("not a valid .npy file ({e})")))?;
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    let order = npy.order();
    let descr = match npy.dtype() {
        DType::Plain(t) => t.to_string(),
        other => {
            return Err(bad(format!(
                "unsupported dtype {other:?} (need float32 or float16)"
            )))
        }
    };
    // A data part shorter than the header's shape says is a truncated file: name it so,
    // with the bytes the shape needs (npyz reports only "failed to fill whole buffer").
    let data_err = |e: std::io::Error, item: usize| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            let need = shape
                .iter()
                .try_fold(item as u128, |a, &d| a.checked_mul(d as u128))
                .map_or("more than 2^128".to_string(), |n| n.to_string());
            bad(format!(
                "truncated: its shape {shape:?} needs {need} bytes of data, the file ends before"
            ))
        } else {
            bad(format!("reading data: {e}"))
        }
    };
    let data: Vec<f32> = match descr.as_str() {
        "<f4" | ">f4" => npy.into_vec::<f32>().map_err(|e| data_err(e, 4))?,
        "<f2" | ">f2" => npy
            .into_vec::<half::f16>()
            .map_err(|e| data_err(e, 2))?
            .into_iter()
            .map(f32::from)
            .collect(),
        d => {
            return Err(bad(format!(
                "unsupported dtype '{d}' (need float32 '<f4' or float16 '<f2')"
            )))
        }
    };
    let arr = match order {
        Order::C => ArrayD::from_shape_vec(IxDyn(&shape), data),
        Order::Fortran => {
            let rev: Vec<usize> = shape.iter().rev().copied().collect();
            ArrayD::from_shape_vec(IxDyn(&rev), data).map(|a| a.reversed_axes())
        }
    }
    .map_err(|e| bad(format!("data does not match shape {shape:?} ({e})")))?;
    Ok(arr.as_standard_layout().into_owned())
}

/// numpy writes the byte order of a dtype as `<` or `>`, but also accepts (and some writers
/// store) `=`, the machine's own order, which npyz does not parse: the header is read ahead and
/// a `'descr': '=...'` is given this machine's explicit order (one byte for one, so the header
/// length is unchanged). Anything else passes through untouched, for npyz to judge.
fn native_order_as_explicit(mut file: std::fs::File) -> std::io::Result<impl std::io::Read> {
    use std::io::Read;
    let mut head = Vec::new();
    (&mut file).take(12).read_to_end(&mut head)?;
    let header_len = match head.get(6) {
        _ if !head.starts_with(b"\x93NUMPY") || head.len() < 10 => None,
        Some(1) => Some((10, u16::from_le_bytes([head[8], head[9]]) as u64)),
        Some(2 | 3) if head.len() == 12 => Some((
            12,
            u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as u64,
        )),
        _ => None,
    };
    if let Some((prefix, len)) = header_len {
        (&mut file)
            .take(len.saturating_sub((head.len() - prefix) as u64))
            .read_to_end(&mut head)?;
        let text = &mut head[prefix..];
        if let Some(at) = text.windows(7).position(|w| w == b"'descr'") {
            let quote = text[at + 7..]
                .iter()
                .position(|&c| c == b'\'' || c == b'"')
                .map(|q| at + 7 + q + 1);
            if let Some(q) = quote.filter(|&q| text.get(q) == Some(&b'=')) {
                text[q] = if cfg!(target_endian = "little") {
                    b'<'
                } else {
                    b'>'
                };
            }
        }
    }
    Ok(std::io::Cursor::new(head).chain(file))
}

fn ndim_err(path: &Path, what: &str, want: &str, got: &[usize]) -> CliError {
    CliError::Input(format!(
        "{what} {}: expected a {want} array, got shape {got:?}",
        path.display()
    ))
}

/// A 3-D array `[tokens, kv_heads, head_dim]`.
pub fn read3(path: &Path, what: &str) -> Result<Array3<f32>, CliError> {
    let a = read(path, what)?;
    let shape = a.shape().to_vec();
    a.into_dimensionality()
        .map_err(|_| ndim_err(path, what, "3-D [tokens, kv_heads, head_dim]", &shape))
}

/// A 2-D array `[q_heads, head_dim]`.
pub fn read2(path: &Path, what: &str) -> Result<Array2<f32>, CliError> {
    let a = read(path, what)?;
    let shape = a.shape().to_vec();
    a.into_dimensionality()
        .map_err(|_| ndim_err(path, what, "2-D [q_heads, head_dim]", &shape))
}

/// Writes a 2-D f32 array as `<f4`, C order; atomically (`mosaickv_spec::atomic`): a failed
/// write leaves a previous file at `path` as it was.
pub fn write2(path: &Path, a: &Array2<f32>) -> Result<(), CliError> {
    let mut bytes = Vec::new();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(&[a.nrows() as u64, a.ncols() as u64])
        .writer(&mut bytes)
        .begin_nd()
        .map_err(|e| io(path, e))?;
    w.extend(a.iter().copied()).map_err(|e| io(path, e))?;
    w.finish().map_err(|e| io(path, e))?;
    mosaickv_spec::atomic::write_atomic(path, &bytes).map_err(|e| io(path, e))
}
