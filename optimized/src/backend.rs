//! [`CpuBackend`]: every stage of `mosaickv_spec::Backend` on the CPU.

use crate::attention::{packed_attention, MosaicScratch, SelectionSource};
use crate::simd::pad8;
use crate::simd::Path;
use crate::{meta, packed, strategy};
use mosaickv_spec::{
    validate, Availability, Backend, BlockMeta, CompressConfig, CompressedCache, MosaicError,
    PackedRows, Result, Selection, Side, SideStrategy,
};
use ndarray::{Array2, ArrayView2, ArrayViewMut2};
use std::borrow::Cow;
use std::sync::Mutex;

/// The optimized CPU backend. `new()` picks the widest kernels the CPU has (AVX-512, else
/// AVX2/FMA/F16C; see `Path::detect` for the environment switches); `portable()` always uses
/// the scalar path; `forced(path)` asks for one path and reports the backend unavailable
/// (running nothing) where the CPU lacks it.
#[derive(Debug)]
pub struct CpuBackend {
    path: Path,
    /// Why the requested path cannot run here (`forced` on a CPU without it).
    unavailable: Option<String>,
    scratch: Mutex<MosaicScratch>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl Clone for CpuBackend {
    fn clone(&self) -> Self {
        Self {
            unavailable: self.unavailable.clone(),
            ..Self::with_path(self.path)
        }
    }
}

/// Row-major contiguous data of a 2-D view.
pub(crate) fn contig<'a>(v: &ArrayView2<'a, f32>) -> Cow<'a, [f32]> {
    match v.to_slice() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(v.iter().copied().collect()),
    }
}

impl CpuBackend {
    /// Detects the CPU's features at run time; honours `MOSAICKV_FORCE_PORTABLE=1`.
    pub fn new() -> Self {
        Self::with_path(Path::detect())
    }

    /// The portable scalar path, whatever the CPU.
    pub fn portable() -> Self {
        Self::with_path(Path::Portable)
    }

    /// The AVX2 path, or `BackendUnavailable` when the CPU lacks AVX2, FMA or F16C.
    pub fn avx2() -> Result<Self> {
        if Path::Avx2.runs_here() {
            Ok(Self::with_path(Path::Avx2))
        } else {
            Err(MosaicError::BackendUnavailable(
                "CPU lacks avx2/fma/f16c".into(),
            ))
        }
    }

    /// The AVX-512 path, or `BackendUnavailable` when the CPU lacks AVX-512 F/BW/VL/VBMI2
    /// (or AVX2/FMA/F16C).
    pub fn avx512() -> Result<Self> {
        if Path::Avx512.runs_here() {
            Ok(Self::with_path(Path::Avx512))
        } else {
            Err(MosaicError::BackendUnavailable(
                "CPU lacks avx512f/bw/vl/vbmi2".into(),
            ))
        }
    }

    /// Exactly `path`: where the CPU cannot run it, a backend whose
    /// [`Backend::availability`] says why (the conformance suite then reports it skipped)
    /// and whose operations run the portable kernels.
    pub fn forced(path: Path) -> Self {
        let made = match path {
            Path::Portable => Ok(Self::portable()),
            Path::Avx2 => Self::avx2(),
            Path::Avx512 => Self::avx512(),
        };
        made.unwrap_or_else(|e| Self {
            unavailable: Some(e.to_string()),
            ..Self::portable()
        })
    }

    pub(crate) fn with_path(path: Path) -> Self {
        Self {
            path,
            unavailable: None,
            scratch: Mutex::new(MosaicScratch::default()),
        }
    }

    /// Which kernel path runs.
    pub fn path(&self) -> Path {
        self.path
    }

    fn check_rows(rows: &ArrayView2<f32>, d: usize, what: &'static str) -> Result<()> {
        if rows.ncols() != d {
            return Err(MosaicError::ShapeMismatch {
                what,
                expected: format!("[n, {d}]"),
                got: format!("{:?}", rows.shape()),
            });
        }
        validate::finite(what, rows.iter())
    }

    /// Checks every structural invariant a foreign cache must satisfy before attention reads
    /// it: the spec crate's one validator ([`CompressedCache::validate`]).
    fn check_cache(cache: &CompressedCache) -> Result<()> {
        cache.validate_for_attention()
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        match self.path {
            Path::Avx2 => "cpu-avx2",
            Path::Avx512 => "cpu-avx512",
            Path::Portable => "cpu-portable",
        }
    }

    fn availability(&self) -> Availability {
        match &self.unavailable {
            None => Availability::Available,
            Some(reason) => Availability::Unavailable(reason.clone()),
        }
    }

    fn fit_side(
        &self,
        rows: ArrayView2<f32>,
        side: Side,
        config: &CompressConfig,
    ) -> Result<SideStrategy> {
        let d = rows.ncols();
        Self::check_rows(&rows, d, "rows")?;
        config.validate(d)?;
        let data = contig(&rows);
        Ok(strategy::fit_side_rotated(&data, d, side, config)?.0)
    }

    fn fit_block_size(
        &self,
        keys: ArrayView2<f32>,
        key: &SideStrategy,
        config: &CompressConfig,
    ) -> Result<usize> {
        key.validate()?;
        Self::check_rows(&keys, key.head_dim(), "keys")?;
        config.validate(key.head_dim())?;
        if config.block_sizes.len() == 1 {
            return Ok(config.block_sizes[0]);
        }
        let packed = packed::encode_rows(&contig(&keys), key)?;
        let dense = packed::decode_rows(&packed, key)?;
        Ok(strategy::block_size_dense(
            &dense,
            key.layout.kept_dims,
            config,
        ))
    }

    fn encode(&self, rows: ArrayView2<f32>, side: &SideStrategy) -> Result<PackedRows> {
        side.validate()?;
        Self::check_rows(&rows, side.head_dim(), "rows")?;
        packed::encode_rows(&contig(&rows), side)
    }

    fn decode(&self, packed: &PackedRows, side: &SideStrategy) -> Result<Array2<f32>> {
        side.validate()?;
        let dt = side.layout.kept_dims;
        let v = packed::decode_rows(packed, side)?;
        Array2::from_shape_vec((packed.count, dt), v).map_err(|e| MosaicError::ShapeMismatch {
            what: "decoded",
            expected: format!("[{}, {dt}]", packed.count),
            got: e.to_string(),
        })
    }

    fn block_meta(
        &self,
        keys: &PackedRows,
        key: &SideStrategy,
        block_size: usize,
    ) -> Result<BlockMeta> {
        key.validate()?;
        if block_size == 0 {
            return Err(MosaicError::InvalidConfig(
                "block_size must be positive".into(),
            ));
        }
        let dense = packed::decode_rows(keys, key)?;
        Ok(meta::block_meta_dense(
            &dense,
            key.layout.kept_dims,
            block_size,
        ))
    }

    fn rotate_queries(&self, queries: ArrayView2<f32>, key: &SideStrategy) -> Result<Array2<f32>> {
        key.validate()?;
        let d = key.head_dim();
        Self::check_rows(&queries, d, "queries")?;
        let dt = key.layout.kept_dims;
        let q = contig(&queries);
        let rows = queries.nrows();
        let mut out = Array2::zeros((rows, dt));
        let o = out.as_slice_mut().expect("standard layout");
        self.path.rotate_queries(&key.rotation, d, &q, rows, o, dt);
        Ok(out)
    }

    fn score_blocks(&self, meta: &BlockMeta, rotated_queries: ArrayView2<f32>) -> Result<Vec<f32>> {
        let dt = meta.kept_dims;
        if rotated_queries.ncols() != dt || rotated_queries.nrows() == 0 {
            return Err(MosaicError::ShapeMismatch {
                what: "rotated_queries",
                expected: format!("[group >= 1, {dt}]"),
                got: format!("{:?}", rotated_queries.shape()),
            });
        }
        if meta.block_size == 0
            || meta.min.len() != meta.blocks() * dt
            || meta.max.len() != meta.min.len()
            || meta.scale.len() != meta.blocks()
        {
            return Err(MosaicError::CorruptPacked("block metadata sizes".into()));
        }
        meta.validate()
            .map_err(|e| MosaicError::CorruptPacked(format!("block metadata: {e}")))?;
        validate::finite("rotated_queries", rotated_queries.iter())?;
        let g = rotated_queries.nrows();
        let dp = pad8(dt);
        let mut q = vec![0f32; g * dp];
        for (k, row) in rotated_queries.rows().into_iter().enumerate() {
            for (j, &x) in row.iter().enumerate() {
                q[k * dp + j] = x;
            }
        }
        let mut out = vec![0f32; meta.blocks()];
        self.path
            .score_blocks(&q, g, dp, dt, &meta.min, &meta.max, &meta.scale, &mut out);
        Ok(out)
    }

    fn select_blocks(
        &self,
        scores: &[f32],
        block_lens: &[usize],
        budget_tokens: usize,
    ) -> Result<Vec<u32>> {
        validate::block_scores(scores, block_lens)?;
        let bmin = block_lens
            .iter()
            .copied()
            .filter(|&l| l > 0)
            .min()
            .unwrap_or(1);
        // Every block of positive length has at least bmin tokens, so at most ceil(B / bmin) of them
        // plus the empty ones can be taken before the budget is reached.
        let max_take = budget_tokens
            .div_ceil(bmin)
            .max(1)
            .saturating_add(block_lens.iter().filter(|&&l| l < bmin).count());
        let mut keys = Vec::new();
        let mut out = Vec::new();
        crate::select::top_blocks(
            self.path,
            scores,
            |i| block_lens[i],
            budget_tokens,
            max_take,
            &mut keys,
            &mut out,
        );
        Ok(out)
    }

    fn select(&self, cache: &CompressedCache, queries: ArrayView2<f32>) -> Result<Selection> {
        Self::check_cache(cache)?;
        let s = cache.shape;
        validate::queries(&s, &queries, &[s.q_heads, s.head_dim])?;
        let q = contig(&queries);
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if cache.segments.is_empty() {
            return Ok(Selection {
                per_head: vec![Vec::new(); s.kv_heads],
            });
        }
        let sel = packed_attention(
            self.path,
            cache,
            &q,
            SelectionSource::Compute,
            true,
            None,
            &mut sc,
        )?;
        Ok(sel.unwrap_or_default())
    }

    fn attend_selected(
        &self,
        cache: &CompressedCache,
        queries: ArrayView2<f32>,
        selection: &Selection,
        mut out: ArrayViewMut2<f32>,
    ) -> Result<()> {
        Self::check_cache(cache)?;
        let s = cache.shape;
        validate::queries(&s, &queries, out.shape())?;
        if cache.is_empty() {
            return Err(MosaicError::EmptyCache);
        }
        let q = contig(&queries);
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let mut tmp;
        let o: &mut [f32] = match out.as_slice_mut() {
            Some(o) => {
                packed_attention(
                    self.path,
                    cache,
                    &q,
                    SelectionSource::Given(selection),
                    false,
                    Some(o),
                    &mut sc,
                )?;
                return Ok(());
            }
            None => {
                tmp = vec![0f32; s.q_heads * s.head_dim];
                &mut tmp
            }
        };
        packed_attention(
            self.path,
            cache,
            &q,
            SelectionSource::Given(selection),
            false,
            Some(o),
            &mut sc,
        )?;
        for (dst, &src) in out.iter_mut().zip(o.iter()) {
            *dst = src;
        }
        Ok(())
    }

    fn attend(
        &self,
        cache: &CompressedCache,
        queries: ArrayView2<f32>,
        mut out: ArrayViewMut2<f32>,
    ) -> Result<()> {
        Self::check_cache(cache)?;
        let s = cache.shape;
        validate::queries(&s, &queries, out.shape())?;
        if cache.is_empty() {
            return Err(MosaicError::EmptyCache);
        }
        let q = contig(&queries);
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let mut o = vec![0f32; s.q_heads * s.head_dim];
        packed_attention(
            self.path,
            cache,
            &q,
            SelectionSource::Compute,
            false,
            Some(&mut o),
            &mut sc,
        )?;
        for (dst, &src) in out.iter_mut().zip(o.iter()) {
            *dst = src;
        }
        Ok(())
    }
}
