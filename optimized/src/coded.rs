//! SPEC.md section 6.1 on the CPU: coded records (every rotated dim its own width, offset and
//! step for the segment; a record is its codes alone). One function per step:
//!
//! | step | function |
//! |---|---|
//! | the candidates of section 11.2 (one per distinct ladder coding) | [`coded_candidates`] |
//! | their section 11.1 losses, equal to the reference's bit for bit | [`coded_losses`] |
//! | one row's section 11.1 terms (the lifecycle's running sums) | [`coded_row_loss_terms`] |
//! | encode: one record from a row's rotated coordinates | [`pack_coded_record`] |
//! | decode: records to dense rotated rows (what attention reads) | [`CodedPlan::expand`], [`expand_coded`] |
//!
//! The arithmetic is the spec crate's ([`mosaickv_spec::coded`]): the ladder, the fitted
//! coding, each dim's encode and decode. What this file adds is speed: a segment's codings
//! differ only in each dim's width, and a dim's parameters depend on its width alone, so each
//! row's squared error at every width is computed once and every candidate's loss is a sum of
//! them, added in the spec's order.

use crate::round::{f16_from_f64, f16_to_f64};
use half::f16;
use mosaickv_spec::coded::{self, DimCode, WIDTHS};
use mosaickv_spec::{rules, CompressConfig, Side, SideStrategy};
use rayon::prelude::*;

/// SPEC.md sections 6.1 and 11.2: where `config` lists `coded`, the index among the bitmap
/// candidates ([`rules::candidates`]) at which the coded ones go, and the coded candidates of
/// rows whose rotated coordinates are `xr` (`[n][w]` f64, `w >= Dt`): one per distinct coding
/// of the ladder, in ladder order, each a side strategy without rotation or fit loss. `None`
/// when `config` does not list `coded`; no candidates when a row's f16 rounding overflows (it
/// cannot be encoded, SPEC.md section 14). The same list as the reference's
/// `strategy::side_candidates`.
pub fn coded_candidates(
    xr: &[f64],
    w: usize,
    config: &CompressConfig,
    head_dim: usize,
) -> Option<(usize, Vec<SideStrategy>)> {
    let at = rules::coded_candidates_at(config, head_dim)?;
    let dt = config.kept_dims(head_dim, 1);
    let mut lo = vec![f16::INFINITY; dt];
    let mut hi = vec![f16::NEG_INFINITY; dt];
    let mut rows = 0usize;
    for x in xr.chunks_exact(w.max(1)) {
        rows += 1;
        for j in 0..dt {
            let y = f16_from_f64(x[j]);
            if !y.is_finite() {
                return Some((at, Vec::new()));
            }
            if f16_to_f64(y) < f16_to_f64(lo[j]) {
                lo[j] = y;
            }
            if f16_to_f64(y) > f16_to_f64(hi[j]) {
                hi[j] = y;
            }
        }
    }
    if rows == 0 {
        lo.fill(f16::ZERO);
        hi.fill(f16::ZERO);
    }
    Some((at, coded::candidates(&lo, &hi, head_dim)))
}

/// The index of `bits` in [`WIDTHS`].
#[inline]
fn width_index(bits: u8) -> usize {
    WIDTHS
        .iter()
        .position(|&b| b == bits)
        .expect("a checked width")
}

/// SPEC.md sections 6.1 and 11.1 for one row `x` (`[D]`) with rotated coordinates `xr` (at
/// least `Dt`, f64) under a coded side: every dim kept, `e_j = (x'_j - d_j)^2` with `d_j` the
/// decoded value of the row's code, `total` the energies, plus the truncated dims' energy
/// `max(0, ||x||^2 - sum_{j<Dt} x'_j^2)` on both when `Dt < D`. The reference's
/// `coded_row_loss_terms`, operation for operation.
pub fn coded_row_loss_terms(x: &[f32], xr: &[f64], side: &SideStrategy) -> (f64, f64) {
    let dt = side.layout.kept_dims;
    let (mut dropped, mut total) = (0f64, 0f64);
    for (&v, c) in xr[..dt].iter().zip(&side.coding) {
        let err = v - f64::from(c.decode(c.encode(f16_from_f64(v))));
        total += v * v;
        dropped += err * err;
    }
    if dt < side.layout.head_dim {
        let energy: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let truncated = (energy - total).max(0.0);
        dropped += truncated;
        total += truncated;
    }
    (dropped, total)
}

/// SPEC.md section 11.1's energy loss of every coded candidate on rows `[n][D]` with rotated
/// coordinates `xr` (`[n][w]`): per row [`coded_row_loss_terms`], rows added in order, keys
/// against their spread. Equal bit for bit to that per candidate: a dim's decoded value depends
/// on its width only (its offset and step come from the segment's range and the width), so
/// each row's squared error and energy at each of the five widths are computed once, and a
/// candidate's row sum adds the ones of its widths in ascending j, as the row form does.
pub fn coded_losses(
    rows: &[f32],
    xr: &[f64],
    w: usize,
    cands: &[SideStrategy],
    side: Side,
) -> Vec<f64> {
    let Some(first) = cands.first() else {
        return Vec::new();
    };
    let (d, dt) = (first.layout.head_dim, first.layout.kept_dims);
    let n = rows.len() / d.max(1);
    // The parameters of dim j at each width: from any candidate that gives j that width.
    let mut by_width: Vec<[Option<DimCode>; WIDTHS.len()]> = vec![[None; WIDTHS.len()]; dt];
    for c in cands {
        for (j, dc) in c.coding.iter().enumerate() {
            by_width[j][width_index(dc.bits)].get_or_insert(*dc);
        }
    }
    // Per row: the squared errors `[Dt][5]` (0 where no candidate uses the width), the
    // energies of the kept dims (ascending j) and the row's energy (for the truncated dims).
    let widths = WIDTHS.len();
    let mut sq_err = vec![0f64; n * dt * widths];
    let mut energy = vec![0f64; n * dt];
    let mut row_energy = vec![0f64; n];
    sq_err
        .par_chunks_mut(dt * widths)
        .zip(energy.par_chunks_mut(dt))
        .zip(row_energy.par_iter_mut())
        .enumerate()
        .for_each(|(i, ((se, en), re))| {
            let x = &xr[i * w..i * w + dt];
            for j in 0..dt {
                let v = x[j];
                let y = f16_from_f64(v);
                en[j] = v * v;
                for (k, dc) in by_width[j].iter().enumerate() {
                    if let Some(dc) = dc {
                        let err = v - f64::from(dc.decode(dc.encode(y)));
                        se[j * widths + k] = err * err;
                    }
                }
            }
            if dt < d {
                *re = rows[i * d..(i + 1) * d]
                    .iter()
                    .map(|&v| f64::from(v) * f64::from(v))
                    .sum();
            }
        });
    let spread = match side {
        Side::Key => crate::strategy::SpreadSums::of_rows(rows, d).spread(),
        Side::Value => 0.0,
    };
    cands
        .par_iter()
        .map(|c| {
            let ks: Vec<usize> = c.coding.iter().map(|dc| width_index(dc.bits)).collect();
            let (mut dropped_all, mut total_all) = (0f64, 0f64);
            for i in 0..n {
                let se = &sq_err[i * dt * widths..(i + 1) * dt * widths];
                let en = &energy[i * dt..(i + 1) * dt];
                let (mut dropped, mut total) = (0f64, 0f64);
                for j in 0..dt {
                    total += en[j];
                    dropped += se[j * widths + ks[j]];
                }
                if dt < d {
                    let truncated = (row_energy[i] - total).max(0.0);
                    dropped += truncated;
                    total += truncated;
                }
                dropped_all += dropped;
                total_all += total;
            }
            rules::side_loss(side, dropped_all, total_all, spread)
        })
        .collect()
}

/// SPEC.md section 6.1: one coded record from a row's rotated coordinates `x` (at least `Dt`,
/// f64) into `out` (`record_bytes`; zeroed here), `codes` scratch of at least `Dt` bytes.
/// Returns the first dim whose f16 value overflows (SPEC.md section 14); the record's bytes
/// are then meaningless and the caller reports the error.
pub(crate) fn pack_coded_record(
    x: &[f64],
    side: &SideStrategy,
    out: &mut [u8],
    codes: &mut [u8],
) -> Option<usize> {
    let dt = side.layout.kept_dims;
    out.fill(0);
    for (j, (c, dc)) in codes[..dt].iter_mut().zip(&side.coding).enumerate() {
        let y = f16_from_f64(x[j]);
        if !y.is_finite() {
            return Some(j);
        }
        *c = dc.encode(y);
    }
    coded::pack_codes(&side.coding, &codes[..dt], out);
    None
}

/// Where each dim's code sits in a coded record and how it decodes (SPEC.md section 6.1's
/// order: widest first, least significant bit first): built once per coding, then used for
/// every tile of records ([`CodedPlan::expand`]).
///
/// The codes of one width are contiguous in a record, so a record is read width group by
/// width group: an 8-bit group is its bytes, a 4-bit group that starts on a byte (always, since
/// only 8-bit codes come before it) is two codes per byte; the narrower groups are read code by
/// code. When code order is dim order (the usual case: widths fall with the dim's energy) the
/// codes land in the row as floats and one loop the compiler vectorizes decodes the row;
/// otherwise each code is decoded straight to its dim. No scratch: nothing is allocated per
/// tile.
pub struct CodedPlan {
    /// Width groups in storage order: (first code, codes, bits, first bit in the record).
    groups: Vec<(usize, usize, u8, usize)>,
    /// Per stored code, in code order: its dim, offset and step (f32).
    dims: Vec<u16>,
    minc: Vec<f32>,
    scalec: Vec<f32>,
    /// Per dim: the offset as f32 (what a 0-bit dim decodes to).
    min: Vec<f32>,
    /// Code order is dim order and every dim has a code: values are stored in place.
    in_place: bool,
}

impl CodedPlan {
    pub fn new(coding: &[DimCode]) -> Self {
        let order = coded::code_order(coding);
        let mut groups = Vec::new();
        let (mut first, mut bit) = (0usize, 0usize);
        for b in [8u8, 4, 2, 1] {
            let count = order[first..]
                .iter()
                .take_while(|&&j| coding[j].bits == b)
                .count();
            if count > 0 {
                groups.push((first, count, b, bit));
            }
            first += count;
            bit += count * usize::from(b);
        }
        Self {
            groups,
            in_place: order.len() == coding.len() && order.iter().enumerate().all(|(k, &j)| k == j),
            dims: order.iter().map(|&j| j as u16).collect(),
            minc: order.iter().map(|&j| coding[j].min.to_f32()).collect(),
            scalec: order.iter().map(|&j| coding[j].scale.to_f32()).collect(),
            min: coding.iter().map(|c| c.min.to_f32()).collect(),
        }
    }

    /// SPEC.md section 6.1 decode: `n` coded records of `rb` bytes (record `i` at
    /// `records[i * rb..]`) into dense rotated rows `out` (`[n][dp]`, `dp >= Dt`; dims past `Dt`
    /// set to 0). Each dim is `f32(m_j) + f32(c_j) * f32(s_j)`: the product is exact (an 8-bit
    /// code times an 11-bit significand), so the one rounding is the add's, as
    /// [`DimCode::decode`] computes it.
    pub fn expand(&self, records: &[u8], n: usize, rb: usize, dp: usize, out: &mut [f32]) {
        let dt = self.min.len();
        for (i, row) in out.chunks_exact_mut(dp.max(1)).take(n).enumerate() {
            // (an all-0-bit coding has 0-byte records: every row is the offsets)
            let rec = &records[i * rb..(i + 1) * rb];
            let (vals, pad) = row.split_at_mut(dt);
            if self.in_place {
                // the codes as floats at their dims, then one decode loop over the row
                self.codes(rec, |k, c| vals[k] = f32::from(c));
                for ((v, &m), &s) in vals.iter_mut().zip(&self.minc).zip(&self.scalec) {
                    *v = m + *v * s;
                }
            } else {
                vals.copy_from_slice(&self.min);
                self.codes(rec, |k, c| {
                    vals[usize::from(self.dims[k])] = self.minc[k] + f32::from(c) * self.scalec[k]
                });
            }
            pad.fill(0.0);
        }
    }

    /// Every code of record `rec` in code order, as `put(k, code)`, width group by width group.
    #[inline(always)]
    fn codes(&self, rec: &[u8], mut put: impl FnMut(usize, u8)) {
        for &(first, count, bits, bit) in &self.groups {
            match bits {
                8 => {
                    for (k, &x) in rec[bit / 8..bit / 8 + count].iter().enumerate() {
                        put(first + k, x);
                    }
                }
                4 if bit % 8 == 0 => {
                    for (k, &x) in rec[bit / 8..bit / 8 + count / 2].iter().enumerate() {
                        put(first + 2 * k, x & 15);
                        put(first + 2 * k + 1, x >> 4);
                    }
                    if count % 2 == 1 {
                        put(first + count - 1, rec[bit / 8 + count / 2] & 15);
                    }
                }
                _ => {
                    let mask = (1u8 << bits) - 1;
                    let w = usize::from(bits);
                    for k in 0..count {
                        let at = bit + k * w;
                        put(first + k, (rec[at / 8] >> (at % 8)) & mask);
                    }
                }
            }
        }
    }
}

/// [`CodedPlan::expand`] under `coding` (the plan built for this call).
pub fn expand_coded(
    records: &[u8],
    n: usize,
    rb: usize,
    coding: &[DimCode],
    dp: usize,
    out: &mut [f32],
) {
    CodedPlan::new(coding).expand(records, n, rb, dp, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random codings (widths in any dim order, 0-bit dims, odd group sizes), several records
    /// per call: every dim equals the spec's decode of the spec's unpacked code, bit for bit,
    /// and the padding dims are 0.
    #[test]
    fn expand_matches_the_spec_on_random_codings() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for trial in 0..300 {
            let dt = rng.gen_range(1..=80);
            let sorted = trial % 3 == 0; // widths falling with the dim: code order is dim order
            let mut bits: Vec<u8> = (0..dt)
                .map(|_| WIDTHS[rng.gen_range(0..WIDTHS.len())])
                .collect();
            if sorted {
                bits.sort_by(|a, b| b.cmp(a));
                if trial % 6 == 0 {
                    bits.iter_mut().for_each(|b| *b = (*b).max(1));
                }
            }
            let coding: Vec<DimCode> = bits
                .iter()
                .map(|&b| DimCode {
                    bits: b,
                    min: f16::from_f32(rng.gen_range(-4.0f32..4.0)),
                    scale: if b == 0 {
                        f16::ZERO
                    } else {
                        f16::from_f32(rng.gen_range(0.001f32..0.5))
                    },
                })
                .collect();
            let code_bits: usize = bits.iter().map(|&b| usize::from(b)).sum();
            let rb = code_bits.div_ceil(8) + rng.gen_range(0..3);
            let n = rng.gen_range(1..6);
            let dp = dt + rng.gen_range(0..5);
            let mut records = vec![0u8; n * rb];
            let mut want = Vec::new();
            for i in 0..n {
                let codes: Vec<u8> = coding
                    .iter()
                    .map(|c| {
                        if c.bits == 0 {
                            0
                        } else {
                            rng.gen_range(0..=c.qmax()) as u8
                        }
                    })
                    .collect();
                coded::pack_codes(&coding, &codes, &mut records[i * rb..(i + 1) * rb]);
                let back = coded::unpack_codes(&coding, &records[i * rb..]);
                assert_eq!(back, codes);
                want.push(codes);
            }
            let mut out = vec![9f32; n * dp];
            CodedPlan::new(&coding).expand(&records, n, rb, dp, &mut out);
            for (i, codes) in want.iter().enumerate() {
                let row = &out[i * dp..(i + 1) * dp];
                for j in 0..dt {
                    assert_eq!(
                        row[j].to_bits(),
                        coding[j].decode(codes[j]).to_bits(),
                        "trial {trial} row {i} dim {j}"
                    );
                }
                assert!(row[dt..].iter().all(|&x| x == 0.0));
            }
        }
    }

    #[test]
    fn expand_decodes_every_dim_as_the_spec_does() {
        let f = f16::from_f32;
        let coding = vec![
            DimCode {
                bits: 4,
                min: f(-1.0),
                scale: f(0.125),
            },
            DimCode {
                bits: 0,
                min: f(0.5),
                scale: f16::ZERO,
            },
            DimCode {
                bits: 8,
                min: f(2.0),
                scale: f(0.01),
            },
            DimCode {
                bits: 1,
                min: f(3.0),
                scale: f(1.0),
            },
        ];
        let codes = [9u8, 0, 200, 1];
        let rb = 4;
        let mut rec = vec![0u8; rb];
        coded::pack_codes(&coding, &codes, &mut rec);
        let mut out = vec![7f32; 8];
        expand_coded(&rec, 1, rb, &coding, 8, &mut out);
        for j in 0..4 {
            assert_eq!(out[j], coding[j].decode(codes[j]), "dim {j}");
        }
        assert_eq!(&out[4..], &[0.0; 4]);
    }
}
