//! RULER's synthetic tasks as NVIDIA/RULER generates them (`scripts/synthetic.yaml`,
//! `scripts/data/synthetic/{niah,variable_tracking,common_words_extraction,
//! freq_words_extraction,constants}.py`), reimplemented on this crate's seeded generator.
//!
//! What follows RULER: every template and needle string ([`NIAH_TEMPLATE`] ...), the task
//! parameters of `synthetic.yaml` ([`NiahParams::of`]), key and value types (wonderwords
//! `adjective-noun` keys, 7-digit numbers, version-4 uuids), the haystacks (noise line,
//! distractor needles, essay words cut into sentences), needle placement (noise and needle
//! haystacks: needles before distinct random haystack lines; essay: at sentence boundaries
//! chosen by depths drawn from [`DEPTHS`]), RULER's singular wording when one value is asked,
//! `vt` with its worked example (3-letter names, sized to 500 tokens) and its trailing spaces,
//! `cwe`'s one-shot example with the answer prefix and its short/long-context settings, `fwe`'s
//! Zipf (alpha 2) counts over `(target - 50) / 50` coded words.
//!
//! Where this differs, and why (also in `docs/ACCURACY.md`):
//! - Python's `random`/`numpy` streams are not reproduced: draws come from ChaCha8 on the
//!   task's stream, so samples are RULER's in distribution, not byte for byte. RULER reuses one
//!   fixed-seed shuffle of the needles, of `cwe`'s list and of `fwe`'s words for every sample;
//!   here each sample shuffles with its own generator.
//! - Essay needles are never placed after the last sentence and never two at one sentence
//!   boundary (RULER maps depth 100 % after the last sentence, and in short haystacks two depths
//!   can map to one boundary): a depth position past the last boundary moves before the last
//!   sentence, coinciding positions move apart by one sentence.
//! - Keys, values and distractor needles are drawn distinct from each other (RULER does not
//!   check; a collision there has a probability below 1e-3 at 32K tokens), so each answer occurs
//!   once in the context.
//! - The `vt` example is sized to 500 tokens by an estimate of four characters per token
//!   ([`vt_example_noise_lines`], 17 noise lines), not by the model's tokenizer, so one seed
//!   gives the same example on every model.
//! - The essay haystack is the King James Bible, not Paul Graham's essays ([`crate::data`]);
//!   sentences are cut by an approximation of NLTK's punkt ([`crate::data::ends_sentence`]).
//! - `cwe` beyond RULER's wonderwords pool (8,169 words, about 80K tokens of list) would switch
//!   to RULER's `english_words.json`, which no registry serves: the haystack stops there.

use std::collections::BTreeSet;

use rand::seq::{index, SliceRandom};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::data::{RulerData, ESSAY_LABEL};
use crate::{Task, NOISE_LINE};

/// RULER's `niah` template (`constants.py`), with `{type_needle_v}`, `{context}`, `{query}`.
pub const NIAH_TEMPLATE: &str = "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?";
/// RULER's `niah` answer prefix.
pub const NIAH_ANSWER_PREFIX: &str =
    " The special magic {type_needle_v} for {query} mentioned in the provided text are";
/// RULER's needle (`niah.py`), also each line of the `needle` haystack.
pub const NIAH_NEEDLE: &str = "One of the special magic {type_needle_v} for {key} is: {value}.";
/// RULER's `variable_tracking` template.
pub const VT_TEMPLATE: &str = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.";
/// RULER's `variable_tracking` answer prefix.
pub const VT_ANSWER_PREFIX: &str = " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the value {query}, they are: ";
/// RULER's `common_words_extraction` template.
pub const CWE_TEMPLATE: &str = "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?";
/// RULER's `common_words_extraction` answer prefix.
pub const CWE_ANSWER_PREFIX: &str =
    " Answer: The top 10 words that appear most often in the list are:";
/// RULER's `freq_words_extraction` template.
pub const FWE_TEMPLATE: &str = "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?";
/// RULER's `freq_words_extraction` answer prefix.
pub const FWE_ANSWER_PREFIX: &str =
    " Answer: According to the coded text above, the three most frequently appeared words are:";

/// RULER's needle depths in percent: `np.round(np.linspace(0, 100, num=40)).astype(int)`.
pub const DEPTHS: [u32; 40] = [
    0, 3, 5, 8, 10, 13, 15, 18, 21, 23, 26, 28, 31, 33, 36, 38, 41, 44, 46, 49, 51, 54, 56, 59, 62,
    64, 67, 69, 72, 74, 77, 79, 82, 85, 87, 90, 92, 95, 97, 100,
];

/// RULER's `tokens_to_generate` per task family (`constants.py`).
pub const NIAH_TOKENS: usize = 128;
/// `variable_tracking`.
pub const VT_TOKENS: usize = 30;
/// `common_words_extraction`.
pub const CWE_TOKENS: usize = 120;
/// `freq_words_extraction`.
pub const FWE_TOKENS: usize = 50;

/// `vt`: chains and hops (`synthetic.yaml`).
pub const VT_CHAINS: usize = 1;
/// Hops per chain: `num_hops + 1` variables hold the value.
pub const VT_HOPS_RULER: usize = 4;
/// `cwe`: `freq_cw`, `freq_ucw`, `num_cw` (`synthetic.yaml`).
pub const CWE_FREQ_CW: usize = 30;
/// Repeats of each uncommon word.
pub const CWE_FREQ_UCW: usize = 3;
/// Common words asked.
pub const CWE_NUM_CW: usize = 10;
/// `fwe`: the Zipf exponent (`synthetic.yaml`) and coded word length (default).
pub const FWE_ALPHA: f64 = 2.0;
/// Letters per coded word.
pub const FWE_WORD_LEN: usize = 6;
/// Smallest nominal word count for `fwe` (below it the three answers' counts can tie).
pub const FWE_MIN_WORDS: usize = 100;
/// Riemann zeta(2) = pi^2 / 6 (`scipy.special.zeta(2.0)`).
const ZETA2: f64 = std::f64::consts::PI * std::f64::consts::PI / 6.0;

/// The three haystacks of RULER's `niah`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Haystack {
    /// [`NOISE_LINE`] repeated, one a line.
    Noise,
    /// The essay's words (here the substitute text), needles between sentences.
    Essay,
    /// Every line a distractor needle with a random key and value.
    Needle,
}

/// RULER's needle key and value types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A 7-digit number.
    Numbers,
    /// A wonderwords `adjective-noun` key.
    Words,
    /// A version-4 uuid.
    Uuids,
}

impl Kind {
    /// RULER's `type_needle_v` word.
    pub const fn plural(self) -> &'static str {
        match self {
            Kind::Numbers => "numbers",
            Kind::Words => "words",
            Kind::Uuids => "uuids",
        }
    }
}

/// A `niah` task's arguments in `synthetic.yaml`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NiahParams {
    /// `type_haystack`.
    pub haystack: Haystack,
    /// `type_needle_k`.
    pub key: Kind,
    /// `type_needle_v`.
    pub value: Kind,
    /// `num_needle_k` (raised to `num_needle_q`, as `niah.py` does).
    pub keys: usize,
    /// `num_needle_v`.
    pub values: usize,
    /// `num_needle_q`.
    pub queries: usize,
}

impl NiahParams {
    /// The parameters of a RULER niah task, `None` for the others.
    pub const fn of(task: Task) -> Option<NiahParams> {
        use Haystack::*;
        use Kind::*;
        const fn p(
            haystack: Haystack,
            key: Kind,
            value: Kind,
            keys: usize,
            values: usize,
            queries: usize,
        ) -> Option<NiahParams> {
            Some(NiahParams {
                haystack,
                key,
                value,
                keys,
                values,
                queries,
            })
        }
        match task {
            Task::NiahSingle1 => p(Noise, Words, Numbers, 1, 1, 1),
            Task::NiahSingle2 => p(Essay, Words, Numbers, 1, 1, 1),
            Task::NiahSingle3 => p(Essay, Words, Uuids, 1, 1, 1),
            Task::NiahMultikey1 => p(Essay, Words, Numbers, 4, 1, 1),
            Task::NiahMultikey2 => p(Needle, Words, Numbers, 1, 1, 1),
            Task::NiahMultikey3 => p(Needle, Uuids, Uuids, 1, 1, 1),
            Task::NiahMultivalue => p(Essay, Words, Numbers, 1, 4, 1),
            Task::NiahMultiquery => p(Essay, Words, Numbers, 4, 1, 4),
            _ => None,
        }
    }

    /// Needles in the context.
    pub const fn needles(&self) -> usize {
        self.keys * self.values
    }
}

/// Smallest haystack size RULER's generator for `task` uses: one noise or distractor line per
/// needle (RULER samples distinct lines to insert before), 5 lines for `vt`, no word for the
/// essay and `cwe`, [`FWE_MIN_WORDS`] for `fwe`.
pub fn min_haystack_size(task: Task) -> usize {
    if let Some(p) = NiahParams::of(task) {
        return match p.haystack {
            Haystack::Essay => 0,
            _ => p.needles(),
        };
    }
    match task {
        Task::Vt => VT_CHAINS * (VT_HOPS_RULER + 1),
        Task::Fwe => FWE_MIN_WORDS,
        _ => 0,
    }
}

/// Python's `str.format` for named fields: each `{name}` replaced by its value, in one pass
/// (a value's own braces are left alone).
pub fn fill(template: &str, fields: &[(&str, &str)]) -> String {
    let mut out =
        String::with_capacity(template.len() + fields.iter().map(|f| f.1.len()).sum::<usize>());
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match after.find('}') {
            Some(close) => {
                let name = &after[..close];
                match fields.iter().find(|f| f.0 == name) {
                    Some((_, v)) => out.push_str(v),
                    None => {
                        out.push('{');
                        out.push_str(name);
                        out.push('}');
                    }
                }
                rest = &after[close + 1..];
            }
            None => {
                out.push_str(&rest[open..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// RULER's singular wording when one value is asked (`niah.py`):
/// `replace('Some', 'A')`, `replace('are all', 'is')`, `replace('are', 'is')`,
/// `replace('answers', 'answer')`, on the template before it is filled.
pub fn singular(template: &str) -> String {
    template
        .replace("Some", "A")
        .replace("are all", "is")
        .replace("are", "is")
        .replace("answers", "answer")
}

/// A rendered sample's parts: `(context, answer_prefix, answers, haystack label)`.
pub(crate) type Parts = (String, String, Vec<String>, String);

/// Renders RULER task `task` with haystack size `n` (lines, essay words, `cwe` uncommon words
/// or `fwe` nominal words; raised to [`min_haystack_size`]).
pub(crate) fn render(
    task: Task,
    rng: &mut ChaCha8Rng,
    n: usize,
    target_tokens: usize,
    data: Option<&RulerData>,
) -> Parts {
    let n = n.max(min_haystack_size(task));
    if let Some(p) = NiahParams::of(task) {
        return render_niah(rng, &p, n, data.expect("niah needs the data"));
    }
    match task {
        Task::Vt => render_vt(rng, n),
        Task::Cwe => render_cwe(rng, n, target_tokens, data.expect("cwe needs the data")),
        Task::Fwe => render_fwe(rng, n, target_tokens),
        _ => unreachable!("{task} is not a RULER task"),
    }
}

/// A 7-digit number (`random.randint(10**6, 10**7 - 1)`).
fn number(rng: &mut ChaCha8Rng) -> String {
    rng.gen_range(1_000_000..=9_999_999u32).to_string()
}

/// `str(uuid.UUID(int=random.getrandbits(128), version=4))`.
pub fn uuid4(rng: &mut ChaCha8Rng) -> String {
    let mut v: u128 = rng.gen();
    v &= !(0xc000u128 << 48);
    v |= 0x8000u128 << 48;
    v &= !(0xf000u128 << 64);
    v |= 4u128 << 76;
    let h = format!("{v:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

fn draw(rng: &mut ChaCha8Rng, kind: Kind, data: &RulerData) -> String {
    match kind {
        Kind::Numbers => number(rng),
        Kind::Words => data.key(rng.gen_range(0..data.key_count())),
        Kind::Uuids => uuid4(rng),
    }
}

/// `niah.py`'s `generate_input_output`.
fn render_niah(rng: &mut ChaCha8Rng, p: &NiahParams, n: usize, data: &RulerData) -> Parts {
    let fmt_needle = |key: &str, value: &str| {
        fill(
            NIAH_NEEDLE,
            &[
                ("type_needle_v", p.value.plural()),
                ("key", key),
                ("value", value),
            ],
        )
    };
    // keys and their values, all distinct
    let mut used: BTreeSet<String> = BTreeSet::new();
    let fresh = |rng: &mut ChaCha8Rng, kind: Kind, used: &mut BTreeSet<String>| loop {
        let s = draw(rng, kind, data);
        if used.insert(s.clone()) {
            break s;
        }
    };
    let mut keys = Vec::with_capacity(p.keys);
    let mut values: Vec<Vec<String>> = Vec::with_capacity(p.keys);
    let mut needles = Vec::with_capacity(p.needles());
    for _ in 0..p.keys {
        let key = fresh(rng, p.key, &mut used);
        let vs: Vec<String> = (0..p.values)
            .map(|_| fresh(rng, p.value, &mut used))
            .collect();
        for v in &vs {
            needles.push(fmt_needle(&key, v));
        }
        keys.push(key);
        values.push(vs);
    }
    needles.shuffle(rng);
    // query and answers (RULER draws them after the haystack; drawn here first so that keys,
    // values and the question do not depend on the haystack size)
    let asked = index::sample(rng, p.keys, p.queries).into_vec();
    let queries: Vec<&str> = asked.iter().map(|&i| keys[i].as_str()).collect();
    let answers: Vec<String> = asked.iter().flat_map(|&i| values[i].clone()).collect();
    let query = match queries.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{}, and {last}", rest.join(", ")),
        _ => queries.concat(),
    };

    let (context, label) = match p.haystack {
        Haystack::Noise | Haystack::Needle => {
            let lines: Vec<String> = if p.haystack == Haystack::Noise {
                vec![NOISE_LINE.to_string(); n]
            } else {
                (0..n)
                    .map(|_| loop {
                        let k = draw(rng, p.key, data);
                        let v = draw(rng, p.value, data);
                        if !used.contains(&k) && !used.contains(&v) {
                            break fmt_needle(&k, &v);
                        }
                    })
                    .collect()
            };
            // `indexes = sorted(random.sample(range(n), k), reverse=True)`, needle i inserted
            // at the i-th largest index: each needle goes before a distinct haystack line, in
            // reverse list order
            let mut at = index::sample(rng, n, needles.len()).into_vec();
            at.sort_unstable();
            let mut out: Vec<&str> = Vec::with_capacity(n + needles.len());
            let mut next = 0;
            for (i, line) in lines.iter().enumerate() {
                if next < at.len() && at[next] == i {
                    out.push(&needles[needles.len() - 1 - next]);
                    next += 1;
                }
                out.push(line);
            }
            let label = if p.haystack == Haystack::Noise {
                "noise"
            } else {
                "needle"
            };
            (out.join("\n"), label.to_string())
        }
        Haystack::Essay => (
            essay_context(rng, data, n, &needles),
            ESSAY_LABEL.to_string(),
        ),
    };

    let (template, prefix, type_v) = if p.queries * p.values == 1 {
        let plural = p.value.plural();
        (
            singular(NIAH_TEMPLATE),
            singular(NIAH_ANSWER_PREFIX),
            &plural[..plural.len() - 1],
        )
    } else {
        (
            NIAH_TEMPLATE.to_string(),
            NIAH_ANSWER_PREFIX.to_string(),
            p.value.plural(),
        )
    };
    let fields = [
        ("type_needle_v", type_v),
        ("context", context.as_str()),
        ("query", query.as_str()),
    ];
    (
        fill(&template, &fields),
        fill(&prefix, &fields),
        answers,
        label,
    )
}

/// Needle positions (sentence boundaries, `0..sentences`) for `k` needles: RULER's
/// `int(len(document_sents) * (depth / 100))` for `k` depths drawn from [`DEPTHS`], sorted;
/// then, when there are at least `k` sentences, none after the last sentence and no two at one
/// boundary (see the module notes).
pub fn essay_positions(rng: &mut ChaCha8Rng, sentences: usize, k: usize) -> Vec<usize> {
    let mut pos: Vec<usize> = index::sample(rng, DEPTHS.len(), k)
        .into_iter()
        .map(|i| (sentences as f64 * (DEPTHS[i] as f64 / 100.0)) as usize)
        .collect();
    pos.sort_unstable();
    if sentences >= k && k > 0 {
        for i in 0..k {
            pos[i] = pos[i].min(sentences - 1);
            if i > 0 && pos[i] <= pos[i - 1] {
                pos[i] = pos[i - 1] + 1;
            }
        }
        for i in (0..k).rev() {
            let limit = if i + 1 == k {
                sentences - 1
            } else {
                pos[i + 1] - 1
            };
            pos[i] = pos[i].min(limit);
        }
    }
    pos
}

/// The essay context: the first `n` words cut into sentences, `needles` inserted in order at
/// [`essay_positions`], pieces joined by single spaces as `niah.py` joins them.
fn essay_context(rng: &mut ChaCha8Rng, data: &RulerData, n: usize, needles: &[String]) -> String {
    let essay = &data.essay;
    let sents = essay.sentences(n);
    let s = sents.len();
    let mut bounds = vec![0];
    bounds.extend(essay_positions(rng, s, needles.len()));
    bounds.push(s);
    let sentence_text = |range: &[(usize, usize)]| -> String {
        let mut t = String::new();
        for &(a, b) in range {
            for w in a..b {
                if !t.is_empty() {
                    t.push(' ');
                }
                t.push_str(essay.word(w));
            }
        }
        t
    };
    let mut pieces: Vec<String> = Vec::with_capacity(2 * needles.len() + 1);
    for i in 1..bounds.len() {
        pieces.push(sentence_text(&sents[bounds[i - 1]..bounds[i]]));
        if i - 1 < needles.len() {
            pieces.push(needles[i - 1].clone());
        }
    }
    pieces.join(" ")
}

/// `len` distinct upper-case names of `letters` letters, none equal to `VAR` or in `avoid`.
fn names(rng: &mut ChaCha8Rng, count: usize, letters: usize, avoid: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(count);
    while out.len() < count {
        let name: String = (0..letters)
            .map(|_| char::from(b'A' + rng.gen_range(0..26u8)))
            .collect();
        if name != "VAR" && !out.contains(&name) && !avoid.contains(&name) {
            out.push(name);
        }
    }
    out
}

/// `vt`'s chain lines: `VAR {v0} = {value}`, then `VAR {v(j+1)} = VAR {vj} ` (with RULER's
/// trailing space).
fn vt_chain(names: &[String], value: &str) -> Vec<String> {
    let mut chain = vec![format!("VAR {} = {value}", names[0])];
    for j in 0..names.len() - 1 {
        chain.push(format!("VAR {} = VAR {} ", names[j + 1], names[j]));
    }
    chain
}

/// `variable_tracking.py`'s noise layout: chain line j goes before original noise line
/// `pos_j` for `pos = sorted(random.sample(range(n), len(chain)))`.
fn vt_noise(rng: &mut ChaCha8Rng, n: usize, chain: &[String]) -> String {
    let mut at = index::sample(rng, n, chain.len()).into_vec();
    at.sort_unstable();
    let mut out: Vec<&str> = Vec::with_capacity(n + chain.len());
    let mut next = 0;
    for i in 0..n {
        if next < at.len() && at[next] == i {
            out.push(&chain[next]);
            next += 1;
        }
        out.push(NOISE_LINE);
    }
    out.join("\n")
}

fn vt_question(context: &str, value: &str) -> (String, String) {
    let num_v = (VT_HOPS_RULER + 1).to_string();
    let fields = [
        ("context", context),
        ("query", value),
        ("num_v", num_v.as_str()),
    ];
    (fill(VT_TEMPLATE, &fields), fill(VT_ANSWER_PREFIX, &fields))
}

/// Noise lines of the `vt` worked example: RULER sizes it to at most 500 tokens of the model's
/// tokenizer (at least 5 lines); here tokens are estimated as characters / 4 (rounded up).
pub fn vt_example_noise_lines() -> usize {
    let names: Vec<String> = ["AAA", "BBB", "CCC", "DDD", "EEE"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let chain = vt_chain(&names, "12345");
    let chars = |m: usize| {
        let chain_chars: usize = chain.iter().map(String::len).sum();
        let context = chain_chars + m * NOISE_LINE.len() + (m + chain.len() - 1);
        let (t, a) = vt_question("", "12345");
        t.len() + a.len() + context
    };
    let mut m = VT_HOPS_RULER + 1;
    while chars(m + 1).div_ceil(4) <= 500 {
        m += 1;
    }
    m
}

/// `variable_tracking.py` with its worked example: the example (3-letter names, its own
/// value, [`vt_example_noise_lines`] noise lines) with its answer, a blank line... then the
/// task on `n` noise lines.
fn render_vt(rng: &mut ChaCha8Rng, n: usize) -> Parts {
    let hops = VT_HOPS_RULER + 1;
    let task_names = names(rng, hops, 5, &[]);
    let value = rng.gen_range(10_000..=99_998u32).to_string();
    let example_names = names(rng, hops, 3, &[]);
    let example_value = loop {
        let v = rng.gen_range(10_000..=99_998u32).to_string();
        if v != value {
            break v;
        }
    };
    let m = vt_example_noise_lines();
    let example_context = vt_noise(rng, m, &vt_chain(&example_names, &example_value));
    let (q, a) = vt_question(&example_context, &example_value);
    // `icl_example = input + " " + " ".join(outputs) + "\n"`, then `icl + "\n" + input`
    let example = format!("{q}{a} {}\n", example_names.join(" "));
    let context = vt_noise(rng, n, &vt_chain(&task_names, &value));
    let (question, prefix) = vt_question(&context, &value);
    (
        format!("{example}\n{question}"),
        prefix,
        task_names,
        "noise".to_string(),
    )
}

/// `1. w1 2. w2 ...`
fn numbered<S: AsRef<str>>(words: &[S]) -> String {
    let items: Vec<String> = words
        .iter()
        .enumerate()
        .map(|(i, w)| format!("{}. {}", i + 1, w.as_ref()))
        .collect();
    items.join(" ")
}

/// `common_words_extraction.py`'s `get_example`: `num_words` words drawn from the pool, the
/// first 10 repeated `common` times, the rest `uncommon` times, shuffled.
fn cwe_example<'a>(
    rng: &mut ChaCha8Rng,
    pool: &'a [String],
    num_words: usize,
    common: usize,
    uncommon: usize,
) -> (Vec<&'a str>, Vec<&'a str>) {
    let picked: Vec<&str> = index::sample(rng, pool.len(), num_words.min(pool.len()))
        .into_iter()
        .map(|i| pool[i].as_str())
        .collect();
    let (c, u) = picked.split_at(CWE_NUM_CW.min(picked.len()));
    let mut list = Vec::with_capacity(c.len() * common + u.len() * uncommon);
    for _ in 0..common {
        list.extend_from_slice(c);
    }
    for _ in 0..uncommon {
        list.extend_from_slice(u);
    }
    list.shuffle(rng);
    (list, c.to_vec())
}

/// `common_words_extraction.py`: one example with its answer, then the task's list of 10
/// common and `n` uncommon words; below 4,096 target tokens RULER's short settings (20-word
/// example 3/1, list 6/1), else the long ones (40-word example 10/3, list 30/3).
fn render_cwe(rng: &mut ChaCha8Rng, n: usize, target_tokens: usize, data: &RulerData) -> Parts {
    let pool = &data.cwe_words;
    let long = target_tokens >= crate::CWE_LONG_CONTEXT;
    let (ex_words, ex_c, ex_u, c, u) = if long {
        (40, 10, 3, CWE_FREQ_CW, CWE_FREQ_UCW)
    } else {
        (20, 3, 1, 6, 1)
    };
    let (ex_list, ex_answer) = cwe_example(rng, pool, ex_words, ex_c, ex_u);
    let (list, answer) = cwe_example(rng, pool, CWE_NUM_CW + n, c, u);
    let example = format!(
        "{}{CWE_ANSWER_PREFIX} {}",
        fill(CWE_TEMPLATE, &[("context", &numbered(&ex_list))]),
        numbered(&ex_answer)
    );
    let task = fill(CWE_TEMPLATE, &[("context", &numbered(&list))]);
    (
        format!("{example}\n{task}"),
        CWE_ANSWER_PREFIX.to_string(),
        answer.iter().map(|w| w.to_string()).collect(),
        "words".to_string(),
    )
}

/// `fwe`'s vocabulary size: `(target - tokens_to_generate) // 50` (at least 5).
pub fn fwe_vocab_size(target_tokens: usize) -> usize {
    (target_tokens.saturating_sub(FWE_TOKENS) / 50).max(5)
}

/// Occurrences of the coded word of rank `k` (1-based) among `n` nominal words:
/// `int(n * k**-alpha / zeta(alpha))`.
pub fn fwe_count(n: usize, k: usize) -> usize {
    (n as f64 * (k as f64).powf(-FWE_ALPHA) / ZETA2) as usize
}

/// `freq_words_extraction.py`: random 6-letter coded words, rank 1 replaced by `...`, each
/// word of rank k [`fwe_count`] times, shuffled; the answers are ranks 2-4.
fn render_fwe(rng: &mut ChaCha8Rng, n: usize, target_tokens: usize) -> Parts {
    let v = fwe_vocab_size(target_tokens);
    let mut vocab: BTreeSet<String> = BTreeSet::new();
    while vocab.len() < v {
        let w: String = (0..FWE_WORD_LEN)
            .map(|_| char::from(b'a' + rng.gen_range(0..26u8)))
            .collect();
        vocab.insert(w);
    }
    let mut vocab: Vec<String> = vocab.into_iter().collect();
    vocab.shuffle(rng);
    vocab[0] = "...".to_string();
    let mut words: Vec<&str> = Vec::new();
    for (k, w) in vocab.iter().enumerate() {
        for _ in 0..fwe_count(n, k + 1) {
            words.push(w);
        }
    }
    words.shuffle(rng);
    (
        fill(FWE_TEMPLATE, &[("context", &words.join(" "))]),
        FWE_ANSWER_PREFIX.to_string(),
        vocab[1..4].to_vec(),
        "coded words".to_string(),
    )
}
