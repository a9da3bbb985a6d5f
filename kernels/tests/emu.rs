//! The CPU emulation of the CUDA execution model (feature `emulated`): it runs every
//! kernel, reports each fault it claims to catch, and its intrinsics round as named.
//! `cargo test --release -p mosaickv-kernels --features emulated --test emu`
#![cfg(feature = "emulated")]

use mosaickv_kernels::emu::{self, EmuError, LaunchDims};
use std::ffi::c_void;

/// A kernel argument: its bytes live in `Box`es so the pointers stay put.
struct Args {
    vals: Vec<Box<[u8; 8]>>,
    sizes: Vec<usize>,
}
impl Args {
    fn new() -> Self {
        Self {
            vals: Vec::new(),
            sizes: Vec::new(),
        }
    }
    fn push<T: Copy>(mut self, v: T) -> Self {
        let mut b = Box::new([0u8; 8]);
        let n = std::mem::size_of::<T>();
        assert!(n <= 8);
        // SAFETY: T is Copy and at most 8 bytes; the box holds 8.
        unsafe { std::ptr::copy_nonoverlapping(&v as *const T as *const u8, b.as_mut_ptr(), n) };
        self.vals.push(b);
        self.sizes.push(n);
        self
    }
    fn ptr<T>(self, p: *const T) -> Self {
        self.push(p as u64)
    }
    fn run(mut self, name: &str, grid: u32, block: u32, smem: usize) -> Result<(), EmuError> {
        let mut ptrs: Vec<*mut c_void> = self
            .vals
            .iter_mut()
            .map(|b| b.as_mut_ptr() as *mut c_void)
            .collect();
        let dims = LaunchDims {
            grid: (grid, 1, 1),
            block: (block, 1, 1),
            dyn_smem: smem,
            max_dyn_smem: 48 * 1024,
        };
        // SAFETY: each test passes its kernel's parameter list, with buffers large enough.
        unsafe { emu::launch(name, dims, &mut ptrs, &self.sizes) }
    }
}

#[test]
fn every_kernel_entry_point_is_compiled_into_the_emulation() {
    let names = emu::kernel_names();
    for (file, e) in mosaickv_kernels::entry_points() {
        assert!(
            names.iter().any(|n| n == e),
            "{file}: {e} is not in the emulation"
        );
    }
    assert!(names.iter().any(|n| n == "mkv_dense_decode_divergent"));
}

#[test]
fn a_correct_kernel_runs_and_computes() {
    let input: Vec<f32> = (0..256).map(|i| (i % 7) as f32).collect();
    let mut out = vec![0f32; 2];
    Args::new()
        .ptr(input.as_ptr())
        .ptr(out.as_mut_ptr())
        .run("emu_test_ok", 2, 128, 0)
        .unwrap();
    let want: Vec<f32> = input.chunks(128).map(|c| c.iter().sum()).collect();
    assert_eq!(out, want);
}

#[test]
fn a_barrier_not_every_thread_reaches_is_reported() {
    let mut out = vec![0i32; 64];
    let e = Args::new()
        .push(10i32)
        .ptr(out.as_mut_ptr())
        .run("emu_test_barrier", 1, 64, 0)
        .unwrap_err();
    match e {
        EmuError::Fault(m) => assert!(m.contains("__syncthreads") && m.contains("54 of 64"), "{m}"),
        e => panic!("{e:?}"),
    }
    // Every thread reaching it is fine.
    Args::new()
        .push(0i32)
        .ptr(out.as_mut_ptr())
        .run("emu_test_barrier", 1, 64, 0)
        .unwrap();
    assert!(out.iter().all(|&x| x == 1));
}

#[test]
fn a_shuffle_from_a_partial_warp_is_reported() {
    let mut out = vec![0f32; 32];
    let e = Args::new()
        .push(16i32)
        .ptr(out.as_mut_ptr())
        .run("emu_test_shuffle", 1, 32, 0)
        .unwrap_err();
    match e {
        EmuError::Fault(m) => assert!(
            m.contains("divergent warp operation") && m.contains("__shfl_xor_sync"),
            "{m}"
        ),
        e => panic!("{e:?}"),
    }
    Args::new()
        .push(32i32)
        .ptr(out.as_mut_ptr())
        .run("emu_test_shuffle", 1, 32, 0)
        .unwrap();
    let want: Vec<f32> = (0..32).map(|i| (i ^ 1) as f32).collect();
    assert_eq!(out, want);
}

#[test]
fn dynamic_shared_memory_past_its_size_is_reported() {
    let mut out = vec![0f32; 1];
    Args::new()
        .push(255i32)
        .ptr(out.as_mut_ptr())
        .run("emu_test_dyn_smem", 1, 32, 1024)
        .unwrap();
    assert_eq!(out[0], 1.0);
    let e = Args::new()
        .push(256i32)
        .ptr(out.as_mut_ptr())
        .run("emu_test_dyn_smem", 1, 32, 1024)
        .unwrap_err();
    assert!(
        matches!(&e, EmuError::Fault(m) if m.contains("shared-memory index out of bounds")),
        "{e:?}"
    );
}

#[test]
fn static_shared_memory_past_its_size_is_reported() {
    let mut out = vec![0f32; 1];
    Args::new()
        .push(63i32)
        .ptr(out.as_mut_ptr())
        .run("emu_test_static_smem", 1, 32, 0)
        .unwrap();
    assert_eq!(out[0], 2.0);
    let e = Args::new()
        .push(64i32)
        .ptr(out.as_mut_ptr())
        .run("emu_test_static_smem", 1, 32, 0)
        .unwrap_err();
    assert!(
        matches!(&e, EmuError::Fault(m) if m.contains("fixed-size array")),
        "{e:?}"
    );
}

#[test]
fn launches_past_the_device_limits_are_refused() {
    let mut out = vec![0f32; 4096];
    let input = vec![0f32; 4096];
    let e = Args::new()
        .ptr(input.as_ptr())
        .ptr(out.as_mut_ptr())
        .run("emu_test_ok", 1, 2048, 0)
        .unwrap_err();
    assert!(matches!(e, EmuError::LaunchLimit(_)), "{e:?}");
    let e = Args::new()
        .push(0i32)
        .ptr(out.as_mut_ptr())
        .run("emu_test_dyn_smem", 1, 32, 64 * 1024)
        .unwrap_err();
    assert!(matches!(e, EmuError::LaunchLimit(_)), "{e:?}");
    // mkv_packed_attention is compiled for 128 threads (__launch_bounds__).
    let e = Args::new()
        .run("mkv_packed_attention", 1, 256, 0)
        .unwrap_err();
    assert!(
        matches!(e, EmuError::BadArguments(_) | EmuError::LaunchLimit(_)),
        "{e:?}"
    );
    // Argument count and sizes are checked against the kernel's signature.
    let e = Args::new()
        .push(0i64)
        .ptr(out.as_mut_ptr())
        .run("emu_test_dyn_smem", 1, 32, 16)
        .unwrap_err();
    assert!(matches!(e, EmuError::BadArguments(_)), "{e:?}");
}

fn f32_next_up(x: f32) -> f32 {
    if x.is_nan() || x == f32::INFINITY {
        return x;
    }
    if x == 0.0 {
        return f32::from_bits(1);
    }
    let b = x.to_bits();
    f32::from_bits(if x > 0.0 { b + 1 } else { b - 1 })
}
fn f32_next_down(x: f32) -> f32 {
    -f32_next_up(-x)
}

#[test]
fn rounding_intrinsics_round_as_named_and_f16_conversions_match_half() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let mut input: Vec<f64> = vec![
        1.0 / 3.0,
        -1.0 / 3.0,
        65504.0,
        65519.99,
        65520.0,
        6.0e-8,
        2.98e-8,
        1.0 + 1e-12,
    ];
    input.extend([0.1, 0.2, -2.5e-5, 3.0e-5, 1e300, -1e-300]);
    while input.len() < 1000 {
        let e: i32 = rng.gen_range(-30..20);
        input.push(rng.gen_range(-1.0..1.0f64) * 2f64.powi(e));
    }
    let n = input.len() / 2;
    let mut out = vec![0f64; 16 * n];
    Args::new()
        .ptr(input.as_ptr())
        .push(n as i64)
        .ptr(out.as_mut_ptr())
        .run("emu_test_round", 1, 64, 0)
        .unwrap();
    for i in 0..n {
        let (a, b) = (input[2 * i], input[2 * i + 1]);
        let o = &out[16 * i..16 * i + 16];
        let rn = a as f32;
        // Directed roundings of f64 -> f32: the neighbours of the nearest value.
        let ru = if (rn as f64) >= a {
            rn
        } else {
            f32_next_up(rn)
        };
        let rd = if (rn as f64) <= a {
            rn
        } else {
            f32_next_down(rn)
        };
        let rz = if a >= 0.0 { rd } else { ru };
        assert_eq!(o[0], rn as f64, "rn {a}");
        assert_eq!(o[1], rz as f64, "rz {a}");
        assert_eq!(o[2], ru as f64, "ru {a}");
        assert_eq!(o[3], rd as f64, "rd {a}");
        // f32 add/mul: the exact result is representable in f64 when the exponents are close
        // (products of two f32 always are); check the bracket and the nearest.
        let (fa, fb) = (a as f32, b as f32);
        let sum = fa as f64 + fb as f64;
        let prod = fa as f64 * fb as f64;
        if !(fa.is_finite() && fb.is_finite() && (fa * fb).is_finite()) {
            continue;
        }
        assert_eq!(o[4], (fa + fb) as f64);
        let near = |x: f64| x as f32;
        let up = |x: f64| {
            let r = near(x);
            if (r as f64) >= x {
                r
            } else {
                f32_next_up(r)
            }
        };
        let down = |x: f64| {
            let r = near(x);
            if (r as f64) <= x {
                r
            } else {
                f32_next_down(r)
            }
        };
        if (sum - fa as f64 - fb as f64) == 0.0
            && ((sum - fa as f64) - fb as f64) == 0.0
            && (sum - fb as f64) == fa as f64
        {
            assert_eq!(o[5], up(sum) as f64, "fadd_ru {fa} {fb}");
            assert_eq!(o[6], down(sum) as f64, "fadd_rd {fa} {fb}");
        }
        assert_eq!(o[7], up(prod) as f64, "fmul_ru {fa} {fb}");
        assert_eq!(o[8], down(prod) as f64, "fmul_rd {fa} {fb}");
        // f64 add/mul directed: bracket the nearest and differ from it by at most one ulp.
        let (sn, pn) = (a + b, a * b);
        assert!(
            o[9] >= sn
                && o[10] <= sn
                && o[9] - o[10] <= 2.0 * (sn.abs() * f64::EPSILON).max(f64::MIN_POSITIVE)
        );
        assert!(o[11] >= pn && o[12] <= pn);
        // f16: one round-to-nearest-even from f64 (and from f32), as the half crate does.
        assert_eq!(o[13] as u16, half::f16::from_f64(a).to_bits(), "d2h {a}");
        assert_eq!(
            o[14] as u16,
            half::f16::from_f32(a as f32).to_bits(),
            "f2h {a}"
        );
        let bits = ((i as u64 * 2654435761u64) & 0xffff) as u16;
        let h = half::f16::from_bits(bits);
        if h.is_nan() {
            assert!(o[15].is_nan())
        } else {
            assert_eq!(o[15], h.to_f64(), "h2f {bits:#x}")
        }
    }
}
