//! Filtered events and their wire encoding: the payload of an `EVENTS` frame (wire
//! format, beside [`crate::frame`]).
//!
//! Encoding (little-endian): per event `id u32, trigger_mask u32, overlays u32, n_hits u32`, then
//! `n_hits` records of 11 bytes: `source u32, channel u8, time_ns u32, amplitude u8,
//! flags u8` (bit 0: the hit took part in the trigger).

use crate::SourceId;
use crate::hit::Hit;
use bytes::{Buf, BufMut, Bytes, BytesMut};

const EVENT_HEADER_LEN: usize = 16;
const EVENT_HIT_LEN: usize = 11;

/// A hit inside an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventHit {
    pub source: SourceId,
    pub channel: u8,
    /// ns since the slice start.
    pub time_ns: u32,
    pub amplitude: u8,
    /// Took part in the trigger decision (otherwise a snapshot hit).
    pub triggered: bool,
}

impl EventHit {
    pub fn from_hit(source: SourceId, h: Hit, triggered: bool) -> Self {
        Self { source, channel: h.channel, time_ns: h.time_ns, amplitude: h.amplitude, triggered }
    }
}

/// A selected event: the hits around a trigger, within one slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// Index of the event within its slice.
    pub id: u32,
    /// Which triggers fired (bit 0: L1 multiplicity, bit 1: causality cluster, bit 2:
    /// direction scan).
    pub trigger_mask: u32,
    /// Further triggers merged into this event because their windows overlapped.
    pub overlays: u32,
    /// Hits sorted by time.
    pub hits: Vec<EventHit>,
}

impl Event {
    pub fn first_time_ns(&self) -> Option<u32> {
        self.hits.iter().map(|h| h.time_ns).min()
    }
    pub fn triggered_hits(&self) -> usize {
        self.hits.iter().filter(|h| h.triggered).count()
    }
}

/// Encodes events for an `EVENTS` frame payload.
pub fn encode_events(events: &[Event]) -> Bytes {
    let n: usize = events.iter().map(|e| EVENT_HEADER_LEN + e.hits.len() * EVENT_HIT_LEN).sum();
    let mut b = BytesMut::with_capacity(n);
    for e in events {
        b.put_u32_le(e.id);
        b.put_u32_le(e.trigger_mask);
        b.put_u32_le(e.overlays);
        b.put_u32_le(e.hits.len() as u32);
        for h in &e.hits {
            b.put_u32_le(h.source);
            b.put_u8(h.channel);
            b.put_u32_le(h.time_ns);
            b.put_u8(h.amplitude);
            b.put_u8(u8::from(h.triggered));
        }
    }
    b.freeze()
}

/// Why an `EVENTS` payload is malformed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EventDecodeError {
    #[error("event {index}: header truncated")]
    TruncatedHeader { index: usize },
    #[error("event {index}: {n_hits} hits do not fit in the {left} bytes left")]
    TruncatedHits { index: usize, n_hits: u32, left: usize },
    #[error("event {index}: undefined hit flags {flags:#x}")]
    BadFlags { index: usize, flags: u8 },
}

/// Decodes an `EVENTS` frame payload; never panics on arbitrary bytes.
pub fn decode_events(mut buf: &[u8]) -> Result<Vec<Event>, EventDecodeError> {
    let mut events = Vec::new();
    while !buf.is_empty() {
        let index = events.len();
        if buf.len() < EVENT_HEADER_LEN {
            return Err(EventDecodeError::TruncatedHeader { index });
        }
        let id = buf.get_u32_le();
        let trigger_mask = buf.get_u32_le();
        let overlays = buf.get_u32_le();
        let n_hits = buf.get_u32_le();
        let need = (n_hits as usize).checked_mul(EVENT_HIT_LEN);
        if need.is_none_or(|need| need > buf.len()) {
            return Err(EventDecodeError::TruncatedHits { index, n_hits, left: buf.len() });
        }
        let mut hits = Vec::with_capacity(n_hits as usize);
        for _ in 0..n_hits {
            let source = buf.get_u32_le();
            let channel = buf.get_u8();
            let time_ns = buf.get_u32_le();
            let amplitude = buf.get_u8();
            let flags = buf.get_u8();
            if flags > 1 {
                return Err(EventDecodeError::BadFlags { index, flags });
            }
            hits.push(EventHit { source, channel, time_ns, amplitude, triggered: flags == 1 });
        }
        events.push(Event { id, trigger_mask, overlays, hits });
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn roundtrip(raw in proptest::collection::vec((any::<u32>(), proptest::collection::vec((any::<u32>(), any::<u8>(), any::<u32>(), any::<u8>(), any::<bool>()), 0..20)), 0..10)) {
            let events: Vec<Event> = raw.into_iter().enumerate().map(|(i, (mask, hits))| Event {
                id: i as u32,
                trigger_mask: mask,
                overlays: mask >> 28,
                hits: hits.into_iter().map(|(source, channel, time_ns, amplitude, triggered)| EventHit { source, channel, time_ns, amplitude, triggered }).collect(),
            }).collect();
            prop_assert_eq!(decode_events(&encode_events(&events)).unwrap(), events);
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_events(&bytes);
        }
    }

    #[test]
    fn truncation_detected() {
        let e = Event {
            id: 1,
            trigger_mask: 1,
            overlays: 0,
            hits: vec![EventHit { source: 1, channel: 2, time_ns: 3, amplitude: 4, triggered: true }],
        };
        let b = encode_events(&[e]);
        assert!(decode_events(&b[..b.len() - 1]).is_err());
        assert!(decode_events(&b[..5]).is_err());
    }
}
