//! `mosaickv generate --prompt TEXT [--method M] [--max-tokens N] [--raw] [--model NAME|PATH]`:
//! greedy generation with the KV cache held by a method; text to stdout as it is generated,
//! statistics to stderr.

use crate::error::CliError;
use mosaickv_engine::Method;
use mosaickv_eval::llm;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// The user message (wrapped in the model's chat template unless --raw).
    #[arg(long)]
    pub prompt: String,
    /// KV-cache method: full, quest, quest-sink, naive2d, kvq8, kvq4, kvq8-norot, kvq4-norot,
    /// turboquant:<preset> (k8v4, 4bit_nc, k3v4_nc, 3bit_nc), mosaic, mosaic-ref (optionally
    /// with :key=value overrides).
    #[arg(long, default_value = "mosaic")]
    pub method: String,
    /// Most tokens to generate (stops earlier at end of sequence).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Feed the prompt as plain text, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// `qwen2.5-1.5b` (Qwen2.5-Coder-1.5B-Instruct), `qwen2.5-0.5b` (Qwen2.5-Coder-0.5B-Instruct;
    /// both fetched on first use), `smollm2-135m` (the default), or a local GGUF file.
    #[arg(long, value_name = "NAME|PATH")]
    pub model: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<(), CliError> {
    let method = Method::parse(&a.method)?;
    let model = llm::load_model(a.model.as_deref())?;
    let ids = if a.raw {
        model.encode_raw(&a.prompt)?
    } else {
        model.encode_chat(&a.prompt)?
    };
    // generation stops at the model's context: say so rather than run past it
    let context = model.config().context_length;
    let room = context.saturating_sub(ids.len());
    if room == 0 {
        return Err(CliError::Input(format!(
            "the prompt is {} tokens, the model's context {context}: no room to generate",
            ids.len()
        )));
    }
    let max_tokens = if a.max_tokens > room {
        eprintln!(
            "mosaickv generate: --max-tokens {} capped at {room} (prompt {} tokens, context {context})",
            a.max_tokens,
            ids.len()
        );
        room
    } else {
        a.max_tokens
    };
    let t = Instant::now();
    let pre = model.prefill(&ids)?;
    let prefill_s = t.elapsed().as_secs_f64();
    // Stream: decode the whole generated prefix each time and print what is new, so multi-byte
    // characters split across tokens come out whole.
    let mut out = std::io::stdout().lock();
    let mut generated: Vec<u32> = Vec::new();
    let mut printed = 0usize;
    let mut write_err = None;
    let d = llm::decode_greedy(&model, &pre, &method, max_tokens, |id| {
        generated.push(id);
        if let Ok(text) = model.decode(&generated) {
            if text.len() > printed && text.is_char_boundary(printed) && !text.ends_with('\u{fffd}')
            {
                if let Err(e) = out
                    .write_all(&text.as_bytes()[printed..])
                    .and_then(|_| out.flush())
                {
                    write_err.get_or_insert(e);
                }
                printed = text.len();
            }
        }
    })?;
    let text = model.decode(&d.ids)?;
    if text.len() > printed && text.is_char_boundary(printed) {
        out.write_all(&text.as_bytes()[printed..]).ok();
    }
    writeln!(out).ok();
    drop(out);
    if let Some(e) = write_err {
        return Err(CliError::Input(format!("writing to stdout: {e}")));
    }
    let decode_s: f64 = d.step_s.iter().sum();
    let tok_s = if decode_s > 0.0 {
        d.step_s.len() as f64 / decode_s
    } else {
        0.0
    };
    eprintln!(
        "[{method}] prompt {} tokens, prefill {:.2} s; {} tokens generated, decode {:.1} tok/s; KV {:.1} device bytes/token (dense f16: {}), {:.2} MiB host rows",
        ids.len(),
        prefill_s,
        d.ids.len(),
        tok_s,
        d.bytes_per_token,
        4 * model.config().kv_heads * model.config().head_dim,
        d.host_bytes as f64 / (1 << 20) as f64
    );
    Ok(())
}
