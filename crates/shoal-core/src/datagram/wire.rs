//! The datagram header: encoding and the checked decoder.

use bytes::{BufMut, Bytes, BytesMut};

use crate::slice::SliceNumber;
use crate::{BuilderId, SourceId};

/// The four bytes every datagram starts with.
pub const DATAGRAM_MAGIC: [u8; 4] = *b"SHLD";
const VERSION: u8 = 1;
/// Length of the header in bytes.
pub const DATAGRAM_HEADER_LEN: usize = 52;
const OFF_CRC: usize = 48;
/// Most sequence numbers one NACK carries (8 bytes each: 1024 bytes of payload).
pub const MAX_NACK_SEQS: usize = 128;

/// What a datagram is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Source to builder: `len` bytes of the frame of `slice` at `offset`, sequence `seq`.
    Data = 1,
    /// Builder to source: the payload lists missing sequence numbers (u64 each).
    Nack = 2,
    /// Source to builder: `seq` is the next sequence number the source will use (every
    /// earlier one was sent).
    Sync = 3,
    /// Source to builder: the stream ended; `seq` is its final next sequence number.
    End = 4,
    /// Builder to source: the `End` was received and nothing is missing any more (or
    /// everything missing was given up).
    EndAck = 5,
    /// Builder to source (pull policies): send the fragment of `slice`. No payload; a lost
    /// request is asked again by the builder's re-ask timer.
    Request = 6,
}

/// The CRC32C a datagram's header (bytes 0-47) and payload (after byte 52) should carry;
/// for tests and fuzzing. `buf` must hold at least the header.
pub fn crc_of(buf: &[u8]) -> u32 {
    crate::checksum::crc32c_append(crate::checksum::crc32c(&buf[..OFF_CRC]), &buf[DATAGRAM_HEADER_LEN..])
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Data,
            2 => Kind::Nack,
            3 => Kind::Sync,
            4 => Kind::End,
            5 => Kind::EndAck,
            6 => Kind::Request,
            _ => return None,
        })
    }
}

/// A datagram's header. Fields a kind does not use are zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DatagramHeader {
    pub kind: Kind,
    /// A `Data` datagram sent again in answer to a NACK.
    pub retransmit: bool,
    /// Low 32 bits of the run number: datagrams of another run are refused.
    pub run: u32,
    pub source: SourceId,
    pub builder: BuilderId,
    pub seq: u64,
    pub slice: SliceNumber,
    /// Length of the whole frame this datagram is a piece of (`Data`).
    pub frame_len: u32,
    pub offset: u32,
}

impl DatagramHeader {
    /// A header of `kind` for the stream `source` to `builder` of `run`, every other field
    /// zero.
    pub fn new(kind: Kind, run: u32, source: SourceId, builder: BuilderId) -> Self {
        Self { kind, retransmit: false, run, source, builder, seq: 0, slice: 0, frame_len: 0, offset: 0 }
    }
}

/// A decoded datagram: its header and payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Datagram {
    pub header: DatagramHeader,
    pub payload: Bytes,
}

/// Why bytes are not a datagram.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DatagramError {
    #[error("shorter than a datagram header ({0} bytes)")]
    Truncated(usize),
    #[error("bad magic")]
    BadMagic,
    #[error("unsupported datagram version {0}")]
    BadVersion(u8),
    #[error("unknown datagram kind {0}")]
    BadKind(u8),
    #[error("undefined flag bits {0:#x}")]
    BadFlags(u8),
    #[error("payload length {declared} but {actual} bytes follow the header")]
    BadLength { declared: usize, actual: usize },
    #[error("checksum mismatch")]
    BadCrc,
    #[error("piece [{offset}, +{len}) outside a frame of {frame_len} bytes")]
    BadRange { offset: u32, len: usize, frame_len: u32 },
    #[error("a NACK payload of {0} bytes is not a list of sequence numbers")]
    BadNack(usize),
}

impl DatagramError {
    /// A stable short name for counters and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            DatagramError::Truncated(_) => "truncated",
            DatagramError::BadMagic => "bad_magic",
            DatagramError::BadVersion(_) => "bad_version",
            DatagramError::BadKind(_) => "bad_kind",
            DatagramError::BadFlags(_) => "bad_flags",
            DatagramError::BadLength { .. } => "bad_length",
            DatagramError::BadCrc => "bad_crc",
            DatagramError::BadRange { .. } => "bad_range",
            DatagramError::BadNack(_) => "bad_nack",
        }
    }
}

const FLAG_RETRANSMIT: u8 = 1;

impl Datagram {
    /// Header and payload as bytes for the wire.
    pub fn encode(header: &DatagramHeader, payload: &[u8]) -> Bytes {
        let mut b = BytesMut::with_capacity(DATAGRAM_HEADER_LEN + payload.len());
        Self::encode_into(header, payload, &mut b);
        b.freeze()
    }

    /// Appends the datagram to `b` (several datagrams can share one allocation).
    pub fn encode_into(header: &DatagramHeader, payload: &[u8], b: &mut BytesMut) {
        let start = b.len();
        b.put_slice(&DATAGRAM_MAGIC);
        b.put_u8(VERSION);
        b.put_u8(header.kind as u8);
        b.put_u8(if header.retransmit { FLAG_RETRANSMIT } else { 0 });
        b.put_u8(0);
        b.put_u32_le(header.run);
        b.put_u32_le(header.source);
        b.put_u32_le(header.builder);
        b.put_u64_le(header.seq);
        b.put_u64_le(header.slice);
        b.put_u32_le(header.frame_len);
        b.put_u32_le(header.offset);
        // Payloads fit a UDP datagram: the sender never builds a larger one.
        b.put_u16_le(u16::try_from(payload.len()).expect("datagram payload fits 64 KiB"));
        b.put_u16_le(0);
        debug_assert_eq!(b.len() - start, OFF_CRC);
        let mut crc = crate::checksum::crc32c(&b[start..]);
        crc = crate::checksum::crc32c_append(crc, payload);
        b.put_u32_le(crc);
        b.put_slice(payload);
    }

    /// A NACK listing `seqs` (at most [`MAX_NACK_SEQS`]).
    pub fn nack(run: u32, source: SourceId, builder: BuilderId, seqs: &[u64]) -> Bytes {
        let mut payload = Vec::with_capacity(seqs.len() * 8);
        for s in seqs.iter().take(MAX_NACK_SEQS) {
            payload.extend_from_slice(&s.to_le_bytes());
        }
        Self::encode(&DatagramHeader::new(Kind::Nack, run, source, builder), &payload)
    }

    /// A pull request: the builder asks `source` for its fragment of `slice`.
    pub fn request(run: u32, source: SourceId, builder: BuilderId, slice: SliceNumber) -> Bytes {
        Self::encode(&DatagramHeader { slice, ..DatagramHeader::new(Kind::Request, run, source, builder) }, &[])
    }

    /// Decodes and checks untrusted bytes; never panics.
    pub fn decode(buf: &Bytes) -> Result<Datagram, DatagramError> {
        if buf.len() < DATAGRAM_HEADER_LEN {
            return Err(DatagramError::Truncated(buf.len()));
        }
        let u32_at = |o: usize| u32::from_le_bytes(buf[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(buf[o..o + 8].try_into().expect("8 bytes"));
        if buf[..4] != DATAGRAM_MAGIC {
            return Err(DatagramError::BadMagic);
        }
        if buf[4] != VERSION {
            return Err(DatagramError::BadVersion(buf[4]));
        }
        let kind = Kind::from_u8(buf[5]).ok_or(DatagramError::BadKind(buf[5]))?;
        if buf[6] & !FLAG_RETRANSMIT != 0 || buf[7] != 0 {
            return Err(DatagramError::BadFlags(buf[6] & !FLAG_RETRANSMIT | buf[7]));
        }
        let len = usize::from(u16::from_le_bytes([buf[44], buf[45]]));
        let actual = buf.len() - DATAGRAM_HEADER_LEN;
        if len != actual || buf[46] != 0 || buf[47] != 0 {
            return Err(DatagramError::BadLength { declared: len, actual });
        }
        if crc_of(buf) != u32_at(OFF_CRC) {
            return Err(DatagramError::BadCrc);
        }
        let header = DatagramHeader {
            kind,
            retransmit: buf[6] & FLAG_RETRANSMIT != 0,
            run: u32_at(8),
            source: u32_at(12),
            builder: u32_at(16),
            seq: u64_at(20),
            slice: u64_at(28),
            frame_len: u32_at(36),
            offset: u32_at(40),
        };
        match kind {
            Kind::Data => {
                let end = u64::from(header.offset) + len as u64;
                if len == 0 || end > u64::from(header.frame_len) {
                    return Err(DatagramError::BadRange { offset: header.offset, len, frame_len: header.frame_len });
                }
            }
            Kind::Nack if len % 8 != 0 || len / 8 > MAX_NACK_SEQS => return Err(DatagramError::BadNack(len)),
            _ => {}
        }
        Ok(Datagram { header, payload: buf.slice(DATAGRAM_HEADER_LEN..) })
    }

    /// The sequence numbers a NACK lists (empty for other kinds).
    pub fn nacked(&self) -> impl Iterator<Item = u64> + '_ {
        let n = if self.header.kind == Kind::Nack { self.payload.len() / 8 } else { 0 };
        (0..n).map(|i| u64::from_le_bytes(self.payload[i * 8..i * 8 + 8].try_into().expect("8 bytes")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn data() -> DatagramHeader {
        DatagramHeader {
            kind: Kind::Data,
            retransmit: true,
            run: 7,
            source: 3,
            builder: 1,
            seq: 99,
            slice: 123_456,
            frame_len: 3000,
            offset: 1420,
        }
    }

    #[test]
    fn round_trip_and_layout() {
        let bytes = Datagram::encode(&data(), &[5u8; 100]);
        assert_eq!(bytes.len(), DATAGRAM_HEADER_LEN + 100);
        assert_eq!(&bytes[..4], b"SHLD");
        let d = Datagram::decode(&bytes).unwrap();
        assert_eq!(d.header, data());
        assert_eq!(&d.payload[..], &[5u8; 100]);
        let nack = Datagram::decode(&Datagram::nack(7, 3, 1, &[4, 9, 1 << 40])).unwrap();
        assert_eq!(nack.header.kind, Kind::Nack);
        assert_eq!(nack.nacked().collect::<Vec<_>>(), [4, 9, 1 << 40]);
    }

    #[test]
    fn refuses_what_is_not_a_datagram() {
        let good = Datagram::encode(&data(), &[5u8; 100]);
        let with = |i: usize, v: u8| {
            let mut b = good.to_vec();
            b[i] = v;
            Bytes::from(b)
        };
        assert_eq!(Datagram::decode(&good.slice(..40)).unwrap_err().kind(), "truncated");
        assert_eq!(Datagram::decode(&with(0, b'X')).unwrap_err().kind(), "bad_magic");
        assert_eq!(Datagram::decode(&with(4, 2)).unwrap_err().kind(), "bad_version");
        assert_eq!(Datagram::decode(&with(5, 9)).unwrap_err().kind(), "bad_kind");
        assert_eq!(Datagram::decode(&with(6, 2)).unwrap_err().kind(), "bad_flags");
        assert_eq!(Datagram::decode(&good.slice(..good.len() - 1)).unwrap_err().kind(), "bad_length");
        assert_eq!(Datagram::decode(&with(60, 6)).unwrap_err().kind(), "bad_crc");
        assert_eq!(Datagram::decode(&with(20, 100)).unwrap_err().kind(), "bad_crc", "a changed sequence number");
        let past_end = DatagramHeader { offset: 2950, ..data() };
        assert_eq!(Datagram::decode(&Datagram::encode(&past_end, &[0; 100])).unwrap_err().kind(), "bad_range");
        let odd_nack = DatagramHeader::new(Kind::Nack, 7, 3, 1);
        assert_eq!(Datagram::decode(&Datagram::encode(&odd_nack, &[0; 12])).unwrap_err().kind(), "bad_nack");
    }

    proptest! {
        /// Arbitrary bytes never panic the decoder, and whatever it accepts re-encodes to
        /// the same bytes.
        #[test]
        fn decoding_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200), keep_magic in any::<bool>()) {
            let mut bytes = bytes;
            if keep_magic && bytes.len() >= 6 {
                bytes[..4].copy_from_slice(&DATAGRAM_MAGIC);
                bytes[4] = 1;
            }
            let b = Bytes::from(bytes);
            if let Ok(d) = Datagram::decode(&b) {
                prop_assert_eq!(Datagram::encode(&d.header, &d.payload), b);
            }
        }

        /// Any single flipped bit is caught.
        #[test]
        fn a_flipped_bit_is_caught(bit in 0usize..(8 * (DATAGRAM_HEADER_LEN + 64))) {
            let good = Datagram::encode(&data(), &[0xA5; 64]);
            let mut b = good.to_vec();
            b[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(Datagram::decode(&Bytes::from(b)).is_err());
        }
    }
}
