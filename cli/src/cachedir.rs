//! The files of a cache directory and their human-readable summary.
//!
//! `DIR/cache.mkv` is the compressed cache (SPEC.md section 15.3),
//! `DIR/dense.mkv` the dense f16 K/V kept as baseline input (section 15.5),
//! `DIR/manifest.json` a summary for people (not read back by the tool).

use mosaickv_spec::cache::{CompressedCache, MemoryReport};
use mosaickv_spec::layout::SideStrategy;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

pub const CACHE_FILE: &str = "cache.mkv";
pub const DENSE_FILE: &str = "dense.mkv";
pub const MANIFEST_FILE: &str = "manifest.json";

pub fn cache_path(dir: &Path) -> PathBuf {
    dir.join(CACHE_FILE)
}
pub fn dense_path(dir: &Path) -> PathBuf {
    dir.join(DENSE_FILE)
}
pub fn manifest_path(dir: &Path) -> PathBuf {
    dir.join(MANIFEST_FILE)
}

/// The memory report of a loaded cache, with its host rows filled in.
pub fn memory(cache: &CompressedCache, host_keys: &[f32], host_values: &[f32]) -> MemoryReport {
    MemoryReport {
        host_rows: 4 * (host_keys.len() + host_values.len()),
        ..cache.memory()
    }
}

fn side_json(s: &SideStrategy, tokens: usize) -> Value {
    let l = &s.layout;
    json!({
        "r": l.r,
        "g": l.group_size,
        "kept_dims": l.kept_dims,
        "dtype": l.dtype.name(),
        "record_bytes": l.record_bytes(),
        "scale_bytes_per_record": l.scale_bytes(),
        "scale_bytes": tokens * l.scale_bytes(),
        "fit_loss": s.fit_loss,
    })
}

fn memory_json(cache: &CompressedCache, m: &MemoryReport) -> Value {
    let dense = MemoryReport::dense_f16_bytes_per_token(&cache.shape);
    let bpt = m.bytes_per_token();
    json!({
        "tokens": m.tokens,
        "values": m.values,
        "scales": m.scales,
        "bitmaps": m.bitmaps,
        "padding": m.padding,
        "block_meta": m.block_meta,
        "rotations": m.rotations,
        "dense_sink_and_buffer": m.dense,
        "headers": m.segment_headers,
        "device_bytes": m.device_bytes(),
        "host_rows_bytes_not_device": m.host_rows,
        "bytes_per_token": bpt,
        "dense_f16_bytes_per_token": dense,
        "ratio_to_dense_f16": if dense > 0.0 { bpt / dense } else { 0.0 },
    })
}

/// The `manifest.json` written by `compress`.
pub fn manifest(cache: &CompressedCache, m: &MemoryReport) -> Value {
    let segments: Vec<Value> = cache
        .segments
        .iter()
        .map(|s| {
            json!({
                "start": s.start,
                "len": s.len,
                "state": format!("{:?}", s.state),
                "heads": s.heads.iter().enumerate().map(|(h, hs)| json!({
                    "head": h,
                    "block_size": hs.strategy.block_size,
                    "key": side_json(&hs.strategy.key, s.len),
                    "value": side_json(&hs.strategy.value, s.len),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "format": format!("MosaicKV cache, format version {}", mosaickv_spec::persist::FORMAT_VERSION),
        "files": {
            CACHE_FILE: "the compressed cache (SPEC.md section 15.3); `attend --method mosaic` and `inspect` read it",
            DENSE_FILE: "BASELINE INPUT ONLY: the prompt's dense f16 K/V, for `attend --method full|quest|naive2d`; not part of the compressed cache and not counted in `memory`",
            MANIFEST_FILE: "this summary (informational; the tool does not read it)",
        },
        "shape": cache.shape,
        "tokens": cache.len(),
        "sink_tokens": cache.sink.tokens,
        "buffer_tokens": cache.buffer.tokens,
        "config": cache.config,
        "segments": segments,
        "memory": memory_json(cache, m),
    })
}

/// The text `inspect` prints (and `compress` ends with the summary line).
pub fn report_text(cache: &CompressedCache, m: &MemoryReport) -> String {
    let mut s = String::new();
    let sh = &cache.shape;
    let dense = MemoryReport::dense_f16_bytes_per_token(sh);
    let bpt = m.bytes_per_token();
    s += &format!(
        "shape: kv_heads {}, head_dim {} (q_heads recorded {}; attend takes q_heads from its queries); tokens {} (sink {}, segments {}, buffer {})\n",
        sh.kv_heads,
        sh.head_dim,
        sh.q_heads,
        cache.len(),
        cache.sink.tokens,
        cache.segment_tokens(),
        cache.buffer.tokens
    );
    s += "memory (device bytes, SPEC.md section 13):\n";
    for (name, v) in [
        ("retained values", m.values),
        ("value minimum + scale", m.scales),
        ("bitmaps", m.bitmaps),
        ("record padding", m.padding),
        ("block metadata", m.block_meta),
        ("rotations", m.rotations),
        ("dense sink + buffer", m.dense),
        ("segment/strategy headers", m.segment_headers),
    ] {
        s += &format!("  {name:<26}{v:>14}\n");
    }
    s += &format!("  {:<26}{:>14}\n", "total", m.device_bytes());
    s += &format!(
        "  {:<26}{:>14}  (host memory, not counted above)\n",
        "host f32 rows", m.host_rows
    );
    s += &format!(
        "bytes/token: {bpt:.2} vs dense f16 {dense:.0} (ratio {:.4})\n",
        if dense > 0.0 { bpt / dense } else { 0.0 }
    );
    for (i, seg) in cache.segments.iter().enumerate() {
        s += &format!(
            "segment {i}: tokens {}..{} ({}, {:?})\n",
            seg.start,
            seg.start + seg.len,
            seg.len,
            seg.state
        );
        for (h, hs) in seg.heads.iter().enumerate() {
            let st = &hs.strategy;
            let side = |x: &SideStrategy| {
                format!(
                    "r {} g {} kept_dims {} {} record {} B (scales {} B) fit_loss {:.4}",
                    x.layout.r,
                    x.layout.group_size,
                    x.layout.kept_dims,
                    x.layout.dtype.name(),
                    x.layout.record_bytes(),
                    seg.len * x.layout.scale_bytes(),
                    x.fit_loss
                )
            };
            s += &format!(
                "  head {h}: block {} | K {} | V {}\n",
                st.block_size,
                side(&st.key),
                side(&st.value)
            );
        }
    }
    s
}
