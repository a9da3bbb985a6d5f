//! SPEC.md section 12, TurboQuant: vLLM's `--kv-cache-dtype turboquant_<preset>` KV cache
//! (vLLM PR 38479, its rotation as simplified by PR 40194), one slot per token and KV head in
//! vLLM's byte layout, with f32 arithmetic as vLLM's Triton kernels do it.
//!
//! Keys (`4bit_nc`, `k3v4_nc`, `3bit_nc`): `n = ||k||` (f32), `x = k / (n + 1e-8)`, `y = H x`
//! (the normalized Sylvester Hadamard of the whole head, [`hadamard_rotate`]), each `y_j`
//! replaced by the index of its Lloyd-Max centroid of N(0, 1/D) (the number of decision
//! midpoints at or below it; `mosaickv_spec::turboquant::lloyd_max_centroids`), indices packed
//! little-endian (4-bit: element `2j` in the low nibble of byte `j`; 3-bit: element `i` at bit
//! `3i`), then `n` as f16. Keys (`k8v4`): each element as FP8 e4m3 (round to nearest even,
//! saturated at 448), no rotation. Values: per token and head, `lo = min v`, `s = (max v - lo) /
//! (2^b - 1)` (at least 1e-8), `q = min(2^b - 1, trunc((v - lo) / s + 0.5))`, packed as the
//! keys, then `s` and `lo` as f16; dequantized `q * s + lo` with the stored f16 `s`, `lo`.
//!
//! Attention for a query `q` (head group as everywhere): `q' = H q` (not for `k8v4`); per
//! token the centroid vector `c` of its key, with norm correction (`_nc`) `c * (1 /
//! sqrt(sum c^2 + 1e-16))`, the logit `n * sum_j q'_j c_j / sqrt(D)` (`k8v4`: `sum_j q_j k_j /
//! sqrt(D)`); an online softmax over the tokens in order in f32 and values dequantized to f32,
//! as [`crate::baselines::KvqCache`]'s. Every token is attended; the output is not rotated.

use crate::baselines::{hadamard_rotate, validate_attend, validate_prompt, validate_token};
use half::f16;
use mosaickv_spec::turboquant::{lloyd_max_centroids, midpoints, TurboQuantPreset};
use mosaickv_spec::{KvCache, KvShape, MemoryReport, MosaicError, Result};
use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2};

/// vLLM's TurboQuant cache of one layer (SPEC.md section 12).
#[derive(Debug, Clone)]
pub struct TurboQuantCache {
    shape: KvShape,
    preset: TurboQuantPreset,
    /// The key codebook, ascending (empty for `k8v4`).
    centroids: Vec<f32>,
    midpoints: Vec<f32>,
    tokens: usize,
    /// Slots `[tokens][kv_heads][slot_bytes]`: key bytes, value bytes, padding to even.
    slots: Vec<u8>,
}

/// FP8 e4m3 (`float8e4nv`) of an f32: round to nearest even, saturated at +-448.
pub fn fp8_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a >= 448.0 {
        return sign | 0x7e;
    }
    let min_normal = f32::powi(2.0, -6);
    if a < min_normal {
        // subnormals: steps of 2^-9; 8 steps is the smallest normal, code 0x08
        return sign | (a / f32::powi(2.0, -9)).round_ties_even() as u8;
    }
    let e = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
    let q = (a / f32::powi(2.0, e - 3)).round_ties_even() as i32; // 8..=16
    let code = ((e + 7) << 3) + (q - 8);
    sign | code.min(0x7e) as u8
}

/// The f32 value of an FP8 e4m3 code.
pub fn fp8_e4m3_value(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((code >> 3) & 0x0f) as i32, (code & 0x07) as f32);
    if e == 0x0f && code & 0x07 == 0x07 {
        return f32::NAN;
    }
    sign * if e == 0 {
        m * f32::powi(2.0, -9)
    } else {
        (1.0 + m / 8.0) * f32::powi(2.0, e - 7)
    }
}

/// Packs indices of `bits` bits little-endian (element `i` at bit `bits * i`).
fn pack(idx: &[u8], bits: usize, out: &mut Vec<u8>) {
    let start = out.len();
    out.resize(start + (idx.len() * bits).div_ceil(8), 0);
    for (i, &q) in idx.iter().enumerate() {
        let bit = i * bits;
        let v = (q as u16) << (bit % 8);
        out[start + bit / 8] |= v as u8;
        if bit % 8 + bits > 8 {
            out[start + bit / 8 + 1] |= (v >> 8) as u8;
        }
    }
}

fn unpack(bytes: &[u8], bits: usize, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| {
            let bit = i * bits;
            let lo = bytes[bit / 8] as u16;
            let hi = bytes.get(bit / 8 + 1).copied().unwrap_or(0) as u16;
            (((lo | hi << 8) >> (bit % 8)) & ((1 << bits) - 1)) as u8
        })
        .collect()
}

/// `NonFinite` for a stored f16 that would overflow, named for a prompt (`plural`) or one
/// token, at the flat index of its head's row.
fn unstorable(
    plural: bool,
    (many, one): (&'static str, &'static str),
    index: usize,
) -> MosaicError {
    let what = if plural { many } else { one };
    MosaicError::NonFinite { what, index }
}

fn f16_bytes(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

fn f16_at(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

impl TurboQuantCache {
    /// An empty cache; `head_dim` as the preset allows (vLLM's limits).
    pub fn new(shape: KvShape, preset: TurboQuantPreset) -> Result<Self> {
        let shape = KvShape::new(shape.kv_heads, shape.q_heads, shape.head_dim)?;
        preset.check_head_dim(shape.head_dim)?;
        let centroids = if preset.key_bits() == 8 {
            Vec::new()
        } else {
            lloyd_max_centroids(shape.head_dim, preset.key_bits())
        };
        let midpoints = midpoints(&centroids);
        Ok(Self {
            shape,
            preset,
            centroids,
            midpoints,
            tokens: 0,
            slots: Vec::new(),
        })
    }

    pub fn preset(&self) -> TurboQuantPreset {
        self.preset
    }

    /// The stored slots, `[tokens][kv_heads][slot bytes]` (vLLM's layout).
    pub fn slots(&self) -> &[u8] {
        &self.slots
    }

    pub fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        let s = self.shape;
        self.shape = KvShape::new(s.kv_heads, q_heads, s.head_dim)?;
        Ok(())
    }

    fn slot(&self) -> usize {
        self.preset.slot_bytes(self.shape.head_dim)
    }

    /// One token's slots `[kv_heads][slot]` from its key and value rows `[kv_heads * D]`;
    /// `NonFinite` when a stored f16 (a key norm, a value scale or minimum) would overflow.
    fn encode(&self, key: &[f32], value: &[f32], plural: bool) -> Result<Vec<u8>> {
        let (d, p) = (self.shape.head_dim, self.preset);
        let mut out = Vec::with_capacity(self.shape.kv_heads * self.slot());
        for (h, (k, v)) in key.chunks(d).zip(value.chunks(d)).enumerate() {
            let start = out.len();
            if p.key_bits() == 8 {
                out.extend(k.iter().map(|&x| fp8_e4m3(x)));
            } else {
                let norm = k.iter().map(|x| x * x).sum::<f32>().sqrt();
                let mut y: Vec<f32> = k.iter().map(|x| x / (norm + 1e-8)).collect();
                hadamard_rotate(&mut y, d);
                let idx: Vec<u8> = y
                    .iter()
                    .map(|&y| {
                        let below = self.midpoints.iter().filter(|&&m| y >= m).count();
                        below.min(self.centroids.len() - 1) as u8
                    })
                    .collect();
                pack(&idx, p.key_bits(), &mut out);
                if f16::from_f32(norm).is_infinite() {
                    return Err(unstorable(
                        plural,
                        (
                            "keys (norm beyond f16 range)",
                            "key (norm beyond f16 range)",
                        ),
                        h * d,
                    ));
                }
                out.extend(f16_bytes(norm));
            }
            let levels = (1u32 << p.value_bits()) - 1;
            let lo = v.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut s = (hi - lo) / levels as f32;
            if !(s > 1e-8) {
                s = 1e-8;
            }
            let idx: Vec<u8> = v
                .iter()
                .map(|&x| (((x - lo) / s + 0.5) as u32).min(levels) as u8)
                .collect();
            pack(&idx, p.value_bits(), &mut out);
            if f16::from_f32(s).is_infinite() || f16::from_f32(lo).is_infinite() {
                return Err(unstorable(
                    plural,
                    (
                        "values (scale beyond f16 range)",
                        "value (scale beyond f16 range)",
                    ),
                    h * d,
                ));
            }
            out.extend(f16_bytes(s));
            out.extend(f16_bytes(lo));
            out.resize(start + self.slot(), 0);
        }
        Ok(out)
    }

    /// The f32 attention of query row `q` over KV head `h`.
    fn attend_row(&self, q: &[f32], h: usize) -> Vec<f32> {
        let (d, p, slot) = (self.shape.head_dim, self.preset, self.slot());
        let kb = p.key_bytes(d);
        let mut q = q.to_vec();
        if p.key_bits() != 8 {
            hadamard_rotate(&mut q, d);
        }
        let scale = 1.0f32 / (d as f32).sqrt();
        let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
        let mut o = vec![0.0f32; d];
        for t in 0..self.tokens {
            let s0 = (t * self.shape.kv_heads + h) * slot;
            let bytes = &self.slots[s0..s0 + slot];
            let z = if p.key_bits() == 8 {
                q.iter()
                    .zip(&bytes[..d])
                    .map(|(a, &c)| a * fp8_e4m3_value(c))
                    .sum::<f32>()
                    * scale
            } else {
                let idx = unpack(&bytes[..kb - 2], p.key_bits(), d);
                let mut c: Vec<f32> = idx.iter().map(|&i| self.centroids[i as usize]).collect();
                if p.norm_correction() {
                    let inv = 1.0 / (c.iter().map(|x| x * x).sum::<f32>() + 1e-16).sqrt();
                    c.iter_mut().for_each(|x| *x *= inv);
                }
                let norm = f16_at(&bytes[kb - 2..kb]);
                norm * q.iter().zip(&c).map(|(a, b)| a * b).sum::<f32>() * scale
            };
            let (mut ms, mut vs) = (1.0f32, 1.0f32);
            if z > m {
                ms = (m - z).exp();
                m = z;
                o.iter_mut().for_each(|x| *x *= ms);
            } else {
                vs = (z - m).exp();
            }
            let vb = p.value_bytes(d);
            let vals = &bytes[kb..kb + vb];
            let (sv, lo) = (f16_at(&vals[vb - 4..vb - 2]), f16_at(&vals[vb - 2..]));
            for (x, i) in o.iter_mut().zip(unpack(&vals[..vb - 4], p.value_bits(), d)) {
                *x += (i as f32 * sv + lo) * vs;
            }
            l = l * ms + vs;
        }
        let inv = if l == 0.0 { 0.0 } else { 1.0 / l };
        o.iter().map(|x| x * inv).collect()
    }
}

impl KvCache for TurboQuantCache {
    fn shape(&self) -> KvShape {
        self.shape
    }
    fn len(&self) -> usize {
        self.tokens
    }
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<()> {
        validate_prompt(&self.shape, &keys, &values, self.tokens)?;
        let n = keys.shape()[0];
        let mut slots = Vec::with_capacity(n * self.shape.kv_heads * self.slot());
        for t in 0..n {
            let k: Vec<f32> = keys
                .index_axis(ndarray::Axis(0), t)
                .iter()
                .copied()
                .collect();
            let v: Vec<f32> = values
                .index_axis(ndarray::Axis(0), t)
                .iter()
                .copied()
                .collect();
            slots.extend(self.encode(&k, &v, true).map_err(|e| match e {
                MosaicError::NonFinite { what, index } => MosaicError::NonFinite {
                    what,
                    index: t * self.shape.kv_heads * self.shape.head_dim + index,
                },
                other => other,
            })?);
        }
        self.slots = slots;
        self.tokens = n;
        Ok(())
    }
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<()> {
        validate_token(&self.shape, &key, &value)?;
        let k: Vec<f32> = key.iter().copied().collect();
        let v: Vec<f32> = value.iter().copied().collect();
        let slots = self.encode(&k, &v, false)?;
        self.slots.extend(slots);
        self.tokens += 1;
        Ok(())
    }
    fn attend(&mut self, queries: ArrayView2<f32>, mut out: ArrayViewMut2<f32>) -> Result<()> {
        validate_attend(&self.shape, &queries, out.shape(), self.tokens)?;
        let g = self.shape.group();
        for qh in 0..self.shape.q_heads {
            let q: Vec<f32> = queries.row(qh).to_vec();
            for (i, x) in self.attend_row(&q, qh / g).into_iter().enumerate() {
                out[[qh, i]] = x;
            }
        }
        Ok(())
    }
    /// vLLM's slots as `values` (every byte of them: indices, norms, scales, minimums,
    /// padding), the key codebook (f32) as `block_meta`.
    fn memory(&self) -> MemoryReport {
        MemoryReport {
            tokens: self.tokens,
            values: self.slots.len(),
            block_meta: 4 * self.centroids.len(),
            ..MemoryReport::default()
        }
    }
    fn set_q_heads(&mut self, q_heads: usize) -> Result<()> {
        TurboQuantCache::set_q_heads(self, q_heads)
    }
    fn attended(&self, _queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>> {
        Ok(None)
    }
    /// TurboQuant has no file format here (vLLM's slots live in its paged cache).
    fn save(&mut self, _path: &std::path::Path) -> Result<()> {
        Err(MosaicError::InvalidConfig(
            "turboquant has no file format".into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_e4m3_round_trips_its_codes_and_rounds_to_nearest_even() {
        for code in 0u8..=0xfe {
            if code & 0x7f == 0x7f {
                continue;
            }
            let x = fp8_e4m3_value(code);
            let back = fp8_e4m3(x);
            // +0 and -0 both encode
            assert!(
                back == code || (x == 0.0 && back & 0x7f == 0),
                "{code:#x} {x} {back:#x}"
            );
        }
        assert_eq!(fp8_e4m3_value(fp8_e4m3(1000.0)), 448.0);
        assert_eq!(fp8_e4m3_value(fp8_e4m3(-1000.0)), -448.0);
        // 1.0625 is halfway between 1.0 and 1.125: to even (1.0)
        assert_eq!(fp8_e4m3_value(fp8_e4m3(1.0625)), 1.0);
        assert_eq!(fp8_e4m3_value(fp8_e4m3(1.1875)), 1.25);
    }

    #[test]
    fn packing_is_vllms_little_endian_bitstream() {
        let idx: Vec<u8> = (0..16).map(|i| (i * 5 % 8) as u8).collect();
        let mut b = Vec::new();
        pack(&idx, 3, &mut b);
        assert_eq!(b.len(), 6);
        assert_eq!(unpack(&b, 3, 16), idx);
        // element i at bit 3i: the first byte holds elements 0, 1 and the low 2 bits of 2
        assert_eq!(b[0], idx[0] | idx[1] << 3 | (idx[2] & 3) << 6);
        let mut b4 = Vec::new();
        pack(&[1, 2, 3, 4], 4, &mut b4);
        assert_eq!(b4, vec![0x21, 0x43]);
    }

    #[test]
    fn slots_have_vllms_size_and_attention_tracks_exact_attention() {
        let shape = KvShape::new(2, 4, 128).unwrap();
        let (k, v) = crate::synthetic::structured_kv(300, 2, 128, 7);
        let q = crate::synthetic::queries(4, 128, &k, 3);
        let mut exact = ndarray::Array2::zeros((4, 128));
        let mut full = crate::FullCache::new(shape);
        full.prefill(k.view(), v.view()).unwrap();
        full.attend(q.view(), exact.view_mut()).unwrap();
        let mut errs = Vec::new();
        for p in TurboQuantPreset::ALL {
            let mut c = TurboQuantCache::new(shape, p).unwrap();
            c.prefill(k.view(), v.view()).unwrap();
            assert_eq!(c.memory().values, 300 * 2 * p.slot_bytes(128));
            let mut o = ndarray::Array2::zeros((4, 128));
            c.attend(q.view(), o.view_mut()).unwrap();
            let e = mosaickv_spec::metrics::rel_l2(o.view(), exact.view());
            println!("{p:?}: rel L2 {e:.4}");
            errs.push((p, e));
            assert!(e < 0.5, "{p:?}: {e}");
        }
        // more bits, less error: k8v4 and 4bit_nc below 3bit_nc
        let err = |p| errs.iter().find(|x| x.0 == p).unwrap().1;
        assert!(
            err(TurboQuantPreset::Bit4Nc) < err(TurboQuantPreset::Bit3Nc),
            "{errs:?}"
        );
    }
}
