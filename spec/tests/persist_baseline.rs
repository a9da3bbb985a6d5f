//! The baseline caches' files (SPEC.md sections 15.5-15.6): exact round trip of every
//! kind; every truncation, byte flip and crafted defect a typed error, never a panic; a file
//! of one kind refused by the reader of another, naming what it is.

use mosaickv_spec::cache::DenseRows;
use mosaickv_spec::config::{CompressConfig, KvShape};
use mosaickv_spec::persist::{read_cache, read_dense, write_cache, write_dense, FORMAT_VERSION};
use mosaickv_spec::persist_baseline::{
    load_baseline, read_baseline, save_baseline, write_baseline, BaselineFile, BaselineMethod,
    KvqBlocks, KvqFile, Naive2dFile,
};
use mosaickv_spec::{f16, CompressedCache, MosaicError};

const KV: usize = 2;
const D: usize = 32;

/// splitmix64: deterministic test data without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn f16(&mut self) -> f16 {
        f16::from_f32((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0)
    }
}

fn shape() -> KvShape {
    KvShape::new(KV, 2 * KV, D).unwrap()
}

fn rows(rng: &mut Rng, tokens: usize, width: usize) -> DenseRows {
    let n = tokens * KV * width;
    DenseRows {
        tokens,
        keys: (0..n).map(|_| rng.f16()).collect(),
        values: (0..n).map(|_| rng.f16()).collect(),
    }
}

fn dense(method: Option<BaselineMethod>) -> BaselineFile {
    BaselineFile::Dense {
        shape: shape(),
        method,
        rows: rows(&mut Rng(1), 21, D),
    }
}

/// retention 0.25 of D = 32: 8 dims per mask.
fn naive2d(tokens: usize) -> BaselineFile {
    let mask = |h: usize| (0..8).map(|i| 3 * i + h).collect::<Vec<_>>();
    BaselineFile::Naive2d(Naive2dFile {
        shape: shape(),
        token_rate: 0.3,
        retention: 0.25,
        min_budget_tokens: 32,
        masks: (tokens > 0).then(|| {
            (
                (0..KV).map(mask).collect(),
                (0..KV).map(|h| mask(h + 1)).collect(),
            )
        }),
        rows: rows(&mut Rng(2), tokens, 8),
    })
}

/// Blocks as ggml's quantizer writes them: a finite f16 scale, then the quants.
fn kvq(format: KvqBlocks, tokens: usize) -> BaselineFile {
    let mut rng = Rng(3);
    let blocks = tokens * KV * D / 32;
    let mut side = || {
        let mut b = Vec::new();
        for _ in 0..blocks {
            b.extend_from_slice(
                &f16::from_f32(0.01 + (rng.next() % 100) as f32 * 1e-3).to_le_bytes(),
            );
            for _ in 0..format.block_bytes() - 2 {
                b.push(match format {
                    KvqBlocks::Q8_0 => (rng.next() % 255) as u8 ^ 0x80 | 1, // never 0x80 = -128
                    KvqBlocks::Q4_0 => rng.next() as u8,
                });
            }
        }
        b
    };
    let (keys, values) = (side(), side());
    BaselineFile::Kvq(KvqFile {
        shape: shape(),
        format,
        rotated: false,
        tokens,
        keys,
        values,
    })
}

fn all_kinds() -> Vec<BaselineFile> {
    vec![
        dense(None),
        dense(Some(BaselineMethod::Full)),
        dense(Some(BaselineMethod::Quest {
            token_rate: 0.15,
            min_budget_tokens: 64,
        })),
        naive2d(0),
        naive2d(19),
        kvq(KvqBlocks::Q8_0, 0),
        kvq(KvqBlocks::Q8_0, 17),
        kvq(KvqBlocks::Q4_0, 17),
    ]
}

fn bytes(f: &BaselineFile) -> Vec<u8> {
    let mut b = Vec::new();
    write_baseline(&mut b, f).unwrap();
    b
}

fn is_format(e: &MosaicError) -> bool {
    matches!(e, MosaicError::BadFormat(_))
}

#[test]
fn every_kind_round_trips_exactly() {
    for f in all_kinds() {
        let b = bytes(&f);
        assert_eq!(read_baseline(&b).unwrap(), f, "{}", f.describe());
        // Writing what was read gives the same bytes.
        assert_eq!(bytes(&read_baseline(&b).unwrap()), b);
    }
}

#[test]
fn the_clis_dense_file_and_a_saved_full_or_quest_file_are_one_format() {
    let BaselineFile::Dense { shape, rows, .. } = dense(None) else {
        unreachable!()
    };
    let mut cli = Vec::new();
    write_dense(&mut cli, &shape, &rows).unwrap();
    assert_eq!(read_baseline(&cli).unwrap(), dense(None));
    for m in [
        BaselineMethod::Full,
        BaselineMethod::Quest {
            token_rate: 0.15,
            min_budget_tokens: 0,
        },
    ] {
        let (s2, r2) = read_dense(&bytes(&dense(Some(m)))).unwrap();
        assert_eq!((s2, r2), (shape, rows.clone()));
    }
}

#[test]
fn every_truncation_and_byte_flip_is_an_error() {
    for f in all_kinds() {
        let b = bytes(&f);
        for len in 0..b.len() {
            assert!(
                read_baseline(&b[..len]).is_err(),
                "{} cut at {len}",
                f.describe()
            );
        }
        for i in 0..b.len() {
            let mut c = b.clone();
            c[i] ^= 0x10;
            assert!(
                read_baseline(&c).is_err(),
                "{} flipped at {i}",
                f.describe()
            );
        }
        let mut longer = b.clone();
        longer.push(0);
        assert!(is_format(&read_baseline(&longer).unwrap_err()));
    }
}

/// Builds a file from (kind, payload) sections with valid CRCs (SPEC.md 15.1-15.2).
fn file_of(sections: &[(u32, Vec<u8>)]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(b"MOSAICKV");
    b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    b.extend_from_slice(&(sections.len() as u32).to_le_bytes());
    let crc = crc32fast::hash(&b[..16]);
    b.extend_from_slice(&crc.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    for (kind, payload) in sections {
        let len = payload.len() as u64;
        let mut h = crc32fast::Hasher::new();
        h.update(&kind.to_le_bytes());
        h.update(&len.to_le_bytes());
        h.update(payload);
        b.extend_from_slice(&kind.to_le_bytes());
        b.extend_from_slice(&h.finalize().to_le_bytes());
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(payload);
    }
    b
}

fn sections_of(b: &[u8]) -> Vec<(u32, Vec<u8>)> {
    let count = u32::from_le_bytes(b[12..16].try_into().unwrap()) as usize;
    let mut pos = 24;
    let mut out = Vec::new();
    for _ in 0..count {
        let kind = u32::from_le_bytes(b[pos..pos + 4].try_into().unwrap());
        let len = u64::from_le_bytes(b[pos + 8..pos + 16].try_into().unwrap()) as usize;
        out.push((kind, b[pos + 16..pos + 16 + len].to_vec()));
        pos += 16 + len;
    }
    out
}

/// `f`'s file with section `i`'s payload replaced by `edit` of it, checksums recomputed: the
/// defect is past the CRCs, so only the structural checks can catch it.
fn crafted(f: &BaselineFile, i: usize, edit: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut s = sections_of(&bytes(f));
    edit(&mut s[i].1);
    file_of(&s)
}

fn json_edit(from: &str, to: &str) -> impl FnOnce(&mut Vec<u8>) {
    let (from, to) = (from.to_string(), to.to_string());
    move |p: &mut Vec<u8>| {
        let text = String::from_utf8(p.clone()).unwrap();
        assert!(text.contains(&from), "{text} lacks {from}");
        *p = text.replacen(&from, &to, 1).into_bytes();
    }
}

fn u32_at(at: usize, x: u32) -> impl FnOnce(&mut Vec<u8>) {
    move |p: &mut Vec<u8>| p[at..at + 4].copy_from_slice(&x.to_le_bytes())
}

fn refused(b: &[u8], needle: &str) {
    let e = read_baseline(b).expect_err("a crafted file must not load");
    assert!(is_format(&e), "{e}");
    assert!(e.to_string().contains(needle), "{e} lacks {needle:?}");
}

#[test]
fn crafted_manifests_are_refused() {
    let quest = dense(Some(BaselineMethod::Quest {
        token_rate: 0.15,
        min_budget_tokens: 0,
    }));
    refused(
        &crafted(&quest, 0, json_edit("0.15", "1.5")),
        "token_rate 1.5",
    );
    refused(
        &crafted(&quest, 0, json_edit("\"quest\"", "\"quests\"")),
        "dense manifest",
    );
    refused(
        &crafted(
            &quest,
            0,
            json_edit("\"token_rate\"", "\"ratio\":1,\"token_rate\""),
        ),
        "ratio",
    );
    refused(
        &crafted(
            &quest,
            0,
            json_edit(
                "\"quest\",\"token_rate\":0.15",
                "\"naive2d\",\"token_rate\":0.15,\"retention\":0.25",
            ),
        ),
        "full or quest",
    );
    let n = naive2d(19);
    refused(&crafted(&n, 0, json_edit("0.25", "0")), "retention 0");
    // A retention that changes the mask width: the masks section disagrees.
    refused(&crafted(&n, 0, json_edit("0.25", "0.5")), "16");
    refused(
        &crafted(
            &n,
            0,
            json_edit(
                "\"kv_heads\":2,\"q_heads\":4",
                "\"kv_heads\":3,\"q_heads\":4",
            ),
        ),
        "kv_heads 3",
    );
    let k = kvq(KvqBlocks::Q8_0, 17);
    refused(
        &crafted(&k, 0, json_edit("\"kvq8\"", "\"full\"")),
        "dense file",
    );
    refused(
        &crafted(&k, 0, json_edit("\"head_dim\":32", "\"head_dim\":48")),
        "multiple of 32",
    );
}

#[test]
fn crafted_masks_and_rows_are_refused() {
    let n = naive2d(19);
    // masks payload: heads u32, kept u32, then key masks, value masks (u32 dims)
    refused(&crafted(&n, 1, u32_at(0, 3)), "3 heads");
    refused(&crafted(&n, 1, u32_at(4, 7)), "7 channels");
    refused(
        &crafted(&n, 1, u32_at(8, 99)),
        "strictly ascending dims below 32",
    );
    refused(&crafted(&n, 1, u32_at(8 + 4, 0)), "strictly ascending");
    refused(&crafted(&n, 1, |p| p.truncate(p.len() - 4)), "masks");
    // No masks while rows are held.
    refused(
        &crafted(&n, 1, |p| {
            p.truncate(8);
            p[..4].copy_from_slice(&0u32.to_le_bytes());
        }),
        "masks for the 19 rows",
    );
    // Masks without rows.
    refused(
        &crafted(&n, 2, |p| {
            p.clear();
            p.extend_from_slice(&0u64.to_le_bytes());
        }),
        "none before any row",
    );
    // A NaN among the masked rows (payload: tokens u64, then f16 keys).
    refused(
        &crafted(&n, 2, |p| {
            p[8 + 6..8 + 8].copy_from_slice(&f16::NAN.to_le_bytes())
        }),
        "naive2d masked rows",
    );
    let full = dense(Some(BaselineMethod::Full));
    refused(
        &crafted(&full, 1, |p| {
            p[8..10].copy_from_slice(&f16::INFINITY.to_le_bytes())
        }),
        "dense rows",
    );
}

#[test]
fn crafted_kvq_blocks_are_refused() {
    for (f, bb) in [(KvqBlocks::Q8_0, 34), (KvqBlocks::Q4_0, 18)] {
        let k = kvq(f, 17);
        // payload: tokens u64, then key blocks, then value blocks
        let at_block = |b: usize| 8 + b * bb;
        refused(
            &crafted(&k, 1, move |p| {
                p[at_block(5)..at_block(5) + 2].copy_from_slice(&f16::NAN.to_le_bytes())
            }),
            "kvq key blocks",
        );
        let values_start = 17 * KV * (D / 32);
        refused(
            &crafted(&k, 1, move |p| {
                p[at_block(values_start)..at_block(values_start) + 2]
                    .copy_from_slice(&f16::INFINITY.to_le_bytes())
            }),
            "kvq value blocks",
        );
        refused(
            &crafted(&k, 1, |p| p[..8].copy_from_slice(&16u64.to_le_bytes())),
            "trailing",
        );
        refused(
            &crafted(&k, 1, |p| p[..8].copy_from_slice(&u64::MAX.to_le_bytes())),
            "kvq blocks",
        );
    }
    let k = kvq(KvqBlocks::Q8_0, 17);
    refused(&crafted(&k, 1, |p| p[8 + 2] = 0x80), "kvq key blocks"); // quant -128
    refused(
        &crafted(&k, 1, |p| {
            p[8..10].copy_from_slice(&f16::from_f32(-0.5).to_le_bytes())
        }),
        "kvq key blocks",
    );
    // q4_0 scales are signed (d = max / -8): a negative one loads.
    let k4 = kvq(KvqBlocks::Q4_0, 3);
    let b = crafted(&k4, 1, |p| {
        p[8..10].copy_from_slice(&f16::from_f32(-0.5).to_le_bytes())
    });
    assert!(read_baseline(&b).is_ok());
}

#[test]
fn sections_out_of_place_are_refused() {
    let n = naive2d(19);
    let mut s = sections_of(&bytes(&n));
    s.swap(1, 2);
    refused(&file_of(&s), "expected channel masks");
    let mut s = sections_of(&bytes(&n));
    s.pop();
    refused(&file_of(&s), "2 sections, expected 3");
    let mut s = sections_of(&bytes(&dense(None)));
    s.push(s[1].clone());
    refused(&file_of(&s), "3 sections, expected 2");
}

#[test]
fn invalid_caches_are_refused_before_writing() {
    let mut n = naive2d(19);
    if let BaselineFile::Naive2d(f) = &mut n {
        f.masks.as_mut().unwrap().0[1].reverse();
    }
    assert!(matches!(
        write_baseline(&mut Vec::new(), &n),
        Err(MosaicError::ShapeMismatch { .. })
    ));
    let mut k = kvq(KvqBlocks::Q4_0, 4);
    if let BaselineFile::Kvq(f) = &mut k {
        f.values.pop();
    }
    assert!(matches!(
        write_baseline(&mut Vec::new(), &k),
        Err(MosaicError::ShapeMismatch { .. })
    ));
    let q = dense(Some(BaselineMethod::Quest {
        token_rate: 0.0,
        min_budget_tokens: 0,
    }));
    assert!(matches!(
        write_baseline(&mut Vec::new(), &q),
        Err(MosaicError::InvalidConfig(_))
    ));
}

#[test]
fn each_reader_names_the_kind_of_file_it_was_given() {
    let cache = CompressedCache::new(KvShape::new(KV, KV, D).unwrap(), CompressConfig::default());
    let mut mkv = Vec::new();
    write_cache(&mut mkv, &cache, &[], &[]).unwrap();
    let e = read_baseline(&mkv).unwrap_err();
    assert!(
        e.to_string().contains("compressed cache (cache.mkv)"),
        "{e}"
    );
    for (f, named) in [
        (naive2d(19), "naive2d baseline file"),
        (kvq(KvqBlocks::Q4_0, 2), "kvq4 baseline file"),
        (
            dense(Some(BaselineMethod::Quest {
                token_rate: 0.15,
                min_budget_tokens: 0,
            })),
            "quest baseline file",
        ),
    ] {
        let e = read_cache(&bytes(&f)).unwrap_err();
        assert!(is_format(&e) && e.to_string().contains(named), "{e}");
    }
    let e = read_dense(&bytes(&kvq(KvqBlocks::Q8_0, 2))).unwrap_err();
    assert!(e.to_string().contains("kvq8 baseline file"), "{e}");

    let dir = std::env::temp_dir().join(format!("mosaickv-baseline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        (dense(None), "full", true),
        (dense(None), "quest", false),
        (dense(Some(BaselineMethod::Full)), "quest", false),
        (
            dense(Some(BaselineMethod::Quest {
                token_rate: 0.15,
                min_budget_tokens: 0,
            })),
            "full",
            false,
        ),
        (naive2d(19), "naive2d", true),
        (naive2d(19), "kvq8", false),
        (kvq(KvqBlocks::Q8_0, 2), "kvq4", false),
        (kvq(KvqBlocks::Q4_0, 2), "kvq4", true),
    ];
    for (i, (f, want, ok)) in cases.into_iter().enumerate() {
        let path = dir.join(format!("{i}.mkv"));
        save_baseline(&path, &f).unwrap();
        match load_baseline(&path, want) {
            Ok(g) => assert!(ok && g == f, "{} as {want}", f.describe()),
            Err(e) => {
                assert!(!ok, "{} as {want}: {e}", f.describe());
                let text = e.to_string();
                assert!(is_format(&e), "{e}");
                assert!(
                    text.contains(&f.describe()) && text.contains(&format!("not a {want}")),
                    "{e}"
                );
                assert!(text.contains(&path.display().to_string()), "{e}");
            }
        }
    }
    let e = load_baseline(&dir.join("missing.mkv"), "full").unwrap_err();
    assert!(matches!(e, MosaicError::Io(_)), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
