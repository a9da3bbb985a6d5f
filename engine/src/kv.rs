//! The pluggable per-layer KV cache and the dense f16 reference implementation.

use half::f16;
use half::slice::HalfFloatSliceExt;
use mosaickv_optimized::simd::SpanPartial;
use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2};

/// One layer's KV cache, as seen by the decode loop.
pub trait LayerKv: Send {
    /// keys/values: [tokens, kv_heads, head_dim] f32, post-RoPE keys.
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<(), String>;
    /// one token: [kv_heads, head_dim]
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<(), String>;
    /// decode attention for one token's queries [q_heads, head_dim] (post-RoPE); writes [q_heads, head_dim];
    /// softmax(q.k / sqrt(head_dim)) over every cached token including the one just appended; GQA: q head h uses kv head h / (q_heads/kv_heads).
    fn attend(&mut self, queries: ArrayView2<f32>, out: ArrayViewMut2<f32>) -> Result<(), String>;
    fn len(&self) -> usize;
    /// Device-side bytes held (every byte counted, SPEC.md section 13).
    fn bytes(&self) -> usize;
    /// The most bytes `bytes()` can reach after at most `more` further appends, from the
    /// cache's state now; `None` when it cannot say better than its method's worst case.
    fn bytes_bound(&self, _more: usize) -> Option<usize> {
        None
    }
    /// Host-side bytes held apart from the device data (full-precision rows kept
    /// for background compression, and the live cache's covariance accumulators:
    /// `MemoryReport::host_bytes`); 0 for caches that keep none.
    fn host_bytes(&self) -> usize {
        0
    }
    /// The layer's query statistics for the attention loss (SPEC.md section 11.1), given
    /// before `prefill`; caches that do not use them ignore them.
    fn set_query_stats(&mut self, _stats: mosaickv_spec::QueryStats) -> Result<(), String> {
        Ok(())
    }
    /// The itemized memory report (SPEC.md section 13) where the cache has one; `None` for
    /// caches that only know their total.
    fn memory_report(&self) -> Option<mosaickv_spec::MemoryReport> {
        None
    }
}

/// Dense cache: every key and value stored as f16, attention accumulated in f32.
///
/// Storage is per KV head, token-major: `keys[h][t * head_dim + d]`.
#[derive(Debug, Clone)]
pub struct FullKv {
    kv_heads: usize,
    head_dim: usize,
    len: usize,
    keys: Vec<Vec<f16>>,
    values: Vec<Vec<f16>>,
}

impl FullKv {
    pub fn new(kv_heads: usize, head_dim: usize) -> Self {
        Self {
            kv_heads,
            head_dim,
            len: 0,
            keys: vec![Vec::new(); kv_heads],
            values: vec![Vec::new(); kv_heads],
        }
    }

    fn check_shape(&self, what: &str, dims: &[usize]) -> Result<(), String> {
        if dims != [self.kv_heads, self.head_dim] {
            return Err(format!(
                "{what}: expected [.., {}, {}], got {dims:?}",
                self.kv_heads, self.head_dim
            ));
        }
        Ok(())
    }

    fn push_row(dst: &mut Vec<f16>, row: ndarray::ArrayView1<f32>) {
        match row.as_slice() {
            Some(s) => {
                let start = dst.len();
                dst.resize(start + s.len(), f16::ZERO);
                dst[start..].convert_from_f32_slice(s);
            }
            None => dst.extend(row.iter().map(|&x| f16::from_f32(x))),
        }
    }
}

impl LayerKv for FullKv {
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<(), String> {
        if keys.dim() != values.dim() {
            return Err(format!(
                "prefill: keys {:?} vs values {:?}",
                keys.dim(),
                values.dim()
            ));
        }
        let (n, h, d) = keys.dim();
        self.check_shape("prefill", &[h, d])?;
        for head in 0..h {
            self.keys[head].reserve(n * d);
            self.values[head].reserve(n * d);
        }
        for t in 0..n {
            for head in 0..h {
                Self::push_row(&mut self.keys[head], keys.slice(ndarray::s![t, head, ..]));
                Self::push_row(
                    &mut self.values[head],
                    values.slice(ndarray::s![t, head, ..]),
                );
            }
        }
        self.len += n;
        Ok(())
    }

    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<(), String> {
        self.check_shape("append key", key.shape())?;
        self.check_shape("append value", value.shape())?;
        for head in 0..self.kv_heads {
            Self::push_row(&mut self.keys[head], key.row(head));
            Self::push_row(&mut self.values[head], value.row(head));
        }
        self.len += 1;
        Ok(())
    }

    fn attend(
        &mut self,
        queries: ArrayView2<f32>,
        mut out: ArrayViewMut2<f32>,
    ) -> Result<(), String> {
        let (qh, d) = queries.dim();
        if d != self.head_dim || qh % self.kv_heads != 0 || out.dim() != (qh, d) {
            return Err(format!(
                "attend: queries {:?}, out {:?}, cache heads {} dim {}",
                queries.dim(),
                out.dim(),
                self.kv_heads,
                d
            ));
        }
        if self.len == 0 {
            return Err("attend on an empty cache".into());
        }
        let group = qh / self.kv_heads;
        let scale = 1.0 / (d as f32).sqrt();
        let n = self.len;
        // Work items: (kv head, token span). Each returns a partial softmax (max, sum, weighted
        // values) per query head of the group; partials are merged below (flash-decoding).
        const SPAN: usize = 512;
        let spans = n.div_ceil(SPAN);
        // ndarray iterates in logical (row-major) order whatever the memory layout
        let q: Vec<f32> = queries.iter().map(|&x| x * scale).collect();
        let path = crate::quant::path();
        let partials: Vec<SpanPartial> = {
            use rayon::prelude::*;
            (0..self.kv_heads * spans)
                .into_par_iter()
                .map(|task| {
                    let (kh, sp) = (task / spans, task % spans);
                    let (t0, t1) = (sp * SPAN, ((sp + 1) * SPAN).min(n));
                    let qg = &q[kh * group * d..(kh + 1) * group * d];
                    let (ks, vs) = (
                        &self.keys[kh][t0 * d..t1 * d],
                        &self.values[kh][t0 * d..t1 * d],
                    );
                    path.span_partial(ks, vs, qg, group, d)
                })
                .collect()
        };
        for kh in 0..self.kv_heads {
            let parts = &partials[kh * spans..(kh + 1) * spans];
            for g in 0..group {
                let m = parts
                    .iter()
                    .map(|p| p.0[g])
                    .fold(f32::NEG_INFINITY, f32::max);
                let mut z = 0f32;
                let mut o = vec![0f32; d];
                for p in parts {
                    let w = (p.0[g] - m).exp();
                    z += w * p.1[g];
                    for (x, &a) in o.iter_mut().zip(&p.2[g * d..(g + 1) * d]) {
                        *x += w * a;
                    }
                }
                let inv = 1.0 / z;
                out.row_mut(kh * group + g)
                    .iter_mut()
                    .zip(&o)
                    .for_each(|(y, &x)| *y = x * inv);
            }
        }
        Ok(())
    }

    fn len(&self) -> usize {
        self.len
    }

    fn bytes(&self) -> usize {
        2 * self.len * self.kv_heads * self.head_dim * std::mem::size_of::<f16>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array2, Array3};

    fn naive(q: &Array2<f32>, k: &Array3<f32>, v: &Array3<f32>) -> Array2<f32> {
        let (qh, d) = q.dim();
        let (n, kh, _) = k.dim();
        let group = qh / kh;
        let mut out = Array2::zeros((qh, d));
        for h in 0..qh {
            let kv = h / group;
            let s: Vec<f64> = (0..n)
                .map(|t| {
                    (0..d)
                        .map(|j| q[[h, j]] as f64 * k[[t, kv, j]] as f64)
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for j in 0..d {
                out[[h, j]] = ((0..n).map(|t| e[t] * v[[t, kv, j]] as f64).sum::<f64>() / z) as f32;
            }
        }
        out
    }

    #[test]
    fn full_kv_matches_naive_attention() {
        let (n, kh, qh, d) = (1300, 3, 9, 64);
        let mut seed = 1u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        };
        let k = Array3::from_shape_fn((n + 1, kh, d), |_| 2.0 * rnd());
        let v = Array3::from_shape_fn((n + 1, kh, d), |_| rnd());
        let q = Array2::from_shape_fn((qh, d), |_| 2.0 * rnd());
        let mut c = FullKv::new(kh, d);
        c.prefill(
            k.slice(ndarray::s![..n, .., ..]),
            v.slice(ndarray::s![..n, .., ..]),
        )
        .unwrap();
        c.append(
            k.slice(ndarray::s![n, .., ..]),
            v.slice(ndarray::s![n, .., ..]),
        )
        .unwrap();
        assert_eq!(c.len(), n + 1);
        assert_eq!(c.bytes(), (n + 1) * kh * d * 2 * 2);
        let mut out = Array2::zeros((qh, d));
        c.attend(q.view(), out.view_mut()).unwrap();
        // reference on the f16-rounded cache
        let kr = k.mapv(|x| f16::from_f32(x).to_f32());
        let vr = v.mapv(|x| f16::from_f32(x).to_f32());
        let want = naive(&q, &kr, &vr);
        let err = (&out - &want).iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(err < 1e-5, "max abs err {err}");
    }

    /// `cargo test --release -p mosaickv-engine --lib kv::tests::attend_timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn attend_timing() {
        let (n, kh, qh, d) = (6144, 3, 9, 64);
        let k = Array3::from_shape_fn((n, kh, d), |(t, h, j)| {
            ((t * 7 + h * 3 + j) % 13) as f32 * 0.1 - 0.6
        });
        let q = Array2::from_shape_fn((qh, d), |(h, j)| ((h + j) % 5) as f32 * 0.2);
        let mut c = FullKv::new(kh, d);
        c.prefill(k.view(), k.view()).unwrap();
        let mut out = Array2::zeros((qh, d));
        let reps = 100;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            c.attend(q.view(), out.view_mut()).unwrap();
        }
        eprintln!(
            "FullKv attend over {n} tokens: {:.3} ms",
            t.elapsed().as_secs_f64() * 1e3 / reps as f64
        );
        // one span kernel over a whole head, single thread: portable vs this CPU's path
        let qg: Vec<f32> = q.iter().take(3 * d).copied().collect();
        for path in [mosaickv_optimized::Path::Portable, crate::quant::path()] {
            let t = std::time::Instant::now();
            for _ in 0..10 {
                std::hint::black_box(path.span_partial(&c.keys[0], &c.values[0], &qg, 3, d));
            }
            eprintln!(
                "span_partial ({}), {n} tokens: {:.3} ms",
                path.name(),
                t.elapsed().as_secs_f64() * 1e2
            );
        }
    }

    #[test]
    fn shape_errors_are_reported() {
        let mut c = FullKv::new(3, 64);
        let k = Array2::<f32>::zeros((2, 64));
        assert!(c.append(k.view(), k.view()).is_err());
        let q = Array2::<f32>::zeros((9, 64));
        let mut o = Array2::<f32>::zeros((9, 64));
        assert!(c.attend(q.view(), o.view_mut()).is_err());
    }
}
