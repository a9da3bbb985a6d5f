//! The CPU emulation of the CUDA execution model (feature `emulated`; `emu/cuda_emu.h`).
//!
//! Every kernel of [`crate::KERNELS`] is compiled as host C++ by `build.rs` and launched
//! here with a `cuLaunchKernel`-style argument array: one pointer per kernel parameter,
//! to the parameter's value; "device" pointers are host pointers. A block's threads run
//! as cooperatively scheduled fibers, blocks one after another, so a run is
//! deterministic and can report what a GPU would only show as a wrong answer or a hang:
//! a barrier or warp operation not every thread reached, an index past shared memory,
//! a launch past the device limits the host assumes ([`EmuError`]).
//! Not modelled: the memory model, timing, real warp scheduling.

use std::ffi::{c_char, c_void, CStr, CString};

extern "C" {
    fn mkv_emu_kernel_count() -> usize;
    fn mkv_emu_kernel_name(i: usize) -> *const c_char;
    #[allow(clippy::too_many_arguments)]
    fn mkv_emu_launch(
        name: *const c_char,
        gx: u32,
        gy: u32,
        gz: u32,
        bx: u32,
        by: u32,
        bz: u32,
        dyn_smem: usize,
        max_dyn_smem: usize,
        args: *mut *mut c_void,
        arg_sizes: *const usize,
        nargs: usize,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
}

/// Why an emulated launch did not complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EmuError {
    /// No kernel of that name is compiled into the emulation.
    UnknownKernel(String),
    /// The argument count or an argument's size differs from the kernel's signature.
    BadArguments(String),
    /// The launch exceeds a device limit (threads, grid, shared memory, launch bounds).
    LaunchLimit(String),
    /// The kernel faulted while running: a divergent barrier or warp operation, an index
    /// past shared memory, a fixed-size array overrun.
    Fault(String),
}

impl std::fmt::Display for EmuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EmuError::UnknownKernel(s) => write!(f, "unknown kernel: {s}"),
            EmuError::BadArguments(s) => write!(f, "bad kernel arguments: {s}"),
            EmuError::LaunchLimit(s) => write!(f, "launch exceeds a device limit: {s}"),
            EmuError::Fault(s) => write!(f, "kernel fault: {s}"),
        }
    }
}

impl std::error::Error for EmuError {}

/// Names of every kernel compiled into the emulation (the entry points of
/// [`crate::KERNELS`] plus the negative case `mkv_dense_decode_divergent`).
pub fn kernel_names() -> Vec<String> {
    // SAFETY: the registry is built once and never changes; each name is a static C string.
    unsafe {
        (0..mkv_emu_kernel_count())
            .map(|i| {
                CStr::from_ptr(mkv_emu_kernel_name(i))
                    .to_string_lossy()
                    .into_owned()
            })
            .collect()
    }
}

/// One launch: grid and block dimensions, dynamic shared memory bytes and the most the
/// host opted in to (48 KiB unless it raised the kernel's limit).
#[derive(Debug, Clone, Copy)]
pub struct LaunchDims {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub dyn_smem: usize,
    pub max_dyn_smem: usize,
}

/// Runs kernel `name` to completion on the emulation.
///
/// # Safety
/// `args[i]` must point to a live value of `sizes[i]` bytes of the kernel's i-th parameter
/// type (checked: the sizes; not checked: the types), and every pointer those values hold
/// must be valid for every access the kernel makes with these dimensions.
pub unsafe fn launch(
    name: &str,
    dims: LaunchDims,
    args: &mut [*mut c_void],
    sizes: &[usize],
) -> Result<(), EmuError> {
    assert_eq!(args.len(), sizes.len(), "one size per argument");
    let cname = CString::new(name).map_err(|_| EmuError::UnknownKernel(name.into()))?;
    let mut err = vec![0u8; 2048];
    let rc = mkv_emu_launch(
        cname.as_ptr(),
        dims.grid.0,
        dims.grid.1,
        dims.grid.2,
        dims.block.0,
        dims.block.1,
        dims.block.2,
        dims.dyn_smem,
        dims.max_dyn_smem,
        args.as_mut_ptr(),
        sizes.as_ptr(),
        args.len(),
        err.as_mut_ptr() as *mut c_char,
        err.len(),
    );
    let msg = CStr::from_bytes_until_nul(&err)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    match rc {
        0 => Ok(()),
        1 => Err(EmuError::UnknownKernel(msg)),
        2 => Err(EmuError::BadArguments(msg)),
        3 => Err(EmuError::LaunchLimit(msg)),
        _ => Err(EmuError::Fault(msg)),
    }
}
