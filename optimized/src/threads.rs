//! The process's rayon pool for command-line decode loops, with the calling thread as one of
//! its workers ([`main_thread_worker`]).
//!
//! A decode step of a model runs a few parallel phases per layer (block scores, the selected
//! blocks, the merge; the weight products). In rayon's default global pool the thread that
//! starts a phase injects it into the pool and sleeps until the pool's threads have finished
//! it: every phase costs a wake-up of each worker and of the caller. On Qwen2.5-Coder-0.5B at
//! 8K tokens that was about a quarter of a 24-layer step in the kernel's scheduler
//! (`docs/PERFORMANCE.md` section 1). With the caller as worker 0 of the pool, it runs its
//! own share of each phase and steals the rest while it waits, and only the other workers
//! are woken.
//!
//! That pool runs no job on worker 0 while that thread is busy outside rayon (blocked on a
//! channel, a socket, an async runtime): the other workers do all of it. So it is for a
//! command whose decode loop runs on the main thread (the CLI's `generate`, `eval`, `attend`,
//! the benches), not for the server, whose requests come from its runtime's threads, and
//! never for one thread: a pool whose only worker is the main thread would leave a job that
//! another thread injects waiting until the main thread next enters rayon.
//! `MOSAICKV_MAIN_THREAD_WORKER=0` keeps rayon's default pool (for side-by-side timing).

use mosaickv_spec::{MosaicError, Result};

/// How the global pool was set up by [`main_thread_worker`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolSetup {
    /// The calling thread is worker 0 of a global pool of this many threads.
    MainThreadWorker(usize),
    /// Rayon's default global pool (fewer than two threads, or switched off).
    Default,
}

/// The number of threads the global pool would have: `RAYON_NUM_THREADS` when it is a
/// positive integer (as rayon reads it), else the available parallelism.
pub fn pool_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Whether [`main_thread_worker`] takes the calling thread into the pool, for `threads`
/// threads and the value of `MOSAICKV_MAIN_THREAD_WORKER`: only for two threads or more
/// (one thread would be the pool's only worker), unless the switch says `0`, `off` or
/// `false`.
pub fn wants_main_thread_worker(threads: usize, switch: Option<&str>) -> bool {
    let off = matches!(
        switch.map(|s| s.trim().to_ascii_lowercase()).as_deref(),
        Some("0" | "off" | "false")
    );
    threads >= 2 && !off
}

/// Builds rayon's global pool with the calling thread as worker 0 (see the module docs), if
/// [`wants_main_thread_worker`] says so; call it once, first thing, from the thread that will
/// run the decode loop. `Err` if the global pool already exists (something ran in rayon
/// before) or its threads cannot be started.
pub fn main_thread_worker() -> Result<PoolSetup> {
    let threads = pool_threads();
    let switch = std::env::var("MOSAICKV_MAIN_THREAD_WORKER").ok();
    if !wants_main_thread_worker(threads, switch.as_deref()) {
        return Ok(PoolSetup::Default);
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .use_current_thread()
        .build_global()
        .map_err(|e| MosaicError::BackendUnavailable(format!("rayon's global pool: {e}")))?;
    Ok(PoolSetup::MainThreadWorker(threads))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_thread_or_the_switch_keeps_the_default_pool() {
        assert!(!wants_main_thread_worker(1, None));
        assert!(!wants_main_thread_worker(0, None));
        assert!(wants_main_thread_worker(2, None));
        assert!(wants_main_thread_worker(16, Some("1")));
        for off in ["0", "off", "OFF", " false "] {
            assert!(!wants_main_thread_worker(2, Some(off)), "{off}");
        }
    }
}
