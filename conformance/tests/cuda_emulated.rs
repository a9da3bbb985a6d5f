//! The conformance suite stamped out for the CUDA backend on the CPU emulation of the
//! CUDA execution model (issue 17), behind this crate's `cuda-emulated` feature:
//! `cargo test --release -p mosaickv-conformance --features cuda-emulated --test cuda_emulated`.
//!
//! Every stage of the `Backend` trait that has a kernel runs it (`mkv_encode`, `mkv_decode`,
//! `mkv_block_meta`, `mkv_rotate_queries`, `mkv_score_blocks`, `mkv_select_topk`, and
//! `mkv_plan_items` + `mkv_packed_attention` + `mkv_merge` for attention) through the same
//! launch plans as on a GPU; the suite compares each stage with the reference (bytes,
//! rotated queries, scores and selections exactly, attention within the derived
//! tolerance). A kernel fault the emulation detects (a divergent barrier or shuffle, an
//! index past shared memory, a launch past the limits) fails the test with its report.
//! It never skips: the emulation is always available.
#![cfg(feature = "cuda-emulated")]

use mosaickv_conformance::conformance_suite;
use mosaickv_optimized::cuda::CudaBackend;
use mosaickv_spec::{
    Availability, Backend, BlockMeta, CompressConfig, CompressedCache, PackedRows, Result,
    Selection, Side, SideStrategy,
};
use ndarray::{Array2, ArrayView2, ArrayViewMut2};
use std::sync::OnceLock;

fn shared() -> &'static CudaBackend {
    static SHARED: OnceLock<CudaBackend> = OnceLock::new();
    SHARED.get_or_init(CudaBackend::emulated)
}

/// Delegates to the one emulated backend (the suite constructs a backend per case).
struct SharedEmu;

impl Backend for SharedEmu {
    fn name(&self) -> &'static str {
        shared().name()
    }
    fn availability(&self) -> Availability {
        shared().availability()
    }
    fn fit_side(
        &self,
        rows: ArrayView2<f32>,
        side: Side,
        config: &CompressConfig,
    ) -> Result<SideStrategy> {
        shared().fit_side(rows, side, config)
    }
    fn fit_block_size(
        &self,
        keys: ArrayView2<f32>,
        key: &SideStrategy,
        config: &CompressConfig,
    ) -> Result<usize> {
        shared().fit_block_size(keys, key, config)
    }
    fn encode(&self, rows: ArrayView2<f32>, side: &SideStrategy) -> Result<PackedRows> {
        shared().encode(rows, side)
    }
    fn decode(&self, packed: &PackedRows, side: &SideStrategy) -> Result<Array2<f32>> {
        shared().decode(packed, side)
    }
    fn block_meta(
        &self,
        keys: &PackedRows,
        key: &SideStrategy,
        block_size: usize,
    ) -> Result<BlockMeta> {
        shared().block_meta(keys, key, block_size)
    }
    fn rotate_queries(&self, queries: ArrayView2<f32>, key: &SideStrategy) -> Result<Array2<f32>> {
        shared().rotate_queries(queries, key)
    }
    fn score_blocks(&self, meta: &BlockMeta, rotated_queries: ArrayView2<f32>) -> Result<Vec<f32>> {
        shared().score_blocks(meta, rotated_queries)
    }
    fn select_blocks(
        &self,
        scores: &[f32],
        block_lens: &[usize],
        budget_tokens: usize,
    ) -> Result<Vec<u32>> {
        shared().select_blocks(scores, block_lens, budget_tokens)
    }
    fn select(&self, cache: &CompressedCache, queries: ArrayView2<f32>) -> Result<Selection> {
        shared().select(cache, queries)
    }
    fn attend_selected(
        &self,
        cache: &CompressedCache,
        queries: ArrayView2<f32>,
        selection: &Selection,
        out: ArrayViewMut2<f32>,
    ) -> Result<()> {
        shared().attend_selected(cache, queries, selection, out)
    }
    fn attend(
        &self,
        cache: &CompressedCache,
        queries: ArrayView2<f32>,
        out: ArrayViewMut2<f32>,
    ) -> Result<()> {
        shared().attend(cache, queries, out)
    }
}

conformance_suite!(cuda_emulated, || Box::new(SharedEmu));

/// The emulated backend is always available and says so by name.
#[test]
fn emulated_backend_is_available() {
    assert_eq!(SharedEmu.name(), "cuda-emulated");
    assert!(matches!(SharedEmu.availability(), Availability::Available));
}

mod device_paths {
    //! The device-only paths that the `Backend` trait does not reach: the dense decode and
    //! Quest baselines, an over-budget selection, a batch of caches in one launch sequence.
    use super::*;
    use mosaickv_conformance::{queries, reference_cache};
    use mosaickv_optimized::cuda::device::{is_kernel_fault, DenseDevice, Gpu, QuestDevice};
    use mosaickv_reference::ReferenceBackend;
    use mosaickv_spec::KvShape;
    use rand::{Rng, SeedableRng};

    /// Full attention in f64 over f16 rows `[n][kv][d]` for queries `[q_heads][d]`.
    fn full_attention(
        k: &[u16],
        v: &[u16],
        n: usize,
        kv: usize,
        qh: usize,
        d: usize,
        q: &[f32],
    ) -> Vec<f32> {
        let g = qh / kv;
        let h2f = |b: u16| half::f16::from_bits(b).to_f64();
        let mut out = vec![0f32; qh * d];
        for h in 0..qh {
            let j = h / g;
            let logits: Vec<f64> = (0..n)
                .map(|t| {
                    (0..d)
                        .map(|e| q[h * d + e] as f64 * h2f(k[(t * kv + j) * d + e]))
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = logits.iter().map(|z| (z - m).exp()).collect();
            let s: f64 = w.iter().sum();
            for e in 0..d {
                let acc: f64 = (0..n).map(|t| w[t] * h2f(v[(t * kv + j) * d + e])).sum();
                out[h * d + e] = (acc / s) as f32;
            }
        }
        out
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

    fn dense(
        gpu: &Gpu,
        n: usize,
        kv: usize,
        qh: usize,
        d: usize,
        seed: u64,
    ) -> (DenseDevice, Vec<u16>, Vec<u16>, Vec<f32>) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut row = || half::f16::from_f32(rng.gen_range(-1.0f32..1.0)).to_bits();
        let k: Vec<u16> = (0..n * kv * d).map(|_| row()).collect();
        let v: Vec<u16> = (0..n * kv * d).map(|_| row()).collect();
        let q: Vec<f32> = queries(qh, d, seed).iter().copied().collect();
        let dd = DenseDevice {
            batch: 1,
            n,
            kv_heads: kv,
            q_heads: qh,
            head_dim: d,
            k: gpu.up(&k).unwrap(),
            v: gpu.up(&v).unwrap(),
        };
        (dd, k, v, q)
    }

    /// The loop shape mkv_dense_decode had before issue 17 (kept in attention.cu behind
    /// MKV_DENSE_DIVERGENT_LOOP, compiled as `mkv_dense_decode_divergent`): with D = 128,
    /// 16 lanes per row, two lane slots per warp and 4 tokens per slot, n = 33 gives slot 0
    /// of warp 0 two trips (tokens 0 and 32) and slot 1 one (token 4): its full-mask
    /// shuffle runs from half a warp. The emulation reports it; the fixed loop computes.
    #[test]
    fn dense_decode_old_loop_shape_is_reported_and_the_fix_computes() {
        let gpu = Gpu::emulated();
        let (dd, k, v, q) = dense(&gpu, 33, 1, 4, 128, 3);
        let qb = gpu.up(&q).unwrap();
        let err = dd
            .decode_with(&gpu, "mkv_dense_decode_divergent", &qb, None, 1)
            .err()
            .expect("must fault");
        let msg = err.to_string();
        assert!(is_kernel_fault(&err), "{msg}");
        assert!(
            msg.contains("divergent warp operation") && msg.contains("__shfl_xor_sync"),
            "{msg}"
        );
        let out = gpu.down(&dd.decode(&gpu, &qb, None, 1).unwrap()).unwrap();
        let want = full_attention(&k, &v, 33, 1, 4, 128, &q);
        assert!(
            rel_l2(&out, &want) < mosaickv_conformance::tolerances::ATTEND_REL_L2,
            "{}",
            rel_l2(&out, &want)
        );
    }

    /// The fixed kernel over head dims, GQA groups, lengths and splits whose lane slots end
    /// at different places (n = 497 is issue 17's example per-split count).
    #[test]
    fn dense_decode_matches_full_attention() {
        let gpu = Gpu::emulated();
        for &(d, kv, qh) in &[
            (64usize, 2usize, 4usize),
            (128, 1, 6),
            (80, 1, 1),
            (256, 1, 2),
        ] {
            for &n in &[1usize, 31, 33, 100, 497] {
                for splits in [1usize, 3] {
                    let (dd, k, v, q) = dense(&gpu, n, kv, qh, d, (d * n + splits) as u64);
                    let qb = gpu.up(&q).unwrap();
                    let out = gpu
                        .down(&dd.decode(&gpu, &qb, None, splits).unwrap())
                        .unwrap();
                    let want = full_attention(&k, &v, n, kv, qh, d, &q);
                    let e = rel_l2(&out, &want);
                    assert!(
                        e < mosaickv_conformance::tolerances::ATTEND_REL_L2,
                        "D={d} kv={kv} q={qh} n={n} splits={splits}: rel L2 {e:e}"
                    );
                }
            }
        }
    }

    /// Quest with every page in budget attends every token: full attention.
    #[test]
    fn quest_at_rate_one_is_full_attention() {
        let gpu = Gpu::emulated();
        for &n in &[40usize, 129] {
            let (dd, k, v, q) = dense(&gpu, n, 2, 4, 64, n as u64);
            let qb = gpu.up(&q).unwrap();
            let quest = QuestDevice::new(&gpu, &dd, 1.0).unwrap();
            let out = gpu.down(&quest.attend(&gpu, &dd, &qb).unwrap()).unwrap();
            let want = full_attention(&k, &v, n, 2, 4, 64, &q);
            assert!(
                rel_l2(&out, &want) < mosaickv_conformance::tolerances::ATTEND_REL_L2,
                "n={n}"
            );
            // A small rate still runs every kernel without a fault.
            let quest = QuestDevice::new(&gpu, &dd, 0.2).unwrap();
            let out = gpu.down(&quest.attend(&gpu, &dd, &qb).unwrap()).unwrap();
            assert!(out.iter().all(|x| x.is_finite()));
        }
    }

    /// A selection far past the token budget (every block of the cache) is attended whole:
    /// the work-item table is sized from the selection, not from the budget (issue 17:
    /// before, mkv_plan_items capped the items at the budget's bound and dropped blocks).
    #[test]
    fn an_over_budget_selection_loses_no_block() {
        let shape = KvShape::new(2, 4, 64).unwrap();
        let cfg = CompressConfig {
            token_rate: 0.02,
            input_segment_len: 1024,
            ..CompressConfig::default()
        };
        let cache = reference_cache(shape, &cfg, 3000, 5, 9).unwrap();
        let q = queries(4, 64, 9);
        let per_head: Vec<Vec<(u32, u32)>> = (0..shape.kv_heads)
            .map(|j| {
                cache
                    .segments
                    .iter()
                    .enumerate()
                    .flat_map(|(s, seg)| {
                        let b = seg.len.div_ceil(seg.heads[j].strategy.block_size);
                        (0..b as u32).map(move |i| (s as u32, i))
                    })
                    .collect()
            })
            .collect();
        let blocks = per_head[0].len();
        let sel = Selection { per_head };
        let mut want = Array2::<f32>::zeros((4, 64));
        ReferenceBackend
            .attend_selected(&cache, q.view(), &sel, want.view_mut())
            .unwrap();
        let mut got = Array2::<f32>::zeros((4, 64));
        SharedEmu
            .attend_selected(&cache, q.view(), &sel, got.view_mut())
            .unwrap();
        let e = rel_l2(got.as_slice().unwrap(), want.as_slice().unwrap());
        assert!(
            e < mosaickv_conformance::tolerances::ATTEND_REL_L2,
            "{blocks} blocks: rel L2 {e:e}"
        );
    }

    /// A batch of caches attended in one launch sequence gives each cache's own answer: one
    /// at the default (int4/int8/f16 values), one with f16 values only, one int4 only.
    #[test]
    fn a_batch_attends_each_sequence() {
        let shape = KvShape::new(2, 4, 64).unwrap();
        let int4 = CompressConfig {
            value_dtypes: vec![mosaickv_spec::ValueDtype::Int4],
            ..CompressConfig::default()
        };
        let a = reference_cache(shape, &CompressConfig::default(), 300, 7, 1).unwrap();
        let b = reference_cache(shape, &mosaickv_conformance::f16_default(), 500, 3, 2).unwrap();
        let c = reference_cache(shape, &int4, 400, 5, 3).unwrap();
        assert!(c.segments.iter().flat_map(|s| &s.heads).all(|h| {
            h.strategy.key.layout.dtype == mosaickv_spec::ValueDtype::Int4
                && h.strategy.value.layout.dtype == mosaickv_spec::ValueDtype::Int4
        }));
        let backend = shared();
        let gpu = backend.gpu().unwrap();
        let dc = backend.upload(&[&a, &b, &c]).unwrap();
        let (qa, qb, qc) = (queries(4, 64, 1), queries(4, 64, 2), queries(4, 64, 3));
        let flat: Vec<f32> = qa
            .iter()
            .chain(qb.iter())
            .chain(qc.iter())
            .copied()
            .collect();
        let out = gpu
            .down(&dc.attend(&gpu, &gpu.up(&flat).unwrap()).unwrap())
            .unwrap();
        for (i, (c, q)) in [(&a, &qa), (&b, &qb), (&c, &qc)].into_iter().enumerate() {
            let mut want = Array2::<f32>::zeros((4, 64));
            ReferenceBackend
                .attend(c, q.view(), want.view_mut())
                .unwrap();
            let e = rel_l2(&out[i * 256..(i + 1) * 256], want.as_slice().unwrap());
            assert!(
                e < mosaickv_conformance::tolerances::ATTEND_REL_L2,
                "sequence {i}: rel L2 {e:e}"
            );
        }
    }
}

#[path = "cuda_cache/mod.rs"]
mod cuda_cache_checks;

mod cuda_cache {
    //! `CudaCache` on the emulation against the reference (`cuda_cache/mod.rs`): prefill,
    //! appends across buffer flushes, a batch of different lengths, a double-buffered
    //! swap, bad input.
    use super::cuda_cache_checks as checks;

    fn gpu() -> std::sync::Arc<mosaickv_optimized::cuda::device::Gpu> {
        super::shared().gpu().unwrap()
    }

    #[test]
    fn prefill_appends_and_flushes_match_the_reference() {
        checks::prefill_appends_and_flushes_match_the_reference(gpu());
    }

    #[test]
    fn live_batch_follows_the_background_worker() {
        checks::live_batch_follows_the_background_worker(gpu());
    }

    #[test]
    fn a_reencoded_segment_swaps_in_without_stopping_decode() {
        checks::a_reencoded_segment_swaps_in_without_stopping_decode(gpu());
    }

    #[test]
    fn bad_input_is_a_typed_error_and_keeps_the_cache() {
        checks::bad_input_is_a_typed_error_and_keeps_the_cache(gpu());
    }

    #[test]
    fn swaps_that_change_the_segment_count_move_the_later_segments() {
        checks::swaps_that_change_the_segment_count_move_the_later_segments(gpu());
    }
}
