//! The source node: generator -> frames -> cutoff -> shaper -> one link per builder.
//!
//! One node hosts one or more sources (boards). Each source has its own shaper (policy
//! state machine from shoal-core); all sources of a node share one [`Link`] per builder.
//! The node's loop wakes at every slice end, at shaper timeouts and on link reports; it
//! never waits on a link, so a dead or slow builder cannot stall the others: its queue
//! grows up to `queue_limit_mb`, then its fragments are dropped and counted.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration as StdDuration;

use bytes::Bytes;
use shoal_core::frame::{self, Flags, FrameHeader};
use shoal_core::ledger::SourceTally;
use shoal_core::shaping::{BurstCutoff, CutoffDecision, Outgoing, Shaper, ShaperContext, Transmit};
use shoal_core::slice::{SliceClock, SliceNumber};
use shoal_core::{BuilderId, Duration, Instant, SourceId};
use shoal_detector::{GeneratedFragment, Generator};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::clock::WallClock;
use crate::config::{Config, ConfigError};
use crate::link::{Backoff, Chunk, Link, LinkReport};
use crate::live::Live;

/// What a source node reports at the end.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SourceReport {
    pub tallies: BTreeMap<SourceId, SourceTally>,
    /// Slices produced per source.
    pub slices: u64,
    /// Payload bytes produced (all sources of the node).
    pub bytes_produced: u64,
    /// Slice ends the generator reached late by more than one slice (CPU overload).
    pub late_slice_ends: u64,
}

struct PendingFrame {
    header: [u8; frame::HEADER_LEN],
    payload: Bytes,
    dest: Option<BuilderId>,
    dropped: bool,
}

struct HostedSource {
    id: SourceId,
    shaper: Box<dyn Shaper>,
    cutoff: Option<BurstCutoff>,
    /// Frames produced and not yet reported sent/failed/dropped, by slice.
    frames: HashMap<SliceNumber, PendingFrame>,
    /// Generated but waiting for the cutoff's decision.
    undecided: HashMap<SliceNumber, GeneratedFragment>,
    /// The fragment holding back the schedule and when it stops doing so.
    stall: Option<(SliceNumber, Instant)>,
    tally: SourceTally,
}

/// Runs a source node until its run time is over (or `cancel`), then drains.
pub async fn run_source_node(
    cfg: Config,
    ids: Vec<SourceId>,
    clock: WallClock,
    live: Arc<Live>,
    cancel: CancellationToken,
) -> Result<SourceReport, ConfigError> {
    let policy = cfg.policy()?;
    let slice_clock: SliceClock = cfg.slice_clock()?;
    let generator = cfg.generator()?;
    let generator = FragmentSource::new(generator, &ids, cfg.source.replay_pool);
    let n_builders = cfg.run.builders;
    let addrs = (0..n_builders).map(|b| cfg.builder_addr(b)).collect::<Result<Vec<_>, _>>()?;
    let backoff = Backoff {
        min: StdDuration::from_millis(cfg.source.reconnect_min_ms.max(1)),
        max: StdDuration::from_millis(cfg.source.reconnect_max_ms.max(cfg.source.reconnect_min_ms.max(1))),
    };
    let (report_tx, mut reports) = mpsc::unbounded_channel();
    let closing = CancellationToken::new();
    let links: Vec<Link> = addrs
        .iter()
        .enumerate()
        .map(|(b, addr)| Link::spawn(b as u32, *addr, clock, backoff, report_tx.clone(), closing.clone()))
        .collect();
    drop(report_tx);

    let mut sources: Vec<HostedSource> = ids
        .iter()
        .map(|&id| HostedSource {
            id,
            shaper: policy.build(ShaperContext { source: id, n_builders }),
            cutoff: cfg.source.cutoff.then(|| BurstCutoff::new(cfg.source.cutoff_head, cfg.source.cutoff_tail)),
            frames: HashMap::new(),
            undecided: HashMap::new(),
            stall: None,
            tally: SourceTally::default(),
        })
        .collect();
    let index: HashMap<SourceId, usize> = sources.iter().enumerate().map(|(i, s)| (s.id, i)).collect();

    let queue_limit = cfg.source.queue_limit_mb << 20;
    let stall_limit = slice_clock.length() * cfg.source.stall_limit_slices.max(1);
    let first_slice = match cfg.run.start_slice {
        Some(s) => s,
        None => first_slice_on_a_second(&slice_clock, clock.now()),
    };
    let n_slices = if cfg.run.seconds > 0.0 {
        Some(((cfg.run.seconds * 1e9) as u64).div_ceil(slice_clock.length().as_nanos() as u64).max(1))
    } else {
        None
    };
    let mut next_slice = first_slice;
    let mut producing = true;
    let mut drain_deadline: Option<Instant> = None;
    let mut report = SourceReport::default();
    info!(sources = ?ids, first_slice, ?n_slices, %policy, "source node started");

    loop {
        let now = clock.now();
        // Produce every slice that has ended (several if we were descheduled).
        if live.ends_before(next_slice) {
            producing = false;
        }
        while producing && now >= slice_clock.end_of(next_slice) {
            if now >= slice_clock.end_of(next_slice + 1) {
                report.late_slice_ends += 1;
            }
            for s in sources.iter_mut() {
                produce(s, &generator, &slice_clock, next_slice, now, &mut report, &live);
            }
            report.slices += 1;
            next_slice += 1;
            if n_slices.is_some_and(|n| next_slice - first_slice >= n) || live.ends_before(next_slice) {
                producing = false;
            }
        }
        if !producing && drain_deadline.is_none() {
            drain_deadline = Some(now + Duration::from_millis(cfg.source.drain_timeout_ms));
            for s in sources.iter_mut() {
                if let Some(c) = s.cutoff.as_mut() {
                    c.handle_drain();
                }
                decide_with(s, &slice_clock, now);
            }
        }
        // After data taking, slots keep passing: delayed transmission keeps its schedule
        // instead of sending every held fragment at once (an incast of its own making).
        while !producing && now >= slice_clock.end_of(next_slice) {
            for s in sources.iter_mut() {
                s.shaper.handle_slot_end(now, next_slice);
            }
            next_slice += 1;
        }
        for s in sources.iter_mut() {
            if let Some((slice, until)) = s.stall
                && now >= until
            {
                // The fragment keeps going on its link; the schedule stops waiting for it.
                s.stall = None;
                s.shaper.handle_sent(now, slice);
            }
            while let Some(tx) = s.shaper.poll_transmit(now) {
                dispatch(s, tx, &links, queue_limit, now, stall_limit, &live);
            }
        }
        if !producing && sources.iter().all(|s| s.frames.is_empty()) {
            break;
        }
        if drain_deadline.is_some_and(|d| now >= d) {
            warn!("drain timeout: {} fragments still queued", sources.iter().map(|s| s.frames.len()).sum::<usize>());
            break;
        }

        let mut wake = slice_clock.end_of(next_slice);
        for s in &sources {
            wake = wake.min(s.shaper.poll_timeout().unwrap_or(Instant::MAX));
            wake = wake.min(s.stall.map_or(Instant::MAX, |x| x.1));
        }
        wake = wake.min(drain_deadline.unwrap_or(Instant::MAX));
        let sleep = tokio::time::sleep_until(clock.deadline(wake.min(now + Duration::from_secs(1))));
        tokio::select! {
            _ = sleep => {}
            r = reports.recv() => if let Some(r) = r {
                handle_report(&mut sources, &index, r, clock.now(), &live);
                while let Ok(r) = reports.try_recv() {
                    handle_report(&mut sources, &index, r, clock.now(), &live);
                }
            },
            _ = cancel.cancelled(), if producing => producing = false,
        }
    }

    // End of stream on every link, one marker per hosted source, then close.
    let now = clock.now();
    for link in &links {
        for s in &sources {
            let eos = FrameHeader {
                flags: Flags::END_OF_STREAM,
                source: s.id,
                hit_count: 0,
                slice: next_slice,
                slice_start: slice_clock.start_of(next_slice),
                send_time: now,
                payload_len: 0,
            };
            link.send(Chunk::frame(s.id, next_slice, frame::encode_header(&eos, &[]), Bytes::new()));
        }
    }
    closing.cancel();
    let tasks: Vec<_> = links.into_iter().map(Link::close).collect();
    // Keep collecting reports until every link task has finished (bounded: a link to an
    // unreachable peer gives up once `closing` is set).
    let collect = async {
        while let Some(r) = reports.recv().await {
            handle_report(&mut sources, &index, r, clock.now(), &live);
        }
    };
    if tokio::time::timeout(StdDuration::from_millis(cfg.source.drain_timeout_ms.max(1000)), collect).await.is_err() {
        warn!("links did not finish in time; their queued fragments count as unsent");
        for t in &tasks {
            t.abort();
        }
    }
    for s in sources {
        let mut tally = s.tally;
        tally.unsent += (s.frames.len() + s.undecided.len()) as u64;
        report.tallies.insert(s.id, tally);
    }
    Ok(report)
}

/// Where fragments come from: the live generator or a pre-generated pool.
enum FragmentSource {
    Live(Generator),
    Pool(HashMap<SourceId, Vec<GeneratedFragment>>),
}

impl FragmentSource {
    fn new(generator: Generator, ids: &[SourceId], pool: u32) -> Self {
        if pool == 0 {
            return FragmentSource::Live(generator);
        }
        let pools =
            ids.iter().map(|&id| (id, (0..u64::from(pool)).map(|s| generator.generate(id, s)).collect())).collect();
        FragmentSource::Pool(pools)
    }

    fn generate(&self, source: SourceId, slice: SliceNumber) -> GeneratedFragment {
        match self {
            FragmentSource::Live(g) => g.generate(source, slice),
            FragmentSource::Pool(p) => {
                let frags = &p[&source];
                frags[(slice % frags.len() as u64) as usize].clone()
            }
        }
    }
}

/// The first slice after `now` that starts on a whole second (or the next slice, for slices
/// that do not divide a second).
fn first_slice_on_a_second(clock: &SliceClock, now: Instant) -> SliceNumber {
    let len = clock.length().as_nanos() as u64;
    let next = clock.slice_at(now) + 1;
    if 1_000_000_000 % len != 0 {
        return next;
    }
    let per_second = 1_000_000_000 / len;
    next.div_ceil(per_second) * per_second
}

fn produce(
    s: &mut HostedSource,
    generator: &FragmentSource,
    clock: &SliceClock,
    slice: SliceNumber,
    now: Instant,
    report: &mut SourceReport,
    live: &Live,
) {
    // Paused: keep the slice schedule (builders still see every slice complete) but send
    // empty fragments.
    let frag = if live.is_paused() {
        GeneratedFragment { hit_count: 0, waveform_count: 0, payload: Bytes::new(), burst: false }
    } else {
        generator.generate(s.id, slice)
    };
    s.tally.produced += 1;
    report.bytes_produced += frag.payload.len() as u64;
    live.fragments_produced.fetch_add(1, Ordering::Relaxed);
    let burst = frag.burst;
    s.undecided.insert(slice, frag);
    match s.cutoff.as_mut() {
        Some(c) => c.handle_fragment(slice, burst),
        None => {
            let frag = s.undecided.remove(&slice).expect("just inserted");
            enqueue(s, clock, slice, frag, false, now);
            return;
        }
    }
    decide_with(s, clock, now);
}

fn decide_with(s: &mut HostedSource, clock: &SliceClock, now: Instant) {
    let Some(c) = s.cutoff.as_mut() else { return };
    let mut decisions = Vec::new();
    while let Some(d) = c.poll_decision() {
        decisions.push(d);
    }
    for d in decisions {
        let (slice, cut) = match d {
            CutoffDecision::Keep(slice) => (slice, false),
            CutoffDecision::Cut(slice) => (slice, true),
        };
        if let Some(frag) = s.undecided.remove(&slice) {
            enqueue(s, clock, slice, frag, cut, now);
        }
    }
}

fn enqueue(
    s: &mut HostedSource,
    clock: &SliceClock,
    slice: SliceNumber,
    frag: GeneratedFragment,
    cut: bool,
    now: Instant,
) {
    let mut flags = Flags::EMPTY;
    if frag.burst {
        flags = flags | Flags::BURST;
    }
    let (hit_count, payload) = if cut {
        flags = flags | Flags::CUT_OFF;
        (0, Bytes::new())
    } else {
        (frag.hit_count, frag.payload)
    };
    let header = FrameHeader {
        flags,
        source: s.id,
        hit_count,
        slice,
        slice_start: clock.start_of(slice),
        send_time: Instant::ZERO,
        payload_len: 0,
    };
    let header = frame::encode_header(&header, &payload);
    let len = (frame::HEADER_LEN + payload.len()) as u64;
    s.frames.insert(slice, PendingFrame { header, payload, dest: None, dropped: false });
    s.shaper.handle_fragment(now, Outgoing { slice, len });
}

fn dispatch(
    s: &mut HostedSource,
    tx: Transmit,
    links: &[Link],
    queue_limit: u64,
    now: Instant,
    stall_limit: Duration,
    live: &Live,
) {
    let Some(f) = s.frames.get_mut(&tx.slice) else {
        warn!(source = s.id, slice = tx.slice, "shaper released an unknown fragment");
        return;
    };
    let link = &links[tx.dest as usize];
    if tx.offset == 0 {
        f.dest = Some(tx.dest);
        if link.queued_bytes() + (frame::HEADER_LEN + f.payload.len()) as u64 > queue_limit {
            f.dropped = true;
        }
    }
    if f.dropped {
        if tx.last {
            s.frames.remove(&tx.slice);
            s.tally.dropped_at_source += 1;
            Live::add(&live.fragments_dropped_at_source, 1);
            s.shaper.handle_sent(now, tx.slice);
        }
        return;
    }
    // The transmit's byte range over header ++ payload, without copying the payload.
    let (start, end) = (tx.offset as usize, (tx.offset + tx.len) as usize);
    let h = frame::HEADER_LEN;
    let head = if start < h { Bytes::copy_from_slice(&f.header[start..end.min(h)]) } else { Bytes::new() };
    let body = if end > h { f.payload.slice(start.max(h) - h..end - h) } else { Bytes::new() };
    link.send(Chunk { source: s.id, slice: tx.slice, first: start == 0, last: tx.last, head, body });
    if tx.last {
        s.stall = Some((tx.slice, now + stall_limit));
    }
}

fn handle_report(
    sources: &mut [HostedSource],
    index: &HashMap<SourceId, usize>,
    r: LinkReport,
    now: Instant,
    live: &Live,
) {
    let (source, slice, link, sent) = match r {
        LinkReport::Sent { link, source, slice } => (source, slice, link, true),
        LinkReport::Failed { link, source, slice } => (source, slice, link, false),
    };
    let Some(&i) = index.get(&source) else { return };
    let s = &mut sources[i];
    // End-of-stream markers are not in `frames`: nothing to account.
    let Some(f) = s.frames.remove(&slice) else { return };
    debug_assert_eq!(f.dest, Some(link));
    if sent {
        *s.tally.sent.entry(link).or_default() += 1;
    } else {
        s.tally.send_failed += 1;
        Live::add(&live.fragments_dropped_at_source, 1);
    }
    if s.stall.is_some_and(|(sl, _)| sl == slice) {
        s.stall = None;
    }
    s.shaper.handle_sent(now, slice);
}
