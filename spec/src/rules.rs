//! Decisions every backend must make identically, written once.
//!
//! These are *data* decisions of SPEC.md: which inputs are storable, where a
//! prompt is split, which `(r, g)` candidates exist and which one a rule
//! picks from their losses. They do no floating-point arithmetic whose order
//! could differ between backends, so there is nothing to cross-check: every
//! backend calls these functions. The arithmetic (rotations, losses,
//! attention) stays independent in each backend and is compared by the
//! conformance suite.

use crate::config::{ceil_to, ChannelPolicy, CompressConfig};
use crate::error::{MosaicError, Result};
use crate::layout::{RecordLayout, ValueDtype};
use crate::traits::Side;

/// Magnitudes at or above this round to +-Inf in f16: the midpoint between
/// the largest finite f16 (65504) and 2^16 (SPEC.md section 14).
pub const F16_OVERFLOW: f64 = 65520.0;

/// The `what` of the `NonFinite` error for a kept rotated value that would
/// overflow f16 (SPEC.md sections 5 and 14); every backend uses this text.
pub const ROTATED_OVERFLOW: &str = "rotated value (f16 overflow)";

/// SPEC.md section 11.1: one side's loss from its sums. `dropped` and `total` are the energy
/// loss's numerator and denominator; `spread` is the rows' spread about their mean (`Q -
/// ||m||^2 / n`, computed by each backend). Keys divide by the spread when it is positive,
/// values (and keys without spread) by the energy; 0 when that denominator is 0.
pub fn side_loss(side: Side, dropped: f64, total: f64, spread: f64) -> f64 {
    let den = match side {
        Side::Key if spread > 0.0 => spread,
        _ => total,
    };
    if den == 0.0 {
        0.0
    } else {
        dropped / den
    }
}

/// The rate rule (SPEC.md section 2): a token rate or a channel retention is a fraction in
/// (0, 1]. Every cache, configuration and front end checks it here; the message names `what`.
pub fn fraction(what: &str, x: f64) -> Result<()> {
    if x > 0.0 && x <= 1.0 {
        Ok(())
    } else {
        Err(MosaicError::InvalidConfig(format!(
            "{what} {x} not in (0, 1]"
        )))
    }
}

/// Whether a finite or non-finite f64 would be stored as a finite f16.
#[inline]
pub fn fits_f16(x: f64) -> bool {
    x.abs() < F16_OVERFLOW // false for NaN and +-Inf too
}

/// SPEC.md section 14: values that will be stored as f16 (sink and buffer
/// rows) must be finite and round to a finite f16. The error is `NonFinite`
/// with the first offending flat index (row-major), the same on every backend.
pub fn f16_storable<'a>(
    what: &'static str,
    values: impl IntoIterator<Item = &'a f32>,
) -> Result<()> {
    match values.into_iter().position(|&x| !fits_f16(f64::from(x))) {
        Some(index) => Err(MosaicError::NonFinite { what, index }),
        None => Ok(()),
    }
}

/// Largest L2 norm of a K/V row a MosaicKV cache accepts: 65472, the largest
/// finite f16 (65504) less 32 (SPEC.md section 14).
///
/// Why a norm: a stored rotated value is `x'_j = sum_i R_ij x_i` with `R`'s
/// columns unit vectors rounded to f16 (SPEC.md section 3), each entry within
/// 2^-11 of its value relative (or 2^-25 absolute when subnormal), so a column's
/// norm is at most `1 + 2^-11 + sqrt(D) 2^-25` (checked on load:
/// [`crate::layout::rotation_column_norm_max`]) and `|x'_j| <= 65472 (1 + 2^-11 +
/// sqrt(D) 2^-25)`, 65504.03 at D = 256 (plus f64 rounding, far below that), `< 65520`
/// whenever `||x|| <= 65472` and `D < 2^26`: no rotation a fit produces can
/// overflow f16, and no element of the row can either (so the sink and the
/// buffer store it finitely). With the limit at 65504 a rotated value could reach
/// 65536 and round to infinity. Checked once, at
/// `prefill`/`append`, the same on every backend, it makes every later flush
/// and segment close unable to fail on magnitude, which the background worker
/// of a production cache relies on.
pub const ROW_NORM_MAX: f64 = 65472.0;

/// Largest L2 norm of a query row that attention accepts: 2^64 (SPEC.md section 14).
///
/// Why: queries are finite f32 but never stored, so f16's range does not bound them, and
/// the optimized backends compute logits in f32. A key attention reads is an f16 value or
/// an int8/int4 decoded value `m + c s` (`|m|, s <= 65504`, `c <= 255`), so every element
/// is below 2^24 and `|q . k| <= ||q|| 2^24 sqrt(D)`: with `||q|| <= 2^64` that is below
/// 2^98 at any head_dim up to 2^20, and the block scores of section 8.2 below 2^100, far
/// from f32's 2^128. Without a bound a query of norm 1e37 made the f32 logits overflow to
/// a NaN output on the CPU backend while the f64 reference answered.
pub const QUERY_NORM_MAX: f64 = 18_446_744_073_709_551_616.0; // 2^64

/// The `what` of the `NonFinite` error for a query row beyond [`QUERY_NORM_MAX`].
pub const ROW_QUERY: &str = "queries (row norm beyond 2^64)";

/// SPEC.md section 14: every query row (finite, checked first) has `||q||^2 <= 2^128`, the
/// sum of squares in f64 over ascending i. Else `NonFinite` ([`ROW_QUERY`]) with the flat
/// index `row * d` of the first such row, the same on every backend.
pub fn queries_in_range<'a, R: IntoIterator<Item = &'a f32>>(
    rows: impl IntoIterator<Item = R>,
    d: usize,
) -> Result<()> {
    for (h, row) in rows.into_iter().enumerate() {
        let sq = row
            .into_iter()
            .fold(0f64, |a, &x| a + f64::from(x) * f64::from(x));
        if !(sq <= QUERY_NORM_MAX * QUERY_NORM_MAX) {
            return Err(MosaicError::NonFinite {
                what: ROW_QUERY,
                index: h * d,
            });
        }
    }
    Ok(())
}

/// The `what` of [`rows_storable`]'s error at `prefill` (keys, values) and `append`
/// (key, value), the same on every backend.
pub const ROW_KEYS: &str = "keys (row norm beyond f16 range)";
pub const ROW_VALUES: &str = "values (row norm beyond f16 range)";
pub const ROW_KEY: &str = "key (row norm beyond f16 range)";
pub const ROW_VALUE: &str = "value (row norm beyond f16 range)";

/// SPEC.md section 14: every row of `rows` (`[n][d]` row-major, the rows of
/// `[tokens, kv_heads, head_dim]` in order) has `||x||^2 <= 65472^2`, with
/// `||x||^2 = sum_i x_i^2` in f64 over ascending i (each square is exact in
/// f64). Else `NonFinite` with the flat index of the first such row's first
/// element. NaN and Inf fail too (the caller checks finiteness first).
pub fn rows_storable(what: &'static str, rows: &[f32], d: usize) -> Result<()> {
    let max = ROW_NORM_MAX * ROW_NORM_MAX; // 4286582784, exact in f64
    for (t, row) in rows.chunks(d.max(1)).enumerate() {
        let mut sq = 0f64;
        for &x in row {
            sq += f64::from(x) * f64::from(x);
        }
        if !(sq <= max) {
            return Err(MosaicError::NonFinite { what, index: t * d });
        }
    }
    Ok(())
}

/// The error for a kept rotated value of row `row`, rotated dim `dim`, that
/// overflows f16: index `row * Dt + dim`, the flat index into the rows'
/// rotated coordinates `[n, Dt]` (SPEC.md section 14).
pub fn rotated_overflow(row: usize, dim: usize, kept_dims: usize) -> MosaicError {
    MosaicError::NonFinite {
        what: ROTATED_OVERFLOW,
        index: row * kept_dims + dim,
    }
}

/// SPEC.md section 10.1's cut, one segment at a time: with `pending` prompt tokens
/// after the sink not yet in a segment, the length of the next closed segment to cut
/// from their front, if any. While more of the prompt may follow (`complete` false),
/// a segment of `L_in` is cut only when at least `2 L_in` tokens are pending, so the
/// remainder can still become a last segment of length in `[L_in, 2 L_in)`; once the
/// prompt is complete, the pending rest (if any) is the last segment. Cutting until
/// `None` gives exactly [`prompt_segments`], in pieces (a chunked prefill uses it as
/// the chunks arrive).
pub fn next_prompt_segment(
    pending: usize,
    input_segment_len: usize,
    complete: bool,
) -> Option<usize> {
    let l_in = input_segment_len.max(1);
    if pending >= 2 * l_in {
        Some(l_in)
    } else if complete && pending > 0 {
        Some(pending)
    } else {
        None
    }
}

/// SPEC.md section 10.1: the prompt's split for `n` tokens: the sink size
/// `S = min(sink_tokens, n)` and the closed segments `(start, len)`.
/// With `m = n - S`: no segment when `m = 0`; else `c = max(1, floor(m / L_in))`
/// segments, segment i covering `S + i*L_in .. S + (i+1)*L_in` for `i < c-1`,
/// the last one the rest (so its length is in `[L_in, 2 L_in)` unless `m < L_in`).
/// Computed by cutting with [`next_prompt_segment`] on the complete prompt.
pub fn prompt_segments(
    n: usize,
    sink_tokens: usize,
    input_segment_len: usize,
) -> (usize, Vec<(usize, usize)>) {
    let sink = sink_tokens.min(n);
    let mut start = sink;
    let mut segments = Vec::new();
    while let Some(len) = next_prompt_segment(n - start, input_segment_len, true) {
        segments.push((start, len));
        start += len;
    }
    (sink, segments)
}

/// SPEC.md sections 6, 7, 11.2 and 13: the most device bytes one KV head of a MosaicKV cache
/// can hold per token under `config`, whatever strategies the fit picks: a key and a value
/// record of the policy's largest candidate layout (value dtype and scales included) and the
/// key block metadata at the smallest block size with every dim kept (`ceil((2 D + 4) / b)`).
pub fn worst_token_bytes(config: &CompressConfig, head_dim: usize) -> usize {
    // A coded record (SPEC.md section 6.1) holds at most 8 bits per rotated dim.
    let coded = if config.value_dtypes.contains(&ValueDtype::Coded) {
        config.kept_dims(head_dim, 1).div_ceil(4) * 4
    } else {
        0
    };
    let record = candidates(config, head_dim)
        .iter()
        .map(|l| l.record_bytes())
        .chain([coded])
        .max()
        .unwrap_or(0);
    let b_min = config.block_sizes.iter().copied().min().unwrap_or(1).max(1);
    2 * record + (2 * head_dim + 4).div_ceil(b_min)
}

/// SPEC.md section 13: the most device bytes one KV head of a segment holds apart from its
/// tokens: two f16 rotations `D x Dt` (at most `D x D`), the two side strategy headers and one
/// partial block of metadata. The segment's own header ([`crate::cache::SEGMENT_HEADER_BYTES`])
/// is per segment, not per head.
pub fn worst_segment_head_bytes(head_dim: usize) -> usize {
    2 * 2 * head_dim * head_dim + 2 * crate::cache::STRATEGY_HEADER_BYTES + 2 * head_dim + 4
}

/// SPEC.md section 11.2: the candidate record layouts of a policy for
/// `head_dim`, in policy order (value dtypes outer, then group sizes, then
/// retentions) with duplicates removed: `r = min(Dt_g, ceil_g(f * D))`, `Dt_g`
/// from section 4. The fixed policy has one candidate, in the first of
/// `value_dtypes`.
pub fn candidates(config: &CompressConfig, head_dim: usize) -> Vec<RecordLayout> {
    let layout = |f: f64, g: usize, dtype: ValueDtype| {
        let kept_dims = config.kept_dims(head_dim, g);
        let r = ceil_to((f * head_dim as f64).ceil() as usize, g).min(kept_dims);
        RecordLayout {
            head_dim,
            kept_dims,
            r,
            group_size: g,
            dtype,
            code_bits: 0,
        }
    };
    let mut out: Vec<RecordLayout> = Vec::new();
    let mut push = |l: RecordLayout| {
        if !out.contains(&l) {
            out.push(l);
        }
    };
    match &config.channels {
        ChannelPolicy::Fixed {
            retention,
            group_size,
        } => push(layout(
            *retention,
            *group_size,
            config
                .value_dtypes
                .first()
                .copied()
                .unwrap_or(ValueDtype::F16),
        )),
        ChannelPolicy::LossThreshold {
            retentions,
            group_sizes,
            ..
        } => {
            // Coded candidates (SPEC.md section 6.1) depend on the rows, so each backend adds
            // them at `coded`'s place in `value_dtypes` (`coded_candidates_at`).
            for &dtype in config.value_dtypes.iter().filter(|d| d.is_bitmap()) {
                for &g in group_sizes {
                    for &f in retentions {
                        push(layout(f, g, dtype));
                    }
                }
            }
        }
    }
    out
}

/// SPEC.md sections 6.1 and 11.2: where a policy's coded candidates go in its candidate list:
/// after the bitmap candidates of the dtypes listed before `coded` in `value_dtypes` (`None`
/// when `coded` is not listed). Coded candidates depend on the rows (one per step of the
/// ladder, [`crate::coded::ladder`]), so each backend builds them and inserts them here.
pub fn coded_candidates_at(config: &CompressConfig, head_dim: usize) -> Option<usize> {
    let at = config
        .value_dtypes
        .iter()
        .position(|&d| d == ValueDtype::Coded)?;
    let before = CompressConfig {
        value_dtypes: config.value_dtypes[..at].to_vec(),
        ..config.clone()
    };
    Some(if at == 0 {
        0
    } else {
        candidates(&before, head_dim).len()
    })
}

/// SPEC.md section 11.2: the index of the chosen candidate, given each
/// candidate's loss (`losses[i]` for `candidates[i]`, finite and >= 0).
///
/// - fixed: the one candidate;
/// - loss_threshold: among the candidates whose loss is at most the side's
///   threshold, the fewest `record_bytes`, ties by lower loss, then smaller
///   g, then candidate order; if none passes, the lowest loss, ties by fewer
///   bytes, then smaller g, then candidate order.
///
/// Losses are compared with `total_cmp` (equal f64 values tie; the losses
/// are never NaN, and `-0.0` cannot occur in a sum of squares over a
/// positive total).
pub fn choose_candidate(
    candidates: &[RecordLayout],
    losses: &[f64],
    side: Side,
    config: &CompressConfig,
) -> usize {
    assert_eq!(candidates.len(), losses.len(), "one loss per candidate");
    let threshold = match (&config.channels, side) {
        (ChannelPolicy::Fixed { .. }, _) => return 0,
        (ChannelPolicy::LossThreshold { key_loss, .. }, Side::Key) => *key_loss,
        (ChannelPolicy::LossThreshold { value_loss, .. }, Side::Value) => *value_loss,
    };
    let bytes = |i: usize| candidates[i].record_bytes();
    let g = |i: usize| candidates[i].group_size;
    let passing: Vec<usize> = (0..candidates.len())
        .filter(|&i| losses[i] <= threshold)
        .collect();
    let pick = if passing.is_empty() {
        (0..candidates.len()).min_by(|&a, &b| {
            losses[a]
                .total_cmp(&losses[b])
                .then(bytes(a).cmp(&bytes(b)))
                .then(g(a).cmp(&g(b)))
        })
    } else {
        passing.into_iter().min_by(|&a, &b| {
            bytes(a)
                .cmp(&bytes(b))
                .then(losses[a].total_cmp(&losses[b]))
                .then(g(a).cmp(&g(b)))
        })
    };
    // `min_by` returns the first of equal elements: candidate order breaks the last tie.
    pick.expect("a validated policy has at least one candidate")
}

/// SPEC.md section 8.3: orders two block scores for top-k: higher first,
/// equal scores (including `+0.0` and `-0.0`) tie. NaN is rejected before
/// any selection, so it never reaches this comparison.
#[inline]
pub fn score_order(a: f32, b: f32) -> std::cmp::Ordering {
    b.partial_cmp(&a).unwrap_or(std::cmp::Ordering::Equal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_range_edges() {
        assert!(fits_f16(65519.99));
        assert!(fits_f16(-65504.0));
        assert!(!fits_f16(65520.0));
        assert!(!fits_f16(-65520.0));
        assert!(!fits_f16(f64::NAN));
        assert!(!fits_f16(f64::INFINITY));
        let e = f16_storable("keys", [1.0f32, -65520.0, f32::NAN].iter()).unwrap_err();
        assert_eq!(
            e,
            MosaicError::NonFinite {
                what: "keys",
                index: 1
            }
        );
        // What the boundary means: 65519.99 rounds to 65504, 65520 to infinity.
        assert!(half::f16::from_f32(65519.99).is_finite());
        assert!(half::f16::from_f32(65520.0).is_infinite());
    }

    #[test]
    fn row_norm_edges() {
        // 65472 alone is storable; one more ulp of norm is not.
        let mut row = vec![0f32; 8];
        row[3] = 65472.0;
        assert!(rows_storable("k", &row, 8).is_ok());
        row[5] = 1.0; // norm sqrt(65472^2 + 1) > 65472
        assert_eq!(
            rows_storable("k", &row, 8),
            Err(MosaicError::NonFinite {
                what: "k",
                index: 0
            })
        );
        // Small elements, large norm: 8 x 23170 has norm 65534 > 65472.
        let rows: Vec<f32> = [vec![1.0f32; 8], vec![23170.0; 8]].concat();
        assert_eq!(
            rows_storable("v", &rows, 8),
            Err(MosaicError::NonFinite {
                what: "v",
                index: 8
            })
        );
        assert!(rows_storable("v", &[23147.0f32; 8], 8).is_ok()); // norm 65470.5
        assert!(rows_storable("v", &[23158.0f32; 8], 8).is_err()); // norm 65500.6
                                                                   // The largest element alone (65504, a finite f16) is past the norm limit.
        let mut row = vec![0f32; 8];
        row[0] = 65504.0;
        assert!(rows_storable("k", &row, 8).is_err());
        assert!(rows_storable("v", &[f32::NAN; 4], 4).is_err());
    }

    #[test]
    fn prompt_split_matches_its_closed_form() {
        // c = max(1, floor(m / L)), c - 1 segments of L, the rest last (SPEC 10.1).
        for l in [1usize, 2, 5, 16] {
            for s in [0usize, 1, 4] {
                for n in 0..80 {
                    let sink = s.min(n);
                    let m = n - sink;
                    let mut want = Vec::new();
                    if m > 0 {
                        let c = (m / l).max(1);
                        for i in 0..c - 1 {
                            want.push((sink + i * l, l));
                        }
                        want.push((sink + (c - 1) * l, n - sink - (c - 1) * l));
                    }
                    assert_eq!(
                        prompt_segments(n, s, l),
                        (sink, want),
                        "n {n} sink {s} L {l}"
                    );
                }
            }
        }
        assert_eq!(next_prompt_segment(31, 16, false), None);
        assert_eq!(next_prompt_segment(32, 16, false), Some(16));
        assert_eq!(next_prompt_segment(31, 16, true), Some(31));
        assert_eq!(next_prompt_segment(0, 16, true), None);
    }

    #[test]
    fn prompt_split_rule() {
        assert_eq!(prompt_segments(0, 4, 16), (0, vec![]));
        assert_eq!(prompt_segments(3, 4, 16), (3, vec![]));
        assert_eq!(prompt_segments(4, 4, 16), (4, vec![]));
        assert_eq!(prompt_segments(5, 4, 16), (4, vec![(4, 1)]));
        assert_eq!(prompt_segments(4 + 31, 4, 16), (4, vec![(4, 31)]));
        assert_eq!(prompt_segments(4 + 32, 4, 16), (4, vec![(4, 16), (20, 16)]));
        assert_eq!(prompt_segments(4 + 47, 4, 16), (4, vec![(4, 16), (20, 31)]));
    }

    #[test]
    fn choose_ties_follow_the_rule() {
        let mut cfg = CompressConfig {
            value_dtypes: vec![ValueDtype::F16],
            ..CompressConfig::default()
        };
        cfg.channels = ChannelPolicy::LossThreshold {
            key_loss: 0.1,
            value_loss: 0.2,
            retentions: vec![0.25, 0.5],
            group_sizes: vec![2, 1],
        };
        let c = candidates(&cfg, 64);
        // Policy order: g = 2 first, then g = 1; r = ceil_g(f * D).
        assert_eq!(
            c.iter().map(|l| (l.r, l.group_size)).collect::<Vec<_>>(),
            vec![(16, 2), (32, 2), (16, 1), (32, 1)]
        );
        let bytes: Vec<usize> = c.iter().map(|l| l.record_bytes()).collect();
        assert_eq!(bytes, vec![36, 68, 40, 72]);
        // A loss exactly at the threshold passes: the cheapest passing one wins.
        assert_eq!(
            choose_candidate(&c, &[0.1, 0.0, 0.0, 0.0], Side::Key, &cfg),
            0
        );
        let above = f64::from_bits(0.1f64.to_bits() + 1); // one ulp over: fails
        assert_eq!(
            choose_candidate(&c, &[above, 0.0, 0.0, 0.0], Side::Key, &cfg),
            2
        );
        assert_eq!(
            choose_candidate(&c, &[0.11, 0.0, 0.1, 0.0], Side::Key, &cfg),
            2
        );
        // The value side has its own threshold.
        assert_eq!(
            choose_candidate(&c, &[0.2, 0.0, 0.0, 0.0], Side::Value, &cfg),
            0
        );
        assert_eq!(
            choose_candidate(&c, &[0.21, 0.3, 0.0, 0.0], Side::Value, &cfg),
            2
        );
        // None passes: lowest loss; equal losses go to fewer bytes.
        assert_eq!(
            choose_candidate(&c, &[0.5, 0.3, 0.9, 0.3], Side::Key, &cfg),
            1
        );
        // Equal bytes and loss: the smaller g, whatever the candidate order.
        let small = |g: usize| RecordLayout {
            head_dim: 32,
            kept_dims: 32,
            r: 8,
            group_size: g,
            dtype: ValueDtype::F16,
            code_bits: 0,
        };
        let twins = vec![small(2), small(1)];
        assert_eq!(twins[0].record_bytes(), twins[1].record_bytes());
        assert_eq!(choose_candidate(&twins, &[0.5, 0.5], Side::Key, &cfg), 1);
        assert_eq!(choose_candidate(&twins, &[0.05, 0.05], Side::Key, &cfg), 1);
        // Fixed policy: the one candidate.
        let fixed = CompressConfig::paper_fixed();
        assert_eq!(candidates(&fixed, 64).len(), 1);
        assert_eq!(
            choose_candidate(&candidates(&fixed, 64), &[0.9], Side::Key, &fixed),
            0
        );
    }

    #[test]
    fn signed_zero_scores_tie() {
        assert_eq!(score_order(0.0, -0.0), std::cmp::Ordering::Equal);
        assert_eq!(score_order(1.0, 0.0), std::cmp::Ordering::Less);
    }

    /// SPEC.md section 11.2: value dtypes are the outer loop of the candidates (config
    /// order), the fixed policy takes the first dtype, and byte order prefers a quantized
    /// layout whose loss passes.
    #[test]
    fn candidates_per_dtype() {
        let cfg = CompressConfig {
            value_dtypes: vec![ValueDtype::Int4, ValueDtype::F16],
            ..CompressConfig::default()
        };
        let c = candidates(&cfg, 64);
        let plain = candidates(
            &CompressConfig {
                value_dtypes: vec![ValueDtype::F16],
                ..CompressConfig::default()
            },
            64,
        );
        assert_eq!(c.len(), 2 * plain.len());
        for (i, l) in c.iter().enumerate() {
            let want = if i < plain.len() {
                ValueDtype::Int4
            } else {
                ValueDtype::F16
            };
            assert_eq!(l.dtype, want);
            let p = &plain[i % plain.len()];
            assert_eq!(
                (l.r, l.group_size, l.kept_dims),
                (p.r, p.group_size, p.kept_dims)
            );
        }
        // Equal losses: the int4 layout of the same (r, g) has fewer bytes and wins.
        let losses = vec![0.001; c.len()];
        let k = choose_candidate(&c, &losses, Side::Key, &cfg);
        assert_eq!(c[k].dtype, ValueDtype::Int4);
        let fixed = CompressConfig {
            value_dtypes: vec![ValueDtype::Int8, ValueDtype::F16],
            ..CompressConfig::paper_fixed()
        };
        let f = candidates(&fixed, 64);
        assert_eq!((f.len(), f[0].dtype), (1, ValueDtype::Int8));
    }
}
