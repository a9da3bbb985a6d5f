//! A minimal NVRTC binding loaded at run time from an explicit path (no CUDA at
//! build time, no panic when the library is missing).
//!
//! NVRTC finds its companion `libnvrtc-builtins.so.*` through the dynamic
//! loader's search path; a pip wheel does not put it there, so [`Nvrtc::load`]
//! first loads every `libnvrtc-builtins*` file beside the given library by full
//! path (a library already loaded under that soname satisfies NVRTC's own
//! `dlopen`).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};

type Prog = *mut c_void;
type CreateFn = unsafe extern "C" fn(
    *mut Prog,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileFn = unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int;
type SizeFn = unsafe extern "C" fn(Prog, *mut usize) -> c_int;
type GetFn = unsafe extern "C" fn(Prog, *mut c_char) -> c_int;
type DestroyFn = unsafe extern "C" fn(*mut Prog) -> c_int;
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;

/// Environment variable naming the `libnvrtc.so.*` to load (CI and scripts/gpu-check.sh set it).
pub const NVRTC_ENV: &str = "MOSAICKV_NVRTC";

/// Library names tried, in order, when no path is given.
pub const NVRTC_CANDIDATES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// The output of one compilation.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub ptx: String,
    /// NVRTC's log: warnings even when compilation succeeded.
    pub log: String,
}

/// A loaded NVRTC library.
pub struct Nvrtc {
    // The builtins libraries must outlive `lib`; fields drop in declaration order.
    lib: libloading::Library,
    _builtins: Vec<libloading::Library>,
    path: PathBuf,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc").field("path", &self.path).finish()
    }
}

impl Nvrtc {
    /// Loads NVRTC from `path` (a file path, or a bare soname resolved by the loader).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, String> {
        let path = path.as_ref().to_path_buf();
        let mut builtins = Vec::new();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if let Ok(entries) = std::fs::read_dir(dir) {
                let mut files: Vec<PathBuf> = entries
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| {
                        p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                            n.starts_with("libnvrtc-builtins") && !n.contains(".alt.")
                        })
                    })
                    .collect();
                files.sort();
                for f in files {
                    // SAFETY: loading NVIDIA's NVRTC builtins library runs only its ELF
                    // initializers, which have no preconditions.
                    if let Ok(l) = unsafe { libloading::Library::new(&f) } {
                        builtins.push(l);
                    }
                }
            }
        }
        // SAFETY: as above; the library is NVRTC, whose initializers have no preconditions.
        let lib = unsafe { libloading::Library::new(&path) }
            .map_err(|e| format!("cannot load {}: {e}", path.display()))?;
        let me = Self {
            lib,
            _builtins: builtins,
            path,
        };
        me.version()?;
        Ok(me)
    }

    /// Loads NVRTC from `$MOSAICKV_NVRTC` if set, else the first of [`NVRTC_CANDIDATES`] the loader finds.
    pub fn load_default() -> Result<Self, String> {
        if let Some(p) = std::env::var_os(NVRTC_ENV).filter(|p| !p.is_empty()) {
            return Self::load(PathBuf::from(p));
        }
        let mut errs = Vec::new();
        for c in NVRTC_CANDIDATES {
            match Self::load(c) {
                Ok(n) => return Ok(n),
                Err(e) => errs.push(e),
            }
        }
        Err(format!(
            "no NVRTC library found (set {NVRTC_ENV}): {}",
            errs.join("; ")
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn sym<T: Copy>(&self, name: &[u8]) -> Result<T, String> {
        // SAFETY: every call site names an NVRTC C function and gives `T` its exact
        // C signature from nvrtc.h.
        unsafe { self.lib.get::<T>(name) }.map(|s| *s).map_err(|e| {
            format!(
                "{}: missing symbol {}: {e}",
                self.path.display(),
                String::from_utf8_lossy(name)
            )
        })
    }

    /// NVRTC's `(major, minor)` version.
    pub fn version(&self) -> Result<(i32, i32), String> {
        let f: VersionFn = self.sym(b"nvrtcVersion\0")?;
        let (mut a, mut b) = (0, 0);
        // SAFETY: both pointers are valid for writes of a c_int.
        let rc = unsafe { f(&mut a, &mut b) };
        if rc != 0 {
            return Err(format!("nvrtcVersion failed: {rc}"));
        }
        Ok((a, b))
    }

    /// Compiles `source` (named `name`, with `headers` as `(include name, source)`) to PTX.
    /// `Err` holds the error code and the log; `Ok` still carries the log (warnings).
    pub fn compile(
        &self,
        name: &str,
        source: &str,
        headers: &[(&str, &str)],
        options: &[&str],
    ) -> Result<Compiled, String> {
        let create: CreateFn = self.sym(b"nvrtcCreateProgram\0")?;
        let compile: CompileFn = self.sym(b"nvrtcCompileProgram\0")?;
        let log_size: SizeFn = self.sym(b"nvrtcGetProgramLogSize\0")?;
        let get_log: GetFn = self.sym(b"nvrtcGetProgramLog\0")?;
        let ptx_size: SizeFn = self.sym(b"nvrtcGetPTXSize\0")?;
        let get_ptx: GetFn = self.sym(b"nvrtcGetPTX\0")?;
        let destroy: DestroyFn = self.sym(b"nvrtcDestroyProgram\0")?;
        let cstr = |s: &str| CString::new(s).map_err(|_| format!("NUL byte in {s:?}"));
        let src = cstr(source)?;
        let cname = cstr(name)?;
        let hsrc = headers
            .iter()
            .map(|(_, s)| cstr(s))
            .collect::<Result<Vec<_>, _>>()?;
        let hname = headers
            .iter()
            .map(|(n, _)| cstr(n))
            .collect::<Result<Vec<_>, _>>()?;
        let hsrc_p: Vec<*const c_char> = hsrc.iter().map(|c| c.as_ptr()).collect();
        let hname_p: Vec<*const c_char> = hname.iter().map(|c| c.as_ptr()).collect();
        let opts = options
            .iter()
            .map(|o| cstr(o))
            .collect::<Result<Vec<_>, _>>()?;
        let opts_p: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
        let mut prog: Prog = std::ptr::null_mut();
        // SAFETY: every pointer refers to a NUL-terminated string alive for this call;
        // the two header arrays have `headers.len()` entries.
        let rc = unsafe {
            create(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                headers.len() as c_int,
                hsrc_p.as_ptr(),
                hname_p.as_ptr(),
            )
        };
        if rc != 0 {
            return Err(format!("nvrtcCreateProgram({name}) failed: {rc}"));
        }
        // SAFETY: `prog` is a live program; the option array has `opts_p.len()` valid strings.
        let rc = unsafe { compile(prog, opts_p.len() as c_int, opts_p.as_ptr()) };
        let read = |size_fn: SizeFn, get_fn: GetFn| -> String {
            let mut n = 0usize;
            // SAFETY: `prog` is live; `n` is valid for writes; the buffer has `n` bytes,
            // which NVRTC fills with a NUL-terminated string.
            unsafe {
                if size_fn(prog, &mut n) != 0 || n == 0 {
                    return String::new();
                }
                let mut buf = vec![0u8; n];
                if get_fn(prog, buf.as_mut_ptr() as *mut c_char) != 0 {
                    return String::new();
                }
                CStr::from_bytes_until_nul(&buf)
                    .map(|c| c.to_string_lossy().into_owned())
                    .unwrap_or_default()
            }
        };
        let log = read(log_size, get_log).trim().to_string();
        let result = if rc == 0 {
            Ok(Compiled {
                ptx: read(ptx_size, get_ptx),
                log,
            })
        } else {
            Err(format!("NVRTC error {rc} compiling {name}:\n{log}"))
        };
        // SAFETY: `prog` was created above and is destroyed exactly once.
        unsafe { destroy(&mut prog) };
        result
    }

    /// Compiles one of [`crate::KERNELS`] for `arch` (e.g. `compute_90`) with [`crate::NVRTC_OPTIONS`].
    pub fn compile_kernel(&self, file: &str, source: &str, arch: &str) -> Result<Compiled, String> {
        let arch_opt = format!("--gpu-architecture={arch}");
        let mut opts: Vec<&str> = vec![&arch_opt];
        opts.extend_from_slice(crate::NVRTC_OPTIONS);
        self.compile(file, source, crate::HEADERS, &opts)
    }
}
