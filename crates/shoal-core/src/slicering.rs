//! The slice ring: complete slices published into shared memory for consumers in other
//! processes (docs/plugins.md, "Slice consumers").
//!
//! A builder copies each filtered slice once into a ring of bytes (a memfd the consumers
//! map read-only) and tells every attached consumer where it is; a consumer reads it in
//! place and releases it. This module holds the decisions and the formats, no I/O:
//!
//! - [`RingLedger`]: where the next slice goes, which consumers are offered it, and when
//!   held space may be taken back. Each consumer has a [`Policy`]: `Hold` (the ring waits up
//!   to a bound for its release) or `Skip` (never waited for). A consumer holds at most its
//!   `window` slices; a slice arriving while its window is full is skipped for it (counted).
//!   Space still held once a `Hold` bound has passed, or held by a `Skip` consumer, is
//!   taken back and counted as `overrun` for each holder; the ring's `reclaimed_below`
//!   sequence number, written into the shared control header *before* the space is reused,
//!   is how a consumer finds out after reading (its release reports the overrun).
//! - [`layout`]: the control header and the slot format (slot header, fragment table,
//!   payloads), byte by byte.
//! - [`msg`]: the 48-byte messages on the consumer's socket.

use std::collections::VecDeque;

use crate::{Duration, Instant};

/// How long a consumer may keep the ring waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// The ring waits up to `max` for this consumer's release before taking the space back.
    Hold { max: Duration },
    /// The ring never waits for this consumer.
    Skip,
}

/// A consumer's number in a [`RingLedger`].
pub type ConsumerId = u32;

/// What one consumer was offered and lost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ConsumerCounters {
    /// Slices handed to the consumer.
    pub offered: u64,
    /// Slices it released in time.
    pub released: u64,
    /// Slices not offered because its window was full.
    pub skipped: u64,
    /// Slices taken back before it released them (its view may have changed under it).
    pub overrun: u64,
}

#[derive(Debug)]
struct ConsumerState {
    id: ConsumerId,
    policy: Policy,
    window: u32,
    outstanding: u32,
    counters: ConsumerCounters,
}

#[derive(Debug)]
struct Slot {
    seq: u64,
    /// Bytes the slot takes, padding before it included (released together).
    span: u64,
    offered_at: Instant,
    holders: Vec<ConsumerId>,
}

/// Why a slice cannot be placed now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reserve {
    /// Write the slot at `offset` (after storing `reclaimed_below` in the control header)
    /// and offer it to `recipients` (none: nobody is attached, nothing to write).
    Ready { seq: u64, offset: u64, reclaimed_below: u64 },
    /// The oldest slot is held by a `Hold` consumer: call again at `until` or on a release.
    Wait { until: Instant },
    /// The slice is larger than the ring.
    TooLarge,
}

/// What a release did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Released {
    /// The slot was still the consumer's.
    InTime,
    /// The slot had been taken back before (already counted as an overrun).
    Overrun,
    /// The consumer did not hold that slot: a protocol error.
    NotHeld,
}

/// The ring's bookkeeping (sans-IO): slots in publication order, consumers, counters.
#[derive(Debug)]
pub struct RingLedger {
    capacity: u64,
    /// Next free offset (slots are contiguous; a slot that does not fit before the end
    /// starts at 0 and the rest is padding).
    head: u64,
    /// Bytes in use, padding included.
    used: u64,
    slots: VecDeque<Slot>,
    consumers: Vec<ConsumerState>,
    next_consumer: ConsumerId,
    next_seq: u64,
    reclaimed_below: u64,
    /// Consumers gone: their counters, for the run's report.
    departed: Vec<(ConsumerId, ConsumerCounters)>,
}

/// Slots start on this alignment (so that every payload can be 8-aligned).
pub const SLOT_ALIGN: u64 = 64;

impl RingLedger {
    /// A ring of `capacity` bytes (rounded down to [`SLOT_ALIGN`]).
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity: capacity / SLOT_ALIGN * SLOT_ALIGN,
            head: 0,
            used: 0,
            slots: VecDeque::new(),
            consumers: Vec::new(),
            next_consumer: 0,
            next_seq: 1,
            reclaimed_below: 1,
            departed: Vec::new(),
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Every sequence number below this may have been overwritten.
    pub fn reclaimed_below(&self) -> u64 {
        self.reclaimed_below
    }

    pub fn add_consumer(&mut self, policy: Policy, window: u32) -> ConsumerId {
        let id = self.next_consumer;
        self.next_consumer += 1;
        self.consumers.push(ConsumerState {
            id,
            policy,
            window: window.max(1),
            outstanding: 0,
            counters: ConsumerCounters::default(),
        });
        id
    }

    /// A consumer left (or died): its slots are free of it.
    pub fn remove_consumer(&mut self, id: ConsumerId) -> Option<ConsumerCounters> {
        let at = self.consumers.iter().position(|c| c.id == id)?;
        let c = self.consumers.remove(at);
        for s in &mut self.slots {
            s.holders.retain(|h| *h != id);
        }
        self.departed.push((id, c.counters));
        self.reclaim_released();
        Some(c.counters)
    }

    pub fn consumer_count(&self) -> usize {
        self.consumers.len()
    }

    pub fn counters(&self, id: ConsumerId) -> Option<ConsumerCounters> {
        self.consumers.iter().find(|c| c.id == id).map(|c| c.counters)
    }

    /// Every consumer's counters, present and departed, by id.
    pub fn all_counters(&self) -> Vec<(ConsumerId, ConsumerCounters)> {
        let mut all = self.departed.clone();
        all.extend(self.consumers.iter().map(|c| (c.id, c.counters)));
        all.sort_by_key(|(id, _)| *id);
        all
    }

    /// Finds room for a slot of `len` bytes, taking back space as the policies allow.
    pub fn reserve(&mut self, len: u64, now: Instant) -> Reserve {
        let len = len.div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        if len > self.capacity || len == 0 {
            return Reserve::TooLarge;
        }
        // A `Hold` consumer with a full window is waited for too, up to the bound of the
        // oldest slot it holds; after that it skips this slice (counted in `offer`).
        let window_wait = self
            .consumers
            .iter()
            .filter(|c| c.outstanding >= c.window)
            .filter_map(|c| {
                let Policy::Hold { max } = c.policy else { return None };
                let oldest = self.slots.iter().find(|s| s.holders.contains(&c.id))?;
                Some(oldest.offered_at + max)
            })
            .filter(|until| now < *until)
            .min();
        if let Some(until) = window_wait {
            return Reserve::Wait { until };
        }
        loop {
            let pad = if self.head + len > self.capacity { self.capacity - self.head } else { 0 };
            if self.used + pad + len <= self.capacity {
                let offset = if pad > 0 { 0 } else { self.head };
                let seq = self.next_seq;
                // Padding belongs to the new slot: it is freed with it.
                self.slots.push_back(Slot { seq, span: pad + len, offered_at: now, holders: Vec::new() });
                self.used += pad + len;
                self.head = offset + len;
                if self.head == self.capacity {
                    self.head = 0;
                }
                self.next_seq += 1;
                return Reserve::Ready { seq, offset, reclaimed_below: self.reclaimed_below };
            }
            // The oldest slot must go.
            let oldest = self.slots.front().expect("used > 0 means a slot is live");
            let deadline = oldest
                .holders
                .iter()
                .filter_map(|h| match self.consumers.iter().find(|c| c.id == *h)?.policy {
                    Policy::Hold { max } => Some(oldest.offered_at + max),
                    Policy::Skip => None,
                })
                .max();
            if let Some(until) = deadline
                && now < until
            {
                return Reserve::Wait { until };
            }
            let s = self.slots.pop_front().expect("checked above");
            for h in &s.holders {
                if let Some(c) = self.consumers.iter_mut().find(|c| c.id == *h) {
                    c.counters.overrun += 1;
                    c.outstanding -= 1;
                }
            }
            self.used -= s.span;
            self.reclaimed_below = s.seq + 1;
        }
    }

    /// The slot `seq` just reserved is written: offers it to every consumer with room in its
    /// window (the others count a skip). Returns the recipients.
    pub fn offer(&mut self, seq: u64) -> Vec<ConsumerId> {
        let Some(slot) = self.slots.iter_mut().rev().find(|s| s.seq == seq) else {
            return Vec::new();
        };
        for c in &mut self.consumers {
            if c.outstanding < c.window {
                c.outstanding += 1;
                c.counters.offered += 1;
                slot.holders.push(c.id);
            } else {
                c.counters.skipped += 1;
            }
        }
        let recipients = slot.holders.clone();
        self.reclaim_released();
        recipients
    }

    /// The latest time a `Hold` consumer may still release a slot it holds (`None`: no
    /// `Hold` consumer holds anything). At the end of a run the ring waits until then.
    pub fn hold_deadline(&self) -> Option<Instant> {
        self.slots
            .iter()
            .flat_map(|s| {
                s.holders.iter().filter_map(|h| match self.consumers.iter().find(|c| c.id == *h)?.policy {
                    Policy::Hold { max } => Some(s.offered_at + max),
                    Policy::Skip => None,
                })
            })
            .max()
    }

    /// Counts a skip for every consumer (a slice not published at all, e.g. too large).
    pub fn skip_all(&mut self) {
        for c in &mut self.consumers {
            c.counters.skipped += 1;
        }
    }

    /// Consumer `id` is done with slot `seq`.
    pub fn release(&mut self, id: ConsumerId, seq: u64) -> Released {
        let Some(c) = self.consumers.iter_mut().find(|c| c.id == id) else {
            return Released::NotHeld;
        };
        if let Some(s) = self.slots.iter_mut().find(|s| s.seq == seq)
            && let Some(at) = s.holders.iter().position(|h| *h == id)
        {
            s.holders.swap_remove(at);
            c.outstanding -= 1;
            c.counters.released += 1;
            self.reclaim_released();
            return Released::InTime;
        }
        if seq < self.reclaimed_below { Released::Overrun } else { Released::NotHeld }
    }

    /// Frees released slots from the oldest on (the newest slot's space is kept until the
    /// next reservation needs it only if someone holds it).
    fn reclaim_released(&mut self) {
        while let Some(s) = self.slots.front() {
            if !s.holders.is_empty() {
                break;
            }
            self.used -= s.span;
            self.slots.pop_front();
        }
        if self.slots.is_empty() {
            // Nothing live: start again at 0 so that large slots need no padding.
            self.head = 0;
        }
    }
}

/// The shared memory's format: a control header, then the ring's data area of slots.
pub mod layout {
    /// `"SHOALRNG"` little-endian.
    pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"SHOALRNG");
    /// `"SLCE"`.
    pub const SLOT_MAGIC: u32 = u32::from_le_bytes(*b"SLCE");
    pub const VERSION: u32 = 1;
    /// The control header takes one page; the data area follows.
    pub const CONTROL_LEN: u64 = 4096;
    /// Offset of the `reclaimed_below` u64 in the control header (8-aligned, written with
    /// release ordering before space is reused, read with acquire ordering after reading).
    pub const RECLAIMED_BELOW_AT: usize = 32;
    pub const SLOT_HEADER_LEN: usize = 64;
    pub const FRAGMENT_ENTRY_LEN: usize = 32;

    /// Control header (offset 0): magic u64, version u32, control_len u32, data_len u64,
    /// builder u32, reserved u32, reclaimed_below u64 (at 32), run u64 (at 40).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Control {
        pub data_len: u64,
        pub builder: u32,
        pub run: u64,
    }

    impl Control {
        pub fn encode(&self, out: &mut [u8]) {
            out[..48].fill(0);
            out[0..8].copy_from_slice(&RING_MAGIC.to_le_bytes());
            out[8..12].copy_from_slice(&VERSION.to_le_bytes());
            out[12..16].copy_from_slice(&(CONTROL_LEN as u32).to_le_bytes());
            out[16..24].copy_from_slice(&self.data_len.to_le_bytes());
            out[24..28].copy_from_slice(&self.builder.to_le_bytes());
            out[40..48].copy_from_slice(&self.run.to_le_bytes());
        }

        pub fn decode(b: &[u8]) -> Result<Control, LayoutError> {
            if b.len() < 48 {
                return Err(LayoutError::Short);
            }
            if u64::from_le_bytes(b[0..8].try_into().unwrap()) != RING_MAGIC {
                return Err(LayoutError::BadMagic);
            }
            let version = u32::from_le_bytes(b[8..12].try_into().unwrap());
            if version != VERSION {
                return Err(LayoutError::Version(version));
            }
            Ok(Control {
                data_len: u64::from_le_bytes(b[16..24].try_into().unwrap()),
                builder: u32::from_le_bytes(b[24..28].try_into().unwrap()),
                run: u64::from_le_bytes(b[40..48].try_into().unwrap()),
            })
        }
    }

    /// One fragment of a published slice.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct FragmentEntry {
        pub source: u32,
        pub flags: u16,
        pub hit_count: u32,
        /// Payload offset from the slot's start (8-aligned).
        pub offset: u64,
        pub len: u64,
    }

    /// A slot's header (64 bytes): magic u32, version u16, reserved u16, fragment_count u32,
    /// reserved u32, seq u64, slice u64, slice_start_ns u64, slice_ns u64, slot_len u64,
    /// payload_bytes u64. The fragment table (32 bytes per entry: source u32, flags u16,
    /// reserved u16, hit_count u32, reserved u32, offset u64, len u64) follows, then the
    /// payloads.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct SlotHeader {
        pub fragment_count: u32,
        pub seq: u64,
        pub slice: u64,
        pub slice_start_ns: u64,
        pub slice_ns: u64,
        pub slot_len: u64,
        pub payload_bytes: u64,
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
    pub enum LayoutError {
        #[error("shorter than its header")]
        Short,
        #[error("bad magic")]
        BadMagic,
        #[error("format version {0}, this build reads 1")]
        Version(u32),
        #[error("a fragment lies outside its slot")]
        OutOfSlot,
    }

    /// Bytes a slot of these payload lengths takes.
    pub fn slot_len(payload_lens: impl Iterator<Item = usize>) -> u64 {
        let mut n = 0u64;
        let mut len = 0u64;
        for l in payload_lens {
            n += 1;
            len += (l as u64).div_ceil(8) * 8;
        }
        SLOT_HEADER_LEN as u64 + n * FRAGMENT_ENTRY_LEN as u64 + len
    }

    /// Writes slot `seq` of slice `slice` into `out` (exactly [`slot_len`] bytes): the header,
    /// the table and the payloads (`source, flags, hit_count, payload`). One copy of each
    /// payload; nothing else is allocated. Returns the header written.
    pub fn write_slot(
        out: &mut [u8],
        seq: u64,
        (slice, slice_start_ns, slice_ns): (u64, u64, u64),
        fragments: &[(u32, u16, u32, &[u8])],
    ) -> SlotHeader {
        let head = SlotHeader {
            fragment_count: fragments.len() as u32,
            seq,
            slice,
            slice_start_ns,
            slice_ns,
            slot_len: out.len() as u64,
            payload_bytes: fragments.iter().map(|f| f.3.len() as u64).sum(),
        };
        let table_end = SLOT_HEADER_LEN + fragments.len() * FRAGMENT_ENTRY_LEN;
        let mut at = table_end;
        for (i, (source, flags, hit_count, payload)) in fragments.iter().enumerate() {
            let e = &mut out[SLOT_HEADER_LEN + i * FRAGMENT_ENTRY_LEN..][..FRAGMENT_ENTRY_LEN];
            e.fill(0);
            e[0..4].copy_from_slice(&source.to_le_bytes());
            e[4..6].copy_from_slice(&flags.to_le_bytes());
            e[8..12].copy_from_slice(&hit_count.to_le_bytes());
            e[16..24].copy_from_slice(&(at as u64).to_le_bytes());
            e[24..32].copy_from_slice(&(payload.len() as u64).to_le_bytes());
            out[at..at + payload.len()].copy_from_slice(payload);
            at += payload.len().div_ceil(8) * 8;
        }
        let h = &mut out[..SLOT_HEADER_LEN];
        h.fill(0);
        h[0..4].copy_from_slice(&SLOT_MAGIC.to_le_bytes());
        h[4..6].copy_from_slice(&(VERSION as u16).to_le_bytes());
        h[8..12].copy_from_slice(&head.fragment_count.to_le_bytes());
        h[16..24].copy_from_slice(&head.seq.to_le_bytes());
        h[24..32].copy_from_slice(&head.slice.to_le_bytes());
        h[32..40].copy_from_slice(&head.slice_start_ns.to_le_bytes());
        h[40..48].copy_from_slice(&head.slice_ns.to_le_bytes());
        h[48..56].copy_from_slice(&head.slot_len.to_le_bytes());
        h[56..64].copy_from_slice(&head.payload_bytes.to_le_bytes());
        head
    }

    fn u64_at(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
    }
    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    /// Reads a slot's header and checks its fragment table against `slot` (the slot's bytes).
    pub fn read_slot(slot: &[u8]) -> Result<(SlotHeader, Vec<FragmentEntry>), LayoutError> {
        if slot.len() < SLOT_HEADER_LEN {
            return Err(LayoutError::Short);
        }
        if u32_at(slot, 0) != SLOT_MAGIC {
            return Err(LayoutError::BadMagic);
        }
        let version = u16::from_le_bytes([slot[4], slot[5]]) as u32;
        if version != VERSION {
            return Err(LayoutError::Version(version));
        }
        let head = SlotHeader {
            fragment_count: u32_at(slot, 8),
            seq: u64_at(slot, 16),
            slice: u64_at(slot, 24),
            slice_start_ns: u64_at(slot, 32),
            slice_ns: u64_at(slot, 40),
            slot_len: u64_at(slot, 48),
            payload_bytes: u64_at(slot, 56),
        };
        let n = head.fragment_count as usize;
        let table_end = n.checked_mul(FRAGMENT_ENTRY_LEN).and_then(|t| t.checked_add(SLOT_HEADER_LEN));
        if table_end.is_none_or(|t| t > slot.len()) {
            return Err(LayoutError::OutOfSlot);
        }
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let e = &slot[SLOT_HEADER_LEN + i * FRAGMENT_ENTRY_LEN..][..FRAGMENT_ENTRY_LEN];
            let f = FragmentEntry {
                source: u32_at(e, 0),
                flags: u16::from_le_bytes([e[4], e[5]]),
                hit_count: u32_at(e, 8),
                offset: u64_at(e, 16),
                len: u64_at(e, 24),
            };
            if f.offset.checked_add(f.len).is_none_or(|end| end > slot.len() as u64) {
                return Err(LayoutError::OutOfSlot);
            }
            out.push(f);
        }
        Ok((head, out))
    }
}

/// Messages on a consumer's socket (`SOCK_SEQPACKET`): 48 bytes each, little-endian,
/// `kind u32, version u32, a u64, b u64, c u64, d u64, e u64`.
pub mod msg {
    pub const LEN: usize = 48;
    pub const VERSION: u32 = 1;

    /// The message kinds and what their fields hold.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Msg {
        /// Consumer to builder, first: `policy` 0 = hold, 1 = skip; `hold_ms`; `window`.
        Hello { policy: u32, hold_ms: u64, window: u64 },
        /// Builder to consumer, with the memfd attached: run, builder, mapping length.
        Welcome { run: u64, builder: u64, map_len: u64 },
        /// A slice to read: its sequence number, offset in the mapping, length, number.
        Slice { seq: u64, offset: u64, len: u64, slice: u64 },
        /// Consumer to builder: done with `seq`.
        Release { seq: u64 },
        /// Builder to consumer, last: the run ended; this consumer's counters.
        End { offered: u64, skipped: u64, overrun: u64 },
        /// A filter worker to its builder: slice `seq` filtered, `events` events in `bytes`
        /// bytes at the start of its results memfd (attached when it is new); `refused`
        /// events the worker's own checks refused (a C plug-in's malformed events).
        Done { seq: u64, events: u64, bytes: u64, refused: u64 },
        /// A Python filter worker to its builder: the filter raised on slice `seq` (the
        /// traceback is on the worker's stderr).
        Failed { seq: u64 },
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
    pub enum MsgError {
        #[error("message of {0} bytes, expected 48")]
        Length(usize),
        #[error("protocol version {0}, this build speaks 1")]
        Version(u32),
        #[error("unknown message kind {0}")]
        Kind(u32),
    }

    impl Msg {
        pub fn encode(&self) -> [u8; LEN] {
            let (kind, f): (u32, [u64; 5]) = match *self {
                Msg::Hello { policy, hold_ms, window } => (1, [policy as u64, hold_ms, window, 0, 0]),
                Msg::Welcome { run, builder, map_len } => (2, [run, builder, map_len, 0, 0]),
                Msg::Slice { seq, offset, len, slice } => (3, [seq, offset, len, slice, 0]),
                Msg::Release { seq } => (4, [seq, 0, 0, 0, 0]),
                Msg::End { offered, skipped, overrun } => (5, [offered, skipped, overrun, 0, 0]),
                Msg::Done { seq, events, bytes, refused } => (6, [seq, events, bytes, refused, 0]),
                Msg::Failed { seq } => (7, [seq, 0, 0, 0, 0]),
            };
            let mut b = [0u8; LEN];
            b[0..4].copy_from_slice(&kind.to_le_bytes());
            b[4..8].copy_from_slice(&VERSION.to_le_bytes());
            for (i, v) in f.iter().enumerate() {
                b[8 + 8 * i..16 + 8 * i].copy_from_slice(&v.to_le_bytes());
            }
            b
        }

        pub fn decode(b: &[u8]) -> Result<Msg, MsgError> {
            if b.len() != LEN {
                return Err(MsgError::Length(b.len()));
            }
            let kind = u32::from_le_bytes(b[0..4].try_into().unwrap());
            let version = u32::from_le_bytes(b[4..8].try_into().unwrap());
            if version != VERSION {
                return Err(MsgError::Version(version));
            }
            let f = |i: usize| u64::from_le_bytes(b[8 + 8 * i..16 + 8 * i].try_into().unwrap());
            Ok(match kind {
                1 => Msg::Hello { policy: f(0) as u32, hold_ms: f(1), window: f(2) },
                2 => Msg::Welcome { run: f(0), builder: f(1), map_len: f(2) },
                3 => Msg::Slice { seq: f(0), offset: f(1), len: f(2), slice: f(3) },
                4 => Msg::Release { seq: f(0) },
                5 => Msg::End { offered: f(0), skipped: f(1), overrun: f(2) },
                6 => Msg::Done { seq: f(0), events: f(1), bytes: f(2), refused: f(3) },
                7 => Msg::Failed { seq: f(0) },
                k => return Err(MsgError::Kind(k)),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: u64) -> Instant {
        Instant::from_nanos(ms * 1_000_000)
    }

    fn ready(r: Reserve) -> (u64, u64) {
        match r {
            Reserve::Ready { seq, offset, .. } => (seq, offset),
            other => panic!("expected Ready, got {other:?}"),
        }
    }

    #[test]
    fn released_slots_are_reused_in_order() {
        let mut r = RingLedger::new(1024);
        let c = r.add_consumer(Policy::Hold { max: Duration::from_millis(100) }, 8);
        let (s1, o1) = ready(r.reserve(400, t(0)));
        assert_eq!(r.offer(s1), vec![c]);
        let (s2, o2) = ready(r.reserve(400, t(0)));
        r.offer(s2);
        assert_eq!((o1, o2), (0, 448));
        // Full: the oldest is held within its bound.
        assert_eq!(r.reserve(400, t(10)), Reserve::Wait { until: t(100) });
        assert_eq!(r.release(c, s1), Released::InTime);
        // 448..896 is held; 896..1024 too small: padding, then offset 0.
        let (s3, o3) = ready(r.reserve(400, t(10)));
        assert_eq!(o3, 0);
        r.offer(s3);
        assert_eq!(r.release(c, s2), Released::InTime);
        assert_eq!(r.release(c, s3), Released::InTime);
        assert_eq!(r.counters(c).unwrap(), ConsumerCounters { offered: 3, released: 3, skipped: 0, overrun: 0 });
        assert_eq!(r.reclaimed_below(), 1, "nothing was taken back");
    }

    #[test]
    fn hold_bound_expires_into_an_overrun() {
        let mut r = RingLedger::new(1024);
        let c = r.add_consumer(Policy::Hold { max: Duration::from_millis(100) }, 8);
        let (s1, _) = ready(r.reserve(600, t(0)));
        r.offer(s1);
        assert!(matches!(r.reserve(600, t(50)), Reserve::Wait { .. }));
        let (s2, _) = ready(r.reserve(600, t(100)));
        assert_eq!(r.reclaimed_below(), s1 + 1);
        r.offer(s2);
        assert_eq!(r.release(c, s1), Released::Overrun);
        assert_eq!(r.release(c, s2), Released::InTime);
        assert_eq!(r.counters(c).unwrap().overrun, 1);
        assert_eq!(r.release(c, 99), Released::NotHeld);
    }

    #[test]
    fn skip_consumers_are_never_waited_for_and_skip_past_their_window() {
        let mut r = RingLedger::new(1024);
        let slow = r.add_consumer(Policy::Skip, 1);
        let (s1, _) = ready(r.reserve(300, t(0)));
        assert_eq!(r.offer(s1), vec![slow]);
        let (s2, _) = ready(r.reserve(300, t(0)));
        assert!(r.offer(s2).is_empty(), "window of one is full");
        assert_eq!(r.counters(slow).unwrap().skipped, 1);
        // s2 is free (nobody took it) and reclaimed only behind s1; the ring takes s1 back.
        let (s3, _) = ready(r.reserve(500, t(1)));
        assert_eq!(r.release(slow, s1), Released::Overrun);
        assert_eq!(r.offer(s3), vec![slow]);
    }

    #[test]
    fn a_hold_consumer_with_a_full_window_is_waited_for_then_skipped() {
        let mut r = RingLedger::new(1 << 20);
        let c = r.add_consumer(Policy::Hold { max: Duration::from_millis(100) }, 1);
        let (s1, _) = ready(r.reserve(100, t(0)));
        r.offer(s1);
        assert_eq!(r.reserve(100, t(5)), Reserve::Wait { until: t(100) });
        let (s2, _) = ready(r.reserve(100, t(100)));
        assert!(r.offer(s2).is_empty());
        assert_eq!(r.counters(c).unwrap().skipped, 1);
        assert_eq!(r.hold_deadline(), Some(t(100)));
        assert_eq!(r.release(c, s1), Released::InTime);
        assert_eq!(r.hold_deadline(), None);
        let (s3, _) = ready(r.reserve(100, t(101)));
        assert_eq!(r.offer(s3), vec![c]);
    }

    #[test]
    fn departed_consumers_free_their_slots() {
        let mut r = RingLedger::new(1024);
        let a = r.add_consumer(Policy::Hold { max: Duration::from_secs(10) }, 4);
        let (s1, _) = ready(r.reserve(1000, t(0)));
        r.offer(s1);
        assert!(matches!(r.reserve(1000, t(1)), Reserve::Wait { .. }));
        r.remove_consumer(a);
        let (s2, o) = ready(r.reserve(1000, t(1)));
        assert_eq!((s2, o), (2, 0));
        assert_eq!(r.reserve(2000, t(1)), Reserve::TooLarge);
        assert_eq!(r.all_counters()[0].1.offered, 1);
    }

    #[test]
    fn slot_layout_round_trips_and_rejects_tables_outside_the_slot() {
        let frags: Vec<(u32, u16, u32, &[u8])> =
            vec![(3, 1, 1, &[1, 2, 3, 4, 5, 6]), (7, 0, 0, &[]), (9, 4, 2, &[9; 12])];
        let len = layout::slot_len(frags.iter().map(|f| f.3.len())) as usize;
        let mut buf = vec![0u8; len];
        let head = layout::write_slot(&mut buf, 5, (42, 7, 100), &frags);
        assert_eq!((head.fragment_count, head.slot_len, head.payload_bytes), (3, len as u64, 18));
        let (h, entries) = layout::read_slot(&buf).unwrap();
        assert_eq!(h, head);
        for (e, f) in entries.iter().zip(&frags) {
            assert_eq!((e.source, e.flags, e.hit_count), (f.0, f.1, f.2));
            assert_eq!(&buf[e.offset as usize..][..e.len as usize], f.3);
            assert_eq!(e.offset % 8, 0);
        }
        assert_eq!(layout::read_slot(&buf[..100]), Err(layout::LayoutError::OutOfSlot));
        buf[0] ^= 1;
        assert_eq!(layout::read_slot(&buf), Err(layout::LayoutError::BadMagic));
    }

    #[test]
    fn messages_round_trip_and_bad_ones_are_named() {
        use msg::Msg;
        for m in [
            Msg::Hello { policy: 1, hold_ms: 500, window: 4 },
            Msg::Welcome { run: 7, builder: 2, map_len: 1 << 26 },
            Msg::Slice { seq: 9, offset: 4096, len: 1000, slice: 77 },
            Msg::Release { seq: 9 },
            Msg::End { offered: 10, skipped: 2, overrun: 1 },
            Msg::Done { seq: 3, events: 2, bytes: 40, refused: 1 },
            Msg::Failed { seq: 4 },
        ] {
            assert_eq!(Msg::decode(&m.encode()), Ok(m));
        }
        assert_eq!(Msg::decode(&[0; 10]), Err(msg::MsgError::Length(10)));
        let mut b = Msg::Release { seq: 1 }.encode();
        b[0] = 99;
        assert_eq!(Msg::decode(&b), Err(msg::MsgError::Kind(99)));
    }
}
