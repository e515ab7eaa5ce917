//! shoal-py: the source SDK's Python module (`import shoal`), built with maturin.
//!
//! ```python
//! import numpy as np, shoal
//! with shoal.Source({"run": {...}, "source": {"ids": [2, 3], "input_time_base": "run"}}) as src:
//!     src.submit(2, 5_000_000, np.zeros(30_000, dtype=np.uint8))   # any buffer-protocol object
//!     src.flush(10.0)
//! report = src.report   # the end-of-run report (the context manager closed the source)
//! ```
//!
//! Main type: `Source`, a [`shoal_net::sdk::SourceHandle`] inside. The module's rules:
//! - any object with the buffer protocol is taken (bytes, bytearray, memoryview, numpy
//!   arrays of any dtype, C-contiguous); buffers of [`HOLD_FROM`] bytes or more are held
//!   without a copy until their fragment is sent, smaller ones are copied (cheaper than
//!   holding them);
//! - every call that can wait (a submission under back-pressure, `flush`, `close`)
//!   releases the GIL while it waits;
//! - refusals raise [`Refused`], back-pressure [`Full`], a closed run [`Closed`], all
//!   subclasses of `shoal.ShoalError`; the counts are in the report.

use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use shoal_core::ingest::{IngestError, Placed, When};
use shoal_net::config::Config;
use shoal_net::sdk::{SdkError, SourceHandle};

// The allocator of shoal's own binary, for this module's Rust code (the source loop
// allocates per frame); Python's objects keep Python's allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

create_exception!(shoal, ShoalError, PyException, "Any error of shoal's source SDK.");
create_exception!(shoal, ConfigError, ShoalError, "The configuration cannot be read or cannot run.");
create_exception!(shoal, Refused, ShoalError, "A fragment was refused (counted); the source goes on.");
create_exception!(shoal, Full, Refused, "Back-pressure: the input stayed full; the fragment was not taken (counted).");
create_exception!(shoal, Closed, ShoalError, "The run has ended: no more fragments are taken.");
create_exception!(shoal, RunError, ShoalError, "The source's data path failed.");

/// Buffers at least this long are held, not copied.
pub const HOLD_FROM: usize = 16 * 1024;

/// Python buffers whose fragments are gone, waiting to be released where the GIL is held
/// (the source's own threads never take the GIL).
type Graveyard = Arc<Mutex<Vec<PyUntypedBuffer>>>;

/// A Python buffer lent to a fragment without a copy.
struct HeldBuffer {
    buf: Option<PyUntypedBuffer>,
    ptr: *const u8,
    len: usize,
    graveyard: Graveyard,
}

// SAFETY: the memory behind `ptr` belongs to the exporting Python object, which the held
// `PyUntypedBuffer` keeps alive and unmoved until it is released; it is only read.
unsafe impl Send for HeldBuffer {}
unsafe impl Sync for HeldBuffer {}

impl AsRef<[u8]> for HeldBuffer {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: see `Send`: `len` bytes at `ptr`, alive while `buf` is held.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for HeldBuffer {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.graveyard.lock().unwrap_or_else(|p| p.into_inner()).push(b);
        }
    }
}

/// A source process inside this Python program.
///
/// `Source(config)`: `config` is a path to a TOML file (str or os.PathLike) or a dict of
/// the same schema. The data path starts at once.
#[pyclass(module = "shoal", frozen)]
struct Source {
    handle: RwLock<Option<Arc<SourceHandle>>>,
    graveyard: Graveyard,
    report: Mutex<Option<Py<PyAny>>>,
}

fn sdk_err(e: SdkError) -> PyErr {
    match e {
        SdkError::Config(e) => ConfigError::new_err(e.to_string()),
        SdkError::Refused(e) => ingest_err(e),
        e => RunError::new_err(e.to_string()),
    }
}

fn ingest_err(e: IngestError) -> PyErr {
    let msg = format!("{e} ({})", e.kind());
    match e {
        IngestError::Full { .. } => Full::new_err(msg),
        IngestError::Closed => Closed::new_err(msg),
        _ => Refused::new_err(msg),
    }
}

fn config_from(py: Python<'_>, config: &Bound<'_, PyAny>) -> PyResult<Config> {
    if config.is_instance_of::<PyDict>() {
        // A dict goes through JSON into the same serde schema as the TOML files.
        let json: String = py.import("json")?.call_method1("dumps", (config,))?.extract()?;
        let cfg: Config = serde_json::from_str(&json).map_err(|e| ConfigError::new_err(e.to_string()))?;
        cfg.validate().map_err(|e| ConfigError::new_err(e.to_string()))?;
        return Ok(cfg);
    }
    let path: std::path::PathBuf =
        config.extract().map_err(|_| PyValueError::new_err("config must be a path to a TOML file or a dict"))?;
    Config::from_file(&path).map_err(|e| ConfigError::new_err(e.to_string()))
}

impl Source {
    fn handle(&self) -> PyResult<Arc<SourceHandle>> {
        self.handle
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| Closed::new_err("the source is closed"))
    }

    /// Releases Python buffers whose fragments are gone (the GIL is held here).
    fn bury(&self) {
        let dead = std::mem::take(&mut *self.graveyard.lock().unwrap_or_else(|p| p.into_inner()));
        drop(dead);
    }

    fn payload(&self, data: &Bound<'_, PyAny>) -> PyResult<Bytes> {
        let buf = PyUntypedBuffer::get(data)?;
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err("the buffer must be C-contiguous (numpy: np.ascontiguousarray)"));
        }
        let (ptr, len) = (buf.buf_ptr() as *const u8, buf.len_bytes());
        if len < HOLD_FROM {
            // SAFETY: `len` readable bytes at `ptr` while `buf` is alive (it is, here).
            return Ok(Bytes::copy_from_slice(unsafe { std::slice::from_raw_parts(ptr, len) }));
        }
        Ok(Bytes::from_owner(HeldBuffer { buf: Some(buf), ptr, len, graveyard: self.graveyard.clone() }))
    }

    fn submit_when(
        &self,
        py: Python<'_>,
        source: u32,
        when: When,
        data: &Bound<'_, PyAny>,
        hit_count: Option<u32>,
    ) -> PyResult<u64> {
        self.bury();
        let handle = self.handle()?;
        let payload = self.payload(data)?;
        let placed = py.detach(|| match hit_count {
            None => handle.submit(source, when, payload),
            Some(n) => handle.submit_hits(source, when, n, payload),
        });
        match placed {
            Ok(Placed::OnTime(s) | Placed::Late(s)) => Ok(s),
            Err(e) => Err(ingest_err(e)),
        }
    }
}

#[pymethods]
impl Source {
    #[new]
    fn new(py: Python<'_>, config: &Bound<'_, PyAny>) -> PyResult<Self> {
        let cfg = config_from(py, config)?;
        let handle = py.detach(|| SourceHandle::open(cfg)).map_err(sdk_err)?;
        Ok(Self { handle: RwLock::new(Some(Arc::new(handle))), graveyard: Arc::default(), report: Mutex::new(None) })
    }

    /// Submits `data` (any buffer: bytes, numpy arrays, memoryview) of board `source` at
    /// data time `time_ns` (ns on the board's clock: UNIX time, or since the run's start
    /// with `source.input_time_base = "run"`). `hit_count`: the data are that many shoal
    /// hit records then waveform records (the filters read them); otherwise opaque.
    /// Returns the slice it went into. Blocks (without the GIL) under back-pressure.
    /// Buffers of 16 KiB or more are held without a copy until sent: do not write into
    /// them before `flush()` or `close()` returns.
    #[pyo3(signature = (source, time_ns, data, hit_count = None))]
    fn submit(
        &self,
        py: Python<'_>,
        source: u32,
        time_ns: u64,
        data: &Bound<'_, PyAny>,
        hit_count: Option<u32>,
    ) -> PyResult<u64> {
        self.submit_when(py, source, When::TimeNs(time_ns), data, hit_count)
    }

    /// `submit` with an explicit slice number instead of a time.
    #[pyo3(signature = (source, slice, data, hit_count = None))]
    fn submit_slice(
        &self,
        py: Python<'_>,
        source: u32,
        slice: u64,
        data: &Bound<'_, PyAny>,
        hit_count: Option<u32>,
    ) -> PyResult<u64> {
        self.submit_when(py, source, When::Slice(slice), data, hit_count)
    }

    /// Waits (without the GIL) until everything submitted is sent, at most `timeout`
    /// seconds; returns whether it is.
    #[pyo3(signature = (timeout = 60.0))]
    fn flush(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let handle = self.handle()?;
        let done = py.detach(|| handle.flush(Duration::from_secs_f64(timeout.max(0.0))));
        self.bury();
        Ok(done)
    }

    /// Ends the run after the last slice with data, waits for the drain (without the
    /// GIL) and returns the end-of-run report as a dict (also kept as `report`).
    fn close(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        if let Some(r) = self.report.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            return Ok(r.clone_ref(py));
        }
        let taken = self.handle.write().unwrap_or_else(|p| p.into_inner()).take();
        let Some(handle) = taken else { return Err(Closed::new_err("the source is closed")) };
        let handle =
            Arc::into_inner(handle).ok_or_else(|| RunError::new_err("the source is in use by another thread"))?;
        let report = py.detach(|| handle.close());
        self.bury();
        let report = report.map_err(sdk_err)?;
        let json = serde_json::to_string(&report).map_err(|e| RunError::new_err(e.to_string()))?;
        let dict: Py<PyAny> = py.import("json")?.call_method1("loads", (json,))?.unbind();
        *self.report.lock().unwrap_or_else(|p| p.into_inner()) = Some(dict.clone_ref(py));
        Ok(dict)
    }

    /// The end-of-run report once closed, else None.
    #[getter]
    fn report(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.report.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|r| r.clone_ref(py))
    }

    /// What the input counted so far (accepted, refused per kind, late, held), a dict.
    fn ingest_report(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let json =
            serde_json::to_string(&self.handle()?.ingest_report()).map_err(|e| RunError::new_err(e.to_string()))?;
        Ok(py.import("json")?.call_method1("loads", (json,))?.unbind())
    }

    /// The run's first slice; data before its start are refused.
    #[getter]
    fn first_slice(&self) -> PyResult<u64> {
        Ok(self.handle()?.first_slice())
    }

    /// When the run's first slice starts, UNIX ns.
    #[getter]
    fn first_slice_start_ns(&self) -> PyResult<u64> {
        Ok(self.handle()?.first_slice_start_ns())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: &Bound<'_, PyAny>,
        _exc: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        if self.report.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
            self.close(py)?;
        }
        Ok(false)
    }
}

#[pymodule]
#[pyo3(name = "shoal")]
fn shoal(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Source>()?;
    m.add("ShoalError", py.get_type::<ShoalError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("Refused", py.get_type::<Refused>())?;
    m.add("Full", py.get_type::<Full>())?;
    m.add("Closed", py.get_type::<Closed>())?;
    m.add("RunError", py.get_type::<RunError>())?;
    m.add("HOLD_FROM", HOLD_FROM)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The slice consumer is pure Python (the same file runs in the builder's Python filter
    // workers): `shoal.slices`, importable as `from shoal.slices import Consumer`.
    let code = std::ffi::CString::new(shoal_shm::PYTHON_CLIENT).expect("no NUL in the Python client");
    let slices = PyModule::from_code(py, &code, c"shoal_slices.py", c"shoal.slices")?;
    m.add_submodule(&slices)?;
    py.import("sys")?.getattr("modules")?.set_item("shoal.slices", &slices)?;
    Ok(())
}
