//! `mosaickv compress`: K/V `.npy` files to a cache directory (SPEC.md sections 10.1, 15).

use crate::cachedir;
use crate::error::{io, CliError};
use crate::npy;
use mosaickv_reference::MosaicCache;
use mosaickv_spec::cache::DenseRows;
use mosaickv_spec::persist::{save_cache, save_dense};
use mosaickv_spec::{f16, validate, CompressConfig, KvCache, KvShape, MosaicError};
use std::path::PathBuf;

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
    /// Query heads that will read this cache (default: kv_heads).
    #[arg(long)]
    pub q_heads: Option<usize>,
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
    validate::prompt_kv(&shape, &keys.view(), &values.view())?;
    if tokens == 0 {
        return Err(MosaicError::EmptyCache.into());
    }
    let mut cache = MosaicCache::new(shape, config)?;
    cache.prefill(keys.view(), values.view())?;

    std::fs::create_dir_all(&a.out).map_err(|e| io(&a.out, e))?;
    let compressed = cache.compressed();
    let (hk, hv) = cache.host_rows();
    save_cache(&cachedir::cache_path(&a.out), compressed, hk, hv)?;
    let dense = DenseRows {
        tokens,
        keys: keys.iter().map(|&x| f16::from_f32(x)).collect(),
        values: values.iter().map(|&x| f16::from_f32(x)).collect(),
    };
    save_dense(&cachedir::dense_path(&a.out), &shape, &dense)?;
    let m = cachedir::memory(compressed, hk, hv);
    let manifest = cachedir::manifest(compressed, &m);
    let text = serde_json::to_string_pretty(&manifest)
        .map_err(|e| CliError::Input(format!("manifest: {e}")))?;
    let mpath = cachedir::manifest_path(&a.out);
    std::fs::write(&mpath, text + "\n").map_err(|e| io(&mpath, e))?;
    println!(
        "compressed {tokens} tokens into {} segments: {:.2} bytes/token vs {:.0} dense f16 (ratio {:.4}); wrote {}",
        compressed.segments.len(),
        m.bytes_per_token(),
        mosaickv_spec::MemoryReport::dense_f16_bytes_per_token(&shape),
        m.bytes_per_token() / mosaickv_spec::MemoryReport::dense_f16_bytes_per_token(&shape),
        a.out.display()
    );
    Ok(())
}
