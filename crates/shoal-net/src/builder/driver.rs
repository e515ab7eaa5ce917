//! The builder's driver: owns the role's tasks and threads, runs its loop, and ends them
//! in order. One function per concern, in the manner of quinn's `ConnectionDriver`: a
//! `start_*` for each task (the datagram endpoint, the accept loop, the writer link, the
//! filter thread), an `on_*` for each event of the loop, [`BuilderDriver::end_round`] for
//! what follows every event (held fragments, the window's edge, forwarding, pull), and
//! [`BuilderDriver::finish`] for the drain.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration as StdDuration;

use shoal_core::assembly::SliceOutcome;
use shoal_core::frame::{self, Flags, FrameHeader};
use shoal_core::node::BuilderNode;
use shoal_core::pullmsg::PullMessage;
use shoal_core::saver::Alert;
use shoal_core::slice::SliceNumber;
use shoal_core::{Instant, SourceId};
use shoal_trigger::FragmentData;
use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{info, warn};

use crate::builder::accept::{BATCHED_IN_FLIGHT, Incoming, Reading, ToBuilder, accept_connections};
use crate::builder::assemble::{Assembly, Measured};
use crate::builder::filter::{FilterJob, FilterStage, FilterThread, FilterThreadReport, filter_stage, slice_publisher};
use crate::builder::forward::{Forwarding, RawSampler, Unfiltered};
use crate::builder::hold::{Held, WindowEdge};
use crate::builder::km3out::Km3Out;
use crate::builder::pull::{Routes, dfm_client};
use crate::builder::report::BuilderReport;
use crate::builder::saving::Saving;
use crate::builder::settings::BuilderSettings;
use crate::builder::spool::{SpoolReport, SpoolWork};
use crate::clock::WallClock;
use crate::config::{ConfigError, ReceivePath, Transport};
use crate::live::Live;
use crate::report::DelayStats;
use crate::transport::link::{Chunk, Link, LinkOptions, LinkReport};
use crate::transport::listen::{ConnectionLimit, DataPort};
use crate::transport::udp::{Received, UdpReceiveReport};
use crate::transport::uring::UringReceiver;

/// One builder: its state, the events its loop waits on and the tasks it owns.
pub(super) struct BuilderDriver {
    s: BuilderSettings,
    assembly: Assembly,
    forwarding: Forwarding,
    events: Events,
    tasks: Tasks,
    /// Free-running sources: how far their connections may run ahead.
    edge: Option<Arc<WindowEdge>>,
    alerts_missed: u64,
}

/// What the builder's loop waits on.
struct Events {
    /// Frames and control from the connection readers and the data-flow manager's client.
    incoming: mpsc::Receiver<Incoming>,
    /// The datagram endpoint's frames (closed for TCP).
    datagrams: mpsc::Receiver<Received>,
    /// Pull over datagrams: requests go to the receive task, which sends them.
    udp_requests: mpsc::UnboundedSender<(SourceId, SliceNumber)>,
    /// Bytes the filter thread is done with, back to the assembler's budget.
    released: mpsc::UnboundedReceiver<u64>,
    /// Bytes the spool has written.
    spooled: mpsc::UnboundedReceiver<u64>,
    /// Only a builder with a saver listens: an alert nobody can take is refused upstream.
    alerts: Option<broadcast::Receiver<Alert>>,
}

/// The tasks and threads the driver started. The readers' and the datagram task's
/// tokens are cancelled when the driver is dropped, also when it is aborted: a killed
/// process leaves no listener or connection open behind it.
struct Tasks {
    readers: CancellationToken,
    _end_readers: DropGuard,
    udp_cancel: CancellationToken,
    _end_udp: DropGuard,
    udp: Option<JoinHandle<UdpReceiveReport>>,
    accept: JoinHandle<u64>,
    writer: WriterLink,
    filter: FilterThread,
    spool: Option<std::thread::JoinHandle<SpoolReport>>,
}

/// The link to the writer and the count of its failed sends.
struct WriterLink {
    link: Arc<Link>,
    closing: CancellationToken,
    failed: JoinHandle<u64>,
}

impl BuilderDriver {
    /// Starts builder `s.id` on its bound data port: every task, then the loop is
    /// [`BuilderDriver::run`]'s.
    pub(super) fn start(
        s: BuilderSettings,
        port: DataPort,
        clock: WallClock,
        live: Arc<Live>,
    ) -> Result<Self, ConfigError> {
        let DataPort { tcp: listener, udp: bound_udp } = port;
        // Built (a plug-in loaded and initialised) here, so that a filter that cannot start
        // refuses the run with its reason; then moved to the filter thread.
        let stage = filter_stage(&s.filter.filter)?;
        // Free-running sources are held back by their connections, not pushed out incomplete.
        let edge = s.holds_connections.then(WindowEdge::new);
        if edge.is_some() {
            share_receive_memory(&s, &listener);
        }
        let (in_tx, incoming) = mpsc::channel::<Incoming>(4096);
        // Ends the datagram task with the driver, also when a later step of the start fails.
        let udp_cancel = CancellationToken::new();
        let _end_udp = udp_cancel.clone().drop_guard();
        let (udp, datagrams, udp_requests) = start_udp(&s, &listener, bound_udp, clock, &udp_cancel)?;
        let readers = CancellationToken::new();
        let _end_readers = readers.clone().drop_guard();
        let to_builder = ToBuilder::new(in_tx.clone(), &Arc::new(tokio::sync::Semaphore::new(BATCHED_IN_FLIGHT)));
        let accept = start_accept(&s, listener, to_builder, clock, edge.clone(), &readers)?;
        let writer = start_writer_link(&s, clock, &live);
        let (spooled_tx, spooled) = mpsc::unbounded_channel::<u64>();
        let alerts = s.saver.is_some().then(|| live.alerts.alerts.subscribe());
        let (saving, spool) = match s.saver.clone() {
            Some(saver) => {
                let (saving, thread) = Saving::start(saver, s.id, &writer.link, spooled_tx, &live);
                (Some(saving), Some(thread))
            }
            None => (None, None),
        };
        let (to_filter, released, filter) = start_filter(&s, stage, &writer.link, &live)?;
        let mut node: BuilderNode<FragmentData> = BuilderNode::new(s.node);
        if let Some((credits, addr)) = s.pull {
            node = node.with_pull(credits);
            tokio::spawn(dfm_client(addr, s.id, s.to_dfm.clone(), in_tx, readers.clone()));
        }
        info!(builder = s.id, n_sources = s.sources, pull = s.pull.is_some(), "builder started");
        Ok(Self {
            assembly: Assembly {
                node,
                measured: Measured::new(s.slice_clock, s.steady_from),
                routes: Routes::default(),
                saving,
                held: Held::default(),
                live,
                clock,
            },
            forwarding: Forwarding {
                sampler: RawSampler { every: s.raw_every, seen: 0, slice_clock: s.slice_clock },
                to_filter,
                not_filtered: Unfiltered::default(),
            },
            events: Events { incoming, datagrams, udp_requests, released, spooled, alerts },
            tasks: Tasks { readers, _end_readers, udp_cancel, _end_udp, udp, accept, writer, filter, spool },
            edge,
            alerts_missed: 0,
            s,
        })
    }

    /// Runs the loop until every source has ended its stream (or `cancel`), then
    /// processes what is left and closes.
    pub(super) async fn run(mut self, cancel: &CancellationToken) -> BuilderReport {
        self.drive(cancel).await;
        self.finish().await
    }

    async fn drive(&mut self, cancel: &CancellationToken) {
        // Often enough for the manager to tell a stopped builder within its silence
        // timeout (`dfm::silence_timeout`, four of these at least).
        let mut heartbeat = tokio::time::interval(StdDuration::from_millis(100));
        let pull = self.s.pull.is_some();
        let clock = self.assembly.clock;
        loop {
            let wake = self.next_wake().unwrap_or(Instant::MAX).min(clock.now() + shoal_core::Duration::from_secs(1));
            let Events { incoming, datagrams, released, spooled, alerts, .. } = &mut self.events;
            tokio::select! {
                m = incoming.recv() => match m {
                    Some(m) => self.on_incoming(m),
                    None => break,
                },
                a = async { alerts.as_mut().expect("checked").recv().await }, if alerts.is_some() => self.on_alert(a),
                Some(bytes) = spooled.recv() => {
                    if let Some(s) = self.assembly.saving.as_mut() {
                        s.saver.handle_spooled(bytes);
                    }
                }
                _ = heartbeat.tick(), if pull => self.send_heartbeat(),
                _ = tokio::time::sleep_until(clock.deadline(wake)) => self.on_timeout(),
                Some(bytes) = released.recv() => self.assembly.node.handle_released(bytes),
                Some(r) = datagrams.recv() => self.on_datagram(r),
                _ = cancel.cancelled() => {
                    let ended = self.assembly.node.sources_ended();
                    warn!(builder = self.s.id, ended, n_sources = self.s.sources, "stopping before every source ended its stream");
                    break;
                }
            }
            if self.end_round() {
                break;
            }
        }
    }

    /// The node's or the burst saver's next timer, whichever is first.
    fn next_wake(&self) -> Option<Instant> {
        let saver_wake = self.assembly.saving.as_ref().and_then(|s| s.saver.poll_timeout());
        match (self.assembly.node.poll_timeout(), saver_wake) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn on_incoming(&mut self, m: Incoming) {
        self.assembly.on_incoming(m);
        // Take what else is ready without another trip through select.
        while let Ok(m) = self.events.incoming.try_recv() {
            self.assembly.on_incoming(m);
        }
    }

    fn on_datagram(&mut self, r: Received) {
        self.assembly.on_received(r, &self.events.udp_requests);
        while let Ok(r) = self.events.datagrams.try_recv() {
            self.assembly.on_received(r, &self.events.udp_requests);
        }
    }

    fn on_alert(&mut self, a: Result<Alert, broadcast::error::RecvError>) {
        match a {
            Ok(alert) => {
                info!(builder = self.s.id, %alert, "alert: saving its window");
                if let Some(s) = self.assembly.saving.as_mut() {
                    s.saver.handle_alert(self.assembly.clock.now(), alert);
                }
            }
            Err(broadcast::error::RecvError::Lagged(n)) => {
                warn!(
                    builder = self.s.id,
                    missed = n,
                    "alerts came faster than this builder took them; some were missed"
                );
                self.alerts_missed += n;
            }
            Err(broadcast::error::RecvError::Closed) => {}
        }
    }

    /// Pull: the builder's memory in use to the manager, ten times a second.
    fn send_heartbeat(&mut self) {
        // A greeting still waiting for the sources goes once its wait is over.
        self.assembly.routes.greet_dfm(&self.assembly.node);
        if let Some(out) = &self.assembly.routes.dfm {
            let beat =
                PullMessage::Credit { builder: self.s.id, slice: None, memory: self.assembly.node.memory_in_use() };
            let _ = out.send(beat.encode());
        }
    }

    fn on_timeout(&mut self) {
        let now = self.assembly.clock.now();
        self.assembly.node.handle_timeout(now);
        if let Some(s) = self.assembly.saving.as_mut() {
            s.saver.handle_timeout(now);
        }
    }

    /// What follows every event: held fragments that now fit, the window's edge for the
    /// held connections, processed slices to the filter, pull's requests and credits.
    /// True once every source has ended its stream.
    fn end_round(&mut self) -> bool {
        self.assembly.release_held(false);
        if let Some(edge) = &self.edge {
            edge.publish(self.assembly.node.window_edge());
        }
        self.forwarding.forward(&mut self.assembly);
        let Assembly { node, routes, clock, .. } = &mut self.assembly;
        routes.send_pull(node, self.s.id);
        if !node.all_ended() {
            return false;
        }
        // Pull: the manager hears the clean end after the last credits, on the same
        // connection: what it assigned meanwhile (past the end of the run) is not handed
        // on to the others.
        if let Some(out) = &routes.dfm {
            let _ = out.send(frame::encode(&end_of_stream(self.s.id, clock.now()), &[]));
        }
        true
    }

    /// Ends the tasks, drains the node, waits for the filter and the spool, closes the
    /// writer link and reports.
    async fn finish(mut self) -> BuilderReport {
        let id = self.s.id;
        self.tasks.readers.cancel();
        self.tasks.udp_cancel.cancel();
        let udp = match self.tasks.udp.take() {
            Some(t) => t.await.ok(),
            None => None,
        };
        let connections = (&mut self.tasks.accept).await.unwrap_or(0);
        // A cancelled run: what was held back goes in before the drain (nothing is lost here).
        self.assembly.release_held(true);
        // The node drained itself at the last end of stream; this is for a cancelled run.
        self.assembly.node.handle_drain(self.assembly.clock.now());
        self.forwarding.forward(&mut self.assembly);
        let Self { s, mut assembly, forwarding, tasks, alerts_missed, .. } = self;
        let Forwarding { to_filter, mut not_filtered, .. } = forwarding;
        drop(to_filter);
        // Open alerts close with what they have; the spool ships the rest before the writer
        // hears this builder's end of stream.
        let saver_stats = assembly.saving.as_mut().map(|s| {
            s.saver.handle_end();
            s.drain();
            let _ = s.spool.send(SpoolWork::Finish);
            s.saver.stats()
        });
        let filter = tasks.filter.join(s.filter_drain).await;
        for slice in &filter.abandoned {
            not_filtered.add(*slice);
        }
        if not_filtered.count > 0 {
            warn!(
                builder = id,
                slices = not_filtered.count,
                "slices processed but not filtered: the filter is slower than the load"
            );
        }
        let spool = match tasks.spool {
            Some(t) => Some(
                tokio::task::spawn_blocking(move || t.join().expect("spool thread panicked"))
                    .await
                    .expect("join spool thread"),
            ),
            None => None,
        };
        let WriterLink { link, closing, failed } = tasks.writer;
        close_writer_link(link, id, assembly.clock, &closing).await;
        let event_frames_failed = failed.await.unwrap_or(0);
        let report = report(
            assembly,
            filter,
            not_filtered,
            Ended { connections, udp, saver_stats, spool, alerts_missed, event_frames_failed },
        );
        info!(
            builder = id,
            complete = report.node.slices_complete,
            incomplete = report.node.slices_incomplete,
            "builder finished"
        );
        report
    }
}

/// What the end of the run adds to the builder's report beside the assembly and the filter.
struct Ended {
    connections: u64,
    udp: Option<UdpReceiveReport>,
    saver_stats: Option<shoal_core::saver::SaverStats>,
    spool: Option<SpoolReport>,
    alerts_missed: u64,
    event_frames_failed: u64,
}

fn report(a: Assembly, f: FilterThreadReport, not_filtered: Unfiltered, e: Ended) -> BuilderReport {
    let Assembly { node, measured, routes, held, live, .. } = a;
    BuilderReport {
        node: node.report(),
        network_delay: DelayStats::from_histogram(&measured.net),
        shaping_delay: DelayStats::from_histogram(&measured.shaping),
        net_delay_us: measured.net,
        shaping_delay_us: measured.shaping,
        network_delay_max_by_second_us: measured.max_by_second,
        network_delay_steady: DelayStats::from_histogram(&measured.steady),
        net_delay_steady_us: measured.steady,
        connections: e.connections,
        read_holds: held.holds,
        held_fragments_most: held.most_frames,
        hits: measured.hits,
        events: f.events,
        filter_busy_s: f.busy_s,
        slices_not_filtered: not_filtered.count,
        not_filtered_slices: not_filtered.slices,
        filter_failed: f.failed_slices,
        filter_timeout: f.timeout_slices,
        filter_workers: f.workers,
        filter_malformed_events: f.malformed_events,
        event_frames_failed: e.event_frames_failed,
        requests_unroutable: routes.unroutable,
        udp: e.udp,
        saver: e.saver_stats,
        spool: e.spool,
        alerts_missed: e.alerts_missed,
        tap: live.tap.is_open().then(|| live.tap.stats()),
        km3net: f.km3net,
        consumers: f.consumers,
    }
}

/// Held connections keep their data in the kernel's TCP memory, which all of them share:
/// many of them get smaller buffers (`crate::transport::listen::KernelShare`).
fn share_receive_memory(s: &BuilderSettings, listener: &TcpListener) {
    let Some(size) = crate::transport::listen::held_receive_buffer(s.held_receive_buffer, s.sources.into()) else {
        return;
    };
    match crate::transport::listen::set_receive_buffer(listener, size) {
        Ok(()) => {
            info!(builder = s.id, n_sources = s.sources, receive_buffer = size, "data connections' receive buffer")
        }
        Err(e) => warn!(builder = s.id, error = %e, "setting the data port's receive buffer"),
    }
}

/// The datagram transport: the same address and port as TCP, a receive task of its own
/// that stops at `cancel`. For TCP, no task, and channels that stay empty.
type DatagramEnds =
    (Option<JoinHandle<UdpReceiveReport>>, mpsc::Receiver<Received>, mpsc::UnboundedSender<(SourceId, SliceNumber)>);

fn start_udp(
    s: &BuilderSettings,
    listener: &TcpListener,
    bound: Option<std::net::UdpSocket>,
    clock: WallClock,
    cancel: &CancellationToken,
) -> Result<DatagramEnds, ConfigError> {
    let (received, datagrams) = mpsc::channel::<Received>(4096);
    let (udp_requests, requests) = mpsc::unbounded_channel();
    if !matches!(s.transport, Transport::Udp) {
        return Ok((None, datagrams, udp_requests));
    }
    let addr: SocketAddr = listener.local_addr().map_err(|e| ConfigError::Invalid(format!("builder address: {e}")))?;
    // On the socket the caller bound with the listener ([`super::bind_port`]), else on
    // one bound here.
    let sock = match bound {
        Some(b) => UdpSocket::from_std(b),
        None => crate::transport::udp::socket(addr, s.udp_socket_buffer),
    }
    .map_err(|e| ConfigError::Invalid(format!("binding UDP {addr}: {e}")))?;
    let task = tokio::spawn(crate::transport::udp::receive(
        sock,
        s.udp,
        s.run_number as u32,
        s.id,
        s.sources,
        s.max_payload,
        clock,
        received,
        requests,
        s.datagram_mac.clone(),
        cancel.clone(),
    ));
    Ok((Some(task), datagrams, udp_requests))
}

/// The accept loop on the data port, each connection read by a task of its own or on
/// the io_uring thread, at most one connection per source.
fn start_accept(
    s: &BuilderSettings,
    listener: TcpListener,
    to: ToBuilder,
    clock: WallClock,
    edge: Option<Arc<WindowEdge>>,
    readers: &CancellationToken,
) -> Result<JoinHandle<u64>, ConfigError> {
    let uring = match s.receive {
        ReceivePath::Epoll => None,
        ReceivePath::IoUring => Some(
            UringReceiver::start().map_err(|e| ConfigError::Invalid(format!("builder.receive = \"io_uring\": {e}")))?,
        ),
    };
    let ucx = match s.transport {
        Transport::Ucx => Some(
            crate::transport::ucx::UcxReceiver::start(&format!("builder{}", s.id), ucx_region_bytes(s))
                .map_err(|e| ConfigError::Invalid(format!("run.transport = \"ucx\": {e}")))?,
        ),
        _ => None,
    };
    let limit = ConnectionLimit::for_port(s.sources as usize, s.data_port.identifies());
    let horizon = s.future_horizon.map(|h| (s.slice_clock, h));
    let reading = Reading { max_payload: s.max_payload, clock, edge, to, cancel: readers.clone(), horizon };
    Ok(tokio::spawn(accept_connections(listener, limit, uring, ucx, s.data_port.clone(), reading)))
}

/// The UCX receive region: the builder's memory budget and a quarter more, so that the
/// assembler's budget (which drops or marks a slice) is what limits a builder, and the
/// region's back-pressure (a rendezvous waits for room) only catches what the budget does
/// not count (a payload between worker and assembler, the allocator's gaps).
fn ucx_region_bytes(s: &BuilderSettings) -> usize {
    let budget = s.node.assembler.memory_budget.min(1 << 40) as usize;
    budget.saturating_add(budget / 4).max(64 << 20)
}

/// The link to the writer, with its failed sends counted.
fn start_writer_link(s: &BuilderSettings, clock: WallClock, live: &Live) -> WriterLink {
    let (reports, mut reports_rx) = mpsc::unbounded_channel();
    let closing = CancellationToken::new();
    let options =
        LinkOptions { paths: Some(live.paths.clone()), connector: s.to_writer.clone(), ..LinkOptions::default() };
    let link =
        Arc::new(Link::spawn_with(s.id, s.writer_addr, clock, s.writer_backoff, reports, closing.clone(), options));
    let failed = tokio::spawn(async move {
        let mut failed = 0u64;
        while let Some(r) = reports_rx.recv().await {
            if matches!(r, LinkReport::Failed { .. }) {
                failed += 1;
            }
        }
        failed
    });
    WriterLink { link, closing, failed }
}

/// The queue to the filter thread, the channel its released bytes come back on, and the
/// thread. The queue is bounded in bytes by the assembler's memory budget and in slices
/// here: a filter slower than the load must not build a backlog of small slices without
/// end.
type FilterEnds =
    (crate::builder::filter_queue::FilterQueue<SliceOutcome<FragmentData>>, mpsc::UnboundedReceiver<u64>, FilterThread);

fn start_filter(
    s: &BuilderSettings,
    stage: FilterStage,
    writer: &Arc<Link>,
    live: &Arc<Live>,
) -> Result<FilterEnds, ConfigError> {
    let f = &s.filter;
    let (to_filter, queue) = crate::builder::filter_queue::filter_queue::<SliceOutcome<FragmentData>>(f.queue_slices);
    let (released_tx, released) = mpsc::unbounded_channel::<u64>();
    let job = FilterJob {
        id: s.id,
        queue,
        released: released_tx,
        link: writer.clone(),
        live: live.clone(),
        stage,
        slice_clock: s.slice_clock,
        tap_events: f.tap_events,
        least_per_slice: f.least_per_slice,
        abandon: Arc::default(),
        store_slices: f.store_slices,
        km3: f.km3.clone().map(|k| Km3Out::new(k, s.id)),
        publisher: slice_publisher(&f.consumers, s.run_number, s.id)?,
    };
    Ok((to_filter, released, FilterThread::start(job)))
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
