//! Which CPU kernel paths this machine runs, for CI logs (`.ci/run` runs it before the tests
//! and again in each forced pass):
//!
//! ```text
//! cargo run --release -p mosaickv-optimized --example cpu_paths
//! ```
//!
//! Prints the CPU features the SIMD paths need, the path `Path::detect()` picks with and
//! without each forcing switch, which paths can run here (a path that cannot is skipped by
//! every test stamped for it), and which kernel layers a short workload on the default
//! constructors actually ran. Exits 1 when that workload ran a layer the detected path
//! excludes (a forcing switch some kernel ignored).

mod workload;

use mosaickv_optimized::simd::{
    avx2_features, avx512_features, kernels_ran, Path, FORCE_AVX2, FORCE_PORTABLE,
};

fn names(paths: &[Path]) -> String {
    paths.iter().map(|p| p.name()).collect::<Vec<_>>().join(" ")
}

fn main() {
    let features: Vec<(&str, bool)> = avx2_features()
        .into_iter()
        .chain(avx512_features())
        .collect();
    let list: Vec<String> = features
        .iter()
        .map(|(f, on)| format!("{f}={}", if *on { "yes" } else { "no" }))
        .collect();
    println!("cpu_paths: CPU features: {}", list.join(" "));
    let env = |v: &str| std::env::var(v).unwrap_or_else(|_| "<unset>".into());
    println!(
        "cpu_paths: environment: {FORCE_PORTABLE}={} {FORCE_AVX2}={}",
        env(FORCE_PORTABLE),
        env(FORCE_AVX2)
    );
    let detected = Path::detect();
    println!(
        "cpu_paths: Path::detect() = {} (no switch: {}; {FORCE_PORTABLE}=1: {}; {FORCE_AVX2}=1: {})",
        detected.name(),
        Path::detect_with(false, false).name(),
        Path::detect_with(true, false).name(),
        Path::detect_with(false, true).name()
    );
    for path in Path::ALL {
        if path.runs_here() {
            println!("cpu_paths: path {}: runs on this CPU", path.name());
        } else {
            let missing: Vec<&str> = match path {
                Path::Avx512 => avx2_features()
                    .into_iter()
                    .chain(avx512_features())
                    .collect(),
                _ => avx2_features().into_iter().collect::<Vec<_>>(),
            }
            .into_iter()
            .filter(|f| !f.1)
            .map(|f| f.0)
            .collect();
            println!(
                "cpu_paths: path {}: CANNOT RUN on this CPU (lacks {}): tests stamped for it are \
                 ignored here, so this run does not test the default path of CPUs that have it",
                path.name(),
                missing.join(" ")
            );
        }
    }
    if let Err(e) = workload::run() {
        eprintln!("cpu_paths: the workload failed: {e}");
        std::process::exit(1);
    }
    let ran = kernels_ran();
    println!(
        "cpu_paths: kernel layers a workload on Path::detect() ran: {}",
        names(&ran)
    );
    let allowed = |p: Path| match p {
        Path::Portable => true,
        Path::Avx2 => detected != Path::Portable,
        Path::Avx512 => detected == Path::Avx512,
    };
    let wrong: Vec<Path> = ran.iter().copied().filter(|&p| !allowed(p)).collect();
    if !wrong.is_empty() {
        eprintln!(
            "cpu_paths: ERROR: kernels of {} ran although the path is {}",
            names(&wrong),
            detected.name()
        );
        std::process::exit(1);
    }
}
