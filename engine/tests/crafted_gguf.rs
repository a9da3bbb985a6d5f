//! Crafted GGUF files (issue 13 item 6): every malformed header, count, length, offset or
//! model shape gives a typed error from `check_gguf_file` / `Model::load`, never a panic, an
//! abort or an allocation sized by the file. The tiny model they start from loads and runs.

mod common;

use common::*;
use mosaickv_engine::gguf::{
    read_content_from_bytes, MAX_ARRAY_DEPTH, MAX_DIMS, MAX_METADATA_VALUES,
};
use mosaickv_engine::{argmax, check_gguf_file, DecodeWeights, EngineError, Model, RopeStyle};

fn write(bytes: &[u8]) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("crafted.gguf");
    std::fs::write(&p, bytes).unwrap();
    (dir, p)
}

/// The error `check_gguf_file` gives on `bytes` (it must give one).
fn check_err(bytes: &[u8]) -> EngineError {
    let (_dir, p) = write(bytes);
    match check_gguf_file(&p) {
        Ok(_) => panic!("a crafted file passed check_gguf_file"),
        Err(e) => e,
    }
}

/// The error `Model::load` gives on `bytes` (it must give one).
fn load_err(bytes: &[u8]) -> EngineError {
    let (_dir, p) = write(bytes);
    match Model::load(&p) {
        Ok(_) => panic!("a crafted model loaded"),
        Err(e) => e,
    }
}

fn assert_format(e: EngineError, needle: &str) {
    match &e {
        EngineError::Format(m) if m.contains(needle) => {}
        _ => panic!("expected a Format error containing {needle:?}, got {e:?}"),
    }
}

fn assert_truncated(e: EngineError) {
    assert!(
        matches!(e, EngineError::Truncated { .. }),
        "expected Truncated, got {e:?}"
    );
}

/// A header with `n_kv` metadata pairs and no tensors, followed by `rest`.
fn header(n_kv: u64, rest: &[u8]) -> Vec<u8> {
    let mut v = b"GGUF".to_vec();
    v.extend(3u32.to_le_bytes());
    v.extend(0u64.to_le_bytes());
    v.extend(n_kv.to_le_bytes());
    v.extend_from_slice(rest);
    v
}

/// A tiny `qwen2` model: its keys are read under its own prefix, its biases are applied and its
/// RoPE is NEOX. Prefill (f32, batched) and a decode step (f32 weights, one row) must give the
/// same logits, which they only do if both add the biases and rotate the same pairs; a
/// missing bias is a typed error.
#[test]
fn a_tiny_qwen2_model_loads_and_its_paths_agree() {
    let dir = tempfile::tempdir().unwrap();
    let t = Tiny {
        arch: "qwen2",
        biases: true,
        hidden: 64,
        q_heads: 2,
        kv_heads: 1,
        ..Tiny::default()
    };
    let model = Model::load(&t.write(dir.path(), "qwen.gguf")).unwrap();
    let c = model.config();
    assert_eq!(c.arch, mosaickv_engine::Arch::Qwen2);
    assert_eq!(c.rope, RopeStyle::Neox);
    assert!(c.qkv_bias);
    assert_eq!((c.q_heads, c.kv_heads, c.head_dim), (2, 1, 32));
    let toks = [3, 4, 5, 6, 7, 3, 4];
    let full = model.prefill(&toks).unwrap();
    let part = model.prefill(&toks[..6]).unwrap();
    let mut caches = model.new_full_caches();
    part.fill(&mut caches).unwrap();
    let step = model
        .decode_step_with(4, 6, &mut caches, DecodeWeights::F32)
        .unwrap();
    let d = full
        .logits
        .iter()
        .zip(&step)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(d < 1e-2, "prefill vs decode: {d}");
    assert_eq!(argmax(&full.logits), argmax(&step));
    // the biases matter: without them the keys differ
    let plain = Tiny {
        biases: false,
        arch: "llama",
        ..t.clone()
    };
    let llama = Model::load(&plain.write(dir.path(), "llama.gguf")).unwrap();
    assert_eq!(llama.config().rope, RopeStyle::Interleaved);
    let lk = llama.prefill(&toks).unwrap();
    assert!((&lk.keys[0] - &full.keys[0]).iter().any(|x| x.abs() > 1e-3));
    // qwen2 without biases is refused
    assert_format(
        load_err(
            &Tiny {
                biases: false,
                ..t.clone()
            }
            .gguf()
            .bytes(),
        ),
        "attn_q.bias",
    );
}

/// `decode_batch` on the tiny `qwen2` model (biases, NEOX RoPE) equals `decode_step` per
/// sequence bit for bit, with sequences at different positions; a bad token fails only its own
/// sequence.
#[test]
fn the_tiny_qwen2_model_decodes_the_same_in_a_batch() {
    use mosaickv_engine::BatchSeq;
    let dir = tempfile::tempdir().unwrap();
    let t = Tiny {
        arch: "qwen2",
        biases: true,
        hidden: 64,
        q_heads: 2,
        kv_heads: 1,
        ..Tiny::default()
    };
    let model = Model::load(&t.write(dir.path(), "qwen.gguf")).unwrap();
    let prompts: [&[u32]; 3] = [&[3, 4, 5], &[7, 3, 4, 5, 6, 7], &[5]];
    let fresh = |p: &[u32]| {
        let mut caches = model.new_full_caches();
        model.prefill(p).unwrap().fill(&mut caches).unwrap();
        caches
    };
    let mut alone: Vec<_> = prompts.iter().map(|p| fresh(p)).collect();
    let mut together: Vec<_> = prompts.iter().map(|p| fresh(p)).collect();
    let mut bad = fresh(&[3]);
    let vocab = model.config().vocab as u32;
    for step in 0..3 {
        let tokens: Vec<u32> = (0..prompts.len()).map(|i| (3 + i + step) as u32).collect();
        let mut batch: Vec<BatchSeq> = together
            .iter_mut()
            .zip(&prompts)
            .zip(&tokens)
            .map(|((caches, p), &token)| BatchSeq {
                token,
                pos: p.len() + step,
                caches,
            })
            .collect();
        batch.push(BatchSeq {
            token: vocab,
            pos: 1 + step,
            caches: &mut bad,
        });
        let out = model.decode_batch(&mut batch);
        assert!(
            out[prompts.len()].is_err(),
            "a bad token must fail its sequence"
        );
        for (i, caches) in alone.iter_mut().enumerate() {
            let one = model
                .decode_step(tokens[i], prompts[i].len() + step, caches)
                .unwrap();
            let got = out[i].as_ref().unwrap();
            assert!(
                got.iter()
                    .zip(&one)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "step {step}, sequence {i}"
            );
        }
    }
}

#[test]
fn the_tiny_model_loads_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::load(&Tiny::default().write(dir.path(), "tiny.gguf")).unwrap();
    let c = model.config();
    assert_eq!(
        (c.n_layers, c.hidden, c.q_heads, c.kv_heads, c.head_dim, c.vocab),
        (1, 32, 1, 1, 32, VOCAB.len())
    );
    let pre = model.prefill(&[3, 4, 5, 6]).unwrap();
    assert_eq!(pre.len(), 4);
    let mut caches = model.new_full_caches();
    pre.fill(&mut caches).unwrap();
    let logits = model.decode_step(7, 4, &mut caches).unwrap();
    assert_eq!(logits.len(), VOCAB.len());
    assert!(logits.iter().all(|x| x.is_finite()));
}

/// Issue 36: numbers the forward pass cannot run with are refused at load, not turned into
/// garbage text (a fuzzer's NaN epsilon, a zero RoPE base, an empty context).
#[test]
fn non_finite_or_non_positive_norm_rope_and_context_are_errors() {
    for (t, needle) in [
        (
            Tiny {
                rms_eps: f32::NAN,
                ..Tiny::default()
            },
            "layer_norm_rms_epsilon",
        ),
        (
            Tiny {
                rms_eps: 0.0,
                ..Tiny::default()
            },
            "layer_norm_rms_epsilon",
        ),
        (
            Tiny {
                rms_eps: -1e-5,
                ..Tiny::default()
            },
            "layer_norm_rms_epsilon",
        ),
        (
            Tiny {
                rope_base: f32::INFINITY,
                ..Tiny::default()
            },
            "rope.freq_base",
        ),
        (
            Tiny {
                rope_base: 0.0,
                ..Tiny::default()
            },
            "rope.freq_base",
        ),
        (
            Tiny {
                rope_base: -10000.0,
                ..Tiny::default()
            },
            "rope.freq_base",
        ),
        (
            Tiny {
                context: 0,
                ..Tiny::default()
            },
            "context_length",
        ),
    ] {
        assert_format(load_err(&t.gguf().bytes()), needle);
    }
    // a prompt longer than the context is a typed error, not a silent wrap of RoPE positions
    let dir = tempfile::tempdir().unwrap();
    let short = Tiny {
        context: 8,
        ..Tiny::default()
    };
    let model = Model::load(&short.write(dir.path(), "short.gguf")).unwrap();
    let e = model.prefill(&[3, 4, 5, 6, 7, 3, 4, 5, 6]).unwrap_err();
    assert!(e.to_string().contains("context"), "{e}");
    model.prefill(&[3, 4, 5, 6, 7, 3, 4, 5]).unwrap();
}

#[test]
fn zero_query_heads_is_an_error() {
    let t = Tiny {
        meta_heads: Some(0),
        ..Tiny::default()
    };
    assert_format(load_err(&t.gguf().bytes()), "head_count");
}

#[test]
fn zero_kv_heads_is_an_error() {
    // K and V weights with zero rows match a KV head count of 0 (the old code loaded this and
    // divided by zero in prefill); the header reader refuses empty tensors
    let t = Tiny {
        kv_heads: 0,
        ..Tiny::default()
    };
    assert_format(load_err(&t.gguf().bytes()), "no elements");
    // the metadata says 0 with real K/V weights
    let t = Tiny {
        meta_kv_heads: Some(0),
        ..Tiny::default()
    };
    assert_format(load_err(&t.gguf().bytes()), "head_count_kv");
}

#[test]
fn an_empty_tensor_is_an_error() {
    // candle built a misaligned empty slice for it (undefined behaviour; found by fuzzing)
    assert_format(check_err(&with_tensor(&[0, 32], F32, 0)), "no elements");
}

#[test]
fn zero_blocks_is_an_error() {
    let t = Tiny {
        layers: 0,
        ..Tiny::default()
    };
    assert_format(load_err(&t.gguf().bytes()), "block_count");
}

#[test]
fn a_huge_block_count_is_an_error_not_an_allocation() {
    for blocks in [u32::MAX, 1 << 20, 2] {
        let t = Tiny {
            meta_blocks: Some(blocks),
            ..Tiny::default()
        };
        assert_format(load_err(&t.gguf().bytes()), "blk.1.");
    }
}

#[test]
fn huge_string_lengths_are_truncation_errors() {
    for len in [1u64 << 40, u64::MAX] {
        // as a metadata key
        assert_truncated(check_err(&header(1, &len.to_le_bytes())));
        // as a string value
        let mut kv = string("general.name");
        kv.extend(T_STRING.to_le_bytes());
        kv.extend(len.to_le_bytes());
        assert_truncated(check_err(&header(1, &kv)));
    }
}

#[test]
fn huge_array_lengths_are_truncation_errors() {
    for (elem, len) in [(0u32, 1u64 << 40), (T_STRING, u64::MAX), (T_ARRAY, 1 << 50)] {
        let mut kv = string("tokenizer.ggml.tokens");
        kv.extend(T_ARRAY.to_le_bytes());
        kv.extend(elem.to_le_bytes());
        kv.extend(len.to_le_bytes());
        kv.extend([0u8; 64]);
        assert_truncated(check_err(&header(1, &kv)));
    }
}

#[test]
fn huge_counts_are_truncation_errors() {
    let g = Tiny::default().gguf();
    assert_truncated(check_err(&g.bytes_with_counts(u64::MAX, 16)));
    assert_truncated(check_err(&g.bytes_with_counts(10, 1 << 40)));
}

#[test]
fn more_metadata_values_than_the_limit_is_an_error() {
    let n = MAX_METADATA_VALUES + 1;
    let mut kv = string("general.blob");
    kv.extend(T_ARRAY.to_le_bytes());
    kv.extend(0u32.to_le_bytes()); // u8
    kv.extend(n.to_le_bytes());
    kv.resize(kv.len() + n as usize, 7);
    assert_format(check_err(&header(1, &kv)), "metadata values");
}

#[test]
fn deeply_nested_arrays_are_an_error() {
    // one array of one array of ... (candle's reader recursed until the stack overflowed)
    let depth = 200_000;
    let mut kv = string("general.nested");
    kv.extend(T_ARRAY.to_le_bytes());
    for _ in 0..depth {
        kv.extend(T_ARRAY.to_le_bytes());
        kv.extend(1u64.to_le_bytes());
    }
    assert_format(
        check_err(&header(1, &kv)),
        &format!("nested more than {MAX_ARRAY_DEPTH} deep"),
    );
}

#[test]
fn a_zero_or_odd_alignment_is_an_error() {
    for a in [0, 24] {
        let t = Tiny {
            alignment: Some(a),
            ..Tiny::default()
        };
        assert_format(check_err(&t.gguf().bytes()), "general.alignment");
    }
}

/// The tiny model plus one extra tensor info.
fn with_tensor(dims: &[u64], dtype: u32, offset: u64) -> Vec<u8> {
    let mut g = Tiny::default().gguf();
    g.tensor_info("extra.weight", dims, dtype, offset);
    g.bytes()
}

#[test]
fn tensor_offsets_past_the_end_are_truncation_errors() {
    // u64::MAX - 15 made the old end-of-data sum wrap to a small number and pass
    for offset in [1 << 30, u64::MAX - 15, u64::MAX] {
        assert_truncated(check_err(&with_tensor(&[32], F32, offset)));
    }
}

#[test]
fn overflowing_dimensions_are_an_error() {
    // 2^96 elements: the old element count wrapped to 0 bytes and passed
    assert_format(
        check_err(&with_tensor(&[1 << 32, 1 << 32, 1 << 32], F32, 0)),
        "overflows",
    );
    // 2^62 Q4_1 blocks of 20 bytes overflow the byte size
    assert_format(
        check_err(&with_tensor(&[1 << 35, 1 << 32], Q4_1, 0)),
        "overflows",
    );
}

#[test]
fn too_many_dimensions_or_partial_blocks_are_errors() {
    let dims = vec![1u64; MAX_DIMS + 1];
    assert_format(check_err(&with_tensor(&dims, F32, 0)), "dimensions");
    // 16 weights are half a Q4_1 block (the old size came out as 0 bytes and passed)
    assert_format(check_err(&with_tensor(&[16], Q4_1, 0)), "whole blocks");
}

#[test]
fn a_huge_dimension_count_is_an_error() {
    // one tensor info claiming u32::MAX dimensions (the old reader allocated 32 GiB for them)
    let mut v = b"GGUF".to_vec();
    v.extend(3u32.to_le_bytes());
    v.extend(1u64.to_le_bytes());
    v.extend(0u64.to_le_bytes());
    v.extend(string("w"));
    v.extend(u32::MAX.to_le_bytes());
    v.extend([0u8; 64]);
    assert_format(check_err(&v), "dimensions");
}

#[test]
fn overlapping_or_duplicate_tensors_are_errors() {
    // a second tensor on the data of the first (token_embd at offset 0)
    assert_format(check_err(&with_tensor(&[32], F32, 0)), "overlap");
    let mut g = Tiny::default().gguf();
    g.tensor("output_norm.weight", &[32], F32, &[0u8; 128]);
    assert_format(check_err(&g.bytes()), "twice");
}

#[test]
fn every_prefix_of_the_tiny_model_is_an_error() {
    let full = Tiny::default().gguf().bytes();
    assert!(read_content_from_bytes(&full).is_ok());
    for cut in 0..full.len() {
        match read_content_from_bytes(&full[..cut]) {
            Err(EngineError::Truncated { .. }) => {}
            other => panic!(
                "cut at {cut} of {}: expected Truncated, got {other:?}",
                full.len()
            ),
        }
    }
    // and through the file: a cut in the metadata, one in the tensor data
    for cut in [100, full.len() - 1] {
        assert_truncated(check_err(&full[..cut]));
    }
}

#[test]
fn model_shapes_that_differ_from_the_metadata_are_errors() {
    // hidden 32 with 3 heads: not a whole head_dim
    let t = Tiny {
        meta_heads: Some(3),
        ..Tiny::default()
    };
    assert_format(load_err(&t.gguf().bytes()), "head_count");
    // 2 query heads over 32 dims claimed, tensors written for 1 head: q is 32 rows either way,
    // but head_dim 16 disagrees with the rope dimension (32) the file states
    let t = Tiny {
        meta_heads: Some(2),
        ..Tiny::default()
    };
    assert!(matches!(
        load_err(&t.gguf().bytes()),
        EngineError::Format(_)
    ));
}

/// Writes the fuzz seed: `cargo test --release -p mosaickv-engine --test crafted_gguf --
/// --ignored write_fuzz_seed`.
#[test]
#[ignore = "writes engine/fuzz/seeds/gguf_header/tiny_llama"]
fn write_fuzz_seed() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/gguf_header");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tiny_llama"), Tiny::default().gguf().bytes()).unwrap();
}

/// Issue 36: a stored prefill is read back bit for bit (with and without query statistics),
/// is keyed by the prompt, and a damaged file is computed again, not trusted.
#[test]
fn stored_prefills_round_trip_and_damaged_ones_are_recomputed() {
    use mosaickv_engine::store::{Origin, PrefillStore};
    let dir = tempfile::tempdir().unwrap();
    let t = Tiny {
        arch: "qwen2",
        biases: true,
        hidden: 64,
        q_heads: 2,
        kv_heads: 1,
        ..Tiny::default()
    };
    let path = t.write(dir.path(), "m.gguf");
    let model = Model::load(&path).unwrap();
    let store = PrefillStore::new(&dir.path().join("home"), &path).unwrap();
    let toks = [3u32, 4, 5, 6, 7, 3, 4];
    for stats in [false, true] {
        let fresh = if stats {
            model.prefill_with_stats(&toks).unwrap()
        } else {
            model.prefill(&toks).unwrap()
        };
        let (a, o) = store.prefill(&model, &toks, stats).unwrap();
        assert_eq!(o, Origin::Computed);
        let (b, o) = store.prefill(&model, &toks, stats).unwrap();
        assert_eq!(o, Origin::Stored);
        for p in [&a, &b] {
            assert_eq!(p.keys, fresh.keys);
            assert_eq!(p.values, fresh.values);
            assert_eq!(p.logits, fresh.logits);
            assert_eq!(p.query_stats, fresh.query_stats);
        }
    }
    assert_ne!(store.key(&toks, false), store.key(&toks[..6], false));
    assert_ne!(store.key(&toks, false), store.key(&toks, true));
    // a flipped byte (checksum) and a truncation: computed again and replaced
    let file = store
        .dir()
        .join(format!("{}.mkvp", store.key(&toks, false)));
    let good = std::fs::read(&file).unwrap();
    let mut bad = good.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 1;
    for damaged in [bad, good[..good.len() - 9].to_vec()] {
        std::fs::write(&file, &damaged).unwrap();
        let (p, o) = store.prefill(&model, &toks, false).unwrap();
        assert_eq!(o, Origin::Computed);
        assert_eq!(p.logits, model.prefill(&toks).unwrap().logits);
        assert_eq!(std::fs::read(&file).unwrap(), good);
    }
}
