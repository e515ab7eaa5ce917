//! Raw-data records: what a builder's burst saver and late-data side stream write to its
//! local spool file and then ship to the writer, as frames with the `RAW` flag.
//!
//! A record is a frame whose payload starts with a 12-byte prefix (little-endian `u32`s):
//! the builder id, the record stream (0: the late-data stream, `n >= 1`: the builder's
//! alert `n` of this run) and the kind:
//!
//! | kind | header `source` | header `slice`, `slice_start`, `hit_count` | after the prefix |
//! | --- | --- | --- | --- |
//! | 0 fragment | the fragment's source | the fragment's | the fragment's payload, byte for byte |
//! | 1 alert opened | the builder | 0 | the alert's text ([`crate::alert`]) |
//! | 2 alert closed | the builder | 0 | the builder's report, JSON |
//! | 3 slice data | the fragment's source | the fragment's | a processed slice's fragment, byte for byte (`builder.store_slices`: the run's complete data, record stream 0) |
//!
//! Byte-for-byte: a saved fragment's payload is exactly what the source sent, so a
//! deterministic generator can check it.

use bytes::{BufMut, Bytes, BytesMut};

use crate::frame::{self, Flags, Frame, FrameHeader};
use crate::slice::SliceNumber;
use crate::{Instant, SourceId};

/// Length of the record prefix.
pub const PREFIX_LEN: usize = 12;

/// What a record carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawKind {
    Fragment,
    AlertOpened,
    AlertClosed,
    /// A fragment of a processed slice, stored whole (`builder.store_slices`).
    SliceData,
}

impl RawKind {
    fn code(self) -> u32 {
        match self {
            RawKind::Fragment => 0,
            RawKind::AlertOpened => 1,
            RawKind::AlertClosed => 2,
            RawKind::SliceData => 3,
        }
    }
    fn from_code(c: u32) -> Option<Self> {
        Some(match c {
            0 => RawKind::Fragment,
            1 => RawKind::AlertOpened,
            2 => RawKind::AlertClosed,
            3 => RawKind::SliceData,
            _ => return None,
        })
    }
}

/// A decoded record: a view into its frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawRecord {
    pub head: RawHead,
    /// What follows the prefix.
    pub body: Bytes,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RawError {
    #[error("not a RAW frame")]
    NotRaw,
    #[error("payload of {0} bytes is shorter than the {PREFIX_LEN}-byte record prefix")]
    TooShort(usize),
    #[error("unknown record kind {0}")]
    UnknownKind(u32),
    #[error("a description record must carry no hits")]
    DescriptionWithHits,
}

impl RawError {
    pub fn kind(&self) -> &'static str {
        match self {
            RawError::NotRaw => "not_raw",
            RawError::TooShort(_) => "raw_too_short",
            RawError::UnknownKind(_) => "raw_unknown_kind",
            RawError::DescriptionWithHits => "raw_description_with_hits",
        }
    }
}

/// Everything of a record but its body: what the frame header and prefix carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawHead {
    pub builder: u32,
    /// 0: late-data stream; otherwise the builder's alert number.
    pub record: u32,
    pub kind: RawKind,
    pub source: SourceId,
    pub slice: SliceNumber,
    pub slice_start: Instant,
    pub hit_count: u32,
}

impl RawHead {
    /// An alert description (opened or closed): from the builder itself, no slice, no hits.
    pub fn description(builder: u32, record: u32, kind: RawKind) -> Self {
        Self { builder, record, kind, source: builder, slice: 0, slice_start: Instant::ZERO, hit_count: 0 }
    }

    /// The record's frame header and payload prefix; `body` follows them unchanged (written
    /// without copying it into a frame buffer).
    pub fn encode_parts(&self, body: &[u8]) -> ([u8; frame::HEADER_LEN], [u8; PREFIX_LEN]) {
        let mut prefix = [0u8; PREFIX_LEN];
        prefix[0..4].copy_from_slice(&self.builder.to_le_bytes());
        prefix[4..8].copy_from_slice(&self.record.to_le_bytes());
        prefix[8..12].copy_from_slice(&self.kind.code().to_le_bytes());
        let crc = crate::checksum::crc32c_append(crate::checksum::crc32c(&prefix), body);
        let header = FrameHeader {
            flags: Flags::RAW,
            source: self.source,
            hit_count: self.hit_count,
            slice: self.slice,
            slice_start: self.slice_start,
            send_time: Instant::ZERO,
            payload_len: (PREFIX_LEN + body.len()) as u32,
        };
        (frame::encode_header_with_crc(&header, header.payload_len, crc), prefix)
    }

    /// The record as one whole frame (header and payload).
    pub fn encode(&self, body: &[u8]) -> Bytes {
        let (header, prefix) = self.encode_parts(body);
        let mut frame = BytesMut::with_capacity(header.len() + prefix.len() + body.len());
        frame.put_slice(&header);
        frame.put_slice(&prefix);
        frame.put_slice(body);
        frame.freeze()
    }
}

impl RawRecord {
    /// Reads a decoded frame as a record.
    pub fn from_frame(f: &Frame) -> Result<RawRecord, RawError> {
        if !f.header.flags.contains(Flags::RAW) {
            return Err(RawError::NotRaw);
        }
        let p = &f.payload;
        if p.len() < PREFIX_LEN {
            return Err(RawError::TooShort(p.len()));
        }
        let word = |i: usize| u32::from_le_bytes(p[i..i + 4].try_into().expect("4 bytes"));
        let kind = RawKind::from_code(word(8)).ok_or(RawError::UnknownKind(word(8)))?;
        if !matches!(kind, RawKind::Fragment | RawKind::SliceData) && f.header.hit_count != 0 {
            return Err(RawError::DescriptionWithHits);
        }
        let head = RawHead {
            builder: word(0),
            record: word(4),
            kind,
            source: f.header.source,
            slice: f.header.slice,
            slice_start: f.header.slice_start,
            hit_count: f.header.hit_count,
        };
        Ok(RawRecord { head, body: p.slice(PREFIX_LEN..) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fragment_round_trips_byte_for_byte() {
        let body = [1u8, 2, 3, 4, 5, 6];
        let head = RawHead {
            builder: 3,
            record: 2,
            kind: RawKind::Fragment,
            source: 17,
            slice: 99,
            slice_start: Instant::from_nanos(5),
            hit_count: 1,
        };
        let bytes = head.encode(&body);
        let (f, used) = frame::decode(&bytes, 1 << 20).unwrap();
        assert_eq!(used, bytes.len());
        let r = RawRecord::from_frame(&f).unwrap();
        let h = r.head;
        assert_eq!((h.builder, h.record, h.kind, h.source, h.slice, h.hit_count), (3, 2, RawKind::Fragment, 17, 99, 1));
        assert_eq!(&r.body[..], &body);
    }

    #[test]
    fn parts_are_the_whole_frame() {
        // The frame codec's own encoding of the same payload (prefix then body): the parts,
        // whose payload CRC is chained over prefix and body, must give the same bytes.
        let body = [9u8; 100];
        let head = RawHead {
            builder: 1,
            record: 0,
            kind: RawKind::Fragment,
            source: 2,
            slice: 3,
            slice_start: Instant::from_nanos(4),
            hit_count: 0,
        };
        let payload = [&1u32.to_le_bytes()[..], &0u32.to_le_bytes(), &0u32.to_le_bytes(), &body].concat();
        let header = FrameHeader {
            flags: Flags::RAW,
            source: 2,
            hit_count: 0,
            slice: 3,
            slice_start: Instant::from_nanos(4),
            send_time: Instant::ZERO,
            payload_len: payload.len() as u32,
        };
        let whole = frame::encode(&header, &payload);
        let (header, prefix) = head.encode_parts(&body);
        assert_eq!([&header[..], &prefix[..], &body[..]].concat(), whole.to_vec());
        assert_eq!(head.encode(&body), whole);
    }

    #[test]
    fn refuses_what_is_not_a_record() {
        let events = frame::encode(
            &FrameHeader {
                flags: Flags::EVENTS,
                source: 0,
                hit_count: 0,
                slice: 0,
                slice_start: Instant::ZERO,
                send_time: Instant::ZERO,
                payload_len: 0,
            },
            &[],
        );
        let (f, _) = frame::decode(&events, 1 << 20).unwrap();
        assert_eq!(RawRecord::from_frame(&f), Err(RawError::NotRaw));
        let mut f = frame::decode(&RawHead::description(0, 0, RawKind::AlertOpened).encode(b"x"), 1 << 20).unwrap().0;
        f.payload = f.payload.slice(..4);
        assert_eq!(RawRecord::from_frame(&f), Err(RawError::TooShort(4)));
        let mut p = BytesMut::new();
        p.put_u32_le(0);
        p.put_u32_le(0);
        p.put_u32_le(9);
        f.payload = p.freeze();
        assert_eq!(RawRecord::from_frame(&f), Err(RawError::UnknownKind(9)));
    }
}
