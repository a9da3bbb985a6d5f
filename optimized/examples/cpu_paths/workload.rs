//! A short run of every CPU kernel family through the default constructors, which take
//! `Path::detect()`: strategy fitting and encoding (covariance, f64 rotations), MosaicKV
//! prefill, appends and attention (bitmap expansion, query rotation, block scores, the
//! selection filter, logits, softmax, value accumulation), `LiveCache` (covariance updates
//! of the open segment) and the dense and Quest baselines (f16 tiles, page scores).
//! Shared by `examples/cpu_paths` and `tests/forced_paths.rs`.

use mosaickv_optimized::{DenseF16Cache, LiveCache, Mode, OptimizedMosaicCache, QuestF16Cache};
use mosaickv_spec::{CompressConfig, KvCache, KvShape, Result};
use ndarray::{s, Array2, Array3};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Rows `[n][kv][d]` from four directions that turn with the token index, plus noise.
fn rows(n: usize, sh: &KvShape, seed: u64) -> Array3<f32> {
    let d = sh.head_dim;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let dirs: Vec<f32> = (0..8 * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
    Array3::from_shape_fn((n, sh.kv_heads, d), |(t, h, j)| {
        let th = t as f32 / 200.0;
        let mut v = 0.05 * rng.gen_range(-1.0f32..1.0);
        for k in 0..4 {
            let dir = th.cos() * dirs[k * d + j] + th.sin() * dirs[(4 + (k + h) % 4) * d + j];
            v += dir / (1 + k) as f32;
        }
        v
    })
}

/// Small segments, so that prefill, flushes and a closed generated segment all happen.
fn small(config: CompressConfig) -> CompressConfig {
    CompressConfig {
        input_segment_len: 128,
        buffer_capacity: 16,
        max_segment_len: 128,
        block_sizes: vec![8, 16],
        ..config
    }
}

/// Prefills `prompt` tokens, appends `gen`, attends every 8 tokens.
fn drive(c: &mut dyn KvCache, prompt: usize, gen: usize, seed: u64) -> Result<()> {
    let sh = c.shape();
    let (k, v) = (
        rows(prompt + gen, &sh, seed),
        rows(prompt + gen, &sh, seed + 1),
    );
    let mut rng = ChaCha8Rng::seed_from_u64(seed + 2);
    let q = Array2::from_shape_fn((sh.q_heads, sh.head_dim), |_| rng.gen_range(-1.0f32..1.0));
    let mut out = Array2::zeros((sh.q_heads, sh.head_dim));
    c.prefill(k.slice(s![..prompt, .., ..]), v.slice(s![..prompt, .., ..]))?;
    c.attend(q.view(), out.view_mut())?;
    for t in prompt..prompt + gen {
        c.append(k.slice(s![t, .., ..]), v.slice(s![t, .., ..]))?;
        if t % 8 == 0 {
            c.attend(q.view(), out.view_mut())?;
        }
    }
    Ok(())
}

/// Runs the workload; every cache is made by its default constructor.
pub fn run() -> Result<()> {
    for (i, &(kv, qh, d)) in [(2, 8, 64), (1, 1, 128), (2, 4, 32)].iter().enumerate() {
        let sh = KvShape::new(kv, qh, d)?;
        let seed = 10 * i as u64;
        for config in [CompressConfig::default(), CompressConfig::paper_fixed()] {
            let config = small(config);
            drive(
                &mut OptimizedMosaicCache::new(sh, config.clone())?,
                300,
                160,
                seed,
            )?;
            drive(&mut LiveCache::new(sh, config, Mode::Sync)?, 300, 160, seed)?;
        }
        drive(&mut DenseF16Cache::new(sh)?, 200, 20, seed)?;
        drive(&mut QuestF16Cache::new(sh, 0.2)?, 200, 20, seed)?;
    }
    Ok(())
}
