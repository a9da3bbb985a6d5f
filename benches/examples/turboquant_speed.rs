//! The optimized TurboQuant cache against the reference's, one layer, side by side in one
//! run: `cargo run --release -p mosaickv-benches --example turboquant_speed -- [TOKENS]
//! [KV_HEADS] [Q_HEADS] [HEAD_DIM]` (default 16384 tokens, Qwen2.5-Coder-1.5B's 2 KV heads,
//! 12 query heads, head_dim 128). Both caches are filled from the same synthetic rows; each
//! decode step's median time (the reference: 3 steps, the optimized cache: at least 20) and
//! whether the two outputs are the same bits.

use mosaickv_optimized::turboquant::TurboQuantCache as Opt;
use mosaickv_reference::synthetic::{queries, structured_kv};
use mosaickv_reference::turboquant::TurboQuantCache as Ref;
use mosaickv_spec::turboquant::TurboQuantPreset;
use mosaickv_spec::{KvCache, KvShape};
use ndarray::Array2;
use std::time::Instant;

fn median_ms(c: &mut dyn KvCache, q: &Array2<f32>, steps: usize) -> (f64, Array2<f32>) {
    let mut out = Array2::zeros(q.dim());
    let mut times: Vec<f64> = (0..steps)
        .map(|_| {
            let t = Instant::now();
            c.attend(q.view(), out.view_mut()).expect("attend");
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    (times[steps / 2], out)
}

fn main() {
    let arg = |i: usize, d: usize| {
        std::env::args()
            .nth(i)
            .map_or(d, |s| s.parse().expect("a number"))
    };
    let (n, kvh, qh, d) = (arg(1, 16384), arg(2, 2), arg(3, 12), arg(4, 128));
    let shape = KvShape::new(kvh, qh, d).expect("shape");
    let (k, v) = structured_kv(n, kvh, d, 5);
    let q = queries(qh, d, &k, 6);
    println!(
        "{n} tokens, {kvh} KV heads, {qh} query heads, head_dim {d}, {} rayon threads",
        rayon::current_num_threads()
    );
    println!("| preset | reference ms | optimized ms | x | same bits |");
    println!("|---|---:|---:|---:|---|");
    for preset in TurboQuantPreset::ALL {
        let mut r = Ref::new(shape, preset).expect("preset");
        let mut o = Opt::new(shape, preset).expect("preset");
        r.prefill(k.view(), v.view()).expect("prefill");
        o.prefill(k.view(), v.view()).expect("prefill");
        let (tr, a) = median_ms(&mut r, &q, 3);
        let (to, b) = median_ms(&mut o, &q, 21);
        let same = a
            .iter()
            .zip(b.iter())
            .all(|(x, y)| x.to_bits() == y.to_bits());
        println!(
            "| {} | {tr:.1} | {to:.2} | {:.1} | {same} |",
            preset.name(),
            tr / to
        );
    }
}
