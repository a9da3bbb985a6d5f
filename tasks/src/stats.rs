//! Statistics of the accuracy suite (issue 14): 95 % Wilson intervals for an accuracy, the
//! paired difference of two methods on the same prompts with Newcombe's interval, and the
//! exact sign test (McNemar's exact test when scores are 0/1).
//!
//! Scores are per-sample `string_match_all` values in [0, 1]. Most tasks score 0 or 1; the
//! multi-answer ones (`niah_multivalue`, `niah_multiquery`, `cwe`, `vt`) can score fractions.
//! A fractional score `s` is treated as the success probability of one Bernoulli draw: the
//! Wilson interval of a mean of such scores is then conservative (a [0, 1] variable of mean
//! `p` has variance at most `p (1 - p)`), and the paired 2x2 table is filled with expected
//! counts (`a = sum f m`, `b = sum f (1 - m)`, `c = sum (1 - f) m`, `d = sum (1 - f)(1 - m)`),
//! which are the ordinary counts when every score is 0 or 1.

use serde::{Deserialize, Serialize};

/// The 97.5 % point of the standard normal (two-sided 95 %).
pub const Z95: f64 = 1.959_963_984_540_054;

/// Wilson's score interval for `successes` out of `n` at [`Z95`]; `(0, 1)` when `n = 0`.
///
/// `center = (p + z^2 / 2n) / (1 + z^2 / n)`,
/// `half = z sqrt(p (1 - p) / n + z^2 / 4n^2) / (1 + z^2 / n)`.
pub fn wilson(successes: f64, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let n = n as f64;
    let p = (successes / n).clamp(0.0, 1.0);
    let z2 = Z95 * Z95;
    let denom = 1.0 + z2 / n;
    let center = (p + z2 / (2.0 * n)) / denom;
    let half = Z95 * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt() / denom;
    ((center - half).max(0.0), (center + half).min(1.0))
}

/// An accuracy with its sample count and 95 % Wilson interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Accuracy {
    /// Mean score.
    pub mean: f64,
    /// Samples.
    pub n: usize,
    /// Lower end of the 95 % Wilson interval.
    pub low: f64,
    /// Upper end of the 95 % Wilson interval.
    pub high: f64,
}

impl Accuracy {
    /// Of per-sample scores in [0, 1].
    pub fn of(scores: &[f64]) -> Accuracy {
        let n = scores.len();
        let sum: f64 = scores.iter().sum();
        let (low, high) = wilson(sum, n);
        Accuracy {
            mean: if n == 0 { 0.0 } else { sum / n as f64 },
            n,
            low,
            high,
        }
    }
}

/// The paired comparison of a method with a baseline (here `full`) on the same samples.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Paired {
    /// `mean(method) - mean(baseline)`.
    pub diff: f64,
    /// Lower end of Newcombe's 95 % interval of the difference (his method 10).
    pub low: f64,
    /// Upper end of that interval.
    pub high: f64,
    /// Samples where the baseline scored higher (the method lost).
    pub worse: usize,
    /// Samples where the method scored higher (ties are neither).
    pub better: usize,
    /// Exact two-sided sign-test p-value on `worse` vs `better` (McNemar's exact test when
    /// every score is 0 or 1).
    pub p_value: f64,
    /// Paired samples.
    pub n: usize,
}

/// Exact two-sided sign test: `min(1, 2 P(X <= min(b, c)))` with `X ~ Binomial(b + c, 1/2)`;
/// 1 when `b + c = 0`.
pub fn sign_test(b: usize, c: usize) -> f64 {
    let n = b + c;
    if n == 0 {
        return 1.0;
    }
    let k = b.min(c);
    // P(X <= k) = sum_{i <= k} C(n, i) / 2^n, in logs to stay finite for large n
    let ln_choose =
        |i: usize| -> f64 { (1..=i).map(|j| ((n - i + j) as f64 / j as f64).ln()).sum() };
    let tail: f64 = (0..=k)
        .map(|i| (ln_choose(i) - n as f64 * std::f64::consts::LN_2).exp())
        .sum();
    (2.0 * tail).min(1.0)
}

/// Newcombe's (1998) method 10 for the difference of paired proportions `p1 - p2` from the
/// 2x2 table `a` (both succeed), `b` (only 1), `c` (only 2), `d` (neither): with Wilson
/// intervals `(l1, u1)`, `(l2, u2)` of `p1 = (a + b) / n` and `p2 = (a + c) / n` and
/// `phi = (a d - b c) / sqrt((a + b)(c + d)(a + c)(b + d))` (0 when a margin is 0),
/// `low = diff - sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2)`,
/// `high = diff + sqrt((u1 - p1)^2 - 2 phi (u1 - p1)(p2 - l2) + (p2 - l2)^2)`.
pub fn newcombe_paired(a: f64, b: f64, c: f64, d: f64) -> (f64, f64) {
    let n = a + b + c + d;
    if n <= 0.0 {
        return (-1.0, 1.0);
    }
    let m = n.round() as usize;
    let (p1, p2) = ((a + b) / n, (a + c) / n);
    let (l1, u1) = wilson(a + b, m);
    let (l2, u2) = wilson(a + c, m);
    let den = (a + b) * (c + d) * (a + c) * (b + d);
    let phi = if den > 0.0 {
        (a * d - b * c) / den.sqrt()
    } else {
        0.0
    };
    let diff = p1 - p2;
    let lo = ((p1 - l1).powi(2) - 2.0 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2).powi(2))
        .max(0.0)
        .sqrt();
    let hi = ((u1 - p1).powi(2) - 2.0 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2).powi(2))
        .max(0.0)
        .sqrt();
    ((diff - lo).max(-1.0), (diff + hi).min(1.0))
}

/// The paired comparison of `method` with `baseline`, sample by sample (same length).
pub fn paired(method: &[f64], baseline: &[f64]) -> Paired {
    assert_eq!(method.len(), baseline.len(), "paired samples");
    let (mut a, mut b, mut c, mut d) = (0.0, 0.0, 0.0, 0.0);
    let (mut worse, mut better) = (0, 0);
    for (&m, &f) in method.iter().zip(baseline) {
        a += m * f;
        b += m * (1.0 - f);
        c += (1.0 - m) * f;
        d += (1.0 - m) * (1.0 - f);
        if m < f {
            worse += 1;
        } else if m > f {
            better += 1;
        }
    }
    let n = method.len();
    let (low, high) = newcombe_paired(a, b, c, d);
    let mean = |x: &[f64]| x.iter().sum::<f64>() / n.max(1) as f64;
    Paired {
        diff: mean(method) - mean(baseline),
        low,
        high,
        worse,
        better,
        p_value: sign_test(worse, better),
        n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn wilson_matches_hand_computed_values() {
        // 8/10: p = 0.8, z^2 = 3.841459; denom 1.3841459; center (0.8 + 0.1920729) / denom
        // = 0.716738; half 1.959964 * sqrt(0.016 + 0.0096036) / denom = 0.226579
        let (lo, hi) = wilson(8.0, 10);
        assert!(
            close(lo, 0.490159, 1e-5) && close(hi, 0.943317, 1e-5),
            "{lo} {hi}"
        );
        // 0/10: (0, z^2/n / (1 + z^2/n)) = (0, 0.277533)
        let (lo, hi) = wilson(0.0, 10);
        assert!(lo == 0.0 && close(hi, 0.277533, 1e-5), "{hi}");
        // 10/10 mirrors 0/10
        let (lo, hi) = wilson(10.0, 10);
        assert!(close(lo, 1.0 - 0.277533, 1e-5) && close(hi, 1.0, 1e-12));
        assert_eq!(wilson(0.0, 0), (0.0, 1.0));
        let a = Accuracy::of(&[1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]);
        assert_eq!((a.mean, a.n), (0.8, 10));
        assert!(close(a.low, 0.490159, 1e-5));
    }

    #[test]
    fn sign_test_matches_exact_binomial_tails() {
        assert_eq!(sign_test(0, 0), 1.0);
        // 5 vs 0: 2 / 2^5 = 0.0625
        assert!(close(sign_test(5, 0), 0.0625, 1e-12));
        assert!(close(sign_test(0, 5), 0.0625, 1e-12));
        // 10 vs 2: 2 (1 + 12 + 66) / 4096 = 0.0385742
        assert!(close(sign_test(10, 2), 158.0 / 4096.0, 1e-12));
        // 3 vs 3: min(1, 2 * 42/64) = 1
        assert_eq!(sign_test(3, 3), 1.0);
        // large counts stay finite: 600 vs 400 is far below 1e-9
        let p = sign_test(600, 400);
        assert!(p > 0.0 && p < 1e-9, "{p}");
    }

    #[test]
    fn newcombe_by_hand_and_its_limits() {
        // all fail on both sides: diff 0, interval (-u, u) with u the 0/10 Wilson upper bound
        let (lo, hi) = newcombe_paired(0.0, 0.0, 0.0, 10.0);
        assert!(
            close(lo, -0.277533, 1e-5) && close(hi, 0.277533, 1e-5),
            "{lo} {hi}"
        );
        // a=6, b=2, c=0, d=2 (n = 10): p1 = 0.8, p2 = 0.6, diff 0.2;
        // phi = (12 - 0) / sqrt(8 * 2 * 6 * 4) = 12 / 19.5959 = 0.612372
        // Wilson 8/10 = (0.490159, 0.943317), 6/10 = (0.312670, 0.831821)
        // low = 0.2 - sqrt(0.309841^2 - 2 phi 0.309841 * 0.231821 + 0.231821^2) = 0.2 - 0.251...
        let (lo, hi) = newcombe_paired(6.0, 2.0, 0.0, 2.0);
        let (l1, u1, l2, u2): (f64, f64, f64, f64) = (0.490159, 0.943317, 0.312670, 0.831821);
        let phi = 12.0 / (8.0f64 * 2.0 * 6.0 * 4.0).sqrt();
        let want_lo = 0.2
            - ((0.8 - l1).powi(2) - 2.0 * phi * (0.8 - l1) * (u2 - 0.6) + (u2 - 0.6).powi(2))
                .sqrt();
        let want_hi = 0.2
            + ((u1 - 0.8).powi(2) - 2.0 * phi * (u1 - 0.8) * (0.6 - l2) + (0.6 - l2).powi(2))
                .sqrt();
        assert!(
            close(lo, want_lo, 1e-5) && close(hi, want_hi, 1e-5),
            "{lo} {hi}"
        );
        assert!(lo < 0.0 && hi > 0.2 && hi < 1.0, "{lo} {hi}");
        // identical samples: diff 0, no discordant pair, p = 1
        let s = [1.0, 0.0, 1.0, 1.0];
        let p = paired(&s, &s);
        assert_eq!((p.diff, p.worse, p.better, p.p_value), (0.0, 0, 0, 1.0));
        assert!(p.low < 0.0 && p.high > 0.0);
    }

    #[test]
    fn paired_counts_discordant_samples() {
        let full = [1.0; 10];
        let method = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0];
        let p = paired(&method, &full);
        assert!(close(p.diff, -0.5, 1e-12));
        assert_eq!((p.worse, p.better, p.n), (5, 0, 10));
        assert!(close(p.p_value, 0.0625, 1e-12));
        assert!(
            p.high < 0.0,
            "five losses in ten against a perfect full: {p:?}"
        );
        // fractional scores fill the table with expected counts; the sign test counts samples
        let p = paired(&[0.5, 1.0], &[1.0, 1.0]);
        assert!(close(p.diff, -0.25, 1e-12));
        assert_eq!((p.worse, p.better), (1, 0));
    }
}
