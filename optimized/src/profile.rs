//! Where a MosaicKV decode step's time goes, stage by stage (issue 38): the wall time of the
//! step's phases and, inside the phases that run on every rayon thread, the thread time of
//! each SPEC step. [`crate::attention::packed_attention_profiled`] fills a [`StepProfile`];
//! `packed_attention` itself reads no clock (its [`Lap`]s are `None`).
//!
//! The thread times are summed over threads: on 2 threads a phase of 10 ms wall can hold up to
//! 20 ms of thread time. A lap reads the clock once per tile of 16 tokens and stage, which
//! costs a few percent of the step (`profile_stages` prints the step with and without it).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The SPEC steps timed inside the parallel phases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// SPEC 8.1: the key rotations widened to f32 and the queries rotated, per segment.
    Rotate,
    /// SPEC 8.2: block scores on the int8 bounds.
    Score,
    /// SPEC 8.3: the top blocks under the token budget.
    TopK,
    /// SPEC 9: key records expanded and dotted with the rotated queries.
    KeyLogits,
    /// SPEC 9: the online softmax.
    Softmax,
    /// SPEC 9: value records expanded (or read in place) and accumulated.
    Values,
}

impl Stage {
    pub const ALL: [Stage; 6] = [
        Stage::Rotate,
        Stage::Score,
        Stage::TopK,
        Stage::KeyLogits,
        Stage::Softmax,
        Stage::Values,
    ];
}

/// Thread time per [`Stage`], in nanoseconds, shared by the threads of a step.
#[derive(Debug, Default)]
pub struct StageClocks {
    ns: [AtomicU64; 6],
}

impl StageClocks {
    /// The time accumulated for `stage`.
    pub fn get(&self, stage: Stage) -> Duration {
        Duration::from_nanos(self.ns[stage as usize].load(Ordering::Relaxed))
    }
}

/// A lap timer of one thread's work: each [`Lap::lap`] charges the time since the previous
/// lap to a stage, locally; the sums reach the [`StageClocks`] once, when the lap is dropped.
/// Without clocks it reads no clock at all.
pub struct Lap<'a> {
    clocks: Option<&'a StageClocks>,
    last: Option<Instant>,
    acc: [u64; 6],
}

impl<'a> Lap<'a> {
    #[inline]
    pub fn new(clocks: Option<&'a StageClocks>) -> Self {
        Self {
            clocks,
            last: clocks.map(|_| Instant::now()),
            acc: [0; 6],
        }
    }

    /// Charges the time since the previous lap (or the start) to `stage`.
    #[inline]
    pub fn lap(&mut self, stage: Stage) {
        if let Some(last) = self.last {
            let now = Instant::now();
            self.acc[stage as usize] += (now - last).as_nanos() as u64;
            self.last = Some(now);
        }
    }
}

impl Drop for Lap<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.clocks {
            for (slot, &x) in c.ns.iter().zip(&self.acc) {
                if x > 0 {
                    slot.fetch_add(x, Ordering::Relaxed);
                }
            }
        }
    }
}

/// Where the decode steps of [`crate::attention::packed_attention_profiled`] went, summed
/// over `steps` steps: wall time per phase, and thread time per [`Stage`] inside them.
#[derive(Debug, Default, Clone, Copy)]
pub struct StepProfile {
    pub steps: usize,
    /// Wall: SPEC 8 for every head (rotation, scores, selection), heads in parallel.
    pub select_wall: Duration,
    /// Wall: the work units planned (one thread).
    pub plan_wall: Duration,
    /// Wall: SPEC 9 over the units (key logits, softmax, values), units in parallel.
    pub units_wall: Duration,
    /// Wall: per head the dense rows (sink, update buffer), the partials merged and the
    /// values rotated back, heads in parallel; and the output written.
    pub merge_wall: Duration,
    /// Thread time per [`Stage`] (in [`Stage::ALL`]'s order).
    pub thread: [Duration; 6],
}

impl StepProfile {
    /// The whole step's wall time (the sum of the phases).
    pub fn wall(&self) -> Duration {
        self.select_wall + self.plan_wall + self.units_wall + self.merge_wall
    }

    /// Thread time of one stage.
    pub fn thread_time(&self, stage: Stage) -> Duration {
        self.thread[stage as usize]
    }
}
