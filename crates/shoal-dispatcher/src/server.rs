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
//! HTTP (optional): `/status` (JSON: clients, nicknames, subscriptions, queues) and
//! `/metrics` (Prometheus text).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Buf;
use serde::Serialize;
use shoal_core::controlhost::router::{ClientStatus, TagStats};
use shoal_core::controlhost::{
    ClientId, CommandAccess, Message, MessageDecoder, Output, Router, RouterConfig, encode_prefix,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Messages decoded by readers and not yet taken by the core, for all connections together.
const INPUT_QUEUE: usize = 32;

/// Dispatcher settings (`shoal dispatcher` flags).
#[derive(Clone, Debug)]
pub struct DispatcherConfig {
    pub router: RouterConfig,
    /// Largest payload accepted; a larger length closes the connection.
    pub max_payload: u32,
    /// Most clients connected at once; a connection beyond is closed at once and counted
    /// (`connection_limit`), so a flood cannot take every descriptor of the process.
    pub max_clients: usize,
    /// Who may publish command tags (default: this host only).
    pub access: CommandAccess,
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        Self {
            router: RouterConfig::default(),
            max_payload: 64 << 20,
            max_clients: 16_000,
            access: CommandAccess::default(),
        }
    }
}

enum Event {
    Connected {
        id: ClientId,
        peer: SocketAddr,
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
    let (in_tx, in_rx) = mpsc::channel::<(ClientId, Message)>(INPUT_QUEUE);
    let accept_events = ev_tx.clone();
    let accept_cancel = cancel.clone();
    let places = std::sync::Arc::new(tokio::sync::Semaphore::new(cfg.max_clients));
    tokio::spawn(async move {
        let mut next_id: ClientId = 1;
        loop {
            tokio::select! {
                r = listener.accept() => match r {
                    Ok((stream, peer)) => {
                        let Ok(place) = places.clone().try_acquire_owned() else {
                            drop(stream);
                            if let Some(held_back) = LIMITED.check() {
                                warn!(%peer, max_clients = cfg.max_clients, held_back, "at the client limit: connection closed");
                            }
                            let _ = accept_events.send(Event::Refused { reason: "connection_limit" });
                            continue;
                        };
                        start_connection(next_id, stream, peer, cfg.max_payload, &accept_events, &in_tx, place);
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
    let core = tokio::spawn(run_core(Router::new(cfg.router), cfg.access, ev_rx, in_rx, cancel));
    info!(%addr, "dispatcher listening");
    Ok((DispatcherHandle { events: ev_tx, addr }, core))
}

fn start_connection(
    id: ClientId,
    stream: TcpStream,
    peer: SocketAddr,
    max_payload: u32,
    events: &mpsc::UnboundedSender<Event>,
    input: &mpsc::Sender<(ClientId, Message)>,
    place: tokio::sync::OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let _ = socket2::SockRef::from(&stream).set_keepalive(true);
    let (r, w) = stream.into_split();
    let (wtx, wrx) = mpsc::unbounded_channel();
    let close = CancellationToken::new();
    // Register before the reader can produce anything, so the core knows the client.
    let _ = events.send(Event::Connected { id, peer, writer: wtx, close: close.clone() });
    let (input, read_events, read_close) = (input.clone(), events.clone(), close.clone());
    tokio::spawn(async move {
        read_loop(id, r, peer, max_payload, input, read_events, read_close).await;
        drop(place);
    });
    tokio::spawn(write_loop(id, w, wrx, events.clone(), close));
}

async fn read_loop(
    id: ClientId,
    mut r: OwnedReadHalf,
    peer: SocketAddr,
    max_payload: u32,
    input: mpsc::Sender<(ClientId, Message)>,
    events: mpsc::UnboundedSender<Event>,
    close: CancellationToken,
) {
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
                    if input.send((id, m)).await.is_err() {
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
    mut w: OwnedWriteHalf,
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
            Event::Connected { id, peer, writer, close } => {
                self.connections_total += 1;
                self.router.handle_connect(id);
                self.conns.insert(id, Conn { peer, writer, close, since: Instant::now() });
            }
            Event::Closed { id, reason } => {
                if let Some(r) = reason {
                    *self.rejected.entry(r.to_string()).or_default() += 1;
                }
                if let Some(c) = self.conns.remove(&id) {
                    c.close.cancel();
                }
                self.router.handle_disconnect(id);
            }
            Event::Refused { reason } => *self.rejected.entry(reason.to_string()).or_default() += 1,
            Event::Written { id, messages } => self.router.handle_written(id, messages),
            Event::Snapshot(reply) => {
                let bp = self.backpressure + self.paused_since.map_or(Duration::ZERO, |t| t.elapsed());
                let mut snap = snapshot(&self.router, &self.conns, &self.rejected, self.connections_total, bp);
                snap.commands_refused = self.commands_refused.clone();
                let _ = reply.send(snap);
            }
        }
    }

    /// A message from a reader. The events waiting are taken first: a connection's
    /// `Connected` was sent before its reader existed, but the core may have looked at
    /// the events just before it came, and a greeting (`_Subscri`, `_Always`) handled
    /// for a connection the router does not know yet would be lost.
    fn on_message(&mut self, events: &mut mpsc::UnboundedReceiver<Event>, id: ClientId, m: Message) {
        while let Ok(e) = events.try_recv() {
            self.on_event(e);
        }
        if let Some(c) = self.conns.get(&id)
            && !self.access.allows(&m.tag, c.peer.ip())
        {
            *self.commands_refused.entry(m.tag.to_string()).or_default() += 1;
            if let Some(held_back) = REFUSED.check() {
                warn!(peer = %c.peer, tag = %m.tag, held_back, allowed = ?self.access.allowed(),
                    "a command tag from an address not allowed to command: dropped");
            }
            return;
        }
        self.router.handle_message(id, m);
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
    mut events: mpsc::UnboundedReceiver<Event>,
    mut input: mpsc::Receiver<(ClientId, Message)>,
    cancel: CancellationToken,
) {
    let mut core = Core {
        router,
        access,
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
                Some((id, m)) => {
                    core.on_message(&mut events, id, m);
                    // Take what else is waiting before flushing outputs, so that writers
                    // wake once per batch rather than once per message.
                    for _ in 0..255 {
                        if !core.router.accepting() {
                            break;
                        }
                        match input.try_recv() {
                            Ok((id, m)) => core.on_message(&mut events, id, m),
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
    let mut out = String::new();
    encode(&mut out, &reg).expect("writing to a String");
    out
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
