//! An outgoing framed TCP connection with its own queue, reconnecting with backoff.
//!
//! Sources keep one [`Link`] per builder; builders keep one to the writer. The owner
//! enqueues [`Chunk`]s without ever waiting (so a slow or dead peer never stalls the
//! owner's other links) and tracks the queued bytes to enforce its own limit. The link
//! task writes chunks in order and reports, per frame, whether its last byte was handed
//! to the kernel ([`LinkReport::Sent`]) or the connection failed ([`LinkReport::Failed`]).
//! The send time in a frame's header is stamped just before the write that carries its
//! first byte. Chunks queued together go out in one vectored write (at most
//! `GATHER_CHUNKS`, adding none past `GATHER_BYTES`): small fragments cost a system
//! call for many of them, not one each.
//!
//! For pull runs ([`LinkOptions`]) a link also greets the peer after every connect (one
//! hello per hosted source, so the builder knows where to send requests) and reads the
//! peer's requests from the same connection.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use shoal_core::frame::{DEFAULT_MAX_PAYLOAD, HEADER_LEN, set_send_time};
use shoal_core::pullmsg::PullMessage;
use shoal_core::{SourceId, slice::SliceNumber};
use shoal_tls::data::{DataRead, DataWrite};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::clock::WallClock;
use crate::transport::framed::{FrameReader, ReadEnd};

pub use crate::transport::chunk::Chunk;

/// The fate of a frame handed to a link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkReport {
    Sent { link: u32, source: SourceId, slice: SliceNumber },
    Failed { link: u32, source: SourceId, slice: SliceNumber },
}

/// The owner's side of a link.
#[derive(Debug)]
pub struct Link {
    pub id: u32,
    tx: mpsc::UnboundedSender<Chunk>,
    queued: Arc<AtomicU64>,
    pub task: tokio::task::JoinHandle<()>,
}

/// What a pull source's link adds: hellos after each connect, and the requests read back.
#[derive(Clone, Debug, Default)]
pub struct LinkOptions {
    /// Where the link counts its failures and registers its TCP connection (none: not
    /// counted).
    pub paths: Option<Arc<crate::paths::NetPaths>>,
    /// Sent (one `SourceHello` each) before anything else on every new connection.
    pub hello: Vec<SourceId>,
    /// Where requests read from the connection go, with the link's id; `None`: the link
    /// does not read.
    pub requests: Option<mpsc::UnboundedSender<(u32, PullRequestFrame)>>,
    /// At the end, wait until the peer has closed its side too (`PeerEnd`) before the
    /// task ends: a source's data links.
    pub wait_for_peer_close: bool,
    /// The handshake after every connect (`[security] data`; plain TCP by default).
    pub connector: shoal_tls::Connector,
    /// `run.transport = "ucx"`: the process's UCX worker; the frames go as its messages
    /// and the TCP connection sets them up and watches the peer ([`crate::transport::ucx`]).
    pub ucx: Option<Arc<shoal_ucx::Worker>>,
    /// `run.transport = "udp"` under `[security] data`: the run's datagram MAC.
    pub mac: Option<Arc<crate::transport::udp::mac::DatagramMac>>,
}

/// What tells a link that its peer has closed the connection: the read half, or the task
/// reading the peer's requests (which ends at the peer's close).
///
/// A source that ends its process with data still in its socket leaves the kernel to
/// deliver it. The kernel gives up on such an orphaned connection after a few probes of a
/// closed window (`net.ipv4.tcp_orphan_retries`, a minute or two), sends nothing to say so,
/// and the data never arrives: a builder holding the connection back (`crate::builder::hold`) or
/// slower than the sources for a minute would lose it unseen. So a source's link waits
/// until its builder has read its end of stream and closed, bounded by the source's drain
/// time.
#[derive(Debug)]
enum PeerEnd {
    Read(DataRead),
    Reader(tokio::task::JoinHandle<()>),
}

impl PeerEnd {
    /// Returns once the peer has closed (or the connection failed), and at once after
    /// that; unlike [`PeerEnd::closed`] it can be asked again.
    async fn gone(&mut self) {
        match self {
            PeerEnd::Read(r) => {
                let mut discard = [0u8; 512];
                while let Ok(n) = tokio::io::AsyncReadExt::read(r, &mut discard).await {
                    if n == 0 {
                        return;
                    }
                }
            }
            PeerEnd::Reader(task) => {
                if !task.is_finished() {
                    let _ = task.await;
                }
            }
        }
    }

    /// Returns once the peer has closed (or the connection failed).
    async fn closed(mut self) {
        self.gone().await;
    }
}

/// A request read from a link: the peer asks for the fragment of (`source`, `slice`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullRequestFrame {
    pub source: SourceId,
    pub slice: SliceNumber,
}

/// Reconnect policy.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    pub min: Duration,
    pub max: Duration,
}

impl Link {
    /// Starts the link task. `closing` tells a disconnected link at the end of the run to
    /// give up after one last attempt instead of retrying forever.
    pub fn spawn(
        id: u32,
        addr: SocketAddr,
        clock: WallClock,
        backoff: Backoff,
        reports: mpsc::UnboundedSender<LinkReport>,
        closing: CancellationToken,
    ) -> Link {
        Self::spawn_with(id, addr, clock, backoff, reports, closing, LinkOptions::default())
    }

    /// [`Link::spawn`] with pull's hellos and request reader.
    pub fn spawn_with(
        id: u32,
        addr: SocketAddr,
        clock: WallClock,
        backoff: Backoff,
        reports: mpsc::UnboundedSender<LinkReport>,
        closing: CancellationToken,
        options: LinkOptions,
    ) -> Link {
        let (tx, rx) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(run(id, addr, clock, backoff, rx, queued.clone(), reports, closing, options));
        Link { id, tx, queued, task }
    }

    /// Bytes enqueued and not yet written.
    pub fn queued_bytes(&self) -> u64 {
        self.queued.load(Ordering::Relaxed)
    }

    /// Enqueues a chunk (never waits).
    pub fn send(&self, chunk: Chunk) {
        let len = chunk.len() as u64;
        self.queued.fetch_add(len, Ordering::Relaxed);
        if self.tx.send(chunk).is_err() {
            // The task has ended (it only does so after `close`); nothing will be written.
            self.queued.fetch_sub(len, Ordering::Relaxed);
        }
    }

    /// No more chunks: the task writes what is queued, closes, and ends.
    pub fn close(self) -> tokio::task::JoinHandle<()> {
        drop(self.tx);
        self.task
    }
}

/// Waits `delay` (or until `closing`), then doubles it up to `max`.
async fn back_off(delay: &mut Duration, max: Duration, closing: &CancellationToken) {
    tokio::select! {
        _ = tokio::time::sleep(*delay) => {}
        _ = closing.cancelled() => {}
    }
    *delay = (*delay * 2).min(max);
}

/// Connects, proves both ends (`options.connector`), greets and starts the request reader.
async fn connect(addr: SocketAddr, id: u32, options: &LinkOptions) -> std::io::Result<Connection> {
    let s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let s = crate::transport::secure::connect(&options.connector, s, addr).await?;
    let registered = options.paths.as_ref().map(|p| p.register(&s));
    let (mut read, mut write) = s.into_split();
    let mut ucx = match &options.ucx {
        Some(worker) => Some(crate::transport::ucx::UcxPath::connect(worker, &mut read).await?),
        None => None,
    };
    for &source in &options.hello {
        let hello = PullMessage::SourceHello { source }.encode();
        match &mut ucx {
            Some(u) => {
                let chunk = Chunk {
                    source,
                    slice: 0,
                    first: true,
                    last: true,
                    head: hello.slice(..HEADER_LEN),
                    body: hello.slice(HEADER_LEN..),
                };
                let (_, sent) = u.write_chunks(&[chunk], shoal_core::Instant::ZERO, std::future::pending()).await;
                sent?;
            }
            None => write.write_all(&hello).await?,
        }
    }
    let peer = match options.requests.clone() {
        Some(requests) => PeerEnd::Reader(tokio::spawn(read_requests(
            FrameReader::new(read, addr, DEFAULT_MAX_PAYLOAD, CancellationToken::new()),
            id,
            requests,
        ))),
        None => PeerEnd::Read(read),
    };
    Ok(Connection { registered, write, peer, ucx })
}

/// Reads a pull peer's requests until the connection ends; anything else closes it.
async fn read_requests(
    mut reader: FrameReader<DataRead>,
    id: u32,
    requests: mpsc::UnboundedSender<(u32, PullRequestFrame)>,
) {
    loop {
        let frame = match reader.next().await {
            Ok(f) => f,
            Err(ReadEnd::Clean | ReadEnd::Cancelled | ReadEnd::Rejected(_)) => return,
        };
        match PullMessage::from_frame(&frame) {
            Ok(Some(PullMessage::Request { source, slice })) => {
                if requests.send((id, PullRequestFrame { source, slice })).is_err() {
                    return;
                }
            }
            Ok(_) => {
                reader.reject("unexpected_frame", "only requests are read on a source link");
                return;
            }
            Err(e) => {
                reader.reject(e.kind(), &e.to_string());
                return;
            }
        }
    }
}

/// A link's connection, with its registration for TCP counters first: fields drop in
/// order, so the registration goes before the socket closes (also when the task is
/// aborted).
struct Connection {
    registered: Option<crate::paths::Registered>,
    write: DataWrite,
    peer: PeerEnd,
    /// `ucx`: where the frames go instead of `write`.
    ucx: Option<crate::transport::ucx::UcxPath>,
}

#[allow(clippy::too_many_arguments)]
async fn run(
    id: u32,
    addr: SocketAddr,
    clock: WallClock,
    backoff: Backoff,
    mut rx: mpsc::UnboundedReceiver<Chunk>,
    queued: Arc<AtomicU64>,
    reports: mpsc::UnboundedSender<LinkReport>,
    closing: CancellationToken,
    options: LinkOptions,
) {
    let mut stream: Option<Connection> = None;
    let mut delay = backoff.min;
    // After a failure mid-frame, the rest of that frame is skipped.
    let mut skipping: Option<(SourceId, SliceNumber)> = None;
    // Chunks taken from the queue and not yet written: one waiting for a connection, or
    // those behind a failed write, for the next connection.
    let mut pending: VecDeque<Chunk> = VecDeque::new();
    loop {
        // A pull source sends nothing until asked, so its link connects (and greets) at
        // once instead of at the first chunk; a secured link too, so that its handshake is
        // made before the data begins rather than holding up the first slices.
        // A ucx link too: the welcome and the endpoint before the first frame.
        let at_once = !options.hello.is_empty()
            || options.connector.mode() != shoal_tls::DataSecurity::Off
            || options.ucx.is_some();
        // Nothing more will come to write (the link is closing): no reason to connect.
        let finished = rx.is_closed() && rx.is_empty();
        if stream.is_none() && pending.is_empty() && at_once && !closing.is_cancelled() && !finished {
            match connect(addr, id, &options).await {
                Ok(s) => {
                    debug!(link = id, %addr, "connected");
                    delay = backoff.min;
                    stream = Some(s);
                }
                Err(e) => {
                    debug!(link = id, %addr, error = %e, ?delay, "connect failed; retrying");
                    back_off(&mut delay, backoff.max, &closing).await;
                    continue;
                }
            }
        }
        let chunk = match pending.pop_front() {
            Some(c) => c,
            None => match next_chunk(&mut rx, &mut stream).await {
                Next::Chunk(c) => c,
                Next::End => break,
                Next::PeerClosed => {
                    // A pull peer (a builder) closed: a restarted one listens again and
                    // waits for this source's hello before it can ask for anything, so
                    // the link connects again now, not at a write that never comes.
                    debug!(link = id, %addr, "peer closed; connecting again");
                    stream = None;
                    back_off(&mut delay, backoff.max, &closing).await;
                    continue;
                }
            },
        };
        if skipped(&chunk, &mut skipping, &queued) {
            continue;
        }
        let s = match &mut stream {
            Some(s) => s,
            None => match connect(addr, id, &options).await {
                Ok(s) => {
                    debug!(link = id, %addr, "connected");
                    delay = backoff.min;
                    stream.insert(s)
                }
                Err(e) => {
                    if closing.is_cancelled() {
                        warn!(link = id, %addr, error = %e, "peer unreachable at end of run; failing queued frames");
                        fail(id, chunk, &queued, &reports, &mut skipping);
                        for c in pending.drain(..) {
                            fail(id, c, &queued, &reports, &mut skipping);
                        }
                        while let Some(c) = rx.recv().await {
                            fail(id, c, &queued, &reports, &mut skipping);
                        }
                        return;
                    }
                    debug!(link = id, %addr, error = %e, ?delay, "connect failed; retrying");
                    pending.push_front(chunk);
                    back_off(&mut delay, backoff.max, &closing).await;
                    continue;
                }
            },
        };
        // What else is queued goes in the same write, up to a bound.
        let mut batch = vec![chunk];
        let mut batch_bytes = batch[0].len();
        let gather_bytes = if s.ucx.is_some() { UCX_GATHER_BYTES } else { GATHER_BYTES };
        while batch.len() < GATHER_CHUNKS && batch_bytes < gather_bytes {
            let next = match pending.pop_front() {
                Some(c) => c,
                None => match rx.try_recv() {
                    Ok(c) => c,
                    Err(_) => break,
                },
            };
            if !skipped(&next, &mut skipping, &queued) {
                batch_bytes += next.len();
                batch.push(next);
            }
        }
        let (written, result) = match &mut s.ucx {
            Some(u) => u.write_chunks(&batch, clock.now(), s.peer.gone()).await,
            None => write_chunks(&mut s.write, &batch, clock.now()).await,
        };
        let mut batch = batch.into_iter();
        for chunk in batch.by_ref().take(written) {
            queued.fetch_sub(chunk.len() as u64, Ordering::Relaxed);
            if chunk.last {
                let _ = reports.send(LinkReport::Sent { link: id, source: chunk.source, slice: chunk.slice });
            }
        }
        if let Err(e) = result {
            // Every link of a process fails at once when a builder goes away: said
            // once, then at most every 10 s with the count held back.
            static WRITE_FAILED: crate::lograte::LogRate = crate::lograte::LogRate::new(Duration::from_secs(10));
            if let Some(held_back) = WRITE_FAILED.check() {
                warn!(link = id, %addr, error = %e, held_back, "write failed; reconnecting");
            }
            if let Some(p) = &options.paths {
                p.count_link_failure();
            }
            stream = None;
            // The chunk the write stopped in fails (with the rest of its frame); those
            // behind it go on the next connection.
            if let Some(broken) = batch.next() {
                fail(id, broken, &queued, &reports, &mut skipping);
            }
            for c in batch.rev() {
                pending.push_front(c);
            }
        }
    }
    if let Some(c) = stream {
        c.close(options.wait_for_peer_close).await;
        info!(link = id, %addr, "closed");
    }
}

impl Connection {
    /// The link's end on an open connection: the `ucx` end message, the write side shut,
    /// then (`wait_for_peer`) the peer's close.
    async fn close(mut self, wait_for_peer: bool) {
        // The counters are read one last time while the socket is open.
        self.registered = None;
        if let Some(u) = &mut self.ucx {
            tokio::select! {
                _ = u.bye() => {}
                _ = self.peer.gone() => {}
            }
        }
        let _ = self.write.shutdown().await;
        if wait_for_peer {
            self.peer.closed().await;
        }
    }
}

enum Next {
    Chunk(Chunk),
    /// The queue is closed and empty.
    End,
    /// The peer closed the connection (its request reader ended).
    PeerClosed,
}

/// The next chunk to write; with a pull peer, also watches its request reader, which
/// ends when the peer closes.
async fn next_chunk(rx: &mut mpsc::UnboundedReceiver<Chunk>, stream: &mut Option<Connection>) -> Next {
    let reader = match stream {
        Some(Connection { peer: PeerEnd::Reader(task), .. }) if task.is_finished() => return Next::PeerClosed,
        Some(Connection { peer: PeerEnd::Reader(task), .. }) => task,
        _ => return rx.recv().await.map_or(Next::End, Next::Chunk),
    };
    tokio::select! {
        c = rx.recv() => c.map_or(Next::End, Next::Chunk),
        _ = reader => Next::PeerClosed,
    }
}

/// Most chunks, and bytes from which no more chunks are added, in one write.
const GATHER_CHUNKS: usize = 64;
const GATHER_BYTES: usize = 256 << 10;
/// With `ucx` a batch's messages are all in flight before the link waits for their
/// completions: more of them keep rendezvous transfers overlapping.
const UCX_GATHER_BYTES: usize = 16 << 20;

/// Drops `chunk` when it belongs to a frame whose earlier part failed (`skipping`).
fn skipped(chunk: &Chunk, skipping: &mut Option<(SourceId, SliceNumber)>, queued: &AtomicU64) -> bool {
    if *skipping != Some((chunk.source, chunk.slice)) {
        return false;
    }
    queued.fetch_sub(chunk.len() as u64, Ordering::Relaxed);
    if chunk.last {
        *skipping = None;
    }
    true
}

/// Writes `chunks` in order with vectored writes, each frame's header stamped with `now`
/// as its send time; returns how many chunks were written whole, and the error that
/// stopped it if any.
async fn write_chunks<W: tokio::io::AsyncWrite + Unpin>(
    w: &mut W,
    chunks: &[Chunk],
    now: shoal_core::Instant,
) -> (usize, std::io::Result<()>) {
    // Stamped copies of the whole headers; the other heads and the bodies as they are.
    let stamped: Vec<Option<[u8; HEADER_LEN]>> = chunks
        .iter()
        .map(|c| {
            (c.first && c.head.len() == HEADER_LEN).then(|| {
                let mut header = [0u8; HEADER_LEN];
                header.copy_from_slice(&c.head);
                set_send_time(&mut header, now);
                header
            })
        })
        .collect();
    let mut slices = Vec::with_capacity(2 * chunks.len());
    for (c, h) in chunks.iter().zip(&stamped) {
        let head: &[u8] = h.as_ref().map_or(&c.head[..], |h| &h[..]);
        for part in [head, &c.body[..]] {
            if !part.is_empty() {
                slices.push(IoSlice::new(part));
            }
        }
    }
    let total: usize = chunks.iter().map(Chunk::len).sum();
    let mut rest = &mut slices[..];
    let mut written = 0;
    let mut result = Ok(());
    while written < total {
        match w.write_vectored(rest).await {
            Ok(0) => {
                result = Err(std::io::ErrorKind::WriteZero.into());
                break;
            }
            Ok(n) => {
                written += n;
                IoSlice::advance_slices(&mut rest, n);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    let whole = chunks
        .iter()
        .scan(0, |end, c| {
            *end += c.len();
            Some(*end)
        })
        .take_while(|&end| end <= written)
        .count();
    (whole, result)
}

fn fail(
    id: u32,
    chunk: Chunk,
    queued: &AtomicU64,
    reports: &mpsc::UnboundedSender<LinkReport>,
    skipping: &mut Option<(SourceId, SliceNumber)>,
) {
    if skipped(&chunk, skipping, queued) {
        return;
    }
    queued.fetch_sub(chunk.len() as u64, Ordering::Relaxed);
    if !chunk.last {
        *skipping = Some((chunk.source, chunk.slice));
    }
    let _ = reports.send(LinkReport::Failed { link: id, source: chunk.source, slice: chunk.slice });
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use tokio::io::AsyncReadExt;

    /// A link to a peer that reads everything and stays open; returns the link's task once
    /// the peer has read the link's end (its shutdown), with the peer still open.
    async fn link_read_to_its_end(wait_for_peer_close: bool) -> (tokio::task::JoinHandle<()>, TcpStream) {
        let (listener, link, mut sent) =
            link_to_a_listener(LinkOptions { wait_for_peer_close, ..LinkOptions::default() }).await;
        link.send(Chunk::frame(7, 1, [0; HEADER_LEN], Bytes::from_static(b"payload")));
        let task = link.close();
        let (mut peer, _) = listener.accept().await.unwrap();
        let mut got = Vec::new();
        peer.read_to_end(&mut got).await.unwrap();
        assert_eq!(got.len(), HEADER_LEN + 7);
        assert_eq!(sent.recv().await, Some(LinkReport::Sent { link: 0, source: 7, slice: 1 }));
        (task, peer)
    }

    /// Takes at most `per_call` bytes a write, and fails once it holds `fail_after`.
    struct Stingy {
        got: Vec<u8>,
        per_call: usize,
        fail_after: usize,
        calls: usize,
    }

    impl tokio::io::AsyncWrite for Stingy {
        fn poll_write(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            let me = self.get_mut();
            me.calls += 1;
            if me.got.len() >= me.fail_after {
                return std::task::Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()));
            }
            let n = buf.len().min(me.per_call).min(me.fail_after - me.got.len());
            me.got.extend_from_slice(&buf[..n]);
            std::task::Poll::Ready(Ok(n))
        }

        fn poll_write_vectored(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> std::task::Poll<std::io::Result<usize>> {
            // As a socket does: across the buffers, up to what it takes.
            let all: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
            self.poll_write(cx, &all)
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }

        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    /// A link (reporting to the receiver returned) to a listener of its own.
    async fn link_to_a_listener(
        options: LinkOptions,
    ) -> (tokio::net::TcpListener, Link, mpsc::UnboundedReceiver<LinkReport>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (reports, fates) = mpsc::unbounded_channel();
        let backoff = Backoff { min: Duration::from_millis(1), max: Duration::from_millis(10) };
        let addr = listener.local_addr().unwrap();
        let link = Link::spawn_with(0, addr, WallClock::new(), backoff, reports, CancellationToken::new(), options);
        (listener, link, fates)
    }

    /// Source 3's frame of `slice`, whole in one chunk.
    fn whole_frame(slice: u64, payload: Bytes) -> Chunk {
        let header = shoal_core::frame::encode_header(
            &shoal_core::frame::FrameHeader {
                flags: shoal_core::frame::Flags::EMPTY,
                source: 3,
                hit_count: 0,
                slice,
                slice_start: shoal_core::Instant::ZERO,
                send_time: shoal_core::Instant::ZERO,
                payload_len: payload.len() as u32,
            },
            &payload,
        );
        Chunk::frame(3, slice, header, payload)
    }

    /// Three whole frames and a frame in two chunks (a header-only chunk, then a body-only one).
    fn chunks() -> Vec<Chunk> {
        let mut out: Vec<Chunk> = (0..3).map(|s| whole_frame(s, Bytes::from(vec![s as u8; 100]))).collect();
        let split = whole_frame(9, Bytes::from(vec![9u8; 50]));
        out.push(Chunk { last: false, body: Bytes::new(), head: split.head.clone(), ..split });
        out.push(Chunk { source: 3, slice: 9, first: false, last: true, head: Bytes::new(), body: split.body });
        out
    }

    #[tokio::test]
    async fn queued_chunks_go_out_in_order_through_short_writes_with_their_send_time() {
        let chunks = chunks();
        let total: usize = chunks.iter().map(Chunk::len).sum();
        let mut w = Stingy { got: Vec::new(), per_call: 37, fail_after: usize::MAX, calls: 0 };
        let now = shoal_core::Instant::from_nanos(123_456_789);
        let (written, result) = write_chunks(&mut w, &chunks, now).await;
        assert!(result.is_ok());
        assert_eq!(written, chunks.len());
        assert_eq!(w.got.len(), total);
        assert_eq!(w.calls, total.div_ceil(37), "every call took what it could");
        // The bytes decode as the four frames, each stamped.
        let mut dec = shoal_core::frame::StreamDecoder::new(shoal_core::frame::DEFAULT_MAX_PAYLOAD);
        dec.extend(&w.got);
        let mut slices = Vec::new();
        while let Some(f) = dec.next_frame().unwrap() {
            assert_eq!(f.header.send_time, now);
            slices.push((f.header.slice, f.payload.len()));
        }
        assert_eq!(slices, vec![(0, 100), (1, 100), (2, 100), (9, 50)]);
    }

    #[tokio::test]
    async fn a_failed_write_says_which_chunks_went_out_whole() {
        let chunks = chunks();
        let first_two = chunks[0].len() + chunks[1].len();
        // Fails ten bytes into the third chunk.
        let mut w = Stingy { got: Vec::new(), per_call: 1000, fail_after: first_two + 10, calls: 0 };
        let (written, result) = write_chunks(&mut w, &chunks, shoal_core::Instant::ZERO).await;
        assert_eq!(written, 2);
        assert_eq!(result.unwrap_err().kind(), std::io::ErrorKind::BrokenPipe);
        // Exactly at a chunk's end: that chunk is whole.
        let mut w = Stingy { got: Vec::new(), per_call: 1000, fail_after: first_two, calls: 0 };
        assert_eq!(write_chunks(&mut w, &chunks, shoal_core::Instant::ZERO).await.0, 2);
    }

    #[tokio::test]
    async fn a_source_link_ends_only_once_its_peer_has_closed() {
        let (task, peer) = link_read_to_its_end(true).await;
        // The link has shut its side (the peer read to the end) and can only be waiting
        // for the peer: nothing else can end it.
        tokio::task::yield_now().await;
        assert!(!task.is_finished(), "the peer is still open");
        drop(peer);
        tokio::time::timeout(Duration::from_secs(60), task).await.expect("ends at the peer's close").unwrap();
    }

    #[tokio::test]
    async fn other_links_end_after_their_shutdown() {
        let (task, _open_peer) = link_read_to_its_end(false).await;
        tokio::time::timeout(Duration::from_secs(60), task).await.expect("ends without the peer").unwrap();
    }

    /// Twice what both socket buffers of a loopback connection can hold, queued at once
    /// (so the link is still writing when its first peer resets the connection): every
    /// frame is reported once, sent or failed; what follows the failed write goes out
    /// whole on the next connection, in order; nothing reported failed arrives.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_reset_mid_batch_reports_every_frame_once_and_the_rest_go_on_the_next() {
        let most = |name: &str| -> u64 {
            let text = std::fs::read_to_string(format!("/proc/sys/net/ipv4/{name}")).unwrap();
            text.split_whitespace().nth(2).unwrap().parse().unwrap()
        };
        let frames: u64 = (2 * (most("tcp_rmem") + most("tcp_wmem")) / 4000).max(4000);
        let (listener, link, mut fates) = link_to_a_listener(LinkOptions::default()).await;
        let payload = Bytes::from(vec![7u8; 4000]);
        for slice in 0..frames {
            link.send(whole_frame(slice, payload.clone()));
        }
        let task = link.close();
        let received = tokio::time::timeout(Duration::from_secs(120), async {
            let (mut first, _) = listener.accept().await.unwrap();
            let mut some = vec![0u8; 10_000];
            first.read_exact(&mut some).await.unwrap();
            // A zero linger: the close resets the connection at once (and never blocks).
            socket2::SockRef::from(&first).set_linger(Some(Duration::ZERO)).unwrap();
            drop(first);
            let (mut second, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            second.read_to_end(&mut got).await.unwrap();
            got
        })
        .await
        .expect("the link reconnects and ends");
        tokio::time::timeout(Duration::from_secs(60), task).await.expect("the link ends").unwrap();
        let mut sent = std::collections::BTreeSet::new();
        let mut failed = std::collections::BTreeSet::new();
        while let Ok(fate) = fates.try_recv() {
            let fresh = match fate {
                LinkReport::Sent { slice, .. } => sent.insert(slice),
                LinkReport::Failed { slice, .. } => failed.insert(slice),
            };
            assert!(fresh && sent.intersection(&failed).next().is_none(), "{fate:?} reported twice");
        }
        assert_eq!(sent.len() + failed.len(), frames as usize, "every frame reported");
        assert!(!failed.is_empty(), "the write in progress at the reset failed");
        let mut dec = shoal_core::frame::StreamDecoder::new(shoal_core::frame::DEFAULT_MAX_PAYLOAD);
        dec.extend(&received);
        let mut on_second = Vec::new();
        while let Some(f) = dec.next_frame().expect("whole frames from the first byte") {
            on_second.push(f.header.slice);
        }
        assert_eq!(dec.buffered(), 0, "nothing cut off");
        assert!(!on_second.is_empty(), "the frames behind the failed write went on");
        assert!(on_second.windows(2).all(|w| w[0] < w[1]), "in order");
        assert!(on_second.iter().all(|s| sent.contains(s)), "only frames reported sent arrive");
        // Everything after the first frame of the second connection arrived there.
        let first_on_second = on_second[0];
        assert_eq!(on_second.len() as u64, frames - first_on_second);
    }
}
