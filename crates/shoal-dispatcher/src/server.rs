//! `shoal dispatcher`: a ControlHost-compatible message dispatcher on tokio.
//!
//! The routing decisions are shoal-core's [`Router`]; this module moves bytes. One reader
//! and one writer task per connection, one core task that owns the router:
//! - readers decode messages ([`MessageDecoder`]) and pass them to the core through one
//!   bounded channel; while the router is over its memory limit the core stops taking from
//!   that channel, so readers stop reading and publishers feel TCP back-pressure;
//! - the core hands each delivery to the client's writer, which gathers what is queued into
//!   as few writes as possible (never splitting a frame across writes) and reports
//!   completions; a slow client only fills its own queue;
//! - garbage (negative or oversized length, EOF inside a message) closes only that
//!   connection, with a logged reason and a counter;
//! - a command tag (`RC_CMD`, `ALERT`) published from an address its [`CommandAccess`]
//!   does not allow is dropped, counted by tag and logged at a bounded rate; the
//!   connection stays, its other messages and its subscriptions go on (KM3NeT's clients
//!   reconnect on errors, so closing would only make them publish again).
//!
//! - secured (`shoal dispatcher --credentials DIR`, what run control starts whenever the
//!   cluster has a CA): the same port also takes mutual TLS (a connection whose first byte
//!   opens a TLS handshake), and each such connection is known by its certificate's process
//!   name and role for its life. Every message is judged by [`Authority`] (who may publish
//!   which of shoal's tags, and about whom; what plain connections may subscribe to); one
//!   refused is dropped, counted by tag, identity and reason, logged at a bounded rate and
//!   audited. A process's control connection that closes is announced on `RC_GONE`, which
//!   nobody else can publish.
//!
//! HTTP (optional): `/status` (JSON: clients, nicknames, subscriptions, queues) and
//! `/metrics` (Prometheus text).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Buf;
use serde::Serialize;
use shoal_core::controlhost::router::{ClientStatus, TagStats};
use shoal_core::controlhost::{
    ClientId, CommandAccess, Message, MessageDecoder, Output, Router, RouterConfig, Tag, encode_prefix,
    parse_subscription,
};
use shoal_tls::peer::PeerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::audit::{Audit, AuditEvent};
use crate::authority::{Authority, Publisher, RC_GONE};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Messages decoded by readers and not yet taken by the core, for all connections together.
const INPUT_QUEUE: usize = 32;

/// Where a message came from: its connection's address and certificate.
#[derive(Debug)]
struct Origin {
    peer: SocketAddr,
    identity: Option<PeerName>,
}

/// A message from a reader, with where it came from. The origin travels with the message
/// because the connection's `Closed` event may overtake its last messages to the core (a
/// client that publishes and leaves at once): judged by a connection the core no longer
/// knows, they would be lost, or let through unjudged.
type Input = (ClientId, std::sync::Arc<Origin>, Message);

/// Dispatcher settings (`shoal dispatcher` flags).
#[derive(Clone, Debug)]
pub struct DispatcherConfig {
    pub router: RouterConfig,
    /// Largest payload accepted; a larger length closes the connection.
    pub max_payload: u32,
    /// Most clients connected at once; a connection beyond is closed at once and counted
    /// (`connection_limit`), so a flood cannot take every descriptor of the process.
    pub max_clients: usize,
    /// Who may publish command tags (default: this host only); unsecured dispatchers.
    pub access: CommandAccess,
    /// Mutual TLS beside the plain port and the rules of a secured control plane.
    pub secure: Option<SecureControl>,
}

/// A secured dispatcher's credentials and rules.
#[derive(Clone)]
pub struct SecureControl {
    acceptor: tokio_rustls::TlsAcceptor,
    pub authority: Authority,
    /// Where refusals and the plain port's commands are audited.
    pub audit: Option<std::sync::Arc<Audit>>,
}

impl std::fmt::Debug for SecureControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecureControl").field("authority", &self.authority).finish_non_exhaustive()
    }
}

impl SecureControl {
    /// The dispatcher's `identity` (role `dispatcher`), taking clients of any role of the
    /// cluster CA, with `authority`'s rules.
    pub fn new(
        identity: &shoal_tls::Identity,
        authority: Authority,
        audit: Option<std::sync::Arc<Audit>>,
    ) -> anyhow::Result<Self> {
        let acceptor = tokio_rustls::TlsAcceptor::from(identity.server_config(&[])?);
        Ok(Self { acceptor, authority, audit })
    }
}

/// The first byte of a TLS handshake record: ControlHost tags are text.
const TLS_HANDSHAKE: u8 = 0x16;

/// How long a connection has to send its first byte (plain) or finish its TLS handshake.
const FIRST_BYTE_WITHIN: Duration = Duration::from_secs(10);

impl Default for DispatcherConfig {
    fn default() -> Self {
        Self {
            router: RouterConfig::default(),
            max_payload: 64 << 20,
            max_clients: 16_000,
            access: CommandAccess::default(),
            secure: None,
        }
    }
}

enum Event {
    Connected {
        id: ClientId,
        peer: SocketAddr,
        identity: Option<PeerName>,
        writer: mpsc::UnboundedSender<Message>,
        close: CancellationToken,
    },
    Closed {
        id: ClientId,
        reason: Option<&'static str>,
    },
    /// A connection closed at accept (over `max_clients`).
    Refused {
        reason: &'static str,
    },
    Written {
        id: ClientId,
        messages: usize,
    },
    Snapshot(oneshot::Sender<Snapshot>),
}

struct Conn {
    peer: SocketAddr,
    /// Its certificate's process (mutual TLS), or none (the plain port).
    identity: Option<PeerName>,
    /// Its nickname, where it named itself.
    nick: Option<String>,
    writer: mpsc::UnboundedSender<Message>,
    close: CancellationToken,
    since: Instant,
}

/// One client on the status page: the router's view plus the connection's.
#[derive(Clone, Debug, Serialize)]
pub struct ClientInfo {
    pub peer: String,
    pub connected_s: f64,
    #[serde(flatten)]
    pub status: ClientStatus,
}

/// Everything `/status` and `/metrics` show.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Snapshot {
    pub clients: Vec<ClientInfo>,
    pub tags: BTreeMap<String, TagStats>,
    pub held_bytes: u64,
    /// Time publishers spent paused by back-pressure (memory limit), seconds.
    pub backpressure_s: f64,
    pub accepting: bool,
    pub connections_total: u64,
    /// Connections closed for bad input, by reason.
    pub rejected: BTreeMap<String, u64>,
    /// Command tags refused for their publisher's address, by tag.
    pub commands_refused: BTreeMap<String, u64>,
    /// A secured dispatcher's refusals: messages dropped and subscriptions cut, by tag,
    /// identity (the certificate's name, or `plain`) and reason.
    pub refused: Vec<Refused>,
    /// Connections of a secured dispatcher by kind: `tls` (authenticated) and `plain`.
    pub authenticated: BTreeMap<String, u64>,
}

/// Messages (or subscriptions) of one tag refused for one identity and reason.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Refused {
    pub tag: String,
    pub identity: String,
    pub reason: String,
    pub count: u64,
}

/// A handle to ask a running dispatcher for its state.
#[derive(Clone, Debug)]
pub struct DispatcherHandle {
    events: mpsc::UnboundedSender<Event>,
    pub addr: SocketAddr,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Event")
    }
}

impl DispatcherHandle {
    pub async fn snapshot(&self) -> Option<Snapshot> {
        let (tx, rx) = oneshot::channel();
        self.events.send(Event::Snapshot(tx)).ok()?;
        rx.await.ok()
    }
}

/// Starts a dispatcher on a bound listener; it runs until `cancel`.
pub fn spawn_dispatcher(
    listener: TcpListener,
    cfg: DispatcherConfig,
    cancel: CancellationToken,
) -> std::io::Result<(DispatcherHandle, tokio::task::JoinHandle<()>)> {
    let addr = listener.local_addr()?;
    let (ev_tx, ev_rx) = mpsc::unbounded_channel();
    // Small on purpose: messages waiting here are outside the router's memory accounting,
    // so while publishers are paused at most this many more can pile up.
    let (in_tx, in_rx) = mpsc::channel::<Input>(INPUT_QUEUE);
    let accept_events = ev_tx.clone();
    let accept_cancel = cancel.clone();
    let places = std::sync::Arc::new(tokio::sync::Semaphore::new(cfg.max_clients));
    let (max_payload, max_clients) = (cfg.max_payload, cfg.max_clients);
    let acceptor = cfg.secure.as_ref().map(|s| s.acceptor.clone());
    tokio::spawn(async move {
        let mut next_id: ClientId = 1;
        loop {
            tokio::select! {
                r = listener.accept() => match r {
                    Ok((stream, peer)) => {
                        let Ok(place) = places.clone().try_acquire_owned() else {
                            drop(stream);
                            if let Some(held_back) = LIMITED.check() {
                                warn!(%peer, max_clients, held_back, "at the client limit: connection closed");
                            }
                            let _ = accept_events.send(Event::Refused { reason: "connection_limit" });
                            continue;
                        };
                        start_connection(next_id, stream, peer, max_payload, acceptor.clone(), &accept_events, &in_tx, place);
                        next_id += 1;
                    }
                    Err(e) => {
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                },
                _ = accept_cancel.cancelled() => return,
            }
        }
    });
    if let Some(audit) = cfg.secure.as_ref().and_then(|s| s.audit.clone()) {
        tokio::spawn(flush_audit(audit, cancel.clone()));
    }
    let authority = cfg.secure.map(|s| (s.authority, s.audit));
    let core = tokio::spawn(run_core(Router::new(cfg.router), cfg.access, authority, ev_rx, in_rx, cancel));
    info!(%addr, "dispatcher listening");
    Ok((DispatcherHandle { events: ev_tx, addr }, core))
}

#[allow(clippy::too_many_arguments)]
fn start_connection(
    id: ClientId,
    stream: TcpStream,
    peer: SocketAddr,
    max_payload: u32,
    secure: Option<tokio_rustls::TlsAcceptor>,
    events: &mpsc::UnboundedSender<Event>,
    input: &mpsc::Sender<Input>,
    place: tokio::sync::OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let _ = socket2::SockRef::from(&stream).set_keepalive(true);
    let (events, input) = (events.clone(), input.clone());
    let Some(acceptor) = secure else {
        let (r, w) = stream.into_split();
        return serve_connection(id, r, w, peer, None, max_payload, events, input, place);
    };
    // Secured: TLS or plain, told by the first byte, in the connection's own task.
    tokio::spawn(async move {
        let mut first = [0u8; 1];
        let tls = match tokio::time::timeout(FIRST_BYTE_WITHIN, stream.peek(&mut first)).await {
            Ok(Ok(1)) => first[0] == TLS_HANDSHAKE,
            Ok(_) => return, // closed, or failed, before its first byte
            Err(_) => false, // silent: a plain client that has not spoken yet
        };
        if !tls {
            let (r, w) = stream.into_split();
            return serve_connection(id, r, w, peer, None, max_payload, events, input, place);
        }
        let handshake = tokio::time::timeout(FIRST_BYTE_WITHIN, acceptor.accept(stream)).await;
        let s = match handshake {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return refuse_handshake(&events, peer, &e.to_string()),
            Err(_) => return refuse_handshake(&events, peer, "no TLS handshake within 10 s"),
        };
        let identity = s.get_ref().1.peer_certificates().and_then(|c| c.first()).and_then(PeerName::of);
        let (r, w) = tokio::io::split(s);
        serve_connection(id, r, w, peer, identity, max_payload, events, input, place);
    });
}

/// A TLS handshake refused on a secured dispatcher: counted, logged at a bounded rate.
fn refuse_handshake(events: &mpsc::UnboundedSender<Event>, peer: SocketAddr, why: &str) {
    if let Some(held_back) = REFUSED.check() {
        warn!(%peer, error = why, held_back, "TLS handshake on the dispatcher's port refused: connection closed");
    }
    let _ = events.send(Event::Refused { reason: "tls_handshake" });
}

/// The reader and the writer of one connection.
#[allow(clippy::too_many_arguments)]
fn serve_connection<R, W>(
    id: ClientId,
    r: R,
    w: W,
    peer: SocketAddr,
    identity: Option<PeerName>,
    max_payload: u32,
    events: mpsc::UnboundedSender<Event>,
    input: mpsc::Sender<Input>,
    place: tokio::sync::OwnedSemaphorePermit,
) where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (wtx, wrx) = mpsc::unbounded_channel();
    let close = CancellationToken::new();
    // Register before the reader can produce anything, so the core knows the client.
    let identity_for_reader = identity.clone();
    let _ = events.send(Event::Connected { id, peer, identity, writer: wtx, close: close.clone() });
    let (read_events, read_close) = (events.clone(), close.clone());
    tokio::spawn(async move {
        let origin = std::sync::Arc::new(Origin { peer, identity: identity_for_reader });
        read_loop(id, r, origin, max_payload, input, read_events, read_close).await;
        drop(place);
    });
    tokio::spawn(write_loop(id, w, wrx, events, close));
}

async fn read_loop(
    id: ClientId,
    mut r: impl AsyncRead + Unpin,
    origin: std::sync::Arc<Origin>,
    max_payload: u32,
    input: mpsc::Sender<Input>,
    events: mpsc::UnboundedSender<Event>,
    close: CancellationToken,
) {
    let peer = origin.peer;
    let mut dec = MessageDecoder::new(max_payload);
    let reason = loop {
        dec.buffer_mut().reserve(16 * 1024);
        let n = tokio::select! {
            n = r.read_buf(dec.buffer_mut()) => n,
            _ = close.cancelled() => break None,
        };
        match n {
            Ok(0) => break dec.finish().err().map(|e| e.kind()),
            Ok(_) => {}
            Err(e) => {
                debug!(%peer, error = %e, "read failed");
                break None;
            }
        }
        let mut bad = None;
        loop {
            match dec.next_message() {
                Ok(Some(m)) => {
                    if input.send((id, origin.clone(), m)).await.is_err() {
                        return;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    warn!(%peer, reason = e.kind(), detail = %e, "closing ControlHost connection");
                    bad = Some(e.kind());
                    break;
                }
            }
        }
        if bad.is_some() {
            break bad;
        }
    };
    if let Some(kind) = reason
        && kind == "truncated"
    {
        warn!(%peer, reason = kind, "connection ended inside a message");
    }
    close.cancel();
    let _ = events.send(Event::Closed { id, reason });
}

async fn write_loop(
    id: ClientId,
    mut w: impl AsyncWrite + Unpin,
    mut rx: mpsc::UnboundedReceiver<Message>,
    events: mpsc::UnboundedSender<Event>,
    close: CancellationToken,
) {
    // Small messages are gathered into one buffer and written together (Redis does the
    // same with its output buffer); a large one is written straight from its payload. Every
    // frame, prefix and payload, is always inside a single write call: some clients read
    // the prefix with one recv(16) and reconnect if it arrives split.
    const GATHER: usize = 64 * 1024;
    let mut out = bytes::BytesMut::with_capacity(GATHER);
    loop {
        let first = tokio::select! {
            m = rx.recv() => match m { Some(m) => m, None => break },
            _ = close.cancelled() => break,
        };
        let mut batch = vec![first];
        while batch.len() < 256 {
            match rx.try_recv() {
                Ok(m) => batch.push(m),
                Err(_) => break,
            }
        }
        let n = batch.len();
        let mut failed = false;
        for m in batch {
            let prefix = encode_prefix(m.tag, m.payload.len());
            if out.len() + prefix.len() + m.payload.len() <= GATHER {
                out.extend_from_slice(&prefix);
                out.extend_from_slice(&m.payload);
                continue;
            }
            if !out.is_empty() && w.write_all_buf(&mut out).await.is_err() {
                failed = true;
                break;
            }
            let mut buf = Buf::chain(&prefix[..], &m.payload[..]);
            if w.write_all_buf(&mut buf).await.is_err() {
                failed = true;
                break;
            }
        }
        if !failed && !out.is_empty() && w.write_all_buf(&mut out).await.is_err() {
            failed = true;
        }
        // A TLS writer keeps what it has not sent until flushed.
        if !failed && w.flush().await.is_err() {
            failed = true;
        }
        if failed {
            debug!(client = id, "write failed");
            close.cancel();
            break;
        }
        let _ = events.send(Event::Written { id, messages: n });
    }
    let _ = w.shutdown().await;
}

/// What the core task owns besides the router.
struct Core {
    router: Router,
    access: CommandAccess,
    /// A secured dispatcher's rules and audit.
    authority: Option<(Authority, Option<std::sync::Arc<Audit>>)>,
    refused: BTreeMap<(String, String, String), u64>,
    authenticated: BTreeMap<String, u64>,
    conns: HashMap<ClientId, Conn>,
    rejected: BTreeMap<String, u64>,
    commands_refused: BTreeMap<String, u64>,
    connections_total: u64,
    paused_since: Option<Instant>,
    backpressure: Duration,
}

impl Core {
    fn on_event(&mut self, event: Event) {
        match event {
            Event::Connected { id, peer, identity, writer, close } => {
                self.connections_total += 1;
                if self.authority.is_some() {
                    *self.authenticated.entry(if identity.is_some() { "tls" } else { "plain" }.into()).or_default() +=
                        1;
                }
                self.router.handle_connect(id);
                self.conns.insert(id, Conn { peer, identity, nick: None, writer, close, since: Instant::now() });
            }
            Event::Closed { id, reason } => {
                if let Some(r) = reason {
                    *self.rejected.entry(r.to_string()).or_default() += 1;
                }
                if let Some(c) = self.conns.remove(&id) {
                    c.close.cancel();
                    // A process's control connection (named as its certificate) is gone:
                    // said on a tag only the dispatcher publishes.
                    if let Some(p) = c.identity.filter(|p| c.nick.as_deref() == Some(p.name.as_str())) {
                        let gone =
                            Message { tag: Tag::new(RC_GONE.as_bytes()).expect("a valid tag"), payload: p.name.into() };
                        self.router.handle_message(id, gone);
                    }
                }
                self.router.handle_disconnect(id);
            }
            Event::Refused { reason } => *self.rejected.entry(reason.to_string()).or_default() += 1,
            Event::Written { id, messages } => self.router.handle_written(id, messages),
            Event::Snapshot(reply) => {
                let bp = self.backpressure + self.paused_since.map_or(Duration::ZERO, |t| t.elapsed());
                let mut snap = snapshot(&self.router, &self.conns, &self.rejected, self.connections_total, bp);
                snap.commands_refused = self.commands_refused.clone();
                snap.refused = self
                    .refused
                    .iter()
                    .map(|((tag, identity, reason), n)| Refused {
                        tag: tag.clone(),
                        identity: identity.clone(),
                        reason: reason.clone(),
                        count: *n,
                    })
                    .collect();
                snap.authenticated = self.authenticated.clone();
                let _ = reply.send(snap);
            }
        }
    }

    /// A message from a reader. The events waiting are taken first: a connection's
    /// `Connected` was sent before its reader existed, but the core may have looked at
    /// the events just before it came, and a greeting (`_Subscri`, `_Always`) handled
    /// for a connection the router does not know yet would be lost.
    fn on_message(&mut self, events: &mut mpsc::UnboundedReceiver<Event>, id: ClientId, origin: &Origin, m: Message) {
        while let Ok(e) = events.try_recv() {
            self.on_event(e);
        }
        if self.authority.is_some() {
            if let Some(m) = self.judge(id, origin, m) {
                self.router.handle_message(id, m);
            }
            return;
        }
        if !self.access.allows(&m.tag, origin.peer.ip()) {
            *self.commands_refused.entry(m.tag.to_string()).or_default() += 1;
            if let Some(held_back) = REFUSED.check() {
                warn!(peer = %origin.peer, tag = %m.tag, held_back, allowed = ?self.access.allowed(),
                    "a command tag from an address not allowed to command: dropped");
            }
            return;
        }
        self.router.handle_message(id, m);
    }

    /// A secured dispatcher's rules on one message: what goes on (a subscription without
    /// the tags the connection may not have), or `None` once its refusal is counted,
    /// logged and audited.
    fn judge(&mut self, id: ClientId, c: &Origin, m: Message) -> Option<Message> {
        let (authority, audit) = self.authority.as_ref()?;
        let who = match &c.identity {
            Some(p) => Publisher::Certified { name: &p.name, role: &p.role },
            None => Publisher::Plain { ip: c.peer.ip() },
        };
        // Named only for a refusal or an audited command: most messages are data.
        let identity = || c.identity.as_ref().map_or_else(|| "plain".to_string(), |p| p.name.clone());
        let what = || String::from_utf8_lossy(&m.payload[..m.payload.len().min(80)]).into_owned();
        let audit_event = |outcome: &str, reason: &str, what: String| {
            if let Some(audit) = audit {
                audit.record(AuditEvent {
                    kind: "dispatcher".into(),
                    what,
                    outcome: outcome.into(),
                    reason: reason.into(),
                    identity: c.identity.as_ref().map(|p| p.name.clone()).unwrap_or_default(),
                    role: c.identity.as_ref().map(|p| p.role.clone()).unwrap_or_default(),
                    address: c.peer.to_string(),
                    ..Default::default()
                });
            }
        };
        if m.tag == Tag::SUBSCRIBE {
            let mut sub = parse_subscription(&m.payload);
            let cut = authority.judge_subscribe(who, &sub);
            if cut.is_empty() {
                return Some(m);
            }
            for t in &cut {
                sub.tags.remove(t);
                *self.refused.entry((t.to_string(), identity(), "subscribe".into())).or_default() += 1;
                audit_event("refused", "subscribe", format!("subscribe {t}"));
            }
            if let Some(held_back) = REFUSED.check() {
                warn!(peer = %c.peer, identity = identity(), tags = ?cut.iter().map(Tag::to_string).collect::<Vec<_>>(), held_back,
                    "a subscription to tags this connection may not read: those tags taken out");
            }
            return Some(Message { tag: m.tag, payload: sub.to_text().into() });
        }
        if let Err(r) = authority.judge_publish(who, &m.tag, &m.payload) {
            *self.refused.entry((m.tag.to_string(), identity(), r.reason().into())).or_default() += 1;
            audit_event("refused", r.reason(), format!("{} {}", m.tag, what()));
            if let Some(held_back) = REFUSED.check() {
                warn!(peer = %c.peer, identity = identity(), tag = %m.tag, reason = r.reason(), held_back,
                    "a message this connection may not publish: dropped");
            }
            return None;
        }
        if c.identity.is_none() && crate::authority::is_command(&m.tag) {
            // A command from the plain port (a network command_from names): audited as
            // run control's API's commands are.
            audit_event("accepted", "", format!("{} {}", m.tag, what()));
        }
        if (m.tag == Tag::MY_ID || m.tag == Tag::UNIQUE_ID)
            && let Some(conn) = self.conns.get_mut(&id)
        {
            let end = m.payload.iter().position(|&b| b == 0).unwrap_or(m.payload.len());
            conn.nick = Some(String::from_utf8_lossy(&m.payload[..end]).into_owned());
        }
        Some(m)
    }

    fn flush(&mut self) {
        while let Some(o) = self.router.poll_output() {
            match o {
                Output::Transmit { client, message } => {
                    if let Some(c) = self.conns.get(&client) {
                        let _ = c.writer.send(message);
                    }
                }
                Output::Close { client, reason } => {
                    warn!(client, ?reason, "closing client");
                    if let Some(c) = self.conns.get(&client) {
                        c.close.cancel();
                    }
                }
            }
        }
    }
}

async fn run_core(
    router: Router,
    access: CommandAccess,
    authority: Option<(Authority, Option<std::sync::Arc<Audit>>)>,
    mut events: mpsc::UnboundedReceiver<Event>,
    mut input: mpsc::Receiver<Input>,
    cancel: CancellationToken,
) {
    let mut core = Core {
        router,
        access,
        authority,
        refused: BTreeMap::new(),
        authenticated: BTreeMap::new(),
        conns: HashMap::new(),
        rejected: BTreeMap::new(),
        commands_refused: BTreeMap::new(),
        connections_total: 0,
        paused_since: None,
        backpressure: Duration::ZERO,
    };
    loop {
        let accepting = core.router.accepting();
        match (accepting, core.paused_since) {
            (false, None) => core.paused_since = Some(Instant::now()),
            (true, Some(t)) => {
                core.backpressure += t.elapsed();
                core.paused_since = None;
            }
            _ => {}
        }
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            e = events.recv() => match e {
                Some(e) => core.on_event(e),
                None => break,
            },
            m = input.recv(), if accepting => match m {
                Some((id, origin, m)) => {
                    core.on_message(&mut events, id, &origin, m);
                    // Take what else is waiting before flushing outputs, so that writers
                    // wake once per batch rather than once per message.
                    for _ in 0..255 {
                        if !core.router.accepting() {
                            break;
                        }
                        match input.try_recv() {
                            Ok((id, origin, m)) => core.on_message(&mut events, id, &origin, m),
                            Err(_) => break,
                        }
                    }
                }
                None => break,
            },
        }
        core.flush();
    }
    for c in core.conns.values() {
        c.close.cancel();
    }
}

fn snapshot(
    router: &Router,
    conns: &HashMap<ClientId, Conn>,
    rejected: &BTreeMap<String, u64>,
    connections_total: u64,
    backpressure: Duration,
) -> Snapshot {
    let clients = router
        .status()
        .into_iter()
        .map(|status| {
            let c = conns.get(&status.id);
            ClientInfo {
                peer: c.map(|c| c.peer.to_string()).unwrap_or_default(),
                connected_s: c.map_or(0.0, |c| c.since.elapsed().as_secs_f64()),
                status,
            }
        })
        .collect();
    Snapshot {
        clients,
        tags: router.tag_stats().map(|(t, s)| (t.to_string(), *s)).collect(),
        held_bytes: router.held_bytes(),
        backpressure_s: backpressure.as_secs_f64(),
        accepting: router.accepting(),
        connections_total,
        rejected: rejected.clone(),
        commands_refused: BTreeMap::new(),
        refused: Vec::new(),
        authenticated: BTreeMap::new(),
    }
}

/// Prometheus text for a snapshot (`shoal_dispatcher_*`).
pub fn metrics_text(s: &Snapshot) -> String {
    use prometheus_client::encoding::text::encode;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::registry::Registry;
    type Labels = Vec<(String, String)>;

    let mut reg = Registry::default();
    let clients = Gauge::<i64>::default();
    clients.set(s.clients.len() as i64);
    reg.register("shoal_dispatcher_clients", "Connected clients", clients);
    let held = Gauge::<i64>::default();
    held.set(s.held_bytes as i64);
    reg.register("shoal_dispatcher_held_bytes", "Bytes queued for delivery", held);
    let conns = Counter::<u64>::default();
    conns.inc_by(s.connections_total);
    reg.register("shoal_dispatcher_connections", "Connections accepted", conns);
    let bp = Counter::<f64, std::sync::atomic::AtomicU64>::default();
    bp.inc_by(s.backpressure_s);
    reg.register("shoal_dispatcher_backpressure_seconds", "Time publishers were paused by the memory limit", bp);
    type TagCounter = (&'static str, &'static str, fn(&TagStats) -> u64);
    let tag_families: [TagCounter; 5] = [
        ("shoal_dispatcher_messages_in", "Messages received per tag", |t| t.messages_in),
        ("shoal_dispatcher_bytes_in", "Payload bytes received per tag", |t| t.bytes_in),
        ("shoal_dispatcher_messages_out", "Messages delivered per tag", |t| t.messages_out),
        ("shoal_dispatcher_bytes_out", "Payload bytes delivered per tag", |t| t.bytes_out),
        ("shoal_dispatcher_dropped_messages", "Any-mode messages dropped per tag", |t| t.dropped),
    ];
    for (name, help, get) in tag_families {
        let fam = Family::<Labels, Counter>::default();
        for (tag, info) in &s.tags {
            fam.get_or_create(&vec![("tag".into(), tag.clone())]).inc_by(get(info));
        }
        reg.register(name, help, fam);
    }
    let drops = Family::<Labels, Counter>::default();
    for c in s.clients.iter().map(|c| &c.status) {
        let nick = c.nickname.clone().unwrap_or_default();
        drops.get_or_create(&vec![("client".into(), c.id.to_string()), ("nickname".into(), nick)]).inc_by(c.dropped);
    }
    reg.register("shoal_dispatcher_client_dropped_messages", "Any-mode messages dropped per client", drops);
    let rej = Family::<Labels, Counter>::default();
    for (reason, n) in &s.rejected {
        rej.get_or_create(&vec![("reason".into(), reason.clone())]).inc_by(*n);
    }
    reg.register("shoal_dispatcher_rejected_connections", "Connections closed for bad input", rej);
    let refused = Family::<Labels, Counter>::default();
    for (tag, n) in &s.commands_refused {
        refused.get_or_create(&vec![("tag".into(), tag.clone())]).inc_by(*n);
    }
    reg.register(
        "shoal_dispatcher_commands_refused",
        "Command tags dropped for their publisher's address (docs/security.md)",
        refused,
    );
    let refused = Family::<Labels, Counter>::default();
    for r in &s.refused {
        let labels = vec![
            ("tag".into(), r.tag.clone()),
            ("identity".into(), r.identity.clone()),
            ("reason".into(), r.reason.clone()),
        ];
        refused.get_or_create(&labels).inc_by(r.count);
    }
    reg.register(
        "shoal_dispatcher_messages_refused",
        "A secured dispatcher's refusals by tag, identity (certificate name or plain) and reason (role, subject, plain, dispatcher, subscribe)",
        refused,
    );
    let mut out = String::new();
    encode(&mut out, &reg).expect("writing to a String");
    out
}

/// Writes the audit's gathered refusals every second, and what is left at the end.
async fn flush_audit(audit: std::sync::Arc<Audit>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => audit.flush_at(std::time::SystemTime::now()),
            _ = cancel.cancelled() => return audit.flush(),
        }
    }
}

/// "a command tag from an address not allowed" warnings, at most one a second.
static REFUSED: crate::lograte::LogRate = crate::lograte::LogRate::new(Duration::from_secs(1));

/// "at the client limit" warnings, at most one a second.
static LIMITED: crate::lograte::LogRate = crate::lograte::LogRate::new(Duration::from_secs(1));

/// Serves `/status` and `/metrics` for a dispatcher until `cancel`.
pub async fn serve_http(
    listener: TcpListener,
    handle: DispatcherHandle,
    web: Option<std::sync::Arc<shoal_tls::web::WebConfig>>,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    use axum::{Json, Router as Http, extract::State, http::header, response::IntoResponse, routing::get};
    async fn status(State(h): State<DispatcherHandle>) -> impl IntoResponse {
        Json(h.snapshot().await.unwrap_or_default())
    }
    async fn metrics(State(h): State<DispatcherHandle>) -> impl IntoResponse {
        let text = metrics_text(&h.snapshot().await.unwrap_or_default());
        ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text)
    }
    let app = Http::new().route("/status", get(status)).route("/metrics", get(metrics)).with_state(handle);
    let limits = crate::httpd::HttpLimits::default();
    let stats = std::sync::Arc::new(crate::httpd::HttpStats::default());
    crate::httpd::serve_with(listener, app, limits, stats, "dispatcher", web, cancel).await
}
