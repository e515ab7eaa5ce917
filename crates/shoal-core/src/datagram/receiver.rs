//! The builder's side: per-source reassembly, gap detection and NACKs, and the endpoint that
//! demultiplexes one socket's datagrams.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::Bytes;

use super::UdpConfig;
use super::wire::{Datagram, DatagramError, DatagramHeader, Kind, MAX_NACK_SEQS};
use crate::slice::SliceNumber;
use crate::{BuilderId, Instant, SourceId};

/// What one stream's receiver saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ReceiverStats {
    pub datagrams: u64,
    pub bytes: u64,
    /// A datagram already received (or for a frame already complete): ignored.
    pub duplicates: u64,
    /// Arrived after a later sequence number (reordered or retransmitted).
    pub out_of_order: u64,
    pub nacks_sent: u64,
    /// Sequence numbers asked for again (each NACK lists several).
    pub seqs_nacked: u64,
    /// Datagrams that arrived after they were NACKed (recovered).
    pub recovered_datagrams: u64,
    /// Datagrams known to be missing (from gaps or the end's sequence number) and given up.
    pub lost_datagrams: u64,
    /// Frames reassembled complete.
    pub frames: u64,
    /// Of those, frames that needed at least one retransmitted datagram.
    pub frames_recovered: u64,
    /// Frames partly received and given up (reassembly timeout or memory bound).
    pub fragments_damaged: u64,
    /// Data that contradicts what was received before for the same frame (another
    /// length): refused.
    pub inconsistent: u64,
}

impl ReceiverStats {
    /// Adds another stream's counts (totals over streams or builders).
    pub fn merge(&mut self, o: &ReceiverStats) {
        self.datagrams += o.datagrams;
        self.bytes += o.bytes;
        self.duplicates += o.duplicates;
        self.out_of_order += o.out_of_order;
        self.nacks_sent += o.nacks_sent;
        self.seqs_nacked += o.seqs_nacked;
        self.recovered_datagrams += o.recovered_datagrams;
        self.lost_datagrams += o.lost_datagrams;
        self.frames += o.frames;
        self.frames_recovered += o.frames_recovered;
        self.fragments_damaged += o.fragments_damaged;
        self.inconsistent += o.inconsistent;
    }
}

/// A frame reassembled from datagrams.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceivedFragment {
    pub source: SourceId,
    pub slice: SliceNumber,
    /// The frame's bytes, as a TCP stream would carry them (decode with
    /// [`crate::frame::decode`], which checks its own CRCs).
    pub frame: Bytes,
    /// At least one of its datagrams was a retransmission.
    pub recovered: bool,
}

#[derive(Debug)]
struct Missing {
    nacks: u32,
    next_nack: Instant,
}

#[derive(Debug)]
struct Partial {
    frame_len: u32,
    data: Vec<u8>,
    /// Offsets received (each datagram starts at a distinct offset).
    pieces: BTreeSet<u32>,
    got: u64,
    since: Instant,
    recovered: bool,
}

/// One (source, builder) stream, builder side.
#[derive(Debug)]
pub struct DatagramReceiver {
    cfg: UdpConfig,
    run: u32,
    source: SourceId,
    builder: BuilderId,
    /// Every sequence number below this was received, is missing, or was given up.
    next_seq: u64,
    missing: BTreeMap<u64, Missing>,
    partial: BTreeMap<SliceNumber, Partial>,
    partial_bytes: u64,
    /// Slices completed or given up recently: later copies of their datagrams are
    /// duplicates (a frame is delivered or counted damaged once).
    finished: BTreeSet<SliceNumber>,
    out: VecDeque<ReceivedFragment>,
    transmit: VecDeque<Bytes>,
    /// The sender's final sequence number, once its `End` arrived.
    end: Option<u64>,
    end_acked: bool,
    stats: ReceiverStats,
}

/// Finished slices remembered per stream to recognise late duplicates.
const FINISHED_MEMORY: usize = 4096;

impl DatagramReceiver {
    pub fn new(cfg: UdpConfig, run: u32, source: SourceId, builder: BuilderId) -> Self {
        Self {
            cfg,
            run,
            source,
            builder,
            next_seq: 0,
            missing: BTreeMap::new(),
            partial: BTreeMap::new(),
            partial_bytes: 0,
            finished: BTreeSet::new(),
            out: VecDeque::new(),
            transmit: VecDeque::new(),
            end: None,
            end_acked: false,
            stats: ReceiverStats::default(),
        }
    }

    /// A decoded datagram of this stream (the endpoint checked run, source and builder).
    pub fn handle_datagram(&mut self, now: Instant, d: &Datagram) {
        let h = &d.header;
        match h.kind {
            Kind::Data => {
                self.stats.datagrams += 1;
                self.stats.bytes += d.payload.len() as u64;
                if !self.handle_seq(now, h.seq) {
                    self.stats.duplicates += 1;
                    return;
                }
                self.handle_piece(now, h, &d.payload);
            }
            Kind::Sync => self.handle_next_seq(now, h.seq),
            Kind::End => {
                self.handle_next_seq(now, h.seq);
                self.end = Some(h.seq);
                // Every End is answered once nothing is missing: the sender repeats it until
                // an acknowledgement gets through.
                self.end_acked = false;
                self.maybe_ack_end();
            }
            Kind::Nack | Kind::EndAck | Kind::Request => {}
        }
    }

    /// Records `seq` as received; false if it was already (a duplicate).
    fn handle_seq(&mut self, now: Instant, seq: u64) -> bool {
        if seq >= self.next_seq {
            if seq > self.next_seq {
                self.mark_missing(now, self.next_seq, seq);
            }
            self.next_seq = seq + 1;
            return true;
        }
        self.stats.out_of_order += 1;
        if self.missing.remove(&seq).is_some() {
            return true;
        }
        false
    }

    /// The sender says every sequence number below `next` was sent.
    fn handle_next_seq(&mut self, now: Instant, next: u64) {
        if next > self.next_seq {
            self.mark_missing(now, self.next_seq, next);
            self.next_seq = next;
        }
    }

    fn mark_missing(&mut self, now: Instant, from: u64, to: u64) {
        let first_nack = now + self.cfg.nack_delay;
        // Bounded: a forged sequence number far ahead must not make the builder allocate.
        let room = (self.cfg.max_missing as usize).saturating_sub(self.missing.len()) as u64;
        let marked = (to - from).min(room);
        for seq in to - marked..to {
            self.missing.insert(seq, Missing { nacks: 0, next_nack: first_nack });
        }
        self.stats.lost_datagrams += (to - from) - marked;
    }

    fn handle_piece(&mut self, now: Instant, h: &DatagramHeader, payload: &[u8]) {
        if self.finished.contains(&h.slice) {
            self.stats.duplicates += 1;
            return;
        }
        // The sender cuts a frame into pieces of exactly `max_payload` bytes (the last one
        // shorter): distinct offsets then never overlap, so a frame whose pieces add up to
        // its length is covered, byte for byte.
        let piece = u32::from(self.cfg.max_payload.max(1));
        let expected_len = piece.min(h.frame_len.saturating_sub(h.offset));
        let frame_len = u64::from(h.frame_len);
        if !h.offset.is_multiple_of(piece)
            || payload.len() != expected_len as usize
            || frame_len > self.cfg.reassembly_bytes
        {
            self.stats.inconsistent += 1;
            return;
        }
        if !self.partial.contains_key(&h.slice) {
            // Memory bound: the oldest partial frames are given up.
            while self.partial_bytes + frame_len > self.cfg.reassembly_bytes {
                let Some(slice) = self.partial.keys().next().copied() else { break };
                self.give_up(slice);
            }
            self.partial_bytes += frame_len;
            self.partial.insert(
                h.slice,
                Partial {
                    frame_len: h.frame_len,
                    data: vec![0; h.frame_len as usize],
                    pieces: BTreeSet::new(),
                    got: 0,
                    since: now,
                    recovered: false,
                },
            );
        }
        let p = self.partial.get_mut(&h.slice).expect("inserted");
        if p.frame_len != h.frame_len {
            self.stats.inconsistent += 1;
            return;
        }
        if !p.pieces.insert(h.offset) {
            self.stats.duplicates += 1;
            return;
        }
        let start = h.offset as usize;
        p.data[start..start + payload.len()].copy_from_slice(payload);
        p.got += payload.len() as u64;
        p.recovered |= h.retransmit;
        if h.retransmit {
            self.stats.recovered_datagrams += 1;
        }
        if p.got == u64::from(p.frame_len) {
            let p = self.partial.remove(&h.slice).expect("present");
            self.partial_bytes -= u64::from(p.frame_len);
            self.finish(h.slice);
            self.stats.frames += 1;
            self.stats.frames_recovered += u64::from(p.recovered);
            self.out.push_back(ReceivedFragment {
                source: self.source,
                slice: h.slice,
                frame: Bytes::from(p.data),
                recovered: p.recovered,
            });
        }
    }

    fn finish(&mut self, slice: SliceNumber) {
        self.finished.insert(slice);
        if self.finished.len() > FINISHED_MEMORY {
            self.finished.pop_first();
        }
    }

    /// A partial frame that cannot be completed (counted damaged).
    fn give_up(&mut self, slice: SliceNumber) {
        if let Some(p) = self.partial.remove(&slice) {
            self.partial_bytes -= u64::from(p.frame_len);
            self.stats.fragments_damaged += 1;
            self.finish(slice);
        }
    }

    fn maybe_ack_end(&mut self) {
        if self.end.is_some() && !self.end_acked && self.missing.is_empty() {
            self.end_acked = true;
            self.transmit.push_back(Datagram::encode(
                &DatagramHeader::new(Kind::EndAck, self.run, self.source, self.builder),
                &[],
            ));
        }
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        // NACK what is due, give up what was asked for too often.
        let mut due = Vec::new();
        let mut given_up = Vec::new();
        for (&seq, m) in &mut self.missing {
            if m.next_nack > now {
                continue;
            }
            if m.nacks >= self.cfg.max_nacks {
                given_up.push(seq);
                continue;
            }
            m.nacks += 1;
            // Each repeat waits twice as long as the one before: a source late to answer
            // (a software host waiting for a CPU) is still heard before the datagram is
            // declared lost, and an answer lost on the way is asked for again soon.
            m.next_nack = now + self.cfg.nack_interval * (1u32 << (m.nacks - 1).min(16));
            due.push(seq);
        }
        for seq in given_up {
            self.missing.remove(&seq);
            self.stats.lost_datagrams += 1;
        }
        for seqs in due.chunks(MAX_NACK_SEQS) {
            self.stats.nacks_sent += 1;
            self.stats.seqs_nacked += seqs.len() as u64;
            self.transmit.push_back(Datagram::nack(self.run, self.source, self.builder, seqs));
        }
        // Frames that cannot complete any more.
        let expired: Vec<SliceNumber> = self
            .partial
            .iter()
            .filter(|(_, p)| now.saturating_duration_since(p.since) >= self.cfg.reassembly_timeout)
            .map(|(s, _)| *s)
            .collect();
        for slice in expired {
            self.give_up(slice);
        }
        self.maybe_ack_end();
    }

    /// The next reassembled frame.
    pub fn poll_fragment(&mut self) -> Option<ReceivedFragment> {
        self.out.pop_front()
    }

    /// The next datagram to send back to the source (NACK, end acknowledgement).
    pub fn poll_transmit(&mut self) -> Option<Bytes> {
        self.transmit.pop_front()
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        let nack = self.missing.values().map(|m| m.next_nack).min();
        let partial = self.partial.values().map(|p| p.since + self.cfg.reassembly_timeout).min();
        [nack, partial].into_iter().flatten().min()
    }

    /// The source ended its stream and nothing is missing or half assembled any more.
    pub fn is_ended(&self) -> bool {
        self.end.is_some() && self.missing.is_empty() && self.partial.is_empty()
    }

    pub fn stats(&self) -> &ReceiverStats {
        &self.stats
    }
}

/// What a builder's endpoint refused, by reason.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct EndpointStats {
    pub datagrams: u64,
    /// Not a datagram at all, by [`DatagramError::kind`].
    pub refused: BTreeMap<String, u64>,
    /// Well-formed, but for another run.
    pub other_run: u64,
    /// Well-formed, but addressed to another builder.
    pub other_builder: u64,
    /// From a source id outside the run.
    pub unknown_source: u64,
    /// A kind a builder never receives (NACK, end acknowledgement).
    pub wrong_direction: u64,
}

/// What a builder's endpoint hands its driver, in the order it happened: a source's frames
/// and damage always come before its end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndpointEvent {
    /// A frame reassembled.
    Fragment(ReceivedFragment),
    /// `n` more frames of `source` were partly received and given up (the node counts
    /// them `damaged`).
    Damaged { source: SourceId, n: u64 },
    /// `source` ended its stream with nothing missing: no more frames come from it.
    Ended { source: SourceId },
}

/// A source's receiver and what the endpoint already told the driver about it.
#[derive(Debug)]
struct Stream {
    rx: DatagramReceiver,
    damaged_reported: u64,
    ended_reported: bool,
    /// Its entry in the endpoint's deadline index.
    deadline: Option<Instant>,
}

/// One builder's datagram socket: checks every datagram, hands it to its source's
/// receiver, and collects what that receiver produced. Work per datagram or timer touches
/// only the streams concerned (a deadline index instead of a scan over every source).
#[derive(Debug)]
pub struct BuilderEndpoint {
    cfg: UdpConfig,
    run: u32,
    builder: BuilderId,
    n_sources: u32,
    streams: BTreeMap<SourceId, Stream>,
    deadlines: BTreeSet<(Instant, SourceId)>,
    events: VecDeque<EndpointEvent>,
    transmit: VecDeque<(SourceId, Bytes)>,
    stats: EndpointStats,
}

impl BuilderEndpoint {
    pub fn new(cfg: UdpConfig, run: u32, builder: BuilderId, n_sources: u32) -> Self {
        Self {
            cfg,
            run,
            builder,
            n_sources,
            streams: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            events: VecDeque::new(),
            transmit: VecDeque::new(),
            stats: EndpointStats::default(),
        }
    }

    /// Untrusted bytes from the socket. Returns the source they came from when accepted
    /// (the driver remembers its address for NACKs), or why they were refused (counted).
    pub fn handle_bytes(&mut self, now: Instant, bytes: &Bytes) -> Result<SourceId, &'static str> {
        self.stats.datagrams += 1;
        let d = match Datagram::decode(bytes) {
            Ok(d) => d,
            Err(e) => return Err(self.refuse(&e)),
        };
        let h = &d.header;
        let reason = if h.run != self.run {
            self.stats.other_run += 1;
            "other_run"
        } else if h.builder != self.builder {
            self.stats.other_builder += 1;
            "other_builder"
        } else if h.source >= self.n_sources {
            self.stats.unknown_source += 1;
            "unknown_source"
        } else if matches!(h.kind, Kind::Nack | Kind::EndAck | Kind::Request) {
            self.stats.wrong_direction += 1;
            "wrong_direction"
        } else {
            let (cfg, run, builder) = (self.cfg, self.run, self.builder);
            let source = h.source;
            self.streams
                .entry(source)
                .or_insert_with(|| Stream {
                    rx: DatagramReceiver::new(cfg, run, source, builder),
                    damaged_reported: 0,
                    ended_reported: false,
                    deadline: None,
                })
                .rx
                .handle_datagram(now, &d);
            self.collect(source);
            return Ok(source);
        };
        Err(reason)
    }

    fn refuse(&mut self, e: &DatagramError) -> &'static str {
        *self.stats.refused.entry(e.kind().to_string()).or_default() += 1;
        e.kind()
    }

    /// Lets the timers that are due fire (only those streams are touched).
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(&(t, source)) = self.deadlines.first() {
            if t > now {
                break;
            }
            self.deadlines.pop_first();
            let st = self.streams.get_mut(&source).expect("an indexed stream exists");
            st.deadline = None;
            st.rx.handle_timeout(now);
            self.collect(source);
        }
    }

    /// Moves what `source`'s receiver produced to the endpoint's queues and re-indexes its
    /// deadline.
    fn collect(&mut self, source: SourceId) {
        let st = self.streams.get_mut(&source).expect("a known stream");
        while let Some(f) = st.rx.poll_fragment() {
            self.events.push_back(EndpointEvent::Fragment(f));
        }
        while let Some(d) = st.rx.poll_transmit() {
            self.transmit.push_back((source, d));
        }
        let damaged = st.rx.stats().fragments_damaged;
        if damaged > st.damaged_reported {
            self.events.push_back(EndpointEvent::Damaged { source, n: damaged - st.damaged_reported });
            st.damaged_reported = damaged;
        }
        if !st.ended_reported && st.rx.is_ended() {
            st.ended_reported = true;
            self.events.push_back(EndpointEvent::Ended { source });
        }
        let next = st.rx.poll_timeout();
        if next != st.deadline {
            if let Some(old) = st.deadline {
                self.deadlines.remove(&(old, source));
            }
            if let Some(t) = next {
                self.deadlines.insert((t, source));
            }
            st.deadline = next;
        }
    }

    /// The next frame, damage or end of stream, from any source.
    pub fn poll_event(&mut self) -> Option<EndpointEvent> {
        self.events.pop_front()
    }

    /// The next datagram to send back, with the source it goes to.
    pub fn poll_transmit(&mut self) -> Option<(SourceId, Bytes)> {
        self.transmit.pop_front()
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadlines.first().map(|&(t, _)| t)
    }

    /// Every source in `sources` ended its stream and nothing is missing.
    pub fn all_ended(&self, sources: impl IntoIterator<Item = SourceId>) -> bool {
        sources.into_iter().all(|s| self.streams.get(&s).is_some_and(|st| st.rx.is_ended()))
    }

    pub fn stream(&self, source: SourceId) -> Option<&DatagramReceiver> {
        self.streams.get(&source).map(|st| &st.rx)
    }

    pub fn stats(&self) -> &EndpointStats {
        &self.stats
    }

    /// The receivers' statistics summed over every source.
    pub fn receiver_totals(&self) -> ReceiverStats {
        let mut t = ReceiverStats::default();
        for st in self.streams.values() {
            t.merge(st.rx.stats());
        }
        t
    }
}
