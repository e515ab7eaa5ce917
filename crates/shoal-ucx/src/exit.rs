//! The process's exit: every worker thread stops and destroys its worker before UCX's
//! libraries are unloaded.
//!
//! A worker thread ends once its [`Worker`](crate::Worker) and endpoints are dropped, and
//! then takes up to its end wait to close what is in flight. A process whose `main`
//! returns meanwhile runs libucs's destructors under the thread's feet (seen: an assertion
//! in `ucs_vfs` on the main thread and a segfault on the worker's, at the end of a
//! saturated demo). So the first worker registers an `atexit` handler, which runs before
//! the shared libraries' destructors (glibc calls those from an exit handler registered at
//! start, so after ours): it tells every live thread to stop and waits, bounded, for them.

#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// Set at the process's exit: worker loops end.
static STOPPING: AtomicBool = AtomicBool::new(false);
/// Wakes worker loops waiting when `STOPPING` is set.
pub(crate) static STOP: Notify = Notify::const_new();
/// The worker threads started and not yet seen finished.
static LIVE: Mutex<Vec<JoinHandle<()>>> = Mutex::new(Vec::new());
static REGISTER: Once = Once::new();

/// Longest the exit waits for the threads: their own end wait and a margin.
const EXIT_WAIT: Duration = Duration::from_secs(4);

pub(crate) fn stopping() -> bool {
    STOPPING.load(Ordering::Acquire)
}

/// Keeps `thread` for the exit to wait on (and forgets those already finished).
pub(crate) fn track(thread: JoinHandle<()>) {
    REGISTER.call_once(|| {
        // SAFETY: registering a function with no arguments that never unwinds (it catches).
        unsafe { libc::atexit(at_exit) };
    });
    let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
    live.retain(|t| !t.is_finished());
    live.push(thread);
}

extern "C" fn at_exit() {
    let _ = std::panic::catch_unwind(stop_all);
}

/// Tells every worker thread to stop and waits for them, at most [`EXIT_WAIT`].
fn stop_all() {
    STOPPING.store(true, Ordering::Release);
    STOP.notify_waiters();
    let threads = std::mem::take(&mut *LIVE.lock().unwrap_or_else(|p| p.into_inner()));
    let deadline = Instant::now() + EXIT_WAIT;
    for t in threads {
        while !t.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        if t.is_finished() {
            let _ = t.join();
        }
    }
}
