//! The compressed cache of one layer, as data (SPEC.md section 9), and its memory report.

use crate::config::{CompressConfig, KvShape};
use crate::layout::{BlockMeta, PackedRows, Strategy};
use half::f16;
use serde::{Deserialize, Serialize};

/// One KV head's part of a segment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadSegment {
    pub strategy: Strategy,
    pub keys: PackedRows,
    pub values: PackedRows,
    pub meta: BlockMeta,
}

/// Whether a segment holds its final encoding or a temporary one made with
/// the previous segment's strategy (SPEC.md section 10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SegmentState {
    Closed,
    Open,
}

/// A run of consecutive tokens `[start, start + len)` compressed with one
/// strategy per KV head. Boundaries are shared by all heads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    pub start: usize,
    pub len: usize,
    pub state: SegmentState,
    pub heads: Vec<HeadSegment>,
}

/// Uncompressed f16 rows `[tokens][kv_heads][head_dim]` (the sink and the update buffer).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DenseRows {
    pub tokens: usize,
    pub keys: Vec<f16>,
    pub values: Vec<f16>,
}

impl DenseRows {
    pub fn bytes(&self) -> usize {
        2 * (self.keys.len() + self.values.len())
    }
    /// Key row of `token` for `head`.
    pub fn key(&self, shape: &KvShape, token: usize, head: usize) -> &[f16] {
        let o = (token * shape.kv_heads + head) * shape.head_dim;
        &self.keys[o..o + shape.head_dim]
    }
    pub fn value(&self, shape: &KvShape, token: usize, head: usize) -> &[f16] {
        let o = (token * shape.kv_heads + head) * shape.head_dim;
        &self.values[o..o + shape.head_dim]
    }
    pub fn push(
        &mut self,
        key: impl IntoIterator<Item = f32>,
        value: impl IntoIterator<Item = f32>,
    ) {
        self.keys.extend(key.into_iter().map(f16::from_f32));
        self.values.extend(value.into_iter().map(f16::from_f32));
        self.tokens += 1;
    }
    /// Takes the last token back out (`row` = `kv_heads * head_dim` elements per side):
    /// how a cache undoes an `append` whose flush failed (SPEC.md section 14).
    pub fn pop(&mut self, row: usize) {
        if self.tokens > 0 {
            self.tokens -= 1;
            self.keys.truncate(self.keys.len().saturating_sub(row));
            self.values.truncate(self.values.len().saturating_sub(row));
        }
    }
    pub fn clear(&mut self) {
        self.tokens = 0;
        self.keys.clear();
        self.values.clear();
    }
}

/// One layer's compressed cache: sink tokens, then segments in token order,
/// then the update buffer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompressedCache {
    pub shape: KvShape,
    pub config: CompressConfig,
    pub sink: DenseRows,
    pub segments: Vec<Segment>,
    pub buffer: DenseRows,
}

impl CompressedCache {
    pub fn new(shape: KvShape, config: CompressConfig) -> Self {
        Self {
            shape,
            config,
            sink: DenseRows::default(),
            segments: Vec::new(),
            buffer: DenseRows::default(),
        }
    }

    /// Tokens in segments (the ones token selection chooses from).
    pub fn segment_tokens(&self) -> usize {
        self.segments.iter().map(|s| s.len).sum()
    }

    /// Every token held: sink + segments + buffer.
    pub fn len(&self) -> usize {
        self.sink.tokens + self.segment_tokens() + self.buffer.tokens
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Device-side bytes, itemized (SPEC.md section 13).
    pub fn memory(&self) -> MemoryReport {
        let mut m = MemoryReport {
            tokens: self.len(),
            dense: self.sink.bytes() + self.buffer.bytes(),
            ..MemoryReport::default()
        };
        for seg in &self.segments {
            m.segment_headers += SEGMENT_HEADER_BYTES;
            for h in &seg.heads {
                for (side, rows) in [(&h.strategy.key, &h.keys), (&h.strategy.value, &h.values)] {
                    let l = &side.layout;
                    m.values += rows.count * l.value_bytes();
                    m.scales += rows.count * l.scale_bytes();
                    // a coded side's per-dim width, offset and step (SPEC.md section 6.1)
                    m.scales += crate::coded::CODING_BYTES_PER_DIM * side.coding.len();
                    m.bitmaps += rows.count * l.bitmap_bytes();
                    m.padding += rows.count * l.padding_bytes();
                    m.rotations += 2 * side.rotation.len();
                    m.segment_headers += STRATEGY_HEADER_BYTES;
                }
                m.block_meta += h.meta.bytes();
            }
        }
        m
    }
}

/// Bytes charged per segment for its start, length and state.
pub const SEGMENT_HEADER_BYTES: usize = 16;
/// Bytes charged per side strategy for its scalars (kept_dims, r, g, dtype, block size, fit loss).
pub const STRATEGY_HEADER_BYTES: usize = 32;

/// SPEC.md sections 10.4 and 13: the host bytes of a live cache's covariance accumulators
/// while a segment is open, one `head_dim x head_dim` f64 matrix per KV head and side:
/// `2 * kv_heads * head_dim^2 * 8` ([`MemoryReport::host_scratch`]). The one place this size is
/// written: the live cache reports it and the server's budget charges it.
pub fn covariance_scratch_bytes(kv_heads: usize, head_dim: usize) -> usize {
    2 * kv_heads * head_dim * head_dim * std::mem::size_of::<f64>()
}

/// Every byte a cache holds, by kind. Device-side kinds are summed by
/// [`MemoryReport::device_bytes`]; `host_rows` (full-precision rows kept on the
/// host for open segments) and `host_scratch` are reported apart
/// ([`MemoryReport::host_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MemoryReport {
    pub tokens: usize,
    /// Retained K/V elements (or the dense f16 rows of an uncompressed cache).
    pub values: usize,
    pub bitmaps: usize,
    /// Per-record value scales of int8/int4 sides (f16, 2 B per record; SPEC.md section 6), and
    /// coded sides' per-dim width, offset and step (5 B per dim and segment; section 6.1).
    #[serde(default)]
    pub scales: usize,
    /// Record padding: zero bytes up to a multiple of 4 bytes per record (SPEC.md section 6).
    pub padding: usize,
    /// Block min/max metadata.
    pub block_meta: usize,
    pub rotations: usize,
    /// Sink and update-buffer rows (f16, uncompressed).
    pub dense: usize,
    pub segment_headers: usize,
    /// Host-side f32 rows of open segments (not device memory).
    pub host_rows: usize,
    /// Host-side working state kept beside the rows (not device memory): the live cache's
    /// covariance accumulators for its open segment's fit (SPEC.md sections 10.4 and 13),
    /// `2 * kv_heads * head_dim^2` f64 while a segment is open; 0 for every other cache.
    #[serde(default)]
    pub host_scratch: usize,
}

/// Kind by kind: the memory of several caches together (e.g. all layers of a model).
impl std::ops::AddAssign for MemoryReport {
    fn add_assign(&mut self, o: Self) {
        self.tokens += o.tokens;
        self.values += o.values;
        self.bitmaps += o.bitmaps;
        self.scales += o.scales;
        self.padding += o.padding;
        self.block_meta += o.block_meta;
        self.rotations += o.rotations;
        self.dense += o.dense;
        self.segment_headers += o.segment_headers;
        self.host_rows += o.host_rows;
        self.host_scratch += o.host_scratch;
    }
}

impl MemoryReport {
    pub fn device_bytes(&self) -> usize {
        self.values
            + self.scales
            + self.bitmaps
            + self.padding
            + self.block_meta
            + self.rotations
            + self.dense
            + self.segment_headers
    }
    /// Host-side bytes beside the device data: `host_rows + host_scratch`.
    pub fn host_bytes(&self) -> usize {
        self.host_rows + self.host_scratch
    }
    /// Device bytes per cached token (0 for an empty cache).
    pub fn bytes_per_token(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.device_bytes() as f64 / self.tokens as f64
        }
    }
    /// Bytes per token of a dense f16 K+V cache of this shape: `2 * 2 * kv_heads * head_dim`.
    pub fn dense_f16_bytes_per_token(shape: &KvShape) -> f64 {
        (4 * shape.kv_heads * shape.head_dim) as f64
    }
}
