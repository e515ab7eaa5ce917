//! Data-frame wire format v1 (specified in `docs/wire-format.md`).
//!
//! A frame is a fixed 56-byte little-endian header followed by the payload. The header
//! carries its own CRC32C so that a stream decoder can tell a real frame boundary from
//! garbage that happens to start with the magic; the payload has a second CRC32C.
//!
//! Decoding untrusted bytes never panics: every failure is a typed [`FrameError`], and
//! [`FrameError::kind`] gives a stable short name for counters and logs.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::{Instant, SourceId, slice::SliceNumber};

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"SHLF";
/// The only version this decoder accepts.
pub const VERSION: u8 = 1;
/// Length of the v1 header in bytes.
pub const HEADER_LEN: usize = 56;
/// Default upper bound on a payload a decoder accepts (16 MiB); larger lengths are
/// rejected as garbage before any allocation.
pub const DEFAULT_MAX_PAYLOAD: u32 = 16 * 1024 * 1024;

const OFF_SEND_TIME: usize = 32;
const OFF_HEADER_CRC: usize = 52;

/// Frame flags (a `u16` bit set).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Flags(u16);

impl Flags {
    /// The source capped this fragment's size and cut data off (counted at the source).
    pub const TRUNCATED: Flags = Flags(1 << 0);
    /// The burst rate cutoff replaced this fragment's data by an empty payload.
    pub const CUT_OFF: Flags = Flags(1 << 1);
    /// The source was in a (bioluminescence) burst during this slice.
    pub const BURST: Flags = Flags(1 << 2);
    /// The payload holds filtered events (builder to writer), not hits.
    pub const EVENTS: Flags = Flags(1 << 3);
    /// The sender will send no more frames on this connection (clean end of run).
    pub const END_OF_STREAM: Flags = Flags(1 << 4);
    /// Pull control messages ([`crate::pullmsg`]): a hello (source to builder, builder to
    /// data-flow manager), a fragment request (builder to source), an assignment (manager
    /// to builder), a returned credit (builder to manager).
    pub const HELLO: Flags = Flags(1 << 5);
    pub const REQUEST: Flags = Flags(1 << 6);
    pub const ASSIGN: Flags = Flags(1 << 7);
    pub const CREDIT: Flags = Flags(1 << 8);
    /// The payload is a raw-data record (builder to writer): a fragment saved by the burst
    /// saver or the late-data side stream, or an alert's description ([`crate::rawrec`]).
    pub const RAW: Flags = Flags(1 << 9);
    /// The payload is user data in no format shoal knows (the source SDK,
    /// [`crate::ingest`]): `hit_count` is 0, builders store it and filters see no hits.
    pub const OPAQUE: Flags = Flags(1 << 10);
    /// Data the source received after it had sent its fragment of this slice (the source
    /// SDK's late data): it never joins the slice; the builder's late/salvage path takes it.
    pub const LATE: Flags = Flags(1 << 11);
    /// Every bit defined by v1; a frame with any other bit set is rejected.
    pub const ALL: Flags = Flags(0b1111_1111_1111);
    /// The pull control bits.
    pub const CONTROL: Flags = Flags(0b1_1110_0000);
    pub const EMPTY: Flags = Flags(0);

    pub const fn bits(self) -> u16 {
        self.0
    }
    /// Flags from raw bits, or `None` if an undefined bit is set.
    pub const fn from_bits(bits: u16) -> Option<Flags> {
        if bits & !Self::ALL.0 == 0 { Some(Flags(bits)) } else { None }
    }
    pub const fn contains(self, other: Flags) -> bool {
        self.0 & other.0 == other.0
    }
    pub const fn intersects(self, other: Flags) -> bool {
        self.0 & other.0 != 0
    }
    pub const fn union(self, other: Flags) -> Flags {
        Flags(self.0 | other.0)
    }
}

impl core::ops::BitOr for Flags {
    type Output = Flags;
    fn bitor(self, rhs: Flags) -> Flags {
        self.union(rhs)
    }
}

/// The validated header of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub flags: Flags,
    pub source: SourceId,
    /// Number of 6-byte hit records at the start of the payload (see [`crate::hit`]).
    pub hit_count: u32,
    pub slice: SliceNumber,
    /// First instant of the slice (driver's time origin).
    pub slice_start: Instant,
    /// When the application handed the frame to the transport; patched just before the
    /// first byte is written (see [`set_send_time`]). Zero if never sent.
    pub send_time: Instant,
    pub payload_len: u32,
}

/// A decoded frame: header plus payload (a cheap view into the receive buffer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub header: FrameHeader,
    pub payload: Bytes,
}

impl Frame {
    /// Length of the frame on the wire.
    pub fn wire_len(&self) -> usize {
        HEADER_LEN + self.payload.len()
    }
}

/// Why bytes are not a valid frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("need {need} bytes, have {have}")]
    TooShort { have: usize, need: usize },
    #[error("bad magic {0:02x?} (expected \"SHLF\")")]
    BadMagic([u8; 4]),
    #[error("unsupported frame version {0} (this build speaks {VERSION})")]
    UnsupportedVersion(u8),
    #[error("header length {0} does not match version 1 ({HEADER_LEN})")]
    BadHeaderLength(u8),
    #[error("header CRC32C mismatch: header says {expected:#010x}, computed {computed:#010x}")]
    HeaderCrc { expected: u32, computed: u32 },
    #[error("reserved header field is {0:#x}, must be zero")]
    ReservedNotZero(u32),
    #[error("undefined flag bits {0:#06x}")]
    UnknownFlags(u16),
    #[error("payload length {len} exceeds the limit {max}")]
    PayloadTooLarge { len: u32, max: u32 },
    #[error("payload CRC32C mismatch: header says {expected:#010x}, computed {computed:#010x}")]
    PayloadCrc { expected: u32, computed: u32 },
    #[error("stream ended inside a frame ({0} bytes left over)")]
    Truncated(usize),
    #[error("the header says {header} payload bytes, the message carried {carried}")]
    PayloadLength { header: u32, carried: usize },
}

impl FrameError {
    /// A stable short name, used as a metric label and in logs.
    pub fn kind(&self) -> &'static str {
        match self {
            FrameError::TooShort { .. } => "too_short",
            FrameError::BadMagic(_) => "bad_magic",
            FrameError::UnsupportedVersion(_) => "bad_version",
            FrameError::BadHeaderLength(_) => "bad_header_length",
            FrameError::HeaderCrc { .. } => "header_crc",
            FrameError::ReservedNotZero(_) => "reserved_not_zero",
            FrameError::UnknownFlags(_) => "unknown_flags",
            FrameError::PayloadTooLarge { .. } => "payload_too_large",
            FrameError::PayloadCrc { .. } => "payload_crc",
            FrameError::Truncated(_) => "truncated",
            FrameError::PayloadLength { .. } => "payload_length",
        }
    }
}

/// Encodes a frame. `header.payload_len` is ignored and taken from `payload`.
///
/// Panics if the payload is longer than `u32::MAX` bytes (a caller bug, not an input).
pub fn encode(header: &FrameHeader, payload: &[u8]) -> Bytes {
    let mut buf = BytesMut::with_capacity(HEADER_LEN + payload.len());
    encode_into(header, payload, &mut buf);
    buf.freeze()
}

/// Appends an encoded frame to `buf`.
pub fn encode_into(header: &FrameHeader, payload: &[u8], buf: &mut BytesMut) {
    buf.reserve(HEADER_LEN + payload.len());
    buf.put_slice(&encode_header(header, payload));
    buf.put_slice(payload);
}

/// Encodes only the header of the frame that carries `payload`, so that the payload can be
/// sent from where it already is (one vectored write, no copy).
///
/// Panics if the payload is longer than `u32::MAX` bytes (a caller bug, not an input).
pub fn encode_header(header: &FrameHeader, payload: &[u8]) -> [u8; HEADER_LEN] {
    let payload_len = u32::try_from(payload.len()).expect("payload longer than u32::MAX");
    encode_header_with_crc(header, payload_len, crate::checksum::crc32c(payload))
}

/// [`encode_header`] for a payload whose length and CRC32C the caller already knows (a
/// payload sent many times need not be checksummed each time).
pub fn encode_header_with_crc(header: &FrameHeader, payload_len: u32, payload_crc: u32) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    let mut b = &mut h[..];
    b.put_slice(&MAGIC);
    b.put_u8(VERSION);
    b.put_u8(HEADER_LEN as u8);
    b.put_u16_le(header.flags.bits());
    b.put_u32_le(header.source);
    b.put_u32_le(header.hit_count);
    b.put_u64_le(header.slice);
    b.put_u64_le(header.slice_start.as_nanos());
    b.put_u64_le(header.send_time.as_nanos());
    b.put_u32_le(payload_len);
    b.put_u32_le(payload_crc);
    b.put_u32_le(0);
    let hcrc = crate::checksum::crc32c(&h[..OFF_HEADER_CRC]);
    h[OFF_HEADER_CRC..].copy_from_slice(&hcrc.to_le_bytes());
    h
}

/// Rewrites the send time of an encoded frame in place (and its header CRC).
/// Returns `false` (and changes nothing) if `frame` is shorter than a header.
pub fn set_send_time(frame: &mut [u8], t: Instant) -> bool {
    if frame.len() < HEADER_LEN {
        return false;
    }
    frame[OFF_SEND_TIME..OFF_SEND_TIME + 8].copy_from_slice(&t.as_nanos().to_le_bytes());
    let hcrc = crate::checksum::crc32c(&frame[..OFF_HEADER_CRC]);
    frame[OFF_HEADER_CRC..HEADER_LEN].copy_from_slice(&hcrc.to_le_bytes());
    true
}

/// Checks and parses a header from the first [`HEADER_LEN`] bytes of `buf`.
pub fn decode_header(buf: &[u8], max_payload: u32) -> Result<FrameHeader, FrameError> {
    if buf.len() < 4 {
        return Err(FrameError::TooShort { have: buf.len(), need: HEADER_LEN });
    }
    // Check the magic before anything else so garbage is named as such even when short.
    let magic: [u8; 4] = buf[..4].try_into().expect("4 bytes");
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    if buf.len() < HEADER_LEN {
        return Err(FrameError::TooShort { have: buf.len(), need: HEADER_LEN });
    }
    let mut h = &buf[4..HEADER_LEN];
    let version = h.get_u8();
    if version != VERSION {
        return Err(FrameError::UnsupportedVersion(version));
    }
    let header_len = h.get_u8();
    if usize::from(header_len) != HEADER_LEN {
        return Err(FrameError::BadHeaderLength(header_len));
    }
    let expected = u32::from_le_bytes(buf[OFF_HEADER_CRC..HEADER_LEN].try_into().expect("4"));
    let computed = crate::checksum::crc32c(&buf[..OFF_HEADER_CRC]);
    if expected != computed {
        return Err(FrameError::HeaderCrc { expected, computed });
    }
    let flag_bits = h.get_u16_le();
    let flags = Flags::from_bits(flag_bits).ok_or(FrameError::UnknownFlags(flag_bits & !Flags::ALL.bits()))?;
    let source = h.get_u32_le();
    let hit_count = h.get_u32_le();
    let slice = h.get_u64_le();
    let slice_start = Instant::from_nanos(h.get_u64_le());
    let send_time = Instant::from_nanos(h.get_u64_le());
    let payload_len = h.get_u32_le();
    let _payload_crc = h.get_u32_le();
    let reserved = h.get_u32_le();
    if reserved != 0 {
        return Err(FrameError::ReservedNotZero(reserved));
    }
    if payload_len > max_payload {
        return Err(FrameError::PayloadTooLarge { len: payload_len, max: max_payload });
    }
    Ok(FrameHeader { flags, source, hit_count, slice, slice_start, send_time, payload_len })
}

fn payload_crc_field(buf: &[u8]) -> u32 {
    u32::from_le_bytes(buf[44..48].try_into().expect("4 bytes"))
}

/// Decodes the one frame at the start of `buf`; returns it and the bytes it used.
pub fn decode(buf: &[u8], max_payload: u32) -> Result<(Frame, usize), FrameError> {
    let header = decode_header(buf, max_payload)?;
    let total = HEADER_LEN + header.payload_len as usize;
    if buf.len() < total {
        return Err(FrameError::TooShort { have: buf.len(), need: total });
    }
    let payload = &buf[HEADER_LEN..total];
    check_payload(buf, payload)?;
    Ok((Frame { header, payload: Bytes::copy_from_slice(payload) }, total))
}

/// Checks a frame that came as a message with its header and payload apart (the `ucx`
/// transport's active messages): the same checks as [`decode`], the payload kept as it
/// is, not copied.
pub fn decode_message(header_bytes: &[u8], payload: Bytes, max_payload: u32) -> Result<Frame, FrameError> {
    if header_bytes.len() != HEADER_LEN && header_bytes.len() >= 4 && header_bytes[..4] == MAGIC {
        return Err(FrameError::BadHeaderLength(header_bytes.len().min(255) as u8));
    }
    let header = decode_header(header_bytes, max_payload)?;
    if header.payload_len as usize != payload.len() {
        return Err(FrameError::PayloadLength { header: header.payload_len, carried: payload.len() });
    }
    check_payload(header_bytes, &payload)?;
    Ok(Frame { header, payload })
}

fn check_payload(header_bytes: &[u8], payload: &[u8]) -> Result<(), FrameError> {
    check_payload_crc(header_bytes, crate::checksum::crc32c(payload))
}

/// Compares a payload's CRC, however it was computed, with the one its header carries.
fn check_payload_crc(header_bytes: &[u8], computed: u32) -> Result<(), FrameError> {
    let expected = payload_crc_field(header_bytes);
    if expected != computed {
        return Err(FrameError::PayloadCrc { expected, computed });
    }
    Ok(())
}

/// Finds frame boundaries in a byte stream (one TCP connection).
///
/// Feed bytes with [`StreamDecoder::extend`] (or read straight into
/// [`StreamDecoder::buffer_mut`]), then drain frames with [`StreamDecoder::next_frame`].
/// The first error poisons the decoder: a byte stream cannot be resynchronised safely, so
/// the caller closes that connection and counts the error; other connections are unaffected.
#[derive(Debug)]
pub struct StreamDecoder {
    buf: BytesMut,
    max_payload: u32,
    pending: Option<FrameHeader>,
    error: Option<FrameError>,
    /// The length of the last frame returned, header included (0: none yet).
    last_frame_len: usize,
    /// The CRC of the pending frame's payload bytes received so far, and how many: each
    /// read's bytes are checked as they arrive, while the copy into the buffer has just put
    /// them in the cache, not once the whole frame is there (1-MB frames read back whole
    /// were checked at 29 GB/s, read by read at 41; docs/benchmarks.md).
    payload_crc: u32,
    payload_checked: usize,
}

/// A frame this many times smaller than its receive buffer is copied out of it rather than
/// split off (see [`StreamDecoder::next_frame`]).
const PIN_RATIO: usize = 4;

/// Room made for a read when the next frame's size is not known (or small). 16 kB, not 64:
/// every connection kept one (now only a connection reading holds one:
/// [`StreamDecoder::release_idle`]), and at 10,000 connections 64-kB buffers were 655 MB of
/// the builder's 1.2 GB, the kernel clearing their pages a fifth of its CPU; with 16 kB its
/// CPU per GB fell by a fifth there and not at all at 10 connections. Tried at 64 kB again
/// once idle connections held none: the builder's peak memory at 10,000 connections
/// doubled, for no gain at 10 (docs/benchmarks.md).
pub const READ_RESERVE: usize = 16 * 1024;

/// Frames at least this long get read buffers of their own size ([`StreamDecoder::prepare_read`]);
/// shorter ones are copied out of a shared one ([`StreamDecoder::next_frame`]).
const OWN_BUFFER_MIN: usize = 16 * 1024;

impl StreamDecoder {
    pub fn new(max_payload: u32) -> Self {
        Self {
            buf: BytesMut::with_capacity(READ_RESERVE),
            max_payload,
            pending: None,
            error: None,
            last_frame_len: 0,
            payload_crc: 0,
            payload_checked: 0,
        }
    }

    /// Makes room in the receive buffer for the next read. Small frames (under 16 kB) share a
    /// [`READ_RESERVE`] buffer and are copied out of it ([`StreamDecoder::next_frame`]). Large ones,
    /// one per connection and slice on a detector, are read into a buffer of about their
    /// own size: the connection's last frame plus an eighth, or exactly the rest of a
    /// frame begun. Such a frame fills its buffer and is split off it without a copy and
    /// without keeping a larger buffer alive: with 64 kB for every read, each of a
    /// full-shape run's 30,000 connections kept a 64-kB buffer per 30-kB fragment in flight.
    pub fn prepare_read(&mut self) {
        let pending_total = self.pending.map(|h| HEADER_LEN + h.payload_len as usize);
        match pending_total {
            Some(total) if total >= OWN_BUFFER_MIN => {
                if total > self.buf.capacity() {
                    // Exactly the frame: `reserve` would make at least the buffer's first
                    // capacity, and the next frame's start would share the allocation.
                    self.move_to_fresh_buffer(total);
                }
            }
            None if self.buf.is_empty() && self.last_frame_len >= OWN_BUFFER_MIN => {
                let expect = self.last_frame_len + self.last_frame_len / 8;
                let room = self.buf.capacity();
                if room < expect || room > 2 * expect {
                    // A fresh buffer: reserving on the old one would allocate at least its
                    // first capacity again, and what is left of a much larger one would
                    // have the next frames copied out of it, or pin it.
                    self.buf = BytesMut::with_capacity(expect);
                }
            }
            _ => {
                if !self.buf.try_reclaim(READ_RESERVE) {
                    self.move_to_fresh_buffer(self.buf.len() + READ_RESERVE);
                }
            }
        }
    }

    /// Gives the receive buffer back while it holds nothing, so that a connection waiting
    /// for data holds no memory: with a buffer kept by each, the builder's memory grew
    /// with its connections (at 10,000, 16 kB each; with this and small frames copied out,
    /// its peak fell by about 110 MB and its CPU per GB by 13-25 %). The next
    /// [`StreamDecoder::prepare_read`] takes a buffer again, from an allocator that has
    /// just had one back. Call it before waiting for the connection to be readable.
    pub fn release_idle(&mut self) {
        if self.buf.is_empty() && self.buf.capacity() > 0 {
            self.buf = BytesMut::new();
        }
    }

    /// Moves the bytes held into a new buffer of `capacity`. Never grown in place (as
    /// `reserve` does): the allocator's `realloc` copies the old buffer whole, reading its
    /// pages never written, which maps them to the shared zero page; once the allocator
    /// hands them out again, the socket's write into each costs a copy and an interrupt to
    /// every core running the process (at 10,000 connections, 16 % of the builder's CPU).
    fn move_to_fresh_buffer(&mut self, capacity: usize) {
        let mut fresh = BytesMut::with_capacity(capacity);
        fresh.extend_from_slice(&self.buf);
        self.buf = fresh;
    }

    /// Appends received bytes.
    pub fn extend(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The receive buffer, for reading into directly (e.g. tokio's `read_buf`).
    pub fn buffer_mut(&mut self) -> &mut BytesMut {
        &mut self.buf
    }

    /// Bytes received but not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next complete frame, `Ok(None)` if more bytes are needed, or the error that
    /// poisoned this stream.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        let result = self.try_next();
        if let Err(e) = &result {
            self.error = Some(e.clone());
        }
        result
    }

    fn try_next(&mut self) -> Result<Option<Frame>, FrameError> {
        let header = match self.pending {
            Some(h) => h,
            None => {
                // Reject garbage as soon as the magic is visible, not only after 56 bytes.
                // Under 4 bytes it is not yet: refused then, it was named too short, where
                // the same bytes decoded whole are a stream cut short (checked against
                // `decode` by shoal-fuzz's `frame_reads`).
                let visible = self.buf.len().min(4);
                if self.buf[..visible] != MAGIC[..visible] {
                    if visible < MAGIC.len() {
                        return Ok(None);
                    }
                    return decode_header(&self.buf, self.max_payload).map(|_| None);
                }
                if self.buf.len() < HEADER_LEN {
                    return Ok(None);
                }
                let h = decode_header(&self.buf, self.max_payload)?;
                self.pending = Some(h);
                h
            }
        };
        let total = HEADER_LEN + header.payload_len as usize;
        let here = self.buf.len().min(total);
        if here > HEADER_LEN + self.payload_checked {
            let new = &self.buf[HEADER_LEN + self.payload_checked..here];
            self.payload_crc = crate::checksum::crc32c_append(self.payload_crc, new);
            self.payload_checked = here - HEADER_LEN;
        }
        if self.buf.len() < total {
            // A large frame's room is made to measure before the next read (`prepare_read`);
            // `extend` grows the buffer as needed.
            if total < OWN_BUFFER_MIN {
                self.buf.reserve(total - self.buf.len());
            }
            return Ok(None);
        }
        // A small frame, or one much smaller than the buffer it arrived in, is copied out:
        // split off, it would share the buffer's allocation and keep all of it alive for as
        // long as its slice is held, and the next read would need a fresh buffer. With one
        // small fragment per connection per slice (10,000 connections), that pinned 16 times
        // the data and the builder spent 69% of its CPU zeroing fresh pages; a 4-kB frame
        // split off a 16-kB buffer still pinned four times its size, and each read took
        // fresh pages. Copied (a few hundred ns from the cache), the buffer is reused or
        // given back ([`StreamDecoder::release_idle`]); a large frame has a buffer of about
        // its own size (`prepare_read`), and one split off pins at most PIN_RATIO times it.
        //
        // Checked in place, then only the payload leaves the buffer: a copy of the whole
        // frame sliced past its header made the copy's allocation shared (a second
        // allocation and atomic reference counts for every frame, freed on another thread).
        self.pending = None;
        self.last_frame_len = total;
        let computed = self.payload_crc;
        (self.payload_crc, self.payload_checked) = (0, 0);
        check_payload_crc(&self.buf[..HEADER_LEN], computed)?;
        let payload = if total < OWN_BUFFER_MIN || total.saturating_mul(PIN_RATIO) < self.buf.capacity() {
            let copy = Bytes::copy_from_slice(&self.buf[HEADER_LEN..total]);
            self.buf.advance(total);
            copy
        } else {
            let mut whole = self.buf.split_to(total);
            whole.advance(HEADER_LEN);
            whole.freeze()
        };
        Ok(Some(Frame { header, payload }))
    }

    /// Call at end of stream: an error if the stream stopped inside a frame.
    pub fn finish(&self) -> Result<(), FrameError> {
        match (&self.error, self.buf.len()) {
            (Some(e), _) => Err(e.clone()),
            (None, 0) => Ok(()),
            (None, n) => Err(FrameError::Truncated(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header(payload_len: u32) -> FrameHeader {
        FrameHeader {
            flags: Flags::BURST,
            source: 7,
            hit_count: 2,
            slice: 123_456,
            slice_start: Instant::from_nanos(1_234_560_000_000),
            send_time: Instant::from_nanos(99),
            payload_len,
        }
    }

    /// A frame as a message (header and payload apart): the payload is kept, not copied,
    /// and every check of a stream's frame applies, plus the lengths agreeing.
    #[test]
    fn a_frame_as_a_message_is_checked_like_one_from_a_stream() {
        let payload = Bytes::from(vec![5u8; 1000]);
        let head = encode_header(&header(1000), &payload);
        let f = decode_message(&head, payload.clone(), DEFAULT_MAX_PAYLOAD).unwrap();
        assert_eq!(f.header, FrameHeader { payload_len: 1000, ..header(1000) });
        assert_eq!(f.payload.as_ptr(), payload.as_ptr(), "not copied");
        let short = payload.slice(..999);
        assert_eq!(decode_message(&head, short, DEFAULT_MAX_PAYLOAD).unwrap_err().kind(), "payload_length");
        let mut other = vec![5u8; 1000];
        other[17] = 6;
        assert_eq!(decode_message(&head, Bytes::from(other), DEFAULT_MAX_PAYLOAD).unwrap_err().kind(), "payload_crc");
        let mut long_head = head.to_vec();
        long_head.push(0);
        assert_eq!(
            decode_message(&long_head, payload.clone(), DEFAULT_MAX_PAYLOAD).unwrap_err().kind(),
            "bad_header_length"
        );
        assert_eq!(decode_message(b"GET / HTTP", payload, DEFAULT_MAX_PAYLOAD).unwrap_err().kind(), "bad_magic");
    }

    /// Small frames kept (as a slice holds its fragments) do not pin the receive buffer:
    /// it is reused for every read; a frame about as large as the buffer is split off it
    /// without a copy.
    #[test]
    fn small_frames_are_copied_out_and_large_ones_split_off() {
        let mut d = StreamDecoder::new(DEFAULT_MAX_PAYLOAD);
        let small = encode(&header(4000), &[7u8; 4000]);
        d.buffer_mut().reserve(64 * 1024);
        let base = d.buffer_mut().as_ptr();
        let mut held = Vec::new();
        for _ in 0..100 {
            d.buffer_mut().reserve(64 * 1024);
            assert_eq!(d.buffer_mut().as_ptr(), base, "the receive buffer was reused");
            d.extend(&small);
            held.push(d.next_frame().unwrap().unwrap());
        }
        assert!(held.iter().all(|f| f.payload[..] == [7u8; 4000]));
        let large = encode(&header(60_000), &[9u8; 60_000]);
        d.buffer_mut().reserve(64 * 1024);
        let base = d.buffer_mut().as_ptr();
        d.extend(&large);
        let frame = d.next_frame().unwrap().unwrap();
        assert_eq!(frame.payload.as_ptr(), base.wrapping_add(HEADER_LEN), "split off, not copied");
        assert_eq!(frame.payload.len(), 60_000);
    }

    /// A connection's read cycle with 4-kB frames (one per read, or several): every frame
    /// is copied out of the read buffer, so none keeps it alive (split off a 16-kB buffer,
    /// each pinned four times its size and the next read took fresh pages), and the buffer
    /// is given back whenever nothing is held, so a connection waiting holds no memory.
    #[test]
    fn small_frames_never_pin_the_read_buffer_and_an_idle_connection_holds_none() {
        let mut d = StreamDecoder::new(DEFAULT_MAX_PAYLOAD);
        let n = 4096;
        let stream: Vec<u8> = (0..30u8).flat_map(|i| encode(&header(n as u32), &vec![i; n])).collect();
        let frame_len = HEADER_LEN + n;
        // Reads of one frame, of three and a half, and of what is left.
        let reads = [frame_len, 3 * frame_len + frame_len / 2, stream.len()];
        let (mut fed, mut frames) = (0, Vec::new());
        for want in reads {
            d.prepare_read();
            let b = d.buffer_mut();
            let (start, end) = (b.as_ptr() as usize, b.as_ptr() as usize + b.capacity());
            let take = want.min(b.capacity() - b.len()).min(stream.len() - fed);
            d.extend(&stream[fed..fed + take]);
            fed += take;
            while let Some(f) = d.next_frame().unwrap() {
                let p = f.payload.as_ptr() as usize;
                assert!(!(start <= p && p < end), "frame {} was split off its read buffer", frames.len());
                frames.push(f);
            }
            d.release_idle();
            assert_eq!(d.buffer_mut().capacity() == 0, d.buffered() == 0, "given back exactly when idle");
        }
        while fed < stream.len() {
            d.prepare_read();
            let room = d.buffer_mut().capacity() - d.buffered();
            let take = room.min(stream.len() - fed);
            d.extend(&stream[fed..fed + take]);
            fed += take;
            while let Some(f) = d.next_frame().unwrap() {
                frames.push(f);
            }
            d.release_idle();
        }
        assert_eq!(frames.len(), 30);
        for (i, f) in frames.iter().enumerate() {
            assert!(f.payload.len() == n && f.payload.iter().all(|&b| b == i as u8), "frame {i}");
        }
        assert_eq!(d.buffer_mut().capacity(), 0, "nothing held at the end: no buffer");
        assert_eq!(d.finish(), Ok(()));
    }

    /// 4-kB frames that straddle reads keep their bytes when room is made elsewhere.
    #[test]
    fn a_full_buffer_of_small_frames_makes_room_without_losing_the_bytes_held() {
        // 4-kB frames arriving 3,000 bytes a read, as on a connection among thousands: a
        // read ends inside a frame that began at the buffer's start, so the room for the
        // next read is made elsewhere (a fresh buffer: growing in place would have the
        // allocator copy the whole old one) with the part held carried over.
        let mut d = StreamDecoder::new(DEFAULT_MAX_PAYLOAD);
        let n = 4000;
        let stream: Vec<u8> = (0..40u8).flat_map(|i| encode(&header(n as u32), &vec![i; n])).collect();
        let mut fed = 0;
        let mut frames = Vec::new();
        let mut moved_holding = 0;
        while fed < stream.len() {
            let (before, held) = (d.buffer_mut().as_ptr(), d.buffered());
            d.prepare_read();
            let b = d.buffer_mut();
            moved_holding += usize::from(held > 0 && b.as_ptr() != before);
            assert!(b.capacity() - b.len() >= READ_RESERVE, "room after {held} bytes held");
            let take = 3000.min(stream.len() - fed);
            d.extend(&stream[fed..fed + take]);
            fed += take;
            while let Some(f) = d.next_frame().unwrap() {
                frames.push(f);
            }
        }
        assert!(moved_holding > 0, "the room was made elsewhere with bytes held");
        assert_eq!(frames.len(), 40);
        for (i, f) in frames.iter().enumerate() {
            assert!(f.payload.len() == n && f.payload.iter().all(|&b| b == i as u8), "frame {i}");
        }
        assert_eq!(d.finish(), Ok(()));
    }

    /// Large frames of about the same size, read as a socket would give them (at most the
    /// room made), are split off the buffers they were read into (never copied out), and
    /// once the connection's frames are known each read buffer is about a frame long, not
    /// 64 kB.
    #[test]
    fn large_frames_are_read_into_buffers_of_their_own_size() {
        let mut d = StreamDecoder::new(DEFAULT_MAX_PAYLOAD);
        let sizes = [30_000usize, 28_500, 33_000, 30_100, 100_000, 20_000, 20_000, 30_000, 30_000];
        let stream: Vec<u8> =
            sizes.iter().enumerate().flat_map(|(i, &n)| encode(&header(n as u32), &vec![i as u8; n])).collect();
        // As on a detector's connection, one frame is there to read at a time (a slice's).
        let ends: Vec<usize> = sizes
            .iter()
            .scan(0, |end, &n| {
                *end += HEADER_LEN + n;
                Some(*end)
            })
            .collect();
        let mut fed = 0;
        let mut frames = Vec::new();
        // Every buffer read into: [start, end) of its memory.
        let mut read_into: Vec<(usize, usize)> = Vec::new();
        let mut rooms = Vec::new();
        let mut copied = Vec::new();
        while frames.len() < sizes.len() {
            d.prepare_read();
            let b = d.buffer_mut();
            let room = b.capacity() - b.len();
            read_into.push((b.as_ptr() as usize, b.as_ptr() as usize + b.capacity()));
            rooms.push(room);
            let available = ends.iter().find(|&&e| e > fed).expect("frames left") - fed;
            let n = room.min(available);
            d.extend(&stream[fed..fed + n]);
            fed += n;
            while let Some(f) = d.next_frame().unwrap() {
                let p = f.payload.as_ptr() as usize;
                if !read_into.iter().any(|&(a, z)| a <= p && p < z) {
                    copied.push(frames.len());
                }
                frames.push(f);
            }
        }
        for (i, (f, &n)) in frames.iter().zip(&sizes).enumerate() {
            assert_eq!(f.payload.len(), n);
            assert!(f.payload.iter().all(|&b| b == i as u8));
        }
        assert_eq!(d.finish(), Ok(()));
        // Copied out, if any: only the 20,000-byte frame read into the room made after the
        // 100,000-byte one (a fifth of it: sharing it would keep it all alive). (Its copy
        // may land in memory a buffer read into before had, so it is not always seen.)
        assert!(copied.iter().all(|&i| i == 5), "copied out: {copied:?}");
        // The last frame, of the size of the one before, was read at once into room for an
        // eighth more.
        let frame = HEADER_LEN + 30_000;
        let last = *rooms.last().unwrap();
        assert!(last >= frame && last <= frame * 9 / 8, "{rooms:?}");
    }

    #[test]
    fn roundtrip_and_layout() {
        let payload = b"hello world!";
        let bytes = encode(&header(0), payload);
        assert_eq!(bytes.len(), HEADER_LEN + payload.len());
        assert_eq!(&bytes[..4], b"SHLF");
        let (frame, used) = decode(&bytes, DEFAULT_MAX_PAYLOAD).unwrap();
        assert_eq!(used, bytes.len());
        assert_eq!(frame.header, header(payload.len() as u32));
        assert_eq!(&frame.payload[..], payload);
    }

    #[test]
    fn header_alone_matches_whole_frame() {
        let payload = [7u8; 99];
        let whole = encode(&header(0), &payload);
        assert_eq!(&whole[..HEADER_LEN], &encode_header(&header(0), &payload)[..]);
    }

    #[test]
    fn send_time_patch_keeps_frame_valid() {
        let mut bytes = encode(&header(0), b"abc").to_vec();
        assert!(set_send_time(&mut bytes, Instant::from_nanos(42)));
        let (frame, _) = decode(&bytes, DEFAULT_MAX_PAYLOAD).unwrap();
        assert_eq!(frame.header.send_time, Instant::from_nanos(42));
        assert!(!set_send_time(&mut [0u8; 10], Instant::ZERO));
    }

    #[test]
    fn each_check_fires() {
        let good = encode(&header(0), b"payload").to_vec();
        let mut b = good.clone();
        b[0] = b'X';
        assert!(matches!(decode(&b, 1 << 20), Err(FrameError::BadMagic(_))));
        let mut b = good.clone();
        b[4] = 2;
        assert_eq!(decode(&b, 1 << 20).unwrap_err(), FrameError::UnsupportedVersion(2));
        let mut b = good.clone();
        b[10] ^= 1; // source id
        assert!(matches!(decode(&b, 1 << 20), Err(FrameError::HeaderCrc { .. })));
        let mut b = good.clone();
        *b.last_mut().unwrap() ^= 1;
        assert!(matches!(decode(&b, 1 << 20), Err(FrameError::PayloadCrc { .. })));
        assert!(matches!(decode(&good, 3), Err(FrameError::PayloadTooLarge { len: 7, max: 3 })));
        assert!(matches!(decode(&good[..20], 1 << 20), Err(FrameError::TooShort { .. })));
    }

    #[test]
    fn stream_decoder_splits_and_rejects_garbage() {
        let a = encode(&header(0), b"first");
        let b = encode(&header(0), &[9u8; 1000]);
        let mut all = a.to_vec();
        all.extend_from_slice(&b);
        let mut d = StreamDecoder::new(DEFAULT_MAX_PAYLOAD);
        let mut frames = Vec::new();
        for chunk in all.chunks(7) {
            d.extend(chunk);
            while let Some(f) = d.next_frame().unwrap() {
                frames.push(f);
            }
        }
        assert_eq!(frames.len(), 2);
        assert_eq!(&frames[1].payload[..], &[9u8; 1000][..]);
        assert!(d.finish().is_ok());

        let mut g = StreamDecoder::new(DEFAULT_MAX_PAYLOAD);
        g.extend(b"GET / HTTP/1.1\r\n");
        assert!(matches!(g.next_frame(), Err(FrameError::BadMagic(_))));
        // Poisoned: stays an error.
        g.extend(&a);
        assert!(g.next_frame().is_err());

        let mut t = StreamDecoder::new(DEFAULT_MAX_PAYLOAD);
        t.extend(&a[..30]);
        assert_eq!(t.next_frame(), Ok(None));
        assert_eq!(t.finish(), Err(FrameError::Truncated(30)));

        // Garbage named once its four bytes are in, whatever the reads.
        let mut s = StreamDecoder::new(DEFAULT_MAX_PAYLOAD);
        s.extend(b"GE");
        assert_eq!(s.next_frame(), Ok(None));
        s.extend(b"T /");
        assert_eq!(s.next_frame(), Err(FrameError::BadMagic(*b"GET ")));
    }

    fn arb_header() -> impl Strategy<Value = FrameHeader> {
        (0u16..32, any::<u32>(), any::<u32>(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(
            |(f, source, hit_count, slice, start, send)| FrameHeader {
                flags: Flags::from_bits(f).unwrap(),
                source,
                hit_count,
                slice,
                slice_start: Instant::from_nanos(start),
                send_time: Instant::from_nanos(send),
                payload_len: 0,
            },
        )
    }

    proptest! {
        #[test]
        fn decode_encode_roundtrip(h in arb_header(), payload in proptest::collection::vec(any::<u8>(), 0..2000)) {
            let bytes = encode(&h, &payload);
            let (frame, used) = decode(&bytes, DEFAULT_MAX_PAYLOAD).unwrap();
            prop_assert_eq!(used, bytes.len());
            prop_assert_eq!(frame.header, FrameHeader { payload_len: payload.len() as u32, ..h });
            prop_assert_eq!(&frame.payload[..], &payload[..]);
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = decode(&bytes, 1024);
            let mut d = StreamDecoder::new(1024);
            d.extend(&bytes);
            for _ in 0..10 {
                match d.next_frame() { Ok(Some(_)) => {}, _ => break }
            }
            let _ = d.finish();
        }

        #[test]
        fn corrupting_any_byte_is_detected(h in arb_header(), payload in proptest::collection::vec(any::<u8>(), 1..200), pos in any::<prop::sample::Index>(), bit in 0u8..8) {
            let mut bytes = encode(&h, &payload).to_vec();
            let i = pos.index(bytes.len());
            bytes[i] ^= 1 << bit;
            prop_assert!(decode(&bytes, DEFAULT_MAX_PAYLOAD).is_err());
        }

        /// The stream decoder checks a payload read by read: a flipped payload bit is found
        /// whatever the chunking, in the frame it hit, with the CRCs the whole-frame check
        /// reports; the frames before it come out intact.
        #[test]
        fn corrupting_a_payload_in_a_stream_is_detected_at_any_chunking(
            payload in proptest::collection::vec(any::<u8>(), 1..3000), pos in any::<prop::sample::Index>(),
            bit in 0u8..8, chunk in 1usize..4000) {
            let good = encode(&header(0), b"before");
            let mut bad = encode(&FrameHeader { slice: 9, ..header(0) }, &payload).to_vec();
            let i = HEADER_LEN + pos.index(payload.len());
            bad[i] ^= 1 << bit;
            let whole = decode(&bad, DEFAULT_MAX_PAYLOAD).unwrap_err();
            let mut all = good.to_vec();
            all.extend_from_slice(&bad);
            let mut d = StreamDecoder::new(DEFAULT_MAX_PAYLOAD);
            let (mut frames, mut error) = (0, None);
            for c in all.chunks(chunk) {
                d.extend(c);
                loop {
                    match d.next_frame() {
                        Ok(Some(f)) => { prop_assert_eq!(&f.payload[..], b"before"); frames += 1; }
                        Ok(None) => break,
                        Err(e) => { error = Some(e); break; }
                    }
                }
            }
            prop_assert_eq!(frames, 1);
            prop_assert_eq!(error, Some(whole));
        }

        #[test]
        fn stream_of_frames_any_chunking(n in 1usize..6, chunk in 1usize..200, seed in any::<u8>()) {
            let frames: Vec<Bytes> = (0..n).map(|i| encode(&FrameHeader { slice: i as u64, ..header(0) }, &vec![seed; i * 37])).collect();
            let all: Vec<u8> = frames.iter().flat_map(|f| f.iter().copied()).collect();
            let mut d = StreamDecoder::new(DEFAULT_MAX_PAYLOAD);
            let mut got = 0u64;
            for c in all.chunks(chunk) {
                d.extend(c);
                while let Some(f) = d.next_frame().unwrap() {
                    prop_assert_eq!(f.header.slice, got);
                    got += 1;
                }
            }
            prop_assert_eq!(got, n as u64);
            prop_assert!(d.finish().is_ok());
        }
    }
}
