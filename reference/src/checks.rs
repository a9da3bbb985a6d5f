//! The structural checks every reading step runs first (SPEC.md sections 6, 7, 14, 15.4):
//! a cache before selection (section 8) or attention (section 9) reads it, a selection before
//! attention follows it. A module of their own, so that `select` and `attention` both use them
//! without importing each other.

use mosaickv_spec::{CompressedCache, MosaicError, Result, Selection};

fn mismatch(what: &'static str, expected: String, got: String) -> MosaicError {
    MosaicError::ShapeMismatch {
        what,
        expected,
        got,
    }
}

/// Structural validation of a compressed cache before it is read: the spec
/// crate's one validator, [`CompressedCache::validate_for_attention`] (SPEC.md
/// sections 6, 7, 14, 15.4; segment states are lifecycle data attention does not read).
pub fn check_cache(cache: &CompressedCache) -> Result<()> {
    cache.validate_for_attention()
}

/// Checks a selection against the cache: one list per KV head, entries
/// strictly ascending, every `(segment, block)` in range.
pub fn check_selection(cache: &CompressedCache, selection: &Selection) -> Result<()> {
    if selection.per_head.len() != cache.shape.kv_heads {
        return Err(mismatch(
            "selection",
            format!("{} heads", cache.shape.kv_heads),
            format!("{}", selection.per_head.len()),
        ));
    }
    for (j, list) in selection.per_head.iter().enumerate() {
        for w in list.windows(2) {
            if w[0] >= w[1] {
                return Err(mismatch(
                    "selection",
                    "strictly ascending blocks".into(),
                    format!("{:?} then {:?}", w[0], w[1]),
                ));
            }
        }
        for &(s, b) in list {
            let ok = cache
                .segments
                .get(s as usize)
                .is_some_and(|seg| (b as usize) < seg.heads[j].meta.blocks());
            if !ok {
                return Err(mismatch(
                    "selection",
                    "existing (segment, block)".into(),
                    format!("({s}, {b}) for head {j}"),
                ));
            }
        }
    }
    Ok(())
}
