//! `threads::main_thread_worker` on the process's main thread (no test harness: the harness
//! runs tests on threads of its own): the main thread becomes worker 0, parallel work started
//! there runs on it and on the other worker with the serial result, and a job that another
//! thread starts while the main thread blocks outside rayon still finishes (the other worker
//! takes it), which is what the CLI's background threads rely on.

use mosaickv_optimized::threads::{main_thread_worker, PoolSetup};
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

fn main() {
    // two workers whatever this machine has (set before rayon reads it)
    std::env::set_var("RAYON_NUM_THREADS", "2");
    std::env::remove_var("MOSAICKV_MAIN_THREAD_WORKER");
    let setup = main_thread_worker().expect("the global pool is built once, here");
    assert_eq!(setup, PoolSetup::MainThreadWorker(2));
    assert_eq!(
        rayon::current_thread_index(),
        Some(0),
        "the main thread is worker 0"
    );
    assert_eq!(rayon::current_num_threads(), 2);
    // A second build is an error, not a second pool.
    assert!(main_thread_worker().is_err());

    // Parallel work from the main thread: the serial sum, and the main thread took part.
    let on_main = AtomicBool::new(false);
    let sum: u64 = (0..1_000_000u32)
        .into_par_iter()
        .with_max_len(1_000)
        .map(|x| {
            if rayon::current_thread_index() == Some(0) {
                on_main.store(true, Ordering::Relaxed);
            }
            u64::from(x) * 3
        })
        .sum();
    assert_eq!(sum, 3 * (1_000_000u64 * 999_999 / 2));
    assert!(
        on_main.load(Ordering::Relaxed),
        "worker 0 ran none of the main thread's work"
    );

    // The main thread blocked on a channel, outside rayon: another thread's parallel job is
    // done by the other worker.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let s: u64 = (0..100_000u64).into_par_iter().sum();
        tx.send(s).expect("main thread waits");
    });
    let s = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a job started by another thread finishes while the main thread blocks");
    assert_eq!(s, 100_000 * 99_999 / 2);
    println!("main_thread_pool: ok (main thread worker 0 of 2)");
}
