//! Reading frames from one TCP connection: the loop builders and the writer share.

use std::net::SocketAddr;

use shoal_core::frame::{Frame, StreamDecoder};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// How a connection ended.
#[derive(Debug, PartialEq, Eq)]
pub enum ReadEnd {
    /// End of stream at a frame boundary, or the consumer stopped.
    Clean,
    /// Closed for bad input; the reason is a stable counter label.
    Rejected(&'static str),
    Cancelled,
}

/// Yields the frames of one connection. Decoding errors end it as [`ReadEnd::Rejected`]
/// (a byte stream cannot be resynchronised), logged with the peer and the reason. Reads a
/// whole connection or its read half.
pub struct FrameReader<R = TcpStream> {
    stream: R,
    peer: SocketAddr,
    dec: StreamDecoder,
    cancel: CancellationToken,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(stream: R, peer: SocketAddr, max_payload: u32, cancel: CancellationToken) -> Self {
        Self { stream, peer, dec: StreamDecoder::new(max_payload), cancel }
    }

    /// Closes for bad input found by the caller: logs and returns the end to report.
    pub fn reject(&self, reason: &'static str, detail: &str) -> ReadEnd {
        warn!(peer = %self.peer, reason, detail, "closing connection");
        ReadEnd::Rejected(reason)
    }

    /// The next frame, or how the connection ended.
    pub async fn next(&mut self) -> Result<Frame, ReadEnd> {
        loop {
            match self.dec.next_frame() {
                Ok(Some(frame)) => return Ok(frame),
                Ok(None) => {}
                Err(e) => return Err(self.reject(e.kind(), &e.to_string())),
            }
            self.dec.buffer_mut().reserve(64 * 1024);
            let n = tokio::select! {
                r = self.stream.read_buf(self.dec.buffer_mut()) => r,
                _ = self.cancel.cancelled() => return Err(ReadEnd::Cancelled),
            };
            match n {
                Ok(0) => {
                    return match self.dec.finish() {
                        Ok(()) => Err(ReadEnd::Clean),
                        Err(e) => Err(self.reject(e.kind(), &e.to_string())),
                    };
                }
                Ok(_) => {}
                Err(e) => return Err(self.reject("io_error", &e.to_string())),
            }
        }
    }
}
