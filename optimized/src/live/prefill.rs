//! Chunked prefill (SPEC.md section 10.1 with an unknown total length): the
//! sink first, then closed prompt segments cut by a [`PrefillRule`] as soon as
//! it allows; `finish_prefill` closes the remainder.

use super::{gather, LiveCache};
use crate::mosaic::encode_segment;
use mosaickv_spec::query::LossContext;
use mosaickv_spec::{rules, validate, KvCache, MosaicError, Result, Segment, SegmentState};
use ndarray::ArrayView3;
use rayon::prelude::*;

/// When chunked prefill cuts a prompt segment (SPEC 10.1 with an unknown total length).
///
/// SPEC 10.1 makes the *last* prompt segment absorb the remainder (length in
/// `[L_in, 2 L_in)`), which needs the total length. A chunked prompt does not
/// know it, so the two rules trade compression latency against equality:
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillRule {
    /// A segment of exactly `L_in` tokens closes as soon as `2 L_in` tokens are
    /// pending (then it cannot be the last one); `finish_prefill` closes the
    /// pending rest (`[L_in, 2 L_in)` tokens, or all when the prompt is
    /// shorter) as one segment. Equals SPEC 10.1 bit for bit; up to `2 L_in`
    /// prompt tokens stay uncompressed host rows until then.
    Exact,
    /// A segment of exactly `L_in` tokens closes as soon as `L_in` tokens are
    /// pending; `finish_prefill` closes the remainder (`< L_in` tokens) as its
    /// own segment. Equals SPEC 10.1 when the post-sink prompt length `m` is a
    /// multiple of `L_in` or below it; otherwise 10.1 would merge the
    /// remainder into the previous segment and this rule keeps it apart.
    Eager,
}

pub(super) struct Prefill {
    pub(super) rule: PrefillRule,
    pub(super) keys: Vec<f32>,
    pub(super) values: Vec<f32>,
}

impl LiveCache {
    /// SPEC 10.1 for a prompt arriving in chunks `[tokens, kv_heads, head_dim]`:
    /// sink first, then closed prompt segments cut by `rule` as soon as it allows
    /// (see [`PrefillRule`]). Only before the first `append`/`attend`; every
    /// chunk must use the same rule. Segments are encoded on the caller's
    /// thread, in parallel over heads.
    pub fn prefill_chunk(
        &mut self,
        keys: ArrayView3<f32>,
        values: ArrayView3<f32>,
        rule: PrefillRule,
    ) -> Result<()> {
        let shape = self.view.shape;
        validate::prompt_kv(&shape, &keys, &values)?;
        if self.prompt_done || self.sent > 0 || self.view.buffer.tokens > 0 {
            return Err(MosaicError::AlreadyPrefilled(self.len()));
        }
        if let Some(p) = &self.prefill {
            if p.rule != rule {
                return Err(MosaicError::InvalidConfig(format!(
                    "prefill rule {rule:?} after chunks with {:?}",
                    p.rule
                )));
            }
        }
        let row = self.row_len();
        let n = keys.shape()[0];
        let to_sink = self
            .view
            .config
            .sink_tokens
            .saturating_sub(self.view.sink.tokens)
            .min(n);
        let kdata: Vec<f32> = keys.iter().copied().collect();
        let vdata: Vec<f32> = values.iter().copied().collect();
        // SPEC 14: every row's norm within f16's range (keys, then values), so that no
        // later flush or close (on the worker) can fail on magnitude.
        rules::rows_storable(rules::ROW_KEYS, &kdata, shape.head_dim)?;
        rules::rows_storable(rules::ROW_VALUES, &vdata, shape.head_dim)?;
        for t in 0..to_sink {
            self.view.sink.push(
                kdata[t * row..(t + 1) * row].iter().copied(),
                vdata[t * row..(t + 1) * row].iter().copied(),
            );
        }
        let p = self.prefill.get_or_insert(Prefill {
            rule,
            keys: Vec::new(),
            values: Vec::new(),
        });
        p.keys.extend_from_slice(&kdata[to_sink * row..]);
        p.values.extend_from_slice(&vdata[to_sink * row..]);
        let l_in = self.view.config.input_segment_len;
        loop {
            let pending = self.prefill.as_ref().map_or(0, |p| p.keys.len() / row);
            let cut = match rule {
                // SPEC 10.1's own cut (spec::rules), with more of the prompt possibly to come.
                PrefillRule::Exact => rules::next_prompt_segment(pending, l_in, false),
                // Not SPEC 10.1 (see `PrefillRule::Eager`): cut as soon as L_in are pending.
                PrefillRule::Eager => (pending >= l_in).then_some(l_in),
            };
            match cut {
                Some(len) => self.close_prompt_segment(len)?,
                None => return Ok(()),
            }
        }
    }

    /// Ends a chunked prompt: the pending rows become the last prompt segment
    /// (SPEC 10.1). A no-op when nothing is pending.
    pub fn finish_prefill(&mut self) -> Result<()> {
        let row = self.row_len();
        let l_in = self.view.config.input_segment_len;
        let mut pending = self.prefill.as_ref().map_or(0, |p| p.keys.len() / row);
        while let Some(len) = rules::next_prompt_segment(pending, l_in, true) {
            self.close_prompt_segment(len)?;
            pending -= len;
        }
        self.prefill = None;
        self.prompt_done = true;
        Ok(())
    }

    /// Encodes the first `len` pending prompt tokens as a closed segment.
    fn close_prompt_segment(&mut self, len: usize) -> Result<()> {
        let shape = self.view.shape;
        let (kv, d) = (shape.kv_heads, shape.head_dim);
        let row = kv * d;
        let p = self.prefill.as_mut().expect("pending prompt rows");
        let config = &self.view.config;
        let (pk, pv) = (&p.keys[..len * row], &p.values[..len * row]);
        let start = self.view.sink.tokens + self.view.segment_tokens();
        let stats = self.query_stats.as_ref();
        let heads = (0..kv)
            .into_par_iter()
            .map(|h| {
                let ctx = stats.map(|stats| LossContext {
                    stats,
                    head: h,
                    start,
                    len,
                });
                encode_segment(&gather(pk, kv, d, h), &gather(pv, kv, d, h), d, config, ctx)
            })
            .collect::<Result<Vec<_>>>()?;
        p.keys.drain(..len * row);
        p.values.drain(..len * row);
        self.view.segments.push(Segment {
            start,
            len,
            state: SegmentState::Closed,
            heads,
        });
        self.tags.push(None);
        Ok(())
    }

    /// The loss strategies are chosen by (SPEC.md section 11.1), as the manifest reports it.
    pub fn loss_in_use(&self) -> &'static str {
        mosaickv_spec::query::loss_in_use(&self.view.config, self.query_stats.is_some())
    }

    pub(super) fn end_prompt(&mut self) -> Result<()> {
        if !self.prompt_done {
            self.finish_prefill()?;
        }
        Ok(())
    }
}
