//! What a link writes: pieces of frames ([`Chunk`]), shared by the TCP link
//! ([`crate::transport::link`]) and the `ucx` path ([`crate::transport::ucx`]).

use bytes::Bytes;
use shoal_core::frame::HEADER_LEN;
use shoal_core::{SourceId, slice::SliceNumber};

/// A piece of one frame to write: `head` (a part of the header) then `body` (a part of the
/// payload), either possibly empty. Payloads are never copied into a frame buffer.
#[derive(Debug)]
pub struct Chunk {
    pub source: SourceId,
    pub slice: SliceNumber,
    /// Starts a frame: `head` is the whole header and gets the send time stamped.
    pub first: bool,
    /// Ends a frame: a report follows.
    pub last: bool,
    pub head: Bytes,
    pub body: Bytes,
}

impl Chunk {
    /// A whole frame in one chunk.
    pub fn frame(source: SourceId, slice: SliceNumber, header: [u8; HEADER_LEN], payload: Bytes) -> Chunk {
        Chunk { source, slice, first: true, last: true, head: Bytes::copy_from_slice(&header), body: payload }
    }

    pub fn len(&self) -> usize {
        self.head.len() + self.body.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
