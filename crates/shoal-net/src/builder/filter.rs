//! The builder's filter thread: the slices of its queue through the filter (in this
//! thread, or Python or isolated plug-in workers), their events to the writer and the
//! tap, their bytes back to the assembler's budget.

use std::sync::Arc;
use std::time::Duration as StdDuration;

use bytes::Bytes;
use shoal_core::Instant;
use shoal_core::assembly::SliceOutcome;
use shoal_core::frame::{self, Flags, FrameHeader};
use shoal_core::slice::SliceClock;
use shoal_trigger::{FragmentData, SliceData, encode_events};
use tokio::sync::mpsc;

use crate::builder::filter_queue::FilterQueueRx;
use crate::config::ConfigError;
use crate::live::Live;
use crate::transport::link::{Chunk, Link};

/// The shared-memory slice publisher of builder `id` in `run`, where `c` enables it.
pub(super) fn slice_publisher(
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
pub(super) struct FilterThread {
    handle: std::thread::JoinHandle<FilterThreadReport>,
    abandon: Arc<std::sync::atomic::AtomicBool>,
}

impl FilterThread {
    pub(super) fn start(job: FilterJob) -> Self {
        let abandon = job.abandon.clone();
        let handle = std::thread::Builder::new()
            .name(format!("filter-{}", job.id))
            .spawn(move || filter_loop(job))
            .expect("spawn filter thread");
        Self { handle, abandon }
    }

    /// Waits for the thread to finish its queue, for at most `drain`; what is left then is
    /// abandoned (the thread counts it), so that the builder answers STOP in time.
    pub(super) async fn join(self, drain: StdDuration) -> FilterThreadReport {
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

/// Builds the builder's filter stage: a Python worker pool (started here, so that a
/// module that cannot import refuses the run with the reason), or a filter in this process.
pub(super) fn filter_stage(f: &shoal_trigger::FilterConfig) -> Result<FilterStage, ConfigError> {
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
pub(super) struct FilterJob {
    pub(super) id: u32,
    /// The slices to filter.
    pub(super) queue: FilterQueueRx<SliceOutcome<FragmentData>>,
    /// The bytes of each slice done with, back to the assembler's memory budget.
    pub(super) released: mpsc::UnboundedSender<u64>,
    /// To the writer: events, stored slices.
    pub(super) link: Arc<Link>,
    pub(super) live: Arc<Live>,
    pub(super) stage: FilterStage,
    pub(super) slice_clock: SliceClock,
    /// Offer every slice's events to the `SHL_EVT` tap.
    pub(super) tap_events: bool,
    /// Fault injection (`builder.fault_filter_ms_per_slice`): least time per slice.
    pub(super) least_per_slice: StdDuration,
    /// Set at the end of the drain: skip what is still queued (counted).
    pub(super) abandon: Arc<std::sync::atomic::AtomicBool>,
    /// `builder.store_slices`: every fragment of every processed slice to the writer.
    pub(super) store_slices: bool,
    /// KM3NeT mode: superframes in, the DataFilter's outputs out.
    pub(super) km3: Option<crate::builder::km3out::Km3Out>,
    /// `builder.consumers`: every filtered slice into the shared-memory ring.
    pub(super) publisher: Option<shoal_shm::SlicePublisher>,
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
pub(super) enum FilterStage {
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
pub(super) struct FilterThreadReport {
    pub(super) events: u64,
    pub(super) busy_s: f64,
    /// Slices left in the queue at the end of the drain.
    pub(super) abandoned: Vec<u64>,
    pub(super) km3net: Option<crate::builder::km3out::Km3OutReport>,
    pub(super) failed_slices: u64,
    pub(super) timeout_slices: u64,
    pub(super) malformed_events: u64,
    pub(super) consumers: Option<shoal_shm::PublisherReport>,
    pub(super) workers: Option<shoal_shm::workers::WorkerReport>,
}
