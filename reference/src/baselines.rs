//! SPEC.md section 12: the baselines (Full, Quest, naive 2-D), same `KvCache` API.

use half::f16;
use mosaickv_spec::rules::f16_storable as check_f16_range;
use mosaickv_spec::validate::{prompt_kv, queries as check_queries, token_kv};
use mosaickv_spec::{KvCache, KvShape, MemoryReport, MosaicError, Result};
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
        key_dims: Vec<Vec<usize>>,
        value_dims: Vec<Vec<usize>>,
    ) -> Self {
        Self {
            shape,
            token_rate,
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
    /// `P = ceil(ceil(token_rate * n) / 16)`; all pages if there are at most P,
    /// else the last page plus the `P - 1` best others by
    /// `sum_c max(q_c M_c, q_c m_c)` (max over the group; ties: lower page).
    fn select_pages(&self, queries: &ArrayView2<f32>, h: usize) -> Vec<usize> {
        let n = self.tokens;
        let pages = self.pages();
        let budget_pages = ((self.token_rate * n as f64).ceil() as usize).div_ceil(PAGE);
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

fn validate_prompt(
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

fn validate_token(shape: &KvShape, key: &ArrayView2<f32>, value: &ArrayView2<f32>) -> Result<()> {
    token_kv(shape, key, value)?;
    check_f16_range("key (beyond f16 range)", key.iter())?;
    check_f16_range("value (beyond f16 range)", value.iter())
}

fn validate_attend(
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
    if x > 0.0 && x <= 1.0 {
        Ok(())
    } else {
        Err(MosaicError::InvalidConfig(format!(
            "{what} {x} not in (0, 1]"
        )))
    }
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
            store: PagedStore::new(shape, 1.0, all_dims(&shape), all_dims(&shape)),
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
/// key min/max, `P = ceil(ceil(token_rate * n) / 16)` pages attended (the
/// last page always). No sink rule.
#[derive(Debug, Clone)]
pub struct QuestCache {
    store: PagedStore,
}

impl QuestCache {
    pub fn new(shape: KvShape, token_rate: f64) -> Result<Self> {
        let shape = KvShape::new(shape.kv_heads, shape.q_heads, shape.head_dim)?;
        check_rate("token_rate", token_rate)?;
        Ok(Self {
            store: PagedStore::new(shape, token_rate, all_dims(&shape), all_dims(&shape)),
        })
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
            retention,
            store: None,
        })
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
