//! [`LiveCache`]: the production MosaicKV cache manager with a background
//! compression worker (SPEC.md section 10.4), chunked prefill, and host/device
//! memory accounting (section 13).
//!
//! # Two threads, one lifecycle
//!
//! - **Decode path** (the caller's thread): `append` puts a token in the update
//!   buffer; when the buffer fills it is encoded with the open segment's
//!   temporary strategy and appended to that segment (SPEC 10.2, the cheap
//!   "fast path"), and the buffer's f32 rows are sent to the worker over a
//!   channel. `append` and `attend` first apply whatever results the worker has
//!   sent (non-blocking `try_recv`); attention always runs on one consistent
//!   version of the cache. The decode path never takes a lock the worker holds.
//! - **Worker**: owns the *authoritative* lifecycle state. It keeps the open
//!   segment's f32 rows, adds each token to the segment's covariance
//!   `C += x x^T` (f64, token order, so `C` is bit-identical to SPEC 3 step 1
//!   over the rows) and to the SPEC 11.1 loss sums under the temporary strategy
//!   (per-row dropped/total energy, added in token order like the reference's
//!   `LossSums`), applies the close rule of SPEC 10.3 at each flush, and on
//!   close fits the final strategy from the accumulated covariance with the
//!   same functions as [`crate::OptimizedMosaicCache`] (rotation, `(r, g)`,
//!   block size), re-encodes the segment and sends it back.
//!
//! # Swaps
//!
//! Because the decode path runs ahead, it may append flushes to a segment the
//! worker has already closed, encoded with a now-stale temporary strategy.
//! Every flush carries a tag naming the strategy it was encoded with (the start
//! token of the closed segment whose final strategy it is). The worker answers
//! each flush with one of: nothing (the provisional encoding is the
//! authoritative one), `Reencode` (the flush belongs to a new open segment
//! whose temporary strategy is the just-closed segment's final one: here are its
//! records re-encoded with it), or `Close` (here is the closed segment). The
//! decode side applies these as splices of its segment list: the cut-off tail
//! of a closed segment stays a provisional open segment (still a valid,
//! attendable encoding) until the worker's `Reencode`s move it, flush by flush,
//! into the authoritative open segment. After [`LiveCache::drain`] the cache is
//! bit-identical to the synchronous run ([`Mode::Sync`]).
//!
//! # Chunked prefill
//!
//! [`LiveCache::prefill_chunk`] takes the prompt in pieces; the first
//! `sink_tokens` go to the sink, the rest to pending host rows from which
//! closed prompt segments are cut as soon as the rule allows
//! ([`PrefillRule`]); [`LiveCache::finish_prefill`] closes the remainder.
//! With [`PrefillRule::Exact`] the result equals SPEC 10.1 on the concatenated
//! prompt bit for bit; [`PrefillRule::Eager`] compresses earlier and differs
//! from 10.1 only in the last segment (see its doc).
//!
//! # Where each step lives
//!
//! - this file: the [`LiveCache`] type, its constructors, accessors and the
//!   [`KvCache`] impl (SPEC 10.1-10.2 entry points, SPEC 8-9 attention, SPEC 13 memory);
//! - `protocol`: the messages between the decode path and the worker (flush jobs,
//!   strategy tags, the worker's answers; SPEC 10.4);
//! - `worker`: the worker's authoritative state, its covariance and SPEC 11.1 loss
//!   sums, and the close rule of SPEC 10.3;
//! - `close`: fitting a closed segment's final strategy from the accumulated
//!   covariance and re-encoding it (SPEC 3, 4, 11 and 10.3's close);
//! - `covariance`: the incremental SPEC 3 step 1 accumulation ([`covariance_update`]);
//! - `flush`: the decode path's fast-path flush of the full buffer (SPEC 10.2);
//! - `swap`: applying the worker's answers to the decode-side view (the splices
//!   described above) and [`LiveCache::drain`];
//! - `prefill`: chunked prefill and [`PrefillRule`] (SPEC 10.1);
//! - `persist`: save/load and `to_parts`/`from_parts` (SPEC 15);
//! - `dense`: the SPEC 9 fallback for a cache with no segment yet.

mod bound;
mod close;
mod covariance;
mod dense;
mod flush;
mod persist;
mod prefill;
mod protocol;
mod swap;
mod worker;

pub use covariance::covariance_update;
pub use prefill::PrefillRule;

use crate::attention::{packed_attention, MosaicScratch, SelectionSource};
use crate::backend::contig;
use crate::simd::Path;
use dense::dense_attention;
use mosaickv_spec::cache::covariance_scratch_bytes;
use mosaickv_spec::{
    rules, validate, CompressConfig, CompressedCache, KvCache, KvShape, MemoryReport, MosaicError,
    Result, SegmentState,
};
use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2};
use prefill::Prefill;
use protocol::{Done, Job, Tag, Timing};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use worker::{worker_loop, WorkerState};

/// Where the worker's work runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Inline on the caller's thread at each flush (the synchronous oracle of SPEC 10.4).
    Sync,
    /// On a background thread with its own one-thread rayon pool.
    Async,
}

/// Token kinds of [`Coverage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    Sink,
    /// A closed segment (its final strategy).
    Final,
    /// An open segment whose records use the authoritative temporary strategy.
    Temporary,
    /// An open segment encoded with a strategy the worker has since replaced
    /// (waiting for its `Reencode`).
    Provisional,
    Buffer,
    /// Chunked-prefill rows not yet in a segment.
    Pending,
}

/// Which token ranges the cache holds, in order: `(first token, tokens, holder)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Coverage {
    pub ranges: Vec<(usize, usize, Holder)>,
}

/// Counters of the lifecycle, for tests and reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LiveStats {
    /// Buffers flushed by the decode path.
    pub flushes: u64,
    /// Worker results applied: closed segments swapped in.
    pub closes: u64,
    /// Worker results applied: provisional flushes replaced by re-encoded ones.
    pub reencodes: u64,
    /// Flushes sent and not yet answered.
    pub in_flight: u64,
    /// Wall time the worker spent processing flushes (covariance, loss, close rule, re-encodes), ns.
    pub worker_ns: u64,
    /// Of which: fitting and re-encoding closed segments, ns.
    pub close_ns: u64,
}

/// Host-side memory detail (SPEC 13's `host_rows`, itemized).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostMemory {
    /// f32 rows of the update buffer (decode side).
    pub buffer_rows: usize,
    /// f32 rows sent to the worker and not yet dropped (open segment + queued flushes).
    pub worker_rows: usize,
    /// Chunked-prefill rows not yet in a segment.
    pub pending_rows: usize,
    /// The worker's covariance accumulators (`2 * kv_heads * head_dim^2` f64 while a segment is open).
    pub covariance: usize,
}

/// Keeps the worker paused while alive (from [`LiveCache::hold_worker`]); dropping it releases the worker.
#[derive(Debug)]
pub struct WorkerHold {
    _release: Sender<()>,
    _alive: Arc<()>,
}

/// Head `h`'s rows `[n][d]` from `[n][kv][d]` data.
fn gather(data: &[f32], kv: usize, d: usize, h: usize) -> Vec<f32> {
    data.chunks_exact(kv * d)
        .flat_map(|t| t[h * d..(h + 1) * d].iter().copied())
        .collect()
}

enum Engine {
    Sync(Box<WorkerState>),
    Async {
        jobs: Option<Sender<Job>>,
        done: Receiver<Done>,
        handle: Option<JoinHandle<()>>,
    },
}

/// The MosaicKV cache of one layer with background compression (SPEC.md section 10.4).
pub struct LiveCache {
    path: Path,
    mode: Mode,
    /// The current version: what attention reads.
    view: CompressedCache,
    /// Per segment of `view`: the strategy tag of an open segment's records (`None` when closed).
    tags: Vec<Option<Tag>>,
    /// f32 rows of the update buffer, `[tokens][kv][d]`.
    buf_k: Vec<f32>,
    buf_v: Vec<f32>,
    engine: Engine,
    /// The worker has seen a flush (it adopts the first one's strategy).
    primed: bool,
    sent: u64,
    answered: u64,
    stats: LiveStats,
    prefill: Option<Prefill>,
    /// The prompt is over: `prefill_chunk` is refused.
    prompt_done: bool,
    failed: Option<MosaicError>,
    host_bytes: Arc<AtomicUsize>,
    cov_bytes: Arc<AtomicUsize>,
    timing: Arc<Timing>,
    /// One reference per live [`WorkerHold`].
    holds: Arc<()>,
    scratch: MosaicScratch,
    out_tmp: Vec<f32>,
    /// The layer's query statistics for the attention loss (SPEC.md section 11.1), if given.
    query_stats: Option<mosaickv_spec::QueryStats>,
    /// Device bytes per token and per segment of the policy's largest strategy, all KV heads
    /// (`rules::worst_token_bytes`, `rules::worst_segment_head_bytes`; see `bound`).
    worst: (usize, usize),
}

impl std::fmt::Debug for LiveCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveCache")
            .field("mode", &self.mode)
            .field("tokens", &self.len())
            .field("segments", &self.view.segments.len())
            .field("stats", &self.stats)
            .finish()
    }
}

impl Drop for LiveCache {
    fn drop(&mut self) {
        if let Engine::Async { jobs, handle, .. } = &mut self.engine {
            jobs.take();
            // With a hold still alive the worker cannot finish yet: let it exit on its own
            // once the hold is dropped, instead of blocking here.
            let held = Arc::strong_count(&self.holds) > 1;
            if let Some(h) = handle.take() {
                if !held {
                    let _ = h.join();
                }
            }
        }
    }
}

impl LiveCache {
    /// An empty cache; the config is validated against the shape. `Mode::Async`
    /// starts the worker thread.
    pub fn new(shape: KvShape, config: CompressConfig, mode: Mode) -> Result<Self> {
        Self::build(shape, config, mode, Path::detect(), None)
    }

    /// As [`LiveCache::new`] with the portable kernels.
    pub fn portable(shape: KvShape, config: CompressConfig, mode: Mode) -> Result<Self> {
        Self::build(shape, config, mode, Path::Portable, None)
    }

    fn build(
        shape: KvShape,
        config: CompressConfig,
        mode: Mode,
        path: Path,
        worker: Option<WorkerState>,
    ) -> Result<Self> {
        let shape = KvShape::new(shape.kv_heads, shape.q_heads, shape.head_dim)?;
        config.validate(shape.head_dim)?;
        let host_bytes = Arc::new(AtomicUsize::new(0));
        let cov_bytes = Arc::new(AtomicUsize::new(0));
        let state = match worker {
            Some(mut w) => {
                w.host_bytes = host_bytes.clone();
                w.cov_bytes = cov_bytes.clone();
                if let Some(o) = &w.open {
                    host_bytes.store(4 * (o.keys.len() + o.values.len()), Ordering::Relaxed);
                    cov_bytes.store(
                        covariance_scratch_bytes(shape.kv_heads, shape.head_dim),
                        Ordering::Relaxed,
                    );
                }
                w
            }
            None => WorkerState::new(shape, config.clone(), host_bytes.clone(), cov_bytes.clone()),
        };
        let primed = state.open.is_some();
        let timing = state.timing.clone();
        let engine = match mode {
            Mode::Sync => Engine::Sync(Box::new(state)),
            Mode::Async => {
                let (jtx, jrx) = mpsc::channel::<Job>();
                let (dtx, drx) = mpsc::channel::<Done>();
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .thread_name(|_| "mosaickv-live-worker".into())
                    .build()
                    .map_err(|e| {
                        MosaicError::BackendUnavailable(format!("live worker pool: {e}"))
                    })?;
                let handle = std::thread::Builder::new()
                    .name("mosaickv-live".into())
                    .spawn(move || pool.install(move || worker_loop(state, jrx, dtx)))
                    .map_err(|e| {
                        MosaicError::BackendUnavailable(format!("live worker thread: {e}"))
                    })?;
                Engine::Async {
                    jobs: Some(jtx),
                    done: drx,
                    handle: Some(handle),
                }
            }
        };
        let worst = (
            shape.kv_heads * rules::worst_token_bytes(&config, shape.head_dim),
            mosaickv_spec::cache::SEGMENT_HEADER_BYTES
                + shape.kv_heads * rules::worst_segment_head_bytes(shape.head_dim),
        );
        Ok(Self {
            path,
            mode,
            view: CompressedCache::new(shape, config),
            tags: Vec::new(),
            buf_k: Vec::new(),
            buf_v: Vec::new(),
            engine,
            primed,
            sent: 0,
            answered: 0,
            stats: LiveStats::default(),
            prefill: None,
            prompt_done: false,
            failed: None,
            host_bytes,
            cov_bytes,
            timing,
            holds: Arc::new(()),
            scratch: MosaicScratch::default(),
            out_tmp: Vec::new(),
            query_stats: None,
            worst,
        })
    }

    /// Pauses the worker (after the flushes already queued reach it) until the
    /// returned guard is dropped: lets tests and benchmarks make the decode path
    /// run ahead deterministically. `None` in `Mode::Sync`.
    pub fn hold_worker(&mut self) -> Option<WorkerHold> {
        match &self.engine {
            Engine::Async {
                jobs: Some(jobs), ..
            } => {
                let (tx, rx) = mpsc::channel();
                jobs.send(Job::Hold(rx)).ok()?;
                Some(WorkerHold {
                    _release: tx,
                    _alive: self.holds.clone(),
                })
            }
            _ => None,
        }
    }

    /// Sets the query head count attention expects (SPEC.md section 1: the GQA group
    /// belongs to the queries, not to the stored cache); `KvShape::new` checks it.
    /// Nothing else changes.
    pub fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        let s = self.view.shape;
        self.view.shape = KvShape::new(s.kv_heads, q_heads, s.head_dim)?;
        Ok(())
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The current version of the compressed data (what the next `attend`
    /// would read if no worker result arrives first). Not drained: call
    /// [`LiveCache::drain`] first for the settled state.
    pub fn compressed(&self) -> &CompressedCache {
        &self.view
    }

    pub fn stats(&self) -> LiveStats {
        LiveStats {
            in_flight: self.sent - self.answered,
            worker_ns: self.timing.worker.load(Ordering::Relaxed),
            close_ns: self.timing.close.load(Ordering::Relaxed),
            ..self.stats
        }
    }

    /// Host-side bytes, itemized.
    pub fn host_memory(&self) -> HostMemory {
        HostMemory {
            buffer_rows: 4 * (self.buf_k.len() + self.buf_v.len()),
            worker_rows: self.host_bytes.load(Ordering::Relaxed),
            pending_rows: self
                .prefill
                .as_ref()
                .map_or(0, |p| 4 * (p.keys.len() + p.values.len())),
            covariance: self.cov_bytes.load(Ordering::Relaxed),
        }
    }

    /// Which holder every token is in, in token order (see [`Holder`]).
    pub fn coverage(&self) -> Coverage {
        let mut ranges = Vec::new();
        if self.view.sink.tokens > 0 {
            ranges.push((0, self.view.sink.tokens, Holder::Sink));
        }
        let auth = self.authoritative_tag();
        for (seg, tag) in self.view.segments.iter().zip(&self.tags) {
            let holder = match (seg.state, tag) {
                (SegmentState::Closed, _) => Holder::Final,
                (SegmentState::Open, t) if *t == auth => Holder::Temporary,
                _ => Holder::Provisional,
            };
            ranges.push((seg.start, seg.len, holder));
        }
        let mut next = self.view.sink.tokens + self.view.segment_tokens();
        if let Some(p) = &self.prefill {
            let n = p.keys.len() / self.row_len();
            if n > 0 {
                ranges.push((next, n, Holder::Pending));
                next += n;
            }
        }
        if self.view.buffer.tokens > 0 {
            ranges.push((next, self.view.buffer.tokens, Holder::Buffer));
        }
        Coverage { ranges }
    }

    /// The tag the authoritative open segment would carry as seen from the view:
    /// the final strategy of the last closed segment (`First` when there is none).
    fn authoritative_tag(&self) -> Option<Tag> {
        match self
            .view
            .segments
            .iter()
            .rposition(|s| s.state == SegmentState::Closed)
        {
            Some(i) => Some(Tag::Seg(self.view.segments[i].start)),
            None => Some(Tag::First),
        }
    }

    fn row_len(&self) -> usize {
        self.view.shape.kv_heads * self.view.shape.head_dim
    }

    fn check_failed(&self) -> Result<()> {
        match &self.failed {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn attend_view(&mut self, q: &[f32], out: &mut [f32]) -> Result<()> {
        if self.view.segments.is_empty() {
            // Only sink and buffer rows: `packed_attention` needs at least one segment.
            dense_attention(&self.view, q, out);
            return Ok(());
        }
        packed_attention(
            self.path,
            &self.view,
            q,
            SelectionSource::Compute,
            false,
            Some(out),
            &mut self.scratch,
        )?;
        Ok(())
    }
}

impl KvCache for LiveCache {
    fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        LiveCache::set_q_heads(self, q_heads)
    }
    fn attended(&self, queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>> {
        crate::select::attended_tokens(LiveCache::compressed(self), queries).map(Some)
    }
    fn compressed(&self) -> Option<&CompressedCache> {
        Some(LiveCache::compressed(self))
    }
    fn save(&mut self, path: &std::path::Path) -> Result<()> {
        LiveCache::save(self, path)
    }
    /// Gives (or with `None` removes) the layer's query statistics, used by the prompt
    /// segments' strategies when the configuration's loss is `attention` (SPEC.md section
    /// 11.1; generated segments keep the energy loss). Checked against the shape; nothing
    /// changes on error.
    fn set_query_stats(&mut self, stats: Option<mosaickv_spec::QueryStats>) -> Result<()> {
        if let Some(st) = &stats {
            st.validate(&self.view.shape)?;
        }
        self.query_stats = stats;
        Ok(())
    }

    fn shape(&self) -> KvShape {
        self.view.shape
    }

    /// Tokens held, pending prompt rows included.
    fn len(&self) -> usize {
        self.view.len()
            + self
                .prefill
                .as_ref()
                .map_or(0, |p| p.keys.len() / self.row_len())
    }

    /// SPEC 10.1 on the whole prompt (bit-identical to `OptimizedMosaicCache::prefill`).
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<()> {
        validate::prompt_kv(&self.view.shape, &keys, &values)?;
        if !self.is_empty() || self.prompt_done {
            return Err(MosaicError::AlreadyPrefilled(self.len()));
        }
        self.prefill_chunk(keys, values, PrefillRule::Exact)?;
        self.finish_prefill()
    }

    /// SPEC 10.2: buffer, and at capacity the fast-path flush; the worker does 10.3.
    /// Ends a chunked prompt first.
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<()> {
        let shape = self.view.shape;
        validate::token_kv(&shape, &key, &value)?;
        rules::rows_storable(rules::ROW_KEY, &contig(&key), shape.head_dim)?;
        rules::rows_storable(rules::ROW_VALUE, &contig(&value), shape.head_dim)?;
        self.check_failed()?;
        self.poll();
        self.end_prompt()?;
        if self.view.len() < self.view.config.sink_tokens {
            self.view
                .sink
                .push(key.iter().copied(), value.iter().copied());
            return Ok(());
        }
        self.view
            .buffer
            .push(key.iter().copied(), value.iter().copied());
        self.buf_k.extend(key.iter().copied());
        self.buf_v.extend(value.iter().copied());
        if self.view.buffer.tokens >= self.view.config.buffer_capacity {
            if let Err(e) = self.flush() {
                if self.failed.is_none() {
                    // The flush mutated nothing (SPEC 14): take the token back out.
                    let row = self.row_len();
                    self.view.buffer.pop(row);
                    self.buf_k.truncate(self.buf_k.len() - row);
                    self.buf_v.truncate(self.buf_v.len() - row);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// SPEC 8-9 on the current version (worker results that arrived are applied first).
    /// Ends a chunked prompt first.
    fn attend(&mut self, queries: ArrayView2<f32>, mut out: ArrayViewMut2<f32>) -> Result<()> {
        let shape = self.view.shape;
        validate::queries(&shape, &queries, out.shape())?;
        self.check_failed()?;
        if self.is_empty() {
            return Err(MosaicError::EmptyCache);
        }
        self.poll();
        self.end_prompt()?;
        let q = contig(&queries);
        match out.as_slice_mut() {
            Some(o) => self.attend_view(&q, o),
            None => {
                let mut tmp = std::mem::take(&mut self.out_tmp);
                tmp.resize(shape.q_heads * shape.head_dim, 0.0);
                let r = self.attend_view(&q, &mut tmp);
                for (dst, &src) in out.iter_mut().zip(tmp.iter()) {
                    *dst = src;
                }
                self.out_tmp = tmp;
                r
            }
        }
    }

    /// See [`LiveCache::device_bytes_bound`] (`bound`).
    fn device_bytes_bound(&self, more: usize) -> Option<usize> {
        LiveCache::device_bytes_bound(self, more)
    }

    /// SPEC 13: device bytes of the current version; `host_rows` = f32 rows of
    /// the buffer, the worker's open segment and queued flushes, and pending prompt rows;
    /// `host_scratch` = the worker's covariance accumulators.
    fn memory(&self) -> MemoryReport {
        let mut m = self.view.memory();
        let h = self.host_memory();
        m.host_rows = h.buffer_rows + h.worker_rows + h.pending_rows;
        m.host_scratch = h.covariance;
        m
    }
}
