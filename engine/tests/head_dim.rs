//! Issue 13 item 8: a method's configuration is checked against the head_dim of the model that
//! is loaded, not a fixed 64. Runs on tiny crafted models (no download): head_dim 48, where a
//! group size of 3 is valid (it is not at 64), and head_dim 32, where 64 is not.

mod common;

use common::Tiny;
use mosaickv_engine::{argmax, Caches, EngineError, Method, Model};

/// Prefill of `n` tokens, then `steps` greedy decode steps, on `method`'s caches.
fn run(model: &Model, method: &Method, n: usize, steps: usize) -> Result<(), EngineError> {
    let prompt: Vec<u32> = (0..n).map(|i| 3 + (i * 7 % 5) as u32).collect();
    let pre = model.prefill(&prompt)?;
    let mut caches = method.new_caches(model.config())?;
    pre.fill(&mut caches)?;
    method.new_probe_caches(model.config())?;
    let mut logits = pre.logits.clone();
    for i in 0..steps {
        let t = argmax(&logits);
        logits = model.decode_step(t, n + i, &mut caches)?;
        assert!(logits.iter().all(|x| x.is_finite()));
    }
    Ok(())
}

#[test]
fn a_group_size_that_divides_the_model_head_dim_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let t = Tiny {
        hidden: 96,
        q_heads: 2,
        kv_heads: 1,
        ..Tiny::default()
    };
    let model = Model::load(&t.write(dir.path(), "hd48.gguf")).unwrap();
    assert_eq!(model.config().head_dim, 48);
    for name in [
        "mosaic:g=3:ret=0.5",
        "mosaic-ref:g=3:ret=0.5",
        "mosaic:gs=1/3",
    ] {
        // 3 does not divide 64: the old parse refused these for every model
        let m = Method::parse(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        m.validate_for(48).unwrap();
        assert!(m.validate_for(64).is_err(), "{name} at head_dim 64");
        run(&model, &m, 200, 3).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn a_group_size_that_does_not_divide_the_model_head_dim_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::load(&Tiny::default().write(dir.path(), "hd32.gguf")).unwrap();
    assert_eq!(model.config().head_dim, 32);
    for name in ["mosaic:g=64:ret=0.5", "mosaic-ref:gs=1/64"] {
        // valid at head_dim 64, so it parses; this model's 32 dims cannot hold a group of 64
        let m = Method::parse(name).unwrap();
        for e in [
            m.new_caches(model.config()).err(),
            m.new_probe_caches(model.config()).err(),
        ] {
            match e {
                Some(EngineError::Invalid(msg)) => assert!(msg.contains("head_dim 32"), "{msg}"),
                other => panic!("{name}: expected an Invalid error, got {other:?}"),
            }
        }
    }
}
