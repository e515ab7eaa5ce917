//! KM3NeT CLB packets: what a digital optical module's central logic board sends per
//! timeslice over UDP, and the dump framing KM3NeT's tools store them in.
//!
//! A packet is a 28-byte big-endian header, then records:
//!
//! | offset | size | field |
//! | ---: | ---: | --- |
//! | 0 | 4 | data type, ASCII: `TTDC` optical hits, `TAES` acoustic, `TMCH` monitoring |
//! | 4 | 4 | run number |
//! | 8 | 4 | UDP sequence number within this DOM's timeslice (from 0) |
//! | 12 | 4 | timeslice start, UNIX seconds |
//! | 16 | 4 | timeslice start, ticks of 16 ns within the second |
//! | 20 | 4 | DOM id |
//! | 24 | 4 | DOM status |
//!
//! Optical records are 6 bytes: PMT channel `u8`, hit time `u32` big-endian in ns since
//! the timeslice start, time over threshold `u8` (ns). A dump (`.dqd`, what km3pipe's
//! `CLBPump` reads) prefixes each packet with its length as a little-endian `u32`.
//!
//! Decoding untrusted bytes never panics; every failure is a [`ClbError`] with a stable
//! [`ClbError::kind`] for counters.

use bytes::{Buf, BufMut};

/// Length of a CLB packet header.
pub const CLB_HEADER_LEN: usize = 28;
/// Length of one optical hit record.
pub const CLB_HIT_LEN: usize = 6;
/// One tick of the CLB's time stamp.
pub const TICK_NS: u64 = 16;

/// What a packet carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ClbDataType {
    /// `TTDC`: optical hits (the data shoal builds timeslices of).
    Optical,
    /// `TAES`: acoustic samples.
    Acoustic,
    /// `TMCH`: monitoring (rates, status).
    Monitoring,
}

impl ClbDataType {
    pub fn code(self) -> [u8; 4] {
        match self {
            ClbDataType::Optical => *b"TTDC",
            ClbDataType::Acoustic => *b"TAES",
            ClbDataType::Monitoring => *b"TMCH",
        }
    }

    pub fn from_code(code: [u8; 4]) -> Option<Self> {
        match &code {
            b"TTDC" => Some(ClbDataType::Optical),
            b"TAES" => Some(ClbDataType::Acoustic),
            b"TMCH" => Some(ClbDataType::Monitoring),
            _ => None,
        }
    }
}

/// A decoded CLB header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClbHeader {
    pub data_type: ClbDataType,
    pub run: u32,
    pub udp_sequence: u32,
    pub timestamp_s: u32,
    pub ticks: u32,
    pub dom_id: u32,
    pub dom_status: u32,
}

impl ClbHeader {
    /// The timeslice start in UNIX ns (the second plus its 16 ns ticks).
    pub fn timeslice_start_ns(&self) -> u64 {
        u64::from(self.timestamp_s) * 1_000_000_000 + u64::from(self.ticks) * TICK_NS
    }
}

/// One optical hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClbHit {
    pub channel: u8,
    /// ns since the timeslice start.
    pub time_ns: u32,
    /// Time over threshold, ns.
    pub tot: u8,
}

/// A decoded packet: its header and its records' bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClbPacket<'a> {
    pub header: ClbHeader,
    pub records: &'a [u8],
}

impl<'a> ClbPacket<'a> {
    /// The optical hits (an optical packet's records are whole 6-byte hits, checked).
    pub fn hits(&self) -> impl Iterator<Item = ClbHit> + 'a {
        self.records.chunks_exact(CLB_HIT_LEN).map(|r| ClbHit {
            channel: r[0],
            time_ns: u32::from_be_bytes([r[1], r[2], r[3], r[4]]),
            tot: r[5],
        })
    }
}

/// Why bytes are not a CLB packet.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClbError {
    #[error("{0} bytes are too short for a {CLB_HEADER_LEN}-byte CLB header")]
    Short(usize),
    #[error("unknown data type {0:02x?}")]
    UnknownType([u8; 4]),
    #[error("optical records of {0} bytes are not whole 6-byte hits")]
    RaggedHits(usize),
    #[error("dump record of {len} bytes at offset {at} runs past the end ({left} left)")]
    TruncatedDump { at: usize, len: usize, left: usize },
}

impl ClbError {
    /// A stable short name (counter label).
    pub fn kind(&self) -> &'static str {
        match self {
            ClbError::Short(_) => "short",
            ClbError::UnknownType(_) => "unknown_type",
            ClbError::RaggedHits(_) => "ragged_hits",
            ClbError::TruncatedDump { .. } => "truncated_dump",
        }
    }
}

/// Decodes and checks one packet (a datagram's payload).
pub fn decode_packet(b: &[u8]) -> Result<ClbPacket<'_>, ClbError> {
    if b.len() < CLB_HEADER_LEN {
        return Err(ClbError::Short(b.len()));
    }
    let code = [b[0], b[1], b[2], b[3]];
    let data_type = ClbDataType::from_code(code).ok_or(ClbError::UnknownType(code))?;
    let mut r = &b[4..CLB_HEADER_LEN];
    let header = ClbHeader {
        data_type,
        run: r.get_u32(),
        udp_sequence: r.get_u32(),
        timestamp_s: r.get_u32(),
        ticks: r.get_u32(),
        dom_id: r.get_u32(),
        dom_status: r.get_u32(),
    };
    let records = &b[CLB_HEADER_LEN..];
    if data_type == ClbDataType::Optical && !records.len().is_multiple_of(CLB_HIT_LEN) {
        return Err(ClbError::RaggedHits(records.len()));
    }
    Ok(ClbPacket { header, records })
}

/// Encodes an optical packet.
pub fn encode_optical(header: &ClbHeader, hits: &[ClbHit]) -> Vec<u8> {
    let mut b = Vec::with_capacity(CLB_HEADER_LEN + hits.len() * CLB_HIT_LEN);
    b.put_slice(&ClbDataType::Optical.code());
    for v in [header.run, header.udp_sequence, header.timestamp_s, header.ticks, header.dom_id, header.dom_status] {
        b.put_u32(v);
    }
    for h in hits {
        b.put_u8(h.channel);
        b.put_u32(h.time_ns);
        b.put_u8(h.tot);
    }
    b
}

/// The packets of a dump (each prefixed by its little-endian `u32` length), in order; a
/// record running past the end is the last item, an error.
pub fn dump_records(b: &[u8]) -> impl Iterator<Item = Result<&[u8], ClbError>> {
    let mut at = 0usize;
    let mut done = false;
    std::iter::from_fn(move || {
        if done || at >= b.len() {
            return None;
        }
        let left = b.len() - at;
        if left < 4 {
            done = true;
            return Some(Err(ClbError::TruncatedDump { at, len: 4, left }));
        }
        let len = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize;
        if len > left - 4 {
            done = true;
            return Some(Err(ClbError::TruncatedDump { at, len, left: left - 4 }));
        }
        let rec = &b[at + 4..at + 4 + len];
        at += 4 + len;
        Some(Ok(rec))
    })
}

/// Appends `packet` to a dump.
pub fn dump_append(dump: &mut Vec<u8>, packet: &[u8]) {
    dump.put_u32_le(packet.len() as u32);
    dump.put_slice(packet);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(seq: u32) -> ClbHeader {
        ClbHeader {
            data_type: ClbDataType::Optical,
            run: 7,
            udp_sequence: seq,
            timestamp_s: 26_690,
            ticks: 6_250_000,
            dom_id: 808_447_066,
            dom_status: 0x8000_0000,
        }
    }

    #[test]
    fn an_optical_packet_round_trips_through_a_dump() {
        let hits = [ClbHit { channel: 3, time_ns: 99_999_999, tot: 26 }, ClbHit { channel: 30, time_ns: 12, tot: 255 }];
        let p = encode_optical(&header(4), &hits);
        assert_eq!(p.len(), CLB_HEADER_LEN + 12);
        assert_eq!(&p[..4], b"TTDC");
        assert_eq!(&p[8..12], &4u32.to_be_bytes(), "big-endian, as the CLB sends");
        let mut dump = Vec::new();
        dump_append(&mut dump, &p);
        dump_append(&mut dump, &p);
        let recs: Vec<_> = dump_records(&dump).collect::<Result<_, _>>().unwrap();
        assert_eq!(recs.len(), 2);
        let d = decode_packet(recs[1]).unwrap();
        assert_eq!(d.header, header(4));
        assert_eq!(d.hits().collect::<Vec<_>>(), hits);
        assert_eq!(d.header.timeslice_start_ns(), 26_690 * 1_000_000_000 + 100_000_000);
    }

    #[test]
    fn bad_bytes_are_named_errors() {
        assert_eq!(decode_packet(&[0; 27]).unwrap_err().kind(), "short");
        let mut p = encode_optical(&header(0), &[ClbHit { channel: 1, time_ns: 2, tot: 3 }]);
        p.push(0);
        assert_eq!(decode_packet(&p).unwrap_err().kind(), "ragged_hits");
        p[..4].copy_from_slice(b"XXXX");
        assert_eq!(decode_packet(&p).unwrap_err().kind(), "unknown_type");
        p[..4].copy_from_slice(b"TAES");
        assert_eq!(decode_packet(&p).unwrap().header.data_type, ClbDataType::Acoustic, "any record length");
        let mut dump = Vec::new();
        dump_append(&mut dump, &p);
        dump.truncate(dump.len() - 1);
        let recs: Vec<_> = dump_records(&dump).collect();
        assert_eq!(recs.len(), 1);
        assert_eq!(recs[0].as_ref().unwrap_err().kind(), "truncated_dump");
    }
}
