//! RULER-style synthetic long-context tasks, generated offline and
//! deterministically from a seed (MOSAICKV.md section 5; issue 4, "Tasks").
//!
//! Six tasks, named as RULER names them: `niah_single_1`, `niah_multikey`,
//! `niah_multivalue`, `niah_multiquery`, `vt` and `cwe`. Every niah task uses
//! the noise haystack (the line [`NOISE_LINE`] repeated), because the essay
//! haystack needs a text corpus we do not ship. Prompt wording follows RULER's
//! `scripts/data/synthetic/constants.py` templates verbatim (see [`Task`]).
//!
//! [`generate`] searches the haystack size (noise lines, or distinct words for
//! `cwe`) so that the prompt, as measured by the caller's token counter, plus
//! an answer budget fits a target length, as large as possible.
//! [`string_match_all`] is RULER's metric.
//!
//! This crate has no SPEC.md section: it is test-data generation for the
//! accuracy suite, not part of the cache contract.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod stats;
pub mod words;

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use rand::seq::{index, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// The noise haystack line (MOSAICKV.md section 5), repeated once per
/// haystack line; needles and variable assignments are whole lines between
/// copies of it.
pub const NOISE_LINE: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";

/// Needles (keys or values) in `niah_multikey`, `niah_multivalue` and
/// `niah_multiquery` (RULER's `num_needle_k` / `num_needle_v` / `num_needle_q`).
pub const MULTI_NEEDLES: usize = 4;

/// Hops in the `vt` chain: `VAR A = value` then this many `VAR B = VAR A`
/// lines, so `VT_HOPS + 1` names hold the value (RULER's default `num_hops`).
pub const VT_HOPS: usize = 4;

/// Number of common words in `cwe` (RULER's `num_cw`).
pub const CWE_COMMON: usize = 10;

/// Target lengths below this use RULER's short-context `cwe` settings
/// (common words 6 times, others once; a 20-word example), at or above it the
/// long-context ones (30 and 3 times; a 40-word example), as RULER does.
pub const CWE_LONG_CONTEXT: usize = 4096;

/// Largest haystack the size search will try for the line-based tasks
/// (niah, vt): 2^18 noise lines, several million tokens.
pub const MAX_HAYSTACK_LINES: usize = 1 << 18;

/// A synthetic task (MOSAICKV.md section 5).
///
/// niah prompts are RULER's `niah` template; with one needle asked and one
/// value (`niah_single_1`, `niah_multikey`) RULER's singular forms are used
/// ("A special magic number is hidden ...", "What is ...", answer prefix
/// "... is"). `vt` and `cwe` use RULER's `variable_tracking` and
/// `common_words_extraction` templates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Task {
    /// One needle in the noise haystack, one key asked.
    #[serde(rename = "niah_single_1")]
    NiahSingle1,
    /// Four needles with different keys (three are distractors), one asked.
    #[serde(rename = "niah_multikey")]
    NiahMultikey,
    /// Four needles with the same key and different values, all asked.
    #[serde(rename = "niah_multivalue")]
    NiahMultivalue,
    /// Four needles with different keys, all four keys asked.
    #[serde(rename = "niah_multiquery")]
    NiahMultiquery,
    /// Variable tracking: one chain of [`VT_HOPS`] assignments in noise.
    #[serde(rename = "vt")]
    Vt,
    /// Common word extraction: the [`CWE_COMMON`] most frequent words.
    #[serde(rename = "cwe")]
    Cwe,
}

const ALL_TASKS: [Task; 6] = [
    Task::NiahSingle1,
    Task::NiahMultikey,
    Task::NiahMultivalue,
    Task::NiahMultiquery,
    Task::Vt,
    Task::Cwe,
];

impl Task {
    /// RULER's name of the task, e.g. `niah_single_1`.
    pub const fn name(self) -> &'static str {
        match self {
            Task::NiahSingle1 => "niah_single_1",
            Task::NiahMultikey => "niah_multikey",
            Task::NiahMultivalue => "niah_multivalue",
            Task::NiahMultiquery => "niah_multiquery",
            Task::Vt => "vt",
            Task::Cwe => "cwe",
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

    /// Every task, in a fixed order.
    pub const fn all() -> &'static [Task] {
        &ALL_TASKS
    }

    /// Stream number of this task's random generator, so one seed gives
    /// unrelated samples for different tasks.
    fn stream(self) -> u64 {
        match self {
            Task::NiahSingle1 => 1,
            Task::NiahMultikey => 2,
            Task::NiahMultivalue => 3,
            Task::NiahMultiquery => 4,
            Task::Vt => 5,
            Task::Cwe => 6,
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
    /// Even the empty haystack does not fit: `minimum_tokens` (prompt tokens
    /// of the smallest sample plus the answer budget) exceeds `target_tokens`.
    TargetTooSmall {
        /// The task asked for.
        task: Task,
        /// The requested total length.
        target_tokens: usize,
        /// Prompt tokens of the smallest sample plus the answer budget.
        minimum_tokens: usize,
    },
}

impl fmt::Display for TaskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TaskError::UnknownTask(name) => {
                let names: Vec<&str> = ALL_TASKS.iter().map(|t| t.name()).collect();
                write!(
                    f,
                    "unknown task {name:?}; known tasks: {}",
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
        }
    }
}

impl std::error::Error for TaskError {}

/// One generated sample.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sample {
    /// The task it belongs to.
    pub task: Task,
    /// The user prompt text, including the question (the chat template's
    /// user message).
    pub context: String,
    /// Text the assistant turn starts with (RULER's answer prefix, with its
    /// leading space); the model continues after it.
    pub answer_prefix: String,
    /// Reference answers, all expected in the output (scored with
    /// [`string_match_all`]).
    pub answers: Vec<String>,
    /// The seed it was generated from.
    pub seed: u64,
}

impl Sample {
    /// `context + answer_prefix`: the text [`generate`] hands to the token
    /// counter.
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
/// The haystack size (noise lines for niah and vt, distinct words for cwe) is
/// the largest one found by a doubling-then-bisection search for which
/// `count_tokens(&(context + answer_prefix)) + answer_budget <= target_tokens`;
/// the returned sample always satisfies that bound. `count_tokens` should
/// count the prompt as the model will see it: a caller with a chat template
/// tokenizes the template wrapped around the text (the template's tokens
/// between user message and answer prefix are a constant the closure adds).
///
/// Deterministic: the same `(task, target_tokens, answer_budget, seed)` and
/// counter give the identical sample. Keys, values and words are drawn first
/// from a ChaCha8 generator seeded with `seed` (on a per-task stream), then
/// the layout (needle lines at random line positions), so keys and values do
/// not depend on the haystack size.
///
/// Errors: [`TaskError::TargetTooSmall`] when not even the empty haystack
/// fits. For `cwe` the haystack is capped by the built-in word pool
/// ([`max_haystack_size`]); a target beyond what the pool can fill gives a
/// shorter sample, not an error.
pub fn generate(
    task: Task,
    target_tokens: usize,
    answer_budget: usize,
    seed: u64,
    count_tokens: &dyn Fn(&str) -> usize,
) -> Result<Sample, TaskError> {
    let size = haystack_size_for(task, target_tokens, answer_budget, seed, count_tokens)?;
    Ok(render(task, size, seed, target_tokens))
}

/// The haystack size [`generate`] uses: the largest found size whose prompt
/// plus `answer_budget` fits `target_tokens` (see [`generate`]).
pub fn haystack_size_for(
    task: Task,
    target_tokens: usize,
    answer_budget: usize,
    seed: u64,
    count_tokens: &dyn Fn(&str) -> usize,
) -> Result<usize, TaskError> {
    let cost = |n: usize| -> usize {
        let sample = render(task, n, seed, target_tokens);
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

/// The largest haystack size the search tries: [`MAX_HAYSTACK_LINES`] for
/// the line-based tasks; for `cwe`, the number of distinct uncommon words the
/// built-in pool ([`words::cwe_pool`]) leaves after the example's and the
/// common words.
pub fn max_haystack_size(task: Task, target_tokens: usize) -> usize {
    match task {
        Task::Cwe => {
            let params = CweParams::for_target(target_tokens);
            words::cwe_pool()
                .len()
                .saturating_sub(params.example_words + CWE_COMMON)
        }
        _ => MAX_HAYSTACK_LINES,
    }
}

/// Renders the sample of `task` with an exact haystack size and seed; what
/// [`generate`] returns for the size it found. `haystack_size` is the number
/// of noise lines (niah, vt) or of distinct uncommon words (cwe, capped at
/// [`max_haystack_size`]); `target_tokens` only selects RULER's short- or
/// long-context `cwe` settings ([`CWE_LONG_CONTEXT`]).
pub fn render(task: Task, haystack_size: usize, seed: u64, target_tokens: usize) -> Sample {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(task.stream());
    let (context, answer_prefix, answers) = match task {
        Task::NiahSingle1 => render_niah(&mut rng, haystack_size, 1, 1, 1),
        Task::NiahMultikey => render_niah(&mut rng, haystack_size, MULTI_NEEDLES, 1, 1),
        Task::NiahMultivalue => render_niah(&mut rng, haystack_size, 1, MULTI_NEEDLES, 1),
        Task::NiahMultiquery => {
            render_niah(&mut rng, haystack_size, MULTI_NEEDLES, 1, MULTI_NEEDLES)
        }
        Task::Vt => render_vt(&mut rng, haystack_size),
        Task::Cwe => render_cwe(&mut rng, haystack_size, target_tokens),
    };
    Sample {
        task,
        context,
        answer_prefix,
        answers,
        seed,
    }
}

/// RULER's `string_match_all`: the fraction of `answers` found,
/// case-insensitively, as substrings of `prediction` (0.0 ..= 1.0). An empty
/// answer list scores 0.0 (no sample has one; this avoids dividing by zero).
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

// ---------------------------------------------------------------------------
// Rendering
// ---------------------------------------------------------------------------

/// Places `items` (in their order) at random line positions among
/// `n_noise` copies of [`NOISE_LINE`] and joins the lines with `\n`.
fn interleave(rng: &mut ChaCha8Rng, n_noise: usize, items: &[String]) -> String {
    let total = n_noise + items.len();
    let mut positions = index::sample(rng, total, items.len()).into_vec();
    positions.sort_unstable();
    let mut lines: Vec<&str> = Vec::with_capacity(total);
    let mut next = 0;
    for slot in 0..total {
        if next < positions.len() && positions[next] == slot {
            lines.push(&items[next]);
            next += 1;
        } else {
            lines.push(NOISE_LINE);
        }
    }
    lines.join("\n")
}

/// `n` distinct `adjective-noun` keys.
fn draw_keys(rng: &mut ChaCha8Rng, n: usize) -> Vec<String> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let adj = words::ADJECTIVES[rng.gen_range(0..words::ADJECTIVES.len())];
        let noun = words::NOUNS[rng.gen_range(0..words::NOUNS.len())];
        let key = format!("{adj}-{noun}");
        if seen.insert(key.clone()) {
            out.push(key);
        }
    }
    out
}

/// `n` distinct numbers in `range`, as decimal strings.
fn draw_numbers(
    rng: &mut ChaCha8Rng,
    n: usize,
    range: std::ops::RangeInclusive<u32>,
) -> Vec<String> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let v = rng.gen_range(range.clone());
        if seen.insert(v) {
            out.push(v.to_string());
        }
    }
    out
}

/// RULER's niah with `n_keys` keys, `n_values` 7-digit values per key and
/// `n_queries` keys asked, on the noise haystack of `n_noise` lines.
fn render_niah(
    rng: &mut ChaCha8Rng,
    n_noise: usize,
    n_keys: usize,
    n_values: usize,
    n_queries: usize,
) -> (String, String, Vec<String>) {
    let keys = draw_keys(rng, n_keys);
    let values = draw_numbers(rng, n_keys * n_values, 1_000_000..=9_999_999);
    let mut needles = Vec::with_capacity(n_keys * n_values);
    for (k, key) in keys.iter().enumerate() {
        for value in &values[k * n_values..(k + 1) * n_values] {
            needles.push(format!(
                "One of the special magic numbers for {key} is: {value}."
            ));
        }
    }
    // Which keys are asked, in RULER's order (random.sample of key indices).
    let asked = index::sample(rng, n_keys, n_queries).into_vec();
    let queries: Vec<&str> = asked.iter().map(|&k| keys[k].as_str()).collect();
    let answers: Vec<String> = asked
        .iter()
        .flat_map(|&k| values[k * n_values..(k + 1) * n_values].iter().cloned())
        .collect();
    let query = match queries.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{}, and {last}", rest.join(", ")),
        _ => queries.join(""),
    };
    needles.shuffle(rng);
    let haystack = interleave(rng, n_noise, &needles);

    let (context, answer_prefix) = if n_queries * n_values == 1 {
        (
            format!(
                "A special magic number is hidden within the following text. Make sure to \
                 memorize it. I will quiz you about the number afterwards.\n{haystack}\n\
                 What is the special magic number for {query} mentioned in the provided text?"
            ),
            format!(" The special magic number for {query} mentioned in the provided text is"),
        )
    } else {
        (
            format!(
                "Some special magic numbers are hidden within the following text. Make sure to \
                 memorize it. I will quiz you about the numbers afterwards.\n{haystack}\n\
                 What are all the special magic numbers for {query} mentioned in the provided \
                 text?"
            ),
            format!(" The special magic numbers for {query} mentioned in the provided text are"),
        )
    };
    (context, answer_prefix, answers)
}

/// Fixed text of the `vt` prompt, which variable names must not occur in.
const VT_FIXED_TEXT: &str = "memorize and track the chain(s) of variable assignment hidden in \
     the following text question: find all variables that are assigned the value in the text \
     above answer: according to the chain(s) of variable assignment in the text above, \
     variables are assigned the value they are";

/// RULER's variable tracking: one chain `VAR A = v`, `VAR B = VAR A`, ...
/// ([`VT_HOPS`] hops, 5-letter upper-case names, a 5-digit value as in RULER)
/// interleaved, in order, with `n_noise` noise lines.
fn render_vt(rng: &mut ChaCha8Rng, n_noise: usize) -> (String, String, Vec<String>) {
    let noise = NOISE_LINE.to_lowercase();
    let mut names: Vec<String> = Vec::with_capacity(VT_HOPS + 1);
    while names.len() < VT_HOPS + 1 {
        let name: String = (0..5)
            .map(|_| char::from(b'A' + rng.gen_range(0..26u8)))
            .collect();
        let lower = name.to_lowercase();
        // A name that occurs in the fixed text would be "found" by
        // string_match_all in an echo of the prompt; draw again.
        if names.contains(&name) || noise.contains(&lower) || VT_FIXED_TEXT.contains(&lower) {
            continue;
        }
        names.push(name);
    }
    let value = rng.gen_range(10_000..=99_999u32).to_string();
    let mut chain = Vec::with_capacity(VT_HOPS + 1);
    chain.push(format!("VAR {} = {value}", names[0]));
    for hop in 0..VT_HOPS {
        chain.push(format!("VAR {} = VAR {}", names[hop + 1], names[hop]));
    }
    let haystack = interleave(rng, n_noise, &chain);
    let context = format!(
        "Memorize and track the chain(s) of variable assignment hidden in the following \
         text.\n\n{haystack}\nQuestion: Find all variables that are assigned the value {value} \
         in the text above."
    );
    let answer_prefix = format!(
        " Answer: According to the chain(s) of variable assignment in the text above, {} \
         variables are assigned the value {value}, they are: ",
        VT_HOPS + 1
    );
    (context, answer_prefix, names)
}

/// RULER's `cwe` settings for a target length.
#[derive(Clone, Copy, Debug)]
struct CweParams {
    /// Distinct words in the one-shot example (10 of them common).
    example_words: usize,
    example_common_repeats: usize,
    example_uncommon_repeats: usize,
    common_repeats: usize,
    uncommon_repeats: usize,
}

impl CweParams {
    fn for_target(target_tokens: usize) -> CweParams {
        if target_tokens < CWE_LONG_CONTEXT {
            CweParams {
                example_words: 20,
                example_common_repeats: 3,
                example_uncommon_repeats: 1,
                common_repeats: 6,
                uncommon_repeats: 1,
            }
        } else {
            CweParams {
                example_words: 40,
                example_common_repeats: 10,
                example_uncommon_repeats: 3,
                common_repeats: 30,
                uncommon_repeats: 3,
            }
        }
    }
}

/// The `cwe` question block for one numbered list (RULER's template).
fn cwe_block(list: &str) -> String {
    format!(
        "Below is a numbered list of words. In these words, some appear more often than \
         others. Memorize the ones that appear most often.\n{list}\nQuestion: What are the \
         {CWE_COMMON} most common words in the above list?"
    )
}

/// `1. w1 2. w2 ...`
fn numbered(words: &[&str]) -> String {
    let items: Vec<String> = words
        .iter()
        .enumerate()
        .map(|(i, w)| format!("{}. {w}", i + 1))
        .collect();
    items.join(" ")
}

/// A shuffled list with each common word `common_repeats` times and each
/// uncommon word `uncommon_repeats` times.
fn cwe_list<'a>(
    rng: &mut ChaCha8Rng,
    common: &[&'a str],
    uncommon: &[&'a str],
    common_repeats: usize,
    uncommon_repeats: usize,
) -> Vec<&'a str> {
    let mut list =
        Vec::with_capacity(common.len() * common_repeats + uncommon.len() * uncommon_repeats);
    for _ in 0..common_repeats {
        list.extend_from_slice(common);
    }
    for _ in 0..uncommon_repeats {
        list.extend_from_slice(uncommon);
    }
    list.shuffle(rng);
    list
}

/// RULER's common word extraction with a one-shot example: the example
/// question with its answer, then the task's list of `CWE_COMMON` common and
/// `n_uncommon` uncommon words (all distinct from the example's words).
fn render_cwe(
    rng: &mut ChaCha8Rng,
    n_uncommon: usize,
    target_tokens: usize,
) -> (String, String, Vec<String>) {
    let p = CweParams::for_target(target_tokens);
    let mut pool = words::cwe_pool();
    pool.shuffle(rng);
    let (example, rest) = pool.split_at(p.example_words);
    let (ex_common, ex_uncommon) = example.split_at(CWE_COMMON);
    let (common, rest) = rest.split_at(CWE_COMMON);
    let uncommon = &rest[..n_uncommon.min(rest.len())];

    let ex_list = cwe_list(
        rng,
        ex_common,
        ex_uncommon,
        p.example_common_repeats,
        p.example_uncommon_repeats,
    );
    let list = cwe_list(rng, common, uncommon, p.common_repeats, p.uncommon_repeats);
    let context = format!(
        "{} {}\n{}",
        cwe_block(&numbered(&ex_list)),
        numbered(ex_common),
        cwe_block(&numbered(&list))
    );
    let answer_prefix =
        format!(" Answer: The top {CWE_COMMON} words that appear most often in the list are:");
    (
        context,
        answer_prefix,
        common.iter().map(|w| w.to_string()).collect(),
    )
}
