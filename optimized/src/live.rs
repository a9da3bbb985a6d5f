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

use crate::attend::{packed_attention, MosaicScratch, SelectionSource};
use crate::backend::contig;
use crate::encode;
use crate::mosaic::encode_segment;
use crate::simd::Path;
use mosaickv_spec::layout::bitmap_bit;
use mosaickv_spec::{
    persist, rules, validate, BlockMeta, CompressConfig, CompressedCache, HeadSegment, KvCache,
    KvShape, MemoryReport, MosaicError, PackedRows, RecordLayout, Result, Segment, SegmentState,
    Side, SideStrategy, Strategy,
};
use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2};
use rayon::prelude::*;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Where the worker's work runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Inline on the caller's thread at each flush (the synchronous oracle of SPEC 10.4).
    Sync,
    /// On a background thread with its own one-thread rayon pool.
    Async,
}

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

/// Names the strategy a flush was encoded with: the final strategy of the
/// closed segment starting at that token, or the one fitted on the first
/// buffer of a cache without any segment (SPEC 10.2 step 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tag {
    Seg(usize),
    First,
}

struct FlushJob {
    seq: u64,
    start: usize,
    n: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
    tag: Tag,
    /// Sent with the first flush a worker sees, so it can adopt the strategy.
    strategies: Option<Arc<Vec<Strategy>>>,
}

/// One head's records of a re-encoded flush.
struct Part {
    keys: PackedRows,
    values: PackedRows,
    meta: BlockMeta,
}

enum Update {
    Nothing,
    Reencode {
        start: usize,
        n: usize,
        tag: Tag,
        parts: Vec<Part>,
    },
    Close {
        start: usize,
        len: usize,
        heads: Vec<HeadSegment>,
    },
}

struct Done {
    seq: u64,
    update: Result<Update>,
}

/// The open segment's host rows, for saving.
struct HostRows {
    keys: Vec<f32>,
    values: Vec<f32>,
}

enum Job {
    Flush(FlushJob),
    Snapshot(Sender<HostRows>),
    /// Blocks the worker until the sender is dropped (see [`LiveCache::hold_worker`]).
    Hold(Receiver<()>),
}

/// Keeps the worker paused while alive (from [`LiveCache::hold_worker`]); dropping it releases the worker.
#[derive(Debug)]
pub struct WorkerHold {
    _release: Sender<()>,
    _alive: Arc<()>,
}

/// Running SPEC 11.1 sums, rows added in token order (as the reference's `LossSums`).
#[derive(Debug, Clone, Copy, Default)]
struct LossSums {
    dropped: f64,
    total: f64,
}

impl LossSums {
    fn loss(&self) -> f64 {
        if self.total == 0.0 {
            0.0
        } else {
            self.dropped / self.total
        }
    }
}

/// One head and side of the worker's open segment.
struct OpenSide {
    /// Lower triangle (`b <= a`) of `C = sum x x^T`, `d x d` row-major.
    cov: Vec<f64>,
    loss: LossSums,
}

struct OpenSeg {
    start: usize,
    len: usize,
    tag: Tag,
    temp: Arc<Vec<Strategy>>,
    keys: Vec<f32>,
    values: Vec<f32>,
    /// Per head: key side, value side.
    sides: Vec<[OpenSide; 2]>,
}

/// The authoritative lifecycle state: what the worker thread owns.
struct WorkerState {
    shape: KvShape,
    config: CompressConfig,
    /// The last closed segment's final strategy (the next open segment's temporary one).
    prev: Option<(Tag, Arc<Vec<Strategy>>)>,
    open: Option<OpenSeg>,
    host_bytes: Arc<AtomicUsize>,
    cov_bytes: Arc<AtomicUsize>,
    timing: Arc<Timing>,
}

/// Worker time counters (ns), shared with the decode side.
#[derive(Debug, Default)]
struct Timing {
    worker: AtomicU64,
    close: AtomicU64,
}

/// `C += sum_t x_t x_t^T` over rows `[n][d]`, lower triangle: for each row `a` of
/// `C` (kept in L1) the rows are added in token order, so every element sees
/// exactly the additions, in the order, of SPEC 3 step 1 (`encode::covariance`).
#[inline(always)]
fn cov_add_body(c: &mut [f64], rows: &[f32], d: usize, xd: &mut [f64]) {
    for (o, &v) in xd.iter_mut().zip(rows) {
        *o = v as f64;
    }
    for a in 0..d {
        let ca = &mut c[a * d..a * d + a + 1];
        for x in xd.chunks_exact(d) {
            let xa = x[a];
            for (cb, &xb) in ca.iter_mut().zip(&x[..=a]) {
                *cb += xa * xb;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn cov_add_avx2(c: &mut [f64], rows: &[f32], d: usize, xd: &mut [f64]) {
    cov_add_body(c, rows, d, xd)
}

/// `C += x x^T` for every row of `rows` (`[n][d]`), in order, lower triangle only.
/// Bit-identical to accumulating the same rows with `encode::covariance` (same
/// products, same order per element, no FMA contraction).
pub fn covariance_update(c: &mut [f64], rows: &[f32], d: usize) {
    let mut xd = vec![0f64; rows.len()];
    #[cfg(target_arch = "x86_64")]
    if crate::simd::Path::detect().runs_avx2() {
        // SAFETY: avx2 detected at run time; the body only uses bounds-checked slice access.
        unsafe { cov_add_avx2(c, rows, d, &mut xd) };
        return;
    }
    cov_add_body(c, rows, d, &mut xd);
}

/// The full symmetric matrix from its lower triangle (as `encode::covariance` mirrors).
fn mirrored(lower: &[f64], d: usize) -> Vec<f64> {
    let mut c = lower.to_vec();
    for a in 0..d {
        for b in a + 1..d {
            c[a * d + b] = c[b * d + a];
        }
    }
    c
}

/// SPEC 11.1 per-row terms `(dropped, total)` of rows `[n][d]` with rotated coordinates `xr`
/// (`[n][Dt]`, f64), whose kept groups are read from their packed records (SPEC 5's
/// selection, done by `pack_rotated`).
fn add_loss_terms(
    sums: &mut LossSums,
    rows: &[f32],
    xr: &[f64],
    packed: &PackedRows,
    layout: &RecordLayout,
) {
    let (d, dt) = (layout.head_dim, layout.kept_dims);
    let rb = layout.record_bytes();
    for (i, (row, x)) in xr.chunks_exact(dt).zip(rows.chunks_exact(d)).enumerate() {
        let rec = &packed.bytes[i * rb..(i + 1) * rb];
        let (dropped, total) = encode::row_loss_terms(x, row, layout, |k| bitmap_bit(rec, k));
        sums.dropped += dropped;
        sums.total += total;
    }
}

/// Head `h`'s rows `[n][d]` from `[n][kv][d]` data.
fn gather(data: &[f32], kv: usize, d: usize, h: usize) -> Vec<f32> {
    data.chunks_exact(kv * d)
        .flat_map(|t| t[h * d..(h + 1) * d].iter().copied())
        .collect()
}

/// SPEC 3, 4, 11 for one side from an accumulated covariance: what
/// `encode::fit_side_rotated` computes from the rows, with `C` given.
fn fit_side_from_cov(
    rows: &[f32],
    lower: &[f64],
    d: usize,
    side: Side,
    config: &CompressConfig,
) -> Result<(SideStrategy, Vec<f64>)> {
    let rotation = encode::rotation_from_covariance(&mirrored(lower, d), d);
    let n = rows.len() / d;
    let mut xr = vec![0f64; n * d];
    xr.par_chunks_mut(d * 256)
        .zip(rows.par_chunks(d * 256))
        .for_each(|(o, x)| encode::rotate_rows_f64(&rotation, d, x, d, o));
    let cands = rules::candidates(config, d);
    for l in &cands {
        l.validate()?;
    }
    let losses: Vec<f64> = cands
        .iter()
        .map(|l| encode::loss_rotated(rows, &xr, d, l))
        .collect();
    let k = rules::choose_candidate(&cands, &losses, side, config);
    Ok((
        SideStrategy {
            layout: cands[k],
            rotation: mosaickv_spec::layout::trim_rotation(&rotation, d, cands[k].kept_dims),
            fit_loss: losses[k],
        },
        xr,
    ))
}

/// SPEC 10.3 close: the segment's own strategy, its records and metadata (as `mosaic::encode_segment`).
fn finalize_head(
    keys: &[f32],
    values: &[f32],
    ck: &[f64],
    cv: &[f64],
    d: usize,
    config: &CompressConfig,
) -> Result<HeadSegment> {
    let (ks, kr) = fit_side_from_cov(keys, ck, d, Side::Key, config)?;
    let packed_k = encode::pack_rotated(&kr, d, &ks.layout)?;
    drop(kr);
    let (vs, vr) = fit_side_from_cov(values, cv, d, Side::Value, config)?;
    let packed_v = encode::pack_rotated(&vr, d, &vs.layout)?;
    drop(vr);
    let dense = encode::decode_trusted(&packed_k, &ks.layout);
    let block_size = encode::block_size_dense(&dense, ks.layout.kept_dims, config);
    let meta = encode::block_meta_dense(&dense, ks.layout.kept_dims, block_size);
    Ok(HeadSegment {
        strategy: Strategy {
            key: ks,
            value: vs,
            block_size,
        },
        keys: packed_k,
        values: packed_v,
        meta,
    })
}

/// SPEC 10.2 step 2 for one head: records and metadata of rows `[n][d]` under `st`.
fn encode_part(k: &[f32], v: &[f32], st: &Strategy) -> Result<Part> {
    let keys = encode::encode_rows(k, &st.key)?;
    let values = encode::encode_rows(v, &st.value)?;
    let dense = encode::decode_trusted(&keys, &st.key.layout);
    let meta = encode::block_meta_dense(&dense, st.key.layout.kept_dims, st.block_size);
    Ok(Part { keys, values, meta })
}

impl WorkerState {
    fn new(
        shape: KvShape,
        config: CompressConfig,
        host_bytes: Arc<AtomicUsize>,
        cov_bytes: Arc<AtomicUsize>,
    ) -> Self {
        Self {
            shape,
            config,
            prev: None,
            open: None,
            host_bytes,
            cov_bytes,
            timing: Arc::new(Timing::default()),
        }
    }

    fn open_segment(&mut self, start: usize, tag: Tag, temp: Arc<Vec<Strategy>>) {
        let (kv, d) = (self.shape.kv_heads, self.shape.head_dim);
        let side = || OpenSide {
            cov: vec![0f64; d * d],
            loss: LossSums::default(),
        };
        self.open = Some(OpenSeg {
            start,
            len: 0,
            tag,
            temp,
            keys: Vec::new(),
            values: Vec::new(),
            sides: (0..kv).map(|_| [side(), side()]).collect(),
        });
        self.cov_bytes.store(2 * kv * d * d * 8, Ordering::Relaxed);
    }

    /// Adds rows `[n][kv][d]` to the open segment: covariance and loss sums per
    /// head and side; returns the records under the temporary strategy when
    /// `want_parts` (a re-encode).
    ///
    /// Rows accepted by `append` cannot overflow f16 under a fitted rotation (SPEC 14);
    /// an error here means a rotation from a damaged file, and the worker stops.
    fn ingest(&mut self, keys: &[f32], values: &[f32], want_parts: bool) -> Result<Vec<Part>> {
        let (kv, d) = (self.shape.kv_heads, self.shape.head_dim);
        let open = self.open.as_mut().expect("ingest needs an open segment");
        let temp = open.temp.clone();
        let parts: Vec<Result<Option<Part>>> = open
            .sides
            .par_iter_mut()
            .enumerate()
            .map(|(h, sides)| {
                let st = &temp[h];
                let k = gather(keys, kv, d, h);
                let v = gather(values, kv, d, h);
                let mut packed = Vec::with_capacity(2);
                for (s, (rows, side)) in [(&k, &st.key), (&v, &st.value)].into_iter().enumerate() {
                    covariance_update(&mut sides[s].cov, rows, d);
                    let n = rows.len() / d;
                    let dt = side.layout.kept_dims;
                    let mut xr = vec![0f64; n * dt];
                    encode::rotate_rows_f64(&side.rotation, d, rows, dt, &mut xr);
                    let p = encode::pack_rotated(&xr, dt, &side.layout)?;
                    add_loss_terms(&mut sides[s].loss, rows, &xr, &p, &side.layout);
                    packed.push(p);
                }
                Ok(want_parts.then(|| {
                    let values = packed.pop().expect("value records");
                    let keys = packed.pop().expect("key records");
                    let dense = encode::decode_trusted(&keys, &st.key.layout);
                    let meta =
                        encode::block_meta_dense(&dense, st.key.layout.kept_dims, st.block_size);
                    Part { keys, values, meta }
                }))
            })
            .collect();
        let parts = parts.into_iter().collect::<Result<Vec<_>>>()?;
        open.keys.extend_from_slice(keys);
        open.values.extend_from_slice(values);
        open.len += keys.len() / (kv * d);
        Ok(parts.into_iter().flatten().collect())
    }

    /// [`WorkerState::process_inner`], timed.
    fn process(&mut self, job: FlushJob) -> Result<Update> {
        let t = std::time::Instant::now();
        let r = self.process_inner(job);
        self.timing
            .worker
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    /// One flush, in the order the decode path made them (SPEC 10.2-10.3).
    fn process_inner(&mut self, job: FlushJob) -> Result<Update> {
        if self.open.is_none() {
            let (tag, temp) = match (&self.prev, &job.strategies) {
                (Some((t, s)), _) => (*t, s.clone()),
                (None, Some(s)) => (job.tag, s.clone()),
                (None, None) => {
                    return Err(MosaicError::InvalidConfig(
                        "live worker: first flush without a strategy".into(),
                    ))
                }
            };
            self.open_segment(job.start, tag, temp);
        }
        let open = self.open.as_ref().expect("open");
        if job.start != open.start + open.len {
            return Err(MosaicError::InvalidConfig(format!(
                "live worker: flush at token {} but the open segment ends at {}",
                job.start,
                open.start + open.len
            )));
        }
        let reencode = job.tag != open.tag;
        let parts = self.ingest(&job.keys, &job.values, reencode)?;
        let open = self.open.as_ref().expect("open");
        let cfg = &self.config;
        let margin = cfg.segment_loss_margin;
        let drifted = open.len >= cfg.min_segment_len
            && open.temp.iter().zip(&open.sides).any(|(st, s)| {
                s[0].loss.loss() > st.key.fit_loss + margin
                    || s[1].loss.loss() > st.value.fit_loss + margin
            });
        if open.len >= cfg.max_segment_len || drifted {
            let t_close = std::time::Instant::now();
            let open = self.open.take().expect("open");
            self.cov_bytes.store(0, Ordering::Relaxed);
            let (kv, d) = (self.shape.kv_heads, self.shape.head_dim);
            let heads = open
                .sides
                .par_iter()
                .enumerate()
                .map(|(h, s)| {
                    let k = gather(&open.keys, kv, d, h);
                    let v = gather(&open.values, kv, d, h);
                    finalize_head(&k, &v, &s[0].cov, &s[1].cov, d, cfg)
                })
                .collect::<Result<Vec<_>>>()?;
            self.host_bytes
                .fetch_sub(4 * (open.keys.len() + open.values.len()), Ordering::Relaxed);
            self.prev = Some((
                Tag::Seg(open.start),
                Arc::new(heads.iter().map(|h| h.strategy.clone()).collect()),
            ));
            self.timing
                .close
                .fetch_add(t_close.elapsed().as_nanos() as u64, Ordering::Relaxed);
            return Ok(Update::Close {
                start: open.start,
                len: open.len,
                heads,
            });
        }
        Ok(if reencode {
            Update::Reencode {
                start: job.start,
                n: job.n,
                tag: open.tag,
                parts,
            }
        } else {
            Update::Nothing
        })
    }

    fn snapshot(&self) -> HostRows {
        match &self.open {
            Some(o) => HostRows {
                keys: o.keys.clone(),
                values: o.values.clone(),
            },
            None => HostRows {
                keys: Vec::new(),
                values: Vec::new(),
            },
        }
    }
}

fn worker_loop(mut state: WorkerState, jobs: Receiver<Job>, done: Sender<Done>) {
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Flush(f) => {
                let seq = f.seq;
                let update = state.process(f);
                if done.send(Done { seq, update }).is_err() {
                    return;
                }
            }
            Job::Snapshot(reply) => {
                let _ = reply.send(state.snapshot());
            }
            Job::Hold(release) => {
                // Returns when the hold's sender is dropped.
                let _ = release.recv();
            }
        }
    }
}

enum Engine {
    Sync(Box<WorkerState>),
    Async {
        jobs: Option<Sender<Job>>,
        done: Receiver<Done>,
        handle: Option<JoinHandle<()>>,
    },
}

struct Prefill {
    rule: PrefillRule,
    keys: Vec<f32>,
    values: Vec<f32>,
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
                        2 * shape.kv_heads * shape.head_dim * shape.head_dim * 8,
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

    // ------------------------------------------------------------ worker results

    /// Applies every worker result that has arrived, without waiting.
    fn poll(&mut self) {
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

    fn apply(&mut self, d: Done) {
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

    // ------------------------------------------------------------ decode path

    /// SPEC 10.2: the full buffer, encoded with the open segment's temporary strategy.
    fn flush(&mut self) -> Result<()> {
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
                    let config = &self.view.config;
                    let (bk, bv) = (&self.buf_k, &self.buf_v);
                    let fitted = (0..kv)
                        .into_par_iter()
                        .map(|h| {
                            let k = gather(bk, kv, d, h);
                            let v = gather(bv, kv, d, h);
                            let (ks, _) = encode::fit_side_rotated(&k, d, Side::Key, config)?;
                            let (vs, _) = encode::fit_side_rotated(&v, d, Side::Value, config)?;
                            let packed = encode::encode_rows(&k, &ks)?;
                            let dense = encode::decode_trusted(&packed, &ks.layout);
                            let block_size =
                                encode::block_size_dense(&dense, ks.layout.kept_dims, config);
                            Ok(Strategy {
                                key: ks,
                                value: vs,
                                block_size,
                            })
                        })
                        .collect::<Vec<Result<_>>>()
                        .into_iter()
                        .collect::<Result<Vec<_>>>()?;
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

    // ------------------------------------------------------------ chunked prefill

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
        let keep = match rule {
            PrefillRule::Exact => 2 * l_in,
            PrefillRule::Eager => l_in,
        };
        while self.prefill.as_ref().map_or(0, |p| p.keys.len() / row) >= keep {
            self.close_prompt_segment(l_in)?;
        }
        Ok(())
    }

    /// Ends a chunked prompt: the pending rows become the last prompt segment
    /// (SPEC 10.1). A no-op when nothing is pending.
    pub fn finish_prefill(&mut self) -> Result<()> {
        let row = self.row_len();
        let pending = self.prefill.as_ref().map_or(0, |p| p.keys.len() / row);
        if pending > 0 {
            self.close_prompt_segment(pending)?;
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
        let heads = (0..kv)
            .into_par_iter()
            .map(|h| encode_segment(&gather(pk, kv, d, h), &gather(pv, kv, d, h), d, config))
            .collect::<Result<Vec<_>>>()?;
        p.keys.drain(..len * row);
        p.values.drain(..len * row);
        let start = self.view.sink.tokens + self.view.segment_tokens();
        self.view.segments.push(Segment {
            start,
            len,
            state: SegmentState::Closed,
            heads,
        });
        self.tags.push(None);
        Ok(())
    }

    fn end_prompt(&mut self) -> Result<()> {
        if !self.prompt_done {
            self.finish_prefill()?;
        }
        Ok(())
    }

    // ------------------------------------------------------------ persistence

    /// The cache and its host rows (open segment, then buffer) in the SPEC 15
    /// form, after draining the worker.
    pub fn to_parts(&mut self) -> Result<(CompressedCache, Vec<f32>, Vec<f32>)> {
        self.end_prompt()?;
        self.drain()?;
        let rows = match &self.engine {
            Engine::Sync(w) => w.snapshot(),
            Engine::Async { jobs, .. } => {
                let (tx, rx) = mpsc::channel();
                let ok = jobs
                    .as_ref()
                    .map(|j| j.send(Job::Snapshot(tx)).is_ok())
                    .unwrap_or(false);
                if !ok {
                    return Err(MosaicError::BackendUnavailable(
                        "live worker stopped".into(),
                    ));
                }
                rx.recv()
                    .map_err(|_| MosaicError::BackendUnavailable("live worker stopped".into()))?
            }
        };
        let mut keys = rows.keys;
        let mut values = rows.values;
        keys.extend_from_slice(&self.buf_k);
        values.extend_from_slice(&self.buf_v);
        Ok((self.view.clone(), keys, values))
    }

    /// Saves the drained cache in the format of SPEC.md section 15 (`spec::persist`).
    pub fn save(&mut self, path: &std::path::Path) -> Result<()> {
        let (cache, k, v) = self.to_parts()?;
        persist::save_cache(path, &cache, &k, &v)
    }

    /// Loads a cache file written by [`LiveCache::save`] (or any SPEC 15 file
    /// with host rows for its open segment and buffer).
    pub fn load(path: &std::path::Path, mode: Mode) -> Result<Self> {
        let (cache, k, v) = persist::load_cache(path)?;
        Self::from_parts(cache, k, v, mode)
    }

    /// Rebuilds a live cache from a compressed cache and its host rows (open
    /// segment's, then the buffer's). The worker's covariance and loss sums are
    /// recomputed from the rows in token order, so they equal the incremental
    /// ones bit for bit.
    pub fn from_parts(
        cache: CompressedCache,
        host_keys: Vec<f32>,
        host_values: Vec<f32>,
        mode: Mode,
    ) -> Result<Self> {
        persist::validate_structure(&cache, &host_keys, &host_values)?;
        let shape = cache.shape;
        let cfg = cache.config.clone();
        let row = shape.kv_heads * shape.head_dim;
        let (open_len, open_tag) = match cache.segments.last() {
            Some(s) if s.state == SegmentState::Open => {
                let n = cache.segments.len();
                let tag = if n >= 2 {
                    Tag::Seg(cache.segments[n - 2].start)
                } else {
                    Tag::First
                };
                (s.len, Some(tag))
            }
            _ => (0, None),
        };
        let bad = |m: String| Err(MosaicError::BadFormat(m));
        if open_len % cfg.buffer_capacity != 0 || (open_len > 0 && open_len >= cfg.max_segment_len)
        {
            return bad(format!("open segment of {open_len} tokens is not a whole number of flushes below max_segment_len"));
        }
        if host_keys.is_empty() && open_len + cache.buffer.tokens > 0 {
            return bad("a live cache needs the host rows of its open segment and buffer".into());
        }
        validate::finite("host keys", host_keys.iter())?;
        validate::finite("host values", host_values.iter())?;
        // The worker re-encodes these rows when the open segment closes: they must obey
        // the append rule (SPEC 14), or a close could fail on the worker.
        rules::rows_storable(
            "host keys (row norm beyond f16 range)",
            &host_keys,
            shape.head_dim,
        )?;
        rules::rows_storable(
            "host values (row norm beyond f16 range)",
            &host_values,
            shape.head_dim,
        )?;
        let split = open_len * row;
        let round = |v: &[f32]| {
            v.iter()
                .map(|&x| half::f16::from_f32(x))
                .collect::<Vec<_>>()
        };
        if round(&host_keys[split..]) != cache.buffer.keys
            || round(&host_values[split..]) != cache.buffer.values
        {
            return bad("buffer rows differ from the host rows".into());
        }
        let worker = match open_tag {
            Some(tag) => {
                let seg = cache.segments.last().expect("open");
                let mut w = WorkerState::new(
                    shape,
                    cfg.clone(),
                    Arc::new(AtomicUsize::new(0)),
                    Arc::new(AtomicUsize::new(0)),
                );
                w.open_segment(
                    seg.start,
                    tag,
                    Arc::new(seg.heads.iter().map(|h| h.strategy.clone()).collect()),
                );
                w.ingest(&host_keys[..split], &host_values[..split], false)?;
                Some(w)
            }
            None => None,
        };
        let mut live = Self::build(shape, cfg, mode, Path::detect(), worker)?;
        live.tags = cache
            .segments
            .iter()
            .map(|s| {
                if s.state == SegmentState::Open {
                    open_tag
                } else {
                    None
                }
            })
            .collect();
        live.prompt_done = !cache.is_empty();
        live.buf_k = host_keys[split..].to_vec();
        live.buf_v = host_values[split..].to_vec();
        live.view = cache;
        Ok(live)
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

/// SPEC 9 over the dense rows (sink, then buffer) of a cache without segments, f64, rounded to f32.
fn dense_attention(cache: &CompressedCache, q: &[f32], out: &mut [f32]) {
    let sh = cache.shape;
    let d = sh.head_dim;
    let scale = 1.0 / (d as f64).sqrt();
    let rows: Vec<(&[half::f16], &[half::f16])> = [&cache.sink, &cache.buffer]
        .into_iter()
        .flat_map(|r| (0..r.tokens).map(move |t| (r, t)))
        .flat_map(|(r, t)| (0..sh.kv_heads).map(move |h| (r.key(&sh, t, h), r.value(&sh, t, h))))
        .collect();
    let n = rows.len() / sh.kv_heads;
    let mut z = vec![0f64; n];
    let mut acc = vec![0f64; d];
    for (h, o) in out.chunks_exact_mut(d).enumerate().take(sh.q_heads) {
        let j = h / sh.group();
        let qh = &q[h * d..(h + 1) * d];
        for (t, zt) in z.iter_mut().enumerate() {
            let k = rows[t * sh.kv_heads + j].0;
            *zt = qh
                .iter()
                .zip(k)
                .map(|(&a, b)| a as f64 * b.to_f64())
                .sum::<f64>()
                * scale;
        }
        let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        acc.fill(0.0);
        let mut sum = 0f64;
        for (t, &zt) in z.iter().enumerate() {
            let p = (zt - m).exp();
            sum += p;
            for (a, v) in acc.iter_mut().zip(rows[t * sh.kv_heads + j].1) {
                *a += p * v.to_f64();
            }
        }
        for (o, a) in o.iter_mut().zip(&acc) {
            *o = (a / sum) as f32;
        }
    }
}

/// Appends a flush's records and metadata to a head segment (whole blocks, SPEC 10.2 step 2).
fn append_part(hs: &mut HeadSegment, p: Part) {
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

impl KvCache for LiveCache {
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
                    let b = &mut self.view.buffer;
                    b.tokens -= 1;
                    b.keys.truncate(b.keys.len() - row);
                    b.values.truncate(b.values.len() - row);
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

    /// SPEC 13: device bytes of the current version; `host_rows` = f32 rows of
    /// the buffer, the worker's open segment and queued flushes, and pending prompt rows.
    fn memory(&self) -> MemoryReport {
        let mut m = self.view.memory();
        let h = self.host_memory();
        m.host_rows = h.buffer_rows + h.worker_rows + h.pending_rows;
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covariance_update_matches_covariance() {
        let d = 16;
        let rows: Vec<f32> = (0..40 * d)
            .map(|i| ((i * 7919) % 113) as f32 / 17.0 - 3.0)
            .collect();
        let full = encode::covariance(&rows, d);
        let mut c = vec![0f64; d * d];
        for chunk in rows.chunks(5 * d) {
            covariance_update(&mut c, chunk, d);
        }
        assert_eq!(mirrored(&c, d), full);
    }
}
