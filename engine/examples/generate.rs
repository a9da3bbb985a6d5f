//! Greedy generation with the dense f16 cache, streaming to stdout; timings to stderr.
//!
//! cargo run --release -p mosaickv-engine --example generate -- "prompt"
//! cargo run --release -p mosaickv-engine --example generate -- --haystack 3000 --max-new 32

use clap::Parser;
use mosaickv_engine::{resolve_model, Model};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Parser)]
struct Args {
    /// User prompt (chat-templated unless --raw).
    prompt: Option<String>,
    /// Encode the prompt as plain text, without the chat template.
    #[arg(long)]
    raw: bool,
    /// Maximum number of new tokens.
    #[arg(long, default_value_t = 128)]
    max_new: usize,
    /// Model file (default: $MOSAICKV_HOME, fetched with pip when absent).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Instead of PROMPT, ask a needle-in-a-haystack question of about this many tokens.
    #[arg(long)]
    haystack: Option<usize>,
}

fn haystack(model: &Model, target: usize) -> BoxResult<String> {
    let filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";
    let per = model.encode_raw(filler)?.len();
    let reps = target.saturating_sub(90) / per;
    let mut ctx = String::new();
    for i in 0..reps.max(1) {
        if i == reps / 2 {
            ctx.push_str("The special magic number for the blue door is: 4729. ");
        }
        ctx.push_str(filler);
    }
    Ok(format!(
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. \
         I will quiz you about the numbers afterwards.\n{ctx}\nWhat is the special magic number for the blue door mentioned in the provided text?"
    ))
}

fn main() -> BoxResult<()> {
    let args = Args::parse();
    let t = Instant::now();
    let model = Model::load(&resolve_model(args.model.as_deref())?)?;
    eprintln!("[load {:.2} s]", t.elapsed().as_secs_f64());
    let prompt = match (args.haystack, &args.prompt) {
        (Some(n), _) => haystack(&model, n)?,
        (None, Some(p)) => p.clone(),
        (None, None) => "What is the capital of France?".to_string(),
    };
    let ids = if args.raw {
        model.encode_raw(&prompt)?
    } else {
        model.encode_chat(&prompt)?
    };
    let t = Instant::now();
    let pre = model.prefill(&ids)?;
    let prefill_s = t.elapsed().as_secs_f64();
    eprintln!(
        "[prefill {} tokens: {:.2} s, {:.0} tok/s]",
        ids.len(),
        prefill_s,
        ids.len() as f64 / prefill_s
    );
    let mut caches = model.new_full_caches();
    pre.fill(&mut caches)?;
    let mut out = Vec::new();
    let mut logits = pre.logits;
    let mut pos = ids.len();
    let mut printed = 0;
    let t = Instant::now();
    let mut steps = 0;
    loop {
        let next = mosaickv_engine::argmax(&logits);
        out.push(next);
        let text = model.decode(&out)?;
        if text.len() > printed && !text.ends_with('\u{fffd}') {
            print!("{}", &text[printed..]);
            std::io::stdout().flush()?;
            printed = text.len();
        }
        if model.is_eos(next) || out.len() >= args.max_new {
            break;
        }
        logits = model.decode_step(next, pos, &mut caches)?;
        pos += 1;
        steps += 1;
    }
    println!();
    let dt = t.elapsed().as_secs_f64();
    let kv: usize = caches.iter().map(|c| c.bytes()).sum();
    eprintln!(
        "[decode {steps} steps: {:.2} s, {:.1} tok/s; KV cache {} tokens, {:.1} MiB]",
        dt,
        steps as f64 / dt.max(1e-9),
        caches[0].len(),
        kv as f64 / (1 << 20) as f64
    );
    Ok(())
}
