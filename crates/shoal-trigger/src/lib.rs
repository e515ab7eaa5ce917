//! shoal-trigger: the builder's filter.
//!
//! A filter sees one assembled slice as the list of its fragments and returns the
//! [`Event`]s worth storing. The plug-in interface is the reference design's
//! `init(configuration)` / `process(slice)` / `cleanup()`: the [`Filter`] trait.
//!
//! Built-in filters (selected by [`FilterConfig::name`]):
//! - `muon` ([`MuonFilter`], the default): L1 (ANTARES or KM3NeT definition), the
//!   causality cluster trigger with optional direction scan, and event building with
//!   snapshot windows, merged overlapping triggers, trigger bits and overlay counts (see
//!   [`muon`]; its direction scan, over cells of directions before directions, in
//!   [`scan`]; the track geometry both test hits with, in [`track`]).
//! - `l1` ([`L1Multiplicity`]): local coincidences (two hits on different channels of one
//!   source within `coincidence_ns`) and a multiplicity trigger (L1 hits on at least
//!   `min_sources` distinct sources within `cluster_ns`); an event keeps every hit within
//!   `snapshot_ns` around the triggering L1 hits (no geometry needed).
//! - `pass` ([`PassThrough`]): one event per slice with every hit (no reduction; for tests).
//! - `none` ([`SelectNothing`]): checks every payload and selects nothing (to measure the
//!   data path without filter cost).
//!
//! Events travel from builder to writer as the payload of an `EVENTS` frame, encoded with
//! [`encode_events`] and checked by [`decode_events`]. [`eval::evaluate`] measures a filter
//! against the physics generator's ground truth (`shoal trigger-eval`).

pub mod eval;
mod l1;
pub mod muon;
pub mod plugin;
pub mod scan;
pub mod track;

pub use l1::{L1Config, L1Multiplicity};
pub use muon::{MuonConfig, MuonFilter};
pub use shoal_core::event::{Event, EventDecodeError, EventHit, decode_events, encode_events};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use shoal_core::SourceId;
use shoal_core::hit::{Hit, HitPayload, PayloadError};

/// One fragment of an assembled slice, as the filter sees it.
#[derive(Clone, Debug)]
pub struct FragmentData {
    pub source: SourceId,
    /// The data frame's flags (`shoal_core::frame::Flags` bits: `BURST`, `OPAQUE`, ...).
    pub flags: u16,
    pub hit_count: u32,
    /// The frame payload (hits then waveforms, see [`shoal_core::hit`]).
    pub payload: Bytes,
}

impl FragmentData {
    pub fn hits(&self) -> Result<HitPayload<'_>, PayloadError> {
        HitPayload::parse(&self.payload, self.hit_count)
    }

    /// The payload's hit records as they came (none if the payload is malformed: the
    /// builder has already checked it).
    pub fn hit_records(&self) -> &[[u8; shoal_core::hit::HIT_LEN]] {
        self.hits().map_or(&[], |p| p.records())
    }
}

/// A slice's hits in time order for a filter that reads its fragments one at a time and
/// then looks hits up by time across all of them (event windows).
///
/// A fragment is decoded into one buffer reused for every fragment, which stays in the
/// cache; a fragment whose records were in time order is later read in place from its
/// payload, and only the others keep a sorted copy. A buffer per fragment held a whole
/// slice's decoded hits per filter, a gigabyte of cold memory in a 100-builder process.
///
/// Looking a time up goes through a sparse index of every [`TIME_INDEX_STRIDE`]th hit's
/// time, written while the fragment is read: a binary search straight over the records
/// missed the cache at nearly every probe (the payloads are cold by then), and with
/// hundreds of fragments and several event windows a slice those probes were two thirds
/// of the `muon` filter's time at 130 kHz singles.
#[derive(Debug, Default)]
pub(crate) struct SliceHits {
    /// The fragment being read, in time order.
    current: Vec<Hit>,
    /// The sorted hits of fragments whose records were not in time order, and where each
    /// fragment's are (`None`: in its payload, in order).
    resorted: Vec<Hit>,
    resorted_at: Vec<Option<std::ops::Range<usize>>>,
    /// Every fragment's time index, one after the other, and where each one's is.
    times: Vec<u32>,
    times_at: Vec<std::ops::Range<usize>>,
}

/// One time in the index for this many hits.
pub(crate) const TIME_INDEX_STRIDE: usize = 32;

impl SliceHits {
    /// Starts a slice.
    pub(crate) fn clear(&mut self) {
        self.resorted.clear();
        self.resorted_at.clear();
        self.times.clear();
        self.times_at.clear();
    }

    /// The hits of `f`, the slice's next fragment, in time order (valid until the next
    /// call).
    pub(crate) fn read(&mut self, f: &FragmentData) -> &[Hit] {
        let hits = &mut self.current;
        hits.clear();
        hits.extend(f.hit_records().iter().map(Hit::from_record));
        // Readouts send hits in time order, ties on a time in any order: the stable sort
        // merges the runs that leaves (the whole key orders, so equal hits are identical
        // and the result is that of any sort).
        if hits.is_sorted() {
            self.resorted_at.push(None);
        } else {
            hits.sort();
            let at = self.resorted.len();
            self.resorted.extend_from_slice(hits);
            self.resorted_at.push(Some(at..self.resorted.len()));
        }
        let at = self.times.len();
        self.times.extend(hits.iter().step_by(TIME_INDEX_STRIDE).map(|h| h.time_ns));
        self.times_at.push(at..self.times.len());
        hits
    }

    /// Every fragment's hits in time order, once all of `slice` was read.
    pub(crate) fn sorted<'a>(&'a self, slice: &'a SliceData) -> Vec<SortedHits<'a>> {
        debug_assert_eq!(slice.fragments.len(), self.resorted_at.len());
        slice
            .fragments
            .iter()
            .zip(&self.resorted_at)
            .zip(&self.times_at)
            .map(|((f, at), times)| SortedHits {
                hits: match at {
                    None => HitsIn::Records(f.hit_records()),
                    Some(r) => HitsIn::Decoded(&self.resorted[r.clone()]),
                },
                times: &self.times[times.clone()],
            })
            .collect()
    }
}

/// One fragment's hits in time order (from [`SliceHits::sorted`]).
#[derive(Clone, Copy)]
pub(crate) struct SortedHits<'a> {
    hits: HitsIn<'a>,
    /// The time of every [`TIME_INDEX_STRIDE`]th hit.
    times: &'a [u32],
}

#[derive(Clone, Copy)]
enum HitsIn<'a> {
    /// The payload's records, already in order.
    Records(&'a [[u8; shoal_core::hit::HIT_LEN]]),
    /// Decoded and sorted (the payload's were not in order).
    Decoded(&'a [Hit]),
}

impl SortedHits<'_> {
    pub(crate) fn get(&self, k: usize) -> Hit {
        match self.hits {
            HitsIn::Records(r) => Hit::from_record(&r[k]),
            HitsIn::Decoded(h) => h[k],
        }
    }

    fn len(&self) -> usize {
        match self.hits {
            HitsIn::Records(r) => r.len(),
            HitsIn::Decoded(h) => h.len(),
        }
    }

    /// The first index whose hit's time fails `pred` (`pred` true on the times of a
    /// prefix, as for `slice::partition_point`): the time index narrows the search to one
    /// stride of hits, the only part of the payload it reads.
    pub(crate) fn partition_point_by_time(&self, pred: impl Fn(u32) -> bool) -> usize {
        // Index entries k < blocks hold hits k * STRIDE whose time passes; the first
        // failing hit is after the last of those and at most at the next entry's hit.
        let blocks = self.times.partition_point(|&t| pred(t));
        if blocks == 0 {
            return 0;
        }
        let from = (blocks - 1) * TIME_INDEX_STRIDE + 1;
        let to = (blocks * TIME_INDEX_STRIDE).min(self.len());
        from + match self.hits {
            HitsIn::Records(r) => r[from..to].partition_point(|rec| pred(Hit::from_record(rec).time_ns)),
            HitsIn::Decoded(h) => h[from..to].partition_point(|h| pred(h.time_ns)),
        }
    }
}

/// An assembled slice handed to the filter.
#[derive(Clone, Debug)]
pub struct SliceData {
    pub slice: u64,
    /// Slice start, ns in the driver's time origin (UNIX ns in the runtime).
    pub slice_start_ns: u64,
    /// Slice length, ns (rates per PMT are hits / length).
    pub slice_ns: u64,
    pub fragments: Vec<FragmentData>,
}

/// The rule for events handed back by user code (a C plug-in, a filter worker): at least
/// one hit, every hit on a source of the slice (`sorted_sources`, ascending) and within the
/// slice (`time_ns < slice_ns`). Anything else is refused and counted as malformed.
pub fn event_is_well_formed(hits: &[EventHit], sorted_sources: &[SourceId], slice_ns: u64) -> bool {
    !hits.is_empty()
        && hits.iter().all(|h| sorted_sources.binary_search(&h.source).is_ok() && u64::from(h.time_ns) < slice_ns)
}

/// Slice `slice` of `generator` as a builder hands it to its filter: one fragment per module
/// (the source id is the module's index). For tests, benchmarks and examples.
pub fn generated_slice(generator: &shoal_detector::physics::PhysicsGenerator, slice: u64) -> SliceData {
    let slice_ns = u64::from(generator.slice_ns());
    let fragments = (0..generator.geometry().modules.len())
        .map(|m| {
            let f = generator.generate(m, slice);
            FragmentData { source: m as u32, flags: 0, hit_count: f.hit_count, payload: f.payload }
        })
        .collect();
    SliceData { slice, slice_start_ns: slice * slice_ns, slice_ns, fragments }
}

/// Filter selection and parameters (the `[builder.filter]` table of the configuration).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilterConfig {
    /// `muon` (default), `l1`, `pass` or `none`; ignored when `plugin` is set.
    pub name: String,
    /// A filter plug-in (C ABI, `include/shoal_filter.h`, docs/plugins.md): the path of its
    /// shared library, loaded by each builder at start. Empty: the built-in `name`.
    pub plugin: String,
    /// Text handed to the plug-in's `shoal_filter_init` (or the Python module's `init`).
    pub config: String,
    /// A Python filter, `module:function`, run in worker processes (docs/plugins.md,
    /// "Python filters"). Empty: not used. Takes precedence over `plugin` and `name`.
    pub python: String,
    /// Prepended to the workers' `sys.path` (`:`-separated).
    pub python_path: String,
    /// The workers' interpreter.
    pub python_exe: String,
    /// Worker processes per builder (slices filtered in parallel).
    pub workers: usize,
    /// Longest a worker may take for one slice, ms; then it is killed and replaced and the
    /// slice counted as `filter_timeout`.
    pub timeout_ms: u64,
    /// Run the C `plugin` in `workers` processes of its own (`shoal filter-worker`): a
    /// crash or a hang costs its slice, not the builder.
    pub isolate: bool,
    /// The `shoal` binary the isolated plug-in's workers run (default: this process's own
    /// executable when it is `shoal`).
    pub worker_exe: String,
    pub l1: L1Config,
    pub muon: MuonConfig,
}

impl Default for FilterConfig {
    fn default() -> Self {
        Self {
            name: "muon".into(),
            plugin: String::new(),
            config: String::new(),
            python: String::new(),
            python_path: String::new(),
            python_exe: "python3".into(),
            workers: 1,
            timeout_ms: 5_000,
            isolate: false,
            worker_exe: String::new(),
            l1: L1Config::default(),
            muon: MuonConfig::default(),
        }
    }
}

/// Why a filter cannot start.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FilterError {
    #[error("unknown filter {0:?} (known: muon, l1, pass, none)")]
    Unknown(String),
    #[error("invalid filter parameter: {0}")]
    BadParameter(String),
}

/// The filter plug-in interface.
pub trait Filter: Send {
    /// Called once before the first slice with the run's configuration.
    fn init(&mut self, config: &FilterConfig) -> Result<(), FilterError>;
    /// Processes one slice; returns the selected events in time order.
    fn process(&mut self, slice: &SliceData) -> Vec<Event>;
    /// Called once after the last slice.
    fn cleanup(&mut self) {}
    /// Slices the filter failed on (a plug-in's error return), counted by the builder.
    fn failed_slices(&self) -> u64 {
        0
    }
    /// Events refused as malformed (a plug-in's), counted by the builder.
    fn malformed_events(&self) -> u64 {
        0
    }
}

/// Checks `config` without loading a plug-in (any process validates a run's configuration;
/// only builders load the plug-in, at start, where its path must exist).
pub fn check(config: &FilterConfig) -> Result<(), FilterError> {
    if !config.python.is_empty() {
        if !config.python.contains(':') {
            return Err(FilterError::BadParameter(format!("python = {:?} is not module:function", config.python)));
        }
        if config.workers == 0 || config.workers > 256 || config.timeout_ms == 0 {
            return Err(FilterError::BadParameter("python filters need workers 1..256 and timeout_ms > 0".into()));
        }
        return Ok(());
    }
    if config.isolate && config.plugin.is_empty() {
        return Err(FilterError::BadParameter("isolate runs a C plugin in worker processes: set plugin".into()));
    }
    if config.isolate && (config.workers == 0 || config.workers > 256 || config.timeout_ms == 0) {
        return Err(FilterError::BadParameter("isolated plug-ins need workers 1..256 and timeout_ms > 0".into()));
    }
    if !config.plugin.is_empty() {
        return Ok(());
    }
    build(config).map(|_| ())
}

/// Builds and initialises the filter named in `config` (loading its plug-in, if any).
pub fn build(config: &FilterConfig) -> Result<Box<dyn Filter>, FilterError> {
    if !config.plugin.is_empty() {
        return Ok(Box::new(plugin::PluginFilter::load(config)?));
    }
    let mut f: Box<dyn Filter> = match config.name.as_str() {
        "muon" => Box::new(MuonFilter::default()),
        "l1" => Box::new(L1Multiplicity::default()),
        "pass" => Box::new(PassThrough),
        "none" => Box::new(SelectNothing),
        other => return Err(FilterError::Unknown(other.to_string())),
    };
    f.init(config)?;
    Ok(f)
}

/// One event per non-empty slice holding every hit. No reduction.
#[derive(Debug, Default)]
pub struct PassThrough;

impl Filter for PassThrough {
    fn init(&mut self, _config: &FilterConfig) -> Result<(), FilterError> {
        Ok(())
    }
    fn process(&mut self, slice: &SliceData) -> Vec<Event> {
        let mut hits = Vec::new();
        for f in &slice.fragments {
            if let Ok(p) = f.hits() {
                hits.extend(p.hits().map(|h| EventHit::from_hit(f.source, h, false)));
            }
        }
        if hits.is_empty() {
            return Vec::new();
        }
        hits.sort_by_key(|h| (h.time_ns, h.source, h.channel));
        vec![Event { id: 0, trigger_mask: 0, overlays: 0, hits }]
    }
}

/// Checks every fragment's payload and selects nothing.
#[derive(Debug, Default)]
pub struct SelectNothing;

impl Filter for SelectNothing {
    fn init(&mut self, _config: &FilterConfig) -> Result<(), FilterError> {
        Ok(())
    }
    fn process(&mut self, slice: &SliceData) -> Vec<Event> {
        // The builder already validated the payloads; touching the hit count keeps this
        // honest about reading the slice without paying for a trigger.
        let _hits: usize = slice.fragments.iter().filter_map(|f| f.hits().ok()).map(|p| p.hit_count()).sum();
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A time looked up through the index lands where a search of every hit does, for
        /// payloads in order (read in place) and out of order (sorted copies), at any
        /// length around the index's stride.
        #[test]
        fn the_time_index_finds_what_a_full_search_finds(
            fragments in proptest::collection::vec(proptest::collection::vec((0u8..3, 0u32..400), 0..140), 1..4),
            in_order in any::<bool>(),
            probes in proptest::collection::vec(0u32..420, 1..20),
        ) {
            let mut slice = SliceData { slice: 0, slice_start_ns: 0, slice_ns: 1_000, fragments: Vec::new() };
            let mut sorted: Vec<Vec<Hit>> = Vec::new();
            for (i, raw) in fragments.iter().enumerate() {
                let mut hits: Vec<Hit> = raw.iter().map(|&(channel, time_ns)| Hit { channel, time_ns, amplitude: 1 }).collect();
                hits.sort();
                let mut payload = Vec::new();
                let sent: Vec<Hit> = if in_order { hits.clone() } else { hits.iter().rev().copied().collect() };
                for h in &sent {
                    h.encode(&mut payload);
                }
                slice.fragments.push(FragmentData { source: i as u32, flags: 0, hit_count: hits.len() as u32, payload: payload.into() });
                sorted.push(hits);
            }
            let mut reader = SliceHits::default();
            reader.clear();
            for (f, want) in slice.fragments.iter().zip(&sorted) {
                prop_assert_eq!(reader.read(f), &want[..]);
            }
            for (fh, want) in reader.sorted(&slice).iter().zip(&sorted) {
                for &t in &probes {
                    prop_assert_eq!(fh.partition_point_by_time(|x| x < t), want.partition_point(|h| h.time_ns < t));
                    prop_assert_eq!(fh.partition_point_by_time(|x| x <= t), want.partition_point(|h| h.time_ns <= t));
                }
                prop_assert!((0..want.len()).all(|k| fh.get(k) == want[k]));
            }
        }
    }

    #[test]
    fn build_by_name() {
        for name in ["muon", "l1", "pass", "none"] {
            assert!(build(&FilterConfig { name: name.into(), ..Default::default() }).is_ok(), "{name}");
        }
        assert_eq!(
            build(&FilterConfig { name: "x".into(), ..Default::default() }).err(),
            Some(FilterError::Unknown("x".into()))
        );
    }
}
