//! The C ABI's lent buffers: `release` is called exactly once for a buffer shoal took
//! (refused at once, or sent or discarded later), never for a call that took nothing.
//! Called through the exported functions, as C calls them.

use std::ffi::{CString, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

use shoal::{ShoalSource, ShoalStatus, shoal_source_close, shoal_source_first_slice, shoal_source_open_toml};
use shoal::{shoal_source_submit_lent, shoal_source_submit_slice_lent};

unsafe extern "C" fn count_release(user: *mut c_void, _data: *const u8, len: usize) {
    // SAFETY: every test passes a pointer to a live counter pair.
    let counters = unsafe { &*(user as *const [AtomicUsize; 2]) };
    counters[0].fetch_add(1, Ordering::SeqCst);
    counters[1].fetch_add(len, Ordering::SeqCst);
}

/// A source whose builder does not exist (a port nobody listens on): fragments stay
/// unsent and are counted at the end.
fn open_towards_nobody() -> *mut ShoalSource {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let toml = CString::new(format!(
        "[run]\nsources = 1\nbuilders = 1\nslice_ms = 10\nseconds = 0.0\n\
         builder_addrs = [\"127.0.0.1:{port}\"]\nwriter_addr = \"127.0.0.1:1\"\n\
         [source]\nsaturate = false\ninput_latency_ms = 0\ninput_time_base = \"run\"\ndrain_timeout_ms = 200\n"
    ))
    .unwrap();
    let mut src: *mut ShoalSource = std::ptr::null_mut();
    // SAFETY: a NUL-terminated string and a writable out pointer.
    assert_eq!(unsafe { shoal_source_open_toml(toml.as_ptr(), &mut src) }, ShoalStatus::Ok as i32);
    src
}

#[test]
fn release_is_called_once_per_buffer_taken() {
    // The fragments stay unsent, are counted at the end, and their buffers come back all
    // the same.
    let src = open_towards_nobody();
    let counters = [AtomicUsize::new(0), AtomicUsize::new(0)];
    let user = &counters as *const _ as *mut c_void;
    let buffers: Vec<Vec<u8>> = (0..5).map(|i| vec![i as u8; 1000 + i]).collect();
    // SAFETY: an open handle; buffers that outlive the handle; a release callable anywhere.
    unsafe {
        let first = shoal_source_first_slice(src);
        for (i, b) in buffers.iter().enumerate() {
            let rc = shoal_source_submit_slice_lent(
                src,
                0,
                first + i as u64,
                b.as_ptr(),
                b.len(),
                Some(count_release),
                user,
            );
            assert_eq!(rc, ShoalStatus::Ok as i32);
        }
        // Refused (a board not hosted): released before the call returns.
        let rc = shoal_source_submit_lent(src, 9, 0, buffers[0].as_ptr(), 7, Some(count_release), user);
        assert_eq!(rc, ShoalStatus::Refused as i32);
        assert_eq!(counters[0].load(Ordering::SeqCst), 1);
        // Nothing taken: no release to call, none called.
        let rc = shoal_source_submit_lent(src, 0, 0, buffers[0].as_ptr(), 7, None, user);
        assert_eq!(rc, ShoalStatus::InvalidArgument as i32);
        let rc = shoal_source_submit_lent(src, 0, 0, std::ptr::null(), 7, Some(count_release), user);
        assert_eq!(rc, ShoalStatus::InvalidArgument as i32);
        assert_eq!(counters[0].load(Ordering::SeqCst), 1);
        assert_eq!(shoal_source_close(src, std::ptr::null_mut()), ShoalStatus::Ok as i32);
    }
    let lent: usize = buffers.iter().map(Vec::len).sum();
    assert_eq!(counters[0].load(Ordering::SeqCst), 6, "five lent and one refused, each released once");
    assert_eq!(counters[1].load(Ordering::SeqCst), lent + 7);
}

/// `shoal_source_abort` from another thread: later submissions are refused `CLOSED`, close
/// still ends the run and gives the report; an aborted handle's data are accounted.
#[test]
fn abort_refuses_later_submissions_and_close_still_reports() {
    use shoal::{shoal_source_abort, shoal_source_submit_slice, shoal_string_free};
    let src = open_towards_nobody();
    let data = [7u8; 100];
    // SAFETY: an open handle, used from one thread at a time here (abort is documented for
    // any thread); a buffer valid for the calls.
    unsafe {
        let first = shoal_source_first_slice(src);
        assert_eq!(shoal_source_submit_slice(src, 0, first, data.as_ptr(), data.len()), ShoalStatus::Ok as i32);
        let handle = src as usize;
        std::thread::spawn(move || {
            assert_eq!(shoal_source_abort(handle as *const ShoalSource), ShoalStatus::Ok as i32);
        })
        .join()
        .unwrap();
        assert_eq!(shoal_source_submit_slice(src, 0, first + 1, data.as_ptr(), data.len()), ShoalStatus::Closed as i32);
        assert_eq!(shoal_source_abort(std::ptr::null()), ShoalStatus::InvalidArgument as i32);
        let mut report: *mut std::ffi::c_char = std::ptr::null_mut();
        assert_eq!(shoal_source_close(src, &mut report), ShoalStatus::Ok as i32);
        let json = std::ffi::CStr::from_ptr(report).to_str().unwrap().to_owned();
        shoal_string_free(report);
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["ingest"]["accepted"], 1, "{json}");
        assert_eq!(v["ingest"]["rejected"]["closed"], 1, "{json}");
    }
}
