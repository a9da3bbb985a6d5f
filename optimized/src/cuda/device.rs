//! The device: an executor (a CUDA context with every kernel compiled and loaded, or the
//! CPU emulation of feature `cuda-emulated`), its buffers, uploaded caches and the decode
//! pipelines. Every launch plan below (grid, block, shared memory, argument list) is the
//! same code for both executors: [`Gpu::launch`] takes a `cuLaunchKernel`-style argument
//! list and hands it to the driver or to the emulation.

use super::layout::HostTables;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr};
use mosaickv_kernels as k;
use mosaickv_spec::{MosaicError, Result};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

pub(crate) fn drv<E: std::fmt::Debug>(what: &str) -> impl FnOnce(E) -> MosaicError + '_ {
    move |e| MosaicError::BackendUnavailable(format!("CUDA {what}: {e:?}"))
}

/// Prefix of the message of a kernel fault (an asynchronous error of a launched kernel on
/// the device, or a fault the emulation detects). Such an error is not "no device": the
/// backend drops its context after one and builds a fresh one on the next call.
pub const KERNEL_FAULT: &str = "CUDA kernel fault";

/// Whether `e` is a kernel fault (see [`KERNEL_FAULT`]).
pub fn is_kernel_fault(e: &MosaicError) -> bool {
    matches!(e, MosaicError::BackendUnavailable(m) if m.starts_with(KERNEL_FAULT))
}

/// Shared memory a kernel gets without opting in (bytes).
pub const DEFAULT_SMEM: usize = 48 * 1024;
/// The opt-in limit of the emulated device: an H100/H200's 227 KiB per block.
pub const EMULATED_SMEM_OPTIN: usize = 227 * 1024;

/// Element types of device buffers.
pub trait Elem:
    cudarc::driver::DeviceRepr
    + cudarc::driver::ValidAsZeroBits
    + Copy
    + Default
    + Send
    + Sync
    + 'static
{
}
impl<T> Elem for T where
    T: cudarc::driver::DeviceRepr
        + cudarc::driver::ValidAsZeroBits
        + Copy
        + Default
        + Send
        + Sync
        + 'static
{
}

/// A device buffer: device memory, or host memory standing in for it under the emulation.
pub enum Buf<T: Elem> {
    Cuda(CudaSlice<T>),
    #[cfg(feature = "cuda-emulated")]
    Emu(EmuBuf<T>),
}

impl<T: Elem> Buf<T> {
    pub fn len(&self) -> usize {
        match self {
            Buf::Cuda(s) => s.len(),
            #[cfg(feature = "cuda-emulated")]
            Buf::Emu(b) => b.len,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device allocation (None under the emulation).
    pub fn cuda(&self) -> Option<&CudaSlice<T>> {
        match self {
            Buf::Cuda(s) => Some(s),
            #[cfg(feature = "cuda-emulated")]
            Buf::Emu(_) => None,
        }
    }
    pub fn cuda_mut(&mut self) -> Option<&mut CudaSlice<T>> {
        match self {
            Buf::Cuda(s) => Some(s),
            #[cfg(feature = "cuda-emulated")]
            Buf::Emu(_) => None,
        }
    }
}

/// Host memory the emulated kernels read and write through raw pointers.
#[cfg(feature = "cuda-emulated")]
pub struct EmuBuf<T> {
    data: std::cell::UnsafeCell<Vec<T>>,
    len: usize,
}
// SAFETY: the buffer is written only by emulated launches, which run to completion
// inside `Gpu::launch` on the calling thread; no reference into it escapes.
#[cfg(feature = "cuda-emulated")]
unsafe impl<T: Send> Send for EmuBuf<T> {}
#[cfg(feature = "cuda-emulated")]
unsafe impl<T: Send> Sync for EmuBuf<T> {}

#[cfg(feature = "cuda-emulated")]
impl<T: Copy> EmuBuf<T> {
    fn addr(&self) -> u64 {
        // SAFETY: only the pointer is taken; kernels access it during a launch.
        unsafe { (*self.data.get()).as_mut_ptr() as u64 }
    }
    fn to_vec(&self) -> Vec<T> {
        // SAFETY: no launch runs while the caller holds `&self` on this thread.
        unsafe { (&*self.data.get())[..self.len].to_vec() }
    }
}

/// One kernel argument as the launch passes it: its bytes (a pointer or a scalar).
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl Arg {
    fn bytes(self) -> ([u8; 8], usize) {
        let mut w = [0u8; 8];
        let n = match self {
            Arg::Ptr(p) => {
                w.copy_from_slice(&p.to_ne_bytes());
                8
            }
            Arg::I64(v) => {
                w.copy_from_slice(&v.to_ne_bytes());
                8
            }
            Arg::I32(v) => {
                w[..4].copy_from_slice(&v.to_ne_bytes());
                4
            }
            Arg::F32(v) => {
                w[..4].copy_from_slice(&v.to_ne_bytes());
                4
            }
        };
        (w, n)
    }
}

/// A null pointer argument.
pub struct Null;

/// Something that can be a kernel argument.
pub trait KArg {
    fn karg(&self, gpu: &Gpu) -> Arg;
}
impl<T: Elem> KArg for Buf<T> {
    fn karg(&self, gpu: &Gpu) -> Arg {
        Arg::Ptr(gpu.addr(self))
    }
}
impl KArg for Null {
    fn karg(&self, _: &Gpu) -> Arg {
        Arg::Ptr(0)
    }
}
impl KArg for i32 {
    fn karg(&self, _: &Gpu) -> Arg {
        Arg::I32(*self)
    }
}
impl KArg for i64 {
    fn karg(&self, _: &Gpu) -> Arg {
        Arg::I64(*self)
    }
}
impl KArg for f32 {
    fn karg(&self, _: &Gpu) -> Arg {
        Arg::F32(*self)
    }
}
impl<A: KArg + ?Sized> KArg for &A {
    fn karg(&self, gpu: &Gpu) -> Arg {
        (**self).karg(gpu)
    }
}

/// `kargs![gpu; a, b, ...]`: the argument list of a launch, in the kernel's parameter order.
macro_rules! kargs {
    ($gpu:expr; $($a:expr),* $(,)?) => { [$($crate::cuda::device::KArg::karg(&$a, $gpu)),*] };
}
pub(crate) use kargs;

/// Grid, block (x only: every kernel is one-dimensional in threads) and dynamic shared memory.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub smem: usize,
}

pub(crate) fn cfg(grid: (u32, u32, u32), block: u32, smem: usize) -> Plan {
    Plan { grid, block, smem }
}

enum Exec {
    Cuda {
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        funcs: HashMap<&'static str, CudaFunction>,
        /// CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN.
        smem_optin: usize,
    },
    #[cfg(feature = "cuda-emulated")]
    Emu,
}

/// An executor for the kernels: a CUDA context with every kernel compiled (NVRTC: CUBIN
/// for the device's arch, else PTX) and loaded, or the CPU emulation.
pub struct Gpu {
    exec: Exec,
    pub arch: String,
    pub sms: u32,
    pub name: String,
    /// How the kernels were compiled ("CUBIN sm_90", "PTX compute_90 (ISA 9.0)", "emulated").
    pub code: String,
}

impl Gpu {
    /// Creates a context on device 0 and compiles every kernel. The caller has
    /// already checked that the driver library loads (cudarc panics otherwise).
    pub fn new() -> Result<Self> {
        let ctx = CudaContext::new(0).map_err(drv("context"))?;
        let (maj, min) = ctx
            .compute_capability()
            .map_err(drv("compute capability"))?;
        use cudarc::driver::sys::CUdevice_attribute as A;
        let sms = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("attribute"))? as u32;
        let smem_optin = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(drv("attribute"))? as usize;
        let name = ctx.name().unwrap_or_else(|_| "unknown CUDA device".into());
        let nvrtc = k::nvrtc::Nvrtc::load_default().map_err(MosaicError::BackendUnavailable)?;
        let mut driver_version = 0i32;
        // SAFETY: cuDriverGetVersion writes one int; the driver is loaded (context exists).
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) };
        let mut funcs = HashMap::new();
        let mut code = String::new();
        for (file, src, entries) in k::KERNELS {
            let out = nvrtc
                .compile_for_device(file, src, (maj, min), driver_version)
                .map_err(MosaicError::BackendUnavailable)?;
            code = out.describe();
            let image = match out.cubin {
                Some(c) => cudarc::nvrtc::Ptx::from_binary(c),
                None => cudarc::nvrtc::Ptx::from_src(out.ptx),
            };
            let module = ctx.load_module(image).map_err(drv("module load"))?;
            for e in *entries {
                funcs.insert(*e, module.load_function(e).map_err(drv("function"))?);
            }
        }
        let stream = ctx.default_stream();
        Ok(Self {
            exec: Exec::Cuda {
                ctx,
                stream,
                funcs,
                smem_optin,
            },
            arch: format!("sm_{maj}{min}"),
            sms,
            name,
            code,
        })
    }

    /// The CPU emulation of the CUDA execution model (feature `cuda-emulated`): every
    /// kernel runs on fibers (kernels/emu); 4 "SMs" for the split heuristics.
    #[cfg(feature = "cuda-emulated")]
    pub fn emulated() -> Self {
        Self {
            exec: Exec::Emu,
            arch: "emulated".into(),
            sms: 4,
            name: "CPU emulation of the CUDA execution model".into(),
            code: "emulated (host C++)".into(),
        }
    }

    /// Whether this executor is the emulation.
    pub fn is_emulated(&self) -> bool {
        !matches!(self.exec, Exec::Cuda { .. })
    }

    /// The stream of a device executor (None under the emulation).
    pub fn stream(&self) -> Option<&Arc<CudaStream>> {
        match &self.exec {
            Exec::Cuda { stream, .. } => Some(stream),
            #[cfg(feature = "cuda-emulated")]
            Exec::Emu => None,
        }
    }

    fn addr<T: Elem>(&self, b: &Buf<T>) -> u64 {
        match (b, &self.exec) {
            (Buf::Cuda(s), Exec::Cuda { stream, .. }) => {
                let (p, _sync) = s.device_ptr(stream);
                p
            }
            #[cfg(feature = "cuda-emulated")]
            (Buf::Emu(e), _) => e.addr(),
            #[cfg(feature = "cuda-emulated")]
            _ => 0,
        }
    }

    /// Launches `name` with `plan` and `args` (the kernel's parameters, in order). Dynamic
    /// shared memory past 48 KiB is opted in to (`cuFuncSetAttribute`) up to the device's
    /// limit; past it, the launch is refused with a typed error.
    pub fn launch(&self, name: &'static str, plan: Plan, args: &[Arg]) -> Result<()> {
        let mut words: Vec<([u8; 8], usize)> = args.iter().map(|a| a.bytes()).collect();
        #[cfg_attr(not(feature = "cuda-emulated"), allow(unused_variables))]
        let sizes: Vec<usize> = words.iter().map(|w| w.1).collect();
        let mut ptrs: Vec<*mut c_void> = words
            .iter_mut()
            .map(|w| w.0.as_mut_ptr() as *mut c_void)
            .collect();
        match &self.exec {
            Exec::Cuda {
                ctx,
                stream,
                funcs,
                smem_optin,
            } => {
                let f = funcs.get(name).ok_or_else(|| {
                    MosaicError::BackendUnavailable(format!("no CUDA kernel {name}"))
                })?;
                ctx.bind_to_thread().map_err(drv("bind context"))?;
                if plan.smem > DEFAULT_SMEM {
                    if plan.smem > *smem_optin {
                        return Err(MosaicError::BackendUnavailable(format!(
                            "{name} needs {} B of shared memory; the device allows {smem_optin} B",
                            plan.smem
                        )));
                    }
                    f.set_attribute(
                        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        plan.smem as i32,
                    )
                    .map_err(drv("cuFuncSetAttribute"))?;
                }
                // SAFETY: every launch site passes the kernel's parameters in order, with the
                // sizes and types of its signature, and buffers holding every element the
                // kernel indexes for this plan (each site says why).
                unsafe {
                    cudarc::driver::result::launch_kernel(
                        f.cu_function(),
                        plan.grid,
                        (plan.block, 1, 1),
                        plan.smem as u32,
                        stream.cu_stream(),
                        &mut ptrs,
                    )
                }
                .map_err(|e| MosaicError::BackendUnavailable(format!("CUDA launch {name}: {e:?}")))
            }
            #[cfg(feature = "cuda-emulated")]
            Exec::Emu => {
                let dims = k::emu::LaunchDims {
                    grid: plan.grid,
                    block: (plan.block, 1, 1),
                    dyn_smem: plan.smem,
                    max_dyn_smem: if plan.smem > DEFAULT_SMEM {
                        EMULATED_SMEM_OPTIN
                    } else {
                        DEFAULT_SMEM
                    },
                };
                // SAFETY: as above; the emulation also checks the count and sizes.
                unsafe { k::emu::launch(name, dims, &mut ptrs, &sizes) }.map_err(|e| {
                    MosaicError::BackendUnavailable(format!("{KERNEL_FAULT} (emulated): {e}"))
                })
            }
        }
    }

    pub fn up<T: Elem>(&self, v: &[T]) -> Result<Buf<T>> {
        match &self.exec {
            Exec::Cuda { stream, .. } => {
                if v.is_empty() {
                    // Zero-length allocations are not portable: one zero element stands in.
                    return stream
                        .alloc_zeros::<T>(1)
                        .map(Buf::Cuda)
                        .map_err(drv("alloc"));
                }
                stream.clone_htod(v).map(Buf::Cuda).map_err(drv("upload"))
            }
            #[cfg(feature = "cuda-emulated")]
            Exec::Emu => {
                let mut d = v.to_vec();
                let len = d.len();
                if d.is_empty() {
                    d.push(T::default());
                }
                Ok(Buf::Emu(EmuBuf {
                    data: std::cell::UnsafeCell::new(d),
                    len: len.max(1),
                }))
            }
        }
    }

    pub fn zeros<T: Elem>(&self, n: usize) -> Result<Buf<T>> {
        match &self.exec {
            Exec::Cuda { stream, .. } => stream
                .alloc_zeros::<T>(n.max(1))
                .map(Buf::Cuda)
                .map_err(drv("alloc")),
            #[cfg(feature = "cuda-emulated")]
            Exec::Emu => Ok(Buf::Emu(EmuBuf {
                // All-zero bits are a valid T (ValidAsZeroBits); the element types are plain numbers.
                data: std::cell::UnsafeCell::new(vec![T::default(); n.max(1)]),
                len: n.max(1),
            })),
        }
    }

    /// Copies a buffer to the host. On the device this synchronizes the stream, so an
    /// asynchronous fault of an earlier launch surfaces here, as a kernel fault.
    pub fn down<T: Elem>(&self, s: &Buf<T>) -> Result<Vec<T>> {
        match (s, &self.exec) {
            (Buf::Cuda(s), Exec::Cuda { stream, .. }) => stream
                .clone_dtoh(s)
                .map_err(|e| device_error("download", e)),
            #[cfg(feature = "cuda-emulated")]
            (Buf::Emu(e), _) => Ok(e.to_vec()),
            #[cfg(feature = "cuda-emulated")]
            _ => Err(MosaicError::BackendUnavailable(
                "a buffer of another executor".into(),
            )),
        }
    }

    /// Writes `v` into `b` at element offset `off`: a copy of only these elements.
    pub fn write<T: Elem>(&self, b: &mut Buf<T>, off: usize, v: &[T]) -> Result<()> {
        if off + v.len() > b.len() {
            return Err(MosaicError::ShapeMismatch {
                what: "device write",
                expected: format!("at most {} elements", b.len()),
                got: format!("{} at offset {off}", v.len()),
            });
        }
        if v.is_empty() {
            // Nothing to copy (and no zero-byte copy for the driver).
            return Ok(());
        }
        match (b, &self.exec) {
            (Buf::Cuda(s), Exec::Cuda { stream, .. }) => stream
                .memcpy_htod(v, &mut s.slice_mut(off..off + v.len()))
                .map_err(drv("upload")),
            #[cfg(feature = "cuda-emulated")]
            (Buf::Emu(e), _) => {
                // SAFETY: no launch runs while the caller holds `&mut` to the buffer.
                unsafe { (&mut *e.data.get())[off..off + v.len()].copy_from_slice(v) };
                Ok(())
            }
            #[cfg(feature = "cuda-emulated")]
            _ => Err(MosaicError::BackendUnavailable(
                "a buffer of another executor".into(),
            )),
        }
    }

    pub fn sync(&self) -> Result<()> {
        match &self.exec {
            Exec::Cuda { stream, .. } => stream
                .synchronize()
                .map_err(|e| device_error("synchronize", e)),
            #[cfg(feature = "cuda-emulated")]
            Exec::Emu => Ok(()),
        }
    }
}

/// A driver error at a synchronization point: the errors a faulting kernel leaves (illegal
/// address, illegal instruction, misaligned address, trap, launch failure, ...) are kernel
/// faults; anything else is the driver's.
fn device_error(what: &str, e: cudarc::driver::DriverError) -> MosaicError {
    use cudarc::driver::sys::CUresult as R;
    let fault = matches!(
        e.0,
        R::CUDA_ERROR_ILLEGAL_ADDRESS
            | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | R::CUDA_ERROR_MISALIGNED_ADDRESS
            | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | R::CUDA_ERROR_INVALID_PC
            | R::CUDA_ERROR_LAUNCH_FAILED
            | R::CUDA_ERROR_HARDWARE_STACK_ERROR
            | R::CUDA_ERROR_ASSERT
            | R::CUDA_ERROR_LAUNCH_TIMEOUT
    );
    if fault {
        MosaicError::BackendUnavailable(format!("{KERNEL_FAULT} (seen at {what}): {e:?}"))
    } else {
        MosaicError::BackendUnavailable(format!("CUDA {what}: {e:?}"))
    }
}

/// A batch of compressed caches resident on the device.
pub struct DeviceCache {
    pub t: HostTables,
    pub(crate) packed_k: Buf<u8>,
    pub(crate) packed_v: Buf<u8>,
    pub(crate) rot: Buf<u16>,
    pub(crate) meta_min: Buf<u8>,
    pub(crate) meta_max: Buf<u8>,
    pub(crate) meta_scale: Buf<f32>,
    pub(crate) seg: Buf<u8>,
    seg_batch: Buf<i32>,
    seg_base: Buf<i32>,
    pub(crate) blocks: Buf<u8>,
    block_owner: Buf<i32>,
    block_base: Buf<i64>,
    pub(crate) block_end: Buf<i64>,
    pub(crate) block_lens: Buf<i32>,
    pub(crate) dense_k: Buf<u16>,
    pub(crate) dense_v: Buf<u16>,
    dense_base: Buf<i64>,
    pub(crate) dense_count: Buf<i32>,
    pub(crate) budget: Buf<i64>,
}

/// Extra elements allocated after the data a [`DeviceCache`] uploads, per data buffer: the
/// room a [`super::CudaCache`] swap writes a re-encoded segment into (its second buffer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DataRoom {
    pub packed_k: usize,
    pub packed_v: usize,
    pub rot: usize,
    /// For `meta_min` and `meta_max` each (they share offsets).
    pub meta: usize,
    pub scale: usize,
}

/// Blocks per work item of `mkv_packed_attention` (one segment's run of selected blocks).
pub const BLOCKS_PER_ITEM: usize = 32;

impl DeviceCache {
    pub fn upload(gpu: &Gpu, t: HostTables) -> Result<Self> {
        Self::upload_with_room(gpu, t, DataRoom::default())
    }

    /// [`DeviceCache::upload`] with `room` extra (zero) elements after each data buffer's data.
    pub fn upload_with_room(gpu: &Gpu, t: HostTables, room: DataRoom) -> Result<Self> {
        fn up_room<T: Elem>(gpu: &Gpu, v: &[T], extra: usize) -> Result<Buf<T>> {
            if extra == 0 {
                return gpu.up(v);
            }
            let mut b = gpu.zeros::<T>(v.len() + extra)?;
            gpu.write(&mut b, 0, v)?;
            Ok(b)
        }
        Ok(Self {
            packed_k: up_room(gpu, &t.packed_k, room.packed_k)?,
            packed_v: up_room(gpu, &t.packed_v, room.packed_v)?,
            rot: up_room(gpu, &t.rot, room.rot)?,
            meta_min: up_room(gpu, &t.meta_min, room.meta)?,
            meta_max: up_room(gpu, &t.meta_max, room.meta)?,
            meta_scale: up_room(gpu, &t.meta_scale, room.scale)?,
            seg: gpu.up(bytemuck::cast_slice::<_, u8>(&t.seg))?,
            seg_batch: gpu.up(&t.seg_batch)?,
            seg_base: gpu.up(&t.seg_base)?,
            blocks: gpu.up(bytemuck::cast_slice::<_, u8>(&t.blocks))?,
            block_owner: gpu.up(&t.block_owner)?,
            block_base: gpu.up(&t.block_base)?,
            block_end: gpu.up(&t.block_end)?,
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

    /// Bytes this cache holds on the device (every buffer, padding element included).
    pub fn device_bytes(&self) -> usize {
        fn b<T: Elem>(x: &Buf<T>) -> usize {
            x.len() * std::mem::size_of::<T>()
        }
        b(&self.packed_k)
            + b(&self.packed_v)
            + b(&self.rot)
            + b(&self.meta_min)
            + b(&self.meta_max)
            + b(&self.meta_scale)
            + b(&self.seg)
            + b(&self.seg_batch)
            + b(&self.seg_base)
            + b(&self.blocks)
            + b(&self.block_owner)
            + b(&self.block_base)
            + b(&self.block_end)
            + b(&self.block_lens)
            + b(&self.dense_k)
            + b(&self.dense_v)
            + b(&self.dense_base)
            + b(&self.dense_count)
            + b(&self.budget)
    }

    /// Appends one token's rows (`[kv_heads][D]` f16 bits each) to sequence `b`'s dense
    /// rows on the device, copying only that token and its new row count. `Err` (and
    /// nothing written) when `b` is out of range, the rows have the wrong length, or the
    /// spare rows reserved at upload are used up.
    pub fn append_token(&mut self, gpu: &Gpu, b: usize, key: &[u16], value: &[u16]) -> Result<()> {
        let t = &self.t;
        let row = t.kv_heads * t.head_dim;
        if b >= t.batch || key.len() != row || value.len() != row {
            return Err(MosaicError::ShapeMismatch {
                what: "appended token",
                expected: format!("sequence < {}, rows of {row}", t.batch),
                got: format!("sequence {b}, rows of {} / {}", key.len(), value.len()),
            });
        }
        let count = t.dense_count[b];
        if count >= t.dense_capacity[b] {
            return Err(MosaicError::InvalidConfig(format!(
                "sequence {b}: the {} dense rows reserved on the device are full",
                t.dense_capacity[b]
            )));
        }
        let off = (t.dense_base[b] as usize + count as usize) * row;
        gpu.write(&mut self.dense_k, off, key)?;
        gpu.write(&mut self.dense_v, off, value)?;
        gpu.write(&mut self.dense_count, b, &[count + 1])?;
        // The host mirror of the dense rows (a swap that consumes buffer rows moves the rest).
        self.t.dense_k[off..off + row].copy_from_slice(key);
        self.t.dense_v[off..off + row].copy_from_slice(value);
        self.t.dense_count[b] = count + 1;
        Ok(())
    }

    /// SPEC.md 8.1 on the device: `qrot[gseg][h]` = R_k(gseg, h / G)^T q_h (first Dt dims)
    /// for queries `q` `[batch][q_heads][D]`.
    pub fn rotate_queries(&self, gpu: &Gpu, q: &Buf<f32>) -> Result<Buf<f32>> {
        let t = &self.t;
        let (kv, qh, d) = (t.kv_heads as i32, t.q_heads as i32, t.head_dim as i32);
        let nseg = t.total_segments();
        let qrot = gpu.zeros::<f32>(nseg * t.q_heads * t.head_dim)?;
        if nseg > 0 {
            // SAFETY (of the arguments): mkv_rotate_queries's parameters in order; the seg
            // table has nseg * kv_heads entries and qrot nseg * q_heads * D (HostTables::build).
            gpu.launch(
                "mkv_rotate_queries",
                cfg((nseg as u32, t.q_heads as u32, 1), 128, 4 * t.head_dim),
                &kargs![gpu; q, self.seg, self.seg_batch, self.rot, kv, qh, d, qrot],
            )?;
        }
        Ok(qrot)
    }

    /// SPEC.md 8.2 on the device: the score of every block of every (b, j), in the tables'
    /// global block order.
    pub fn score_blocks(&self, gpu: &Gpu, qrot: &Buf<f32>) -> Result<Buf<f32>> {
        let t = &self.t;
        let (kv, qh, d) = (t.kv_heads as i32, t.q_heads as i32, t.head_dim as i32);
        let scores = gpu.zeros::<f32>(t.blocks.len())?;
        if !t.blocks.is_empty() {
            let total = t.blocks.len() as i64;
            let grid = (t.blocks.len().div_ceil(8) as u32).clamp(1, 65535 * 16);
            // mkv_score_blocks: one warp per block, 8 warps per thread block.
            gpu.launch(
                "mkv_score_blocks",
                cfg((grid, 1, 1), 256, 0),
                &kargs![gpu; self.blocks, self.block_owner, total, self.seg, self.meta_min,
                    self.meta_max, self.meta_scale, qrot, kv, qh, d, scores],
            )?;
        }
        Ok(scores)
    }

    /// SPEC.md 8.3 on the device: each (b, j)'s selection under its sequence's budget;
    /// returns (sel, count): sel[block_base[bj]..][..count[bj]] ascending.
    pub fn select_topk(&self, gpu: &Gpu, scores: &Buf<f32>) -> Result<(Buf<i32>, Buf<i32>)> {
        let sel = gpu.zeros::<i32>(self.t.blocks.len())?;
        let count = gpu.zeros::<i32>(self.nbj())?;
        let (kv, zero, no_force) = (self.t.kv_heads as i32, 0i32, 0i32);
        // Lengths given, so the uniform / last lengths are unused.
        gpu.launch(
            "mkv_select_topk",
            cfg((self.nbj() as u32, 1, 1), k::SELECT_THREADS, 0),
            &kargs![gpu; scores, self.block_base, self.block_end, self.block_lens, zero, zero,
                self.budget, kv, no_force, sel, count],
        )?;
        Ok((sel, count))
    }

    /// SPEC.md 8 on the device: rotated queries, block scores, top-k for queries `q`
    /// `[batch][q_heads][D]` (already uploaded). Returns (qrot, sel, count).
    pub fn select(&self, gpu: &Gpu, q: &Buf<f32>) -> Result<(Buf<f32>, Buf<i32>, Buf<i32>)> {
        let qrot = self.rotate_queries(gpu, q)?;
        let scores = self.score_blocks(gpu, &qrot)?;
        let (sel, count) = self.select_topk(gpu, &scores)?;
        Ok((qrot, sel, count))
    }

    /// Work items any selection the device's top-k makes can need (its budget bounds it).
    pub fn budget_max_items(&self) -> usize {
        self.t.max_items(BLOCKS_PER_ITEM)
    }

    /// Work items a selection of `counts[bj]` blocks per (b, j) needs: each segment's run
    /// splits into ceil(run / BLOCKS_PER_ITEM) items, at most ceil(count / per) + segments.
    pub fn selection_max_items(&self, counts: &[i32]) -> usize {
        counts
            .iter()
            .map(|&c| (c.max(0) as usize).div_ceil(BLOCKS_PER_ITEM) + self.t.max_segments)
            .max()
            .unwrap_or(0)
            .max(1)
    }

    /// SPEC.md 9 on the device for a selection already on the device; returns `[batch][q_heads][D]`.
    /// `max_items` must bound every (b, j)'s work items ([`DeviceCache::budget_max_items`] for
    /// the device's own selection, [`DeviceCache::selection_max_items`] for a given one); the
    /// planner's item count is checked against it, so a selection never loses blocks silently.
    pub fn attend_selected(
        &self,
        gpu: &Gpu,
        q: &Buf<f32>,
        qrot: &Buf<f32>,
        sel: &Buf<i32>,
        count: &Buf<i32>,
        max_items: usize,
    ) -> Result<Buf<f32>> {
        let t = &self.t;
        let (kv, qh, d) = (t.kv_heads as i32, t.q_heads as i32, t.head_dim as i32);
        let g = t.q_heads / t.kv_heads;
        let smem = k::packed_attention_smem_bytes(g, t.head_dim);
        let max_items = max_items.max(1);
        let per_item = BLOCKS_PER_ITEM as i32;
        let mi = max_items as i32;
        let items = gpu.zeros::<i32>(3 * self.nbj() * max_items)?;
        let item_count = gpu.zeros::<i32>(self.nbj())?;
        // items holds nbj * max_items int3.
        gpu.launch(
            "mkv_plan_items",
            cfg((self.nbj() as u32, 1, 1), 256, 0),
            &kargs![gpu; self.blocks, self.block_base, sel, count, self.seg_base, kv, per_item,
                mi, items, item_count],
        )?;
        let parts = max_items + 1;
        let pm = gpu.zeros::<f32>(self.nbj() * parts * g)?;
        let pl = gpu.zeros::<f32>(self.nbj() * parts * g)?;
        let po = gpu.zeros::<f32>(self.nbj() * parts * g * t.head_dim)?;
        let scale = std::f32::consts::LOG2_E / (t.head_dim as f32).sqrt();
        // Partial buffers hold nbj * (max_items + 1) parts of G heads.
        gpu.launch(
            "mkv_packed_attention",
            cfg(
                (parts as u32, t.kv_heads as u32, t.batch as u32),
                k::ATT_THREADS,
                smem,
            ),
            &kargs![gpu; q, qrot, self.seg, self.blocks, self.block_base, sel, items, item_count,
                mi, self.packed_k, self.packed_v, self.rot, self.dense_k, self.dense_v,
                self.dense_base, self.dense_count, kv, qh, d, scale, pm, pl, po],
        )?;
        let out = gpu.zeros::<f32>(t.batch * t.q_heads * t.head_dim)?;
        let pp = parts as i32;
        gpu.launch(
            "mkv_merge",
            cfg((t.q_heads as u32, t.batch as u32, 1), 128, 0),
            &kargs![gpu; pm, pl, po, item_count, pp, kv, qh, d, out],
        )?;
        Ok(out)
    }

    /// One decode step (select + attend) for queries `[batch][q_heads][D]` on the device.
    pub fn attend(&self, gpu: &Gpu, q: &Buf<f32>) -> Result<Buf<f32>> {
        let (qrot, sel, count) = self.select(gpu, q)?;
        self.attend_selected(gpu, q, &qrot, &sel, &count, self.budget_max_items())
    }

    /// Downloads a selection as `(sel, count)` host vectors.
    pub fn download_selection(
        &self,
        gpu: &Gpu,
        sel: &Buf<i32>,
        count: &Buf<i32>,
    ) -> Result<(Vec<i32>, Vec<i32>)> {
        Ok((gpu.down(sel)?, gpu.down(count)?))
    }

    pub fn upload_selection(
        &self,
        gpu: &Gpu,
        sel: &[i32],
        count: &[i32],
    ) -> Result<(Buf<i32>, Buf<i32>)> {
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
    pub k: Buf<u16>,
    pub v: Buf<u16>,
}

/// Quest page size (SPEC.md section 12).
pub const QUEST_PAGE: usize = 16;

/// Quest's selected pages as `mkv_dense_decode` reads them: (pages, base, count, max pages).
pub type PageList<'a> = (&'a Buf<i32>, &'a Buf<i64>, &'a Buf<i32>, usize);

impl DenseDevice {
    fn seq_stride(&self) -> i64 {
        (self.n * self.kv_heads * self.head_dim) as i64
    }

    /// Full attention (pages None) or attention over the listed pages with `splits` splits.
    pub fn decode(
        &self,
        gpu: &Gpu,
        q: &Buf<f32>,
        pages: Option<PageList<'_>>,
        splits: usize,
    ) -> Result<Buf<f32>> {
        self.decode_with(gpu, "mkv_dense_decode", q, pages, splits)
    }

    /// [`DenseDevice::decode`] with the kernel named (the emulation's negative case
    /// `mkv_dense_decode_divergent` has the same parameters).
    pub fn decode_with(
        &self,
        gpu: &Gpu,
        kernel: &'static str,
        q: &Buf<f32>,
        pages: Option<PageList<'_>>,
        splits: usize,
    ) -> Result<Buf<f32>> {
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
        let (pg, pb, pc) = match pages {
            Some((sel, base, count, _)) => (sel.karg(gpu), base.karg(gpu), count.karg(gpu)),
            None => (Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0)),
        };
        let chunks = g.div_ceil(k::DENSE_HEAD_CHUNK);
        // Null page pointers select the all-tokens mode; partial buffers hold nbj * splits
        // parts of G heads.
        let mut args = kargs![gpu; q, self.k, self.v, n, ss, kv, qh, d, scale, per_split].to_vec();
        args.extend([pg, pb, pc]);
        args.extend(kargs![gpu; page, pm, pl, po]);
        gpu.launch(
            kernel,
            cfg(
                (
                    splits as u32,
                    (self.kv_heads * chunks) as u32,
                    self.batch as u32,
                ),
                k::DENSE_THREADS,
                0,
            ),
            &args,
        )?;
        let out = gpu.zeros::<f32>(self.batch * self.q_heads * self.head_dim)?;
        let sp = splits as i32;
        // Null counts: every split is a part.
        gpu.launch(
            "mkv_merge",
            cfg((self.q_heads as u32, self.batch as u32, 1), 128, 0),
            &kargs![gpu; pm, pl, po, Null, sp, kv, qh, d, out],
        )?;
        Ok(out)
    }

    /// Splits so that about 4 thread blocks per SM run for this batch.
    pub fn default_splits(&self, gpu: &Gpu, work: usize) -> usize {
        let ctas = (4 * gpu.sms as usize).div_ceil(self.batch * self.kv_heads);
        ctas.clamp(1, work.div_ceil(256).max(1))
    }

    /// Full attention over every token.
    pub fn attend_full(&self, gpu: &Gpu, q: &Buf<f32>) -> Result<Buf<f32>> {
        let s = self.default_splits(gpu, self.n);
        self.decode(gpu, q, None, s)
    }
}

/// Quest on a [`DenseDevice`]: page metadata plus the selection state.
pub struct QuestDevice {
    pub pages: usize,
    mn: Buf<u16>,
    mx: Buf<u16>,
    base: Buf<i64>,
    budget: Buf<i64>,
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
        // mn/mx hold nbj * pages * D.
        gpu.launch(
            "mkv_page_meta",
            cfg(
                (pages as u32, dense.kv_heads as u32, dense.batch as u32),
                128,
                0,
            ),
            &kargs![gpu; dense.k, n, ss, kv, d, page, mn, mx],
        )?;
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
    pub fn attend(&self, gpu: &Gpu, dense: &DenseDevice, q: &Buf<f32>) -> Result<Buf<f32>> {
        let nbj = dense.batch * dense.kv_heads;
        let scores = gpu.zeros::<f32>(nbj * self.pages)?;
        let (pg, b, kv, qh, d) = (
            self.pages as i64,
            dense.batch as i32,
            dense.kv_heads as i32,
            dense.q_heads as i32,
            dense.head_dim as i32,
        );
        let grid = ((nbj * self.pages).div_ceil(8) as u32).clamp(1, 1 << 20);
        gpu.launch(
            "mkv_page_score",
            cfg((grid, 1, 1), 256, 0),
            &kargs![gpu; q, self.mn, self.mx, pg, b, kv, qh, d, scores],
        )?;
        let sel = gpu.zeros::<i32>(nbj * self.pages)?;
        let count = gpu.zeros::<i32>(nbj)?;
        let last = (dense.n - (self.pages - 1) * QUEST_PAGE) as i32;
        let uni = QUEST_PAGE as i32;
        let force = if self.pages > self.budget_pages {
            1i32
        } else {
            0
        };
        // Null lens: uniform pages.
        gpu.launch(
            "mkv_select_topk",
            cfg((nbj as u32, 1, 1), k::SELECT_THREADS, 0),
            &kargs![gpu; scores, self.base, Null, Null, uni, last, self.budget, kv, force, sel, count],
        )?;
        let splits = dense.default_splits(gpu, self.budget_pages * QUEST_PAGE);
        dense.decode(
            gpu,
            q,
            Some((&sel, &self.base, &count, self.budget_pages)),
            splits,
        )
    }
}
