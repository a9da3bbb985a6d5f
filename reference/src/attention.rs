//! SPEC.md section 9: PackedAttention (what is attended, and how).

// The structural checks, also reachable as `attention::check_cache` / `check_selection`.
pub use crate::checks::{check_cache, check_selection};
use crate::packed::decode_record;
use crate::select::{rotate_query_f64, select, QuantQuery};
use mosaickv_spec::layout::{bitmap_bit, read_code, record_quant};
use mosaickv_spec::{CompressedCache, MosaicError, RecordLayout, Result, Selection};
use ndarray::{ArrayView2, ArrayViewMut2};

/// Where an attended token's value lives.
enum AttendedValue {
    /// A sink or buffer row, f16 widened, original basis (D dims).
    Dense(Vec<f64>),
    /// A packed row `v^` of segment `segment`, rotated basis (Dt_v dims).
    Rotated { segment: usize, v: Vec<f64> },
}

fn dense_dot(q: &[f32], k: &[half::f16]) -> f64 {
    let mut s = 0.0;
    for i in 0..q.len() {
        s += f64::from(q[i]) * f64::from(k[i].to_f32());
    }
    s
}

/// SPEC.md section 9, logits on int8/int4 key records: `I_c = sum_kept a_j c_j` and `I_k =
/// sum_kept a_j` over the record's kept dims (the k-th kept dim takes the k-th stored code),
/// then `f32((s_q * (s * I_c + m * I_k)) / sqrt(D))` in f64 (`spec::layout::key_logit_q8`).
/// The record must be valid (`check_cache` has run).
pub fn key_logits_q8(layout: &RecordLayout, record: &[u8], q: &QuantQuery, head_dim: usize) -> f32 {
    let codes = &record[layout.values_offset()..];
    let (mut ic, mut ik) = (0i64, 0i64);
    let mut k = 0; // index of the next stored code
    for grp in 0..layout.groups() {
        if bitmap_bit(record, grp) {
            for dim in grp * layout.group_size..(grp + 1) * layout.group_size {
                let a = i64::from(q.a[dim]);
                ic += a * i64::from(read_code(layout.dtype, codes, k));
                ik += a;
                k += 1;
            }
        }
    }
    // |I_c| <= 127 * 255 * Dt < 2^24 for Dt <= 512 (SPEC.md 9): the i32 every backend uses.
    let (ic, ik) = (ic as i32, ik as i32);
    let inv = mosaickv_spec::layout::inv_sqrt_d(head_dim);
    mosaickv_spec::layout::key_logit_q8(q.scale, record_quant(layout, record), ic, ik, inv)
}

fn widen(v: &[half::f16]) -> Vec<f64> {
    v.iter().map(|x| f64::from(x.to_f32())).collect()
}

/// SPEC.md section 9: attention of queries `[q_heads, D]` over the sink,
/// the selected blocks and the update buffer, written to `out`.
///
/// For query head h of KV head `j = h / G`:
/// - `z_t = (q . k_t) / sqrt(D)`; sink and buffer keys are their f16 rows;
///   a packed f16 key contributes `q'_seg . k^_t` (q' from section 8.1, f64); an int8/int4
///   key record its integer logit against the int8 query of 8.2 ([`key_logits_q8`]);
/// - `p = softmax(z)` with the max subtracted;
/// - `o = sum_{sink, buffer} p_t v_t + sum_seg R_v,seg (sum_{t in seg} p_t v^_t)`.
///
/// f64 throughout, rounded to f32 at the end. `out` is written only on success.
pub fn attend_selected(
    cache: &CompressedCache,
    queries: ArrayView2<f32>,
    selection: &Selection,
    mut out: ArrayViewMut2<f32>,
) -> Result<()> {
    let shape = cache.shape;
    check_cache(cache)?;
    mosaickv_spec::validate::queries(&shape, &queries, out.shape())?;
    if cache.is_empty() {
        return Err(MosaicError::EmptyCache);
    }
    check_selection(cache, selection)?;
    let d = shape.head_dim;
    let scale = 1.0 / (d as f64).sqrt();
    let mut result = vec![vec![0.0f32; d]; shape.q_heads];
    for h in 0..shape.q_heads {
        let j = h / shape.group();
        let q: Vec<f32> = queries.row(h).iter().copied().collect();
        let mut attended: Vec<(f64, AttendedValue)> = Vec::new();
        for t in 0..cache.sink.tokens {
            let z = dense_dot(&q, cache.sink.key(&shape, t, j)) * scale;
            attended.push((
                z,
                AttendedValue::Dense(widen(cache.sink.value(&shape, t, j))),
            ));
        }
        let mut last_segment = usize::MAX;
        let mut q_rot: Vec<f64> = Vec::new();
        let mut q_int8 = QuantQuery::new(&[]);
        for &(s, b) in &selection.per_head[j] {
            let (s, b) = (s as usize, b as usize);
            let head = &cache.segments[s].heads[j];
            if s != last_segment {
                q_rot = rotate_query_f64(&q, &head.strategy.key);
                // SPEC 8.2's int8 query of the f32 rotated query (8.1), for int8/int4 keys.
                let q_f32: Vec<f32> = q_rot.iter().map(|&x| x as f32).collect();
                q_int8 = QuantQuery::new(&q_f32);
                last_segment = s;
            }
            let (kl, vl) = (&head.strategy.key.layout, &head.strategy.value.layout);
            let first = b * head.meta.block_size;
            for t in first..first + head.meta.block_len(b) {
                let z = if kl.dtype.is_quantized() {
                    f64::from(key_logits_q8(kl, head.keys.record(kl, t), &q_int8, d))
                } else {
                    let k_hat = decode_record(&head.strategy.key, head.keys.record(kl, t))?;
                    let mut dot = 0.0;
                    for i in 0..k_hat.len() {
                        dot += q_rot[i] * f64::from(k_hat[i]);
                    }
                    dot * scale
                };
                let v_hat = decode_record(&head.strategy.value, head.values.record(vl, t))?;
                let v = v_hat.iter().map(|&x| f64::from(x)).collect();
                attended.push((z, AttendedValue::Rotated { segment: s, v }));
            }
        }
        for t in 0..cache.buffer.tokens {
            let z = dense_dot(&q, cache.buffer.key(&shape, t, j)) * scale;
            attended.push((
                z,
                AttendedValue::Dense(widen(cache.buffer.value(&shape, t, j))),
            ));
        }

        let z_max = attended
            .iter()
            .map(|a| a.0)
            .fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = attended.iter().map(|a| (a.0 - z_max).exp()).collect();
        let denom: f64 = weights.iter().sum();

        let mut o = vec![0.0f64; d];
        let mut rotated_acc: Vec<Option<Vec<f64>>> = vec![None; cache.segments.len()];
        for ((_, value), w) in attended.iter().zip(&weights) {
            let p = w / denom;
            match value {
                AttendedValue::Dense(v) => {
                    for i in 0..d {
                        o[i] += p * v[i];
                    }
                }
                AttendedValue::Rotated { segment, v } => {
                    let acc = rotated_acc[*segment].get_or_insert_with(|| vec![0.0; v.len()]);
                    for i in 0..v.len() {
                        acc[i] += p * v[i];
                    }
                }
            }
        }
        // Rotate each segment's accumulated values back once: o_i += sum_j R_v[i][j] acc_j.
        for (s, acc) in rotated_acc.iter().enumerate() {
            if let Some(acc) = acc {
                let r = &cache.segments[s].heads[j].strategy.value.rotation; // D x Dt_v
                let dtv = acc.len();
                for i in 0..d {
                    for (jj, a) in acc.iter().enumerate() {
                        o[i] += r[i * dtv + jj].to_f64() * a;
                    }
                }
            }
        }
        for i in 0..d {
            result[h][i] = o[i] as f32;
        }
    }
    for h in 0..shape.q_heads {
        for i in 0..d {
            out[[h, i]] = result[h][i];
        }
    }
    Ok(())
}

/// SPEC.md sections 8 + 9: one decode step's attention.
pub fn attend(
    cache: &CompressedCache,
    queries: ArrayView2<f32>,
    out: ArrayViewMut2<f32>,
) -> Result<()> {
    mosaickv_spec::validate::queries(&cache.shape, &queries, out.shape())?;
    if cache.is_empty() {
        return Err(MosaicError::EmptyCache);
    }
    let selection = select(cache, queries)?;
    attend_selected(cache, queries, &selection, out)
}

/// SPEC.md section 9's attended set as token indices, per query head
/// (ascending): the sink, every token of the head's selected blocks, the buffer.
pub fn attended_tokens(cache: &CompressedCache, selection: &Selection) -> Result<Vec<Vec<usize>>> {
    check_selection(cache, selection)?;
    let shape = cache.shape;
    let mut per_kv = Vec::with_capacity(shape.kv_heads);
    for j in 0..shape.kv_heads {
        let mut tokens: Vec<usize> = (0..cache.sink.tokens).collect();
        for &(s, b) in &selection.per_head[j] {
            let seg = &cache.segments[s as usize];
            let meta = &seg.heads[j].meta;
            let first = seg.start + b as usize * meta.block_size;
            tokens.extend(first..first + meta.block_len(b as usize));
        }
        let buffer_start = cache.len() - cache.buffer.tokens;
        tokens.extend(buffer_start..cache.len());
        per_kv.push(tokens);
    }
    Ok((0..shape.q_heads)
        .map(|h| per_kv[h / shape.group()].clone())
        .collect())
}
