//! SPEC.md section 12, TurboQuant: vLLM's `--kv-cache-dtype turboquant_<preset>` KV cache, the
//! reference's `TurboQuantCache` (its module doc has the arithmetic) with the same slots byte
//! for byte and the same attention output bit for bit, at a fraction of its cost:
//!
//! - each slot is decoded once per KV head for all of the head's query heads (the reference
//!   decodes it once per query head), into reused buffers;
//! - the key logits of eight tokens at a time: their decoded keys stored transposed
//!   (`[dim][token]`), so each of the eight lanes runs one token's dot product over the dims
//!   in ascending order, with the multiply and the add rounded apart, as the reference's
//!   `sum` of products does (and its norm-correction sums the same way);
//! - the online softmax and the value accumulation token by token in the reference's order;
//! - KV heads on rayon threads, prompt slots encoded in parallel.
//!
//! Every f32 operation is the reference's, in its order, so `conformance/tests/turboquant.rs`
//! asserts equal bytes and equal outputs, as `tests/kvq.rs` does for kvq8 / kvq4.

use crate::baselines::hadamard_rotate;
use crate::simd::ggml::f16_at;
use crate::simd::Path;
use half::f16;
use mosaickv_spec::rules::f16_storable;
use mosaickv_spec::turboquant::{lloyd_max_centroids, midpoints, TurboQuantPreset};
use mosaickv_spec::{validate, KvCache, KvShape, MemoryReport, MosaicError, Result};
use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2, Axis};
use rayon::prelude::*;
use std::borrow::Cow;
use std::sync::OnceLock;

/// Tokens whose key logits are computed together (one f32 lane each).
const LANES: usize = 8;

/// vLLM's TurboQuant cache of one layer (SPEC.md section 12), optimized.
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
    /// The kernel path, detected once (as the other optimized baselines do).
    path: Path,
}

/// FP8 e4m3 (`float8e4nv`) of an f32: round to nearest even, saturated at +-448 (the
/// reference's `fp8_e4m3`, the same codes).
pub fn fp8_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a >= 448.0 {
        return sign | 0x7e;
    }
    if a < f32::powi(2.0, -6) {
        // subnormals: steps of 2^-9
        return sign | (a / f32::powi(2.0, -9)).round_ties_even() as u8;
    }
    let e = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
    let q = (a / f32::powi(2.0, e - 3)).round_ties_even() as i32; // 8..=16
    let code = ((e + 7) << 3) + (q - 8);
    sign | code.min(0x7e) as u8
}

/// The f32 values of the 256 FP8 e4m3 codes (NaN for the two NaN codes).
pub fn fp8_e4m3_table() -> &'static [f32; 256] {
    static TABLE: OnceLock<[f32; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        std::array::from_fn(|c| {
            let code = c as u8;
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
        })
    })
}

/// Packs indices of `bits` bits little-endian (element `i` at bit `bits * i`) onto `out`.
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

/// The first `out.len()` indices of `bits` bits packed in `bytes`.
fn unpack(bytes: &[u8], bits: usize, out: &mut [u8]) {
    if bits == 4 {
        for (pair, &b) in out.chunks_mut(2).zip(bytes) {
            pair[0] = b & 0x0f;
            if let Some(hi) = pair.get_mut(1) {
                *hi = b >> 4;
            }
        }
        return;
    }
    let mask = (1u16 << bits) - 1;
    for (i, o) in out.iter_mut().enumerate() {
        let bit = i * bits;
        let lo = bytes[bit / 8] as u16;
        let hi = bytes.get(bit / 8 + 1).copied().unwrap_or(0) as u16;
        *o = (((lo | hi << 8) >> (bit % 8)) & mask) as u8;
    }
}

/// `NonFinite` for a stored f16 that would overflow: `what` names a prompt's rows (`plural`)
/// or one token's, at the flat index of its head's row.
fn unstorable(
    plural: bool,
    (many, one): (&'static str, &'static str),
    index: usize,
) -> MosaicError {
    MosaicError::NonFinite {
        what: if plural { many } else { one },
        index,
    }
}

/// One token's encoding buffers (the normalized, rotated key and the indices of a row),
/// reused across the tokens of a prompt.
struct EncodeBufs {
    y: Vec<f32>,
    idx: Vec<u8>,
}

impl EncodeBufs {
    fn new(d: usize) -> Self {
        Self {
            y: vec![0.0; d],
            idx: vec![0; d],
        }
    }
}

/// One KV head's attention state for its query heads: the running maximum, sum and
/// unnormalized output of each (the reference's `m`, `l`, `o`), and the decode buffers.
struct HeadWork {
    m: Vec<f32>,
    l: Vec<f32>,
    o: Vec<f32>,
    /// Decoded keys of up to [`LANES`] tokens, `[dim][lane]`.
    kt: Vec<[f32; LANES]>,
    /// Logits `[query head][lane]`.
    z: Vec<[f32; LANES]>,
    idx: Vec<u8>,
    vals: Vec<f32>,
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
            path: Path::detect(),
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

    /// One token's slots `[kv_heads][slot]` from its key and value rows `[kv_heads * D]`,
    /// appended to `out`: the reference's `encode`, operation for operation.
    #[allow(clippy::neg_cmp_op_on_partial_ord)] // `!(s > 1e-8)` catches NaN too, as vLLM's max()
    fn encode(
        &self,
        key: &[f32],
        value: &[f32],
        plural: bool,
        bufs: &mut EncodeBufs,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let (d, p) = (self.shape.head_dim, self.preset);
        let EncodeBufs { y, idx } = bufs;
        for (h, (k, v)) in key.chunks(d).zip(value.chunks(d)).enumerate() {
            let start = out.len();
            if p.key_bits() == 8 {
                out.extend(k.iter().map(|&x| fp8_e4m3(x)));
            } else {
                let norm = k.iter().map(|x| x * x).sum::<f32>().sqrt();
                for (yj, &x) in y.iter_mut().zip(k) {
                    *yj = x / (norm + 1e-8);
                }
                hadamard_rotate(y, d);
                let top = self.centroids.len() - 1;
                for (i, &yj) in idx.iter_mut().zip(y.iter()) {
                    *i = self.midpoints.iter().filter(|&&m| yj >= m).count().min(top) as u8;
                }
                pack(idx, p.key_bits(), out);
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
                out.extend(f16::from_f32(norm).to_le_bytes());
            }
            let levels = (1u32 << p.value_bits()) - 1;
            let lo = v.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut s = (hi - lo) / levels as f32;
            if !(s > 1e-8) {
                s = 1e-8;
            }
            for (i, &x) in idx.iter_mut().zip(v) {
                *i = (((x - lo) / s + 0.5) as u32).min(levels) as u8;
            }
            pack(idx, p.value_bits(), out);
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
            out.extend(f16::from_f32(s).to_le_bytes());
            out.extend(f16::from_f32(lo).to_le_bytes());
            out.resize(start + self.slot(), 0);
        }
        Ok(())
    }

    /// [`Self::attend_head_body`], compiled for AVX2 where the CPU path has it (wider lanes
    /// for the same operations: Rust never fuses a multiply and an add, so the bits are the
    /// same on every path).
    fn attend_head(&self, qs: &[f32], h: usize, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if self.path != Path::Portable {
            // SAFETY: a SIMD path was detected, so the CPU has AVX2.
            unsafe { self.attend_head_avx2(qs, h, out) };
            return;
        }
        self.attend_head_body(qs, h, out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn attend_head_avx2(&self, qs: &[f32], h: usize, out: &mut [f32]) {
        self.attend_head_body(qs, h, out)
    }

    /// KV head `h`'s query rows `qs` (`[g][D]`, Hadamard-rotated unless `k8v4`) attended over
    /// every token: `out` `[g][D]`.
    #[inline(always)]
    fn attend_head_body(&self, qs: &[f32], h: usize, out: &mut [f32]) {
        let (d, p, slot) = (self.shape.head_dim, self.preset, self.slot());
        let g = qs.len() / d;
        let (kb, vb) = (p.key_bytes(d), p.value_bytes(d));
        let scale = 1.0f32 / (d as f32).sqrt();
        let mut w = HeadWork {
            m: vec![f32::NEG_INFINITY; g],
            l: vec![0.0; g],
            o: vec![0.0; g * d],
            kt: vec![[0.0; LANES]; d],
            z: vec![[0.0; LANES]; g],
            idx: vec![0; d],
            vals: vec![0.0; d],
        };
        let fp8 = fp8_e4m3_table();
        let slot_of = |t: usize| {
            let s0 = (t * self.shape.kv_heads + h) * slot;
            &self.slots[s0..s0 + slot]
        };
        let mut t0 = 0;
        while t0 < self.tokens {
            let n = (self.tokens - t0).min(LANES);
            // Keys of tokens t0..t0 + n, transposed; per lane the reference's decode.
            let mut norm = [0f32; LANES];
            for lane in 0..n {
                let bytes = slot_of(t0 + lane);
                if p.key_bits() == 8 {
                    for (j, &c) in bytes[..d].iter().enumerate() {
                        w.kt[j][lane] = fp8[c as usize];
                    }
                } else {
                    unpack(&bytes[..kb - 2], p.key_bits(), &mut w.idx);
                    for (j, &i) in w.idx.iter().enumerate() {
                        w.kt[j][lane] = self.centroids[i as usize];
                    }
                    norm[lane] = f16_at(bytes, kb - 2);
                }
            }
            if p.key_bits() != 8 && p.norm_correction() {
                // per lane: inv = 1 / sqrt(sum_j c_j^2 + 1e-16), the sum over ascending j
                let mut ss = [-0.0f32; LANES];
                for row in &w.kt {
                    for (s, &c) in ss.iter_mut().zip(row) {
                        *s += c * c;
                    }
                }
                let inv: [f32; LANES] = std::array::from_fn(|l| 1.0 / (ss[l] + 1e-16).sqrt());
                for row in w.kt.iter_mut() {
                    for (c, &f) in row.iter_mut().zip(&inv) {
                        *c *= f;
                    }
                }
            }
            // Logits: per lane sum_j q_j c_j over ascending j (products rounded, then added).
            for (hq, zq) in w.z.iter_mut().enumerate() {
                let q = &qs[hq * d..(hq + 1) * d];
                let mut acc = [-0.0f32; LANES];
                for (&a, row) in q.iter().zip(&w.kt) {
                    for (s, &c) in acc.iter_mut().zip(row) {
                        *s += a * c;
                    }
                }
                for lane in 0..LANES {
                    zq[lane] = if p.key_bits() == 8 {
                        acc[lane] * scale
                    } else {
                        norm[lane] * acc[lane] * scale
                    };
                }
            }
            // The online softmax and the values, token by token.
            for lane in 0..n {
                let vals = &slot_of(t0 + lane)[kb..kb + vb];
                let (sv, lo) = (f16_at(vals, vb - 4), f16_at(vals, vb - 2));
                unpack(&vals[..vb - 4], p.value_bits(), &mut w.idx);
                for (x, &i) in w.vals.iter_mut().zip(&w.idx) {
                    *x = i as f32 * sv + lo;
                }
                for hq in 0..g {
                    let z = w.z[hq][lane];
                    let (m, o) = (&mut w.m[hq], &mut w.o[hq * d..(hq + 1) * d]);
                    let (mut ms, mut vs) = (1.0f32, 1.0f32);
                    if z > *m {
                        ms = (*m - z).exp();
                        *m = z;
                        o.iter_mut().for_each(|x| *x *= ms);
                    } else {
                        vs = (z - *m).exp();
                    }
                    for (x, &v) in o.iter_mut().zip(&w.vals) {
                        *x += v * vs;
                    }
                    w.l[hq] = w.l[hq] * ms + vs;
                }
            }
            t0 += n;
        }
        for hq in 0..g {
            let inv = if w.l[hq] == 0.0 { 0.0 } else { 1.0 / w.l[hq] };
            for (y, &x) in out[hq * d..(hq + 1) * d]
                .iter_mut()
                .zip(&w.o[hq * d..(hq + 1) * d])
            {
                *y = x * inv;
            }
        }
    }
}

/// The reference's prompt checks: not yet prefilled, the shapes, every value an f16 can hold.
fn check_prompt(
    cache: &TurboQuantCache,
    keys: &ArrayView3<f32>,
    values: &ArrayView3<f32>,
) -> Result<()> {
    if cache.tokens > 0 {
        return Err(MosaicError::AlreadyPrefilled(cache.tokens));
    }
    validate::prompt_kv(&cache.shape, keys, values)?;
    f16_storable("keys (beyond f16 range)", keys.iter())?;
    f16_storable("values (beyond f16 range)", values.iter())
}

impl KvCache for TurboQuantCache {
    fn shape(&self) -> KvShape {
        self.shape
    }
    fn len(&self) -> usize {
        self.tokens
    }
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<()> {
        check_prompt(self, &keys, &values)?;
        let n = keys.shape()[0];
        let per = self.shape.kv_heads * self.slot();
        let row = self.shape.kv_heads * self.shape.head_dim;
        let this = &*self;
        // Tokens encoded in parallel; the first failing token (in token order) reported, as
        // the reference reports it.
        let d = self.shape.head_dim;
        let encoded: Vec<Result<Vec<u8>>> = (0..n)
            .into_par_iter()
            .map_init(
                || EncodeBufs::new(d),
                |bufs, t| {
                    // a token's rows `[kv_heads * D]`, copied only when not contiguous
                    let (k, v) = (keys.index_axis(Axis(0), t), values.index_axis(Axis(0), t));
                    let (k, v) = (
                        k.as_slice()
                            .map_or_else(|| k.iter().copied().collect(), Cow::Borrowed),
                        v.as_slice()
                            .map_or_else(|| v.iter().copied().collect(), Cow::Borrowed),
                    );
                    let mut out = Vec::with_capacity(per);
                    this.encode(&k, &v, true, bufs, &mut out)
                        .map_err(|e| match e {
                            MosaicError::NonFinite { what, index } => MosaicError::NonFinite {
                                what,
                                index: t * row + index,
                            },
                            other => other,
                        })?;
                    Ok(out)
                },
            )
            .collect();
        let mut slots = Vec::with_capacity(n * per);
        for e in encoded {
            slots.extend(e?);
        }
        self.slots = slots;
        self.tokens = n;
        Ok(())
    }
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<()> {
        validate::token_kv(&self.shape, &key, &value)?;
        f16_storable("key (beyond f16 range)", key.iter())?;
        f16_storable("value (beyond f16 range)", value.iter())?;
        let k: Vec<f32> = key.iter().copied().collect();
        let v: Vec<f32> = value.iter().copied().collect();
        let mut out = Vec::with_capacity(self.shape.kv_heads * self.slot());
        let mut bufs = EncodeBufs::new(self.shape.head_dim);
        self.encode(&k, &v, false, &mut bufs, &mut out)?;
        self.slots.extend(out);
        self.tokens += 1;
        Ok(())
    }
    fn attend(&mut self, queries: ArrayView2<f32>, mut out: ArrayViewMut2<f32>) -> Result<()> {
        validate::queries(&self.shape, &queries, out.shape())?;
        if self.tokens == 0 {
            return Err(MosaicError::EmptyCache);
        }
        let (d, g) = (self.shape.head_dim, self.shape.group());
        // Query rows in head order, rotated as the keys are (not for `k8v4`).
        let mut q: Vec<f32> = queries.iter().copied().collect();
        if self.preset.key_bits() != 8 {
            q.chunks_mut(d).for_each(|row| hadamard_rotate(row, d));
        }
        let mut o = vec![0f32; q.len()];
        let this = &*self;
        o.par_chunks_mut(g * d)
            .zip(q.par_chunks(g * d))
            .enumerate()
            .for_each(|(h, (oh, qh))| this.attend_head(qh, h, oh));
        for (qh, row) in o.chunks(d).enumerate() {
            for (i, &x) in row.iter().enumerate() {
                out[[qh, i]] = x;
            }
        }
        Ok(())
    }
    /// vLLM's slots as `values` (every byte of them: indices, norms, scales, minimums,
    /// padding), the key codebook (f32) as `block_meta`, as the reference counts them. The
    /// attention's decode buffers (about `(8 g + 8 + 4) D` floats per KV head, freed after
    /// each step) are scratch.
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
