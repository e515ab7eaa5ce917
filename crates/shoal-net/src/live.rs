//! Live counters of one process (progress bar, run-control statistics, `/metrics`).
//!
//! Counters only grow; rates are differences between two readings. The delay window is the
//! one piece of state that is reset: [`Live::take_delays`] returns the network delays
//! recorded since the previous call.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use hdrhistogram::Histogram;
use shoal_core::saver::{Alert, AlertReport};
use tokio::sync::broadcast;

#[derive(Debug, Default)]
pub struct Live {
    /// The writer's archiver (`writer.archive`), when it has one.
    pub archive: crate::archive::ArchiveLive,
    /// The writer's disk (`crate::writer::disk`): free and total bytes, the hours of
    /// autonomy left at the rate it fills (seconds; `u64::MAX`: not filling), and its level
    /// (0 ok, 1 warning at 75 % used, 2 alert at 90 %, 3 throttle at 95 %).
    pub disk_free_bytes: AtomicU64,
    pub disk_total_bytes: AtomicU64,
    pub disk_autonomy_s: AtomicU64,
    pub disk_level: AtomicU64,
    pub fragments_produced: AtomicU64,
    pub fragments_received: AtomicU64,
    pub bytes_received: AtomicU64,
    pub slices_complete: AtomicU64,
    pub slices_incomplete: AtomicU64,
    pub events: AtomicU64,
    pub rejected_connections: AtomicU64,
    /// Fragments a source dropped (full queue) or failed to send (connection lost).
    pub fragments_dropped_at_source: AtomicU64,
    /// Fragments the builders discarded (late, duplicate, overload, unknown source).
    pub fragments_discarded_at_builder: AtomicU64,
    /// Slices assembled but not filtered (the filter's queue was full, or still held at
    /// the end of the drain).
    pub slices_not_filtered: AtomicU64,
    /// Of the discarded fragments: those the builder's memory budget had no room for.
    pub fragments_refused_by_budget: AtomicU64,
    /// Time the filter thread spent on slices (filtering, handing on the events), ns; a
    /// filter busy all the time is behind.
    pub filter_busy_ns: AtomicU64,
    /// Fragments the burst rate cutoff replaced by an empty marker (sources).
    pub fragments_cut_off: AtomicU64,
    /// Source nodes: fragments reported written, and the sum of their send completions
    /// (µs, from handing a fragment to its link to the link's report).
    pub send_completions: AtomicU64,
    pub send_completion_us: AtomicU64,
    /// What the outgoing data links see of the network (failures, retransmissions).
    pub paths: std::sync::Arc<crate::paths::NetPaths>,
    /// The writer's disk refused a write: what arrives since is not stored (0 or 1).
    pub storage_failed: AtomicU64,
    /// Time the writer's disk thread spent writing, ns (a disk busy all the time is too
    /// slow for the data).
    pub storage_busy_ns: AtomicU64,
    /// Run control's end of the run: the first slice sources must not produce (0: none).
    pub end_slice: AtomicU64,
    /// Run control paused the run: sources keep the slice schedule with empty fragments.
    pub paused: AtomicBool,
    /// Alerts for this process's builders, and what they saved.
    pub alerts: AlertBus,
    /// Burst saver: alerts answered, fragments saved for them, late fragments kept, and
    /// the bytes the savers keep alive now (a gauge).
    pub alerts_answered: AtomicU64,
    pub fragments_saved: AtomicU64,
    pub late_salvaged: AtomicU64,
    pub saver_bytes: AtomicU64,
    /// Monitoring taps (open in a run-controlled builder process).
    pub tap: std::sync::Arc<crate::tap::Tap>,
    /// Network delays (us) since the last [`Live::take_delays`].
    delays: Mutex<Option<Histogram<u64>>>,
    /// The same delays since the process started, for Prometheus (cumulative buckets, so a
    /// percentile over any window: the latency alert of deploy/prometheus).
    pub delay_histogram: DelayHistogram,
}

/// Fragment network delays in seconds, Prometheus's cumulative histogram (buckets from
/// 0.5 ms to 5 s).
#[derive(Clone, Debug)]
pub struct DelayHistogram(pub prometheus_client::metrics::histogram::Histogram);

impl Default for DelayHistogram {
    fn default() -> Self {
        const BUCKETS: [f64; 13] = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0];
        Self(prometheus_client::metrics::histogram::Histogram::new(BUCKETS))
    }
}

impl Live {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::Relaxed)
    }

    /// Whether run control ended the run before `slice`.
    pub fn ends_before(&self, slice: u64) -> bool {
        let end = self.end_slice.load(Ordering::Relaxed);
        end != 0 && slice >= end
    }

    /// Records one fragment's network delay in microseconds.
    pub fn record_delay(&self, us: u64) {
        let mut d = self.delays.lock().unwrap_or_else(|e| e.into_inner());
        let h = d.get_or_insert_with(|| Histogram::new_with_bounds(1, 3_600_000_000, 2).expect("valid bounds"));
        let _ = h.record(us.max(1));
        drop(d);
        self.delay_histogram.0.observe(us as f64 * 1e-6);
    }

    /// The delays recorded since the previous call (empty if none).
    pub fn take_delays(&self) -> Option<Histogram<u64>> {
        self.delays.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// Alerts reach every builder of a process through here (from the dispatcher in a
/// run-controlled process, from the caller in an embedded run); builders answer with their
/// reports.
#[derive(Debug)]
pub struct AlertBus {
    pub alerts: broadcast::Sender<Alert>,
    pub reports: broadcast::Sender<AlertReport>,
}

impl Default for AlertBus {
    fn default() -> Self {
        Self { alerts: broadcast::channel(64).0, reports: broadcast::channel(256).0 }
    }
}
