//! The messages between [`super::LiveCache`]'s decode path and its worker
//! (SPEC.md section 10.4): flush jobs, the strategy tags they carry, and the
//! worker's answers (nothing, a re-encoded flush, or a closed segment), plus
//! the worker's time counters shared with the decode side.

use mosaickv_spec::{BlockMeta, HeadSegment, PackedRows, Result, Strategy};
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

/// Names the strategy a flush was encoded with: the final strategy of the
/// closed segment starting at that token, or the one fitted on the first
/// buffer of a cache without any segment (SPEC 10.2 step 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Tag {
    Seg(usize),
    First,
}

pub(super) struct FlushJob {
    pub(super) seq: u64,
    pub(super) start: usize,
    pub(super) n: usize,
    pub(super) keys: Vec<f32>,
    pub(super) values: Vec<f32>,
    pub(super) tag: Tag,
    /// Sent with the first flush a worker sees, so it can adopt the strategy.
    pub(super) strategies: Option<Arc<Vec<Strategy>>>,
}

/// One head's records of a re-encoded flush.
pub(super) struct Part {
    pub(super) keys: PackedRows,
    pub(super) values: PackedRows,
    pub(super) meta: BlockMeta,
}

pub(super) enum Update {
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

pub(super) struct Done {
    pub(super) seq: u64,
    pub(super) update: Result<Update>,
}

/// The open segment's host rows, for saving.
pub(super) struct HostRows {
    pub(super) keys: Vec<f32>,
    pub(super) values: Vec<f32>,
}

pub(super) enum Job {
    Flush(FlushJob),
    Snapshot(Sender<HostRows>),
    /// Blocks the worker until the sender is dropped (see [`super::LiveCache::hold_worker`]).
    Hold(Receiver<()>),
}

/// Worker time counters (ns), shared with the decode side.
#[derive(Debug, Default)]
pub(super) struct Timing {
    pub(super) worker: AtomicU64,
    pub(super) close: AtomicU64,
}
