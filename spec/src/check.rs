//! The one structural validator of a [`CompressedCache`] (SPEC.md sections
//! 6, 7, 10, 14 and 15.4). Every backend calls it before it reads a cache
//! it did not build itself, and the file reader calls it after parsing, so
//! a defective cache gets the same error everywhere.

use crate::cache::{CompressedCache, DenseRows, SegmentState};
use crate::config::KvShape;
use crate::error::{MosaicError, Result};
use crate::layout::{PackedRows, SideStrategy};

fn shape_err(
    what: &'static str,
    expected: impl std::fmt::Display,
    got: impl std::fmt::Display,
) -> MosaicError {
    MosaicError::ShapeMismatch {
        what,
        expected: expected.to_string(),
        got: got.to_string(),
    }
}

/// Dense f16 rows: `tokens * kv_heads * head_dim` keys and values, all finite.
pub(crate) fn validate_dense(shape: &KvShape, rows: &DenseRows, what: &'static str) -> Result<()> {
    let n = rows
        .tokens
        .checked_mul(shape.kv_heads)
        .and_then(|x| x.checked_mul(shape.head_dim));
    if n.is_none() || rows.keys.len() != n.unwrap_or(0) || rows.values.len() != n.unwrap_or(0) {
        let n = n.map_or("too many".to_string(), |n| n.to_string());
        return Err(shape_err(
            what,
            format!("{n} keys and values for {} tokens", rows.tokens),
            format!("{} keys, {} values", rows.keys.len(), rows.values.len()),
        ));
    }
    if let Some(index) = rows
        .keys
        .iter()
        .chain(&rows.values)
        .position(|v| !v.is_finite())
    {
        return Err(MosaicError::NonFinite { what, index });
    }
    Ok(())
}

/// One side of a head segment: a valid layout and rotation of the shape's
/// head_dim, a finite `fit_loss >= 0`, and `tokens` valid records.
fn validate_side(
    shape: &KvShape,
    s: &SideStrategy,
    rows: &PackedRows,
    tokens: usize,
    what: &'static str,
) -> Result<()> {
    s.validate()?;
    if s.layout.head_dim != shape.head_dim {
        return Err(shape_err(
            what,
            format!("head_dim {}", shape.head_dim),
            s.layout.head_dim,
        ));
    }
    if !(s.fit_loss.is_finite() && s.fit_loss >= 0.0) {
        return Err(MosaicError::InvalidConfig(format!(
            "{what}: fit_loss {} is not a finite value >= 0",
            s.fit_loss
        )));
    }
    if rows.count != tokens {
        return Err(shape_err(what, format!("{tokens} records"), rows.count));
    }
    // Checked here so that a huge count cannot overflow inside `PackedRows::validate`.
    if rows.count.checked_mul(s.layout.record_bytes()) != Some(rows.bytes.len()) {
        return Err(MosaicError::CorruptPacked(format!(
            "{what}: {} bytes for {} records of {} bytes",
            rows.bytes.len(),
            rows.count,
            s.layout.record_bytes()
        )));
    }
    rows.validate(&s.layout)
}

impl CompressedCache {
    /// Checks the whole structure ([`CompressedCache::validate_for_attention`]),
    /// then the lifecycle rule on segment states: only the last segment may be
    /// `Open` (SPEC.md sections 10 and 15.4). Files are checked with this.
    pub fn validate(&self) -> Result<()> {
        self.validate_for_attention()?;
        let last = self.segments.len().saturating_sub(1);
        if let Some(si) = self
            .segments
            .iter()
            .position(|s| s.state == SegmentState::Open)
            .filter(|&si| si != last)
        {
            return Err(MosaicError::InvalidConfig(format!(
                "segment {si} is open but is not the last segment"
            )));
        }
        Ok(())
    }

    /// Everything a backend needs before it reads a cache (SPEC.md sections 8-9),
    /// in this order: the shape (`KvShape::new`)
    /// and `config.validate(head_dim)`; dense row counts and finiteness (sink,
    /// then buffer); sink tokens `<= sink_tokens`, and fewer only when there
    /// is no segment and no buffer token; buffer tokens `< buffer_capacity`;
    /// segments contiguous from the end of the sink, non-empty, `kv_heads`
    /// heads each; per head, K then V: valid layout and
    /// finite rotation of this head_dim, finite `fit_loss >= 0`, one valid
    /// record per token (`CorruptPacked` otherwise); then the block metadata:
    /// the strategy's block size, the key side's kept dims, the segment's
    /// tokens, `blocks * kept_dims` bounds in [-127, 127] with min <= max, and
    /// `blocks` finite scales >= 0.
    ///
    /// Values inside records are not checked here: a non-finite stored value
    /// is `NonFinite` where it is decoded (SPEC.md section 6). Segment states
    /// are not checked either: attention does not read them, and a production
    /// cache in the middle of a background swap (SPEC.md section 10.4) holds
    /// a provisional open segment ahead of the authoritative one.
    pub fn validate_for_attention(&self) -> Result<()> {
        let shape = &self.shape;
        KvShape::new(shape.kv_heads, shape.q_heads, shape.head_dim)?;
        let cfg = &self.config;
        cfg.validate(shape.head_dim)?;
        validate_dense(shape, &self.sink, "sink rows")?;
        validate_dense(shape, &self.buffer, "buffer rows")?;
        if self.sink.tokens > cfg.sink_tokens {
            return Err(shape_err(
                "sink rows",
                format!("at most {} tokens", cfg.sink_tokens),
                self.sink.tokens,
            ));
        }
        if self.sink.tokens < cfg.sink_tokens
            && (!self.segments.is_empty() || self.buffer.tokens > 0)
        {
            return Err(shape_err(
                "sink rows",
                format!(
                    "{} tokens before any segment or buffer token",
                    cfg.sink_tokens
                ),
                self.sink.tokens,
            ));
        }
        if self.buffer.tokens >= cfg.buffer_capacity {
            return Err(shape_err(
                "buffer rows",
                format!("fewer than {} tokens", cfg.buffer_capacity),
                self.buffer.tokens,
            ));
        }
        let mut next = self.sink.tokens;
        for (si, seg) in self.segments.iter().enumerate() {
            if seg.start != next || seg.len == 0 {
                return Err(shape_err(
                    "segment",
                    format!("segment {si} starting at token {next}, non-empty"),
                    format!("start {}, len {}", seg.start, seg.len),
                ));
            }
            if seg.heads.len() != shape.kv_heads {
                return Err(shape_err("segment heads", shape.kv_heads, seg.heads.len()));
            }
            for h in &seg.heads {
                let st = &h.strategy;
                validate_side(shape, &st.key, &h.keys, seg.len, "packed keys")?;
                validate_side(shape, &st.value, &h.values, seg.len, "packed values")?;
                let m = &h.meta;
                if st.block_size == 0
                    || m.block_size != st.block_size
                    || m.kept_dims != st.key.layout.kept_dims
                    || m.tokens != seg.len
                {
                    return Err(shape_err(
                        "block metadata",
                        format!(
                            "block size {}, {} dims, {} tokens",
                            st.block_size, st.key.layout.kept_dims, seg.len
                        ),
                        format!(
                            "block size {}, {} dims, {} tokens",
                            m.block_size, m.kept_dims, m.tokens
                        ),
                    ));
                }
                let n = m.blocks().checked_mul(m.kept_dims);
                if n.is_none()
                    || m.min.len() != n.unwrap_or(0)
                    || m.max.len() != n.unwrap_or(0)
                    || m.scale.len() != m.blocks()
                {
                    return Err(shape_err(
                        "block metadata",
                        format!(
                            "{} min and max values, {} scales",
                            n.map_or("too many".to_string(), |n| n.to_string()),
                            m.blocks()
                        ),
                        format!(
                            "{} min, {} max, {} scales",
                            m.min.len(),
                            m.max.len(),
                            m.scale.len()
                        ),
                    ));
                }
                m.validate()
                    .map_err(|e| MosaicError::InvalidConfig(format!("block metadata: {e}")))?;
            }
            next = next.checked_add(seg.len).ok_or_else(|| {
                shape_err("segment", "token positions that fit in usize", seg.len)
            })?;
        }
        Ok(())
    }
}

/// SPEC.md section 6, decode of one record into `out` (`kept_dims` long): the stored value
/// (f16, or `m + code * s` in f32) at each kept dim, 0 elsewhere; a coded record (section
/// 6.1) every dim. The record must be valid (`PackedRows::validate`).
fn decode_into(side: &crate::layout::SideStrategy, rec: &[u8], out: &mut [f32]) {
    use crate::layout::{bitmap_bit, dequantize, read_code, record_quant, record_value};
    let layout = &side.layout;
    if layout.dtype == crate::layout::ValueDtype::Coded {
        // SPEC.md section 6.1: every dim from its own offset and step.
        let codes = crate::coded::unpack_codes(&side.coding, rec);
        for ((x, c), d) in out.iter_mut().zip(codes).zip(&side.coding) {
            *x = d.decode(c);
        }
        return;
    }
    let g = layout.group_size;
    let quant = layout
        .dtype
        .is_quantized()
        .then(|| record_quant(layout, rec));
    let codes = &rec[layout.values_offset()..];
    out.fill(0.0);
    let mut next = 0;
    for k in 0..layout.groups() {
        if bitmap_bit(rec, k) {
            for x in &mut out[k * g..(k + 1) * g] {
                *x = match quant {
                    Some(p) => dequantize(p, read_code(layout.dtype, codes, next)),
                    None => record_value(layout, rec, next).to_f32(),
                };
                next += 1;
            }
        }
    }
}

impl CompressedCache {
    /// SPEC.md sections 7, 8.2 and 15.4: every block's stored bounds are true bounds of its
    /// decoded keys, `qmin_j * s <= k^_j <= qmax_j * s` for every token and kept dim (zeros
    /// included), so a block score is an upper bound of what attention computes. Run on every
    /// loaded file after [`CompressedCache::validate`]: a crafted file whose metadata does not
    /// bound its records (all bounds zero, say) would otherwise load and make selection skip
    /// the blocks that matter. Cost: one decode of every key record (about what one dense
    /// pass over the keys costs), no allocation beyond one row.
    pub fn check_block_bounds(&self) -> Result<()> {
        for (si, seg) in self.segments.iter().enumerate() {
            for (h, head) in seg.heads.iter().enumerate() {
                let layout = &head.strategy.key.layout;
                let meta = &head.meta;
                let dt = layout.kept_dims;
                let mut row = vec![0.0f32; dt];
                for t in 0..seg.len {
                    let b = t / meta.block_size;
                    decode_into(&head.strategy.key, head.keys.record(layout, t), &mut row);
                    let s = f64::from(meta.scale[b]);
                    for (j, &x) in row.iter().enumerate() {
                        if !x.is_finite() {
                            return Err(MosaicError::CorruptPacked(format!(
                                "segment {si}, head {h}, keys record {t}: a stored value is not finite"
                            )));
                        }
                        let (lo, hi) = (meta.min[b * dt + j], meta.max[b * dt + j]);
                        let x = f64::from(x);
                        if f64::from(lo) * s > x || f64::from(hi) * s < x {
                            return Err(MosaicError::BadFormat(format!(
                                "segment {si}, head {h}, block {b}: the block metadata does not \
                                 bound its keys (token {t}, dim {j}: {x} outside [{}, {}]; \
                                 SPEC.md section 7)",
                                f64::from(lo) * s,
                                f64::from(hi) * s
                            )));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

impl CompressedCache {
    /// SPEC.md sections 14 and 15.4: every stored f16 value of every record is finite. Encode
    /// never stores a non-finite f16, so one in a file is damage: `CorruptPacked`, refused on
    /// load and before writing (rather than met by attention, where the backends would differ).
    pub fn check_records_finite(&self) -> Result<()> {
        for (s, seg) in self.segments.iter().enumerate() {
            for (h, head) in seg.heads.iter().enumerate() {
                for (side, rows, layout) in [
                    ("keys", &head.keys, &head.strategy.key.layout),
                    ("values", &head.values, &head.strategy.value.layout),
                ] {
                    if layout.dtype != crate::layout::ValueDtype::F16 {
                        continue;
                    }
                    for i in 0..rows.count {
                        let rec = rows.record(layout, i);
                        if (0..layout.r)
                            .any(|j| !crate::layout::record_value(layout, rec, j).is_finite())
                        {
                            return Err(MosaicError::CorruptPacked(format!(
                                "segment {s}, head {h}, {side} record {i}: a stored f16 value is not finite"
                            )));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
