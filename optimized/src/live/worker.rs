//! The worker's side of [`super::LiveCache`] (SPEC.md section 10.4): the
//! authoritative lifecycle state, the open segment's covariance and SPEC 11.1
//! loss sums (rows added in token order), the close rule of SPEC 10.3 at each
//! flush, and the worker thread's job loop. Fitting and re-encoding a closed
//! segment is in `close`; the covariance kernel in `covariance`.

use super::close::finalize_head;
use super::covariance::covariance_update;
use super::gather;
use super::protocol::{Done, FlushJob, HostRows, Job, Part, Tag, Timing, Update};
use crate::strategy::LossSums;
use crate::{meta, packed, rotation, strategy};
use mosaickv_spec::cache::covariance_scratch_bytes;
use mosaickv_spec::layout::bitmap_bit;
use mosaickv_spec::{
    CompressConfig, KvShape, MosaicError, PackedRows, Result, Side, SideStrategy, Strategy,
    ValueDtype,
};
use rayon::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

/// One head and side of the worker's open segment.
struct OpenSide {
    /// Lower triangle (`b <= a`) of `C = sum x x^T`, `d x d` row-major.
    cov: Vec<f64>,
    loss: LossSums,
}

pub(super) struct OpenSeg {
    start: usize,
    len: usize,
    tag: Tag,
    temp: Arc<Vec<Strategy>>,
    pub(super) keys: Vec<f32>,
    pub(super) values: Vec<f32>,
    /// Per head: key side, value side.
    sides: Vec<[OpenSide; 2]>,
}

/// The authoritative lifecycle state: what the worker thread owns.
pub(super) struct WorkerState {
    shape: KvShape,
    config: CompressConfig,
    /// The last closed segment's final strategy (the next open segment's temporary one).
    prev: Option<(Tag, Arc<Vec<Strategy>>)>,
    pub(super) open: Option<OpenSeg>,
    pub(super) host_bytes: Arc<AtomicUsize>,
    pub(super) cov_bytes: Arc<AtomicUsize>,
    pub(super) timing: Arc<Timing>,
}

/// SPEC 11.1 per-row terms `(dropped, total)` of rows `[n][d]` with rotated coordinates `xr`
/// (`[n][Dt]`, f64), whose kept groups are read from their packed records (SPEC 5's
/// selection, done by `pack_rotated`); a coded side (SPEC 6.1) keeps every dim and measures
/// each one's decoded value.
fn add_loss_terms(
    sums: &mut LossSums,
    rows: &[f32],
    xr: &[f64],
    packed: &PackedRows,
    side: &SideStrategy,
) {
    let layout = &side.layout;
    let (d, dt) = (layout.head_dim, layout.kept_dims);
    let rb = layout.record_bytes();
    let mut deq = Vec::new();
    for (i, (rot, x)) in xr.chunks_exact(dt).zip(rows.chunks_exact(d)).enumerate() {
        let (dropped, total) = if layout.dtype == ValueDtype::Coded {
            crate::coded::coded_row_loss_terms(x, rot, side)
        } else {
            let rec = &packed.bytes[i * rb..(i + 1) * rb];
            if layout.dtype.is_quantized() {
                // The decoded values this record stores are the ones the loss measures (SPEC
                // 11.1).
                packed::record_dequantized(rec, layout, &mut deq);
            }
            strategy::row_loss_terms(x, rot, layout, |k| bitmap_bit(rec, k), &deq)
        };
        sums.dropped += dropped;
        sums.total += total;
    }
    sums.spread.add_rows(rows, d);
}

impl WorkerState {
    pub(super) fn new(
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

    pub(super) fn open_segment(&mut self, start: usize, tag: Tag, temp: Arc<Vec<Strategy>>) {
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
        self.cov_bytes
            .store(covariance_scratch_bytes(kv, d), Ordering::Relaxed);
    }

    /// Adds rows `[n][kv][d]` to the open segment: covariance and loss sums per
    /// head and side; returns the records under the temporary strategy when
    /// `want_parts` (a re-encode).
    ///
    /// Rows accepted by `append` cannot overflow f16 under a fitted rotation (SPEC 14);
    /// an error here means a rotation from a damaged file, and the worker stops.
    pub(super) fn ingest(
        &mut self,
        keys: &[f32],
        values: &[f32],
        want_parts: bool,
    ) -> Result<Vec<Part>> {
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
                    let rot = mosaickv_spec::layout::rotation_f32(&side.rotation);
                    rotation::rotate_rows_f64(&rot, d, rows, dt, &mut xr);
                    let p = packed::pack_rotated(&xr, dt, side)?;
                    add_loss_terms(&mut sides[s].loss, rows, &xr, &p, side);
                    packed.push(p);
                }
                Ok(want_parts.then(|| {
                    let values = packed.pop().expect("value records");
                    let keys = packed.pop().expect("key records");
                    let dense = packed::decode_trusted(&keys, &st.key);
                    let meta =
                        meta::block_meta_dense(&dense, st.key.layout.kept_dims, st.block_size);
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
    pub(super) fn process(&mut self, job: FlushJob) -> Result<Update> {
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
                s[0].loss.loss(Side::Key) > st.key.fit_loss + margin
                    || s[1].loss.loss(Side::Value) > st.value.fit_loss + margin
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

    pub(super) fn snapshot(&self) -> HostRows {
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

pub(super) fn worker_loop(mut state: WorkerState, jobs: Receiver<Job>, done: Sender<Done>) {
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
