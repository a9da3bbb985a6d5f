//! `mosaickv._mosaickv`: the native half of the Python package.
//!
//! A thin layer over the library crates: one `_Cache` class holding any of the
//! caches (MosaicKV on the CPU or reference backend, or a baseline) behind a
//! mutex, numpy arrays in and out, and every `MosaicError` raised as the Python
//! class of its kind (defined in `mosaickv/_errors.py`) with the one-line
//! message the CLI prints. The user-facing classes and their docstrings live in
//! `mosaickv/__init__.py`.
//!
//! Every compression and attention call runs with the GIL released
//! (`Python::detach`); the mutex is taken inside, so a second thread waiting
//! for the same cache never holds the GIL while it waits.

#[cfg(feature = "cuda")]
use mosaickv_optimized::LiveCache;
use mosaickv_methods::{Implementation, Method, Mode, MosaicRun, Options};
use mosaickv_spec::{
    ChannelPolicy, CompressConfig, CompressedCache, KvCache, KvShape, KvqFormat, MemoryReport,
    MosaicError, SideStrategy, ValueDtype,
};
use ndarray::{Array2, ArrayD, ArrayView2, ArrayView3, ArrayViewD, Ix2, Ix3};
use numpy::{IntoPyArray, PyArray2, PyReadonlyArrayDyn};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::path::PathBuf;
use std::sync::Mutex;

// ------------------------------------------------------------------ errors

/// The Python class name of each `MosaicError` kind (in `mosaickv._errors`).
fn class_name(e: &MosaicError) -> &'static str {
    match e {
        MosaicError::NonFinite { .. } => "NonFiniteError",
        MosaicError::ShapeMismatch { .. } => "ShapeMismatchError",
        MosaicError::GroupSizeNotDivisor { .. } => "GroupSizeNotDivisorError",
        MosaicError::RetentionOutOfRange { .. } => "RetentionOutOfRangeError",
        MosaicError::EmptyCache => "EmptyCacheError",
        MosaicError::GqaMismatch { .. } => "GqaMismatchError",
        MosaicError::UnknownConfigKey(_) => "UnknownConfigKeyError",
        MosaicError::InvalidConfig(_) => "InvalidConfigError",
        MosaicError::AlreadyPrefilled(_) => "AlreadyPrefilledError",
        MosaicError::CorruptPacked(_) => "CorruptPackedError",
        MosaicError::BadFormat(_) => "BadFormatError",
        MosaicError::Io(_) => "IoError",
        MosaicError::BackendUnavailable(_) => "BackendUnavailableError",
    }
}

/// The message on one line, as `mosaickv` prints it (`CliError::one_line`).
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A Python exception of class `name` from `mosaickv._errors`.
fn raise(py: Python<'_>, name: &str, msg: String) -> PyErr {
    let made = py
        .import("mosaickv._errors")
        .and_then(|m| m.getattr(name))
        .and_then(|cls| cls.call1((msg.clone(),)));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        // Only if the package's Python half is missing: still an exception, never a crash.
        Err(_) => PyRuntimeError::new_err(msg),
    }
}

fn to_py(py: Python<'_>, e: MosaicError) -> PyErr {
    raise(py, class_name(&e), one_line(&e.to_string()))
}

/// Maps a library result to Python (`?` after this raises the right class).
trait OrRaise<T> {
    fn or_raise(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> OrRaise<T> for mosaickv_spec::Result<T> {
    fn or_raise(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}

// ------------------------------------------------------------------ arrays in

/// An input array as f32, always copied (a float16 array widened exactly) while the GIL is
/// held: the calls run with the GIL released (`Python::detach`), and another Python thread
/// could otherwise change a float32 array between its validation and its use (a row checked
/// finite, then read as infinity). The copy's memory is reserved fallibly: an input too large
/// to copy is a `MemoryError`, not an abort. Anything else than float32/float16 is a
/// `DtypeError`.
struct Input(ArrayD<f32>);

/// `a`'s elements mapped by `f` into a new array, its memory reserved first (`MemoryError`).
fn copied<T: Copy>(
    a: ndarray::ArrayViewD<'_, T>,
    what: &str,
    f: impl Fn(T) -> f32,
) -> PyResult<ArrayD<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(a.len()).map_err(|_| {
        pyo3::exceptions::PyMemoryError::new_err(format!(
            "{what}: {} elements of shape {:?} do not fit in memory",
            a.len(),
            a.shape()
        ))
    })?;
    v.extend(a.iter().map(|&x| f(x)));
    ArrayD::from_shape_vec(a.raw_dim(), v).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

impl Input {
    fn from<'py>(py: Python<'py>, obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        if let Ok(a) = obj.extract::<PyReadonlyArrayDyn<'py, f32>>() {
            return Ok(Input(copied(a.as_array(), what, |x| x)?));
        }
        if let Ok(a) = obj.extract::<PyReadonlyArrayDyn<'py, half::f16>>() {
            return Ok(Input(copied(a.as_array(), what, f32::from)?));
        }
        let got = match obj.getattr("dtype") {
            Ok(d) => format!("dtype {}", d.str()?),
            Err(_) => format!("a {}", obj.get_type().name()?),
        };
        Err(raise(
            py,
            "DtypeError",
            format!("{what}: unsupported {got} (need a numpy array of float32 or float16)"),
        ))
    }

    fn view(&self) -> ArrayViewD<'_, f32> {
        self.0.view()
    }
}

/// `a` as a view of rank 2 or 3, or `ShapeMismatch` naming what was expected.
fn ranked<'a, D: ndarray::Dimension>(
    a: ArrayViewD<'a, f32>,
    what: &'static str,
    expected: String,
) -> mosaickv_spec::Result<ndarray::ArrayView<'a, f32, D>> {
    let got = format!("{:?}", a.shape());
    a.into_dimensionality::<D>()
        .map_err(|_| MosaicError::ShapeMismatch {
            what,
            expected,
            got,
        })
}

// ------------------------------------------------------------------ the caches

/// Every cache the package offers: a cache of the method registry (`mosaickv-methods`, the
/// factory every front end uses) or, with the `cuda` feature, the CPU lifecycle with
/// attention on the GPU.
enum Kind {
    /// `backend="cpu"` or `"reference"`: whatever the registry built, with the backend it ran
    /// on (`"reference"` for the methods that exist only there, e.g. naive 2-D).
    Registry(Box<dyn KvCache>, &'static str),
    /// `Cache(backend="cuda")`: the CPU lifecycle, attention by the CUDA backend.
    #[cfg(feature = "cuda")]
    Cuda(Box<LiveCache>, Box<mosaickv_optimized::cuda::CudaBackend>),
}

impl Kind {
    fn kv(&mut self) -> &mut dyn KvCache {
        match self {
            Kind::Registry(c, _) => c.as_mut(),
            #[cfg(feature = "cuda")]
            Kind::Cuda(c, _) => c.as_mut(),
        }
    }

    fn kv_ref(&self) -> &dyn KvCache {
        match self {
            Kind::Registry(c, _) => c.as_ref(),
            #[cfg(feature = "cuda")]
            Kind::Cuda(c, _) => c.as_ref(),
        }
    }

    fn set_q_heads(&mut self, q: usize) -> mosaickv_spec::Result<()> {
        self.kv().set_q_heads(q)
    }

    fn compressed(&self) -> Option<&CompressedCache> {
        self.kv_ref().compressed()
    }

    fn backend(&self) -> &'static str {
        match self {
            Kind::Registry(_, b) => b,
            #[cfg(feature = "cuda")]
            Kind::Cuda(..) => "cuda",
        }
    }

    /// SPEC 8-9 (or 12) for queries `[q_heads, D]`, after matching the cache's q_heads to them.
    fn attend(&mut self, q: ArrayView2<f32>) -> mosaickv_spec::Result<Array2<f32>> {
        let s = self.kv_ref().shape();
        if q.ncols() == s.head_dim && q.nrows() != s.q_heads {
            // The queries are checked against the shape they would give before the cache takes
            // it: a refused call must leave the cache (and what it saves) as it was.
            let want = mosaickv_spec::KvShape::new(s.kv_heads, q.nrows(), s.head_dim)?;
            mosaickv_spec::validate::queries(&want, &q, &[want.q_heads, want.head_dim])?;
            self.set_q_heads(q.nrows())?;
        }
        let s = self.kv_ref().shape();
        let mut out = Array2::<f32>::zeros((s.q_heads, s.head_dim));
        match self {
            #[cfg(feature = "cuda")]
            Kind::Cuda(c, gpu) => {
                use mosaickv_spec::Backend as _;
                mosaickv_spec::validate::queries(&s, &q, out.shape())?;
                if c.is_empty() {
                    return Err(MosaicError::EmptyCache);
                }
                // The current version, uploaded for this step (correct, not fast).
                gpu.attend(c.compressed(), q, out.view_mut())?;
            }
            _ => self.kv().attend(q, out.view_mut())?,
        }
        Ok(out)
    }
}

fn shape_of(kv_heads: usize, head_dim: usize) -> mosaickv_spec::Result<KvShape> {
    KvShape::new(kv_heads, kv_heads, head_dim)
}

#[cfg(feature = "cuda")]
fn cuda_backend() -> mosaickv_spec::Result<Box<mosaickv_optimized::cuda::CudaBackend>> {
    Ok(Box::new(mosaickv_optimized::cuda::CudaBackend::new()?))
}

#[cfg(not(feature = "cuda"))]
fn no_cuda() -> MosaicError {
    MosaicError::BackendUnavailable(
        "this build of mosaickv has no CUDA support (rebuild the package with the `cuda` feature)"
            .into(),
    )
}

fn unknown_backend(name: &str, allowed: &str) -> MosaicError {
    MosaicError::InvalidConfig(format!("unknown backend `{name}` (expected {allowed})"))
}

/// Parses a configuration and checks every range that does not depend on
/// `head_dim` (group sizes against head_dim are checked when a cache is built).
fn parse_config(json: &str) -> mosaickv_spec::Result<CompressConfig> {
    let cfg = CompressConfig::from_json(json)?;
    // Any head_dim every candidate g divides: only the g-vs-head_dim rule is left out.
    let gs: Vec<usize> = match &cfg.channels {
        ChannelPolicy::Fixed { group_size, .. } => vec![*group_size],
        ChannelPolicy::LossThreshold { group_sizes, .. } => group_sizes.clone(),
    };
    let d = gs
        .iter()
        .try_fold(1usize, |acc, &g| {
            if g == 0 {
                None
            } else {
                acc.checked_mul(g / gcd(acc, g))
            }
        })
        .unwrap_or(1);
    cfg.validate(d)?;
    Ok(cfg)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn config_json(cfg: &CompressConfig) -> String {
    serde_json::to_string(cfg).expect("a CompressConfig always serializes")
}

/// One cache of any kind, shared between Python threads.
#[pyclass(module = "mosaickv._mosaickv", frozen)]
struct _Cache {
    inner: Mutex<Kind>,
}

impl _Cache {
    fn new(kind: Kind) -> Self {
        Self {
            inner: Mutex::new(kind),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Kind> {
        // A panic inside a library call would poison the lock; the data is still
        // the library's (which validates before mutating), so keep using it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A side strategy without its rotation matrix (all `segments` reports of it).
fn side_info(s: &SideStrategy) -> SideStrategy {
    SideStrategy {
        layout: s.layout.clone(),
        rotation: Vec::new(),
        fit_loss: s.fit_loss,
        coding: s.coding.clone(),
    }
}

fn side_dict<'py>(py: Python<'py>, s: &SideStrategy) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let l = &s.layout;
    d.set_item("r", l.r)?;
    d.set_item("g", l.group_size)?;
    d.set_item(
        "dtype",
        match l.dtype {
            ValueDtype::F16 => "float16",
            ValueDtype::Int8 => "int8",
            ValueDtype::Int4 => "int4",
            ValueDtype::Coded => "coded",
        },
    )?;
    d.set_item("kept_dims", l.kept_dims)?;
    if l.dtype == ValueDtype::Coded {
        d.set_item("code_bits", l.code_bits)?;
    }
    d.set_item("record_bytes", l.record_bytes())?;
    d.set_item("fit_loss", s.fit_loss)?;
    Ok(d)
}

fn memory_dict<'py>(
    py: Python<'py>,
    m: &MemoryReport,
    shape: &KvShape,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in [
        ("tokens", m.tokens),
        ("values", m.values),
        ("bitmaps", m.bitmaps),
        ("scales", m.scales),
        ("padding", m.padding),
        ("block_meta", m.block_meta),
        ("rotations", m.rotations),
        ("dense", m.dense),
        ("segment_headers", m.segment_headers),
        ("host_rows", m.host_rows),
        ("host_scratch", m.host_scratch),
        ("device_bytes", m.device_bytes()),
        ("host_bytes", m.host_bytes()),
    ] {
        d.set_item(k, v)?;
    }
    d.set_item("bytes_per_token", m.bytes_per_token())?;
    d.set_item(
        "dense_f16_bytes_per_token",
        MemoryReport::dense_f16_bytes_per_token(shape),
    )?;
    Ok(d)
}

#[pymethods]
impl _Cache {
    #[staticmethod]
    fn mosaic(
        py: Python<'_>,
        kv_heads: usize,
        head_dim: usize,
        config: &str,
        backend: &str,
    ) -> PyResult<Self> {
        let cfg = parse_config(config).or_raise(py)?;
        let shape = shape_of(kv_heads, head_dim).or_raise(py)?;
        if backend == "cuda" {
            return cuda_cache(py, shape, cfg);
        }
        let method = Method::Mosaic {
            implementation: implementation(backend).or_raise(py)?,
            config: cfg,
        };
        Self::built(py, &method, shape, backend)
    }

    /// Any method string, as every front end parses it (`mosaickv_spec::method`): `quest:rate=0.1`,
    /// `kvq4`, `mosaic:kloss=0.02`, ... (`mosaic-ref` is `mosaic` on the reference).
    #[staticmethod]
    fn method(
        py: Python<'_>,
        kv_heads: usize,
        head_dim: usize,
        method: &str,
        backend: &str,
    ) -> PyResult<Self> {
        let m = Method::parse(method).or_raise(py)?;
        let shape = shape_of(kv_heads, head_dim).or_raise(py)?;
        if backend == "cuda" {
            return match m {
                Method::Mosaic {
                    implementation: Implementation::Optimized,
                    config,
                } => cuda_cache(py, shape, config),
                _ => Err(to_py(py, cuda_baseline())),
            };
        }
        Self::built(py, &m, shape, backend)
    }

    #[staticmethod]
    fn full(py: Python<'_>, kv_heads: usize, head_dim: usize, backend: &str) -> PyResult<Self> {
        let shape = shape_of(kv_heads, head_dim).or_raise(py)?;
        Self::built(py, &Method::Full, shape, backend)
    }

    #[staticmethod]
    fn quest(
        py: Python<'_>,
        kv_heads: usize,
        head_dim: usize,
        token_rate: f64,
        min_budget_tokens: usize,
        backend: &str,
    ) -> PyResult<Self> {
        let shape = shape_of(kv_heads, head_dim).or_raise(py)?;
        let method = Method::Quest {
            token_rate,
            dense_layers: mosaickv_methods::QUEST_DENSE_LAYERS,
            min_budget_tokens,
        };
        Self::built(py, &method, shape, backend)
    }

    #[staticmethod]
    fn naive2d(
        py: Python<'_>,
        kv_heads: usize,
        head_dim: usize,
        token_rate: f64,
        retention: f64,
        min_budget_tokens: usize,
        backend: &str,
    ) -> PyResult<Self> {
        let shape = shape_of(kv_heads, head_dim).or_raise(py)?;
        let method = Method::Naive2d {
            retention,
            token_rate,
            min_budget_tokens,
        };
        Self::built(py, &method, shape, backend)
    }

    #[staticmethod]
    fn kvq(
        py: Python<'_>,
        kv_heads: usize,
        head_dim: usize,
        bits: u32,
        rotated: bool,
        backend: &str,
    ) -> PyResult<Self> {
        let shape = shape_of(kv_heads, head_dim).or_raise(py)?;
        let format = match bits {
            8 => KvqFormat::Q8_0,
            4 => KvqFormat::Q4_0,
            b => {
                return Err(to_py(
                    py,
                    MosaicError::InvalidConfig(format!(
                        "kvq has 8 (q8_0) or 4 (q4_0) bits, not {b}"
                    )),
                ))
            }
        };
        Self::built(py, &Method::Kvq { format, rotated }, shape, backend)
    }

    /// SPEC 15.5-15.6: a baseline cache file written by `save` of the baseline `method`
    /// (`full`, `quest`, `naive2d`, `kvq8`, `kvq4`); `full` also reads the `dense.mkv` of
    /// `mosaickv compress`. Another kind of file is `BadFormat` naming what it is.
    #[staticmethod]
    fn load_baseline(py: Python<'_>, path: PathBuf, method: &str, backend: &str) -> PyResult<Self> {
        let kind = py
            .detach(|| -> mosaickv_spec::Result<Kind> {
                if backend == "cuda" {
                    return Err(cuda_baseline());
                }
                let imp = implementation(backend)?;
                let c = mosaickv_methods::load_baseline(&path, method, imp).map_err(|e| match e {
                    MosaicError::BadFormat(m) => {
                        MosaicError::BadFormat(format!("{}: {m}", path.display()))
                    }
                    other => other,
                })?;
                let ran = if method == "naive2d" {
                    Implementation::Reference
                } else {
                    imp
                };
                Ok(Kind::Registry(c, backend_name(ran)))
            })
            .or_raise(py)?;
        Ok(Self::new(kind))
    }

    /// SPEC 15: a cache file as written by `save` or `mosaickv compress` (its `cache.mkv`).
    #[staticmethod]
    fn load(py: Python<'_>, path: PathBuf, backend: &str) -> PyResult<Self> {
        let kind = py
            .detach(|| -> mosaickv_spec::Result<Kind> {
                if backend == "cuda" {
                    #[cfg(feature = "cuda")]
                    {
                        let gpu = cuda_backend()?;
                        return Ok(Kind::Cuda(Box::new(LiveCache::load(&path, Mode::Sync)?), gpu));
                    }
                    #[cfg(not(feature = "cuda"))]
                    return Err(no_cuda());
                }
                let imp = implementation(backend)?;
                Ok(Kind::Registry(
                    mosaickv_methods::load_mosaic(&path, imp, Mode::Sync)?,
                    backend_name(imp),
                ))
            })
            .or_raise(py)?;
        Ok(Self::new(kind))
    }

    fn prefill(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let k = Input::from(py, keys, "keys")?;
        let v = Input::from(py, values, "values")?;
        let (kv, vv) = (k.view(), v.view());
        let want = "[tokens, kv_heads, head_dim]".to_string();
        let k3: ArrayView3<f32> = ranked::<Ix3>(kv, "keys", want.clone()).or_raise(py)?;
        let v3: ArrayView3<f32> = ranked::<Ix3>(vv, "values", want).or_raise(py)?;
        py.detach(|| self.lock().kv().prefill(k3, v3)).or_raise(py)
    }

    fn append(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let k = Input::from(py, key, "key")?;
        let v = Input::from(py, value, "value")?;
        let (kv, vv) = (k.view(), v.view());
        let want = "[kv_heads, head_dim]".to_string();
        let k2: ArrayView2<f32> = ranked::<Ix2>(kv, "key", want.clone()).or_raise(py)?;
        let v2: ArrayView2<f32> = ranked::<Ix2>(vv, "value", want).or_raise(py)?;
        py.detach(|| self.lock().kv().append(k2, v2)).or_raise(py)
    }

    fn attend<'py>(
        &self,
        py: Python<'py>,
        queries: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let q = Input::from(py, queries, "queries")?;
        let qv = q.view();
        let q2 = ranked::<Ix2>(qv, "queries", "[q_heads, head_dim]".into()).or_raise(py)?;
        let out = py.detach(|| self.lock().attend(q2)).or_raise(py)?;
        Ok(out.into_pyarray(py))
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        py.detach(|| self.lock().kv_ref().len())
    }

    /// (kv_heads, q_heads, head_dim): q_heads is the last one attention was given.
    fn shape(&self, py: Python<'_>) -> (usize, usize, usize) {
        let s = py.detach(|| self.lock().kv_ref().shape());
        (s.kv_heads, s.q_heads, s.head_dim)
    }

    fn backend(&self, py: Python<'_>) -> &'static str {
        py.detach(|| self.lock().backend())
    }

    /// The configuration as JSON (MosaicKV caches only).
    fn config(&self, py: Python<'_>) -> Option<String> {
        py.detach(|| self.lock().compressed().map(|c| config_json(&c.config)))
    }

    fn memory<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (m, s) = py.detach(|| {
            let g = self.lock();
            (g.kv_ref().memory(), g.kv_ref().shape())
        });
        memory_dict(py, &m, &s)
    }

    /// Per segment: start, len, state and per KV head the strategy (MosaicKV caches only).
    fn segments<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        // Copied out under the lock without the GIL (another thread may hold the lock
        // while it computes), turned into Python objects after.
        type Head = (usize, SideStrategy, SideStrategy);
        let segs: Option<Vec<(usize, usize, String, Vec<Head>)>> = py.detach(|| {
            let g = self.lock();
            g.compressed().map(|c| {
                c.segments
                    .iter()
                    .map(|seg| {
                        let heads = seg
                            .heads
                            .iter()
                            .map(|hs| {
                                let st = &hs.strategy;
                                (st.block_size, side_info(&st.key), side_info(&st.value))
                            })
                            .collect();
                        let state = format!("{:?}", seg.state).to_lowercase();
                        (seg.start, seg.len, state, heads)
                    })
                    .collect()
            })
        });
        let Some(segs) = segs else {
            return Ok(None);
        };
        let list = PyList::empty(py);
        for (start, len, state, heads) in segs {
            let d = PyDict::new(py);
            d.set_item("start", start)?;
            d.set_item("len", len)?;
            d.set_item("state", state)?;
            let hl = PyList::empty(py);
            for (block_size, key, value) in heads {
                let h = PyDict::new(py);
                h.set_item("block_size", block_size)?;
                h.set_item("key", side_dict(py, &key)?)?;
                h.set_item("value", side_dict(py, &value)?)?;
                hl.append(h)?;
            }
            d.set_item("heads", hl)?;
            list.append(d)?;
        }
        Ok(Some(list))
    }

    /// SPEC 15: writes the cache file: `cache.mkv` (15.3) for MosaicKV, a dense file (15.5)
    /// for full and Quest, a baseline cache file (15.6) for naive 2-D and kvq.
    fn save(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        py.detach(|| self.lock().kv().save(&path)).or_raise(py)
    }
}

impl _Cache {
    /// A cache of the method registry on `backend` (`"cpu"`: the optimized implementation,
    /// `"reference"`: the oracle), reporting the implementation that runs it.
    fn built(py: Python<'_>, method: &Method, shape: KvShape, backend: &str) -> PyResult<Self> {
        if backend == "cuda" {
            return Err(to_py(py, cuda_baseline()));
        }
        let options = Options {
            implementation: implementation(backend).or_raise(py)?,
            mosaic: MosaicRun::Live(Mode::Sync),
        };
        let cache = mosaickv_methods::cache(method, shape, &options).or_raise(py)?;
        let ran = mosaickv_methods::implementation_of(method, &options);
        Ok(Self::new(Kind::Registry(cache, backend_name(ran))))
    }
}

/// `"cpu"` / `"reference"` as the registry's implementation.
fn implementation(backend: &str) -> mosaickv_spec::Result<Implementation> {
    match backend {
        "cpu" => Ok(Implementation::Optimized),
        "reference" => Ok(Implementation::Reference),
        other => Err(unknown_backend(other, "\"cpu\", \"reference\" or \"cuda\"")),
    }
}

fn backend_name(imp: Implementation) -> &'static str {
    match imp {
        Implementation::Optimized => "cpu",
        Implementation::Reference => "reference",
    }
}

/// `Cache(backend="cuda")`: the CPU lifecycle, attention on the GPU.
#[allow(unused_variables)]
fn cuda_cache(py: Python<'_>, shape: KvShape, cfg: CompressConfig) -> PyResult<_Cache> {
    #[cfg(feature = "cuda")]
    {
        let gpu = cuda_backend().or_raise(py)?;
        let live = LiveCache::new(shape, cfg, Mode::Sync).or_raise(py)?;
        Ok(_Cache::new(Kind::Cuda(Box::new(live), gpu)))
    }
    #[cfg(not(feature = "cuda"))]
    Err(to_py(py, no_cuda()))
}

fn cuda_baseline() -> MosaicError {
    MosaicError::BackendUnavailable(
        "the package offers the baselines on \"cpu\" and \"reference\" only".into(),
    )
}

/// Parses and checks a configuration (JSON, any subset of SPEC.md section 2's
/// keys); returns it whole, defaults filled in.
#[pyfunction]
fn config_check(py: Python<'_>, json: &str) -> PyResult<String> {
    Ok(config_json(&parse_config(json).or_raise(py)?))
}

/// `CompressConfig::paper_fixed()` as JSON.
#[pyfunction]
fn config_paper() -> String {
    config_json(&CompressConfig::paper_fixed())
}

/// Whether this build has the CUDA backend.
#[pyfunction]
fn has_cuda() -> bool {
    cfg!(feature = "cuda")
}

#[pymodule]
fn _mosaickv(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<_Cache>()?;
    m.add_function(wrap_pyfunction!(config_check, m)?)?;
    m.add_function(wrap_pyfunction!(config_paper, m)?)?;
    m.add_function(wrap_pyfunction!(has_cuda, m)?)?;
    m.add("FORMAT_VERSION", mosaickv_spec::persist::FORMAT_VERSION)?;
    Ok(())
}
