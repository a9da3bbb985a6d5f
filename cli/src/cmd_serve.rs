//! `mosaickv serve [--model PATH] [--method M] [--host H] [--port N] [--kv-budget BYTES]
//! [--max-batch N] [--queue N]`: an OpenAI-compatible HTTP server (crate `mosaickv-server`)
//! decoding many sequences together under one KV memory budget.

use crate::error::CliError;
use mosaickv_engine::Method;
use mosaickv_eval::llm;
use mosaickv_server::{ServeConfig, Server};
use std::path::PathBuf;
use std::sync::Arc;

/// The name `/v1/models` lists for the default model.
pub const DEFAULT_MODEL_NAME: &str = "smollm2-135m-instruct";

#[derive(clap::Args)]
pub struct Args {
    /// A local GGUF file instead of the cached (or fetched) SmolLM2-135M-Instruct; it is served
    /// under its file name without the extension (the default model as smollm2-135m-instruct).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// KV-cache method: full, kvq8, kvq4 (llama.cpp's q8_0 / q4_0 KV, Hadamard-rotated),
    /// kvq8-norot, kvq4-norot (unrotated), turboquant:<preset> (vLLM's k8v4, 4bit_nc, k3v4_nc,
    /// 3bit_nc), mosaic or mosaic-ref (the f64 reference), optionally with :key=value overrides.
    #[arg(long, default_value = "mosaic")]
    pub method: String,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// TCP port (0: any free port, printed at start).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Cap on the bytes of every KV cache together, as memory() counts them: an integer,
    /// optionally with a K, M or G suffix (powers of 1024).
    #[arg(long, default_value = "2G", value_parser = parse_bytes)]
    pub kv_budget: usize,
    /// Most sequences decoded together.
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    /// Most requests waiting for memory or a batch slot; more get 429.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
}

/// `123`, `64K`, `512M`, `2G` (powers of 1024).
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: usize = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                _ => return Err(format!("{s:?}: unknown suffix {c:?} (K, M or G)")),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    let n: usize = num
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count"))?;
    n.checked_mul(mult)
        .filter(|&b| b <= mosaickv_server::MAX_KV_BUDGET)
        .ok_or_else(|| {
            format!(
                "{s:?} is too large (at most {} bytes, 2^63 - 1)",
                mosaickv_server::MAX_KV_BUDGET
            )
        })
}

pub fn run(a: Args) -> Result<(), CliError> {
    let method = Method::parse(&a.method)?;
    let model_name = match &a.model {
        Some(p) => p
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| DEFAULT_MODEL_NAME.into()),
        None => DEFAULT_MODEL_NAME.into(),
    };
    let model = Arc::new(llm::load_model(a.model.as_deref())?);
    let cfg = ServeConfig {
        model_name: model_name.clone(),
        method: method.clone(),
        kv_budget: a.kv_budget,
        max_batch: a.max_batch,
        queue_capacity: a.queue,
    };
    let rt = tokio::runtime::Runtime::new()
        .map_err(|e| CliError::Input(format!("tokio runtime: {e}")))?;
    rt.block_on(async {
        let server = Server::start(model, cfg, &a.host, a.port)
            .await
            .map_err(|e| CliError::Input(e.to_string()))?;
        eprintln!(
            "mosaickv serve: {model_name} with {method} on http://{} (KV budget {} bytes, batch {}, queue {})",
            server.addr(),
            a.kv_budget,
            a.max_batch,
            a.queue
        );
        server.wait().await;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts_parse() {
        assert_eq!(parse_bytes("123"), Ok(123));
        assert_eq!(parse_bytes("64K"), Ok(64 << 10));
        assert_eq!(parse_bytes("2g"), Ok(2 << 30));
        assert!(parse_bytes("2T").is_err());
        assert!(parse_bytes("-1").is_err());
        assert!(parse_bytes("G").is_err());
        assert!(parse_bytes("99999999999999999999G").is_err());
        // issue 40: a budget the signed 64-bit gauges cannot hold is refused
        assert!(parse_bytes("9223372036854775808").is_err());
        assert!(parse_bytes("8589934592G").is_err());
        assert_eq!(parse_bytes("9223372036854775807"), Ok(i64::MAX as usize));
    }
}
