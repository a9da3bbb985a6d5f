//! Persistence of a [`LiveCache`] (SPEC.md section 15): the drained cache and
//! its host rows out (`to_parts`, `save`) and back in (`load`, `from_parts`,
//! which rebuilds the worker's state from the rows).

use super::protocol::{Job, Tag};
use super::worker::WorkerState;
use super::{Engine, LiveCache, Mode};
use crate::simd::Path;
use mosaickv_spec::{persist, rules, validate, CompressedCache, MosaicError, Result, SegmentState};
use std::sync::atomic::AtomicUsize;
use std::sync::mpsc;
use std::sync::Arc;

impl LiveCache {
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
        // The open segment's records are its host rows encoded with its strategies (SPEC 10.2,
        // 15.4): a file whose two copies disagree would switch answers when the segment
        // closes and is re-encoded from the host rows. Cost: one encode of the open segment.
        if let Some(seg) = cache.segments.last().filter(|_| open_len > 0) {
            for (h, head) in seg.heads.iter().enumerate() {
                let st = &head.strategy;
                for (side, host, stored, name) in [
                    (&st.key, &host_keys, &head.keys, "keys"),
                    (&st.value, &host_values, &head.values, "values"),
                ] {
                    let rows = super::gather(&host[..split], shape.kv_heads, shape.head_dim, h);
                    if crate::packed::encode_rows(&rows, side)?.bytes != stored.bytes {
                        return bad(format!(
                            "the open segment's packed {name} of head {h} are not its host rows encoded with its strategy"
                        ));
                    }
                }
            }
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
}
