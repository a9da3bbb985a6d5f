//! `mosaickv compress`: K/V `.npy` files to a cache directory (SPEC.md sections 10.1, 15).

use crate::backend::Backend;
use crate::cachedir;
use crate::error::{io, CliError};
use crate::npy;
use mosaickv_methods::{Implementation, Method, MosaicRun, Options};
use mosaickv_spec::atomic::Pending;
use mosaickv_spec::cache::DenseRows;
use mosaickv_spec::persist::{write_cache, write_dense};
use mosaickv_spec::{
    f16, validate, CompressConfig, CompressedCache, KvShape, MemoryReport, MosaicError,
};
use ndarray::Array3;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    /// Keys [tokens, kv_heads, head_dim], float32 or float16 .npy (post-RoPE).
    #[arg(long)]
    pub keys: PathBuf,
    /// Values [tokens, kv_heads, head_dim], float32 or float16 .npy.
    #[arg(long)]
    pub values: PathBuf,
    /// JSON configuration (any subset of the keys of SPEC.md section 2).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Deprecated, not needed: `attend` takes q_heads from its queries. Still accepted (a
    /// positive multiple of kv_heads) and recorded in the cache's shape; default kv_heads.
    #[arg(long)]
    pub q_heads: Option<usize>,
    /// Which implementation compresses; both write the same bytes (SPEC.md sections 5-7).
    #[arg(long, value_enum, default_value_t = Backend::Optimized)]
    pub backend: Backend,
    /// Output directory (created if missing).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(a: Args) -> Result<(), CliError> {
    let config = match &a.config {
        Some(p) => CompressConfig::from_json(&std::fs::read_to_string(p).map_err(|e| io(p, e))?)?,
        None => CompressConfig::default(),
    };
    let keys = npy::read3(&a.keys, "keys")?;
    let values = npy::read3(&a.values, "values")?;
    let (tokens, kv_heads, head_dim) = keys.dim();
    let shape = KvShape::new(kv_heads, a.q_heads.unwrap_or(kv_heads), head_dim)?;
    if a.q_heads.is_some() {
        eprintln!(
            "mosaickv: warning: --q-heads is deprecated and not needed: attend takes q_heads from its queries"
        );
    }
    validate::prompt_kv(&shape, &keys.view(), &values.view())?;
    if tokens == 0 {
        return Err(MosaicError::EmptyCache.into());
    }
    // The method registry's MosaicKV cache on the chosen implementation, every close inline.
    let implementation = match a.backend {
        Backend::Optimized => Implementation::Optimized,
        Backend::Reference => Implementation::Reference,
    };
    let method = Method::Mosaic {
        implementation,
        config,
    };
    let options = Options {
        implementation,
        mosaic: MosaicRun::Whole,
    };
    let mut cache = mosaickv_methods::cache(&method, shape, &options)?;
    cache.prefill(keys.view(), values.view())?;
    // A prefill leaves no open segment and an empty buffer (SPEC.md section 10.1): no host
    // rows to save, on either implementation.
    if cache.memory().host_rows != 0 {
        return Err(CliError::Input(
            "a prefilled cache kept host rows; SPEC.md section 10.1 leaves none".into(),
        ));
    }
    let compressed = cache
        .compressed()
        .expect("a MosaicKV cache has a compressed cache");
    write_dir(&a.out, compressed, (&[], &[]), &keys, &values)
}

/// Writes `cache.mkv`, `dense.mkv` and `manifest.json` into `out` and prints the summary line.
/// The three files change together or not at all: each is written and synced under a
/// temporary name first, and only when all three are on disk are they renamed over the old
/// ones (`mosaickv_spec::atomic`), so a failed write (a full disk, a file-size limit, a kill)
/// leaves a previous cache directory byte for byte as it was.
fn write_dir(
    out: &Path,
    compressed: &CompressedCache,
    (host_keys, host_values): (&[f32], &[f32]),
    keys: &Array3<f32>,
    values: &Array3<f32>,
) -> Result<(), CliError> {
    let shape = compressed.shape;
    let tokens = keys.dim().0;
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    let mut cache_bytes = Vec::new();
    write_cache(&mut cache_bytes, compressed, host_keys, host_values)?;
    let dense = DenseRows {
        tokens,
        keys: keys.iter().map(|&x| f16::from_f32(x)).collect(),
        values: values.iter().map(|&x| f16::from_f32(x)).collect(),
    };
    let mut dense_bytes = Vec::new();
    write_dense(&mut dense_bytes, &shape, &dense)?;
    drop(dense);
    let m = cachedir::memory(compressed, host_keys, host_values);
    let manifest = cachedir::manifest(compressed, &m);
    let text = serde_json::to_string_pretty(&manifest)
        .map_err(|e| CliError::Input(format!("manifest: {e}")))?
        + "\n";
    let files = [
        (cachedir::cache_path(out), cache_bytes),
        (cachedir::dense_path(out), dense_bytes),
        (cachedir::manifest_path(out), text.into_bytes()),
    ];
    let mut pending = Vec::with_capacity(files.len());
    for (path, bytes) in &files {
        let p = Pending::prepare(path, |f| std::io::Write::write_all(f, bytes))
            .map_err(|e| io(path, e))?;
        pending.push((path, p));
    }
    for (path, p) in pending {
        p.commit().map_err(|e| io(path, e))?;
    }
    let dense_bpt = MemoryReport::dense_f16_bytes_per_token(&shape);
    println!(
        "compressed {tokens} tokens into {} segments: {:.2} bytes/token vs {dense_bpt:.0} dense f16 (ratio {:.4}); wrote {}",
        compressed.segments.len(),
        m.bytes_per_token(),
        m.bytes_per_token() / dense_bpt,
        out.display()
    );
    Ok(())
}
