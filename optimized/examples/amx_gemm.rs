//! The AMX bf16 product (`simd::amx::matmul_t_bf16`) on prefill-sized matrices, its GFLOP/s,
//! and the packing of a weight apart: `cargo run --release -p mosaickv-optimized --example
//! amx_gemm -- [M] [N] [K] [reps]` (default 4096 x 8960 x 1536, Qwen2.5-1.5B's gate/up half at
//! a 4K prompt). Prints nothing useful on a CPU without AMX-BF16.
use mosaickv_optimized::simd::amx::{amx_available, matmul_t_bf16, PackedBf16};
use std::time::Instant;

fn main() {
    let arg = |i: usize, d: usize| {
        std::env::args()
            .nth(i)
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    let (m, n, k, reps) = (arg(1, 4096), arg(2, 8960), arg(3, 1536), arg(4, 5));
    if !amx_available() {
        eprintln!("AMX-BF16 not available on this CPU (or switched off)");
        return;
    }
    let x: Vec<f32> = (0..m * k)
        .map(|i| ((i * 31 % 97) as f32 - 48.0) / 97.0)
        .collect();
    let w: Vec<f32> = (0..n * k)
        .map(|i| ((i * 17 % 89) as f32 - 44.0) / 89.0)
        .collect();
    let mut out = vec![0f32; m * n];
    let t = Instant::now();
    let packed = PackedBf16::new(&w, n, k);
    let pack_s = t.elapsed().as_secs_f64();
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        matmul_t_bf16(&x, m, &packed, &mut out);
        best = best.min(t.elapsed().as_secs_f64());
    }
    let flop = 2.0 * (m * n * k) as f64;
    println!(
        "{m} x {n} x {k}: pack {:.1} ms, product best of {reps} {:.1} ms = {:.0} GFLOP/s (threads {})",
        pack_s * 1e3,
        best * 1e3,
        flop / best / 1e9,
        rayon::current_num_threads()
    );
}
