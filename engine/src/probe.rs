//! Per-layer fidelity probes for the decode loop (issue 4, `mosaickv fidelity`).
//!
//! A [`LayerProbe`] is a [`LayerKv`] that drives the decode with the dense [`FullKv`] and,
//! beside it, feeds the same K/V and the same queries to one cache per method; at every attend
//! it records each method's attention-output relative L2 error and recall@k against full
//! attention (SPEC.md section 16). The model's trajectory is the full cache's, so each layer's
//! error is measured on identical inputs (no error compounding across layers).

use crate::kv::{FullKv, LayerKv};
use crate::methods::ProbeKv;
use mosaickv_spec::metrics::{full_attention_probs, recall_at_k, rel_l2};
use ndarray::{Array2, ArrayView2, ArrayView3, ArrayViewMut2};
use std::sync::{Arc, Mutex};

/// One measurement: a method's attention output at one layer and decode step.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeRecord {
    pub layer: usize,
    /// Index into the probe's method list.
    pub method: usize,
    /// Cached tokens at the time of the measurement (including the current one).
    pub tokens: usize,
    /// SPEC.md section 16 relative L2 error against the dense f16 output.
    pub rel_l2: f64,
    /// SPEC.md section 16 recall@k (1.0 for a method that attends every token).
    pub recall: f64,
}

/// Shared sink of [`ProbeRecord`]s; `enabled` switches recording on for chosen decode steps.
#[derive(Debug, Default)]
pub struct ProbeLog {
    pub records: Vec<ProbeRecord>,
    pub enabled: bool,
}

/// See the module documentation.
pub struct LayerProbe {
    layer: usize,
    full: FullKv,
    /// f32 keys `[tokens][kv_heads][head_dim]` for the exact attention probabilities.
    keys: Vec<f32>,
    kv_heads: usize,
    head_dim: usize,
    methods: Vec<Box<dyn ProbeKv>>,
    recall_k: usize,
    log: Arc<Mutex<ProbeLog>>,
}

impl LayerProbe {
    /// A probe for `layer` comparing `methods` (one empty cache each) with full attention.
    pub fn new(
        layer: usize,
        kv_heads: usize,
        head_dim: usize,
        methods: Vec<Box<dyn ProbeKv>>,
        recall_k: usize,
        log: Arc<Mutex<ProbeLog>>,
    ) -> Self {
        Self {
            layer,
            full: FullKv::new(kv_heads, head_dim),
            keys: Vec::new(),
            kv_heads,
            head_dim,
            methods,
            recall_k,
            log,
        }
    }
}

impl LayerKv for LayerProbe {
    fn set_query_stats(&mut self, stats: mosaickv_spec::QueryStats) -> Result<(), String> {
        for m in &mut self.methods {
            m.set_query_stats(stats.clone())?;
        }
        Ok(())
    }
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<(), String> {
        self.full.prefill(keys, values)?;
        self.keys.extend(keys.iter());
        for m in &mut self.methods {
            m.prefill(keys, values)?;
        }
        Ok(())
    }

    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<(), String> {
        self.full.append(key, value)?;
        self.keys.extend(key.iter());
        for m in &mut self.methods {
            m.append(key, value)?;
        }
        Ok(())
    }

    fn attend(
        &mut self,
        queries: ArrayView2<f32>,
        mut out: ArrayViewMut2<f32>,
    ) -> Result<(), String> {
        self.full.attend(queries, out.view_mut())?;
        let enabled = self.log.lock().map_err(|_| "probe log poisoned")?.enabled;
        if !enabled {
            return Ok(());
        }
        let n = self.full.len();
        let keys = ArrayView3::from_shape((n, self.kv_heads, self.head_dim), &self.keys[..])
            .map_err(|e| e.to_string())?;
        let probs = full_attention_probs(keys, queries);
        let mut recs = Vec::with_capacity(self.methods.len());
        for (i, m) in self.methods.iter_mut().enumerate() {
            let mut o = Array2::<f32>::zeros(out.dim());
            m.attend(queries, o.view_mut())?;
            let recall = match m.attended(queries)? {
                Some(sets) => recall_at_k(&sets, probs.view(), self.recall_k),
                None => 1.0,
            };
            recs.push(ProbeRecord {
                layer: self.layer,
                method: i,
                tokens: n,
                rel_l2: rel_l2(o.view(), out.view()),
                recall,
            });
        }
        self.log
            .lock()
            .map_err(|_| "probe log poisoned")?
            .records
            .extend(recs);
        Ok(())
    }

    fn len(&self) -> usize {
        self.full.len()
    }

    fn bytes(&self) -> usize {
        self.full.bytes()
    }
}

/// Mean next-token KL divergence `KL(p_full || p_method)` (natural log) of two logit vectors,
/// and whether their argmaxes agree.
pub fn kl_and_top1(full: &[f32], method: &[f32]) -> (f64, bool) {
    let lsm = |x: &[f32]| -> Vec<f64> {
        let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let z: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum();
        let lz = m + z.ln();
        x.iter().map(|&v| v as f64 - lz).collect()
    };
    let (lp, lq) = (lsm(full), lsm(method));
    let kl: f64 = lp.iter().zip(&lq).map(|(&a, &b)| a.exp() * (a - b)).sum();
    (kl.max(0.0), crate::argmax(full) == crate::argmax(method))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_is_zero_for_equal_logits_and_positive_otherwise() {
        let a = [1.0f32, 2.0, 3.0, -1.0];
        let (kl, top) = kl_and_top1(&a, &a);
        assert!(kl.abs() < 1e-12 && top);
        let b = [3.0f32, 2.0, 1.0, -1.0];
        let (kl, top) = kl_and_top1(&a, &b);
        assert!(kl > 0.5 && !top, "{kl}");
    }
}
