//! Applying the worker's answers to the decode-side view (SPEC.md section
//! 10.4, "Swaps" in the module docs): a closed segment replaces the tokens it
//! covers, a re-encoded flush moves from a provisional segment into the
//! authoritative open one; [`LiveCache::drain`] waits for every answer.

use super::flush::append_part;
use super::protocol::{Done, Part, Tag, Update};
use super::{Engine, LiveCache};
use mosaickv_spec::{HeadSegment, MosaicError, Result, Segment, SegmentState};
use std::sync::mpsc::TryRecvError;

impl LiveCache {
    /// Applies every worker result that has arrived, without waiting.
    pub(super) fn poll(&mut self) {
        loop {
            let got = match &self.engine {
                Engine::Async { done, .. } => match done.try_recv() {
                    Ok(d) => Some(d),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => {
                        if self.sent > self.answered && self.failed.is_none() {
                            self.failed = Some(MosaicError::BackendUnavailable(
                                "live worker stopped".into(),
                            ));
                        }
                        None
                    }
                },
                Engine::Sync(_) => None,
            };
            match got {
                Some(d) => self.apply(d),
                None => return,
            }
        }
    }

    /// Applies every worker result that has arrived, without waiting (what `append` and
    /// `attend` do first); a failed worker is reported.
    pub fn apply_arrived(&mut self) -> Result<()> {
        self.poll();
        self.check_failed()
    }

    /// Blocks until the worker has answered every flush and applies the answers.
    /// Afterwards the cache equals the synchronous one (SPEC 10.4).
    pub fn drain(&mut self) -> Result<()> {
        while self.sent > self.answered {
            let d = match &self.engine {
                Engine::Async { done, .. } => done
                    .recv()
                    .map_err(|_| MosaicError::BackendUnavailable("live worker stopped".into()))?,
                Engine::Sync(_) => unreachable!("sync flushes are answered inline"),
            };
            self.apply(d);
        }
        self.check_failed()
    }

    pub(super) fn apply(&mut self, d: Done) {
        debug_assert_eq!(d.seq, self.answered + 1, "worker answers in order");
        self.answered = d.seq;
        match d.update {
            Ok(Update::Nothing) => {}
            Ok(Update::Reencode {
                start,
                n,
                tag,
                parts,
            }) => {
                self.apply_reencode(start, n, tag, parts);
                self.stats.reencodes += 1;
            }
            Ok(Update::Close { start, len, heads }) => {
                self.apply_close(start, len, heads);
                self.stats.closes += 1;
            }
            Err(e) => {
                if self.failed.is_none() {
                    self.failed = Some(e);
                }
            }
        }
    }

    /// Removes the first `k` tokens of segment `i` (an open segment made of whole flushes,
    /// so `k` is a multiple of its block size); drops the segment if nothing is left.
    fn cut_front(&mut self, i: usize, k: usize) {
        let seg = &mut self.view.segments[i];
        if k >= seg.len {
            self.view.segments.remove(i);
            self.tags.remove(i);
            return;
        }
        for hs in &mut seg.heads {
            let st = &hs.strategy;
            let b = st.block_size;
            debug_assert_eq!(k % b, 0, "flush boundaries are block boundaries");
            hs.keys.bytes.drain(..k * st.key.layout.record_bytes());
            hs.keys.count -= k;
            hs.values.bytes.drain(..k * st.value.layout.record_bytes());
            hs.values.count -= k;
            let cut = (k / b) * hs.meta.kept_dims;
            hs.meta.min.drain(..cut);
            hs.meta.max.drain(..cut);
            hs.meta.scale.drain(..k / b);
            hs.meta.tokens -= k;
        }
        seg.start += k;
        seg.len -= k;
    }

    /// Replaces the view's tokens `[start, start + len)` with the closed segment.
    fn apply_close(&mut self, start: usize, len: usize, heads: Vec<HeadSegment>) {
        let i = self
            .view
            .segments
            .iter()
            .position(|s| s.start == start)
            .expect("a closed segment starts where the view has a segment boundary");
        let end = start + len;
        while i < self.view.segments.len() && self.view.segments[i].start < end {
            let s = &self.view.segments[i];
            let k = (end - s.start).min(s.len);
            self.cut_front(i, k);
        }
        self.view.segments.insert(
            i,
            Segment {
                start,
                len,
                state: SegmentState::Closed,
                heads,
            },
        );
        self.tags.insert(i, None);
    }

    /// Moves a provisional flush at `start` into the authoritative open segment (tag `tag`).
    fn apply_reencode(&mut self, start: usize, n: usize, tag: Tag, parts: Vec<Part>) {
        let i = self
            .view
            .segments
            .iter()
            .position(|s| s.start == start)
            .expect("a re-encoded flush starts a provisional segment");
        self.cut_front(i, n);
        let merge = i > 0
            && self.view.segments[i - 1].state == SegmentState::Open
            && self.tags[i - 1] == Some(tag);
        if merge {
            let seg = &mut self.view.segments[i - 1];
            for (hs, p) in seg.heads.iter_mut().zip(parts) {
                append_part(hs, p);
            }
            seg.len += n;
        } else {
            let Tag::Seg(from) = tag else {
                unreachable!("a re-encode follows a close, so its strategy is a closed segment's")
            };
            let src = self
                .view
                .segments
                .iter()
                .find(|s| s.start == from)
                .expect("the strategy's segment is in the view");
            let heads = src
                .heads
                .iter()
                .zip(parts)
                .map(|(h, p)| HeadSegment {
                    strategy: h.strategy.clone(),
                    keys: p.keys,
                    values: p.values,
                    meta: p.meta,
                })
                .collect();
            self.view.segments.insert(
                i,
                Segment {
                    start,
                    len: n,
                    state: SegmentState::Open,
                    heads,
                },
            );
            self.tags.insert(i, Some(tag));
        }
    }
}
