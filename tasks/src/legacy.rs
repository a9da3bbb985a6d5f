//! The project's earlier task generators (issue 4), kept byte-identical under names that claim
//! nothing (`niah_single_noise`, `niah_multikey_noise`, `niah_multivalue_noise`,
//! `niah_multiquery_noise`, `vt_noex`, `cwe_small`) so that earlier figures stay
//! reproducible. They differ from RULER (see `docs/ACCURACY.md`, "RULER as published"):
//! keys from the built-in 52K-key vocabulary ([`crate::words`]), needles at random line
//! positions (possibly adjacent or last), the noise haystack for every niah variant, `vt`
//! without its worked example, `cwe` with an example lacking the answer prefix and a pool
//! that runs out at long lengths. This code is not to be changed: a change alters the
//! samples behind published figures.

use std::collections::BTreeSet;

use rand::seq::{index, SliceRandom};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::{words, CWE_COMMON, CWE_LONG_CONTEXT, NOISE_LINE, VT_HOPS};

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
pub(crate) fn render_niah(
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
pub(crate) fn render_vt(rng: &mut ChaCha8Rng, n_noise: usize) -> (String, String, Vec<String>) {
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
pub(crate) struct CweParams {
    /// Distinct words in the one-shot example (10 of them common).
    pub(crate) example_words: usize,
    example_common_repeats: usize,
    example_uncommon_repeats: usize,
    common_repeats: usize,
    uncommon_repeats: usize,
}

impl CweParams {
    pub(crate) fn for_target(target_tokens: usize) -> CweParams {
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
pub(crate) fn render_cwe(
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
