//! KM3NeT's JDAQTimeslice (version 1), as the DataFilter publishes it on `IO_TSL*` and
//! stores it in files, and km3pipe's `TimesliceParser` reads it. Little-endian:
//!
//! | size | field |
//! | ---: | --- |
//! | 4 | size of the whole timeslice in bytes, this field included |
//! | 4 | data type: 1002 L0 (all hits), 1003 L1, 1004 L2, 1005 SN |
//! | 2 | version, 1 |
//! | 4 + 4 + 4 | detector id, run, frame index (the timeslice's number) |
//! | 4 + 4 | UTC seconds (most significant bit: White Rabbit status), ticks of 16 ns |
//! | 4 | number of frames |
//!
//! then per DOM a frame: size (56 + 6 per hit), data type 101, detector id, run, frame
//! index, UTC seconds, ticks, DOM id, DataQueue status, four DOM status words, hit count
//! (each `i32` little-endian), then the hits as the CLB sends them (channel `u8`, time
//! `u32` big-endian ns since the timeslice start, ToT `u8`).

use bytes::{Buf, BufMut};

use super::clb::ClbHit;

/// Length of a timeslice's header.
pub const TIMESLICE_HEADER_LEN: usize = 34;
/// Length of a frame's header.
pub const FRAME_HEADER_LEN: usize = 56;
/// The only version this codec reads and writes.
pub const TIMESLICE_VERSION: i16 = 1;
/// A frame's data type (JDAQSuperFrame).
pub const FRAME_TYPE: i32 = 101;
/// Timeslice data types.
pub const TYPE_L0: i32 = 1002;
pub const TYPE_L1: i32 = 1003;
pub const TYPE_L2: i32 = 1004;
pub const TYPE_SN: i32 = 1005;

/// One DOM's frame of a timeslice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JdaqFrame {
    pub dom_id: u32,
    /// DataQueue status (KM3NeT's `JDAQFrameStatus`: packets received, trailer seen,
    /// high-rate veto, FIFO status bits); kept as given.
    pub dataqueue_status: u32,
    pub dom_status: [u32; 4],
    pub hits: Vec<ClbHit>,
}

/// One timeslice of every DOM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JdaqTimeslice {
    pub data_type: i32,
    pub det_id: i32,
    pub run: i32,
    pub frame_index: i32,
    /// UTC seconds with the White Rabbit status in the most significant bit.
    pub timestamp: u32,
    pub ticks: u32,
    pub frames: Vec<JdaqFrame>,
}

impl JdaqTimeslice {
    /// The timeslice start in UNIX ns (the White Rabbit bit masked).
    pub fn start_ns(&self) -> u64 {
        u64::from(self.timestamp & 0x7fff_ffff) * 1_000_000_000 + u64::from(self.ticks) * 16
    }

    pub fn encoded_len(&self) -> usize {
        TIMESLICE_HEADER_LEN + self.frames.iter().map(|f| FRAME_HEADER_LEN + 6 * f.hits.len()).sum::<usize>()
    }
}

/// Why bytes are not a JDAQTimeslice.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum JdaqError {
    #[error("{0} bytes are too short for what they announce")]
    Short(usize),
    #[error("unsupported JDAQTimeslice version {0}")]
    Version(i16),
    #[error("data type {0} is not a timeslice")]
    NotATimeslice(i32),
    #[error("a length or count field is negative or inconsistent")]
    BadLength,
}

impl JdaqError {
    pub fn kind(&self) -> &'static str {
        match self {
            JdaqError::Short(_) => "short",
            JdaqError::Version(_) => "version",
            JdaqError::NotATimeslice(_) => "not_a_timeslice",
            JdaqError::BadLength => "bad_length",
        }
    }
}

/// Encodes a timeslice.
pub fn encode_timeslice(ts: &JdaqTimeslice) -> Vec<u8> {
    let mut b = Vec::with_capacity(ts.encoded_len());
    b.put_i32_le(ts.encoded_len() as i32);
    b.put_i32_le(ts.data_type);
    b.put_i16_le(TIMESLICE_VERSION);
    b.put_i32_le(ts.det_id);
    b.put_i32_le(ts.run);
    b.put_i32_le(ts.frame_index);
    b.put_u32_le(ts.timestamp);
    b.put_u32_le(ts.ticks);
    b.put_i32_le(ts.frames.len() as i32);
    for f in &ts.frames {
        b.put_i32_le((FRAME_HEADER_LEN + 6 * f.hits.len()) as i32);
        b.put_i32_le(FRAME_TYPE);
        b.put_i32_le(ts.det_id);
        b.put_i32_le(ts.run);
        b.put_i32_le(ts.frame_index);
        b.put_u32_le(ts.timestamp);
        b.put_u32_le(ts.ticks);
        b.put_u32_le(f.dom_id);
        b.put_u32_le(f.dataqueue_status);
        for w in f.dom_status {
            b.put_u32_le(w);
        }
        b.put_i32_le(f.hits.len() as i32);
        for h in &f.hits {
            b.put_u8(h.channel);
            b.put_u32(h.time_ns);
            b.put_u8(h.tot);
        }
    }
    b
}

/// Decodes the timeslice at the start of `b`; returns it and the bytes it took.
pub fn decode_timeslice(b: &[u8]) -> Result<(JdaqTimeslice, usize), JdaqError> {
    if b.len() < TIMESLICE_HEADER_LEN {
        return Err(JdaqError::Short(b.len()));
    }
    let mut r = b;
    let size = r.get_i32_le();
    let data_type = r.get_i32_le();
    let version = r.get_i16_le();
    let size = usize::try_from(size).map_err(|_| JdaqError::BadLength)?;
    if !(TYPE_L0..=TYPE_SN).contains(&data_type) {
        return Err(JdaqError::NotATimeslice(data_type));
    }
    if version != TIMESLICE_VERSION {
        return Err(JdaqError::Version(version));
    }
    if size < TIMESLICE_HEADER_LEN || size > b.len() {
        return Err(JdaqError::Short(b.len()));
    }
    let mut r = &b[10..size];
    let (det_id, run, frame_index) = (r.get_i32_le(), r.get_i32_le(), r.get_i32_le());
    let (timestamp, ticks) = (r.get_u32_le(), r.get_u32_le());
    let n_frames = usize::try_from(r.get_i32_le()).map_err(|_| JdaqError::BadLength)?;
    let mut frames = Vec::with_capacity(n_frames.min(r.len() / FRAME_HEADER_LEN));
    for _ in 0..n_frames {
        if r.len() < FRAME_HEADER_LEN {
            return Err(JdaqError::Short(r.len()));
        }
        r.advance(28); // size, type, detector, run, frame index, seconds, ticks: the slice's
        let dom_id = r.get_u32_le();
        let dataqueue_status = r.get_u32_le();
        let dom_status = [r.get_u32_le(), r.get_u32_le(), r.get_u32_le(), r.get_u32_le()];
        let n_hits = usize::try_from(r.get_i32_le()).map_err(|_| JdaqError::BadLength)?;
        if r.len() < n_hits.saturating_mul(6) {
            return Err(JdaqError::Short(r.len()));
        }
        let hits = (0..n_hits).map(|_| ClbHit { channel: r.get_u8(), time_ns: r.get_u32(), tot: r.get_u8() }).collect();
        frames.push(JdaqFrame { dom_id, dataqueue_status, dom_status, hits });
    }
    if !r.is_empty() {
        return Err(JdaqError::BadLength);
    }
    Ok((JdaqTimeslice { data_type, det_id, run, frame_index, timestamp, ticks, frames }, size))
}

/// The timeslices of a file (one after another); the first bad one ends it as an error.
pub fn timeslices(b: &[u8]) -> impl Iterator<Item = Result<JdaqTimeslice, JdaqError>> + '_ {
    let mut at = 0;
    let mut failed = false;
    std::iter::from_fn(move || {
        if failed || at >= b.len() {
            return None;
        }
        match decode_timeslice(&b[at..]) {
            Ok((ts, used)) => {
                at += used;
                Some(Ok(ts))
            }
            Err(e) => {
                failed = true;
                Some(Err(e))
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts() -> JdaqTimeslice {
        JdaqTimeslice {
            data_type: TYPE_L1,
            det_id: 48,
            run: 4380,
            frame_index: 13_535,
            timestamp: 0x5faa_be56,
            ticks: 31_250_000,
            frames: vec![
                JdaqFrame {
                    dom_id: 806_451_239,
                    dataqueue_status: 0xb000c,
                    dom_status: [1 << 31, 1 << 31, 0, 0],
                    hits: vec![],
                },
                JdaqFrame {
                    dom_id: 808_447_031,
                    dataqueue_status: 0xb000c,
                    dom_status: [1 << 31, 1 << 31, 0, 0],
                    hits: vec![
                        ClbHit { channel: 12, time_ns: 607_618, tot: 25 },
                        ClbHit { channel: 3, time_ns: 9, tot: 1 },
                    ],
                },
            ],
        }
    }

    #[test]
    fn a_timeslice_round_trips_and_has_the_sizes_km3pipe_reads() {
        let t = ts();
        let b = encode_timeslice(&t);
        assert_eq!(b.len(), 34 + 56 + 56 + 12);
        assert_eq!(i32::from_le_bytes(b[0..4].try_into().unwrap()) as usize, b.len());
        assert_eq!(&b[34 + 56 + 56..34 + 56 + 62], &[12, 0x00, 0x09, 0x45, 0x82, 25], "hits as the CLB sends them");
        let (back, used) = decode_timeslice(&b).unwrap();
        assert_eq!((back, used), (t.clone(), b.len()));
        let two = [b.clone(), b].concat();
        assert_eq!(timeslices(&two).filter(Result::is_ok).count(), 2);
        assert_eq!(t.start_ns(), 0x5faa_be56u64 * 1_000_000_000 + 500_000_000);
    }

    #[test]
    fn bad_timeslices_are_named_errors() {
        let b = encode_timeslice(&ts());
        assert_eq!(decode_timeslice(&b[..b.len() - 1]).unwrap_err().kind(), "short");
        let mut v = b.clone();
        v[8] = 2;
        assert_eq!(decode_timeslice(&v).unwrap_err().kind(), "version");
        let mut v = b.clone();
        v[4..8].copy_from_slice(&10001i32.to_le_bytes());
        assert_eq!(decode_timeslice(&v).unwrap_err().kind(), "not_a_timeslice");
        let mut v = b;
        v[30..34].copy_from_slice(&(-1i32).to_le_bytes());
        assert_eq!(decode_timeslice(&v).unwrap_err().kind(), "bad_length");
    }
}
