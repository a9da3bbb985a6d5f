//! The engine loop: one thread that owns every running sequence and its caches.
//!
//! The HTTP side validates a request, prices it ([`crate::budget::Footprint::worst_case`]) and
//! pushes a [`Job`] on the bounded queue ([`Shared::submit`]: a full queue is refused at once).
//! Each turn of the loop:
//! 1. drops sequences (and queued jobs) whose client has gone: their caches are freed and their
//!    reservation released;
//! 2. admits the next queued job, in arrival order, when no other prompt is prefilling, the
//!    batch has room and its reservation fits under the budget with everything already
//!    reserved; its prompt is prefilled [`PREFILL_CHUNK`] tokens per turn, between decode steps,
//!    then handed to its caches a few layers per turn ([`FILL_SLICE`]);
//! 3. runs one batched decode step ([`mosaickv_engine::Model::decode_batch`]) for every running
//!    sequence, samples each one's next token and streams its text;
//! 4. measures each sequence's cache bytes and lowers its reservation to what it may still need.
//!
//! Every accepted job ends with exactly one `Done` or `Error` event (or its client is gone).

use crate::budget::Footprint;
use crate::metrics::Metrics;
use mosaickv_engine::{BatchSeq, Caches, ChunkedPrefill, LayerKv, Method, Model};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// Prompt tokens prefilled per engine turn (between two decode steps).
pub const PREFILL_CHUNK: usize = 256;

/// Once a chunked prompt's forward pass is done, its layers are handed to their caches (where a
/// MosaicKV layer compresses its prompt segments, SPEC.md section 10.1) in engine turns of at
/// least one layer, ending the turn when this much time has passed, so that the running
/// sequences get a decode step between them instead of waiting for every layer.
pub const FILL_SLICE: Duration = Duration::from_millis(50);

/// How a request samples.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// 0: greedy (argmax).
    pub temperature: f64,
    /// Nucleus: keep the smallest set of tokens whose probability reaches `top_p` (1: all).
    pub top_p: f64,
    pub seed: u64,
    /// OpenAI's `logit_bias`: `(token, bias)` pairs added to those tokens' logits before
    /// anything else (greedy decoding included); bias in [-100, 100].
    pub logit_bias: Vec<(u32, f32)>,
    /// OpenAI's `frequency_penalty` in [-2, 2]: subtracted from a token's logit once per time
    /// it was generated so far.
    pub frequency_penalty: f32,
    /// OpenAI's `presence_penalty` in [-2, 2]: subtracted from a token's logit once if it was
    /// generated so far.
    pub presence_penalty: f32,
}

impl Sampling {
    /// Plain sampling at `temperature` and `top_p`: no bias, no penalties.
    pub fn plain(temperature: f64, top_p: f64, seed: u64) -> Sampling {
        Sampling {
            temperature,
            top_p,
            seed,
            logit_bias: Vec::new(),
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
        }
    }

    /// The logits the draw sees: `logits` with the bias added and the penalties taken off,
    /// as OpenAI defines them (`mu[j] - c[j] * frequency_penalty - (c[j] > 0) *
    /// presence_penalty + logit_bias[j]`, `c[j]` the times token j was generated so far).
    /// Borrowed unchanged when the request asks for none of them.
    pub fn adjusted<'a>(&self, logits: &'a [f32], generated: &[u32]) -> Cow<'a, [f32]> {
        let penalize = !generated.is_empty()
            && (self.frequency_penalty != 0.0 || self.presence_penalty != 0.0);
        if self.logit_bias.is_empty() && !penalize {
            return Cow::Borrowed(logits);
        }
        let mut out = logits.to_vec();
        for &(t, b) in &self.logit_bias {
            if let Some(l) = out.get_mut(t as usize) {
                *l += b;
            }
        }
        if penalize {
            let mut counts: HashMap<u32, u32> = HashMap::new();
            for &t in generated {
                *counts.entry(t).or_default() += 1;
            }
            for (t, c) in counts {
                if let Some(l) = out.get_mut(t as usize) {
                    *l -= c as f32 * self.frequency_penalty + self.presence_penalty;
                }
            }
        }
        Cow::Owned(out)
    }
}

/// What the engine streams back for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// New text (may be empty when only a partial character or a possible stop prefix came).
    Text(String),
    Done {
        finish_reason: &'static str,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Error(String),
}

/// An accepted request waiting in the queue.
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    /// Generate through end-of-sequence tokens (the request's `ignore_eos`).
    pub ignore_eos: bool,
    /// Bytes reserved at admission ([`Footprint::worst_case`]).
    pub reserve: usize,
    pub events: UnboundedSender<Event>,
    pub enqueued: Instant,
}

/// Why a job was not queued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    QueueFull,
    ShuttingDown,
}

/// State shared by the HTTP side and the engine thread.
pub struct Shared {
    queue: Mutex<VecDeque<Job>>,
    wake: Condvar,
    pub queue_capacity: usize,
    pub budget: usize,
    pub max_batch: usize,
    pub shutdown: AtomicBool,
    /// Device bytes of every running sequence's caches, as measured after the last step.
    pub kv_used: AtomicUsize,
    pub kv_reserved: AtomicUsize,
    pub kv_peak: AtomicUsize,
    pub running: AtomicUsize,
    pub running_peak: AtomicUsize,
    /// Steps where a sequence's measured bytes exceeded its reservation (a bug if ever > 0).
    pub reservation_overruns: AtomicUsize,
    /// Batched decode steps run, and the tokens they produced (a prompt's first token comes
    /// from its prefill and is not counted here). Their engine seconds, and the prefills',
    /// are the Prometheus counters `metrics.decode_seconds` and `metrics.prefill_seconds`.
    pub decode_steps: AtomicUsize,
    pub decode_tokens: AtomicUsize,
    pub metrics: Metrics,
}

impl Shared {
    pub fn new(budget: usize, max_batch: usize, queue_capacity: usize) -> Self {
        Self {
            queue: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            queue_capacity,
            budget,
            max_batch,
            shutdown: AtomicBool::new(false),
            kv_used: AtomicUsize::new(0),
            kv_reserved: AtomicUsize::new(0),
            kv_peak: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            running_peak: AtomicUsize::new(0),
            reservation_overruns: AtomicUsize::new(0),
            decode_steps: AtomicUsize::new(0),
            decode_tokens: AtomicUsize::new(0),
            metrics: Metrics::new(),
        }
    }

    /// Queues a job, or refuses it at once when the queue is full.
    pub fn submit(&self, job: Job) -> Result<(), Refused> {
        if self.shutdown.load(Ordering::SeqCst) {
            return Err(Refused::ShuttingDown);
        }
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= self.queue_capacity {
            return Err(Refused::QueueFull);
        }
        q.push_back(job);
        self.metrics.queued.set(q.len() as i64);
        drop(q);
        self.wake.notify_all();
        Ok(())
    }

    pub fn queued(&self) -> usize {
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn stop(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
        self.wake.notify_all();
    }
}

/// One running sequence.
struct Seq {
    caches: Vec<Box<dyn LayerKv>>,
    prompt_len: usize,
    /// Position of `next` (the token the next decode step runs).
    pos: usize,
    next: u32,
    generated: Vec<u32>,
    max_tokens: usize,
    sampling: Sampling,
    rng: ChaCha8Rng,
    stop: Vec<String>,
    ignore_eos: bool,
    /// End-of-sequence tokens generated and passed over (`ignore_eos`): in the cache and the
    /// token count, not in `generated` (the text).
    eos_passed: usize,
    /// Bytes of text already sent.
    sent: usize,
    reserve: usize,
    events: UnboundedSender<Event>,
    last_token_at: Instant,
}

impl Seq {
    /// Tokens generated so far, end-of-sequence tokens passed over included.
    fn tokens(&self) -> usize {
        self.generated.len() + self.eos_passed
    }
}

/// Samples a token from logits, after the request's bias and penalties
/// ([`Sampling::adjusted`]; `generated`: the tokens generated so far).
pub fn sample(logits: &[f32], s: &Sampling, generated: &[u32], rng: &mut ChaCha8Rng) -> u32 {
    let logits = s.adjusted(logits, generated);
    let logits: &[f32] = &logits;
    if s.temperature <= 0.0 {
        return mosaickv_engine::argmax(logits);
    }
    // (l - m) / t, not (l - m) * (1 / t): at a temperature so small that 1 / t is infinite
    // the top logit would be 0 * inf = NaN; divided, it is 0 (weight 1) and every lower
    // logit -inf (weight 0), the greedy limit.
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut probs: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, ((l as f64 - m) / s.temperature).exp()))
        .collect();
    let z: f64 = probs.iter().map(|p| p.1).sum();
    if s.top_p < 1.0 {
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            acc += p.1 / z;
            if acc >= s.top_p {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
    }
    let total: f64 = probs.iter().map(|p| p.1).sum();
    let mut r = rng.gen::<f64>() * total;
    for &(i, p) in &probs {
        r -= p;
        if r <= 0.0 {
            return i;
        }
    }
    probs.last().map_or(0, |p| p.0)
}

/// Runs the engine loop until [`Shared::stop`] and every accepted job has finished.
pub fn run(model: Arc<Model>, method: Method, foot: Footprint, shared: Arc<Shared>) {
    let mut running: Vec<Seq> = Vec::new();
    let mut prefilling: Option<Prefilling> = None;
    loop {
        // 1. cancellations: a closed channel means the client is gone
        running.retain(|s| {
            let gone = s.events.is_closed();
            if gone {
                shared.metrics.finished("cancelled");
            }
            !gone
        });
        if prefilling
            .as_ref()
            .is_some_and(|p| p.job.events.is_closed())
        {
            prefilling = None;
            shared.metrics.finished("cancelled");
        }
        {
            let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            let before = q.len();
            q.retain(|j| !j.events.is_closed());
            for _ in q.len()..before {
                shared.metrics.finished("cancelled");
            }
            shared.metrics.queued.set(q.len() as i64);
        }
        publish(&shared, &running, prefilling.as_ref());
        // 2. admission, in arrival order: one prompt prefills at a time, a chunk per turn
        if prefilling.is_none() && running.len() < shared.max_batch {
            let reserved: usize = running.iter().map(|s| s.reserve).sum();
            let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(j) = q.front() {
                if reserved + j.reserve <= shared.budget {
                    prefilling = q.pop_front().map(|job| Prefilling {
                        job,
                        state: ChunkedPrefill::default(),
                        filling: None,
                    });
                    shared.metrics.queued.set(q.len() as i64);
                }
            }
        }
        if let Some(mut p) = prefilling.take() {
            let t = Instant::now();
            let step = prefill_step(&model, &method, &shared, &mut p);
            shared
                .metrics
                .prefill_seconds
                .inc_by(t.elapsed().as_secs_f64());
            match step {
                Step::More => prefilling = Some(p),
                Step::Ready(caches, logits) => {
                    if let Some(seq) = start(&model, &foot, &shared, p.job, caches, &logits) {
                        running.push(seq);
                    }
                }
                Step::Failed => {}
            }
            publish(&shared, &running, prefilling.as_ref());
        }
        if running.is_empty() {
            if prefilling.is_some() {
                continue;
            }
            let q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            if shared.shutdown.load(Ordering::SeqCst) && q.is_empty() {
                return;
            }
            // a queued job that does not fit can only be waiting for a running one: none runs
            // here, so it fits (the HTTP side refuses jobs above the whole budget)
            let _unused = shared
                .wake
                .wait_timeout(q, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner());
            continue;
        }
        // 3. one batched decode step
        let t_step = Instant::now();
        let results = {
            let mut batch: Vec<BatchSeq<'_>> = running
                .iter_mut()
                .map(|s| BatchSeq {
                    token: s.next,
                    pos: s.pos,
                    caches: &mut s.caches,
                })
                .collect();
            model.decode_batch(&mut batch)
        };
        shared.metrics.step();
        shared.decode_steps.fetch_add(1, Ordering::Relaxed);
        shared.decode_tokens.fetch_add(
            results.iter().filter(|r| r.is_ok()).count(),
            Ordering::Relaxed,
        );
        let mut keep = Vec::with_capacity(running.len());
        for (mut s, r) in running.drain(..).zip(results) {
            match r {
                Ok(logits) => {
                    s.pos += 1;
                    let tok = sample(&logits, &s.sampling, &s.generated, &mut s.rng);
                    if let Some(seq) = emit(&model, &foot, &shared, s, tok) {
                        keep.push(seq);
                    }
                }
                Err(e) => {
                    let _ = s.events.send(Event::Error(format!("decode failed: {e}")));
                    shared.metrics.finished("error");
                }
            }
        }
        running = keep;
        shared
            .metrics
            .decode_seconds
            .inc_by(t_step.elapsed().as_secs_f64());
        publish(&shared, &running, prefilling.as_ref());
    }
}

/// A job whose prompt is being prefilled.
struct Prefilling {
    job: Job,
    state: ChunkedPrefill,
    /// After the forward pass of a chunked prompt: its caches (the first `filled` layers hold
    /// the prompt) and the logits of its last token.
    filling: Option<Filling>,
}

struct Filling {
    caches: Vec<Box<dyn LayerKv>>,
    filled: usize,
    logits: Vec<f32>,
}

enum Step {
    More,
    Ready(Vec<Box<dyn LayerKv>>, Vec<f32>),
    Failed,
}

/// Runs the next prefill chunk of `p`: a prompt of at most [`PREFILL_CHUNK`] tokens in one
/// [`Model::prefill`] (as a sequence decoded alone), a longer one [`PREFILL_CHUNK`] tokens per
/// call ([`Model::prefill_chunk`]); then its caches take the prompt, layer by layer, in turns of
/// about [`FILL_SLICE`].
fn prefill_step(model: &Model, method: &Method, shared: &Shared, p: &mut Prefilling) -> Step {
    let fail = |job: &Job, msg: String| {
        let _ = job.events.send(Event::Error(msg));
        shared.metrics.finished("error");
        Step::Failed
    };
    let n = p.job.prompt.len();
    if let Some(f) = &mut p.filling {
        let t = Instant::now();
        while f.filled < f.caches.len() {
            let layer = f.filled;
            if let Err(e) = p.state.fill_layer(model, layer, f.caches[layer].as_mut()) {
                return fail(&p.job, format!("prefill: {e}"));
            }
            f.filled += 1;
            if t.elapsed() >= FILL_SLICE {
                break;
            }
        }
        if f.filled < f.caches.len() {
            return Step::More;
        }
        let f = p.filling.take().expect("filling");
        return Step::Ready(f.caches, f.logits);
    }
    let mut caches = if n <= PREFILL_CHUNK || p.state.len() + PREFILL_CHUNK >= n {
        match method.new_caches(model.config()) {
            Ok(c) => c,
            Err(e) => return fail(&p.job, format!("cache: {e}")),
        }
    } else {
        Vec::new()
    };
    if n <= PREFILL_CHUNK {
        let pre = match model.prefill(&p.job.prompt) {
            Ok(pre) => pre,
            Err(e) => return fail(&p.job, format!("prefill: {e}")),
        };
        return match pre.fill(&mut caches) {
            Ok(()) => Step::Ready(caches, pre.logits),
            Err(e) => fail(&p.job, format!("prefill: {e}")),
        };
    }
    let a = p.state.len();
    let b = (a + PREFILL_CHUNK).min(n);
    let logits = match model.prefill_chunk(&mut p.state, &p.job.prompt[a..b]) {
        Ok(l) => l,
        Err(e) => return fail(&p.job, format!("prefill: {e}")),
    };
    if b < n {
        return Step::More;
    }
    p.filling = Some(Filling {
        caches: std::mem::take(&mut caches),
        filled: 0,
        logits,
    });
    prefill_step(model, method, shared, p)
}

/// Samples a prefilled job's first token and makes it a running sequence; `None` when it
/// finished at once.
fn start(
    model: &Model,
    foot: &Footprint,
    shared: &Shared,
    job: Job,
    caches: Vec<Box<dyn LayerKv>>,
    logits: &[f32],
) -> Option<Seq> {
    let mut rng = ChaCha8Rng::seed_from_u64(job.sampling.seed);
    let tok = sample(logits, &job.sampling, &[], &mut rng);
    shared
        .metrics
        .ttft
        .observe(job.enqueued.elapsed().as_secs_f64());
    let seq = Seq {
        caches,
        prompt_len: job.prompt.len(),
        pos: job.prompt.len(),
        next: tok,
        generated: Vec::new(),
        max_tokens: job.max_tokens,
        sampling: job.sampling,
        rng,
        stop: job.stop,
        ignore_eos: job.ignore_eos,
        eos_passed: 0,
        sent: 0,
        reserve: job.reserve,
        events: job.events,
        last_token_at: Instant::now(),
    };
    emit(model, foot, shared, seq, tok)
}

/// Records a sampled token: streams the new text, finishes the sequence on end of sequence, a
/// stop string or its token limit, and lowers its reservation. `None` when it finished.
fn emit(model: &Model, foot: &Footprint, shared: &Shared, mut s: Seq, tok: u32) -> Option<Seq> {
    let now = Instant::now();
    if s.tokens() > 0 {
        shared
            .metrics
            .tbt
            .observe((now - s.last_token_at).as_secs_f64());
    }
    s.last_token_at = now;
    let is_eos = model.is_eos(tok);
    if !is_eos {
        s.generated.push(tok);
    } else if s.ignore_eos {
        s.eos_passed += 1;
    }
    // the sequence ends here on EOS, unless the request passes over it
    let eos = is_eos && !s.ignore_eos;
    if !eos {
        shared.metrics.tokens.inc();
    }
    let text = match model.decode(&s.generated) {
        Ok(t) => t,
        Err(e) => {
            let _ = s.events.send(Event::Error(format!("detokenize: {e}")));
            shared.metrics.finished("error");
            return None;
        }
    };
    let at_limit = s.tokens() >= s.max_tokens;
    // A trailing U+FFFD is a character whose bytes are still being generated, not text:
    // stop strings are looked for in the text before it (in the whole text once the
    // sequence ends anyway), so that a stop of "\u{FFFD}" does not match a half emoji.
    let settled = if eos || at_limit {
        &text[..]
    } else {
        text.trim_end_matches('\u{FFFD}')
    };
    let stop_at = s
        .stop
        .iter()
        .filter_map(|st| settled.find(st.as_str()))
        .min();
    let finish = if stop_at.is_some() || eos {
        Some("stop")
    } else if at_limit {
        Some("length")
    } else {
        None
    };
    let end = match (finish, stop_at) {
        (_, Some(i)) => i,
        (Some(_), None) => text.len(),
        (None, None) => {
            // hold back a partial character and what could be the start of a stop string
            let hold = s.stop.iter().map(|st| st.len()).max().unwrap_or(1) - 1;
            let mut e = text.trim_end_matches('\u{FFFD}').len().saturating_sub(hold);
            while e > 0 && !text.is_char_boundary(e) {
                e -= 1;
            }
            e
        }
    };
    // the decoded prefix is stable (byte-level BPE; a trailing partial character is held back),
    // so `sent` is a character boundary; `get` keeps a surprise from panicking the engine
    if let Some(piece) = text.get(s.sent..end).filter(|p| !p.is_empty()) {
        let _ = s.events.send(Event::Text(piece.to_string()));
        s.sent = end;
    }
    if let Some(reason) = finish {
        let _ = s.events.send(Event::Done {
            finish_reason: reason,
            prompt_tokens: s.prompt_len,
            completion_tokens: s.tokens(),
        });
        shared.metrics.finished("ok");
        return None;
    }
    // device bytes, host bytes and the host rows among them (the host bytes less the scratch,
    // which `host_fixed` charges whole), one look at each cache
    let (mut device, mut host, mut rows) = (0usize, 0usize, 0usize);
    for c in &s.caches {
        match c.memory_report() {
            Some(m) => {
                device += m.device_bytes();
                host += m.host_bytes();
                rows += m.host_rows;
            }
            None => {
                let h = c.host_bytes();
                device += c.bytes();
                host += h;
                rows += h;
            }
        }
    }
    if device + host > s.reserve {
        shared.reservation_overruns.fetch_add(1, Ordering::SeqCst);
    }
    // tokens still to append: this one (next step) and up to max_tokens - generated - 1 more
    let remaining = s.max_tokens - s.tokens();
    // the caches' own bound from their state (the fitted strategies), else the method's; plus
    // the host rows held now, those of every token still to come (a close only drops them) and
    // the scratch (allocated while a segment is open)
    let bound = s
        .caches
        .iter()
        .map(|c| c.bytes_bound(remaining))
        .sum::<Option<usize>>()
        .unwrap_or_else(|| foot.device_still_needed(device, remaining))
        + rows
        + remaining * foot.host_per_token
        + foot.host_fixed;
    s.reserve = s.reserve.min(bound);
    s.next = tok;
    Some(s)
}

/// Publishes the running set's measured bytes, reservations (the prefilling job's included)
/// and count.
fn publish(shared: &Shared, running: &[Seq], prefilling: Option<&Prefilling>) {
    let held = |caches: &[Box<dyn LayerKv>]| -> usize {
        caches.iter().map(|c| c.bytes() + c.host_bytes()).sum()
    };
    // device and host bytes of the running caches and of the caches a prompt is filling (its
    // f32 prompt rows are the forward pass's working memory, outside the budget: budget.rs)
    let used: usize = running.iter().map(|s| held(&s.caches)).sum::<usize>()
        + prefilling.map_or(0, |p| p.filling.as_ref().map_or(0, |f| held(&f.caches)));
    let reserved: usize =
        running.iter().map(|s| s.reserve).sum::<usize>() + prefilling.map_or(0, |p| p.job.reserve);
    shared.kv_used.store(used, Ordering::SeqCst);
    shared.kv_reserved.store(reserved, Ordering::SeqCst);
    shared.kv_peak.fetch_max(used, Ordering::SeqCst);
    shared.running.store(running.len(), Ordering::SeqCst);
    shared
        .running_peak
        .fetch_max(running.len(), Ordering::SeqCst);
    shared.metrics.running.set(running.len() as i64);
    shared.metrics.kv_used.set(used as i64);
    shared.metrics.kv_reserved.set(reserved as i64);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_and_sampling_is_seeded() {
        let logits = vec![0.1f32, 2.0, 1.9, -1.0];
        let greedy = Sampling::plain(0.0, 1.0, 0);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(sample(&logits, &greedy, &[], &mut rng), 1);
        let hot = Sampling::plain(1.0, 1.0, 5);
        let draw = |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            (0..50)
                .map(|_| sample(&logits, &hot, &[], &mut rng))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
        // more than one token is drawn at temperature 1
        let d = draw(5);
        assert!(d.iter().any(|&t| t != d[0]));
        // top_p small keeps only the most likely token
        let nucleus = Sampling::plain(1.0, 0.01, 1);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        assert!((0..50).all(|_| sample(&logits, &nucleus, &[], &mut rng) == 1));
    }

    #[test]
    fn logit_bias_and_penalties_follow_openai() {
        let logits = vec![0.1f32, 2.0, 1.9, -1.0];
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        // a bias moves the greedy choice, a ban (-100) removes it
        let mut s = Sampling::plain(0.0, 1.0, 0);
        s.logit_bias = vec![(3, 100.0)];
        assert_eq!(sample(&logits, &s, &[], &mut rng), 3);
        s.logit_bias = vec![(1, -100.0)];
        assert_eq!(sample(&logits, &s, &[], &mut rng), 2);
        // frequency: 2.0 - 2 * 0.1 = 1.8 < 1.9; presence: 2.0 - 0.5 = 1.5 < 1.9
        let mut f = Sampling::plain(0.0, 1.0, 0);
        f.frequency_penalty = 0.1;
        assert_eq!(sample(&logits, &f, &[1], &mut rng), 1);
        assert_eq!(sample(&logits, &f, &[1, 1], &mut rng), 2);
        let mut p = Sampling::plain(0.0, 1.0, 0);
        p.presence_penalty = 0.5;
        assert_eq!(sample(&logits, &p, &[1, 1, 1], &mut rng), 2);
        assert_eq!(p.adjusted(&logits, &[1, 1, 1])[1], 1.5);
        // none asked: the logits are borrowed, not copied
        assert!(matches!(
            Sampling::plain(1.0, 1.0, 0).adjusted(&logits, &[1]),
            Cow::Borrowed(_)
        ));
    }
}
