//! The C ABI of the shared-memory slice consumer (docs/plugins.md, "Slice consumers"):
//! attach to a builder's ring, read slices in place, release them.

use std::ffi::c_char;
use std::os::raw::c_int;
use std::time::Duration;

use shoal_shm::{ConsumerOptions, Next, Policy, SliceConsumer, SliceRef};

use crate::{Failure, ShoalStatus, guard, str_arg};

/// An attached consumer (opaque).
pub struct ShoalConsumer {
    inner: SliceConsumer,
    end: Option<ShoalConsumerEnd>,
}

/// One slice read in place (opaque); valid until [`shoal_slice_release`].
pub struct ShoalSlice {
    inner: SliceRef,
}

/// A slice's numbers.
#[repr(C)]
pub struct ShoalSliceInfo {
    pub seq: u64,
    pub slice: u64,
    /// Slice start, ns since the UNIX epoch.
    pub slice_start_ns: u64,
    pub slice_ns: u64,
    pub fragment_count: u64,
}

/// One fragment: its payload points into the shared ring, valid until the slice is released.
#[repr(C)]
pub struct ShoalFragmentRef {
    pub source: u32,
    pub flags: u16,
    pub reserved: u16,
    pub hit_count: u32,
    pub reserved2: u32,
    pub payload: *const u8,
    pub payload_len: u64,
}

/// What the builder said at the end of the run, for this consumer.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ShoalConsumerEnd {
    pub offered: u64,
    pub skipped: u64,
    pub overrun: u64,
    /// Slices taken back before this consumer read them (not handed out).
    pub lost_before_read: u64,
}

/// # Safety
/// `c` is null or a handle from `shoal_consumer_open` not yet closed.
unsafe fn consumer_arg<'a>(c: *mut ShoalConsumer) -> Result<&'a mut ShoalConsumer, Failure> {
    // SAFETY: a live handle by the caller's contract.
    unsafe { c.as_mut() }.ok_or((ShoalStatus::InvalidArgument, "the consumer handle is NULL".into()))
}

/// Attaches to the builder whose `builder.consumers.socket` (with `{builder}` replaced) is
/// `socket_name`, retrying for up to `wait_s` seconds while it starts. `hold` non-zero: the
/// builder waits up to `hold_ms` for each release; zero: it never waits for this consumer.
/// `window`: most slices held at once (more are skipped, counted).
///
/// Thread-safety: the handle is used by one thread at a time; slices may be released from
/// any thread.
///
/// # Safety
/// `socket_name` is a NUL-terminated string; `out` points to writable storage.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn shoal_consumer_open(
    socket_name: *const c_char,
    hold: c_int,
    hold_ms: u64,
    window: u32,
    wait_s: f64,
    out: *mut *mut ShoalConsumer,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let name = unsafe { str_arg(socket_name, "socket_name") }?;
        if out.is_null() {
            return Err((ShoalStatus::InvalidArgument, "out is NULL".into()));
        }
        let policy = if hold != 0 { Policy::Hold { max: Duration::from_millis(hold_ms) } } else { Policy::Skip };
        let wait = if wait_s.is_finite() && wait_s > 0.0 { Duration::from_secs_f64(wait_s) } else { Duration::ZERO };
        let inner = SliceConsumer::connect_within(name, ConsumerOptions { policy, window }, wait)
            .map_err(|e| (ShoalStatus::Run, format!("attaching to @{name}: {e}")))?;
        // SAFETY: non-null and writable by the caller's contract.
        unsafe { *out = Box::into_raw(Box::new(ShoalConsumer { inner, end: None })) };
        Ok(())
    })
}

/// The next slice into `*out`: `SHOAL_STATUS_OK`; the run's end: `SHOAL_STATUS_END`
/// (counters from [`shoal_consumer_end`]); nothing within `timeout_ms` (negative: wait
/// without limit): `SHOAL_STATUS_TIMEOUT`; the builder gone: `SHOAL_STATUS_RUN`.
///
/// # Safety
/// `c` is an open handle; `out` points to writable storage.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn shoal_consumer_next(
    c: *mut ShoalConsumer,
    timeout_ms: i64,
    out: *mut *mut ShoalSlice,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let c = unsafe { consumer_arg(c) }?;
        if out.is_null() {
            return Err((ShoalStatus::InvalidArgument, "out is NULL".into()));
        }
        let timeout = u64::try_from(timeout_ms).ok().map(Duration::from_millis);
        match c.inner.next(timeout).map_err(|e| (ShoalStatus::Run, e.to_string()))? {
            Next::Slice(inner) => {
                // SAFETY: writable by the caller's contract.
                unsafe { *out = Box::into_raw(Box::new(ShoalSlice { inner })) };
                Ok(())
            }
            Next::End { offered, skipped, overrun } => {
                c.end =
                    Some(ShoalConsumerEnd { offered, skipped, overrun, lost_before_read: c.inner.lost_before_read });
                Err((ShoalStatus::End, "the run ended".into()))
            }
            Next::Timeout => Err((ShoalStatus::Timeout, "no slice within the timeout".into())),
        }
    })
}

/// The counters the builder sent at the end of the run (`SHOAL_STATUS_END` seen first, else
/// `SHOAL_STATUS_INVALID_ARGUMENT`).
///
/// # Safety
/// `c` is an open handle; `out` points to writable storage.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn shoal_consumer_end(c: *mut ShoalConsumer, out: *mut ShoalConsumerEnd) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let c = unsafe { consumer_arg(c) }?;
        let end = c.end.ok_or((ShoalStatus::InvalidArgument, "the run has not ended".into()))?;
        // SAFETY: writable by the caller's contract (checked non-null).
        unsafe { out.as_mut() }.map(|o| *o = end).ok_or((ShoalStatus::InvalidArgument, "out is NULL".into()))
    })
}

/// Detaches (slices not yet released stay readable until released).
///
/// # Safety
/// `c` is NULL or an open handle, not used again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn shoal_consumer_close(c: *mut ShoalConsumer) {
    if !c.is_null() {
        // SAFETY: from `Box::into_raw` in open, given back once by the contract.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(unsafe { Box::from_raw(c) })));
    }
}

/// The slice's numbers.
///
/// # Safety
/// `s` is a slice not yet released; `out` points to writable storage.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn shoal_slice_info(s: *const ShoalSlice, out: *mut ShoalSliceInfo) -> c_int {
    guard(|| {
        // SAFETY: caller contract.
        let s = unsafe { s.as_ref() }.ok_or((ShoalStatus::InvalidArgument, "the slice is NULL".into()))?;
        let i = &s.inner;
        let info = ShoalSliceInfo {
            seq: i.seq,
            slice: i.slice,
            slice_start_ns: i.slice_start_ns,
            slice_ns: i.slice_ns,
            fragment_count: i.fragment_count() as u64,
        };
        // SAFETY: caller contract.
        unsafe { out.as_mut() }.map(|o| *o = info).ok_or((ShoalStatus::InvalidArgument, "out is NULL".into()))
    })
}

/// Fragment `index` (0 .. fragment_count) of the slice; its payload is read in place.
///
/// # Safety
/// `s` is a slice not yet released; `out` points to writable storage.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn shoal_slice_fragment(s: *const ShoalSlice, index: u64, out: *mut ShoalFragmentRef) -> c_int {
    guard(|| {
        // SAFETY: caller contract.
        let s = unsafe { s.as_ref() }.ok_or((ShoalStatus::InvalidArgument, "the slice is NULL".into()))?;
        let n = s.inner.fragment_count() as u64;
        if index >= n {
            return Err((ShoalStatus::InvalidArgument, format!("fragment {index} of {n}")));
        }
        let f = s.inner.fragment(index as usize);
        let r = ShoalFragmentRef {
            source: f.source,
            flags: f.flags,
            reserved: 0,
            hit_count: f.hit_count,
            reserved2: 0,
            payload: f.payload.as_ptr(),
            payload_len: f.payload.len() as u64,
        };
        // SAFETY: caller contract.
        unsafe { out.as_mut() }.map(|o| *o = r).ok_or((ShoalStatus::InvalidArgument, "out is NULL".into()))
    })
}

/// Done with the slice (frees it): 1 if no byte of it was reused before now, 0 if the ring
/// took it back first (counted by the builder as an overrun), -1 for a NULL slice.
///
/// # Safety
/// `s` is NULL or a slice from `shoal_consumer_next`, released once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn shoal_slice_release(s: *mut ShoalSlice) -> c_int {
    if s.is_null() {
        return -1;
    }
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: from `Box::into_raw` in next, given back once by the contract.
        let s = unsafe { Box::from_raw(s) };
        c_int::from(s.inner.release())
    }))
    .unwrap_or(-1)
}
