//! The on-disk format (SPEC.md section 15): exact round trip, and every
//! truncation and byte flip of a saved cache is an error, never a panic.

use mosaickv_spec::cache::{CompressedCache, DenseRows, HeadSegment, Segment, SegmentState};
use mosaickv_spec::config::{ChannelPolicy, CompressConfig, KvShape};
use mosaickv_spec::layout::{
    BlockMeta, PackedRows, RecordLayout, SideStrategy, Strategy, ValueDtype,
};
use mosaickv_spec::persist::{read_cache, read_dense, write_cache, write_dense, FORMAT_VERSION};
use mosaickv_spec::{f16, MosaicError};

/// splitmix64: deterministic test data without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

const KV: usize = 2;
const D: usize = 8;

fn dense(rng: &mut Rng, tokens: usize) -> DenseRows {
    let n = tokens * KV * D;
    DenseRows {
        tokens,
        keys: (0..n).map(|_| f16::from_f32(rng.f32())).collect(),
        values: (0..n).map(|_| f16::from_f32(rng.f32())).collect(),
    }
}

/// `count` valid records of `layout`: r/g random groups set, random values, zero padding.
fn packed(rng: &mut Rng, layout: &RecordLayout, count: usize) -> PackedRows {
    let rb = layout.record_bytes();
    let mut bytes = vec![0u8; count * rb];
    for rec in bytes.chunks_exact_mut(rb) {
        let mut chosen = Vec::new();
        while chosen.len() < layout.kept_groups() {
            let g = rng.below(layout.groups());
            if !chosen.contains(&g) {
                chosen.push(g);
            }
        }
        let mut word = 0u64;
        for g in chosen {
            word |= 1 << g;
        }
        let bb = layout.bitmap_bytes();
        rec[..bb].copy_from_slice(&word.to_le_bytes()[..bb]);
        if layout.dtype.is_quantized() {
            let q = layout.dtype.qmax() as usize;
            let codes: Vec<u8> = (0..layout.r).map(|_| rng.below(q + 1) as u8).collect();
            let p = mosaickv_spec::layout::QuantParams {
                min: f16::from_f32(rng.f32()),
                scale: f16::from_f32(rng.f32().abs() + 0.01),
            };
            mosaickv_spec::layout::write_quantized(layout.dtype, p, &codes, &mut rec[bb..]);
        } else {
            for i in 0..layout.r {
                let v = f16::from_f32(rng.f32()).to_le_bytes();
                rec[bb + 2 * i..bb + 2 + 2 * i].copy_from_slice(&v);
            }
        }
    }
    PackedRows { count, bytes }
}

fn side(rng: &mut Rng, kept_dims: usize, r: usize, g: usize) -> SideStrategy {
    // Every dtype occurs in the sample (SPEC.md section 6).
    let dtype = ValueDtype::ALL[rng.below(3)];
    SideStrategy {
        layout: RecordLayout {
            head_dim: D,
            kept_dims,
            r,
            group_size: g,
            dtype,
            code_bits: 0,
        },
        // columns shorter than a unit vector (SideStrategy::validate bounds their norm)
        rotation: (0..D * kept_dims)
            .map(|_| half::f16::from_f32(rng.f32() / D as f32))
            .collect(),
        fit_loss: rng.f32().abs() as f64 / 7.0,
        coding: Vec::new(),
    }
}

fn head(rng: &mut Rng, tokens: usize, block_size: usize) -> HeadSegment {
    let key = side(rng, 6, 2, 1);
    let value = side(rng, 6, 4, 2);
    let keys = packed(rng, &key.layout, tokens);
    let values = packed(rng, &value.layout, tokens);
    let mut meta = BlockMeta::empty(block_size, 6);
    // True bounds of the random records (section 7; checked on load): decoded values are
    // f16 in [-1, 1], or `m + code * s` with |m| <= 1, s <= 1.01, code <= 255.
    for b in 0..tokens.div_ceil(block_size) {
        let lo: Vec<f32> = (0..6).map(|_| -300.0 - rng.f32().abs()).collect();
        let hi: Vec<f32> = (0..6).map(|_| 300.0 + rng.f32().abs()).collect();
        meta.push_block(&lo, &hi, (tokens - b * block_size).min(block_size));
    }
    HeadSegment {
        strategy: Strategy {
            key,
            value,
            block_size,
        },
        keys,
        values,
        meta,
    }
}

fn config() -> CompressConfig {
    CompressConfig {
        channels: ChannelPolicy::Fixed {
            retention: 0.3,
            group_size: 2,
        },
        token_rate: 0.1 + 0.2,
        block_sizes: vec![4, 8],
        sink_tokens: 2,
        buffer_capacity: 16,
        max_segment_len: 64,
        input_segment_len: 10,
        ..CompressConfig::default()
    }
}

/// Sink 2 tokens, a closed segment of 10, an open one of 16, a buffer of 5,
/// host rows for the 21 open + buffer tokens.
fn sample() -> (CompressedCache, Vec<f32>, Vec<f32>) {
    let mut rng = Rng(7);
    let shape = KvShape::new(KV, 2 * KV, D).unwrap();
    let mut cache = CompressedCache::new(shape, config());
    cache.sink = dense(&mut rng, 2);
    cache.segments.push(Segment {
        start: 2,
        len: 10,
        state: SegmentState::Closed,
        heads: (0..KV).map(|_| head(&mut rng, 10, 4)).collect(),
    });
    cache.segments.push(Segment {
        start: 12,
        len: 16,
        state: SegmentState::Open,
        heads: (0..KV).map(|_| head(&mut rng, 16, 8)).collect(),
    });
    cache.buffer = dense(&mut rng, 5);
    let n = 21 * KV * D;
    let hk = (0..n).map(|_| rng.f32()).collect();
    let hv = (0..n).map(|_| rng.f32()).collect();
    (cache, hk, hv)
}

fn save(cache: &CompressedCache, hk: &[f32], hv: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    write_cache(&mut out, cache, hk, hv).expect("write");
    out
}

#[test]
fn round_trip_is_exact() {
    let (cache, hk, hv) = sample();
    let bytes = save(&cache, &hk, &hv);
    let (c2, hk2, hv2) = read_cache(&bytes).expect("read");
    assert_eq!(c2, cache);
    assert_eq!(
        hk2.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        hk.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!(
        hv2.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        hv.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    // Bit-exact: writing what was read gives the same bytes.
    assert_eq!(save(&c2, &hk2, &hv2), bytes);
    assert_eq!(&bytes[..8], b"MOSAICKV");
    assert_eq!(
        u32::from_le_bytes(bytes[8..12].try_into().unwrap()),
        FORMAT_VERSION
    );
}

#[test]
fn round_trip_without_host_rows_and_segments() {
    let (mut cache, _, _) = sample();
    let bytes = save(&cache, &[], &[]);
    let (c2, hk, hv) = read_cache(&bytes).unwrap();
    assert_eq!(c2, cache);
    assert!(hk.is_empty() && hv.is_empty());
    cache.segments.clear();
    cache.buffer = DenseRows::default();
    let (c3, _, _) = read_cache(&save(&cache, &[], &[])).unwrap();
    assert_eq!(c3, cache);
}

#[test]
fn write_refuses_inconsistent_caches() {
    let (cache, hk, hv) = sample();
    // Host rows for the wrong number of tokens.
    let mut out = Vec::new();
    let e = write_cache(
        &mut out,
        &cache,
        &hk[..hk.len() - KV * D],
        &hv[..hv.len() - KV * D],
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            MosaicError::ShapeMismatch {
                what: "host rows",
                ..
            }
        ),
        "{e}"
    );
    // An open segment that is not the last one.
    let mut c = cache.clone();
    c.segments[0].state = SegmentState::Open;
    assert!(write_cache(&mut Vec::new(), &c, &hk, &hv).is_err());
    // A gap between segments.
    let mut c = cache.clone();
    c.segments[1].start += 1;
    assert!(write_cache(&mut Vec::new(), &c, &hk, &hv).is_err());
    // A record with a bad bitmap.
    let mut c = cache.clone();
    c.segments[0].heads[1].keys.bytes[0] ^= 0xff;
    let e = write_cache(&mut Vec::new(), &c, &hk, &hv).unwrap_err();
    assert!(matches!(e, MosaicError::CorruptPacked(_)), "{e}");
    // Metadata of the wrong length.
    let mut c = cache.clone();
    c.segments[1].heads[0].meta.min.pop();
    assert!(write_cache(&mut Vec::new(), &c, &hk, &hv).is_err());
    // A missing scale, a negative scale, an i8 bound of -128, min above max.
    let mut c = cache.clone();
    c.segments[1].heads[0].meta.scale.pop();
    assert!(write_cache(&mut Vec::new(), &c, &hk, &hv).is_err());
    let mut c = cache.clone();
    c.segments[0].heads[0].meta.scale[0] = -1.0;
    assert!(write_cache(&mut Vec::new(), &c, &hk, &hv).is_err());
    let mut c = cache.clone();
    c.segments[0].heads[0].meta.min[0] = i8::MIN;
    assert!(write_cache(&mut Vec::new(), &c, &hk, &hv).is_err());
    let mut c = cache;
    c.segments[0].heads[0].meta.min[0] = 100;
    c.segments[0].heads[0].meta.max[0] = 99;
    assert!(write_cache(&mut Vec::new(), &c, &hk, &hv).is_err());
}

fn is_format_error(e: &MosaicError) -> bool {
    matches!(e, MosaicError::BadFormat(_) | MosaicError::CorruptPacked(_))
}

#[test]
fn every_truncation_is_bad_format() {
    let (cache, hk, hv) = sample();
    let bytes = save(&cache, &hk, &hv);
    for len in 0..bytes.len() {
        match read_cache(&bytes[..len]) {
            Err(e) => assert!(is_format_error(&e), "length {len}: {e}"),
            Ok(_) => panic!("truncation to {len} of {} bytes loaded", bytes.len()),
        }
    }
    let mut longer = bytes.clone();
    longer.push(0);
    let e = read_cache(&longer).unwrap_err();
    assert!(e.to_string().contains("trailing"), "{e}");
}

#[test]
fn random_byte_flips_are_bad_format() {
    let (cache, hk, hv) = sample();
    let bytes = save(&cache, &hk, &hv);
    let mut rng = Rng(42);
    for _ in 0..600 {
        let mut b = bytes.clone();
        let pos = rng.below(b.len());
        let mask = 1 + rng.below(255) as u8;
        b[pos] ^= mask;
        match read_cache(&b) {
            Err(e) => assert!(is_format_error(&e), "flip at {pos}: {e}"),
            Ok((c, k, v)) => {
                assert!(
                    c == cache && k == hk && v == hv,
                    "flip at {pos} loaded different content"
                );
                panic!("flip at {pos} went unnoticed");
            }
        }
    }
}

/// Recomputes every CRC, so mutations reach the structural checks behind them.
fn resign(b: &mut [u8]) {
    let crc = crc32fast::hash(&b[..16]);
    b[16..20].copy_from_slice(&crc.to_le_bytes());
    let count = u32::from_le_bytes(b[12..16].try_into().unwrap()) as usize;
    let mut pos = 24;
    for _ in 0..count {
        if pos + 16 > b.len() {
            return;
        }
        let len = u64::from_le_bytes(b[pos + 8..pos + 16].try_into().unwrap()) as usize;
        let end = (pos + 16).saturating_add(len).min(b.len());
        let mut h = crc32fast::Hasher::new();
        h.update(&b[pos..pos + 4]);
        h.update(&b[pos + 8..pos + 16]);
        h.update(&b[pos + 16..end]);
        let crc = h.finalize();
        b[pos + 4..pos + 8].copy_from_slice(&crc.to_le_bytes());
        pos = end;
    }
}

#[test]
fn resigned_mutations_never_panic() {
    let (cache, hk, hv) = sample();
    let bytes = save(&cache, &hk, &hv);
    let mut rng = Rng(3);
    let (mut errors, mut loaded) = (0, 0);
    for _ in 0..600 {
        let mut b = bytes.clone();
        for _ in 0..1 + rng.below(3) {
            let pos = rng.below(b.len());
            b[pos] ^= 1 << rng.below(8);
        }
        resign(&mut b);
        match read_cache(&b) {
            Err(e) => {
                assert!(is_format_error(&e), "{e}");
                errors += 1;
            }
            // A flipped value or rotation byte is a different but valid cache;
            // it must save and load back to itself.
            Ok((c, k, v)) => {
                let first = save(&c, &k, &v);
                let (c2, k2, v2) = read_cache(&first).expect("a loaded cache re-saves");
                assert!(save(&c2, &k2, &v2) == first, "re-saved cache differs");
                loaded += 1;
            }
        }
    }
    assert!(errors > 0 && loaded > 0, "errors {errors}, loaded {loaded}");
}

#[test]
fn sample_covers_every_dtype() {
    let (cache, _, _) = sample();
    for dtype in ValueDtype::ALL {
        assert!(
            cache.segments.iter().flat_map(|s| &s.heads).any(|h| {
                h.strategy.key.layout.dtype == dtype || h.strategy.value.layout.dtype == dtype
            }),
            "{dtype:?} missing from the sample"
        );
    }
    let m = cache.memory();
    assert!(m.scales > 0 && m.scales % 2 == 0);
}

#[test]
fn other_version_is_named() {
    let (cache, hk, hv) = sample();
    let mut b = save(&cache, &hk, &hv);
    assert_eq!(FORMAT_VERSION, 7);
    // Each is refused by name, never misread:
    // - version 6 (key fit_loss against the keys' energy): a continued generation would compare
    //   it with open-row losses against the keys' spread;
    // - version 5 (f32 rotations): each rotation would be taken as twice as many f16 values;
    // - version 4 (no budget floor in the manifest's configuration): its caches would attend
    //   a larger budget than they were written for;
    // - version 3 (no quantized dtypes): the file today's f16 caches would have been with the
    //   old code differs only in the version field.
    for version in [6u32, 5, 4, 3] {
        b[8..12].copy_from_slice(&version.to_le_bytes());
        resign(&mut b);
        let e = read_cache(&b).unwrap_err();
        let want = format!("unsupported format version {version}");
        assert!(
            matches!(e, MosaicError::BadFormat(ref m) if m.contains(&want)),
            "version {version}: {e}"
        );
    }
    // Version 2 (u64 bitmap words, D x D rotations) is refused by name.
    b[8..12].copy_from_slice(&2u32.to_le_bytes());
    resign(&mut b);
    let e = read_cache(&b).unwrap_err();
    assert!(
        matches!(e, MosaicError::BadFormat(ref m) if m.contains("version 2")),
        "{e}"
    );
    // Version 1 (f16 block metadata) is no longer read: a clean BadFormat.
    b[8..12].copy_from_slice(&1u32.to_le_bytes());
    resign(&mut b);
    let e = read_cache(&b).unwrap_err();
    assert!(
        matches!(e, MosaicError::BadFormat(ref m) if m.contains("unsupported format version 1")),
        "{e}"
    );
    let e = read_cache(b"NOTMOSAIC and more bytes").unwrap_err();
    assert!(e.to_string().contains("magic"), "{e}");
}

#[test]
fn resigned_bad_bitmap_is_corrupt_packed() {
    let (cache, hk, hv) = sample();
    let clean = save(&cache, &hk, &hv);
    // Find the first key record of segment 0 head 0 by its bytes.
    let rec = cache.segments[0].heads[0]
        .keys
        .record(&cache.segments[0].heads[0].strategy.key.layout, 0)
        .to_vec();
    let pos = clean
        .windows(rec.len())
        .position(|w| w == rec.as_slice())
        .unwrap();
    let mut b = clean.clone();
    b[pos] = 0xff; // popcount 8, r/g = 2
    resign(&mut b);
    let e = read_cache(&b).unwrap_err();
    assert!(matches!(e, MosaicError::CorruptPacked(_)), "{e}");
}

#[test]
fn dense_file_round_trip_and_kind_check() {
    let mut rng = Rng(9);
    let shape = KvShape::new(KV, KV, D).unwrap();
    let rows = dense(&mut rng, 13);
    let mut b = Vec::new();
    write_dense(&mut b, &shape, &rows).unwrap();
    let (s2, r2) = read_dense(&b).unwrap();
    assert_eq!((s2, &r2), (shape, &rows));
    let e = read_cache(&b).unwrap_err();
    assert!(e.to_string().contains("dense baseline"), "{e}");
    let (cache, hk, hv) = sample();
    let e = read_dense(&save(&cache, &hk, &hv)).unwrap_err();
    assert!(e.to_string().contains("compressed cache"), "{e}");
    for len in 0..b.len() {
        assert!(read_dense(&b[..len]).is_err());
    }
}

/// Builds a file from (kind, payload) sections with valid CRCs (SPEC.md 15.1-15.2).
fn file_of(sections: &[(u32, Vec<u8>)]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(b"MOSAICKV");
    b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    b.extend_from_slice(&(sections.len() as u32).to_le_bytes());
    let crc = crc32fast::hash(&b[..16]);
    b.extend_from_slice(&crc.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    for (kind, payload) in sections {
        let len = payload.len() as u64;
        let mut h = crc32fast::Hasher::new();
        h.update(&kind.to_le_bytes());
        h.update(&len.to_le_bytes());
        h.update(payload);
        b.extend_from_slice(&kind.to_le_bytes());
        b.extend_from_slice(&h.finalize().to_le_bytes());
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(payload);
    }
    b
}

/// Splits a valid file into its (kind, payload) sections.
fn sections_of(b: &[u8]) -> Vec<(u32, Vec<u8>)> {
    let count = u32::from_le_bytes(b[12..16].try_into().unwrap()) as usize;
    let mut pos = 24;
    let mut out = Vec::new();
    for _ in 0..count {
        let kind = u32::from_le_bytes(b[pos..pos + 4].try_into().unwrap());
        let len = u64::from_le_bytes(b[pos + 8..pos + 16].try_into().unwrap()) as usize;
        out.push((kind, b[pos + 16..pos + 16 + len].to_vec()));
        pos += 16 + len;
    }
    out
}

/// A manifest whose `kv_heads * head_dim` overflows usize (2 * 2^63 wraps to 0)
/// used to load, then divide by zero when saved. It is refused on load, and a
/// cache of that shape is refused on save, with a typed error.
#[test]
fn overflowing_shape_is_refused() {
    let shape = KvShape::new(2, 2, 8).unwrap();
    let cache = CompressedCache::new(shape, CompressConfig::default());
    let bytes = save(&cache, &[], &[]);
    let mut sections = sections_of(&bytes);
    assert_eq!(sections[0].0, 1, "the manifest comes first");
    let text = String::from_utf8(sections[0].1.clone()).unwrap();
    for (kv, q, d) in [
        (2u64, 2u64, 1u64 << 63),
        (1 << 33, 1 << 33, 1 << 31),
        (1, 1, u64::MAX),
    ] {
        let crafted = text.replacen(
            "\"kv_heads\":2,\"q_heads\":2,\"head_dim\":8",
            &format!("\"kv_heads\":{kv},\"q_heads\":{q},\"head_dim\":{d}"),
            1,
        );
        assert_ne!(crafted, text, "manifest text changed: {text}");
        sections[0].1 = crafted.into_bytes();
        let e = read_cache(&file_of(&sections)).expect_err("an overflowing shape must not load");
        assert!(is_format_error(&e), "{e}");
    }
    let mut wide = cache.clone();
    wide.shape = KvShape {
        kv_heads: 2,
        q_heads: 2,
        head_dim: 1 << 63,
    };
    assert!(write_cache(&mut Vec::new(), &wide, &[], &[]).is_err());
    assert!(KvShape::new(2, 2, 1 << 63).is_err());
    assert!(KvShape::new(1, 1 << 40, 1 << 30).is_err());
    assert!(KvShape::new(8, 32, 128).is_ok());
}

/// The `load_*` functions read only regular files, and check the 24-byte header before
/// reading the rest: `/dev/zero` (endless) and a directory are `BadFormat` at once, a file
/// of ours with a damaged version is refused without being read whole, and a good file
/// still loads.
#[test]
fn loading_reads_only_regular_files_and_checks_the_header_first() {
    use mosaickv_spec::persist::{load_cache, load_dense};
    let dir = std::env::temp_dir().join(format!("mkv-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for p in [std::path::Path::new("/dev/zero"), dir.as_path()] {
        if !p.exists() {
            continue;
        }
        for e in [load_cache(p).unwrap_err(), load_dense(p).unwrap_err()] {
            assert!(
                matches!(&e, MosaicError::BadFormat(m) if m.contains("not a regular file")),
                "{}: {e}",
                p.display()
            );
        }
    }
    let (cache, hk, hv) = sample();
    let bytes = save(&cache, &hk, &hv);
    let good = dir.join("cache.mkv");
    std::fs::write(&good, &bytes).unwrap();
    assert_eq!(load_cache(&good).unwrap().0, cache);
    // a wrong version: refused from the header (the file is otherwise whole)
    let mut old = bytes.clone();
    old[8..12].copy_from_slice(&(FORMAT_VERSION - 1).to_le_bytes());
    let bad = dir.join("old.mkv");
    std::fs::write(&bad, &old).unwrap();
    let e = load_cache(&bad).unwrap_err();
    assert!(
        matches!(&e, MosaicError::BadFormat(m) if m.contains("unsupported format version")),
        "{e}"
    );
    // shorter than the header
    std::fs::write(&bad, &bytes[..20]).unwrap();
    assert!(matches!(
        load_cache(&bad).unwrap_err(),
        MosaicError::BadFormat(_)
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A configuration, and every JSON section of a file, is an object of named keys: serde
/// would read a struct from an array by field position, so an array is refused.
#[test]
fn json_arrays_are_not_configurations() {
    for text in ["[0.5, 7]", "[]", "0.5", "null", "\"x\""] {
        let e = CompressConfig::from_json(text).unwrap_err();
        assert!(
            matches!(&e, MosaicError::InvalidConfig(m) if m.contains("JSON object")),
            "{text}: {e}"
        );
    }
    assert_eq!(
        CompressConfig::from_json("{}").unwrap(),
        CompressConfig::default()
    );
}

/// A stored f16 value that is not finite (encode never writes one, SPEC.md section 14) makes
/// a file `CorruptPacked` on load, even with every checksum recomputed.
#[test]
fn a_non_finite_f16_record_value_is_refused_on_load() {
    let (mut cache, hk, hv) = sample();
    let (s, h, side) = cache
        .segments
        .iter()
        .enumerate()
        .flat_map(|(s, seg)| seg.heads.iter().enumerate().map(move |(h, hd)| (s, h, hd)))
        .find_map(|(s, h, hd)| {
            if hd.strategy.key.layout.dtype == ValueDtype::F16 && hd.keys.count > 0 {
                Some((s, h, 0))
            } else if hd.strategy.value.layout.dtype == ValueDtype::F16 && hd.values.count > 0 {
                Some((s, h, 1))
            } else {
                None
            }
        })
        .expect("the sample has an f16 side");
    let good = cache.clone();
    let head = &mut cache.segments[s].heads[h];
    let (rows, layout) = if side == 0 {
        (&mut head.keys, &head.strategy.key.layout)
    } else {
        (&mut head.values, &head.strategy.value.layout)
    };
    let o = layout.bitmap_bytes(); // the first stored value of record 0
    let record = rows.bytes[..layout.record_bytes()].to_vec();
    rows.bytes[o..o + 2].copy_from_slice(&half::f16::INFINITY.to_le_bytes());
    let mut bytes = Vec::new();
    // refused on write (a written file always loads) ...
    let e = write_cache(&mut bytes, &cache, &hk, &hv).unwrap_err();
    assert!(
        matches!(&e, MosaicError::CorruptPacked(m) if m.contains("not finite")),
        "{e}"
    );
    // ... and in a file: the record's value patched in the saved bytes, checksums recomputed
    let mut bytes = save(&good, &hk, &hv);
    let at: Vec<usize> = (0..bytes.len() - record.len())
        .filter(|&i| bytes[i..i + record.len()] == record[..])
        .collect();
    assert!(!at.is_empty(), "the record's bytes are in the file");
    bytes[at[0] + o..at[0] + o + 2].copy_from_slice(&half::f16::INFINITY.to_le_bytes());
    resign(&mut bytes);
    let e = read_cache(&bytes).unwrap_err();
    assert!(
        matches!(&e, MosaicError::CorruptPacked(m) if m.contains("not finite")),
        "{e}"
    );
}

/// Issue 40, class 5: block metadata that does not bound its records (here a block scale of
/// 0, so every bound is 0) is refused on write and, in a file with valid checksums, on load
/// (SPEC.md sections 7 and 15.4).
#[test]
fn metadata_that_does_not_bound_its_keys_is_refused() {
    let (cache, hk, hv) = sample();
    let mut bad = cache.clone();
    let m = &mut bad.segments[0].heads[0].meta;
    m.scale[0] = 0.0;
    let mut out = Vec::new();
    let e = write_cache(&mut out, &bad, &hk, &hv).unwrap_err();
    assert!(
        matches!(&e, MosaicError::BadFormat(s) if s.contains("does not bound")),
        "{e}"
    );
    // The same damage in a file: the scale's bytes (the first head segment's first scale)
    // set to 0 and every checksum recomputed.
    let mut b = save(&cache, &hk, &hv);
    let pat = cache.segments[0].heads[0].meta.scale[0].to_le_bytes();
    let at: Vec<usize> = (0..b.len() - 3).filter(|&i| b[i..i + 4] == pat).collect();
    assert_eq!(at.len(), 1, "the scale's bytes occur once");
    b[at[0]..at[0] + 4].copy_from_slice(&0f32.to_le_bytes());
    resign(&mut b);
    let e = read_cache(&b).unwrap_err();
    assert!(
        matches!(&e, MosaicError::BadFormat(s) if s.contains("does not bound")),
        "{e}"
    );
}
