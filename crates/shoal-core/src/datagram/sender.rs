//! The source's side of one datagram stream: cutting frames into datagrams, the retransmit
//! buffer, tail probes and the end of the stream.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};

use super::UdpConfig;
use super::wire::{Datagram, DatagramHeader, Kind};
use crate::slice::SliceNumber;
use crate::{BuilderId, Instant, SourceId};

/// What one stream's sender did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SenderStats {
    pub frames: u64,
    pub datagrams: u64,
    pub bytes: u64,
    pub nacks: u64,
    /// Datagrams sent again in answer to a NACK.
    pub retransmitted: u64,
    /// NACKed datagrams no longer in the retransmit buffer (too old, or pushed out by the
    /// byte limit): the builder will declare them lost.
    pub unanswerable: u64,
    pub probes: u64,
    pub ends: u64,
    /// Datagrams from the builder that do not belong to this stream or are not a NACK or
    /// end acknowledgement.
    pub refused: u64,
    /// Frames left half handed over (a part of another frame came first): what was cut of
    /// them is sent, the builder gives them up as damaged.
    pub abandoned: u64,
}

impl SenderStats {
    /// Adds another stream's counts (totals over streams or links).
    pub fn merge(&mut self, o: &SenderStats) {
        self.frames += o.frames;
        self.datagrams += o.datagrams;
        self.bytes += o.bytes;
        self.nacks += o.nacks;
        self.retransmitted += o.retransmitted;
        self.unanswerable += o.unanswerable;
        self.probes += o.probes;
        self.ends += o.ends;
        self.refused += o.refused;
        self.abandoned += o.abandoned;
    }
}

#[derive(Debug)]
struct Kept {
    at: Instant,
    header: DatagramHeader,
    payload: Bytes,
}

impl Kept {
    fn wire_len(&self) -> u64 {
        (super::DATAGRAM_HEADER_LEN + self.payload.len()) as u64
    }
}

/// One (source, builder) stream, source side.
#[derive(Debug)]
pub struct DatagramSender {
    cfg: UdpConfig,
    run: u32,
    source: SourceId,
    builder: BuilderId,
    next_seq: u64,
    /// Sent datagrams by sequence number, oldest first, for retransmission.
    kept: VecDeque<Kept>,
    kept_bytes: u64,
    /// When the first data datagram was sent: those of the stream's start are kept for
    /// [`UdpConfig::start_retransmit_age`].
    started: Option<Instant>,
    out: VecDeque<Bytes>,
    /// When to send a `SYNC` if nothing else is sent before (one per idle period).
    probe_at: Option<Instant>,
    end: Option<EndState>,
    /// The frame being handed over in parts, if its last part has not come yet.
    partial: Option<Partial>,
    /// The last frame completed (slice, length): an empty part of an empty frame after it
    /// is not another frame.
    last_frame: Option<(SliceNumber, u32)>,
    stats: SenderStats,
}

/// A frame handed over in parts: how far it is cut, and the bytes of its next piece.
#[derive(Debug)]
struct Partial {
    slice: SliceNumber,
    frame_len: u32,
    /// Bytes already cut into datagrams.
    cut: u32,
    /// Bytes of the next piece, fewer than a piece.
    pending: Vec<u8>,
}

#[derive(Debug)]
struct EndState {
    next_at: Instant,
    sent: u32,
    acked: bool,
}

impl DatagramSender {
    pub fn new(cfg: UdpConfig, run: u32, source: SourceId, builder: BuilderId) -> Self {
        Self {
            cfg,
            run,
            source,
            builder,
            next_seq: 0,
            kept: VecDeque::new(),
            kept_bytes: 0,
            started: None,
            out: VecDeque::new(),
            probe_at: None,
            end: None,
            partial: None,
            last_frame: None,
            stats: SenderStats::default(),
        }
    }

    fn header(&self, kind: Kind) -> DatagramHeader {
        DatagramHeader::new(kind, self.run, self.source, self.builder)
    }

    /// Cuts the frame of `slice` into datagrams, queues them and keeps them for
    /// retransmission. Frames of 4 GiB and more cannot be sent (the caller's payload limit
    /// is far below).
    pub fn handle_frame(&mut self, now: Instant, slice: SliceNumber, frame: &[u8]) {
        let Ok(frame_len) = u32::try_from(frame.len()) else { return };
        self.handle_frame_part(now, slice, frame_len, frame);
    }

    /// The next part of the frame of `slice`, `frame_len` bytes in all, parts in order.
    /// Every datagram whose bytes are all here is queued at once, so a paced source's
    /// datagrams leave at its pace, not in one burst at the end of the frame; the cut is
    /// the same however the frame is split. The frame is done when its parts add up to
    /// `frame_len` (bytes beyond are ignored). A part of another frame before that
    /// abandons the unfinished one (counted; the builder gives it up as damaged).
    pub fn handle_frame_part(&mut self, now: Instant, slice: SliceNumber, frame_len: u32, part: &[u8]) {
        // A frame starts with its first byte: an empty part that continues nothing (one
        // after the frame was complete) is not a new frame. An empty frame has no byte: its
        // first empty part is the frame, the next ones repeat it.
        let continues = self.partial.as_ref().is_some_and(|p| p.slice == slice && p.frame_len == frame_len);
        let repeats_empty = frame_len == 0 && self.last_frame == Some((slice, 0));
        if part.is_empty() && !continues && (frame_len > 0 || repeats_empty) {
            return;
        }
        let mut p = match self.partial.take() {
            Some(p) if p.slice == slice && p.frame_len == frame_len => p,
            other => {
                if other.is_some() {
                    self.stats.abandoned += 1;
                }
                self.stats.frames += 1;
                Partial { slice, frame_len, cut: 0, pending: Vec::new() }
            }
        };
        let piece = usize::from(self.cfg.max_payload.max(1));
        let left = (frame_len - p.cut) as usize - p.pending.len();
        let mut part = &part[..part.len().min(left)];
        let sent_before = self.next_seq;
        // This call's datagrams share one allocation (kept for retransmission as slices
        // of it): one allocation per part instead of one per datagram.
        let mut batch = BytesMut::with_capacity((part.len() / piece + 2) * (super::DATAGRAM_HEADER_LEN + piece));
        let mut headers: Vec<(DatagramHeader, usize)> = Vec::new();
        loop {
            let received = p.cut as usize + p.pending.len() + part.len();
            let ends = received == frame_len as usize;
            if p.pending.is_empty() {
                // Straight from the part, without copying it first.
                if part.len() >= piece || (ends && !part.is_empty()) {
                    let n = piece.min(part.len());
                    headers.push(self.emit(&mut batch, slice, frame_len, p.cut, &part[..n]));
                    p.cut += n as u32;
                    part = &part[n..];
                    continue;
                }
                p.pending.extend_from_slice(part);
                break;
            }
            let n = (piece - p.pending.len()).min(part.len());
            p.pending.extend_from_slice(&part[..n]);
            part = &part[n..];
            if p.pending.len() == piece || (ends && part.is_empty()) {
                let pending = std::mem::take(&mut p.pending);
                headers.push(self.emit(&mut batch, slice, frame_len, p.cut, &pending));
                p.cut += pending.len() as u32;
                continue;
            }
            break;
        }
        if p.cut < frame_len {
            self.partial = Some(p);
        } else {
            self.last_frame = Some((slice, frame_len));
        }
        if !headers.is_empty() {
            self.started.get_or_insert(now);
        }
        let mut batch = batch.freeze();
        for (h, len) in headers {
            let d = batch.split_to(super::DATAGRAM_HEADER_LEN + len);
            let kept = Kept { at: now, header: h, payload: d.slice(super::DATAGRAM_HEADER_LEN..) };
            self.kept_bytes += kept.wire_len();
            self.kept.push_back(kept);
            self.out.push_back(d);
        }
        if self.next_seq != sent_before {
            self.forget_old(now);
            self.probe_at = Some(now + self.cfg.probe_delay);
        }
    }

    /// Encodes one data datagram onto `batch` (queued and kept by the caller).
    fn emit(
        &mut self,
        batch: &mut BytesMut,
        slice: SliceNumber,
        frame_len: u32,
        offset: u32,
        payload: &[u8],
    ) -> (DatagramHeader, usize) {
        let h = DatagramHeader { seq: self.next_seq, slice, frame_len, offset, ..self.header(Kind::Data) };
        Datagram::encode_into(&h, payload, batch);
        self.next_seq += 1;
        self.stats.datagrams += 1;
        self.stats.bytes += (super::DATAGRAM_HEADER_LEN + payload.len()) as u64;
        (h, payload.len())
    }

    /// Announces the stream now with a `SYNC` (its next sequence number), before any data:
    /// a pull builder learns where to send its requests from it.
    pub fn handle_greet(&mut self, now: Instant) {
        if self.end.is_none() {
            self.probe_at = Some(now);
            self.handle_timeout(now);
        }
    }

    /// No more frames: the end of the stream is sent (and repeated until acknowledged).
    pub fn handle_end(&mut self, now: Instant) {
        if self.end.is_none() {
            self.end = Some(EndState { next_at: now, sent: 0, acked: false });
            self.probe_at = None;
        }
    }

    /// A datagram from the builder (already decoded): a NACK or an end acknowledgement.
    pub fn handle_datagram(&mut self, now: Instant, d: &Datagram) {
        let h = &d.header;
        if h.run != self.run || h.source != self.source || h.builder != self.builder {
            self.stats.refused += 1;
            return;
        }
        match h.kind {
            Kind::Nack => {
                self.stats.nacks += 1;
                self.forget_old(now);
                for seq in d.nacked() {
                    match self.find(seq) {
                        Some(datagram) => {
                            self.stats.retransmitted += 1;
                            self.out.push_back(datagram);
                        }
                        None if seq < self.next_seq => self.stats.unanswerable += 1,
                        // Never sent: a forged or corrupted request.
                        None => self.stats.refused += 1,
                    }
                }
            }
            Kind::EndAck => {
                if let Some(e) = &mut self.end {
                    e.acked = true;
                }
            }
            // Requests are the pull driver's (it reads them before the stream does).
            Kind::Data | Kind::Sync | Kind::End | Kind::Request => self.stats.refused += 1,
        }
    }

    /// The kept datagram `seq`, marked as a retransmission.
    fn find(&self, seq: u64) -> Option<Bytes> {
        // Kept datagrams have consecutive sequence numbers.
        let first = self.kept.front()?.header.seq;
        let k = self.kept.get(usize::try_from(seq.checked_sub(first)?).ok()?)?;
        debug_assert_eq!(k.header.seq, seq);
        Some(Datagram::encode(&DatagramHeader { retransmit: true, ..k.header }, &k.payload))
    }

    fn forget_old(&mut self, now: Instant) {
        while let Some(k) = self.kept.front() {
            let at_start =
                self.started.is_some_and(|s| k.at.saturating_duration_since(s) < self.cfg.start_retransmit_age);
            let age = if at_start {
                self.cfg.start_retransmit_age.max(self.cfg.retransmit_age)
            } else {
                self.cfg.retransmit_age
            };
            let too_old = now.saturating_duration_since(k.at) > age;
            if !too_old && self.kept_bytes <= self.cfg.retransmit_bytes {
                break;
            }
            self.kept_bytes -= k.wire_len();
            self.kept.pop_front();
        }
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        self.forget_old(now);
        if self.probe_at.is_some_and(|t| t <= now) {
            self.probe_at = None;
            self.stats.probes += 1;
            let h = DatagramHeader { seq: self.next_seq, ..self.header(Kind::Sync) };
            self.out.push_back(Datagram::encode(&h, &[]));
        }
        let (interval, max_ends) = (self.cfg.end_interval, self.cfg.max_ends);
        let end_header = DatagramHeader { seq: self.next_seq, ..self.header(Kind::End) };
        if let Some(e) = &mut self.end
            && !e.acked
            && e.sent < max_ends
            && e.next_at <= now
        {
            e.sent += 1;
            e.next_at = now + interval;
            self.stats.ends += 1;
            self.out.push_back(Datagram::encode(&end_header, &[]));
        }
    }

    /// The next datagram to send.
    pub fn poll_transmit(&mut self) -> Option<Bytes> {
        self.out.pop_front()
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        let end = self.end.as_ref().filter(|e| !e.acked && e.sent < self.cfg.max_ends).map(|e| e.next_at);
        [self.probe_at, end].into_iter().flatten().min()
    }

    /// The end was acknowledged, or repeated as often as allowed.
    pub fn is_finished(&self) -> bool {
        self.out.is_empty() && self.end.as_ref().is_some_and(|e| e.acked || e.sent >= self.cfg.max_ends)
    }

    /// The end was acknowledged by the builder.
    pub fn end_acknowledged(&self) -> bool {
        self.end.as_ref().is_some_and(|e| e.acked)
    }

    pub fn stats(&self) -> &SenderStats {
        &self.stats
    }

    /// Bytes held for retransmission.
    pub fn kept_bytes(&self) -> u64 {
        self.kept_bytes
    }
}
