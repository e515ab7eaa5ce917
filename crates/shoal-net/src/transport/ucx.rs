//! The `ucx` transport (`run.transport = "ucx"`): a source's frames to a builder as UCX
//! active messages, beside the TCP connection that sets them up and watches the peer.
//!
//! A source's link connects over TCP exactly as with `tcp` (the `[security] data`
//! handshake included). The builder answers with a welcome on that connection
//! ([`welcome`]): a connection key it has just opened for this connection (128 bits from
//! the OS's random source: a secret handed over the connection, which `[security] data`
//! authenticates) and its UCX worker's address. The source makes an endpoint to that address and from then on sends
//! every frame (hellos, fragments, its end of stream) as one active message
//! ([`AM_FRAME`]): the 24-byte route (connection key, sequence number) and the frame's header
//! as the message's header, the payload (in parts, never joined) as its data. UCX sends
//! small messages eagerly and large ones by rendezvous: the builder allocates the frame's
//! buffer and UCX lands the payload in it (`ucp_am_recv_data_nbx`; over `cma` one copy
//! between the processes, over RDMA none by a CPU). At its end the link sends [`AM_BYE`]
//! with the next sequence number.
//!
//! Completions can come out of order (a small eager message overtakes a rendezvous), so
//! the builder puts each connection's messages back in sequence before they reach
//! `serve_frames`, which checks every frame as it does a TCP stream's. What goes from the
//! builder to the source (pull requests) stays on the TCP connection, as does liveness:
//! the connection's end, or the endpoint's failure where the transports report one,
//! ends the link. Messages for a connection key the builder has not opened (a stranger,
//! who would have to guess 128 random bits, or one closed) are counted and dropped.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use shoal_core::frame::{Frame, HEADER_LEN, set_send_time};
use shoal_ucx::{Endpoint, Message, Receive, UcxError, Worker};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::transport::chunk::Chunk;
use crate::transport::framed::{Frames, ReadEnd, log_closing};

/// A frame (its route and header, then its payload).
pub const AM_FRAME: u16 = 0;
/// The link's end: nothing follows this sequence number.
pub const AM_BYE: u16 = 1;

/// The route before every message's frame header: connection key, sequence number.
const ROUTE_LEN: usize = 24;

/// A connection's key: 128 random bits, the secret every message of it carries.
pub type ConnKey = u128;

/// A fresh key from the OS's random source.
fn new_key() -> std::io::Result<ConnKey> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b)
        .map_err(|e| std::io::Error::other(format!("no randomness for a UCX connection key: {e}")))?;
    Ok(ConnKey::from_le_bytes(b))
}
const WELCOME_MAGIC: &[u8; 8] = b"SHOALUCX";
/// A UCX worker address is a few hundred bytes; anything much larger is not one.
const MAX_ADDRESS_LEN: usize = 64 << 10;
/// How long a welcome may take to arrive after the TCP connection is made.
const WELCOME_WITHIN: Duration = Duration::from_secs(10);
/// After the source's TCP side has closed, how long its last messages (the end among
/// them) may take to come by UCX before the connection is ended without them.
const END_WAIT: Duration = Duration::from_secs(5);
/// Most messages of one connection held waiting for an earlier one.
const MAX_OUT_OF_ORDER: usize = 65_536;

/// The welcome a builder writes on a new connection: its connection key and its worker's
/// address.
pub fn welcome(conn: ConnKey, address: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(WELCOME_HEAD + address.len());
    b.put_slice(WELCOME_MAGIC);
    b.put_u128_le(conn);
    b.put_u32_le(address.len() as u32);
    b.put_slice(address);
    b.freeze()
}

/// A welcome's fixed part: magic, key, address length.
const WELCOME_HEAD: usize = 8 + 16 + 4;

/// Reads a builder's welcome: the connection key and the worker address.
pub async fn read_welcome<R: tokio::io::AsyncRead + Unpin>(r: &mut R) -> std::io::Result<(ConnKey, Vec<u8>)> {
    let bad = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    let read = async {
        let mut head = [0u8; WELCOME_HEAD];
        r.read_exact(&mut head).await?;
        if &head[..8] != WELCOME_MAGIC {
            return Err(bad(format!(
                "the builder did not answer with a UCX welcome (its run.transport is not \"ucx\"?): {:02x?}",
                &head[..8]
            )));
        }
        let conn = ConnKey::from_le_bytes(head[8..24].try_into().expect("16"));
        let len = u32::from_le_bytes(head[24..28].try_into().expect("4")) as usize;
        if len > MAX_ADDRESS_LEN {
            return Err(bad(format!("a {len}-byte UCX address in the welcome")));
        }
        let mut address = vec![0u8; len];
        r.read_exact(&mut address).await?;
        Ok((conn, address))
    };
    tokio::time::timeout(WELCOME_WITHIN, read)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no UCX welcome from the builder"))?
}

fn route(conn: ConnKey, seq: u64) -> [u8; ROUTE_LEN] {
    let mut r = [0u8; ROUTE_LEN];
    r[..16].copy_from_slice(&conn.to_le_bytes());
    r[16..].copy_from_slice(&seq.to_le_bytes());
    r
}

/// What a builder's connection receives, in sequence.
#[derive(Debug)]
enum Item {
    Frame {
        header: Bytes,
        payload: Result<Bytes, UcxError>,
    },
    Bye,
    /// The connection's messages could not be kept in order (too many held).
    Overrun,
}

/// One open connection's place in the worker's table.
struct Route {
    next: u64,
    waiting: BTreeMap<u64, Item>,
    tx: mpsc::UnboundedSender<Item>,
}

/// The builder's open connections, reached from the worker's thread.
#[derive(Default)]
struct Table {
    routes: HashMap<ConnKey, Route>,
}

/// What a builder's UCX receive counts (besides the worker's own [`shoal_ucx::WorkerStats`]).
#[derive(Debug, Default)]
pub struct ReceiveCounts {
    /// Messages for a connection number not open (a stranger's, or a closed one's).
    pub unknown_connection: AtomicU64,
    /// Messages too short to carry a route.
    pub malformed: AtomicU64,
}

/// A builder's UCX side: its worker and the connections it has opened.
pub struct UcxReceiver {
    worker: Worker,
    table: Arc<Mutex<Table>>,
    pub counts: Arc<ReceiveCounts>,
}

impl std::fmt::Debug for UcxReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxReceiver").finish_non_exhaustive()
    }
}

impl UcxReceiver {
    /// Starts the builder's worker, its payloads landing in a region of `region_bytes`
    /// registered once (0: a buffer per payload).
    pub fn start(name: &str, region_bytes: usize) -> Result<Arc<UcxReceiver>, UcxError> {
        let table = Arc::new(Mutex::new(Table::default()));
        let counts = Arc::new(ReceiveCounts::default());
        let sink = {
            let (table, counts) = (table.clone(), counts.clone());
            Box::new(move |m: Message| deliver(&table, &counts, m))
        };
        let worker = Worker::start(name, Some(Receive { ids: vec![AM_FRAME, AM_BYE], sink, region_bytes }))?;
        Ok(Arc::new(UcxReceiver { worker, table, counts }))
    }

    pub fn worker_stats(&self) -> &Arc<shoal_ucx::WorkerStats> {
        self.worker.stats()
    }

    /// Opens a connection under a fresh key: its welcome (to write to the source) and its
    /// messages.
    fn open(self: &Arc<Self>) -> std::io::Result<(Bytes, Inbox)> {
        let conn = new_key()?;
        let (tx, rx) = mpsc::unbounded_channel();
        self.table.lock().expect("ucx table").routes.insert(conn, Route { next: 1, waiting: BTreeMap::new(), tx });
        Ok((welcome(conn, self.worker.address()), Inbox { conn, rx, receiver: self.clone() }))
    }
}

impl Drop for UcxReceiver {
    /// What the worker moved, and what it refused, said once at the builder's end.
    fn drop(&mut self) {
        let w = self.worker.stats();
        let get = shoal_ucx::WorkerStats::get;
        let (unknown, malformed) =
            (self.counts.unknown_connection.load(Ordering::Relaxed), self.counts.malformed.load(Ordering::Relaxed));
        tracing::info!(
            messages = get(&w.messages_received),
            bytes = get(&w.bytes_received),
            rendezvous = get(&w.rendezvous_received),
            deferred_for_room = get(&w.receives_deferred),
            outside_region = get(&w.received_outside_region),
            region_peak_mb = self.worker.region().map_or(0, |r| r.peak_in_use.load(Ordering::Relaxed) >> 20),
            receive_errors = get(&w.receive_errors),
            endpoint_failures = get(&w.endpoint_failures),
            unknown_connection = unknown,
            malformed,
            "UCX receive"
        );
        if unknown + malformed > 0 {
            warn!(
                unknown_connection = unknown,
                malformed, "UCX messages for no open connection, or without a route, were dropped"
            );
        }
    }
}

/// On the worker's thread: a message to its connection, in sequence.
fn deliver(table: &Mutex<Table>, counts: &ReceiveCounts, m: Message) {
    if m.header.len() < ROUTE_LEN {
        counts.malformed.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let conn = ConnKey::from_le_bytes(m.header[..16].try_into().expect("16"));
    let seq = u64::from_le_bytes(m.header[16..24].try_into().expect("8"));
    let mut t = table.lock().expect("ucx table");
    let Some(r) = t.routes.get_mut(&conn) else {
        // A link's end after its builder closed the connection (at the run's end it stops
        // reading once every source has ended) is no stranger's.
        if m.id != AM_BYE {
            counts.unknown_connection.fetch_add(1, Ordering::Relaxed);
        }
        return;
    };
    let item = match m.id {
        AM_BYE => Item::Bye,
        _ => Item::Frame { header: m.header.slice(ROUTE_LEN..), payload: m.data },
    };
    if seq < r.next {
        // Already delivered: a message seen twice is dropped, counted with the strangers'.
        counts.unknown_connection.fetch_add(1, Ordering::Relaxed);
        return;
    }
    r.waiting.insert(seq, item);
    while let Some(item) = r.waiting.remove(&r.next) {
        r.next += 1;
        let _ = r.tx.send(item);
    }
    if r.waiting.len() > MAX_OUT_OF_ORDER {
        r.waiting.clear();
        let _ = r.tx.send(Item::Overrun);
    }
}

/// One connection's messages, in sequence; closing it takes it out of the table.
struct Inbox {
    conn: ConnKey,
    rx: mpsc::UnboundedReceiver<Item>,
    receiver: Arc<UcxReceiver>,
}

impl Drop for Inbox {
    fn drop(&mut self) {
        self.receiver.table.lock().expect("ucx table").routes.remove(&self.conn);
    }
}

/// A builder's connection over UCX as the frames `serve_frames` reads: those of its
/// inbox, checked, until the source's end (or its TCP side closes and the end does not
/// follow within `END_WAIT`, 5 s).
pub struct UcxFrames {
    inbox: Inbox,
    tcp: shoal_tls::data::DataRead,
    peer: SocketAddr,
    max_payload: u32,
    cancel: CancellationToken,
    /// Once the TCP side has closed: until when the end may still come.
    ending_by: Option<tokio::time::Instant>,
}

impl UcxFrames {
    /// Writes the welcome on the connection's TCP side and returns the frames to read
    /// and the write half (for pull requests).
    pub async fn open(
        receiver: &Arc<UcxReceiver>,
        stream: shoal_tls::DataStream,
        peer: SocketAddr,
        max_payload: u32,
        cancel: CancellationToken,
    ) -> std::io::Result<(UcxFrames, shoal_tls::data::DataWrite)> {
        let (inbox_welcome, inbox) = receiver.open()?;
        let (tcp, mut write) = stream.into_split();
        write.write_all(&inbox_welcome).await?;
        Ok((UcxFrames { inbox, tcp, peer, max_payload, cancel, ending_by: None }, write))
    }

    fn take(&self, item: Item) -> Result<Frame, ReadEnd> {
        match item {
            Item::Bye => Err(ReadEnd::Clean),
            Item::Overrun => Err(self.reject("ucx_out_of_order", "too many messages held for an earlier one")),
            Item::Frame { payload: Err(e), .. } => Err(self.reject("ucx_receive", &e.to_string())),
            Item::Frame { header, payload: Ok(payload) } => {
                shoal_core::frame::decode_message(&header, payload, self.max_payload)
                    .map_err(|e| self.reject(e.kind(), &e.to_string()))
            }
        }
    }
}

/// Reads the TCP side until it ends: in `ucx` mode the source writes nothing more on it.
async fn tcp_closed(tcp: &mut shoal_tls::data::DataRead) {
    let mut discard = [0u8; 256];
    while let Ok(n) = tcp.read(&mut discard).await {
        if n == 0 {
            return;
        }
    }
}

impl Frames for UcxFrames {
    async fn next(&mut self) -> Result<Frame, ReadEnd> {
        loop {
            let Self { inbox, tcp, cancel, ending_by, .. } = &mut *self;
            let item = tokio::select! {
                biased;
                item = inbox.rx.recv() => item,
                _ = tcp_closed(tcp), if ending_by.is_none() => {
                    *ending_by = Some(tokio::time::Instant::now() + END_WAIT);
                    continue;
                }
                _ = tokio::time::sleep_until(ending_by.unwrap_or_else(tokio::time::Instant::now)), if ending_by.is_some() => {
                    // The source went away without its end: as a TCP stream that ends.
                    return Err(ReadEnd::Clean);
                }
                _ = cancel.cancelled() => return Err(ReadEnd::Cancelled),
            };
            return match item {
                Some(item) => self.take(item),
                None => Err(ReadEnd::Clean),
            };
        }
    }

    fn next_buffered(&mut self) -> Result<Option<Frame>, ReadEnd> {
        match self.inbox.rx.try_recv() {
            Ok(item) => self.take(item).map(Some),
            Err(_) => Ok(None),
        }
    }

    fn reject(&self, reason: &'static str, detail: &str) -> ReadEnd {
        log_closing(self.peer, reason, detail);
        ReadEnd::Rejected(reason)
    }
}

/// Most payload bytes a link has handed to UCX and not seen completed: the `ucx`
/// transport's socket buffer. Within it a frame counts as sent once UCX has it (as a TCP
/// frame does once the kernel has it), so a source keeps several rendezvous transfers
/// going instead of waiting out each one's round trip.
const IN_FLIGHT_BYTES: u64 = 16 << 20;
/// ... and most messages.
const IN_FLIGHT_MESSAGES: usize = 256;

type Completion = tokio::sync::oneshot::Receiver<Result<(), UcxError>>;

/// The process's worker for sending, shared by its source nodes while any is running
/// (started by the first, ended with the last). Its endpoints are shared too, one per
/// builder: an embedded full shape (75 source nodes of 4 sources to 100 builders) had 75
/// workers' threads and 7,500 endpoints on 2 cores, where one thread and 100 endpoints
/// carry the same messages; each link's connection number keeps its frames apart.
pub fn sending_worker() -> Result<Arc<Worker>, UcxError> {
    static SHARED: Mutex<std::sync::Weak<Worker>> = Mutex::new(std::sync::Weak::new());
    let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(w) = shared.upgrade() {
        return Ok(w);
    }
    let w = Arc::new(Worker::start("source", None)?);
    *shared = Arc::downgrade(&w);
    Ok(w)
}

/// A source link's UCX side: the endpoint to its builder and the connection's numbering.
pub struct UcxPath {
    endpoint: Endpoint,
    conn: ConnKey,
    seq: u64,
    /// The frame being gathered from its chunks: its header bytes and payload parts.
    partial: Option<(BytesMut, Vec<Bytes>)>,
    /// Messages handed to UCX and not completed, oldest first, with their sizes.
    in_flight: std::collections::VecDeque<(u64, Completion)>,
    in_flight_bytes: u64,
}

impl UcxPath {
    /// Reads the builder's welcome from the TCP side and makes the endpoint.
    pub async fn connect<R: tokio::io::AsyncRead + Unpin>(worker: &Worker, tcp: &mut R) -> std::io::Result<UcxPath> {
        let (conn, address) = read_welcome(tcp).await?;
        let endpoint = worker.connect(&address).await.map_err(std::io::Error::other)?;
        Ok(UcxPath {
            endpoint,
            conn,
            seq: 0,
            partial: None,
            in_flight: std::collections::VecDeque::new(),
            in_flight_bytes: 0,
        })
    }

    /// Hands `chunks` to UCX (whole frames once their last chunk is there), each frame's
    /// header stamped with `now`, then waits while more than the window is in flight (or
    /// until `peer_gone`). Returns how many chunks went whole, and the error that stopped
    /// it: a failed completion ends the connection, as a failed write does.
    pub async fn write_chunks(
        &mut self,
        chunks: &[Chunk],
        now: shoal_core::Instant,
        peer_gone: impl std::future::Future<Output = ()>,
    ) -> (usize, std::io::Result<()>) {
        for c in chunks {
            let (head, parts) =
                self.partial.get_or_insert_with(|| (BytesMut::with_capacity(ROUTE_LEN + HEADER_LEN), Vec::new()));
            if c.first {
                head.clear();
                parts.clear();
            }
            head.put_slice(&c.head);
            if !c.body.is_empty() {
                parts.push(c.body.clone());
            }
            if !c.last {
                continue;
            }
            let (frame_head, parts) = self.partial.take().expect("gathered above");
            let mut header = BytesMut::with_capacity(ROUTE_LEN + frame_head.len());
            self.seq += 1;
            header.put_slice(&route(self.conn, self.seq));
            let at = header.len();
            header.put_slice(&frame_head);
            if frame_head.len() == HEADER_LEN {
                set_send_time(&mut header[at..], now);
            }
            let bytes: u64 = parts.iter().map(|p| p.len() as u64).sum();
            self.in_flight.push_back((bytes, self.endpoint.send(AM_FRAME, header.freeze(), parts)));
            self.in_flight_bytes += bytes;
        }
        match self.settle(peer_gone, false).await {
            Ok(()) => (chunks.len(), Ok(())),
            Err(e) => (chunks.len(), Err(e)),
        }
    }

    /// Takes the completions that are in; waits for the oldest while over the window
    /// (`all`: until none is left).
    async fn settle(&mut self, peer_gone: impl std::future::Future<Output = ()>, all: bool) -> std::io::Result<()> {
        let gone = std::pin::pin!(peer_gone);
        let mut gone = gone;
        loop {
            let over = self.in_flight_bytes > IN_FLIGHT_BYTES || self.in_flight.len() > IN_FLIGHT_MESSAGES;
            let Some((bytes, front)) = self.in_flight.front_mut() else {
                return Ok(());
            };
            let result = if all || over {
                tokio::select! {
                    r = front => r,
                    _ = &mut gone => {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::ConnectionReset,
                            "the builder closed its connection",
                        ));
                    }
                }
            } else {
                match front.try_recv() {
                    Ok(r) => Ok(r),
                    Err(tokio::sync::oneshot::error::TryRecvError::Empty) => return Ok(()),
                    Err(tokio::sync::oneshot::error::TryRecvError::Closed) => Ok(Err(UcxError::WorkerGone)),
                }
            };
            let bytes = *bytes;
            self.in_flight.pop_front();
            self.in_flight_bytes -= bytes;
            match result {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(std::io::Error::other(e)),
                Err(_) => return Err(std::io::Error::other(UcxError::WorkerGone)),
            }
        }
    }

    /// The link's end: what is in flight completes, then the end goes (no message follows).
    pub async fn bye(&mut self) {
        if let Err(e) = self.settle(std::future::pending(), true).await {
            warn!(error = %e, "UCX messages in flight at the link's end");
            return;
        }
        self.seq += 1;
        let done = self.endpoint.send(AM_BYE, Bytes::copy_from_slice(&route(self.conn, self.seq)), Vec::new());
        if let Ok(Err(e)) = done.await {
            warn!(error = %e, "sending the UCX end");
        }
    }

    /// The endpoint's failure as UCX reported it, if it has.
    pub fn failure(&self) -> Option<UcxError> {
        self.endpoint.failure()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(id: u16, conn: ConnKey, seq: u64, tag: u8) -> Message {
        let mut header = route(conn, seq).to_vec();
        header.push(tag);
        Message { id, header: Bytes::from(header), data: Ok(Bytes::new()), rendezvous: false }
    }

    /// Completions out of order reach the connection in sequence; a stranger's message
    /// (a number not open) is counted and dropped, a late end is not counted.
    #[test]
    fn messages_are_put_back_in_sequence_and_strangers_counted() {
        let table = Mutex::new(Table::default());
        let counts = ReceiveCounts::default();
        let (tx, mut rx) = mpsc::unbounded_channel();
        table.lock().unwrap().routes.insert(7, Route { next: 1, waiting: BTreeMap::new(), tx });
        for (seq, tag) in [(2, b'b'), (3, b'c'), (1, b'a')] {
            deliver(&table, &counts, message(AM_FRAME, 7, seq, tag));
        }
        deliver(&table, &counts, message(AM_BYE, 7, 4, 0));
        let mut got = Vec::new();
        while let Ok(item) = rx.try_recv() {
            got.push(match item {
                Item::Frame { header, .. } => header[0],
                Item::Bye => b'.',
                Item::Overrun => b'!',
            });
        }
        assert_eq!(got, b"abc.");
        deliver(&table, &counts, message(AM_FRAME, 8, 1, 0));
        deliver(&table, &counts, message(AM_FRAME, 7, 2, 0));
        assert_eq!(counts.unknown_connection.load(Ordering::Relaxed), 2, "a stranger and a repeat");
        table.lock().unwrap().routes.clear();
        deliver(&table, &counts, message(AM_BYE, 7, 5, 0));
        assert_eq!(counts.unknown_connection.load(Ordering::Relaxed), 2, "an end after the close is no stranger's");
        deliver(
            &table,
            &counts,
            Message { id: AM_FRAME, header: Bytes::from_static(b"short"), data: Ok(Bytes::new()), rendezvous: false },
        );
        assert_eq!(counts.malformed.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn a_welcome_reads_back_and_garbage_is_refused() {
        let w = welcome(42, b"some worker address");
        let (conn, addr) = read_welcome(&mut &w[..]).await.unwrap();
        assert_eq!((conn, &addr[..]), (42, &b"some worker address"[..]));
        let e = read_welcome(&mut &b"GET / HTTP/1.1\r\n\r\nxxxxxxxxxxxxxxxx"[..]).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        let mut huge = welcome(1, b"").to_vec();
        huge[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(read_welcome(&mut &huge[..]).await.unwrap_err().kind(), std::io::ErrorKind::InvalidData);
    }
}
