//! The bulk path's security (`data = "off" | "authenticated" | "tls"`).
//!
//! - `tls`: every connection is TLS 1.3 with both certificates checked, for its whole life;
//! - `authenticated`: the same handshake proves both ends at connect, the server answers
//!   with one byte over TLS ([`GO`]), the client acknowledges with one plain byte
//!   ([`ACK`]), and both ends go on in plain text on the same socket: nothing per byte
//!   afterwards. Each end drops its TLS layer at a point where the other has sent nothing
//!   it has not read (no session tickets; the client writes nothing between its handshake
//!   and the go byte; the server nothing between the go byte and the acknowledgement, which
//!   it reads from the socket itself), so no TLS layer takes bytes of the plain stream
//!   with it. This keeps
//!   strangers out (no certificate from the cluster CA, no connection); it does not hide
//!   or protect the data from someone who can already read and write the wire.
//! - `off`: plain TCP, as before.
//!
//! A handshake refused ([`Refusal`]) is counted by reason in [`RefusalCounts`]; the caller
//! logs it with the peer's address and goes on serving everyone else.

use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::pki_types::ServerName;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio_rustls::{TlsAcceptor, TlsConnector, TlsStream};

use crate::identity::Identity;
use crate::peer::PeerName;

/// The byte a server of the `authenticated` mode sends, over TLS, once it has taken the
/// client's certificate.
pub const GO: u8 = 0x5A;

/// The client's plain acknowledgement of [`GO`]: from here on both ends write plain text.
pub const ACK: u8 = 0xA5;

/// How long a peer has for its handshake (a connection that sends nothing is closed).
pub const HANDSHAKE_WITHIN: Duration = Duration::from_secs(10);

/// The bulk path's setting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataSecurity {
    #[default]
    Off,
    Authenticated,
    Tls,
}

impl DataSecurity {
    pub fn as_str(self) -> &'static str {
        match self {
            DataSecurity::Off => "off",
            DataSecurity::Authenticated => "authenticated",
            DataSecurity::Tls => "tls",
        }
    }
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("no handshake within {0:?}")]
    Timeout(Duration),
    /// The peer's certificate (or lack of one), as rustls or the role check said.
    #[error("{0}")]
    Certificate(String),
    /// Not TLS at all, or the connection broke during the handshake.
    #[error("{0}")]
    Io(std::io::Error),
}

impl Refusal {
    /// A short label for counters and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Refusal::Timeout(_) => "timeout",
            Refusal::Certificate(_) => "certificate",
            Refusal::Io(_) => "not_tls",
        }
    }

    fn from_io(e: std::io::Error) -> Self {
        // rustls' errors come back inside io::Error (InvalidData, with the rustls error inside).
        match e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
            Some(rustls::Error::InvalidCertificate(c)) => Refusal::Certificate(format!("certificate refused: {c:?}")),
            Some(rustls::Error::General(m)) => Refusal::Certificate(m.clone()),
            Some(rustls::Error::NoCertificatesPresented) => Refusal::Certificate("no certificate presented".into()),
            Some(rustls::Error::AlertReceived(a)) => Refusal::Certificate(format!("the peer refused us: {a:?}")),
            _ => Refusal::Io(e),
        }
    }
}

/// Refused handshakes of one process, by [`Refusal::kind`].
#[derive(Debug, Default)]
pub struct RefusalCounts {
    pub timeout: AtomicU64,
    pub certificate: AtomicU64,
    pub not_tls: AtomicU64,
    pub accepted: AtomicU64,
}

impl RefusalCounts {
    pub fn count(&self, r: &Refusal) {
        let c = match r {
            Refusal::Timeout(_) => &self.timeout,
            Refusal::Certificate(_) => &self.certificate,
            Refusal::Io(_) => &self.not_tls,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// (kind, count) for every kind.
    pub fn snapshot(&self) -> [(&'static str, u64); 3] {
        [
            ("timeout", self.timeout.load(Ordering::Relaxed)),
            ("certificate", self.certificate.load(Ordering::Relaxed)),
            ("not_tls", self.not_tls.load(Ordering::Relaxed)),
        ]
    }

    pub fn refused(&self) -> u64 {
        self.snapshot().iter().map(|(_, n)| n).sum()
    }
}

/// A connection after the handshake: plain TCP (`off`, `authenticated`) or TLS.
#[derive(Debug)]
pub enum DataStream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl DataStream {
    pub fn tcp(&self) -> &TcpStream {
        match self {
            DataStream::Plain(s) => s,
            DataStream::Tls(s) => s.get_ref().0,
        }
    }

    /// Read and write halves: owned TCP halves for plain streams (no lock between them),
    /// `tokio::io::split`'s for TLS (one TLS state, shared).
    pub fn into_split(self) -> (DataRead, DataWrite) {
        match self {
            DataStream::Plain(s) => {
                let (r, w) = s.into_split();
                (DataRead::Plain(r), DataWrite::Plain(w))
            }
            DataStream::Tls(s) => {
                let (r, w) = tokio::io::split(*s);
                (DataRead::Tls(r), DataWrite::Tls(w))
            }
        }
    }

    /// The peer of a TLS stream, as its certificate names it.
    pub fn peer_name(&self) -> Option<PeerName> {
        match self {
            DataStream::Plain(_) => None,
            DataStream::Tls(s) => s.get_ref().1.peer_certificates().and_then(|c| c.first()).and_then(PeerName::of),
        }
    }
}

impl AsRawFd for DataStream {
    fn as_raw_fd(&self) -> RawFd {
        self.tcp().as_raw_fd()
    }
}

/// The read half of a [`DataStream`].
#[derive(Debug)]
pub enum DataRead {
    Plain(OwnedReadHalf),
    Tls(tokio::io::ReadHalf<TlsStream<TcpStream>>),
}

/// The write half of a [`DataStream`].
#[derive(Debug)]
pub enum DataWrite {
    Plain(OwnedWriteHalf),
    Tls(tokio::io::WriteHalf<TlsStream<TcpStream>>),
}

impl DataRead {
    /// Waits until the socket has bytes (plain); a TLS half has no such wait without
    /// reading, so it returns at once and the read that follows waits.
    pub async fn ready(&mut self) -> std::io::Result<()> {
        match self {
            DataRead::Plain(r) => r.readable().await,
            DataRead::Tls(_) => Ok(()),
        }
    }
}

impl AsyncRead for DataRead {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            DataRead::Plain(r) => Pin::new(r).poll_read(cx, buf),
            DataRead::Tls(r) => Pin::new(r).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for DataWrite {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            DataWrite::Plain(w) => Pin::new(w).poll_write(cx, buf),
            DataWrite::Tls(w) => Pin::new(w).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            DataWrite::Plain(w) => Pin::new(w).poll_write_vectored(cx, bufs),
            DataWrite::Tls(w) => Pin::new(w).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            DataWrite::Plain(w) => w.is_write_vectored(),
            DataWrite::Tls(w) => w.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            DataWrite::Plain(w) => Pin::new(w).poll_flush(cx),
            DataWrite::Tls(w) => Pin::new(w).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            DataWrite::Plain(w) => Pin::new(w).poll_shutdown(cx),
            DataWrite::Tls(w) => Pin::new(w).poll_shutdown(cx),
        }
    }
}

/// The connecting end of one kind of link (a source's to builders, a builder's to the
/// writer).
#[derive(Clone)]
pub struct Connector {
    mode: DataSecurity,
    tls: Option<TlsConnector>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector").field("mode", &self.mode).finish_non_exhaustive()
    }
}

impl Default for Connector {
    fn default() -> Self {
        Self::off()
    }
}

impl Connector {
    /// Plain TCP.
    pub fn off() -> Self {
        Self { mode: DataSecurity::Off, tls: None }
    }

    /// `mode` with `identity`, taking servers with one of `roles`.
    pub fn new(mode: DataSecurity, identity: &Identity, roles: &[&str]) -> anyhow::Result<Self> {
        let tls = match mode {
            DataSecurity::Off => None,
            _ => Some(TlsConnector::from(identity.client_config(roles)?)),
        };
        Ok(Self { mode, tls })
    }

    pub fn mode(&self) -> DataSecurity {
        self.mode
    }

    /// The handshake on a connected socket to `addr` (its certificate must name `addr`'s IP).
    pub async fn connect(&self, tcp: TcpStream, addr: SocketAddr) -> Result<DataStream, Refusal> {
        let Some(tls) = &self.tls else { return Ok(DataStream::Plain(tcp)) };
        let name = ServerName::IpAddress(addr.ip().into());
        let handshake = async {
            let mut s = tls.connect(name, tcp).await.map_err(Refusal::from_io)?;
            if self.mode == DataSecurity::Tls {
                return Ok(DataStream::Tls(Box::new(TlsStream::Client(s))));
            }
            // The server's answer says it took our certificate (a refusal arrives as an alert).
            let mut go = [0u8; 1];
            s.read_exact(&mut go).await.map_err(Refusal::from_io)?;
            if go[0] != GO {
                return Err(Refusal::Certificate(format!("the server answered {:#04x}, not the go byte", go[0])));
            }
            let mut tcp = s.into_inner().0;
            tcp.write_all(&[ACK]).await.map_err(Refusal::Io)?;
            Ok(DataStream::Plain(tcp))
        };
        tokio::time::timeout(HANDSHAKE_WITHIN, handshake).await.map_err(|_| Refusal::Timeout(HANDSHAKE_WITHIN))?
    }
}

/// The accepting end of one kind of port (a builder's data port, the writer's).
#[derive(Clone)]
pub struct Acceptor {
    mode: DataSecurity,
    tls: Option<TlsAcceptor>,
    pub counts: Arc<RefusalCounts>,
}

impl std::fmt::Debug for Acceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Acceptor").field("mode", &self.mode).finish_non_exhaustive()
    }
}

impl Default for Acceptor {
    fn default() -> Self {
        Self::off()
    }
}

impl Acceptor {
    pub fn off() -> Self {
        Self { mode: DataSecurity::Off, tls: None, counts: Default::default() }
    }

    /// `mode` with `identity`, taking clients with one of `roles`.
    pub fn new(mode: DataSecurity, identity: &Identity, roles: &[&str]) -> anyhow::Result<Self> {
        let tls = match mode {
            DataSecurity::Off => None,
            _ => Some(TlsAcceptor::from(identity.server_config(roles)?)),
        };
        Ok(Self { mode, tls, counts: Default::default() })
    }

    pub fn mode(&self) -> DataSecurity {
        self.mode
    }

    /// The handshake on an accepted socket; a refusal is counted here.
    pub async fn accept(&self, tcp: TcpStream) -> Result<(DataStream, Option<PeerName>), Refusal> {
        let Some(tls) = &self.tls else { return Ok((DataStream::Plain(tcp), None)) };
        let handshake = async {
            let mut s = tls.accept(tcp).await.map_err(Refusal::from_io)?;
            let peer = s.get_ref().1.peer_certificates().and_then(|c| c.first()).and_then(PeerName::of);
            if self.mode == DataSecurity::Tls {
                return Ok((DataStream::Tls(Box::new(TlsStream::Server(s))), peer));
            }
            s.write_all(&[GO]).await.map_err(Refusal::Io)?;
            s.flush().await.map_err(Refusal::Io)?;
            let mut tcp = s.into_inner().0;
            let mut ack = [0u8; 1];
            tcp.read_exact(&mut ack).await.map_err(Refusal::Io)?;
            if ack[0] != ACK {
                return Err(Refusal::Certificate(format!(
                    "the client answered {:#04x}, not the acknowledgement",
                    ack[0]
                )));
            }
            Ok((DataStream::Plain(tcp), peer))
        };
        let r =
            tokio::time::timeout(HANDSHAKE_WITHIN, handshake).await.unwrap_or(Err(Refusal::Timeout(HANDSHAKE_WITHIN)));
        match &r {
            Ok(_) => {
                self.counts.accepted.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => self.counts.count(e),
        }
        r
    }
}
