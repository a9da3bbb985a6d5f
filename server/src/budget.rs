//! KV memory budget: what a request may need at worst, and what it may still need once running.
//!
//! Every figure counts every byte a request's KV rows take in this process: the device bytes of
//! `memory()` (SPEC.md section 13: retained values, bitmaps, padding, block metadata,
//! rotations, dense sink and buffer rows, headers, [`mosaickv_engine::LayerKv::bytes`]) plus
//! the host-side rows beside them, which on a CPU server are the same RAM:
//!
//! * the f32 rows a MosaicKV cache keeps for its open segment and update buffer until a close
//!   re-fits them (SPEC 10.2-10.3, `memory().host_rows`, [`mosaickv_engine::LayerKv::host_bytes`]):
//!   `8 * head_dim` bytes (f32 K and V) per appended token, layer and KV head, twice a dense
//!   f16 row, so a generated token costs more than a dense cache's until its segment closes
//!   ([`Footprint::host_per_token`]);
//! * the live MosaicKV cache's covariance accumulators for its open segment's fit (SPEC 10.4,
//!   `memory().host_scratch`): `2 * kv_heads * head_dim^2` f64 per layer while a segment is
//!   open, charged once per sequence ([`Footprint::host_fixed`]; 5.9 MB on SmolLM2, 14.7 MB on
//!   Qwen2.5-Coder-1.5B).
//!
//! Outside the budget, as vLLM keeps its forward pass's activations outside its KV pool: the
//! prompt's f32 K/V rows that the model's prefill hands to the caches (a chunked prompt's
//! [`mosaickv_engine::ChunkedPrefill`]), `8 * head_dim` bytes per prompt token, layer and KV
//! head for every method, held until the caches are filled. The engine prefills one prompt at
//! a time, so they are one prompt's worth at most (8K tokens on SmolLM2: 354 MB, beside 186 MB
//! of its dense f16 cache).
//!
//! * `full`: exactly `4 * kv_heads * head_dim` bytes per token per layer (f16 K and V).
//! * `kvq8` / `kvq4` (llama.cpp's `q8_0` / `q4_0` KV cache): exactly `2 * kv_heads *
//!   ceil(head_dim / 32)` blocks of 34 / 18 bytes per token per layer (K and V, f16 block scale
//!   included).
//! * `mosaic`: an upper bound that holds whatever strategies the fit picks. Per token, layer and
//!   KV head: a key and a value record with the most values the channel policy can keep
//!   (SPEC.md section 11.2: `r = min(D, ceil_g(f * D))` at the largest retention `f` and group
//!   size `g`; `align4(4 * ceil(D / 32) + 2 * r)` bytes each with the bitmap at g = 1, section
//!   6), plus the key block metadata at the smallest block size (`ceil((2 * D + 4) / b_min)`,
//!   section 7). Once per sequence: the rows kept dense f16 (`sink_tokens + buffer_capacity`
//!   rows of `4 * D` bytes for K and V). Per segment, layer and KV head: two f16 rotations
//!   `D x D`, the segment and strategy headers (16 + 2 * 32 B) and one more (partial) metadata
//!   block. Segments: exactly the prompt's closed segments of SPEC.md section 10.1
//!   ([`mosaickv_spec::rules::prompt_segments`]), one open segment for the generated tokens
//!   (it holds a copy of the last strategy), and two more for each close that can happen
//!   (SPEC 10.3: a generated segment closes only once it holds `min(L_min, L_max)` tokens, so
//!   at most `floor(max_tokens / min(L_min, L_max))` closes; each one fits a new strategy for
//!   the closed segment and the next open segment copies it).
//!
//! Admission reserves [`Footprint::worst_case`] for the prompt plus `max_tokens`. Once the prompt is in the cache, the scheduler lowers the reservation
//! after each step to the bound the caches give from their real state
//! ([`mosaickv_engine::LayerKv::bytes_bound`]: for the live MosaicKV cache, the measured bytes
//! plus the remaining tokens at the fitted strategies' own rate while no close can happen;
//! `mosaickv_optimized::LiveCache::device_bytes_bound`), or, for a cache that gives none, to
//! [`Footprint::still_needed`], plus the host rows held now,
//! [`Footprint::host_per_token`] for each token still to come and [`Footprint::host_fixed`]. The reservation never rises,
//! and the measured bytes (device and host) never exceed it (the engine counts any step where
//! they do, and the tests check that count is zero).

use mosaickv_engine::{Config, Method};
use mosaickv_spec::kvq::KVQ_BLOCK;

/// The worst-case byte rates of one method on one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    /// Bytes per token, all layers.
    pub per_token: usize,
    /// Bytes per segment, all layers (0 for dense caches).
    pub per_segment: usize,
    /// Bytes of the rows kept dense f16 (sink and update buffer), all layers, charged once.
    pub dense: usize,
    /// Prompt segment length `L_in` (for counting segments; unused when `per_segment` is 0).
    pub input_segment_len: usize,
    /// The fewest tokens a generated segment holds when it closes, `min(L_min, L_max)`
    /// (`CompressConfig::close_spacing`; 1 for dense caches).
    pub min_segment_len: usize,
    /// Tokens kept in the dense sink (not in any segment).
    pub sink_tokens: usize,
    /// Host bytes per appended token, all layers: the f32 K/V rows a MosaicKV cache keeps for
    /// its update buffer and open segment until a close (0 for caches that keep none). An
    /// upper bound: a close drops them.
    pub host_per_token: usize,
    /// Host bytes charged once per sequence, all layers: the live MosaicKV cache's covariance
    /// accumulators (`2 * kv_heads * head_dim^2` f64 per layer while a segment is open; 0 for
    /// caches that keep none).
    pub host_fixed: usize,
}

/// Methods the server runs.
pub const SERVED_METHODS: &str =
    "full, kvq8, kvq4, kvq8-norot, kvq4-norot, turboquant:<preset>, mosaic, mosaic-ref";

impl Footprint {
    /// The byte rates of `method` on a model of configuration `cfg`; `None` for a method the
    /// server does not run (see [`SERVED_METHODS`]).
    pub fn of(method: &Method, cfg: &Config) -> Option<Self> {
        let (layers, kvh, d) = (cfg.n_layers, cfg.kv_heads, cfg.head_dim);
        // f32 K and V of one token, all layers
        let rows = layers * kvh * 8 * d;
        match method {
            Method::Full => Some(Self {
                per_token: layers * kvh * 4 * d,
                per_segment: 0,
                dense: 0,
                input_segment_len: 1,
                min_segment_len: 1,
                sink_tokens: 0,
                host_per_token: 0,
                host_fixed: 0,
            }),
            Method::Kvq { format, .. } => Some(Self {
                per_token: layers * kvh * 2 * d.div_ceil(KVQ_BLOCK) * format.block_bytes(),
                per_segment: 0,
                dense: 0,
                input_segment_len: 1,
                min_segment_len: 1,
                sink_tokens: 0,
                host_per_token: 0,
                host_fixed: 0,
            }),
            // vLLM's slots in the compressed layers, dense f16 in its boundary layers (the
            // engine's own dense cache), the f32 key codebook once per compressed layer
            Method::TurboQuant {
                preset,
                boundary_layers: b,
            } => {
                let dense_layers = (0..layers).filter(|&l| l < *b || l + b >= layers).count();
                let tq = layers - dense_layers;
                let codebook = if preset.key_bits() == 8 {
                    0
                } else {
                    4 << preset.key_bits()
                };
                Some(Self {
                    per_token: dense_layers * kvh * 4 * d + tq * kvh * preset.slot_bytes(d),
                    per_segment: 0,
                    dense: tq * codebook,
                    input_segment_len: 1,
                    min_segment_len: 1,
                    sink_tokens: 0,
                    host_per_token: 0,
                    host_fixed: 0,
                })
            }
            Method::Mosaic { config, .. } => {
                use mosaickv_spec::rules::{worst_segment_head_bytes, worst_token_bytes};
                Some(Self {
                    per_token: layers * kvh * worst_token_bytes(config, d),
                    // the 16-byte segment header charged per head too (an over-count)
                    per_segment: layers
                        * kvh
                        * (worst_segment_head_bytes(d)
                            + mosaickv_spec::cache::SEGMENT_HEADER_BYTES),
                    dense: layers * kvh * (config.sink_tokens + config.buffer_capacity) * 4 * d,
                    input_segment_len: config.input_segment_len.max(1),
                    min_segment_len: config.close_spacing(),
                    sink_tokens: config.sink_tokens,
                    host_per_token: rows,
                    // the reference cache (`mosaic-ref`) keeps none: an over-count there
                    host_fixed: layers * mosaickv_spec::cache::covariance_scratch_bytes(kvh, d),
                })
            }
            _ => None,
        }
    }

    /// The most bytes a request of `prompt` tokens and up to `max_tokens` generated ones can
    /// hold at any time: its caches at their worst, the host rows of every generated token and
    /// the host scratch.
    pub fn worst_case(&self, prompt: usize, max_tokens: usize) -> usize {
        self.cache_worst_case(prompt, max_tokens)
            + max_tokens * self.host_per_token
            + self.host_fixed
    }

    /// The most device bytes the caches alone can reach (SPEC.md section 13).
    pub fn cache_worst_case(&self, prompt: usize, max_tokens: usize) -> usize {
        let segments = if self.per_segment == 0 {
            0
        } else {
            let (_, prompt_segments) = mosaickv_spec::rules::prompt_segments(
                prompt,
                self.sink_tokens,
                self.input_segment_len,
            );
            prompt_segments.len() + 1 + 2 * (max_tokens / self.min_segment_len)
        };
        (prompt + max_tokens) * self.per_token + segments * self.per_segment + self.dense
    }

    /// The most bytes a running request can reach from `measured` bytes now, with at most
    /// `remaining` more tokens to append, for a cache that cannot bound it from its state
    /// (the live MosaicKV cache can: see the module doc). Generated segments: up to
    /// `ceil(remaining / L_min) + 3` (the open one, a provisional one of the background worker,
    /// and the remainder).
    pub fn still_needed(&self, measured: usize, remaining: usize) -> usize {
        self.device_still_needed(measured, remaining)
            + remaining * self.host_per_token
            + self.host_fixed
    }

    /// [`Footprint::still_needed`] without the host rows of the tokens to come.
    pub fn device_still_needed(&self, measured: usize, remaining: usize) -> usize {
        let segments = if self.per_segment == 0 {
            0
        } else {
            remaining.div_ceil(self.min_segment_len) + 3
        };
        measured + remaining * self.per_token + segments * self.per_segment + self.dense
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config {
            arch: mosaickv_engine::Arch::Llama,
            n_layers: 30,
            hidden: 576,
            ffn: 1536,
            q_heads: 9,
            kv_heads: 3,
            head_dim: 64,
            vocab: 49152,
            rope_theta: 1e5,
            rope: mosaickv_engine::RopeStyle::Interleaved,
            rms_eps: 1e-5,
            context_length: 8192,
            tied_embeddings: true,
            qkv_bias: false,
        }
    }

    #[test]
    fn full_is_exactly_dense_f16() {
        let f = Footprint::of(&Method::Full, &cfg()).unwrap();
        assert_eq!(f.per_token, 30 * 3 * 4 * 64);
        assert_eq!(f.cache_worst_case(100, 28), 128 * 30 * 3 * 4 * 64);
        assert_eq!(f.still_needed(1000, 10), 1000 + 10 * f.per_token);
        // a dense cache keeps no host rows
        assert_eq!(f.host_per_token, 0);
        assert_eq!(f.worst_case(100, 28), f.cache_worst_case(100, 28));
    }

    #[test]
    fn kvq_is_exactly_ggml_blocks() {
        let f = |m: &str| Footprint::of(&Method::parse(m).unwrap(), &cfg()).unwrap();
        // head_dim 64: 2 blocks per head and tensor
        assert_eq!(f("kvq8").per_token, 30 * 3 * 2 * 2 * 34);
        assert_eq!(f("kvq4").per_token, 30 * 3 * 2 * 2 * 18);
        assert_eq!(
            f("kvq4").cache_worst_case(100, 28),
            128 * f("kvq4").per_token
        );
    }

    #[test]
    fn turboquant_is_vllms_slots_plus_its_dense_boundary_layers() {
        let f = |m: &str| Footprint::of(&Method::parse(m).unwrap(), &cfg()).unwrap();
        // 30 layers: the first and last two dense (4 * 64 B per head), 26 with 70 B slots
        let tq = f("turboquant:4bit_nc");
        assert_eq!(tq.per_token, 4 * 3 * 4 * 64 + 26 * 3 * 70);
        assert_eq!(tq.dense, 26 * 4 * 16);
        assert_eq!(f("turboquant:k8v4").dense, 0);
        assert_eq!(f("turboquant:3bit_nc:boundary=0").per_token, 30 * 3 * 54);
        assert_eq!(tq.cache_worst_case(100, 28), 128 * tq.per_token + tq.dense);
    }

    #[test]
    fn mosaic_bound_is_above_dense_and_counts_segments() {
        let m = Method::parse("mosaic").unwrap();
        let f = Footprint::of(&m, &cfg()).unwrap();
        let dense = Footprint::of(&Method::Full, &cfg()).unwrap();
        // default policy: the largest candidate is f = 6/8 at g = 1, f16: r = 48, a record is
        // 8 B of bitmap + 96 B of values = 104 B; metadata at b = 16 is ceil(132 / 16) = 9 B
        // per token
        assert_eq!(f.per_token, 30 * 3 * (2 * 104 + 9));
        assert!(f.per_token < dense.per_token);
        // two D x D f16 rotations (2 * 2 * 64 * 64 B), two side headers, one partial block
        assert_eq!(f.per_segment, 30 * 3 * (16384 + 80 + 132));
        assert_eq!(f.dense, 30 * 3 * (4 + 64) * 256);
        // 1 prompt segment (SPEC 10.1: 996 tokens after the sink < L_in), 1 open one, no close
        // (100 < L_min)
        assert_eq!(
            f.cache_worst_case(1000, 100),
            1100 * f.per_token + 2 * f.per_segment + f.dense
        );
        // a prompt within the sink has no segment; 8,192 generated tokens allow 8 closes (one
        // per min(L_min, L_max) = 1,024 tokens), each charged two segments
        assert_eq!(
            f.cache_worst_case(4, 8192),
            8196 * f.per_token + (1 + 16) * f.per_segment + f.dense
        );
        // L_max below L_min: the cap sets the spacing
        let capped =
            Footprint::of(&Method::parse("mosaic:lmin=4096:lmax=512").unwrap(), &cfg()).unwrap();
        assert_eq!(capped.min_segment_len, 512);
        // 40,000 prompt tokens after the sink: floor(40000 / 16384) = 2 segments
        assert_eq!(
            f.cache_worst_case(40_004, 10),
            40_014 * f.per_token + 3 * f.per_segment + f.dense
        );
        // fixed retention 1/4 at g = 1: r = 16, a record is 8 + 32 = 40 B
        let fixed = Footprint::of(&Method::parse("mosaic:ret=0.25").unwrap(), &cfg()).unwrap();
        assert_eq!(fixed.per_token, 30 * 3 * (2 * 40 + 9));
        // quantized values: int8 r = 48 is 8 + 4 (minimum and scale) + 48 = 60 B, int4 r = 48
        // is 8 + 4 + 24 = 36 B; with f16 allowed too, f16 is the largest
        let per_token = |m: &str| {
            Footprint::of(&Method::parse(m).unwrap(), &cfg())
                .unwrap()
                .per_token
        };
        assert_eq!(per_token("mosaic:dt=int8"), 30 * 3 * (2 * 60 + 9));
        assert_eq!(per_token("mosaic:dt=int4"), 30 * 3 * (2 * 36 + 9));
        assert_eq!(per_token("mosaic:dt=int4/int8/f16"), per_token("mosaic"));
        assert!(Footprint::of(&Method::parse("quest").unwrap(), &cfg()).is_none());
    }

    #[test]
    fn mosaic_charges_the_host_rows_of_generated_tokens_and_its_scratch() {
        let f = Footprint::of(&Method::parse("mosaic").unwrap(), &cfg()).unwrap();
        // f32 K and V per token, layer and KV head
        assert_eq!(f.host_per_token, 30 * 3 * 8 * 64);
        // two f64 covariances D x D per layer and KV head: 5,898,240 B on SmolLM2
        assert_eq!(f.host_fixed, 30 * 2 * 3 * 64 * 64 * 8);
        assert_eq!(f.host_fixed, 5_898_240);
        assert_eq!(
            f.worst_case(1000, 100),
            f.cache_worst_case(1000, 100) + 100 * f.host_per_token + f.host_fixed
        );
        assert_eq!(
            f.still_needed(5000, 10),
            f.device_still_needed(5000, 10) + 10 * f.host_per_token + f.host_fixed
        );
    }
}
