//! Flash-decoding attention over packed segments, dense rows and their merge
//! (SPEC.md sections 8 and 9), plus the fused score + top-k selection.
//!
//! A *partial* is the online-softmax state of one work unit for the `G` query
//! heads of one KV head: `[m; G] [l; G] [acc; G * dp]` (f32). Units run on
//! rayon threads; partials are merged afterwards. All buffers live in a
//! reusable [`MosaicScratch`] or in per-thread tile buffers, so a decode step
//! allocates nothing once the buffers have grown to the cache's size.

use crate::simd::quant::SparsePlan;
use crate::simd::{fast_exp, Path, TILE};
use half::f16;
use mosaickv_spec::{CompressedCache, MosaicError, Result, Selection};
use rayon::prelude::*;
use std::cell::RefCell;

/// Selected blocks per work unit (flash-decoding split inside a segment).
pub const UNIT_BLOCKS: usize = 32;

/// Selected blocks prefetched ahead of the one being attended.
pub const PREFETCH_AHEAD: usize = 3;

/// Rounds up to a multiple of 8 (SIMD width).
#[inline]
pub fn pad8(x: usize) -> usize {
    x.div_ceil(8) * 8
}

/// Floats of one partial for `g` heads of padded width `dp`.
#[inline]
pub fn partial_len(g: usize, dp: usize) -> usize {
    2 * g + g * dp
}

/// Resets a partial to the empty state.
#[inline]
pub fn partial_init(st: &mut [f32], g: usize) {
    st[..g].fill(f32::NEG_INFINITY);
    st[g..].fill(0.0);
}

thread_local! {
    static TILES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f(ktile, vtile, logits)` with this thread's tile buffers (grown once, then reused).
pub fn with_tiles<R>(
    dp: usize,
    g: usize,
    f: impl FnOnce(&mut [f32], &mut [f32], &mut [f32]) -> R,
) -> R {
    TILES.with(|t| {
        let mut t = t.borrow_mut();
        let need = 2 * TILE * dp + g * TILE;
        if t.len() < need {
            t.resize(need, 0.0);
        }
        let (k, rest) = t.split_at_mut(TILE * dp);
        let (v, l) = rest.split_at_mut(TILE * dp);
        f(k, v, &mut l[..g * TILE])
    })
}

/// Tile-local online softmax step: `logits` (`[g][TILE]`, first `n` valid) become
/// probabilities relative to the new running max; `st` is rescaled; values accumulated.
#[inline]
pub fn online_update(
    path: Path,
    st: &mut [f32],
    g: usize,
    dp: usize,
    logits: &mut [f32],
    n: usize,
    vtile: &[f32],
) {
    let (m, rest) = st.split_at_mut(g);
    let (l, acc) = rest.split_at_mut(g);
    online_softmax(path, m, l, acc, g, dp, logits, n, None);
    path.tile_accumulate(logits, g, dp, vtile, n, acc);
}

/// The softmax half of [`online_update`] for `g` heads with running max `m`, sum `l`,
/// accumulators `acc` (`[g][dp]`): logits become probabilities, the state is rescaled.
/// With `corr` given, the accumulators are left alone (`acc` may be empty) and `corr[h]` gets
/// the factor they must be scaled by before this tile's values are added. The 16-lane kernel
/// on [`Path::Avx512`] (one register per head), the AVX2 kernel on [`Path::Avx2`], plain Rust
/// on [`Path::Portable`] (so the forced-portable run tests it).
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn online_softmax(
    path: Path,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
    g: usize,
    dp: usize,
    logits: &mut [f32],
    n: usize,
    mut corr: Option<&mut [f32]>,
) {
    #[cfg(target_arch = "x86_64")]
    if path != Path::Portable {
        assert!(
            m.len() >= g
                && l.len() >= g
                && (acc.len() >= g * dp || corr.as_ref().is_some_and(|c| c.len() >= g))
                && logits.len() >= g * TILE
                && n <= TILE
        );
        let mut local = [0f32; 64];
        if path == Path::Avx512 && (corr.is_some() || g <= local.len()) {
            let c = match corr.as_deref_mut() {
                Some(c) => &mut c[..g],
                None => &mut local[..g],
            };
            // SAFETY: AVX-512 detected; m, l, c hold g floats and logits g * TILE (asserted).
            unsafe {
                crate::simd::avx512::softmax::tile_softmax(
                    m.as_mut_ptr(),
                    l.as_mut_ptr(),
                    g,
                    logits.as_mut_ptr(),
                    n,
                    c.as_mut_ptr(),
                )
            };
            if corr.is_none() {
                for (a, &c) in acc[..g * dp].chunks_exact_mut(dp.max(1)).zip(&local[..g]) {
                    if c != 1.0 {
                        a.iter_mut().for_each(|x| *x *= c);
                    }
                }
            }
            return;
        }
        // SAFETY: a SIMD path means avx2/fma/f16c were detected; logits hold g * TILE floats
        // (asserted), other accesses are checked.
        unsafe { crate::simd::avx2::softmax::online_softmax(m, l, acc, g, dp, logits, n, corr) };
        return;
    }
    Path::Portable.ran();
    online_softmax_body(m, l, acc, g, dp, logits, n, corr)
}

/// Written over fixed 16-wide arrays so the compiler vectorizes the max, the exps and the sum.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn online_softmax_body(
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
    g: usize,
    dp: usize,
    logits: &mut [f32],
    n: usize,
    mut corr_out: Option<&mut [f32]>,
) {
    for h in 0..g {
        let lg: &mut [f32; TILE] = (&mut logits[h * TILE..(h + 1) * TILE])
            .try_into()
            .expect("TILE logits");
        for x in lg[n..].iter_mut() {
            *x = f32::NEG_INFINITY;
        }
        let mut mx = [f32::NEG_INFINITY; 8];
        for i in 0..TILE {
            mx[i % 8] = if lg[i] > mx[i % 8] { lg[i] } else { mx[i % 8] };
        }
        let mt = mx.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let m_old = m[h];
        let m_new = m_old.max(mt);
        let corr = if m_old == f32::NEG_INFINITY {
            0.0
        } else {
            fast_exp(m_old - m_new)
        };
        let mut sums = [0f32; 8];
        for i in 0..TILE {
            let p = if lg[i] == f32::NEG_INFINITY {
                0.0
            } else {
                fast_exp(lg[i] - m_new)
            };
            lg[i] = p;
            sums[i % 8] += p;
        }
        let sum: f32 = sums.iter().sum();
        l[h] = l[h] * corr + sum;
        if let Some(c) = corr_out.as_deref_mut() {
            c[h] = corr;
        } else if corr != 1.0 {
            for a in &mut acc[h * dp..(h + 1) * dp] {
                *a *= corr;
            }
        }
        m[h] = m_new;
    }
}

/// Attends dense f16 rows `t0..t1` (row t's key at `keys[t * stride ..][..d]`) into partial `st`.
/// `q` is `[g][dp]` (zero-padded past d).
#[allow(clippy::too_many_arguments)]
pub fn dense_rows_update(
    path: Path,
    q: &[f32],
    g: usize,
    d: usize,
    dp: usize,
    keys: &[f16],
    values: &[f16],
    stride: usize,
    t0: usize,
    t1: usize,
    scale: f32,
    st: &mut [f32],
) {
    if path.fused_f16(d) {
        // f16 rows read directly by the kernels; heads in groups of up to 8.
        let mut lg = [0f32; 8 * TILE];
        let (m, rest) = st.split_at_mut(g);
        let (l, acc) = rest.split_at_mut(g);
        let mut h0 = 0;
        while h0 < g {
            let gn = (g - h0).min(8);
            let (mg, lgs, ag) = (
                &mut m[h0..h0 + gn],
                &mut l[h0..h0 + gn],
                &mut acc[h0 * dp..(h0 + gn) * dp],
            );
            let mut t = t0;
            while t < t1 {
                let n = (t1 - t).min(TILE);
                path.tile_logits_f16(
                    &q[h0 * dp..],
                    gn,
                    dp,
                    &keys[t * stride..],
                    stride,
                    n,
                    scale,
                    &mut lg,
                );
                online_softmax(path, mg, lgs, ag, gn, dp, &mut lg, n, None);
                path.tile_accumulate_f16(&lg, gn, dp, &values[t * stride..], stride, n, ag);
                t += n;
            }
            h0 += gn;
        }
        return;
    }
    with_tiles(dp, g, |kt, vt, lg| {
        if d != dp {
            kt[..TILE * dp].fill(0.0);
            vt[..TILE * dp].fill(0.0);
        }
        let mut t = t0;
        while t < t1 {
            let n = (t1 - t).min(TILE);
            for i in 0..n {
                let o = (t + i) * stride;
                path.f16_to_f32(&keys[o..o + d], &mut kt[i * dp..i * dp + d]);
            }
            path.tile_logits(q, g, dp, kt, n, scale, lg);
            for i in 0..n {
                let o = (t + i) * stride;
                path.f16_to_f32(&values[o..o + d], &mut vt[i * dp..i * dp + d]);
            }
            online_update(path, st, g, dp, lg, n, vt);
            t += n;
        }
    })
}

/// Key for the fused top-k: sorts by score descending, then index ascending (SPEC 8.3, 12).
#[inline]
pub fn rank_key(score: f32, index: u32) -> u64 {
    // NaN ranks as -inf; `+ 0.0` turns -0 into +0 and leaves every other value alone.
    let s = if score.is_nan() {
        f32::NEG_INFINITY
    } else {
        score + 0.0
    };
    let b = s.to_bits();
    // Monotone map f32 -> u32 (increasing: negative values have all bits flipped, positive
    // ones the sign bit set), then inverted for descending.
    let mono = b ^ (((b as i32 >> 31) as u32) | 0x8000_0000);
    ((!mono as u64) << 32) | index as u64
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
        c = match path {
            // SAFETY: AVX-512 detected (the path); cand holds n + 16; n < 2^32 (block indices
            // are u32).
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 => unsafe {
                crate::simd::avx512::select::filter_rank_keys(scores, pivot, cand.as_mut_ptr())
            },
            _ => {
                Path::Portable.ran();
                let mut c = 0;
                for (i, &score) in scores.iter().enumerate() {
                    let x = rank_key(score, i as u32);
                    cand[c] = x;
                    c += usize::from(x <= pivot);
                }
                c
            }
        };
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

/// Per-segment geometry of one KV head, cached per step.
#[derive(Debug, Clone, Copy, Default)]
struct SegGeom {
    dtk: usize,
    dpk: usize,
    dtv: usize,
    dpv: usize,
    block: usize,
    blocks: usize,
    /// First global block index of this segment for this head.
    first: usize,
}

/// One flash-decoding work unit: selected blocks `sel[s0..s1]` of KV head `head`, all in segment `seg`.
#[derive(Debug, Clone, Copy)]
struct Unit {
    head: usize,
    seg: usize,
    s0: usize,
    s1: usize,
}

/// Reusable buffers for packed attention over a [`CompressedCache`].
#[derive(Debug, Default)]
pub struct MosaicScratch {
    geom: Vec<SegGeom>,
    qrot: Vec<f32>,
    scores: Vec<f32>,
    sel: Vec<Vec<u32>>,
    keys: Vec<Vec<u64>>,
    units: Vec<Unit>,
    partials: Vec<f32>,
    head_out: Vec<f32>,
}

/// Sizes the step needs, from the cache's geometry.
struct Dims {
    kv: usize,
    g: usize,
    d: usize,
    dp: usize,
    nseg: usize,
    dpk_max: usize,
    dpv_max: usize,
    blocks_max: usize,
}

fn dims(cache: &CompressedCache) -> Dims {
    let s = &cache.shape;
    let mut dpk_max = 8;
    let mut dpv_max = 8;
    let mut blocks_max = 0;
    for h in 0..s.kv_heads {
        let mut b = 0;
        for seg in &cache.segments {
            let hs = &seg.heads[h];
            dpk_max = dpk_max.max(pad8(hs.strategy.key.layout.kept_dims));
            dpv_max = dpv_max.max(pad8(hs.strategy.value.layout.kept_dims));
            b += seg.len.div_ceil(hs.strategy.block_size.max(1));
        }
        blocks_max = blocks_max.max(b);
    }
    Dims {
        kv: s.kv_heads,
        g: s.group(),
        d: s.head_dim,
        dp: pad8(s.head_dim),
        nseg: cache.segments.len(),
        dpk_max,
        dpv_max,
        blocks_max,
    }
}

/// Scratch bytes packed attention needs for a cache of this geometry (excluding
/// per-thread tile buffers of `2 * TILE * dp + g * TILE` floats and the unit list).
pub fn scratch_bytes_for(
    kv: usize,
    g: usize,
    d: usize,
    nseg: usize,
    blocks_per_head: usize,
    selected_per_head: usize,
) -> usize {
    let dp = pad8(d);
    let units = kv * (nseg + selected_per_head.div_ceil(UNIT_BLOCKS));
    4 * (kv * nseg * g * dp) // rotated queries
        + 4 * kv * blocks_per_head // scores
        + 8 * kv * blocks_per_head // rank keys
        + 4 * kv * selected_per_head // selections
        + 4 * units * partial_len(g, dp) // unit partials
        + 4 * kv * (3 * g * dp + 3 * g) // per-head merge buffers
        + std::mem::size_of::<SegGeom>() * kv * nseg
        + std::mem::size_of::<Unit>() * units
}

/// Where the selection of a step comes from.
pub enum SelectionSource<'a> {
    /// Score and select (SPEC 8).
    Compute,
    /// Use this selection (validated).
    Given(&'a Selection),
}

/// SPEC 8 + 9 over a compressed cache. `queries` is `[q_heads][d]` row-major, `out` `[q_heads][d]`.
/// When `want_selection` is set (and the selection is computed), the selection is returned as `(segment, block)` pairs.
pub fn packed_attention(
    path: Path,
    cache: &CompressedCache,
    queries: &[f32],
    src: SelectionSource<'_>,
    want_selection: bool,
    out: Option<&mut [f32]>,
    sc: &mut MosaicScratch,
) -> Result<Option<Selection>> {
    if cache.is_empty() {
        return Err(MosaicError::EmptyCache);
    }
    let dm = dims(cache);
    let (kv, g, d, dp, nseg) = (dm.kv, dm.g, dm.d, dm.dp, dm.nseg);
    // Geometry per (head, seg).
    sc.geom.clear();
    for h in 0..kv {
        let mut first = 0;
        for seg in &cache.segments {
            let st = &seg.heads[h].strategy;
            let blocks = seg.len.div_ceil(st.block_size.max(1));
            sc.geom.push(SegGeom {
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
    let qstride = g * dm.dpk_max; // per (head, seg)
    sc.qrot.resize(kv * nseg * qstride, 0.0);
    sc.scores.resize(kv * dm.blocks_max, 0.0);
    sc.sel.resize_with(kv, Vec::new);
    sc.keys.resize_with(kv, Vec::new);
    let n_seg_tokens = cache.segment_tokens();
    let budget = cache.config.budget_tokens(n_seg_tokens);
    let compute = matches!(src, SelectionSource::Compute);

    for sel in &mut sc.sel {
        sel.clear();
    }
    // Phase A: rotate queries once per (segment, head); score + select (fused, per KV head).
    if nseg > 0 {
        let geom = &sc.geom;
        sc.qrot
            .par_chunks_mut(nseg * qstride)
            .zip(sc.scores.par_chunks_mut(dm.blocks_max.max(1)))
            .zip(sc.sel.par_iter_mut().zip(sc.keys.par_iter_mut()))
            .enumerate()
            .for_each(|(h, ((qr, scores), (sel, keys)))| {
                // the f16 rotations widened to f32 (exact), one segment at a time
                let mut rot32 = Vec::new();
                let mut bmin = usize::MAX;
                let mut total_blocks = 0;
                for (s, seg) in cache.segments.iter().enumerate() {
                    let gm = geom[h * nseg + s];
                    let hs = &seg.heads[h];
                    let q = &mut qr[s * qstride..(s + 1) * qstride];
                    let qh = &queries[h * g * d..(h + 1) * g * d];
                    mosaickv_spec::layout::widen_rotation(&hs.strategy.key.rotation, &mut rot32);
                    path.rotate_queries(&rot32, d, qh, g, q, gm.dpk);
                    for k in 0..g {
                        q[k * gm.dpk + gm.dtk..(k + 1) * gm.dpk].fill(0.0);
                    }
                    if compute {
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
                        bmin = bmin.min(gm.block);
                    }
                    total_blocks += gm.blocks;
                }
                if compute {
                    let gh = &geom[h * nseg..(h + 1) * nseg];
                    // Blocks below `full_until` all hold `b0` tokens (the leading segments of
                    // one block size), so most lookups skip the search over segments.
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
                        let s = gh.partition_point(|x| x.first + x.blocks <= i);
                        let b = i - gh[s].first;
                        (cache.segments[s].len - b * gh[s].block).min(gh[s].block)
                    };
                    let max_take = budget.div_ceil(bmin.max(1)) + nseg;
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
            });
    }
    if let SelectionSource::Given(given) = src {
        if given.per_head.len() != kv {
            return Err(MosaicError::ShapeMismatch {
                what: "selection",
                expected: format!("{kv} heads"),
                got: format!("{} heads", given.per_head.len()),
            });
        }
        for h in 0..kv {
            let sel = &mut sc.sel[h];
            sel.clear();
            for &(s, b) in &given.per_head[h] {
                let (s, b) = (s as usize, b as usize);
                if s >= nseg || b >= sc.geom[h * nseg + s].blocks {
                    return Err(MosaicError::ShapeMismatch {
                        what: "selection",
                        expected: "blocks of existing segments".into(),
                        got: format!("({s}, {b}) for head {h}"),
                    });
                }
                let gi = (sc.geom[h * nseg + s].first + b) as u32;
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
    }
    let selection = if compute && want_selection {
        let mut per_head = Vec::with_capacity(kv);
        for h in 0..kv {
            let gh = &sc.geom[h * nseg..(h + 1) * nseg];
            per_head.push(
                sc.sel[h]
                    .iter()
                    .map(|&i| {
                        let s = gh.partition_point(|x| x.first + x.blocks <= i as usize);
                        (s as u32, i - gh[s].first as u32)
                    })
                    .collect(),
            );
        }
        Some(Selection { per_head })
    } else {
        None
    };
    let out = match out {
        Some(o) => o,
        None => return Ok(selection),
    };

    // Units: consecutive selected blocks of one (head, segment), at most UNIT_BLOCKS each.
    sc.units.clear();
    for h in 0..kv {
        let sel = &sc.sel[h];
        let gh = &sc.geom[h * nseg..(h + 1) * nseg];
        let mut i = 0;
        while i < sel.len() {
            let s = gh.partition_point(|x| x.first + x.blocks <= sel[i] as usize);
            let end_block = (gh[s].first + gh[s].blocks) as u32;
            let mut j = i;
            while j < sel.len() && sel[j] < end_block && j - i < UNIT_BLOCKS {
                j += 1;
            }
            sc.units.push(Unit {
                head: h,
                seg: s,
                s0: i,
                s1: j,
            });
            i = j;
        }
    }
    let plen = partial_len(g, dm.dpv_max.max(dp));
    sc.partials.resize(sc.units.len() * plen, 0.0);
    let scale = 1.0 / (d as f32).sqrt();

    // Phase B: flash-decoding over the selected packed blocks.
    {
        let (units, geom, sel, qrot) = (&sc.units, &sc.geom, &sc.sel, &sc.qrot);
        sc.partials
            .par_chunks_mut(plen)
            .zip(units.par_iter())
            .for_each(|(st, u)| {
                let gm = geom[u.head * nseg + u.seg];
                let hs = &cache.segments[u.seg].heads[u.head];
                let seg_len = cache.segments[u.seg].len;
                let (kl, vl) = (&hs.strategy.key.layout, &hs.strategy.value.layout);
                let (krb, vrb) = (kl.record_bytes(), vl.record_bytes());
                let q = &qrot[(u.head * nseg + u.seg) * qstride..][..g * gm.dpk];
                let dpmax = gm.dpk.max(gm.dpv);
                partial_init(&mut st[..partial_len(g, gm.dpv)], g);
                // Values expanded in registers straight into the accumulators where the path can.
                let mut corr = [0f32; 64];
                // The fused and f16-tile kernels read f16 values; int8/int4 records are
                // expanded to f32 tiles of decoded values (`Path::expand_records_q`).
                let fused_v = g <= corr.len()
                    && !vl.dtype.is_quantized()
                    && path.fused_packed(vl.group_size, vl.kept_dims, vl.r, gm.dpv);
                // Sparse int8/int4 values: only the kept dims are accumulated, into a
                // head-minor accumulator (in the value tile's buffer) for the whole unit.
                // (`plan.len(dtv) <= 16 dtv`, inside the value tile's TILE * dpmax floats.)
                let sparse = if path.sparse_values(vl, g) {
                    SparsePlan::new(vl.group_size, g)
                } else {
                    None
                };
                let half_keys = !kl.dtype.is_quantized()
                    && path.half_tile(kl.group_size, kl.kept_dims, kl.r, gm.dpk);
                with_tiles(dpmax, g, |kt, vt, lg| {
                    let blocks = &sel[u.head][u.s0..u.s1];
                    // Software prefetch PREFETCH_AHEAD selected blocks ahead (their records are
                    // scattered, so the hardware prefetcher cannot guess them).
                    let prefetch = |i: usize| {
                        if let Some(&next) = blocks.get(i) {
                            let t0 = (next as usize - gm.first) * gm.block;
                            let t1 = (t0 + gm.block).min(seg_len);
                            path.prefetch(&hs.keys.bytes[t0 * krb..t1 * krb]);
                            path.prefetch(&hs.values.bytes[t0 * vrb..t1 * vrb]);
                        }
                    };
                    for i in 0..PREFETCH_AHEAD {
                        prefetch(i);
                    }
                    if let Some(plan) = &sparse {
                        vt[..plan.len(gm.dtv)].fill(0.0);
                    }
                    for (bi, &gi) in blocks.iter().enumerate() {
                        prefetch(bi + PREFETCH_AHEAD);
                        let b = gi as usize - gm.first;
                        let t0 = b * gm.block;
                        let t1 = (t0 + gm.block).min(seg_len);
                        let mut t = t0;
                        while t < t1 {
                            let n = (t1 - t).min(TILE);
                            let kb = &hs.keys.bytes[t * krb..];
                            if half_keys {
                                // Keys expanded to an f16 tile (in the f32 key tile's bytes),
                                // widened as the logits load them.
                                let kh: &mut [half::f16] = bytemuck::cast_slice_mut(&mut kt[..]);
                                let kr = (kb, krb, kl.bitmap_bytes());
                                path.expand_records_h(kr, n, kl.kept_dims, kl.r, gm.dpk, kh);
                                path.tile_logits_h(q, g, gm.dpk, kh, n, scale, lg);
                            } else if kl.dtype.is_quantized() {
                                path.expand_records_q(kb, n, kl, gm.dpk, kt);
                                path.tile_logits(q, g, gm.dpk, kt, n, scale, lg);
                            } else {
                                path.expand_records(
                                    kb,
                                    kb.len() - n * krb,
                                    n,
                                    krb,
                                    kl.bitmap_bytes(),
                                    kl.group_size,
                                    kl.kept_dims,
                                    kl.r,
                                    gm.dpk,
                                    kt,
                                );
                                path.tile_logits(q, g, gm.dpk, kt, n, scale, lg);
                            }
                            let st = &mut st[..partial_len(g, gm.dpv)];
                            let vb = &hs.values.bytes[t * vrb..];
                            if fused_v || sparse.is_some() {
                                // The softmax step gives the rescale factors; the kernel
                                // rescales its accumulator with them.
                                let (m, rest) = st.split_at_mut(g);
                                let (l, acc) = rest.split_at_mut(g);
                                let corr = &mut corr[..g];
                                online_softmax(
                                    path,
                                    m,
                                    l,
                                    &mut [],
                                    g,
                                    gm.dpv,
                                    lg,
                                    n,
                                    Some(&mut *corr),
                                );
                                if let Some(plan) = &sparse {
                                    let acc_t = &mut vt[..plan.len(gm.dtv)];
                                    plan.rescale(acc_t, corr);
                                    path.sparse_accumulate_q(lg, plan, vb, vl, n, acc_t);
                                } else {
                                    path.packed_accumulate(
                                        lg,
                                        g,
                                        gm.dpv,
                                        (vb, vrb, vl.bitmap_bytes()),
                                        n,
                                        vl.kept_dims,
                                        vl.r,
                                        corr,
                                        acc,
                                    );
                                }
                            } else if vl.dtype.is_quantized() {
                                path.expand_records_q(vb, n, vl, gm.dpv, vt);
                                online_update(path, st, g, gm.dpv, lg, n, vt);
                            } else {
                                path.expand_records(
                                    vb,
                                    vb.len() - n * vrb,
                                    n,
                                    vrb,
                                    vl.bitmap_bytes(),
                                    vl.group_size,
                                    vl.kept_dims,
                                    vl.r,
                                    gm.dpv,
                                    vt,
                                );
                                online_update(path, st, g, gm.dpv, lg, n, vt);
                            }
                            t += n;
                        }
                    }
                    if let Some(plan) = &sparse {
                        // The head-minor accumulator into the partial's `[g][dpv]` one (the
                        // dims past Dt stay 0, as the dense path leaves them).
                        let acc = &mut st[2 * g..partial_len(g, gm.dpv)];
                        for h in 0..g {
                            for j in 0..gm.dtv {
                                acc[h * gm.dpv + j] = vt[plan.at(j, h)];
                            }
                        }
                    }
                });
            });
    }

    // Phase C: per KV head, the dense part (sink + buffer), then merge units of each
    // segment in rotated space, rotate back once per (segment, head), merge everything.
    let hlen = 3 * g * dp + 3 * g;
    sc.head_out.resize(kv * hlen, 0.0);
    {
        let (units, geom, partials) = (&sc.units, &sc.geom, &sc.partials);
        sc.head_out
            .par_chunks_mut(hlen)
            .enumerate()
            .for_each(|(h, buf)| {
                // a segment's f16 value rotation widened to f32 (exact)
                let mut rv32 = Vec::new();
                let (dense, rest) = buf.split_at_mut(partial_len(g, dp));
                let (qd, rest) = rest.split_at_mut(g * dp);
                let (acc, mx) = rest.split_at_mut(g * dp);
                let mx = &mut mx[..g];
                // Dense part with the unrotated queries.
                partial_init(dense, g);
                for k in 0..g {
                    let row = &mut qd[k * dp..(k + 1) * dp];
                    row[..d].copy_from_slice(&queries[(h * g + k) * d..(h * g + k + 1) * d]);
                    row[d..].fill(0.0);
                }
                let stride = kv * d;
                for rows in [&cache.sink, &cache.buffer] {
                    if rows.tokens > 0 {
                        dense_rows_update(
                            path,
                            qd,
                            g,
                            d,
                            dp,
                            &rows.keys[h * d..],
                            &rows.values[h * d..],
                            stride,
                            0,
                            rows.tokens,
                            scale,
                            dense,
                        );
                    }
                }
                // Global max per query head.
                mx.copy_from_slice(&dense[..g]);
                let base = units.partition_point(|u| u.head < h);
                let hu = &units[base..units.partition_point(|u| u.head <= h)];
                for i in 0..hu.len() {
                    let p = &partials[(base + i) * plen..];
                    for k in 0..g {
                        mx[k] = mx[k].max(p[k]);
                    }
                }
                // Output accumulator (unrotated, width dp): starts from the dense part.
                let mut lsum = [0f32; 64];
                let mut lsum_vec: Vec<f32>;
                let l: &mut [f32] = if g <= 64 {
                    &mut lsum[..g]
                } else {
                    lsum_vec = vec![0.0; g];
                    &mut lsum_vec[..]
                };
                let (o_acc, seg_acc) = (qd, acc); // qd no longer needed after dense part
                for k in 0..g {
                    let c = if dense[k] == f32::NEG_INFINITY {
                        0.0
                    } else {
                        fast_exp(dense[k] - mx[k])
                    };
                    l[k] = dense[g + k] * c;
                    for (o, &a) in o_acc[k * dp..(k + 1) * dp]
                        .iter_mut()
                        .zip(&dense[2 * g + k * dp..2 * g + (k + 1) * dp])
                    {
                        *o = a * c;
                    }
                }
                let mut i = 0;
                while i < hu.len() {
                    let s = hu[i].seg;
                    let gm = geom[h * nseg + s];
                    seg_acc[..g * gm.dpv].fill(0.0);
                    while i < hu.len() && hu[i].seg == s {
                        let p = &partials
                            [(base + i) * plen..(base + i) * plen + partial_len(g, gm.dpv)];
                        for k in 0..g {
                            if p[k] == f32::NEG_INFINITY {
                                continue;
                            }
                            let c = fast_exp(p[k] - mx[k]);
                            l[k] += p[g + k] * c;
                            for (o, &a) in seg_acc[k * gm.dpv..(k + 1) * gm.dpv]
                                .iter_mut()
                                .zip(&p[2 * g + k * gm.dpv..2 * g + (k + 1) * gm.dpv])
                            {
                                *o += a * c;
                            }
                        }
                        i += 1;
                    }
                    // Rotate back: o_i += sum_{j < dtv} R_v[i][j] acc_j (R_v stored D x Dt_v).
                    mosaickv_spec::layout::widen_rotation(
                        &cache.segments[s].heads[h].strategy.value.rotation,
                        &mut rv32,
                    );
                    let rv = &rv32;
                    for k in 0..g {
                        let a = &seg_acc[k * gm.dpv..k * gm.dpv + gm.dtv];
                        let o = &mut o_acc[k * dp..k * dp + d];
                        for (ii, oi) in o.iter_mut().enumerate() {
                            *oi += path.dot(&rv[ii * gm.dtv..(ii + 1) * gm.dtv], a);
                        }
                    }
                }
                for k in 0..g {
                    let inv = if l[k] > 0.0 { 1.0 / l[k] } else { 0.0 };
                    for x in &mut o_acc[k * dp..k * dp + d] {
                        *x *= inv;
                    }
                }
            });
    }
    for h in 0..kv {
        let buf = &sc.head_out[h * hlen..(h + 1) * hlen];
        let o_acc = &buf[partial_len(g, dp)..partial_len(g, dp) + g * dp];
        for k in 0..g {
            out[(h * g + k) * d..(h * g + k + 1) * d].copy_from_slice(&o_acc[k * dp..k * dp + d]);
        }
    }
    Ok(selection)
}

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
