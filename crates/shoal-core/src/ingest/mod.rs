//! Ingest: fragments submitted by user code (the source SDK in Rust, C and Python, and the
//! input sockets) on their way into a [`crate::node::SourceNode`].
//!
//! A [`Submission`] carries a source id, its data time in ns on the board's clock (or an
//! explicit slice number) and payload bytes, opaque or in shoal's hit format. [`Ingest`]
//! decides, with no I/O and no clock of its own:
//! - **slice assignment** from the data's own time ([`When`]): the board's clock is the
//!   truth, the host's clock only paces sending (the node produces a slice when the host
//!   clock passes its end plus [`crate::node::SourceNodeConfig::produce_delay`]);
//! - **what is refused** and why ([`IngestError`], counted per kind): a source this process
//!   does not host, a time before the run or after its end, too far ahead of the slice being
//!   produced (a board clock gone wrong would otherwise fill memory), a fragment over the
//!   size limit, hits that do not parse, a closed input;
//! - **back-pressure**: [`IngestError::Full`] when the bytes held would pass the bound; the
//!   caller blocks and retries, or gives up and counts ([`Ingest::handle_dropped_full`]);
//! - **late data**: a submission for a slice the node has already produced is kept as a
//!   late fragment ([`Ingest::poll_late`]), which the node sends flagged `LATE` and the
//!   builder's late/salvage path takes (counted in the ledger);
//! - **end of run**: [`Ingest::handle_close`]; the driver then ends the node's data taking
//!   after the last slice with data.
//!
//! Everything submitted for one (source, slice) travels as one fragment: the pieces are
//! concatenated in submission order (hit records first, then waveform records, for hit
//! payloads), as the KM3NeT DataQueue assembles a frame from a board's packets. The
//! builder's output then holds exactly the bytes submitted.
//!
//! [`wire`] is the length-prefixed framing of the input sockets.

pub mod wire;

use std::collections::{BTreeMap, VecDeque};

use bytes::{Bytes, BytesMut};

use crate::hit::{HIT_LEN, HitPayload, PayloadError};
use crate::node::GeneratedFragment;
use crate::slice::{SliceClock, SliceNumber};
use crate::{Instant, SourceId};

/// Which slice a submission belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum When {
    /// Data time in ns on the board's clock, relative to [`IngestConfig::time_origin_ns`].
    TimeNs(u64),
    /// An explicit slice number (a readout that counts slices itself).
    Slice(SliceNumber),
}

/// One piece of a board's data, as user code hands it in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Submission {
    pub source: SourceId,
    pub when: When,
    /// `Some(n)`: the payload is `n` shoal hit records then whole waveform records (the
    /// builder's filters read them); `None`: opaque bytes (stored, not filtered).
    pub hit_count: Option<u32>,
    pub payload: Bytes,
}

/// Where an accepted submission went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placed {
    /// Into the fragment of this slice, not yet produced.
    OnTime(SliceNumber),
    /// The slice was produced already: sent as a late fragment.
    Late(SliceNumber),
}

/// Why a submission is refused. Nothing of it is kept; the process goes on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IngestError {
    #[error("source {0} is not hosted by this process")]
    UnknownSource(SourceId),
    #[error("slice {slice} is before the run's first slice {first}")]
    BeforeRun { slice: SliceNumber, first: SliceNumber },
    #[error("slice {slice} is at or after the run's end slice {end}")]
    AfterRun { slice: SliceNumber, end: SliceNumber },
    #[error(
        "slice {slice} is more than {ahead} slices ahead of slice {current} being produced (is the board's clock right?)"
    )]
    TooFarAhead { slice: SliceNumber, current: SliceNumber, ahead: u64 },
    #[error("data time {0} ns is outside the slice clock's range")]
    TimeOutOfRange(u64),
    #[error("fragment of source {id} for slice {slice} would hold {bytes} bytes, over the limit of {max}")]
    TooLarge { id: SourceId, slice: SliceNumber, bytes: u64, max: u64 },
    #[error("hit payload: {0}")]
    BadHits(PayloadError),
    #[error("slice {slice} of source {id} mixes opaque and hit payloads")]
    FormatMismatch { id: SourceId, slice: SliceNumber },
    #[error("the input holds {held} bytes, the bound is {max}: back-pressure")]
    Full { held: u64, max: u64 },
    #[error("the input is closed (end of run)")]
    Closed,
}

impl IngestError {
    /// A stable short name (counter label, C error code's text).
    pub fn kind(&self) -> &'static str {
        match self {
            IngestError::UnknownSource(_) => "unknown_source",
            IngestError::BeforeRun { .. } => "before_run",
            IngestError::AfterRun { .. } => "after_run",
            IngestError::TooFarAhead { .. } => "too_far_ahead",
            IngestError::TimeOutOfRange(_) => "time_out_of_range",
            IngestError::TooLarge { .. } => "too_large",
            IngestError::BadHits(_) => "bad_hits",
            IngestError::FormatMismatch { .. } => "format_mismatch",
            IngestError::Full { .. } => "full",
            IngestError::Closed => "closed",
        }
    }
}

/// What an ingest is told at start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IngestConfig {
    /// The sources this process hosts.
    pub sources: Vec<SourceId>,
    pub slice_clock: SliceClock,
    /// The run's first slice (the node's).
    pub first_slice: SliceNumber,
    /// The first slice not in the run, when the run has a fixed length.
    pub end_slice: Option<SliceNumber>,
    /// Added to every data time: 0 when boards count UNIX ns (White Rabbit, GPS), the
    /// start of the run's first slice when they count from the run's start.
    pub time_origin_ns: u64,
    /// Most payload bytes of one source's fragment of one slice.
    pub max_fragment_bytes: u64,
    /// Most payload bytes held, on time and late, before [`IngestError::Full`].
    pub max_held_bytes: u64,
    /// Most slices a submission may be ahead of the slice being produced.
    pub max_ahead_slices: u64,
}

/// What an ingest counted (part of a source process's end-of-run report).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct IngestReport {
    /// Submissions accepted, and their payload bytes.
    pub accepted: u64,
    pub accepted_bytes: u64,
    /// Of those, placed in a slice already produced (sent as late fragments).
    pub late: u64,
    /// Accepted submissions that have gone into fragments handed to the node.
    pub in_fragments: u64,
    /// Accepted and still held (zero after a clean end of run).
    pub held: u64,
    /// Refused submissions per [`IngestError::kind`], and per input-side problem
    /// (`bad_magic`, `partial_at_disconnect`, ...) counted by the inputs.
    pub rejected: BTreeMap<String, u64>,
    /// Datagram inputs: fragments never received (gaps in a source's sequence numbers),
    /// and datagrams that came behind the sequence (reordered: accepted, and taken back
    /// from `lost_at_input`, where their gap had counted them).
    pub lost_at_input: u64,
    pub reordered_at_input: u64,
    /// Accepted for a slice the run never produced (it ended first: a run-control STOP
    /// before the data's time); discarded at the end, counted.
    pub discarded_at_end: u64,
}

impl IngestReport {
    /// Submissions refused, all kinds.
    pub fn rejected_total(&self) -> u64 {
        self.rejected.values().sum()
    }

    /// Every accepted submission is in a fragment or still held.
    pub fn balanced(&self) -> bool {
        self.accepted == self.in_fragments + self.held + self.discarded_at_end
    }
}

/// One (source, slice)'s pieces, not yet a fragment.
#[derive(Debug, Default)]
struct Pending {
    /// `None`: opaque pieces; `Some(n)`: hit pieces with `n` hits in all.
    hit_count: Option<u32>,
    /// Opaque pieces, or the hit records of hit pieces.
    parts: Vec<Bytes>,
    /// Waveform records of hit pieces (after every hit record in the fragment).
    waveforms: Vec<Bytes>,
    bytes: u64,
    submissions: u64,
}

impl Pending {
    fn into_fragment(self) -> GeneratedFragment {
        let waveform_count = self.waveforms.iter().map(|w| w.len()).sum::<usize>() / crate::hit::WAVEFORM_LEN;
        let mut pieces = self.parts;
        pieces.extend(self.waveforms);
        pieces.retain(|p| !p.is_empty());
        let payload = match pieces.len() {
            0 => Bytes::new(),
            // The usual case: one submission per slice travels without a copy.
            1 => pieces.pop().expect("one piece"),
            _ => {
                let mut b = BytesMut::with_capacity(self.bytes as usize);
                for p in &pieces {
                    b.extend_from_slice(p);
                }
                b.freeze()
            }
        };
        GeneratedFragment {
            hit_count: self.hit_count.unwrap_or(0),
            waveform_count: waveform_count as u32,
            payload,
            burst: false,
            opaque: self.hit_count.is_none() && self.bytes > 0,
        }
    }
}

#[derive(Debug)]
struct Hosted {
    /// The next slice the node takes from this source: below it, a submission is late.
    produce_from: SliceNumber,
    /// The latest slice this source submitted for.
    latest: Option<SliceNumber>,
    pending: BTreeMap<SliceNumber, Pending>,
}

/// The ingest state machine. See the [module documentation](self).
#[derive(Debug)]
pub struct Ingest {
    cfg: IngestConfig,
    /// Sorted by source id.
    hosted: Vec<(SourceId, Hosted)>,
    late: BTreeMap<(SourceId, SliceNumber), Pending>,
    late_order: VecDeque<(SourceId, SliceNumber)>,
    held_bytes: u64,
    closed: bool,
    /// Data-driven production may go up to here whatever the sources submit next (a
    /// flush: the caller says its data so far are complete).
    flushed_below: SliceNumber,
    report: IngestReport,
}

impl Ingest {
    pub fn new(cfg: IngestConfig) -> Self {
        let mut ids = cfg.sources.clone();
        ids.sort_unstable();
        ids.dedup();
        let first = cfg.first_slice;
        let hosted = ids
            .into_iter()
            .map(|id| (id, Hosted { produce_from: first, latest: None, pending: BTreeMap::new() }))
            .collect();
        Self {
            cfg,
            hosted,
            late: BTreeMap::new(),
            late_order: VecDeque::new(),
            held_bytes: 0,
            closed: false,
            flushed_below: 0,
            report: IngestReport::default(),
        }
    }

    pub fn config(&self) -> &IngestConfig {
        &self.cfg
    }

    /// The slice a submission belongs to, or why it has none.
    pub fn slice_of(&self, when: When) -> Result<SliceNumber, IngestError> {
        match when {
            When::Slice(s) => Ok(s),
            When::TimeNs(t) => {
                let abs = t.checked_add(self.cfg.time_origin_ns).ok_or(IngestError::TimeOutOfRange(t))?;
                Ok(self.cfg.slice_clock.slice_at(Instant::from_nanos(abs)))
            }
        }
    }

    /// Takes a submission in, or says why not (counted).
    pub fn handle_submit(&mut self, sub: Submission) -> Result<Placed, IngestError> {
        let r = self.admit(sub);
        if let Err(e) = &r
            && !matches!(e, IngestError::Full { .. })
        {
            // `Full` is counted only when the caller gives up (it may wait and retry).
            self.count_rejected(e.kind());
        }
        r
    }

    fn admit(&mut self, sub: Submission) -> Result<Placed, IngestError> {
        if self.closed {
            return Err(IngestError::Closed);
        }
        let slice = self.slice_of(sub.when)?;
        let first = self.cfg.first_slice;
        if slice < first {
            return Err(IngestError::BeforeRun { slice, first });
        }
        if let Some(end) = self.cfg.end_slice
            && slice >= end
        {
            return Err(IngestError::AfterRun { slice, end });
        }
        let max_ahead = self.cfg.max_ahead_slices;
        let Ok(k) = self.hosted.binary_search_by_key(&sub.source, |(id, _)| *id) else {
            return Err(IngestError::UnknownSource(sub.source));
        };
        let h = &self.hosted[k].1;
        let current = h.produce_from;
        if slice >= current.saturating_add(max_ahead) {
            return Err(IngestError::TooFarAhead { slice, current, ahead: max_ahead });
        }
        let split = match sub.hit_count {
            None => None,
            Some(n) => {
                let p = HitPayload::parse(&sub.payload, n).map_err(IngestError::BadHits)?;
                Some(p.hit_count() * HIT_LEN)
            }
        };
        let len = sub.payload.len() as u64;
        let late = slice < current;
        let existing = if late { self.late.get(&(sub.source, slice)) } else { h.pending.get(&slice) };
        if let Some(p) = existing
            && p.hit_count.is_some() != sub.hit_count.is_some()
        {
            return Err(IngestError::FormatMismatch { id: sub.source, slice });
        }
        let bytes = existing.map_or(0, |p| p.bytes) + len;
        if bytes > self.cfg.max_fragment_bytes {
            return Err(IngestError::TooLarge { id: sub.source, slice, bytes, max: self.cfg.max_fragment_bytes });
        }
        if self.held_bytes + len > self.cfg.max_held_bytes && self.held_bytes > 0 {
            return Err(IngestError::Full { held: self.held_bytes, max: self.cfg.max_held_bytes });
        }
        let h = &mut self.hosted[k].1;
        h.latest = Some(h.latest.map_or(slice, |l| l.max(slice)));
        let p = if late {
            let key = (sub.source, slice);
            if !self.late.contains_key(&key) {
                self.late_order.push_back(key);
            }
            self.late.entry(key).or_default()
        } else {
            h.pending.entry(slice).or_default()
        };
        match (split, sub.hit_count) {
            (Some(at), Some(n)) => {
                p.hit_count = Some(p.hit_count.unwrap_or(0) + n);
                p.parts.push(sub.payload.slice(..at));
                p.waveforms.push(sub.payload.slice(at..));
            }
            _ => p.parts.push(sub.payload),
        }
        p.bytes += len;
        p.submissions += 1;
        self.held_bytes += len;
        self.report.accepted += 1;
        self.report.accepted_bytes += len;
        self.report.held += 1;
        if late {
            self.report.late += 1;
            Ok(Placed::Late(slice))
        } else {
            Ok(Placed::OnTime(slice))
        }
    }

    /// The node produces `slice` of `source`: its fragment (empty when nothing was
    /// submitted); from now on a submission for it or an earlier slice is late.
    pub fn take(&mut self, source: SourceId, slice: SliceNumber) -> GeneratedFragment {
        let Ok(k) = self.hosted.binary_search_by_key(&source, |(id, _)| *id) else {
            return GeneratedFragment::empty();
        };
        let h = &mut self.hosted[k].1;
        h.produce_from = h.produce_from.max(slice + 1);
        // Slices the node skipped (a stall longer than its lag limit) were never produced:
        // what was submitted for them goes out late rather than being lost.
        while let Some((&s, _)) = h.pending.first_key_value()
            && s < slice
        {
            let p = h.pending.remove(&s).expect("present");
            let key = (source, s);
            match self.late.get_mut(&key) {
                Some(l) => {
                    l.parts.extend(p.parts);
                    l.waveforms.extend(p.waveforms);
                    l.bytes += p.bytes;
                    l.submissions += p.submissions;
                    l.hit_count = l.hit_count.map(|n| n + p.hit_count.unwrap_or(0));
                }
                None => {
                    self.late.insert(key, p);
                    self.late_order.push_back(key);
                }
            }
        }
        match h.pending.remove(&slice) {
            Some(p) => self.release(p),
            None => GeneratedFragment::empty(),
        }
    }

    /// The next late fragment to send: (source, slice, fragment).
    pub fn poll_late(&mut self) -> Option<(SourceId, SliceNumber, GeneratedFragment)> {
        let key = self.late_order.pop_front()?;
        let p = self.late.remove(&key).expect("late order and map agree");
        Some((key.0, key.1, self.release(p)))
    }

    fn release(&mut self, p: Pending) -> GeneratedFragment {
        self.held_bytes -= p.bytes;
        self.report.in_fragments += p.submissions;
        self.report.held -= p.submissions;
        p.into_fragment()
    }

    /// The caller gave up on a submission refused with [`IngestError::Full`].
    pub fn handle_dropped_full(&mut self) {
        self.count_rejected("full");
    }

    /// An input counted a problem of its own (a malformed frame, a client gone in the
    /// middle of a fragment).
    pub fn count_rejected(&mut self, kind: &str) {
        *self.report.rejected.entry(kind.to_string()).or_default() += 1;
    }

    /// A datagram input saw a gap of `n` fragments.
    pub fn handle_lost_at_input(&mut self, n: u64) {
        self.report.lost_at_input += n;
    }

    /// A datagram input got one behind its sequence (counted lost when its gap was seen).
    pub fn handle_reordered_at_input(&mut self) {
        self.report.reordered_at_input += 1;
        self.report.lost_at_input = self.report.lost_at_input.saturating_sub(1);
    }

    /// The run is over: what is still held will never be produced (counted discarded).
    pub fn handle_finish(&mut self) {
        self.closed = true;
        let mut n = 0;
        for (_, h) in &mut self.hosted {
            n += h.pending.values().map(|p| p.submissions).sum::<u64>();
            h.pending.clear();
        }
        n += self.late.values().map(|p| p.submissions).sum::<u64>();
        self.late.clear();
        self.late_order.clear();
        self.held_bytes = 0;
        self.report.held -= n;
        self.report.discarded_at_end += n;
    }

    /// No more submissions: the run ends after the last slice with data.
    pub fn handle_close(&mut self) {
        self.closed = true;
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Data taking may end: every slice with data submitted is below this slice.
    pub fn end_after_data(&self) -> SliceNumber {
        self.hosted.iter().filter_map(|(_, h)| h.latest).max().map_or(self.cfg.first_slice, |l| l + 1)
    }

    /// Slices below this one can be produced without waiting for more data: every hosted
    /// source has submitted for a later slice (or the input is closed). Data-driven
    /// production (saturation benchmarks) produces up to here.
    pub fn ready_below(&self) -> SliceNumber {
        if self.closed {
            return SliceNumber::MAX;
        }
        let waiting = self.hosted.iter().map(|(_, h)| h.latest.unwrap_or(self.cfg.first_slice)).min();
        waiting.unwrap_or(SliceNumber::MAX).max(self.flushed_below)
    }

    /// The caller flushes: every slice it has submitted data for is complete, so
    /// data-driven production goes through the last of them (data submitted later for
    /// those slices go out late).
    pub fn handle_flush(&mut self) {
        self.flushed_below = self.flushed_below.max(self.end_after_data());
    }

    /// Payload bytes held, on time and late.
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes
    }

    /// Nothing held: every accepted submission is in a fragment handed to the node.
    pub fn is_empty(&self) -> bool {
        self.held_bytes == 0 && self.report.held == 0
    }

    pub fn report(&self) -> IngestReport {
        self.report.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Duration;
    use crate::hit::Hit;

    const MS: u64 = 1_000_000;

    fn ingest() -> Ingest {
        Ingest::new(IngestConfig {
            sources: vec![2, 0],
            slice_clock: SliceClock::new(Duration::from_millis(10)),
            first_slice: 100,
            end_slice: Some(200),
            time_origin_ns: 0,
            max_fragment_bytes: 1000,
            max_held_bytes: 3000,
            max_ahead_slices: 50,
        })
    }

    fn opaque(source: SourceId, t: u64, payload: &'static [u8]) -> Submission {
        Submission { source, when: When::TimeNs(t), hit_count: None, payload: Bytes::from_static(payload) }
    }

    #[test]
    fn slices_come_from_the_data_time_and_pieces_concatenate() {
        let mut i = ingest();
        assert_eq!(i.handle_submit(opaque(0, 1005 * MS + 3, b"ab")), Ok(Placed::OnTime(100)));
        assert_eq!(i.handle_submit(opaque(0, 1009 * MS, b"cd")), Ok(Placed::OnTime(100)));
        assert_eq!(i.handle_submit(opaque(2, 1010 * MS, b"ef")), Ok(Placed::OnTime(101)));
        let f = i.take(0, 100);
        assert_eq!(&f.payload[..], b"abcd");
        assert!(f.opaque);
        assert_eq!(i.take(2, 100), GeneratedFragment::empty());
        assert_eq!(&i.take(2, 101).payload[..], b"ef");
        let r = i.report();
        assert_eq!((r.accepted, r.in_fragments, r.held, r.accepted_bytes), (3, 3, 0, 6));
        assert!(r.balanced() && i.is_empty());
    }

    #[test]
    fn a_single_piece_is_not_copied() {
        let mut i = ingest();
        let buf = Bytes::from(vec![7u8; 100]);
        i.handle_submit(Submission { source: 0, when: When::Slice(100), hit_count: None, payload: buf.clone() })
            .unwrap();
        assert_eq!(i.take(0, 100).payload.as_ptr(), buf.as_ptr());
    }

    #[test]
    fn hit_pieces_keep_hits_before_waveforms() {
        let mut i = ingest();
        let piece = |t: u32| {
            let mut b = Vec::new();
            Hit { channel: 1, time_ns: t, amplitude: 2 }.encode(&mut b);
            b.extend_from_slice(&[9u8; crate::hit::WAVEFORM_LEN]);
            Submission { source: 0, when: When::Slice(100), hit_count: Some(1), payload: Bytes::from(b) }
        };
        i.handle_submit(piece(5)).unwrap();
        i.handle_submit(piece(6)).unwrap();
        let f = i.take(0, 100);
        assert_eq!((f.hit_count, f.waveform_count, f.opaque), (2, 2, false));
        let p = HitPayload::parse(&f.payload, 2).unwrap();
        assert_eq!(p.hits().map(|h| h.time_ns).collect::<Vec<_>>(), [5, 6]);
        assert_eq!(p.waveform_count(), 2);
        let bad = Submission { hit_count: Some(3), ..piece(1) };
        assert_eq!(i.handle_submit(bad).unwrap_err().kind(), "bad_hits");
    }

    #[test]
    fn refuses_what_it_cannot_place_and_counts_it() {
        let mut i = ingest();
        assert_eq!(i.handle_submit(opaque(1, 1000 * MS, b"x")).unwrap_err(), IngestError::UnknownSource(1));
        assert_eq!(i.handle_submit(opaque(0, 999 * MS, b"x")).unwrap_err().kind(), "before_run");
        assert_eq!(i.handle_submit(opaque(0, 2000 * MS, b"x")).unwrap_err().kind(), "after_run");
        assert_eq!(i.handle_submit(opaque(0, 1500 * MS, b"x")).unwrap_err().kind(), "too_far_ahead");
        let big = Submission { payload: Bytes::from(vec![0u8; 1001]), ..opaque(0, 1000 * MS, b"") };
        assert_eq!(i.handle_submit(big).unwrap_err().kind(), "too_large");
        i.handle_submit(opaque(0, 1000 * MS, b"x")).unwrap();
        let hits = Submission { hit_count: Some(0), ..opaque(0, 1000 * MS, b"") };
        assert_eq!(i.handle_submit(hits).unwrap_err().kind(), "format_mismatch");
        let r = i.report();
        assert_eq!(r.rejected_total(), 6);
        assert_eq!((r.accepted, r.held), (1, 1));
        i.handle_close();
        assert_eq!(i.handle_submit(opaque(0, 1000 * MS, b"x")).unwrap_err(), IngestError::Closed);
    }

    #[test]
    fn back_pressure_is_full_until_taken_and_counted_only_when_given_up() {
        let mut i = ingest();
        let kb =
            |s| Submission { source: 0, when: When::Slice(s), hit_count: None, payload: Bytes::from(vec![0u8; 1000]) };
        for s in 100..103 {
            i.handle_submit(kb(s)).unwrap();
        }
        assert!(matches!(i.handle_submit(kb(103)), Err(IngestError::Full { .. })));
        assert_eq!(i.report().rejected_total(), 0);
        i.handle_dropped_full();
        assert_eq!(i.report().rejected["full"], 1);
        i.take(0, 100);
        assert_eq!(i.handle_submit(kb(103)), Ok(Placed::OnTime(103)));
    }

    #[test]
    fn late_submissions_become_late_fragments() {
        let mut i = ingest();
        i.handle_submit(opaque(0, 1000 * MS, b"on time")).unwrap();
        i.take(0, 100);
        assert_eq!(i.handle_submit(opaque(0, 1001 * MS, b"late")), Ok(Placed::Late(100)));
        assert_eq!(i.handle_submit(opaque(0, 1002 * MS, b"r")), Ok(Placed::Late(100)));
        let (s, slice, f) = i.poll_late().unwrap();
        assert_eq!((s, slice, &f.payload[..]), (0, 100, &b"later"[..]));
        assert!(i.poll_late().is_none());
        assert_eq!(i.report().late, 2);
        assert!(i.report().balanced());
    }

    #[test]
    fn what_the_run_never_produced_is_discarded_and_counted_at_the_end() {
        let mut i = ingest();
        i.handle_submit(opaque(0, 1000 * MS, b"a")).unwrap();
        i.handle_submit(opaque(0, 1001 * MS, b"b")).unwrap();
        i.handle_finish();
        let r = i.report();
        assert_eq!((r.held, r.discarded_at_end, r.in_fragments), (0, 2, 0));
        assert!(r.balanced() && i.is_empty());
    }

    #[test]
    fn skipped_slices_go_out_late_not_lost() {
        let mut i = ingest();
        i.handle_submit(opaque(0, 1000 * MS, b"a")).unwrap();
        i.handle_submit(opaque(0, 1010 * MS, b"b")).unwrap();
        assert_eq!(&i.take(0, 101).payload[..], b"b");
        assert_eq!(i.poll_late().map(|(_, s, f)| (s, f.payload)), Some((100, Bytes::from_static(b"a"))));
        assert!(i.is_empty());
    }

    #[test]
    fn ready_and_end_follow_the_data() {
        let mut i = ingest();
        assert_eq!(i.ready_below(), 100);
        assert_eq!(i.end_after_data(), 100);
        i.handle_submit(opaque(0, 1030 * MS, b"a")).unwrap();
        assert_eq!(i.ready_below(), 100, "source 2 has sent nothing yet");
        i.handle_submit(opaque(2, 1020 * MS, b"a")).unwrap();
        assert_eq!(i.ready_below(), 102);
        assert_eq!(i.end_after_data(), 104);
        i.handle_flush();
        assert_eq!(i.ready_below(), 104, "a flush completes every slice with data");
        i.handle_close();
        assert_eq!(i.ready_below(), SliceNumber::MAX);
    }

    #[test]
    fn run_relative_times_use_the_origin() {
        let mut i = Ingest::new(IngestConfig { time_origin_ns: 1000 * MS, ..ingest().cfg });
        assert_eq!(i.handle_submit(opaque(0, 15 * MS, b"a")), Ok(Placed::OnTime(101)));
        assert_eq!(i.handle_submit(opaque(0, u64::MAX, b"x")).unwrap_err().kind(), "time_out_of_range");
    }

    /// A board's clock off its host's (issue 36): each host millisecond a board submits one
    /// piece stamped with its own clock, `offset(host ms)` ns away from the host's; the node
    /// takes slice `s` when the host clock passes its end plus a 5 ms latency. Returns (on
    /// time, late, refused before the run) and checks the books balance.
    fn run_with_board_clock(offset: impl Fn(u64) -> i64) -> (u64, u64, u64) {
        let mut i = ingest();
        let latency = 5;
        let mut next = 100; // the next slice the node takes
        let (mut on_time, mut late) = (0, 0);
        for host_ms in 990..1500u64 {
            let t = (host_ms * MS) as i64 + offset(host_ms);
            match i.handle_submit(opaque(0, t.max(0) as u64, b"x")) {
                Ok(Placed::OnTime(_)) => on_time += 1,
                Ok(Placed::Late(_)) => late += 1,
                Err(_) => {}
            }
            while (next + 1) * 10 + latency <= host_ms && next < 200 {
                i.take(0, next);
                next += 1;
            }
        }
        while i.poll_late().is_some() {}
        let r = i.report();
        assert!(r.balanced(), "{r:?}");
        (on_time, late, r.rejected.get("before_run").copied().unwrap_or(0))
    }

    #[test]
    fn a_board_clock_off_the_hosts_is_on_time_within_the_latency_and_late_beyond() {
        // Ahead of the host, or behind by less than the latency: every piece on time (of
        // 510; those stamped before the run's first slice at 1,000 ms are refused, counted).
        assert_eq!(run_with_board_clock(|_| 3 * MS as i64), (503, 0, 7));
        assert_eq!(run_with_board_clock(|_| -3 * (MS as i64)), (497, 0, 13));
        // Behind by 8 ms, more than the 5 ms latency: what the board stamps in the last 2 ms
        // of a slice reaches the host after the slice went out (at its end + 5 ms), and goes
        // as a late fragment (counted, delivered): 2 of every 10 pieces.
        let (on_time, late, before) = run_with_board_clock(|_| -8 * (MS as i64));
        assert_eq!((on_time, late, before), (394, 98, 18));
        // Drifting from 0 to 20 ms behind over the run: on time first, then late, more and
        // more; nothing lost.
        let (on_time, late, _) = run_with_board_clock(|h| -((h.saturating_sub(990) * 20 * MS / 510) as i64));
        assert!(on_time > late && late > 100, "{on_time} on time, {late} late");
    }
}
