//! The premises of `mosaickv_conformance::tolerances`: the condition factors
//! its attention bounds are derived from, computed in f64 on the generators
//! the checks use. A generator change that breaks one fails here, so the
//! bounds are re-derived instead of silently no longer holding.

use mosaickv_conformance::{queries, structured_kv, HEAD_DIMS};
use mosaickv_reference::{synthetic, ReferenceBackend};
use mosaickv_spec::{Backend, CompressConfig, Side};
use ndarray::{Array3, ArrayView2, Axis};

/// Condition factors of one query head's full attention over `k`, `v` (`[n][d]`).
struct Factors {
    /// max_t |z_t|
    z: f64,
    /// max_t S_t sqrt(D), S_t = sum_j |q_j k_tj| / sqrt(D)
    s_sqrt_d: f64,
    /// || sum_t p_t |v_t| || / ||o||
    kappa: f64,
    /// max_t ||v_t - o|| / ||o||
    rho: f64,
    /// sum_t p_t ||v_t - o|| / ||o||
    rho_w: f64,
    /// sqrt(sum_t p_t^2 ||v_t - o||^2 (S_t sqrt(D) / 3)^2) / ||o||
    logit_term: f64,
}

fn factors(q: &[f64], k: ArrayView2<f32>, v: ArrayView2<f32>) -> Factors {
    let (n, d) = k.dim();
    let sc = 1.0 / (d as f64).sqrt();
    let dot = |t: usize, abs: bool| -> f64 {
        (0..d)
            .map(|i| {
                let x = q[i] * k[[t, i]] as f64;
                if abs {
                    x.abs()
                } else {
                    x
                }
            })
            .sum::<f64>()
            * sc
    };
    let z: Vec<f64> = (0..n).map(|t| dot(t, false)).collect();
    let s: Vec<f64> = (0..n).map(|t| dot(t, true)).collect();
    let m = z.iter().cloned().fold(f64::MIN, f64::max);
    let p: Vec<f64> = z.iter().map(|x| (x - m).exp()).collect();
    let l: f64 = p.iter().sum();
    let p: Vec<f64> = p.iter().map(|x| x / l).collect();
    let o: Vec<f64> = (0..d)
        .map(|i| (0..n).map(|t| p[t] * v[[t, i]] as f64).sum())
        .collect();
    let o_abs: Vec<f64> = (0..d)
        .map(|i| (0..n).map(|t| p[t] * (v[[t, i]] as f64).abs()).sum())
        .collect();
    let norm = |x: &[f64]| x.iter().map(|a| a * a).sum::<f64>().sqrt();
    let no = norm(&o);
    let spread: Vec<f64> = (0..n)
        .map(|t| {
            (0..d)
                .map(|i| (v[[t, i]] as f64 - o[i]).powi(2))
                .sum::<f64>()
                .sqrt()
        })
        .collect();
    let sd = (d as f64).sqrt();
    Factors {
        z: z.iter().map(|x| x.abs()).fold(0.0, f64::max),
        s_sqrt_d: s.iter().cloned().fold(0.0, f64::max) * sd,
        kappa: norm(&o_abs) / no,
        rho: spread.iter().cloned().fold(0.0, f64::max) / no,
        rho_w: (0..n).map(|t| p[t] * spread[t]).sum::<f64>() / no,
        logit_term: (0..n)
            .map(|t| (p[t] * spread[t] * s[t] * sd / 3.0).powi(2))
            .sum::<f64>()
            .sqrt()
            / no,
    }
}

/// `|| |R| |a| || / ||R a||` for the value rotation fitted on `v` (`[n][d]`) and
/// `a = R^T mean(v)`, the rotated accumulator of flat attention.
fn kappa_r(v: ArrayView2<f32>, cfg: &CompressConfig) -> f64 {
    let (n, d) = v.dim();
    let st = ReferenceBackend.fit_side(v, Side::Value, cfg).unwrap();
    let dt = st.layout.kept_dims;
    let r = |i: usize, j: usize| st.rotation[i * dt + j].to_f64();
    let mean: Vec<f64> = (0..d)
        .map(|i| (0..n).map(|t| v[[t, i]] as f64).sum::<f64>() / n as f64)
        .collect();
    let a: Vec<f64> = (0..dt)
        .map(|j| (0..d).map(|i| r(i, j) * mean[i]).sum())
        .collect();
    let (mut ra, mut rabs) = (0.0, 0.0);
    for i in 0..d {
        ra += (0..dt).map(|j| r(i, j) * a[j]).sum::<f64>().powi(2);
        rabs += (0..dt).map(|j| (r(i, j) * a[j]).abs()).sum::<f64>().powi(2);
    }
    (rabs / ra).sqrt()
}

fn worst(k: &Array3<f32>, v: &Array3<f32>, q: ndarray::ArrayView2<f32>) -> Factors {
    let g = q.nrows() / k.dim().1;
    let mut w = Factors {
        z: 0.0,
        s_sqrt_d: 0.0,
        kappa: 0.0,
        rho: 0.0,
        rho_w: 0.0,
        logit_term: 0.0,
    };
    for h in 0..q.nrows() {
        let qh: Vec<f64> = q.row(h).iter().map(|&x| x as f64).collect();
        let j = h / g;
        let f = factors(&qh, k.index_axis(Axis(1), j), v.index_axis(Axis(1), j));
        w.z = w.z.max(f.z);
        w.s_sqrt_d = w.s_sqrt_d.max(f.s_sqrt_d);
        w.kappa = w.kappa.max(f.kappa);
        w.rho = w.rho.max(f.rho);
        w.rho_w = w.rho_w.max(f.rho_w);
        w.logit_term = w.logit_term.max(f.logit_term);
    }
    w
}

/// `ATTEND_REL_L2`: |z| < 1, S sqrt(D) <= 6, kappa, kappa_R <= 1.1, rho <= 0.6.
#[test]
fn suite_generators_within_attend_premises() {
    for &d in &HEAD_DIMS {
        for seed in 0..3u64 {
            for &n in &[3usize, 40, 300, 1100] {
                let (k, v) = structured_kv(n, 2, d, seed * 7 + n as u64);
                let q = queries(8, d, seed);
                let f = worst(&k, &v, q.view());
                let at = format!("D={d} n={n} seed={seed}");
                assert!(f.z < 1.0, "{at}: |z| {}", f.z);
                assert!(f.s_sqrt_d <= 6.0, "{at}: S sqrt(D) {}", f.s_sqrt_d);
                assert!(f.kappa <= 1.1, "{at}: kappa {}", f.kappa);
                assert!(f.rho <= 0.6, "{at}: rho {}", f.rho);
            }
        }
        for cfg in [CompressConfig::default(), CompressConfig::paper_fixed()] {
            let (_, v) = structured_kv(1100, 1, d, d as u64);
            let kr = kappa_r(v.index_axis(Axis(1), 0), &cfg);
            assert!(kr <= 1.1, "D={d}: kappa_R {kr}");
        }
    }
}

/// `ATTEND_REL_L2_PEAKED`, on the data of `benches/tests/agree_with_reference.rs`:
/// kappa <= 1.8, kappa_R <= 1.5, rho_w <= 2.5, logit term <= 150.
#[test]
fn needle_queries_within_peaked_premises() {
    let (k, v) = synthetic::structured_kv(1500, 2, 64, 3);
    for seed in 0..5 {
        let q = synthetic::queries(8, 64, &k, seed);
        let f = worst(&k, &v, q.view());
        assert!(f.kappa <= 1.8, "seed {seed}: kappa {}", f.kappa);
        assert!(f.rho_w <= 2.5, "seed {seed}: rho_w {}", f.rho_w);
        assert!(
            f.logit_term <= 150.0,
            "seed {seed}: logit term {}",
            f.logit_term
        );
    }
    for cfg in [CompressConfig::default(), CompressConfig::paper_fixed()] {
        for h in 0..2 {
            let kr = kappa_r(v.index_axis(Axis(1), h), &cfg);
            assert!(kr <= 1.5, "head {h}: kappa_R {kr}");
        }
    }
}
