//! A checked reader for the GGUF header: magic, metadata and tensor infos.
//!
//! candle's `Content::read` allocates every length it reads (strings, arrays, dimension lists)
//! before it knows whether the file holds that many bytes, divides by a `general.alignment` of 0,
//! and leaves tensor sizes and offsets unchecked. [`read_content`] builds the same candle
//! [`Content`] (so the model loader and the tokenizer read it as before) but:
//!
//! * checks every length against the bytes left in the file before allocating for it;
//! * bounds array nesting ([`MAX_ARRAY_DEPTH`]) and the number of metadata values
//!   ([`MAX_METADATA_VALUES`]), so the parsed metadata takes at most 128 MiB of candle `Value`s
//!   beyond the file's own string bytes;
//! * checks every tensor info: a known type, at most [`MAX_DIMS`] dimensions, at least one
//!   element, element count and byte size without overflow, whole blocks, data inside the file,
//!   no two tensors overlapping;
//! * rejects duplicate metadata keys and tensor names (candle would keep the last silently) and an
//!   alignment that is not a power of two.
//!
//! After it, candle's `Content::tensor` reads only sizes that fit in the file.

use crate::{EngineError, Result};
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value, VersionedMagic};
use candle_core::quantized::GgmlDType;
use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of metadata arrays (real files use flat arrays only).
pub const MAX_ARRAY_DEPTH: usize = 4;
/// Most metadata values (scalars and array elements together). candle holds each in a 32-byte
/// `Value`, so this caps that at 128 MiB; a 128K-token vocabulary with its merges and token
/// types is about 540K values.
pub const MAX_METADATA_VALUES: u64 = 1 << 22;
/// `general.alignment` when the file does not set it (GGUF and candle's default).
const DEFAULT_ALIGNMENT: u64 = 32;

/// Reads and checks the header of a GGUF file of `len` bytes from `r` (positioned at byte 0).
/// `path` only names the file in errors.
///
/// Errors: [`EngineError::BadMagic`], [`EngineError::Truncated`] when a length, count or tensor
/// reaches past the end of the file, [`EngineError::Format`] for anything else malformed,
/// [`EngineError::Io`] when reading fails.
pub fn read_content<R: Read>(r: R, len: u64, path: &Path) -> Result<Content> {
    let mut h = Header {
        r,
        pos: 0,
        len,
        path,
        values_left: MAX_METADATA_VALUES,
        v1: false,
    };
    let magic = h.array::<4>("magic")?;
    if &magic != b"GGUF" {
        return Err(EngineError::BadMagic {
            path: path.into(),
            found: magic.to_vec(),
        });
    }
    let magic = match h.u32("version")? {
        1 => VersionedMagic::GgufV1,
        2 => VersionedMagic::GgufV2,
        3 => VersionedMagic::GgufV3,
        v => return Err(h.format(format!("GGUF version {v} (1, 2 or 3 supported)"))),
    };
    h.v1 = magic == VersionedMagic::GgufV1;
    let tensor_count = h.count("tensor count")?;
    let kv_count = h.count("metadata count")?;
    // the smallest key-value pair is an empty key, a type and one byte; the smallest tensor
    // info an empty name, a dimension count, a type and an offset
    let len_bytes = h.len_bytes();
    h.need(kv_count, len_bytes + 4 + 1, "metadata key-value pairs")?;
    h.need(tensor_count, len_bytes + 4 + 4 + 8, "tensor infos")?;

    let mut metadata = HashMap::new();
    for _ in 0..kv_count {
        let key = h.string("metadata key")?;
        let ty = h.u32("metadata value type")?;
        let value = h.value(ty, 0, &key)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(h.format(format!("metadata key {key:?} appears twice")));
        }
    }

    let mut tensor_infos = HashMap::new();
    let mut extents = Vec::new();
    for _ in 0..tensor_count {
        let name = h.string("tensor name")?;
        let (info, bytes) = h.tensor_info(&name)?;
        extents.push((info.offset, bytes, name.clone()));
        if tensor_infos.insert(name.clone(), info).is_some() {
            return Err(h.format(format!("tensor {name:?} appears twice")));
        }
    }

    let alignment = alignment(&metadata).map_err(|m| h.format(m))?;
    let tensor_data_offset = h
        .pos
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| h.format("tensor data offset overflows".into()))?;
    check_extents(&mut extents, tensor_data_offset, len, path)?;
    Ok(Content {
        magic,
        metadata,
        tensor_infos,
        tensor_data_offset,
    })
}

/// `general.alignment` as candle reads it (any non-negative integer type of up to 32 bits,
/// else the default), which GGUF requires to be a power of two.
fn alignment(metadata: &HashMap<String, Value>) -> std::result::Result<u64, String> {
    let a = match metadata.get("general.alignment") {
        Some(Value::U8(v)) => *v as u64,
        Some(Value::U16(v)) => *v as u64,
        Some(Value::U32(v)) => *v as u64,
        Some(Value::I8(v)) if *v >= 0 => *v as u64,
        Some(Value::I16(v)) if *v >= 0 => *v as u64,
        Some(Value::I32(v)) if *v >= 0 => *v as u64,
        _ => DEFAULT_ALIGNMENT,
    };
    if a.is_power_of_two() {
        Ok(a)
    } else {
        Err(format!("general.alignment {a} is not a power of two"))
    }
}

/// Every tensor's data `[data_offset + offset, + bytes)` lies inside the file and no two overlap.
/// `extents`: (offset, bytes, name) per tensor.
fn check_extents(
    extents: &mut [(u64, u64, String)],
    data_offset: u64,
    len: u64,
    path: &Path,
) -> Result<()> {
    if data_offset > len && !extents.is_empty() {
        return Err(EngineError::Truncated {
            path: path.into(),
            expected: data_offset,
            actual: len,
            what: "tensor data".into(),
        });
    }
    for (offset, bytes, name) in extents.iter() {
        // saturating: an end past u64::MAX is past the end of any file
        let end = data_offset.saturating_add(*offset).saturating_add(*bytes);
        if end > len {
            return Err(EngineError::Truncated {
                path: path.into(),
                expected: end,
                actual: len,
                what: format!("data of tensor {name}"),
            });
        }
    }
    extents.sort_unstable();
    let mut prev: Option<(u64, &str)> = None;
    for (offset, bytes, name) in extents.iter() {
        if let Some((end, other)) = prev {
            if *offset < end {
                return Err(EngineError::Format(format!(
                    "{}: the data of tensors {other} and {name} overlap",
                    path.display()
                )));
            }
        }
        prev = Some((offset + bytes, name));
    }
    Ok(())
}

/// The reading position in the header and what is left to spend.
struct Header<'p, R> {
    r: R,
    pos: u64,
    len: u64,
    path: &'p Path,
    /// Metadata values that may still be read (see [`MAX_METADATA_VALUES`]).
    values_left: u64,
    /// GGUF version 1: lengths and counts are u32, not u64.
    v1: bool,
}

impl<R: Read> Header<'_, R> {
    fn format(&self, message: String) -> EngineError {
        EngineError::Format(format!(
            "{}: {message} (GGUF header, byte {})",
            self.path.display(),
            self.pos
        ))
    }

    fn truncated(&self, bytes: u64, what: &str) -> EngineError {
        EngineError::Truncated {
            path: self.path.into(),
            expected: self.pos.saturating_add(bytes),
            actual: self.len,
            what: what.into(),
        }
    }

    /// Fails unless `count` items of at least `each` bytes fit in the rest of the file.
    fn need(&self, count: u64, each: u64, what: &str) -> Result<()> {
        let bytes = count.saturating_mul(each);
        if bytes > self.len.saturating_sub(self.pos) {
            return Err(self.truncated(bytes, &format!("{count} {what}")));
        }
        Ok(())
    }

    /// Reads exactly `buf.len()` bytes, which the caller has checked fit in the file.
    fn fill(&mut self, buf: &mut [u8], what: &str) -> Result<()> {
        self.need(buf.len() as u64, 1, what)?;
        self.r.read_exact(buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                self.truncated(buf.len() as u64, what)
            } else {
                EngineError::Io {
                    path: self.path.into(),
                    source: e,
                }
            }
        })?;
        self.pos += buf.len() as u64;
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.fill(&mut b, what)?;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Bytes of a length or count field.
    fn len_bytes(&self) -> u64 {
        if self.v1 {
            4
        } else {
            8
        }
    }

    /// A length or count field: u32 in version 1, u64 after.
    fn count(&mut self, what: &str) -> Result<u64> {
        if self.v1 {
            Ok(self.u32(what)? as u64)
        } else {
            self.u64(what)
        }
    }

    /// A length-prefixed string; trailing NULs are dropped and invalid UTF-8 replaced, as candle
    /// does.
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.count(what)?;
        self.need(n, 1, what)?;
        let mut v = vec![0u8; n as usize];
        self.fill(&mut v, what)?;
        while v.last() == Some(&0) {
            v.pop();
        }
        Ok(String::from_utf8_lossy(&v).into_owned())
    }

    /// Takes `n` values from the metadata budget.
    fn spend(&mut self, n: u64, key: &str) -> Result<()> {
        self.values_left = self.values_left.checked_sub(n).ok_or_else(|| {
            self.format(format!(
                "metadata {key:?}: more than {MAX_METADATA_VALUES} metadata values in all"
            ))
        })?;
        Ok(())
    }

    /// Bytes one value of type `ty` takes at least (None: unknown type).
    fn min_size(&self, ty: u32) -> Option<u64> {
        Some(match ty {
            0 | 1 | 7 => 1,            // u8, i8, bool
            2 | 3 => 2,                // u16, i16
            4..=6 => 4,                // u32, i32, f32
            10..=12 => 8,              // u64, i64, f64
            8 => self.len_bytes(),     // string: its length
            9 => 4 + self.len_bytes(), // array: element type and length
            _ => return None,
        })
    }

    /// A metadata value of type `ty` (GGUF's numbering), `depth` arrays deep, under `key`.
    fn value(&mut self, ty: u32, depth: usize, key: &str) -> Result<Value> {
        self.spend(1, key)?;
        let what = format!("metadata {key:?}");
        Ok(match ty {
            0 => Value::U8(self.array::<1>(&what)?[0]),
            1 => Value::I8(self.array::<1>(&what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => Value::U32(self.u32(&what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => match self.array::<1>(&what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.format(format!("{what}: bool byte {b}"))),
            },
            8 => Value::String(self.string(&what)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.format(format!(
                        "{what}: arrays nested more than {MAX_ARRAY_DEPTH} deep"
                    )));
                }
                let elem = self.u32(&what)?;
                let each = self
                    .min_size(elem)
                    .ok_or_else(|| self.format(format!("{what}: array of unknown type {elem}")))?;
                let n = self.count(&what)?;
                self.need(n, each, &what)?;
                // the values themselves are spent one by one as they are read
                if n > self.values_left {
                    return Err(self.format(format!(
                        "{what}: array of {n} values exceeds the limit of \
                         {MAX_METADATA_VALUES} metadata values"
                    )));
                }
                let mut vs = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    vs.push(self.value(elem, depth + 1, key)?);
                }
                Value::Array(vs)
            }
            10 => Value::U64(self.u64(&what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            t => return Err(self.format(format!("{what}: unknown value type {t}"))),
        })
    }

    /// One tensor info after its name, and the bytes its data takes.
    fn tensor_info(&mut self, name: &str) -> Result<(TensorInfo, u64)> {
        let what = format!("tensor {name:?}");
        let n_dims = self.u32(&what)? as usize;
        if n_dims > MAX_DIMS {
            return Err(self.format(format!("{what}: {n_dims} dimensions (at most {MAX_DIMS})")));
        }
        let mut dims = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            let d = self.count(&what)?;
            dims.push(
                usize::try_from(d)
                    .map_err(|_| self.format(format!("{what}: dimension {d} too large")))?,
            );
        }
        // GGUF lists the fastest-varying dimension first; candle's shapes list it last
        dims.reverse();
        let code = self.u32(&what)?;
        let dtype = ggml_dtype(code)
            .ok_or_else(|| self.format(format!("{what}: unknown tensor type {code}")))?;
        let offset = self.u64(&what)?;
        let elems = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| self.format(format!("{what}: element count of {dims:?} overflows")))?;
        if elems == 0 {
            // candle reads an empty tensor through a misaligned empty slice (undefined
            // behaviour), and no model has one
            return Err(self.format(format!("{what}: no elements (shape {dims:?})")));
        }
        let block = dtype.block_size();
        if elems % block != 0 {
            return Err(self.format(format!(
                "{what}: {elems} elements are not whole blocks of {block} ({dtype:?})"
            )));
        }
        let bytes = (elems / block)
            .checked_mul(dtype.type_size())
            .and_then(|b| u64::try_from(b).ok())
            .ok_or_else(|| self.format(format!("{what}: byte size overflows")))?;
        let info = TensorInfo {
            ggml_dtype: dtype,
            shape: candle_core::Shape::from(dims),
            offset,
        };
        Ok((info, bytes))
    }
}

/// ggml's tensor type numbers, for the types candle reads.
fn ggml_dtype(code: u32) -> Option<GgmlDType> {
    Some(match code {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// [`read_content`] on a byte slice (the whole file).
pub fn read_content_from_bytes(bytes: &[u8]) -> Result<Content> {
    read_content(bytes, bytes.len() as u64, Path::new("<bytes>"))
}
