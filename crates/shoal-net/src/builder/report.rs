//! What a builder reports at the end of its run.

use hdrhistogram::Histogram;
use shoal_core::node::BuilderNodeReport;
use shoal_core::saver::SaverStats;

use crate::builder::spool::SpoolReport;
use crate::report::DelayStats;
use crate::transport::udp::UdpReceiveReport;

/// What a builder reports at the end: the node's report plus what only the process knows
/// (delay histograms, connections, the filter's work).
#[derive(Clone, Debug, serde::Serialize)]
pub struct BuilderReport {
    #[serde(flatten)]
    pub node: BuilderNodeReport,
    /// Application send to complete arrival, and slice end to application send (the delay
    /// added on purpose by shaping).
    pub network_delay: DelayStats,
    pub shaping_delay: DelayStats,
    /// The same, as histograms in microseconds (to combine several builders).
    #[serde(skip)]
    pub net_delay_us: Histogram<u64>,
    #[serde(skip)]
    pub shaping_delay_us: Histogram<u64>,
    /// The largest network delay of the fragments that arrived in each second of the
    /// run, counted from the first arrival (µs): when a tail came, at start-up or
    /// throughout.
    pub network_delay_max_by_second_us: Vec<u64>,
    /// The network delay without the start-up transient: fragments of the slices that end
    /// [`shoal_core::node::STEADY_AFTER`] or later after the run's first slice (new
    /// connections, cold processes and the first wake-ups are not the network's steady
    /// state; the simulator's `network_delay_steady_*` leave out the same slices).
    pub network_delay_steady: DelayStats,
    /// The same as a histogram. A cluster node's report adds its recorded values
    /// ([`crate::report::recorded_counts`]) as `network_delay_steady_counts`, so that a run's builders can
    /// be pooled exactly (the testbed's p99 over all fragments; a p99 of p99s is not one).
    #[serde(skip)]
    pub net_delay_steady_us: Histogram<u64>,
    pub connections: u64,
    /// Free-running sources (`source.saturate`): times a connection was held back because
    /// its next fragment would have opened a slice past the window, and the most fragments
    /// held at once (shoal-net's `hold` module).
    #[serde(default)]
    pub read_holds: u64,
    #[serde(default)]
    pub held_fragments_most: usize,
    /// Hits in the accepted fragments (the filter's input).
    pub hits: u64,
    pub events: u64,
    /// Time the filter thread spent on slices (filtering them and handing on their
    /// events), seconds.
    pub filter_busy_s: f64,
    /// Slices assembled but never filtered: the filter's queue was full (a filter slower
    /// than the load), or still held at the end of the drain. Their fragments were
    /// delivered; their events are lost.
    pub slices_not_filtered: u64,
    /// Their slice numbers (at most `shoal_core::node::MAX_LISTED_SLICES`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_filtered_slices: Vec<u64>,
    /// Slices the filter failed on (a plug-in's error return; their events so far kept).
    #[serde(default)]
    pub filter_failed: u64,
    /// Events a plug-in handed back malformed (refused).
    #[serde(default)]
    pub filter_malformed_events: u64,
    /// Slices a Python filter worker did not finish within `builder.filter.timeout_ms` (the
    /// worker killed and replaced; the slice's fragments kept in the slices file).
    #[serde(default)]
    pub filter_timeout: u64,
    /// `builder.filter.python` or `isolate`: the worker pool's counts (started again,
    /// failed, crashed, timed out, malformed events).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter_workers: Option<shoal_shm::workers::WorkerReport>,
    /// Event frames the writer link could not deliver.
    pub event_frames_failed: u64,
    /// Pull: requests for a source that had not greeted this builder (asked again later).
    pub requests_unroutable: u64,
    /// Datagram transport: what the endpoint received, refused, asked again and lost.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp: Option<UdpReceiveReport>,
    /// The burst saver (history, evictions, alerts, late fragments kept) and its spool
    /// (records on disk, shipped to the writer, refused, failed; each alert's report).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saver: Option<SaverStats>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spool: Option<SpoolReport>,
    /// Alerts this builder never saw (its alert queue overflowed).
    pub alerts_missed: u64,
    /// Monitoring taps of this process (published, dropped), when open.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tap: Option<crate::tap::TapStats>,
    /// KM3NeT mode: timeslices, frames and messages published, DAQ file bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub km3net: Option<crate::builder::km3out::Km3OutReport>,
    /// `builder.consumers`: slices published to shared-memory consumers, and what each
    /// consumer was offered, skipped and lost to overruns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumers: Option<shoal_shm::PublisherReport>,
}
