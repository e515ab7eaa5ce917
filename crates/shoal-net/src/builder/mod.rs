//! The builder: accepts every source's connection, finds frames in each byte stream,
//! assembles slices (shoal-core's [`BuilderNode`]), filters them on a thread of its own
//! and ships the selected events to the writer.
//!
//! Beside the filter, the burst saver (shoal-core's `BurstSaver`) keeps the last seconds
//! of built slices and the late fragments; what it saves goes through the builder's spool
//! ([`crate::builder::spool`]: local disk first, then the writer). Alerts arrive through
//! [`Live::alerts`].
//!
//! Receiving never waits for filtering: completed slices go to the filter thread through a
//! queue ([`crate::builder::filter_queue`], a batch per round of the assembler's loop) bounded in
//! *bytes* by the assembler's memory budget (the filter releases bytes as it finishes a
//! batch; above the budget new fragments are dropped and counted) and in slices
//! (`builder.filter_queue_slices`; beyond, a slice goes unfiltered, counted). A
//! connection that sends garbage is closed with a logged reason and a counted rejection;
//! the other connections carry on.
//!
//! Pull runs: the builder keeps a connection to the data-flow manager (greeting it with the
//! slices it holds after every connect, reading assignments, returning credits and a
//! heartbeat with its memory in use), and writes its fragment requests back on the
//! connection of the source that greeted it.

pub mod filter_queue;
mod hold;
pub mod km3out;
pub mod spool;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration as StdDuration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use shoal_core::assembly::{Admission, SliceOutcome};
use shoal_core::frame::{self, Flags, Frame, FrameHeader};
use shoal_core::hit::HitPayload;
use shoal_core::node::{Arrival, BuilderNode, BuilderNodeReport};
use shoal_core::pullmsg::PullMessage;
use shoal_core::saver::{BurstSaver, SaverOutput, SaverStats};
use shoal_core::slice::SliceClock;
use shoal_core::slice::SliceNumber;
use shoal_core::{Instant, SourceId};
use shoal_trigger::{FragmentData, SliceData, encode_events};
use tokio::net::{TcpStream, UdpSocket};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::builder::filter_queue::{FilterQueue, FilterQueueRx};
use crate::builder::hold::{ConnectionGate, Held, ReadGate, WindowEdge};
use crate::builder::spool::{SpoolConfig, SpoolReport, SpoolWork};
use crate::clock::WallClock;
use crate::config::{Config, ConfigError, ReceivePath, Transport};
use crate::live::Live;
use crate::report::{DelayStats, new_histogram};
use crate::transport::framed::{FrameReader, ReadEnd};
use crate::transport::link::{Backoff, Chunk, Link, LinkOptions, LinkReport};
use crate::transport::udp::{Received, UdpReceiveReport};
use crate::transport::write_queue::{write_queued, write_queued_until};

/// What a builder reports at the end: the node's report plus what only the process knows
/// (delay histograms, connections, the filter's work).
#[derive(Clone, Debug, serde::Serialize)]
pub struct BuilderReport {
    #[serde(flatten)]
    pub node: BuilderNodeReport,
    /// Application send to complete arrival, and slice end to application send (the delay
    /// added on purpose by shaping).
    pub network_delay: DelayStats,
    pub shaping_delay: DelayStats,
    /// The same, as histograms in microseconds (to combine several builders).
    #[serde(skip)]
    pub net_delay_us: Histogram<u64>,
    #[serde(skip)]
    pub shaping_delay_us: Histogram<u64>,
    /// The largest network delay of the fragments that arrived in each second of the
    /// run, counted from the first arrival (µs): when a tail came, at start-up or
    /// throughout.
    pub network_delay_max_by_second_us: Vec<u64>,
    /// The network delay without the start-up transient: fragments of the slices that end
    /// [`shoal_core::node::STEADY_AFTER`] or later after the run's first slice (new
    /// connections, cold processes and the first wake-ups are not the network's steady
    /// state; the simulator's `network_delay_steady_*` leave out the same slices).
    pub network_delay_steady: DelayStats,
    /// The same as a histogram. A cluster node's report adds its recorded values
    /// ([`crate::report::recorded_counts`]) as `network_delay_steady_counts`, so that a run's builders can
    /// be pooled exactly (the testbed's p99 over all fragments; a p99 of p99s is not one).
    #[serde(skip)]
    pub net_delay_steady_us: Histogram<u64>,
    pub connections: u64,
    /// Free-running sources (`source.saturate`): times a connection was held back because
    /// its next fragment would have opened a slice past the window, and the most fragments
    /// held at once (shoal-net's `hold` module).
    #[serde(default)]
    pub read_holds: u64,
    #[serde(default)]
    pub held_fragments_most: usize,
    /// Hits in the accepted fragments (the filter's input).
    pub hits: u64,
    pub events: u64,
    /// Time the filter thread spent on slices (filtering them and handing on their
    /// events), seconds.
    pub filter_busy_s: f64,
    /// Slices assembled but never filtered: the filter's queue was full (a filter slower
    /// than the load), or still held at the end of the drain. Their fragments were
    /// delivered; their events are lost.
    pub slices_not_filtered: u64,
    /// Their slice numbers (at most `shoal_core::node::MAX_LISTED_SLICES`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_filtered_slices: Vec<u64>,
    /// Slices the filter failed on (a plug-in's error return; their events so far kept).
    #[serde(default)]
    pub filter_failed: u64,
    /// Events a plug-in handed back malformed (refused).
    #[serde(default)]
    pub filter_malformed_events: u64,
    /// Slices a Python filter worker did not finish within `builder.filter.timeout_ms` (the
    /// worker killed and replaced; the slice's fragments kept in the slices file).
    #[serde(default)]
    pub filter_timeout: u64,
    /// `builder.filter.python` or `isolate`: the worker pool's counts (started again,
    /// failed, crashed, timed out, malformed events).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter_workers: Option<shoal_shm::workers::WorkerReport>,
    /// Event frames the writer link could not deliver.
    pub event_frames_failed: u64,
    /// Pull: requests for a source that had not greeted this builder (asked again later).
    pub requests_unroutable: u64,
    /// Datagram transport: what the endpoint received, refused, asked again and lost.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp: Option<UdpReceiveReport>,
    /// The burst saver (history, evictions, alerts, late fragments kept) and its spool
    /// (records on disk, shipped to the writer, refused, failed; each alert's report).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saver: Option<SaverStats>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spool: Option<SpoolReport>,
    /// Alerts this builder never saw (its alert queue overflowed).
    pub alerts_missed: u64,
    /// Monitoring taps of this process (published, dropped), when open.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tap: Option<crate::tap::TapStats>,
    /// KM3NeT mode: timeslices, frames and messages published, DAQ file bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub km3net: Option<crate::builder::km3out::Km3OutReport>,
    /// `builder.consumers`: slices published to shared-memory consumers, and what each
    /// consumer was offered, skipped and lost to overruns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumers: Option<shoal_shm::PublisherReport>,
}

/// The burst saver and the channel to its spool thread.
struct Saving {
    saver: BurstSaver<FragmentData>,
    spool: std::sync::mpsc::Sender<SpoolWork>,
    live: Arc<Live>,
}

impl Saving {
    /// The burst saver of builder `id` and its spool thread, which ships what it spools on
    /// `writer_link` and reports each write's bytes on `spooled`.
    fn start(
        cfg: &Config,
        id: u32,
        slice_clock: SliceClock,
        writer_link: &Arc<Link>,
        spooled: mpsc::UnboundedSender<u64>,
        live: &Arc<Live>,
    ) -> (Self, std::thread::JoinHandle<SpoolReport>) {
        let (spool_tx, spool_rx) = std::sync::mpsc::channel();
        let spool_cfg = SpoolConfig {
            builder: id,
            run: cfg.run.run_number,
            dir: cfg.spool_dir(),
            max_bytes: cfg.saver.spool_max_mb << 20,
            slice_clock,
            ship_bytes_per_s: (cfg.saver.ship_mb_per_s * 1e6) as u64,
        };
        let thread = crate::builder::spool::spawn(spool_cfg, writer_link.clone(), spool_rx, spooled);
        let saver = BurstSaver::new(cfg.saver_config(), id, slice_clock);
        (Self { saver, spool: spool_tx, live: live.clone() }, thread)
    }

    /// Hands what the saver decided to the spool thread; alert reports also go to whoever
    /// listens (the dispatcher in a run-controlled process).
    fn drain(&mut self) {
        while let Some(o) = self.saver.poll_output() {
            match &o {
                SaverOutput::Closed(r) => {
                    Live::add(&self.live.alerts_answered, 1);
                    let _ = self.live.alerts.reports.send(r.clone());
                }
                SaverOutput::Fragment { record: shoal_core::saver::Record::Late, .. } => {
                    Live::add(&self.live.late_salvaged, 1);
                }
                SaverOutput::Fragment { .. } => Live::add(&self.live.fragments_saved, 1),
                SaverOutput::Opened { .. } => {}
            }
            if self.spool.send(SpoolWork::Save(o)).is_err() {
                // The spool thread is gone (it ends only after Finish): nothing to do.
                break;
            }
        }
    }
}

enum Incoming {
    Frame {
        frame: Frame,
        arrival: Instant,
        /// Free-running sources: the connection's gate, if it may be held ([`crate::builder::hold`]).
        gate: Option<Arc<ReadGate>>,
    },
    Rejected {
        reason: &'static str,
    },
    /// Pull: requests for `source` go back on this connection.
    Hello {
        source: SourceId,
        requests: mpsc::UnboundedSender<Bytes>,
    },
    /// Pull: connected to the data-flow manager (what to write to it), and its assignments.
    DfmUp {
        out: mpsc::UnboundedSender<Bytes>,
    },
    Assign {
        slice: SliceNumber,
    },
    /// What one read of a connection brought, in order ([`ToBuilder`]), with its room.
    Batch {
        messages: Vec<Incoming>,
        _room: tokio::sync::OwnedSemaphorePermit,
    },
}

/// Most frames of one read a connection's reader hands on in one message.
const READ_BATCH: usize = 64;
/// Most batched frames on their way from the readers to the builder's loop, as the
/// channel's bound holds single messages.
const BATCHED_IN_FLIGHT: usize = 4096;
const _: () = assert!(READ_BATCH <= BATCHED_IN_FLIGHT, "a batch must fit in the room for batches");

/// A connection reader's way to the builder's loop. The frames one read brought go in one
/// message: at small fragments a message per frame cost a channel operation and often a
/// wake-up each, hundreds of thousands a second.
#[derive(Clone)]
struct ToBuilder {
    tx: mpsc::Sender<Incoming>,
    room: Arc<tokio::sync::Semaphore>,
}

impl ToBuilder {
    fn new(tx: mpsc::Sender<Incoming>, room: &Arc<tokio::sync::Semaphore>) -> Self {
        Self { tx, room: room.clone() }
    }

    /// Sends `messages` (emptied) as one; false once the builder's loop is gone.
    async fn send(&self, messages: &mut Vec<Incoming>) -> bool {
        let sent = match messages.len() {
            0 => return true,
            1 => self.tx.send(messages.pop().expect("one")).await,
            n => {
                // At most READ_BATCH (`serve_frames`), within the semaphore's permits: more
                // than it has would wait for ever.
                debug_assert!(n <= READ_BATCH, "a batch of {n} frames");
                let Ok(room) = self.room.clone().acquire_many_owned(n as u32).await else {
                    return false;
                };
                self.tx.send(Incoming::Batch { messages: std::mem::take(messages), _room: room }).await
            }
        };
        sent.is_ok()
    }
}

/// Builder `id`'s end of stream (to the writer, and in pull to the data-flow manager).
fn end_of_stream(id: u32, now: Instant) -> FrameHeader {
    FrameHeader {
        flags: Flags::END_OF_STREAM,
        source: id,
        hit_count: 0,
        slice: 0,
        slice_start: Instant::ZERO,
        send_time: now,
        payload_len: 0,
    }
}

/// Pull: the connection to the data-flow manager, reconnecting until `cancel`.
async fn dfm_client(addr: SocketAddr, builder: u32, tx: mpsc::Sender<Incoming>, cancel: CancellationToken) {
    let mut delay = StdDuration::from_millis(20);
    loop {
        let stream = tokio::select! {
            r = TcpStream::connect(addr) => r,
            _ = cancel.cancelled() => return,
        };
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(builder, %addr, error = %e, "data-flow manager unreachable; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = cancel.cancelled() => return,
                }
                delay = (delay * 2).min(StdDuration::from_secs(1));
                continue;
            }
        };
        delay = StdDuration::from_millis(20);
        let _ = stream.set_nodelay(true);
        let (read, write) = stream.into_split();
        let (out, out_rx) = mpsc::unbounded_channel();
        tokio::spawn(write_queued(write, out_rx));
        if tx.send(Incoming::DfmUp { out }).await.is_err() {
            return;
        }
        let mut reader = FrameReader::new(read, addr, shoal_core::frame::DEFAULT_MAX_PAYLOAD, cancel.clone());
        loop {
            let frame = match reader.next().await {
                Ok(f) => f,
                Err(ReadEnd::Cancelled) => return,
                Err(_) => break,
            };
            match PullMessage::from_frame(&frame) {
                Ok(Some(PullMessage::Assign { builder: b, slice })) if b == builder => {
                    if tx.send(Incoming::Assign { slice }).await.is_err() {
                        return;
                    }
                }
                Ok(_) => {
                    reader.reject("unexpected_frame", "only assignments for this builder are expected");
                    break;
                }
                Err(e) => {
                    reader.reject(e.kind(), &e.to_string());
                    break;
                }
            }
        }
        warn!(builder, %addr, "lost the data-flow manager; reconnecting");
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = cancel.cancelled() => return,
        }
    }
}

/// Reads one source connection (epoll path): validated frames go to the assembler task.
async fn read_connection(
    stream: TcpStream,
    peer: SocketAddr,
    max_payload: u32,
    clock: WallClock,
    edge: Option<Arc<WindowEdge>>,
    tx: ToBuilder,
    cancel: CancellationToken,
) {
    let (read, write) = stream.into_split();
    // Pull requests for the sources that greet us go back on this connection.
    let (requests, requests_rx) = mpsc::unbounded_channel();
    let ended = CancellationToken::new();
    tokio::spawn(write_queued_until(write, requests_rx, ended.clone()));
    let reader = FrameReader::new(read, peer, max_payload, cancel)
        .first_frame_within(crate::transport::listen::FIRST_FRAME_WITHIN);
    serve_frames(reader, requests, clock, ConnectionGate::new(edge), tx).await;
    ended.cancel();
}

/// The io_uring path's [`read_connection`]: the same frames, read on the io_uring thread.
fn uring_connection(
    peer: SocketAddr,
    max_payload: u32,
    clock: WallClock,
    edge: Option<Arc<WindowEdge>>,
    tx: ToBuilder,
    cancel: CancellationToken,
    place: tokio::sync::OwnedSemaphorePermit,
) -> crate::transport::uring::ConnectionTask {
    Box::new(move |stream| {
        Box::pin(async move {
            let (requests, requests_rx) = mpsc::unbounded_channel();
            let ended = CancellationToken::new();
            tokio_uring::spawn(stream.clone().write_queued(requests_rx, ended.clone()));
            let reader = FrameReader::new(stream, peer, max_payload, cancel)
                .first_frame_within(crate::transport::listen::FIRST_FRAME_WITHIN);
            serve_frames(reader, requests, clock, ConnectionGate::new(edge), tx).await;
            ended.cancel();
            drop(place);
        })
    })
}

/// Validates one connection's frames and passes them on, those of one read in one message;
/// source hellos register the connection for pull requests (`requests`). Waits at `gate`
/// while the builder holds the connection's fragments back (free-running sources too far
/// ahead: [`crate::builder::hold`]).
async fn serve_frames<R: crate::transport::framed::ReadSource>(
    mut reader: FrameReader<R>,
    requests: mpsc::UnboundedSender<Bytes>,
    clock: WallClock,
    mut gate: ConnectionGate,
    to: ToBuilder,
) {
    let mut batch = Vec::new();
    let end = 'connection: loop {
        let mut next = match reader.next().await {
            Ok(f) => Some(f),
            Err(end) => break end,
        };
        // The frames of one read arrived together, whether or not one then waits for room
        // in the window (its delay includes the wait, as a fragment held by the builder's
        // loop counts its hold).
        let arrival = clock.now();
        let mut ended = None;
        while let Some(frame) = next.take() {
            match check_frame(&reader, &frame) {
                Err(end) => {
                    ended = Some(end);
                    break;
                }
                Ok(Some(source)) => batch.push(Incoming::Hello { source, requests: requests.clone() }),
                Ok(None) => {
                    let h = &frame.header;
                    let frame_gate = gate.for_frame(h.source);
                    if !h.flags.contains(Flags::END_OF_STREAM) && !gate.has_room(h.slice) {
                        // What came before goes in first: it may be what moves the window.
                        if !to.send(&mut batch).await {
                            break 'connection ReadEnd::Clean;
                        }
                        gate.wait_for_room(h.slice, to.tx.closed()).await;
                    }
                    batch.push(Incoming::Frame { frame, arrival, gate: frame_gate });
                }
            }
            // No more once the builder holds this connection: it would only hold them too.
            if batch.len() < READ_BATCH && !gate.is_shut() {
                match reader.next_buffered() {
                    Ok(f) => next = f,
                    Err(end) => ended = Some(end),
                }
            }
        }
        if !to.send(&mut batch).await {
            break ReadEnd::Clean;
        }
        if let Some(end) = ended {
            break end;
        }
        gate.pass(to.tx.closed()).await;
    };
    if let ReadEnd::Rejected(reason) = end {
        let _ = to.tx.send(Incoming::Rejected { reason }).await;
    }
}

/// A frame on a data port checked: `Some(source)` for a source's hello (pull), `None` for
/// a fragment to take in, or the end of the connection for anything else.
fn check_frame<R: crate::transport::framed::ReadSource>(
    reader: &FrameReader<R>,
    frame: &Frame,
) -> Result<Option<SourceId>, ReadEnd> {
    match PullMessage::from_frame(frame) {
        Ok(None) => {}
        Ok(Some(PullMessage::SourceHello { source })) => return Ok(Some(source)),
        Ok(Some(_)) => {
            return Err(reader.reject("unexpected_control", "only source hellos are expected on a data port"));
        }
        Err(e) => return Err(reader.reject(e.kind(), &e.to_string())),
    }
    let h = &frame.header;
    if h.flags.contains(Flags::EVENTS) {
        return Err(reader.reject("unexpected_events", "an EVENTS frame on a data port"));
    }
    if h.flags.contains(Flags::RAW) {
        return Err(reader.reject("unexpected_raw", "a RAW frame on a data port"));
    }
    if h.flags.contains(Flags::OPAQUE) {
        // User data in no format shoal knows (the source SDK): stored, not parsed.
        if h.hit_count != 0 {
            return Err(reader.reject("opaque_with_hits", "an OPAQUE frame claims hits"));
        }
    } else if let Err(e) = HitPayload::parse(&frame.payload, h.hit_count) {
        return Err(reader.reject("bad_payload", &e.to_string()));
    }
    Ok(None)
}

/// Accepts the data port's connections until `cancel`, each read by a task of its own (or
/// on the io_uring thread), at most `limit` at once; returns how many it accepted.
#[allow(clippy::too_many_arguments)]
async fn accept_connections(
    listener: tokio::net::TcpListener,
    limit: crate::transport::listen::ConnectionLimit,
    to: ToBuilder,
    uring: Option<crate::transport::uring::UringReceiver>,
    max_payload: u32,
    clock: WallClock,
    edge: Option<Arc<WindowEdge>>,
    cancel: CancellationToken,
) -> u64 {
    let serve = |stream: tokio::net::TcpStream, peer, place| {
        let _ = stream.set_nodelay(true);
        let (tx, c, edge) = (to.clone(), cancel.clone(), edge.clone());
        if let Some(uring) = &uring {
            if !uring.submit(stream, uring_connection(peer, max_payload, clock, edge, tx, c, place)) {
                // Closed: the source reconnects, and its link counts it.
                warn!(%peer, "the io_uring receive thread is gone: connection closed");
            }
            return;
        }
        tokio::spawn(async move {
            read_connection(stream, peer, max_payload, clock, edge, tx, c).await;
            drop(place);
        });
    };
    let rejected = || {
        let tx = to.tx.clone();
        async move {
            let _ = tx.send(Incoming::Rejected { reason: "connection_limit" }).await;
        }
    };
    crate::transport::listen::accept_loop(listener, "data", limit, cancel.clone(), serve, rejected).await
}

/// Binds a builder's data port at `addr`: the TCP listener and, for the datagram
/// transport, its UDP socket on the same port ([`crate::transport::listen::bind_data_port`]).
pub fn bind_port(cfg: &Config, addr: std::net::SocketAddr) -> anyhow::Result<crate::transport::listen::DataPort> {
    let udp = matches!(cfg.transport()?, Transport::Udp).then(|| cfg.udp_socket_buffer());
    Ok(crate::transport::listen::bind_data_port(addr, udp)?)
}

/// Runs a builder on an already bound listener until every source has ended its stream
/// (or `cancel`), then processes what is left and closes.
pub async fn run_builder(
    cfg: Config,
    id: u32,
    port: impl Into<crate::transport::listen::DataPort>,
    clock: WallClock,
    live: Arc<Live>,
    cancel: CancellationToken,
) -> Result<BuilderReport, ConfigError> {
    let crate::transport::listen::DataPort { tcp: listener, udp: bound_udp } = port.into();
    let slice_clock = cfg.slice_clock()?;
    let writer_addr = cfg.writer_addr()?;
    let least_per_slice = StdDuration::from_millis(cfg.builder.fault_filter_ms_per_slice);
    // Built (a plug-in loaded and initialised) here, so that a filter that cannot start
    // refuses the run with its reason; then moved to the filter thread.
    let stage = filter_stage(&cfg.builder.filter)?;
    let n_sources = cfg.run.sources;
    let max_payload = cfg.max_payload();
    // Free-running sources are held back by their connections, not pushed out incomplete.
    let edge = (cfg.source.saturate && matches!(cfg.transport()?, Transport::Tcp)).then(WindowEdge::new);
    // Held connections keep their data in the kernel's TCP memory, which all of them
    // share: many of them get smaller buffers (`crate::transport::listen::KernelShare`).
    if edge.is_some()
        && let Some(size) =
            crate::transport::listen::held_receive_buffer(cfg.builder.held_receive_buffer, n_sources.into())
    {
        match crate::transport::listen::set_receive_buffer(&listener, size) {
            Ok(()) => info!(builder = id, n_sources, receive_buffer = size, "data connections' receive buffer"),
            Err(e) => warn!(builder = id, error = %e, "setting the data port's receive buffer"),
        }
    }

    let (in_tx, mut in_rx) = mpsc::channel::<Incoming>(4096);
    let batched_room = Arc::new(tokio::sync::Semaphore::new(BATCHED_IN_FLIGHT));
    // Ends the datagram task with this function, also when it is aborted.
    let cancel_udp = CancellationToken::new();
    let _end_udp = cancel_udp.clone().drop_guard();
    // Datagram transport: the same address and port as TCP, its own receive task.
    let (udp_tx, mut udp_rx) = mpsc::channel::<Received>(4096);
    // Pull over datagrams: requests go to the receive task, which sends them.
    let (udp_requests, udp_requests_rx) = mpsc::unbounded_channel();
    let udp_task = match cfg.transport()? {
        Transport::Udp => {
            let addr = listener.local_addr().map_err(|e| ConfigError::Invalid(format!("builder address: {e}")))?;
            let endpoint = DatagramEndpoint { received: udp_tx, requests: udp_requests_rx, cancel: cancel_udp.clone() };
            Some(start_udp(&cfg, id, addr, bound_udp, clock, endpoint)?)
        }
        Transport::Tcp => {
            drop(udp_tx);
            None
        }
    };
    let dfm_in_tx = in_tx.clone();
    let readers = CancellationToken::new();
    // The tasks spawned for this process (accept loop, connection readers, the manager's
    // client) end with it, also when it is aborted: a killed process leaves no listener or
    // connection open behind it.
    let _end_tasks = readers.clone().drop_guard();
    let limit = crate::transport::listen::ConnectionLimit::new(n_sources as usize);
    let uring = match cfg.builder.receive {
        ReceivePath::Epoll => None,
        ReceivePath::IoUring => Some(
            crate::transport::uring::UringReceiver::start()
                .map_err(|e| ConfigError::Invalid(format!("builder.receive = \"io_uring\": {e}")))?,
        ),
    };
    let to_builder = ToBuilder::new(in_tx, &batched_room);
    let accept_task = tokio::spawn(accept_connections(
        listener,
        limit,
        to_builder,
        uring,
        max_payload,
        clock,
        edge.clone(),
        readers.clone(),
    ));

    // Writer link and the filter thread.
    let (wreport_tx, mut wreports) = mpsc::unbounded_channel();
    let wclosing = CancellationToken::new();
    let backoff = Backoff {
        min: StdDuration::from_millis(cfg.source.reconnect_min_ms.max(1)),
        max: StdDuration::from_millis(cfg.source.reconnect_max_ms.max(1)),
    };
    let writer_link = Arc::new(Link::spawn_with(
        id,
        writer_addr,
        clock,
        backoff,
        wreport_tx,
        wclosing.clone(),
        LinkOptions { paths: Some(live.paths.clone()), ..LinkOptions::default() },
    ));
    // The burst saver and its spool thread.
    let (spooled_tx, mut spooled_rx) = mpsc::unbounded_channel::<u64>();
    // Only a builder with a saver listens: an alert nobody can take is refused upstream.
    let mut alerts_rx = cfg.saver.enabled.then(|| live.alerts.alerts.subscribe());
    let (mut saving, spool_thread) = match cfg.saver.enabled {
        true => {
            let (saving, thread) = Saving::start(&cfg, id, slice_clock, &writer_link, spooled_tx, &live);
            (Some(saving), Some(thread))
        }
        false => (None, None),
    };
    let mut alerts_missed = 0u64;
    let failed_task = tokio::spawn(async move {
        let mut failed = 0u64;
        while let Some(r) = wreports.recv().await {
            if matches!(r, LinkReport::Failed { .. }) {
                failed += 1;
            }
        }
        failed
    });
    // Bounded in bytes by the assembler's memory budget and in slices here: a filter
    // slower than the load must not build a backlog of small slices without end.
    let (mut out_tx, out_rx) = crate::builder::filter_queue::filter_queue::<SliceOutcome<FragmentData>>(
        cfg.builder.filter_queue_slices as usize,
    );
    let mut not_filtered = Unfiltered::default();
    let (released_tx, mut released_rx) = mpsc::unbounded_channel::<u64>();
    let job = FilterJob {
        id,
        queue: out_rx,
        released: released_tx,
        link: writer_link.clone(),
        live: live.clone(),
        stage,
        slice_clock,
        tap_events: cfg.tap.events,
        least_per_slice,
        abandon: Arc::default(),
        store_slices: cfg.builder.store_slices,
        km3: crate::builder::km3out::Km3Out::new(&cfg, id)?,
        publisher: slice_publisher(&cfg.builder.consumers, cfg.run.run_number, id)?,
    };
    let filter_thread = FilterThread::start(job);
    let mut sampler = RawSampler { every: cfg.tap.raw_every, seen: 0, slice_clock };

    let mut node: BuilderNode<FragmentData> = BuilderNode::new(cfg.builder_node(id)?);
    let pull = cfg.policy()?.pull();
    if let Some(p) = pull {
        node = node.with_pull(p);
        let addr = cfg.dfm_addr()?;
        tokio::spawn(dfm_client(addr, id, dfm_in_tx, readers.clone()));
    } else {
        drop(dfm_in_tx);
    }
    let mut measured = Measured {
        net: new_histogram(),
        shaping: new_histogram(),
        hits: 0,
        first_arrival: None,
        max_by_second: Vec::new(),
        steady: new_histogram(),
        steady_from: cfg.run.start_slice.map(|first| shoal_core::node::steady_from(first, slice_clock)),
        slice_clock,
    };
    let mut routes = Routes::default();
    let mut held = Held::default();
    let mut heartbeat = tokio::time::interval(StdDuration::from_millis(500));
    info!(builder = id, n_sources, pull = pull.is_some(), "builder started");

    loop {
        let saver_wake = saving.as_ref().and_then(|s| s.saver.poll_timeout());
        let wake = match (node.poll_timeout(), saver_wake) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        tokio::select! {
            m = in_rx.recv() => match m {
                Some(m) => {
                    on_incoming(&mut node, &mut measured, &mut routes, &mut saving, &mut held, m, &live, clock);
                    // Take what else is ready without another trip through select.
                    while let Ok(m) = in_rx.try_recv() {
                        on_incoming(&mut node, &mut measured, &mut routes, &mut saving, &mut held, m, &live, clock);
                    }
                }
                None => break,
            },
            a = async { alerts_rx.as_mut().expect("checked").recv().await }, if alerts_rx.is_some() => match a {
                Ok(alert) => {
                    info!(builder = id, %alert, "alert: saving its window");
                    if let Some(s) = saving.as_mut() {
                        s.saver.handle_alert(clock.now(), alert);
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                    warn!(builder = id, missed = n, "alerts came faster than this builder took them; some were missed");
                    alerts_missed += n;
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => {}
            },
            Some(bytes) = spooled_rx.recv() => {
                if let Some(s) = saving.as_mut() {
                    s.saver.handle_spooled(bytes);
                }
            }
            _ = heartbeat.tick(), if pull.is_some() => {
                if let Some(out) = &routes.dfm {
                    let _ = out.send(PullMessage::Credit { builder: id, slice: None, memory: node.memory_in_use() }.encode());
                }
            }
            _ = tokio::time::sleep_until(clock.deadline(wake.unwrap_or(Instant::MAX).min(clock.now() + shoal_core::Duration::from_secs(1)))) => {
                node.handle_timeout(clock.now());
                if let Some(s) = saving.as_mut() {
                    s.saver.handle_timeout(clock.now());
                }
            }
            Some(bytes) = released_rx.recv() => node.handle_released(bytes),
            Some(r) = udp_rx.recv() => {
                on_received(&mut node, &mut measured, &mut routes, &mut saving, &udp_requests, r, &live, clock);
                while let Ok(r) = udp_rx.try_recv() {
                    on_received(&mut node, &mut measured, &mut routes, &mut saving, &udp_requests, r, &live, clock);
                }
            }
            _ = cancel.cancelled() => {
                warn!(builder = id, ended = node.sources_ended(), n_sources, "stopping before every source ended its stream");
                break;
            }
        }
        if !held.is_empty() {
            held.release(&mut node, false, |node, frame, at| {
                on_frame(node, &mut measured, &mut saving, frame, at, false, &live)
            });
        }
        if let Some(edge) = &edge {
            edge.publish(node.window_edge());
        }
        forward(&mut node, &mut saving, &mut sampler, &mut out_tx, &live, clock, &mut not_filtered);
        routes.send_pull(&mut node, id);
        if node.all_ended() {
            // Pull: the manager hears the clean end after the last credits, on the same
            // connection: what it assigned meanwhile (past the end of the run) is not
            // handed on to the others.
            if let Some(out) = &routes.dfm {
                let _ = out.send(frame::encode(&end_of_stream(id, clock.now()), &[]));
            }
            break;
        }
    }
    readers.cancel();
    cancel_udp.cancel();
    let udp = match udp_task {
        Some(t) => t.await.ok(),
        None => None,
    };
    let connections = accept_task.await.unwrap_or(0);
    // A cancelled run: what was held back goes in before the drain (nothing is lost here).
    held.release(&mut node, true, |node, frame, at| {
        on_frame(node, &mut measured, &mut saving, frame, at, false, &live)
    });
    // The node drained itself at the last end of stream; this is for a cancelled run.
    node.handle_drain(clock.now());
    forward(&mut node, &mut saving, &mut sampler, &mut out_tx, &live, clock, &mut not_filtered);
    drop(out_tx);
    // Open alerts close with what they have; the spool ships the rest before the writer
    // hears this builder's end of stream.
    let saver_stats = saving.as_mut().map(|s| {
        s.saver.handle_end();
        s.drain();
        let _ = s.spool.send(SpoolWork::Finish);
        s.saver.stats()
    });
    let filter_drain = StdDuration::from_millis(cfg.builder.drain_timeout_ms / 2);
    let FilterThreadReport {
        events,
        busy_s: busy,
        abandoned,
        km3net,
        failed_slices,
        timeout_slices,
        malformed_events,
        consumers,
        workers,
    } = filter_thread.join(filter_drain).await;
    for slice in abandoned {
        not_filtered.add(slice);
    }
    if not_filtered.count > 0 {
        warn!(
            builder = id,
            slices = not_filtered.count,
            "slices processed but not filtered: the filter is slower than the load"
        );
    }
    let spool = match spool_thread {
        Some(t) => Some(
            tokio::task::spawn_blocking(move || t.join().expect("spool thread panicked"))
                .await
                .expect("join spool thread"),
        ),
        None => None,
    };
    close_writer_link(writer_link, id, clock, &wclosing).await;
    let report = BuilderReport {
        node: node.report(),
        network_delay: DelayStats::from_histogram(&measured.net),
        shaping_delay: DelayStats::from_histogram(&measured.shaping),
        net_delay_us: measured.net,
        shaping_delay_us: measured.shaping,
        network_delay_max_by_second_us: measured.max_by_second,
        network_delay_steady: DelayStats::from_histogram(&measured.steady),
        net_delay_steady_us: measured.steady,
        connections,
        read_holds: held.holds,
        held_fragments_most: held.most_frames,
        hits: measured.hits,
        events,
        filter_busy_s: busy,
        slices_not_filtered: not_filtered.count,
        not_filtered_slices: not_filtered.slices,
        filter_failed: failed_slices,
        filter_timeout: timeout_slices,
        filter_workers: workers,
        filter_malformed_events: malformed_events,
        event_frames_failed: failed_task.await.unwrap_or(0),
        requests_unroutable: routes.unroutable,
        udp,
        saver: saver_stats,
        spool,
        alerts_missed,
        tap: live.tap.is_open().then(|| live.tap.stats()),
        km3net,
        consumers,
    };
    info!(
        builder = id,
        complete = report.node.slices_complete,
        incomplete = report.node.slices_incomplete,
        "builder finished"
    );
    Ok(report)
}

/// The datagram receive task's ends: what it received goes to `received`, the pull
/// requests it sends come from `requests`; it stops at `cancel`.
struct DatagramEndpoint {
    received: mpsc::Sender<Received>,
    requests: mpsc::UnboundedReceiver<(SourceId, SliceNumber)>,
    cancel: CancellationToken,
}

/// Starts builder `id`'s datagram receive task at `addr`, the TCP listener's address and
/// port, on `bound` where the caller bound it with the listener ([`bind_port`]), else on a
/// socket bound here.
fn start_udp(
    cfg: &Config,
    id: u32,
    addr: SocketAddr,
    bound: Option<std::net::UdpSocket>,
    clock: WallClock,
    endpoint: DatagramEndpoint,
) -> Result<tokio::task::JoinHandle<UdpReceiveReport>, ConfigError> {
    let sock = match bound {
        Some(s) => UdpSocket::from_std(s),
        None => crate::transport::udp::socket(addr, cfg.udp_socket_buffer()),
    }
    .map_err(|e| ConfigError::Invalid(format!("binding UDP {addr}: {e}")))?;
    Ok(tokio::spawn(crate::transport::udp::receive(
        sock,
        cfg.udp_config(),
        cfg.run.run_number as u32,
        id,
        cfg.run.sources,
        cfg.max_payload(),
        clock,
        endpoint.received,
        endpoint.requests,
        endpoint.cancel,
    )))
}

/// The shared-memory slice publisher of builder `id` in `run`, where `c` enables it.
fn slice_publisher(
    c: &crate::config::ConsumersConfig,
    run: u64,
    id: u32,
) -> Result<Option<shoal_shm::SlicePublisher>, ConfigError> {
    if !c.enabled {
        return Ok(None);
    }
    let pc = shoal_shm::PublisherConfig {
        socket: shoal_shm::socket_name(&c.socket, id),
        ring_bytes: c.ring_mb << 20,
        max_consumers: c.max_consumers,
        max_hold: StdDuration::from_millis(c.max_hold_ms),
        any_user: c.any_user,
        run,
        builder: id,
    };
    shoal_shm::SlicePublisher::start(&pc).map(Some).map_err(|e| ConfigError::Invalid(format!("builder.consumers: {e}")))
}

/// The builder's filter thread: filters the slices of its queue, sends their events to
/// the writer and gives their bytes back (`released`). Told to abandon what is left when
/// the drain at the end of a run takes too long.
struct FilterThread {
    handle: std::thread::JoinHandle<FilterThreadReport>,
    abandon: Arc<std::sync::atomic::AtomicBool>,
}

impl FilterThread {
    fn start(job: FilterJob) -> Self {
        let abandon = job.abandon.clone();
        let handle = std::thread::Builder::new()
            .name(format!("filter-{}", job.id))
            .spawn(move || filter_loop(job))
            .expect("spawn filter thread");
        Self { handle, abandon }
    }

    /// Waits for the thread to finish its queue, for at most `drain`; what is left then is
    /// abandoned (the thread counts it), so that the builder answers STOP in time.
    async fn join(self, drain: StdDuration) -> FilterThreadReport {
        let Self { handle, abandon } = self;
        let mut joining = tokio::task::spawn_blocking(move || handle.join().expect("filter thread panicked"));
        match tokio::time::timeout(drain, &mut joining).await {
            Ok(r) => r,
            Err(_) => {
                abandon.store(true, std::sync::atomic::Ordering::Relaxed);
                joining.await
            }
        }
        .expect("join filter thread")
    }
}

/// Sends builder `id`'s end of stream to the writer, then closes the link (at most 10 s
/// for what is queued). The filter and spool threads have ended: this is its last handle.
async fn close_writer_link(writer_link: Arc<Link>, id: u32, clock: WallClock, closing: &CancellationToken) {
    let Ok(link) = Arc::try_unwrap(writer_link) else {
        unreachable!("the filter and spool threads have ended and dropped their handles");
    };
    let eos = end_of_stream(id, clock.now());
    link.send(Chunk::frame(id, u64::MAX, frame::encode_header(&eos, &[]), bytes::Bytes::new()));
    closing.cancel();
    if tokio::time::timeout(StdDuration::from_secs(10), link.close()).await.is_err() {
        warn!(builder = id, "writer link did not finish in time");
    }
}

/// What the driver measures beside the node: delays and the filter's input.
struct Measured {
    net: Histogram<u64>,
    shaping: Histogram<u64>,
    hits: u64,
    first_arrival: Option<Instant>,
    max_by_second: Vec<u64>,
    /// Delays from `steady_from` on (the run's first slice plus the warm-up; without a
    /// start slice, counted from the first fragment's).
    steady: Histogram<u64>,
    steady_from: Option<SliceNumber>,
    slice_clock: shoal_core::slice::SliceClock,
}

impl Measured {
    /// Keeps the largest delay per second of arrival (bounded: a second is one entry).
    fn record_by_second(&mut self, arrival: Instant, us: u64) {
        let first = *self.first_arrival.get_or_insert(arrival);
        let second = (arrival.saturating_duration_since(first).as_secs()) as usize;
        if second >= self.max_by_second.len() {
            self.max_by_second.resize(second + 1, 0);
        }
        self.max_by_second[second] = self.max_by_second[second].max(us);
    }
}

/// Pull: where a source's requests go.
enum RequestRoute {
    /// Encoded request frames, written on the source's TCP connection.
    Tcp(mpsc::UnboundedSender<Bytes>),
    /// (source, slice) to the datagram endpoint, sent as a `REQUEST` datagram.
    Udp(mpsc::UnboundedSender<(SourceId, SliceNumber)>),
}

/// Pull: where requests and credits go.
#[derive(Default)]
struct Routes {
    sources: std::collections::HashMap<SourceId, RequestRoute>,
    dfm: Option<mpsc::UnboundedSender<Bytes>>,
    unroutable: u64,
}

impl Routes {
    /// The node's requests to the sources, its returned credits to the manager.
    fn send_pull(&mut self, node: &mut BuilderNode<FragmentData>, id: u32) {
        while let Some(r) = node.poll_request() {
            let sent = match self.sources.get(&r.source) {
                Some(RequestRoute::Tcp(tx)) => {
                    tx.send(PullMessage::Request { source: r.source, slice: r.slice }.encode()).is_ok()
                }
                Some(RequestRoute::Udp(tx)) => tx.send((r.source, r.slice)).is_ok(),
                None => false,
            };
            if !sent {
                // Not greeted yet (or gone): the re-ask timer tries again.
                self.unroutable += 1;
            }
        }
        while let Some(slice) = node.poll_done() {
            if let Some(out) = &self.dfm {
                let _ = out.send(
                    PullMessage::Credit { builder: id, slice: Some(slice), memory: node.memory_in_use() }.encode(),
                );
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn on_incoming(
    node: &mut BuilderNode<FragmentData>,
    measured: &mut Measured,
    routes: &mut Routes,
    saving: &mut Option<Saving>,
    held: &mut Held,
    m: Incoming,
    live: &Live,
    clock: WallClock,
) {
    let (frame, arrival) = match m {
        Incoming::Frame { frame, arrival, gate: None } => (frame, arrival),
        Incoming::Frame { frame, arrival, gate: Some(gate) } => match held.offer(node, &gate, frame, arrival) {
            Some(taken) => taken,
            None => return,
        },
        Incoming::Rejected { reason } => {
            node.handle_rejected(reason);
            Live::add(&live.rejected_connections, 1);
            return;
        }
        Incoming::Hello { source, requests } => {
            routes.sources.insert(source, RequestRoute::Tcp(requests));
            return;
        }
        Incoming::DfmUp { out } => {
            // The manager (new, or restarted) learns what this builder holds.
            let (open, history) = match node.pull() {
                Some(p) => (p.assigned().collect(), p.history().collect()),
                None => (Vec::new(), Vec::new()),
            };
            let _ = out.send(PullMessage::BuilderHello { builder: node.config().id, open, history }.encode());
            routes.dfm = Some(out);
            return;
        }
        Incoming::Assign { slice } => {
            node.handle_assignment(clock.now(), slice);
            return;
        }
        Incoming::Batch { messages, _room } => {
            for m in messages {
                on_incoming(node, measured, routes, saving, held, m, live, clock);
            }
            return;
        }
    };
    on_frame(node, measured, saving, frame, arrival, false, live);
}

/// What the datagram endpoint hands over: whole frames, damage, ends of stream.
#[allow(clippy::too_many_arguments)]
fn on_received(
    node: &mut BuilderNode<FragmentData>,
    measured: &mut Measured,
    routes: &mut Routes,
    saving: &mut Option<Saving>,
    udp_requests: &mpsc::UnboundedSender<(SourceId, SliceNumber)>,
    r: Received,
    live: &Live,
    clock: WallClock,
) {
    match r {
        Received::Frame { frame, recovered } => on_frame(node, measured, saving, frame, clock.now(), recovered, live),
        Received::Damaged { source, n } => node.handle_damaged(source, n),
        Received::Ended { source } => node.handle_end_of_stream(clock.now(), source),
        Received::Greeted { source } => {
            routes.sources.insert(source, RequestRoute::Udp(udp_requests.clone()));
        }
    }
}

fn on_frame(
    node: &mut BuilderNode<FragmentData>,
    measured: &mut Measured,
    saving: &mut Option<Saving>,
    frame: Frame,
    arrival: Instant,
    recovered: bool,
    live: &Live,
) {
    let h = frame.header;
    let data = FragmentData { source: h.source, flags: h.flags.bits(), hit_count: h.hit_count, payload: frame.payload };
    if h.flags.contains(Flags::END_OF_STREAM) {
        node.handle_end_of_stream(arrival, h.source);
        return;
    }
    let a = Arrival { recovered, ..Arrival::from_header(&h) };
    let (o, late) = node.handle_fragment_keep(arrival, a, data);
    // A late fragment goes to the late-data side stream if it has room.
    if let (Some(data), Some(s)) = (late, saving.as_mut())
        && s.saver.handle_late(a.source, a.slice, a.wire_bytes, data)
    {
        node.handle_salvaged();
        s.drain();
    }
    if let Some(d) = o.network_delay {
        let us = (d.as_micros() as u64).max(1);
        let _ = measured.net.record(us);
        measured.record_by_second(arrival, us);
        let clock = measured.slice_clock;
        if a.slice >= *measured.steady_from.get_or_insert_with(|| shoal_core::node::steady_from(a.slice, clock)) {
            let _ = measured.steady.record(us);
        }
        live.record_delay(us);
    }
    if let Some(d) = o.shaping_delay {
        let _ = measured.shaping.record((d.as_micros() as u64).max(1));
    }
    if o.admission == Admission::Accepted {
        measured.hits += u64::from(h.hit_count);
        Live::add(&live.fragments_received, 1);
        Live::add(&live.bytes_received, h.payload_len as u64 + frame::HEADER_LEN as u64);
    } else {
        Live::add(&live.fragments_discarded_at_builder, 1);
        if o.admission == Admission::DroppedOverload {
            Live::add(&live.fragments_refused_by_budget, 1);
        }
    }
}

/// Picks the slices the raw tap publishes: every `every`-th this builder processes.
struct RawSampler {
    every: u64,
    seen: u64,
    slice_clock: SliceClock,
}

impl RawSampler {
    /// The slice's fragments as data frames, concatenated, if this one is sampled.
    fn sample(&mut self, o: &SliceOutcome<FragmentData>) -> Option<Bytes> {
        if self.every == 0 {
            return None;
        }
        self.seen += 1;
        if !(self.seen - 1).is_multiple_of(self.every) {
            return None;
        }
        let mut buf = bytes::BytesMut::new();
        for f in o.fragments.iter().filter(|f| !f.cut_off) {
            // The fragment's own data flags (opaque data, a burst, truncated), so that a
            // tap client reads each payload as what it is.
            let kept = Flags::OPAQUE.union(Flags::BURST).union(Flags::TRUNCATED).bits();
            let header = FrameHeader {
                flags: Flags::from_bits(f.data.flags & kept).unwrap_or(Flags::EMPTY),
                source: f.source,
                hit_count: f.data.hit_count,
                slice: o.slice,
                slice_start: self.slice_clock.start_of(o.slice),
                send_time: Instant::ZERO,
                payload_len: f.data.payload.len() as u32,
            };
            frame::encode_into(&header, &f.data.payload, &mut buf);
        }
        Some(buf.freeze())
    }
}

/// Hands processed slices to the filter thread, keeping them in the burst saver's history
/// and offering the sampled ones to the raw tap.
fn forward(
    node: &mut BuilderNode<FragmentData>,
    saving: &mut Option<Saving>,
    sampler: &mut RawSampler,
    out: &mut FilterQueue<SliceOutcome<FragmentData>>,
    live: &Live,
    clock: WallClock,
    not_filtered: &mut Unfiltered,
) {
    if let Some(s) = saving.as_mut() {
        s.drain();
    }
    while let Some(o) = node.poll_slice() {
        if let Some(s) = saving.as_mut() {
            // The payloads are shared, not copied: the frame decoder hands out frames that
            // own their buffer (copied out of a shared one when small, read into one of
            // about their size when large: shoal_core::frame::StreamDecoder::prepare_read),
            // so the history keeps alive about what it counts (an eighth more once a
            // connection's frame size is known; up to four times a frame's size before).
            // Copying them here cost 8-17 % of the CPU of a full-shape run.
            s.saver.handle_slice(clock.now(), &o);
            s.drain();
            // One builder per run-controlled process: the gauge is its saver's.
            s.live.saver_bytes.store(s.saver.memory_in_use(), std::sync::atomic::Ordering::Relaxed);
        }
        if live.tap.is_open()
            && let Some(raw) = sampler.sample(&o)
        {
            live.tap.offer(crate::tap::TAG_RAW, raw);
        }
        if o.is_complete() {
            Live::add(&live.slices_complete, 1);
        } else {
            Live::add(&live.slices_incomplete, 1);
        }
        if let Err(o) = out.offer(o) {
            not_filtered.add(o.slice);
            Live::add(&live.slices_not_filtered, 1);
            node.handle_released(o.bytes);
        }
    }
    // One hand-off for every slice of this round.
    if let Err(batch) = out.flush() {
        // The filter thread is gone (it only ends after we drop the sender).
        for o in batch {
            node.handle_released(o.bytes);
        }
    }
}

/// Slices assembled but never filtered: counted, and listed up to a bound (the diagnosis
/// names a cause for each).
#[derive(Debug, Default)]
struct Unfiltered {
    count: u64,
    slices: Vec<u64>,
}

impl Unfiltered {
    fn add(&mut self, slice: u64) {
        self.count += 1;
        if self.slices.len() < shoal_core::node::MAX_LISTED_SLICES {
            self.slices.push(slice);
        }
    }
}

/// Builds the builder's filter stage: a Python worker pool (started here, so that a
/// module that cannot import refuses the run with the reason), or a filter in this process.
fn filter_stage(f: &shoal_trigger::FilterConfig) -> Result<FilterStage, ConfigError> {
    use shoal_shm::workers::{WorkerConfig, WorkerPool, WorkerProgram};
    let program = if !f.python.is_empty() {
        WorkerProgram::Python { exe: f.python_exe.clone(), target: f.python.clone(), path: f.python_path.clone() }
    } else if f.isolate {
        let exe = if f.worker_exe.is_empty() { own_shoal_exe()? } else { f.worker_exe.clone().into() };
        let args =
            vec!["filter-worker".into(), "--plugin".into(), f.plugin.clone(), "--config".into(), f.config.clone()];
        WorkerProgram::Exe { exe, args }
    } else {
        let filter = shoal_trigger::build(f).map_err(|e| ConfigError::Invalid(format!("builder.filter: {e}")))?;
        return Ok(FilterStage::InProcess(filter));
    };
    let cfg = WorkerConfig {
        program,
        workers: f.workers,
        config: f.config.clone(),
        timeout: StdDuration::from_millis(f.timeout_ms),
        start_timeout: StdDuration::from_secs(60),
        max_restarts: 100,
    };
    let pool = WorkerPool::start(cfg).map_err(|e| ConfigError::Invalid(format!("builder.filter: {e}")))?;
    Ok(FilterStage::Workers(Box::new(pool)))
}

/// This process's executable, when it is the `shoal` binary (whose `filter-worker` runs
/// isolated plug-ins); a builder inside another program must name it (`worker_exe`).
fn own_shoal_exe() -> Result<std::path::PathBuf, ConfigError> {
    let exe = std::env::current_exe().map_err(|e| ConfigError::Invalid(format!("builder.filter.isolate: {e}")))?;
    if exe.file_stem().is_some_and(|n| n == "shoal") {
        return Ok(exe);
    }
    Err(ConfigError::Invalid(format!(
        "builder.filter.isolate: this process ({}) is not the shoal binary: set builder.filter.worker_exe",
        exe.display()
    )))
}

/// What the filter thread is given and told.
struct FilterJob {
    id: u32,
    /// The slices to filter.
    queue: FilterQueueRx<SliceOutcome<FragmentData>>,
    /// The bytes of each slice done with, back to the assembler's memory budget.
    released: mpsc::UnboundedSender<u64>,
    /// To the writer: events, stored slices.
    link: Arc<Link>,
    live: Arc<Live>,
    stage: FilterStage,
    slice_clock: SliceClock,
    /// Offer every slice's events to the `SHL_EVT` tap.
    tap_events: bool,
    /// Fault injection (`builder.fault_filter_ms_per_slice`): least time per slice.
    least_per_slice: StdDuration,
    /// Set at the end of the drain: skip what is still queued (counted).
    abandon: Arc<std::sync::atomic::AtomicBool>,
    /// `builder.store_slices`: every fragment of every processed slice to the writer.
    store_slices: bool,
    /// KM3NeT mode: superframes in, the DataFilter's outputs out.
    km3: Option<crate::builder::km3out::Km3Out>,
    /// `builder.consumers`: every filtered slice into the shared-memory ring.
    publisher: Option<shoal_shm::SlicePublisher>,
}

/// Where a filtered slice goes: its EVENTS frame to the writer (and the tap), its
/// fragments to the writer when stored whole or when its filter failed, its slot in the
/// shared-memory ring, its bytes back to the assembler's budget (once for a batch of
/// slices: [`Emitter::give_back`]).
struct Emitter {
    id: u32,
    link: Arc<Link>,
    live: Arc<Live>,
    released: mpsc::UnboundedSender<u64>,
    /// Bytes of slices done with since the last [`Emitter::give_back`].
    releasing: u64,
    tap_events: bool,
    store_slices: bool,
    publisher: Option<shoal_shm::SlicePublisher>,
    events: u64,
}

impl Emitter {
    /// `keep_raw`: the filter failed on this slice; its fragments go to the writer's
    /// slices file so that nothing of it is lost.
    fn emit(
        &mut self,
        data: &SliceData,
        slice_start: Instant,
        selected: &[shoal_trigger::Event],
        keep_raw: bool,
        bytes: u64,
    ) {
        let (id, slice) = (self.id, data.slice);
        self.events += selected.len() as u64;
        Live::add(&self.live.events, selected.len() as u64);
        // One EVENTS frame per processed slice, empty or not, so the writer sees every slice.
        let header = FrameHeader {
            flags: Flags::EVENTS,
            source: id,
            hit_count: 0,
            slice,
            slice_start,
            send_time: Instant::ZERO,
            payload_len: 0,
        };
        let payload = encode_events(selected);
        if self.tap_events && self.live.tap.is_open() {
            self.live.tap.offer(crate::tap::TAG_EVENTS, frame::encode(&header, &payload));
        }
        self.link.send(Chunk::frame(id, slice, frame::encode_header(&header, &payload), payload));
        if let Some(p) = self.publisher.as_mut() {
            let frags: Vec<(u32, u16, u32, &[u8])> =
                data.fragments.iter().map(|f| (f.source, f.flags, f.hit_count, &f.payload[..])).collect();
            p.publish(slice, data.slice_start_ns, data.slice_ns, &frags);
        }
        if self.store_slices || keep_raw {
            for f in &data.fragments {
                let head = shoal_core::rawrec::RawHead {
                    builder: id,
                    record: 0,
                    kind: shoal_core::rawrec::RawKind::SliceData,
                    source: f.source,
                    slice,
                    slice_start,
                    hit_count: f.hit_count,
                };
                // Header and prefix copied, the payload handed on as it is.
                let (h, prefix) = head.encode_parts(&f.payload);
                let head_bytes = Bytes::from([&h[..], &prefix[..]].concat());
                self.link.send(Chunk {
                    source: id,
                    slice,
                    first: true,
                    last: true,
                    head: head_bytes,
                    body: f.payload.clone(),
                });
            }
        }
        self.releasing += bytes;
    }

    /// Gives the bytes of the slices done with back to the assembler's budget (one
    /// message, so one wake of the assembler, for a whole batch).
    fn give_back(&mut self) {
        if self.releasing > 0 {
            let _ = self.released.send(std::mem::take(&mut self.releasing));
        }
    }
}

/// What filters a slice: a filter in this thread, or Python worker processes.
enum FilterStage {
    InProcess(Box<dyn shoal_trigger::Filter>),
    Workers(Box<shoal_shm::workers::WorkerPool<(SliceData, u64)>>),
}

/// Counts of the Python workers' bad outcomes, and what they cost.
#[derive(Default)]
struct WorkerTally {
    failed: u64,
    timeout: u64,
}

fn worker_outcome(
    em: &mut Emitter,
    slice_clock: &SliceClock,
    tally: &mut WorkerTally,
    ((data, bytes), outcome): ((SliceData, u64), shoal_shm::workers::Outcome),
) {
    use shoal_shm::workers::Outcome;
    let start = slice_clock.start_of(data.slice);
    match outcome {
        Outcome::Events(ev) => em.emit(&data, start, &ev, false, bytes),
        Outcome::TimedOut => {
            tally.timeout += 1;
            em.emit(&data, start, &[], true, bytes);
        }
        Outcome::Failed | Outcome::Crashed | Outcome::NoWorker => {
            tally.failed += 1;
            em.emit(&data, start, &[], true, bytes);
        }
    }
}

fn filter_loop(job: FilterJob) -> FilterThreadReport {
    let FilterJob {
        id,
        queue: rx,
        released,
        link,
        live,
        mut stage,
        slice_clock,
        tap_events,
        least_per_slice,
        abandon,
        store_slices,
        mut km3,
        publisher,
    } = job;
    let mut em = Emitter { id, link, live, released, releasing: 0, tap_events, store_slices, publisher, events: 0 };
    let mut busy = StdDuration::ZERO;
    let mut abandoned = Vec::new();
    let mut tally = WorkerTally::default();
    while let Some(batch) = rx.next_batch() {
        // The filter's busy time is taken per batch: three clock reads a slice were 2 % of
        // a saturated 4-kB run.
        let batch_started = std::time::Instant::now();
        for o in batch {
            rx.started();
            let (slice, bytes) = (o.slice, o.bytes);
            if abandon.load(std::sync::atomic::Ordering::Relaxed) {
                abandoned.push(slice);
                Live::add(&em.live.slices_not_filtered, 1);
                em.releasing += bytes;
                continue;
            }
            let slice_start = slice_clock.start_of(slice);
            let data = SliceData {
                slice,
                slice_start_ns: slice_start.as_nanos(),
                slice_ns: slice_clock.length().as_nanos() as u64,
                fragments: o.into_filter_input(),
            };
            let t = (!least_per_slice.is_zero()).then(std::time::Instant::now);
            let filter = match &mut stage {
                FilterStage::InProcess(f) => f,
                FilterStage::Workers(pool) => {
                    let frags: Vec<(u32, u16, u32, &[u8])> =
                        data.fragments.iter().map(|f| (f.source, f.flags, f.hit_count, &f.payload[..])).collect();
                    let (start_ns, slice_ns) = (data.slice_start_ns, data.slice_ns);
                    let done = pool.submit(slice, start_ns, slice_ns, &frags, (data.clone(), bytes));
                    for d in done {
                        worker_outcome(&mut em, &slice_clock, &mut tally, d);
                    }
                    continue;
                }
            };
            // KM3NeT: the filter sees the superframes' hits; stored slices keep the frames.
            let (selected, km3_slice) = match km3.as_mut() {
                Some(k) => {
                    let (hits, frames) = k.decode(&data.fragments);
                    let view = SliceData {
                        slice,
                        slice_start_ns: data.slice_start_ns,
                        slice_ns: data.slice_ns,
                        fragments: hits,
                    };
                    (filter.process(&view), Some(frames))
                }
                None => (filter.process(&data), None),
            };
            if let (Some(k), Some(frames)) = (km3.as_mut(), km3_slice) {
                k.publish(slice, frames, &selected, &em.live);
            }
            if let Some(rest) = t.and_then(|t| least_per_slice.checked_sub(t.elapsed())) {
                // Fault injection: a filter slower than the load.
                std::thread::sleep(rest);
            }
            em.emit(&data, slice_start, &selected, false, bytes);
        }
        em.give_back();
        let spent = batch_started.elapsed();
        busy += spent;
        Live::add(&em.live.filter_busy_ns, spent.as_nanos() as u64);
    }
    let (failed_slices, malformed_events, workers) = match stage {
        FilterStage::InProcess(mut filter) => {
            filter.cleanup();
            (filter.failed_slices(), filter.malformed_events(), None)
        }
        FilterStage::Workers(pool) => {
            let t = std::time::Instant::now();
            let (done, report) = pool.finish();
            for d in done {
                worker_outcome(&mut em, &slice_clock, &mut tally, d);
            }
            busy += t.elapsed();
            em.give_back();
            (tally.failed, report.malformed_events, Some(report))
        }
    };
    FilterThreadReport {
        events: em.events,
        busy_s: busy.as_secs_f64(),
        abandoned,
        km3net: km3.map(crate::builder::km3out::Km3Out::finish),
        failed_slices,
        timeout_slices: tally.timeout,
        malformed_events,
        consumers: em.publisher.map(shoal_shm::SlicePublisher::finish),
        workers,
    }
}

/// What the filter thread did.
struct FilterThreadReport {
    events: u64,
    busy_s: f64,
    /// Slices left in the queue at the end of the drain.
    abandoned: Vec<u64>,
    km3net: Option<crate::builder::km3out::Km3OutReport>,
    failed_slices: u64,
    timeout_slices: u64,
    malformed_events: u64,
    consumers: Option<shoal_shm::PublisherReport>,
    workers: Option<shoal_shm::workers::WorkerReport>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    /// A data fragment of source 0 for `slice`, encoded.
    fn fragment(slice: u64) -> Bytes {
        let header = FrameHeader {
            flags: Flags::EMPTY,
            source: 0,
            hit_count: 0,
            slice,
            slice_start: Instant::ZERO,
            send_time: Instant::ZERO,
            payload_len: 0,
        };
        frame::encode(&header, &[])
    }

    /// A reader of one accepted connection, its peer's end, and where its messages go.
    async fn reader_and_peer(
        edge: Option<Arc<WindowEdge>>,
    ) -> (tokio::task::JoinHandle<()>, TcpStream, mpsc::Receiver<Incoming>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (stream, addr) = listener.accept().await.unwrap();
        let reader = FrameReader::new(stream, addr, 1 << 20, CancellationToken::new());
        let (tx, rx) = mpsc::channel(4096);
        let to = ToBuilder::new(tx, &Arc::new(tokio::sync::Semaphore::new(BATCHED_IN_FLIGHT)));
        let (requests, _) = mpsc::unbounded_channel();
        let task = tokio::spawn(serve_frames(reader, requests, WallClock::new(), ConnectionGate::new(edge), to));
        (task, peer, rx)
    }

    /// The next message's fragments' slices (a batch's in order), or the rejection's reason.
    async fn next_message(rx: &mut mpsc::Receiver<Incoming>) -> Option<Result<Vec<u64>, &'static str>> {
        // Guards against a hang only: a reader that kept what it read would never send.
        let m = tokio::time::timeout(StdDuration::from_secs(60), rx.recv()).await.expect("the reader sent nothing");
        let slice = |m: Incoming| match m {
            Incoming::Frame { frame, .. } => frame.header.slice,
            _ => panic!("a fragment expected"),
        };
        Some(match m? {
            Incoming::Batch { messages, .. } => Ok(messages.into_iter().map(slice).collect()),
            Incoming::Rejected { reason } => Err(reason),
            m => Ok(vec![slice(m)]),
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_fragments_before_a_bad_frame_go_in_in_order_then_the_connection_is_rejected() {
        let (task, mut peer, mut rx) = reader_and_peer(None).await;
        let mut bytes: Vec<u8> = (1..=200).flat_map(|s| fragment(s).to_vec()).collect();
        bytes.extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
        peer.write_all(&bytes).await.unwrap();
        let mut slices = Vec::new();
        let reason = loop {
            match next_message(&mut rx).await.expect("a rejection ends it") {
                Ok(s) => slices.extend(s),
                Err(reason) => break reason,
            }
        };
        assert_eq!(slices, (1..=200).collect::<Vec<_>>());
        assert_eq!(reason, "bad_magic");
        task.await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_hands_on_what_it_read_before_it_waits_for_room_in_the_window() {
        // The window is full up to slice 5: the fragment of 6 waits, but those before it
        // may be what moves the window, so they go in first.
        let edge = WindowEdge::new();
        edge.publish(Some(5));
        let (task, mut peer, mut rx) = reader_and_peer(Some(edge.clone())).await;
        let bytes: Vec<u8> = (1..=8).flat_map(|s| fragment(s).to_vec()).collect();
        peer.write_all(&bytes).await.unwrap();
        let mut slices = Vec::new();
        while slices.len() < 5 {
            slices.extend(next_message(&mut rx).await.expect("open").unwrap());
        }
        assert_eq!(slices, [1, 2, 3, 4, 5]);
        assert!(rx.try_recv().is_err(), "the fragment of slice 6 went in past the window");
        edge.publish(None);
        while slices.len() < 8 {
            slices.extend(next_message(&mut rx).await.expect("open").unwrap());
        }
        assert_eq!(slices, (1..=8).collect::<Vec<_>>());
        drop(peer);
        assert!(next_message(&mut rx).await.is_none(), "a clean end sends nothing more");
        task.await.unwrap();
    }
}
