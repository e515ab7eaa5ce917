//! The input framing: how a readout program hands fragments to a source process over a
//! stream socket (`source.input = "unix:PATH"`) or in datagrams (`"udp:ADDR"`), specified
//! byte by byte in `docs/sdk.md`.
//!
//! Every fragment is a 32-byte little-endian header followed by its payload:
//!
//! | offset | size | field |
//! | ---: | ---: | --- |
//! | 0 | 4 | magic `SHLI` |
//! | 4 | 1 | version, 1 |
//! | 5 | 1 | flags: bit 0 `time` is a slice number; bit 1 the payload is shoal hit records (`hit_count` valid); other bits 0 |
//! | 6 | 2 | reserved, 0 |
//! | 8 | 4 | source id |
//! | 12 | 4 | hit count (flag bit 1), else 0 |
//! | 16 | 8 | data time, ns (the board's clock), or the slice number (flag bit 0) |
//! | 24 | 4 | payload length |
//! | 28 | 4 | sequence number per source (datagrams: gaps are counted lost at the input) |
//!
//! Decoding untrusted bytes never panics; every failure is an [`InputFrameError`] with a
//! stable [`InputFrameError::kind`] for counters.

use bytes::{Buf, Bytes, BytesMut};

use super::{Submission, When};
use crate::SourceId;

/// The four bytes every input frame starts with.
pub const INPUT_MAGIC: [u8; 4] = *b"SHLI";
/// The only version this decoder accepts.
pub const INPUT_VERSION: u8 = 1;
/// Length of the header.
pub const INPUT_HEADER_LEN: usize = 32;

const FLAG_SLICE: u8 = 1 << 0;
const FLAG_HITS: u8 = 1 << 1;

/// One decoded input header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputHeader {
    pub source: SourceId,
    pub when: When,
    /// `Some`: the payload is shoal hit records (then waveforms); `None`: opaque bytes.
    pub hit_count: Option<u32>,
    pub payload_len: u32,
    pub sequence: u32,
}

/// Why bytes are not an input frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InputFrameError {
    #[error("bad magic {0:02x?} (expected \"SHLI\")")]
    BadMagic([u8; 4]),
    #[error("unsupported input framing version {0} (this build reads 1)")]
    BadVersion(u8),
    #[error("undefined flag bits {0:#04x}")]
    BadFlags(u8),
    #[error("reserved bytes are not zero")]
    Reserved,
    #[error("hit count {0} on an opaque payload (flag bit 1 not set)")]
    HitCountOnOpaque(u32),
    #[error("payload of {len} bytes is over the limit of {max}")]
    TooLarge { len: u32, max: u32 },
    #[error("datagram of {got} bytes, its header says {want}")]
    LengthMismatch { got: usize, want: usize },
    #[error("{0} bytes are too short for a {INPUT_HEADER_LEN}-byte header")]
    Short(usize),
}

impl InputFrameError {
    /// A stable short name (counter label).
    pub fn kind(&self) -> &'static str {
        match self {
            InputFrameError::BadMagic(_) => "bad_magic",
            InputFrameError::BadVersion(_) => "bad_version",
            InputFrameError::BadFlags(_) => "bad_flags",
            InputFrameError::Reserved => "reserved_not_zero",
            InputFrameError::HitCountOnOpaque(_) => "hit_count_on_opaque",
            InputFrameError::TooLarge { .. } => "too_large",
            InputFrameError::LengthMismatch { .. } => "length_mismatch",
            InputFrameError::Short(_) => "short",
        }
    }
}

/// Decodes and checks a header (`max_payload`: the largest payload accepted).
pub fn decode_header(b: &[u8; INPUT_HEADER_LEN], max_payload: u32) -> Result<InputHeader, InputFrameError> {
    let magic = [b[0], b[1], b[2], b[3]];
    if magic != INPUT_MAGIC {
        return Err(InputFrameError::BadMagic(magic));
    }
    if b[4] != INPUT_VERSION {
        return Err(InputFrameError::BadVersion(b[4]));
    }
    let flags = b[5];
    if flags & !(FLAG_SLICE | FLAG_HITS) != 0 {
        return Err(InputFrameError::BadFlags(flags));
    }
    if b[6] != 0 || b[7] != 0 {
        return Err(InputFrameError::Reserved);
    }
    let mut r = &b[8..];
    let source = r.get_u32_le();
    let hit_count = r.get_u32_le();
    let time = r.get_u64_le();
    let payload_len = r.get_u32_le();
    let sequence = r.get_u32_le();
    if flags & FLAG_HITS == 0 && hit_count != 0 {
        return Err(InputFrameError::HitCountOnOpaque(hit_count));
    }
    if payload_len > max_payload {
        return Err(InputFrameError::TooLarge { len: payload_len, max: max_payload });
    }
    let when = if flags & FLAG_SLICE != 0 { When::Slice(time) } else { When::TimeNs(time) };
    let hit_count = (flags & FLAG_HITS != 0).then_some(hit_count);
    Ok(InputHeader { source, when, hit_count, payload_len, sequence })
}

/// Encodes a header (for writers in Rust, tests and the fuzz target's seeds).
pub fn encode_header(h: &InputHeader) -> [u8; INPUT_HEADER_LEN] {
    let mut b = [0u8; INPUT_HEADER_LEN];
    b[0..4].copy_from_slice(&INPUT_MAGIC);
    b[4] = INPUT_VERSION;
    let (flag_slice, time) = match h.when {
        When::Slice(s) => (FLAG_SLICE, s),
        When::TimeNs(t) => (0, t),
    };
    b[5] = flag_slice | if h.hit_count.is_some() { FLAG_HITS } else { 0 };
    b[8..12].copy_from_slice(&h.source.to_le_bytes());
    b[12..16].copy_from_slice(&h.hit_count.unwrap_or(0).to_le_bytes());
    b[16..24].copy_from_slice(&time.to_le_bytes());
    b[24..28].copy_from_slice(&h.payload_len.to_le_bytes());
    b[28..32].copy_from_slice(&h.sequence.to_le_bytes());
    b
}

/// A whole frame: header then payload.
pub fn encode(sub: &Submission, sequence: u32) -> Bytes {
    let h = InputHeader {
        source: sub.source,
        when: sub.when,
        hit_count: sub.hit_count,
        payload_len: sub.payload.len() as u32,
        sequence,
    };
    let mut out = BytesMut::with_capacity(INPUT_HEADER_LEN + sub.payload.len());
    out.extend_from_slice(&encode_header(&h));
    out.extend_from_slice(&sub.payload);
    out.freeze()
}

/// One datagram holding exactly one frame.
pub fn decode_datagram(d: &Bytes, max_payload: u32) -> Result<(InputHeader, Bytes), InputFrameError> {
    let head: &[u8; INPUT_HEADER_LEN] =
        d.get(..INPUT_HEADER_LEN).and_then(|h| h.try_into().ok()).ok_or(InputFrameError::Short(d.len()))?;
    let h = decode_header(head, max_payload)?;
    let want = INPUT_HEADER_LEN + h.payload_len as usize;
    if d.len() != want {
        return Err(InputFrameError::LengthMismatch { got: d.len(), want });
    }
    Ok((h, d.slice(INPUT_HEADER_LEN..)))
}

/// Frames out of a byte stream, fed in whatever pieces the socket gives.
///
/// After an error the stream cannot be resynchronised (there is no frame CRC to find the
/// next boundary by): the caller closes the connection, and what it had decoded before
/// stays accepted.
#[derive(Debug)]
pub struct InputStreamDecoder {
    buf: BytesMut,
    max_payload: u32,
    header: Option<InputHeader>,
    failed: bool,
}

impl InputStreamDecoder {
    pub fn new(max_payload: u32) -> Self {
        Self { buf: BytesMut::new(), max_payload, header: None, failed: false }
    }

    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole frame, `Ok(None)` when more bytes are needed.
    pub fn next_frame(&mut self) -> Result<Option<(InputHeader, Bytes)>, InputFrameError> {
        if self.failed {
            return Ok(None);
        }
        if self.header.is_none() {
            if self.buf.len() < INPUT_HEADER_LEN {
                return Ok(None);
            }
            let head: [u8; INPUT_HEADER_LEN] = self.buf[..INPUT_HEADER_LEN].try_into().expect("length checked");
            match decode_header(&head, self.max_payload) {
                Ok(h) => {
                    self.buf.advance(INPUT_HEADER_LEN);
                    self.buf.reserve(h.payload_len as usize);
                    self.header = Some(h);
                }
                Err(e) => {
                    self.failed = true;
                    return Err(e);
                }
            }
        }
        let h = self.header.expect("set above");
        if self.buf.len() < h.payload_len as usize {
            return Ok(None);
        }
        self.header = None;
        Ok(Some((h, self.buf.split_to(h.payload_len as usize).freeze())))
    }

    /// Bytes of a frame begun and not finished (a client that disconnects now leaves a
    /// partial fragment behind: counted, never delivered).
    pub fn partial(&self) -> bool {
        self.header.is_some() || !self.buf.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub(payload: &'static [u8]) -> Submission {
        Submission { source: 3, when: When::TimeNs(123_456_789), hit_count: None, payload: Bytes::from_static(payload) }
    }

    #[test]
    fn round_trips_through_a_stream_in_any_pieces() {
        let mut wire = Vec::new();
        wire.extend_from_slice(&encode(&sub(b"hello"), 7));
        let hits = Submission { hit_count: Some(1), when: When::Slice(42), ..sub(b"\x01\x02\x00\x00\x00\x09") };
        wire.extend_from_slice(&encode(&hits, 8));
        for piece in [1, 5, 31, 32, 33, wire.len()] {
            let mut d = InputStreamDecoder::new(1 << 20);
            let mut got = Vec::new();
            for chunk in wire.chunks(piece) {
                d.push(chunk);
                while let Some(f) = d.next_frame().unwrap() {
                    got.push(f);
                }
            }
            assert!(!d.partial());
            assert_eq!(got.len(), 2);
            assert_eq!((got[0].0.source, got[0].0.when, got[0].0.sequence), (3, When::TimeNs(123_456_789), 7));
            assert_eq!(&got[0].1[..], b"hello");
            assert_eq!((got[1].0.hit_count, got[1].0.when), (Some(1), When::Slice(42)));
        }
    }

    #[test]
    fn rejects_garbage_with_a_kind() {
        let good = encode(&sub(b"x"), 0);
        let bad = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut b = good.to_vec();
            f(&mut b);
            let mut d = InputStreamDecoder::new(100);
            d.push(&b);
            d.next_frame().unwrap_err().kind()
        };
        assert_eq!(bad(&|b| b[0] = b'X'), "bad_magic");
        assert_eq!(bad(&|b| b[4] = 2), "bad_version");
        assert_eq!(bad(&|b| b[5] = 0x80), "bad_flags");
        assert_eq!(bad(&|b| b[7] = 1), "reserved_not_zero");
        assert_eq!(bad(&|b| b[12] = 1), "hit_count_on_opaque");
        assert_eq!(bad(&|b| b[26] = 1), "too_large");
        assert_eq!(decode_datagram(&good.slice(..20), 100).unwrap_err().kind(), "short");
        let mut long = good.to_vec();
        long.push(0);
        assert_eq!(decode_datagram(&Bytes::from(long), 100).unwrap_err().kind(), "length_mismatch");
        assert_eq!(decode_datagram(&good, 100).unwrap().1, Bytes::from_static(b"x"));
    }

    #[test]
    fn a_partial_frame_is_seen() {
        let good = encode(&sub(b"hello"), 0);
        let mut d = InputStreamDecoder::new(100);
        d.push(&good[..35]);
        assert_eq!(d.next_frame().unwrap(), None);
        assert!(d.partial());
    }
}
