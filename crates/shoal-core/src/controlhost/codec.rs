//! Tags, the 16-byte prefix and a stream decoder.
//!
//! Prefix: tag (8 bytes, ASCII, NUL-padded) + payload length (signed 32-bit big-endian,
//! payload bytes only) + 4 padding bytes (written as zero, never checked on read).

use bytes::{Bytes, BytesMut};
use std::fmt;

/// Length of the prefix before every payload.
pub const PREFIX_LEN: usize = 16;

/// An 8-byte tag, compared as raw bytes (NUL-padded form).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag([u8; 8]);

impl Tag {
    pub const SUBSCRIBE: Tag = Tag(*b"_Subscri");
    pub const ALWAYS: Tag = Tag(*b"_Always\0");
    pub const GIME: Tag = Tag(*b"_Gime\0\0\0");
    pub const MY_ID: Tag = Tag(*b"_MyId\0\0\0");
    pub const UNIQUE_ID: Tag = Tag(*b"_UniqueI");
    pub const BORN: Tag = Tag(*b"Born\0\0\0\0");
    pub const DIED: Tag = Tag(*b"Died\0\0\0\0");

    /// A tag from its text: 1 to 8 bytes, no blanks or NULs.
    pub fn new(name: &[u8]) -> Option<Tag> {
        if name.is_empty() || name.len() > 8 || name.iter().any(|b| b.is_ascii_whitespace() || *b == 0) {
            return None;
        }
        let mut t = [0u8; 8];
        t[..name.len()].copy_from_slice(name);
        Some(Tag(t))
    }

    /// A tag as it appears on the wire.
    pub const fn from_raw(raw: [u8; 8]) -> Tag {
        Tag(raw)
    }

    pub fn raw(&self) -> &[u8; 8] {
        &self.0
    }

    /// The tag's text without trailing NULs.
    pub fn name(&self) -> &[u8] {
        let end = self.0.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
        &self.0[..end]
    }

    /// Tags starting with `_` are control tags: consumed by the dispatcher, never forwarded.
    pub fn is_control(&self) -> bool {
        self.0[0] == b'_'
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for &b in self.name() {
            if b.is_ascii_graphic() {
                write!(f, "{}", b as char)?;
            } else {
                write!(f, "\\x{b:02x}")?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tag({self})")
    }
}

/// One ControlHost message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub tag: Tag,
    pub payload: Bytes,
}

/// The prefix for a message of `len` payload bytes (padding zero).
///
/// Panics if `len` exceeds `i32::MAX` (payload limits are far below).
pub fn encode_prefix(tag: Tag, len: usize) -> [u8; PREFIX_LEN] {
    let len = i32::try_from(len).expect("ControlHost payloads are below 2 GiB");
    let mut p = [0u8; PREFIX_LEN];
    p[..8].copy_from_slice(&tag.0);
    p[8..12].copy_from_slice(&len.to_be_bytes());
    p
}

/// Why a byte stream is not a ControlHost stream.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("negative payload length {0}")]
    NegativeLength(i32),
    #[error("payload length {len} exceeds the limit {max}")]
    TooLarge { len: u32, max: u32 },
    #[error("stream ended inside a message ({0} bytes left over)")]
    Truncated(usize),
}

impl CodecError {
    /// Stable short name for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            CodecError::NegativeLength(_) => "negative_length",
            CodecError::TooLarge { .. } => "too_large",
            CodecError::Truncated(_) => "truncated",
        }
    }
}

/// Splits a byte stream into messages. The first error poisons the stream (the caller
/// closes that connection).
#[derive(Debug)]
pub struct MessageDecoder {
    buf: BytesMut,
    max_payload: u32,
    error: Option<CodecError>,
}

impl MessageDecoder {
    pub fn new(max_payload: u32) -> Self {
        Self { buf: BytesMut::with_capacity(16 * 1024), max_payload, error: None }
    }

    pub fn extend(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    pub fn buffer_mut(&mut self) -> &mut BytesMut {
        &mut self.buf
    }

    pub fn next_message(&mut self) -> Result<Option<Message>, CodecError> {
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        if self.buf.len() < PREFIX_LEN {
            return Ok(None);
        }
        let len = i32::from_be_bytes(self.buf[8..12].try_into().expect("4 bytes"));
        let len = match u32::try_from(len) {
            Err(_) => return Err(self.fail(CodecError::NegativeLength(len))),
            Ok(l) if l > self.max_payload => {
                return Err(self.fail(CodecError::TooLarge { len: l, max: self.max_payload }));
            }
            Ok(l) => l as usize,
        };
        if self.buf.len() < PREFIX_LEN + len {
            self.buf.reserve(PREFIX_LEN + len - self.buf.len());
            return Ok(None);
        }
        let tag = Tag(self.buf[..8].try_into().expect("8 bytes"));
        let mut msg = self.buf.split_to(PREFIX_LEN + len);
        let payload = msg.split_off(PREFIX_LEN).freeze();
        Ok(Some(Message { tag, payload }))
    }

    fn fail(&mut self, e: CodecError) -> CodecError {
        self.error = Some(e.clone());
        e
    }

    /// At end of stream: an error if it stopped inside a message.
    pub fn finish(&self) -> Result<(), CodecError> {
        match (&self.error, self.buf.len()) {
            (Some(e), _) => Err(e.clone()),
            (None, 0) => Ok(()),
            (None, n) => Err(CodecError::Truncated(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tags() {
        assert_eq!(Tag::new(b"IO_MONIT").unwrap().raw(), b"IO_MONIT");
        assert_eq!(Tag::new(b"MSG").unwrap().name(), b"MSG");
        assert!(Tag::new(b"TOO_LONG_").is_none());
        assert!(Tag::new(b"A B").is_none());
        assert!(Tag::new(b"").is_none());
        assert!(Tag::SUBSCRIBE.is_control() && !Tag::BORN.is_control());
        assert_eq!(Tag::ALWAYS.to_string(), "_Always");
    }

    #[test]
    fn negative_and_oversized_lengths_poison() {
        let mut d = MessageDecoder::new(1000);
        d.extend(&[b'M', b'S', b'G', 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xfb, 0, 0, 0, 0]);
        assert_eq!(d.next_message(), Err(CodecError::NegativeLength(-5)));
        assert!(d.next_message().is_err());
        let mut d = MessageDecoder::new(1000);
        d.extend(&encode_prefix(Tag::new(b"X").unwrap(), 1001));
        assert_eq!(d.next_message(), Err(CodecError::TooLarge { len: 1001, max: 1000 }));
        let mut d = MessageDecoder::new(1000);
        d.extend(&encode_prefix(Tag::new(b"X").unwrap(), 10)[..9]);
        assert_eq!(d.next_message(), Ok(None));
        assert_eq!(d.finish(), Err(CodecError::Truncated(9)));
    }

    proptest! {
        #[test]
        fn any_split_decodes_the_same(payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 1..5), chunk in 1usize..40) {
            let tag = Tag::new(b"IO_EVT").unwrap();
            let mut bytes = Vec::new();
            for p in &payloads {
                bytes.extend_from_slice(&encode_prefix(tag, p.len()));
                bytes.extend_from_slice(p);
            }
            let mut d = MessageDecoder::new(1 << 20);
            let mut got = Vec::new();
            for c in bytes.chunks(chunk) {
                d.extend(c);
                while let Some(m) = d.next_message().unwrap() { got.push(m.payload.to_vec()); }
            }
            prop_assert_eq!(got, payloads);
            prop_assert!(d.finish().is_ok());
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut d = MessageDecoder::new(64);
            d.extend(&bytes);
            for _ in 0..20 { if !matches!(d.next_message(), Ok(Some(_))) { break; } }
            let _ = d.finish();
        }
    }
}
