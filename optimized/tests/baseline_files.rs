//! SPEC.md sections 15.5-15.6: every optimized baseline cache, saved and loaded back, attends
//! bit for bit as before, counts the same memory, and goes on growing exactly like the
//! original; its file is the reference cache's; a file of another kind is refused naming it.

use mosaickv_optimized::baselines::{KvqCache, KvqFormat};
use mosaickv_optimized::{DenseF16Cache, QuestF16Cache};
use mosaickv_reference::baselines as reference;
use mosaickv_spec::persist_baseline::{read_baseline, write_baseline, BaselineFile};
use mosaickv_spec::{KvCache, KvShape, MosaicError};
use ndarray::{Array2, Array3};
use rand::{Rng, SeedableRng};

const KV: usize = 2;
const D: usize = 32;

fn kv(seed: u64, tokens: usize) -> (Array3<f32>, Array3<f32>) {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut a = || Array3::from_shape_fn((tokens, KV, D), |_| r.gen_range(-2.0f32..2.0));
    (a(), a())
}

fn queries(seed: u64) -> Array2<f32> {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    Array2::from_shape_fn((2 * KV, D), |_| r.gen_range(-2.0f32..2.0))
}

fn attend(c: &mut dyn KvCache, q: &Array2<f32>) -> Array2<f32> {
    let mut out = Array2::zeros(q.raw_dim());
    c.attend(q.view(), out.view_mut()).unwrap();
    out
}

/// Saved through the bytes of the file, loaded back.
fn through_file(f: BaselineFile) -> BaselineFile {
    let mut b = Vec::new();
    write_baseline(&mut b, &f).unwrap();
    read_baseline(&b).unwrap()
}

fn grow(c: &mut dyn KvCache, seed: u64, n: usize) {
    let (k, v) = kv(seed, n);
    for t in 0..n {
        c.append(
            k.slice(ndarray::s![t, .., ..]),
            v.slice(ndarray::s![t, .., ..]),
        )
        .unwrap();
    }
}

/// `make` builds an empty cache, `save` / `load` its file conversions.
fn round_trip<C: KvCache>(
    make: impl Fn() -> C,
    save: impl Fn(&C) -> BaselineFile,
    load: impl Fn(&BaselineFile) -> mosaickv_spec::Result<C>,
) {
    // empty: loads as an empty cache
    let empty = load(&through_file(save(&make()))).unwrap();
    assert_eq!(empty.len(), 0);
    let mut c = make();
    let (k, v) = kv(1, 150);
    c.prefill(k.view(), v.view()).unwrap();
    grow(&mut c, 2, 23);
    let mut back = load(&through_file(save(&c))).unwrap();
    let q = queries(3);
    assert_eq!(back.len(), c.len());
    assert_eq!(back.memory(), c.memory());
    assert_eq!(attend(&mut back, &q), attend(&mut c, &q));
    grow(&mut c, 4, 40);
    grow(&mut back, 4, 40);
    assert_eq!(back.memory(), c.memory());
    assert_eq!(attend(&mut back, &q), attend(&mut c, &q));
    // and the bytes of a second save are the first's
    assert_eq!(save(&back), save(&c));
}

fn shape() -> KvShape {
    KvShape::new(KV, 2 * KV, D).unwrap()
}

#[test]
fn full_round_trips() {
    round_trip(
        || DenseF16Cache::new(shape()).unwrap(),
        DenseF16Cache::to_file,
        DenseF16Cache::from_file,
    );
}

#[test]
fn quest_round_trips() {
    round_trip(
        || {
            QuestF16Cache::new(shape(), 0.2)
                .unwrap()
                .with_min_budget_tokens(48)
        },
        QuestF16Cache::to_file,
        QuestF16Cache::from_file,
    );
}

#[test]
fn kvq_round_trips() {
    for f in [KvqFormat::Q8_0, KvqFormat::Q4_0] {
        round_trip(
            || KvqCache::new(shape(), f).unwrap(),
            KvqCache::to_file,
            |file| KvqCache::from_file(file, f),
        );
    }
}

/// The same rows give the same file from either implementation, and each loads the other's.
#[test]
fn files_are_the_references() {
    let (k, v) = kv(7, 70);
    let fill = |c: &mut dyn KvCache| {
        c.prefill(k.view(), v.view()).unwrap();
        grow(c, 8, 5);
    };
    let mut full = DenseF16Cache::new(shape()).unwrap();
    let mut full_ref = reference::FullCache::new(shape());
    fill(&mut full);
    fill(&mut full_ref);
    assert_eq!(full.to_file(), full_ref.to_file());
    let mut quest = QuestF16Cache::new(shape(), 0.3)
        .unwrap()
        .with_min_budget_tokens(48);
    let mut quest_ref = reference::QuestCache::new(shape(), 0.3)
        .unwrap()
        .with_min_budget_tokens(48);
    fill(&mut quest);
    fill(&mut quest_ref);
    assert_eq!(quest.to_file(), quest_ref.to_file());
    assert!(reference::QuestCache::from_file(&quest.to_file()).is_ok());
    for (f, rf) in [
        (KvqFormat::Q8_0, reference::KvqFormat::Q8_0),
        (KvqFormat::Q4_0, reference::KvqFormat::Q4_0),
    ] {
        let mut c = KvqCache::new(shape(), f).unwrap();
        let mut r = reference::KvqCache::new(shape(), rf).unwrap();
        fill(&mut c);
        fill(&mut r);
        assert_eq!(c.to_file(), r.to_file());
        let q = queries(9);
        let mut r2 = reference::KvqCache::from_file(&through_file(c.to_file()), rf).unwrap();
        let mut c2 = KvqCache::from_file(&through_file(r.to_file()), f).unwrap();
        assert_eq!(attend(&mut c2, &q), attend(&mut r2, &q));
    }
}

#[test]
fn a_file_of_another_kind_is_refused_naming_it() {
    let (k, v) = kv(6, 20);
    let mut quest = QuestF16Cache::new(shape(), 0.2).unwrap();
    quest.prefill(k.view(), v.view()).unwrap();
    let mut q8 = KvqCache::new(shape(), KvqFormat::Q8_0).unwrap();
    q8.prefill(k.view(), v.view()).unwrap();
    let named = |e: MosaicError, what: &str| {
        assert!(matches!(e, MosaicError::BadFormat(_)), "{e}");
        assert!(e.to_string().contains(what), "{e} lacks {what}");
    };
    named(
        DenseF16Cache::from_file(&quest.to_file()).unwrap_err(),
        "quest baseline file",
    );
    named(
        QuestF16Cache::from_file(&q8.to_file()).unwrap_err(),
        "kvq8 baseline file",
    );
    named(
        KvqCache::from_file(&q8.to_file(), KvqFormat::Q4_0).unwrap_err(),
        "this is a kvq8 baseline file, not a kvq4",
    );
}
