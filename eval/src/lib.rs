//! # mosaickv-eval: the evaluation harness
//!
//! What `mosaickv eval`, `mosaickv fidelity` and `mosaickv frontier` measure, as a library (issue
//! 39): the CLI parses the arguments into these inputs, calls these functions and prints what
//! they return. docs/ACCURACY.md describes the measures and their results.
//!
//! | module | what it holds |
//! |---|---|
//! | [`suite`] | running a suite of tasks x lengths x methods on one model: [`Suite`], the request a command line makes of it and its resolution over the model's default suite, prefill storage ([`StorePrefills`]), progress ([`Observer`]), one [`Record`] per cell |
//! | [`runlog`] | the run log: each (prompt, method) result as a JSON line, appended as measured, read back on a rerun |
//! | [`report`] | the per-cell table, the per-method summary and its headline, RULER's average, `eval`'s JSON and plot |
//! | [`fidelity`] | per-layer attention error and recall on a niah prompt, teacher-forced KL and top-1 agreement on natural text, their tables |
//! | [`frontier`] | the accuracy-memory frontier: the swept methods, their points, the table and the two plots |
//! | [`llm`] | loading the model, method lists, greedy decoding on a method's caches, bytes per token (also used by `generate` and `serve`) |
//! | [`plot`] | SVG line charts |
//! | [`output`] | JSON result files, written atomically |
//! | [`error`] | [`EvalError`] |
//!
//! The modules import one another in one direction only: `report` and `frontier` read
//! `suite`'s records and `fidelity`'s results; `suite` reads `runlog` and `llm`; nothing below
//! reads what is above it.
//!
//! Features: `oracle` builds the f64 oracle's methods (`mosaic-ref`, `naive2d`, `quest-sink`)
//! and puts them in the default method lists; `clap` derives `clap::ValueEnum` for
//! [`StorePrefills`].

pub mod error;
pub mod fidelity;
pub mod frontier;
pub mod llm;
pub mod output;
pub mod plot;
pub mod report;
pub mod runlog;
pub mod suite;

pub use error::{EvalError, Result};
pub use fidelity::{ForcedRecord, LayerRecord};
pub use runlog::{run_log_path, Done, RunLog};
pub use suite::{
    run_suite, Keep, Observer, Record, Resolved, StorePrefills, Suite, SuiteRequest,
    STORE_FROM_TOKENS,
};
