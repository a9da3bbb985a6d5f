//! How many device bytes a [`LiveCache`] can reach with more tokens appended (SPEC.md
//! section 13's `memory()`, every byte counted), from the state it is in now. A scheduler
//! reserves this for a running sequence instead of a worst case priced before the prompt
//! was compressed.
//!
//! What the lifecycle of SPEC 10.2-10.4 allows after the prompt is in segments:
//! - a new token sits in the update buffer (dense f16 rows, at most `buffer_capacity`
//!   of them) until a flush encodes it with the open segment's temporary strategy: the
//!   last segment's strategy, so its record and metadata bytes per token are known;
//! - the first flush after a closed segment opens a segment that holds a copy of that
//!   strategy (its rotations and headers are charged again);
//! - only a segment close changes a strategy, and a generated segment closes only once
//!   it holds at least `min(min_segment_len, max_segment_len)` tokens (SPEC 10.3,
//!   `CompressConfig::close_spacing`). With `o` tokens in open
//!   segments now and `f` still to be flushed (the buffer's and the new ones), at most
//!   `c = floor((o + f) / close_spacing)` closes can happen.
//!
//! With no close possible (`c = 0`, the common case for a reply shorter than
//! `close_spacing`), the bound is exact up to the buffer's last partial fill. With
//! closes possible, every open or future token is priced at the policy's largest record
//! again (the close re-encodes the open segment with a new strategy) and each close at two
//! of the largest segment overheads (the closed segment's new strategy and the next open
//! segment's copy of it).

use super::LiveCache;
use mosaickv_spec::cache::{SEGMENT_HEADER_BYTES, STRATEGY_HEADER_BYTES};
use mosaickv_spec::{SegmentState, Strategy};

/// Bytes per token of one head's records and block metadata under `st` (whole blocks).
fn head_rate(st: &Strategy) -> usize {
    let bs = st.block_size.max(1);
    st.key.layout.record_bytes()
        + st.value.layout.record_bytes()
        + (2 * st.key.layout.kept_dims + 4).div_ceil(bs)
}

/// Bytes of one head's strategy held once per segment: rotations and side headers.
fn head_overhead(st: &Strategy) -> usize {
    2 * (st.key.rotation.len() + st.value.rotation.len()) + 2 * STRATEGY_HEADER_BYTES
}

impl LiveCache {
    /// The most device bytes `memory()` can report after at most `more` further
    /// `append`s, given the cache's state now (see the module doc for the rule); `None`
    /// while a chunked prompt is still pending (its segments are not fitted yet).
    pub fn device_bytes_bound(&self, more: usize) -> Option<usize> {
        if self.prefill.is_some() {
            return None;
        }
        let (kv, d) = (self.view.shape.kv_heads, self.view.shape.head_dim);
        let cfg = &self.view.config;
        let now = self.view.memory().device_bytes();
        let buffer_now = self.view.buffer.bytes();
        let buffer_cap = cfg.buffer_capacity * kv * 4 * d;
        let open: usize = self
            .view
            .segments
            .iter()
            .filter(|s| s.state == SegmentState::Open)
            .map(|s| s.len)
            .sum();
        let flushed = self.view.buffer.tokens + more;

        // The policy's largest record and per-segment overhead (any fitted strategy), from
        // `rules::worst_token_bytes` / `worst_segment_head_bytes`, computed once at build.
        let (worst_rate, worst_segment) = self.worst;

        let closes = (open + flushed) / cfg.close_spacing();
        let segments_bytes = now - buffer_now;
        let bound = match self.view.segments.last() {
            Some(last) if closes == 0 => {
                let rate: usize = last.heads.iter().map(|h| head_rate(&h.strategy)).sum();
                let reopen = if last.state == SegmentState::Open {
                    0
                } else {
                    SEGMENT_HEADER_BYTES
                        + last
                            .heads
                            .iter()
                            .map(|h| head_overhead(&h.strategy))
                            .sum::<usize>()
                };
                segments_bytes + flushed * rate + reopen + buffer_cap
            }
            // No segment yet (the first flush fits its own strategy), or closes possible.
            _ => {
                segments_bytes
                    + (open + flushed) * worst_rate
                    + (2 * closes + 1) * worst_segment
                    + buffer_cap
            }
        };
        Some(bound)
    }
}
