//! C ABI filter plug-ins (`builder.filter.plugin = "path/libmyfilter.so"`): the host side
//! of `include/shoal_filter.h` (docs/plugins.md).
//!
//! [`PluginFilter`] loads the library with libloading, checks its ABI version before
//! anything else, calls its `shoal_filter_init` with `builder.filter.config`, and for every
//! slice hands it a view of the fragments (valid for the call) and an `emit_event` callback
//! that copies each event back, refusing malformed ones (counted). A non-zero return from
//! `shoal_filter_process` counts the slice as failed; the run goes on. The layouts here are
//! `#[repr(C)]` mirrors of the header's structs; the C l1 example (examples/c/filter/), run
//! against the built-in `l1` on the same slices, is what checks they agree.

// Calling into a C library is unsafe by nature; every unsafe block says what the header
// promises. The rest of the crate stays free of unsafe code.
#![allow(unsafe_code)]

use std::ffi::{CString, c_char, c_void};
use std::os::raw::c_int;

use shoal_core::SourceId;
use shoal_core::event::{Event, EventHit};

use crate::{Filter, FilterConfig, FilterError, SliceData};

/// The ABI version this host speaks (`SHOAL_FILTER_ABI_VERSION`).
pub const ABI_VERSION: u32 = 1;

#[repr(C)]
struct FragmentView {
    source: u32,
    flags: u32,
    hit_count: u32,
    reserved: u32,
    payload: *const u8,
    payload_len: u64,
}

#[repr(C)]
struct SliceView {
    slice: u64,
    slice_start_ns: u64,
    slice_ns: u64,
    fragments: *const FragmentView,
    fragment_count: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct EventHitC {
    source: u32,
    time_ns: u32,
    channel: u8,
    amplitude: u8,
    triggered: u8,
    reserved: u8,
}

type EmitFn = unsafe extern "C" fn(*mut c_void, u32, u32, *const EventHitC, u64) -> i32;

#[repr(C)]
struct HostC {
    ctx: *mut c_void,
    emit_event: EmitFn,
}

type AbiVersionFn = unsafe extern "C" fn() -> u32;
type InitFn = unsafe extern "C" fn(*const c_char, *mut *mut c_void, *mut c_char, usize) -> i32;
type ProcessFn = unsafe extern "C" fn(*mut c_void, *const SliceView, *const HostC) -> i32;
type CleanupFn = unsafe extern "C" fn(*mut c_void);

/// What a plug-in did wrong, counted (the builder's report).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PluginStats {
    /// Slices whose `shoal_filter_process` returned non-zero.
    pub failed_slices: u64,
    /// Events refused: no hit, a source not in the slice, a time past the slice's end.
    pub malformed_events: u64,
}

/// The events of one slice being handed back, and what they are checked against.
struct Collect<'a> {
    slice_ns: u64,
    sources: &'a [SourceId],
    events: Vec<Event>,
    malformed: u64,
}

unsafe extern "C" fn emit_event(
    ctx: *mut c_void,
    trigger_mask: u32,
    overlays: u32,
    hits: *const EventHitC,
    n: u64,
) -> i32 {
    // Nothing may unwind into C: a panic here is caught and the event refused.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: ctx is the Collect the host passed for this very call of process.
        let c = unsafe { &mut *ctx.cast::<Collect<'_>>() };
        let ok = !hits.is_null() && n > 0 && n <= (1 << 26);
        // SAFETY: the plug-in promises `n` hits at `hits` for the duration of the call.
        let slice = if ok { unsafe { std::slice::from_raw_parts(hits, n as usize) } } else { &[][..] };
        let mut hits: Vec<EventHit> = slice
            .iter()
            .map(|h| EventHit {
                source: h.source,
                channel: h.channel,
                time_ns: h.time_ns,
                amplitude: h.amplitude,
                triggered: h.triggered != 0,
            })
            .collect();
        if !crate::event_is_well_formed(&hits, c.sources, c.slice_ns) {
            c.malformed += 1;
            return -1;
        }
        hits.sort_unstable_by_key(|h| (h.time_ns, h.source, h.channel));
        let id = c.events.len() as u32;
        c.events.push(Event { id, trigger_mask, overlays, hits });
        0
    }));
    r.unwrap_or(-1)
}

/// A filter in a shared library. See the module documentation.
pub struct PluginFilter {
    // Order matters for drop: the functions live in `_lib`, which goes last.
    state: *mut c_void,
    process: ProcessFn,
    cleanup: CleanupFn,
    cleaned: bool,
    stats: PluginStats,
    views: Vec<FragmentView>,
    _lib: libloading::Library,
}

// SAFETY: the plug-in's state is used from one thread at a time (the builder's filter
// thread; the trait requires Send to move it there), as the header documents.
unsafe impl Send for PluginFilter {}

impl std::fmt::Debug for PluginFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginFilter").field("stats", &self.stats).finish_non_exhaustive()
    }
}

fn bad(path: &str, what: impl std::fmt::Display) -> FilterError {
    FilterError::BadParameter(format!("filter plug-in {path}: {what}"))
}

/// A libloading error with its cause (dlerror's text: "no such file", a missing symbol).
fn dl(e: libloading::Error) -> String {
    match std::error::Error::source(&e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}

/// Opens the library and checks its ABI version, without initialising it: what a process
/// does when it accepts a configuration (CONFIGURE, `shoal demo`), so that a plug-in that
/// cannot run stops the run before it starts.
pub fn probe(path: &str) -> Result<(), FilterError> {
    // SAFETY: as in `PluginFilter::load`.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| bad(path, dl(e)))?;
    // SAFETY: the symbol's type is declared in include/shoal_filter.h.
    let version = unsafe {
        *lib.get::<AbiVersionFn>(b"shoal_filter_abi_version\0")
            .map_err(|e| bad(path, format!("{} (is it a shoal filter plug-in?)", dl(e))))?
    };
    // SAFETY: as above.
    check_version(path, unsafe { version() })
}

fn check_version(path: &str, v: u32) -> Result<(), FilterError> {
    if v == ABI_VERSION {
        return Ok(());
    }
    Err(bad(
        path,
        format!(
            "built for filter ABI version {v}, this shoal speaks version {ABI_VERSION}: rebuild it against this include/shoal_filter.h"
        ),
    ))
}

impl PluginFilter {
    /// Loads `config.plugin`, checks its ABI version and initialises it with `config.config`.
    pub fn load(config: &FilterConfig) -> Result<Self, FilterError> {
        let path = config.plugin.as_str();
        // SAFETY: loading a library runs its initialisers; the operator named this file as
        // the filter to run, which is what it is for.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| bad(path, dl(e)))?;
        // SAFETY: the symbols are declared in include/shoal_filter.h with these types; the
        // version is checked before any other is called.
        let (version, init, process, cleanup) = unsafe {
            let version: AbiVersionFn = *lib
                .get::<AbiVersionFn>(b"shoal_filter_abi_version\0")
                .map_err(|e| bad(path, format!("{} (is it a shoal filter plug-in?)", dl(e))))?;
            let init: InitFn = *lib.get::<InitFn>(b"shoal_filter_init\0").map_err(|e| bad(path, dl(e)))?;
            let process: ProcessFn = *lib.get::<ProcessFn>(b"shoal_filter_process\0").map_err(|e| bad(path, dl(e)))?;
            let cleanup: CleanupFn = *lib.get::<CleanupFn>(b"shoal_filter_cleanup\0").map_err(|e| bad(path, dl(e)))?;
            (version, init, process, cleanup)
        };
        // SAFETY: as above.
        check_version(path, unsafe { version() })?;
        let text =
            CString::new(config.config.as_str()).map_err(|_| bad(path, "builder.filter.config holds a NUL byte"))?;
        let mut state: *mut c_void = std::ptr::null_mut();
        let mut err = vec![0u8; 1024];
        // SAFETY: valid NUL-terminated text, a place for the state, a buffer of the length
        // given.
        let rc = unsafe { init(text.as_ptr(), &mut state, err.as_mut_ptr().cast(), err.len()) };
        if rc != 0 {
            let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
            let msg = String::from_utf8_lossy(&err[..end]).into_owned();
            return Err(bad(path, format!("init failed ({rc}): {msg}")));
        }
        Ok(Self {
            state,
            process,
            cleanup,
            cleaned: false,
            stats: PluginStats::default(),
            views: Vec::new(),
            _lib: lib,
        })
    }

    pub fn stats(&self) -> &PluginStats {
        &self.stats
    }
}

impl Filter for PluginFilter {
    fn init(&mut self, _config: &FilterConfig) -> Result<(), FilterError> {
        // Initialised at load (the library's init needs the configuration there).
        Ok(())
    }

    fn process(&mut self, slice: &SliceData) -> Vec<Event> {
        self.views.clear();
        self.views.extend(slice.fragments.iter().map(|f| FragmentView {
            source: f.source,
            flags: u32::from(f.flags),
            hit_count: f.hit_count,
            reserved: 0,
            payload: f.payload.as_ptr(),
            payload_len: f.payload.len() as u64,
        }));
        let mut sources: Vec<SourceId> = slice.fragments.iter().map(|f| f.source).collect();
        sources.sort_unstable();
        let mut collect = Collect { slice_ns: slice.slice_ns, sources: &sources, events: Vec::new(), malformed: 0 };
        let view = SliceView {
            slice: slice.slice,
            slice_start_ns: slice.slice_start_ns,
            slice_ns: slice.slice_ns,
            fragments: self.views.as_ptr(),
            fragment_count: self.views.len() as u64,
        };
        let host = HostC { ctx: (&mut collect as *mut Collect<'_>).cast(), emit_event };
        // SAFETY: the views point into `slice`, alive for the call; `host.ctx` is `collect`,
        // alive for the call and touched only through `emit_event` during it.
        let rc = unsafe { (self.process)(self.state, &view, &host) };
        if rc != 0 {
            self.stats.failed_slices += 1;
        }
        self.stats.malformed_events += collect.malformed;
        collect.events
    }

    fn cleanup(&mut self) {
        if !self.cleaned {
            self.cleaned = true;
            // SAFETY: the state from init, cleaned up once.
            unsafe { (self.cleanup)(self.state) };
        }
    }

    fn failed_slices(&self) -> u64 {
        self.stats.failed_slices
    }

    fn malformed_events(&self) -> u64 {
        self.stats.malformed_events
    }
}

impl Drop for PluginFilter {
    fn drop(&mut self) {
        Filter::cleanup(self);
    }
}

// `c_int` is the header's `int` where it is not a fixed-width type.
const _: () = assert!(std::mem::size_of::<c_int>() == 4);
const _: () = assert!(std::mem::size_of::<FragmentView>() == 32 && std::mem::size_of::<SliceView>() == 40);
const _: () = assert!(std::mem::size_of::<EventHitC>() == 12);
