//! The SPEC.md section 9 fallback of [`super::LiveCache`] for a cache whose
//! rows are all dense (sink and buffer, no segment yet), where
//! `packed_attention` does not apply.

use mosaickv_spec::CompressedCache;

/// SPEC 9 over the dense rows (sink, then buffer) of a cache without segments, f64, rounded to f32.
pub(super) fn dense_attention(cache: &CompressedCache, q: &[f32], out: &mut [f32]) {
    let sh = cache.shape;
    let d = sh.head_dim;
    let scale = 1.0 / (d as f64).sqrt();
    let rows: Vec<(&[half::f16], &[half::f16])> = [&cache.sink, &cache.buffer]
        .into_iter()
        .flat_map(|r| (0..r.tokens).map(move |t| (r, t)))
        .flat_map(|(r, t)| (0..sh.kv_heads).map(move |h| (r.key(&sh, t, h), r.value(&sh, t, h))))
        .collect();
    let n = rows.len() / sh.kv_heads;
    let mut z = vec![0f64; n];
    let mut acc = vec![0f64; d];
    for (h, o) in out.chunks_exact_mut(d).enumerate().take(sh.q_heads) {
        let j = h / sh.group();
        let qh = &q[h * d..(h + 1) * d];
        for (t, zt) in z.iter_mut().enumerate() {
            let k = rows[t * sh.kv_heads + j].0;
            *zt = qh
                .iter()
                .zip(k)
                .map(|(&a, b)| a as f64 * b.to_f64())
                .sum::<f64>()
                * scale;
        }
        let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        acc.fill(0.0);
        let mut sum = 0f64;
        for (t, &zt) in z.iter().enumerate() {
            let p = (zt - m).exp();
            sum += p;
            for (a, v) in acc.iter_mut().zip(rows[t * sh.kv_heads + j].1) {
                *a += p * v.to_f64();
            }
        }
        for (o, a) in o.iter_mut().zip(&acc) {
            *o = (a / sum) as f32;
        }
    }
}
