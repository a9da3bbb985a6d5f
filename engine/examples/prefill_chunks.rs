//! Times a prompt's prefill whole ([`Model::prefill`]) and in server-sized chunks
//! ([`Model::prefill_chunk`], the path `mosaickv serve` takes), and checks that both give the
//! same last-token argmax.
//!
//! cargo run --release -p mosaickv-engine --example prefill_chunks -- --length 7680 --chunk 256

use clap::Parser;
use mosaickv_engine::{argmax, resolve_model, ChunkedPrefill, Model};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Prompt length in tokens (the first N tokens of a fixed filler text).
    #[arg(long, default_value_t = 7680)]
    length: usize,
    /// Tokens per chunk (the server's `PREFILL_CHUNK` is 256).
    #[arg(long, default_value_t = 256)]
    chunk: usize,
    /// Skip the whole-prompt prefill.
    #[arg(long)]
    chunked_only: bool,
    #[arg(long)]
    model: Option<PathBuf>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.chunk == 0 || args.length == 0 {
        return Err("--length and --chunk must be positive".into());
    }
    let model = Model::load(&resolve_model(args.model.as_deref())?)?;
    let text = "The quick brown fox jumps over the lazy dog while the cat sleeps by the fire. "
        .repeat(args.length / 8 + 16);
    let mut tokens = model.encode_raw(&text)?;
    if tokens.len() < args.length {
        return Err(format!("filler gave {} tokens", tokens.len()).into());
    }
    tokens.truncate(args.length);
    let mut whole = None;
    if !args.chunked_only {
        let t = Instant::now();
        let pre = model.prefill(&tokens)?;
        eprintln!("whole prefill: {:.2} s", t.elapsed().as_secs_f64());
        whole = Some(argmax(&pre.logits));
    }
    let t = Instant::now();
    let mut state = ChunkedPrefill::default();
    let mut logits = Vec::new();
    for part in tokens.chunks(args.chunk) {
        logits = model.prefill_chunk(&mut state, part)?;
    }
    eprintln!(
        "chunked prefill ({} tokens a chunk): {:.2} s",
        args.chunk,
        t.elapsed().as_secs_f64()
    );
    let chunked = argmax(&logits);
    if let Some(w) = whole {
        eprintln!("argmax whole {w}, chunked {chunked}");
        if w != chunked {
            return Err("whole and chunked prefills disagree on the next token".into());
        }
    }
    Ok(())
}
