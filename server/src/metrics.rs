//! `GET /metrics`: Prometheus text format (the `prometheus` crate).

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};
use std::sync::Mutex;
use std::time::Instant;

/// Latency buckets in seconds, 1 ms to 2 min.
const BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

pub struct Metrics {
    registry: Registry,
    pub running: IntGauge,
    pub queued: IntGauge,
    pub kv_used: IntGauge,
    pub kv_reserved: IntGauge,
    pub kv_budget: IntGauge,
    pub tokens: IntCounter,
    pub requests: IntCounterVec,
    pub ttft: Histogram,
    pub tbt: Histogram,
    pub tokens_per_second: prometheus::Gauge,
    /// Engine seconds in batched decode steps and in prompt prefill turns.
    pub decode_seconds: prometheus::Counter,
    pub prefill_seconds: prometheus::Counter,
    /// (window start, tokens at its start) for the tokens-per-second gauge.
    window: Mutex<(Instant, u64)>,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("metric name");
            registry.register(Box::new(g.clone())).expect("register");
            g
        };
        let hist = |name: &str, help: &str| {
            let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(BUCKETS.to_vec()))
                .expect("metric name");
            registry.register(Box::new(h.clone())).expect("register");
            h
        };
        let running = gauge("mosaickv_running_sequences", "Sequences being decoded");
        let queued = gauge("mosaickv_queued_sequences", "Accepted requests waiting");
        let kv_used = gauge(
            "mosaickv_kv_bytes_used",
            "Bytes of every running sequence's KV caches, device (memory(), SPEC.md section 13) and host rows, and of the caches a prompt is filling",
        );
        let kv_reserved = gauge(
            "mosaickv_kv_bytes_reserved",
            "Bytes reserved by running sequences (their worst case still to come)",
        );
        let kv_budget = gauge("mosaickv_kv_bytes_budget", "The --kv-budget in bytes");
        let tokens =
            IntCounter::new("mosaickv_generated_tokens_total", "Tokens generated").expect("name");
        registry
            .register(Box::new(tokens.clone()))
            .expect("register");
        let requests = IntCounterVec::new(
            Opts::new("mosaickv_requests_total", "Finished requests by outcome"),
            &["outcome"],
        )
        .expect("name");
        registry
            .register(Box::new(requests.clone()))
            .expect("register");
        let ttft = hist(
            "mosaickv_time_to_first_token_seconds",
            "From queueing to the first generated token",
        );
        let tbt = hist(
            "mosaickv_time_between_tokens_seconds",
            "Between consecutive tokens of one sequence",
        );
        let tokens_per_second = prometheus::Gauge::new(
            "mosaickv_generated_tokens_per_second",
            "Generated tokens per second over the last window of at least 1 s",
        )
        .expect("name");
        registry
            .register(Box::new(tokens_per_second.clone()))
            .expect("register");
        let counter = |name: &str, help: &str| {
            let c = prometheus::Counter::new(name, help).expect("metric name");
            registry.register(Box::new(c.clone())).expect("register");
            c
        };
        let decode_seconds = counter(
            "mosaickv_decode_seconds_total",
            "Engine time in batched decode steps (step, sampling, streaming)",
        );
        let prefill_seconds = counter(
            "mosaickv_prefill_seconds_total",
            "Engine time prefilling prompts (forward chunks, caches taking the prompt)",
        );
        Self {
            registry,
            running,
            queued,
            kv_used,
            kv_reserved,
            kv_budget,
            tokens,
            requests,
            ttft,
            tbt,
            tokens_per_second,
            decode_seconds,
            prefill_seconds,
            window: Mutex::new((Instant::now(), 0)),
        }
    }

    pub fn finished(&self, outcome: &str) {
        self.requests.with_label_values(&[outcome]).inc();
    }

    /// After each decode step: refreshes the tokens-per-second gauge once a second has passed.
    pub fn step(&self) {
        let mut w = self.window.lock().unwrap_or_else(|e| e.into_inner());
        let dt = w.0.elapsed().as_secs_f64();
        if dt >= 1.0 {
            let now = self.tokens.get();
            self.tokens_per_second.set((now - w.1) as f64 / dt);
            *w = (Instant::now(), now);
        }
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let enc = TextEncoder::new();
        // encoding our own registered metrics into a Vec cannot fail
        let _ = enc.encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
