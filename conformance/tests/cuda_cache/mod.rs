//! `CudaCache` against the reference (issue 17), shared by the emulated stamp
//! (`cuda_emulated.rs`) and the device stamp (`cuda.rs`): each test takes the executor.
//! Selections are compared exactly, attention within `tolerances::ATTEND_REL_L2`.
//! Each test prints `CudaCache conformance ran on: <executor>` at its end (the
//! device check greps for it).

use mosaickv_conformance::{queries, structured_kv, tolerances};
use mosaickv_optimized::cuda::device::Gpu;
use mosaickv_optimized::cuda::{CudaCache, CudaCacheOptions, CudaLiveBatch};
use mosaickv_optimized::{Holder, LiveCache, Mode};
use mosaickv_reference::{MosaicCache, ReferenceBackend};
use mosaickv_spec::{
    Backend, CompressConfig, CompressedCache, KvCache, KvShape, MosaicError, Segment, Selection,
};
use ndarray::{Array2, Array3, Axis};
use std::sync::Arc;

const SHAPE: (usize, usize, usize) = (2, 4, 64);

fn shape() -> KvShape {
    KvShape::new(SHAPE.0, SHAPE.1, SHAPE.2).unwrap()
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// The batch's queries, one set per sequence, flattened `[batch][q_heads][D]`.
fn batch_queries(batch: usize, seed: u64) -> (Vec<Array2<f32>>, Vec<f32>) {
    let qs: Vec<Array2<f32>> = (0..batch)
        .map(|b| queries(SHAPE.1, SHAPE.2, seed + b as u64))
        .collect();
    let flat = qs.iter().flat_map(|q| q.iter().copied()).collect();
    (qs, flat)
}

/// The device's selection and attention of every sequence equal the reference's on
/// `want[b]` (selections exactly, outputs within the derived tolerance).
fn check_batch(cc: &CudaCache, want: &[&CompressedCache], seed: u64, when: &str) {
    let (qs, flat) = batch_queries(want.len(), seed);
    let sel = cc.select(&flat).unwrap();
    let out = cc.attend(&flat).unwrap();
    check_outputs(&sel, &out, want, &qs, when);
}

/// The device's selections `sel` and outputs `out` for queries `qs` against the reference on
/// `want` (selections exactly, outputs within the derived tolerance).
fn check_outputs(
    sel: &[Selection],
    out: &[f32],
    want: &[&CompressedCache],
    qs: &[Array2<f32>],
    when: &str,
) {
    let per = SHAPE.1 * SHAPE.2;
    for (b, (c, q)) in want.iter().zip(qs).enumerate() {
        let ref_sel = ReferenceBackend.select(c, q.view()).unwrap();
        assert_eq!(sel[b], ref_sel, "{when}: sequence {b} selection");
        let mut o = Array2::<f32>::zeros((SHAPE.1, SHAPE.2));
        ReferenceBackend.attend(c, q.view(), o.view_mut()).unwrap();
        let e = rel_l2(&out[b * per..(b + 1) * per], o.as_slice().unwrap());
        assert!(
            e < tolerances::ATTEND_REL_L2,
            "{when}: sequence {b}: rel L2 {e:e}"
        );
    }
}

/// Small buffers (32 tokens) so that appends cross buffer flushes quickly; the default's
/// value dtypes (int4/int8/f16, SPEC.md section 2).
fn flush_config() -> CompressConfig {
    CompressConfig {
        buffer_capacity: 32,
        block_sizes: vec![16, 32],
        ..CompressConfig::default()
    }
}

/// Whether any segment of `c` stores int8/int4 values on either side.
fn has_quantized(c: &CompressedCache) -> bool {
    c.segments.iter().flat_map(|s| &s.heads).any(|h| {
        h.strategy.key.layout.dtype.is_quantized() || h.strategy.value.layout.dtype.is_quantized()
    })
}

fn opts() -> CudaCacheOptions {
    CudaCacheOptions {
        spare_rows: 40,
        spare_segments: 2,
        spare_blocks: 16,
        swap_tokens: 1024,
        // Room for a few swaps' rotations: freed ranges coalesce, but three sequences'
        // alternating flushes leave holes of different sizes (first fit; docs/GPU.md).
        swap_segments: 4,
    }
}

/// What changed between two versions of a reference cache: the first differing
/// segment, how many old segments it replaces, the new segments, the buffer rows consumed.
fn diff(
    before: &CompressedCache,
    after: &CompressedCache,
) -> Option<(usize, usize, Vec<Segment>, usize)> {
    if before.segments == after.segments {
        return None;
    }
    let first = before
        .segments
        .iter()
        .zip(&after.segments)
        .take_while(|(a, b)| a == b)
        .count();
    let consumed = after.segment_tokens() - before.segment_tokens();
    Some((
        first,
        before.segments.len() - first,
        after.segments[first..].to_vec(),
        consumed,
    ))
}

/// Prefill of three sequences of different lengths, then appends token by token to each
/// (mirrored on the device: one token copied per append, and each buffer flush of the
/// reference swapped in as the grown open segment consuming the flushed rows), checked
/// after every flush and at the end: selections exact, attention within tolerance, for
/// the whole batch in one launch sequence with per-sequence lengths and budgets.
pub fn prefill_appends_and_flushes_match_the_reference(gpu: Arc<Gpu>) {
    let cfg = flush_config();
    let prompts = [300usize, 90, 520];
    let appends = [70usize, 40, 5];
    let data: Vec<(Array3<f32>, Array3<f32>)> = prompts
        .iter()
        .zip(appends)
        .enumerate()
        .map(|(i, (&p, a))| structured_kv(p + a, SHAPE.0, SHAPE.2, 11 + i as u64))
        .collect();
    let mut refs: Vec<MosaicCache> = Vec::new();
    for (i, (k, v)) in data.iter().enumerate() {
        let mut c = MosaicCache::new(shape(), cfg.clone()).unwrap();
        let p = prompts[i];
        c.prefill(
            k.slice(ndarray::s![..p, .., ..]),
            v.slice(ndarray::s![..p, .., ..]),
        )
        .unwrap();
        refs.push(c);
    }
    let views: Vec<&CompressedCache> = refs.iter().map(|c| c.compressed()).collect();
    assert!(
        views.iter().any(|c| has_quantized(c)),
        "the default stores int8/int4 values here"
    );
    let mut cc = CudaCache::new(gpu.clone(), &views, opts()).unwrap();
    check_batch(&cc, &views, 1, "after prefill");
    let mut flushes = 0;
    let longest = *appends.iter().max().unwrap();
    for step in 0..longest {
        let mut flushed = false;
        for (b, r) in refs.iter_mut().enumerate() {
            if step >= appends[b] {
                continue;
            }
            let t = prompts[b] + step;
            let (k, v) = (
                data[b].0.index_axis(Axis(0), t),
                data[b].1.index_axis(Axis(0), t),
            );
            let before = r.compressed().clone();
            r.append(k, v).unwrap();
            let kh: Vec<half::f16> = k.iter().map(|&x| half::f16::from_f32(x)).collect();
            let vh: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
            cc.append(b, &kh, &vh).unwrap();
            if let Some((first, count, segs, consumed)) = diff(&before, r.compressed()) {
                cc.begin_swap(b, first, count, segs, consumed).unwrap();
                cc.commit_swap().unwrap();
                flushes += 1;
                flushed = true;
            }
        }
        if flushed {
            let views: Vec<&CompressedCache> = refs.iter().map(|c| c.compressed()).collect();
            check_batch(&cc, &views, 2 + flushes, &format!("after flush {flushes}"));
        }
    }
    assert!(
        flushes >= 3,
        "the test must cross buffer flushes, got {flushes}"
    );
    let views: Vec<&CompressedCache> = refs.iter().map(|c| c.compressed()).collect();
    check_batch(&cc, &views, 50, "at the end");
    println!("CudaCache conformance ran on: {}", gpu.name);
}

/// `CudaLiveBatch`: two `LiveCache`s with background workers that are held and released at
/// random (so closes arrive late, provisional segments form and are re-encoded), mirrored on
/// the device token by token. Checked every 16 steps and after the final drain: the device's
/// selections equal the reference's on the host views exactly, its attention is within
/// tolerance, and it is bit-equal to a `CudaCache` uploaded afresh from the same views (the
/// incremental swaps leave the device holding exactly what a fresh upload holds).
pub fn live_batch_follows_the_background_worker(gpu: Arc<Gpu>) {
    use rand::{Rng, SeedableRng};
    let cfg = CompressConfig {
        sink_tokens: 4,
        input_segment_len: 64,
        buffer_capacity: 16,
        block_sizes: vec![8, 16],
        max_segment_len: 128,
        min_segment_len: 64,
        truncate_fraction: 0.25,
        ..CompressConfig::default()
    };
    let prompts = [100usize, 70];
    let appends = 300;
    let data: Vec<(Array3<f32>, Array3<f32>)> = prompts
        .iter()
        .enumerate()
        .map(|(i, &p)| structured_kv(p + appends + 400, SHAPE.0, SHAPE.2, 31 + i as u64))
        .collect();
    let lives: Vec<LiveCache> = data
        .iter()
        .zip(prompts)
        .map(|((k, v), p)| {
            let mut l = LiveCache::new(shape(), cfg.clone(), Mode::Async).unwrap();
            l.prefill(
                k.slice(ndarray::s![..p, .., ..]),
                v.slice(ndarray::s![..p, .., ..]),
            )
            .unwrap();
            l
        })
        .collect();
    let opts = CudaCacheOptions {
        spare_rows: 40,
        spare_segments: 16,
        spare_blocks: 160,
        swap_tokens: 1024,
        swap_segments: 16,
    };
    let mut batch = CudaLiveBatch::new(gpu.clone(), lives, opts).unwrap();
    let check = |batch: &CudaLiveBatch, seed: u64, when: &str| {
        let views: Vec<CompressedCache> = batch
            .lives()
            .iter()
            .map(|l| l.compressed().clone())
            .collect();
        let refs: Vec<&CompressedCache> = views.iter().collect();
        let (qs, flat) = batch_queries(refs.len(), seed);
        let sel = batch.select_current(&flat).unwrap();
        let out = batch.attend_current(&flat).unwrap();
        let fresh = CudaCache::new(gpu.clone(), &refs, opts).unwrap();
        let fresh_out = fresh.attend(&flat).unwrap();
        assert!(
            out.iter()
                .zip(&fresh_out)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{when}: the mirrored device cache attends differently from a fresh upload"
        );
        check_outputs(&sel, &out, &refs, &qs, when);
    };
    check(&batch, 1, "after prefill");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let mut holds = Vec::new();
    for step in 0..appends {
        // Release the workers now and then, let them run a little, hold them again.
        if rng.gen_bool(0.03) {
            holds.clear();
            std::thread::sleep(std::time::Duration::from_millis(rng.gen_range(0..4)));
        } else if holds.is_empty() && rng.gen_bool(0.05) {
            holds = batch.hold_workers();
        }
        for (b, (k, v)) in data.iter().enumerate() {
            let t = prompts[b] + step;
            batch
                .append(b, k.index_axis(Axis(0), t), v.index_axis(Axis(0), t))
                .unwrap();
        }
        if step % 16 == 15 {
            batch.refresh().unwrap();
            check(&batch, 100 + step as u64, &format!("step {step}"));
        }
    }
    holds.clear();
    batch.drain().unwrap();
    check(&batch, 7, "after drain");

    // A provisional segment made on purpose, then re-encoded: sequence 0's worker is held
    // (hold 1) while its open segment reaches max_segment_len (the closing flush waits
    // behind hold 1), held again (hold 2, queued after that flush), and given one more
    // flush (behind hold 2). Releasing hold 1 lets the close through and nothing after it:
    // the last flush's segment is provisional, on the host and so on the device. Releasing
    // hold 2 re-encodes it (same tokens, new strategy): the device follows again.
    let mut next = prompts[0] + appends;
    let mut push = |batch: &mut CudaLiveBatch, n: usize| {
        for _ in 0..n {
            let (k, v) = &data[0];
            batch
                .append(0, k.index_axis(Axis(0), next), v.index_axis(Axis(0), next))
                .unwrap();
            next += 1;
        }
    };
    let open_len = |batch: &CudaLiveBatch| {
        batch.lives()[0]
            .compressed()
            .segments
            .last()
            .filter(|s| s.state == mosaickv_spec::SegmentState::Open)
            .map_or(0, |s| s.len)
    };
    let provisional = |batch: &CudaLiveBatch| {
        batch.lives()[0]
            .coverage()
            .ranges
            .iter()
            .any(|r| r.2 == Holder::Provisional)
    };
    let hold1 = batch.hold_worker(0).expect("async worker");
    for _ in 0..cfg.max_segment_len {
        if open_len(&batch) >= cfg.max_segment_len {
            break;
        }
        push(&mut batch, 1);
    }
    assert!(open_len(&batch) >= cfg.max_segment_len);
    let hold2 = batch.hold_worker(0).expect("async worker");
    push(&mut batch, cfg.buffer_capacity);
    drop(hold1);
    let mut seen = false;
    for _ in 0..400 {
        batch.refresh().unwrap();
        if provisional(&batch) {
            seen = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(
        seen,
        "the close must arrive while the next flush is held back"
    );
    let swaps_before = batch.stats().swaps;
    check(&batch, 8, "with a provisional segment");
    drop(hold2);
    batch.drain().unwrap();
    assert!(!provisional(&batch));
    assert!(
        batch.stats().swaps > swaps_before,
        "the re-encoding is swapped in"
    );
    check(&batch, 9, "after the re-encoding");

    let closes: u64 = batch.lives().iter().map(|l| l.stats().closes).sum();
    assert!(closes >= 3, "the workers must close segments, got {closes}");
    let st = batch.stats();
    assert_eq!(st.appends, 2 * appends + (next - prompts[0] - appends));
    assert!(st.swaps >= 2 * appends / 16, "{st:?}");
    let m = batch.memory();
    assert!(m.cuda.device_bytes > 0 && m.host_view_bytes > 0, "{m:?}");
    println!("CudaCache conformance ran on: {}", gpu.name);
}

/// Two references on the same rows whose segments cover the same tokens but are encoded
/// differently (block size 32 against 16, other channel thresholds, and int4 values only
/// against the default's int4/int8/f16): the second's segment is the "re-encoded" version
/// the background worker delivers.
fn reencoded_pair(prompt: usize, seed: u64) -> (CompressedCache, CompressedCache) {
    let (k, v) = structured_kv(prompt, SHAPE.0, SHAPE.2, seed);
    let a_cfg = CompressConfig {
        block_sizes: vec![32],
        ..CompressConfig::default()
    };
    let mut b_cfg = CompressConfig {
        block_sizes: vec![16],
        value_dtypes: vec![mosaickv_spec::ValueDtype::Int4],
        ..CompressConfig::default()
    };
    if let mosaickv_spec::ChannelPolicy::LossThreshold {
        key_loss,
        value_loss,
        ..
    } = &mut b_cfg.channels
    {
        *key_loss *= 4.0;
        *value_loss *= 2.0;
    }
    let build = |cfg: CompressConfig| {
        let mut c = MosaicCache::new(shape(), cfg).unwrap();
        c.prefill(k.view(), v.view()).unwrap();
        c.compressed().clone()
    };
    (build(a_cfg), build(b_cfg))
}

/// A re-encoded segment swapped in while decode goes on: its bytes go to the second
/// buffer, attention keeps the old answer (bit for bit) and appends still land; the
/// memory report counts both buffers; the commit switches to the new segment; swapping
/// back reuses the freed room.
pub fn a_reencoded_segment_swaps_in_without_stopping_decode(gpu: Arc<Gpu>) {
    let (a, re) = reencoded_pair(400, 21);
    let other = mosaickv_conformance::reference_cache(
        shape(),
        &mosaickv_conformance::f16_default(),
        200,
        3,
        5,
    )
    .unwrap();
    assert_eq!(a.segments.len(), re.segments.len());
    let (sa, sr) = (&a.segments[0], &re.segments[0]);
    assert_eq!((sa.start, sa.len), (sr.start, sr.len));
    assert_ne!(
        sa.heads[0].strategy.block_size, sr.heads[0].strategy.block_size,
        "the re-encoded segment must differ in its block layout"
    );
    assert!(
        has_quantized(&re),
        "the re-encoded segment stores int4 values"
    );
    let mut cc = CudaCache::new(gpu.clone(), &[&a, &other], opts()).unwrap();
    let (_, flat) = batch_queries(2, 7);
    let out0 = cc.attend(&flat).unwrap();
    check_batch(&cc, &[&a, &other], 7, "before the swap");
    let m0 = cc.memory();
    assert_eq!(
        (
            m0.device_staged_bytes,
            m0.device_replaced_bytes,
            m0.host_staged_bytes
        ),
        (0, 0, 0)
    );

    cc.begin_swap(0, 0, 1, vec![sr.clone()], 0).unwrap();
    assert!(cc.swap_in_flight());
    let m1 = cc.memory();
    let records = |s: &Segment| -> usize {
        s.heads
            .iter()
            .map(|h| {
                h.keys.bytes.len()
                    + h.values.bytes.len()
                    + 2 * (h.strategy.key.rotation.len() + h.strategy.value.rotation.len())
                    + 4 * h.meta.scale.len()
            })
            .sum()
    };
    // Both versions are on the device, in memory reserved up front. The staged bytes are
    // exactly the new segment's: its records (int4: with each record's 4-byte minimum and
    // scale, SPEC.md section 6), rotations (f16, section 3), block scales, and int8 bounds in 8-byte chunks.
    assert_eq!(m1.device_bytes, m0.device_bytes, "{m1:?}");
    for h in &sr.heads {
        for (side, packed) in [(&h.strategy.key, &h.keys), (&h.strategy.value, &h.values)] {
            let l = &side.layout;
            assert_eq!(l.dtype, mosaickv_spec::ValueDtype::Int4);
            let rb = (l.bitmap_bytes() + 4 + l.r.div_ceil(2)).next_multiple_of(4);
            assert_eq!(
                packed.bytes.len(),
                sr.len * rb,
                "records with their scale bytes"
            );
        }
    }
    let meta: usize = sr
        .heads
        .iter()
        .map(|h| h.meta.min.len().next_multiple_of(8))
        .sum();
    assert_eq!(m1.device_staged_bytes, records(sr) + 2 * meta, "{m1:?}");
    assert!(m1.device_replaced_bytes >= records(sa), "{m1:?}");
    assert_eq!(
        m1.device_free_bytes,
        m0.device_free_bytes - m1.device_staged_bytes,
        "{m1:?}"
    );
    assert!(m1.host_staged_bytes > 0 && m1.host_bytes == m0.host_bytes + m1.host_staged_bytes);
    // Decode goes on against the old segment: the same bits, and an append lands.
    assert_eq!(cc.attend(&flat).unwrap(), out0);
    let row = SHAPE.0 * SHAPE.2;
    let tok: Vec<half::f16> = (0..row)
        .map(|i| half::f16::from_f32(((i * 7 % 13) as f32 - 6.0) / 8.0))
        .collect();
    cc.append(0, &tok, &tok).unwrap();
    let mut a_app = a.clone();
    a_app.buffer.tokens += 1;
    a_app.buffer.keys.extend_from_slice(&tok);
    a_app.buffer.values.extend_from_slice(&tok);
    check_batch(&cc, &[&a_app, &other], 8, "during the swap");

    cc.commit_swap().unwrap();
    assert!(!cc.swap_in_flight());
    let m2 = cc.memory();
    assert_eq!(
        (
            m2.device_staged_bytes,
            m2.device_replaced_bytes,
            m2.host_staged_bytes
        ),
        (0, 0, 0)
    );
    assert_eq!(m2.device_bytes, m0.device_bytes);
    assert_eq!(
        m2.device_free_bytes,
        m1.device_free_bytes + m1.device_replaced_bytes,
        "the replaced segment's room is free again"
    );
    let mut swapped = a_app.clone();
    swapped.segments[0] = sr.clone();
    check_batch(&cc, &[&swapped, &other], 9, "after the swap");

    // And back: the freed room takes the original segment again.
    cc.begin_swap(0, 0, 1, vec![sa.clone()], 0).unwrap();
    cc.commit_swap().unwrap();
    check_batch(&cc, &[&a_app, &other], 10, "after swapping back");
    assert_eq!(cc.memory().device_free_bytes, m0.device_free_bytes);
    println!("CudaCache conformance ran on: {}", gpu.name);
}

/// Bad input is a typed error and leaves the cache as it was (same answers, same memory).
pub fn bad_input_is_a_typed_error_and_keeps_the_cache(gpu: Arc<Gpu>) {
    let (a, re) = reencoded_pair(400, 31);
    let other = mosaickv_conformance::reference_cache(
        shape(),
        &mosaickv_conformance::f16_default(),
        200,
        3,
        6,
    )
    .unwrap();
    let mut cc = CudaCache::new(gpu.clone(), &[&a, &other], opts()).unwrap();
    let (_, flat) = batch_queries(2, 12);
    let out0 = cc.attend(&flat).unwrap();
    let m0 = cc.memory();
    let sr = re.segments[0].clone();
    let intact = |cc: &CudaCache, what: &str| {
        assert!(!cc.swap_in_flight(), "{what}");
        assert_eq!(cc.attend(&flat).unwrap(), out0, "{what}: answers changed");
        assert_eq!(cc.memory(), m0, "{what}: memory changed");
    };
    let shape_err = |r: Result<(), MosaicError>, what: &str| {
        assert!(
            matches!(r, Err(MosaicError::ShapeMismatch { .. })),
            "{what}: {r:?}"
        );
    };
    // A sequence that does not exist, a range past its segments, a wrong token span.
    shape_err(cc.begin_swap(2, 0, 1, vec![sr.clone()], 0), "sequence 2");
    intact(&cc, "sequence 2");
    shape_err(cc.begin_swap(0, 0, 2, vec![sr.clone()], 0), "segments 0..2");
    intact(&cc, "segments 0..2");
    let short = reencoded_pair(350, 31).1.segments[0].clone();
    shape_err(cc.begin_swap(0, 0, 1, vec![short], 0), "shorter segment");
    intact(&cc, "shorter segment");
    shape_err(
        cc.begin_swap(0, 0, 1, vec![sr.clone()], 1),
        "consumed rows the buffer lacks",
    );
    intact(&cc, "consumed rows");
    shape_err(cc.begin_swap(0, 0, 1, Vec::new(), 0), "no segments");
    intact(&cc, "no segments");
    // A corrupt segment (records cut short) is refused by the spec's validator.
    let mut bad = sr.clone();
    bad.heads[1].keys.bytes.truncate(8);
    let r = cc.begin_swap(0, 0, 1, vec![bad], 0);
    assert!(
        matches!(
            r,
            Err(MosaicError::ShapeMismatch { .. } | MosaicError::CorruptPacked(_))
        ),
        "{r:?}"
    );
    intact(&cc, "corrupt segment");
    // Committing nothing; a second swap while one is in flight; cancelling frees its room.
    assert!(matches!(
        cc.commit_swap(),
        Err(MosaicError::InvalidConfig(_))
    ));
    intact(&cc, "commit without a swap");
    cc.begin_swap(0, 0, 1, vec![sr.clone()], 0).unwrap();
    assert!(matches!(
        cc.begin_swap(1, 0, 1, vec![other.segments[0].clone()], 0),
        Err(MosaicError::InvalidConfig(_))
    ));
    cc.cancel_swap();
    intact(&cc, "cancelled swap");
    // Bad queries and appends.
    assert!(matches!(
        cc.attend(&flat[1..]),
        Err(MosaicError::ShapeMismatch { .. })
    ));
    let mut nan = flat.clone();
    nan[3] = f32::NAN;
    assert!(cc.attend(&nan).is_err());
    let row = vec![half::f16::ZERO; SHAPE.0 * SHAPE.2];
    assert!(matches!(
        cc.append(2, &row, &row),
        Err(MosaicError::ShapeMismatch { .. })
    ));
    assert!(matches!(
        cc.append(0, &row[1..], &row),
        Err(MosaicError::ShapeMismatch { .. })
    ));
    intact(&cc, "bad queries and appends");
    // A reserve too small for the swap: a typed error, nothing taken.
    let small = CudaCacheOptions {
        swap_tokens: 10,
        ..opts()
    };
    let mut tight = CudaCache::new(gpu.clone(), &[&a, &other], small).unwrap();
    let t0 = tight.attend(&flat).unwrap();
    let tm = tight.memory();
    assert!(matches!(
        tight.begin_swap(0, 0, 1, vec![sr.clone()], 0),
        Err(MosaicError::InvalidConfig(_))
    ));
    assert!(!tight.swap_in_flight());
    assert_eq!(tight.attend(&flat).unwrap(), t0);
    assert_eq!(tight.memory(), tm);
    // No spare block entries for a swap that adds blocks (block size 32 -> 16).
    let no_blocks = CudaCacheOptions {
        spare_blocks: 0,
        ..opts()
    };
    let mut nb = CudaCache::new(gpu.clone(), &[&a, &other], no_blocks).unwrap();
    let nm = nb.memory();
    assert!(matches!(
        nb.begin_swap(0, 0, 1, vec![sr], 0),
        Err(MosaicError::InvalidConfig(_))
    ));
    assert_eq!(nb.memory(), nm);
    // The spare dense rows used up: a typed error, the cache unchanged.
    let no_rows = CudaCacheOptions {
        spare_rows: 1,
        ..opts()
    };
    let mut nr = CudaCache::new(gpu.clone(), &[&a, &other], no_rows).unwrap();
    nr.append(1, &row, &row).unwrap();
    let before = nr.attend(&flat).unwrap();
    assert!(matches!(
        nr.append(1, &row, &row),
        Err(MosaicError::InvalidConfig(_))
    ));
    assert_eq!(nr.attend(&flat).unwrap(), before);
    println!("CudaCache conformance ran on: {}", gpu.name);
}

/// Swaps that change a sequence's segment count in the middle of its segment list (a close
/// over two provisional segments, and the reverse): the segments after the replaced ones
/// move down and then up in their slots and block entries, and every answer follows the
/// reference on the spliced cache; the other sequence is untouched.
pub fn swaps_that_change_the_segment_count_move_the_later_segments(gpu: Arc<Gpu>) {
    let (k, v) = structured_kv(800, SHAPE.0, SHAPE.2, 41);
    let build = |input_segment_len: usize| {
        let cfg = CompressConfig {
            input_segment_len,
            ..CompressConfig::default()
        };
        let mut c = MosaicCache::new(shape(), cfg).unwrap();
        c.prefill(k.view(), v.view()).unwrap();
        c.compressed().clone()
    };
    // Segments of 128 tokens, and of 256 over the same rows: one of the latter covers two
    // of the former.
    let (fine, coarse) = (build(128), build(256));
    assert!(fine.segments.len() >= 4, "{} segments", fine.segments.len());
    // A coarse segment that covers fine segments i and i + 1, with fine segments before
    // and after them.
    let (i, covering) = (1..fine.segments.len().saturating_sub(2))
        .find_map(|i| {
            let (a, b) = (&fine.segments[i], &fine.segments[i + 1]);
            coarse
                .segments
                .iter()
                .find(|s| s.start == a.start && s.len == a.len + b.len)
                .map(|s| (i, s.clone()))
        })
        .expect("a coarse segment covering two fine ones in the middle");
    let other = mosaickv_conformance::reference_cache(
        shape(),
        &mosaickv_conformance::f16_default(),
        200,
        3,
        8,
    )
    .unwrap();
    let mut cc = CudaCache::new(gpu.clone(), &[&other, &fine], opts()).unwrap();
    check_batch(&cc, &[&other, &fine], 60, "before");
    // Two segments become one: the later segments move down a slot.
    cc.begin_swap(1, i, 2, vec![covering.clone()], 0).unwrap();
    cc.commit_swap().unwrap();
    let mut merged = fine.clone();
    merged.segments.splice(i..i + 2, [covering]);
    check_batch(&cc, &[&other, &merged], 61, "after 2 -> 1");
    // And back: one becomes two, the later segments move up again.
    cc.begin_swap(1, i, 1, fine.segments[i..i + 2].to_vec(), 0)
        .unwrap();
    cc.commit_swap().unwrap();
    check_batch(&cc, &[&other, &fine], 62, "after 1 -> 2");
    println!("CudaCache conformance ran on: {}", gpu.name);
}
