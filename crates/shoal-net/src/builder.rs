//! The builder: accepts every source's connection, finds frames in each byte stream,
//! assembles slices (shoal-core's [`SliceAssembler`]), filters them on a thread of its own
//! and ships the selected events to the writer.
//!
//! Receiving never waits for filtering: completed slices go to the filter thread through a
//! queue bounded in *bytes* by the assembler's memory budget (the filter releases bytes as
//! it finishes slices; above the budget new fragments are dropped and counted). A
//! connection that sends garbage is closed with a logged reason and a counted rejection;
//! the other connections carry on.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration as StdDuration;

use hdrhistogram::Histogram;
use shoal_core::assembly::{EmitReason, SliceAssembler, SliceOutcome};
use shoal_core::frame::{self, Flags, Frame, FrameHeader};
use shoal_core::hit::HitPayload;
use shoal_core::ledger::BuilderTally;
use shoal_core::slice::SliceClock;
use shoal_core::{Instant, SourceId};
use shoal_trigger::{FilterConfig, FragmentData, SliceData, encode_events};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::clock::WallClock;
use crate::config::{Config, ConfigError};
use crate::framed::{FrameReader, ReadEnd};
use crate::link::{Backoff, Chunk, Link, LinkReport};
use crate::live::Live;

/// Delay histograms are kept in microseconds, up to one hour.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds")
}

/// What a builder reports at the end.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BuilderReport {
    pub id: u32,
    pub tally: BuilderTally,
    pub slices_complete: u64,
    pub slices_incomplete: u64,
    /// Incomplete slices by the reason they were processed.
    pub incomplete_reasons: BTreeMap<String, u64>,
    /// Fragments accepted into slices, and their bytes on the wire.
    pub fragments: u64,
    pub bytes: u64,
    /// Application send to complete arrival, microseconds.
    #[serde(skip)]
    pub net_delay_us: Histogram<u64>,
    /// Slice end to application send (the delay added on purpose by shaping), microseconds.
    #[serde(skip)]
    pub shaping_delay_us: Histogram<u64>,
    /// Closed connections by reason (bad magic, CRC errors, ...).
    pub rejected_connections: BTreeMap<String, u64>,
    pub connections: u64,
    pub events: u64,
    /// Time the filter spent processing, seconds.
    pub filter_busy_s: f64,
    /// Event frames the writer link could not deliver.
    pub event_frames_failed: u64,
    /// Arrival of the first and last accepted fragment (UNIX ns).
    pub first_arrival_ns: u64,
    pub last_arrival_ns: u64,
}

enum Incoming {
    Frame { frame: Frame, arrival: Instant },
    Rejected { reason: &'static str },
}

/// Reads one source connection: validated frames go to the assembler task.
async fn read_connection(
    stream: TcpStream,
    peer: SocketAddr,
    max_payload: u32,
    clock: WallClock,
    tx: mpsc::Sender<Incoming>,
    cancel: CancellationToken,
) {
    let mut reader = FrameReader::new(stream, peer, max_payload, cancel);
    let end = loop {
        let frame = match reader.next().await {
            Ok(f) => f,
            Err(end) => break end,
        };
        let h = &frame.header;
        if h.flags.contains(Flags::EVENTS) {
            break reader.reject("unexpected_events", "an EVENTS frame on a data port");
        }
        if let Err(e) = HitPayload::parse(&frame.payload, h.hit_count) {
            break reader.reject("bad_payload", &e.to_string());
        }
        if tx.send(Incoming::Frame { frame, arrival: clock.now() }).await.is_err() {
            break ReadEnd::Clean;
        }
    };
    if let ReadEnd::Rejected(reason) = end {
        let _ = tx.send(Incoming::Rejected { reason }).await;
    }
}

/// Runs a builder on an already bound listener until every source has ended its stream
/// (or `cancel`), then processes what is left and closes.
pub async fn run_builder(
    cfg: Config,
    id: u32,
    listener: TcpListener,
    clock: WallClock,
    live: Arc<Live>,
    cancel: CancellationToken,
) -> Result<BuilderReport, ConfigError> {
    let slice_clock = cfg.slice_clock()?;
    let writer_addr = cfg.writer_addr()?;
    let filter_cfg = cfg.builder.filter.clone();
    shoal_trigger::build(&filter_cfg).map_err(|e| ConfigError::Invalid(format!("builder.filter: {e}")))?;
    let n_sources = cfg.run.sources;
    let max_payload = cfg.max_payload();

    let (in_tx, mut in_rx) = mpsc::channel::<Incoming>(4096);
    let readers = CancellationToken::new();
    let accept_cancel = readers.clone();
    let accept_task = tokio::spawn(async move {
        let mut accepted = 0u64;
        loop {
            tokio::select! {
                r = listener.accept() => match r {
                    Ok((stream, peer)) => {
                        accepted += 1;
                        let _ = stream.set_nodelay(true);
                        tokio::spawn(read_connection(stream, peer, max_payload, clock, in_tx.clone(), accept_cancel.clone()));
                    }
                    Err(e) => {
                        // Typically EMFILE: back off instead of spinning.
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(StdDuration::from_millis(50)).await;
                    }
                },
                _ = accept_cancel.cancelled() => return accepted,
            }
        }
    });

    // Writer link and the filter thread.
    let (wreport_tx, mut wreports) = mpsc::unbounded_channel();
    let wclosing = CancellationToken::new();
    let backoff = Backoff {
        min: StdDuration::from_millis(cfg.source.reconnect_min_ms.max(1)),
        max: StdDuration::from_millis(cfg.source.reconnect_max_ms.max(1)),
    };
    let writer_link = Link::spawn(id, writer_addr, clock, backoff, wreport_tx, wclosing.clone());
    let failed_task = tokio::spawn(async move {
        let mut failed = 0u64;
        while let Some(r) = wreports.recv().await {
            if matches!(r, LinkReport::Failed { .. }) {
                failed += 1;
            }
        }
        failed
    });
    let (out_tx, out_rx) = std::sync::mpsc::channel::<SliceOutcome<FragmentData>>();
    let (released_tx, mut released_rx) = mpsc::unbounded_channel::<u64>();
    let filter_live = live.clone();
    let filter_thread = std::thread::Builder::new()
        .name(format!("filter-{id}"))
        .spawn(move || filter_loop(id, filter_cfg, slice_clock, out_rx, released_tx, writer_link, filter_live))
        .expect("spawn filter thread");

    let mut asm: SliceAssembler<FragmentData> = SliceAssembler::new(cfg.assembler());
    let mut report = BuilderReport {
        id,
        tally: BuilderTally::default(),
        slices_complete: 0,
        slices_incomplete: 0,
        incomplete_reasons: BTreeMap::new(),
        fragments: 0,
        bytes: 0,
        net_delay_us: new_histogram(),
        shaping_delay_us: new_histogram(),
        rejected_connections: BTreeMap::new(),
        connections: 0,
        events: 0,
        filter_busy_s: 0.0,
        event_frames_failed: 0,
        first_arrival_ns: 0,
        last_arrival_ns: 0,
    };
    let mut ended: BTreeSet<SourceId> = BTreeSet::new();
    info!(builder = id, n_sources, "builder started");

    loop {
        let wake = asm.poll_timeout();
        tokio::select! {
            m = in_rx.recv() => match m {
                Some(Incoming::Frame { frame, arrival }) => {
                    on_frame(&mut asm, &mut report, &mut ended, &slice_clock, frame, arrival, &live);
                    // Take what else is ready without another trip through select.
                    while let Ok(m) = in_rx.try_recv() {
                        match m {
                            Incoming::Frame { frame, arrival } => on_frame(&mut asm, &mut report, &mut ended, &slice_clock, frame, arrival, &live),
                            Incoming::Rejected { reason } => on_reject(&mut report, reason, &live),
                        }
                    }
                }
                Some(Incoming::Rejected { reason }) => on_reject(&mut report, reason, &live),
                None => break,
            },
            _ = tokio::time::sleep_until(clock.deadline(wake.unwrap_or(Instant::MAX).min(clock.now() + shoal_core::Duration::from_secs(1)))) => {
                asm.handle_timeout(clock.now());
            }
            Some(bytes) = released_rx.recv() => asm.handle_released(bytes),
            _ = cancel.cancelled() => {
                warn!(builder = id, ended = ended.len(), n_sources, "stopping before every source ended its stream");
                break;
            }
        }
        forward(&mut asm, &mut report, &out_tx, &live);
        if ended.len() as u32 >= n_sources {
            break;
        }
    }
    readers.cancel();
    report.connections = accept_task.await.unwrap_or(0);
    asm.handle_drain(clock.now());
    forward(&mut asm, &mut report, &out_tx, &live);
    report.tally = asm.tally();
    drop(out_tx);
    let (events, busy, link) =
        tokio::task::spawn_blocking(move || filter_thread.join().expect("filter thread panicked"))
            .await
            .expect("join filter thread");
    report.events = events;
    report.filter_busy_s = busy;
    // End of stream to the writer, then close the link.
    let eos = FrameHeader {
        flags: Flags::END_OF_STREAM,
        source: id,
        hit_count: 0,
        slice: 0,
        slice_start: Instant::ZERO,
        send_time: clock.now(),
        payload_len: 0,
    };
    link.send(Chunk::frame(id, u64::MAX, frame::encode_header(&eos, &[]), bytes::Bytes::new()));
    wclosing.cancel();
    let link_task = link.close();
    if tokio::time::timeout(StdDuration::from_secs(10), link_task).await.is_err() {
        warn!(builder = id, "writer link did not finish in time");
    }
    report.event_frames_failed = failed_task.await.unwrap_or(0);
    info!(builder = id, complete = report.slices_complete, incomplete = report.slices_incomplete, "builder finished");
    Ok(report)
}

fn on_reject(report: &mut BuilderReport, reason: &'static str, live: &Live) {
    *report.rejected_connections.entry(reason.to_string()).or_default() += 1;
    Live::add(&live.rejected_connections, 1);
}

fn on_frame(
    asm: &mut SliceAssembler<FragmentData>,
    report: &mut BuilderReport,
    ended: &mut BTreeSet<SourceId>,
    slice_clock: &SliceClock,
    frame: Frame,
    arrival: Instant,
    live: &Live,
) {
    let h = frame.header;
    if h.flags.contains(Flags::END_OF_STREAM) {
        ended.insert(h.source);
        return;
    }
    let bytes = frame.wire_len() as u64;
    if h.send_time > Instant::ZERO {
        let delay_us = (arrival - h.send_time).as_micros().max(1) as u64;
        let _ = report.net_delay_us.record(delay_us);
        live.record_delay(delay_us);
        let _ = report.shaping_delay_us.record((h.send_time - slice_clock.end_of(h.slice)).as_micros().max(1) as u64);
    }
    if report.first_arrival_ns == 0 {
        report.first_arrival_ns = arrival.as_nanos();
    }
    report.last_arrival_ns = arrival.as_nanos();
    let data = FragmentData { source: h.source, hit_count: h.hit_count, payload: frame.payload };
    let admission = asm.handle_fragment(arrival, h.source, h.slice, bytes, h.flags.contains(Flags::CUT_OFF), data);
    if admission != shoal_core::assembly::Admission::Accepted {
        Live::add(&live.fragments_discarded_at_builder, 1);
    }
    if admission == shoal_core::assembly::Admission::Accepted {
        report.fragments += 1;
        report.bytes += bytes;
        Live::add(&live.fragments_received, 1);
        Live::add(&live.bytes_received, bytes);
    }
}

fn forward(
    asm: &mut SliceAssembler<FragmentData>,
    report: &mut BuilderReport,
    out: &std::sync::mpsc::Sender<SliceOutcome<FragmentData>>,
    live: &Live,
) {
    while let Some(o) = asm.poll_outcome() {
        if o.is_complete() {
            report.slices_complete += 1;
            Live::add(&live.slices_complete, 1);
        } else {
            report.slices_incomplete += 1;
            Live::add(&live.slices_incomplete, 1);
            let reason = match o.reason {
                EmitReason::Complete => "dropped_overload",
                EmitReason::SliceCountTimeout => "slice_count_timeout",
                EmitReason::WallClockTimeout => "wall_clock_timeout",
                EmitReason::Drained => "end_of_run",
            };
            *report.incomplete_reasons.entry(reason.into()).or_default() += 1;
        }
        let bytes = o.bytes;
        if out.send(o).is_err() {
            // The filter thread is gone (it only ends after we drop the sender).
            asm.handle_released(bytes);
        }
    }
}

fn filter_loop(
    id: u32,
    cfg: FilterConfig,
    slice_clock: SliceClock,
    rx: std::sync::mpsc::Receiver<SliceOutcome<FragmentData>>,
    released: mpsc::UnboundedSender<u64>,
    link: Link,
    live: Arc<Live>,
) -> (u64, f64, Link) {
    let mut filter = shoal_trigger::build(&cfg).expect("validated before the thread started");
    let mut events = 0u64;
    let mut busy = StdDuration::ZERO;
    for o in rx {
        let slice_start = slice_clock.start_of(o.slice);
        let data = SliceData {
            slice: o.slice,
            slice_start_ns: slice_start.as_nanos(),
            slice_ns: slice_clock.length().as_nanos() as u64,
            fragments: o.fragments.into_iter().filter(|f| !f.cut_off).map(|f| f.data).collect(),
        };
        let t = std::time::Instant::now();
        let selected = filter.process(&data);
        busy += t.elapsed();
        events += selected.len() as u64;
        Live::add(&live.events, selected.len() as u64);
        // One EVENTS frame per processed slice, empty or not, so the writer sees every slice.
        let header = FrameHeader {
            flags: Flags::EVENTS,
            source: id,
            hit_count: 0,
            slice: o.slice,
            slice_start,
            send_time: Instant::ZERO,
            payload_len: 0,
        };
        let payload = encode_events(&selected);
        link.send(Chunk::frame(id, o.slice, frame::encode_header(&header, &payload), payload));
        let _ = released.send(o.bytes);
    }
    filter.cleanup();
    (events, busy.as_secs_f64(), link)
}
