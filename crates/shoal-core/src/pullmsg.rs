//! Pull control messages (specified in `docs/wire-format.md`, "Pull control frames").
//!
//! They travel as ordinary v1 frames with one control flag set, so every stream keeps one
//! checked decoder ([`crate::frame::StreamDecoder`]) and a receiver tells them from data by
//! the flag. [`PullMessage::from_frame`] checks what the frame decoder cannot: exactly one
//! control flag, the payload shape of each kind, and counts that fit the payload.

use bytes::{BufMut, Bytes, BytesMut};

use crate::frame::{self, Flags, Frame, FrameHeader};
use crate::slice::SliceNumber;
use crate::{BuilderId, Instant, SourceId};

/// The `slice` of a credit frame that returns no slice (a heartbeat with memory only).
pub const NO_SLICE: SliceNumber = u64::MAX;

/// A hello's `slice` field says who greets: a source (on a data connection) or a builder
/// (to the data-flow manager).
pub const HELLO_FROM_SOURCE: u64 = 0;
pub const HELLO_FROM_BUILDER: u64 = 1;

/// Most slices a hello may list (the assigned-slice history plus open slices).
pub const MAX_HELLO_SLICES: usize = 2 * crate::node::ASSIGNED_HISTORY;

/// One pull control message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PullMessage {
    /// Source to builder, once per hosted source after connecting: requests for `source`
    /// go back on this connection.
    SourceHello { source: SourceId },
    /// Builder to manager after (re)connecting: the slices assigned to it and not yet
    /// processed, then its recent assignments (for a restarted manager).
    BuilderHello { builder: BuilderId, open: Vec<SliceNumber>, history: Vec<SliceNumber> },
    /// Builder to source: send your fragment of `slice` of `source` (on this connection).
    Request { source: SourceId, slice: SliceNumber },
    /// Manager to builder: `slice` is yours.
    Assign { builder: BuilderId, slice: SliceNumber },
    /// Builder to manager: `slice` is processed (its credit is free) or, with `None`, a
    /// heartbeat; `memory` is the builder's bytes in use.
    Credit { builder: BuilderId, slice: Option<SliceNumber>, memory: u64 },
}

/// Why a control frame is malformed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PullMessageError {
    #[error("control frame with flags {0:#06x}: exactly one control flag and nothing else expected")]
    BadFlags(u16),
    #[error("{kind} frame with a {len}-byte payload (expected {expected})")]
    BadPayload { kind: &'static str, len: usize, expected: &'static str },
    #[error("hello lists {open} open slices but carries {listed}")]
    BadCount { open: u32, listed: usize },
    #[error("hello of unknown kind {0} (0: from a source, 1: from a builder)")]
    BadHelloKind(u64),
}

impl PullMessageError {
    /// Stable short name for counters and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            PullMessageError::BadFlags(_) => "bad_control_flags",
            PullMessageError::BadPayload { .. } => "bad_control_payload",
            PullMessageError::BadCount { .. } => "bad_hello_count",
            PullMessageError::BadHelloKind(_) => "bad_hello_kind",
        }
    }
}

fn header(flags: Flags, id: u32, slice: SliceNumber, hit_count: u32) -> FrameHeader {
    FrameHeader {
        flags,
        source: id,
        hit_count,
        slice,
        slice_start: Instant::ZERO,
        send_time: Instant::ZERO,
        payload_len: 0,
    }
}

impl PullMessage {
    /// The whole frame.
    pub fn encode(&self) -> Bytes {
        match self {
            PullMessage::SourceHello { source } => {
                frame::encode(&header(Flags::HELLO, *source, HELLO_FROM_SOURCE, 0), &[])
            }
            PullMessage::BuilderHello { builder, open, history } => {
                let mut p = BytesMut::with_capacity(8 * (open.len() + history.len()));
                for s in open.iter().chain(history) {
                    p.put_u64_le(*s);
                }
                frame::encode(&header(Flags::HELLO, *builder, HELLO_FROM_BUILDER, open.len() as u32), &p)
            }
            PullMessage::Request { source, slice } => frame::encode(&header(Flags::REQUEST, *source, *slice, 0), &[]),
            PullMessage::Assign { builder, slice } => frame::encode(&header(Flags::ASSIGN, *builder, *slice, 0), &[]),
            PullMessage::Credit { builder, slice, memory } => {
                let h = header(Flags::CREDIT, *builder, slice.unwrap_or(NO_SLICE), 0);
                frame::encode(&h, &memory.to_le_bytes())
            }
        }
    }

    /// `Ok(None)`: not a control frame (data, events, end of stream). Errors: a control
    /// frame that breaks its kind's rules.
    pub fn from_frame(f: &Frame) -> Result<Option<PullMessage>, PullMessageError> {
        let h = &f.header;
        if !h.flags.intersects(Flags::CONTROL) {
            return Ok(None);
        }
        let bad_payload = |kind, expected| PullMessageError::BadPayload { kind, len: f.payload.len(), expected };
        let only = |flag: Flags| h.flags == flag;
        let slices = |p: &[u8]| -> Vec<SliceNumber> {
            p.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
        };
        if only(Flags::HELLO) {
            let len = f.payload.len();
            if h.slice == HELLO_FROM_SOURCE {
                if len != 0 || h.hit_count != 0 {
                    return Err(bad_payload("source hello", "0"));
                }
                return Ok(Some(PullMessage::SourceHello { source: h.source }));
            }
            if h.slice != HELLO_FROM_BUILDER {
                return Err(PullMessageError::BadHelloKind(h.slice));
            }
            if !len.is_multiple_of(8) || len / 8 > MAX_HELLO_SLICES {
                return Err(bad_payload("hello", "a multiple of 8 bytes, at most 2 x 4096 slices"));
            }
            let mut all = slices(&f.payload);
            if h.hit_count as usize > all.len() {
                return Err(PullMessageError::BadCount { open: h.hit_count, listed: all.len() });
            }
            let history = all.split_off(h.hit_count as usize);
            return Ok(Some(PullMessage::BuilderHello { builder: h.source, open: all, history }));
        }
        if only(Flags::REQUEST) || only(Flags::ASSIGN) {
            if !f.payload.is_empty() || h.hit_count != 0 {
                return Err(bad_payload(if only(Flags::REQUEST) { "request" } else { "assign" }, "0"));
            }
            return Ok(Some(if only(Flags::REQUEST) {
                PullMessage::Request { source: h.source, slice: h.slice }
            } else {
                PullMessage::Assign { builder: h.source, slice: h.slice }
            }));
        }
        if only(Flags::CREDIT) {
            let memory: [u8; 8] = f.payload[..].try_into().map_err(|_| bad_payload("credit", "8"))?;
            let slice = (h.slice != NO_SLICE).then_some(h.slice);
            return Ok(Some(PullMessage::Credit { builder: h.source, slice, memory: u64::from_le_bytes(memory) }));
        }
        Err(PullMessageError::BadFlags(h.flags.bits()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip(m: &PullMessage) -> PullMessage {
        let bytes = m.encode();
        let (f, used) = frame::decode(&bytes, 1 << 20).expect("a valid frame");
        assert_eq!(used, bytes.len());
        PullMessage::from_frame(&f).expect("valid").expect("a control frame")
    }

    #[test]
    fn every_kind_round_trips() {
        for m in [
            PullMessage::SourceHello { source: 7 },
            PullMessage::BuilderHello { builder: 2, open: vec![10, 12], history: vec![4, 6, 8, 10, 12] },
            PullMessage::BuilderHello { builder: 2, open: vec![], history: vec![3] },
            PullMessage::BuilderHello { builder: 0, open: vec![], history: vec![] },
            PullMessage::Request { source: 3, slice: 99 },
            PullMessage::Assign { builder: 1, slice: 1 << 40 },
            PullMessage::Credit { builder: 1, slice: Some(5), memory: 123 },
            PullMessage::Credit { builder: 1, slice: None, memory: 0 },
        ] {
            assert_eq!(roundtrip(&m), m);
        }
    }

    #[test]
    fn data_frames_are_not_control_frames() {
        let f = Frame { header: header(Flags::BURST, 1, 2, 0), payload: Bytes::new() };
        assert_eq!(PullMessage::from_frame(&f), Ok(None));
    }

    #[test]
    fn malformed_control_frames_are_refused() {
        let two = Frame { header: header(Flags::REQUEST | Flags::ASSIGN, 1, 2, 0), payload: Bytes::new() };
        assert_eq!(PullMessage::from_frame(&two).unwrap_err().kind(), "bad_control_flags");
        let mixed = Frame { header: header(Flags::REQUEST | Flags::BURST, 1, 2, 0), payload: Bytes::new() };
        assert_eq!(PullMessage::from_frame(&mixed).unwrap_err().kind(), "bad_control_flags");
        let short = Frame { header: header(Flags::CREDIT, 1, 2, 0), payload: Bytes::from_static(&[1, 2]) };
        assert_eq!(PullMessage::from_frame(&short).unwrap_err().kind(), "bad_control_payload");
        let count =
            Frame { header: header(Flags::HELLO, 1, HELLO_FROM_BUILDER, 3), payload: Bytes::from(vec![0u8; 16]) };
        assert_eq!(PullMessage::from_frame(&count).unwrap_err().kind(), "bad_hello_count");
    }

    proptest! {
        /// Any header fields and payload: a verdict, never a panic.
        #[test]
        fn any_control_frame_gets_a_verdict(bits in 0u16..0x200, id: u32, hits: u32, slice: u64, payload in proptest::collection::vec(any::<u8>(), 0..64)) {
            let f = Frame { header: header(Flags::from_bits(bits).unwrap(), id, slice, hits), payload: Bytes::from(payload) };
            let _ = PullMessage::from_frame(&f);
        }
    }
}
