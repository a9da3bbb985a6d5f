//! The device: context, compiled kernels, uploaded caches and the decode pipelines.

use super::layout::HostTables;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use mosaickv_kernels as k;
use mosaickv_spec::{MosaicError, Result};
use std::collections::HashMap;
use std::sync::Arc;

pub(crate) fn drv<E: std::fmt::Debug>(what: &str) -> impl FnOnce(E) -> MosaicError + '_ {
    move |e| MosaicError::BackendUnavailable(format!("CUDA {what}: {e:?}"))
}

/// A CUDA context with every kernel compiled (NVRTC, PTX for the device's arch) and loaded.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    pub arch: String,
    pub sms: u32,
    pub name: String,
}

impl Gpu {
    /// Creates a context on device 0 and compiles every kernel. The caller has
    /// already checked that the driver library loads (cudarc panics otherwise).
    pub fn new() -> Result<Self> {
        let ctx = CudaContext::new(0).map_err(drv("context"))?;
        let (maj, min) = ctx
            .compute_capability()
            .map_err(drv("compute capability"))?;
        let arch = format!("compute_{maj}{min}");
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(drv("attribute"))? as u32;
        let name = ctx.name().unwrap_or_else(|_| "unknown CUDA device".into());
        let nvrtc = k::nvrtc::Nvrtc::load_default().map_err(MosaicError::BackendUnavailable)?;
        let mut funcs = HashMap::new();
        for (file, src, entries) in k::KERNELS {
            let out = nvrtc
                .compile_kernel(file, src, &arch)
                .map_err(MosaicError::BackendUnavailable)?;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(out.ptx))
                .map_err(drv("module load"))?;
            for e in *entries {
                funcs.insert(*e, module.load_function(e).map_err(drv("function"))?);
            }
        }
        let stream = ctx.default_stream();
        Ok(Self {
            ctx,
            stream,
            funcs,
            arch,
            sms,
            name,
        })
    }

    pub fn func(&self, name: &str) -> &CudaFunction {
        &self.funcs[name]
    }

    pub fn up<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + Default>(
        &self,
        v: &[T],
    ) -> Result<CudaSlice<T>> {
        if v.is_empty() {
            // Zero-length allocations are not portable: one zero element stands in.
            return self.stream.alloc_zeros::<T>(1).map_err(drv("alloc"));
        }
        self.stream.clone_htod(v).map_err(drv("upload"))
    }

    pub fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros::<T>(n.max(1)).map_err(drv("alloc"))
    }

    pub fn down<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        s: &CudaSlice<T>,
    ) -> Result<Vec<T>> {
        self.stream.clone_dtoh(s).map_err(drv("download"))
    }

    pub fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv("synchronize"))
    }
}

pub(crate) fn cfg(grid: (u32, u32, u32), block: u32, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

/// A batch of compressed caches resident on the device.
pub struct DeviceCache {
    pub t: HostTables,
    packed_k: CudaSlice<u8>,
    packed_v: CudaSlice<u8>,
    rot: CudaSlice<f32>,
    meta_min: CudaSlice<u8>,
    meta_max: CudaSlice<u8>,
    meta_scale: CudaSlice<f32>,
    seg: CudaSlice<u8>,
    seg_batch: CudaSlice<i32>,
    seg_base: CudaSlice<i32>,
    blocks: CudaSlice<u8>,
    block_owner: CudaSlice<i32>,
    block_base: CudaSlice<i64>,
    block_lens: CudaSlice<i32>,
    dense_k: CudaSlice<u16>,
    dense_v: CudaSlice<u16>,
    dense_base: CudaSlice<i64>,
    dense_count: CudaSlice<i32>,
    budget: CudaSlice<i64>,
}

/// Blocks per work item of `mkv_packed_attention` (one segment's run of selected blocks).
pub const BLOCKS_PER_ITEM: usize = 32;

impl DeviceCache {
    pub fn upload(gpu: &Gpu, t: HostTables) -> Result<Self> {
        Ok(Self {
            packed_k: gpu.up(&t.packed_k)?,
            packed_v: gpu.up(&t.packed_v)?,
            rot: gpu.up(&t.rot)?,
            meta_min: gpu.up(&t.meta_min)?,
            meta_max: gpu.up(&t.meta_max)?,
            meta_scale: gpu.up(&t.meta_scale)?,
            seg: gpu.up(bytemuck::cast_slice::<_, u8>(&t.seg))?,
            seg_batch: gpu.up(&t.seg_batch)?,
            seg_base: gpu.up(&t.seg_base)?,
            blocks: gpu.up(bytemuck::cast_slice::<_, u8>(&t.blocks))?,
            block_owner: gpu.up(&t.block_owner)?,
            block_base: gpu.up(&t.block_base)?,
            block_lens: gpu.up(&t.block_lens)?,
            dense_k: gpu.up(&t.dense_k)?,
            dense_v: gpu.up(&t.dense_v)?,
            dense_base: gpu.up(&t.dense_base)?,
            dense_count: gpu.up(&t.dense_count)?,
            budget: gpu.up(&t.budget)?,
            t,
        })
    }

    fn nbj(&self) -> usize {
        self.t.batch * self.t.kv_heads
    }

    /// SPEC.md 8 on the device: rotated queries `q` `[batch][q_heads][D]` (already
    /// uploaded), block scores, top-k. Returns (qrot, sel, count).
    pub fn select(
        &self,
        gpu: &Gpu,
        q: &CudaSlice<f32>,
    ) -> Result<(CudaSlice<f32>, CudaSlice<i32>, CudaSlice<i32>)> {
        let t = &self.t;
        let (kv, qh, d) = (t.kv_heads as i32, t.q_heads as i32, t.head_dim as i32);
        let nseg = t.total_segments();
        let qrot = gpu.zeros::<f32>(nseg * t.q_heads * t.head_dim)?;
        let scores = gpu.zeros::<f32>(t.blocks.len())?;
        let sel = gpu.zeros::<i32>(t.blocks.len())?;
        let count = gpu.zeros::<i32>(self.nbj())?;
        if nseg > 0 {
            let f = gpu.func("mkv_rotate_queries");
            let mut l = gpu.stream.launch_builder(f);
            l.arg(q)
                .arg(&self.seg)
                .arg(&self.seg_batch)
                .arg(&self.rot)
                .arg(&kv)
                .arg(&qh)
                .arg(&d)
                .arg(&qrot);
            // SAFETY: argument order and types match mkv_rotate_queries; every buffer holds
            // the elements the tables index (built together in HostTables::build).
            unsafe { l.launch(cfg((nseg as u32, t.q_heads as u32, 1), 128, 4 * t.head_dim)) }
                .map_err(drv("launch"))?;
            let total = t.blocks.len() as i64;
            let f = gpu.func("mkv_score_blocks");
            let mut l = gpu.stream.launch_builder(f);
            l.arg(&self.blocks)
                .arg(&self.block_owner)
                .arg(&total)
                .arg(&self.seg)
                .arg(&self.meta_min)
                .arg(&self.meta_max)
                .arg(&self.meta_scale);
            l.arg(&qrot).arg(&kv).arg(&qh).arg(&d).arg(&scores);
            let grid = (t.blocks.len().div_ceil(8) as u32).clamp(1, 65535 * 16);
            // SAFETY: as above for mkv_score_blocks.
            unsafe { l.launch(cfg((grid, 1, 1), 256, 0)) }.map_err(drv("launch"))?;
        }
        let f = gpu.func("mkv_select_topk");
        let mut l = gpu.stream.launch_builder(f);
        let (zero, no_force) = (0i32, 0i32);
        l.arg(&scores)
            .arg(&self.block_base)
            .arg(&self.block_lens)
            .arg(&zero)
            .arg(&zero)
            .arg(&self.budget);
        l.arg(&kv).arg(&no_force).arg(&sel).arg(&count);
        // SAFETY: as above for mkv_select_topk (lens given, so uniform/last lengths unused).
        unsafe { l.launch(cfg((self.nbj() as u32, 1, 1), k::SELECT_THREADS, 0)) }
            .map_err(drv("launch"))?;
        Ok((qrot, sel, count))
    }

    /// SPEC.md 9 on the device for a selection already on the device; returns `[batch][q_heads][D]`.
    pub fn attend_selected(
        &self,
        gpu: &Gpu,
        q: &CudaSlice<f32>,
        qrot: &CudaSlice<f32>,
        sel: &CudaSlice<i32>,
        count: &CudaSlice<i32>,
    ) -> Result<CudaSlice<f32>> {
        let t = &self.t;
        let (kv, qh, d) = (t.kv_heads as i32, t.q_heads as i32, t.head_dim as i32);
        let g = t.q_heads / t.kv_heads;
        let smem = k::packed_attention_smem_bytes(g, t.head_dim);
        if smem > 48 * 1024 {
            return Err(MosaicError::BackendUnavailable(format!(
                "GQA group {g} x head_dim {} needs {smem} B of shared memory (limit 48 KiB)",
                t.head_dim
            )));
        }
        let max_items = t.max_items(BLOCKS_PER_ITEM);
        let per_item = BLOCKS_PER_ITEM as i32;
        let mi = max_items as i32;
        let items = gpu.zeros::<i32>(3 * self.nbj() * max_items)?;
        let item_count = gpu.zeros::<i32>(self.nbj())?;
        let f = gpu.func("mkv_plan_items");
        let mut l = gpu.stream.launch_builder(f);
        l.arg(&self.blocks)
            .arg(&self.block_base)
            .arg(sel)
            .arg(count)
            .arg(&self.seg_base)
            .arg(&kv)
            .arg(&per_item)
            .arg(&mi);
        l.arg(&items).arg(&item_count);
        // SAFETY: argument order and types match mkv_plan_items; items has nbj * max_items int3.
        unsafe { l.launch(cfg((self.nbj() as u32, 1, 1), 256, 0)) }.map_err(drv("launch"))?;
        let parts = max_items + 1;
        let pm = gpu.zeros::<f32>(self.nbj() * parts * g)?;
        let pl = gpu.zeros::<f32>(self.nbj() * parts * g)?;
        let po = gpu.zeros::<f32>(self.nbj() * parts * g * t.head_dim)?;
        let scale = std::f32::consts::LOG2_E / (t.head_dim as f32).sqrt();
        let f = gpu.func("mkv_packed_attention");
        let mut l = gpu.stream.launch_builder(f);
        l.arg(q)
            .arg(qrot)
            .arg(&self.seg)
            .arg(&self.blocks)
            .arg(&self.block_base)
            .arg(sel)
            .arg(&items)
            .arg(&item_count)
            .arg(&mi);
        l.arg(&self.packed_k)
            .arg(&self.packed_v)
            .arg(&self.rot)
            .arg(&self.dense_k)
            .arg(&self.dense_v);
        l.arg(&self.dense_base)
            .arg(&self.dense_count)
            .arg(&kv)
            .arg(&qh)
            .arg(&d)
            .arg(&scale)
            .arg(&pm)
            .arg(&pl)
            .arg(&po);
        // SAFETY: argument order and types match mkv_packed_attention; partial buffers hold
        // nbj * (max_items + 1) parts of G heads.
        unsafe {
            l.launch(cfg(
                (parts as u32, t.kv_heads as u32, t.batch as u32),
                k::ATT_THREADS,
                smem,
            ))
        }
        .map_err(drv("launch"))?;
        let out = gpu.zeros::<f32>(t.batch * t.q_heads * t.head_dim)?;
        let pp = parts as i32;
        let f = gpu.func("mkv_merge");
        let mut l = gpu.stream.launch_builder(f);
        l.arg(&pm)
            .arg(&pl)
            .arg(&po)
            .arg(&item_count)
            .arg(&pp)
            .arg(&kv)
            .arg(&qh)
            .arg(&d)
            .arg(&out);
        // SAFETY: argument order and types match mkv_merge.
        unsafe { l.launch(cfg((t.q_heads as u32, t.batch as u32, 1), 128, 0)) }
            .map_err(drv("launch"))?;
        Ok(out)
    }

    /// One decode step (select + attend) for queries `[batch][q_heads][D]` on the device.
    pub fn attend(&self, gpu: &Gpu, q: &CudaSlice<f32>) -> Result<CudaSlice<f32>> {
        let (qrot, sel, count) = self.select(gpu, q)?;
        self.attend_selected(gpu, q, &qrot, &sel, &count)
    }

    /// Downloads a selection as `(sel, count, block_base)` host vectors.
    pub fn download_selection(
        &self,
        gpu: &Gpu,
        sel: &CudaSlice<i32>,
        count: &CudaSlice<i32>,
    ) -> Result<(Vec<i32>, Vec<i32>)> {
        Ok((gpu.down(sel)?, gpu.down(count)?))
    }

    pub fn upload_selection(
        &self,
        gpu: &Gpu,
        sel: &[i32],
        count: &[i32],
    ) -> Result<(CudaSlice<i32>, CudaSlice<i32>)> {
        Ok((gpu.up(sel)?, gpu.up(count)?))
    }
}

/// A batch of dense f16 caches `[batch][n][kv_heads][D]` on the device: the full-attention
/// and Quest baselines (SPEC.md section 12) for the GPU comparison.
pub struct DenseDevice {
    pub batch: usize,
    pub n: usize,
    pub kv_heads: usize,
    pub q_heads: usize,
    pub head_dim: usize,
    pub k: CudaSlice<u16>,
    pub v: CudaSlice<u16>,
}

/// Quest page size (SPEC.md section 12).
pub const QUEST_PAGE: usize = 16;

impl DenseDevice {
    fn seq_stride(&self) -> i64 {
        (self.n * self.kv_heads * self.head_dim) as i64
    }

    fn decode(
        &self,
        gpu: &Gpu,
        q: &CudaSlice<f32>,
        pages: Option<(&CudaSlice<i32>, &CudaSlice<i64>, &CudaSlice<i32>, usize)>,
        splits: usize,
    ) -> Result<CudaSlice<f32>> {
        if self.head_dim % 8 != 0 || self.head_dim > k::MAX_HEAD_DIM {
            return Err(MosaicError::BackendUnavailable(format!(
                "dense decode needs head_dim % 8 == 0 and <= 256, got {}",
                self.head_dim
            )));
        }
        let g = self.q_heads / self.kv_heads;
        let nbj = self.batch * self.kv_heads;
        let work = match pages {
            Some((_, _, _, max_pages)) => max_pages * QUEST_PAGE,
            None => self.n,
        };
        let splits = splits.max(1);
        let per_split = work.div_ceil(splits).max(1) as i64;
        let pm = gpu.zeros::<f32>(nbj * splits * g)?;
        let pl = gpu.zeros::<f32>(nbj * splits * g)?;
        let po = gpu.zeros::<f32>(nbj * splits * g * self.head_dim)?;
        let (kv, qh, d) = (
            self.kv_heads as i32,
            self.q_heads as i32,
            self.head_dim as i32,
        );
        let n = self.n as i64;
        let ss = self.seq_stride();
        let scale = std::f32::consts::LOG2_E / (self.head_dim as f32).sqrt();
        let page = QUEST_PAGE as i32;
        let null = 0u64;
        let f = gpu.func("mkv_dense_decode");
        let mut l = gpu.stream.launch_builder(f);
        l.arg(q)
            .arg(&self.k)
            .arg(&self.v)
            .arg(&n)
            .arg(&ss)
            .arg(&kv)
            .arg(&qh)
            .arg(&d)
            .arg(&scale)
            .arg(&per_split);
        match pages {
            Some((sel, base, count, _)) => {
                l.arg(sel).arg(base).arg(count);
            }
            None => {
                l.arg(&null).arg(&null).arg(&null);
            }
        }
        l.arg(&page).arg(&pm).arg(&pl).arg(&po);
        let chunks = g.div_ceil(k::DENSE_HEAD_CHUNK);
        // SAFETY: argument order and types match mkv_dense_decode (null page pointers select
        // the all-tokens mode); partial buffers hold nbj * splits parts of G heads.
        unsafe {
            l.launch(cfg(
                (
                    splits as u32,
                    (self.kv_heads * chunks) as u32,
                    self.batch as u32,
                ),
                k::DENSE_THREADS,
                0,
            ))
        }
        .map_err(drv("launch"))?;
        let out = gpu.zeros::<f32>(self.batch * self.q_heads * self.head_dim)?;
        let sp = splits as i32;
        let f = gpu.func("mkv_merge");
        let mut l = gpu.stream.launch_builder(f);
        l.arg(&pm)
            .arg(&pl)
            .arg(&po)
            .arg(&null)
            .arg(&sp)
            .arg(&kv)
            .arg(&qh)
            .arg(&d)
            .arg(&out);
        // SAFETY: argument order and types match mkv_merge (null counts: every split is a part).
        unsafe { l.launch(cfg((self.q_heads as u32, self.batch as u32, 1), 128, 0)) }
            .map_err(drv("launch"))?;
        Ok(out)
    }

    /// Splits so that about 4 thread blocks per SM run for this batch.
    pub fn default_splits(&self, gpu: &Gpu, work: usize) -> usize {
        let ctas = (4 * gpu.sms as usize).div_ceil(self.batch * self.kv_heads);
        ctas.clamp(1, work.div_ceil(256).max(1))
    }

    /// Full attention over every token.
    pub fn attend_full(&self, gpu: &Gpu, q: &CudaSlice<f32>) -> Result<CudaSlice<f32>> {
        let s = self.default_splits(gpu, self.n);
        self.decode(gpu, q, None, s)
    }
}

/// Quest on a [`DenseDevice`]: page metadata plus the selection state.
pub struct QuestDevice {
    pub pages: usize,
    mn: CudaSlice<u16>,
    mx: CudaSlice<u16>,
    base: CudaSlice<i64>,
    budget: CudaSlice<i64>,
    pub budget_pages: usize,
}

impl QuestDevice {
    /// Builds Quest's page metadata for `token_rate` (SPEC.md section 12).
    pub fn new(gpu: &Gpu, dense: &DenseDevice, token_rate: f64) -> Result<Self> {
        let pages = dense.n.div_ceil(QUEST_PAGE);
        let nbj = dense.batch * dense.kv_heads;
        let mn = gpu.zeros::<u16>(nbj * pages * dense.head_dim)?;
        let mx = gpu.zeros::<u16>(nbj * pages * dense.head_dim)?;
        let (n, ss, kv, d, page) = (
            dense.n as i64,
            dense.seq_stride(),
            dense.kv_heads as i32,
            dense.head_dim as i32,
            QUEST_PAGE as i32,
        );
        let f = gpu.func("mkv_page_meta");
        let mut l = gpu.stream.launch_builder(f);
        l.arg(&dense.k)
            .arg(&n)
            .arg(&ss)
            .arg(&kv)
            .arg(&d)
            .arg(&page)
            .arg(&mn)
            .arg(&mx);
        // SAFETY: argument order and types match mkv_page_meta; mn/mx hold nbj * pages * D.
        unsafe {
            l.launch(cfg(
                (pages as u32, dense.kv_heads as u32, dense.batch as u32),
                128,
                0,
            ))
        }
        .map_err(drv("launch"))?;
        let p = ((token_rate * dense.n as f64).ceil() as usize)
            .div_ceil(QUEST_PAGE)
            .max(1);
        // Budget over the pages other than the last, in tokens of full pages (SPEC.md 12).
        let budget_tokens = if pages <= p {
            dense.n
        } else {
            (p - 1) * QUEST_PAGE
        };
        let base: Vec<i64> = (0..=nbj).map(|i| (i * pages) as i64).collect();
        Ok(Self {
            pages,
            mn,
            mx,
            base: gpu.up(&base)?,
            budget: gpu.up(&vec![budget_tokens as i64; dense.batch])?,
            budget_pages: p.min(pages),
        })
    }

    /// One Quest decode step.
    pub fn attend(
        &self,
        gpu: &Gpu,
        dense: &DenseDevice,
        q: &CudaSlice<f32>,
    ) -> Result<CudaSlice<f32>> {
        let nbj = dense.batch * dense.kv_heads;
        let scores = gpu.zeros::<f32>(nbj * self.pages)?;
        let (pg, b, kv, qh, d) = (
            self.pages as i64,
            dense.batch as i32,
            dense.kv_heads as i32,
            dense.q_heads as i32,
            dense.head_dim as i32,
        );
        let f = gpu.func("mkv_page_score");
        let mut l = gpu.stream.launch_builder(f);
        l.arg(q)
            .arg(&self.mn)
            .arg(&self.mx)
            .arg(&pg)
            .arg(&b)
            .arg(&kv)
            .arg(&qh)
            .arg(&d)
            .arg(&scores);
        let grid = ((nbj * self.pages).div_ceil(8) as u32).clamp(1, 1 << 20);
        // SAFETY: argument order and types match mkv_page_score.
        unsafe { l.launch(cfg((grid, 1, 1), 256, 0)) }.map_err(drv("launch"))?;
        let sel = gpu.zeros::<i32>(nbj * self.pages)?;
        let count = gpu.zeros::<i32>(nbj)?;
        let last = (dense.n - (self.pages - 1) * QUEST_PAGE) as i32;
        let uni = QUEST_PAGE as i32;
        let force = if self.pages > self.budget_pages {
            1i32
        } else {
            0
        };
        let null = 0u64;
        let f = gpu.func("mkv_select_topk");
        let mut l = gpu.stream.launch_builder(f);
        l.arg(&scores)
            .arg(&self.base)
            .arg(&null)
            .arg(&uni)
            .arg(&last)
            .arg(&self.budget)
            .arg(&kv)
            .arg(&force)
            .arg(&sel)
            .arg(&count);
        // SAFETY: argument order and types match mkv_select_topk (null lens: uniform pages).
        unsafe { l.launch(cfg((nbj as u32, 1, 1), k::SELECT_THREADS, 0)) }
            .map_err(drv("launch"))?;
        let splits = dense.default_splits(gpu, self.budget_pages * QUEST_PAGE);
        dense.decode(
            gpu,
            q,
            Some((&sel, &self.base, &count, self.budget_pages)),
            splits,
        )
    }
}
