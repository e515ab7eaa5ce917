//! How long a process's threads ran and how long they waited for a CPU while runnable,
//! from the kernel's scheduler statistics (`/proc/self/task/*/schedstat`: run time and
//! run-queue wait in nanoseconds, per thread).
//!
//! On a machine shared by more processes than cores (the testbed runs 20 to 50 on two), a
//! fragment can be late because its sender or receiver waited for a CPU, not because of
//! the network. The machine's idle time does not show this (cores can be idle on average
//! and still busy at every slice end); the wait of each process does. Threads that ended
//! during the run take their counts with them, so the figures are a lower bound.

use serde::{Deserialize, Serialize};

/// Run and wait time of this process's live threads, in nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedTimes {
    pub run_ns: u64,
    pub wait_ns: u64,
}

impl SchedTimes {
    /// The sums over `/proc/self/task/*/schedstat`; `None` when the kernel has no
    /// scheduler statistics.
    pub fn of_this_process() -> Option<SchedTimes> {
        let mut t = SchedTimes::default();
        let mut any = false;
        for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
            let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) else { continue };
            if let Some(one) = parse(&text) {
                t.run_ns += one.run_ns;
                t.wait_ns += one.wait_ns;
                any = true;
            }
        }
        any.then_some(t)
    }
}

/// One thread's `schedstat`: run time, wait time, time slices.
fn parse(text: &str) -> Option<SchedTimes> {
    let mut w = text.split_whitespace().map(|v| v.parse::<u64>().ok());
    Some(SchedTimes { run_ns: w.next()??, wait_ns: w.next()?? })
}

/// A process's CPU over a run, for its end-of-run report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuUse {
    /// Length of the run as this process saw it.
    pub wall_s: f64,
    /// CPU time its threads ran.
    pub run_s: f64,
    /// Time its threads were runnable but waited for a CPU (summed over threads).
    pub wait_s: f64,
}

impl CpuUse {
    pub fn between(start: SchedTimes, end: SchedTimes, wall: std::time::Duration) -> CpuUse {
        CpuUse {
            wall_s: wall.as_secs_f64(),
            run_s: end.run_ns.saturating_sub(start.run_ns) as f64 / 1e9,
            wait_s: end.wait_ns.saturating_sub(start.wait_ns) as f64 / 1e9,
        }
    }

    /// Wait for a CPU per second of the run (0.05: its threads together waited 50 ms a second).
    pub fn wait_fraction(&self) -> f64 {
        if self.wall_s > 0.0 { self.wait_s / self.wall_s } else { 0.0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_line_is_run_wait_and_slices() {
        assert_eq!(parse("167469 2500 1\n"), Some(SchedTimes { run_ns: 167469, wait_ns: 2500 }));
        assert_eq!(parse("garbage"), None);
        assert_eq!(parse(""), None);
    }

    #[test]
    fn this_process_has_run() {
        // Every Linux kernel this runs on has schedstat (CONFIG_SCHED_INFO); a thread that
        // is running now has run for some time.
        let t = SchedTimes::of_this_process().expect("schedstat");
        assert!(t.run_ns > 0);
        let u = CpuUse::between(
            SchedTimes { run_ns: 1_000_000_000, wait_ns: 0 },
            SchedTimes { run_ns: 1_500_000_000, wait_ns: 200_000_000 },
            std::time::Duration::from_secs(2),
        );
        assert_eq!((u.run_s, u.wait_s, u.wait_fraction()), (0.5, 0.2, 0.1));
    }
}
