//! Deterministic synthetic K/V with the structure of real decode caches
//! (not normative; used by tests, benches, conformance and CLI tests).
//!
//! Per KV head (its own ChaCha8 stream, so heads are independent of each other):
//! - **low rank**: keys get 4 high-energy directions (amplitudes 3, 2, 1.5, 1),
//!   values 6 (amplitudes 2, 1.5, 1.2, 1, 0.8, 0.6); the per-token
//!   coefficients follow an AR(1) process (rho = 0.9), so neighbouring tokens
//!   look alike, as in real text;
//! - **outlier channels**: two key channels among the low-frequency RoPE
//!   pairs carry a large offset (+6 and -4 plus noise); one value channel
//!   carries +2;
//! - **noise**: i.i.d. uniform with standard deviation 0.25 on every element;
//! - **attention sink**: token 0's key is 6x a typical key norm along a fixed
//!   direction (its value is a small fixed vector);
//! - **RoPE** on keys (after everything above), theta 10000, **half-split**
//!   (GPT-NeoX / Hugging Face Llama layout): dims `i` and `i + D/2` form a pair
//!   rotated by `t * 10000^(-2i/D)`.
//!
//! Cost is O(tokens * kv_heads * head_dim * rank): about a second for
//! 131072 x 8 x 128 in release builds.
//!
//! [`drifting_kv`] is the same with a **drifting** low-rank basis: each key and
//! value direction turns, at one radian per `drift_tokens` tokens, from its
//! start direction towards a second random one, so what the rows look like
//! changes slowly over a long generation (a strategy fitted early fits later
//! rows worse), while the outlier channels stay put.

use ndarray::{Array2, Array3};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const KEY_AMPS: [f32; 4] = [3.0, 2.0, 1.5, 1.0];
const VALUE_AMPS: [f32; 6] = [2.0, 1.5, 1.2, 1.0, 0.8, 0.6];
const RHO: f32 = 0.9;
const NOISE_STD: f32 = 0.05;
/// Logit of a needle above the mean key's (scaled by 1/sqrt(D)).
const NEEDLE_LOGIT: f64 = 11.0;

/// Uniform noise with mean 0 and standard deviation `std`.
fn noise(rng: &mut ChaCha8Rng, std: f32) -> f32 {
    (rng.gen::<f32>() - 0.5) * (12f32).sqrt() * std
}

/// A random unit vector of length `d` (uniform entries, normalised).
fn unit_vector(rng: &mut ChaCha8Rng, d: usize) -> Vec<f32> {
    let mut v: Vec<f32> = (0..d).map(|_| noise(rng, 1.0)).collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
    for x in &mut v {
        *x /= norm;
    }
    v
}

/// Per-head generator state.
struct HeadGen {
    rng: ChaCha8Rng,
    key_dirs: Vec<Vec<f32>>,
    value_dirs: Vec<Vec<f32>>,
    key_coef: Vec<f32>,
    value_coef: Vec<f32>,
    outliers: [usize; 2],
    value_outlier: usize,
    sink_dir: Vec<f32>,
    drift: Option<Drift>,
}

/// The second direction of every key and value direction, and the drift rate.
struct Drift {
    key_to: Vec<Vec<f32>>,
    value_to: Vec<Vec<f32>>,
    tokens_per_radian: f64,
}

/// `cos(theta) a + sin(theta) b`.
fn turned(a: &[f32], b: &[f32], theta: f64) -> Vec<f32> {
    let (c, s) = (theta.cos() as f32, theta.sin() as f32);
    a.iter().zip(b).map(|(x, y)| c * x + s * y).collect()
}

impl HeadGen {
    fn new(seed: u64, head: usize, d: usize) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(head as u64);
        let key_dirs = (0..KEY_AMPS.len())
            .map(|_| unit_vector(&mut rng, d))
            .collect();
        let value_dirs = (0..VALUE_AMPS.len())
            .map(|_| unit_vector(&mut rng, d))
            .collect();
        let half = d / 2;
        // Low-frequency pairs are the last ones of each half: dims half-4 .. half.
        let low = half.saturating_sub(4);
        let o1 = low + rng.gen_range(0..(half - low).max(1));
        let mut o2 = low + rng.gen_range(0..(half - low).max(1));
        if o2 == o1 {
            o2 = if o1 > 0 { o1 - 1 } else { (o1 + 1) % d };
        }
        let value_outlier = rng.gen_range(0..d);
        let sink_dir = unit_vector(&mut rng, d);
        let key_coef = KEY_AMPS.iter().map(|_| noise(&mut rng, 1.0)).collect();
        let value_coef = VALUE_AMPS.iter().map(|_| noise(&mut rng, 1.0)).collect();
        Self {
            rng,
            key_dirs,
            value_dirs,
            key_coef,
            value_coef,
            outliers: [o1, o2],
            value_outlier,
            sink_dir,
            drift: None,
        }
    }

    /// Makes the basis drift (see [`drifting_kv`]); the second directions come
    /// from their own stream, so the rest of the head's data is unchanged.
    fn with_drift(mut self, seed: u64, head: usize, tokens_per_radian: f64) -> Self {
        let d = self.sink_dir.len();
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xd21f_7a3c_5b9e_0461);
        rng.set_stream(head as u64);
        let key_to = (0..KEY_AMPS.len())
            .map(|_| unit_vector(&mut rng, d))
            .collect();
        let value_to = (0..VALUE_AMPS.len())
            .map(|_| unit_vector(&mut rng, d))
            .collect();
        self.drift = Some(Drift {
            key_to,
            value_to,
            tokens_per_radian,
        });
        self
    }

    /// Advances the AR(1) coefficients: `a <- rho a + sqrt(1 - rho^2) e`.
    fn step(coef: &mut [f32], rng: &mut ChaCha8Rng) {
        let s = (1.0 - RHO * RHO).sqrt();
        for a in coef.iter_mut() {
            *a = RHO * *a + s * noise(rng, 1.0);
        }
    }

    /// Pre-RoPE key and value of the next token into `k`, `v`.
    fn next(&mut self, t: usize, k: &mut [f32], v: &mut [f32]) {
        let d = k.len();
        Self::step(&mut self.key_coef, &mut self.rng);
        Self::step(&mut self.value_coef, &mut self.rng);
        for i in 0..d {
            k[i] = noise(&mut self.rng, NOISE_STD);
            v[i] = noise(&mut self.rng, NOISE_STD);
        }
        let turned_dirs;
        let (key_dirs, value_dirs): (&[Vec<f32>], &[Vec<f32>]) = match &self.drift {
            None => (&self.key_dirs, &self.value_dirs),
            Some(drift) => {
                let theta = t as f64 / drift.tokens_per_radian;
                let turn = |from: &[Vec<f32>], to: &[Vec<f32>]| -> Vec<Vec<f32>> {
                    from.iter()
                        .zip(to)
                        .map(|(a, b)| turned(a, b, theta))
                        .collect()
                };
                turned_dirs = (
                    turn(&self.key_dirs, &drift.key_to),
                    turn(&self.value_dirs, &drift.value_to),
                );
                (&turned_dirs.0, &turned_dirs.1)
            }
        };
        for (r, dir) in key_dirs.iter().enumerate() {
            let a = KEY_AMPS[r] * self.key_coef[r];
            for i in 0..d {
                k[i] += a * dir[i];
            }
        }
        for (r, dir) in value_dirs.iter().enumerate() {
            let a = VALUE_AMPS[r] * self.value_coef[r];
            for i in 0..d {
                v[i] += a * dir[i];
            }
        }
        k[self.outliers[0]] += 6.0;
        k[self.outliers[1]] -= 4.0;
        v[self.value_outlier] += 2.0;
        if t == 0 {
            // A typical key norm is about sqrt(36 + 16 + 16.25 + d * 0.0625); the sink is 6x that.
            let typical = (68.25 + d as f32 * NOISE_STD * NOISE_STD).sqrt();
            for i in 0..d {
                k[i] = 6.0 * typical * self.sink_dir[i];
                v[i] = 0.1 * self.sink_dir[i];
            }
        }
    }
}

/// Applies half-split RoPE (theta 10000) at position `t` to `x` in place.
fn rope(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = a * sin[i] + b * cos[i];
    }
}

/// Deterministic structured keys and values `[tokens, kv_heads, head_dim]`
/// (see the module doc). Keys are post-RoPE, half-split, theta 10000.
/// `head_dim` should be even (an odd last dim is left unrotated).
pub fn structured_kv(
    tokens: usize,
    kv_heads: usize,
    head_dim: usize,
    seed: u64,
) -> (Array3<f32>, Array3<f32>) {
    let heads = (0..kv_heads)
        .map(|h| HeadGen::new(seed, h, head_dim))
        .collect();
    generate(tokens, head_dim, heads)
}

/// [`structured_kv`] with a basis that drifts by one radian per
/// `tokens_per_radian` tokens (see the module doc): the rows of a long
/// generation. Token `t` of one call is token `t` of any longer call.
pub fn drifting_kv(
    tokens: usize,
    kv_heads: usize,
    head_dim: usize,
    seed: u64,
    tokens_per_radian: f64,
) -> (Array3<f32>, Array3<f32>) {
    let heads = (0..kv_heads)
        .map(|h| HeadGen::new(seed, h, head_dim).with_drift(seed, h, tokens_per_radian))
        .collect();
    generate(tokens, head_dim, heads)
}

/// Runs the per-head generators over `tokens` positions, RoPE on the keys.
fn generate(tokens: usize, head_dim: usize, mut heads: Vec<HeadGen>) -> (Array3<f32>, Array3<f32>) {
    let d = head_dim;
    let half = d / 2;
    let kv_heads = heads.len();
    let mut keys = Array3::<f32>::zeros((tokens, kv_heads, d));
    let mut values = Array3::<f32>::zeros((tokens, kv_heads, d));
    let inv_freq: Vec<f64> = (0..half)
        .map(|i| 10000f64.powf(-2.0 * i as f64 / d as f64))
        .collect();
    let mut cos = vec![0.0f32; half];
    let mut sin = vec![0.0f32; half];
    let mut k = vec![0.0f32; d];
    let mut v = vec![0.0f32; d];
    for t in 0..tokens {
        for i in 0..half {
            let angle = t as f64 * inv_freq[i];
            cos[i] = angle.cos() as f32;
            sin[i] = angle.sin() as f32;
        }
        for (h, gen) in heads.iter_mut().enumerate() {
            gen.next(t, &mut k, &mut v);
            rope(&mut k[..2 * half], &cos, &sin);
            for i in 0..d {
                keys[[t, h, i]] = k[i];
                values[[t, h, i]] = v[i];
            }
        }
    }
    (keys, values)
}

/// Deterministic decode queries `[q_heads, head_dim]` that attend sharply to
/// a few "needle" tokens of `keys` (`[tokens, kv_heads, head_dim]`), like a
/// real decode step.
///
/// Query head h (KV head `j = h / (q_heads / kv_heads)`) picks 2 needle
/// tokens (each the token of `1..tokens` most extreme along a random
/// direction: real heads attend to keys that stand out) and is
/// `q = sum_needles 11 sqrt(D) (k_n - mean_j) / ||k_n - mean_j||^2 + noise`,
/// i.e. each needle's logit sits about 11 above the mean key's, the noise adding logits
/// of standard deviation about 1. Panics if `q_heads` is not a multiple of
/// `kv_heads` or `keys` is empty (a caller bug).
pub fn queries(q_heads: usize, head_dim: usize, keys: &Array3<f32>, seed: u64) -> Array2<f32> {
    let (n, kvh, d) = keys.dim();
    assert!(
        n > 0 && kvh > 0 && q_heads % kvh == 0 && d == head_dim,
        "queries: bad shapes"
    );
    let g = q_heads / kvh;
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    let mut out = Array2::<f32>::zeros((q_heads, d));
    for j in 0..kvh {
        let mut mean = vec![0.0f64; d];
        let mut sq_norm = 0.0f64;
        for t in 0..n {
            for i in 0..d {
                let x = f64::from(keys[[t, j, i]]);
                mean[i] += x / n as f64;
                sq_norm += x * x / n as f64;
            }
        }
        for h in j * g..(j + 1) * g {
            for _ in 0..2 {
                // The needle is the token most extreme along a random direction u:
                // real heads attend to keys that stand out, not to average ones.
                let u = unit_vector(&mut rng, d);
                let mut needle = 0;
                let mut best = f64::NEG_INFINITY;
                for t in 1.min(n - 1)..n {
                    let mut p = 0.0;
                    for i in 0..d {
                        p += f64::from(u[i]) * (f64::from(keys[[t, j, i]]) - mean[i]);
                    }
                    if p > best {
                        best = p;
                        needle = t;
                    }
                }
                let dir: Vec<f64> = (0..d)
                    .map(|i| f64::from(keys[[needle, j, i]]) - mean[i])
                    .collect();
                let norm2 = dir.iter().map(|x| x * x).sum::<f64>().max(1e-12);
                for i in 0..d {
                    out[[h, i]] += (NEEDLE_LOGIT * (d as f64).sqrt() * dir[i] / norm2) as f32;
                }
            }
            // Noise: logits q.k / sqrt(D) with std ~1 for keys of mean square norm `sq_norm`.
            let std = (0.5 * ((d as f64) / sq_norm.max(1e-12)).sqrt()) as f32;
            for i in 0..d {
                out[[h, i]] += noise(&mut rng, std);
            }
        }
    }
    out
}
