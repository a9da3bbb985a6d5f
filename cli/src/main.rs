//! `mosaickv`: the command-line tool (SPEC.md section 15 for its files).
//!
//! Each subcommand lives in its own module (`cmd_*.rs`) with an `Args`
//! struct and a `run(args) -> Result<(), CliError>`; add a subcommand by
//! adding a module and a variant of [`Command`]. No `cmd_*` module imports
//! another: what two share is a library's (`eval`, `fidelity` and `frontier`
//! run the harness in `mosaickv-eval`) or a module of its own here
//! (`progress.rs`, `cachedir.rs`, `npy.rs`, `backend.rs`).

mod backend;
mod cachedir;
mod cmd_attend;
mod cmd_compress;
mod cmd_eval;
mod cmd_fidelity;
mod cmd_frontier;
mod cmd_generate;
mod cmd_inspect;
mod cmd_serve;
mod error;
mod npy;
mod progress;

use clap::{Parser, Subcommand};
use error::CliError;

#[derive(Parser)]
#[command(name = "mosaickv", version, about = "MosaicKV: 2-D KV-cache compression", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Compress keys/values [tokens, kv_heads, head_dim] (.npy, f32 or f16) into a cache directory.
    Compress(cmd_compress::Args),
    /// Decode attention for queries [q_heads, head_dim] over a saved cache, with MosaicKV or a baseline.
    Attend(cmd_attend::Args),
    /// Print a saved cache's memory breakdown and per-segment strategies.
    Inspect(cmd_inspect::Args),
    /// Generate text with SmolLM2-135M-Instruct, its KV cache held by a method (greedy, streamed).
    Generate(cmd_generate::Args),
    /// The accuracy suite: RULER-style tasks x lengths x methods (the main job).
    Eval(cmd_eval::Args),
    /// Per-layer attention error / recall and teacher-forced KL of each method against the full cache.
    Fidelity(cmd_fidelity::Args),
    /// The accuracy-memory frontier: channel-retention sweep of mosaic and naive2d, plus Quest.
    Frontier(cmd_frontier::Args),
    /// An OpenAI-compatible HTTP server: batched decode of many sequences under one KV budget.
    Serve(cmd_serve::Args),
}

fn run(cli: Cli) -> Result<(), CliError> {
    // Every command but the server runs its work on this thread: make it one of rayon's
    // workers (mosaickv_optimized::threads). The server's requests come from its runtime's
    // threads, so it keeps rayon's default pool.
    if !matches!(cli.command, Command::Serve(_)) {
        mosaickv_optimized::threads::main_thread_worker()?;
    }
    match cli.command {
        Command::Compress(a) => cmd_compress::run(a),
        Command::Attend(a) => cmd_attend::run(a),
        Command::Inspect(a) => cmd_inspect::run(a),
        Command::Generate(a) => cmd_generate::run(a),
        Command::Eval(a) => cmd_eval::run(a),
        Command::Fidelity(a) => cmd_fidelity::run(a),
        Command::Frontier(a) => cmd_frontier::run(a),
        Command::Serve(a) => cmd_serve::run(a),
    }
}

fn main() {
    // `println!` panics when stdout cannot be written (a full disk, a closed pipe): report
    // that as the error it is, exit 1, instead of a panic message and exit 101.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if let Some(rest) = msg.strip_prefix("failed printing to stdout: ") {
            eprintln!("mosaickv: error: writing to stdout: {rest}");
            std::process::exit(1);
        }
        default_hook(info)
    }));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version print as clap prints them, on stdout, exit 0
        Err(e) if !e.use_stderr() => e.exit(),
        // A usage error (unknown flag, bad value, missing argument): the documented one line
        // `mosaickv: error: ...`, exit 2 as clap and most tools use for usage errors.
        Err(e) => {
            let text = e.render().to_string();
            eprintln!(
                "mosaickv: error: {} (mosaickv --help lists the commands and options)",
                error::printable(&usage_error_line(&text))
            );
            std::process::exit(2);
        }
    };
    if let Err(e) = run(cli) {
        eprintln!("mosaickv: error: {}", e.one_line());
        std::process::exit(1);
    }
}

/// clap's usage error as one line: its first paragraph (up to the first blank line, before
/// `Usage:`), the lines joined, so a list such as the missing required arguments stays in it:
/// `the following required arguments were not provided: --method <METHOD>, --out <OUT>`.
fn usage_error_line(text: &str) -> String {
    let mut line = String::new();
    for (i, l) in text
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .enumerate()
    {
        let l = l.trim();
        let l = if i == 0 {
            l.strip_prefix("error: ").unwrap_or(l)
        } else {
            l
        };
        if i > 1 {
            line.push(',');
        }
        if i > 0 && !line.ends_with(' ') {
            line.push(' ');
        }
        line.push_str(l);
    }
    line
}
