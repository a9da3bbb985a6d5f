//! The OpenAI-compatible HTTP side: request parsing and validation, SSE streaming, errors.
//!
//! Every bad request gets a 400 JSON error (`{"error": {"message", "type", "code"}}`) before it
//! reaches the engine; a full queue gets 429. The body is parsed here (not by axum's `Json`
//! extractor) so that malformed JSON is a 400 with the same error shape.

use crate::engine::{Event, Job, Refused, Sampling};
use crate::AppState;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio_stream::wrappers::UnboundedReceiverStream;

/// Default `max_tokens` when a request gives none.
pub const DEFAULT_MAX_TOKENS: usize = 256;
/// At most this many stop strings (OpenAI's limit).
const MAX_STOPS: usize = 4;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// An error answer.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub code: &'static str,
}

impl ApiError {
    pub fn bad(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            code,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        };
        (
            self.status,
            Json(json!({"error": {"message": self.message, "type": kind, "code": self.code}})),
        )
            .into_response()
    }
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: Value,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum StopField {
    One(String),
    Many(Vec<String>),
}

/// The fields of both endpoints that the server reads (others are ignored, as OpenAI clients
/// send some by default).
#[derive(Debug, Deserialize)]
struct Request {
    model: Option<String>,
    prompt: Option<Value>,
    messages: Option<Vec<Message>>,
    max_tokens: Option<Value>,
    max_completion_tokens: Option<Value>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    seed: Option<i64>,
    stop: Option<StopField>,
    stream: Option<bool>,
    n: Option<i64>,
    /// Extension (as in vLLM): keep generating through end-of-sequence tokens, up to
    /// `max_tokens`; the EOS tokens count as completion tokens and are left out of the text.
    /// For load tests that need every request to run its full length.
    ignore_eos: Option<bool>,
    /// Asked-for features this server does not have: refused with 400 when they ask for
    /// something (`logprobs: true`, `top_logprobs > 0`, `echo: true`, `best_of > 1`, a
    /// non-empty `suffix`), accepted in their "off" form, which clients send by default.
    logprobs: Option<Value>,
    top_logprobs: Option<Value>,
    echo: Option<Value>,
    best_of: Option<Value>,
    suffix: Option<Value>,
    /// Structured output and tool calls: refused with 400 when they ask for something
    /// (`response_format` other than `{"type": "text"}`, a non-empty `tools` or
    /// `functions` list); this server generates plain text only.
    response_format: Option<Value>,
    tools: Option<Value>,
    functions: Option<Value>,
    /// OpenAI's sampling adjustments ([`Sampling`]): a map from token id (a string) to a bias
    /// in [-100, 100], and two penalties in [-2, 2].
    logit_bias: Option<Value>,
    frequency_penalty: Option<Value>,
    presence_penalty: Option<Value>,
}

impl Request {
    /// The first asked-for feature that the server cannot give, if any: answering without it
    /// would look like an answer to the question asked.
    fn unsupported(&self) -> Option<&'static str> {
        let on = |v: &Option<Value>| match v {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Number(n)) => n.as_f64() != Some(0.0),
            Some(Value::String(s)) => !s.is_empty(),
            Some(_) => true,
        };
        if on(&self.logprobs) {
            Some("logprobs")
        } else if on(&self.top_logprobs) {
            Some("top_logprobs")
        } else if on(&self.echo) {
            Some("echo")
        } else if matches!(&self.best_of, Some(v) if !v.is_null() && v.as_f64() != Some(1.0)) {
            Some("best_of")
        } else if on(&self.suffix) {
            Some("suffix")
        } else if matches!(&self.response_format, Some(v) if !v.is_null()
            && v.get("type").and_then(Value::as_str) != Some("text"))
        {
            Some("response_format (other than {\"type\": \"text\"})")
        } else if matches!(&self.tools, Some(v) if !v.is_null() && v.as_array().map_or(true, |a| !a.is_empty()))
        {
            Some("tools")
        } else if matches!(&self.functions, Some(v) if !v.is_null() && v.as_array().map_or(true, |a| !a.is_empty()))
        {
            Some("functions")
        } else {
            None
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// Renders a chat as the model's ChatML template (the default system message when the chat has
/// none), ending with the assistant's generation prompt.
fn render_chat(state: &AppState, messages: &[Message]) -> Result<String, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad("invalid_messages", "messages is empty"));
    }
    let mut out = String::new();
    if messages[0].role != "system" {
        let system = &state.model.tokenizer().chat.system;
        out.push_str(&format!("<|im_start|>system\n{system}<|im_end|>\n"));
    }
    for m in messages {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
            return Err(ApiError::bad(
                "invalid_messages",
                format!("unknown role {:?} (system, user, assistant)", m.role),
            ));
        }
        let content = match &m.content {
            Value::String(s) => s.clone(),
            // the array form: concatenated text parts
            Value::Array(parts) => {
                let mut s = String::new();
                for p in parts {
                    match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => s.push_str(t),
                        _ => {
                            return Err(ApiError::bad(
                                "invalid_messages",
                                "only text content parts are supported",
                            ))
                        }
                    }
                }
                s
            }
            _ => {
                return Err(ApiError::bad(
                    "invalid_messages",
                    "message content must be a string",
                ))
            }
        };
        out.push_str(&format!("<|im_start|>{}\n{content}<|im_end|>\n", m.role));
    }
    out.push_str("<|im_start|>assistant\n");
    Ok(out)
}

/// A validated request, ready for the queue.
struct Prepared {
    job: Job,
    stream: bool,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
}

/// A penalty (`frequency_penalty` / `presence_penalty`): a number in [-2, 2], 0 when absent.
fn parse_penalty(field: &str, v: &Option<Value>) -> Result<f32, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(0.0),
        Some(x) => match x.as_f64() {
            Some(p) if (-2.0..=2.0).contains(&p) => Ok(p as f32),
            _ => Err(ApiError::bad(
                "invalid_penalty",
                format!("{field} must be a number in [-2, 2], got {x}"),
            )),
        },
    }
}

/// `logit_bias`: an object from token ids (decimal strings) to numbers in [-100, 100], each
/// id below the vocabulary size.
fn parse_logit_bias(v: &Option<Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::bad("invalid_logit_bias", m);
    let map = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(x) => return Err(bad(format!("logit_bias must be an object, got {x}"))),
    };
    let mut out = Vec::with_capacity(map.len());
    for (k, b) in map {
        let t: u32 = k
            .parse()
            .ok()
            .filter(|&t: &u32| (t as usize) < vocab)
            .ok_or_else(|| {
                bad(format!(
                    "logit_bias key {k:?} is not a token id below the vocabulary size {vocab}"
                ))
            })?;
        let b = b
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                bad(format!(
                    "logit_bias value for token {t} must be a number in [-100, 100], got {b}"
                ))
            })?;
        out.push((t, b as f32));
    }
    Ok(out)
}

/// `max_tokens` or `max_completion_tokens` (`field` names which one, for the error).
fn parse_max_tokens(field: &str, v: &Value) -> Result<usize, ApiError> {
    match v.as_i64() {
        Some(n) if n >= 1 => Ok(n as usize),
        Some(n) => Err(ApiError::bad(
            "invalid_max_tokens",
            format!("{field} must be at least 1, got {n}"),
        )),
        None => Err(ApiError::bad(
            "invalid_max_tokens",
            format!("{field} must be an integer, got {v}"),
        )),
    }
}

fn prepare(state: &AppState, body: &[u8], kind: Kind) -> Result<Prepared, ApiError> {
    let req: Request = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("invalid_json", format!("malformed request body: {e}")))?;
    if let Some(m) = &req.model {
        if *m != state.model_name {
            return Err(ApiError::bad(
                "model_not_found",
                format!(
                    "unknown model {m:?}; this server serves {:?}",
                    state.model_name
                ),
            ));
        }
    }
    if let Some(n) = req.n {
        if n != 1 {
            return Err(ApiError::bad("invalid_n", "only n = 1 is supported"));
        }
    }
    if let Some(field) = req.unsupported() {
        return Err(ApiError::bad(
            "unsupported_parameter",
            format!("{field} is not supported by this server; leave it out (or off)"),
        ));
    }
    let text = match kind {
        Kind::Chat => {
            let messages = req
                .messages
                .as_deref()
                .ok_or_else(|| ApiError::bad("missing_messages", "messages is required"))?;
            render_chat(state, messages)?
        }
        Kind::Completion => match &req.prompt {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                a[0].as_str().unwrap_or_default().to_string()
            }
            Some(_) => {
                return Err(ApiError::bad(
                    "invalid_prompt",
                    "prompt must be a string (or a list of one string)",
                ))
            }
            None => return Err(ApiError::bad("missing_prompt", "prompt is required")),
        },
    };
    let prompt = state
        .model
        .encode_raw(&text)
        .map_err(|e| ApiError::bad("invalid_prompt", format!("tokenizer: {e}")))?;
    if prompt.is_empty() {
        return Err(ApiError::bad("invalid_prompt", "prompt is empty"));
    }
    let context = state.model.config().context_length;
    // OpenAI's newer name wins when both are given; each is validated under its own name
    let given = match (&req.max_completion_tokens, &req.max_tokens) {
        (Some(v), _) => Some(("max_completion_tokens", v)),
        (None, Some(v)) => Some(("max_tokens", v)),
        (None, None) => None,
    };
    let max_tokens = match given {
        Some((field, v)) => parse_max_tokens(field, v)?,
        None => DEFAULT_MAX_TOKENS
            .min(context.saturating_sub(prompt.len()))
            .max(1),
    };
    if prompt.len() + max_tokens > context {
        return Err(ApiError::bad(
            "context_length_exceeded",
            format!(
                "prompt ({} tokens) plus max_tokens ({max_tokens}) exceeds the context length {context}",
                prompt.len()
            ),
        ));
    }
    let temperature = req.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad(
            "invalid_temperature",
            format!("temperature must be in [0, 2], got {temperature}"),
        ));
    }
    let top_p = req.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(
            "invalid_top_p",
            format!("top_p must be in (0, 1], got {top_p}"),
        ));
    }
    let logit_bias = parse_logit_bias(&req.logit_bias, state.model.config().vocab)?;
    let frequency_penalty = parse_penalty("frequency_penalty", &req.frequency_penalty)?;
    let presence_penalty = parse_penalty("presence_penalty", &req.presence_penalty)?;
    let stop = match req.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s],
        Some(StopField::Many(v)) => v,
    };
    if stop.len() > MAX_STOPS || stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::bad(
            "invalid_stop",
            format!("stop takes up to {MAX_STOPS} non-empty strings"),
        ));
    }
    let reserve = state.footprint.worst_case(prompt.len(), max_tokens);
    if reserve > state.shared.budget {
        return Err(ApiError::bad(
            "kv_budget_exceeded",
            format!(
                "this request may need {reserve} bytes of KV cache ({} prompt tokens + {max_tokens}), more than the whole budget of {} bytes",
                prompt.len(),
                state.shared.budget
            ),
        ));
    }
    let seed = req
        .seed
        .map(|s| s as u64)
        .unwrap_or_else(|| NEXT_ID.fetch_add(1, Ordering::Relaxed));
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    Ok(Prepared {
        job: Job {
            prompt,
            max_tokens,
            sampling: Sampling {
                temperature,
                top_p,
                seed,
                logit_bias,
                frequency_penalty,
                presence_penalty,
            },
            stop,
            ignore_eos: req.ignore_eos.unwrap_or(false),
            reserve,
            events: tx,
            enqueued: Instant::now(),
        },
        stream: req.stream.unwrap_or(false),
        rx,
    })
}

fn created() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub async fn chat(State(state): State<AppState>, body: Bytes) -> Response {
    completion(state, body, Kind::Chat).await
}

pub async fn completions(State(state): State<AppState>, body: Bytes) -> Response {
    completion(state, body, Kind::Completion).await
}

async fn completion(state: AppState, body: Bytes, kind: Kind) -> Response {
    // Parsing and tokenizing a prompt of up to 2 MiB takes about a second: on a blocking
    // thread, not on the few async workers that answer /health and every other client.
    let prepared = {
        let state = state.clone();
        tokio::task::spawn_blocking(move || prepare(&state, &body, kind)).await
    };
    let p = match prepared {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return e.into_response(),
        Err(e) => {
            return ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: format!("request preparation failed: {e}"),
                code: "internal_error",
            }
            .into_response()
        }
    };
    match state.shared.submit(p.job) {
        Ok(()) => {}
        Err(Refused::QueueFull) => {
            return ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: format!(
                    "the queue is full ({} requests waiting); retry later",
                    state.shared.queue_capacity
                ),
                code: "queue_full",
            }
            .into_response()
        }
        Err(Refused::ShuttingDown) => {
            return ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: "the server is shutting down".into(),
                code: "shutting_down",
            }
            .into_response()
        }
    }
    let id = format!(
        "{}-{}",
        if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        NEXT_ID.fetch_add(1, Ordering::Relaxed)
    );
    let model = state.model_name.clone();
    if p.stream {
        stream_response(p.rx, id, model, kind).into_response()
    } else {
        whole_response(p.rx, id, model, kind).await
    }
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// Waits for the whole answer. If the client goes away, axum drops this future and with it the
/// receiver: the engine sees the closed channel and cancels the sequence.
async fn whole_response(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    id: String,
    model: String,
    kind: Kind,
) -> Response {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text(t) => text.push_str(&t),
            Event::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
            } => {
                let choice = match kind {
                    Kind::Chat => {
                        json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason})
                    }
                    Kind::Completion => {
                        json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason})
                    }
                };
                let object = if kind == Kind::Chat {
                    "chat.completion"
                } else {
                    "text_completion"
                };
                return Json(json!({
                    "id": id, "object": object, "created": created(), "model": model,
                    "choices": [choice], "usage": usage(prompt_tokens, completion_tokens),
                }))
                .into_response();
            }
            Event::Error(m) => {
                return ApiError {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: m,
                    code: "engine_error",
                }
                .into_response()
            }
        }
    }
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: "the engine stopped before the request finished".into(),
        code: "engine_stopped",
    }
    .into_response()
}

/// Server-sent events: one chunk per piece of text, a last chunk with `finish_reason` and
/// `usage`, then `[DONE]`. An engine error is sent as an `{"error": ...}` event before
/// `[DONE]`. Dropping the stream (client gone) drops the receiver, which cancels the sequence.
fn stream_response(
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    id: String,
    model: String,
    kind: Kind,
) -> impl IntoResponse {
    let object = if kind == Kind::Chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let created = created();
    let chunk = move |delta: Option<&str>, finish: Option<&str>, usage_v: Option<Value>| {
        let choice = match kind {
            Kind::Chat => {
                let d = match delta {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                json!({"index": 0, "delta": d, "finish_reason": finish})
            }
            Kind::Completion => {
                json!({"index": 0, "text": delta.unwrap_or(""), "logprobs": null, "finish_reason": finish})
            }
        };
        let mut v = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
        if let Some(u) = usage_v {
            v["usage"] = u;
        }
        v.to_string()
    };
    let first = (kind == Kind::Chat).then(|| {
        let mut v: Value = serde_json::from_str(&chunk(None, None, None)).unwrap_or(Value::Null);
        v["choices"][0]["delta"] = json!({"role": "assistant", "content": ""});
        v.to_string()
    });
    let head = futures_util::stream::iter(first.into_iter().map(|s| SseEvent::default().data(s)));
    let body = UnboundedReceiverStream::new(rx).filter_map(move |ev| {
        let out = match ev {
            Event::Text(t) if t.is_empty() => None,
            Event::Text(t) => Some(vec![chunk(Some(&t), None, None)]),
            Event::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
            } => Some(vec![
                chunk(
                    None,
                    Some(finish_reason),
                    Some(usage(prompt_tokens, completion_tokens)),
                ),
                "[DONE]".to_string(),
            ]),
            Event::Error(m) => Some(vec![
                json!({"error": {"message": m, "type": "server_error", "code": "engine_error"}})
                    .to_string(),
                "[DONE]".to_string(),
            ]),
        };
        std::future::ready(out)
    });
    let events = head
        .chain(body.flat_map(|v| {
            futures_util::stream::iter(v.into_iter().map(|s| SseEvent::default().data(s)))
        }))
        .map(Ok::<_, Infallible>);
    Sse::new(events).keep_alive(KeepAlive::default())
}

pub async fn models(State(state): State<AppState>) -> Response {
    Json(json!({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": 0, "owned_by": "mosaickv",
    }]}))
    .into_response()
}

pub async fn health(State(state): State<AppState>) -> Response {
    Json(json!({"status": "ok", "method": state.method_label})).into_response()
}

pub async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.shared.metrics.render(),
    )
        .into_response()
}

/// A known path with another HTTP method (405, with axum's `Allow` header kept).
pub async fn method_not_allowed() -> Response {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: "this endpoint does not take that HTTP method".into(),
        code: "method_not_allowed",
    }
    .into_response()
}

/// Most bytes of a request body (axum's default limit, kept): a prompt of the model's whole
/// context is tens of kilobytes.
pub const BODY_LIMIT: usize = 2 << 20;
/// A client has this long to send its whole body once its request head is in.
pub const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// A body over [`BODY_LIMIT`] but at most this large is read to its end and dropped before the
/// 413 goes out, so that a client still writing it reads the answer instead of a broken pipe;
/// a larger one is answered at once and its connection closed.
pub const DRAIN_LIMIT: u64 = 64 << 20;

/// Reads the request body before the handler does, bounded in bytes and in time, so that a
/// body too large (413), a broken one (400) or one that never arrives (408) gets the JSON
/// error shape instead of axum's plain-text rejection, and a stalled client holds its
/// connection for at most [`BODY_TIMEOUT`].
pub async fn read_body(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    use http_body_util::BodyExt;
    let (parts, mut body) = req.into_parts();
    let too_large = || {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("the request body is larger than {BODY_LIMIT} bytes"),
            code: "request_too_large",
        }
        .into_response()
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > DRAIN_LIMIT) {
        return too_large();
    }
    let mut kept = Vec::new();
    let mut total = 0u64;
    let read = async {
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                total += data.len() as u64;
                if total <= BODY_LIMIT as u64 {
                    kept.extend_from_slice(&data);
                } else if total > DRAIN_LIMIT {
                    break;
                }
            }
        }
        Ok::<(), axum::Error>(())
    };
    match tokio::time::timeout(BODY_TIMEOUT, read).await {
        Ok(Ok(())) if total > BODY_LIMIT as u64 => too_large(),
        Ok(Ok(())) => {
            next.run(axum::extract::Request::from_parts(parts, kept.into()))
                .await
        }
        Ok(Err(e)) => ApiError::bad(
            "invalid_body",
            format!("the request body could not be read: {e}"),
        )
        .into_response(),
        Err(_) => ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            message: format!(
                "the request body did not arrive within {} s",
                BODY_TIMEOUT.as_secs()
            ),
            code: "request_timeout",
        }
        .into_response(),
    }
}

pub async fn not_found() -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "no such endpoint".into(),
        code: "not_found",
    }
    .into_response()
}
