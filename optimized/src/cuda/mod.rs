//! The CUDA backend (feature `cuda`): the kernels of `mosaickv-kernels`, compiled
//! with NVRTC on first use for the device's architecture (CUBIN for sm_90 on Hopper,
//! PTX as the fallback) and launched through the CUDA driver (cudarc, dynamic loading:
//! the crate builds without CUDA). Feature `cuda-emulated` adds
//! [`CudaBackend::emulated`]: the same launch plans on the CPU emulation of the CUDA
//! execution model (kernels/emu), for testing without a GPU.
//!
//! On the device, every stage of the `Backend` trait that has a kernel: `encode`
//! (`mkv_encode`, SPEC.md 5-6), `decode` (`mkv_decode`), `block_meta` (`mkv_block_meta`,
//! 7), `rotate_queries` (`mkv_rotate_queries`, 8.1), `score_blocks` (`mkv_score_blocks`,
//! 8.2), `select_blocks` (`mkv_select_topk`, 8.3), `select` (all three), and
//! `attend_selected` / `attend` (`mkv_plan_items`, `mkv_packed_attention`, `mkv_merge`,
//! 9). On the host, through [`crate::CpuBackend`]: strategy fitting (`fit_side`,
//! `fit_block_size`: SPEC.md 3, 4, 11, an eigendecomposition and a loss search), which
//! has no kernel.

pub mod cache;
pub mod device;
pub mod layout;
pub mod live;

pub use cache::{CudaCache, CudaCacheMemory, CudaCacheOptions};
pub use live::{CudaLiveBatch, CudaLiveMemory, CudaLiveStats};

use device::{cfg, is_kernel_fault, kargs, Buf, DeviceCache, Gpu, Null};
use layout::HostTables;
use mosaickv_spec::{
    validate, Availability, Backend, BlockMeta, CompressConfig, CompressedCache, MosaicError,
    PackedRows, Result, Selection, Side, SideStrategy,
};
use ndarray::{Array2, ArrayView2, ArrayViewMut2};
use std::sync::{Arc, Mutex};

/// The CUDA driver library probed before cudarc is touched (cudarc panics when it is missing).
pub const DRIVER_LIB: &str = "libcuda.so.1";

/// Loads the driver library once, without cudarc; `Err` says why it cannot.
pub fn probe_driver() -> std::result::Result<(), String> {
    // SAFETY: loading the CUDA driver runs only its ELF initializers; the handle is
    // dropped at once (cudarc loads it again by the same name).
    unsafe { libloading::Library::new(DRIVER_LIB) }
        .map(drop)
        .map_err(|e| format!("CUDA driver library {DRIVER_LIB} not found: {e}"))
}

/// MosaicKV on an NVIDIA GPU (or on the emulation of one, [`CudaBackend::emulated`]).
pub struct CudaBackend {
    /// The executor, built on first use. A kernel fault drops it (a device context with a
    /// sticky error is useless), so the next call builds a fresh one instead of failing
    /// every later call with the first fault.
    gpu: Mutex<Option<std::result::Result<Arc<Gpu>, String>>>,
    emulated: bool,
    host: crate::CpuBackend,
}

impl CudaBackend {
    /// Probes for the driver; `BackendUnavailable` when it is absent. The context is
    /// created and the kernels compiled on first use ([`CudaBackend::gpu`]).
    pub fn new() -> Result<Self> {
        probe_driver().map_err(MosaicError::BackendUnavailable)?;
        Ok(Self {
            gpu: Mutex::new(None),
            emulated: false,
            host: crate::CpuBackend::new(),
        })
    }

    /// The backend on the CPU emulation of the CUDA execution model: the same launch plans
    /// and kernels, run on fibers (testing infrastructure; see docs/GPU.md).
    #[cfg(feature = "cuda-emulated")]
    pub fn emulated() -> Self {
        Self {
            gpu: Mutex::new(Some(Ok(Arc::new(Gpu::emulated())))),
            emulated: true,
            host: crate::CpuBackend::new(),
        }
    }

    /// The executor with every kernel compiled and loaded (cached after the first call).
    pub fn gpu(&self) -> Result<Arc<Gpu>> {
        let mut g = self.gpu.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(Gpu::new().map(Arc::new).map_err(|e| e.to_string()));
        }
        match g.as_ref() {
            Some(Ok(gpu)) => Ok(gpu.clone()),
            Some(Err(e)) => Err(MosaicError::BackendUnavailable(e.clone())),
            None => unreachable!("set above"),
        }
    }

    /// Passes `r` through; after a kernel fault on the device, drops the context (and
    /// resets the primary context when no other call still holds it) so that later calls
    /// start from a fresh one.
    fn after<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            if is_kernel_fault(e) && !self.emulated {
                let mut g = self.gpu.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(Ok(gpu)) = g.take() {
                    if let Ok(gpu) = Arc::try_unwrap(gpu) {
                        drop(gpu);
                        // SAFETY: no handle into the primary context of device 0 is left
                        // (this was the last reference to the executor holding them).
                        unsafe { cudarc::driver::sys::cuDevicePrimaryCtxReset_v2(0) };
                    }
                }
            }
        }
        r
    }

    /// Uploads a batch of caches (same shape) for repeated decode steps.
    pub fn upload(&self, caches: &[&CompressedCache]) -> Result<DeviceCache> {
        let t = HostTables::build(caches)?;
        DeviceCache::upload(&*self.gpu()?, t)
    }

    fn upload_queries(
        &self,
        gpu: &Gpu,
        cache: &CompressedCache,
        queries: &ArrayView2<f32>,
        out_shape: &[usize],
    ) -> Result<Buf<f32>> {
        validate::queries(&cache.shape, queries, out_shape)?;
        if cache.is_empty() {
            return Err(MosaicError::EmptyCache);
        }
        let q: Vec<f32> = queries.iter().copied().collect();
        gpu.up(&q)
    }
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

fn head_dim_supported(d: usize) -> Result<()> {
    if d > mosaickv_kernels::MAX_HEAD_DIM {
        return Err(MosaicError::BackendUnavailable(format!(
            "head_dim {d} > {}",
            mosaickv_kernels::MAX_HEAD_DIM
        )));
    }
    Ok(())
}

/// A one-(segment, head) table for the single-stage kernels: the key side's layout and
/// rotation at offset 0, metadata at offset 0.
fn single_key_desc(key: &SideStrategy, block_size: usize, tokens: usize) -> layout::SegHeadDesc {
    let l = &key.layout;
    layout::SegHeadDesc {
        seg_len: tokens as i32,
        block_size: block_size as i32,
        key_dt: l.kept_dims as i32,
        key_r: l.r as i32,
        key_g: l.group_size as i32,
        key_rb: l.record_bytes() as i32,
        val_dt: l.kept_dims as i32,
        val_r: l.r as i32,
        val_g: l.group_size as i32,
        val_rb: l.record_bytes() as i32,
        key_dtype: layout::dtype_tag(l),
        val_dtype: layout::dtype_tag(l),
        ..Default::default()
    }
}

/// `Availability` of a CUDA backend on this machine, without constructing one.
pub fn availability() -> Availability {
    match CudaBackend::new().and_then(|b| b.gpu().map(|_| ())) {
        Ok(()) => Availability::Available,
        Err(e) => Availability::Unavailable(e.to_string()),
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        if self.emulated {
            "cuda-emulated"
        } else {
            "cuda"
        }
    }

    fn availability(&self) -> Availability {
        match self.gpu() {
            Ok(_) => Availability::Available,
            Err(e) => Availability::Unavailable(e.to_string()),
        }
    }

    /// Host: eigendecomposition and loss search (SPEC.md 3, 4, 11) run on the CPU backend
    /// (no kernel).
    fn fit_side(
        &self,
        rows: ArrayView2<f32>,
        side: Side,
        config: &CompressConfig,
    ) -> Result<SideStrategy> {
        crate::refuse_coded_config(config)?;
        self.host.fit_side(rows, side, config)
    }

    /// Host (SPEC.md 11.3), as for `fit_side` (no kernel).
    fn fit_block_size(
        &self,
        keys: ArrayView2<f32>,
        key: &SideStrategy,
        config: &CompressConfig,
    ) -> Result<usize> {
        crate::refuse_coded_config(config)?;
        crate::refuse_coded_layout(&key.layout)?;
        self.host.fit_block_size(keys, key, config)
    }

    /// Device: `mkv_encode` (SPEC.md 5, 6; f16, int8 and int4 records).
    fn encode(&self, rows: ArrayView2<f32>, side: &SideStrategy) -> Result<PackedRows> {
        side.validate()?;
        crate::refuse_coded_layout(&side.layout)?;
        let l = side.layout;
        check_rows(&rows, l.head_dim, "rows")?;
        head_dim_supported(l.head_dim)?;
        let n = rows.nrows();
        let rb = l.record_bytes();
        if n == 0 {
            return Ok(PackedRows {
                count: 0,
                bytes: Vec::new(),
            });
        }
        let gpu = self.gpu()?;
        let gpu = &*gpu;
        let run = || -> Result<Vec<i32>> {
            let host: Vec<f32> = rows.iter().copied().collect();
            let d_rows = gpu.up(&host)?;
            let d_rot = gpu.up(bytemuck::cast_slice::<_, u16>(&side.rotation))?;
            let out = gpu.zeros::<u8>(n * rb)?;
            let status = gpu.zeros::<i32>(1)?;
            let (nn, stride) = (n as i64, l.head_dim as i64);
            let (d, dt, r, g, rbi, dtype) = (
                l.head_dim as i32,
                l.kept_dims as i32,
                l.r as i32,
                l.group_size as i32,
                rb as i32,
                layout::dtype_tag(&l),
            );
            let smem = mosaickv_kernels::encode_smem_bytes(l.head_dim, l.kept_dims, l.groups());
            // `out` holds n records; one thread block per row (grid-stride past 2^20).
            gpu.launch(
                "mkv_encode",
                cfg(((n as u32).min(1 << 20), 1, 1), 128, smem),
                &kargs![gpu; d_rows, nn, stride, d_rot, d, dt, r, g, rbi, dtype, out, status],
            )?;
            let st = gpu.down(&status)?;
            let mut bytes = gpu.down(&out)?;
            bytes.truncate(n * rb);
            Ok([vec![st[0]], bytes.into_iter().map(i32::from).collect()].concat())
        };
        let res = self.after(run())?;
        if res[0] != 0 {
            // A kept rotated value overflowed f16 (SPEC 14). The kernel only flags it; the
            // error names the first such value in row order, the same on every backend, so
            // this rare path asks the host encoder (the same SPEC 5 arithmetic) which one.
            return match self.host.encode(rows, side) {
                Err(e) => Err(e),
                Ok(_) => Err(MosaicError::BackendUnavailable(
                    "mkv_encode flagged an f16 overflow the host encoder does not see".into(),
                )),
            };
        }
        Ok(PackedRows {
            count: n,
            bytes: res[1..].iter().map(|&b| b as u8).collect(),
        })
    }

    /// Device: `mkv_decode` (SPEC.md 6): `[n, Dt]`, zeros where a group is not kept; int8/int4
    /// values decoded as `m + code * s` in f32.
    fn decode(&self, packed: &PackedRows, side: &SideStrategy) -> Result<Array2<f32>> {
        side.validate()?;
        crate::refuse_coded_layout(&side.layout)?;
        packed.validate(&side.layout)?;
        let l = side.layout;
        head_dim_supported(l.head_dim)?;
        let (n, dt) = (packed.count, l.kept_dims);
        if n == 0 {
            return Ok(Array2::zeros((0, dt)));
        }
        let gpu = self.gpu()?;
        let gpu = &*gpu;
        let run = || -> Result<Vec<f32>> {
            let d_packed = gpu.up(&packed.bytes)?;
            let out = gpu.zeros::<f32>(n * dt)?;
            let (nn, dti, r, g, rb, dtype) = (
                n as i64,
                dt as i32,
                l.r as i32,
                l.group_size as i32,
                l.record_bytes() as i32,
                layout::dtype_tag(&l),
            );
            gpu.launch(
                "mkv_decode",
                cfg(((n as u32).min(1 << 20), 1, 1), 128, 0),
                &kargs![gpu; d_packed, nn, dti, r, g, rb, dtype, out],
            )?;
            gpu.down(&out)
        };
        let mut v = self.after(run())?;
        v.truncate(n * dt);
        Array2::from_shape_vec((n, dt), v).map_err(|e| MosaicError::ShapeMismatch {
            what: "decoded",
            expected: format!("[{n}, {dt}]"),
            got: e.to_string(),
        })
    }

    /// Device: `mkv_block_meta` (SPEC.md 7), bounds over the decoded keys of any dtype.
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
        crate::refuse_coded_layout(&key.layout)?;
        keys.validate(&key.layout)?;
        let l = key.layout;
        head_dim_supported(l.head_dim)?;
        let (n, dt) = (keys.count, l.kept_dims);
        let blocks = n.div_ceil(block_size);
        let mut meta = BlockMeta::empty(block_size, dt);
        if n == 0 {
            return Ok(meta);
        }
        let gpu = self.gpu()?;
        let gpu = &*gpu;
        let run = || -> Result<(Vec<u8>, Vec<u8>, Vec<f32>)> {
            let d_packed = gpu.up(&keys.bytes)?;
            let mn = gpu.zeros::<u8>(blocks * dt)?;
            let mx = gpu.zeros::<u8>(blocks * dt)?;
            let sc = gpu.zeros::<f32>(blocks)?;
            let (nn, dti, r, g, rb, dtype, bs) = (
                n as i64,
                dt as i32,
                l.r as i32,
                l.group_size as i32,
                l.record_bytes() as i32,
                layout::dtype_tag(&l),
                block_size as i32,
            );
            // One thread block per token block, a thread per dim (Dt <= 256 threads, whole warps).
            let threads = (dt.div_ceil(32) * 32).clamp(32, 256) as u32;
            gpu.launch(
                "mkv_block_meta",
                cfg(((blocks as u32).min(1 << 20), 1, 1), threads, 0),
                &kargs![gpu; d_packed, nn, dti, r, g, rb, dtype, bs, mn, mx, sc],
            )?;
            Ok((gpu.down(&mn)?, gpu.down(&mx)?, gpu.down(&sc)?))
        };
        let (mn, mx, sc) = self.after(run())?;
        meta.tokens = n;
        meta.min = mn[..blocks * dt].iter().map(|&b| b as i8).collect();
        meta.max = mx[..blocks * dt].iter().map(|&b| b as i8).collect();
        meta.scale = sc[..blocks].to_vec();
        Ok(meta)
    }

    /// Device: `mkv_rotate_queries` (SPEC.md 8.1) with a one-segment table: `[m, Dt]`.
    fn rotate_queries(&self, queries: ArrayView2<f32>, key: &SideStrategy) -> Result<Array2<f32>> {
        key.validate()?;
        crate::refuse_coded_layout(&key.layout)?;
        let d = key.head_dim();
        check_rows(&queries, d, "queries")?;
        head_dim_supported(d)?;
        let (m, dt) = (queries.nrows(), key.layout.kept_dims);
        if m == 0 {
            return Ok(Array2::zeros((0, dt)));
        }
        let gpu = self.gpu()?;
        let gpu = &*gpu;
        let run = || -> Result<Vec<f32>> {
            let q: Vec<f32> = queries.iter().copied().collect();
            let dq = gpu.up(&q)?;
            let sh = gpu.up(bytemuck::cast_slice::<_, u8>(&[single_key_desc(key, 1, 0)]))?;
            let seg_batch = gpu.up(&[0i32])?;
            let rot = gpu.up(bytemuck::cast_slice::<_, u16>(&key.rotation))?;
            let qrot = gpu.zeros::<f32>(m * d)?;
            // One KV head whose group is every query row: kv_heads 1, q_heads m.
            let (kv, qh, di) = (1i32, m as i32, d as i32);
            gpu.launch(
                "mkv_rotate_queries",
                cfg((1, m as u32, 1), 128, 4 * d),
                &kargs![gpu; dq, sh, seg_batch, rot, kv, qh, di, qrot],
            )?;
            gpu.down(&qrot)
        };
        let full = self.after(run())?;
        let mut out = Array2::zeros((m, dt));
        for i in 0..m {
            for j in 0..dt {
                out[[i, j]] = full[i * d + j];
            }
        }
        Ok(out)
    }

    /// Device: `mkv_score_blocks` (SPEC.md 8.2) over one (segment, head)'s blocks.
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
        head_dim_supported(dt)?;
        let nb = meta.blocks();
        if nb == 0 {
            return Ok(Vec::new());
        }
        let g = rotated_queries.nrows();
        let gpu = self.gpu()?;
        let gpu = &*gpu;
        let run = || -> Result<Vec<f32>> {
            let blocks: Vec<layout::BlockRefDesc> = (0..nb)
                .map(|i| layout::BlockRefDesc {
                    gseg: 0,
                    block: i as i32,
                    start: (i * meta.block_size) as i32,
                    len: meta.block_len(i) as i32,
                })
                .collect();
            let d_blocks = gpu.up(bytemuck::cast_slice::<_, u8>(&blocks))?;
            let owner = gpu.up(&vec![0i32; nb])?;
            let mut desc = layout::SegHeadDesc {
                key_dt: dt as i32,
                block_size: meta.block_size as i32,
                seg_len: meta.tokens as i32,
                ..Default::default()
            };
            desc.val_dt = dt as i32;
            let sh = gpu.up(bytemuck::cast_slice::<_, u8>(&[desc]))?;
            let mn = gpu.up(&meta.min.iter().map(|&x| x as u8).collect::<Vec<u8>>())?;
            let mx = gpu.up(&meta.max.iter().map(|&x| x as u8).collect::<Vec<u8>>())?;
            let sc = gpu.up(&meta.scale)?;
            let q: Vec<f32> = rotated_queries.iter().copied().collect();
            let dq = gpu.up(&q)?;
            let scores = gpu.zeros::<f32>(nb)?;
            // The rotated queries are [G][Dt]: head_dim = Dt as their row stride.
            let (total, kv, qh, di) = (nb as i64, 1i32, g as i32, dt as i32);
            let grid = (nb.div_ceil(8) as u32).clamp(1, 65535 * 16);
            gpu.launch(
                "mkv_score_blocks",
                cfg((grid, 1, 1), 256, 0),
                &kargs![gpu; d_blocks, owner, total, sh, mn, mx, sc, dq, kv, qh, di, scores],
            )?;
            gpu.down(&scores)
        };
        let mut v = self.after(run())?;
        v.truncate(nb);
        Ok(v)
    }

    /// Device: `mkv_select_topk` (SPEC.md 8.3): ascending block indices.
    fn select_blocks(
        &self,
        scores: &[f32],
        block_lens: &[usize],
        budget_tokens: usize,
    ) -> Result<Vec<u32>> {
        validate::block_scores(scores, block_lens)?;
        let n = scores.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        if block_lens.iter().any(|&l| l > i32::MAX as usize) || n > i32::MAX as usize {
            return Err(MosaicError::ShapeMismatch {
                what: "block_lens",
                expected: "lengths and counts below 2^31 (the kernel's int)".into(),
                got: format!("{n} blocks"),
            });
        }
        let gpu = self.gpu()?;
        let gpu = &*gpu;
        let run = || -> Result<(Vec<i32>, Vec<i32>)> {
            let sc = gpu.up(scores)?;
            let base = gpu.up(&[0i64, n as i64])?;
            let lens: Vec<i32> = block_lens.iter().map(|&l| l as i32).collect();
            let dl = gpu.up(&lens)?;
            let budget = gpu.up(&[budget_tokens.min(i64::MAX as usize) as i64])?;
            let sel = gpu.zeros::<i32>(n)?;
            let count = gpu.zeros::<i32>(1)?;
            let (zero, kv, no_force) = (0i32, 1i32, 0i32);
            gpu.launch(
                "mkv_select_topk",
                cfg((1, 1, 1), mosaickv_kernels::SELECT_THREADS, 0),
                &kargs![gpu; sc, base, Null, dl, zero, zero, budget, kv, no_force, sel, count],
            )?;
            Ok((gpu.down(&sel)?, gpu.down(&count)?))
        };
        let (sel, count) = self.after(run())?;
        Ok(sel[..count[0].max(0) as usize]
            .iter()
            .map(|&i| i as u32)
            .collect())
    }

    /// Device: `mkv_rotate_queries`, `mkv_score_blocks`, `mkv_select_topk` (SPEC.md 8).
    fn select(&self, cache: &CompressedCache, queries: ArrayView2<f32>) -> Result<Selection> {
        let shape = [cache.shape.q_heads, cache.shape.head_dim];
        let gpu = self.gpu()?;
        let gpu = &*gpu;
        let q = self.upload_queries(gpu, cache, &queries, &shape)?;
        let dc = self.upload(&[cache])?;
        let (sel, count) = self.after((|| {
            let (_, sel, count) = dc.select(gpu, &q)?;
            dc.download_selection(gpu, &sel, &count)
        })())?;
        let t = &dc.t;
        let per_head = (0..t.kv_heads)
            .map(|j| {
                let b0 = t.block_base[j] as usize;
                (0..count[j] as usize)
                    .map(|i| {
                        let br = t.blocks[b0 + sel[b0 + i] as usize];
                        (br.gseg as u32, br.block as u32)
                    })
                    .collect()
            })
            .collect();
        Ok(Selection { per_head })
    }

    /// Device: `mkv_plan_items`, `mkv_packed_attention`, `mkv_merge` (SPEC.md 9). The work
    /// item table is sized from this selection, so any valid selection is attended whole.
    fn attend_selected(
        &self,
        cache: &CompressedCache,
        queries: ArrayView2<f32>,
        selection: &Selection,
        mut out: ArrayViewMut2<f32>,
    ) -> Result<()> {
        let gpu = self.gpu()?;
        let gpu = &*gpu;
        let q = self.upload_queries(gpu, cache, &queries, out.shape())?;
        let dc = self.upload(&[cache])?;
        let t = &dc.t;
        if selection.per_head.len() != t.kv_heads {
            return Err(MosaicError::ShapeMismatch {
                what: "selection",
                expected: format!("{} heads", t.kv_heads),
                got: selection.per_head.len().to_string(),
            });
        }
        let mut sel = vec![0i32; t.blocks.len().max(1)];
        let mut count = vec![0i32; t.kv_heads];
        for (j, list) in selection.per_head.iter().enumerate() {
            let b0 = t.block_base[j] as usize;
            let mut prev: Option<i64> = None;
            for (i, &(s, blk)) in list.iter().enumerate() {
                let bad = || MosaicError::ShapeMismatch {
                    what: "selection",
                    expected: "ascending (segment, block) pairs inside the cache".into(),
                    got: format!("({s}, {blk}) for head {j}"),
                };
                let s = s as usize;
                if s >= cache.segments.len()
                    || blk as usize
                        >= cache.segments[s]
                            .len
                            .div_ceil(cache.segments[s].heads[j].strategy.block_size.max(1))
                {
                    return Err(bad());
                }
                let idx = t.seg_first_block[s * t.kv_heads + j] + blk as i64;
                if prev.is_some_and(|p| p >= idx) {
                    return Err(bad());
                }
                prev = Some(idx);
                sel[b0 + i] = idx as i32;
            }
            count[j] = list.len() as i32;
        }
        let max_items = dc.selection_max_items(&count);
        let host = self.after((|| {
            let (d_sel, d_count) = dc.upload_selection(gpu, &sel, &count)?;
            let qrot = dc.rotate_queries(gpu, &q)?;
            let res = dc.attend_selected(gpu, &q, &qrot, &d_sel, &d_count, max_items)?;
            gpu.down(&res)
        })())?;
        for (o, v) in out.iter_mut().zip(host) {
            *o = v;
        }
        Ok(())
    }

    /// Device: one decode step without a host round trip between selection and attention.
    fn attend(
        &self,
        cache: &CompressedCache,
        queries: ArrayView2<f32>,
        mut out: ArrayViewMut2<f32>,
    ) -> Result<()> {
        let gpu = self.gpu()?;
        let gpu = &*gpu;
        let q = self.upload_queries(gpu, cache, &queries, out.shape())?;
        let dc = self.upload(&[cache])?;
        let host = self.after((|| gpu.down(&dc.attend(gpu, &q)?))())?;
        for (o, v) in out.iter_mut().zip(host) {
            *o = v;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver the backend is a typed error, never a panic; with one, it compiles.
    #[test]
    fn new_is_typed_error_or_available() {
        match CudaBackend::new() {
            Err(MosaicError::BackendUnavailable(reason)) => println!("skipped: {reason}"),
            Err(e) => panic!("unexpected error {e:?}"),
            Ok(b) => match b.availability() {
                Availability::Available => println!("CUDA available: {}", b.gpu().unwrap().name),
                Availability::Unavailable(r) => println!("skipped: {r}"),
            },
        }
    }

    #[test]
    fn availability_reports_a_reason_when_unavailable() {
        if let Availability::Unavailable(r) = availability() {
            assert!(!r.is_empty());
            println!("skipped: {r}");
        }
    }
}
