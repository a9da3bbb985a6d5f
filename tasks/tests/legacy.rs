//! Tests of the project's earlier task generators (MOSAICKV.md section 5), kept under the
//! names `niah_single_noise`, `niah_multikey_noise`, `niah_multivalue_noise`,
//! `niah_multiquery_noise`, `vt_noex`, `cwe_small` (issue 36): unchanged behaviour, plus a
//! digest of their samples taken before the rename.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use mosaickv_tasks::{
    generate, haystack_size_for, max_haystack_size, render, string_match_all, words, Sample, Task,
    TaskError, CWE_COMMON, MULTI_NEEDLES, NOISE_LINE, VT_HOPS,
};

/// Whitespace-separated words as tokens.
fn ws_tokens(s: &str) -> usize {
    s.split_whitespace().count()
}

/// About four characters per token, rounded up.
fn char_tokens(s: &str) -> usize {
    s.chars().count().div_ceil(4)
}

const BUDGET: usize = 128;

type Counter = fn(&str) -> usize;

fn counters() -> [(&'static str, Counter); 2] {
    [("whitespace", ws_tokens), ("chars/4", char_tokens)]
}

/// The earlier tasks (the suite `noise`).
fn legacy() -> &'static [Task] {
    Task::suite("noise").expect("the noise suite")
}

fn gen(task: Task, target: usize, seed: u64) -> Sample {
    generate(task, target, BUDGET, seed, &ws_tokens).expect("target large enough")
}

/// The needle lines `One of the special magic numbers for KEY is: VALUE.` as
/// (key, value) pairs, in order.
fn needles(context: &str) -> Vec<(String, String)> {
    context
        .lines()
        .filter_map(|l| l.strip_prefix("One of the special magic numbers for "))
        .map(|rest| {
            let (key, value) = rest.split_once(" is: ").expect("needle shape");
            (key.to_string(), value.trim_end_matches('.').to_string())
        })
        .collect()
}

#[test]
fn names_round_trip_and_unknown_name_is_an_error() {
    let names: Vec<&str> = legacy().iter().map(|t| t.name()).collect();
    assert_eq!(
        names,
        [
            "niah_single_noise",
            "niah_multikey_noise",
            "niah_multivalue_noise",
            "niah_multiquery_noise",
            "vt_noex",
            "cwe_small"
        ]
    );
    for &t in legacy() {
        assert_eq!(Task::from_name(t.name()), Ok(t));
        assert_eq!(t.name().parse::<Task>(), Ok(t));
        assert_eq!(t.to_string(), t.name());
        assert_eq!(
            serde_json::to_string(&t).unwrap(),
            format!("\"{}\"", t.name())
        );
    }
    assert_eq!(
        Task::from_name("niah_multikey"),
        Err(TaskError::UnknownTask("niah_multikey".into()))
    );
    let msg = Task::from_name("niah_multikey").unwrap_err().to_string();
    assert!(msg.contains("niah_multikey_noise"), "{msg}");
    assert!(Task::from_name("NIAH_SINGLE_1").is_err());
}

#[test]
fn same_seed_gives_identical_sample_and_other_seeds_differ() {
    for &task in legacy() {
        let a = gen(task, 1024, 7);
        let b = gen(task, 1024, 7);
        assert_eq!(a, b, "{task}: not deterministic");
        assert_eq!(a.seed, 7);
        assert_eq!(a.task, task);
        let c = gen(task, 1024, 8);
        assert_ne!(
            a.context, c.context,
            "{task}: seeds 7 and 8 gave the same context"
        );
        assert_ne!(
            a.answers, c.answers,
            "{task}: seeds 7 and 8 gave the same answers"
        );
    }
}

#[test]
fn different_tasks_with_one_seed_draw_different_keys() {
    let a = gen(Task::NiahSingleNoise, 1024, 3);
    let b = gen(Task::NiahMultikeyNoise, 1024, 3);
    assert_ne!(a.answers[0], b.answers[0]);
}

#[test]
fn prompt_fits_and_one_more_haystack_line_would_not() {
    for (counter_name, count) in counters() {
        for &task in legacy() {
            for target in [700, 1024, 2048, 4096, 6000] {
                let n = haystack_size_for(task, target, BUDGET, 11, &count).unwrap();
                let sample = generate(task, target, BUDGET, 11, &count).unwrap();
                assert_eq!(sample, render(task, n, 11, target).unwrap());
                let used = count(&sample.prompt()) + BUDGET;
                assert!(
                    used <= target,
                    "{task}/{counter_name}/{target}: {used} > {target}"
                );
                assert!(
                    n < max_haystack_size(task, target),
                    "{task}: pool exhausted at {target}"
                );
                let bigger = render(task, n + 1, 11, target).unwrap();
                let used_bigger = count(&bigger.prompt()) + BUDGET;
                assert!(
                    used_bigger > target,
                    "{task}/{counter_name}/{target}: size {} would fit too ({used_bigger})",
                    n + 1
                );
                // The haystack is the bulk of the prompt at these lengths.
                if target >= 1024 {
                    assert!(
                        used * 10 >= target * 8,
                        "{task}: only {used} of {target} used"
                    );
                }
            }
        }
    }
}

#[test]
fn needle_count_follows_the_haystack_size() {
    // render's haystack_size is the number of noise lines for niah and vt.
    for &task in &[Task::NiahSingleNoise, Task::NiahMultikeyNoise, Task::VtNoex] {
        for n in [0, 1, 5, 37] {
            let s = render(task, n, 5, 1024).unwrap();
            assert_eq!(
                s.context.lines().filter(|l| *l == NOISE_LINE).count(),
                n,
                "{task}"
            );
        }
    }
}

#[test]
fn target_too_small_for_an_empty_haystack_is_an_error() {
    for &task in legacy() {
        let minimum = ws_tokens(&render(task, 0, 1, 1000).unwrap().prompt()) + BUDGET;
        match generate(task, minimum - 1, BUDGET, 1, &ws_tokens) {
            Err(TaskError::TargetTooSmall {
                task: t,
                target_tokens,
                minimum_tokens,
            }) => {
                assert_eq!(
                    (t, target_tokens, minimum_tokens),
                    (task, minimum - 1, minimum)
                );
            }
            other => panic!("{task}: expected TargetTooSmall, got {other:?}"),
        }
        assert!(generate(task, 10, BUDGET, 1, &ws_tokens).is_err());
        let exact = generate(task, minimum, BUDGET, 1, &ws_tokens).unwrap();
        assert_eq!(exact, render(task, 0, 1, minimum).unwrap());
        let msg = generate(task, 10, BUDGET, 1, &ws_tokens)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("too small"), "{msg}");
    }
}

#[test]
fn niah_needles_keys_and_answers() {
    let adjectives: BTreeSet<&str> = words::ADJECTIVES.iter().copied().collect();
    let nouns: BTreeSet<&str> = words::NOUNS.iter().copied().collect();
    for seed in 0..20 {
        for &(task, n_keys, n_values, n_asked) in &[
            (Task::NiahSingleNoise, 1, 1, 1),
            (Task::NiahMultikeyNoise, MULTI_NEEDLES, 1, 1),
            (Task::NiahMultivalueNoise, 1, MULTI_NEEDLES, 1),
            (Task::NiahMultiqueryNoise, MULTI_NEEDLES, 1, MULTI_NEEDLES),
        ] {
            let s = gen(task, 2048, seed);
            let found = needles(&s.context);
            assert_eq!(found.len(), n_keys * n_values, "{task}");
            let keys: BTreeSet<&str> = found.iter().map(|(k, _)| k.as_str()).collect();
            assert_eq!(keys.len(), n_keys, "{task}: keys not distinct");
            for key in &keys {
                let (adj, noun) = key.split_once('-').expect("adjective-noun key");
                assert!(adjectives.contains(adj) && nouns.contains(noun), "{key}");
            }
            let values: BTreeSet<&str> = found.iter().map(|(_, v)| v.as_str()).collect();
            assert_eq!(values.len(), found.len(), "{task}: values not distinct");
            for v in &values {
                assert!(v.len() == 7 && v.bytes().all(|b| b.is_ascii_digit()), "{v}");
            }
            assert_eq!(s.answers.len(), n_asked * n_values, "{task}");
            // Every answer is a needle value, and the needle's key is asked.
            let question = s.context.lines().last().unwrap();
            for a in &s.answers {
                assert!(
                    s.context.contains(a.as_str()),
                    "{task}: answer {a} not in context"
                );
                let (key, _) = found
                    .iter()
                    .find(|(_, v)| v == a)
                    .expect("answer is a needle");
                assert!(question.contains(key.as_str()), "{task}: {key} not asked");
                assert!(s.answer_prefix.contains(key.as_str()));
            }
            // Keys that are not asked are distractors: absent from the question.
            let asked = found
                .iter()
                .filter(|(k, _)| question.contains(k.as_str()))
                .count();
            assert_eq!(asked, n_asked * n_values, "{task}");
            let singular = n_asked * n_values == 1;
            if singular {
                assert!(s
                    .context
                    .starts_with("A special magic number is hidden within"));
                assert!(question.starts_with("What is the special magic number for "));
                assert!(s
                    .answer_prefix
                    .ends_with("mentioned in the provided text is"));
            } else {
                assert!(s
                    .context
                    .starts_with("Some special magic numbers are hidden within"));
                assert!(question.starts_with("What are all the special magic numbers for "));
                assert!(s
                    .answer_prefix
                    .ends_with("mentioned in the provided text are"));
            }
        }
    }
}

#[test]
fn niah_single_prompt_is_rulers_wording() {
    let s = render(Task::NiahSingleNoise, 2, 9, 1024).unwrap();
    let (key, value) = needles(&s.context).pop().unwrap();
    assert_eq!(s.answers, vec![value.clone()]);
    let mut lines = vec![NOISE_LINE.to_string(), NOISE_LINE.to_string()];
    let pos = s
        .context
        .lines()
        .position(|l| l.starts_with("One of"))
        .unwrap()
        - 1;
    lines.insert(
        pos,
        format!("One of the special magic numbers for {key} is: {value}."),
    );
    let expected = format!(
        "A special magic number is hidden within the following text. Make sure to memorize it. \
         I will quiz you about the number afterwards.\n{}\nWhat is the special magic number for \
         {key} mentioned in the provided text?",
        lines.join("\n")
    );
    assert_eq!(s.context, expected);
    assert_eq!(
        s.answer_prefix,
        format!(" The special magic number for {key} mentioned in the provided text is")
    );
}

#[test]
fn multiquery_question_lists_four_keys_rulers_way() {
    let s = gen(Task::NiahMultiqueryNoise, 1024, 4);
    let question = s.context.lines().last().unwrap();
    let keys: Vec<String> = s
        .answers
        .iter()
        .map(|a| {
            needles(&s.context)
                .into_iter()
                .find(|(_, v)| v == a)
                .unwrap()
                .0
        })
        .collect();
    let list = format!("{}, {}, {}, and {}", keys[0], keys[1], keys[2], keys[3]);
    assert_eq!(
        question,
        format!(
            "What are all the special magic numbers for {list} mentioned in the provided text?"
        )
    );
}

#[test]
fn needle_positions_are_random_by_line() {
    let mut positions = BTreeSet::new();
    for seed in 0..30 {
        let s = gen(Task::NiahSingleNoise, 1024, seed);
        let pos = s
            .context
            .lines()
            .position(|l| l.starts_with("One of the special"))
            .unwrap();
        positions.insert(pos);
    }
    assert!(positions.len() >= 15, "needle positions: {positions:?}");
}

/// Follows the `VAR X = ...` lines of a vt prompt and returns the names whose
/// resolved value is `value`.
fn resolve_vt(context: &str, value: &str) -> BTreeSet<String> {
    let mut env: HashMap<String, String> = HashMap::new();
    for line in context.lines() {
        let Some(rest) = line.strip_prefix("VAR ") else {
            continue;
        };
        let (name, rhs) = rest.split_once(" = ").expect("assignment shape");
        let resolved = match rhs.strip_prefix("VAR ") {
            Some(src) => env
                .get(src)
                .cloned()
                .expect("variable used before it is assigned"),
            None => rhs.to_string(),
        };
        assert!(
            env.insert(name.to_string(), resolved).is_none(),
            "{name} assigned twice"
        );
    }
    env.into_iter()
        .filter(|(_, v)| v == value)
        .map(|(k, _)| k)
        .collect()
}

#[test]
fn vt_chain_resolves_to_the_answers() {
    for seed in 0..30 {
        let s = gen(Task::VtNoex, 1024 + 64 * seed as usize, seed);
        let question = s.context.lines().last().unwrap();
        let value = question
            .strip_prefix("Question: Find all variables that are assigned the value ")
            .and_then(|r| r.strip_suffix(" in the text above."))
            .expect("vt question shape");
        assert!(value.len() == 5 && value.bytes().all(|b| b.is_ascii_digit()));
        let holders = resolve_vt(&s.context, value);
        let answers: BTreeSet<String> = s.answers.iter().cloned().collect();
        assert_eq!(holders, answers);
        assert_eq!(s.answers.len(), VT_HOPS + 1);
        for a in &s.answers {
            assert!(
                a.len() == 5 && a.bytes().all(|b| b.is_ascii_uppercase()),
                "{a}"
            );
            assert!(!NOISE_LINE.to_lowercase().contains(&a.to_lowercase()));
        }
        assert!(s.context.starts_with(
            "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        ));
        assert_eq!(
            s.answer_prefix,
            format!(
                " Answer: According to the chain(s) of variable assignment in the text above, 5 \
                 variables are assigned the value {value}, they are: "
            )
        );
        // The assignments are spread through the noise, not bunched at one end.
        assert!(s.context.lines().filter(|l| *l == NOISE_LINE).count() > 20);
    }
}

/// The words of the last numbered list in a cwe prompt.
fn last_cwe_list(context: &str) -> Vec<String> {
    let marker = "Memorize the ones that appear most often.\n";
    let start = context.rfind(marker).expect("cwe block") + marker.len();
    let end = start + context[start..].find("\nQuestion:").expect("cwe question");
    let tokens: Vec<&str> = context[start..end].split(' ').collect();
    assert_eq!(tokens.len() % 2, 0);
    tokens
        .chunks(2)
        .enumerate()
        .map(|(i, pair)| {
            assert_eq!(pair[0], format!("{}.", i + 1), "numbering");
            pair[1].to_string()
        })
        .collect()
}

#[test]
fn cwe_answers_are_the_ten_most_frequent_words() {
    for (seed, target) in [
        (1u64, 1024usize),
        (2, 2048),
        (3, 3000),
        (4, 4096),
        (5, 6000),
    ] {
        let s = gen(Task::CweSmall, target, seed);
        let list = last_cwe_list(&s.context);
        let mut freq: BTreeMap<&str, usize> = BTreeMap::new();
        for w in &list {
            *freq.entry(w.as_str()).or_default() += 1;
        }
        let mut by_count: Vec<(usize, &str)> = freq.iter().map(|(w, c)| (*c, *w)).collect();
        by_count.sort_by(|a, b| b.cmp(a));
        assert!(
            by_count.len() > CWE_COMMON,
            "only {} distinct words",
            by_count.len()
        );
        // The 10th most common word is strictly more frequent than the 11th.
        assert!(by_count[CWE_COMMON - 1].0 > by_count[CWE_COMMON].0);
        let top: BTreeSet<&str> = by_count[..CWE_COMMON].iter().map(|(_, w)| *w).collect();
        let answers: BTreeSet<&str> = s.answers.iter().map(|a| a.as_str()).collect();
        assert_eq!(top, answers, "target {target}");
        assert_eq!(s.answers.len(), CWE_COMMON);
        // The one-shot example comes first and uses other words.
        assert_eq!(
            s.context
                .matches("Question: What are the 10 most common words")
                .count(),
            2
        );
        let example_end = s.context.find("\nBelow is a numbered list").unwrap();
        for a in &s.answers {
            assert!(
                !s.context[..example_end].split(' ').any(|w| w == a),
                "{a} in the example"
            );
        }
        assert_eq!(
            s.answer_prefix,
            " Answer: The top 10 words that appear most often in the list are:"
        );
    }
}

#[test]
fn cwe_pool_is_large_and_distinct() {
    let pool = words::cwe_pool();
    assert!(words::COMMON_WORDS.len() >= 500);
    assert!(words::ADJECTIVES.len() >= 200 && words::NOUNS.len() >= 200);
    let distinct: BTreeSet<&str> = pool.iter().copied().collect();
    assert_eq!(distinct.len(), pool.len());
    assert!(pool
        .iter()
        .all(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_lowercase())));
}

#[test]
fn cwe_beyond_the_word_pool_still_fits() {
    let target = 100_000;
    let n = haystack_size_for(Task::CweSmall, target, BUDGET, 1, &ws_tokens).unwrap();
    assert_eq!(n, max_haystack_size(Task::CweSmall, target));
    let s = generate(Task::CweSmall, target, BUDGET, 1, &ws_tokens).unwrap();
    assert!(ws_tokens(&s.prompt()) + BUDGET <= target);
}

#[test]
fn string_match_all_examples() {
    let answers: Vec<String> = ["1234567", "7654321", "Banana"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(string_match_all("I don't know.", &answers), 0.0);
    assert_eq!(string_match_all("", &answers), 0.0);
    assert!((string_match_all("It is 1234567.", &answers) - 1.0 / 3.0).abs() < 1e-12);
    assert!((string_match_all("7654321 and 1234567", &answers) - 2.0 / 3.0).abs() < 1e-12);
    assert_eq!(string_match_all("1234567, 7654321, banana", &answers), 1.0);
    assert_eq!(string_match_all("BANANA 76543210 x1234567x", &answers), 1.0);
    assert_eq!(string_match_all("123456 7", &answers), 0.0);
    let vt = vec!["ABCDE".to_string(), "FGHIJ".to_string()];
    assert_eq!(string_match_all("abcde, fghij", &vt), 1.0);
    assert_eq!(string_match_all("anything", &[]), 0.0);
}

#[test]
fn generated_answers_score_one_on_themselves() {
    for &task in legacy() {
        let s = gen(task, 1024, 21);
        assert_eq!(
            string_match_all(&s.answers.join(", "), &s.answers),
            1.0,
            "{task}"
        );
        assert!(
            string_match_all(&s.answer_prefix, &s.answers) < 1.0,
            "{task}"
        );
    }
}

#[test]
fn sample_round_trips_through_json() {
    let s = gen(Task::VtNoex, 512, 2);
    let json = serde_json::to_string(&s).unwrap();
    assert!(json.contains("\"task\":\"vt_noex\""));
    let back: Sample = serde_json::from_str(&json).unwrap();
    assert_eq!(back, s);
}

fn fnv(h: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *h ^= b as u64;
        *h = h.wrapping_mul(0x100000001b3);
    }
}

/// The earlier tasks give, under their new names, the very samples they gave under their old
/// ones: an FNV-1a digest of 180 prompts and answer lists (6 tasks x 2 budgets and counters x
/// 5 lengths x 3 seeds), 99a73caa2cfc97cf as computed by the generator before the rename
/// (commit 1ec2b22, names niah_single_1, niah_multikey, niah_multivalue, niah_multiquery, vt,
/// cwe).
#[test]
fn earlier_tasks_are_byte_identical_to_before_the_rename() {
    let mut h: u64 = 0xcbf29ce484222325;
    for &task in legacy() {
        for (budget, counter) in [
            (24usize, ws_tokens as Counter),
            (64, char_tokens as Counter),
        ] {
            for target in [700usize, 1024, 2048, 4096, 6000] {
                for seed in 0..3u64 {
                    let s = generate(task, target, budget, seed, &counter).unwrap();
                    fnv(&mut h, s.prompt().as_bytes());
                    fnv(&mut h, &[0]);
                    fnv(&mut h, s.answers.join("\u{1}").as_bytes());
                    fnv(&mut h, &[0]);
                }
            }
        }
    }
    assert_eq!(format!("{h:016x}"), "99a73caa2cfc97cf");
}
