//! `mosaickv serve` in-process on 127.0.0.1 (port 0) with the real model (fetched with
//! `model_path(None)`, pip on first use): concurrent streaming clients, batched == single
//! answers, the 400 and 429 paths, cancellation freeing memory, budget accounting.
//!
//! Every wait is bounded: polls run at most `POLLS` times `POLL` apart, and every request has a
//! client timeout.

use mosaickv_engine::{model_path, Method, Model};
use mosaickv_server::budget::Footprint;
use mosaickv_server::{ServeConfig, Server};
use serde_json::{json, Value};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

const NAME: &str = "smollm2";
const POLL: Duration = Duration::from_millis(100);
const POLLS: usize = 600;
const TIMEOUT: Duration = Duration::from_secs(300);
/// Most retries of a request refused with 429 in the soak test, `RETRY_PAUSE` apart (each retry
/// is tokenized again by the server, so a short pause only burns CPU).
const RETRIES: usize = 600;
const RETRY_PAUSE: Duration = Duration::from_millis(500);

fn model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| {
        Arc::new(
            Model::load(&model_path(None).expect("model (needs python3 -m pip)"))
                .expect("load model"),
        )
    })
    .clone()
}

async fn start(method: &str, kv_budget: usize, max_batch: usize, queue: usize) -> Server {
    let cfg = ServeConfig {
        model_name: NAME.into(),
        method: Method::parse(method).unwrap(),
        kv_budget,
        max_batch,
        queue_capacity: queue,
    };
    Server::start(model(), cfg, "127.0.0.1", 0).await.unwrap()
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(TIMEOUT).build().unwrap()
}

fn url(s: &Server, path: &str) -> String {
    format!("http://{}{path}", s.addr())
}

async fn post(s: &Server, path: &str, body: &str) -> (u16, Value) {
    let r = client()
        .post(url(s, path))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Posts `body` to `/v1/completions` on a task of its own; the task gives the status and the
/// JSON answer.
fn spawn_completion(s: &Server, body: String) -> tokio::task::JoinHandle<(u16, Value)> {
    let u = url(s, "/v1/completions");
    tokio::spawn(async move {
        let r = client()
            .post(u)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    })
}

/// Reads an SSE stream to its end; returns the data payloads before `[DONE]` and whether
/// `[DONE]` came.
async fn read_sse(r: reqwest::Response) -> (Vec<Value>, bool) {
    use futures_util::StreamExt;
    let mut buf = String::new();
    let mut out = Vec::new();
    let mut stream = r.bytes_stream();
    while let Some(chunk) = stream.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        while let Some(i) = buf.find("\n\n") {
            let ev: String = buf.drain(..i + 2).collect();
            for line in ev.lines() {
                if let Some(d) = line.strip_prefix("data: ") {
                    if d == "[DONE]" {
                        return (out, true);
                    }
                    out.push(serde_json::from_str(d).unwrap());
                }
            }
        }
    }
    (out, false)
}

fn chat_body(prompt: &str, max_tokens: usize, stream: bool) -> String {
    json!({"model": NAME, "messages": [{"role": "user", "content": prompt}],
           "max_tokens": max_tokens, "temperature": 0, "stream": stream})
    .to_string()
}

fn completion_body(prompt: &str, max_tokens: usize, stream: bool) -> String {
    json!({"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream})
        .to_string()
}

/// Polls until `f` holds (bounded), panicking with `what` otherwise.
async fn wait_for(s: &Server, what: &str, f: impl Fn(&mosaickv_server::Stats) -> bool) {
    for _ in 0..POLLS {
        if f(&s.stats()) {
            return;
        }
        tokio::time::sleep(POLL).await;
    }
    panic!("timed out waiting for {what}: {:?}", s.stats());
}

const PROMPTS: [&str; 4] = [
    "What is the capital of France?",
    "Count from one to five.",
    "Write a haiku about the sea.",
    "Name three colors.",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_streams_equal_single_answers() {
    for method in ["full", "kvq4", "mosaic"] {
        let s = start(method, 1 << 34, 4, 16).await;
        // one at a time: each decoded alone
        let mut single = Vec::new();
        for p in PROMPTS {
            let (st, v) = post(&s, "/v1/chat/completions", &chat_body(p, 20, false)).await;
            assert_eq!(st, 200, "{v}");
            assert_eq!(v["object"], "chat.completion");
            let u = &v["usage"];
            assert_eq!(
                u["total_tokens"].as_u64().unwrap(),
                u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
            );
            single.push(
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            );
        }
        // all at once, streamed: decoded in one batch
        let handles: Vec<_> = PROMPTS
            .iter()
            .map(|p| {
                let (u, body) = (url(&s, "/v1/chat/completions"), chat_body(p, 20, true));
                tokio::spawn(async move {
                    let r = client()
                        .post(u)
                        .header("content-type", "application/json")
                        .body(body)
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status().as_u16(), 200);
                    read_sse(r).await
                })
            })
            .collect();
        let mut peak_seen = 0;
        for (i, h) in handles.into_iter().enumerate() {
            let (events, done) = h.await.unwrap();
            assert!(done, "{method}: stream {i} ended without [DONE]");
            assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
            let text: String = events
                .iter()
                .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
                .collect();
            assert_eq!(text, single[i], "{method}: prompt {i} batched vs alone");
            let last = events.last().unwrap();
            assert!(last["choices"][0]["finish_reason"].is_string());
            assert!(last["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
            peak_seen = peak_seen.max(s.stats().running_peak);
        }
        assert!(peak_seen >= 2, "{method}: the streams never ran together");
        wait_for(&s, "all memory released", |st| {
            st.running == 0 && st.kv_used == 0
        })
        .await;
        assert_eq!(s.stats().reservation_overruns, 0, "{method}");
        s.shutdown();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_requests_get_400_and_the_server_stays_up() {
    let s = start("full", 1 << 34, 2, 4).await;
    let ctx = model().config().context_length;
    let long_prompt = "hello ".repeat(ctx + 100);
    let cases = [
        ("/v1/chat/completions", "{not json".to_string(), "invalid_json"),
        ("/v1/chat/completions", json!({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}).to_string(), "model_not_found"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}).to_string(), "invalid_max_tokens"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1_000_000_000_000i64}).to_string(), "context_length_exceeded"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}).to_string(), "invalid_max_tokens"),
        ("/v1/chat/completions", json!({"messages": []}).to_string(), "invalid_messages"),
        ("/v1/chat/completions", json!({"prompt": "hi"}).to_string(), "missing_messages"),
        ("/v1/completions", json!({"prompt": long_prompt, "max_tokens": 1}).to_string(), "context_length_exceeded"),
        ("/v1/completions", json!({"prompt": 5}).to_string(), "invalid_prompt"),
        ("/v1/completions", json!({"prompt": "hi", "temperature": -1}).to_string(), "invalid_temperature"),
        ("/v1/completions", json!({"prompt": "hi", "ignore_eos": "yes"}).to_string(), "invalid_json"),
        ("/v1/completions", json!({"prompt": "hi", "logprobs": 2}).to_string(), "unsupported_parameter"),
        ("/v1/completions", json!({"prompt": "hi", "echo": true}).to_string(), "unsupported_parameter"),
        ("/v1/completions", json!({"prompt": "hi", "best_of": 3}).to_string(), "unsupported_parameter"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 2}).to_string(), "unsupported_parameter"),
    ];
    for (path, body, code) in &cases {
        let (st, v) = post(&s, path, body).await;
        assert_eq!(st, 400, "{body}: {v}");
        assert_eq!(v["error"]["code"], *code, "{body}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().len() > 3);
    }
    // still serving: models, health, metrics, and a completion with a stop string
    let m: Value = client()
        .get(url(&s, "/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(m["data"][0]["id"], NAME);
    let h = client().get(url(&s, "/health")).send().await.unwrap();
    assert_eq!(h.status().as_u16(), 200);
    let (st, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "1, 2, 3, 4,", "max_tokens": 30, "temperature": 0, "stop": [" 7"]})
            .to_string(),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(!text.contains(" 7"), "stop string in the text: {text:?}");
    // ignore_eos: a chat that ends early runs on to max_tokens, its text extending the answer
    let ask = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                           "max_tokens": 48, "temperature": 0});
        if let Value::Object(m) = extra {
            b.as_object_mut().unwrap().extend(m);
        }
        b.to_string()
    };
    let (st, short) = post(&s, "/v1/chat/completions", &ask(json!({}))).await;
    assert_eq!(st, 200, "{short}");
    assert_eq!(short["choices"][0]["finish_reason"], "stop", "{short}");
    let n_short = short["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(n_short < 48, "{short}");
    let (st, long) = post(
        &s,
        "/v1/chat/completions",
        &ask(json!({"ignore_eos": true})),
    )
    .await;
    assert_eq!(st, 200, "{long}");
    assert_eq!(long["choices"][0]["finish_reason"], "length", "{long}");
    assert_eq!(long["usage"]["completion_tokens"], 48, "{long}");
    let (a, b) = (
        short["choices"][0]["message"]["content"].as_str().unwrap(),
        long["choices"][0]["message"]["content"].as_str().unwrap(),
    );
    assert!(b.starts_with(a) && b.len() > a.len(), "{a:?} vs {b:?}");
    assert!(!b.contains("<|im_end|>"), "EOS text in {b:?}");
    // seeded sampling is reproducible
    let body =
        json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 11})
            .to_string();
    let (a, b) = (
        post(&s, "/v1/completions", &body).await,
        post(&s, "/v1/completions", &body).await,
    );
    assert_eq!(a.0, 200);
    assert_eq!(a.1["choices"][0]["text"], b.1["choices"][0]["text"]);
    let metrics = client()
        .get(url(&s, "/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "mosaickv_running_sequences",
        "mosaickv_queued_sequences",
        "mosaickv_kv_bytes_used",
        "mosaickv_kv_bytes_budget",
        "mosaickv_generated_tokens_per_second",
        "mosaickv_time_to_first_token_seconds_bucket",
        "mosaickv_time_between_tokens_seconds_bucket",
        "mosaickv_decode_seconds_total",
        "mosaickv_prefill_seconds_total",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
    // the engine's time split: the 48-token answer alone needed 47 decode steps after its
    // prefill's first token, and every request a prefill
    let st = s.stats();
    assert!(st.decode_tokens >= 47 && st.decode_steps >= 47, "{st:?}");
    assert!(st.decode_tokens <= st.decode_steps * 2, "{st:?}"); // max batch 2
    assert!(st.decode_s > 0.0 && st.prefill_s > 0.0, "{st:?}");
    s.shutdown();
}

/// The HTTP edges answer in the API's JSON error shape too: a body over the limit is 413
/// (declared or chunked), another HTTP method on a known path 405 (with `Allow`), a bad
/// `max_completion_tokens` is named as such; a temperature so small that its reciprocal is
/// infinite samples the greedy answer (it gave NaN weights and the last vocabulary token);
/// a stop string of U+FFFD does not match a character still being generated; and a client
/// that opens a connection and sends nothing does not keep the others waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_edges_get_json_errors_and_tiny_temperatures_are_greedy() {
    let s = start("full", 1 << 34, 2, 4).await;
    // an idle connection, held through the whole test
    let _idle = tokio::net::TcpStream::connect(s.addr()).await.unwrap();
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(3 << 20));
    let (st, v) = post(&s, "/v1/completions", &big).await;
    assert_eq!(st, 413, "{v}");
    assert_eq!(v["error"]["code"], "request_too_large", "{v}");
    // the same body chunked (no Content-Length): stopped at the limit
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = big
        .into_bytes()
        .chunks(1 << 16)
        .map(|c| Ok(c.to_vec()))
        .collect();
    let r = client()
        .post(url(&s, "/v1/completions"))
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
            chunks,
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 413);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "request_too_large", "{v}");
    for (method, path) in [
        (reqwest::Method::GET, "/v1/chat/completions"),
        (reqwest::Method::DELETE, "/v1/completions"),
        (reqwest::Method::POST, "/health"),
    ] {
        let r = client()
            .request(method.clone(), url(&s, path))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 405, "{method} {path}");
        assert!(r.headers().contains_key("allow"), "{method} {path}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "method_not_allowed", "{v}");
    }
    let (st, v) = post(
        &s,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "max_completion_tokens": 0})
        .to_string(),
    )
    .await;
    assert_eq!(st, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("max_completion_tokens"),
        "{v}"
    );
    let ask = |t: f64| {
        json!({"prompt": "The capital of France is", "max_tokens": 6, "temperature": t, "seed": 3})
            .to_string()
    };
    let (st, greedy) = post(&s, "/v1/completions", &ask(0.0)).await;
    assert_eq!(st, 200, "{greedy}");
    // the "off" forms of the unsupported features, as clients send them by default
    let (st, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
                "logprobs": null, "echo": false, "best_of": 1, "suffix": null, "top_logprobs": 0})
        .to_string(),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], greedy["choices"][0]["text"]);
    let (st, tiny) = post(&s, "/v1/completions", &ask(1e-310)).await;
    assert_eq!(st, 200, "{tiny}");
    assert_eq!(tiny["choices"][0]["text"], greedy["choices"][0]["text"]);
    // U+FFFD as a stop string: the emoji comes out whole (or the request stops on a real
    // U+FFFD, never on the half of a character)
    let (st, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "Emoji party: 🎉🎉🎉🎉", "max_tokens": 8, "temperature": 0,
                "stop": ["\u{FFFD}"]})
        .to_string(),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let (_, plain) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "Emoji party: 🎉🎉🎉🎉", "max_tokens": 8, "temperature": 0}).to_string(),
    )
    .await;
    let whole = plain["choices"][0]["text"].as_str().unwrap();
    let cut = whole.find('\u{FFFD}').unwrap_or(whole.len());
    assert_eq!(
        v["choices"][0]["text"].as_str().unwrap(),
        &whole[..cut],
        "{v} / {plain}"
    );
    s.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn budget_queue_429_and_cancellation() {
    let m = model();
    // a counting prompt: greedy decoding goes on without an end-of-sequence token
    let prompt = "1, 2, 3, 4, 5, 6,";
    let n_prompt = m.encode_raw(prompt).unwrap().len();
    let foot = Footprint::of(&Method::Full, m.config()).unwrap();
    let one = foot.worst_case(n_prompt, 400);
    // room for one such request, not two
    let budget = one + one / 2;
    let s = start("full", budget, 4, 1).await;
    // larger than the whole budget: 400 at once
    let (st, v) = post(&s, "/v1/completions", &completion_body(prompt, 2000, false)).await;
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["code"], "kv_budget_exceeded");
    // A runs (streamed), B waits in the queue (capacity 1), C is refused with 429
    let a = client()
        .post(url(&s, "/v1/completions"))
        .header("content-type", "application/json")
        .body(completion_body(prompt, 400, true))
        .send()
        .await
        .unwrap();
    assert_eq!(a.status().as_u16(), 200);
    wait_for(&s, "A running", |st| st.running == 1 && st.kv_used > 0).await;
    let used_a = s.stats().kv_used;
    assert!(s.stats().kv_reserved <= budget);
    let b = spawn_completion(&s, completion_body(prompt, 400, false));
    wait_for(&s, "B queued", |st| st.queued == 1).await;
    let (st, v) = post(&s, "/v1/completions", &completion_body(prompt, 400, false)).await;
    assert_eq!(st, 429, "{v}");
    assert_eq!(v["error"]["code"], "queue_full");
    // budget accounting while A runs: used is A's caches, within its reservation
    let now = s.stats();
    assert!(
        now.kv_used >= used_a && now.kv_used <= now.kv_reserved,
        "{now:?}"
    );
    assert_eq!(now.running, 1, "B must wait for A's memory");
    // cancel A mid-stream: its memory is freed and B is admitted and completes
    drop(a);
    let (st, v) = b.await.unwrap();
    assert_eq!(st, 200, "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
    wait_for(&s, "memory back to zero", |st| {
        st.running == 0 && st.queued == 0 && st.kv_used == 0 && st.kv_reserved == 0
    })
    .await;
    assert_eq!(s.stats().running_peak, 1);
    assert_eq!(s.stats().reservation_overruns, 0);
    let metrics = client()
        .get(url(&s, "/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("mosaickv_requests_total{outcome=\"cancelled\"} 1"),
        "{metrics}"
    );
    s.shutdown();
}

/// A running MosaicKV sequence's reservation drops, once its prompt is compressed, from the
/// admission worst case to the bound its caches give at their fitted strategies
/// (`LayerKv::bytes_bound`): under a budget one byte short of two worst cases, two requests run
/// at once, with no step above its reservation. (Pricing the rest of a sequence at the policy's
/// largest record, as `Footprint::still_needed` does, admits only one here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mosaic_reservation_drops_to_the_fitted_bound() {
    let m = model();
    let prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,";
    let n_prompt = m.encode_raw(prompt).unwrap().len();
    let max_tokens = 200;
    let method = Method::parse("mosaic").unwrap();
    let foot = Footprint::of(&method, m.config()).unwrap();
    let one = foot.worst_case(n_prompt, max_tokens);
    let budget = 2 * one - 1;
    let s = start("mosaic", budget, 4, 4).await;
    let body = json!({"model": NAME, "prompt": prompt, "max_tokens": max_tokens,
                      "temperature": 0, "ignore_eos": true})
    .to_string();
    let tasks: Vec<_> = (0..2).map(|_| spawn_completion(&s, body.clone())).collect();
    for t in tasks {
        let (st, v) = t.await.unwrap();
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], max_tokens, "{v}");
    }
    let st = s.stats();
    assert_eq!(st.running_peak, 2, "{st:?}");
    assert!(st.kv_peak <= budget, "{st:?}");
    assert_eq!(st.reservation_overruns, 0, "{st:?}");
    wait_for(&s, "memory back to zero", |st| {
        st.kv_used == 0 && st.kv_reserved == 0
    })
    .await;
    s.shutdown();
}

/// A prompt longer than two prefill chunks runs through the chunked path (forward pass 256
/// tokens per turn, then its layers handed to the caches a few per turn, where `mosaic`
/// compresses them) while another sequence decodes between those turns: its answer equals the
/// same request's answer alone, and so does the other sequence's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_prompt_prefills_in_turns_beside_a_running_sequence() {
    let m = model();
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(60);
    let n = m.encode_raw(&long).unwrap().len();
    assert!(n > 2 * mosaickv_server::engine::PREFILL_CHUNK, "{n} tokens");
    let s = start("mosaic", 1 << 30, 4, 4).await;
    let body = |prompt: &str, max_tokens: usize| {
        json!({"model": NAME, "prompt": prompt, "max_tokens": max_tokens,
               "temperature": 0, "ignore_eos": true})
        .to_string()
    };
    let text = |v: &Value| v["choices"][0]["text"].as_str().unwrap().to_string();
    let (st, alone_long) = post(&s, "/v1/completions", &body(&long, 12)).await;
    assert_eq!(st, 200, "{alone_long}");
    let short = "1, 2, 3, 4, 5, 6,";
    let (st, alone_short) = post(&s, "/v1/completions", &body(short, 96)).await;
    assert_eq!(st, 200, "{alone_short}");
    // the short one starts first and decodes while the long one prefills
    let t_short = spawn_completion(&s, body(short, 96));
    wait_for(&s, "the short one running", |st| st.running == 1).await;
    let t_long = spawn_completion(&s, body(&long, 12));
    let (st1, v_short) = t_short.await.unwrap();
    let (st2, v_long) = t_long.await.unwrap();
    assert_eq!((st1, st2), (200, 200), "{v_short} {v_long}");
    assert_eq!(text(&v_long), text(&alone_long));
    assert_eq!(text(&v_short), text(&alone_short));
    assert_eq!(s.stats().running_peak, 2, "{:?}", s.stats());
    assert_eq!(s.stats().reservation_overruns, 0);
    s.shutdown();
}

/// Soak: `requests` requests of random lengths (prompts of 1..`max_words` repeats of two words,
/// 1..16 new tokens) from `n_clients` concurrent clients, a quarter of them streamed and dropped
/// after their first chunk, under a budget that makes requests wait and a queue small enough to
/// refuse some (429 with its reason; the client retries after a pause, at most `RETRIES`
/// times). Every request ends answered (200) or cancelled by its client; the KV bytes return to
/// zero and no sequence ever held more than its reservation.
async fn soak(requests: usize, n_clients: u64, max_words: usize) {
    use rand::{Rng, SeedableRng};
    let m = model();
    let foot = Footprint::of(&Method::parse("mosaic").unwrap(), m.config()).unwrap();
    // about four mid-sized requests at once
    let budget = 4 * foot.worst_case(150, 16);
    let s = Arc::new(start("mosaic", budget, 8, 6).await);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut clients = Vec::new();
    for c in 0..n_clients {
        let (s, next) = (s.clone(), next.clone());
        clients.push(tokio::spawn(async move {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(c);
            let mut outcomes = Vec::new();
            let mut refused = 0usize;
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= requests {
                    return (outcomes, refused);
                }
                let words = rng.gen_range(1..max_words);
                let prompt = "lorem ipsum ".repeat(words);
                let max_tokens = rng.gen_range(1..16);
                let cancel = i % 4 == 0;
                let body = json!({"prompt": prompt, "max_tokens": max_tokens,
                    "temperature": if i % 3 == 0 { 0.8 } else { 0.0 }, "seed": i, "stream": cancel})
                .to_string();
                // a refused request (429, with its reason) is retried after a pause, as a
                // client would; bounded
                let mut r = None;
                for _ in 0..RETRIES {
                    let resp = client()
                        .post(url(&s, "/v1/completions"))
                        .header("content-type", "application/json")
                        .body(body.clone())
                        .send()
                        .await
                        .unwrap();
                    if resp.status().as_u16() == 429 {
                        let v: Value = resp.json().await.unwrap();
                        assert_eq!(v["error"]["code"], "queue_full", "{v}");
                        refused += 1;
                        tokio::time::sleep(RETRY_PAUSE).await;
                        continue;
                    }
                    r = Some(resp);
                    break;
                }
                let r = r.expect("still refused after every retry");
                let status = r.status().as_u16();
                if status != 200 {
                    let v: Value = r.json().await.unwrap();
                    panic!("{status}: {v}");
                }
                if cancel {
                    // read until the first chunk (or the end), then hang up
                    use futures_util::StreamExt;
                    let mut stream = r.bytes_stream();
                    let _ = stream.next().await;
                    drop(stream);
                    outcomes.push(499);
                } else {
                    let v: Value = r.json().await.unwrap();
                    let n = v["usage"]["completion_tokens"].as_u64().unwrap();
                    assert!(n >= 1 && n <= max_tokens as u64, "{v}");
                    outcomes.push(200);
                }
            }
        }));
    }
    let (mut all, mut refused) = (Vec::new(), 0);
    for c in clients {
        let (o, r) = c.await.unwrap();
        all.extend(o);
        refused += r;
    }
    assert_eq!(all.len(), requests);
    assert!(all.iter().all(|st| matches!(st, 200 | 499)), "{all:?}");
    assert_eq!(
        all.iter().filter(|&&st| st == 499).count(),
        requests.div_ceil(4)
    );
    wait_for(&s, "memory back to zero", |st| {
        st.running == 0 && st.queued == 0 && st.kv_used == 0 && st.kv_reserved == 0
    })
    .await;
    let st = s.stats();
    assert_eq!(st.reservation_overruns, 0, "{st:?}");
    assert!(st.kv_peak <= budget, "{st:?}");
    eprintln!(
        "soak: {} answered, {} cancelled, {refused} refusals (429) retried; peak {} running, peak KV {} of {} bytes",
        all.iter().filter(|&&x| x == 200).count(),
        all.iter().filter(|&&x| x == 499).count(),
        st.running_peak,
        st.kv_peak,
        budget
    );
    // the clients are done, so this is the last handle; dropping it stops the server
    drop(s);
}

/// The soak in the default test run: 30 requests from 6 clients, prompts up to 60 repeats.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_30_requests_with_cancellations() {
    soak(30, 6, 60).await;
}

/// The long soak (200 requests from 16 clients, prompts up to 120 repeats; 1,104 s on the
/// loaded 2-core machine): `cargo test --release -p mosaickv-server --test serve --
/// --ignored soak_200`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "long soak (minutes); run with --ignored"]
async fn soak_200_requests_with_cancellations() {
    soak(200, 16, 120).await;
}

/// Issue 40: nothing asked for is silently ignored, and a half-closed client gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn half_closed_clients_are_answered_and_sampling_parameters_are_honoured() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = start("full", 1 << 34, 2, 4).await;
    // POST, then shut down the writing half (what `nc -N` does): the answer still comes.
    let raw = |req: String| {
        let addr = s.addr();
        async move {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            c.write_all(req.as_bytes()).await.unwrap();
            c.shutdown().await.unwrap();
            let mut out = Vec::new();
            tokio::time::timeout(TIMEOUT, c.read_to_end(&mut out))
                .await
                .expect("answered in time")
                .unwrap();
            String::from_utf8_lossy(&out).into_owned()
        }
    };
    let body = json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        .to_string();
    let answer = raw(format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    ))
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    assert!(answer.contains("\"text_completion\""), "{answer:?}");
    // hyper's own protocol errors carry the JSON error body too
    for (req, status, code) in [
        (
            // more header fields than hyper parses (100)
            format!(
                "GET /health HTTP/1.1\r\nhost: x\r\n{}\r\n",
                (0..120)
                    .map(|i| format!("x-h{i}: v\r\n"))
                    .collect::<String>()
            ),
            "431",
            "request_header_fields_too_large",
        ),
        (
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: ten\r\n\r\n{}".to_string(),
            "400",
            "bad_request",
        ),
    ] {
        let a = raw(req).await;
        assert!(a.starts_with(&format!("HTTP/1.1 {status}")), "{a:?}");
        let body = a.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
        let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
        assert_eq!(v["error"]["code"], code, "{a:?}");
    }
    let health = raw("GET /health HTTP/1.1\r\nhost: x\r\n\r\n".into()).await;
    assert!(
        health.starts_with("HTTP/1.1 200") && health.contains("\"ok\""),
        "{health:?}"
    );

    // Refused, not ignored: structured output and tools.
    for (extra, what) in [
        (
            json!({"response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools",
        ),
        (json!({"functions": [{"name": "f"}]}), "functions"),
        (json!({"logit_bias": {"999999999": 5}}), "logit_bias"),
        (json!({"logit_bias": {"12": 101}}), "logit_bias"),
        (json!({"logit_bias": [1, 2]}), "logit_bias"),
        (json!({"frequency_penalty": 2.5}), "frequency_penalty"),
        (json!({"presence_penalty": "a"}), "presence_penalty"),
    ] {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let (st, v) = post(&s, "/v1/chat/completions", &b.to_string()).await;
        assert_eq!(st, 400, "{b}: {v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(what),
            "{b}: {v}"
        );
    }
    // Their "off" forms are accepted and change nothing.
    let ask = |extra: Value| {
        let mut b =
            json!({"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b.to_string()
    };
    let (st, greedy) = post(&s, "/v1/completions", &ask(json!({}))).await;
    assert_eq!(st, 200, "{greedy}");
    let (st, off) = post(
        &s,
        "/v1/completions",
        &ask(
            json!({"response_format": {"type": "text"}, "tools": [], "logit_bias": {},
                    "frequency_penalty": 0, "presence_penalty": null}),
        ),
    )
    .await;
    assert_eq!(st, 200, "{off}");
    assert_eq!(off["choices"][0]["text"], greedy["choices"][0]["text"]);
    // Banning the greedy answer's first token changes the answer (it was ignored before).
    let first = model()
        .encode_raw(greedy["choices"][0]["text"].as_str().unwrap())
        .unwrap()[0];
    let (st, banned) = post(
        &s,
        "/v1/completions",
        &ask(json!({"logit_bias": {first.to_string(): -100}})),
    )
    .await;
    assert_eq!(st, 200, "{banned}");
    let t = banned["choices"][0]["text"].as_str().unwrap();
    assert_ne!(t, greedy["choices"][0]["text"].as_str().unwrap());
    // A strong frequency penalty stops a repetition the greedy text makes.
    let (_, rep) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "a a a a a a a a a a a a", "max_tokens": 8, "temperature": 0})
            .to_string(),
    )
    .await;
    let (_, pen) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "a a a a a a a a a a a a", "max_tokens": 8, "temperature": 0,
                "frequency_penalty": 2, "presence_penalty": 2})
        .to_string(),
    )
    .await;
    assert_ne!(
        rep["choices"][0]["text"], pen["choices"][0]["text"],
        "{rep} / {pen}"
    );
    s.shutdown();

    // A budget the gauges cannot hold is refused at start.
    let cfg = ServeConfig {
        model_name: NAME.into(),
        method: Method::parse("full").unwrap(),
        kv_budget: 1 << 63,
        max_batch: 1,
        queue_capacity: 1,
    };
    let e = Server::start(model(), cfg, "127.0.0.1", 0)
        .await
        .err()
        .expect("refused");
    assert!(e.to_string().contains("kv-budget"), "{e}");
}
