//! `mosaickv serve`: many sequences decoded together under one KV memory budget, behind an
//! OpenAI-compatible HTTP API (issue 16).
//!
//! * [`engine`]: the engine thread (admission under the budget, prefill between decode steps,
//!   batched decode, sampling, stop strings, cancellation).
//! * [`budget`]: the worst-case bytes a request may need and what a running one may still need.
//! * `api`: `POST /v1/chat/completions`, `POST /v1/completions` (JSON or `stream: true` as
//!   server-sent events), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text).
//!
//! The HTTP side (axum on tokio) and the engine thread talk over channels: a bounded queue of
//! jobs one way, a per-request event channel the other. [`Server::start`] binds and returns at
//! once (port 0 picks a free port; [`Server::addr`] says which).

mod api;
pub mod budget;
mod conn;
pub mod engine;
mod metrics;

use budget::Footprint;
use engine::Shared;
use mosaickv_engine::{Method, Model};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Errors starting the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("method {0} is not served (served: {methods})", methods = budget::SERVED_METHODS)]
    Method(String),
    #[error("invalid setting: {0}")]
    Invalid(String),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
}

/// What `mosaickv serve` runs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The name `/v1/models` lists and requests must use (or omit).
    pub model_name: String,
    pub method: Method,
    /// Cap on the bytes of every cache together (device bytes of `memory()`).
    pub kv_budget: usize,
    /// Most sequences decoded together.
    pub max_batch: usize,
    /// Most accepted requests waiting for memory or a batch slot; more get 429.
    pub queue_capacity: usize,
}

#[derive(Clone)]
pub(crate) struct AppState {
    model: Arc<Model>,
    model_name: String,
    method_label: String,
    footprint: Footprint,
    shared: Arc<Shared>,
}

/// A running server: the HTTP listener on the tokio runtime it was started on, and the engine
/// thread.
pub struct Server {
    addr: SocketAddr,
    shared: Arc<Shared>,
    engine: Option<std::thread::JoinHandle<()>>,
    http: tokio::task::JoinHandle<()>,
}

/// Counters of a running server, for tests and the load generator.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    pub running: usize,
    pub queued: usize,
    pub kv_used: usize,
    pub kv_reserved: usize,
    pub kv_peak: usize,
    pub running_peak: usize,
    pub reservation_overruns: usize,
    /// Batched decode steps, the tokens they produced and the engine seconds they took.
    pub decode_steps: usize,
    pub decode_tokens: usize,
    pub decode_s: f64,
    /// Engine seconds spent prefilling prompts (compression included).
    pub prefill_s: f64,
}

impl Server {
    /// Checks the settings, starts the engine thread and binds `host:port` (call inside a tokio
    /// runtime).
    pub async fn start(
        model: Arc<Model>,
        cfg: ServeConfig,
        host: &str,
        port: u16,
    ) -> Result<Server, ServeError> {
        cfg.method
            .validate_for(model.config().head_dim)
            .map_err(|e| ServeError::Invalid(e.to_string()))?;
        let footprint = Footprint::of(&cfg.method, model.config())
            .ok_or_else(|| ServeError::Method(cfg.method.to_string()))?;
        if cfg.max_batch == 0 || cfg.queue_capacity == 0 || cfg.kv_budget == 0 {
            return Err(ServeError::Invalid(
                "--max-batch, --queue and --kv-budget must be at least 1".into(),
            ));
        }
        // The budget, and the bytes used and reserved under it, are Prometheus gauges
        // (signed 64-bit): a budget they cannot hold would be reported negative.
        if cfg.kv_budget > MAX_KV_BUDGET {
            return Err(ServeError::Invalid(format!(
                "--kv-budget {} bytes is more than the largest budget the server can count ({MAX_KV_BUDGET} bytes, 2^63 - 1)",
                cfg.kv_budget
            )));
        }
        let shared = Arc::new(Shared::new(
            cfg.kv_budget,
            cfg.max_batch,
            cfg.queue_capacity,
        ));
        shared.metrics.kv_budget.set(cfg.kv_budget as i64);
        let addr_s = format!("{host}:{port}");
        let listener = tokio::net::TcpListener::bind(&addr_s)
            .await
            .map_err(|source| ServeError::Bind {
                addr: addr_s.clone(),
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| ServeError::Bind {
            addr: addr_s,
            source,
        })?;
        let engine = {
            let (model, method, shared) = (model.clone(), cfg.method.clone(), shared.clone());
            std::thread::Builder::new()
                .name("mosaickv-engine".into())
                .spawn(move || engine::run(model, method, footprint, shared))
                .map_err(|e| ServeError::Invalid(format!("engine thread: {e}")))?
        };
        let state = AppState {
            model,
            model_name: cfg.model_name,
            method_label: cfg.method.to_string(),
            footprint,
            shared: shared.clone(),
        };
        use axum::routing::{get, post};
        let body = axum::middleware::from_fn(api::read_body);
        let app = axum::Router::new()
            .route("/v1/chat/completions", post(api::chat).layer(body.clone()))
            .route("/v1/completions", post(api::completions).layer(body))
            .route("/v1/models", get(api::models))
            .route("/health", get(api::health))
            .route("/metrics", get(api::metrics))
            .method_not_allowed_fallback(api::method_not_allowed)
            .fallback(api::not_found)
            .with_state(state);
        let http = tokio::spawn(serve_http(listener, app));
        Ok(Server {
            addr,
            shared,
            engine: Some(engine),
            http,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> Stats {
        let s = &self.shared;
        Stats {
            running: s.running.load(Ordering::SeqCst),
            queued: s.queued(),
            kv_used: s.kv_used.load(Ordering::SeqCst),
            kv_reserved: s.kv_reserved.load(Ordering::SeqCst),
            kv_peak: s.kv_peak.load(Ordering::SeqCst),
            running_peak: s.running_peak.load(Ordering::SeqCst),
            reservation_overruns: s.reservation_overruns.load(Ordering::SeqCst),
            decode_steps: s.decode_steps.load(Ordering::SeqCst),
            decode_tokens: s.decode_tokens.load(Ordering::SeqCst),
            decode_s: s.metrics.decode_seconds.get(),
            prefill_s: s.metrics.prefill_seconds.get(),
        }
    }

    /// Resets the peaks (between load-generator runs).
    pub fn reset_peaks(&self) {
        self.shared.kv_peak.store(0, Ordering::SeqCst);
        self.shared.running_peak.store(0, Ordering::SeqCst);
    }

    /// Waits until the HTTP side stops (for `mosaickv serve`: forever, unless it fails).
    pub async fn wait(mut self) {
        let _ = (&mut self.http).await;
        self.shutdown_engine();
    }

    /// Stops accepting, lets the engine finish what it accepted, and joins it.
    pub fn shutdown(mut self) {
        self.http.abort();
        self.shutdown_engine();
    }

    fn shutdown_engine(&mut self) {
        self.shared.stop();
        if let Some(h) = self.engine.take() {
            let _ = h.join();
        }
    }
}

/// The largest `--kv-budget`: what the signed 64-bit metrics gauges can hold.
pub const MAX_KV_BUDGET: usize = i64::MAX as usize;

/// A client has this long to send its request head (each request of a keep-alive
/// connection): a slow or silent client cannot hold a connection for longer.
pub const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// Most connections open at once; more wait in the listen backlog until one closes, so
/// clients that open connections and send nothing cannot use up the process's file
/// descriptors (each is closed after [`HEADER_TIMEOUT`]).
pub const MAX_CONNECTIONS: usize = 1024;

/// The HTTP side: axum's router on hyper's HTTP/1 connections, with what `axum::serve` does
/// not set: a timeout on each request head ([`HEADER_TIMEOUT`]; the body's is
/// `api::BODY_TIMEOUT`) and a cap on open connections ([`MAX_CONNECTIONS`]).
async fn serve_http(listener: tokio::net::TcpListener, app: axum::Router) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return; // never closed
        };
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // out of file descriptors or a connection reset before accept: wait, go on
                eprintln!("mosaickv serve: accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let mut http1 = hyper::server::conn::http1::Builder::new();
            http1
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                // A client that sends its whole request and then shuts down its writing half
                // (`nc -N`, some HTTP/1.0 clients) still gets its answer: a request is
                // cancelled when its connection really closes or a write to it fails, not at
                // the end of its body.
                .half_close(true);
            // a connection ends with an error when its client goes away: nothing to report
            let _ = http1
                .serve_connection(
                    hyper_util::rt::TokioIo::new(conn::JsonErrors::new(stream)),
                    service,
                )
                .await;
            drop(slot);
        });
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.http.abort();
        self.shutdown_engine();
    }
}
