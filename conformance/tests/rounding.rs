//! SPEC.md notation: "f16 is IEEE binary16 with round-to-nearest-even", one rounding from
//! f64. The reference (`round::f16_from_f64`, power-of-two scaling) and the optimized
//! encoder (`round::f16_from_f64`, bit manipulation) are independent implementations of
//! that arithmetic; here they are compared on every f16 midpoint and its neighbours, the
//! subnormal range, the overflow edge and a million random f64 values.

use half::f16;
use mosaickv_optimized::round::f16_from_f64 as optimized;
use mosaickv_reference::round::f16_from_f64 as reference;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn same(x: f64) {
    let (a, b) = (reference(x), optimized(x));
    let ok = a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    assert!(
        ok,
        "{x:e} ({:#x}): reference {a} ({:#06x}), optimized {b} ({:#06x})",
        x.to_bits(),
        a.to_bits(),
        b.to_bits()
    );
}

#[test]
fn both_roundings_agree_everywhere_that_matters() {
    for bits in 0u16..0x7c00 {
        let a = f16::from_bits(bits).to_f64();
        let next = f16::from_bits(bits + 1).to_f64(); // 0x7c00 is +Inf: the overflow edge
        let mid = if next.is_finite() {
            0.5 * (a + next)
        } else {
            65520.0
        };
        for x in [
            a,
            mid,
            f64::from_bits(mid.to_bits() - 1),
            f64::from_bits(mid.to_bits() + 1),
        ] {
            same(x);
            same(-x);
        }
    }
    for x in [
        0.0,
        -0.0,
        65504.0,
        65519.999,
        65520.0,
        1e300,
        f64::INFINITY,
        f64::NAN,
        5e-324,
        2.9e-8,
        3.0e-8,
    ] {
        same(x);
        same(-x);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    for _ in 0..1_000_000 {
        // Exponents around the f16 range, random mantissas (and sign).
        let e: i32 = rng.gen_range(-40..20);
        let m: f64 = rng.gen_range(1.0..2.0);
        let x = m * 2f64.powi(e);
        same(if rng.gen() { x } else { -x });
    }
}
