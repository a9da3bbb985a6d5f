#![allow(dead_code)]
//! Helpers shared by the integration tests.

use mosaickv_spec::{RecordLayout, SideStrategy, ValueDtype};
use ndarray::Array2;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Rows `[n, d]` uniform in [-scale, scale).
pub fn random_rows(n: usize, d: usize, scale: f32, seed: u64) -> Array2<f32> {
    let mut r = rng(seed);
    Array2::from_shape_fn((n, d), |_| (r.gen::<f32>() * 2.0 - 1.0) * scale)
}

/// A side strategy with the identity rotation.
pub fn identity_side(d: usize, kept_dims: usize, r: usize, g: usize) -> SideStrategy {
    // The first `kept_dims` columns of I (the stored rotation is D x Dt).
    let mut rotation = vec![half::f16::ZERO; d * kept_dims];
    for i in 0..kept_dims {
        rotation[i * kept_dims + i] = half::f16::ONE;
    }
    SideStrategy {
        layout: RecordLayout {
            head_dim: d,
            kept_dims,
            r,
            group_size: g,
            dtype: ValueDtype::F16,
            code_bits: 0,
        },
        rotation,
        fit_loss: 0.0,
        coding: Vec::new(),
    }
}
