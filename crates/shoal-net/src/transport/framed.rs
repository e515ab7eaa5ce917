//! Reading frames from one TCP connection: the loop builders and the writer share.

use std::net::SocketAddr;

use bytes::BytesMut;
use shoal_core::frame::{Frame, StreamDecoder};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedReadHalf;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// A byte stream a [`FrameReader`] reads from: a tokio socket (epoll), or an io_uring one
/// ([`crate::transport::uring`]).
pub trait ReadSource {
    /// Waits until a read would find bytes (or the end of the stream), without a buffer:
    /// the read buffer is taken only then, so that a connection waiting holds none.
    fn ready(&mut self) -> impl std::future::Future<Output = std::io::Result<()>>;

    /// Appends what arrives to `buf` (at least one byte, or 0 at the end of the stream).
    fn read_into(&mut self, buf: &mut BytesMut) -> impl std::future::Future<Output = std::io::Result<usize>>;
}

impl ReadSource for TcpStream {
    async fn ready(&mut self) -> std::io::Result<()> {
        self.readable().await
    }

    async fn read_into(&mut self, buf: &mut BytesMut) -> std::io::Result<usize> {
        self.read_buf(buf).await
    }
}

impl ReadSource for shoal_tls::DataStream {
    async fn ready(&mut self) -> std::io::Result<()> {
        match self {
            shoal_tls::DataStream::Plain(s) => s.readable().await,
            // Whether TLS has bytes to give is known only by reading.
            shoal_tls::DataStream::Tls(_) => Ok(()),
        }
    }

    async fn read_into(&mut self, buf: &mut BytesMut) -> std::io::Result<usize> {
        match self {
            shoal_tls::DataStream::Plain(s) => s.read_buf(buf).await,
            shoal_tls::DataStream::Tls(s) => s.read_buf(buf).await,
        }
    }
}

impl ReadSource for shoal_tls::data::DataRead {
    async fn ready(&mut self) -> std::io::Result<()> {
        shoal_tls::data::DataRead::ready(self).await
    }

    async fn read_into(&mut self, buf: &mut BytesMut) -> std::io::Result<usize> {
        self.read_buf(buf).await
    }
}

impl ReadSource for OwnedReadHalf {
    async fn ready(&mut self) -> std::io::Result<()> {
        self.readable().await
    }

    async fn read_into(&mut self, buf: &mut BytesMut) -> std::io::Result<usize> {
        self.read_buf(buf).await
    }
}

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
    /// Until the first frame: when the connection is closed for saying nothing.
    first_by: Option<tokio::time::Instant>,
}

/// "closing connection" warnings of the whole process: at most one a second, with a count
/// of those held back (a flood of bad connections must not flood the log).
static CLOSING: crate::lograte::LogRate = crate::lograte::LogRate::new(std::time::Duration::from_secs(1));

/// Logs a connection closed for bad input (rate-limited for the whole process).
pub fn log_closing(peer: SocketAddr, reason: &'static str, detail: &str) {
    if let Some(held_back) = CLOSING.check() {
        warn!(%peer, reason, detail, held_back, "closing connection");
    }
}

/// What a builder's connection reader takes frames from: a byte stream's decoder
/// ([`FrameReader`]) or the `ucx` transport's messages ([`crate::transport::ucx::UcxFrames`]).
pub trait Frames {
    /// The next frame, or how the connection ended.
    fn next(&mut self) -> impl std::future::Future<Output = Result<Frame, ReadEnd>>;
    /// The next frame if it is already here, without waiting.
    fn next_buffered(&mut self) -> Result<Option<Frame>, ReadEnd>;
    /// Closes for bad input found by the caller: logs and returns the end to report.
    fn reject(&self, reason: &'static str, detail: &str) -> ReadEnd;
}

impl<R: ReadSource> Frames for FrameReader<R> {
    async fn next(&mut self) -> Result<Frame, ReadEnd> {
        FrameReader::next(self).await
    }

    fn next_buffered(&mut self) -> Result<Option<Frame>, ReadEnd> {
        FrameReader::next_buffered(self)
    }

    fn reject(&self, reason: &'static str, detail: &str) -> ReadEnd {
        FrameReader::reject(self, reason, detail)
    }
}

impl<R: ReadSource> FrameReader<R> {
    pub fn new(stream: R, peer: SocketAddr, max_payload: u32, cancel: CancellationToken) -> Self {
        Self { stream, peer, dec: StreamDecoder::new(max_payload), cancel, first_by: None }
    }

    /// Closes the connection (`no_frame_in_time`) if no whole frame arrives within `d`.
    pub fn first_frame_within(mut self, d: std::time::Duration) -> Self {
        self.first_by = Some(tokio::time::Instant::now() + d);
        self
    }

    /// Closes for bad input found by the caller: logs and returns the end to report.
    pub fn reject(&self, reason: &'static str, detail: &str) -> ReadEnd {
        log_closing(self.peer, reason, detail);
        ReadEnd::Rejected(reason)
    }

    /// The next frame if it has already been read whole, without reading: lets a caller
    /// hand on in one message every frame one read brought.
    pub fn next_buffered(&mut self) -> Result<Option<Frame>, ReadEnd> {
        match self.dec.next_frame() {
            Ok(Some(frame)) => {
                self.first_by = None;
                Ok(Some(frame))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(self.reject(e.kind(), &e.to_string())),
        }
    }

    /// The next frame, or how the connection ended.
    pub async fn next(&mut self) -> Result<Frame, ReadEnd> {
        loop {
            match self.dec.next_frame() {
                Ok(Some(frame)) => {
                    self.first_by = None;
                    return Ok(frame);
                }
                Ok(None) => {}
                Err(e) => return Err(self.reject(e.kind(), &e.to_string())),
            }
            // Nothing held while waiting: the buffer is taken once bytes are there.
            self.dec.release_idle();
            let Self { stream, dec, cancel, first_by, .. } = &mut *self;
            let read = async {
                stream.ready().await?;
                dec.prepare_read();
                stream.read_into(dec.buffer_mut()).await
            };
            let n = tokio::select! {
                r = read => r,
                _ = cancel.cancelled() => return Err(ReadEnd::Cancelled),
                _ = tokio::time::sleep_until(first_by.unwrap_or_else(tokio::time::Instant::now)), if first_by.is_some() => {
                    return Err(self.reject("no_frame_in_time", "no whole frame since the connection opened"));
                }
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
