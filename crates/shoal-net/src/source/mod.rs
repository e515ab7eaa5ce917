//! The source process's driver: a [`SourceNode`] (every decision) on one [`Link`] per
//! builder (the bytes), or with `source.connection_per_source` one per hosted source and
//! builder, as boards that each hold their own connections.
//!
//! The loop sleeps until the node's next timeout or a link report, feeds the node the
//! time, run control's end slice and pause flag, and hands the node's transmits to the
//! links. A link never blocks the loop, so a dead or slow builder cannot stall the others;
//! what that costs (the queue limit, drops at the source, the stall limit) is the node's
//! decision.

pub mod ingest;
pub mod prefetch;
pub mod sdk;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration as StdDuration;

use shoal_core::node::{
    GeneratedFragment, SourceEvent, SourceNode, SourceNodeReport, SourceTotals, SourceTransmit, Workload,
};
use shoal_core::shaping::PullRequest;
use shoal_core::slice::SliceNumber;
use shoal_core::{Duration, Instant, SourceId};
use shoal_detector::Generator;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::clock::WallClock;
use crate::config::{Config, ConfigError, Transport};
use crate::live::Live;
use crate::source::ingest::SharedIngest;
use crate::transport::link::{Backoff, Chunk, Link, LinkOptions, LinkReport};
use crate::transport::udp::UdpLink;
use prefetch::Prefetch;
use shoal_core::datagram::SenderStats;

/// What a source process reports at the end (the node's report).
pub type SourceReport = SourceNodeReport;

/// Runs a source node until its run time is over (or `cancel`), then drains.
pub async fn run_source_node(
    cfg: Config,
    ids: Vec<SourceId>,
    clock: WallClock,
    live: Arc<Live>,
    cancel: CancellationToken,
) -> Result<SourceReport, ConfigError> {
    let mut cfg = cfg;
    cfg.source.ids = ids;
    let kind = cfg.input()?;
    if kind == crate::config::InputKind::Generator {
        return run_source(&cfg, clock, live, cancel, false).await;
    }
    // Real data from an input socket: fix the first slice now, so the ingest and the node
    // agree on it.
    let first = cfg
        .run
        .start_slice
        .unwrap_or_else(|| cfg.slice_clock().map(|c| c.first_on_a_second_after(clock.now())).unwrap_or_default());
    cfg.run.start_slice = Some(first);
    if let crate::config::InputKind::Unix(path) = &kind {
        crate::source::ingest::check_unix_path(path)?;
    }
    let ingest = crate::source::ingest::shared_ingest(&cfg, first)?;
    let input = crate::source::ingest::InputTask::start(&kind, &cfg, ingest.clone())?;
    let mut r = run_source_with(&cfg, clock, live, cancel, false, Some(ingest)).await;
    let clb = input.and_then(crate::source::ingest::InputTask::stop);
    if let Ok(report) = &mut r {
        report.clb = clb;
    }
    r
}

/// [`run_source_node`] for the sources of `cfg.source.ids`, optionally keeping the log of
/// every transmit (parity tests).
pub async fn run_source(
    cfg: &Config,
    clock: WallClock,
    live: Arc<Live>,
    cancel: CancellationToken,
    record_transmits: bool,
) -> Result<SourceReport, ConfigError> {
    run_source_with(cfg, clock, live, cancel, record_transmits, None).await
}

/// [`run_source`] whose fragments come from `ingest` (the source SDK, input sockets)
/// instead of the generator, when given. The ingest's first slice is the node's.
pub async fn run_source_with(
    cfg: &Config,
    clock: WallClock,
    live: Arc<Live>,
    cancel: CancellationToken,
    record_transmits: bool,
    ingest: Option<Arc<SharedIngest>>,
) -> Result<SourceReport, ConfigError> {
    let mut node_cfg = cfg.source_node()?;
    node_cfg.record_transmits = record_transmits;
    if let Some(i) = &ingest {
        node_cfg.first_slice = Some(i.first_slice());
        node_cfg.produce_delay = Duration::from_millis(cfg.source.input_latency_ms);
        node_cfg.data_driven = true;
    }
    // The finish of the ingest whatever way this function ends: submitters blocked on
    // back-pressure or flush are released, later submissions refused.
    let _finish = FinishIngest(ingest.clone());
    let generator = cfg.workload()?;
    let addrs = (0..cfg.run.builders).map(|b| cfg.builder_addr(b)).collect::<Result<Vec<_>, _>>()?;
    let backoff = Backoff {
        min: StdDuration::from_millis(cfg.source.reconnect_min_ms.max(1)),
        max: StdDuration::from_millis(cfg.source.reconnect_max_ms.max(cfg.source.reconnect_min_ms.max(1))),
    };
    let (report_tx, mut reports) = mpsc::unbounded_channel();
    let closing = CancellationToken::new();
    // Pull: each link greets its builder for every hosted source and reads its requests.
    let (request_tx, mut requests) = mpsc::unbounded_channel();
    // Every data link waits for its builder's close before it ends (`crate::transport::link`'s
    // `PeerEnd`): nothing is left for the kernel to deliver after this process is gone.
    let mut options =
        LinkOptions { paths: Some(live.paths.clone()), wait_for_peer_close: true, ..LinkOptions::default() };
    if node_cfg.policy.pull().is_some() {
        options.hello = node_cfg.sources.clone();
        options.requests = Some(request_tx);
    }
    let transport = cfg.transport()?;
    let spawn = |b: usize, options: LinkOptions| match transport {
        Transport::Tcp => DataLink::Tcp(Link::spawn_with(
            b as u32,
            addrs[b],
            clock,
            backoff,
            report_tx.clone(),
            closing.clone(),
            options,
        )),
        Transport::Udp => DataLink::Udp(UdpLink::spawn(
            b as u32,
            addrs[b],
            clock,
            cfg.udp_config(),
            cfg.run.run_number as u32,
            cfg.udp_socket_buffer(),
            report_tx.clone(),
            options,
        )),
    };
    let links = if cfg.source.connection_per_source {
        let per_source = node_cfg
            .sources
            .iter()
            .map(|&s| {
                // Each connection greets its builder for its own source only.
                let options = LinkOptions { hello: vec![s], ..options.clone() };
                (s, (0..addrs.len()).map(|b| spawn(b, options.clone())).collect())
            })
            .collect();
        Links::PerSource(per_source)
    } else {
        Links::Shared((0..addrs.len()).map(|b| spawn(b, options.clone())).collect())
    };
    drop(report_tx);
    drop(options);

    let sources = node_cfg.sources.clone();
    let mut node = SourceNode::new(node_cfg, clock.now());
    // Slices computed ahead, off the runtime's workers (crate::source::prefetch); or, with
    // `source.generate_ahead_ms = 0`, in this task at each slice end.
    let limit = cfg.source.prefetch_limit_bytes.unwrap_or(prefetch::MAX_BYTES);
    let workload = match (&ingest, prefetch::ahead_slices(cfg)?) {
        (Some(i), _) => SourceWorkload::Ingest(i.clone()),
        (None, ahead) if ahead > 0 && limit > 0 => SourceWorkload::Ahead(
            Prefetch::new(generator, sources, node.next_slice(), ahead, limit)
                .map_err(|e| ConfigError::Invalid(format!("starting the generator thread: {e}")))?,
        ),
        _ => SourceWorkload::AtSliceEnd(generator),
    };
    let mut seen = SourceTotals::default();
    info!(sources = ?node.config().sources, first_slice = node.first_slice(), slices = ?node.config().slices,
        policy = %node.config().policy, "source node started");

    // Shaping waits are often under a millisecond: tokio's timer would round them up.
    let timer = crate::transport::timer::FineTimer::new()
        .map_err(|e| ConfigError::Invalid(format!("creating the source's timer (timerfd): {e}")))?;
    while !node.is_closed() {
        let now = clock.now();
        let end = live.end_slice.load(Ordering::Relaxed);
        if end != 0 {
            node.handle_end_slice(now, end);
        }
        node.handle_pause(live.is_paused());
        if let Some(i) = &ingest {
            let input = i.poll_loop();
            for (source, slice, frag) in input.late {
                node.handle_late_fragment(now, source, slice, frag);
            }
            node.handle_input_ready(input.ready_below);
            if let Some(end) = input.end_after {
                node.handle_end_slice(now, end);
            }
        }
        node.handle_timeout(now, &workload);
        pump(&mut node, &links, now, &live, &mut seen);
        if let Some(i) = &ingest {
            i.publish_progress(node.queued(), node.next_slice(), node.waiting_for_input());
        }
        if node.is_closed() {
            break;
        }
        let wake = node.poll_timeout().unwrap_or(Instant::MAX).min(now + Duration::from_secs(1));
        tokio::select! {
            _ = timer.sleep_until(clock.deadline(wake).into_std()) => {}
            r = reports.recv() => if let Some(r) = r {
                let now = clock.now();
                handle_report(&mut node, r, now);
                while let Ok(r) = reports.try_recv() {
                    handle_report(&mut node, r, now);
                }
            },
            Some((builder, r)) = requests.recv() => {
                let now = clock.now();
                node.handle_request(now, r.source, PullRequest { builder, slice: r.slice });
                while let Ok((builder, r)) = requests.try_recv() {
                    node.handle_request(now, r.source, PullRequest { builder, slice: r.slice });
                }
            },
            _ = ingest_woken(&ingest) => {}
            _ = cancel.cancelled(), if node.is_producing() => {
                node.handle_stop(clock.now());
                if let Some(i) = &ingest {
                    i.close();
                }
            }
        }
    }
    // The end-of-stream markers are queued behind the data on every link: close the links
    // and keep collecting reports until every link task has finished (bounded: a link to an
    // unreachable peer gives up once `closing` is set).
    closing.cancel();
    let tasks: Vec<_> = links.into_all().map(DataLink::close).collect();
    let collect = async {
        while let Some(r) = reports.recv().await {
            handle_report(&mut node, r, clock.now());
        }
    };
    if tokio::time::timeout(StdDuration::from_millis(cfg.source.drain_timeout_ms.max(1000)), collect).await.is_err() {
        warn!(
            "links did not finish in time (a builder neither took everything nor closed): their queued \
             fragments count as unsent, and what the kernel still held for them may not arrive"
        );
        for t in &tasks {
            t.abort();
        }
    }
    sync_live(&node, &live, &mut seen);
    if let SourceWorkload::Ahead(p) = &workload
        && let generated = p.stats()
        && generated.generated_inline > 0
    {
        // Once per node, so debug: the run's late slice ends already say it was starved.
        tracing::debug!(
            inline = generated.generated_inline,
            ahead = generated.generated_ahead,
            "the generator thread fell behind: the node computed {} fragments itself (CPU starved)",
            generated.generated_inline
        );
    }
    let mut report = node.report();
    if let Some(i) = &ingest {
        i.finish();
        report.ingest = Some(i.report());
    }
    // Every report has come, so every link task has ended (or was aborted above).
    for t in tasks {
        if let LinkTask::Udp(t) = t
            && let Ok(stats) = t.await
        {
            report.datagrams.get_or_insert_with(SenderStats::default).merge(&stats);
        }
    }
    Ok(report)
}

/// Where a source node's fragments are computed.
enum SourceWorkload {
    Ahead(Prefetch<Generator>),
    AtSliceEnd(Generator),
    /// Submitted by user code (SDK, input sockets).
    Ingest(Arc<SharedIngest>),
}

impl Workload for SourceWorkload {
    fn generate(&self, source: SourceId, slice: SliceNumber) -> GeneratedFragment {
        match self {
            SourceWorkload::Ahead(p) => p.generate(source, slice),
            SourceWorkload::AtSliceEnd(g) => g.generate(source, slice),
            SourceWorkload::Ingest(i) => i.generate(source, slice),
        }
    }
}

/// Resolves when the ingest has news for the loop (never without an ingest).
async fn ingest_woken(ingest: &Option<Arc<SharedIngest>>) {
    match ingest {
        Some(i) => i.wake.notified().await,
        None => std::future::pending().await,
    }
}

/// Finishes the ingest when dropped (see [`run_source_with`]).
struct FinishIngest(Option<Arc<SharedIngest>>);

impl Drop for FinishIngest {
    fn drop(&mut self) {
        if let Some(i) = &self.0 {
            i.finish();
        }
    }
}

/// The node's links: one per builder shared by its sources, or one per source and builder.
enum Links {
    Shared(Vec<DataLink>),
    PerSource(std::collections::HashMap<SourceId, Vec<DataLink>>),
}

impl Links {
    fn to(&self, source: SourceId, builder: usize) -> &DataLink {
        match self {
            Links::Shared(links) => &links[builder],
            // The node transmits only for the sources it hosts, each of which has links.
            Links::PerSource(links) => &links[&source][builder],
        }
    }

    fn into_all(self) -> impl Iterator<Item = DataLink> {
        let all: Vec<DataLink> = match self {
            Links::Shared(links) => links,
            Links::PerSource(links) => links.into_values().flatten().collect(),
        };
        all.into_iter()
    }
}

/// A source's link to one builder, on the run's transport.
enum DataLink {
    Tcp(Link),
    Udp(UdpLink),
}

impl DataLink {
    fn send(&self, chunk: Chunk) {
        match self {
            DataLink::Tcp(l) => l.send(chunk),
            DataLink::Udp(l) => l.send(chunk),
        }
    }

    fn close(self) -> LinkTask {
        match self {
            DataLink::Tcp(l) => LinkTask::Tcp(l.close()),
            DataLink::Udp(l) => LinkTask::Udp(l.close()),
        }
    }
}

/// A closing link's task; a datagram link's ends with its streams' totals.
enum LinkTask {
    Tcp(tokio::task::JoinHandle<()>),
    Udp(tokio::task::JoinHandle<SenderStats>),
}

impl LinkTask {
    fn abort(&self) {
        match self {
            LinkTask::Tcp(t) => t.abort(),
            LinkTask::Udp(t) => t.abort(),
        }
    }
}

fn pump(node: &mut SourceNode, links: &Links, now: Instant, live: &Live, seen: &mut SourceTotals) {
    while let Some(t) = node.poll_transmit(now) {
        links.to(t.source, t.dest as usize).send(chunk(t));
    }
    while let Some(e) = node.poll_event() {
        match e {
            SourceEvent::DrainTimeout { queued } => {
                warn!(queued, "drain timeout: fragments still queued count as unsent")
            }
            SourceEvent::UnknownFragment { source, slice } => {
                warn!(source, slice, "shaper released an unknown fragment")
            }
        }
    }
    sync_live(node, live, seen);
}

fn sync_live(node: &SourceNode, live: &Live, seen: &mut SourceTotals) {
    let t = node.totals();
    Live::add(&live.fragments_produced, t.produced - seen.produced);
    Live::add(&live.fragments_dropped_at_source, t.dropped - seen.dropped);
    Live::add(&live.fragments_cut_off, t.cut_off - seen.cut_off);
    Live::add(&live.send_completions, t.send_completions - seen.send_completions);
    Live::add(&live.send_completion_us, t.send_completion_us - seen.send_completion_us);
    *seen = t;
}

fn chunk(t: SourceTransmit) -> Chunk {
    Chunk { source: t.source, slice: t.slice, first: t.first(), last: t.last, head: t.head, body: t.body }
}

fn handle_report(node: &mut SourceNode, r: LinkReport, now: Instant) {
    match r {
        LinkReport::Sent { source, slice, .. } => node.handle_sent(now, source, slice),
        LinkReport::Failed { source, slice, .. } => node.handle_send_failed(now, source, slice),
    }
}
