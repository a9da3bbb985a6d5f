//! What the int8/int4 kernels of every layer share (SPEC.md section 6's codes): the limits of
//! the SIMD kernels, the scalar unpacking of codes, and the plan of the sparse value
//! accumulation (SPEC 9). A leaf like `common`: the dispatch (`quant.rs`) and the AVX2 and
//! AVX-512 layers import from here, and it imports none of them.

use mosaickv_spec::layout::read_code;
use mosaickv_spec::ValueDtype;

/// Largest `r` the SIMD kernels unpack into their local code buffer; larger records take the
/// portable kernel.
pub const QUANT_SIMD_MAX_R: usize = 512;

/// Slack after the unpacked codes so that a kernel may load a whole register past the last one.
pub(crate) const CODE_SLACK: usize = 64;

/// The `r` codes of a quantized record's code bytes `v`, one byte each, into `out[..r]`.
pub(crate) fn unpack_codes_scalar(dtype: ValueDtype, v: &[u8], r: usize, out: &mut [u8]) {
    for (i, o) in out[..r].iter_mut().enumerate() {
        *o = read_code(dtype, v, i);
    }
}

/// Word `w` of a record's group bitmap (little-endian, groups `32 w..32 w + 32`), with the bits
/// past the last of its `groups` groups cleared: what the kernels that walk a record's kept
/// groups read, so that a record breaking the layout's invariants cannot make them write past
/// their accumulators.
#[inline]
pub(crate) fn group_word(rec: &[u8], w: usize, groups: usize) -> u32 {
    let bits = u32::from_le_bytes([rec[4 * w], rec[4 * w + 1], rec[4 * w + 2], rec[4 * w + 3]]);
    if groups < 32 * (w + 1) {
        bits & ((1u64 << groups.saturating_sub(32 * w)) - 1) as u32
    } else {
        bits
    }
}

/// Most query heads per KV head [`Path::sparse_accumulate_q`] takes.
pub const SPARSE_MAX_HEADS: usize = 16;

/// Most registers a kept group's slot spans (`g * heads <= lanes * SPARSE_MAX_CHUNKS`).
pub const SPARSE_MAX_CHUNKS: usize = 8;

/// The head-minor accumulator of the sparse value accumulation for one group size `g` and
/// `heads` query heads: one slot of whole registers of `lanes` floats (16 on AVX-512, 8 on
/// AVX2) per group of `g` dims, lane `e < g * heads` of a slot being dim `e / heads` of the
/// group and head `e % heads`; the lanes past that stay 0. Per register `c` of a slot: the
/// first decoded value its lanes read (`vbase`), each lane's value offset from it (`vidx`, <
/// `lanes`) and head (`hidx`), the live lanes (`live`); entries past `lanes` are unused.
#[derive(Clone, Debug)]
pub struct SparsePlan {
    pub g: usize,
    pub heads: usize,
    pub lanes: usize,
    pub chunks: usize,
    pub vbase: [usize; SPARSE_MAX_CHUNKS],
    pub vidx: [[i32; 16]; SPARSE_MAX_CHUNKS],
    pub hidx: [[i32; 16]; SPARSE_MAX_CHUNKS],
    pub live: [u16; SPARSE_MAX_CHUNKS],
}

impl SparsePlan {
    /// The plan for group size `g`, `heads` heads and registers of `lanes` floats (8 or 16),
    /// or `None` past the kernels' limits.
    pub fn new(g: usize, heads: usize, lanes: usize) -> Option<Self> {
        let span = g * heads;
        if !(1..=SPARSE_MAX_HEADS).contains(&heads)
            || g == 0
            || !(lanes == 8 || lanes == 16)
            || span > lanes * SPARSE_MAX_CHUNKS
        {
            return None;
        }
        let chunks = span.div_ceil(lanes);
        let mut plan = SparsePlan {
            g,
            heads,
            lanes,
            chunks,
            vbase: [0; SPARSE_MAX_CHUNKS],
            vidx: [[0; 16]; SPARSE_MAX_CHUNKS],
            hidx: [[0; 16]; SPARSE_MAX_CHUNKS],
            live: [0; SPARSE_MAX_CHUNKS],
        };
        for c in 0..chunks {
            plan.vbase[c] = lanes * c / heads;
            for l in 0..lanes {
                let e = (lanes * c + l).min(span - 1);
                plan.vidx[c][l] = (e / heads - plan.vbase[c]) as i32;
                plan.hidx[c][l] = (e % heads) as i32;
            }
            let live = (span - lanes * c).min(lanes);
            plan.live[c] = ((1u32 << live) - 1) as u16;
        }
        Some(plan)
    }

    /// Floats of one group's slot.
    #[inline]
    pub fn stride(&self) -> usize {
        self.lanes * self.chunks
    }

    /// Floats of the accumulator for `kept_dims` dims.
    #[inline]
    pub fn len(&self, kept_dims: usize) -> usize {
        kept_dims.div_ceil(self.g) * self.stride()
    }

    /// Where dim `j`, head `h` lives in the accumulator.
    #[inline]
    pub fn at(&self, j: usize, h: usize) -> usize {
        (j / self.g) * self.stride() + (j % self.g) * self.heads + h
    }

    /// `acc_t *= corr[head]` lane by lane, when some factor is not 1: per element the
    /// multiply the dense path's rescale makes (which skips heads whose factor is 1, and `x *
    /// 1 = x`); dead lanes are 0 and stay 0.
    pub fn rescale(&self, acc_t: &mut [f32], corr: &[f32]) {
        if corr[..self.heads].iter().all(|&c| c == 1.0) {
            return;
        }
        let mut pattern = [[1f32; 16]; SPARSE_MAX_CHUNKS];
        for (c, pat) in pattern.iter_mut().enumerate().take(self.chunks) {
            for (l, x) in pat.iter_mut().enumerate() {
                *x = corr[self.hidx[c][l] as usize];
            }
        }
        for slot in acc_t.chunks_exact_mut(self.stride()) {
            for (reg, pat) in slot.chunks_exact_mut(self.lanes).zip(&pattern) {
                for (x, &c) in reg.iter_mut().zip(pat) {
                    *x *= c;
                }
            }
        }
    }
}
