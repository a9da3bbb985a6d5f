//! SPEC.md section 8, block selection, for every KV head of a compressed cache: each
//! segment's query rotation (8.1, [`Path::rotate_queries`]), the block scores on the int8
//! bounds (8.2, [`Path::score_blocks`]) and the top blocks under the token budget (8.3,
//! [`top_blocks`], filtered by [`Path::filter_rank_keys`]).
//!
//! Blocks are numbered per KV head across segments: a block's global index is its segment's
//! first block ([`SegGeom::first`]) plus its index in the segment. Selections are kept as
//! ascending global indices, one list per KV head.

use crate::profile::{Lap, Stage, StageClocks};
use crate::simd::{pad8, q8_stride, quantize_query_i8, rank_key, Path};
use mosaickv_spec::{CompressedCache, MosaicError, Result, Selection};
use rayon::prelude::*;

/// Per-segment geometry of one KV head, cached per step.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SegGeom {
    /// Kept dims of the key records (`Dt_k`) and their padded width.
    pub dtk: usize,
    pub dpk: usize,
    /// Kept dims of the value records (`Dt_v`) and their padded width.
    pub dtv: usize,
    pub dpv: usize,
    /// Block size and blocks of the segment.
    pub block: usize,
    pub blocks: usize,
    /// First global block index of this segment for this head.
    pub first: usize,
}

/// The geometry of every (KV head, segment) of `cache`, head-major, into `geom`.
pub(crate) fn segment_geometry(cache: &CompressedCache, geom: &mut Vec<SegGeom>) {
    geom.clear();
    for h in 0..cache.shape.kv_heads {
        let mut first = 0;
        for seg in &cache.segments {
            let st = &seg.heads[h].strategy;
            let blocks = seg.len.div_ceil(st.block_size.max(1));
            geom.push(SegGeom {
                dtk: st.key.layout.kept_dims,
                dpk: pad8(st.key.layout.kept_dims),
                dtv: st.value.layout.kept_dims,
                dpv: pad8(st.value.layout.kept_dims),
                block: st.block_size,
                blocks,
                first,
            });
            first += blocks;
        }
    }
}

/// The segment of one head's geometry `gh` that holds global block `i`.
#[inline]
pub(crate) fn segment_of(gh: &[SegGeom], i: usize) -> usize {
    gh.partition_point(|x| x.first + x.blocks <= i)
}

/// The buffers of one step's selection, one chunk per KV head.
pub(crate) struct SelectBuffers<'a> {
    /// Rotated queries, `qstride` floats per (head, segment): `[g][dpk]` zero-padded past `Dt_k`.
    pub qrot: &'a mut [f32],
    pub qstride: usize,
    /// SPEC 8.2's int8 rotated queries for SPEC 9's logits on int8/int4 key records,
    /// `q8stride` bytes per (head, segment): `[g][q8_stride(Dt_k)]`, zero past `Dt_k`; and
    /// their scales `s_q`, `g` per (head, segment). Written for segments whose keys are
    /// int8/int4.
    pub q8: &'a mut [i8],
    pub q8stride: usize,
    pub q8scale: &'a mut [f64],
    /// Block scores, `blocks_max` per head.
    pub scores: &'a mut [f32],
    pub blocks_max: usize,
    /// The selected global block indices per head, and [`top_blocks`]'s scratch.
    pub sel: &'a mut [Vec<u32>],
    pub keys: &'a mut [Vec<u64>],
}

/// SPEC 8 for every KV head of `cache`, queries `[q_heads][d]`: the rotated queries of every
/// segment (8.1) into `bufs.qrot`, and, when `score` is set, the block scores (8.2) and the
/// selected blocks under `cache`'s token budget (8.3) into `bufs.sel`. The heads run in
/// parallel. With `clocks`, each step's thread time is charged to its [`Stage`].
pub(crate) fn rotate_and_select(
    path: Path,
    cache: &CompressedCache,
    queries: &[f32],
    geom: &[SegGeom],
    score: bool,
    bufs: SelectBuffers<'_>,
    clocks: Option<&StageClocks>,
) {
    let (kv, nseg) = (cache.shape.kv_heads, cache.segments.len());
    let (g, d) = (cache.shape.group(), cache.shape.head_dim);
    let budget = cache.config.budget_tokens(cache.segment_tokens());
    let (qstride, q8stride) = (bufs.qstride, bufs.q8stride);
    bufs.qrot[..kv * nseg * qstride]
        .par_chunks_mut(nseg * qstride)
        .zip(bufs.scores.par_chunks_mut(bufs.blocks_max.max(1)))
        .zip(bufs.sel.par_iter_mut().zip(bufs.keys.par_iter_mut()))
        .zip(
            bufs.q8[..kv * nseg * q8stride]
                .par_chunks_mut(nseg * q8stride)
                .zip(bufs.q8scale[..kv * nseg * g].par_chunks_mut(nseg * g)),
        )
        .enumerate()
        .for_each(|(h, (((qr, scores), (sel, keys)), (q8h, q8s)))| {
            let mut lap = Lap::new(clocks);
            let gh = &geom[h * nseg..(h + 1) * nseg];
            let qh = &queries[h * g * d..(h + 1) * g * d];
            for (s, (seg, gm)) in cache.segments.iter().zip(gh).enumerate() {
                let hs = &seg.heads[h];
                let q = &mut qr[s * qstride..(s + 1) * qstride];
                path.rotate_queries(&hs.strategy.key.rotation, d, qh, g, q, gm.dpk);
                for k in 0..g {
                    q[k * gm.dpk + gm.dtk..(k + 1) * gm.dpk].fill(0.0);
                }
                if hs.strategy.key.layout.dtype.is_quantized() {
                    // SPEC 9 on int8/int4 keys multiplies 8.2's int8 query
                    let qs = q8_stride(gm.dtk);
                    let q8 = &mut q8h[s * q8stride..(s + 1) * q8stride];
                    for k in 0..g {
                        q8s[s * g + k] = quantize_query_i8(
                            path,
                            &q[k * gm.dpk..k * gm.dpk + gm.dtk],
                            &mut q8[k * qs..(k + 1) * qs],
                        );
                    }
                }
                lap.lap(Stage::Rotate);
                if score {
                    path.score_blocks(
                        q,
                        g,
                        gm.dpk,
                        gm.dtk,
                        &hs.meta.min,
                        &hs.meta.max,
                        &hs.meta.scale,
                        &mut scores[gm.first..gm.first + gm.blocks],
                    );
                    lap.lap(Stage::Score);
                }
            }
            if score {
                select_head(path, cache, gh, budget, scores, keys, sel);
                lap.lap(Stage::TopK);
            }
        });
}

/// SPEC 8.3 for one KV head (geometry `gh`): the blocks of `scores` (all segments, global
/// indices) taken under `budget` tokens, ascending, into `sel`.
fn select_head(
    path: Path,
    cache: &CompressedCache,
    gh: &[SegGeom],
    budget: usize,
    scores: &[f32],
    keys: &mut Vec<u64>,
    sel: &mut Vec<u32>,
) {
    let total_blocks: usize = gh.iter().map(|x| x.blocks).sum();
    let bmin = gh.iter().map(|x| x.block).min().unwrap_or(1);
    // Blocks below `full_until` all hold `b0` tokens (the leading segments of one block
    // size), so most lookups skip the search over segments.
    let b0 = gh[0].block;
    let mut full_until = 0;
    for (x, seg) in gh.iter().zip(&cache.segments) {
        if x.block != b0 || b0 == 0 {
            break;
        }
        full_until = x.first + seg.len / b0;
        if seg.len % b0 != 0 {
            break;
        }
    }
    let lens = |i: usize| {
        if i < full_until {
            return b0;
        }
        let s = segment_of(gh, i);
        let b = i - gh[s].first;
        (cache.segments[s].len - b * gh[s].block).min(gh[s].block)
    };
    let max_take = budget.div_ceil(bmin.max(1)) + gh.len();
    top_blocks(
        path,
        &scores[..total_blocks],
        lens,
        budget,
        max_take,
        keys,
        sel,
    );
}

/// A given selection (`(segment, block)` pairs per KV head) as ascending global block indices
/// in `sel`, checked against the cache's geometry: one list per head, existing blocks,
/// strictly ascending.
pub(crate) fn given_blocks(
    given: &Selection,
    geom: &[SegGeom],
    kv: usize,
    nseg: usize,
    sel: &mut [Vec<u32>],
) -> Result<()> {
    if given.per_head.len() != kv {
        return Err(MosaicError::ShapeMismatch {
            what: "selection",
            expected: format!("{kv} heads"),
            got: format!("{} heads", given.per_head.len()),
        });
    }
    for (h, sel) in sel.iter_mut().enumerate().take(kv) {
        sel.clear();
        for &(s, b) in &given.per_head[h] {
            let (s, b) = (s as usize, b as usize);
            if s >= nseg || b >= geom[h * nseg + s].blocks {
                return Err(MosaicError::ShapeMismatch {
                    what: "selection",
                    expected: "blocks of existing segments".into(),
                    got: format!("({s}, {b}) for head {h}"),
                });
            }
            let gi = (geom[h * nseg + s].first + b) as u32;
            if sel.last().is_some_and(|&l| l >= gi) {
                return Err(MosaicError::ShapeMismatch {
                    what: "selection",
                    expected: "strictly ascending blocks".into(),
                    got: format!("({s}, {b}) for head {h}"),
                });
            }
            sel.push(gi);
        }
    }
    Ok(())
}

/// The selection of global block indices `sel` (per KV head) as `(segment, block)` pairs.
pub(crate) fn selection_of(sel: &[Vec<u32>], geom: &[SegGeom], nseg: usize) -> Selection {
    let per_head = sel
        .iter()
        .enumerate()
        .map(|(h, blocks)| {
            let gh = &geom[h * nseg..(h + 1) * nseg];
            blocks
                .iter()
                .map(|&i| {
                    let s = segment_of(gh, i as usize);
                    (s as u32, i - gh[s].first as u32)
                })
                .collect()
        })
        .collect();
    Selection { per_head }
}

/// SPEC 8.3: blocks taken in (score desc, index asc) order while fewer than `budget` tokens are taken;
/// written ascending into `out`. `keys` is scratch. `max_take` bounds how many blocks can be needed.
///
/// Work per call, for `n` scores and `k = max_take`:
/// 1. when `n` is large against `k`, a pivot from an evenly strided sample of the keys
///    bounds the `k` smallest keys, so one streaming pass keeps only the keys at or below
///    it (about `2k` of them) instead of storing all `n` (a pivot that keeps fewer than `k`
///    falls back to all keys: the result never depends on the sample);
/// 2. with `len` the length of any candidate's block and `m = ceil(budget / len) <= k`,
///    `select_nth_unstable` puts the `m` smallest keys first; when all of them name blocks
///    of length `len`, exactly those `m` are taken (no sort);
/// 3. otherwise the `k` smallest keys are sorted and taken in order until the budget is met;
/// 4. the taken indices are marked in a bitmap and read back in ascending order.
pub fn top_blocks(
    path: Path,
    scores: &[f32],
    lens: impl Fn(usize) -> usize,
    budget: usize,
    max_take: usize,
    keys: &mut Vec<u64>,
    out: &mut Vec<u32>,
) {
    out.clear();
    let n = scores.len();
    if budget == 0 || n == 0 {
        return;
    }
    let k = max_take.clamp(1, n);
    let key = |i: usize| rank_key(scores[i], i as u32);
    // Scratch: candidate keys in [0, n + 16) (the vector filter stores 16 at a time), the output
    // bitmap after them. Grown once, never cleared: every entry used below is written first.
    let words = n.div_ceil(64);
    if keys.len() < n + 16 + words {
        keys.resize(n + 16 + words, 0);
    }
    let (cand, bits) = keys.split_at_mut(n + 16);
    let bits = &mut bits[..words];
    let mut c = 0;
    if n >= SAMPLE_MIN_SCORES && k.saturating_mul(4) <= n {
        // Pivot: the sample key at rank r = about k/n of the sample, plus a margin of
        // 3 sqrt(r) + 2 ranks (the spread of the keys below a sample rank), so that at least
        // k keys lie at or below it unless the scores are laid out against the stride.
        let mut sample = [0u64; SAMPLE_KEYS];
        for (j, x) in sample.iter_mut().enumerate() {
            *x = key(j * n / SAMPLE_KEYS);
        }
        let r = (k * SAMPLE_KEYS).div_ceil(n);
        let rank = r + 3 * (r as f64).sqrt().ceil() as usize + 2;
        let pivot = if rank < SAMPLE_KEYS {
            *sample.select_nth_unstable(rank).1
        } else {
            u64::MAX
        };
        c = path.filter_rank_keys(scores, pivot, cand);
    }
    if c < k {
        // No filter, or a pivot that kept too few: every key is a candidate.
        for (i, x) in cand[..n].iter_mut().enumerate() {
            *x = key(i);
        }
        c = n;
    }
    let cand = &mut cand[..c];
    let index = |x: u64| (x & 0xffff_ffff) as usize;
    // Uniform case: the m smallest keys all name blocks of one length (that of any candidate).
    let len0 = lens(index(cand[0]));
    let m = if len0 > 0 { budget.div_ceil(len0) } else { 0 };
    let uniform = m > 0 && m <= k && {
        if m < c {
            cand.select_nth_unstable(m - 1);
        }
        cand[..m].iter().all(|&x| lens(index(x)) == len0)
    };
    let take = if uniform {
        m
    } else {
        if k < c {
            cand.select_nth_unstable(k - 1);
        }
        let head = &mut cand[..k];
        head.sort_unstable();
        let mut taken = 0usize;
        let mut m = 0;
        for &x in head.iter() {
            if taken >= budget {
                break;
            }
            taken += lens(index(x));
            m += 1;
        }
        m
    };
    // Ascending output through a bitmap of the n blocks.
    bits.fill(0);
    for &x in &cand[..take] {
        let i = index(x);
        bits[i / 64] |= 1 << (i % 64);
    }
    for (w, &word) in bits.iter().enumerate() {
        let mut b = word;
        while b != 0 {
            out.push((w * 64) as u32 + b.trailing_zeros());
            b &= b - 1;
        }
    }
}

/// Fewest scores for which [`top_blocks`] filters by a sampled pivot.
const SAMPLE_MIN_SCORES: usize = 2048;
/// Keys in [`top_blocks`]'s sample.
const SAMPLE_KEYS: usize = 256;

/// SPEC.md sections 8-9: the tokens a compressed cache attends per query head for queries
/// `[q_heads, head_dim]`: the sink, the blocks [`crate::CpuBackend`] selects, the open tail
/// and the update buffer (SPEC.md section 16's recall@k).
pub fn attended_tokens(
    cache: &CompressedCache,
    queries: ndarray::ArrayView2<f32>,
) -> Result<Vec<Vec<usize>>> {
    use mosaickv_spec::Backend as _;
    let shape = cache.shape;
    let total = cache.len();
    let sink = cache.sink.tokens;
    let seg_end = cache.segments.last().map_or(sink, |s| s.start + s.len);
    let mut per_kv: Vec<Vec<usize>> = vec![(0..sink).collect(); shape.kv_heads];
    if !cache.segments.is_empty() {
        let sel = crate::CpuBackend::new().select(cache, queries)?;
        for (h, blocks) in sel.per_head.iter().enumerate() {
            for &(s, b) in blocks {
                let seg = &cache.segments[s as usize];
                let bs = seg.heads[h].strategy.block_size;
                let a = seg.start + b as usize * bs;
                let e = (a + bs).min(seg.start + seg.len);
                per_kv[h].extend(a..e);
            }
        }
    }
    for set in &mut per_kv {
        set.extend(seg_end..total);
    }
    Ok((0..shape.q_heads)
        .map(|qh| per_kv[qh / shape.group()].clone())
        .collect())
}
