//! KV-cache methods for the decode loop: every cache of the method registry
//! (`mosaickv-methods`: MosaicKV and the SPEC.md section 12 baselines) as an engine
//! [`LayerKv`], built from a [`Method`], the name a user picks on the command line
//! (`mosaickv_spec::method` parses it, with every default).
//!
//! Prefill stays dense and shared (issue 4): one [`crate::Model::prefill`] per prompt, then each
//! method's caches take the same per-layer K/V through `prefill` and decode from there.
//! Every layer is compressed, except where the method's description says otherwise: `quest`
//! keeps its first [`QUEST_DENSE_LAYERS`] layers dense as Quest's code does (`layer_id < 2`
//! runs dense attention in `evaluation/quest_attention.py`); those layers' f16 bytes are
//! counted in its bytes per token (docs/ACCURACY.md). The registry says which layers are
//! dense; the engine serves them with its own [`FullKv`].

use crate::kv::{FullKv, LayerKv};
use crate::{EngineError, Result};
pub use mosaickv_methods::{
    has_oracle, Implementation, Method, Mode, MosaicRun, Options, NAIVE2D_DEFAULT_RETENTION,
    QUEST_DENSE_LAYERS,
};
use mosaickv_methods::{layer_cache, LayerCache};
use mosaickv_spec::{KvCache, KvShape, MosaicError};
use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2};

/// The name this crate used for [`Implementation`] before the registry.
pub type MosaicBackend = Implementation;

impl From<MosaicError> for EngineError {
    /// A method or cache refusal: the message as the cache wrote it.
    fn from(e: MosaicError) -> Self {
        match e {
            MosaicError::InvalidConfig(m) => EngineError::Invalid(m),
            other => EngineError::Invalid(other.to_string()),
        }
    }
}

/// Any [`KvCache`] as a [`LayerKv`]: errors become strings, `bytes()` is the device bytes of
/// `memory()` (SPEC.md section 13, every byte counted).
pub struct KvAdapter(pub Box<dyn KvCache>);

impl LayerKv for KvAdapter {
    fn prefill(&mut self, keys: ArrayView3<f32>, values: ArrayView3<f32>) -> Result<(), String> {
        self.0.prefill(keys, values).map_err(|e| e.to_string())
    }
    fn append(&mut self, key: ArrayView2<f32>, value: ArrayView2<f32>) -> Result<(), String> {
        self.0.append(key, value).map_err(|e| e.to_string())
    }
    fn attend(&mut self, queries: ArrayView2<f32>, out: ArrayViewMut2<f32>) -> Result<(), String> {
        self.0.attend(queries, out).map_err(|e| e.to_string())
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn bytes(&self) -> usize {
        self.0.memory().device_bytes()
    }
    fn bytes_bound(&self, more: usize) -> Option<usize> {
        self.0.device_bytes_bound(more)
    }
    fn set_query_stats(&mut self, stats: mosaickv_spec::QueryStats) -> Result<(), String> {
        self.0
            .set_query_stats(Some(stats))
            .map_err(|e| e.to_string())
    }
    fn host_bytes(&self) -> usize {
        self.0.memory().host_bytes()
    }
    fn memory_report(&self) -> Option<mosaickv_spec::MemoryReport> {
        Some(self.0.memory())
    }
}

/// A layer cache that can also say which tokens it attends for given queries (for recall@k,
/// SPEC.md section 16). `None`: every token.
pub trait ProbeKv: LayerKv {
    /// Token indices attended per query head for queries `[q_heads, head_dim]`.
    fn attended(&self, queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>, String>;
}

impl ProbeKv for FullKv {
    fn attended(&self, _queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>, String> {
        Ok(None)
    }
}

impl ProbeKv for KvAdapter {
    fn attended(&self, queries: ArrayView2<f32>) -> Result<Option<Vec<Vec<usize>>>, String> {
        self.0.attended(queries).map_err(|e| e.to_string())
    }
}

/// The engine's caches of a [`Method`]: one per layer of a loaded model.
pub trait Caches {
    /// One empty cache per layer for a model of this configuration (the method is checked
    /// against its head_dim first): MosaicKV as the production live cache, its segment
    /// closes on a background worker per layer (SPEC.md section 10.4).
    fn new_caches(&self, cfg: &crate::Config) -> Result<Vec<Box<dyn LayerKv>>>;
    /// As [`Caches::new_caches`], with caches that report their attended tokens (for
    /// `fidelity`); MosaicKV's closes run inline, so that the selection read between steps is
    /// the one attention used.
    fn new_probe_caches(&self, cfg: &crate::Config) -> Result<Vec<Box<dyn ProbeKv>>>;
}

impl Caches for Method {
    fn new_caches(&self, cfg: &crate::Config) -> Result<Vec<Box<dyn LayerKv>>> {
        let options = Options {
            mosaic: MosaicRun::Live(Mode::Async),
            ..Options::default()
        };
        per_layer(self, cfg, &options, |d| Box::new(d), |c| Box::new(c))
    }

    fn new_probe_caches(&self, cfg: &crate::Config) -> Result<Vec<Box<dyn ProbeKv>>> {
        let options = Options {
            mosaic: MosaicRun::Whole,
            ..Options::default()
        };
        per_layer(self, cfg, &options, |d| Box::new(d), |c| Box::new(c))
    }
}

/// One empty cache per layer of a model of configuration `cfg` (the method checked against its
/// head_dim first): the engine's [`FullKv`] where the method's layer rule keeps a layer dense,
/// the registry's cache elsewhere, each boxed as the caller's trait object.
fn per_layer<T: ?Sized>(
    method: &Method,
    cfg: &crate::Config,
    options: &Options,
    dense: fn(FullKv) -> Box<T>,
    cache: fn(KvAdapter) -> Box<T>,
) -> Result<Vec<Box<T>>> {
    checked_for_model(method, cfg.head_dim)?;
    let shape = shape_of(cfg)?;
    (0..cfg.n_layers)
        .map(|layer| {
            Ok(
                match layer_cache(method, shape, layer, cfg.n_layers, options)? {
                    LayerCache::Dense => dense(FullKv::new(shape.kv_heads, shape.head_dim)),
                    LayerCache::Cache(c) => cache(KvAdapter(c)),
                },
            )
        })
        .collect()
}

/// The method checked against the loaded model's head_dim, a MosaicKV refusal naming both.
fn checked_for_model(method: &Method, head_dim: usize) -> Result<()> {
    method.validate_for(head_dim).map_err(|e| match method {
        Method::Mosaic { .. } => {
            EngineError::Invalid(format!("{method} for the model's head_dim {head_dim}: {e}"))
        }
        _ => e.into(),
    })
}

fn shape_of(cfg: &crate::Config) -> Result<KvShape> {
    Ok(KvShape::new(cfg.kv_heads, cfg.q_heads, cfg.head_dim)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quest_keeps_its_first_two_layers_dense_and_the_others_compressed() {
        let cfg = crate::Config {
            arch: crate::Arch::Llama,
            n_layers: 4,
            hidden: 6 * 64,
            ffn: 4 * 6 * 64,
            q_heads: 6,
            kv_heads: 2,
            head_dim: 64,
            vocab: 16,
            rope_theta: 10000.0,
            rope: crate::RopeStyle::Interleaved,
            rms_eps: 1e-5,
            context_length: 4096,
            tied_embeddings: true,
            qkv_bias: false,
        };
        let kv = ndarray::Array3::from_shape_fn((100, 2, 64), |(t, h, i)| {
            ((t * 7 + h * 3 + i) % 11) as f32 / 11.0 - 0.5
        });
        let bytes = |m: &str| -> Vec<usize> {
            let method = Method::parse(m).unwrap();
            let mut caches = method.new_caches(&cfg).unwrap();
            caches
                .iter_mut()
                .map(|c| {
                    c.prefill(kv.view(), kv.view()).unwrap();
                    c.bytes()
                })
                .collect()
        };
        let dense = 100 * 4 * 2 * 64;
        let pages = 7 * 4 * 2 * 64; // f16 min and max per 16-token page
        assert_eq!(
            bytes("quest"),
            vec![dense, dense, dense + pages, dense + pages]
        );
        assert_eq!(bytes("quest:dense=0"), vec![dense + pages; 4]);
        assert_eq!(bytes("full"), vec![dense; 4]);
        assert_eq!(bytes("kvq8"), vec![100 * 2 * 2 * 2 * 34; 4]);
        assert_eq!(bytes("kvq4"), vec![100 * 2 * 2 * 2 * 18; 4]);
    }
}
