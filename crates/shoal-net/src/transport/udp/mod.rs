//! The datagram transport on UDP sockets (`run.transport = "udp"`): shoal-core's
//! [`DatagramSender`] behind a source's [`UdpLink`] (one per builder, the same owner API as
//! a TCP [`crate::transport::link::Link`]) and its [`BuilderEndpoint`] behind a builder's
//! [`receive`] task. Every decision (cutting, sequence numbers, NACKs, retransmissions,
//! what is lost or damaged) is the core's; this module moves datagrams and time.
//!
//! A builder receives datagrams on the same address and port as TCP. A source's end of
//! stream (its end-of-stream frame) becomes the stream's `END`, repeated until the builder
//! acknowledges it; the builder tells its node a source ended once that source's stream
//! has ended with nothing missing.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;

use bytes::{Bytes, BytesMut};
use shoal_core::SourceId;
use shoal_core::datagram::{
    BuilderEndpoint, DATAGRAM_HEADER_LEN, Datagram, DatagramSender, EndpointEvent, EndpointStats, Kind, ReceiverStats,
    SenderStats, UdpConfig,
};
use shoal_core::frame::{self, Flags, HEADER_LEN, set_send_time};
use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::clock::WallClock;
use crate::transport::link::{Chunk, LinkOptions, LinkReport, PullRequestFrame};

pub mod batch;
pub mod mac;

use batch::BatchSocket;

/// Largest datagram the sockets read (a UDP datagram's maximum).
const RECV_BUF: usize = 65_536;

/// Most receive batches a builder takes from its socket, without waiting, before it
/// judges its deadlines (bounds the loop while sources keep sending).
const MAX_DRAIN_BATCHES: usize = 64;

/// Sockets of this process the kernel granted smaller buffers than asked (warned once).
static SMALL_BUFFERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A UDP socket for `peer`'s address family with send and receive buffers of
/// `buffer_bytes`, warning when the kernel grants less (raise `net.core.rmem_max` and
/// `net.core.wmem_max`): once per process, since a source process opens a socket per
/// builder (30,000 at full shape); the rest at debug level.
pub fn socket(bind: SocketAddr, buffer_bytes: usize) -> std::io::Result<UdpSocket> {
    let s = std_socket(bind, buffer_bytes)?;
    s.set_nonblocking(true)?;
    UdpSocket::from_std(s)
}

/// [`socket`] as a blocking std socket (the input threads).
pub fn std_socket(bind: SocketAddr, buffer_bytes: usize) -> std::io::Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::for_address(bind), Type::DGRAM, Some(Protocol::UDP))?;
    for (what, set, get) in [
        (
            "receive",
            Socket::set_recv_buffer_size as fn(&Socket, usize) -> std::io::Result<()>,
            Socket::recv_buffer_size as fn(&Socket) -> std::io::Result<usize>,
        ),
        ("send", Socket::set_send_buffer_size, Socket::send_buffer_size),
    ] {
        let _ = set(&s, buffer_bytes);
        // Linux reports twice what it grants (bookkeeping overhead included).
        let granted = get(&s).unwrap_or(0) / 2;
        if granted < buffer_bytes {
            if SMALL_BUFFERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 0 {
                warn!(
                    what,
                    asked = buffer_bytes,
                    granted,
                    "the kernel granted a smaller UDP socket buffer; raise net.core.rmem_max / wmem_max \
                     (said once for this process)"
                );
            } else {
                debug!(what, asked = buffer_bytes, granted, "smaller UDP socket buffer");
            }
        }
    }
    s.bind(&bind.into())?;
    Ok(s.into())
}

/// Datagrams the kernel dropped on the UDP socket bound to `local` because its receive
/// buffer was full (the `drops` column of /proc/net/udp, udp6), or `None` when the table
/// does not show it. Nothing else tells a receiver about them.
pub fn kernel_drops(local: SocketAddr) -> Option<u64> {
    let (table, addr_hex) = match local {
        SocketAddr::V4(a) => ("/proc/self/net/udp", format!("{:08X}", u32::from_le_bytes(a.ip().octets()))),
        SocketAddr::V6(a) => (
            "/proc/self/net/udp6",
            a.ip()
                .octets()
                .chunks(4)
                .map(|w| format!("{:08X}", u32::from_le_bytes([w[0], w[1], w[2], w[3]])))
                .collect(),
        ),
    };
    let want = format!("{addr_hex}:{:04X}", local.port());
    let text = std::fs::read_to_string(table).ok()?;
    text.lines().skip(1).find_map(|line| {
        let cols: Vec<&str> = line.split_whitespace().collect();
        (cols.get(1) == Some(&want.as_str())).then(|| cols.last()?.parse().ok()).flatten()
    })
}

/// A source's datagram link to one builder.
#[derive(Debug)]
pub struct UdpLink {
    tx: mpsc::UnboundedSender<Chunk>,
    pub task: tokio::task::JoinHandle<SenderStats>,
}

impl UdpLink {
    #[allow(clippy::too_many_arguments)]
    pub fn spawn(
        builder: u32,
        addr: SocketAddr,
        clock: WallClock,
        cfg: UdpConfig,
        run: u32,
        buffer_bytes: usize,
        reports: mpsc::UnboundedSender<LinkReport>,
        options: LinkOptions,
    ) -> UdpLink {
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run_link(builder, addr, clock, cfg, run, buffer_bytes, rx, reports, options));
        UdpLink { tx, task }
    }

    /// Enqueues a chunk (never waits).
    pub fn send(&self, chunk: Chunk) {
        let _ = self.tx.send(chunk);
    }

    /// No more chunks: the task sends what is queued, waits for the builder to acknowledge
    /// every stream's end (bounded by `max_ends` repeats), and ends with its streams' totals.
    pub fn close(self) -> tokio::task::JoinHandle<SenderStats> {
        drop(self.tx);
        self.task
    }
}

#[allow(clippy::too_many_arguments)]
async fn run_link(
    builder: u32,
    addr: SocketAddr,
    clock: WallClock,
    cfg: UdpConfig,
    run: u32,
    buffer_bytes: usize,
    mut rx: mpsc::UnboundedReceiver<Chunk>,
    reports: mpsc::UnboundedSender<LinkReport>,
    options: LinkOptions,
) -> SenderStats {
    let unspecified: SocketAddr =
        if addr.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { (std::net::Ipv6Addr::UNSPECIFIED, 0).into() };
    let sock = match socket(unspecified, buffer_bytes)
        .and_then(|s| BatchSocket::new(s, cfg.max_payload as usize + DATAGRAM_HEADER_LEN + mac::SEAL_LEN))
        .map(|s| s.with_mac(options.mac.clone()))
    {
        Ok(s) => s,
        Err(e) => {
            warn!(builder, %addr, error = %e, "cannot open a UDP socket; every frame fails");
            while let Some(c) = rx.recv().await {
                if c.last {
                    let _ = reports.send(LinkReport::Failed { link: builder, source: c.source, slice: c.slice });
                }
            }
            return SenderStats::default();
        }
    };
    let mut link = DatagramLink::new(builder, addr, cfg, run, sock, reports, options, clock.now());
    let mut buf = vec![0u8; RECV_BUF];
    let mut open = true;
    loop {
        link.transmit(clock.now()).await;
        if !open && link.senders.values().all(DatagramSender::is_finished) {
            break;
        }
        let wake =
            link.next_wake().unwrap_or(shoal_core::Instant::MAX).min(clock.now() + shoal_core::Duration::from_secs(1));
        tokio::select! {
            c = rx.recv(), if open => match c {
                Some(c) => link.on_chunk(clock.now(), c),
                None => open = false,
            },
            r = link.sock.socket().recv_from(&mut buf) => if let Ok((n, from)) = r
                && let Some(d) = link.sock.open_one(&buf[..n])
            {
                link.on_datagram(clock.now(), &d, from);
            },
            _ = tokio::time::sleep_until(clock.deadline(wake)) => {}
        }
    }
    link.finish()
}

/// A source's datagram link while it runs: a stream per hosted source, the frames being
/// handed over, what the socket did.
struct DatagramLink {
    builder: u32,
    addr: SocketAddr,
    cfg: UdpConfig,
    run: u32,
    sock: BatchSocket,
    reports: mpsc::UnboundedSender<LinkReport>,
    options: LinkOptions,
    senders: BTreeMap<SourceId, DatagramSender>,
    /// Pull: each hosted source's stream greets the builder (a SYNC before any data, so
    /// the builder learns where to send requests), again with a doubling interval up to
    /// 1 s until the builder has sent anything for that source (the greeting may be lost).
    ungreeted: BTreeMap<SourceId, (shoal_core::Instant, shoal_core::Duration)>,
    requests_read: u64,
    /// The frame each source is handing over: its length, and whether it ends the stream.
    current: HashMap<SourceId, (u32, bool)>,
    outgoing: Vec<Bytes>,
    /// What the socket did (datagrams it refused are lost; NACKs recover them).
    sent: batch::SendOutcome,
    /// Datagrams from the builder's address that were no NACK or acknowledgement of this
    /// link's streams.
    refused: u64,
}

impl DatagramLink {
    #[allow(clippy::too_many_arguments)]
    fn new(
        builder: u32,
        addr: SocketAddr,
        cfg: UdpConfig,
        run: u32,
        sock: BatchSocket,
        reports: mpsc::UnboundedSender<LinkReport>,
        options: LinkOptions,
        now: shoal_core::Instant,
    ) -> Self {
        let mut senders = BTreeMap::new();
        let mut ungreeted = BTreeMap::new();
        if options.requests.is_some() {
            for &source in &options.hello {
                senders.insert(source, DatagramSender::new(cfg, run, source, builder));
                ungreeted.insert(source, (now, shoal_core::Duration::from_millis(20)));
            }
        }
        Self {
            builder,
            addr,
            cfg,
            run,
            sock,
            reports,
            options,
            senders,
            ungreeted,
            requests_read: 0,
            current: HashMap::new(),
            outgoing: Vec::new(),
            sent: batch::SendOutcome::default(),
            refused: 0,
        }
    }

    /// The greetings due, the streams' timeouts, and every stream's datagrams sent.
    async fn transmit(&mut self, now: shoal_core::Instant) {
        for (source, (at, every)) in self.ungreeted.iter_mut() {
            if *at <= now
                && let Some(s) = self.senders.get_mut(source)
            {
                s.handle_greet(now);
                *at = now + *every;
                *every = (*every * 2).min(shoal_core::Duration::from_secs(1));
            }
        }
        for s in self.senders.values_mut() {
            if s.poll_timeout().is_some_and(|t| t <= now) {
                s.handle_timeout(now);
            }
            self.outgoing.clear();
            self.outgoing.extend(std::iter::from_fn(|| s.poll_transmit()));
            if self.outgoing.is_empty() {
                continue;
            }
            if let Some(p) = &self.options.paths {
                p.count_datagrams_sent(self.outgoing.len() as u64);
            }
            let o = self.sock.send_all(self.addr, &self.outgoing).await;
            if o.refused > 0 {
                debug!(builder = self.builder, refused = o.refused, "datagrams not sent");
            }
            self.sent.datagrams += o.datagrams;
            self.sent.calls += o.calls;
            self.sent.refused += o.refused;
        }
    }

    fn next_wake(&self) -> Option<shoal_core::Instant> {
        let timeouts = self.senders.values().filter_map(DatagramSender::poll_timeout);
        timeouts.chain(self.ungreeted.values().map(|g| g.0)).min()
    }

    /// A chunk from the node: into its source's stream, each part as soon as it is here
    /// (the shaper's pace is the datagrams' pace).
    fn on_chunk(&mut self, now: shoal_core::Instant, c: Chunk) {
        let (cfg, run, builder) = (self.cfg, self.run, self.builder);
        let sender = self.senders.entry(c.source).or_insert_with(|| DatagramSender::new(cfg, run, c.source, builder));
        let mut head = c.head;
        if c.first {
            // The frame's length and kind are in its header, which the first chunk holds
            // whole; its send time is stamped now.
            let mut stamped = BytesMut::from(&head[..]);
            self.current.remove(&c.source);
            match frame::decode_header(&stamped, u32::MAX) {
                Ok(h) => {
                    set_send_time(&mut stamped[..HEADER_LEN], now);
                    let len = HEADER_LEN as u64 + u64::from(h.payload_len);
                    let end = h.flags.contains(Flags::END_OF_STREAM);
                    self.current.insert(c.source, (u32::try_from(len).unwrap_or(u32::MAX), end));
                }
                Err(e) => warn!(builder, source = c.source, error = %e, "a frame with no valid header is not sent"),
            }
            head = stamped.freeze();
        }
        if let Some(&(len, false)) = self.current.get(&c.source) {
            sender.handle_frame_part(now, c.slice, len, &head);
            sender.handle_frame_part(now, c.slice, len, &c.body);
        }
        if c.last {
            if self.current.remove(&c.source).is_some_and(|(_, end)| end) {
                sender.handle_end(now);
            }
            let _ = self.reports.send(LinkReport::Sent { link: builder, source: c.source, slice: c.slice });
        }
    }

    /// A datagram from the builder: a pull request, or a NACK or acknowledgement of one
    /// of this link's streams; anything else is counted and dropped.
    fn on_datagram(&mut self, now: shoal_core::Instant, bytes: &[u8], from: SocketAddr) {
        let d = match Datagram::decode(&Bytes::copy_from_slice(bytes)) {
            Ok(d) if from == self.addr && self.senders.contains_key(&d.header.source) => d,
            _ => {
                self.refused += 1;
                return;
            }
        };
        self.ungreeted.remove(&d.header.source);
        match (&d.header.kind, &self.options.requests) {
            (Kind::Request, Some(requests)) if d.header.run == self.run && d.header.builder == self.builder => {
                self.requests_read += 1;
                let _ =
                    requests.send((self.builder, PullRequestFrame { source: d.header.source, slice: d.header.slice }));
            }
            _ => {
                let s = self.senders.get_mut(&d.header.source).expect("checked");
                let before = s.stats().retransmitted;
                s.handle_datagram(now, &d);
                // A NACK's datagrams, sent again: the path lost them.
                if let Some(p) = &self.options.paths {
                    p.count_datagrams_resent(s.stats().retransmitted - before);
                }
            }
        }
    }

    /// Every stream's totals, logged.
    fn finish(self) -> SenderStats {
        let mut total = SenderStats::default();
        for s in self.senders.values() {
            total.merge(s.stats());
        }
        let ends_unacknowledged = self.senders.values().filter(|s| !s.end_acknowledged()).count();
        info!(
            builder = self.builder,
            frames = total.frames,
            datagrams = total.datagrams,
            nacks = total.nacks,
            retransmitted = total.retransmitted,
            unanswerable = total.unanswerable,
            send_calls = self.sent.calls,
            send_errors = self.sent.refused,
            gso_segments = self.sock.max_gso_segments(),
            refused = self.refused,
            requests_read = self.requests_read,
            ends_unacknowledged,
            "UDP link finished"
        );
        total
    }
}

/// What a builder's datagram endpoint saw.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct UdpReceiveReport {
    pub endpoint: EndpointStats,
    pub streams: ReceiverStats,
    /// Reassembled frames whose own decoding failed (forged pieces): counted damaged.
    pub frames_undecodable: u64,
    pub send_errors: u64,
    /// Datagrams whose MAC did not verify (`[security] data`): dropped before anything
    /// read them.
    pub mac_refused: u64,
}

/// What the receive task hands the builder's loop.
pub enum Received {
    Frame {
        frame: frame::Frame,
        recovered: bool,
    },
    /// `n` more frames of `source` were given up.
    Damaged {
        source: SourceId,
        n: u64,
    },
    /// `source`'s stream ended with nothing missing.
    Ended {
        source: SourceId,
    },
    /// `source` was heard from for the first time: pull requests for it can be sent
    /// ([`receive`]'s `requests`).
    Greeted {
        source: SourceId,
    },
}

/// A builder's datagram endpoint on `sock` until `cancel`: frames, damage, ends and first
/// greetings go to `out`; NACKs, acknowledgements and pull `requests` (source, slice) go to
/// the address each source last sent from.
#[allow(clippy::too_many_arguments)]
pub async fn receive(
    sock: UdpSocket,
    cfg: UdpConfig,
    run: u32,
    builder: u32,
    n_sources: u32,
    max_payload: u32,
    clock: WallClock,
    out: mpsc::Sender<Received>,
    mut requests: mpsc::UnboundedReceiver<(SourceId, shoal_core::slice::SliceNumber)>,
    mac: Option<std::sync::Arc<mac::DatagramMac>>,
    cancel: CancellationToken,
) -> UdpReceiveReport {
    let mut ep = BuilderEndpoint::new(cfg, run, builder, n_sources);
    let mut peers: HashMap<SourceId, SocketAddr> = HashMap::new();
    let mut report = UdpReceiveReport::default();
    let mut sock = match BatchSocket::new(sock, cfg.max_payload as usize + DATAGRAM_HEADER_LEN + mac::SEAL_LEN) {
        Ok(s) => s.with_mac(mac),
        Err(e) => {
            warn!(builder, error = %e, "cannot set up batched UDP receive; no datagram is received");
            cancel.cancelled().await;
            return report;
        }
    };
    let mut received: Vec<(SocketAddr, Bytes)> = Vec::new();
    let mut greeted: Vec<SourceId> = Vec::new();
    let mut requests_open = true;
    loop {
        let wake =
            ep.poll_timeout().unwrap_or(shoal_core::Instant::MAX).min(clock.now() + shoal_core::Duration::from_secs(1));
        tokio::select! {
            r = sock.recv(&mut received) => {
                if let Err(e) = r {
                    debug!(builder, error = %e, "UDP receive failed");
                }
            }
            _ = tokio::time::sleep_until(clock.deadline(wake)) => {}
            r = requests.recv(), if requests_open => match r {
                Some((source, slice)) => {
                    // Routed only to greeted sources, so the peer is known.
                    if let Some(peer) = peers.get(&source)
                        && sock.send_one(*peer, &Datagram::request(run, source, builder, slice)).await.is_err()
                    {
                        report.send_errors += 1;
                    }
                }
                None => requests_open = false,
            },
            _ = cancel.cancelled() => break,
        }
        // When a deadline has passed, the datagrams already in the socket arrived before
        // now: take them before judging it. A builder that waited for a CPU past a frame's
        // reassembly deadline otherwise gave the frame up (counted it damaged) with its
        // last datagrams waiting in the socket: 1-3 fragments in some testbed runs with
        // nothing lost anywhere (docs/validation.md). Only then, so the usual wake-up
        // makes no extra system call.
        // Datagrams handled below only arm deadlines after now, so one look (it scans every
        // stream) says whether any is due, before and after them.
        let expired = ep.poll_timeout().is_some_and(|t| t <= clock.now());
        if expired {
            for _ in 0..MAX_DRAIN_BATCHES {
                match sock.try_recv(&mut received) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) => {
                        debug!(builder, error = %e, "UDP receive failed");
                        break;
                    }
                }
            }
        }
        let now = clock.now();
        for (from, d) in received.drain(..) {
            if let Ok(source) = ep.handle_bytes(now, &d)
                && peers.insert(source, from).is_none()
            {
                greeted.push(source);
            }
        }
        if expired {
            ep.handle_timeout(now);
        }
        while let Some((source, d)) = ep.poll_transmit() {
            if let Some(peer) = peers.get(&source)
                && sock.send_one(*peer, &d).await.is_err()
            {
                report.send_errors += 1;
            }
        }
        let mut msgs: Vec<Received> = greeted.drain(..).map(|source| Received::Greeted { source }).collect();
        while let Some(e) = ep.poll_event() {
            msgs.push(match e {
                EndpointEvent::Fragment(f) => match frame::decode(&f.frame, max_payload) {
                    Ok((frame, used)) if used == f.frame.len() && frame.header.source == f.source => {
                        Received::Frame { frame, recovered: f.recovered }
                    }
                    _ => {
                        report.frames_undecodable += 1;
                        Received::Damaged { source: f.source, n: 1 }
                    }
                },
                EndpointEvent::Damaged { source, n } => Received::Damaged { source, n },
                EndpointEvent::Ended { source } => Received::Ended { source },
            });
        }
        for m in msgs {
            if out.send(m).await.is_err() {
                break;
            }
        }
    }
    report.endpoint = ep.stats().clone();
    report.streams = ep.receiver_totals();
    report.mac_refused = sock.mac_refused;
    if report.mac_refused > 0 {
        warn!(builder, refused = report.mac_refused, "datagrams whose MAC did not verify were dropped");
    }
    report
}
