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

/// Library names tried, in order, when no path is given (the loader's search path).
pub const NVRTC_CANDIDATES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// Where pip wheels put NVRTC below each `nvidia` namespace directory (CUDA 13 wheels use
/// `cu13/lib`, CUDA 12 ones `cuda_nvrtc/lib`), newest first.
pub const NVRTC_WHEEL_PATHS: &[&str] = &[
    "cu13/lib/libnvrtc.so.13",
    "cuda_nvrtc/lib/libnvrtc.so.13",
    "cu12/lib/libnvrtc.so.12",
    "cuda_nvrtc/lib/libnvrtc.so.12",
];

/// Every place NVRTC is looked for, in order, when `$MOSAICKV_NVRTC` is not set: the
/// toolkit (`$CUDA_HOME`, `/usr/local/cuda`), each `nvidia` namespace directory of the
/// Python environments (`site-packages/nvidia` under every entry of `$PYTHONPATH`, of
/// `python3 -c 'import sys; print(sys.path)'`, and of `$VIRTUAL_ENV` / `$CONDA_PREFIX`)
/// with [`NVRTC_WHEEL_PATHS`], then the bare sonames of [`NVRTC_CANDIDATES`].
pub fn nvrtc_search_paths() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut toolkits: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(p) = std::env::var_os(var).filter(|p| !p.is_empty()) {
            toolkits.push(PathBuf::from(p));
        }
    }
    toolkits.push(PathBuf::from("/usr/local/cuda"));
    for t in toolkits {
        for so in ["libnvrtc.so.13", "libnvrtc.so.12"] {
            out.push(t.join("lib64").join(so));
        }
    }
    let mut namespaces: Vec<PathBuf> = Vec::new();
    let mut site_dirs: Vec<PathBuf> = Vec::new();
    if let Some(pp) = std::env::var_os("PYTHONPATH") {
        site_dirs.extend(std::env::split_paths(&pp));
    }
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(root) = std::env::var_os(var).filter(|p| !p.is_empty()) {
            if let Ok(libs) = std::fs::read_dir(PathBuf::from(root).join("lib")) {
                for e in libs.flatten() {
                    site_dirs.push(e.path().join("site-packages"));
                }
            }
        }
    }
    // The interpreter's own path (covers --user installs and distribution site dirs).
    if let Ok(o) = std::process::Command::new("python3")
        .args(["-c", "import sys; print(chr(10).join(sys.path))"])
        .output()
    {
        site_dirs.extend(
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| !l.is_empty())
                .map(PathBuf::from),
        );
    }
    for d in site_dirs {
        let ns = d.join("nvidia");
        if ns.is_dir() && !namespaces.contains(&ns) {
            namespaces.push(ns);
        }
    }
    for ns in namespaces {
        for w in NVRTC_WHEEL_PATHS {
            out.push(ns.join(w));
        }
    }
    out.retain(|p| p.is_file());
    out.extend(NVRTC_CANDIDATES.iter().map(PathBuf::from));
    out
}

/// The output of one compilation.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// PTX text (empty when compiled to CUBIN for a real architecture `sm_XX`).
    pub ptx: String,
    /// NVRTC's log: warnings even when compilation succeeded.
    pub log: String,
    /// Device code for one real architecture (`nvrtcGetCUBIN`), when compiled for `sm_XX`.
    pub cubin: Option<Vec<u8>>,
    /// What was built, for reports: "CUBIN sm_90" or "PTX compute_90 (NVRTC 13.0)".
    pub what: String,
}

impl Compiled {
    pub fn describe(&self) -> String {
        self.what.clone()
    }
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

    /// Loads NVRTC from `$MOSAICKV_NVRTC` if set, else the first of [`nvrtc_search_paths`] that loads.
    pub fn load_default() -> Result<Self, String> {
        if let Some(p) = std::env::var_os(NVRTC_ENV).filter(|p| !p.is_empty()) {
            return Self::load(PathBuf::from(p));
        }
        let mut errs = Vec::new();
        for c in nvrtc_search_paths() {
            match Self::load(&c) {
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
        let real_arch = options
            .iter()
            .any(|o| o.starts_with("--gpu-architecture=sm_") || o.starts_with("-arch=sm_"));
        let result = if rc == 0 && real_arch {
            self.read_cubin(prog).map(|cubin| Compiled {
                ptx: String::new(),
                log,
                cubin: Some(cubin),
                what: String::new(),
            })
        } else if rc == 0 {
            Ok(Compiled {
                ptx: read(ptx_size, get_ptx),
                log,
                cubin: None,
                what: String::new(),
            })
        } else {
            Err(format!("NVRTC error {rc} compiling {name}:\n{log}"))
        };
        // SAFETY: `prog` was created above and is destroyed exactly once.
        unsafe { destroy(&mut prog) };
        result
    }

    fn read_cubin(&self, prog: Prog) -> Result<Vec<u8>, String> {
        let size: SizeFn = self.sym(b"nvrtcGetCUBINSize\0")?;
        let get: GetFn = self.sym(b"nvrtcGetCUBIN\0")?;
        let mut n = 0usize;
        // SAFETY: `prog` is a live, compiled program; the buffer has the `n` bytes NVRTC reports.
        unsafe {
            if size(prog, &mut n) != 0 || n == 0 {
                return Err("nvrtcGetCUBINSize failed or returned no CUBIN".into());
            }
            let mut buf = vec![0u8; n];
            if get(prog, buf.as_mut_ptr() as *mut c_char) != 0 {
                return Err("nvrtcGetCUBIN failed".into());
            }
            Ok(buf)
        }
    }

    /// Compiles one of [`crate::KERNELS`] for `arch` (`compute_90`: PTX; `sm_90`: CUBIN)
    /// with [`crate::NVRTC_OPTIONS`].
    pub fn compile_kernel(&self, file: &str, source: &str, arch: &str) -> Result<Compiled, String> {
        let arch_opt = format!("--gpu-architecture={arch}");
        let mut opts: Vec<&str> = vec![&arch_opt];
        opts.extend_from_slice(crate::NVRTC_OPTIONS);
        let mut c = self.compile(file, source, crate::HEADERS, &opts)?;
        let (a, b) = self.version()?;
        c.what = if c.cubin.is_some() {
            format!("CUBIN {arch} (NVRTC {a}.{b})")
        } else {
            format!("PTX {arch} (NVRTC {a}.{b})")
        };
        Ok(c)
    }

    /// Compiles for the device of compute capability `cc` under a driver of version
    /// `driver` (`cuDriverGetVersion`: 1000 * major + 10 * minor): CUBIN for `sm_XX`, which
    /// any driver that runs the device loads; where NVRTC cannot emit that, PTX for
    /// `compute_XX`, which the driver JIT-compiles only if it is at least as new as this
    /// NVRTC (else a clear error instead of the driver's unsupported-PTX-version failure).
    pub fn compile_for_device(
        &self,
        file: &str,
        source: &str,
        cc: (i32, i32),
        driver: i32,
    ) -> Result<Compiled, String> {
        let sm = format!("sm_{}{}", cc.0, cc.1);
        let cubin_err = match self.compile_kernel(file, source, &sm) {
            Ok(c) => return Ok(c),
            Err(e) => e,
        };
        let (a, b) = self.version()?;
        if check_ptx_driver((a, b), driver).is_err() {
            return Err(format!(
                "{file}: no CUBIN for {sm} ({cubin_err}); and PTX from NVRTC {a}.{b} needs a driver \
                 for CUDA {a}.{b} or newer, this one is CUDA {}.{}",
                driver / 1000,
                (driver % 1000) / 10
            ));
        }
        self.compile_kernel(file, source, &format!("compute_{}{}", cc.0, cc.1))
    }
}

/// `Ok` when a driver of version `driver` (1000 * major + 10 * minor) loads PTX from an
/// NVRTC of version `nvrtc`: PTX ISA versions are only read by drivers at least as new.
pub fn check_ptx_driver(nvrtc: (i32, i32), driver: i32) -> Result<(), String> {
    let need = 1000 * nvrtc.0 + 10 * nvrtc.1;
    if driver >= need {
        Ok(())
    } else {
        Err(format!(
            "PTX from NVRTC {}.{} needs driver version {need}, have {driver}",
            nvrtc.0, nvrtc.1
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_needs_a_driver_at_least_as_new_as_nvrtc() {
        assert!(check_ptx_driver((13, 0), 13000).is_ok());
        assert!(check_ptx_driver((12, 8), 13000).is_ok());
        assert!(check_ptx_driver((13, 1), 13000).is_err());
        assert!(check_ptx_driver((13, 0), 12080).is_err());
    }

    #[test]
    fn wheel_paths_cover_cuda_12_and_13_layouts() {
        assert!(NVRTC_WHEEL_PATHS.contains(&"cuda_nvrtc/lib/libnvrtc.so.12"));
        assert!(NVRTC_WHEEL_PATHS.contains(&"cu13/lib/libnvrtc.so.13"));
        // Every search path either exists or is a bare soname for the loader.
        for p in nvrtc_search_paths() {
            assert!(
                p.is_file() || p.components().count() == 1,
                "{}",
                p.display()
            );
        }
    }
}
