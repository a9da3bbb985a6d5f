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

/// Writes a 2-D f32 array as `<f4`, C order.
pub fn write2(path: &Path, a: &Array2<f32>) -> Result<(), CliError> {
    let file = std::fs::File::create(path).map_err(|e| io(path, e))?;
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(&[a.nrows() as u64, a.ncols() as u64])
        .writer(std::io::BufWriter::new(file))
        .begin_nd()
        .map_err(|e| io(path, e))?;
    w.extend(a.iter().copied()).map_err(|e| io(path, e))?;
    w.finish().map_err(|e| io(path, e))
}
