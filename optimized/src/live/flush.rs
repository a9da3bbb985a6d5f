//! The decode path's flush (SPEC.md section 10.2): the full update buffer
//! encoded with the open segment's temporary strategy and appended to it (the
//! fast path), then sent to the worker as a [`FlushJob`] (SPEC 10.4).

use super::protocol::{Done, FlushJob, Job, Part, Tag};
use super::{gather, Engine, LiveCache};
use crate::mosaic::first_strategies;
use crate::{meta, packed};
use mosaickv_spec::{BlockMeta, HeadSegment, MosaicError, Result, Segment, SegmentState, Strategy};
use rayon::prelude::*;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// SPEC 10.2 step 2 for one head: records and metadata of rows `[n][d]` under `st`.
fn encode_part(k: &[f32], v: &[f32], st: &Strategy) -> Result<Part> {
    let keys = packed::encode_rows(k, &st.key)?;
    let values = packed::encode_rows(v, &st.value)?;
    let dense = packed::decode_trusted(&keys, &st.key);
    let meta = meta::block_meta_dense(&dense, st.key.layout.kept_dims, st.block_size);
    Ok(Part { keys, values, meta })
}

/// Appends a flush's records and metadata to a head segment (whole blocks, SPEC 10.2 step 2).
pub(super) fn append_part(hs: &mut HeadSegment, p: Part) {
    hs.keys.bytes.extend_from_slice(&p.keys.bytes);
    hs.keys.count += p.keys.count;
    hs.values.bytes.extend_from_slice(&p.values.bytes);
    hs.values.count += p.values.count;
    debug_assert_eq!(
        hs.meta.tokens % hs.meta.block_size.max(1),
        0,
        "open segments hold whole blocks"
    );
    hs.meta.append(&p.meta);
}

impl LiveCache {
    /// SPEC 10.2: the full buffer, encoded with the open segment's temporary strategy.
    pub(super) fn flush(&mut self) -> Result<()> {
        let shape = self.view.shape;
        let (kv, d) = (shape.kv_heads, shape.head_dim);
        let n = self.view.buffer.tokens;
        let start = self.view.sink.tokens + self.view.segment_tokens();
        let last_open =
            matches!(self.view.segments.last(), Some(s) if s.state == SegmentState::Open);
        // Everything fallible (fitting the first strategy, encoding) runs before the
        // first mutation, so an error leaves the cache as it was (SPEC 14).
        let (tag, new_open): (Tag, Option<Vec<Strategy>>) = if last_open {
            let tag = self
                .tags
                .last()
                .copied()
                .flatten()
                .expect("an open segment has a tag");
            (tag, None)
        } else {
            match self.view.segments.last() {
                Some(last) => (
                    Tag::Seg(last.start),
                    Some(last.heads.iter().map(|h| h.strategy.clone()).collect()),
                ),
                None => {
                    let fitted =
                        first_strategies(&self.buf_k, &self.buf_v, kv, d, &self.view.config)?;
                    (Tag::First, Some(fitted))
                }
            }
        };
        // Encode with the temporary strategy (the fast path), heads in order.
        let (bk, bv) = (&self.buf_k, &self.buf_v);
        let temp: Vec<&Strategy> = match &new_open {
            Some(st) => st.iter().collect(),
            None => {
                let seg = self.view.segments.last().expect("open segment");
                seg.heads.iter().map(|h| &h.strategy).collect()
            }
        };
        let parts: Vec<Part> = temp
            .par_iter()
            .enumerate()
            .map(|(h, st)| encode_part(&gather(bk, kv, d, h), &gather(bv, kv, d, h), st))
            .collect::<Vec<Result<_>>>()
            .into_iter()
            .collect::<Result<Vec<_>>>()?;
        drop(temp);

        // Commit.
        let mut send_strategies = None;
        if let Some(strategies) = new_open {
            if !self.primed {
                send_strategies = Some(Arc::new(strategies.clone()));
            }
            let heads = strategies
                .into_iter()
                .map(|strategy| HeadSegment {
                    meta: BlockMeta::empty(strategy.block_size, strategy.key.layout.kept_dims),
                    strategy,
                    keys: Default::default(),
                    values: Default::default(),
                })
                .collect();
            self.view.segments.push(Segment {
                start,
                len: 0,
                state: SegmentState::Open,
                heads,
            });
            self.tags.push(Some(tag));
        }
        if !self.primed && send_strategies.is_none() {
            let seg = self.view.segments.last().expect("open segment");
            send_strategies = Some(Arc::new(
                seg.heads.iter().map(|h| h.strategy.clone()).collect(),
            ));
        }
        let seg = self.view.segments.last_mut().expect("open segment");
        for (hs, p) in seg.heads.iter_mut().zip(parts) {
            append_part(hs, p);
        }
        seg.len += n;
        self.view.buffer.clear();
        let keys = std::mem::take(&mut self.buf_k);
        let values = std::mem::take(&mut self.buf_v);
        self.host_bytes
            .fetch_add(4 * (keys.len() + values.len()), Ordering::Relaxed);
        self.sent += 1;
        self.stats.flushes += 1;
        self.primed = true;
        let job = FlushJob {
            seq: self.sent,
            start,
            n,
            keys,
            values,
            tag,
            strategies: send_strategies,
        };
        let inline = match &mut self.engine {
            Engine::Sync(w) => Some(w.process(job)),
            Engine::Async { jobs, .. } => {
                let sent = jobs
                    .as_ref()
                    .map(|j| j.send(Job::Flush(job)).is_ok())
                    .unwrap_or(false);
                if !sent {
                    self.failed = Some(MosaicError::BackendUnavailable(
                        "live worker stopped".into(),
                    ));
                }
                None
            }
        };
        if let Some(update) = inline {
            self.apply(Done {
                seq: self.sent,
                update,
            });
        }
        self.check_failed()
    }
}
