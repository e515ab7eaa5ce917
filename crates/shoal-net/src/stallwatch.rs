//! Stalls of this process: times it was not scheduled for [`STALL_THRESHOLD`] or more
//! (stopped with SIGSTOP, its host's CPU taken by something of higher priority, the host
//! swapping or frozen), seen from inside.
//!
//! A thread of its own sleeps [`PERIOD`] at a time and measures how late each wake-up is
//! on the monotonic clock; a wake-up late by the threshold or more is a stall, from the
//! wake-up before it (the last time the process is known to have run) to when it came. It also reads its own scheduler statistics
//! (`/proc/thread-self/schedstat`): time spent runnable but waiting for a CPU during the
//! stall says the CPU was taken; none says the process was stopped (or the whole machine
//! was). A stall shorter than the hung threshold (run control's five statistics intervals)
//! falls between run control's checks: the process reports its stalls in its statistics
//! ([`crate::node::NodeStats::stalls`]) once it runs again, and the diagnosis gives them
//! the slices the process lost meanwhile.
//!
//! The thread costs one wake-up per [`PERIOD`] (40 a second), a few microseconds each.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::clock::WallClock;

/// How often the watch thread wakes.
pub const PERIOD: Duration = Duration::from_millis(25);
/// A wake-up this late is a stall: with [`PERIOD`], every stall of 0.2 s or more is seen
/// (one that began just after a wake-up makes the next one late by its length less a
/// period), and a busy machine's scheduling delays (milliseconds) are not.
pub const STALL_THRESHOLD: Duration = Duration::from_millis(150);
/// Stalls kept for the statistics (the newest): enough for many stalls between two
/// reports.
pub const KEPT: usize = 32;

/// One stall, on the process's clock (UNIX ns) as its statistics are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stall {
    pub from_ns: u64,
    pub to_ns: u64,
    /// Of that time, the watch thread was runnable and waited for a CPU (ns): the host's
    /// CPU was taken. The rest it was not runnable: stopped.
    pub waited_for_cpu_ns: u64,
}

#[derive(Debug)]
struct Seen {
    /// Monotonic ends and the CPU wait, converted to the clock when read.
    from: Instant,
    to: Instant,
    waited_for_cpu_ns: u64,
}

#[derive(Debug, Default)]
struct Shared {
    stalls: VecDeque<Seen>,
    total: Duration,
}

/// The watch (one per process); dropping it ends its thread within a [`PERIOD`].
#[derive(Debug, Clone)]
pub struct StallWatch {
    shared: Arc<Mutex<Shared>>,
    _stop: Arc<StopOnDrop>,
}

#[derive(Debug)]
struct StopOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// This thread's time runnable but waiting for a CPU, ns (none without schedstat).
fn cpu_wait_ns() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    text.split_whitespace().nth(1)?.parse().ok()
}

impl StallWatch {
    /// Starts the watch thread.
    pub fn start() -> std::io::Result<StallWatch> {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, halt) = (shared.clone(), stop.clone());
        std::thread::Builder::new().name("stall-watch".into()).spawn(move || {
            let mut ran = Instant::now();
            let mut due = ran + PERIOD;
            let mut wait_before = cpu_wait_ns();
            while !halt.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
                let woke = Instant::now();
                let wait_now = cpu_wait_ns();
                let late = woke.saturating_duration_since(due);
                if late >= STALL_THRESHOLD {
                    let waited = wait_now.zip(wait_before).map_or(0, |(a, b)| a.saturating_sub(b));
                    let mut sh = s.lock().unwrap_or_else(|e| e.into_inner());
                    sh.total += late;
                    sh.stalls.push_back(Seen { from: ran, to: woke, waited_for_cpu_ns: waited });
                    while sh.stalls.len() > KEPT {
                        sh.stalls.pop_front();
                    }
                }
                wait_before = wait_now;
                ran = woke;
                due = woke + PERIOD;
            }
        })?;
        Ok(StallWatch { shared, _stop: Arc::new(StopOnDrop(stop)) })
    }

    /// The stalls kept, oldest first, on `clock`, and the time stalled in all.
    pub fn stalls(&self, clock: &WallClock) -> (Vec<Stall>, Duration) {
        let sh = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        (on_clock(sh.stalls.iter(), Instant::now(), clock.now().as_nanos()), sh.total)
    }
}

/// Stalls seen on the monotonic clock, put on a clock that reads `now_ns` at `now`.
fn on_clock<'a>(seen: impl Iterator<Item = &'a Seen>, now: Instant, now_ns: u64) -> Vec<Stall> {
    let at = |t: Instant| now_ns.saturating_sub(now.saturating_duration_since(t).as_nanos() as u64);
    seen.map(|s| Stall { from_ns: at(s.from), to_ns: at(s.to), waited_for_cpu_ns: s.waited_for_cpu_ns }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stalls_are_put_on_the_clock_they_are_read_with() {
        let t = Instant::now();
        let seen = [Seen { from: t, to: t + Duration::from_millis(300), waited_for_cpu_ns: 7 }];
        // Read 1 s after the stall began, on a clock that then says 5e9 ns.
        let stalls = on_clock(seen.iter(), t + Duration::from_secs(1), 5_000_000_000);
        assert_eq!(stalls, [Stall { from_ns: 4_000_000_000, to_ns: 4_300_000_000, waited_for_cpu_ns: 7 }]);
    }

    #[test]
    fn the_watch_thread_starts_and_reads_its_own_cpu_wait() {
        let w = StallWatch::start().unwrap();
        let _ = w.stalls(&WallClock::new());
        // The kernel here keeps scheduler statistics (docs/monitoring.md says what is lost
        // without them: stopped and starved are not told apart).
        if std::path::Path::new("/proc/thread-self/schedstat").exists() {
            assert!(cpu_wait_ns().is_some());
        }
    }
}
