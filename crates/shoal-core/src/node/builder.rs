//! The builder node: the slice assembler plus what a builder process decides around it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::assembly::{Admission, AssemblerConfig, EmitReason, SliceAssembler, SliceOutcome};
use crate::frame::{Flags, FrameHeader, HEADER_LEN};
use crate::ledger::BuilderTally;
use crate::shaping::PullConfig;

use super::pull::{FragmentRequest, PullRequester, PullStats};
use crate::slice::{SliceClock, SliceNumber};
use crate::{BuilderId, Duration, Instant, SourceId};

/// What a builder node is told at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BuilderNodeConfig {
    pub id: BuilderId,
    pub assembler: AssemblerConfig,
    pub slice_clock: SliceClock,
}

/// A fragment that arrived whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arrival {
    pub source: SourceId,
    pub slice: SliceNumber,
    /// Length on the wire (header and payload).
    pub wire_bytes: u64,
    /// A burst-cutoff marker (no data).
    pub cut_off: bool,
    /// When the source handed the frame to the transport (`Instant::ZERO`: unknown).
    pub send_time: Instant,
    /// It arrived only thanks to a retransmission (datagram transport).
    pub recovered: bool,
    /// The source flagged it late ([`Flags::LATE`]): it never joins its slice.
    pub late: bool,
}

impl Arrival {
    pub fn from_header(h: &FrameHeader) -> Self {
        Self {
            source: h.source,
            slice: h.slice,
            wire_bytes: HEADER_LEN as u64 + u64::from(h.payload_len),
            cut_off: h.flags.contains(Flags::CUT_OFF),
            send_time: h.send_time,
            recovered: false,
            late: h.flags.contains(Flags::LATE),
        }
    }
}

/// What became of an arrival, and the delays it measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArrivalOutcome {
    pub admission: Admission,
    /// Application send to complete arrival.
    pub network_delay: Option<Duration>,
    /// Slice end to application send: the delay added on purpose by shaping.
    pub shaping_delay: Option<Duration>,
}

/// The report's name for why a slice was processed incomplete.
fn incomplete_reason(reason: EmitReason) -> &'static str {
    match reason {
        // Every source delivered or was dropped, some for overload.
        EmitReason::Complete => "dropped_overload",
        EmitReason::SliceCountTimeout => "slice_count_timeout",
        EmitReason::WallClockTimeout => "wall_clock_timeout",
        EmitReason::Drained => "end_of_run",
        EmitReason::Abandoned => "request_timeout",
    }
}

/// What a builder node reports.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct BuilderNodeReport {
    pub id: BuilderId,
    pub tally: BuilderTally,
    pub slices_complete: u64,
    pub slices_incomplete: u64,
    /// Incomplete slices by the reason they were processed.
    pub incomplete_reasons: BTreeMap<String, u64>,
    /// Fragments accepted into slices, and their bytes on the wire.
    pub fragments: u64,
    pub bytes: u64,
    /// Sources that ended their stream.
    pub sources_ended: u32,
    /// Closed connections by reason (bad magic, CRC errors, ...).
    pub rejected_connections: BTreeMap<String, u64>,
    /// Arrival of the first and last accepted fragment (driver's time origin, ns).
    pub first_arrival_ns: u64,
    pub last_arrival_ns: u64,
    /// Pull policies: assignments, requests, re-asks, fragments given up, waits.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub pull: Option<PullStats>,
    /// The first and last slice this builder processed (none: it processed none).
    #[cfg_attr(feature = "serde", serde(default))]
    pub slices_first: Option<SliceNumber>,
    #[cfg_attr(feature = "serde", serde(default))]
    pub slices_last: Option<SliceNumber>,
    /// The incomplete slices with the sources they lacked, in processing order (the
    /// diagnosis names a cause for each); at most [`MAX_LISTED_SLICES`], the rest counted
    /// in `incomplete_unlisted`.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub incomplete_slices: Vec<IncompleteSlice>,
    #[cfg_attr(feature = "serde", serde(default))]
    pub incomplete_unlisted: u64,
}

/// Most incomplete slices a builder lists in its report (a run losing more has one cause
/// that the first ten thousand show).
pub const MAX_LISTED_SLICES: usize = 10_000;
/// Most sources listed per incomplete slice (the rest counted).
pub const MAX_LISTED_SOURCES: usize = 64;

/// One incomplete slice: the sources that sent nothing and those discarded for overload.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct IncompleteSlice {
    pub slice: SliceNumber,
    /// Why it was processed (`wall_clock_timeout`, `end_of_run`, ...).
    pub reason: String,
    pub missing: Vec<SourceId>,
    pub dropped: Vec<SourceId>,
    /// Sources beyond `MAX_LISTED_SOURCES` (64) in `missing` and `dropped` together.
    #[cfg_attr(feature = "serde", serde(default))]
    pub unlisted_sources: u32,
    /// Of `missing`, the sources whose fragment came after the slice was processed: they
    /// were sending, but later than the builder waited (a source behind, not a loss on the
    /// way).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub arrived_late: Vec<SourceId>,
}

impl IncompleteSlice {
    fn of<T>(o: &SliceOutcome<T>) -> Self {
        let missing: Vec<SourceId> = o.missing.iter().copied().take(MAX_LISTED_SOURCES).collect();
        let dropped: Vec<SourceId> =
            o.dropped.iter().copied().take(MAX_LISTED_SOURCES.saturating_sub(missing.len())).collect();
        let unlisted = (o.missing.len() + o.dropped.len()).saturating_sub(missing.len() + dropped.len());
        Self {
            slice: o.slice,
            reason: incomplete_reason(o.reason).to_string(),
            missing,
            dropped,
            unlisted_sources: unlisted as u32,
            arrived_late: Vec::new(),
        }
    }

    /// Every source it lacked sent its fragment, after the slice was processed (none sent
    /// nothing, none was discarded): the sources were late, nothing was lost on the way.
    pub fn sources_came_late(&self) -> bool {
        !self.missing.is_empty()
            && self.dropped.is_empty()
            && self.unlisted_sources == 0
            && self.missing.iter().all(|m| self.arrived_late.contains(m))
    }
}

/// A builder process's decisions. See the [module documentation](super).
///
/// Driving it: feed arrivals ([`BuilderNode::handle_frame`]), call
/// [`BuilderNode::handle_timeout`] at [`BuilderNode::poll_timeout`], hand every slice from
/// [`BuilderNode::poll_slice`] to the filter and report its bytes back with
/// [`BuilderNode::handle_released`] when the filter is done with it. The run is over for
/// this builder when [`BuilderNode::all_ended`]: the node drains itself when the last
/// source ends its stream. [`BuilderNode::handle_drain`] is for runs cut short.
#[derive(Debug)]
pub struct BuilderNode<T> {
    cfg: BuilderNodeConfig,
    asm: SliceAssembler<T>,
    ended: BTreeSet<SourceId>,
    report: BuilderNodeReport,
    out: VecDeque<SliceOutcome<T>>,
    /// Pull policies: the requesting side.
    pull: Option<PullRequester>,
    /// Datagram transport: frames given up in reassembly, per source.
    damaged: BTreeMap<SourceId, u64>,
    /// Late fragments kept by the late-data side stream.
    salvaged: u64,
}

impl<T> BuilderNode<T> {
    pub fn new(cfg: BuilderNodeConfig) -> Self {
        Self {
            asm: SliceAssembler::new(cfg.assembler),
            cfg,
            ended: BTreeSet::new(),
            report: BuilderNodeReport { id: cfg.id, ..Default::default() },
            out: VecDeque::new(),
            pull: None,
            damaged: BTreeMap::new(),
            salvaged: 0,
        }
    }

    /// A builder of a pull run: it builds the slices assigned to it
    /// ([`BuilderNode::handle_assignment`]) from the fragments it requests
    /// ([`BuilderNode::poll_request`]). Its slice-count timeout is at least one more than
    /// its credits (it never holds more slices than that; re-asks time slices out).
    pub fn with_pull(mut self, pull: PullConfig) -> Self {
        let mut assembler = self.cfg.assembler;
        assembler.max_active = assembler.max_active.max(pull.credits as usize + 1);
        self.cfg.assembler = assembler;
        self.asm = SliceAssembler::new(assembler);
        self.pull = Some(PullRequester::new(pull, assembler.n_sources));
        self
    }

    /// Pull: the data-flow manager assigned `slice` to this builder.
    pub fn handle_assignment(&mut self, now: Instant, slice: SliceNumber) {
        if let Some(p) = self.pull.as_mut() {
            p.handle_assignment(now, slice);
        }
    }

    /// Pull: the next fragment request to send to a source.
    pub fn poll_request(&mut self) -> Option<FragmentRequest> {
        self.pull.as_mut()?.poll_request()
    }

    /// Pull: the next slice whose credit returned, to report to the data-flow manager.
    pub fn poll_done(&mut self) -> Option<SliceNumber> {
        self.pull.as_mut()?.poll_done()
    }

    /// Pull: the requesting side (assigned slices and history, for the manager's hello).
    pub fn pull(&self) -> Option<&PullRequester> {
        self.pull.as_ref()
    }

    pub fn config(&self) -> &BuilderNodeConfig {
        &self.cfg
    }

    /// A whole frame arrived: a data fragment or a source's end-of-stream marker (`None`).
    pub fn handle_frame(&mut self, now: Instant, header: &FrameHeader, data: T) -> Option<ArrivalOutcome> {
        if header.flags.contains(Flags::END_OF_STREAM) {
            self.handle_end_of_stream(now, header.source);
            return None;
        }
        Some(self.handle_fragment(now, Arrival::from_header(header), data))
    }

    /// A data fragment arrived whole.
    pub fn handle_fragment(&mut self, now: Instant, a: Arrival, data: T) -> ArrivalOutcome {
        self.handle_fragment_keep(now, a, data).0
    }

    /// [`BuilderNode::handle_fragment`] that gives back the data of a late fragment, for
    /// the late-data side stream ([`crate::saver::BurstSaver::handle_late`]); report the
    /// ones kept with [`BuilderNode::handle_salvaged`].
    pub fn handle_fragment_keep(&mut self, now: Instant, a: Arrival, data: T) -> (ArrivalOutcome, Option<T>) {
        let (mut network_delay, mut shaping_delay) = (None, None);
        if a.send_time > Instant::ZERO {
            network_delay = Some(now - a.send_time);
            shaping_delay = Some(a.send_time - self.cfg.slice_clock.end_of(a.slice));
        }
        let (admission, late) = if a.late {
            self.asm.handle_late_fragment(a.source, data)
        } else {
            self.asm.handle_fragment_returning(now, a.source, a.slice, a.wire_bytes, a.cut_off, a.recovered, data)
        };
        if let Some(p) = self.pull.as_mut() {
            p.handle_arrival(now, a.source, a.slice);
        }
        if admission == Admission::Late {
            self.note_late_arrival(a.source, a.slice);
        }
        if admission == Admission::Accepted {
            self.report.fragments += 1;
            self.report.bytes += a.wire_bytes;
            if self.report.first_arrival_ns == 0 {
                self.report.first_arrival_ns = now.as_nanos();
            }
            self.report.last_arrival_ns = now.as_nanos();
        }
        self.collect(now);
        (ArrivalOutcome { admission, network_delay, shaping_delay }, late)
    }

    /// A fragment of a slice already processed: if the slice is listed incomplete without
    /// this source, the source was sending, only late.
    fn note_late_arrival(&mut self, source: SourceId, slice: SliceNumber) {
        let listed = &mut self.report.incomplete_slices;
        // Listed in the order processed, which is slice order (a search that finds the
        // slice has found it, sorted or not).
        if let Ok(i) = listed.binary_search_by_key(&slice, |s| s.slice) {
            let s = &mut listed[i];
            if s.missing.contains(&source) && !s.arrived_late.contains(&source) {
                s.arrived_late.push(source);
            }
        }
    }

    /// A late fragment was kept in the late-data side stream: the ledger counts it
    /// `salvaged` instead of `late`.
    pub fn handle_salvaged(&mut self) {
        self.salvaged += 1;
    }

    /// A source ended its stream (markers from unknown sources are ignored). When the last
    /// one does, no fragment can come any more: every active slice is processed.
    pub fn handle_end_of_stream(&mut self, now: Instant, source: SourceId) {
        if source < self.cfg.assembler.n_sources && self.ended.insert(source) && self.all_ended() {
            self.handle_drain(now);
        }
    }

    /// Datagram transport: `n` frames of `source` were partly received and given up
    /// (counted `damaged` in the ledger).
    pub fn handle_damaged(&mut self, source: SourceId, n: u64) {
        if n > 0 {
            *self.damaged.entry(source).or_default() += n;
        }
    }

    /// A connection was closed for bad input.
    pub fn handle_rejected(&mut self, reason: &str) {
        *self.report.rejected_connections.entry(reason.to_string()).or_default() += 1;
    }

    /// Lets the wall-clock guard fire.
    pub fn handle_timeout(&mut self, now: Instant) {
        if let Some(p) = self.pull.as_mut() {
            p.handle_timeout(now);
        }
        self.asm.handle_timeout(now);
        self.collect(now);
    }

    /// The filter is done with `bytes` handed out earlier: they leave the memory budget.
    pub fn handle_released(&mut self, bytes: u64) {
        self.asm.handle_released(bytes);
    }

    /// End of run: every active slice is processed, in order.
    pub fn handle_drain(&mut self, now: Instant) {
        self.asm.handle_drain(now);
        self.collect(now);
        if let Some(p) = self.pull.as_mut() {
            p.handle_drain(now);
        }
    }

    /// The next processed slice, for the filter.
    pub fn poll_slice(&mut self) -> Option<SliceOutcome<T>> {
        self.out.pop_front()
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        let asm = self.asm.poll_timeout();
        match self.pull.as_ref().and_then(|p| p.poll_timeout()) {
            Some(t) => Some(asm.map_or(t, |a| a.min(t))),
            None => asm,
        }
    }

    /// Every source has ended its stream.
    pub fn all_ended(&self) -> bool {
        self.ended.len() as u32 >= self.cfg.assembler.n_sources
    }

    pub fn sources_ended(&self) -> usize {
        self.ended.len()
    }

    pub fn memory_in_use(&self) -> u64 {
        self.asm.memory_in_use()
    }

    /// A fragment of `slice` would push the oldest active slice out incomplete
    /// ([`crate::assembly::SliceAssembler::opens_past_window`]).
    pub fn opens_past_window(&self, slice: SliceNumber) -> bool {
        self.asm.opens_past_window(slice)
    }

    /// The newest active slice while the window is full
    /// ([`crate::assembly::SliceAssembler::window_edge`]).
    pub fn window_edge(&self) -> Option<SliceNumber> {
        self.asm.window_edge()
    }

    /// The report so far; fragments still held count as pending.
    pub fn report(&self) -> BuilderNodeReport {
        let mut r = self.report.clone();
        r.tally = self.asm.tally();
        r.tally.damaged = self.damaged.clone();
        r.tally.late -= self.salvaged.min(r.tally.late);
        r.tally.salvaged = self.salvaged;
        r.sources_ended = self.ended.len() as u32;
        r.pull = self.pull.as_ref().map(|p| p.stats().clone());
        r
    }

    fn collect(&mut self, now: Instant) {
        // Pull: slices whose missing fragments were given up are processed now.
        while let Some(slice) = self.pull.as_mut().and_then(|p| p.poll_give_up()) {
            self.asm.handle_give_up(now, slice);
        }
        while let Some(o) = self.asm.poll_outcome() {
            if let Some(p) = self.pull.as_mut() {
                p.handle_slice_done(now, o.slice);
            }
            let r = &mut self.report;
            r.slices_first = Some(r.slices_first.map_or(o.slice, |f| f.min(o.slice)));
            r.slices_last = Some(r.slices_last.map_or(o.slice, |l| l.max(o.slice)));
            if o.is_complete() {
                r.slices_complete += 1;
            } else {
                r.slices_incomplete += 1;
                let name = incomplete_reason(o.reason);
                *r.incomplete_reasons.entry(name.to_string()).or_default() += 1;
                if r.incomplete_slices.len() < MAX_LISTED_SLICES {
                    r.incomplete_slices.push(IncompleteSlice::of(&o));
                } else {
                    r.incomplete_unlisted += 1;
                }
            }
            self.out.push_back(o);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(n_sources: u32) -> BuilderNode<u32> {
        BuilderNode::new(BuilderNodeConfig {
            id: 0,
            assembler: AssemblerConfig::new(n_sources),
            slice_clock: SliceClock::new(Duration::from_millis(10)),
        })
    }

    fn arrival(source: SourceId, slice: SliceNumber) -> Arrival {
        Arrival {
            source,
            slice,
            wire_bytes: 100,
            cut_off: false,
            send_time: Instant::from_nanos(12_000_000),
            recovered: false,
            late: false,
        }
    }

    #[test]
    fn recovered_and_damaged_fragments_are_counted_apart() {
        let mut b = node(2);
        let now = Instant::from_nanos(13_000_000);
        b.handle_fragment(now, arrival(0, 0), 1);
        b.handle_fragment(now, Arrival { recovered: true, ..arrival(1, 0) }, 2);
        assert!(b.poll_slice().unwrap().is_complete());
        // A recovered fragment that comes too late is late, not recovered.
        assert_eq!(b.handle_fragment(now, Arrival { recovered: true, ..arrival(1, 0) }, 3).admission, Admission::Late);
        b.handle_damaged(1, 2);
        let t = b.report().tally;
        assert_eq!((t.delivered, t.recovered, t.late), (1, 1, 1));
        assert_eq!(t.damaged.get(&1), Some(&2));
        assert_eq!(t.unaccounted(), 0);
    }

    #[test]
    fn late_fragments_come_back_for_the_side_stream() {
        let mut b = node(1);
        let now = Instant::from_nanos(13_000_000);
        b.handle_fragment(now, arrival(0, 0), 1);
        assert!(b.poll_slice().is_some());
        let (o, late) = b.handle_fragment_keep(now, arrival(0, 0), 2);
        assert_eq!((o.admission, late), (Admission::Late, Some(2)));
        b.handle_salvaged();
        let (_, late) = b.handle_fragment_keep(now, arrival(0, 0), 3);
        assert_eq!(late, Some(3), "kept or not is the driver's choice; this one is dropped");
        let t = b.report().tally;
        assert_eq!((t.delivered, t.late, t.salvaged, t.unaccounted()), (1, 1, 1, 0));
    }

    #[test]
    fn a_missing_source_that_sends_late_is_listed_as_late_not_lost() {
        let mut b = node(3);
        b.handle_fragment(Instant::from_nanos(13_000_000), arrival(0, 0), 1);
        // The wall-clock guard processes slice 0 without sources 1 and 2.
        b.handle_timeout(Instant::from_nanos(13_000_000) + Duration::from_secs(3));
        assert_eq!(b.poll_slice().unwrap().missing, [1, 2]);
        let later = Instant::from_nanos(13_000_000) + Duration::from_secs(4);
        assert_eq!(b.handle_fragment(later, arrival(2, 0), 2).admission, Admission::Late);
        // Again, and a source that was not missing: neither listed twice nor added.
        b.handle_fragment(later, arrival(2, 0), 3);
        b.handle_fragment(later, arrival(0, 0), 4);
        let r = b.report();
        assert_eq!(r.incomplete_slices.len(), 1);
        assert_eq!(
            (r.incomplete_slices[0].missing.clone(), r.incomplete_slices[0].arrived_late.clone()),
            (vec![1, 2], vec![2])
        );
        assert_eq!((r.tally.late, r.tally.unaccounted()), (3, 0));
    }

    #[test]
    fn builds_measures_and_ends() {
        let mut b = node(2);
        let now = Instant::from_nanos(13_000_000);
        let o = b.handle_fragment(now, arrival(0, 0), 7);
        assert_eq!(o.admission, Admission::Accepted);
        assert_eq!(o.network_delay, Some(Duration::from_millis(1)));
        assert_eq!(o.shaping_delay, Some(Duration::from_millis(2)));
        assert!(b.poll_slice().is_none());
        b.handle_fragment(now, arrival(1, 0), 8);
        let s = b.poll_slice().unwrap();
        assert!(s.is_complete());
        assert_eq!(b.memory_in_use(), 200);
        b.handle_released(s.bytes);
        assert_eq!(b.memory_in_use(), 0);
        assert_eq!(b.handle_fragment(now, arrival(1, 0), 9).admission, Admission::Late);
        b.handle_fragment(now, arrival(1, 1), 9);
        b.handle_end_of_stream(now, 0);
        b.handle_end_of_stream(now, 99);
        assert!(!b.all_ended());
        assert!(b.poll_slice().is_none(), "slice 1 waits for source 1");
        b.handle_end_of_stream(now, 1);
        assert!(b.all_ended());
        assert_eq!(b.poll_slice().unwrap().missing, [0]);
        let r = b.report();
        assert_eq!((r.slices_complete, r.slices_incomplete, r.fragments, r.sources_ended), (1, 1, 3, 2));
        assert_eq!(r.incomplete_reasons["end_of_run"], 1);
        assert_eq!(r.incomplete_slices.len(), 1, "the incomplete slice is listed with what it lacked");
        assert_eq!((r.incomplete_slices[0].slice, r.incomplete_slices[0].reason.as_str()), (1, "end_of_run"));
        assert_eq!(r.incomplete_slices[0].missing, [0]);
        assert_eq!((r.slices_first, r.slices_last), (Some(0), Some(1)));
        assert_eq!((r.tally.delivered, r.tally.late, r.tally.unaccounted()), (3, 1, 0));
    }
}
