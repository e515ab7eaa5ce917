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

    /// Its header (every frame repeats it).
    pub fn header(&self) -> JdaqHeader {
        JdaqHeader {
            det_id: self.det_id,
            run: self.run,
            frame_index: self.frame_index,
            timestamp: self.timestamp,
            ticks: self.ticks,
        }
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
    #[error("data type {0} is not the one expected here")]
    WrongType(i32),
    #[error("a length or count field is negative or inconsistent")]
    BadLength,
    #[error("a frame is not a superframe of this timeslice (type or header differs)")]
    Inconsistent,
}

impl JdaqError {
    pub fn kind(&self) -> &'static str {
        match self {
            JdaqError::Short(_) => "short",
            JdaqError::Version(_) => "version",
            JdaqError::WrongType(_) => "wrong_type",
            JdaqError::BadLength => "bad_length",
            JdaqError::Inconsistent => "inconsistent",
        }
    }
}

/// Encodes a timeslice.
pub fn encode_timeslice(ts: &JdaqTimeslice) -> Vec<u8> {
    let h = ts.header();
    let frames: Vec<Vec<u8>> = ts.frames.iter().map(|f| encode_superframe(&h, f)).collect();
    timeslice_of_superframes(ts.data_type, &h, frames.iter().map(Vec::as_slice))
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
        return Err(JdaqError::WrongType(data_type));
    }
    if version != TIMESLICE_VERSION {
        return Err(JdaqError::Version(version));
    }
    if size < TIMESLICE_HEADER_LEN || size > b.len() {
        return Err(JdaqError::Short(b.len()));
    }
    let mut r = &b[10..size];
    let header = JdaqHeader::get(&mut r);
    let JdaqHeader { det_id, run, frame_index, timestamp, ticks } = header;
    let n_frames = usize::try_from(r.get_i32_le()).map_err(|_| JdaqError::BadLength)?;
    let mut frames = Vec::with_capacity(n_frames.min(r.len() / FRAME_HEADER_LEN));
    for _ in 0..n_frames {
        if r.len() < FRAME_HEADER_LEN {
            return Err(JdaqError::Short(r.len()));
        }
        let frame_size = r.get_i32_le();
        if r.get_i32_le() != FRAME_TYPE {
            return Err(JdaqError::Inconsistent);
        }
        // Every frame carries the timeslice's own header (detector, run, index, time).
        if JdaqHeader::get(&mut r) != header {
            return Err(JdaqError::Inconsistent);
        }
        let dom_id = r.get_u32_le();
        let dataqueue_status = r.get_u32_le();
        let dom_status = [r.get_u32_le(), r.get_u32_le(), r.get_u32_le(), r.get_u32_le()];
        let n_hits = usize::try_from(r.get_i32_le()).map_err(|_| JdaqError::BadLength)?;
        if r.len() < n_hits.saturating_mul(6) {
            return Err(JdaqError::Short(r.len()));
        }
        if usize::try_from(frame_size).ok() != Some(FRAME_HEADER_LEN + 6 * n_hits) {
            return Err(JdaqError::BadLength);
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

/// The header every JDAQ object (timeslice, superframe, event, summaryslice) carries
/// after its preamble (and version): detector, run, frame index and the timeslice start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JdaqHeader {
    pub det_id: i32,
    pub run: i32,
    /// The timeslice's number in the run.
    pub frame_index: i32,
    /// UTC seconds with the White Rabbit status in the most significant bit.
    pub timestamp: u32,
    /// Ticks of 16 ns.
    pub ticks: u32,
}

impl JdaqHeader {
    /// The header of the timeslice starting at `start_ns` (UNIX ns; White Rabbit status
    /// set, as a synchronised detector reports it).
    pub fn at(det_id: i32, run: i32, frame_index: i32, start_ns: u64) -> Self {
        Self {
            det_id,
            run,
            frame_index,
            timestamp: ((start_ns / 1_000_000_000) as u32 & 0x7fff_ffff) | 0x8000_0000,
            ticks: ((start_ns % 1_000_000_000) / 16) as u32,
        }
    }

    pub fn start_ns(&self) -> u64 {
        u64::from(self.timestamp & 0x7fff_ffff) * 1_000_000_000 + u64::from(self.ticks) * 16
    }

    fn put(&self, b: &mut Vec<u8>) {
        b.put_i32_le(self.det_id);
        b.put_i32_le(self.run);
        b.put_i32_le(self.frame_index);
        b.put_u32_le(self.timestamp);
        b.put_u32_le(self.ticks);
    }

    fn get(r: &mut &[u8]) -> Self {
        Self {
            det_id: r.get_i32_le(),
            run: r.get_i32_le(),
            frame_index: r.get_i32_le(),
            timestamp: r.get_u32_le(),
            ticks: r.get_u32_le(),
        }
    }
}

/// One DOM's frame on its own (a JDAQSuperFrame: what a DataQueue hands a DataFilter,
/// and the payload of a shoal fragment from a `clb:` input): the 56-byte frame header of
/// [`encode_timeslice`], then the hits. A timeslice is its header then such frames, so
/// [`timeslice_of_superframes`] builds one without decoding them.
pub fn encode_superframe(h: &JdaqHeader, f: &JdaqFrame) -> Vec<u8> {
    let mut b = Vec::with_capacity(FRAME_HEADER_LEN + 6 * f.hits.len());
    b.put_i32_le((FRAME_HEADER_LEN + 6 * f.hits.len()) as i32);
    b.put_i32_le(FRAME_TYPE);
    h.put(&mut b);
    b.put_u32_le(f.dom_id);
    b.put_u32_le(f.dataqueue_status);
    for w in f.dom_status {
        b.put_u32_le(w);
    }
    b.put_i32_le(f.hits.len() as i32);
    for hit in &f.hits {
        b.put_u8(hit.channel);
        b.put_u32(hit.time_ns);
        b.put_u8(hit.tot);
    }
    b
}

/// Decodes a superframe that fills `b` exactly.
pub fn decode_superframe(b: &[u8]) -> Result<(JdaqHeader, JdaqFrame), JdaqError> {
    if b.len() < FRAME_HEADER_LEN {
        return Err(JdaqError::Short(b.len()));
    }
    let mut r = b;
    let size = usize::try_from(r.get_i32_le()).map_err(|_| JdaqError::BadLength)?;
    let data_type = r.get_i32_le();
    if data_type != FRAME_TYPE {
        return Err(JdaqError::WrongType(data_type));
    }
    let h = JdaqHeader::get(&mut r);
    let dom_id = r.get_u32_le();
    let dataqueue_status = r.get_u32_le();
    let dom_status = [r.get_u32_le(), r.get_u32_le(), r.get_u32_le(), r.get_u32_le()];
    let n_hits = usize::try_from(r.get_i32_le()).map_err(|_| JdaqError::BadLength)?;
    if size != b.len() || r.len() != n_hits.saturating_mul(6) {
        return Err(JdaqError::BadLength);
    }
    let hits = (0..n_hits).map(|_| ClbHit { channel: r.get_u8(), time_ns: r.get_u32(), tot: r.get_u8() }).collect();
    Ok((h, JdaqFrame { dom_id, dataqueue_status, dom_status, hits }))
}

/// A timeslice of `data_type` from encoded superframes, copied as they are.
pub fn timeslice_of_superframes<'a>(
    data_type: i32,
    h: &JdaqHeader,
    frames: impl IntoIterator<Item = &'a [u8]> + Clone,
) -> Vec<u8> {
    let body: usize = frames.clone().into_iter().map(<[u8]>::len).sum();
    let n = frames.clone().into_iter().count();
    let mut b = Vec::with_capacity(TIMESLICE_HEADER_LEN + body);
    b.put_i32_le((TIMESLICE_HEADER_LEN + body) as i32);
    b.put_i32_le(data_type);
    b.put_i16_le(TIMESLICE_VERSION);
    h.put(&mut b);
    b.put_i32_le(n as i32);
    for f in frames {
        b.put_slice(f);
    }
    b
}

/// JDAQEvent's data type and the only version this codec reads and writes.
pub const TYPE_EVENT: i32 = 10001;
pub const EVENT_VERSION: i16 = 4;
/// JDAQSummaryslice's data type and version.
pub const TYPE_SUMMARYSLICE: i32 = 2001;
pub const SUMMARYSLICE_VERSION: i16 = 6;
/// PMTs of a KM3NeT DOM (the summary frame's rate count).
pub const DOM_PMTS: usize = 31;
/// Length of the event's fixed part, preamble included.
const EVENT_FIXED_LEN: usize = 8 + 2 + 20 + 8 + 8 + 4 + 4 + 4;
const TRIGGERED_HIT_LEN: usize = 18;
const SNAPSHOT_HIT_LEN: usize = 10;
const SUMMARY_FRAME_LEN: usize = 4 + 4 + 16 + DOM_PMTS;

/// A hit of an event: its DOM, then as the CLB sends it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct JdaqHit {
    pub dom_id: u32,
    pub channel: u8,
    /// ns since the timeslice start.
    pub time_ns: u32,
    pub tot: u8,
}

/// A JDAQEvent (version 4), as on `IO_EVT`: triggered hits (with the triggers each
/// satisfied) and the snapshot (every hit in the event's window).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JdaqEvent {
    pub header: JdaqHeader,
    /// The DataFilter's running count of triggers.
    pub trigger_counter: u64,
    pub trigger_mask: u64,
    /// Further triggers merged into this event.
    pub overlays: u32,
    pub triggered: Vec<(JdaqHit, u64)>,
    pub snapshot: Vec<JdaqHit>,
}

impl JdaqEvent {
    pub fn encoded_len(&self) -> usize {
        EVENT_FIXED_LEN + TRIGGERED_HIT_LEN * self.triggered.len() + SNAPSHOT_HIT_LEN * self.snapshot.len()
    }
}

fn put_hit(b: &mut Vec<u8>, h: &JdaqHit) {
    b.put_u32_le(h.dom_id);
    b.put_u8(h.channel);
    b.put_u32(h.time_ns);
    b.put_u8(h.tot);
}

fn get_hit(r: &mut &[u8]) -> JdaqHit {
    JdaqHit { dom_id: r.get_u32_le(), channel: r.get_u8(), time_ns: r.get_u32(), tot: r.get_u8() }
}

/// Encodes an event, preamble included (what `IO_EVT` carries and DAQ files hold).
pub fn encode_event(e: &JdaqEvent) -> Vec<u8> {
    let mut b = Vec::with_capacity(e.encoded_len());
    b.put_i32_le(e.encoded_len() as i32);
    b.put_i32_le(TYPE_EVENT);
    b.put_i16_le(EVENT_VERSION);
    e.header.put(&mut b);
    b.put_u64_le(e.trigger_counter);
    b.put_u64_le(e.trigger_mask);
    b.put_u32_le(e.overlays);
    b.put_i32_le(e.triggered.len() as i32);
    for (h, mask) in &e.triggered {
        put_hit(&mut b, h);
        b.put_u64_le(*mask);
    }
    b.put_i32_le(e.snapshot.len() as i32);
    for h in &e.snapshot {
        put_hit(&mut b, h);
    }
    b
}

/// Checks the preamble of the object at the start of `b`: its size (within `b`) and type.
fn preamble(b: &[u8], want_type: i32, want_version: i16, least: usize) -> Result<usize, JdaqError> {
    if b.len() < 10 {
        return Err(JdaqError::Short(b.len()));
    }
    let mut r = b;
    let size = usize::try_from(r.get_i32_le()).map_err(|_| JdaqError::BadLength)?;
    let data_type = r.get_i32_le();
    let version = r.get_i16_le();
    if data_type != want_type {
        return Err(JdaqError::WrongType(data_type));
    }
    if version != want_version {
        return Err(JdaqError::Version(version));
    }
    if size < least || size > b.len() {
        return Err(JdaqError::Short(b.len()));
    }
    Ok(size)
}

/// Decodes the event at the start of `b`; returns it and the bytes it took.
pub fn decode_event(b: &[u8]) -> Result<(JdaqEvent, usize), JdaqError> {
    let size = preamble(b, TYPE_EVENT, EVENT_VERSION, EVENT_FIXED_LEN)?;
    let mut r = &b[10..size];
    let header = JdaqHeader::get(&mut r);
    let (trigger_counter, trigger_mask, overlays) = (r.get_u64_le(), r.get_u64_le(), r.get_u32_le());
    let n = usize::try_from(r.get_i32_le()).map_err(|_| JdaqError::BadLength)?;
    if r.len() < n.saturating_mul(TRIGGERED_HIT_LEN) + 4 {
        return Err(JdaqError::BadLength);
    }
    let triggered = (0..n).map(|_| (get_hit(&mut r), r.get_u64_le())).collect();
    let n = usize::try_from(r.get_i32_le()).map_err(|_| JdaqError::BadLength)?;
    if r.len() != n.saturating_mul(SNAPSHOT_HIT_LEN) {
        return Err(JdaqError::BadLength);
    }
    let snapshot = (0..n).map(|_| get_hit(&mut r)).collect();
    Ok((JdaqEvent { header, trigger_counter, trigger_mask, overlays, triggered, snapshot }, size))
}

/// One DOM's rates in a summaryslice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JdaqSummaryFrame {
    pub dom_id: u32,
    pub dataqueue_status: u32,
    pub dom_status: [u32; 4],
    /// Per PMT, [`rate_code`] of the rate.
    pub rates: [u8; DOM_PMTS],
}

/// A JDAQSummaryslice (version 6), as on `IO_SUM`: every DOM's per-PMT rates of one
/// timeslice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JdaqSummaryslice {
    pub header: JdaqHeader,
    pub frames: Vec<JdaqSummaryFrame>,
}

/// Rates a summary frame can say: below [`RATE_MIN_HZ`] is code 0, the codes 1 to 255
/// are logarithmic up to [`RATE_MAX_HZ`] (KM3NeT's JDAQRate).
pub const RATE_MIN_HZ: f64 = 2.0e3;
pub const RATE_MAX_HZ: f64 = 2.0e6;

fn rate_factor() -> f64 {
    (RATE_MAX_HZ / RATE_MIN_HZ).ln() / 255.0
}

/// A rate's one-byte code (nearest on the logarithmic scale; a relative precision of
/// about 1.4 %).
pub fn rate_code(hz: f64) -> u8 {
    if hz.is_nan() || hz < RATE_MIN_HZ {
        0
    } else if hz >= RATE_MAX_HZ {
        255
    } else {
        ((hz / RATE_MIN_HZ).ln() / rate_factor()).round().clamp(1.0, 255.0) as u8
    }
}

/// The rate a code stands for, Hz.
pub fn rate_hz(code: u8) -> f64 {
    if code == 0 { 0.0 } else { RATE_MIN_HZ * (f64::from(code) * rate_factor()).exp() }
}

pub fn encode_summaryslice(s: &JdaqSummaryslice) -> Vec<u8> {
    let len = 10 + 20 + 4 + SUMMARY_FRAME_LEN * s.frames.len();
    let mut b = Vec::with_capacity(len);
    b.put_i32_le(len as i32);
    b.put_i32_le(TYPE_SUMMARYSLICE);
    b.put_i16_le(SUMMARYSLICE_VERSION);
    s.header.put(&mut b);
    b.put_i32_le(s.frames.len() as i32);
    for f in &s.frames {
        b.put_u32_le(f.dom_id);
        b.put_u32_le(f.dataqueue_status);
        for w in f.dom_status {
            b.put_u32_le(w);
        }
        b.put_slice(&f.rates);
    }
    b
}

/// Decodes the summaryslice at the start of `b`; returns it and the bytes it took.
pub fn decode_summaryslice(b: &[u8]) -> Result<(JdaqSummaryslice, usize), JdaqError> {
    let size = preamble(b, TYPE_SUMMARYSLICE, SUMMARYSLICE_VERSION, 34)?;
    let mut r = &b[10..size];
    let header = JdaqHeader::get(&mut r);
    let n = usize::try_from(r.get_i32_le()).map_err(|_| JdaqError::BadLength)?;
    if r.len() != n.saturating_mul(SUMMARY_FRAME_LEN) {
        return Err(JdaqError::BadLength);
    }
    let frames = (0..n)
        .map(|_| {
            let dom_id = r.get_u32_le();
            let dataqueue_status = r.get_u32_le();
            let dom_status = [r.get_u32_le(), r.get_u32_le(), r.get_u32_le(), r.get_u32_le()];
            let mut rates = [0u8; DOM_PMTS];
            r.copy_to_slice(&mut rates);
            JdaqSummaryFrame { dom_id, dataqueue_status, dom_status, rates }
        })
        .collect();
    Ok((JdaqSummaryslice { header, frames }, size))
}

/// The data type of the JDAQ object at the start of `b` and its size, if its preamble
/// is sane (for files holding several kinds).
pub fn peek_preamble(b: &[u8]) -> Option<(i32, usize)> {
    let size = usize::try_from(i32::from_le_bytes(b.get(0..4)?.try_into().ok()?)).ok()?;
    let data_type = i32::from_le_bytes(b.get(4..8)?.try_into().ok()?);
    (size >= 8 && size <= b.len()).then_some((data_type, size))
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
        assert_eq!(decode_timeslice(&v).unwrap_err().kind(), "wrong_type");
        let mut v = b;
        v[30..34].copy_from_slice(&(-1i32).to_le_bytes());
        assert_eq!(decode_timeslice(&v).unwrap_err().kind(), "bad_length");
    }

    #[test]
    fn superframes_events_and_summaryslices_round_trip() {
        let t = ts();
        let h = t.header();
        let frames: Vec<Vec<u8>> = t.frames.iter().map(|f| encode_superframe(&h, f)).collect();
        let (h2, f2) = decode_superframe(&frames[1]).unwrap();
        assert_eq!((h2, &f2), (h, &t.frames[1]));
        assert_eq!(decode_superframe(&frames[1][..60]).unwrap_err().kind(), "bad_length");
        assert_eq!(timeslice_of_superframes(t.data_type, &h, frames.iter().map(Vec::as_slice)), encode_timeslice(&t));

        let hit = JdaqHit { dom_id: 808_447_031, channel: 12, time_ns: 607_618, tot: 25 };
        let e = JdaqEvent {
            header: h,
            trigger_counter: 9,
            trigger_mask: 0b101,
            overlays: 1,
            triggered: vec![(hit, 0b100)],
            snapshot: vec![hit, JdaqHit { channel: 3, ..hit }],
        };
        let b = encode_event(&e);
        assert_eq!(b.len(), 58 + 18 + 2 * 10);
        assert_eq!(peek_preamble(&b), Some((TYPE_EVENT, b.len())));
        assert_eq!(decode_event(&b).unwrap(), (e, b.len()));
        assert_eq!(decode_event(&b[..b.len() - 1]).unwrap_err().kind(), "short");

        let s = JdaqSummaryslice {
            header: h,
            frames: vec![JdaqSummaryFrame {
                dom_id: 5,
                dataqueue_status: 1,
                dom_status: [2, 3, 4, 5],
                rates: [51; DOM_PMTS],
            }],
        };
        let b = encode_summaryslice(&s);
        assert_eq!(b.len(), 34 + 55);
        assert_eq!(decode_summaryslice(&b).unwrap(), (s, b.len()));
        assert_eq!(decode_event(&b).unwrap_err().kind(), "wrong_type");
    }

    #[test]
    fn rate_codes_are_logarithmic_between_2_khz_and_2_mhz() {
        assert_eq!((rate_code(0.0), rate_code(1_999.0), rate_code(2.5e6)), (0, 0, 255));
        for hz in [2_100.0, 5_000.0, 7_950.0, 10_000.0, 123_456.0, 1.9e6] {
            let back = rate_hz(rate_code(hz));
            assert!((back / hz - 1.0).abs() < 0.0137, "{hz} -> {back}");
        }
        // km3pipe's reading of IO_SUM.dat's first rate code, 51: 7.96 kHz.
        assert!((rate_hz(51) - 7_961.0).abs() < 2.0, "{}", rate_hz(51));
    }
}
