//! An async ControlHost client: publish, subscribe (any/all), receive, and reconnect with
//! resubscription. shoal's own processes use it to talk to a dispatcher.
//!
//! Like the KM3NeT Python clients, it keeps its subscription list locally and sends the
//! whole list (`_Subscri`, replace semantics) followed by `_Always` on every change and
//! after every reconnect (with its nickname). A reconnection is cancel-safe: the new
//! connection becomes the client's only once it has been greeted, so a call dropped
//! half-way (a `select!`) never leaves a connection without its subscription.
//!
//! A message published while the client is away is lost (ControlHost keeps nothing), so
//! the greeting can end with a *hello* of the client's choosing ([`ChClient::set_hello`]):
//! a run-controlled process re-announces its state with it, and run control sends again
//! what the process missed.
//!
//! On a secured cluster the client proves itself with its process's certificate
//! ([`ControlTls`], [`ChClient::connect_with`]): mutual TLS 1.3 with the dispatcher, whose
//! certificate must have the `dispatcher` role and name the address dialled.

use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Buf;
use shoal_core::controlhost::{Message, MessageDecoder, Mode, Tag, encode_prefix};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tracing::{debug, warn};

/// A client's credentials for a secured dispatcher (mutual TLS).
#[derive(Clone)]
pub struct ControlTls {
    connector: tokio_rustls::TlsConnector,
}

impl std::fmt::Debug for ControlTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ControlTls")
    }
}

impl ControlTls {
    /// This process's `identity`, taking only a dispatcher's certificate.
    pub fn new(identity: &shoal_tls::Identity) -> anyhow::Result<Self> {
        Ok(Self { connector: tokio_rustls::TlsConnector::from(identity.client_config(&["dispatcher"])?) })
    }
}

/// A connection to the dispatcher: plain, or TLS.
#[derive(Debug)]
enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl Stream {
    fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref().0,
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// Whether the peer has closed the connection (a FIN or a reset is waiting), seen
/// without reading: a peek that does not wait.
fn peer_closed(stream: &TcpStream) -> bool {
    let mut byte = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    match socket2::SockRef::from(stream).peek(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

/// Client errors.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid tag {0:?}: 1 to 8 bytes, no blanks")]
    BadTag(String),
    #[error("dispatcher protocol error: {0}")]
    Protocol(#[from] shoal_core::controlhost::CodecError),
    #[error("cannot reach the dispatcher at {addr} after {attempts} attempts: {source}")]
    Unreachable { addr: SocketAddr, attempts: u32, source: std::io::Error },
}

/// A connection to a dispatcher.
#[derive(Debug)]
pub struct ChClient {
    addr: SocketAddr,
    /// Mutual TLS with a secured dispatcher.
    tls: Option<ControlTls>,
    stream: Option<Stream>,
    decoder: MessageDecoder,
    subs: Vec<(Tag, Mode)>,
    /// Sent as `_MyId` again after a reconnect.
    nickname: Option<String>,
    /// Published at the end of every greeting after a reconnect.
    hello: Option<(Tag, Vec<u8>)>,
    /// A connection was made before (the next one is a reconnection).
    connected_once: bool,
    /// A reconnection completed that [`ChClient::next_message_or_reconnect`] has not
    /// reported yet.
    reconnected: bool,
    /// Connection attempts before an operation gives up (with backoff 50 ms .. 2 s).
    pub max_attempts: u32,
    /// Reconnections so far.
    pub reconnects: u64,
}

/// How long one connection attempt may take before it is abandoned and made again.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The name a dispatcher's certificate must carry: the IP address dialled.
fn rustls_name(addr: SocketAddr) -> tokio_rustls::rustls::pki_types::ServerName<'static> {
    tokio_rustls::rustls::pki_types::ServerName::IpAddress(addr.ip().into())
}

/// Writes `buf` whole and flushes it (a TLS layer holds what it has not sent until then).
async fn write_all_flushed(s: &mut Stream, buf: &mut impl Buf) -> std::io::Result<()> {
    s.write_all_buf(buf).await?;
    s.flush().await
}

pub fn tag(name: &str) -> Result<Tag, ClientError> {
    Tag::new(name.as_bytes()).ok_or_else(|| ClientError::BadTag(name.into()))
}

impl ChClient {
    /// Connects (retrying with backoff up to `max_attempts`).
    pub async fn connect(addr: SocketAddr) -> Result<Self, ClientError> {
        Self::connect_with(addr, None).await
    }

    /// [`ChClient::connect`], proving this process's identity with `tls` where given.
    pub async fn connect_with(addr: SocketAddr, tls: Option<ControlTls>) -> Result<Self, ClientError> {
        let mut c = Self {
            addr,
            tls,
            stream: None,
            decoder: MessageDecoder::new(u32::MAX >> 1),
            subs: Vec::new(),
            nickname: None,
            hello: None,
            connected_once: false,
            reconnected: false,
            max_attempts: 20,
            reconnects: 0,
        };
        c.ensure_connected().await?;
        Ok(c)
    }

    /// Mutual TLS on a connected socket, when this client has credentials.
    async fn secure(&self, tcp: TcpStream) -> std::io::Result<Stream> {
        let Some(tls) = &self.tls else { return Ok(Stream::Plain(tcp)) };
        let name = rustls_name(self.addr);
        match tokio::time::timeout(CONNECT_TIMEOUT, tls.connector.connect(name, tcp)).await {
            Ok(s) => Ok(Stream::Tls(Box::new(s?))),
            Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake timed out")),
        }
    }

    async fn ensure_connected(&mut self) -> Result<&mut Stream, ClientError> {
        if self.stream.is_none() {
            let mut delay = Duration::from_millis(50);
            let mut attempt = 0;
            let began = std::time::Instant::now();
            let s = loop {
                attempt += 1;
                // A SYN that meets a dying dispatcher's full listen queue is dropped and
                // the kernel retries it only after 1, 3, 7 ... s: give up sooner and try
                // afresh, where a restarted dispatcher listens.
                let connected = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(self.addr)).await {
                    Ok(r) => r,
                    Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out")),
                };
                let greeted = match connected {
                    Ok(s) => {
                        let _ = s.set_nodelay(true);
                        // A client that only reads (run control's listener) would wait
                        // forever on a connection whose dispatcher vanished without a FIN
                        // or a reset (its host died, or the handshake landed in a dying
                        // listener): keepalive probes find it out within seconds.
                        let probes = socket2::TcpKeepalive::new()
                            .with_time(Duration::from_secs(2))
                            .with_interval(Duration::from_secs(1))
                            .with_retries(3);
                        let _ = socket2::SockRef::from(&s).set_tcp_keepalive(&probes);
                        match self.secure(s).await {
                            Ok(mut s) => self.greet(&mut s).await.map(|()| s),
                            Err(e) => Err(e),
                        }
                    }
                    Err(e) => Err(e),
                };
                match greeted {
                    Ok(s) => break s,
                    Err(e) if attempt >= self.max_attempts => {
                        return Err(ClientError::Unreachable { addr: self.addr, attempts: attempt, source: e });
                    }
                    Err(e) => {
                        debug!(addr = %self.addr, error = %e, "connect failed, retrying");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(2));
                    }
                }
            };
            self.decoder = MessageDecoder::new(u32::MAX >> 1);
            self.stream = Some(s);
            if self.connected_once {
                // At the level of the "reconnecting" warning, so that the logs show
                // how long a client was away from the dispatcher.
                warn!(addr = %self.addr, attempts = attempt, after = ?began.elapsed(), "reconnected to the dispatcher");
            }
            self.reconnected |= self.connected_once;
            self.connected_once = true;
        }
        Ok(self.stream.as_mut().expect("just connected"))
    }

    /// Nickname and subscription on a new connection, before it is the client's.
    async fn greet(&self, s: &mut Stream) -> std::io::Result<()> {
        if let Some(nick) = &self.nickname {
            s.write_all(&encode_prefix(Tag::MY_ID, nick.len())).await?;
            s.write_all(nick.as_bytes()).await?;
        }
        if !self.subs.is_empty() {
            let text = self.subscription_text();
            for (tag, payload) in [(Tag::SUBSCRIBE, text.as_bytes()), (Tag::ALWAYS, &b""[..])] {
                s.write_all(&encode_prefix(tag, payload.len())).await?;
                s.write_all(payload).await?;
            }
        }
        if let Some((tag, payload)) = &self.hello {
            s.write_all(&encode_prefix(*tag, payload.len())).await?;
            s.write_all(payload).await?;
        }
        s.flush().await
    }

    /// The message published at the end of the greeting on every reconnection (after
    /// the nickname and the subscription), replacing the one set before.
    pub fn set_hello(&mut self, name: &str, payload: &[u8]) -> Result<(), ClientError> {
        self.hello = Some((tag(name)?, payload.to_vec()));
        Ok(())
    }

    fn subscription_text(&self) -> String {
        let mut text = String::new();
        for (t, m) in &self.subs {
            text.push(' ');
            text.push(m.letter());
            text.push(' ');
            text.push_str(&t.to_string());
        }
        text
    }

    async fn write_message(&mut self, tag: Tag, payload: &[u8]) -> Result<(), ClientError> {
        let prefix = encode_prefix(tag, payload.len());
        let mut last_err = None;
        for _ in 0..3 {
            if self.stream.as_ref().is_some_and(|s| peer_closed(s.tcp())) {
                // The dispatcher went away (it was restarted): a write would still be
                // taken by our socket and then lost. Reconnect first.
                warn!("the dispatcher closed the connection; reconnecting");
                self.stream = None;
                self.reconnects += 1;
            }
            self.ensure_connected().await?;
            let s = self.stream.as_mut().expect("connected");
            let mut buf = Buf::chain(&prefix[..], payload);
            match write_all_flushed(s, &mut buf).await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    warn!(error = %e, "write to dispatcher failed; reconnecting");
                    self.stream = None;
                    self.reconnects += 1;
                    last_err = Some(e);
                }
            }
        }
        Err(ClientError::Unreachable { addr: self.addr, attempts: 3, source: last_err.expect("three failures") })
    }

    async fn send_subscription(&mut self) -> Result<(), ClientError> {
        let text = self.subscription_text();
        let s = self.stream.as_mut().expect("connected");
        for (tag, payload) in [(Tag::SUBSCRIBE, text.as_bytes()), (Tag::ALWAYS, &b""[..])] {
            let prefix = encode_prefix(tag, payload.len());
            let mut buf = Buf::chain(&prefix[..], payload);
            if let Err(e) = write_all_flushed(s, &mut buf).await {
                warn!(error = %e, "subscribing failed");
                self.stream = None;
                break;
            }
        }
        Ok(())
    }

    /// Adds `name` to the subscription (or changes its mode) and re-sends the whole list.
    pub async fn subscribe(&mut self, name: &str, mode: Mode) -> Result<(), ClientError> {
        let t = tag(name)?;
        match self.subs.iter_mut().find(|(x, _)| *x == t) {
            Some(e) => e.1 = mode,
            None => self.subs.push((t, mode)),
        }
        self.ensure_connected().await?;
        self.send_subscription().await
    }

    pub async fn unsubscribe(&mut self, name: &str) -> Result<(), ClientError> {
        let t = tag(name)?;
        self.subs.retain(|(x, _)| *x != t);
        self.ensure_connected().await?;
        self.send_subscription().await
    }

    /// Names this connection (`_MyId`); the dispatcher announces it as `Born`.
    pub async fn set_nickname(&mut self, nick: &str) -> Result<(), ClientError> {
        self.nickname = Some(nick.to_string());
        self.write_message(Tag::MY_ID, nick.as_bytes()).await
    }

    pub async fn publish(&mut self, name: &str, payload: &[u8]) -> Result<(), ClientError> {
        self.write_message(tag(name)?, payload).await
    }

    /// The next message for our subscriptions. Reconnects (and resubscribes) if the
    /// dispatcher goes away; a protocol error is returned and the connection reset.
    pub async fn next_message(&mut self) -> Result<Message, ClientError> {
        loop {
            if let Some(m) = self.next_message_or_reconnect().await? {
                return Ok(m);
            }
        }
    }

    /// Like [`ChClient::next_message`], but `None` once after every reconnection (by
    /// any call): what was published to us while we were away is lost.
    pub async fn next_message_or_reconnect(&mut self) -> Result<Option<Message>, ClientError> {
        loop {
            match self.decoder.next_message() {
                Ok(Some(m)) => return Ok(Some(m)),
                Ok(None) => {}
                Err(e) => {
                    self.stream = None;
                    return Err(e.into());
                }
            }
            self.ensure_connected().await?;
            // Here or in an earlier call (a publish, a read that was dropped).
            if std::mem::take(&mut self.reconnected) {
                return Ok(None);
            }
            let s = self.stream.as_mut().expect("connected");
            let buf = self.decoder.buffer_mut();
            buf.reserve(16 * 1024);
            match s.read_buf(buf).await {
                Ok(n) if n > 0 => {}
                other => {
                    warn!(result = ?other.map_err(|e| e.to_string()), "dispatcher connection lost; reconnecting");
                    self.stream = None;
                    self.reconnects += 1;
                }
            }
        }
    }
}
