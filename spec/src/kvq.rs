//! The ggml block contract of the kvq8 / kvq4 baselines (SPEC.md section 12): llama.cpp's
//! `q8_0` and `q4_0` KV-cache formats, written once for every backend.
//!
//! What is shared is data: the block length, the byte layout of a block (as `#[repr(C)]`
//! structs whose sizes are checked at compile time against ggml's `block_q8_0` /
//! `block_q4_0`), the method names and the storability rule of a block's scale. The
//! quantization arithmetic stays in each backend and is compared bit for bit by the
//! conformance suite (`conformance/tests/kvq.rs`).

use crate::error::{MosaicError, Result};

/// ggml's block length for `q8_0` and `q4_0` (`QK8_0` / `QK4_0`).
pub const KVQ_BLOCK: usize = 32;

/// ggml `block_q8_0`: the f16 scale `d` (little-endian bytes), then 32 int8 quants;
/// `x_j = q_j * d`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ8_0 {
    pub d: [u8; 2],
    pub qs: [i8; KVQ_BLOCK],
}

/// ggml `block_q4_0`: the f16 scale `d` (little-endian bytes), then 16 bytes of nibbles:
/// element `j` in the low nibble of byte `j`, element `j + 16` in its high nibble;
/// `x_j = (q_j - 8) * d`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ4_0 {
    pub d: [u8; 2],
    pub qs: [u8; KVQ_BLOCK / 2],
}

// ggml's sizes (`static_assert(sizeof(block_q8_0) == sizeof(ggml_half) + QK8_0, ...)`), with
// no padding: a row of blocks is the bytes llama.cpp writes.
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::align_of::<BlockQ8_0>() == 1);
const _: () = assert!(std::mem::align_of::<BlockQ4_0>() == 1);

/// A llama.cpp quantized KV format (SPEC.md section 12, kvq8 / kvq4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvqFormat {
    /// ggml `q8_0` ([`BlockQ8_0`]), 34 bytes per block.
    Q8_0,
    /// ggml `q4_0` ([`BlockQ4_0`]), 18 bytes per block.
    Q4_0,
}

impl KvqFormat {
    /// Both formats, in the order of their method names.
    pub const ALL: [KvqFormat; 2] = [KvqFormat::Q8_0, KvqFormat::Q4_0];

    /// Bytes of one block of [`KVQ_BLOCK`] values: the f16 scale plus the quants.
    pub const fn block_bytes(self) -> usize {
        match self {
            KvqFormat::Q8_0 => std::mem::size_of::<BlockQ8_0>(),
            KvqFormat::Q4_0 => std::mem::size_of::<BlockQ4_0>(),
        }
    }

    /// The method name (`kvq8`, `kvq4`).
    pub const fn name(self) -> &'static str {
        match self {
            KvqFormat::Q8_0 => "kvq8",
            KvqFormat::Q4_0 => "kvq4",
        }
    }

    /// The format of a method name (`kvq8`, `kvq4`).
    pub fn from_name(name: &str) -> Option<KvqFormat> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }

    /// The largest finite f32 magnitude whose block scale still rounds to a finite f16:
    /// `d = amax / 127` (q8_0) or `|max| / 8` (q4_0) must stay below 65520.
    pub fn max_block_abs(self) -> f32 {
        match self {
            KvqFormat::Q8_0 => 65519.0 * 127.0,
            KvqFormat::Q4_0 => 65519.0 * 8.0,
        }
    }
}

/// The Hadamard block of llama.cpp's rotation of V rows (and of the attention output back):
/// always 64 (`build_input_v_rot` in llama.cpp's `src/llama-kv-cache.cpp`).
pub const VALUE_ROTATION_BLOCK: usize = 64;

/// SPEC.md section 12 (kvq8 / kvq4): the Hadamard block of llama.cpp's rotation of K rows and
/// queries for heads of `head_dim` dimensions: the largest power of two of at least 64 that
/// divides it (64 -> 64, 128 -> 128, 192 -> 64); `None` when 64 does not divide it, where
/// llama.cpp does not rotate (`build_input_k_rot`, `attn_rot_k`). The same rule of 64 gates
/// V's rotation.
pub fn key_rotation_block(head_dim: usize) -> Option<usize> {
    if head_dim == 0 || head_dim % VALUE_ROTATION_BLOCK != 0 {
        return None;
    }
    let mut n = VALUE_ROTATION_BLOCK;
    while head_dim % (2 * n) == 0 {
        n *= 2;
    }
    Some(n)
}

/// SPEC.md section 12 (kvq8 / kvq4): every block of a row set must have a scale that is a
/// finite f16, else `NonFinite` at the flat index of the first element of the first block that
/// breaks it. `values` run over whole rows, so every [`KVQ_BLOCK`] of them is one block.
pub fn check_block_scales<'a>(
    format: KvqFormat,
    what: &'static str,
    values: impl Iterator<Item = &'a f32>,
) -> Result<()> {
    let limit = format.max_block_abs();
    match values.enumerate().find(|(_, v)| v.abs() > limit) {
        Some((i, _)) => Err(MosaicError::NonFinite {
            what,
            index: i - i % KVQ_BLOCK,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sizes_are_ggmls() {
        for f in KvqFormat::ALL {
            assert_eq!(KvqFormat::from_name(f.name()), Some(f));
        }
        assert_eq!(KvqFormat::from_name("kvq2"), None);
        assert_eq!(KvqFormat::Q8_0.block_bytes(), 2 + KVQ_BLOCK);
        assert_eq!(KvqFormat::Q4_0.block_bytes(), 2 + KVQ_BLOCK / 2);
    }

    #[test]
    fn the_key_rotation_block_is_llama_cpps() {
        assert_eq!(key_rotation_block(64), Some(64));
        assert_eq!(key_rotation_block(128), Some(128));
        assert_eq!(key_rotation_block(256), Some(256));
        assert_eq!(key_rotation_block(192), Some(64));
        assert_eq!(key_rotation_block(320), Some(64));
        for d in [0, 32, 80, 96, 112] {
            assert_eq!(key_rotation_block(d), None, "{d}");
        }
    }

    #[test]
    fn an_unstorable_scale_is_reported_at_its_blocks_first_element() {
        let mut x = vec![1.0f32; 3 * KVQ_BLOCK];
        x[KVQ_BLOCK + 5] = KvqFormat::Q4_0.max_block_abs() * 2.0;
        let e = check_block_scales(KvqFormat::Q4_0, "keys", x.iter()).unwrap_err();
        assert!(matches!(e, MosaicError::NonFinite { index, .. } if index == KVQ_BLOCK));
        // the same magnitude fits q8_0's larger range
        assert!(check_block_scales(KvqFormat::Q8_0, "keys", x.iter()).is_ok());
        x[KVQ_BLOCK + 5] = f32::NAN;
        // NaN fails no `>`: SPEC 14's finiteness checks catch it before this rule
        assert!(check_block_scales(KvqFormat::Q8_0, "keys", x.iter()).is_ok());
    }
}
