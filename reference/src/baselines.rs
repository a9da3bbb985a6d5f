//! SPEC.md section 12: the baselines (Full, Quest, naive 2-D), same `KvCache` API.

use half::f16;
use mosaickv_spec::persist_baseline::{
    widen_rows, BaselineFile, BaselineMethod, KvqBlocks, KvqFile, Naive2dFile,
};
use mosaickv_spec::rules::f16_storable as check_f16_range;
use mosaickv_spec::validate::{prompt_kv, queries as check_queries, token_kv};
use mosaickv_spec::{DenseRows, KvCache, KvShape, MemoryReport, MosaicError, Result};
use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2};

/// Quest's page size (SPEC.md section 12).
pub const PAGE: usize = 16;

/// Softmax attention of one query over `tokens`, f64: `z_t = logit(t) / sqrt(D)`
/// (the caller's dot product), `o = sum_t p_t v_t` with `value(t, p, o)` adding
/// `p * v_t` into `o`.
fn softmax_attend(
    head_dim: usize,
    tokens: &[usize],
    logit: impl Fn(usize) -> f64,
    add_value: impl Fn(usize, f64, &mut [f64]),
) -> Vec<f64> {
    let scale = 1.0 / (head_dim as f64).sqrt();
    let z: Vec<f64> = tokens.iter().map(|&t| logit(t) * scale).collect();
    let z_max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = z.iter().map(|&x| (x - z_max).exp()).collect();
    let denom: f64 = w.iter().sum();
    let mut o = vec![0.0; head_dim];
    for (&t, &wt) in tokens.iter().zip(&w) {
        add_value(t, wt / denom, &mut o);
    }
    o
}

/// Dense f16 storage of some channels of every token, plus Quest page
/// metadata over the stored key channels. `key_dims[h]` / `value_dims[h]`:
/// the channels stored for KV head h (all of them for Quest).
#[derive(Debug, Clone)]
struct PagedStore {
    shape: KvShape,
    token_rate: f64,
    /// The budget floor of SPEC.md section 8.3 (0: none).
    min_budget_tokens: usize,
    key_dims: Vec<Vec<usize>>,
    value_dims: Vec<Vec<usize>>,
    tokens: usize,
    /// `keys[t][h]`: the stored key channels of token t, head h.
    keys: Vec<Vec<Vec<f16>>>,
    values: Vec<Vec<Vec<f16>>>,
    /// `page_min[p][h][c]`, `page_max[p][h][c]` over stored key channels.
    page_min: Vec<Vec<Vec<f16>>>,
    page_max: Vec<Vec<Vec<f16>>>,
}

impl PagedStore {
    fn new(
        shape: KvShape,
        token_rate: f64,
        min_budget_tokens: usize,
        key_dims: Vec<Vec<usize>>,
        value_dims: Vec<Vec<usize>>,
    ) -> Self {
        Self {
            shape,
            token_rate,
            min_budget_tokens,
            key_dims,
            value_dims,
            tokens: 0,
            keys: Vec::new(),
            values: Vec::new(),
            page_min: Vec::new(),
            page_max: Vec::new(),
        }
    }

    fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        let s = self.shape;
        self.shape = KvShape::new(s.kv_heads, q_heads, s.head_dim)?;
        Ok(())
    }

    /// Stores every token of a (validated) prompt `[tokens, kv_heads, D]`, in order.
    fn push_prompt(&mut self, keys: &ArrayView3<f32>, values: &ArrayView3<f32>) {
        for t in 0..keys.shape()[0] {
            self.push(
                keys.index_axis(ndarray::Axis(0), t),
                values.index_axis(ndarray::Axis(0), t),
            );
        }
    }

    /// Stores one (validated) token `[kv_heads, D]` and updates its page's min/max.
    fn push(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) {
        let kvh = self.shape.kv_heads;
        let k: Vec<Vec<f16>> = (0..kvh)
            .map(|h| {
                self.key_dims[h]
                    .iter()
                    .map(|&i| f16::from_f32(key[[h, i]]))
                    .collect()
            })
            .collect();
        let v: Vec<Vec<f16>> = (0..kvh)
            .map(|h| {
                self.value_dims[h]
                    .iter()
                    .map(|&i| f16::from_f32(value[[h, i]]))
                    .collect()
            })
            .collect();
        if self.tokens % PAGE == 0 {
            self.page_min.push(k.clone());
            self.page_max.push(k.clone());
        } else {
            let p = self.page_min.len() - 1;
            for h in 0..kvh {
                for c in 0..k[h].len() {
                    if k[h][c] < self.page_min[p][h][c] {
                        self.page_min[p][h][c] = k[h][c];
                    }
                    if k[h][c] > self.page_max[p][h][c] {
                        self.page_max[p][h][c] = k[h][c];
                    }
                }
            }
        }
        self.keys.push(k);
        self.values.push(v);
        self.tokens += 1;
    }

    fn pages(&self) -> usize {
        self.tokens.div_ceil(PAGE)
    }

    /// SPEC.md section 12 (Quest): the pages KV head `h` attends for `queries`:
    /// `P = ceil(B / 16)`, `B` section 8.3's token budget over all `n` tokens; all pages
    /// if there are at most P,
    /// else the last page plus the `P - 1` best others by
    /// `sum_c max(q_c M_c, q_c m_c)` (max over the group; ties: lower page).
    fn select_pages(&self, queries: &ArrayView2<f32>, h: usize) -> Vec<usize> {
        let n = self.tokens;
        let pages = self.pages();
        let budget_pages =
            mosaickv_spec::config::budget_tokens(self.token_rate, self.min_budget_tokens, n)
                .div_ceil(PAGE);
        if pages <= budget_pages {
            return (0..pages).collect();
        }
        let g = self.shape.group();
        let dims = &self.key_dims[h];
        let mut scores = Vec::with_capacity(pages - 1);
        for p in 0..pages - 1 {
            let mut best = f64::NEG_INFINITY;
            for qh in h * g..(h + 1) * g {
                let mut s = 0.0;
                for (c, &i) in dims.iter().enumerate() {
                    let q = f64::from(queries[[qh, i]]);
                    let hi = f64::from(self.page_max[p][h][c].to_f32());
                    let lo = f64::from(self.page_min[p][h][c].to_f32());
                    s += (q * hi).max(q * lo);
                }
                best = best.max(s);
            }
            scores.push(best);
        }
        let mut order: Vec<usize> = (0..pages - 1).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a])); // stable: ties keep the lower page first
        let mut chosen: Vec<usize> = order.into_iter().take(budget_pages - 1).collect();
        chosen.push(pages - 1);
        chosen.sort_unstable();
        chosen
    }

    fn page_tokens(&self, pages: &[usize]) -> Vec<usize> {
        pages
            .iter()
            .flat_map(|&p| p * PAGE..((p + 1) * PAGE).min(self.tokens))
            .collect()
    }

    /// Attention of every query head over `tokens_of(kv head)`, f64, rounded to f32.
    fn attend_over(
        &self,
        queries: &ArrayView2<f32>,
        out: &mut ArrayViewMut2<f32>,
        tokens_of: impl Fn(usize) -> Vec<usize>,
    ) {
        let d = self.shape.head_dim;
        let g = self.shape.group();
        let per_kv: Vec<Vec<usize>> = (0..self.shape.kv_heads).map(&tokens_of).collect();
        for qh in 0..self.shape.q_heads {
            let h = qh / g;
            let o = softmax_attend(
                d,
                &per_kv[h],
                |t| {
                    let mut s = 0.0;
                    for (c, &i) in self.key_dims[h].iter().enumerate() {
                        s += f64::from(queries[[qh, i]]) * f64::from(self.keys[t][h][c].to_f32());
                    }
                    s
                },
                |t, p, o| {
                    for (c, &i) in self.value_dims[h].iter().enumerate() {
                        o[i] += p * f64::from(self.values[t][h][c].to_f32());
                    }
                },
            );
            for i in 0..d {
                out[[qh, i]] = o[i] as f32;
            }
        }
    }

    fn memory(&self, with_pages: bool) -> MemoryReport {
        let kept: usize = (0..self.shape.kv_heads)
            .map(|h| self.key_dims[h].len() + self.value_dims[h].len())
            .sum();
        let key_kept: usize = self.key_dims.iter().map(Vec::len).sum();
        MemoryReport {
            tokens: self.tokens,
            values: 2 * kept * self.tokens,
            block_meta: if with_pages {
                2 * 2 * key_kept * self.pages()
            } else {
                0
            },
            ..MemoryReport::default()
        }
    }
}

pub(crate) fn validate_prompt(
    shape: &KvShape,
    keys: &ArrayView3<f32>,
    values: &ArrayView3<f32>,
    len: usize,
) -> Result<()> {
    if len > 0 {
        return Err(MosaicError::AlreadyPrefilled(len));
    }
    prompt_kv(shape, keys, values)?;
    check_f16_range("keys (beyond f16 range)", keys.iter())?;
    check_f16_range("values (beyond f16 range)", values.iter())
}

pub(crate) fn validate_token(
    shape: &KvShape,
    key: &ArrayView2<f32>,
    value: &ArrayView2<f32>,
) -> Result<()> {
    token_kv(shape, key, value)?;
    check_f16_range("key (beyond f16 range)", key.iter())?;
    check_f16_range("value (beyond f16 range)", value.iter())
}

pub(crate) fn validate_attend(
    shape: &KvShape,
    queries: &ArrayView2<f32>,
    out_shape: &[usize],
    len: usize,
) -> Result<()> {
    check_queries(shape, queries, out_shape)?;
    if len == 0 {
        return Err(MosaicError::EmptyCache);
    }
    Ok(())
}

fn check_rate(what: &str, x: f64) -> Result<()> {
    mosaickv_spec::rules::fraction(what, x)
}

fn all_dims(shape: &KvShape) -> Vec<Vec<usize>> {
    vec![(0..shape.head_dim).collect(); shape.kv_heads]
}

/// SPEC.md section 12, Full: dense f16 K and V, attention over every token (f64).
#[derive(Debug, Clone)]
pub struct FullCache {
    store: PagedStore,
}

impl FullCache {
    pub fn new(shape: KvShape) -> Self {
        Self {
            store: PagedStore::new(shape, 1.0, 0, all_dims(&shape), all_dims(&shape)),
        }
    }
    /// Sets the query head count attention expects (SPEC.md section 1: the GQA group
    /// belongs to the queries, not to the stored cache); `KvShape::new` checks it.
    /// Nothing else changes.
    pub fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        self.store.set_q_heads(q_heads)
    }
}

impl KvCache for FullCache {
    fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        FullCache::set_q_heads(self, q_heads)
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
        validate_prompt(&self.store.shape, &keys, &values, self.len())?;
        self.store.push_prompt(&keys, &values);
        Ok(())
    }
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<()> {
        validate_token(&self.store.shape, &key, &value)?;
        self.store.push(key, value);
        Ok(())
    }
    fn attend(&mut self, queries: ArrayView2<f32>, mut out: ArrayViewMut2<f32>) -> Result<()> {
        validate_attend(&self.store.shape, &queries, out.shape(), self.len())?;
        let n = self.store.tokens;
        self.store
            .attend_over(&queries, &mut out, |_| (0..n).collect());
        Ok(())
    }
    /// Dense f16 rows as `values`; no metadata (the page min/max are not needed by Full).
    fn memory(&self) -> MemoryReport {
        self.store.memory(false)
    }
}

/// SPEC.md section 12, Quest: dense f16 K and V, 16-token pages with f16
/// key min/max, `P = ceil(B / 16)` pages attended (`B` the token budget of section 8.3,
/// the last page always). No sink rule.
#[derive(Debug, Clone)]
pub struct QuestCache {
    store: PagedStore,
}

impl QuestCache {
    pub fn new(shape: KvShape, token_rate: f64) -> Result<Self> {
        let shape = KvShape::new(shape.kv_heads, shape.q_heads, shape.head_dim)?;
        check_rate("token_rate", token_rate)?;
        Ok(Self {
            store: PagedStore::new(shape, token_rate, 0, all_dims(&shape), all_dims(&shape)),
        })
    }

    /// Sets the budget floor of SPEC.md section 8.3 (fewest tokens attended; 0: none).
    pub fn with_min_budget_tokens(mut self, tokens: usize) -> Self {
        self.store.min_budget_tokens = tokens;
        self
    }

    /// Sets the query head count attention expects (SPEC.md section 1: the GQA group
    /// belongs to the queries, not to the stored cache); `KvShape::new` checks it.
    /// Nothing else changes.
    pub fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        self.store.set_q_heads(q_heads)
    }

    /// Token indices attended per query head (SPEC.md section 12's page choice).
    pub fn attended_tokens(&self, queries: ArrayView2<f32>) -> Result<Vec<Vec<usize>>> {
        let shape = self.store.shape;
        validate_attend(
            &shape,
            &queries,
            &[shape.q_heads, shape.head_dim],
            self.len(),
        )?;
        Ok((0..shape.q_heads)
            .map(|qh| {
                self.store
                    .page_tokens(&self.store.select_pages(&queries, qh / shape.group()))
            })
            .collect())
    }
}

impl KvCache for QuestCache {
    fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        QuestCache::set_q_heads(self, q_heads)
    }
    fn attended(&self, queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>> {
        QuestCache::attended_tokens(self, queries).map(Some)
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
        validate_prompt(&self.store.shape, &keys, &values, self.len())?;
        self.store.push_prompt(&keys, &values);
        Ok(())
    }
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<()> {
        validate_token(&self.store.shape, &key, &value)?;
        self.store.push(key, value);
        Ok(())
    }
    fn attend(&mut self, queries: ArrayView2<f32>, mut out: ArrayViewMut2<f32>) -> Result<()> {
        validate_attend(&self.store.shape, &queries, out.shape(), self.len())?;
        let store = &self.store;
        store.attend_over(&queries, &mut out, |h| {
            store.page_tokens(&store.select_pages(&queries, h))
        });
        Ok(())
    }
    /// Dense f16 rows as `values`, page min/max as `block_meta`.
    fn memory(&self) -> MemoryReport {
        self.store.memory(true)
    }
}

/// SPEC.md section 12, naive 2-D (ThinK-like): per head and side one channel
/// mask, the `c = ceil(retention * D)` dims of largest energy `sum_t x_tj^2`
/// over the first rows the cache receives (ties: lower dim); only those dims
/// stored (f16); Quest selection and attention on the masked rows. No
/// rotation, no sink rule.
#[derive(Debug, Clone)]
pub struct Naive2dCache {
    shape: KvShape,
    token_rate: f64,
    /// The budget floor of SPEC.md section 8.3 (0: none).
    min_budget_tokens: usize,
    retention: f64,
    /// None until the first rows arrive (they fix the masks).
    store: Option<PagedStore>,
}

/// SPEC.md section 12: the `c` dims of largest energy of rows `x[t][i]`
/// (f64 sums of f32 squares; ties: lower dim), ascending.
pub fn energy_mask(rows: impl Iterator<Item = Vec<f32>>, head_dim: usize, c: usize) -> Vec<usize> {
    let mut energy = vec![0.0f64; head_dim];
    for row in rows {
        for i in 0..head_dim {
            energy[i] += f64::from(row[i]) * f64::from(row[i]);
        }
    }
    let mut order: Vec<usize> = (0..head_dim).collect();
    order.sort_by(|&a, &b| energy[b].total_cmp(&energy[a])); // stable: ties keep the lower dim
    let mut kept: Vec<usize> = order.into_iter().take(c).collect();
    kept.sort_unstable();
    kept
}

impl Naive2dCache {
    pub fn new(shape: KvShape, token_rate: f64, retention: f64) -> Result<Self> {
        let shape = KvShape::new(shape.kv_heads, shape.q_heads, shape.head_dim)?;
        check_rate("token_rate", token_rate)?;
        check_rate("retention", retention)?;
        Ok(Self {
            shape,
            token_rate,
            min_budget_tokens: 0,
            retention,
            store: None,
        })
    }

    /// Sets the budget floor of SPEC.md section 8.3 (fewest tokens attended; 0: none).
    pub fn with_min_budget_tokens(mut self, tokens: usize) -> Self {
        self.min_budget_tokens = tokens;
        if let Some(store) = &mut self.store {
            store.min_budget_tokens = tokens;
        }
        self
    }

    /// Sets the query head count attention expects (SPEC.md section 1: the GQA group
    /// belongs to the queries, not to the stored cache); `KvShape::new` checks it.
    /// Nothing else changes.
    pub fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        let s = self.shape;
        self.shape = KvShape::new(s.kv_heads, q_heads, s.head_dim)?;
        if let Some(store) = &mut self.store {
            store.set_q_heads(q_heads)?;
        }
        Ok(())
    }

    /// Channels kept per vector: `c = ceil(retention * D)`.
    pub fn kept_channels(&self) -> usize {
        ((self.retention * self.shape.head_dim as f64).ceil() as usize)
            .clamp(1, self.shape.head_dim)
    }

    /// The channel masks (key, value) per KV head, once fixed.
    pub fn masks(&self) -> Option<(&[Vec<usize>], &[Vec<usize>])> {
        self.store
            .as_ref()
            .map(|s| (s.key_dims.as_slice(), s.value_dims.as_slice()))
    }

    fn fix_masks(&mut self, keys: &ArrayView3<f32>, values: &ArrayView3<f32>) {
        if self.store.is_some() || keys.shape()[0] == 0 {
            return;
        }
        let (d, c) = (self.shape.head_dim, self.kept_channels());
        let mask = |x: &ArrayView3<f32>, h: usize| {
            energy_mask(x.outer_iter().map(|tok| tok.row(h).to_vec()), d, c)
        };
        let key_dims = (0..self.shape.kv_heads).map(|h| mask(keys, h)).collect();
        let value_dims = (0..self.shape.kv_heads).map(|h| mask(values, h)).collect();
        self.store = Some(PagedStore::new(
            self.shape,
            self.token_rate,
            self.min_budget_tokens,
            key_dims,
            value_dims,
        ));
    }

    /// Token indices attended per query head.
    pub fn attended_tokens(&self, queries: ArrayView2<f32>) -> Result<Vec<Vec<usize>>> {
        validate_attend(
            &self.shape,
            &queries,
            &[self.shape.q_heads, self.shape.head_dim],
            self.len(),
        )?;
        let store = self.store.as_ref().expect("non-empty cache has masks");
        Ok((0..self.shape.q_heads)
            .map(|qh| store.page_tokens(&store.select_pages(&queries, qh / self.shape.group())))
            .collect())
    }
}

impl KvCache for Naive2dCache {
    fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        Naive2dCache::set_q_heads(self, q_heads)
    }
    fn attended(&self, queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>> {
        Naive2dCache::attended_tokens(self, queries).map(Some)
    }
    fn save(&mut self, path: &std::path::Path) -> Result<()> {
        mosaickv_spec::persist_baseline::save_baseline(path, &self.to_file())
    }
    fn shape(&self) -> KvShape {
        self.shape
    }
    fn len(&self) -> usize {
        self.store.as_ref().map_or(0, |s| s.tokens)
    }
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<()> {
        validate_prompt(&self.shape, &keys, &values, self.len())?;
        self.fix_masks(&keys, &values);
        if let Some(store) = self.store.as_mut() {
            store.push_prompt(&keys, &values);
        }
        Ok(())
    }
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<()> {
        validate_token(&self.shape, &key, &value)?;
        let k3 = key.insert_axis(ndarray::Axis(0));
        let v3 = value.insert_axis(ndarray::Axis(0));
        self.fix_masks(&k3, &v3);
        self.store.as_mut().expect("masks fixed").push(key, value);
        Ok(())
    }
    fn attend(&mut self, queries: ArrayView2<f32>, mut out: ArrayViewMut2<f32>) -> Result<()> {
        validate_attend(&self.shape, &queries, out.shape(), self.len())?;
        let store = self.store.as_ref().expect("non-empty cache has masks");
        store.attend_over(&queries, &mut out, |h| {
            store.page_tokens(&store.select_pages(&queries, h))
        });
        Ok(())
    }
    /// Kept f16 channels as `values`, page min/max (kept key channels) as
    /// `block_meta`, the channel masks (u16 per index) as `segment_headers`.
    fn memory(&self) -> MemoryReport {
        match &self.store {
            None => MemoryReport::default(),
            Some(s) => {
                let mut m = s.memory(true);
                m.segment_headers = 2
                    * (s.key_dims
                        .iter()
                        .chain(&s.value_dims)
                        .map(Vec::len)
                        .sum::<usize>());
                m
            }
        }
    }
}

/// SPEC.md section 12, Quest-sink: Quest's pages and page score under MosaicKV's attend rules
/// (SPEC.md sections 8.3, 9, 10), so that it differs from MosaicKV only by channel compression
/// (no rotation, no per-vector top-r: dense f16 rows, f16 page min/max instead of int8 block
/// metadata, fixed 16-token pages instead of the variance rule's block size).
/// - the first `sink_tokens` tokens are the sink (f16, always attended);
/// - the other prompt tokens are paged in 16s from the first token after the sink (the last
///   prompt page may be partial);
/// - generated tokens join the update buffer (f16, always attended); when it reaches
///   `buffer_capacity` its tokens become pages (16 each) and it empties (10.2);
/// - per KV head, pages are scored `sum_c max(q_c M_c, q_c m_c)` (f64, max over the GQA
///   group) and taken by score descending (ties: lower page) while the tokens taken are fewer
///   than the token budget `B` of section 8.3 over `n_paged` tokens;
/// - softmax attention (f64) over sink, chosen pages and buffer.
#[derive(Debug, Clone)]
pub struct QuestSinkCache {
    shape: KvShape,
    token_rate: f64,
    min_budget_tokens: usize,
    sink_tokens: usize,
    buffer_capacity: usize,
    /// f16 rows of every token `[t][h][D]` (sink, paged tokens, buffer, in token order).
    keys: Vec<Vec<Vec<f16>>>,
    values: Vec<Vec<Vec<f16>>>,
    /// Tokens in the sink.
    sink: usize,
    /// Pages `(first token, tokens)`, in token order, covering `sink .. sink + paged`.
    pages: Vec<(usize, usize)>,
    /// `page_min[p][h][c]`, `page_max[p][h][c]`.
    page_min: Vec<Vec<Vec<f16>>>,
    page_max: Vec<Vec<Vec<f16>>>,
    paged: usize,
}

impl QuestSinkCache {
    /// Takes `token_rate`, `sink_tokens` and `buffer_capacity` from MosaicKV's configuration
    /// (validated at `head_dim`, so that both run under the same rules).
    pub fn new(shape: KvShape, config: &mosaickv_spec::CompressConfig) -> Result<Self> {
        let shape = KvShape::new(shape.kv_heads, shape.q_heads, shape.head_dim)?;
        config.validate(shape.head_dim)?;
        Ok(Self {
            shape,
            token_rate: config.token_rate,
            min_budget_tokens: config.min_budget_tokens,
            sink_tokens: config.sink_tokens,
            buffer_capacity: config.buffer_capacity,
            keys: Vec::new(),
            values: Vec::new(),
            sink: 0,
            pages: Vec::new(),
            page_min: Vec::new(),
            page_max: Vec::new(),
            paged: 0,
        })
    }

    /// Sets the query head count attention expects (SPEC.md section 1); nothing else changes.
    pub fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        let s = self.shape;
        self.shape = KvShape::new(s.kv_heads, q_heads, s.head_dim)?;
        Ok(())
    }

    fn tokens(&self) -> usize {
        self.keys.len()
    }

    /// Tokens in the update buffer.
    pub fn buffer_len(&self) -> usize {
        self.tokens() - self.sink - self.paged
    }

    fn push_row(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) {
        let row = |x: &ArrayView2<f32>| -> Vec<Vec<f16>> {
            x.outer_iter()
                .map(|r| r.iter().map(|&v| f16::from_f32(v)).collect())
                .collect()
        };
        self.keys.push(row(&key));
        self.values.push(row(&value));
    }

    /// Pages the tokens `from .. tokens()` in 16s (the last one may be partial).
    fn page_from(&mut self, from: usize) {
        let n = self.tokens();
        let mut a = from;
        while a < n {
            let len = PAGE.min(n - a);
            let (mut lo, mut hi) = (self.keys[a].clone(), self.keys[a].clone());
            for t in a + 1..a + len {
                for h in 0..self.shape.kv_heads {
                    for c in 0..self.shape.head_dim {
                        let x = self.keys[t][h][c];
                        if x < lo[h][c] {
                            lo[h][c] = x;
                        }
                        if x > hi[h][c] {
                            hi[h][c] = x;
                        }
                    }
                }
            }
            self.pages.push((a, len));
            self.page_min.push(lo);
            self.page_max.push(hi);
            a += len;
        }
        self.paged += n - from;
    }

    /// SPEC.md section 12 (Quest-sink): the pages KV head `h` attends, ascending.
    fn select_pages(&self, queries: &ArrayView2<f32>, h: usize) -> Vec<usize> {
        let n = self.paged;
        let budget =
            mosaickv_spec::config::budget_tokens(self.token_rate, self.min_budget_tokens, n);
        let g = self.shape.group();
        let scores: Vec<f64> = (0..self.pages.len())
            .map(|p| {
                let mut best = f64::NEG_INFINITY;
                for qh in h * g..(h + 1) * g {
                    let mut s = 0.0;
                    for c in 0..self.shape.head_dim {
                        let q = f64::from(queries[[qh, c]]);
                        let hi = f64::from(self.page_max[p][h][c].to_f32());
                        let lo = f64::from(self.page_min[p][h][c].to_f32());
                        s += (q * hi).max(q * lo);
                    }
                    best = best.max(s);
                }
                best
            })
            .collect();
        let mut order: Vec<usize> = (0..self.pages.len()).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a])); // stable: ties keep the lower page
        let mut chosen = Vec::new();
        let mut taken = 0;
        for p in order {
            if taken >= budget {
                break;
            }
            chosen.push(p);
            taken += self.pages[p].1;
        }
        chosen.sort_unstable();
        chosen
    }

    /// Token indices attended per KV head: sink, chosen pages, buffer.
    fn attended_per_kv(&self, queries: &ArrayView2<f32>) -> Vec<Vec<usize>> {
        let end = self.sink + self.paged;
        (0..self.shape.kv_heads)
            .map(|h| {
                let mut ts: Vec<usize> = (0..self.sink).collect();
                for p in self.select_pages(queries, h) {
                    let (a, len) = self.pages[p];
                    ts.extend(a..a + len);
                }
                ts.extend(end..self.tokens());
                ts
            })
            .collect()
    }

    /// Token indices attended per query head.
    pub fn attended_tokens(&self, queries: ArrayView2<f32>) -> Result<Vec<Vec<usize>>> {
        let shape = self.shape;
        validate_attend(
            &shape,
            &queries,
            &[shape.q_heads, shape.head_dim],
            self.len(),
        )?;
        let per_kv = self.attended_per_kv(&queries);
        Ok((0..shape.q_heads)
            .map(|qh| per_kv[qh / shape.group()].clone())
            .collect())
    }
}

impl KvCache for QuestSinkCache {
    fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        QuestSinkCache::set_q_heads(self, q_heads)
    }
    fn attended(&self, queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>> {
        QuestSinkCache::attended_tokens(self, queries).map(Some)
    }
    /// Quest-sink has no file format (SPEC.md section 15.6 covers naive 2-D and kvq).
    fn save(&mut self, _path: &std::path::Path) -> Result<()> {
        Err(MosaicError::InvalidConfig(
            "quest-sink has no file format".into(),
        ))
    }
    fn shape(&self) -> KvShape {
        self.shape
    }
    fn len(&self) -> usize {
        self.tokens()
    }
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<()> {
        validate_prompt(&self.shape, &keys, &values, self.len())?;
        let n = keys.shape()[0];
        for t in 0..n {
            self.push_row(
                keys.index_axis(ndarray::Axis(0), t),
                values.index_axis(ndarray::Axis(0), t),
            );
        }
        self.sink = self.sink_tokens.min(n);
        self.page_from(self.sink);
        Ok(())
    }
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<()> {
        validate_token(&self.shape, &key, &value)?;
        let in_sink = self.tokens() < self.sink_tokens;
        self.push_row(key, value);
        if in_sink {
            self.sink += 1;
        } else if self.buffer_len() == self.buffer_capacity {
            self.page_from(self.sink + self.paged);
        }
        Ok(())
    }
    fn attend(&mut self, queries: ArrayView2<f32>, mut out: ArrayViewMut2<f32>) -> Result<()> {
        validate_attend(&self.shape, &queries, out.shape(), self.len())?;
        let (d, g) = (self.shape.head_dim, self.shape.group());
        let per_kv = self.attended_per_kv(&queries);
        for qh in 0..self.shape.q_heads {
            let h = qh / g;
            let o = softmax_attend(
                d,
                &per_kv[h],
                |t| {
                    (0..d)
                        .map(|i| {
                            f64::from(queries[[qh, i]]) * f64::from(self.keys[t][h][i].to_f32())
                        })
                        .sum()
                },
                |t, p, o| {
                    for (i, oi) in o.iter_mut().enumerate() {
                        *oi += p * f64::from(self.values[t][h][i].to_f32());
                    }
                },
            );
            for (i, x) in o.into_iter().enumerate() {
                out[[qh, i]] = x as f32;
            }
        }
        Ok(())
    }
    /// Paged rows (f16) as `values`, sink and buffer rows (f16) as `dense`, page min/max (f16)
    /// as `block_meta`.
    fn memory(&self) -> MemoryReport {
        let row = 2 * 2 * self.shape.kv_heads * self.shape.head_dim;
        MemoryReport {
            tokens: self.tokens(),
            values: row * self.paged,
            dense: row * (self.sink + self.buffer_len()),
            block_meta: row * self.pages.len(),
            ..MemoryReport::default()
        }
    }
}

use mosaickv_spec::kvq::check_block_scales as check_kvq_scales;
use mosaickv_spec::kvq::{key_rotation_block, VALUE_ROTATION_BLOCK};
pub use mosaickv_spec::kvq::{KvqFormat, KVQ_BLOCK};

/// SPEC.md section 12: one block of 32 f32 values as ggml's `quantize_row_q8_0_ref` /
/// `quantize_row_q4_0_ref` write it, all arithmetic f32 as there, appended to `out`:
/// - q8_0: `amax = max |x|`, `d = amax / 127`, `id = 1 / d` (0 when d = 0),
///   `q_j = round(x_j * id)` (half away from zero, C's `roundf`);
/// - q4_0: `max` = the element of largest |x| (the first one on ties), `d = max / -8`,
///   `id = 1 / d` (0 when d = 0), `q_j = min(15, trunc(x_j * id + 8.5))`.
///
/// `d` is stored as f16 (round to nearest even); the quants are computed with the f32 `d`.
/// The bytes are the block structs of `mosaickv_spec::kvq`.
pub fn quantize_block(format: KvqFormat, x: &[f32], out: &mut Vec<u8>) {
    assert_eq!(x.len(), KVQ_BLOCK, "one block is {KVQ_BLOCK} values");
    match format {
        KvqFormat::Q8_0 => {
            let mut amax = 0.0f32;
            for &v in x {
                amax = amax.max(v.abs());
            }
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
            for &v in x {
                out.push(((v * id).round() as i8) as u8);
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
            out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
            let quant = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
            for j in 0..KVQ_BLOCK / 2 {
                out.push(quant(x[j]) | (quant(x[j + KVQ_BLOCK / 2]) << 4));
            }
        }
    }
}

/// The f16 scale of a block, as f32.
pub fn block_scale(block: &[u8]) -> f32 {
    f16::from_le_bytes([block[0], block[1]]).to_f32()
}

/// The 32 signed integer quants of a block (`q` for q8_0, `q - 8` for q4_0).
pub fn block_quants(format: KvqFormat, block: &[u8]) -> [i32; KVQ_BLOCK] {
    let mut q = [0i32; KVQ_BLOCK];
    match format {
        KvqFormat::Q8_0 => {
            for (j, qj) in q.iter_mut().enumerate() {
                *qj = i32::from(block[2 + j] as i8);
            }
        }
        KvqFormat::Q4_0 => {
            for j in 0..KVQ_BLOCK / 2 {
                q[j] = i32::from(block[2 + j] & 0x0f) - 8;
                q[j + KVQ_BLOCK / 2] = i32::from(block[2 + j] >> 4) - 8;
            }
        }
    }
    q
}

/// SPEC.md section 12: llama.cpp's rotation of one row, block-diagonal by `n` (a power of two):
/// each `n` consecutive values `x` become `H_n x`, `H_n` the Sylvester Hadamard matrix in
/// natural order scaled by `1 / sqrt(n)` (`H[i][j] = (-1)^popcount(i & j) / sqrt(n)`, its own
/// inverse), computed as ggml's CPU fast Walsh-Hadamard transform does it, all f32: every value
/// times `1 / sqrtf(n)` first, then for `len = 1, 2, 4, ..., n/2` each pair `(i, i + len)` with
/// bit `len` of `i` clear becomes `(x_i + x_{i+len}, x_i - x_{i+len})`.
pub fn hadamard_rotate(row: &mut [f32], n: usize) {
    assert!(
        n.is_power_of_two() && row.len() % n == 0,
        "blocks of {n} values"
    );
    let scale = 1.0f32 / (n as f32).sqrt();
    for block in row.chunks_mut(n) {
        for x in block.iter_mut() {
            *x *= scale;
        }
        let mut len = 1;
        while len < n {
            for i in 0..n {
                if i & len == 0 {
                    let (u, v) = (block[i], block[i + len]);
                    block[i] = u + v;
                    block[i + len] = u - v;
                }
            }
            len *= 2;
        }
    }
}

/// ggml's `dequantize_row_*`: `x_j = q_j * d` in f32.
pub fn dequantize_block(format: KvqFormat, block: &[u8], out: &mut [f32]) {
    let d = block_scale(block);
    for (o, q) in out.iter_mut().zip(block_quants(format, block)) {
        *o = q as f32 * d;
    }
}

/// SPEC.md section 12, kvq8 / kvq4: llama.cpp's quantized KV cache (`--cache-type-k/-v q8_0`
/// or `q4_0`). Every K and V row `[kv_heads * head_dim]` is stored as ggml blocks of 32 values
/// ([`KvqFormat::quantize_block`]), in llama.cpp's order: token, KV head, block. Attention
/// emulates ggml's CPU flash-attention decode row (`ggml_compute_forward_flash_attn_ext_f16`,
/// one query row): the query is quantized to q8_0 (ggml's `vec_dot_type` of both formats),
/// `s_t = (sum_b d_k d_q sum_j qk_j qq_j) * (1 / sqrt(D))` (integer block sums, f32 across
/// blocks in order), an online softmax over the tokens in order in f32
/// (`M`, `S`, `ms = exp(M_old - M)`, `vs = exp(s - M)`), values dequantized to f32 and
/// accumulated `o = o * ms + v * vs`, then `o / S`. Every token is attended.
///
/// Rotated ([`KvqCache::with_rotation`], llama.cpp since 2026-04, PR 21038): keys and queries
/// are rotated per head by [`hadamard_rotate`] in blocks of
/// `mosaickv_spec::kvq::key_rotation_block(head_dim)`, values in blocks of 64, before keys and
/// values are quantized and before the query is; the output of each head is rotated back by the
/// same blocks of 64. Where 64 does not divide `head_dim`, llama.cpp does not rotate, nor does
/// this cache.
#[derive(Debug, Clone)]
pub struct KvqCache {
    shape: KvShape,
    format: KvqFormat,
    /// Rows rotated before quantization (SPEC.md section 12).
    rotated: bool,
    tokens: usize,
    /// Blocks of every key row, token-major (llama.cpp's K cache layout for one layer).
    keys: Vec<u8>,
    values: Vec<u8>,
}

impl KvqCache {
    /// An empty cache; `head_dim` must be a multiple of 32 (blocks never span heads).
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
            keys: Vec::new(),
            values: Vec::new(),
        })
    }

    /// The cache llama.cpp runs today: rows Hadamard-rotated before quantization where its
    /// rule rotates them (`head_dim` a multiple of 64; see [`KvqCache`]). Only on an empty cache.
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

    /// Sets the query head count attention expects (SPEC.md section 1); nothing else changes.
    pub fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        let s = self.shape;
        self.shape = KvShape::new(s.kv_heads, q_heads, s.head_dim)?;
        Ok(())
    }

    pub fn format(&self) -> KvqFormat {
        self.format
    }

    /// Rows `[.. , head_dim]` rotated in place by the blocks of `n` (nothing when unrotated).
    fn rotate_rows(&self, rows: &mut [f32], n: usize) {
        if self.rotated {
            for row in rows.chunks_mut(self.shape.head_dim) {
                hadamard_rotate(row, n);
            }
        }
    }

    fn key_block(&self) -> usize {
        key_rotation_block(self.shape.head_dim).unwrap_or(self.shape.head_dim)
    }

    /// The stored key blocks, token-major, then KV head, then block.
    pub fn key_bytes(&self) -> &[u8] {
        &self.keys
    }

    /// The stored value blocks, in the order of [`KvqCache::key_bytes`].
    pub fn value_bytes(&self) -> &[u8] {
        &self.values
    }

    fn blocks_per_row(&self) -> usize {
        self.shape.kv_heads * self.shape.head_dim / KVQ_BLOCK
    }

    fn push_rows<'a>(
        &mut self,
        keys: impl Iterator<Item = &'a f32>,
        values: impl Iterator<Item = &'a f32>,
    ) {
        let quantize = |src: Vec<f32>, dst: &mut Vec<u8>| {
            for block in src.chunks(KVQ_BLOCK) {
                quantize_block(self.format, block, dst);
            }
        };
        quantize(keys.copied().collect(), &mut self.keys);
        quantize(values.copied().collect(), &mut self.values);
    }

    fn validate_rows(&self, keys: &[f32], values: &[f32], plural: bool) -> Result<()> {
        let (k, v) = if plural {
            (
                "keys (block scale beyond f16 range)",
                "values (block scale beyond f16 range)",
            )
        } else {
            (
                "key (block scale beyond f16 range)",
                "value (block scale beyond f16 range)",
            )
        };
        check_kvq_scales(self.format, k, keys.iter())?;
        check_kvq_scales(self.format, v, values.iter())
    }

    /// The f32 attention of query row `q` (`[D]`) over KV head `h`, as ggml's one-row loop.
    fn attend_row(&self, q: &[f32], h: usize) -> Vec<f32> {
        let d = self.shape.head_dim;
        let (bpr, bb) = (self.blocks_per_row(), self.format.block_bytes());
        let blocks = d / KVQ_BLOCK;
        // the query as q8_0 blocks (ggml converts Q to K's vec_dot_type, q8_0 for both formats)
        let mut qb = Vec::with_capacity(blocks * KvqFormat::Q8_0.block_bytes());
        for block in q.chunks(KVQ_BLOCK) {
            quantize_block(KvqFormat::Q8_0, block, &mut qb);
        }
        let q_quants: Vec<([i32; KVQ_BLOCK], f32)> = qb
            .chunks(KvqFormat::Q8_0.block_bytes())
            .map(|b| (block_quants(KvqFormat::Q8_0, b), block_scale(b)))
            .collect();
        let scale = 1.0f32 / (d as f32).sqrt();
        let (mut m, mut s) = (f32::NEG_INFINITY, 0.0f32);
        let mut o = vec![0.0f32; d];
        let mut v32 = vec![0.0f32; d];
        for t in 0..self.tokens {
            let row = (t * bpr + h * blocks) * bb;
            let mut dot = 0.0f32;
            for (b, (qq, dq)) in q_quants.iter().enumerate() {
                let kb = &self.keys[row + b * bb..row + (b + 1) * bb];
                let kq = block_quants(self.format, kb);
                let sumi: i32 = kq.iter().zip(qq).map(|(a, b)| a * b).sum();
                dot += sumi as f32 * (block_scale(kb) * dq);
            }
            let z = dot * scale;
            let m_old = m;
            let (mut ms, mut vs) = (1.0f32, 1.0f32);
            if z > m {
                m = z;
                ms = (m_old - m).exp();
                for x in o.iter_mut() {
                    *x *= ms;
                }
            } else {
                vs = (z - m).exp();
            }
            for b in 0..blocks {
                let vb = &self.values[row + b * bb..row + (b + 1) * bb];
                dequantize_block(
                    self.format,
                    vb,
                    &mut v32[b * KVQ_BLOCK..(b + 1) * KVQ_BLOCK],
                );
            }
            for (x, &v) in o.iter_mut().zip(&v32) {
                *x += v * vs;
            }
            s = s * ms + vs;
        }
        let inv = if s == 0.0 { 0.0 } else { 1.0 / s };
        o.iter().map(|x| x * inv).collect()
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
        if self.tokens > 0 {
            return Err(MosaicError::AlreadyPrefilled(self.tokens));
        }
        prompt_kv(&self.shape, &keys, &values)?;
        let (mut k, mut v): (Vec<f32>, Vec<f32>) = (
            keys.iter().copied().collect(),
            values.iter().copied().collect(),
        );
        self.rotate_rows(&mut k, self.key_block());
        self.rotate_rows(&mut v, VALUE_ROTATION_BLOCK);
        self.validate_rows(&k, &v, true)?;
        self.push_rows(k.iter(), v.iter());
        self.tokens = keys.shape()[0];
        Ok(())
    }
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<()> {
        token_kv(&self.shape, &key, &value)?;
        let (mut k, mut v): (Vec<f32>, Vec<f32>) = (
            key.iter().copied().collect(),
            value.iter().copied().collect(),
        );
        self.rotate_rows(&mut k, self.key_block());
        self.rotate_rows(&mut v, VALUE_ROTATION_BLOCK);
        self.validate_rows(&k, &v, false)?;
        self.push_rows(k.iter(), v.iter());
        self.tokens += 1;
        Ok(())
    }
    fn attend(&mut self, queries: ArrayView2<f32>, mut out: ArrayViewMut2<f32>) -> Result<()> {
        validate_attend(&self.shape, &queries, out.shape(), self.len())?;
        // the queries as attention sees them: rotated like the keys
        let mut q: Vec<f32> = queries.iter().copied().collect();
        self.rotate_rows(&mut q, self.key_block());
        check_kvq_scales(
            KvqFormat::Q8_0,
            "queries (block scale beyond f16 range)",
            q.iter(),
        )?;
        let (g, d) = (self.shape.group(), self.shape.head_dim);
        for qh in 0..self.shape.q_heads {
            let mut o = self.attend_row(&q[qh * d..(qh + 1) * d], qh / g);
            // rotated back from the values' rotation
            self.rotate_rows(&mut o, VALUE_ROTATION_BLOCK);
            for (i, x) in o.into_iter().enumerate() {
                out[[qh, i]] = x;
            }
        }
        Ok(())
    }
    /// The quants as `values` (32 or 16 bytes per block), the f16 block scales as `block_meta`
    /// (2 bytes per block): 34 / 18 bytes per 32 values, K and V, nothing else.
    fn memory(&self) -> MemoryReport {
        let blocks = (self.keys.len() + self.values.len()) / self.format.block_bytes();
        MemoryReport {
            tokens: self.tokens,
            values: blocks * (self.format.block_bytes() - 2),
            block_meta: blocks * 2,
            ..MemoryReport::default()
        }
    }
}

// ---------------------------------------------------------------- files (SPEC.md 15.5-15.6)

/// A prompt's rows `[tokens][kv_heads][width]` from a store's per-token, per-head f16 lists.
fn flat_rows(tokens: usize, keys: &[Vec<Vec<f16>>], values: &[Vec<Vec<f16>>]) -> DenseRows {
    let flat = |x: &[Vec<Vec<f16>>]| x.iter().flatten().flatten().copied().collect();
    DenseRows {
        tokens,
        keys: flat(keys),
        values: flat(values),
    }
}

/// Rebuilds a dense cache from the rows of its file: `prefill` with them widened (exact), so
/// every f16 and every Quest page bound is the saved cache's.
fn refill(cache: &mut dyn KvCache, rows: &DenseRows, width: usize) -> Result<()> {
    if rows.tokens > 0 {
        let (k, v) = widen_rows(rows, cache.shape().kv_heads, width)?;
        cache.prefill(k.view(), v.view())?;
    }
    Ok(())
}

impl FullCache {
    /// The cache as its file holds it (SPEC.md section 15.5: a dense file, method `full`).
    pub fn to_file(&self) -> BaselineFile {
        let s = &self.store;
        BaselineFile::Dense {
            shape: s.shape,
            method: Some(BaselineMethod::Full),
            rows: flat_rows(s.tokens, &s.keys, &s.values),
        }
    }

    /// The cache a file holds (a `full` dense file, or the CLI's dense input file); another
    /// kind of file is `BadFormat` naming it.
    pub fn from_file(file: &BaselineFile) -> Result<Self> {
        match file {
            BaselineFile::Dense {
                shape,
                method: None | Some(BaselineMethod::Full),
                rows,
            } => {
                file.validate()?;
                let mut c = Self::new(*shape);
                refill(&mut c, rows, shape.head_dim)?;
                Ok(c)
            }
            other => Err(other.not_a("full")),
        }
    }
}

impl QuestCache {
    /// The cache as its file holds it (SPEC.md section 15.5: a dense file, method `quest`).
    pub fn to_file(&self) -> BaselineFile {
        let s = &self.store;
        BaselineFile::Dense {
            shape: s.shape,
            method: Some(BaselineMethod::Quest {
                token_rate: s.token_rate,
                min_budget_tokens: s.min_budget_tokens,
            }),
            rows: flat_rows(s.tokens, &s.keys, &s.values),
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
                refill(&mut c, rows, shape.head_dim)?;
                Ok(c)
            }
            other => Err(other.not_a("quest")),
        }
    }
}

impl Naive2dCache {
    /// The cache as its file holds it (SPEC.md section 15.6): masks and masked f16 rows.
    pub fn to_file(&self) -> BaselineFile {
        let (masks, rows) = match &self.store {
            None => (None, DenseRows::default()),
            Some(s) => (
                Some((s.key_dims.clone(), s.value_dims.clone())),
                flat_rows(s.tokens, &s.keys, &s.values),
            ),
        };
        BaselineFile::Naive2d(Naive2dFile {
            shape: self.shape,
            token_rate: self.token_rate,
            retention: self.retention,
            min_budget_tokens: self.min_budget_tokens,
            masks,
            rows,
        })
    }

    /// The cache a naive2d file holds: its masks, then its rows pushed in order (each put back
    /// at its masked dims of a zero row; only those dims are stored, so the f16 values and
    /// page bounds are the saved cache's). Another kind of file is `BadFormat` naming it.
    pub fn from_file(file: &BaselineFile) -> Result<Self> {
        let BaselineFile::Naive2d(f) = file else {
            return Err(file.not_a("naive2d"));
        };
        file.validate()?;
        let mut c = Self::new(f.shape, f.token_rate, f.retention)?
            .with_min_budget_tokens(f.min_budget_tokens);
        if let Some((km, vm)) = &f.masks {
            let (kv, d, w) = (f.shape.kv_heads, f.shape.head_dim, f.kept());
            let mut store = PagedStore::new(
                c.shape,
                c.token_rate,
                c.min_budget_tokens,
                km.clone(),
                vm.clone(),
            );
            let mut key = ndarray::Array2::<f32>::zeros((kv, d));
            let mut value = ndarray::Array2::<f32>::zeros((kv, d));
            for t in 0..f.rows.tokens {
                for h in 0..kv {
                    let at = (t * kv + h) * w;
                    for (j, (&ki, &vi)) in km[h].iter().zip(&vm[h]).enumerate() {
                        key[[h, ki]] = f.rows.keys[at + j].to_f32();
                        value[[h, vi]] = f.rows.values[at + j].to_f32();
                    }
                }
                store.push(key.view(), value.view());
            }
            c.store = Some(store);
        }
        Ok(c)
    }
}

impl KvqCache {
    /// The cache as its file holds it (SPEC.md section 15.6): the ggml blocks as stored.
    pub fn to_file(&self) -> BaselineFile {
        BaselineFile::Kvq(KvqFile {
            shape: self.shape,
            format: match self.format {
                KvqFormat::Q8_0 => KvqBlocks::Q8_0,
                KvqFormat::Q4_0 => KvqBlocks::Q4_0,
            },
            rotated: self.rotated,
            tokens: self.tokens,
            keys: self.keys.clone(),
            values: self.values.clone(),
        })
    }

    /// The cache a kvq8 / kvq4 file holds (`want` is the format the caller expects); another
    /// kind of file is `BadFormat` naming it.
    pub fn from_file(file: &BaselineFile, want: KvqFormat) -> Result<Self> {
        let want_blocks = match want {
            KvqFormat::Q8_0 => KvqBlocks::Q8_0,
            KvqFormat::Q4_0 => KvqBlocks::Q4_0,
        };
        match file {
            BaselineFile::Kvq(f) if f.format == want_blocks => {
                file.validate()?;
                let mut c = Self::new(f.shape, want)?;
                c.rotated = f.rotated;
                c.tokens = f.tokens;
                c.keys = f.keys.clone();
                c.values = f.values.clone();
                Ok(c)
            }
            other => Err(other.not_a(want.name())),
        }
    }
}

#[cfg(test)]
mod kvq_tests {
    use super::*;
    use ndarray::{Array2, Array3};

    fn block(f: impl Fn(usize) -> f32) -> Vec<f32> {
        (0..KVQ_BLOCK).map(f).collect()
    }

    #[test]
    fn q4_0_rounding_and_the_signed_max_by_hand() {
        // max element -8 (the first of largest |x|): d = -8 / -8 = 1, id = 1, q = trunc(x + 8.5)
        let mut x = block(|_| 0.0);
        x[0] = -8.0;
        x[1] = 7.4; // 15.9 -> 15
        x[2] = 0.49; // 8.99 -> 8
        x[3] = -0.5; // 8.0 -> 8
        x[4] = -0.51; // 7.99 -> 7
        x[16] = 8.0; // |8| ties |-8|: the first stays the max; 16.5 -> 16 -> min 15
        let mut out = Vec::new();
        quantize_block(KvqFormat::Q4_0, &x, &mut out);
        assert_eq!(out.len(), 18);
        assert_eq!(block_scale(&out), 1.0);
        let q = block_quants(KvqFormat::Q4_0, &out);
        assert_eq!(&q[..5], &[-8, 7, 0, 0, -1]);
        assert_eq!(q[16], 7);
        assert_eq!(
            out[2],
            0x0f << 4,
            "element 0 low nibble 0, element 16 high nibble 15"
        );
        // a positive max: d = 8 / -8 = -1; -7.9 * -1 + 8.5 = 16.4 -> 15 -> (15 - 8) * -1 = -7
        let mut x = block(|_| 0.0);
        x[5] = 8.0;
        x[6] = -7.9;
        let mut out = Vec::new();
        quantize_block(KvqFormat::Q4_0, &x, &mut out);
        let mut y = [0.0f32; KVQ_BLOCK];
        dequantize_block(KvqFormat::Q4_0, &out, &mut y);
        assert_eq!((y[5], y[6], y[0]), (8.0, -7.0, 0.0));
    }

    #[test]
    fn q8_0_scale_and_round_half_away_by_hand() {
        // amax 127: d = 1, id = 1; roundf(2.5) = 3, roundf(-2.5) = -3 (half away from zero)
        let mut x = block(|_| 0.0);
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -2.5;
        x[3] = -126.4;
        let mut out = Vec::new();
        quantize_block(KvqFormat::Q8_0, &x, &mut out);
        assert_eq!(out.len(), 34);
        assert_eq!(block_scale(&out), 1.0);
        assert_eq!(
            &block_quants(KvqFormat::Q8_0, &out)[..4],
            &[127, 3, -3, -126]
        );
        // all zeros: d = 0, id = 0, every quant 0
        let mut out = Vec::new();
        quantize_block(KvqFormat::Q8_0, &block(|_| 0.0), &mut out);
        assert!(out.iter().all(|&b| b == 0));
    }

    #[test]
    fn memory_is_34_or_18_bytes_per_32_values_for_k_and_v() {
        let shape = KvShape::new(3, 9, 64).unwrap();
        let kv = Array3::from_shape_fn((10, 3, 64), |(t, h, i)| (t + h + i) as f32 * 0.01);
        for (f, per_token) in [(KvqFormat::Q8_0, 408), (KvqFormat::Q4_0, 216)] {
            let mut c = KvqCache::new(shape, f).unwrap();
            c.prefill(kv.view(), kv.view()).unwrap();
            let m = c.memory();
            assert_eq!(m.device_bytes(), 10 * per_token);
            assert_eq!(m.bytes_per_token(), per_token as f64);
            assert_eq!(c.key_bytes().len() + c.value_bytes().len(), 10 * per_token);
        }
    }

    #[test]
    fn bad_input_is_a_typed_error_and_changes_nothing() {
        assert!(matches!(
            KvqCache::new(KvShape::new(1, 1, 48).unwrap(), KvqFormat::Q8_0),
            Err(MosaicError::InvalidConfig(_))
        ));
        let shape = KvShape::new(1, 2, 32).unwrap();
        let mut c = KvqCache::new(shape, KvqFormat::Q4_0).unwrap();
        let ok = Array3::from_elem((2, 1, 32), 0.5f32);
        c.prefill(ok.view(), ok.view()).unwrap();
        let before = (c.key_bytes().to_vec(), c.value_bytes().to_vec());
        let mut big = Array2::from_elem((1, 32), 1.0f32);
        big[[0, 7]] = 1e7; // |max| / 8 > 65519: the f16 scale would overflow
        let e = c.append(big.view(), Array2::from_elem((1, 32), 1.0f32).view());
        assert_eq!(
            e,
            Err(MosaicError::NonFinite {
                what: "key (block scale beyond f16 range)",
                index: 0
            })
        );
        assert_eq!(c.len(), 2);
        assert_eq!((c.key_bytes().to_vec(), c.value_bytes().to_vec()), before);
        let mut out = Array2::zeros((2, 32));
        let q = Array2::from_elem((2, 32), f32::NAN);
        assert!(matches!(
            c.attend(q.view(), out.view_mut()),
            Err(MosaicError::NonFinite { .. })
        ));
        assert!(matches!(
            c.prefill(ok.view(), ok.view()),
            Err(MosaicError::AlreadyPrefilled(2))
        ));
    }

    #[test]
    fn attention_over_exactly_representable_rows_is_full_attention() {
        // rows whose blocks quantize exactly: q8_0 with a block max of 127 * 2^-6 (d = 2^-6)
        // and small integer multiples of 2^-6; q4_0 with a block max of -8 * 2^-3 (d = 2^-3)
        // and multiples of 2^-3 in [-1, 0.875]. The query is exact under q8_0 (block max
        // 127 * 2^-6), so only f32 rounding separates the result from full attention.
        let (n, d) = (40, 64);
        let shape = KvShape::new(1, 1, d).unwrap();
        let q8 = |t: usize, i: usize| -> f32 {
            let m = if i % KVQ_BLOCK == 0 {
                -127
            } else {
                ((t * 7 + i * 3) % 41) as i32 - 20
            };
            m as f32 / 64.0
        };
        let q4 = |t: usize, i: usize| -> f32 {
            let m = if i % KVQ_BLOCK == 0 {
                -8
            } else {
                ((t * 7 + i * 3) % 16) as i32 - 8
            };
            m as f32 / 8.0
        };
        let q = Array2::from_shape_fn((1, d), |(_, i)| {
            let m = if i % KVQ_BLOCK == 0 {
                127
            } else {
                ((i * 5) % 21) as i32 - 10
            };
            m as f32 / 64.0
        });
        for (f, val) in [
            (KvqFormat::Q8_0, &q8 as &dyn Fn(usize, usize) -> f32),
            (KvqFormat::Q4_0, &q4),
        ] {
            let kv = Array3::from_shape_fn((n, 1, d), |(t, _, i)| val(t, i));
            let mut full = FullCache::new(shape);
            full.prefill(kv.view(), kv.view()).unwrap();
            let mut want = Array2::zeros((1, d));
            full.attend(q.view(), want.view_mut()).unwrap();
            let mut c = KvqCache::new(shape, f).unwrap();
            c.prefill(kv.view(), kv.view()).unwrap();
            let mut got = Array2::zeros((1, d));
            c.attend(q.view(), got.view_mut()).unwrap();
            for i in 0..d {
                assert!(
                    (got[[0, i]] - want[[0, i]]).abs() < 1e-5,
                    "{f:?} dim {i}: {} vs {}",
                    got[[0, i]],
                    want[[0, i]]
                );
            }
        }
    }
}

#[cfg(test)]
mod quest_sink_tests {
    use super::*;
    use mosaickv_spec::CompressConfig;
    use ndarray::{Array2, Array3};

    fn kv(n: usize, d: usize) -> Array3<f32> {
        Array3::from_shape_fn((n, 1, d), |(t, _, i)| {
            (((t * 31 + i * 7) % 23) as f32 - 11.0) / 8.0
        })
    }

    #[test]
    fn sink_pages_and_buffer_follow_mosaics_rules() {
        let d = 16;
        let shape = KvShape::new(1, 2, d).unwrap();
        let cfg = CompressConfig {
            token_rate: 0.25,
            min_budget_tokens: 0,
            ..CompressConfig::default()
        };
        let mut c = QuestSinkCache::new(shape, &cfg).unwrap();
        let x = kv(4 + 40 + 64 + 3, d);
        c.prefill(
            x.slice(ndarray::s![..44, .., ..]),
            x.slice(ndarray::s![..44, .., ..]),
        )
        .unwrap();
        // sink 0..4; prompt pages 4..20, 20..36, 36..44 (partial)
        assert_eq!(c.pages, vec![(4, 16), (20, 16), (36, 8)]);
        assert_eq!(c.buffer_len(), 0);
        for t in 44..44 + 63 {
            c.append(
                x.slice(ndarray::s![t, .., ..]),
                x.slice(ndarray::s![t, .., ..]),
            )
            .unwrap();
        }
        assert_eq!((c.buffer_len(), c.pages.len()), (63, 3));
        c.append(
            x.slice(ndarray::s![107, .., ..]),
            x.slice(ndarray::s![107, .., ..]),
        )
        .unwrap();
        // the 64th buffered token flushes the buffer into four whole pages
        assert_eq!(c.buffer_len(), 0);
        assert_eq!(&c.pages[3..], &[(44, 16), (60, 16), (76, 16), (92, 16)]);
        for t in 108..111 {
            c.append(
                x.slice(ndarray::s![t, .., ..]),
                x.slice(ndarray::s![t, .., ..]),
            )
            .unwrap();
        }
        let q = Array2::from_shape_fn((2, d), |(h, i)| (h as f32 - 0.5) * (i as f32 - 7.0) / 4.0);
        let att = c.attended_tokens(q.view()).unwrap();
        // budget ceil(0.25 * 104) = 26 tokens of pages: two pages (16 + 16 or 16 + 8 ...)
        let set = &att[0];
        assert_eq!(&set[..4], &[0, 1, 2, 3]);
        assert_eq!(&set[set.len() - 3..], &[108, 109, 110]);
        let paged = set.len() - 7;
        assert!((26..26 + 16).contains(&paged), "{paged}");
        assert_eq!(att[0], att[1], "one selection per KV head");
        // memory: every row f16 K and V, page min/max per page
        let m = c.memory();
        assert_eq!(m.device_bytes(), 111 * 4 * d + 7 * 4 * d);
        assert_eq!(m.dense, 7 * 4 * d);
    }

    #[test]
    fn budget_floor_attends_every_page_of_a_short_prompt() {
        let d = 16;
        let shape = KvShape::new(1, 2, d).unwrap();
        let x = kv(4 + 40, d);
        let q = Array2::from_shape_fn((2, d), |(h, i)| (h as f32 - 0.5) * (i as f32 - 7.0) / 4.0);
        let attended = |min_budget_tokens| {
            let cfg = CompressConfig {
                token_rate: 0.25,
                min_budget_tokens,
                ..CompressConfig::default()
            };
            let mut c = QuestSinkCache::new(shape, &cfg).unwrap();
            c.prefill(x.view(), x.view()).unwrap();
            c.attended_tokens(q.view()).unwrap()[0].len()
        };
        // SPEC 8.3: 40 paged tokens in pages of 16, 16, 8; ceil(0.25 * 40) = 10 takes one or
        // two pages; a floor of 32 at least 32 tokens; a floor of 256 all 40
        let none = attended(0);
        assert!((4 + 8..=4 + 24).contains(&none), "{none}");
        assert!(attended(32) >= 4 + 32);
        assert_eq!(attended(256), 4 + 40);
    }

    #[test]
    fn at_full_rate_it_is_full_attention() {
        let d = 32;
        let shape = KvShape::new(1, 1, d).unwrap();
        let cfg = CompressConfig {
            token_rate: 1.0,
            ..CompressConfig::default()
        };
        let x = kv(100, d);
        let mut c = QuestSinkCache::new(shape, &cfg).unwrap();
        let mut f = FullCache::new(shape);
        c.prefill(x.view(), x.view()).unwrap();
        f.prefill(x.view(), x.view()).unwrap();
        let q = Array2::from_shape_fn((1, d), |(_, i)| i as f32 / 16.0 - 1.0);
        let (mut a, mut b) = (Array2::zeros((1, d)), Array2::zeros((1, d)));
        c.attend(q.view(), a.view_mut()).unwrap();
        f.attend(q.view(), b.view_mut()).unwrap();
        assert_eq!(a, b);
    }
}
