//! TurboQuant (SPEC.md section 12, vLLM's `turboquant_<preset>` KV cache): the optimized cache
//! against the reference. The stored slots must be equal byte for byte, and so must the
//! attention output: the optimized cache runs the reference's f32 operations in the
//! reference's order (each token's dot product over ascending dims, one lane per token; the
//! online softmax token by token), so the derived tolerance is zero, as for kvq8 / kvq4.

use mosaickv_conformance::{queries, structured_kv};
use mosaickv_optimized::turboquant::{
    fp8_e4m3 as opt_fp8, fp8_e4m3_table, TurboQuantCache as OptTq,
};
use mosaickv_reference::turboquant::{
    fp8_e4m3 as ref_fp8, fp8_e4m3_value, TurboQuantCache as RefTq,
};
use mosaickv_spec::turboquant::TurboQuantPreset;
use mosaickv_spec::{KvCache, KvShape, MosaicError};
use ndarray::{s, Array2, Array3};

fn bits(a: &Array2<f32>) -> Vec<u32> {
    a.iter().map(|x| x.to_bits()).collect()
}

fn attend_both(r: &mut RefTq, o: &mut OptTq, q: &Array2<f32>) -> (Array2<f32>, Array2<f32>) {
    let (mut a, mut b) = (Array2::zeros(q.dim()), Array2::zeros(q.dim()));
    r.attend(q.view(), a.view_mut()).unwrap();
    o.attend(q.view(), b.view_mut()).unwrap();
    (a, b)
}

#[test]
fn same_slots_memory_and_attention_as_the_reference() {
    // every preset; head sizes 32, 64 and 128; GQA groups of 1, 3 and 6 (Qwen2.5-1.5B's);
    // prompts not a multiple of the eight-token lanes; appended tokens; small random queries
    // and needle queries (logits about 11 above the rest, the online softmax's rescale path)
    for (kv_heads, gqa, head_dim) in [(1, 1, 32), (3, 3, 64), (2, 6, 128), (1, 4, 128)] {
        let shape = KvShape::new(kv_heads, kv_heads * gqa, head_dim).unwrap();
        let (n, gen) = (301, 19);
        let (k, v) = structured_kv(n + gen, kv_heads, head_dim, 17 + head_dim as u64);
        for preset in TurboQuantPreset::ALL {
            let mut r = RefTq::new(shape, preset).unwrap();
            let mut o = OptTq::new(shape, preset).unwrap();
            r.prefill(k.slice(s![..n, .., ..]), v.slice(s![..n, .., ..]))
                .unwrap();
            o.prefill(k.slice(s![..n, .., ..]), v.slice(s![..n, .., ..]))
                .unwrap();
            assert_eq!(r.slots(), o.slots(), "{preset:?} D={head_dim} prefill");
            for t in n..n + gen {
                let (kt, vt) = (k.slice(s![t, .., ..]), v.slice(s![t, .., ..]));
                r.append(kt, vt).unwrap();
                o.append(kt, vt).unwrap();
                if t % 7 == 0 || t == n + gen - 1 {
                    let q = queries(shape.q_heads, head_dim, t as u64);
                    let (a, b) = attend_both(&mut r, &mut o, &q);
                    assert_eq!(bits(&a), bits(&b), "{preset:?} D={head_dim} t={t}");
                }
            }
            let kv = k.slice(s![..n + gen, .., ..]).to_owned();
            let needles = mosaickv_reference::synthetic::queries(shape.q_heads, head_dim, &kv, 4);
            let (a, b) = attend_both(&mut r, &mut o, &needles);
            assert_eq!(bits(&a), bits(&b), "{preset:?} D={head_dim} needles");
            assert_eq!(r.slots(), o.slots(), "{preset:?} D={head_dim}");
            assert_eq!(r.memory(), o.memory());
            assert_eq!(
                o.memory().values,
                (n + gen) * kv_heads * preset.slot_bytes(head_dim)
            );
        }
    }
}

#[test]
fn fp8_codes_and_values_are_the_references() {
    let table = fp8_e4m3_table();
    for code in 0u8..=255 {
        let (a, b) = (table[code as usize], fp8_e4m3_value(code));
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "{code:#x}"
        );
    }
    let mut x = -500.0f32;
    while x < 500.0 {
        for y in [x, x * 1e-3, x * 1e-5] {
            assert_eq!(opt_fp8(y), ref_fp8(y), "{y}");
        }
        x += 0.37;
    }
}

#[test]
fn refusals_are_the_references() {
    let shape = KvShape::new(2, 4, 64).unwrap();
    // a key too large for its f16 norm (every element f16-storable)
    let mut k = Array3::from_elem((3, 2, 64), 1.0f32);
    k.slice_mut(s![1, 1, ..]).fill(60000.0);
    let v = Array3::from_elem((3, 2, 64), 0.5f32);
    let mut r = RefTq::new(shape, TurboQuantPreset::Bit4Nc).unwrap();
    let mut o = OptTq::new(shape, TurboQuantPreset::Bit4Nc).unwrap();
    let (a, b) = (
        r.prefill(k.view(), v.view()).unwrap_err(),
        o.prefill(k.view(), v.view()).unwrap_err(),
    );
    assert!(matches!(a, MosaicError::NonFinite { .. }), "{a:?}");
    assert_eq!(format!("{a:?}"), format!("{b:?}"));
    assert_eq!(o.len(), 0, "a refused prompt stores nothing");
    // attending an empty cache, a second prefill, a bad head size
    let q = Array2::<f32>::zeros((4, 64));
    let mut out = Array2::<f32>::zeros((4, 64));
    assert!(matches!(
        o.attend(q.view(), out.view_mut()),
        Err(MosaicError::EmptyCache)
    ));
    let ok = Array3::from_elem((3, 2, 64), 0.25f32);
    o.prefill(ok.view(), ok.view()).unwrap();
    assert!(matches!(
        o.prefill(ok.view(), ok.view()),
        Err(MosaicError::AlreadyPrefilled(3))
    ));
    assert!(OptTq::new(KvShape::new(1, 1, 96).unwrap(), TurboQuantPreset::Bit4Nc).is_err());
    assert!(OptTq::new(KvShape::new(1, 1, 96).unwrap(), TurboQuantPreset::K8V4).is_ok());
}
