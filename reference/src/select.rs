//! SPEC.md section 8: token selection (rotated query, block score, top-k under a token budget).

use crate::checks::check_cache;
use mosaickv_spec::validate::finite;
use mosaickv_spec::{BlockMeta, CompressedCache, MosaicError, Result, Selection, SideStrategy};
use ndarray::{Array2, ArrayView2};

/// SPEC.md section 8.1 for one query: `q'_j = sum_i R_k[i][j] * q_i` for
/// `j < Dt`, f64, ascending i (R's f16 values widened).
pub fn rotate_query_f64(q: &[f32], key: &SideStrategy) -> Vec<f64> {
    let d = key.head_dim();
    let dt = key.layout.kept_dims;
    let mut out = vec![0.0f64; dt];
    for i in 0..d {
        let qi = f64::from(q[i]);
        for j in 0..dt {
            out[j] += key.rotation[i * dt + j].to_f64() * qi;
        }
    }
    out
}

/// SPEC.md section 8.1: rotated queries `[m, Dt]` (f64, rounded to f32) for queries `[m, D]`.
pub fn rotate_queries(queries: ArrayView2<f32>, key: &SideStrategy) -> Result<Array2<f32>> {
    key.validate()?;
    if queries.ncols() != key.head_dim() {
        return Err(MosaicError::ShapeMismatch {
            what: "queries",
            expected: format!("[m, {}]", key.head_dim()),
            got: format!("{:?}", queries.shape()),
        });
    }
    finite("queries", queries.iter())?;
    let dt = key.layout.kept_dims;
    let mut out = Array2::<f32>::zeros((queries.nrows(), dt));
    for (m, q) in queries.rows().into_iter().enumerate() {
        let q: Vec<f32> = q.iter().copied().collect();
        for (j, v) in rotate_query_f64(&q, key).into_iter().enumerate() {
            out[[m, j]] = v as f32;
        }
    }
    Ok(out)
}

/// SPEC.md section 8.2: a rotated query (f32) quantized to int8, `q'_j = s_q (a_j + e_j)`
/// with `|e_j| <= 1/2`: `s_q = max_j |q'_j| / 127` (f64), `a_j = round_half_even(q'_j / s_q)`
/// (f64) in `[-127, 127]`; all zero (and `s_q = 0`) for a zero query.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantQuery {
    pub scale: f64,
    pub a: Vec<i32>,
}

impl QuantQuery {
    pub fn new(q: &[f32]) -> Self {
        let m = q.iter().fold(0f32, |m, &x| m.max(x.abs()));
        if m == 0.0 {
            return Self {
                scale: 0.0,
                a: vec![0; q.len()],
            };
        }
        let scale = f64::from(m) / 127.0;
        let a = q
            .iter()
            .map(|&x| ((f64::from(x) / scale).round_ties_even() as i32).clamp(-127, 127))
            .collect();
        Self { scale, a }
    }
}

/// SPEC.md section 8.2, the integer part for one block: `I = sum_{j<Dt}
/// max(a_j qmax_j, a_j qmin_j)` and `W = sum_{j<Dt} max(|qmax_j|, |qmin_j|)`.
pub fn block_integer_terms(meta: &BlockMeta, block: usize, a: &[i32]) -> (i64, i64) {
    let dt = meta.kept_dims;
    let (mut i_sum, mut w_sum) = (0i64, 0i64);
    for j in 0..dt {
        let hi = i64::from(meta.max[block * dt + j]);
        let lo = i64::from(meta.min[block * dt + j]);
        let aj = i64::from(a[j]);
        i_sum += (aj * hi).max(aj * lo);
        w_sum += hi.abs().max(lo.abs());
    }
    (i_sum, w_sum)
}

/// SPEC.md section 8.2 for one block and one quantized rotated query (f64):
/// `s = s_b * s_q * (I + W / 2)`.
///
/// Upper bound: for every decoded key `k^` of the block and every `j`,
/// `qmin_j s_b <= m_j <= k^_j <= M_j <= qmax_j s_b` (section 7 rounds the
/// stored bounds outward), so `q'_j k^_j <= s_b max(q'_j qmax_j, q'_j qmin_j)`
/// (a linear function of `k^_j` on an interval is largest at an end point).
/// With `q'_j = s_q (a_j + e_j)`, `|e_j| <= 1/2`:
/// `max(q'_j x, q'_j y) <= s_q (max(a_j x, a_j y) + |e_j| max(|x|, |y|))`,
/// and summing over `j` gives `q' . k^ <= s_b s_q (I + W / 2)`.
pub fn block_score_f64(meta: &BlockMeta, block: usize, q: &QuantQuery) -> f64 {
    let (i_sum, w_sum) = block_integer_terms(meta, block, &q.a);
    f64::from(meta.scale[block]) * q.scale * (i_sum as f64 + 0.5 * w_sum as f64)
}

/// Checks a block metadata's internal sizes and values ([`BlockMeta::validate`]).
pub fn check_meta(meta: &BlockMeta) -> Result<()> {
    let want = meta.blocks() * meta.kept_dims;
    if meta.block_size == 0
        || meta.min.len() != want
        || meta.max.len() != want
        || meta.scale.len() != meta.blocks()
    {
        return Err(MosaicError::ShapeMismatch {
            what: "block metadata",
            expected: format!(
                "{want} min and max values, {} scales (block_size > 0)",
                meta.blocks()
            ),
            got: format!(
                "{} min, {} max, {} scales, block_size {}",
                meta.min.len(),
                meta.max.len(),
                meta.scale.len(),
                meta.block_size
            ),
        });
    }
    if let Some(index) = meta.scale.iter().position(|s| !s.is_finite()) {
        return Err(MosaicError::NonFinite {
            what: "block metadata scale",
            index,
        });
    }
    meta.validate()
        .map_err(|e| MosaicError::CorruptPacked(format!("block metadata: {e}")))
}

/// SPEC.md section 8.2: per block, the score (integer sums, then f64,
/// rounded to f32) maximised over the group's rotated queries `[group, Dt]`.
pub fn score_blocks(meta: &BlockMeta, rotated_queries: ArrayView2<f32>) -> Result<Vec<f32>> {
    check_meta(meta)?;
    if rotated_queries.ncols() != meta.kept_dims || rotated_queries.nrows() == 0 {
        return Err(MosaicError::ShapeMismatch {
            what: "rotated queries",
            expected: format!("[group >= 1, {}]", meta.kept_dims),
            got: format!("{:?}", rotated_queries.shape()),
        });
    }
    finite("rotated queries", rotated_queries.iter())?;
    let queries: Vec<QuantQuery> = rotated_queries
        .rows()
        .into_iter()
        .map(|q| QuantQuery::new(&q.iter().copied().collect::<Vec<f32>>()))
        .collect();
    let mut scores = Vec::with_capacity(meta.blocks());
    for b in 0..meta.blocks() {
        let mut best = f64::NEG_INFINITY;
        for q in &queries {
            best = best.max(block_score_f64(meta, b, q));
        }
        scores.push(best as f32);
    }
    Ok(scores)
}

/// SPEC.md section 8.3: blocks sorted by score descending (ties: lower
/// index), taken in that order while fewer than `budget_tokens` tokens are
/// taken; returned ascending. With variable block lengths the budget may be
/// overshot by less than one block.
pub fn select_blocks(
    scores: &[f32],
    block_lens: &[usize],
    budget_tokens: usize,
) -> Result<Vec<u32>> {
    mosaickv_spec::validate::block_scores(scores, block_lens)?;
    let mut order: Vec<usize> = (0..scores.len()).collect();
    // Stable sort, descending: equal scores (+0 and -0 included) stay in
    // ascending index order.
    order.sort_by(|&a, &b| mosaickv_spec::rules::score_order(scores[a], scores[b]));
    let mut taken_tokens = 0;
    let mut chosen = Vec::new();
    for b in order {
        if taken_tokens >= budget_tokens {
            break;
        }
        chosen.push(b as u32);
        taken_tokens += block_lens[b];
    }
    chosen.sort_unstable();
    Ok(chosen)
}

/// SPEC.md section 8: per KV head, the blocks of all segments (global order:
/// segments in token order, blocks in order) scored with the group's
/// rotated queries and selected under the budget `B = min(n_seg, max(ceil(token_rate *
/// n_seg), min_budget_tokens))` (section 8.3).
/// Composed from [`rotate_queries`], [`score_blocks`] and [`select_blocks`].
pub fn select(cache: &CompressedCache, queries: ArrayView2<f32>) -> Result<Selection> {
    let shape = cache.shape;
    check_cache(cache)?;
    mosaickv_spec::validate::queries(&shape, &queries, &[shape.q_heads, shape.head_dim])?;
    let g = shape.group();
    let budget = cache.config.budget_tokens(cache.segment_tokens());
    let mut per_head = Vec::with_capacity(shape.kv_heads);
    for j in 0..shape.kv_heads {
        let group = queries.slice(ndarray::s![j * g..(j + 1) * g, ..]);
        let mut ids: Vec<(u32, u32)> = Vec::new();
        let mut scores: Vec<f32> = Vec::new();
        let mut lens: Vec<usize> = Vec::new();
        for (s, seg) in cache.segments.iter().enumerate() {
            let head = &seg.heads[j];
            let rq = rotate_queries(group, &head.strategy.key)?;
            let seg_scores = score_blocks(&head.meta, rq.view())?;
            for (b, score) in seg_scores.into_iter().enumerate() {
                ids.push((s as u32, b as u32));
                scores.push(score);
                lens.push(head.meta.block_len(b));
            }
        }
        let chosen = select_blocks(&scores, &lens, budget)?;
        per_head.push(chosen.into_iter().map(|i| ids[i as usize]).collect());
    }
    Ok(Selection { per_head })
}
