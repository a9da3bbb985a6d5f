//! The CUDA backend (feature `cuda`): the kernels of `mosaickv-kernels`, compiled
//! with NVRTC on first use for the device's architecture (sm_90 on Hopper) and
//! launched through cudarc (dynamic loading: the crate builds without CUDA).
//!
//! On the device: encode (SPEC.md 5-6), selection (8.1-8.3: rotated queries,
//! block scores, top-k), PackedAttention (9) and the full / Quest baselines (12).
//! On the host, through [`crate::CpuBackend`]: strategy fitting (3, 4, 11:
//! eigendecomposition), and the single-stage calls `decode`, `block_meta`,
//! `rotate_queries`, `score_blocks`, `select_blocks` (each is a small host-side
//! call in the trait; the device versions run inside `encode`/`select`/`attend`).

pub mod device;
pub mod layout;

use device::{drv, DeviceCache, Gpu};
use layout::HostTables;
use mosaickv_spec::{
    validate, Availability, Backend, BlockMeta, CompressConfig, CompressedCache, MosaicError,
    PackedRows, Result, Selection, Side, SideStrategy,
};
use ndarray::{Array2, ArrayView2, ArrayViewMut2};
use std::sync::OnceLock;

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

/// MosaicKV on an NVIDIA GPU.
pub struct CudaBackend {
    gpu: OnceLock<std::result::Result<Gpu, String>>,
    host: crate::CpuBackend,
}

/// The CUDA kernels read and write f16 records only (SPEC.md section 6); an int8/int4 layout
/// is a typed error here, never a misread record (docs/GPU.md).
pub(crate) fn f16_only(l: &mosaickv_spec::RecordLayout) -> Result<()> {
    if l.dtype.is_quantized() {
        return Err(MosaicError::BackendUnavailable(format!(
            "the CUDA kernels store f16 values only; a {} layout needs a CPU backend",
            l.dtype.name()
        )));
    }
    Ok(())
}

impl CudaBackend {
    /// Probes for the driver; `BackendUnavailable` when it is absent. The context is
    /// created and the kernels compiled on first use ([`CudaBackend::gpu`]).
    pub fn new() -> Result<Self> {
        probe_driver().map_err(MosaicError::BackendUnavailable)?;
        Ok(Self {
            gpu: OnceLock::new(),
            host: crate::CpuBackend::new(),
        })
    }

    /// The context with every kernel compiled and loaded (cached after the first call).
    pub fn gpu(&self) -> Result<&Gpu> {
        self.gpu
            .get_or_init(|| Gpu::new().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| MosaicError::BackendUnavailable(e.clone()))
    }

    /// Uploads a batch of caches (same shape) for repeated decode steps.
    pub fn upload(&self, caches: &[&CompressedCache]) -> Result<DeviceCache> {
        let t = HostTables::build(caches)?;
        DeviceCache::upload(self.gpu()?, t)
    }

    fn upload_queries(
        &self,
        cache: &CompressedCache,
        queries: &ArrayView2<f32>,
        out_shape: &[usize],
    ) -> Result<cudarc::driver::CudaSlice<f32>> {
        validate::queries(&cache.shape, queries, out_shape)?;
        if cache.is_empty() {
            return Err(MosaicError::EmptyCache);
        }
        let q: Vec<f32> = queries.iter().copied().collect();
        self.gpu()?.up(&q)
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
        "cuda"
    }

    fn availability(&self) -> Availability {
        match self.gpu() {
            Ok(_) => Availability::Available,
            Err(e) => Availability::Unavailable(e.to_string()),
        }
    }

    /// Host: eigendecomposition and loss search (SPEC.md 3, 4, 11) run on the CPU backend.
    fn fit_side(
        &self,
        rows: ArrayView2<f32>,
        side: Side,
        config: &CompressConfig,
    ) -> Result<SideStrategy> {
        self.host.fit_side(rows, side, config)
    }

    /// Host (SPEC.md 11.3), as for `fit_side`.
    fn fit_block_size(
        &self,
        keys: ArrayView2<f32>,
        key: &SideStrategy,
        config: &CompressConfig,
    ) -> Result<usize> {
        self.host.fit_block_size(keys, key, config)
    }

    /// Device: `mkv_encode` (SPEC.md 5, 6).
    fn encode(&self, rows: ArrayView2<f32>, side: &SideStrategy) -> Result<PackedRows> {
        side.validate()?;
        let l = side.layout;
        f16_only(&l)?;
        if rows.ncols() != l.head_dim {
            return Err(MosaicError::ShapeMismatch {
                what: "rows",
                expected: format!("[n, {}]", l.head_dim),
                got: format!("{:?}", rows.shape()),
            });
        }
        if l.head_dim > mosaickv_kernels::MAX_HEAD_DIM {
            return Err(MosaicError::BackendUnavailable(format!(
                "head_dim {} > {}",
                l.head_dim,
                mosaickv_kernels::MAX_HEAD_DIM
            )));
        }
        validate::finite("rows", rows.iter())?;
        let n = rows.nrows();
        let rb = l.record_bytes();
        if n == 0 {
            return Ok(PackedRows {
                count: 0,
                bytes: Vec::new(),
            });
        }
        let gpu = self.gpu()?;
        let host: Vec<f32> = rows.iter().copied().collect();
        let d_rows = gpu.up(&host)?;
        let d_rot = gpu.up(&side.rotation)?;
        let out = gpu.zeros::<u8>(n * rb)?;
        let status = gpu.zeros::<i32>(1)?;
        let (nn, stride) = (n as i64, l.head_dim as i64);
        let (d, dt, r, g, rbi) = (
            l.head_dim as i32,
            l.kept_dims as i32,
            l.r as i32,
            l.group_size as i32,
            rb as i32,
        );
        let smem = mosaickv_kernels::encode_smem_bytes(l.head_dim, l.kept_dims, l.groups());
        let f = gpu.func("mkv_encode");
        let mut b = gpu.stream.launch_builder(f);
        use cudarc::driver::PushKernelArg;
        b.arg(&d_rows)
            .arg(&nn)
            .arg(&stride)
            .arg(&d_rot)
            .arg(&d)
            .arg(&dt)
            .arg(&r)
            .arg(&g)
            .arg(&rbi)
            .arg(&out)
            .arg(&status);
        // SAFETY: argument order and types match mkv_encode; `out` holds n records.
        unsafe { b.launch(device::cfg(((n as u32).min(1 << 20), 1, 1), 128, smem)) }
            .map_err(drv("launch"))?;
        let st = gpu.down(&status)?;
        if st[0] != 0 {
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
        let mut bytes = gpu.down(&out)?;
        bytes.truncate(n * rb);
        Ok(PackedRows { count: n, bytes })
    }

    /// Host (fallback): a single small unpack; the device unpacks inside attention.
    fn decode(&self, packed: &PackedRows, side: &SideStrategy) -> Result<Array2<f32>> {
        self.host.decode(packed, side)
    }

    /// Host (fallback); `mkv_block_meta` exists but this single-stage call stays on the CPU.
    fn block_meta(
        &self,
        keys: &PackedRows,
        key: &SideStrategy,
        block_size: usize,
    ) -> Result<BlockMeta> {
        self.host.block_meta(keys, key, block_size)
    }

    /// Host (fallback); the device rotates queries inside `select`.
    fn rotate_queries(&self, queries: ArrayView2<f32>, key: &SideStrategy) -> Result<Array2<f32>> {
        self.host.rotate_queries(queries, key)
    }

    /// Host (fallback); the device scores blocks inside `select`.
    fn score_blocks(&self, meta: &BlockMeta, rotated_queries: ArrayView2<f32>) -> Result<Vec<f32>> {
        self.host.score_blocks(meta, rotated_queries)
    }

    /// Host (fallback); the device selects inside `select`.
    fn select_blocks(
        &self,
        scores: &[f32],
        block_lens: &[usize],
        budget_tokens: usize,
    ) -> Result<Vec<u32>> {
        self.host.select_blocks(scores, block_lens, budget_tokens)
    }

    /// Device: `mkv_rotate_queries`, `mkv_score_blocks`, `mkv_select_topk` (SPEC.md 8).
    fn select(&self, cache: &CompressedCache, queries: ArrayView2<f32>) -> Result<Selection> {
        let shape = [cache.shape.q_heads, cache.shape.head_dim];
        let q = self.upload_queries(cache, &queries, &shape)?;
        let gpu = self.gpu()?;
        let dc = self.upload(&[cache])?;
        let (_, sel, count) = dc.select(gpu, &q)?;
        let (sel, count) = dc.download_selection(gpu, &sel, &count)?;
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

    /// Device: `mkv_plan_items`, `mkv_packed_attention`, `mkv_merge` (SPEC.md 9).
    fn attend_selected(
        &self,
        cache: &CompressedCache,
        queries: ArrayView2<f32>,
        selection: &Selection,
        mut out: ArrayViewMut2<f32>,
    ) -> Result<()> {
        let q = self.upload_queries(cache, &queries, out.shape())?;
        let gpu = self.gpu()?;
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
        let (d_sel, d_count) = dc.upload_selection(gpu, &sel, &count)?;
        let (qrot, _, _) = dc.select(gpu, &q)?;
        let res = dc.attend_selected(gpu, &q, &qrot, &d_sel, &d_count)?;
        let host = gpu.down(&res)?;
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
        let q = self.upload_queries(cache, &queries, out.shape())?;
        let gpu = self.gpu()?;
        let dc = self.upload(&[cache])?;
        let res = dc.attend(gpu, &q)?;
        let host = gpu.down(&res)?;
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
