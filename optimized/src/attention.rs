//! SPEC.md section 9, PackedAttention: flash-decoding attention over the selected blocks of
//! packed segments, the dense rows (sink and update buffer), and their merge. One function per
//! step of the decode step ([`packed_attention`] runs them in order):
//!
//! | step | function |
//! |---|---|
//! | SPEC 8 (rotated queries, block scores, top blocks) | [`crate::select::rotate_and_select`] |
//! | work units over the selected blocks | [`plan_units`] |
//! | SPEC 9 key logits on packed records | [`tile_key_logits`] |
//! | SPEC 9 online softmax and value accumulation (rotated space) | [`attend_unit`] |
//! | SPEC 9 dense rows (sink, update buffer) | [`dense_rows_update`] |
//! | SPEC 9 merge of the partials and back-rotation of the values | [`merge_head`] |
//!
//! A *partial* is the online-softmax state of one work unit for the `G` query
//! heads of one KV head: `[m; G] [l; G] [acc; G * dp]` (f32). Units run on
//! rayon threads; partials are merged afterwards. All buffers live in a
//! reusable [`MosaicScratch`] or in per-thread tile buffers, so a decode step
//! allocates nothing once the buffers have grown to the cache's size.

use crate::coded::CodedPlan;
use crate::profile::{Lap, Stage, StageClocks, StepProfile};
use crate::select::{
    given_blocks, rotate_and_select, segment_geometry, segment_of, selection_of, SegGeom,
    SelectBuffers,
};
use crate::simd::{fast_exp, pad8, q8_stride, Path, TILE};
use half::f16;
use mosaickv_spec::{CompressedCache, MosaicError, Result, Selection, SideStrategy, ValueDtype};
use rayon::prelude::*;
use std::cell::RefCell;
use std::time::Instant;

/// Selected blocks per work unit (flash-decoding split inside a segment).
pub const UNIT_BLOCKS: usize = 32;

/// Selected blocks prefetched ahead of the one being attended.
pub const PREFETCH_AHEAD: usize = 3;

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
    path.online_softmax(m, l, acc, g, dp, logits, n, None);
    path.tile_accumulate(logits, g, dp, vtile, n, acc);
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
                path.online_softmax(mg, lgs, ag, gn, dp, &mut lg, n, None);
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

/// One flash-decoding work unit: selected blocks `sel[s0..s1]` of KV head `head`, all in segment `seg`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unit {
    pub(crate) head: usize,
    pub(crate) seg: usize,
    pub(crate) s0: usize,
    pub(crate) s1: usize,
}

/// Reusable buffers for packed attention over a [`CompressedCache`].
#[derive(Debug, Default)]
pub struct MosaicScratch {
    geom: Vec<SegGeom>,
    qrot: Vec<f32>,
    q8: Vec<i8>,
    q8scale: Vec<f64>,
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
        + kv * nseg * g * (q8_stride(d) + 8) // their int8 forms and scales (SPEC 9 on int8/int4 keys)
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
    step(path, cache, queries, src, want_selection, out, sc, None)
}

/// [`packed_attention`] with its selection computed and its output written, timed stage by
/// stage into `profile` (issue 38; see [`crate::profile`]): the same arithmetic, plus a clock
/// read per phase, and per tile of 16 tokens and stage.
pub fn packed_attention_profiled(
    path: Path,
    cache: &CompressedCache,
    queries: &[f32],
    out: &mut [f32],
    sc: &mut MosaicScratch,
    profile: &mut StepProfile,
) -> Result<()> {
    let clocks = StageClocks::default();
    let src = SelectionSource::Compute;
    // the phases' wall times are charged to `profile` as the step runs
    step(
        path,
        cache,
        queries,
        src,
        false,
        Some(out),
        sc,
        Some((&clocks, &mut *profile)),
    )?;
    profile.steps += 1;
    for (t, stage) in profile.thread.iter_mut().zip(Stage::ALL) {
        *t += clocks.get(stage);
    }
    Ok(())
}

/// The decode step of [`packed_attention`]; with `prof`, the phases' wall times go to its
/// [`StepProfile`] and the stages' thread times to its [`StageClocks`].
#[allow(clippy::too_many_arguments)]
fn step(
    path: Path,
    cache: &CompressedCache,
    queries: &[f32],
    src: SelectionSource<'_>,
    want_selection: bool,
    out: Option<&mut [f32]>,
    sc: &mut MosaicScratch,
    mut prof: Option<(&StageClocks, &mut StepProfile)>,
) -> Result<Option<Selection>> {
    let clocks = prof.as_ref().map(|p| p.0);
    let mut phase = prof.as_ref().map(|_| Instant::now());
    // the wall time since the previous phase's end, charged to `field` of the profile
    let mut charge = |field: fn(&mut StepProfile) -> &mut std::time::Duration| {
        if let (Some((_, p)), Some(t)) = (prof.as_mut(), phase.as_mut()) {
            let now = Instant::now();
            *field(p) += now - *t;
            *t = now;
        }
    };
    if cache.is_empty() {
        return Err(MosaicError::EmptyCache);
    }
    let dm = dims(cache);
    let (kv, g, d, dp, nseg) = (dm.kv, dm.g, dm.d, dm.dp, dm.nseg);
    segment_geometry(cache, &mut sc.geom);
    let qstride = g * dm.dpk_max; // per (head, seg)
    sc.qrot.resize(kv * nseg * qstride, 0.0);
    let q8stride = g * q8_stride(dm.dpk_max); // per (head, seg)
    sc.q8.resize(kv * nseg * q8stride, 0);
    sc.q8scale.resize(kv * nseg * g, 0.0);
    sc.scores.resize(kv * dm.blocks_max, 0.0);
    sc.sel.resize_with(kv, Vec::new);
    sc.keys.resize_with(kv, Vec::new);
    let compute = matches!(src, SelectionSource::Compute);
    for sel in &mut sc.sel {
        sel.clear();
    }
    // SPEC 8: the rotated queries of every (head, segment); scores and selection when computed.
    if nseg > 0 {
        let bufs = SelectBuffers {
            qrot: &mut sc.qrot,
            qstride,
            q8: &mut sc.q8,
            q8stride,
            q8scale: &mut sc.q8scale,
            scores: &mut sc.scores,
            blocks_max: dm.blocks_max,
            sel: &mut sc.sel,
            keys: &mut sc.keys,
        };
        rotate_and_select(path, cache, queries, &sc.geom, compute, bufs, clocks);
    }
    if let SelectionSource::Given(given) = src {
        given_blocks(given, &sc.geom, kv, nseg, &mut sc.sel)?;
    }
    let selection = (compute && want_selection).then(|| selection_of(&sc.sel, &sc.geom, nseg));
    charge(|p| &mut p.select_wall);
    let Some(out) = out else {
        return Ok(selection);
    };

    // SPEC 9 over the selected packed blocks, one partial per work unit.
    plan_units(&sc.sel, &sc.geom, nseg, &mut sc.units);
    let plen = partial_len(g, dm.dpv_max.max(dp));
    sc.partials.resize(sc.units.len() * plen, 0.0);
    let scale = 1.0 / (d as f32).sqrt();
    charge(|p| &mut p.plan_wall);
    {
        let (units, geom, sel, qrot) = (&sc.units, &sc.geom, &sc.sel, &sc.qrot);
        let (q8, q8scale) = (&sc.q8, &sc.q8scale);
        sc.partials
            .par_chunks_mut(plen)
            .zip(units.par_iter())
            .for_each(|(st, u)| {
                let gm = geom[u.head * nseg + u.seg];
                let hs = u.head * nseg + u.seg;
                let q = KeyQueries {
                    rotated: &qrot[hs * qstride..][..g * gm.dpk],
                    int8: &q8[hs * q8stride..][..g * q8_stride(gm.dtk)],
                    int8_scale: &q8scale[hs * g..][..g],
                    inv_sqrt_d: mosaickv_spec::layout::inv_sqrt_d(d),
                };
                let blocks = &sel[u.head][u.s0..u.s1];
                attend_unit(path, cache, u, gm, blocks, q, g, scale, st, clocks);
            });
    }
    charge(|p| &mut p.units_wall);

    // SPEC 9: per KV head, the dense rows, then the units' partials merged, the values
    // rotated back once per (segment, head).
    let hlen = 3 * g * dp + 3 * g;
    sc.head_out.resize(kv * hlen, 0.0);
    {
        let (units, geom, partials) = (&sc.units, &sc.geom, &sc.partials);
        sc.head_out
            .par_chunks_mut(hlen)
            .enumerate()
            .for_each(|(h, buf)| {
                let heads = Partials {
                    units,
                    geom: &geom[h * nseg..(h + 1) * nseg],
                    partials,
                    plen,
                };
                merge_head(path, cache, queries, h, &heads, scale, buf);
            });
    }
    for h in 0..kv {
        let buf = &sc.head_out[h * hlen..(h + 1) * hlen];
        let o_acc = &buf[partial_len(g, dp)..partial_len(g, dp) + g * dp];
        for k in 0..g {
            out[(h * g + k) * d..(h * g + k + 1) * d].copy_from_slice(&o_acc[k * dp..k * dp + d]);
        }
    }
    charge(|p| &mut p.merge_wall);
    Ok(selection)
}

/// The work units of a step: consecutive selected blocks of one (head, segment), at most
/// [`UNIT_BLOCKS`] each, head-major, into `units`.
pub(crate) fn plan_units(sel: &[Vec<u32>], geom: &[SegGeom], nseg: usize, units: &mut Vec<Unit>) {
    units.clear();
    for (h, sel) in sel.iter().enumerate() {
        let gh = &geom[h * nseg..(h + 1) * nseg];
        let mut i = 0;
        while i < sel.len() {
            let s = segment_of(gh, sel[i] as usize);
            let end_block = (gh[s].first + gh[s].blocks) as u32;
            let mut j = i;
            while j < sel.len() && sel[j] < end_block && j - i < UNIT_BLOCKS {
                j += 1;
            }
            units.push(Unit {
                head: h,
                seg: s,
                s0: i,
                s1: j,
            });
            i = j;
        }
    }
}

/// The queries SPEC 9's key logits take for one (KV head, segment): the rotated queries of
/// SPEC 8.1 (`[g][dpk]` f32, for f16 key records) and SPEC 8.2's int8 form of them (`[g]
/// [q8_stride(Dt)]` bytes and `g` scales `s_q`, for int8/int4 key records), with `1 /
/// sqrt(D)` in f64.
#[derive(Clone, Copy)]
pub(crate) struct KeyQueries<'a> {
    pub rotated: &'a [f32],
    pub int8: &'a [i8],
    pub int8_scale: &'a [f64],
    pub inv_sqrt_d: f64,
}

/// SPEC 9 key logits of one tile: `n` key records of side `ks` (record 0 at `kb[0]`) against
/// the queries `kq` of their segment, scaled, into `lg` (`[g][TILE]`). int8/int4 records take
/// the integer logits of the int8 query ([`Path::key_logits_q8`]), on the codes as stored;
/// f16 records are expanded into the key tile `kt` first (to f16 where `half_keys`, read by
/// the f16 logits kernel; to f32 otherwise) and multiplied by the f32 rotated queries, as are
/// coded records (SPEC 6.1; `kc` their plan), decoded into the f32 tile ([`CodedPlan::expand`]).
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn tile_key_logits(
    path: Path,
    ks: &SideStrategy,
    kc: Option<&CodedPlan>,
    kb: &[u8],
    n: usize,
    kq: KeyQueries<'_>,
    g: usize,
    dpk: usize,
    scale: f32,
    half_keys: bool,
    kt: &mut [f32],
    lg: &mut [f32],
) {
    let kl = &ks.layout;
    let krb = kl.record_bytes();
    let q = kq.rotated;
    if let Some(plan) = kc {
        plan.expand(kb, n, krb, dpk, kt);
        path.tile_logits(q, g, dpk, kt, n, scale, lg);
    } else if kl.dtype.is_quantized() {
        let qs = q8_stride(kl.kept_dims);
        path.key_logits_q8(kq.int8, qs, kq.int8_scale, g, kb, kl, n, kq.inv_sqrt_d, lg);
    } else if half_keys {
        // Keys expanded to an f16 tile (in the f32 key tile's bytes), widened as the logits
        // load them.
        let kh: &mut [f16] = bytemuck::cast_slice_mut(kt);
        let kr = (kb, krb, kl.bitmap_bytes());
        path.expand_records_h(kr, n, kl.kept_dims, kl.r, dpk, kh);
        path.tile_logits_h(q, g, dpk, kh, n, scale, lg);
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
            dpk,
            kt,
        );
        path.tile_logits(q, g, dpk, kt, n, scale, lg);
    }
}

/// SPEC 9 over one work unit: the selected `blocks` (global indices) of segment `u.seg`, KV
/// head `u.head`, geometry `gm`, tile by tile: key logits ([`tile_key_logits`]), the online
/// softmax, and the values accumulated in the segment's rotated space, into the partial `st`.
/// The values take the fastest kernel the path has for their layout: accumulated straight
/// from f16 records of `g` 1 (AVX-512, [`Path::packed_accumulate`]); at their kept dims only
/// into a head-minor accumulator where the records keep at most half their dims
/// ([`Path::sparse_accumulate_q`]: int8/int4 on AVX-512; int8/int4/f16 of `g` 2-8 on AVX2);
/// other sparse int8/int4 records on AVX2 into the dense accumulator
/// ([`Path::kept_accumulate_q`]); or expanded to a tile first. With `clocks`, each step's
/// thread time is charged to its [`Stage`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_unit(
    path: Path,
    cache: &CompressedCache,
    u: &Unit,
    gm: SegGeom,
    blocks: &[u32],
    q: KeyQueries<'_>,
    g: usize,
    scale: f32,
    st: &mut [f32],
    clocks: Option<&StageClocks>,
) {
    let hs = &cache.segments[u.seg].heads[u.head];
    let seg_len = cache.segments[u.seg].len;
    let (ks, vs) = (&hs.strategy.key, &hs.strategy.value);
    let (kl, vl) = (&ks.layout, &vs.layout);
    let (krb, vrb) = (kl.record_bytes(), vl.record_bytes());
    // Coded records (SPEC 6.1) are decoded into the f32 tiles (the generic path).
    let (coded_k, coded_v) = (kl.dtype == ValueDtype::Coded, vl.dtype == ValueDtype::Coded);
    let kplan = coded_k.then(|| CodedPlan::new(&ks.coding));
    let vplan = coded_v.then(|| CodedPlan::new(&vs.coding));
    let dpmax = gm.dpk.max(gm.dpv);
    partial_init(&mut st[..partial_len(g, gm.dpv)], g);
    // Values expanded in registers straight into the accumulators where the path can.
    let mut corr = [0f32; 64];
    // The fused and f16-tile kernels read f16 values; int8/int4 records are
    // expanded to f32 tiles of decoded values (`Path::expand_records_q`).
    let fused_v = g <= corr.len()
        && !coded_v
        && !vl.dtype.is_quantized()
        && path.fused_packed(vl.group_size, vl.kept_dims, vl.r, gm.dpv);
    // Sparse values (int8/int4; AVX2 also f16): only the kept dims are accumulated, into a
    // head-minor accumulator (in the value tile's buffer) for the whole unit.
    // (`plan.len(dtv) <= 16 dtv`, inside the value tile's TILE * dpmax floats.)
    let sparse = if coded_v || fused_v {
        None
    } else {
        path.sparse_plan(vl, g)
    };
    // AVX2: int8/int4 values that keep at most half their dims are added at those dims only.
    let kept_v = sparse.is_none() && !fused_v && !coded_v && path.kept_values_q(vl);
    let half_keys = !coded_k
        && !kl.dtype.is_quantized()
        && path.half_tile(kl.group_size, kl.kept_dims, kl.r, gm.dpk);
    with_tiles(dpmax, g, |kt, vt, lg| {
        let mut lap = Lap::new(clocks);
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
                let kc = kplan.as_ref();
                tile_key_logits(path, ks, kc, kb, n, q, g, gm.dpk, scale, half_keys, kt, lg);
                lap.lap(Stage::KeyLogits);
                let st = &mut st[..partial_len(g, gm.dpv)];
                let vb = &hs.values.bytes[t * vrb..];
                if fused_v || sparse.is_some() {
                    // The softmax step gives the rescale factors; the kernel
                    // rescales its accumulator with them.
                    let (m, rest) = st.split_at_mut(g);
                    let (l, acc) = rest.split_at_mut(g);
                    let corr = &mut corr[..g];
                    path.online_softmax(m, l, &mut [], g, gm.dpv, lg, n, Some(&mut *corr));
                    lap.lap(Stage::Softmax);
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
                } else if kept_v {
                    // int8/int4 values added at their kept dims only, into the dense
                    // accumulator the softmax step has rescaled
                    let (m, rest) = st.split_at_mut(g);
                    let (l, acc) = rest.split_at_mut(g);
                    path.online_softmax(m, l, acc, g, gm.dpv, lg, n, None);
                    lap.lap(Stage::Softmax);
                    path.kept_accumulate_q(lg, g, gm.dpv, vb, vl, n, acc);
                } else {
                    // values expanded to a tile, then the softmax and the accumulation of
                    // `online_update`
                    if let Some(plan) = &vplan {
                        plan.expand(vb, n, vrb, gm.dpv, vt);
                    } else if vl.dtype.is_quantized() {
                        path.expand_records_q(vb, n, vl, gm.dpv, vt);
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
                    }
                    lap.lap(Stage::Values);
                    let (m, rest) = st.split_at_mut(g);
                    let (l, acc) = rest.split_at_mut(g);
                    path.online_softmax(m, l, acc, g, gm.dpv, lg, n, None);
                    lap.lap(Stage::Softmax);
                    path.tile_accumulate(lg, g, gm.dpv, vt, n, acc);
                }
                lap.lap(Stage::Values);
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
}

/// The work units of every head and their partials (`plen` floats each), with one head's
/// segment geometry: what [`merge_head`] reads.
pub(crate) struct Partials<'a> {
    pub units: &'a [Unit],
    pub geom: &'a [SegGeom],
    pub partials: &'a [f32],
    pub plen: usize,
}

/// SPEC 9's end for KV head `h`: the dense rows (sink and update buffer) attended with the
/// unrotated queries ([`dense_rows_update`]), then the head's unit partials merged per
/// segment in that segment's rotated value space, each segment's sum rotated back once
/// (`o += R_v acc`), and everything normalized. `buf` is the head's `3 g dp + 3 g` floats;
/// the output `[g][dp]` is left at `buf[partial_len(g, dp)..]`.
pub(crate) fn merge_head(
    path: Path,
    cache: &CompressedCache,
    queries: &[f32],
    h: usize,
    parts: &Partials<'_>,
    scale: f32,
    buf: &mut [f32],
) {
    let s = &cache.shape;
    let (kv, g, d) = (s.kv_heads, s.group(), s.head_dim);
    let dp = pad8(d);
    let (units, gh, partials, plen) = (parts.units, parts.geom, parts.partials, parts.plen);
    // the portable path's f32 copy of a segment's value rotation
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
        let gm = gh[s];
        seg_acc[..g * gm.dpv].fill(0.0);
        while i < hu.len() && hu[i].seg == s {
            let p = &partials[(base + i) * plen..(base + i) * plen + partial_len(g, gm.dpv)];
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
        path.back_rotate_f16(
            &cache.segments[s].heads[h].strategy.value.rotation,
            d,
            &seg_acc[..g * gm.dpv],
            gm.dpv,
            g,
            &mut o_acc[..g * dp],
            dp,
            &mut rv32,
        );
    }
    for k in 0..g {
        let inv = if l[k] > 0.0 { 1.0 / l[k] } else { 0.0 };
        for x in &mut o_acc[k * dp..k * dp + d] {
            *x *= inv;
        }
    }
}
