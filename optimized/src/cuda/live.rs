//! [`CudaLiveBatch`]: a batch of [`LiveCache`]s (SPEC.md section 10.4, the background
//! worker on the host) whose compressed data is kept resident on the device by one
//! [`CudaCache`], and attended there (issue 17).
//!
//! The host [`LiveCache`] stays the authority on the lifecycle: it takes every token,
//! flushes its update buffer into the open segment and applies the worker's closes and
//! re-encodings. After each of its changes this batch brings the device up to date with the
//! least the [`CudaCache`] API allows:
//! - a token that stays in the update buffer: that token's f16 rows, copied alone
//!   ([`CudaCache::append`]);
//! - anything that changed segments (a flush into the open segment, a close, a re-encoded
//!   provisional segment, a new open segment): one swap ([`CudaCache::begin_swap`] then
//!   [`CudaCache::commit_swap`]) that replaces the device's segments from the first one that
//!   differs from the host's, and consumes the buffer rows the flush moved into segments.
//!
//! A segment is "the same" on both sides when its start, length and state are equal and,
//! for an open segment, every head's strategy too: the records and block metadata of a
//! segment are a function of its tokens and its strategy (SPEC.md 5-7), so equal strategies
//! over equal tokens are equal bytes. A closed segment is final (SPEC 10.3: nothing replaces
//! it), so its span and state say it all and its strategies are neither kept nor compared.
//!
//! What this costs and what it does not do: a flush re-uploads the whole open segment (its
//! records so far plus the flushed ones), so a long open segment costs `O(its tokens)` per
//! flush, once every `buffer_capacity` tokens; the swap's upload runs on the one stream,
//! between decode steps, not on a copy stream beside them; and the host keeps its own copy of
//! every segment (the [`LiveCache`]'s view), which [`CudaLiveBatch::memory`] reports apart from
//! the device bytes.

use super::cache::{CudaCache, CudaCacheMemory, CudaCacheOptions};
use super::device::Gpu;
use crate::backend::contig;
use crate::live::LiveCache;
use half::f16;
use mosaickv_spec::{
    rules, validate, KvCache, MosaicError, Result, Segment, SegmentState, Selection, Strategy,
};
use ndarray::ArrayView2;
use std::sync::Arc;

/// What the device holds of one segment, to compare with the host's (see the module doc).
#[derive(Debug, Clone, PartialEq)]
struct Held {
    start: usize,
    len: usize,
    state: SegmentState,
    /// Per head, for an open segment only (empty for a closed one).
    strategies: Vec<Strategy>,
}

impl Held {
    fn of(s: &Segment) -> Self {
        let strategies = match s.state {
            SegmentState::Open => s.heads.iter().map(|h| h.strategy.clone()).collect(),
            SegmentState::Closed => Vec::new(),
        };
        Self {
            start: s.start,
            len: s.len,
            state: s.state,
            strategies,
        }
    }

    fn matches(&self, s: &Segment) -> bool {
        let same_strategies = || {
            self.strategies.len() == s.heads.len()
                && self
                    .strategies
                    .iter()
                    .zip(&s.heads)
                    .all(|(a, h)| *a == h.strategy)
        };
        self.start == s.start
            && self.len == s.len
            && self.state == s.state
            && (s.state == SegmentState::Closed || same_strategies())
    }
}

/// Device and host bytes of a [`CudaLiveBatch`], counted separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaLiveMemory {
    /// The [`CudaCache`]'s own report (device bytes with its reserve, its host tables).
    pub cuda: CudaCacheMemory,
    /// The host [`LiveCache`]s' copy of the compressed data (SPEC.md 13's device kinds,
    /// held here on the host as the lifecycle's authority), summed over the batch.
    pub host_view_bytes: usize,
    /// The host [`LiveCache`]s' f32 rows kept for the background worker, summed.
    pub host_rows_bytes: usize,
    /// The batch's copy of each open device segment's strategies (for [`Held`] comparisons).
    pub host_held_bytes: usize,
}

/// Swaps this batch has made and the tokens they uploaded (for benchmarks and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CudaLiveStats {
    pub appends: usize,
    pub swaps: usize,
    pub swapped_tokens: usize,
}

/// A batch of live caches attended on the device; see the module doc.
pub struct CudaLiveBatch {
    lives: Vec<LiveCache>,
    cc: CudaCache,
    held: Vec<Vec<Held>>,
    stats: CudaLiveStats,
    /// Set when the host and the device went out of step (a device write failed after the
    /// host cache had taken a token); every later call is refused.
    broken: bool,
}

fn shape_err(what: &'static str, expected: String, got: String) -> MosaicError {
    MosaicError::ShapeMismatch {
        what,
        expected,
        got,
    }
}

impl CudaLiveBatch {
    /// Uploads the live caches (same shape; each prompt prefilled, its sink full) with the
    /// room of `opts` reserved on the device. A swap re-uploads a sequence's open segment and
    /// what follows it, so `opts.swap_tokens` should cover `max_segment_len` plus the update
    /// buffer, and `opts.swap_segments` the provisional segments a lagging worker can leave;
    /// a swap that does not fit is a typed error.
    pub fn new(gpu: Arc<Gpu>, mut lives: Vec<LiveCache>, opts: CudaCacheOptions) -> Result<Self> {
        if lives.is_empty() {
            return Err(shape_err(
                "live batch",
                "at least one sequence".into(),
                "none".into(),
            ));
        }
        for (b, l) in lives.iter_mut().enumerate() {
            // the kernels read bitmap records only (SPEC.md section 6.1)
            crate::refuse_coded_config(&l.compressed().config)?;
            l.apply_arrived()?;
            let view = l.compressed();
            if view.sink.tokens < view.config.sink_tokens {
                return Err(MosaicError::InvalidConfig(format!(
                    "CudaLiveBatch: sequence {b} holds {} tokens, fewer than its {} sink tokens \
                     (the device cache appends to the update buffer only)",
                    view.len(),
                    view.config.sink_tokens
                )));
            }
        }
        let views: Vec<_> = lives.iter().map(|l| l.compressed()).collect();
        let cc = CudaCache::new(gpu, &views, opts)?;
        let held = views
            .iter()
            .map(|v| v.segments.iter().map(Held::of).collect())
            .collect();
        Ok(Self {
            lives,
            cc,
            held,
            stats: CudaLiveStats::default(),
            broken: false,
        })
    }

    pub fn batch(&self) -> usize {
        self.lives.len()
    }

    /// The host caches, the lifecycle's authority.
    pub fn lives(&self) -> &[LiveCache] {
        &self.lives
    }

    pub fn stats(&self) -> CudaLiveStats {
        self.stats
    }

    fn usable(&self) -> Result<()> {
        if self.broken {
            return Err(MosaicError::BackendUnavailable(
                "CudaLiveBatch: the device and the host caches are out of step; rebuild the batch"
                    .into(),
            ));
        }
        Ok(())
    }

    /// SPEC 10.2 for sequence `b`: one token's K/V `[kv_heads, head_dim]`. Checked as
    /// [`LiveCache`] checks it, before anything changes; then copied to the device's update
    /// buffer, given to the host cache, and any segment change the host made is swapped in.
    pub fn append(&mut self, b: usize, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<()> {
        self.usable()?;
        if b >= self.lives.len() {
            return Err(shape_err(
                "appended sequence",
                format!("< {}", self.lives.len()),
                b.to_string(),
            ));
        }
        let shape = self.lives[b].shape();
        validate::token_kv(&shape, &key, &value)?;
        rules::rows_storable(rules::ROW_KEY, &contig(&key), shape.head_dim)?;
        rules::rows_storable(rules::ROW_VALUE, &contig(&value), shape.head_dim)?;
        // The same f16 rows the host's update buffer stores (`DenseRows::push`).
        let k: Vec<f16> = key.iter().map(|&x| f16::from_f32(x)).collect();
        let v: Vec<f16> = value.iter().map(|&x| f16::from_f32(x)).collect();
        // A full device buffer is a typed error here, with nothing changed on either side.
        self.cc.append(b, &k, &v)?;
        if let Err(e) = self.lives[b].append(key, value) {
            // Checked above, so only a failed worker gets here; the device already has the
            // token and cannot take it back.
            self.broken = true;
            return Err(e);
        }
        self.stats.appends += 1;
        self.sync(b)
    }

    /// Applies the worker results that have arrived to every host cache and swaps the
    /// changes onto the device.
    pub fn refresh(&mut self) -> Result<()> {
        self.usable()?;
        for b in 0..self.lives.len() {
            self.lives[b].apply_arrived()?;
            self.sync(b)?;
        }
        Ok(())
    }

    /// Waits for every host worker's answers ([`LiveCache::drain`]) and swaps them in.
    pub fn drain(&mut self) -> Result<()> {
        self.usable()?;
        for b in 0..self.lives.len() {
            self.lives[b].drain()?;
            self.sync(b)?;
        }
        Ok(())
    }

    /// Pauses sequence `b`'s host worker while the returned guard lives
    /// ([`LiveCache::hold_worker`]; `None` in `Mode::Sync` or for a bad `b`).
    pub fn hold_worker(&mut self, b: usize) -> Option<crate::live::WorkerHold> {
        self.lives.get_mut(b)?.hold_worker()
    }

    /// Pauses every host worker while the returned guards live ([`LiveCache::hold_worker`];
    /// empty in `Mode::Sync`).
    pub fn hold_workers(&mut self) -> Vec<crate::live::WorkerHold> {
        self.lives
            .iter_mut()
            .filter_map(|l| l.hold_worker())
            .collect()
    }

    /// One decode step's attention for the whole batch on the device (queries
    /// `[batch][q_heads][D]`, output the same), after [`CudaLiveBatch::refresh`].
    pub fn attend(&mut self, queries: &[f32]) -> Result<Vec<f32>> {
        self.refresh()?;
        self.attend_current(queries)
    }

    /// The batch's attention on what the device holds now, without a refresh: equal to
    /// attending the host caches' current views.
    pub fn attend_current(&self, queries: &[f32]) -> Result<Vec<f32>> {
        self.usable()?;
        self.cc.attend(queries)
    }

    /// The device's block selection for every sequence (SPEC 8) on what it holds now.
    pub fn select_current(&self, queries: &[f32]) -> Result<Vec<Selection>> {
        self.usable()?;
        self.cc.select(queries)
    }

    /// Device and host bytes, apart.
    pub fn memory(&self) -> CudaLiveMemory {
        let (mut view, mut rows) = (0, 0);
        for l in &self.lives {
            let m = l.memory();
            view += m.device_bytes();
            rows += m.host_rows;
        }
        let held = self
            .held
            .iter()
            .flatten()
            .map(|h| {
                std::mem::size_of::<Held>()
                    + h.strategies
                        .iter()
                        .map(|s| 2 * (s.key.rotation.len() + s.value.rotation.len()))
                        .sum::<usize>()
            })
            .sum();
        CudaLiveMemory {
            cuda: self.cc.memory(),
            host_view_bytes: view,
            host_rows_bytes: rows,
            host_held_bytes: held,
        }
    }

    /// Brings sequence `b`'s device segments up to the host's: one swap from the first
    /// segment that differs, consuming the buffer rows that moved into segments.
    fn sync(&mut self, b: usize) -> Result<()> {
        let view = self.lives[b].compressed();
        let held = &self.held[b];
        let first = held
            .iter()
            .zip(&view.segments)
            .take_while(|(h, s)| h.matches(s))
            .count();
        if first == held.len() && first == view.segments.len() {
            return Ok(());
        }
        let device_tokens: usize = held.iter().map(|h| h.len).sum();
        let consumed = view.segment_tokens().checked_sub(device_tokens);
        let (consumed, segments) = match consumed {
            Some(c) if first < view.segments.len() => (c, view.segments[first..].to_vec()),
            _ => {
                self.broken = true;
                return Err(MosaicError::InvalidConfig(format!(
                    "CudaLiveBatch: sequence {b}'s host segments ({} tokens) no longer extend \
                     the device's ({device_tokens} tokens)",
                    view.segment_tokens()
                )));
            }
        };
        let tokens: usize = segments.iter().map(|s| s.len).sum();
        let replaced = held.len() - first;
        let new_held: Vec<Held> = segments.iter().map(Held::of).collect();
        // Either failing leaves the host ahead of the device (the host has taken the token
        // that caused the change), so the batch is refused from then on.
        if let Err(e) = self.cc.begin_swap(b, first, replaced, segments, consumed) {
            self.broken = true;
            return Err(e);
        }
        if let Err(e) = self.cc.commit_swap() {
            self.broken = true;
            return Err(e);
        }
        let held = &mut self.held[b];
        held.truncate(first);
        held.extend(new_held);
        self.stats.swaps += 1;
        self.stats.swapped_tokens += tokens;
        Ok(())
    }
}
