//! vLLM's TurboQuant KV cache (SPEC.md section 12, `turboquant:<preset>`): the presets, the
//! slot layout and the Lloyd-Max codebooks, written once. Source: vLLM PR 38479 and PR 40194
//! (`vllm/model_executor/layers/quantization/turboquant/{config,centroids}.py`,
//! `vllm/v1/attention/backends/turboquant_attn.py`, `vllm/v1/attention/ops/triton_turboquant_*`).
//! The quantization and attention arithmetic stays in the backend.

use crate::error::{MosaicError, Result};

/// One of vLLM's `--kv-cache-dtype turboquant_*` presets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurboQuantPreset {
    /// `turboquant_k8v4`: FP8 (e4m3) keys, 4-bit values.
    K8V4,
    /// `turboquant_4bit_nc`: 4-bit keys (norm-corrected), 4-bit values.
    Bit4Nc,
    /// `turboquant_k3v4_nc`: 3-bit keys (norm-corrected), 4-bit values.
    K3V4Nc,
    /// `turboquant_3bit_nc`: 3-bit keys (norm-corrected), 3-bit values.
    Bit3Nc,
}

/// Layers at each end of a dense model that vLLM keeps in the model's dtype under TurboQuant
/// (`TurboQuantConfig.get_boundary_skip_layers`: the first 2 and the last 2).
pub const BOUNDARY_LAYERS: usize = 2;

impl TurboQuantPreset {
    pub const ALL: [TurboQuantPreset; 4] = [
        TurboQuantPreset::K8V4,
        TurboQuantPreset::Bit4Nc,
        TurboQuantPreset::K3V4Nc,
        TurboQuantPreset::Bit3Nc,
    ];

    /// The preset's name after `turboquant_` in vLLM (`k8v4`, `4bit_nc`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            TurboQuantPreset::K8V4 => "k8v4",
            TurboQuantPreset::Bit4Nc => "4bit_nc",
            TurboQuantPreset::K3V4Nc => "k3v4_nc",
            TurboQuantPreset::Bit3Nc => "3bit_nc",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Bits per key element: 8 is FP8 e4m3 (no rotation, no codebook), 3 or 4 a Lloyd-Max index.
    pub const fn key_bits(self) -> usize {
        match self {
            TurboQuantPreset::K8V4 => 8,
            TurboQuantPreset::Bit4Nc => 4,
            TurboQuantPreset::K3V4Nc | TurboQuantPreset::Bit3Nc => 3,
        }
    }

    /// Bits per value element (uniform min/max quantization).
    pub const fn value_bits(self) -> usize {
        match self {
            TurboQuantPreset::Bit3Nc => 3,
            _ => 4,
        }
    }

    /// Whether dequantized key centroid vectors are rescaled to unit norm (`_nc`).
    pub const fn norm_correction(self) -> bool {
        !matches!(self, TurboQuantPreset::K8V4)
    }

    /// Key bytes per slot: FP8 `D`, else the packed indices `ceil(D * bits / 8)` plus the
    /// f16 norm (`key_packed_size`).
    pub const fn key_bytes(self, head_dim: usize) -> usize {
        match self.key_bits() {
            8 => head_dim,
            b => (head_dim * b).div_ceil(8) + 2,
        }
    }

    /// Value bytes per slot: packed indices plus the f16 scale and f16 minimum.
    pub const fn value_bytes(self, head_dim: usize) -> usize {
        (head_dim * self.value_bits()).div_ceil(8) + 4
    }

    /// vLLM's slot (one token, one KV head): key then value bytes, rounded up to even
    /// (`slot_size_aligned`). 134 B at head_dim 128 for `4bit_nc`, 70 B at 64.
    pub const fn slot_bytes(self, head_dim: usize) -> usize {
        let s = self.key_bytes(head_dim) + self.value_bytes(head_dim);
        s + s % 2
    }

    /// The head sizes vLLM runs the preset at: the key codebook presets need a power-of-two
    /// `head_dim` (its Hadamard; vLLM issue 41413 for others) and 3-bit packing a multiple
    /// of 8; `InvalidConfig` otherwise.
    pub fn check_head_dim(self, head_dim: usize) -> Result<()> {
        let bad = |why: &str| {
            Err(MosaicError::InvalidConfig(format!(
                "turboquant:{}: head_dim {head_dim} {why}",
                self.name()
            )))
        };
        if head_dim == 0 || head_dim % 8 != 0 {
            return bad("is not a multiple of 8 (vLLM packs 3-bit indices by 8)");
        }
        if self.key_bits() != 8 && !head_dim.is_power_of_two() {
            return bad("is not a power of two (vLLM's Hadamard rotation needs one, issue 41413)");
        }
        Ok(())
    }
}

/// vLLM's `solve_lloyd_max(d, bits)` (`centroids.py`): the Lloyd-Max quantizer of N(0, 1/d),
/// in f64 as there, then f32 (`torch.tensor(..., dtype=torch.float32)`), ascending. Uniform
/// start on `[-3.5 sigma, 3.5 sigma]`, outer edges at `+-10.5 sigma`, each centroid the ratio of
/// trapezoid integrals (200 intervals) of `x pdf` and `pdf` over its cell, at most 200
/// iterations, stopping when no centroid moves by `1e-10`.
pub fn lloyd_max_centroids(d: usize, bits: usize) -> Vec<f32> {
    let n_levels = 1usize << bits;
    let sigma2 = 1.0 / d as f64;
    let sigma = sigma2.sqrt();
    let pdf = |x: f64| {
        (1.0 / (2.0 * std::f64::consts::PI * sigma2).sqrt()) * (-x * x / (2.0 * sigma2)).exp()
    };
    let trapz = |f: &dyn Fn(f64) -> f64, a: f64, b: f64| {
        let n = 200;
        let h = (b - a) / n as f64;
        let mut result = 0.5 * (f(a) + f(b));
        for i in 1..n {
            result += f(a + i as f64 * h);
        }
        result * h
    };
    let (lo, hi) = (-3.5 * sigma, 3.5 * sigma);
    let mut centroids: Vec<f64> = (0..n_levels)
        .map(|i| lo + (hi - lo) * (i as f64 + 0.5) / n_levels as f64)
        .collect();
    for _ in 0..200 {
        let mut edges = vec![lo * 3.0];
        edges.extend((0..n_levels - 1).map(|i| (centroids[i] + centroids[i + 1]) / 2.0));
        edges.push(hi * 3.0);
        let next: Vec<f64> = (0..n_levels)
            .map(|i| {
                let (a, b) = (edges[i], edges[i + 1]);
                let num = trapz(&|x| x * pdf(x), a, b);
                let den = trapz(&pdf, a, b);
                if den > 1e-15 {
                    num / den
                } else {
                    centroids[i]
                }
            })
            .collect();
        let moved = next
            .iter()
            .zip(&centroids)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f64, f64::max);
        if moved < 1e-10 {
            break;
        }
        centroids = next;
    }
    centroids.into_iter().map(|c| c as f32).collect()
}

/// The decision midpoints of sorted centroids, in f32 as vLLM computes them
/// (`(c_sorted[:-1] + c_sorted[1:]) / 2` on the f32 tensor).
pub fn midpoints(centroids: &[f32]) -> Vec<f32> {
    centroids.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_bytes_are_vllms() {
        use TurboQuantPreset::*;
        // config.py at head_dim 128 and 64 (vLLM's slot_size_aligned)
        for (p, d128, d64) in [
            (K8V4, 196, 100),
            (Bit4Nc, 134, 70),
            (K3V4Nc, 118, 62),
            (Bit3Nc, 102, 54),
        ] {
            assert_eq!(p.slot_bytes(128), d128, "{p:?}");
            assert_eq!(p.slot_bytes(64), d64, "{p:?}");
            assert_eq!(TurboQuantPreset::from_name(p.name()), Some(p));
        }
        assert!(Bit4Nc.check_head_dim(80).is_err());
        assert!(K8V4.check_head_dim(80).is_ok());
        assert!(Bit3Nc.check_head_dim(68).is_err());
    }

    #[test]
    fn the_codebooks_are_vllms_solver_values() {
        // vLLM's solver re-run in Python (its positive halves, 6 decimals): symmetric, ascending
        let check = |d: usize, bits: usize, want: &[f64]| {
            let c = lloyd_max_centroids(d, bits);
            assert_eq!(c.len(), 1 << bits);
            let half = &c[c.len() / 2..];
            for (x, w) in half.iter().zip(want) {
                assert!(
                    (*x as f64 - w).abs() < 2e-6,
                    "d={d} bits={bits}: {x} vs {w}"
                );
            }
            for (a, b) in c.iter().zip(c.iter().rev()) {
                assert!((a + b).abs() < 1e-6);
            }
        };
        check(128, 3, &[0.021654, 0.066790, 0.118721, 0.190066]);
        check(
            128,
            4,
            &[
                0.011352, 0.034307, 0.058061, 0.083301, 0.111039, 0.143002, 0.182827, 0.241382,
            ],
        );
        check(64, 3, &[0.030623, 0.094456, 0.167898, 0.268794]);
        check(
            64,
            4,
            &[
                0.016053, 0.048517, 0.082110, 0.117806, 0.157032, 0.202235, 0.258556, 0.341365,
            ],
        );
    }
}
