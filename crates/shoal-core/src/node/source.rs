//! The source node: one process's sources, from slice end to bytes on a connection.

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;

use super::slice_map::SliceMap;
use super::{GeneratedFragment, Workload};
use crate::frame::{self, Flags, FrameHeader, HEADER_LEN};
use crate::ledger::SourceTally;
use crate::shaping::{BurstCutoff, CutoffDecision, Outgoing, Policy, PullRequest, Shaper, ShaperContext, Transmit};
use crate::slice::{SliceClock, SliceNumber};
use crate::{BuilderId, Duration, Instant, SourceId};

/// The burst rate cutoff: during a burst send only the first `head` and last `tail` slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CutoffConfig {
    pub head: u32,
    pub tail: u32,
}

/// Saturation: slices a node holds at least per hosted source, produced and not yet taken
/// by the transport.
pub const SATURATION_SLICES: usize = 4;
/// Saturation: bytes a node holds per hosted source before it stops producing, once it
/// holds [`SATURATION_SLICES`] slices. Slices of small fragments are no measure of what a
/// shaper may release at once: four 9,000-byte fragments are a quarter of a token bucket's
/// depth at 1 Gbit/s, so a bucket waited for four fragments at a time (three times as many
/// wake-ups as it needs). A quarter of a megabyte per source, what a front-end board's
/// output buffer holds, covers the default depth up to 2 Gbit/s.
pub const SATURATION_BYTES: u64 = 256 * 1024;

/// What a source node is told at start.
#[derive(Clone, Debug, PartialEq)]
pub struct SourceNodeConfig {
    /// The sources (boards) this node hosts. They share the node's connections (one per
    /// builder) and its per-builder queue limit; each keeps its own cutoff and shaper.
    pub sources: Vec<SourceId>,
    pub n_builders: u32,
    pub policy: Policy,
    pub slice_clock: SliceClock,
    /// First slice to produce. `None`: the first slice that starts on a whole second after
    /// the node is created, so processes started within the same second agree.
    pub first_slice: Option<SliceNumber>,
    /// How many slices to produce (`None`: until [`SourceNode::handle_stop`] or the end slice).
    pub slices: Option<u64>,
    pub cutoff: Option<CutoffConfig>,
    /// Most bytes handed to the transport towards one builder and not yet written; a
    /// fragment that would exceed it is dropped at the source (counted).
    pub queue_limit_bytes: u64,
    /// Most bytes the node holds in all (produced and not yet written: waiting in shapers,
    /// the cutoff or the transport, towards every builder): its share of the process's
    /// memory budget (`crate::budget`). A fragment produced beyond it is dropped at the
    /// source (counted), so no backlog can outgrow the budget.
    pub held_limit_bytes: u64,
    /// A slice whose end the node reaches more than this late is skipped: not produced,
    /// counted in [`SourceNodeReport::slices_skipped`]. A generator that cannot keep up
    /// with real time (the machine is too slow for the configured load) then stays within
    /// this much of it instead of falling further behind without end. `None`: never skip.
    pub max_lag: Option<Duration>,
    /// A fragment still being written this many slices after it was handed out no longer
    /// holds back its shaper's schedule, so one slow builder cannot stall the others.
    pub stall_limit_slices: u32,
    /// After the last slice, most time to hand out what is still queued.
    pub drain_timeout: Duration,
    /// Keep a log of every piece handed to the transport (parity tests, studies).
    pub record_transmits: bool,
    /// Saturation (benchmarks): slices are produced as soon as the transport has taken
    /// enough of the earlier ones (`SATURATION_SLICES` and `SATURATION_BYTES` per
    /// source), not when the slice clock says, so the data path, not the generator, sets
    /// the rate. Slice numbers then run ahead of the clock; policies that send by the
    /// clock (delayed transmission's slots) still wait for it, rate shapers (token
    /// bucket) and direct sending do not.
    pub saturate: bool,
    /// A slice is produced this long after its end on the host clock (the source SDK's
    /// input latency: data of a slice reach the host a little after the slice ends on the
    /// board; what comes later still goes out late, [`SourceNode::handle_late_fragment`]).
    /// Zero for generators.
    pub produce_delay: Duration,
    /// Saturating, produce only the slices the input has data for
    /// ([`SourceNode::handle_input_ready`]): submitted data, not the clock, sets the pace.
    pub data_driven: bool,
}

impl SourceNodeConfig {
    /// A node with the reference defaults: 64 MiB per builder (the ANTARES board's
    /// buffer), stall limit 2 slices, 10 s drain, no cutoff, no fixed length.
    pub fn new(sources: Vec<SourceId>, n_builders: u32, policy: Policy, slice_clock: SliceClock) -> Self {
        Self {
            sources,
            n_builders,
            policy,
            slice_clock,
            first_slice: None,
            slices: None,
            cutoff: None,
            queue_limit_bytes: 64 << 20,
            held_limit_bytes: u64::MAX,
            max_lag: None,
            stall_limit_slices: 2,
            drain_timeout: Duration::from_secs(10),
            record_transmits: false,
            saturate: false,
            produce_delay: Duration::ZERO,
            data_driven: false,
        }
    }
}

/// What a transmit carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransmitKind {
    /// A piece of a data frame (accounted: the transport must report it sent or failed).
    Data,
    /// The source's end-of-stream marker (one per hosted source and builder, after the
    /// last data frame; not accounted).
    EndOfStream,
}

/// A piece of a frame to write to builder `dest`: `head` (part of the 56-byte header),
/// then `body` (part of the payload), without copying the payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceTransmit {
    pub kind: TransmitKind,
    pub source: SourceId,
    pub dest: BuilderId,
    pub slice: SliceNumber,
    pub flags: Flags,
    /// Where this piece starts in the frame, and the frame's whole length on the wire.
    pub offset: u64,
    pub frame_len: u64,
    /// The frame's last piece: the transport reports the frame when it has written it.
    pub last: bool,
    pub head: Bytes,
    pub body: Bytes,
}

impl SourceTransmit {
    /// The piece starts the frame (its head is the whole header; stamp the send time).
    pub fn first(&self) -> bool {
        self.offset == 0
    }
    pub fn len(&self) -> u64 {
        (self.head.len() + self.body.len()) as u64
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One piece a node handed to the transport (with [`SourceNodeConfig::record_transmits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct TransmitRecord {
    pub at: Instant,
    pub source: SourceId,
    pub dest: BuilderId,
    pub slice: SliceNumber,
    pub bytes: u64,
}

/// Something the driver should log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceEvent {
    /// The drain deadline passed with fragments still queued (they count as unsent).
    DrainTimeout { queued: usize },
    /// A shaper released a fragment the node does not hold (a bug; nothing is sent).
    UnknownFragment { source: SourceId, slice: SliceNumber },
}

/// What a source node reports at the end.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SourceNodeReport {
    pub tallies: BTreeMap<SourceId, SourceTally>,
    /// Slices produced (per source).
    pub slices: u64,
    /// Payload bytes produced (all sources of the node).
    pub bytes_produced: u64,
    /// Slice ends reached late by more than one slice (the driver was starved of CPU).
    pub late_slice_ends: u64,
    /// The latest of those: how late (ns), and when, counted from the node's first slice
    /// (ns of slice time), so that an operator can hold it against the machine's load.
    #[cfg_attr(feature = "serde", serde(default))]
    pub worst_late_ns: u64,
    #[cfg_attr(feature = "serde", serde(default))]
    pub worst_late_into_run_ns: u64,
    /// Every slice end produced on time or late: how many, and the sum of how late the
    /// driver called (ns). Their mean is the host's wake-up latency after a slice end, which
    /// the simulator models for software sources (shoal-sim `wake`).
    #[cfg_attr(feature = "serde", serde(default))]
    pub slice_end_lag_count: u64,
    #[cfg_attr(feature = "serde", serde(default))]
    pub slice_end_lag_sum_ns: u64,
    /// The same lags' distribution (µs): its tail and shape, not only its mean, decide how
    /// far apart software sources start sending (shoal-sim `wake` draws from it).
    #[cfg_attr(feature = "serde", serde(default))]
    pub slice_end_lag_us: crate::loghist::LogHistogram,
    /// Fragments written: the time from the last piece handed to the transport to the
    /// transport's report that it was written (µs). Long times mean a full socket buffer
    /// (the builder reads slowly) or a driver starved of CPU between the two; with
    /// delayed transmission each of them holds back the source's next fragment.
    #[cfg_attr(feature = "serde", serde(default))]
    pub send_completion_us: crate::loghist::LogHistogram,
    /// Slices not produced because the node reached their end more than
    /// [`SourceNodeConfig::max_lag`] late (per node, not per source).
    #[cfg_attr(feature = "serde", serde(default))]
    pub slices_skipped: u64,
    /// Fragments dropped at the source because the node held
    /// [`SourceNodeConfig::held_limit_bytes`] already (also in the tallies' `dropped_at_source`).
    #[cfg_attr(feature = "serde", serde(default))]
    pub dropped_over_memory: u64,
    /// Source SDK: late fragments (data for a slice already sent) produced, and those that
    /// could not be routed (pull policies: the slice's builder is not known here; counted
    /// in the tallies' `dropped_at_source`).
    #[cfg_attr(feature = "serde", serde(default))]
    pub late_fragments: u64,
    #[cfg_attr(feature = "serde", serde(default))]
    pub late_unroutable: u64,
    /// Pull policies: requests received, and those for a fragment no longer held (a
    /// re-ask for one already handed out, or one evicted) or a source not hosted here.
    #[cfg_attr(feature = "serde", serde(default))]
    pub requests: u64,
    #[cfg_attr(feature = "serde", serde(default))]
    pub requests_unanswerable: u64,
    /// Datagram transport: what the node's streams sent, NACKs answered and not (filled
    /// in by the driver, which owns the streams).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub datagrams: Option<crate::datagram::SenderStats>,
    /// Source SDK and inputs: what the ingest accepted, refused and lost (filled in by
    /// the driver, which owns the ingest).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub ingest: Option<crate::ingest::IngestReport>,
    /// KM3NeT `clb:` input: what its DataQueue received, refused and found missing
    /// (packets, not fragments; filled in by the driver).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub clb: Option<crate::km3net::dataqueue::DataQueueReport>,
    /// With [`SourceNodeConfig::record_transmits`]: every piece handed out, in order.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub transmits: Vec<TransmitRecord>,
}

/// Running totals for live statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SourceTotals {
    pub produced: u64,
    /// Dropped at the source (queue limit) plus failed sends.
    pub dropped: u64,
    /// Replaced by an empty marker by the burst rate cutoff (delivered, data gone).
    pub cut_off: u64,
    /// Fragments reported written, and the sum of their send completions (µs; see
    /// [`SourceNodeReport::send_completion_us`]): their ratio over an interval is the mean.
    pub send_completions: u64,
    pub send_completion_us: u64,
}

#[derive(Debug)]
struct PendingFrame {
    /// The encoded header, sliced (not copied) into each piece.
    header: Bytes,
    flags: Flags,
    payload: Bytes,
    dest: Option<BuilderId>,
    dropped: bool,
    /// Bytes of this frame handed to the transport so far.
    handed: u64,
    /// When its last piece was handed out (for [`SourceNodeReport::send_completion_us`]).
    handed_at: Instant,
}

impl PendingFrame {
    fn len(&self) -> u64 {
        (HEADER_LEN + self.payload.len()) as u64
    }
}

#[derive(Debug)]
struct Hosted {
    id: SourceId,
    shaper: Box<dyn Shaper>,
    cutoff: Option<BurstCutoff>,
    /// Frames handed to the shaper and not yet reported sent, failed or dropped.
    frames: SliceMap<PendingFrame>,
    /// Produced, waiting for the cutoff's decision.
    undecided: SliceMap<GeneratedFragment>,
    /// The fragment holding back the schedule, and when it stops doing so.
    stall: Option<(SliceNumber, Instant)>,
    /// Fragments sent per builder (the tally's `sent`, kept as a vector on the hot path).
    sent_to: Vec<u64>,
    tally: SourceTally,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Producing,
    Draining {
        deadline: Instant,
    },
    /// End-of-stream markers handed out (or queued in `eos`); nothing else is sent.
    Closed,
}

/// A source process's decisions. See the [module documentation](super).
///
/// Driving it: call [`SourceNode::handle_timeout`] when [`SourceNode::poll_timeout`] is
/// reached (earlier is harmless), feed the transport's reports, and after every input drain
/// [`SourceNode::poll_transmit`] and [`SourceNode::poll_event`]. The node is done when
/// [`SourceNode::is_closed`]; reports that still arrive are accounted until
/// [`SourceNode::report`].
#[derive(Debug)]
pub struct SourceNode {
    cfg: SourceNodeConfig,
    hosted: Vec<Hosted>,
    /// (source id, position in `hosted`), sorted by id.
    index: Vec<(SourceId, usize)>,
    first_slice: SliceNumber,
    next_slice: SliceNumber,
    end_slice: Option<SliceNumber>,
    stopped: bool,
    paused: bool,
    phase: Phase,
    /// Bytes handed to the transport per builder and not yet reported.
    in_transport: Vec<u64>,
    /// Bytes of every frame and undecided fragment held (bounded by `held_limit_bytes`).
    held_bytes: u64,
    /// Late fragments waiting to be handed out whole, and those handed out and not yet
    /// reported: per (source, slice), their destinations and lengths. A late frame goes
    /// out only when the on-time frame of its (source, slice) has been reported, so a
    /// transport report is never ambiguous.
    late_frames: VecDeque<(usize, SliceNumber, PendingFrame)>,
    late_in_flight: BTreeMap<(SourceId, SliceNumber), Vec<(BuilderId, u64)>>,
    /// Data-driven production: the first slice the input has no complete data for.
    input_ready_below: SliceNumber,
    /// Per builder, the frame whose pieces are being handed out: hosted sources share one
    /// connection per builder, so a frame cut into pieces (token bucket) owns it until its
    /// last piece and pieces of other frames wait in `deferred`.
    open_frame: Vec<Option<(SourceId, SliceNumber)>>,
    deferred: Vec<VecDeque<(usize, Transmit)>>,
    /// Pieces in `deferred` (most of the time zero: skip the scan).
    deferred_pieces: usize,
    stall_limit: Duration,
    /// Round-robin cursor over hosted sources for `poll_transmit`.
    cursor: usize,
    eos: VecDeque<SourceTransmit>,
    events: VecDeque<SourceEvent>,
    totals: SourceTotals,
    report: SourceNodeReport,
    /// The last payload checksummed and its CRC32C. Fixed workloads and replay pools hand
    /// out the same buffer again and again; holding it keeps its address from being reused,
    /// so the same address and length mean the same bytes.
    crc_cache: Option<(Bytes, u32)>,
}

impl SourceNode {
    /// A node created at `now` (which fixes the first slice when the configuration does
    /// not). Panics if the configuration has no builder (validated by the caller).
    pub fn new(cfg: SourceNodeConfig, now: Instant) -> Self {
        assert!(cfg.n_builders > 0, "a source node needs at least one builder");
        let first_slice = cfg.first_slice.unwrap_or_else(|| cfg.slice_clock.first_on_a_second_after(now));
        let hosted: Vec<Hosted> = cfg
            .sources
            .iter()
            .map(|&id| Hosted {
                id,
                shaper: cfg.policy.build(ShaperContext { source: id, n_builders: cfg.n_builders }),
                cutoff: cfg.cutoff.map(|c| BurstCutoff::new(c.head, c.tail)),
                frames: SliceMap::default(),
                undecided: SliceMap::default(),
                stall: None,
                sent_to: vec![0; cfg.n_builders as usize],
                tally: SourceTally::default(),
            })
            .collect();
        let mut index: Vec<(SourceId, usize)> = hosted.iter().enumerate().map(|(i, h)| (h.id, i)).collect();
        index.sort_unstable();
        let stall_limit = cfg.slice_clock.length() * cfg.stall_limit_slices.max(1);
        let in_transport = vec![0; cfg.n_builders as usize];
        let open_frame = vec![None; cfg.n_builders as usize];
        let deferred = vec![VecDeque::new(); cfg.n_builders as usize];
        let mut node = Self {
            cfg,
            hosted,
            index,
            first_slice,
            next_slice: first_slice,
            end_slice: None,
            stopped: false,
            paused: false,
            phase: Phase::Producing,
            in_transport,
            held_bytes: 0,
            open_frame,
            deferred,
            deferred_pieces: 0,
            stall_limit,
            cursor: 0,
            eos: VecDeque::new(),
            events: VecDeque::new(),
            totals: SourceTotals::default(),
            report: SourceNodeReport::default(),
            crc_cache: None,
            late_frames: VecDeque::new(),
            late_in_flight: BTreeMap::new(),
            input_ready_below: 0,
        };
        if node.cfg.slices == Some(0) {
            node.start_drain(now);
        }
        node
    }

    pub fn config(&self) -> &SourceNodeConfig {
        &self.cfg
    }

    /// The first slice this node produces.
    pub fn first_slice(&self) -> SliceNumber {
        self.first_slice
    }

    /// The next slice whose end the node waits for (produced or, after data taking, ticked).
    pub fn next_slice(&self) -> SliceNumber {
        self.next_slice
    }

    /// Time has passed: produce every slice that has ended (several if the driver was
    /// late), tick slots after data taking, release stalls, end the drain.
    pub fn handle_timeout<W: Workload + ?Sized>(&mut self, now: Instant, workload: &W) {
        let clock = self.cfg.slice_clock;
        if self.phase == Phase::Producing {
            while !self.ends_before(self.next_slice) && self.next_slice_due(now) {
                let slice = self.next_slice;
                // Saturating, slice numbers run ahead of the clock: lag means nothing.
                if !self.cfg.saturate && self.cfg.max_lag.is_some_and(|lag| now >= self.due_at(slice) + lag) {
                    // Too far behind: a real board would have sent this slice long ago;
                    // skipping it keeps the node within `max_lag` of real time.
                    self.report.slices_skipped += 1;
                    for h in &mut self.hosted {
                        h.shaper.handle_slot_end(now, slice);
                    }
                    self.next_slice += 1;
                    continue;
                }
                if !self.cfg.saturate {
                    let lag_ns = now.saturating_duration_since(self.due_at(slice)).as_nanos() as u64;
                    self.report.slice_end_lag_count += 1;
                    self.report.slice_end_lag_sum_ns += lag_ns;
                    self.report.slice_end_lag_us.record(lag_ns / 1_000);
                }
                if !self.cfg.saturate && now >= self.due_at(slice + 1) {
                    self.report.late_slice_ends += 1;
                    let late = now.saturating_duration_since(self.due_at(slice)).as_nanos() as u64;
                    if late > self.report.worst_late_ns {
                        self.report.worst_late_ns = late;
                        self.report.worst_late_into_run_ns =
                            clock.end_of(slice).saturating_duration_since(clock.start_of(self.first_slice)).as_nanos()
                                as u64;
                    }
                }
                for i in 0..self.hosted.len() {
                    self.produce(i, slice, now, workload);
                }
                self.report.slices += 1;
                self.next_slice += 1;
            }
            if self.ends_before(self.next_slice) {
                self.start_drain(now);
            }
        }
        if let Phase::Draining { .. } = self.phase {
            // After data taking, slots keep passing: delayed transmission keeps its schedule
            // instead of sending every held fragment at once (an incast of its own making).
            while now >= clock.end_of(self.next_slice) {
                for h in &mut self.hosted {
                    h.shaper.handle_slot_end(now, self.next_slice);
                }
                self.next_slice += 1;
            }
        }
        for h in &mut self.hosted {
            if let Some((slice, until)) = h.stall
                && now >= until
            {
                // The fragment keeps going on its connection; the schedule stops waiting.
                h.stall = None;
                h.shaper.handle_sent(now, slice);
            }
            // Pull: fragments held past their hold time without a request.
            while let Some(slice) = h.shaper.poll_evicted() {
                if let Some(f) = h.frames.remove(slice) {
                    self.held_bytes -= f.len();
                    h.tally.never_requested += 1;
                }
            }
        }
        self.check_closed(now);
    }

    /// The transport has written the last byte of the frame of (`source`, `slice`).
    pub fn handle_sent(&mut self, now: Instant, source: SourceId, slice: SliceNumber) {
        self.handle_report(now, source, slice, true);
    }

    /// The connection failed while the frame of (`source`, `slice`) was queued or being
    /// written: the frame is lost (counted as `send_failed`).
    pub fn handle_send_failed(&mut self, now: Instant, source: SourceId, slice: SliceNumber) {
        self.handle_report(now, source, slice, false);
    }

    /// Run control ends the run: `end` is the first slice not to produce.
    pub fn handle_end_slice(&mut self, now: Instant, end: SliceNumber) {
        self.end_slice = Some(self.end_slice.map_or(end, |e| e.min(end)));
        if self.phase == Phase::Producing && self.ends_before(self.next_slice) {
            self.start_drain(now);
            self.check_closed(now);
        }
    }

    /// Stop producing now (Ctrl-C, cancellation); what is queued is still drained.
    pub fn handle_stop(&mut self, now: Instant) {
        self.stopped = true;
        if self.phase == Phase::Producing {
            self.start_drain(now);
            self.check_closed(now);
        }
    }

    /// Paused sources keep the slice schedule (builders still see every slice complete)
    /// but send empty fragments.
    pub fn handle_pause(&mut self, paused: bool) {
        self.paused = paused;
    }

    /// A builder asks `source` for a fragment (credit-based pull policies). A request for
    /// a fragment this node no longer holds (already handed out: a re-ask; or evicted) or
    /// for a source it does not host is counted and otherwise ignored.
    pub fn handle_request(&mut self, now: Instant, source: SourceId, req: PullRequest) {
        self.report.requests += 1;
        let Some(i) = self.hosted_index(source) else {
            self.report.requests_unanswerable += 1;
            return;
        };
        let h = &mut self.hosted[i];
        let produced = req.slice < self.next_slice || self.phase != Phase::Producing;
        let held =
            h.frames.get_mut(req.slice).is_some_and(|f| f.dest.is_none()) || h.undecided.get_mut(req.slice).is_some();
        if produced && !held {
            self.report.requests_unanswerable += 1;
            return;
        }
        h.shaper.handle_request(now, req);
    }

    /// Data-driven production ([`SourceNodeConfig::data_driven`]): the input has complete
    /// data for every slice below `below`.
    pub fn handle_input_ready(&mut self, below: SliceNumber) {
        self.input_ready_below = self.input_ready_below.max(below);
    }

    /// Data-driven production waits for the input: the next slice would be produced now
    /// but for its data. Returns the `ready_below` that lets it go on (the driver wakes the
    /// node when the input reaches it, and not on every submission).
    pub fn waiting_for_input(&self) -> Option<SliceNumber> {
        let waiting = self.cfg.saturate
            && self.cfg.data_driven
            && self.phase == Phase::Producing
            && !self.paused
            && self.has_room_saturating()
            && self.next_slice >= self.input_ready_below;
        waiting.then(|| self.next_slice + 1)
    }

    /// Data for (`source`, `slice`) that came after the node produced that slice (the
    /// source SDK, [`crate::ingest::Ingest::poll_late`]): it goes out whole, flagged
    /// [`Flags::LATE`], to the slice's builder, outside the shaper's schedule (it is rare
    /// and its slot has passed), and is accounted like any fragment. Pull policies do not
    /// know the slice's builder at the source: the fragment is dropped at the source.
    pub fn handle_late_fragment(
        &mut self,
        now: Instant,
        source: SourceId,
        slice: SliceNumber,
        frag: GeneratedFragment,
    ) {
        let Some(i) = self.hosted_index(source) else { return };
        self.hosted[i].tally.produced += 1;
        self.totals.produced += 1;
        self.report.late_fragments += 1;
        self.report.bytes_produced += frag.payload.len() as u64;
        let len = (HEADER_LEN + frag.payload.len()) as u64;
        if self.cfg.policy.pull().is_some() || self.held_bytes + len > self.cfg.held_limit_bytes {
            if self.cfg.policy.pull().is_some() {
                self.report.late_unroutable += 1;
            } else {
                self.report.dropped_over_memory += 1;
            }
            self.hosted[i].tally.dropped_at_source += 1;
            self.totals.dropped += 1;
            return;
        }
        if self.phase == Phase::Closed {
            // Too late for this run: its streams have ended.
            self.hosted[i].tally.unsent += 1;
            return;
        }
        let mut flags = Flags::LATE;
        if frag.opaque {
            flags = flags | Flags::OPAQUE;
        }
        let header = FrameHeader {
            flags,
            source,
            hit_count: frag.hit_count,
            slice,
            slice_start: self.cfg.slice_clock.start_of(slice),
            send_time: Instant::ZERO,
            payload_len: 0,
        };
        let payload_len = u32::try_from(frag.payload.len()).expect("payload longer than u32::MAX");
        let header = Bytes::copy_from_slice(&frame::encode_header_with_crc(
            &header,
            payload_len,
            crate::checksum::crc32c(&frag.payload),
        ));
        self.held_bytes += len;
        let f = PendingFrame {
            header,
            flags,
            payload: frag.payload,
            dest: None,
            dropped: false,
            handed: 0,
            handed_at: Instant::ZERO,
        };
        self.late_frames.push_back((i, slice, f));
        // Produced after the drain began: the drain waits for it like any queued frame.
        self.check_closed(now);
    }

    /// The first late frame that may go now: its on-time frame is reported and its
    /// builder's connection is between frames.
    fn next_late(&mut self, now: Instant) -> Option<SourceTransmit> {
        let n_builders = self.cfg.n_builders;
        let pos = self.late_frames.iter().position(|(i, slice, _)| {
            let dest = crate::slice::builder_for(*slice, n_builders) as usize;
            self.open_frame[dest].is_none() && !self.hosted[*i].frames.contains(*slice)
        })?;
        let (i, slice, f) = self.late_frames.remove(pos).expect("position found");
        let dest = crate::slice::builder_for(slice, n_builders);
        let len = f.len();
        let h = &mut self.hosted[i];
        if self.in_transport[dest as usize] + len > self.cfg.queue_limit_bytes {
            self.held_bytes -= len;
            h.tally.dropped_at_source += 1;
            self.totals.dropped += 1;
            return None;
        }
        self.in_transport[dest as usize] += len;
        self.late_in_flight.entry((h.id, slice)).or_default().push((dest, len));
        if self.cfg.record_transmits {
            let rec = TransmitRecord { at: now, source: h.id, dest, slice, bytes: len };
            self.report.transmits.push(rec);
        }
        Some(SourceTransmit {
            kind: TransmitKind::Data,
            source: h.id,
            dest,
            slice,
            flags: f.flags,
            offset: 0,
            frame_len: len,
            last: true,
            head: f.header,
            body: f.payload,
        })
    }

    fn handle_late_report(&mut self, now: Instant, i: usize, slice: SliceNumber, sent: bool) {
        let h = &mut self.hosted[i];
        let key = (h.id, slice);
        let Some(v) = self.late_in_flight.get_mut(&key) else { return };
        let (dest, len) = v.remove(0);
        if v.is_empty() {
            self.late_in_flight.remove(&key);
        }
        self.in_transport[dest as usize] -= len;
        self.held_bytes -= len;
        if sent {
            h.sent_to[dest as usize] += 1;
        } else {
            h.tally.send_failed += 1;
            self.totals.dropped += 1;
        }
        self.check_closed(now);
    }

    /// The next piece to hand to the transport.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<SourceTransmit> {
        if self.phase == Phase::Closed {
            return self.eos.pop_front();
        }
        if !self.late_frames.is_empty()
            && let Some(t) = self.next_late(now)
        {
            return Some(t);
        }
        for dest in 0..if self.deferred_pieces > 0 { self.deferred.len() } else { 0 } {
            while let Some((i, tx)) = self.next_deferred(dest) {
                if let Some(t) = self.dispatch(i, tx, now) {
                    return Some(t);
                }
            }
        }
        let n = self.hosted.len();
        for _ in 0..n {
            let i = self.cursor;
            while let Some(tx) = self.hosted[i].shaper.poll_transmit(now) {
                let key = (self.hosted[i].id, tx.slice);
                if self.open_frame[tx.dest as usize].is_some_and(|open| open != key) {
                    self.deferred[tx.dest as usize].push_back((i, tx));
                    self.deferred_pieces += 1;
                    continue;
                }
                if let Some(t) = self.dispatch(i, tx, now) {
                    return Some(t);
                }
            }
            self.cursor = (self.cursor + 1) % n;
        }
        None
    }

    /// The next waiting piece for `dest` that may go now: one of the open frame, or any
    /// if no frame is open (pieces of one frame stay in order).
    fn next_deferred(&mut self, dest: usize) -> Option<(usize, Transmit)> {
        let q = &mut self.deferred[dest];
        let pos = match self.open_frame[dest] {
            None => 0,
            Some(open) => q.iter().position(|(i, tx)| (self.hosted[*i].id, tx.slice) == open)?,
        };
        let piece = q.remove(pos)?;
        self.deferred_pieces -= 1;
        Some(piece)
    }

    /// When to call [`SourceNode::handle_timeout`] next (`None`: only on inputs).
    pub fn poll_timeout(&self) -> Option<Instant> {
        let deadline = match self.phase {
            Phase::Closed => return None,
            Phase::Producing => Instant::MAX,
            Phase::Draining { deadline } => deadline,
        };
        // Saturating, the next slice is due at once when there is room for it, else when
        // the transport reports fragments taken (an input, not a time).
        let next_due = match self.phase {
            Phase::Producing if self.cfg.saturate => {
                if self.next_slice_due(Instant::ZERO) {
                    Instant::ZERO
                } else {
                    Instant::MAX
                }
            }
            _ => self.due_at(self.next_slice),
        };
        let mut wake = deadline.min(next_due);
        for h in &self.hosted {
            wake = wake.min(h.shaper.poll_timeout().unwrap_or(Instant::MAX));
            wake = wake.min(h.stall.map_or(Instant::MAX, |s| s.1));
        }
        Some(wake)
    }

    pub fn poll_event(&mut self) -> Option<SourceEvent> {
        self.events.pop_front()
    }

    /// Data taking and drain are over and every end-of-stream marker has been handed out.
    pub fn is_closed(&self) -> bool {
        self.phase == Phase::Closed && self.eos.is_empty()
    }

    /// Whether the node still produces slices.
    pub fn is_producing(&self) -> bool {
        self.phase == Phase::Producing
    }

    /// Whether the next slice is to be produced at `now`: when it has ended on the slice
    /// clock or, saturating, when the node has room ([`Self::has_room_saturating`]: a few
    /// slices ahead of the transport, enough that a shaper always has the next fragments
    /// when its tokens come, few enough to bound memory and drift).
    fn next_slice_due(&self, now: Instant) -> bool {
        if self.cfg.saturate {
            !self.paused
                && self.has_room_saturating()
                && (!self.cfg.data_driven || self.next_slice < self.input_ready_below)
        } else {
            now >= self.due_at(self.next_slice)
        }
    }

    /// Saturating, whether the node holds few enough fragments to produce another slice:
    /// fewer than [`SATURATION_SLICES`] slices' worth, or fewer than [`SATURATION_BYTES`]
    /// per hosted source and half its memory share (the bytes hold must never make the
    /// node drop at its limit what the slices' hold would have sent).
    fn has_room_saturating(&self) -> bool {
        let hosted = self.hosted.len();
        let bytes_hold = (SATURATION_BYTES * hosted as u64).min(self.cfg.held_limit_bytes / 2);
        self.queued() < SATURATION_SLICES * hosted || self.held_bytes < bytes_hold
    }

    /// When the node produces `slice`: its end on the slice clock plus the produce delay.
    fn due_at(&self, slice: SliceNumber) -> Instant {
        self.cfg.slice_clock.end_of(slice) + self.cfg.produce_delay
    }

    /// Fragments produced and not yet reported sent, failed or dropped.
    /// (Deferred pieces belong to frames counted here.)
    pub fn queued(&self) -> usize {
        self.hosted.iter().map(|h| h.frames.len() + h.undecided.len()).sum::<usize>()
            + self.late_frames.len()
            + self.late_in_flight.values().map(Vec::len).sum::<usize>()
    }

    /// Bytes of every fragment the node holds (see [`SourceNodeConfig::held_limit_bytes`]).
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes
    }

    /// Bytes handed to the transport towards `dest` and not yet reported.
    pub fn in_transport(&self, dest: BuilderId) -> u64 {
        self.in_transport.get(dest as usize).copied().unwrap_or(0)
    }

    pub fn totals(&self) -> SourceTotals {
        self.totals
    }

    /// The node's report; fragments still held count as unsent.
    pub fn report(&self) -> SourceNodeReport {
        let mut r = self.report.clone();
        for (i, h) in self.hosted.iter().enumerate() {
            let mut t = h.tally.clone();
            t.unsent += (h.frames.len() + h.undecided.len()) as u64;
            t.unsent += self.late_frames.iter().filter(|(j, _, _)| *j == i).count() as u64;
            t.unsent += self
                .late_in_flight
                .range((h.id, 0)..=(h.id, SliceNumber::MAX))
                .map(|(_, v)| v.len() as u64)
                .sum::<u64>();
            for (b, &n) in h.sent_to.iter().enumerate().filter(|(_, n)| **n > 0) {
                *t.sent.entry(b as BuilderId).or_default() += n;
            }
            r.tallies.insert(h.id, t);
        }
        r
    }

    fn hosted_index(&self, source: SourceId) -> Option<usize> {
        self.index.binary_search_by_key(&source, |&(id, _)| id).ok().map(|k| self.index[k].1)
    }

    fn ends_before(&self, slice: SliceNumber) -> bool {
        self.stopped
            || self.end_slice.is_some_and(|e| slice >= e)
            || self.cfg.slices.is_some_and(|n| slice - self.first_slice >= n)
    }

    fn start_drain(&mut self, now: Instant) {
        self.phase = Phase::Draining { deadline: now + self.cfg.drain_timeout };
        for i in 0..self.hosted.len() {
            if let Some(c) = self.hosted[i].cutoff.as_mut() {
                c.handle_drain();
            }
            self.decide(i, now);
        }
    }

    fn check_closed(&mut self, now: Instant) {
        let Phase::Draining { deadline } = self.phase else { return };
        let queued = self.queued();
        if queued > 0 {
            if now < deadline {
                return;
            }
            self.events.push_back(SourceEvent::DrainTimeout { queued });
        }
        self.phase = Phase::Closed;
        let clock = self.cfg.slice_clock;
        for dest in 0..self.cfg.n_builders {
            for h in &self.hosted {
                let eos = FrameHeader {
                    flags: Flags::END_OF_STREAM,
                    source: h.id,
                    hit_count: 0,
                    slice: self.next_slice,
                    slice_start: clock.start_of(self.next_slice),
                    send_time: now,
                    payload_len: 0,
                };
                let head = Bytes::copy_from_slice(&frame::encode_header(&eos, &[]));
                self.eos.push_back(SourceTransmit {
                    kind: TransmitKind::EndOfStream,
                    source: h.id,
                    dest,
                    slice: self.next_slice,
                    flags: Flags::END_OF_STREAM,
                    offset: 0,
                    frame_len: HEADER_LEN as u64,
                    last: true,
                    head,
                    body: Bytes::new(),
                });
            }
        }
    }

    fn produce<W: Workload + ?Sized>(&mut self, i: usize, slice: SliceNumber, now: Instant, workload: &W) {
        let h = &mut self.hosted[i];
        let frag = if self.paused { GeneratedFragment::empty() } else { workload.generate(h.id, slice) };
        h.tally.produced += 1;
        self.totals.produced += 1;
        self.report.bytes_produced += frag.payload.len() as u64;
        let len = (HEADER_LEN + frag.payload.len()) as u64;
        if self.held_bytes + len > self.cfg.held_limit_bytes {
            // The node's memory share is full (builders slower than production): drop the
            // new fragment, as a board whose buffer is full does. Its slot passes empty.
            h.tally.dropped_at_source += 1;
            self.totals.dropped += 1;
            self.report.dropped_over_memory += 1;
            if let Some(c) = h.cutoff.as_mut() {
                c.handle_fragment(slice, frag.burst);
            }
            h.shaper.handle_slot_end(now, slice);
            self.decide(i, now);
            return;
        }
        match h.cutoff.as_mut() {
            None => self.enqueue(i, slice, frag, false, now),
            Some(c) => {
                c.handle_fragment(slice, frag.burst);
                self.held_bytes += len;
                h.undecided.insert(slice, frag);
                self.decide(i, now);
            }
        }
    }

    fn decide(&mut self, i: usize, now: Instant) {
        while let Some(d) = self.hosted[i].cutoff.as_mut().and_then(|c| c.poll_decision()) {
            let (slice, cut) = match d {
                CutoffDecision::Keep(slice) => (slice, false),
                CutoffDecision::Cut(slice) => (slice, true),
            };
            if let Some(frag) = self.hosted[i].undecided.remove(slice) {
                // Held again as a frame by `enqueue` (smaller if cut off).
                self.held_bytes -= (HEADER_LEN + frag.payload.len()) as u64;
                self.enqueue(i, slice, frag, cut, now);
            }
        }
    }

    fn enqueue(&mut self, i: usize, slice: SliceNumber, frag: GeneratedFragment, cut: bool, now: Instant) {
        let h = &self.hosted[i];
        let mut flags = Flags::EMPTY;
        if frag.burst {
            flags = flags | Flags::BURST;
        }
        if frag.opaque {
            flags = flags | Flags::OPAQUE;
        }
        let (hit_count, payload) = if cut {
            flags = flags | Flags::CUT_OFF;
            self.totals.cut_off += 1;
            (0, Bytes::new())
        } else {
            (frag.hit_count, frag.payload)
        };
        let header = FrameHeader {
            flags,
            source: h.id,
            hit_count,
            slice,
            slice_start: self.cfg.slice_clock.start_of(slice),
            send_time: Instant::ZERO,
            payload_len: 0,
        };
        let crc = match &self.crc_cache {
            Some((p, crc)) if p.as_ptr() == payload.as_ptr() && p.len() == payload.len() => *crc,
            _ => {
                let crc = crate::checksum::crc32c(&payload);
                self.crc_cache = Some((payload.clone(), crc));
                crc
            }
        };
        let payload_len = u32::try_from(payload.len()).expect("payload longer than u32::MAX");
        let header = Bytes::copy_from_slice(&frame::encode_header_with_crc(&header, payload_len, crc));
        let f =
            PendingFrame { header, flags, payload, dest: None, dropped: false, handed: 0, handed_at: Instant::ZERO };
        let len = f.len();
        self.held_bytes += len;
        let h = &mut self.hosted[i];
        h.frames.insert(slice, f);
        h.shaper.handle_fragment(now, Outgoing { slice, len });
    }

    /// Turns a shaper's decision into a transmit, or drops the fragment at the source.
    fn dispatch(&mut self, i: usize, tx: Transmit, now: Instant) -> Option<SourceTransmit> {
        let h = &mut self.hosted[i];
        let Some(f) = h.frames.get_mut(tx.slice) else {
            self.events.push_back(SourceEvent::UnknownFragment { source: h.id, slice: tx.slice });
            return None;
        };
        let dest = tx.dest as usize;
        if tx.offset == 0 {
            f.dest = Some(tx.dest);
            f.dropped = self.in_transport[dest] + f.len() > self.cfg.queue_limit_bytes;
        }
        self.open_frame[dest] = (!tx.last && !f.dropped).then_some((h.id, tx.slice));
        if f.dropped {
            if tx.last {
                if let Some(f) = h.frames.remove(tx.slice) {
                    self.held_bytes -= f.len();
                }
                h.tally.dropped_at_source += 1;
                self.totals.dropped += 1;
                h.shaper.handle_sent(now, tx.slice);
            }
            return None;
        }
        // The transmit's byte range over header ++ payload, without copying the payload.
        let (start, end) = (tx.offset as usize, (tx.offset + tx.len) as usize);
        let head = if start < HEADER_LEN { f.header.slice(start..end.min(HEADER_LEN)) } else { Bytes::new() };
        let body = if end > HEADER_LEN {
            f.payload.slice(start.max(HEADER_LEN) - HEADER_LEN..end - HEADER_LEN)
        } else {
            Bytes::new()
        };
        self.in_transport[dest] += tx.len;
        f.handed += tx.len;
        let out = SourceTransmit {
            kind: TransmitKind::Data,
            source: h.id,
            dest: tx.dest,
            slice: tx.slice,
            flags: f.flags,
            offset: tx.offset,
            frame_len: f.len(),
            last: tx.last,
            head,
            body,
        };
        if tx.last {
            h.stall = Some((tx.slice, now + self.stall_limit));
            f.handed_at = now;
        }
        if self.cfg.record_transmits {
            let rec = TransmitRecord { at: now, source: h.id, dest: tx.dest, slice: tx.slice, bytes: tx.len };
            self.report.transmits.push(rec);
        }
        Some(out)
    }

    fn handle_report(&mut self, now: Instant, source: SourceId, slice: SliceNumber, sent: bool) {
        let Some(i) = self.hosted_index(source) else { return };
        let h = &mut self.hosted[i];
        if !h.frames.contains(slice) && self.late_in_flight.contains_key(&(source, slice)) {
            self.handle_late_report(now, i, slice, sent);
            return;
        }
        let h = &mut self.hosted[i];
        // End-of-stream markers are not held: nothing to account.
        let Some(f) = h.frames.remove(slice) else { return };
        let Some(dest) = f.dest else {
            // Reported before it was handed out: cannot happen with a correct driver; keep
            // the fragment so it counts as unsent rather than being double-counted.
            h.frames.insert(slice, f);
            return;
        };
        self.in_transport[dest as usize] -= f.handed;
        self.held_bytes -= f.len();
        if sent {
            h.sent_to[dest as usize] += 1;
            let completion_us = now.as_nanos().saturating_sub(f.handed_at.as_nanos()) / 1_000;
            self.report.send_completion_us.record(completion_us);
            self.totals.send_completions += 1;
            self.totals.send_completion_us += completion_us;
        } else {
            h.tally.send_failed += 1;
            self.totals.dropped += 1;
        }
        if h.stall.is_some_and(|(s, _)| s == slice) {
            h.stall = None;
        }
        h.shaper.handle_sent(now, slice);
        self.check_closed(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed(usize);
    impl Workload for Fixed {
        fn generate(&self, _source: SourceId, _slice: SliceNumber) -> GeneratedFragment {
            GeneratedFragment {
                hit_count: (self.0 / 6) as u32,
                waveform_count: 0,
                payload: Bytes::from(vec![0u8; self.0]),
                burst: false,
                opaque: false,
            }
        }
    }

    const MS: u64 = 1_000_000;

    fn cfg(sources: Vec<SourceId>, n_builders: u32, policy: &str) -> SourceNodeConfig {
        let mut c = SourceNodeConfig::new(
            sources,
            n_builders,
            policy.parse().unwrap(),
            SliceClock::new(Duration::from_millis(10)),
        );
        c.first_slice = Some(0);
        c
    }

    fn drain(node: &mut SourceNode, now: Instant) -> Vec<SourceTransmit> {
        std::iter::from_fn(|| node.poll_transmit(now)).collect()
    }

    fn opaque(payload: &'static [u8]) -> GeneratedFragment {
        GeneratedFragment { payload: Bytes::from_static(payload), opaque: true, ..GeneratedFragment::empty() }
    }

    #[test]
    fn late_fragments_go_out_whole_after_their_on_time_frame_and_are_accounted() {
        let mut c = cfg(vec![0], 2, "direct");
        c.slices = Some(2);
        let mut node = SourceNode::new(c, Instant::ZERO);
        let t = Instant::from_nanos(10 * MS);
        node.handle_timeout(t, &Fixed(60));
        assert_eq!(drain(&mut node, t).len(), 1);
        node.handle_late_fragment(t, 0, 0, opaque(b"late data"));
        assert!(drain(&mut node, t).is_empty(), "the on-time frame of (0, 0) is not reported yet");
        node.handle_sent(t, 0, 0);
        let tx = drain(&mut node, t);
        assert_eq!(tx.len(), 1);
        assert!(tx[0].flags.contains(Flags::LATE) && tx[0].flags.contains(Flags::OPAQUE));
        assert_eq!((tx[0].dest, tx[0].slice, tx[0].last, &tx[0].body[..]), (0, 0, true, &b"late data"[..]));
        let h = frame::decode(&[&tx[0].head[..], &tx[0].body[..]].concat(), 1 << 20).expect("a valid frame");
        assert_eq!(h.0.payload.len(), 9);
        assert_eq!(node.queued(), 1);
        node.handle_sent(t, 0, 0);
        assert_eq!(node.queued(), 0);
        let r = node.report();
        assert_eq!((r.tallies[&0].produced, r.tallies[&0].sent[&0], r.late_fragments), (2, 2, 1));
        assert_eq!(node.in_transport(0), 0);
    }

    #[test]
    fn a_late_fragment_under_pull_is_dropped_at_the_source_and_counted() {
        let mut node = SourceNode::new(cfg(vec![0], 2, "pull:2"), Instant::ZERO);
        node.handle_late_fragment(Instant::ZERO, 0, 0, opaque(b"x"));
        let r = node.report();
        assert_eq!((r.tallies[&0].produced, r.tallies[&0].dropped_at_source, r.late_unroutable), (1, 1, 1));
    }

    #[test]
    fn the_produce_delay_shifts_every_slice_end() {
        let mut c = cfg(vec![0], 1, "direct");
        c.produce_delay = Duration::from_millis(3);
        let mut node = SourceNode::new(c, Instant::ZERO);
        assert_eq!(node.poll_timeout(), Some(Instant::from_nanos(13 * MS)));
        node.handle_timeout(Instant::from_nanos(12 * MS), &Fixed(6));
        assert_eq!(node.next_slice(), 0);
        node.handle_timeout(Instant::from_nanos(13 * MS), &Fixed(6));
        assert_eq!(node.next_slice(), 1);
    }

    #[test]
    fn data_driven_saturation_produces_only_what_the_input_has() {
        let mut c = cfg(vec![0], 1, "direct");
        (c.saturate, c.data_driven) = (true, true);
        let mut node = SourceNode::new(c, Instant::ZERO);
        node.handle_timeout(Instant::ZERO, &Fixed(6));
        assert_eq!(node.next_slice(), 0);
        assert_eq!(node.poll_timeout(), Some(Instant::MAX), "waits for input, not a time");
        assert_eq!(node.waiting_for_input(), Some(1), "slice 0 goes once the input is past it");
        node.handle_input_ready(2);
        assert_eq!(node.waiting_for_input(), None);
        assert_eq!(node.poll_timeout(), Some(Instant::ZERO));
        node.handle_timeout(Instant::ZERO, &Fixed(6));
        assert_eq!(node.next_slice(), 2);
        assert_eq!(node.waiting_for_input(), Some(3), "two slices held, room for two more, no data");
    }

    #[test]
    fn first_slice_defaults_to_a_whole_second() {
        let mut c = cfg(vec![0], 1, "direct");
        c.first_slice = None;
        let node = SourceNode::new(c, Instant::from_nanos(1_234 * MS));
        assert_eq!(node.first_slice(), 200);
    }

    #[test]
    fn produces_sends_drains_and_ends_the_stream() {
        let mut c = cfg(vec![0, 1], 2, "direct");
        c.slices = Some(2);
        let mut node = SourceNode::new(c, Instant::ZERO);
        assert_eq!(node.poll_timeout(), Some(Instant::from_nanos(10 * MS)));
        let t = Instant::from_nanos(25 * MS); // two slice ends at once: one reached late
        node.handle_timeout(t, &Fixed(60));
        let tx = drain(&mut node, t);
        assert_eq!(tx.len(), 4);
        assert!(tx.iter().all(|x| x.kind == TransmitKind::Data && x.last && x.len() == 116));
        assert!(!node.is_closed());
        for x in &tx {
            node.handle_sent(t, x.source, x.slice);
        }
        let eos = drain(&mut node, t);
        assert_eq!(eos.len(), 4, "one marker per hosted source and builder");
        assert!(eos.iter().all(|x| x.kind == TransmitKind::EndOfStream && x.slice == 2));
        assert!(node.is_closed());
        let r = node.report();
        assert_eq!((r.slices, r.late_slice_ends), (2, 1));
        // Slices 0 and 1 ended at 10 and 20 ms, both produced at 25 ms.
        assert_eq!((r.slice_end_lag_count, r.slice_end_lag_sum_ns), (2, 20 * MS));
        // 15 and 5 ms, their distribution kept too: one in each bucket.
        assert_eq!(r.slice_end_lag_us.count(), 2);
        assert!((r.slice_end_lag_us.inverse_cdf(0.25).unwrap() - 5_000.0).abs() < 5_000.0 / 8.0);
        assert!((r.slice_end_lag_us.inverse_cdf(0.75).unwrap() - 15_000.0).abs() < 15_000.0 / 8.0);
        // Slice 0 ended at 10 ms and was taken at 25 ms: 15 ms late, 10 ms into the run.
        assert_eq!((r.worst_late_ns, r.worst_late_into_run_ns), (15 * MS, 10 * MS));
        assert!(r.tallies.values().all(|t| t.produced == 2 && t.unaccounted() == 0 && t.unsent == 0));
    }

    #[test]
    fn saturation_keeps_a_few_slices_ahead_of_the_transport_whatever_the_clock() {
        // Fragments this large pass the byte hold in fewer slices: the slices count.
        let big = Fixed(SATURATION_BYTES as usize);
        let mut c = cfg(vec![0, 1], 2, "direct");
        c.slices = Some(SATURATION_SLICES as u64 + 2);
        c.saturate = true;
        let mut node = SourceNode::new(c, Instant::ZERO);
        // Due at once, long before the first slice ends on the clock.
        assert_eq!(node.poll_timeout(), Some(Instant::ZERO));
        let t = Instant::from_nanos(MS / 10);
        node.handle_timeout(t, &big);
        let tx = drain(&mut node, t);
        assert_eq!(tx.len(), 2 * SATURATION_SLICES, "the window: two hosted sources");
        // Nothing more while the transport holds them, however late it is.
        node.handle_timeout(Instant::from_nanos(1000 * MS), &big);
        assert!(drain(&mut node, t).is_empty());
        assert_ne!(node.poll_timeout(), Some(Instant::ZERO));
        // One fragment taken: the next slice is due and produced (the window is in
        // fragments; a slice may overfill it by the rest of itself) ...
        node.handle_sent(t, 0, 0);
        assert_eq!(node.poll_timeout(), Some(Instant::ZERO));
        node.handle_timeout(t, &big);
        let next = drain(&mut node, t);
        assert_eq!(next.len(), 2);
        assert!(next.iter().all(|x| x.slice == SATURATION_SLICES as u64));
        // ... and then nothing until more is taken.
        node.handle_timeout(t, &big);
        assert!(drain(&mut node, t).is_empty());
        node.handle_sent(t, 1, 0);
        for x in tx.iter().chain(&next).filter(|x| x.slice > 0) {
            node.handle_sent(t, x.source, x.slice);
        }
        node.handle_timeout(t, &big);
        for x in drain(&mut node, t) {
            node.handle_sent(t, x.source, x.slice);
        }
        node.handle_timeout(t, &big);
        let r = node.report();
        assert_eq!((r.slices, r.late_slice_ends, r.slices_skipped), (SATURATION_SLICES as u64 + 2, 0, 0));
        assert!(!node.is_producing(), "every slice made, then the drain");
    }

    #[test]
    fn saturation_holds_a_quarter_megabyte_of_small_fragments() {
        // 9,000-byte fragments: four slices would be a quarter of a 1-Gbit/s token
        // bucket's depth; the node holds slices until it holds SATURATION_BYTES.
        let mut c = cfg(vec![0], 1, "tbf:1000Mbit");
        c.saturate = true;
        let mut node = SourceNode::new(c, Instant::ZERO);
        let t = Instant::from_nanos(MS / 10);
        let mut produced = 0;
        while node.poll_timeout() == Some(Instant::ZERO) && produced < 1000 {
            node.handle_timeout(t, &Fixed(9000));
            produced += 1;
        }
        let frame = node.held_bytes() / node.queued() as u64;
        assert_eq!(node.queued() as u64, SATURATION_BYTES.div_ceil(frame), "slices held until the byte hold is passed");
        // The bucket (125,000 bytes deep, full) releases what it holds in one batch: 13.
        assert_eq!(drain(&mut node, t).len(), 13);
        // One fragment taken is room for one more slice, not more.
        node.handle_sent(t, 0, 0);
        assert_eq!(node.poll_timeout(), Some(Instant::ZERO));
        node.handle_timeout(t, &Fixed(9000));
        assert_ne!(node.poll_timeout(), Some(Instant::ZERO));

        // Under a memory share, the bytes hold takes at most half of it: nothing dropped.
        let mut c = cfg(vec![0], 1, "tbf:1000Mbit");
        c.saturate = true;
        c.held_limit_bytes = 100_000;
        let mut node = SourceNode::new(c, Instant::ZERO);
        let mut produced = 0;
        while node.poll_timeout() == Some(Instant::ZERO) && produced < 1000 {
            node.handle_timeout(t, &Fixed(9000));
            produced += 1;
        }
        assert!((5..=6).contains(&node.queued()), "{} held", node.queued());
        assert_eq!(node.report().tallies[&0].dropped_at_source, 0);
    }

    #[test]
    fn queue_limit_drops_at_source() {
        let mut c = cfg(vec![0], 1, "direct");
        c.queue_limit_bytes = 250; // two 116-byte frames fit, the third does not
        let mut node = SourceNode::new(c, Instant::ZERO);
        for slice in 0..3u64 {
            let t = Instant::from_nanos((slice + 1) * 10 * MS);
            node.handle_timeout(t, &Fixed(60));
            drain(&mut node, t);
        }
        assert_eq!(node.in_transport(0), 232);
        let r = node.report();
        assert_eq!(r.tallies[&0].dropped_at_source, 1);
        assert_eq!(r.tallies[&0].unsent, 2);
    }

    #[test]
    fn held_limit_bounds_everything_the_node_holds() {
        // delayed:1 holds fragments in the shaper until the previous one is written: the
        // transport's queue limit never sees them, the node's held limit does.
        let mut c = cfg(vec![0, 1], 2, "delayed:1");
        c.held_limit_bytes = 3 * 116; // three 116-byte frames
        c.stall_limit_slices = 1000; // the builders never take a byte: nothing is released
        let mut node = SourceNode::new(c, Instant::ZERO);
        let mut handed = Vec::new();
        for slice in 0..4u64 {
            let t = Instant::from_nanos((slice + 1) * 10 * MS);
            node.handle_timeout(t, &Fixed(60));
            handed.extend(drain(&mut node, t));
            assert!(node.held_bytes() <= 3 * 116);
        }
        let r = node.report();
        assert_eq!(r.dropped_over_memory, 5, "8 produced, 3 held");
        let dropped: u64 = r.tallies.values().map(|t| t.dropped_at_source).sum();
        let unsent: u64 = r.tallies.values().map(|t| t.unsent).sum();
        assert_eq!((dropped, unsent), (5, 3));
        // Written frames free their room (and release the held ones): the next slice
        // fits again.
        let t = Instant::from_nanos(45 * MS);
        for _ in 0..10 {
            for x in std::mem::take(&mut handed) {
                node.handle_sent(t, x.source, x.slice);
            }
            handed.extend(drain(&mut node, t));
        }
        assert_eq!(node.held_bytes(), 0);
        let t = Instant::from_nanos(50 * MS);
        node.handle_timeout(t, &Fixed(60));
        assert_eq!(node.report().dropped_over_memory, 5);
        assert_eq!(node.held_bytes(), 2 * 116);
    }

    #[test]
    fn max_lag_skips_slices_reached_too_late() {
        let mut c = cfg(vec![0, 1], 1, "direct");
        c.max_lag = Some(Duration::from_millis(25));
        let mut node = SourceNode::new(c, Instant::ZERO);
        // The driver wakes at 100 ms: slices 0..=6 ended more than 25 ms ago (skipped),
        // slices 7 and 8 ended within it (produced, late), slice 9 ends at 100 ms.
        let t = Instant::from_nanos(100 * MS);
        node.handle_timeout(t, &Fixed(60));
        let tx = drain(&mut node, t);
        let r = node.report();
        assert_eq!((r.slices_skipped, r.slices, r.late_slice_ends), (7, 3, 2));
        assert_eq!(tx.iter().map(|x| x.slice).collect::<std::collections::BTreeSet<_>>(), [7, 8, 9].into());
        assert_eq!(r.tallies.values().map(|t| t.produced).sum::<u64>(), 6, "skipped slices are not produced");
    }

    #[test]
    fn stall_limit_releases_the_barrel_shifter() {
        // delayed:1, one source: each fragment waits for the previous one to be written.
        let mut node = SourceNode::new(cfg(vec![0], 2, "delayed:1"), Instant::ZERO);
        let t1 = Instant::from_nanos(10 * MS);
        node.handle_timeout(t1, &Fixed(60));
        assert_eq!(drain(&mut node, t1).len(), 1);
        // Builder 0 never takes the bytes. Slice 1's fragment must wait ...
        let t2 = Instant::from_nanos(20 * MS);
        node.handle_timeout(t2, &Fixed(60));
        assert!(drain(&mut node, t2).is_empty());
        // ... until the stall limit (2 slices after slice 0 was handed out) releases it.
        assert_eq!(node.poll_timeout(), Some(Instant::from_nanos(30 * MS)));
        let t3 = Instant::from_nanos(30 * MS);
        node.handle_timeout(t3, &Fixed(60));
        let tx = drain(&mut node, t3);
        assert_eq!(tx.iter().map(|x| x.slice).collect::<Vec<_>>(), [1]);
    }

    /// How far behind its slot a `delayed:1:W` source is after 1 s in which the transport
    /// reports each frame written 15 ms (1.5 slots) after it was handed out: the most slots
    /// between a fragment's slot and its hand-out, and the fragments still queued.
    fn lag_with_slow_reports(policy: &str) -> (u64, usize) {
        let mut c = cfg(vec![0], 4, policy);
        c.stall_limit_slices = 1000; // the reports alone release the schedule
        let mut node = SourceNode::new(c, Instant::ZERO);
        let mut reports: VecDeque<(Instant, SliceNumber)> = VecDeque::new();
        let mut worst = 0;
        for ms in 1..=1000u64 {
            let now = Instant::from_nanos(ms * MS);
            while reports.front().is_some_and(|&(at, _)| at <= now) {
                let (_, slice) = reports.pop_front().unwrap();
                node.handle_sent(now, 0, slice);
            }
            node.handle_timeout(now, &Fixed(60));
            for t in drain(&mut node, now) {
                // Slice s ends at (s + 1) slots; delayed:1 gives source 0 no delay.
                worst = worst.max((ms / 10).saturating_sub(t.slice + 1));
                reports.push_back((now + Duration::from_millis(15), t.slice));
            }
        }
        let t = node.totals();
        assert_eq!(t.send_completion_us, t.send_completions * 15_000, "every report 15 ms after its hand-out");
        (worst, node.queued())
    }

    #[test]
    fn a_window_lets_a_source_keep_up_when_each_write_outlasts_its_slot() {
        // One fragment at a time, 15 ms each, against one slice every 10 ms: the source
        // falls a third of a slot further behind with every slice.
        let (worst, queued) = lag_with_slow_reports("delayed:1");
        assert!(worst >= 30 && queued >= 30, "one in flight: {worst} slots behind, {queued} queued");
        // Two in flight: twice the rate the transport's latency allows, so it keeps pace.
        let (worst, queued) = lag_with_slow_reports("delayed:1:2");
        assert!(worst <= 2 && queued <= 2, "window 2: {worst} slots behind, {queued} queued");
    }

    #[test]
    fn hosted_sources_never_interleave_frames_on_a_connection() {
        // Two sources share the connection to builder 0; the token bucket cuts each
        // 1,056-byte frame into 100-byte pieces that become ready at the same instants.
        let mut node = SourceNode::new(cfg(vec![0, 1], 1, "tbf:100k:100"), Instant::ZERO);
        let mut now = Instant::from_nanos(10 * MS);
        node.handle_timeout(now, &Fixed(1000));
        let mut order = Vec::new();
        for _ in 0..1000 {
            for t in drain(&mut node, now) {
                order.push((t.source, t.offset, t.last));
                if t.last {
                    node.handle_sent(now, t.source, t.slice);
                }
            }
            match node.poll_timeout() {
                Some(t) if t < Instant::from_nanos(20 * MS) => now = t,
                _ => break,
            }
            node.handle_timeout(now, &Fixed(1000));
        }
        assert_eq!(order.len(), 2 * 11, "both frames, 11 pieces each");
        let first = order[0].0;
        assert!(order[..11].iter().all(|p| p.0 == first) && order[10].2, "one frame, then the other: {order:?}");
        let offsets: Vec<u64> = order[11..].iter().map(|p| p.1).collect();
        assert_eq!(offsets, (0..11).map(|k| k * 100).collect::<Vec<_>>());
    }

    /// Shared payloads (fixed workloads, replay pools) reuse the cached CRC; any other
    /// payload is checksummed. Every frame must decode with its CRC checked.
    #[test]
    fn payload_crc_is_right_for_shared_and_fresh_buffers() {
        struct Mixed(Bytes);
        impl Workload for Mixed {
            fn generate(&self, source: SourceId, slice: SliceNumber) -> GeneratedFragment {
                let payload = if slice.is_multiple_of(3) {
                    Bytes::from(vec![(slice as u8).wrapping_add(source as u8); 96])
                } else {
                    self.0.clone()
                };
                GeneratedFragment { hit_count: 16, waveform_count: 0, payload, burst: false, opaque: false }
            }
        }
        let w = Mixed(Bytes::from(vec![7u8; 96]));
        let mut node = SourceNode::new(cfg(vec![0, 1], 2, "direct"), Instant::ZERO);
        let mut frames = 0;
        for slice in 0..12u64 {
            let t = Instant::from_nanos((slice + 1) * 10 * MS);
            node.handle_timeout(t, &w);
            for x in drain(&mut node, t) {
                let mut wire = x.head.to_vec();
                wire.extend_from_slice(&x.body);
                let (f, _) = frame::decode(&wire, 1 << 20).expect("frame with the right CRC");
                assert_eq!(f.payload.len(), 96);
                frames += 1;
            }
        }
        assert_eq!(frames, 24);
    }

    #[test]
    fn pause_sends_empty_fragments_on_schedule() {
        let mut node = SourceNode::new(cfg(vec![3], 1, "direct"), Instant::ZERO);
        node.handle_pause(true);
        let t = Instant::from_nanos(10 * MS);
        node.handle_timeout(t, &Fixed(600));
        let tx = drain(&mut node, t);
        assert_eq!(tx.len(), 1);
        assert_eq!(tx[0].len(), HEADER_LEN as u64);
        let h = frame::decode_header(&tx[0].head, 1 << 20).unwrap();
        assert_eq!((h.hit_count, h.payload_len, h.slice), (0, 0, 0));
    }

    #[test]
    fn drain_timeout_counts_unsent_and_closes() {
        let mut c = cfg(vec![0], 1, "direct");
        c.slices = Some(1);
        c.drain_timeout = Duration::from_millis(50);
        let mut node = SourceNode::new(c, Instant::ZERO);
        let t = Instant::from_nanos(10 * MS);
        node.handle_timeout(t, &Fixed(60));
        drain(&mut node, t);
        let deadline = Instant::from_nanos(60 * MS);
        let mut now = t;
        while !node.is_closed() {
            now = node.poll_timeout().unwrap();
            assert!(now <= deadline);
            node.handle_timeout(now, &Fixed(60));
            drain(&mut node, now);
        }
        assert_eq!(now, deadline);
        assert_eq!(node.poll_event(), Some(SourceEvent::DrainTimeout { queued: 1 }));
        // A report that comes after the close is still accounted.
        node.handle_sent(now, 0, 0);
        let r = node.report();
        assert_eq!((r.tallies[&0].sent[&0], r.tallies[&0].unsent), (1, 0));
    }
}
