//! Feature `emulated`: compiles every kernel source (`cuda/*.cu`) as host C++ with the
//! CPU emulation of the CUDA execution model (`emu/`), linked into this crate.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=cuda");
    println!("cargo:rerun-if-changed=emu");
    if std::env::var_os("CARGO_FEATURE_EMULATED").is_none() {
        return;
    }
    cc::Build::new()
        .cpp(true)
        .files([
            "emu/emu.cpp",
            "emu/kernels.cpp",
            "emu/divergent.cpp",
            "emu/selftest.cpp",
        ])
        .include("emu")
        .include("cuda")
        .flag("-std=c++20")
        // The device rounds what the kernels spell out (__fadd_rn, ...) and nothing else is
        // compared bit for bit; the host must not contract a * b + c on its own.
        .flag("-ffp-contract=off")
        .flag("-frounding-math")
        // The kernels read byte buffers through u32 / uint4 pointers, as device code may.
        .flag("-fno-strict-aliasing")
        // Out-of-bounds indices of fixed-size arrays (static __shared__, local arrays) trap;
        // emu.cpp turns the trap into a launch error.
        .flag("-fsanitize=bounds")
        .flag("-fsanitize-undefined-trap-on-error")
        .flag("-Wno-unknown-pragmas")
        .flag("-Wno-unused-parameter")
        .opt_level(2)
        .compile("mkv_cuda_emu");
}
