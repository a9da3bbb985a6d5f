//! Input checks shared by every backend, so bad input gets the same error everywhere (SPEC.md section 14).

use crate::config::KvShape;
use crate::error::{MosaicError, Result};
use ndarray::{ArrayView2, ArrayView3};

/// Every element finite, else `NonFinite` with the first bad flat index (row-major).
pub fn finite<'a>(what: &'static str, values: impl IntoIterator<Item = &'a f32>) -> Result<()> {
    match values.into_iter().position(|x| !x.is_finite()) {
        Some(index) => Err(MosaicError::NonFinite { what, index }),
        None => Ok(()),
    }
}

fn mismatch(what: &'static str, expected: String, got: &[usize]) -> MosaicError {
    MosaicError::ShapeMismatch {
        what,
        expected,
        got: format!("{got:?}"),
    }
}

/// Prompt K/V: `[tokens, kv_heads, head_dim]`, same shape, finite.
pub fn prompt_kv(shape: &KvShape, keys: &ArrayView3<f32>, values: &ArrayView3<f32>) -> Result<()> {
    for (what, s) in [("keys", keys.shape()), ("values", values.shape())] {
        if s[1] != shape.kv_heads || s[2] != shape.head_dim {
            return Err(mismatch(
                what,
                format!("[tokens, {}, {}]", shape.kv_heads, shape.head_dim),
                s,
            ));
        }
    }
    if keys.shape()[0] != values.shape()[0] {
        return Err(mismatch(
            "values",
            format!("{} tokens like keys", keys.shape()[0]),
            values.shape(),
        ));
    }
    finite("keys", keys.iter())?;
    finite("values", values.iter())
}

/// One token's K/V: `[kv_heads, head_dim]`, finite.
pub fn token_kv(shape: &KvShape, key: &ArrayView2<f32>, value: &ArrayView2<f32>) -> Result<()> {
    for (what, s) in [("key", key.shape()), ("value", value.shape())] {
        if s != [shape.kv_heads, shape.head_dim] {
            return Err(mismatch(
                what,
                format!("[{}, {}]", shape.kv_heads, shape.head_dim),
                s,
            ));
        }
    }
    finite("key", key.iter())?;
    finite("value", value.iter())
}

/// Queries `[q_heads, head_dim]`, finite, each row's norm at most 2^64
/// ([`crate::rules::QUERY_NORM_MAX`]); output of the same shape.
pub fn queries(shape: &KvShape, queries: &ArrayView2<f32>, out_shape: &[usize]) -> Result<()> {
    if queries.shape() != [shape.q_heads, shape.head_dim] {
        return Err(mismatch(
            "queries",
            format!("[{}, {}]", shape.q_heads, shape.head_dim),
            queries.shape(),
        ));
    }
    if out_shape != [shape.q_heads, shape.head_dim] {
        return Err(mismatch(
            "out",
            format!("[{}, {}]", shape.q_heads, shape.head_dim),
            out_shape,
        ));
    }
    finite("queries", queries.iter())?;
    crate::rules::queries_in_range(queries.rows(), shape.head_dim)
}

/// Inputs of top-k selection (SPEC.md section 8.3): one length per score, every
/// score finite (a NaN has no place in a descending order).
pub fn block_scores(scores: &[f32], block_lens: &[usize]) -> Result<()> {
    if scores.len() != block_lens.len() {
        return Err(MosaicError::ShapeMismatch {
            what: "block_lens",
            expected: format!("{} entries like scores", scores.len()),
            got: format!("{}", block_lens.len()),
        });
    }
    finite("scores", scores.iter())
}
