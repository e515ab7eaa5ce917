//! The source node's driver: owns its links and its workload, runs the loop, and drains.
//! One function per concern: [`SourceDriver::start`] (the links and the workload),
//! [`SourceDriver::feed`] (time, run control and the ingest into the node, its transmits
//! out), [`SourceDriver::wait`] (the next timeout, a link report, a pull request, the
//! ingest, a stop), and [`SourceDriver::finish`] (the links closed and their reports
//! collected).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use shoal_core::datagram::SenderStats;
use shoal_core::node::{GeneratedFragment, SourceEvent, SourceNode, SourceTotals, SourceTransmit, Workload};
use shoal_core::shaping::PullRequest;
use shoal_core::slice::SliceNumber;
use shoal_core::{Duration, Instant, SourceId};
use shoal_detector::Generator;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::clock::WallClock;
use crate::config::ConfigError;
use crate::live::Live;
use crate::source::SourceReport;
use crate::source::ingest::SharedIngest;
use crate::source::links::{DataLink, LinkEnds, LinkTask, Links};
use crate::source::prefetch::Prefetch;
use crate::source::settings::SourceSettings;
use crate::transport::link::{Chunk, LinkReport, PullRequestFrame};
use crate::transport::timer::FineTimer;

/// One source node: the node machine, its links, where its fragments come from.
pub(super) struct SourceDriver {
    node: SourceNode,
    links: Links,
    workload: SourceWorkload,
    ingest: Option<Arc<SharedIngest>>,
    /// The finish of the ingest whatever way the driver ends: submitters blocked on
    /// back-pressure or flush are released, later submissions refused.
    _finish: FinishIngest,
    reports: mpsc::UnboundedReceiver<LinkReport>,
    requests: mpsc::UnboundedReceiver<(u32, PullRequestFrame)>,
    closing: CancellationToken,
    /// Shaping waits are often under a millisecond: tokio's timer would round them up.
    timer: FineTimer,
    clock: WallClock,
    live: Arc<Live>,
    seen: SourceTotals,
    drain_timeout: std::time::Duration,
}

impl SourceDriver {
    /// Spawns the links and the workload (`ingest`: user code submits the fragments).
    pub(super) fn start(
        s: SourceSettings,
        clock: WallClock,
        live: Arc<Live>,
        ingest: Option<Arc<SharedIngest>>,
    ) -> Result<Self, ConfigError> {
        let finish = FinishIngest(ingest.clone());
        let (report_tx, reports) = mpsc::unbounded_channel();
        let (request_tx, requests) = mpsc::unbounded_channel();
        let closing = CancellationToken::new();
        let requests_to = s.node.policy.pull().is_some().then_some(request_tx);
        let ucx = match s.transport {
            crate::config::Transport::Ucx => Some(
                crate::transport::ucx::sending_worker()
                    .map_err(|e| ConfigError::Invalid(format!("run.transport = \"ucx\": {e}")))?,
            ),
            _ => None,
        };
        let ends = LinkEnds { reports: report_tx, closing: closing.clone(), requests: requests_to, ucx };
        let links = Links::spawn(&s, clock, &live, ends);
        let SourceSettings { node: node_cfg, generator, ahead_slices, ahead_limit_bytes, drain_timeout, .. } = s;
        let sources = node_cfg.sources.clone();
        let node = SourceNode::new(node_cfg, clock.now());
        // Slices computed ahead, off the runtime's workers (crate::source::prefetch); or,
        // with `source.generate_ahead_ms = 0`, in this task at each slice end.
        let workload = match &ingest {
            Some(i) => SourceWorkload::Ingest(i.clone()),
            None if ahead_slices > 0 && ahead_limit_bytes > 0 => SourceWorkload::Ahead(
                Prefetch::new(generator, sources, node.next_slice(), ahead_slices, ahead_limit_bytes)
                    .map_err(|e| ConfigError::Invalid(format!("starting the generator thread: {e}")))?,
            ),
            None => SourceWorkload::AtSliceEnd(generator),
        };
        info!(sources = ?node.config().sources, first_slice = node.first_slice(), slices = ?node.config().slices,
            policy = %node.config().policy, "source node started");
        let timer = FineTimer::new()
            .map_err(|e| ConfigError::Invalid(format!("creating the source's timer (timerfd): {e}")))?;
        Ok(Self {
            node,
            links,
            workload,
            _finish: finish,
            ingest,
            reports,
            requests,
            closing,
            timer,
            clock,
            live,
            seen: SourceTotals::default(),
            drain_timeout,
        })
    }

    /// Runs the node until its run time is over (or `cancel`), then drains.
    pub(super) async fn run(mut self, cancel: &CancellationToken) -> SourceReport {
        while !self.node.is_closed() {
            let now = self.clock.now();
            self.feed(now);
            if self.node.is_closed() {
                break;
            }
            self.wait(now, cancel).await;
        }
        self.finish().await
    }

    /// Run control's end slice and pause flag and the ingest's news into the node, the
    /// time, then its transmits to the links.
    fn feed(&mut self, now: Instant) {
        let node = &mut self.node;
        let end = self.live.end_slice.load(Ordering::Relaxed);
        if end != 0 {
            node.handle_end_slice(now, end);
        }
        node.handle_pause(self.live.is_paused());
        if let Some(i) = &self.ingest {
            let input = i.poll_loop();
            for (source, slice, frag) in input.late {
                node.handle_late_fragment(now, source, slice, frag);
            }
            node.handle_input_ready(input.ready_below);
            if let Some(end) = input.end_after {
                node.handle_end_slice(now, end);
            }
        }
        node.handle_timeout(now, &self.workload);
        pump(node, &self.links, now, &self.live, &mut self.seen);
        if let Some(i) = &self.ingest {
            i.publish_progress(node.queued(), node.next_slice(), node.waiting_for_input());
        }
    }

    /// Sleeps until the node's next timeout, a link's report, a pull request, news from
    /// the ingest or a stop.
    async fn wait(&mut self, now: Instant, cancel: &CancellationToken) {
        let wake = self.node.poll_timeout().unwrap_or(Instant::MAX).min(now + Duration::from_secs(1));
        let clock = self.clock;
        tokio::select! {
            _ = self.timer.sleep_until(clock.deadline(wake).into_std()) => {}
            r = self.reports.recv() => if let Some(r) = r {
                let now = clock.now();
                handle_report(&mut self.node, r, now);
                while let Ok(r) = self.reports.try_recv() {
                    handle_report(&mut self.node, r, now);
                }
            },
            Some((builder, r)) = self.requests.recv() => {
                let now = clock.now();
                self.node.handle_request(now, r.source, PullRequest { builder, slice: r.slice });
                while let Ok((builder, r)) = self.requests.try_recv() {
                    self.node.handle_request(now, r.source, PullRequest { builder, slice: r.slice });
                }
            },
            _ = ingest_woken(&self.ingest) => {}
            _ = cancel.cancelled(), if self.node.is_producing() => {
                self.node.handle_stop(clock.now());
                if let Some(i) = &self.ingest {
                    i.close();
                }
            }
        }
    }

    /// The end-of-stream markers are queued behind the data on every link: closes the
    /// links and keeps collecting reports until every link task has finished (bounded: a
    /// link to an unreachable peer gives up once `closing` is set).
    async fn finish(mut self) -> SourceReport {
        self.closing.cancel();
        let tasks: Vec<_> = self.links.into_all().map(DataLink::close).collect();
        let (node, reports, clock) = (&mut self.node, &mut self.reports, self.clock);
        let collect = async {
            while let Some(r) = reports.recv().await {
                handle_report(node, r, clock.now());
            }
        };
        if tokio::time::timeout(self.drain_timeout, collect).await.is_err() {
            warn!(
                "links did not finish in time (a builder neither took everything nor closed): their queued \
                 fragments count as unsent, and what the kernel still held for them may not arrive"
            );
            for t in &tasks {
                t.abort();
            }
        }
        sync_live(&self.node, &self.live, &mut self.seen);
        if let SourceWorkload::Ahead(p) = &self.workload
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
        let mut report = self.node.report();
        if let Some(i) = &self.ingest {
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
        report
    }
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

/// Finishes the ingest when dropped (see [`SourceDriver`]).
struct FinishIngest(Option<Arc<SharedIngest>>);

impl Drop for FinishIngest {
    fn drop(&mut self) {
        if let Some(i) = &self.0 {
            i.finish();
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
