//! Optimized baselines (SPEC.md section 12): dense full attention over an f16
//! cache and Quest, with the same flash-decoding kernels as MosaicKV so that
//! speed ratios compare like with like.

use crate::attention::{dense_rows_update, partial_init, partial_len, PREFETCH_AHEAD};
use crate::backend::contig;
use crate::select::top_blocks;
use crate::simd::{fast_exp, pad8, Path};
use half::f16;
use mosaickv_spec::persist_baseline::{
    widen_rows, BaselineFile, BaselineMethod, KvqBlocks, KvqFile,
};
use mosaickv_spec::{
    rules, validate, DenseRows, KvCache, KvShape, MemoryReport, MosaicError, Result,
};
use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2};
use rayon::prelude::*;

/// Quest page size (SPEC 12).
pub const QUEST_PAGE: usize = 16;
/// Dense attention splits each head's tokens into chunks of this many tokens.
const DENSE_CHUNK: usize = 2048;
/// Quest pages per work unit.
const QUEST_UNIT_PAGES: usize = 64;

/// Dense f16 K/V per KV head, `[tokens][d]` contiguous per head (streaming layout).
#[derive(Debug, Clone)]
struct F16Store {
    shape: KvShape,
    tokens: usize,
    keys: Vec<Vec<f16>>,
    values: Vec<Vec<f16>>,
}

impl F16Store {
    fn new(shape: KvShape) -> Result<Self> {
        KvShape::new(shape.kv_heads, shape.q_heads, shape.head_dim)?;
        Ok(Self {
            shape,
            tokens: 0,
            keys: vec![Vec::new(); shape.kv_heads],
            values: vec![Vec::new(); shape.kv_heads],
        })
    }

    fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        let s = self.shape;
        self.shape = KvShape::new(s.kv_heads, q_heads, s.head_dim)?;
        Ok(())
    }

    fn prefill(&mut self, keys: &ArrayView3<f32>, values: &ArrayView3<f32>) -> Result<()> {
        validate::prompt_kv(&self.shape, keys, values)?;
        if self.tokens != 0 {
            return Err(MosaicError::AlreadyPrefilled(self.tokens));
        }
        // SPEC 14, dense baselines: every element must round to a finite f16.
        rules::f16_storable("keys (beyond f16 range)", keys.iter())?;
        rules::f16_storable("values (beyond f16 range)", values.iter())?;
        let n = keys.shape()[0];
        let d = self.shape.head_dim;
        let conv = |a: &ArrayView3<f32>, h: usize, out: &mut Vec<f16>| {
            out.reserve(n * d);
            // Back the untouched capacity with huge pages (the pointer is only handed to madvise).
            crate::simd::advise_huge_pages(out.as_ptr(), out.capacity());
            for t in 0..n {
                out.extend(
                    a.slice(ndarray::s![t, h, ..])
                        .iter()
                        .map(|&x| f16::from_f32(x)),
                );
            }
        };
        self.keys
            .par_iter_mut()
            .zip(self.values.par_iter_mut())
            .enumerate()
            .for_each(|(h, (k, v))| {
                conv(keys, h, k);
                conv(values, h, v);
            });
        self.tokens = n;
        Ok(())
    }

    fn append(&mut self, key: &ArrayView2<f32>, value: &ArrayView2<f32>) -> Result<()> {
        validate::token_kv(&self.shape, key, value)?;
        rules::f16_storable("key (beyond f16 range)", key.iter())?;
        rules::f16_storable("value (beyond f16 range)", value.iter())?;
        for h in 0..self.shape.kv_heads {
            self.keys[h].extend(key.row(h).iter().map(|&x| f16::from_f32(x)));
            self.values[h].extend(value.row(h).iter().map(|&x| f16::from_f32(x)));
        }
        self.tokens += 1;
        Ok(())
    }

    fn memory(&self) -> MemoryReport {
        MemoryReport {
            tokens: self.tokens,
            values: 2 * self
                .keys
                .iter()
                .chain(&self.values)
                .map(Vec::len)
                .sum::<usize>(),
            ..MemoryReport::default()
        }
    }
}

/// Reusable buffers of the page-based attention.
#[derive(Debug, Default)]
struct PageScratch {
    q: Vec<f32>,
    scores: Vec<f32>,
    keys: Vec<Vec<u64>>,
    sel: Vec<Vec<u32>>,
    units: Vec<(usize, usize, usize)>,
    partials: Vec<f32>,
    out: Vec<f32>,
}

/// Attention over the pages in `sc.sel[h]` (page `p` = tokens `p*page .. (p+1)*page`), flash-decoding
/// split into units of `unit_pages` pages, merged per head, selected pages software-prefetched
/// `ahead` pages in advance (0: none). `sc.q` holds `[q_heads][dp]` queries.
fn attend_pages(
    path: Path,
    store: &F16Store,
    page: usize,
    unit_pages: usize,
    ahead: usize,
    sc: &mut PageScratch,
    out: &mut [f32],
) {
    let s = store.shape;
    let (kv, g, d) = (s.kv_heads, s.group(), s.head_dim);
    let dp = pad8(d);
    sc.units.clear();
    for h in 0..kv {
        let n = sc.sel[h].len();
        let mut i = 0;
        while i < n {
            let j = (i + unit_pages).min(n);
            sc.units.push((h, i, j));
            i = j;
        }
    }
    let plen = partial_len(g, dp);
    sc.partials.resize(sc.units.len() * plen, 0.0);
    let scale = 1.0 / (d as f32).sqrt();
    let (units, sel, q) = (&sc.units, &sc.sel, &sc.q);
    sc.partials
        .par_chunks_mut(plen)
        .zip(units.par_iter())
        .for_each(|(st, &(h, i, j))| {
            partial_init(st, g);
            let qh = &q[h * g * dp..(h + 1) * g * dp];
            let (k, v) = (&store.keys[h], &store.values[h]);
            // Software prefetch up to `ahead` selected pages past the current run (as MosaicKV
            // does for its blocks: Quest's pages are scattered).
            let mut fetched = i;
            let mut prefetch_to = |end: usize| {
                while fetched < end.min(j) {
                    let t0 = sel[h][fetched] as usize * page;
                    let t1 = (t0 + page).min(store.tokens);
                    path.prefetch(&k[t0 * d..t1 * d]);
                    path.prefetch(&v[t0 * d..t1 * d]);
                    fetched += 1;
                }
            };
            // Coalesce consecutive pages into one token range.
            let mut a = i;
            while a < j {
                let mut b = a + 1;
                while b < j && sel[h][b] == sel[h][b - 1] + 1 {
                    b += 1;
                }
                if ahead > 0 {
                    prefetch_to(b + ahead);
                }
                let t0 = sel[h][a] as usize * page;
                let t1 = ((sel[h][b - 1] as usize + 1) * page).min(store.tokens);
                dense_rows_update(path, qh, g, d, dp, k, v, d, t0, t1, scale, st);
                a = b;
            }
        });
    // Merge per head.
    let (units, partials) = (&sc.units, &sc.partials);
    sc.out.resize(s.q_heads * dp, 0.0);
    sc.out
        .par_chunks_mut(g * dp)
        .enumerate()
        .for_each(|(h, o)| {
            let a = units.partition_point(|u| u.0 < h);
            let b = units.partition_point(|u| u.0 <= h);
            o.fill(0.0);
            for k in 0..g {
                let mx = (a..b)
                    .map(|u| partials[u * plen + k])
                    .fold(f32::NEG_INFINITY, f32::max);
                let mut l = 0f32;
                let ok = &mut o[k * dp..(k + 1) * dp];
                for u in a..b {
                    let p = &partials[u * plen..(u + 1) * plen];
                    if p[k] == f32::NEG_INFINITY {
                        continue;
                    }
                    let c = fast_exp(p[k] - mx);
                    l += p[g + k] * c;
                    for (x, &y) in ok.iter_mut().zip(&p[2 * g + k * dp..2 * g + (k + 1) * dp]) {
                        *x += y * c;
                    }
                }
                let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
                for x in ok.iter_mut() {
                    *x *= inv;
                }
            }
        });
    for qh in 0..s.q_heads {
        out[qh * d..(qh + 1) * d].copy_from_slice(&sc.out[qh * dp..qh * dp + d]);
    }
}

/// Copies queries into the padded `[q_heads][dp]` buffer.
fn load_queries(shape: &KvShape, queries: &[f32], q: &mut Vec<f32>) {
    let (d, dp) = (shape.head_dim, pad8(shape.head_dim));
    q.resize(shape.q_heads * dp, 0.0);
    for h in 0..shape.q_heads {
        q[h * dp..h * dp + d].copy_from_slice(&queries[h * d..(h + 1) * d]);
        q[h * dp + d..(h + 1) * dp].fill(0.0);
    }
}

fn write_out(
    out: &mut ArrayViewMut2<f32>,
    shape: &KvShape,
    tmp: &mut Vec<f32>,
    f: impl FnOnce(&mut [f32]),
) {
    match out.as_slice_mut() {
        Some(o) => f(o),
        None => {
            tmp.resize(shape.q_heads * shape.head_dim, 0.0);
            f(tmp);
            for (d, &s) in out.iter_mut().zip(tmp.iter()) {
                *d = s;
            }
        }
    }
}

/// Full attention over a dense f16 cache (SPEC 12 "Full"), flash-decoding over
/// token chunks on rayon threads, f16 -> f32 with F16C where available.
#[derive(Debug)]
pub struct DenseF16Cache {
    path: Path,
    store: F16Store,
    sc: PageScratch,
    tmp: Vec<f32>,
}

impl DenseF16Cache {
    pub fn new(shape: KvShape) -> Result<Self> {
        Self::with_path(shape, Path::detect())
    }
    /// Same cache on the portable kernels.
    pub fn portable(shape: KvShape) -> Result<Self> {
        Self::with_path(shape, Path::Portable)
    }
    fn with_path(shape: KvShape, path: Path) -> Result<Self> {
        Ok(Self {
            path,
            store: F16Store::new(shape)?,
            sc: PageScratch::default(),
            tmp: Vec::new(),
        })
    }
    /// Bytes one decode step reads: every K and V element.
    pub fn bytes_per_step(&self) -> usize {
        self.store.memory().values
    }
    /// Sets the query head count attention expects (SPEC.md section 1: the GQA group
    /// belongs to the queries, not to the stored cache); `KvShape::new` checks it.
    /// Nothing else changes.
    pub fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        self.store.set_q_heads(q_heads)
    }
}

impl KvCache for DenseF16Cache {
    fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        DenseF16Cache::set_q_heads(self, q_heads)
    }
    fn attended(&self, _queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>> {
        Ok(None)
    }
    fn save(&mut self, path: &std::path::Path) -> Result<()> {
        mosaickv_spec::persist_baseline::save_baseline(path, &self.to_file())
    }
    fn shape(&self) -> KvShape {
        self.store.shape
    }
    fn len(&self) -> usize {
        self.store.tokens
    }
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<()> {
        self.store.prefill(&keys, &values)
    }
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<()> {
        self.store.append(&key, &value)
    }
    fn attend(&mut self, queries: ArrayView2<f32>, mut out: ArrayViewMut2<f32>) -> Result<()> {
        let shape = self.store.shape;
        validate::queries(&shape, &queries, out.shape())?;
        if self.store.tokens == 0 {
            return Err(MosaicError::EmptyCache);
        }
        let q = contig(&queries);
        load_queries(&shape, &q, &mut self.sc.q);
        let chunks = self.store.tokens.div_ceil(DENSE_CHUNK);
        self.sc.sel.resize_with(shape.kv_heads, Vec::new);
        for s in &mut self.sc.sel {
            s.clear();
            s.extend(0..chunks as u32);
        }
        let (path, store, sc) = (self.path, &self.store, &mut self.sc);
        write_out(&mut out, &shape, &mut self.tmp, |o| {
            // No software prefetch: the chunks stream in order, which the hardware prefetcher
            // follows (prefetching them made the dense step slower: 22 -> 30 ms at 131K).
            attend_pages(path, store, DENSE_CHUNK, 1, 0, sc, o)
        });
        Ok(())
    }
    fn memory(&self) -> MemoryReport {
        self.store.memory()
    }
}

/// Quest (SPEC 12): dense f16 K/V, per page of 16 tokens the min/max of each key dim,
/// budget `P = ceil(B / 16)` pages (`B` the token budget of SPEC 8.3): the last page plus the
/// `P - 1` best others.
#[derive(Debug)]
pub struct QuestF16Cache {
    path: Path,
    store: F16Store,
    token_rate: f64,
    /// The budget floor of SPEC.md section 8.3 (0: none).
    min_budget_tokens: usize,
    /// Per KV head, `[pages][d]` f16 min and max of the keys.
    min: Vec<Vec<f16>>,
    max: Vec<Vec<f16>>,
    sc: PageScratch,
    tmp: Vec<f32>,
}

impl QuestF16Cache {
    /// `token_rate` in (0, 1].
    pub fn new(shape: KvShape, token_rate: f64) -> Result<Self> {
        Self::with_path(shape, token_rate, Path::detect())
    }
    pub fn portable(shape: KvShape, token_rate: f64) -> Result<Self> {
        Self::with_path(shape, token_rate, Path::Portable)
    }
    fn with_path(shape: KvShape, token_rate: f64, path: Path) -> Result<Self> {
        mosaickv_spec::rules::fraction("token_rate", token_rate)?;
        Ok(Self {
            path,
            store: F16Store::new(shape)?,
            token_rate,
            min_budget_tokens: 0,
            min: vec![Vec::new(); shape.kv_heads],
            max: vec![Vec::new(); shape.kv_heads],
            sc: PageScratch::default(),
            tmp: Vec::new(),
        })
    }

    /// Sets the query head count attention expects (SPEC.md section 1: the GQA group
    /// belongs to the queries, not to the stored cache); `KvShape::new` checks it.
    /// Nothing else changes.
    pub fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        self.store.set_q_heads(q_heads)
    }

    /// Sets the budget floor of SPEC.md section 8.3 (fewest tokens attended; 0: none).
    pub fn with_min_budget_tokens(mut self, tokens: usize) -> Self {
        self.min_budget_tokens = tokens;
        self
    }

    /// Pages attended for a cache of `n` tokens.
    pub fn budget_pages(&self, n: usize) -> usize {
        mosaickv_spec::config::budget_tokens(self.token_rate, self.min_budget_tokens, n)
            .div_ceil(QUEST_PAGE)
    }

    /// Bytes one decode step reads: all page metadata plus K and V of the selected pages.
    pub fn bytes_per_step(&self) -> usize {
        let s = self.store.shape;
        let n = self.store.tokens;
        let pages = n.div_ceil(QUEST_PAGE);
        let p = self.budget_pages(n).min(pages);
        let meta = 2 * 2 * pages * s.head_dim * s.kv_heads;
        meta + p * QUEST_PAGE * 4 * s.head_dim * s.kv_heads
    }

    /// SPEC 12 (Quest): the pages attended per KV head for the queries loaded in `sc.q`
    /// (`sc.sel[h]`, ascending; the last page always), scored on the page min/max.
    fn select_pages(&self, sc: &mut PageScratch) {
        let shape = self.store.shape;
        let n = self.store.tokens;
        let (kv, g, d) = (shape.kv_heads, shape.group(), shape.head_dim);
        let dp = pad8(d);
        let pages = n.div_ceil(QUEST_PAGE);
        let p_budget = self.budget_pages(n);
        sc.sel.resize_with(kv, Vec::new);
        sc.keys.resize_with(kv, Vec::new);
        sc.scores.resize(kv * pages, 0.0);
        let path = self.path;
        let (mins, maxs, qv) = (&self.min, &self.max, &sc.q);
        sc.sel
            .par_iter_mut()
            .zip(sc.keys.par_iter_mut())
            .zip(sc.scores.par_chunks_mut(pages))
            .enumerate()
            .for_each(|(h, ((sel, keys), scores))| {
                sel.clear();
                if pages <= p_budget {
                    sel.extend(0..pages as u32);
                    return;
                }
                let others = pages - 1;
                path.score_pages_f16(
                    &qv[h * g * dp..],
                    g,
                    dp,
                    d,
                    &mins[h][..others * d],
                    &maxs[h][..others * d],
                    &mut scores[..others],
                );
                top_blocks(
                    path,
                    &scores[..others],
                    |_| 1,
                    p_budget - 1,
                    p_budget - 1,
                    keys,
                    sel,
                );
                sel.push(others as u32);
            });
    }

    /// Token indices attended per query head for queries `[q_heads, head_dim]` (the pages
    /// [`QuestF16Cache`]'s attention selects; SPEC.md section 16's recall@k).
    pub fn attended_tokens(&self, queries: ArrayView2<f32>) -> Result<Vec<Vec<usize>>> {
        let shape = self.store.shape;
        validate::queries(&shape, &queries, &[shape.q_heads, shape.head_dim])?;
        let n = self.store.tokens;
        if n == 0 {
            return Err(MosaicError::EmptyCache);
        }
        let mut sc = PageScratch::default();
        load_queries(&shape, &contig(&queries), &mut sc.q);
        self.select_pages(&mut sc);
        Ok((0..shape.q_heads)
            .map(|qh| {
                sc.sel[qh / shape.group()]
                    .iter()
                    .flat_map(|&p| p as usize * QUEST_PAGE..((p as usize + 1) * QUEST_PAGE).min(n))
                    .collect()
            })
            .collect())
    }

    /// Updates page metadata for tokens `t0..tokens`.
    fn update_meta(&mut self, t0: usize) {
        let d = self.store.shape.head_dim;
        let n = self.store.tokens;
        let path = self.path;
        let _ = path;
        self.min
            .par_iter_mut()
            .zip(self.max.par_iter_mut())
            .zip(self.store.keys.par_iter())
            .for_each(|((mn, mx), k)| {
                mn.resize(n.div_ceil(QUEST_PAGE) * d, f16::ZERO);
                mx.resize(n.div_ceil(QUEST_PAGE) * d, f16::ZERO);
                let first_page = t0 / QUEST_PAGE;
                for p in first_page..n.div_ceil(QUEST_PAGE) {
                    let rows = &k[p * QUEST_PAGE * d..((p + 1) * QUEST_PAGE).min(n) * d];
                    for j in 0..d {
                        let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
                        for r in rows.chunks_exact(d) {
                            let x = r[j].to_f32();
                            lo = lo.min(x);
                            hi = hi.max(x);
                        }
                        mn[p * d + j] = f16::from_f32(lo);
                        mx[p * d + j] = f16::from_f32(hi);
                    }
                }
            });
    }
}

impl KvCache for QuestF16Cache {
    fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        QuestF16Cache::set_q_heads(self, q_heads)
    }
    fn attended(&self, queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>> {
        QuestF16Cache::attended_tokens(self, queries).map(Some)
    }
    fn save(&mut self, path: &std::path::Path) -> Result<()> {
        mosaickv_spec::persist_baseline::save_baseline(path, &self.to_file())
    }
    fn shape(&self) -> KvShape {
        self.store.shape
    }
    fn len(&self) -> usize {
        self.store.tokens
    }
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<()> {
        self.store.prefill(&keys, &values)?;
        self.update_meta(0);
        Ok(())
    }
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<()> {
        let t0 = self.store.tokens;
        self.store.append(&key, &value)?;
        self.update_meta(t0);
        Ok(())
    }
    fn attend(&mut self, queries: ArrayView2<f32>, mut out: ArrayViewMut2<f32>) -> Result<()> {
        let shape = self.store.shape;
        validate::queries(&shape, &queries, out.shape())?;
        let n = self.store.tokens;
        if n == 0 {
            return Err(MosaicError::EmptyCache);
        }
        let q = contig(&queries);
        load_queries(&shape, &q, &mut self.sc.q);
        let mut sc = std::mem::take(&mut self.sc);
        self.select_pages(&mut sc);
        self.sc = sc;
        let path = self.path;
        let (store, sc) = (&self.store, &mut self.sc);
        write_out(&mut out, &shape, &mut self.tmp, |o| {
            attend_pages(
                path,
                store,
                QUEST_PAGE,
                QUEST_UNIT_PAGES,
                PREFETCH_AHEAD,
                sc,
                o,
            )
        });
        Ok(())
    }
    fn memory(&self) -> MemoryReport {
        let mut m = self.store.memory();
        m.block_meta = 2 * self
            .min
            .iter()
            .chain(&self.max)
            .map(Vec::len)
            .sum::<usize>();
        m
    }
}

use mosaickv_spec::kvq::check_block_scales as kvq_scales_ok;
use mosaickv_spec::kvq::{key_rotation_block, VALUE_ROTATION_BLOCK};
pub use mosaickv_spec::kvq::{KvqFormat, KVQ_BLOCK};

/// SPEC 12: llama.cpp's Hadamard rotation of rows in blocks of `n`, as ggml's CPU fast
/// Walsh-Hadamard transform computes it (f32: scale by `1 / sqrtf(n)`, then butterflies of
/// length 1, 2, 4, ...); the same operations in the same order as the reference's
/// `hadamard_rotate`, so the same bits.
pub(crate) fn hadamard_rotate(row: &mut [f32], n: usize) {
    let scale = 1.0f32 / (n as f32).sqrt();
    for block in row.chunks_exact_mut(n) {
        block.iter_mut().for_each(|x| *x *= scale);
        let mut len = 1;
        while len < n {
            for pair in block.chunks_exact_mut(2 * len) {
                let (lo, hi) = pair.split_at_mut(len);
                for (u, v) in lo.iter_mut().zip(hi.iter_mut()) {
                    let (a, b) = (*u, *v);
                    *u = a + b;
                    *v = a - b;
                }
            }
            len *= 2;
        }
    }
}

/// One block as ggml's `quantize_row_q8_0_ref` / `quantize_row_q4_0_ref` writes it (f32
/// arithmetic; the same bytes as the reference, written into `out[..block_bytes]`).
fn quantize_block(format: KvqFormat, x: &[f32], out: &mut [u8]) {
    match format {
        KvqFormat::Q8_0 => {
            let amax = x.iter().fold(0.0f32, |a, &v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
            for (o, &v) in out[2..2 + KVQ_BLOCK].iter_mut().zip(x) {
                *o = ((v * id).round() as i8) as u8;
            }
        }
        KvqFormat::Q4_0 => {
            let (mut amax, mut max) = (0.0f32, 0.0f32);
            for &v in x {
                if amax < v.abs() {
                    amax = v.abs();
                    max = v;
                }
            }
            let d = max / -8.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
            let (lo, hi) = x.split_at(KVQ_BLOCK / 2);
            for ((o, &a), &b) in out[2..2 + KVQ_BLOCK / 2].iter_mut().zip(lo).zip(hi) {
                let qa = ((a * id + 8.5) as i8).min(15) as u8;
                let qb = ((b * id + 8.5) as i8).min(15) as u8;
                *o = qa | (qb << 4);
            }
        }
    }
}

/// llama.cpp's quantized KV cache (SPEC 12 kvq8 / kvq4), the same bytes as
/// `mosaickv_reference::baselines::KvqCache`, stored per KV head (`[tokens][blocks]`) so a
/// head's rows stream; attention is the reference's ggml one-row loop, one query head per rayon
/// task, with the same f32 operations in the same order (integer block sums vectorize freely:
/// they are exact), so its output equals the reference's bit for bit.
#[derive(Debug, Clone)]
pub struct KvqCache {
    shape: KvShape,
    format: KvqFormat,
    /// Rows Hadamard-rotated before quantization (SPEC 12, llama.cpp since 2026-04).
    rotated: bool,
    tokens: usize,
    keys: Vec<Vec<u8>>,
    values: Vec<Vec<u8>>,
}

impl KvqCache {
    /// `head_dim` must be a multiple of 32.
    pub fn new(shape: KvShape, format: KvqFormat) -> Result<Self> {
        let shape = KvShape::new(shape.kv_heads, shape.q_heads, shape.head_dim)?;
        if shape.head_dim % KVQ_BLOCK != 0 {
            return Err(MosaicError::InvalidConfig(format!(
                "{}: head_dim {} is not a multiple of the block length {KVQ_BLOCK}",
                format.name(),
                shape.head_dim
            )));
        }
        Ok(Self {
            shape,
            format,
            rotated: false,
            tokens: 0,
            keys: vec![Vec::new(); shape.kv_heads],
            values: vec![Vec::new(); shape.kv_heads],
        })
    }

    /// llama.cpp's cache as it runs today: rows Hadamard-rotated where its rule rotates them
    /// (`head_dim` a multiple of 64; SPEC 12). Only on an empty cache.
    pub fn with_rotation(mut self) -> Self {
        assert_eq!(
            self.tokens, 0,
            "the rotation is chosen before any row is stored"
        );
        self.rotated = key_rotation_block(self.shape.head_dim).is_some();
        self
    }

    /// Whether the rows are rotated.
    pub fn rotated(&self) -> bool {
        self.rotated
    }

    /// Rows `[.., head_dim]` rotated in place in blocks of `n` (nothing when unrotated).
    /// Prompts in parallel by 64 rows; a token's or a step's queries on this thread.
    fn rotate_rows(&self, rows: &mut [f32], n: usize) {
        if self.rotated {
            let chunk = self.shape.head_dim.max(1) * 64;
            if rows.len() <= chunk {
                hadamard_rotate(rows, n);
            } else {
                rows.par_chunks_mut(chunk)
                    .for_each(|rows| hadamard_rotate(rows, n));
            }
        }
    }

    fn key_block(&self) -> usize {
        key_rotation_block(self.shape.head_dim).unwrap_or(self.shape.head_dim)
    }

    /// Sets the query head count attention expects (SPEC.md section 1); nothing else changes.
    pub fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        let s = self.shape;
        self.shape = KvShape::new(s.kv_heads, q_heads, s.head_dim)?;
        Ok(())
    }

    fn row_bytes(&self) -> usize {
        self.shape.head_dim / KVQ_BLOCK * self.format.block_bytes()
    }

    /// The key blocks in llama.cpp's order (token, KV head, block), as the reference stores them.
    pub fn key_bytes(&self) -> Vec<u8> {
        self.interleave(&self.keys)
    }

    /// The value blocks in the order of [`KvqCache::key_bytes`].
    pub fn value_bytes(&self) -> Vec<u8> {
        self.interleave(&self.values)
    }

    fn interleave(&self, per_head: &[Vec<u8>]) -> Vec<u8> {
        let rb = self.row_bytes();
        let mut out = Vec::with_capacity(self.tokens * rb * self.shape.kv_heads);
        for t in 0..self.tokens {
            for h in per_head {
                out.extend_from_slice(&h[t * rb..(t + 1) * rb]);
            }
        }
        out
    }

    /// Quantizes rows `[n][kv_heads][d]` (validated) onto the per-head stores.
    fn push(&mut self, keys: &[f32], values: &[f32], n: usize) {
        let (d, rb, f) = (self.shape.head_dim, self.row_bytes(), self.format);
        let kvh = self.shape.kv_heads;
        let bb = f.block_bytes();
        let fill = |src: &[f32], h: usize, dst: &mut Vec<u8>| {
            let start = dst.len();
            dst.resize(start + n * rb, 0);
            for t in 0..n {
                let row = &src[(t * kvh + h) * d..(t * kvh + h + 1) * d];
                let out = &mut dst[start + t * rb..start + (t + 1) * rb];
                for (x, o) in row.chunks_exact(KVQ_BLOCK).zip(out.chunks_exact_mut(bb)) {
                    quantize_block(f, x, o);
                }
            }
        };
        self.keys
            .par_iter_mut()
            .zip(self.values.par_iter_mut())
            .enumerate()
            .for_each(|(h, (k, v))| {
                fill(keys, h, k);
                fill(values, h, v);
            });
        self.tokens += n;
    }

    /// The online-softmax partial `(m, s, o[d])` of query row `q` (q8_0 quants and scales per
    /// block) over tokens `t0..t1` of KV head `h`, in ggml's order and arithmetic.
    fn partial(
        &self,
        qq: &[i8],
        qd: &[f32],
        h: usize,
        t0: usize,
        t1: usize,
        o: &mut [f32],
    ) -> (f32, f32) {
        let d = self.shape.head_dim;
        let (bb, rb, f) = (self.format.block_bytes(), self.row_bytes(), self.format);
        let scale = 1.0f32 / (d as f32).sqrt();
        let (k, v) = (&self.keys[h], &self.values[h]);
        let (mut m, mut s) = (f32::NEG_INFINITY, 0.0f32);
        o.fill(0.0);
        let mut v32 = vec![0.0f32; d];
        for t in t0..t1 {
            let krow = &k[t * rb..(t + 1) * rb];
            let mut dot = 0.0f32;
            for (b, kb) in krow.chunks_exact(bb).enumerate() {
                let dk = f16::from_le_bytes([kb[0], kb[1]]).to_f32();
                let q = &qq[b * KVQ_BLOCK..(b + 1) * KVQ_BLOCK];
                let sumi: i32 = match f {
                    KvqFormat::Q8_0 => kb[2..]
                        .iter()
                        .zip(q)
                        .map(|(&a, &b)| i32::from(a as i8) * i32::from(b))
                        .sum(),
                    KvqFormat::Q4_0 => {
                        let (qlo, qhi) = q.split_at(KVQ_BLOCK / 2);
                        kb[2..]
                            .iter()
                            .zip(qlo.iter().zip(qhi))
                            .map(|(&x, (&a, &b))| {
                                (i32::from(x & 0x0f) - 8) * i32::from(a)
                                    + (i32::from(x >> 4) - 8) * i32::from(b)
                            })
                            .sum()
                    }
                };
                dot += sumi as f32 * (dk * qd[b]);
            }
            let z = dot * scale;
            let (mut ms, mut vs) = (1.0f32, 1.0f32);
            if z > m {
                ms = (m - z).exp();
                m = z;
                for x in o.iter_mut() {
                    *x *= ms;
                }
            } else {
                vs = (z - m).exp();
            }
            let vrow = &v[t * rb..(t + 1) * rb];
            for (vb, out) in vrow.chunks_exact(bb).zip(v32.chunks_exact_mut(KVQ_BLOCK)) {
                let dv = f16::from_le_bytes([vb[0], vb[1]]).to_f32();
                match f {
                    KvqFormat::Q8_0 => {
                        for (y, &x) in out.iter_mut().zip(&vb[2..]) {
                            *y = f32::from(x as i8) * dv;
                        }
                    }
                    KvqFormat::Q4_0 => {
                        let (lo, hi) = out.split_at_mut(KVQ_BLOCK / 2);
                        for ((a, b), &x) in lo.iter_mut().zip(hi.iter_mut()).zip(&vb[2..]) {
                            *a = (i32::from(x & 0x0f) - 8) as f32 * dv;
                            *b = (i32::from(x >> 4) - 8) as f32 * dv;
                        }
                    }
                }
            }
            for (x, &y) in o.iter_mut().zip(&v32) {
                *x += y * vs;
            }
            s = s * ms + vs;
        }
        (m, s)
    }
}

impl KvCache for KvqCache {
    fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        KvqCache::set_q_heads(self, q_heads)
    }
    fn attended(&self, _queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>> {
        Ok(None)
    }
    fn save(&mut self, path: &std::path::Path) -> Result<()> {
        mosaickv_spec::persist_baseline::save_baseline(path, &self.to_file())
    }
    fn shape(&self) -> KvShape {
        self.shape
    }
    fn len(&self) -> usize {
        self.tokens
    }
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<()> {
        if self.tokens != 0 {
            return Err(MosaicError::AlreadyPrefilled(self.tokens));
        }
        validate::prompt_kv(&self.shape, &keys, &values)?;
        let (mut k, mut v) = (contig3(&keys), contig3(&values));
        self.rotate_rows(&mut k, self.key_block());
        self.rotate_rows(&mut v, VALUE_ROTATION_BLOCK);
        kvq_scales_ok(self.format, "keys (block scale beyond f16 range)", k.iter())?;
        kvq_scales_ok(
            self.format,
            "values (block scale beyond f16 range)",
            v.iter(),
        )?;
        self.push(&k, &v, keys.shape()[0]);
        Ok(())
    }
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<()> {
        validate::token_kv(&self.shape, &key, &value)?;
        // copied only when rotated
        let (mut k, mut v) = (contig(&key), contig(&value));
        if self.rotated {
            self.rotate_rows(k.to_mut(), self.key_block());
            self.rotate_rows(v.to_mut(), VALUE_ROTATION_BLOCK);
        }
        kvq_scales_ok(self.format, "key (block scale beyond f16 range)", k.iter())?;
        kvq_scales_ok(
            self.format,
            "value (block scale beyond f16 range)",
            v.iter(),
        )?;
        self.push(&k, &v, 1);
        Ok(())
    }
    fn attend(&mut self, queries: ArrayView2<f32>, mut out: ArrayViewMut2<f32>) -> Result<()> {
        let s = self.shape;
        validate::queries(&s, &queries, out.shape())?;
        if self.tokens == 0 {
            return Err(MosaicError::EmptyCache);
        }
        // the queries as attention sees them: rotated like the keys
        // copied only when rotated
        let mut q = contig(&queries);
        if self.rotated {
            self.rotate_rows(q.to_mut(), self.key_block());
        }
        kvq_scales_ok(
            KvqFormat::Q8_0,
            "queries (block scale beyond f16 range)",
            q.iter(),
        )?;
        let (d, g) = (s.head_dim, s.group());
        // the queries as q8_0 (ggml's vec_dot_type of both formats): quants and f32 scales
        let blocks = d / KVQ_BLOCK;
        let mut qq = vec![0i8; s.q_heads * d];
        let mut qd = vec![0.0f32; s.q_heads * blocks];
        let mut buf = [0u8; 2 + KVQ_BLOCK];
        for (b, x) in q.chunks_exact(KVQ_BLOCK).enumerate() {
            quantize_block(KvqFormat::Q8_0, x, &mut buf);
            qd[b] = f16::from_le_bytes([buf[0], buf[1]]).to_f32();
            for (o, &y) in qq[b * KVQ_BLOCK..(b + 1) * KVQ_BLOCK]
                .iter_mut()
                .zip(&buf[2..])
            {
                *o = y as i8;
            }
        }
        // one work unit per query head: the same operations in the same order as the
        // reference's loop, so the output is the reference's bit for bit
        let rows: Vec<Vec<f32>> = (0..s.q_heads)
            .into_par_iter()
            .map(|qh| {
                let mut o = vec![0.0f32; d];
                let (_, l) = self.partial(
                    &qq[qh * d..(qh + 1) * d],
                    &qd[qh * blocks..(qh + 1) * blocks],
                    qh / g,
                    0,
                    self.tokens,
                    &mut o,
                );
                let inv = if l == 0.0 { 0.0 } else { 1.0 / l };
                o.iter_mut().for_each(|x| *x *= inv);
                // rotated back from the values' rotation
                if self.rotated {
                    hadamard_rotate(&mut o, VALUE_ROTATION_BLOCK);
                }
                o
            })
            .collect();
        for (qh, o) in rows.into_iter().enumerate() {
            for (i, x) in o.into_iter().enumerate() {
                out[[qh, i]] = x;
            }
        }
        Ok(())
    }
    /// The quants as `values`, the f16 block scales as `block_meta` (as the reference).
    fn memory(&self) -> MemoryReport {
        let bytes: usize = self.keys.iter().chain(&self.values).map(Vec::len).sum();
        let blocks = bytes / self.format.block_bytes();
        MemoryReport {
            tokens: self.tokens,
            values: blocks * (self.format.block_bytes() - 2),
            block_meta: blocks * 2,
            ..MemoryReport::default()
        }
    }
}

/// A contiguous row-major copy of a 3-D view.
fn contig3(a: &ArrayView3<f32>) -> Vec<f32> {
    a.iter().copied().collect()
}

// ---------------------------------------------------------------- files (SPEC.md 15.5-15.6)

impl F16Store {
    /// The rows `[tokens][kv_heads][d]` (the store keeps them per head).
    fn rows(&self) -> DenseRows {
        let d = self.shape.head_dim;
        let flat = |per_head: &[Vec<f16>]| {
            let mut out = Vec::with_capacity(self.tokens * per_head.len() * d);
            for t in 0..self.tokens {
                for h in per_head {
                    out.extend_from_slice(&h[t * d..(t + 1) * d]);
                }
            }
            out
        };
        DenseRows {
            tokens: self.tokens,
            keys: flat(&self.keys),
            values: flat(&self.values),
        }
    }
}

/// Rebuilds a dense cache from the rows of its file: `prefill` with them widened (exact), so
/// every f16 and every Quest page bound is the saved cache's.
fn refill(cache: &mut dyn KvCache, rows: &DenseRows) -> Result<()> {
    if rows.tokens > 0 {
        let s = cache.shape();
        let (k, v) = widen_rows(rows, s.kv_heads, s.head_dim)?;
        cache.prefill(k.view(), v.view())?;
    }
    Ok(())
}

impl DenseF16Cache {
    /// The cache as its file holds it (SPEC.md section 15.5: a dense file, method `full`).
    pub fn to_file(&self) -> BaselineFile {
        BaselineFile::Dense {
            shape: self.store.shape,
            method: Some(BaselineMethod::Full),
            rows: self.store.rows(),
        }
    }

    /// The cache a `full` dense file (or the CLI's dense input file) holds; another kind of
    /// file is `BadFormat` naming it.
    pub fn from_file(file: &BaselineFile) -> Result<Self> {
        match file {
            BaselineFile::Dense {
                shape,
                method: None | Some(BaselineMethod::Full),
                rows,
            } => {
                file.validate()?;
                let mut c = Self::new(*shape)?;
                refill(&mut c, rows)?;
                Ok(c)
            }
            other => Err(other.not_a("full")),
        }
    }
}

impl QuestF16Cache {
    /// The cache as its file holds it (SPEC.md section 15.5: a dense file, method `quest`).
    pub fn to_file(&self) -> BaselineFile {
        BaselineFile::Dense {
            shape: self.store.shape,
            method: Some(BaselineMethod::Quest {
                token_rate: self.token_rate,
                min_budget_tokens: self.min_budget_tokens,
            }),
            rows: self.store.rows(),
        }
    }

    /// The cache a `quest` dense file holds; another kind of file is `BadFormat` naming it.
    pub fn from_file(file: &BaselineFile) -> Result<Self> {
        match file {
            BaselineFile::Dense {
                shape,
                method:
                    Some(BaselineMethod::Quest {
                        token_rate,
                        min_budget_tokens,
                    }),
                rows,
            } => {
                file.validate()?;
                let mut c =
                    Self::new(*shape, *token_rate)?.with_min_budget_tokens(*min_budget_tokens);
                refill(&mut c, rows)?;
                Ok(c)
            }
            other => Err(other.not_a("quest")),
        }
    }
}

impl KvqCache {
    fn blocks(format: KvqFormat) -> KvqBlocks {
        match format {
            KvqFormat::Q8_0 => KvqBlocks::Q8_0,
            KvqFormat::Q4_0 => KvqBlocks::Q4_0,
        }
    }

    /// The cache as its file holds it (SPEC.md section 15.6): the ggml blocks in llama.cpp's
    /// order (token, KV head, block), the bytes of the reference's file.
    pub fn to_file(&self) -> BaselineFile {
        BaselineFile::Kvq(KvqFile {
            shape: self.shape,
            format: Self::blocks(self.format),
            rotated: self.rotated,
            tokens: self.tokens,
            keys: self.key_bytes(),
            values: self.value_bytes(),
        })
    }

    /// The cache a kvq8 / kvq4 file holds (`want` is the format the caller expects), its
    /// blocks split back per KV head; another kind of file is `BadFormat` naming it.
    pub fn from_file(file: &BaselineFile, want: KvqFormat) -> Result<Self> {
        match file {
            BaselineFile::Kvq(f) if f.format == Self::blocks(want) => {
                file.validate()?;
                let mut c = Self::new(f.shape, want)?;
                c.rotated = f.rotated;
                let rb = c.row_bytes();
                for (src, dst) in [(&f.keys, &mut c.keys), (&f.values, &mut c.values)] {
                    for (i, row) in src.chunks_exact(rb).enumerate() {
                        dst[i % f.shape.kv_heads].extend_from_slice(row);
                    }
                }
                c.tokens = f.tokens;
                Ok(c)
            }
            other => Err(other.not_a(want.name())),
        }
    }
}
