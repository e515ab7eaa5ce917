//! Real data in: the shared ingest a source process's submitters and its node loop meet
//! at, and the input sockets (`source.input = "unix:PATH" | "udp:ADDR"`).
//!
//! [`SharedIngest`] wraps shoal-core's [`Ingest`] (every decision) in a mutex with two
//! wake-ups: a condition variable for submitters blocked by back-pressure (and `flush`),
//! and a tokio [`Notify`] for the source loop. Submitters are plain threads (the SDK's
//! callers, one thread per input connection), so back-pressure is simply blocking: a
//! readout program writing to a `unix:` socket waits on its `write` when shoal is full.
//!
//! The input threads read with a short timeout so that they see the run end; nothing in
//! them waits on a condition by sleeping.

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration as StdDuration, Instant as StdInstant};

use bytes::Bytes;
use shoal_core::SourceId;
use shoal_core::ingest::wire::{InputStreamDecoder, decode_datagram};
use shoal_core::ingest::{Ingest, IngestError, IngestReport, Placed, Submission, When};
use shoal_core::km3net::dataqueue::{DataQueue, DataQueueConfig, DataQueueReport};
use shoal_core::km3net::jdaq::{JdaqFrame, JdaqHeader, encode_superframe};
use shoal_core::node::{GeneratedFragment, Workload};
use shoal_core::slice::SliceNumber;
use tokio::sync::Notify;
use tracing::{info, warn};

use crate::config::{Backpressure, Config, ConfigError, InputKind};

/// How often input threads look whether the run has ended while their socket is quiet.
const INPUT_POLL: StdDuration = StdDuration::from_millis(100);

/// The ingest shared by a source process's submitters and its node loop.
#[derive(Debug)]
pub struct SharedIngest {
    state: Mutex<Ingest>,
    /// Submitters waiting for room (back-pressure) or for the data path to finish (flush).
    changed: Condvar,
    /// Wakes the source loop: new data, a close.
    pub(crate) wake: Notify,
    backpressure: Backpressure,
    /// Fragments produced and not yet reported by the transport (published by the loop).
    node_queued: AtomicUsize,
    /// The source loop has ended (its node is closed): submissions are refused.
    finished: AtomicBool,
    /// Slice the node produces next (published by the loop; for flush).
    next_slice: AtomicU64,
    /// Data-driven production is waiting until the ingest's `ready_below` reaches this
    /// (`u64::MAX`: it is not waiting for data). A submission wakes the loop only then, or
    /// for late data: one wake-up per submission cost the source loop a context switch
    /// per fragment.
    wake_at_ready: AtomicU64,
    /// Threads waiting on `changed` (back-pressure, flush): only then is it notified,
    /// because a notification is a system call even with nobody waiting.
    waiting: AtomicUsize,
}

impl SharedIngest {
    pub fn new(ingest: Ingest, backpressure: Backpressure) -> Arc<Self> {
        let first = ingest.config().first_slice;
        Arc::new(Self {
            state: Mutex::new(ingest),
            changed: Condvar::new(),
            wake: Notify::new(),
            backpressure,
            node_queued: AtomicUsize::new(0),
            finished: AtomicBool::new(false),
            next_slice: AtomicU64::new(first),
            wake_at_ready: AtomicU64::new(u64::MAX),
            waiting: AtomicUsize::new(0),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Ingest> {
        // A submitter that panicked while holding the lock left a consistent ingest (every
        // method finishes its update before it can panic): keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Submits, blocking under back-pressure as configured. Thread-safe.
    pub fn submit(&self, sub: Submission) -> Result<Placed, IngestError> {
        let mut st = self.lock();
        let deadline = match self.backpressure {
            Backpressure::Block(d) => Some(StdInstant::now() + d),
            Backpressure::Drop => None,
        };
        loop {
            if self.finished.load(Ordering::Acquire) && !st.is_closed() {
                st.handle_close();
            }
            match st.handle_submit(sub.clone()) {
                Err(IngestError::Full { held, max }) => {
                    let now = StdInstant::now();
                    match deadline {
                        Some(d) if now < d => {
                            st = self.wait_changed(st, d - now);
                        }
                        _ => {
                            st.handle_dropped_full();
                            return Err(IngestError::Full { held, max });
                        }
                    }
                }
                Ok(p) => {
                    let want = self.wake_at_ready.load(Ordering::Acquire);
                    let wake = matches!(p, Placed::Late(_)) || (want != u64::MAX && st.ready_below() >= want);
                    drop(st);
                    if wake {
                        self.wake.notify_one();
                    }
                    return Ok(p);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits until everything submitted so far has been produced and reported by the
    /// transport (sent or lost, accounted), at most `timeout`. Returns whether it has.
    pub fn flush(&self, timeout: StdDuration) -> bool {
        let deadline = StdInstant::now() + timeout;
        let mut st = self.lock();
        st.handle_flush();
        self.wake.notify_one();
        loop {
            if self.finished.load(Ordering::Acquire) || (st.is_empty() && self.node_queued.load(Ordering::Acquire) == 0)
            {
                return true;
            }
            let now = StdInstant::now();
            if now >= deadline {
                return false;
            }
            st = self.wait_changed(st, deadline - now);
        }
    }

    /// Waits on `changed` at most `timeout`, counted in `waiting` (under the lock, so a
    /// notifier holding the lock after us sees the count).
    fn wait_changed<'a>(&self, st: MutexGuard<'a, Ingest>, timeout: StdDuration) -> MutexGuard<'a, Ingest> {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let st = self.changed.wait_timeout(st, timeout).unwrap_or_else(|p| p.into_inner()).0;
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        st
    }

    /// Notifies `changed` if anybody waits on it; call with the lock held.
    fn notify_changed(&self) {
        if self.waiting.load(Ordering::Acquire) > 0 {
            self.changed.notify_all();
        }
    }

    /// Ends data taking after the last slice with data. Thread-safe, idempotent.
    pub fn close(&self) {
        self.lock().handle_close();
        self.wake.notify_one();
        self.changed.notify_all();
    }

    pub fn is_closed(&self) -> bool {
        self.lock().is_closed()
    }

    /// The run's first slice and its start (UNIX ns).
    pub fn first_slice(&self) -> SliceNumber {
        self.lock().config().first_slice
    }

    pub fn first_slice_start_ns(&self) -> u64 {
        let st = self.lock();
        st.config().slice_clock.start_of(st.config().first_slice).as_nanos()
    }

    /// Whether the source loop has ended.
    pub fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    pub fn count_rejected(&self, kind: &str) {
        self.lock().count_rejected(kind);
    }

    pub fn handle_lost_at_input(&self, n: u64) {
        self.lock().handle_lost_at_input(n);
    }

    pub fn handle_reordered_at_input(&self) {
        self.lock().handle_reordered_at_input();
    }

    pub fn report(&self) -> IngestReport {
        self.lock().report()
    }

    /// The loop's side: late fragments to send, how far data-driven production may go,
    /// and the end slice once closed.
    pub(crate) fn poll_loop(&self) -> LoopInput {
        let mut st = self.lock();
        let late = std::iter::from_fn(|| st.poll_late()).collect();
        LoopInput { late, ready_below: st.ready_below(), end_after: st.is_closed().then(|| st.end_after_data()) }
    }

    /// The loop's progress, for flush: fragments still with the node or transport; and
    /// the input it waits for (data-driven production, `SourceNode::waiting_for_input`).
    pub(crate) fn publish_progress(&self, queued: usize, next_slice: SliceNumber, wake_at_ready: Option<SliceNumber>) {
        let st = self.lock();
        self.node_queued.store(queued, Ordering::Release);
        self.next_slice.store(next_slice, Ordering::Release);
        let want = wake_at_ready.unwrap_or(u64::MAX);
        self.wake_at_ready.store(want, Ordering::Release);
        // Data that came since the loop looked: wake it now (the permit is kept).
        if want != u64::MAX && st.ready_below() >= want {
            self.wake.notify_one();
        }
        self.notify_changed();
    }

    /// The loop has ended: refuse further submissions, count what is still held as
    /// discarded, release every waiter.
    pub(crate) fn finish(&self) {
        self.finished.store(true, Ordering::Release);
        self.lock().handle_finish();
        self.changed.notify_all();
    }
}

/// What the source loop takes from the ingest on each wake-up.
pub(crate) struct LoopInput {
    pub late: Vec<(SourceId, SliceNumber, GeneratedFragment)>,
    pub ready_below: SliceNumber,
    pub end_after: Option<SliceNumber>,
}

impl Workload for SharedIngest {
    fn generate(&self, source: SourceId, slice: SliceNumber) -> GeneratedFragment {
        let st = &mut *self.lock();
        let f = st.take(source, slice);
        // Room freed: wake submitters blocked by back-pressure.
        self.notify_changed();
        f
    }
}

/// Builds a source process's ingest from its configuration for a run starting at
/// `first_slice`.
pub fn shared_ingest(cfg: &Config, first_slice: SliceNumber) -> Result<Arc<SharedIngest>, ConfigError> {
    let ingest = Ingest::new(cfg.ingest_config(first_slice)?);
    Ok(SharedIngest::new(ingest, cfg.input_settings()?.backpressure))
}

/// A running input socket; stopped when dropped (or with [`InputTask::stop`]).
pub struct InputTask {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    unix_path: Option<PathBuf>,
    udp_addr: Option<std::net::SocketAddr>,
    /// A `clb:` input's DataQueue counters.
    clb: Option<Arc<Mutex<DataQueueReport>>>,
}

impl InputTask {
    /// Starts the input `kind` feeding `ingest` (nothing for the generator).
    pub fn start(kind: &InputKind, cfg: &Config, ingest: Arc<SharedIngest>) -> Result<Option<InputTask>, ConfigError> {
        let stop = Arc::new(AtomicBool::new(false));
        let max_payload = cfg.source.input_max_fragment_mb.saturating_mul(1 << 20);
        match kind {
            InputKind::Generator => Ok(None),
            InputKind::Unix(path) => {
                // A socket file left by a process that died is ours to replace; anything
                // else at that path is not.
                if let Ok(meta) = std::fs::symlink_metadata(path) {
                    use std::os::unix::fs::FileTypeExt;
                    if !meta.file_type().is_socket() {
                        return Err(ConfigError::Invalid(format!(
                            "source.input: {} exists and is not a socket",
                            path.display()
                        )));
                    }
                    let _ = std::fs::remove_file(path);
                }
                let listener = UnixListener::bind(path)
                    .map_err(|e| ConfigError::Invalid(format!("source.input: binding {}: {e}", path.display())))?;
                info!(path = %path.display(), "input: accepting readout programs on a unix socket");
                let end_on_disconnect = cfg.source.input_end_on_disconnect && cfg.run.seconds == 0.0;
                let max_clients = cfg.source.input_max_clients.max(1) as usize;
                let st = stop.clone();
                let t = std::thread::Builder::new()
                    .name("shoal-input".into())
                    .spawn(move || accept_loop(listener, ingest, st, max_payload, max_clients, end_on_disconnect))
                    .map_err(|e| ConfigError::Invalid(format!("starting the input thread: {e}")))?;
                Ok(Some(InputTask { stop, threads: vec![t], unix_path: Some(path.clone()), udp_addr: None, clb: None }))
            }
            InputKind::Clb(addr) => {
                // A DOM's timeslice comes in a burst of packets: a large receive buffer.
                let socket = crate::transport::udp::std_socket(*addr, cfg.udp_socket_buffer())
                    .map_err(|e| ConfigError::Invalid(format!("source.input: binding udp {addr}: {e}")))?;
                let udp_addr = socket.local_addr().ok();
                let clb = ClbInput::new(cfg, &ingest)?;
                let report = clb.report.clone();
                info!(%addr, doms = clb.sources.len(), "input: receiving KM3NeT CLB packets");
                let st = stop.clone();
                let t = std::thread::Builder::new()
                    .name("shoal-input-clb".into())
                    .spawn(move || clb.run(socket, ingest, st))
                    .map_err(|e| ConfigError::Invalid(format!("starting the input thread: {e}")))?;
                Ok(Some(InputTask { stop, threads: vec![t], unix_path: None, udp_addr, clb: Some(report) }))
            }
            InputKind::Udp(addr) => {
                let socket = std::net::UdpSocket::bind(addr)
                    .map_err(|e| ConfigError::Invalid(format!("source.input: binding udp {addr}: {e}")))?;
                socket
                    .set_read_timeout(Some(INPUT_POLL))
                    .map_err(|e| ConfigError::Invalid(format!("source.input: {e}")))?;
                let udp_addr = socket.local_addr().ok();
                info!(%addr, "input: receiving fragments in datagrams");
                let st = stop.clone();
                let t = std::thread::Builder::new()
                    .name("shoal-input-udp".into())
                    .spawn(move || udp_loop(socket, ingest, st, max_payload))
                    .map_err(|e| ConfigError::Invalid(format!("starting the input thread: {e}")))?;
                Ok(Some(InputTask { stop, threads: vec![t], unix_path: None, udp_addr, clb: None }))
            }
        }
    }

    /// The address a `udp:` input is bound to (its port when the configuration said 0).
    pub fn udp_addr(&self) -> Option<std::net::SocketAddr> {
        self.udp_addr
    }

    /// Stops accepting and reading, and waits for the threads; a `clb:` input's
    /// DataQueue counters.
    pub fn stop(mut self) -> Option<DataQueueReport> {
        self.shutdown();
        self.clb.as_ref().map(|r| r.lock().unwrap_or_else(|p| p.into_inner()).clone())
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        if let Some(p) = self.unix_path.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Drop for InputTask {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(
    listener: UnixListener,
    ingest: Arc<SharedIngest>,
    stop: Arc<AtomicBool>,
    max_payload: u32,
    max_clients: usize,
    end_on_disconnect: bool,
) {
    // Non-blocking accept polled with the same period as the readers: the loop must see
    // the run end even when no client ever comes.
    if let Err(e) = listener.set_nonblocking(true) {
        warn!("input: {e}");
        return;
    }
    let active = Arc::new(AtomicUsize::new(0));
    let mut ever = false;
    let mut readers = Vec::new();
    while !stop.load(Ordering::Acquire) && !ingest.is_finished() {
        match listener.accept() {
            Ok((stream, _)) => {
                if active.load(Ordering::Acquire) >= max_clients {
                    warn!(max_clients, "input: too many clients, refusing one");
                    ingest.count_rejected("too_many_clients");
                    continue;
                }
                ever = true;
                active.fetch_add(1, Ordering::AcqRel);
                let (ingest, stop, gone) = (ingest.clone(), stop.clone(), active.clone());
                let spawned = std::thread::Builder::new().name("shoal-input-conn".into()).spawn(move || {
                    read_client(stream, &ingest, &stop, max_payload);
                    gone.fetch_sub(1, Ordering::AcqRel);
                    ingest.wake.notify_one();
                });
                match spawned {
                    Ok(t) => readers.push(t),
                    Err(e) => {
                        warn!("input: cannot start a reader thread: {e}");
                        active.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if end_on_disconnect && ever && active.load(Ordering::Acquire) == 0 && !ingest.is_closed() {
                    info!("input: every client has disconnected; ending the run after the last slice with data");
                    ingest.close();
                }
                wait_readable(&listener, INPUT_POLL);
            }
            Err(e) => {
                warn!("input: accept failed: {e}");
                wait_readable(&listener, INPUT_POLL);
            }
        }
        readers.retain(|t| !t.is_finished());
    }
    for t in readers {
        let _ = t.join();
    }
}

/// Waits until the listener has a connection to accept or `timeout` passes.
fn wait_readable(listener: &UnixListener, timeout: StdDuration) {
    use std::os::fd::AsFd;
    let mut fds = [nix::poll::PollFd::new(listener.as_fd(), nix::poll::PollFlags::POLLIN)];
    let ms = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
    let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(ms));
}

/// Reads one client's frames into the ingest until it disconnects, sends garbage, or the
/// run ends. A refused fragment is counted and the connection kept (the client's next
/// fragment may be fine); a malformed frame closes this connection only.
fn read_client(mut stream: UnixStream, ingest: &SharedIngest, stop: &AtomicBool, max_payload: u32) {
    if stream.set_read_timeout(Some(INPUT_POLL)).is_err() {
        return;
    }
    let mut decoder = InputStreamDecoder::new(max_payload);
    let mut buf = vec![0u8; 256 * 1024];
    let mut refused_logged = 0u64;
    loop {
        if stop.load(Ordering::Acquire) || ingest.is_finished() {
            return;
        }
        let n = match stream.read(&mut buf) {
            Ok(0) => {
                if decoder.partial() {
                    warn!("input: a client disconnected in the middle of a fragment (counted, not delivered)");
                    ingest.count_rejected("partial_at_disconnect");
                }
                return;
            }
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                warn!("input: reading a client: {e}");
                if decoder.partial() {
                    ingest.count_rejected("partial_at_disconnect");
                }
                return;
            }
        };
        decoder.push(&buf[..n]);
        loop {
            match decoder.next_frame() {
                Ok(Some((h, payload))) => {
                    let sub = Submission { source: h.source, when: h.when, hit_count: h.hit_count, payload };
                    if let Err(e) = ingest.submit(sub) {
                        // Counted by the ingest; logged once per 1000 so a bad client
                        // cannot flood the log.
                        if refused_logged.is_multiple_of(1000) {
                            warn!(kind = e.kind(), "input: fragment refused: {e}");
                        }
                        refused_logged += 1;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    warn!(kind = e.kind(), "input: malformed frame, closing this client: {e}");
                    ingest.count_rejected(e.kind());
                    return;
                }
            }
        }
    }
}

/// Which of a source's datagram sequence numbers came: the next one expected and a bit per
/// number of the 128 below it, so that a duplicate is told from a late (reordered) one.
#[derive(Debug)]
struct SeqWindow {
    next: u32,
    /// Bit k: sequence number `next - 1 - k` has come.
    seen: u128,
}

/// What a datagram's sequence number says.
#[derive(Debug, PartialEq, Eq)]
enum SeqVerdict {
    /// In order, or ahead: this many before it are missing (counted lost).
    New { missing: u32 },
    /// Behind, not seen before: a reordered datagram (counted lost when its gap was seen).
    Reordered,
    /// Seen before: dropped.
    Duplicate,
}

impl SeqWindow {
    fn start(seq: u32) -> Self {
        Self { next: seq.wrapping_add(1), seen: 1 }
    }

    fn handle(&mut self, seq: u32) -> SeqVerdict {
        let ahead = seq.wrapping_sub(self.next);
        if ahead < u32::MAX / 2 {
            let shift = ahead + 1;
            self.seen = if shift >= 128 { 1 } else { (self.seen << shift) | 1 };
            self.next = seq.wrapping_add(1);
            return SeqVerdict::New { missing: ahead };
        }
        let behind = self.next.wrapping_sub(1).wrapping_sub(seq);
        if behind >= 128 {
            // Too far back to remember: take it as a late one.
            return SeqVerdict::Reordered;
        }
        let bit = 1u128 << behind;
        if self.seen & bit != 0 {
            return SeqVerdict::Duplicate;
        }
        self.seen |= bit;
        SeqVerdict::Reordered
    }
}

/// One fragment per datagram; gaps in a source's sequence numbers are counted lost, a
/// datagram that comes twice is dropped the second time (counted `duplicate`: its payload
/// would otherwise be appended to the fragment twice).
fn udp_loop(socket: std::net::UdpSocket, ingest: Arc<SharedIngest>, stop: Arc<AtomicBool>, max_payload: u32) {
    let mut buf = vec![0u8; 65_536];
    let mut windows: HashMap<SourceId, SeqWindow> = HashMap::new();
    while !stop.load(Ordering::Acquire) && !ingest.is_finished() {
        let n = match socket.recv(&mut buf) {
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                warn!("input: udp receive: {e}");
                continue;
            }
        };
        let datagram = Bytes::copy_from_slice(&buf[..n]);
        let (h, payload) = match decode_datagram(&datagram, max_payload) {
            Ok(x) => x,
            Err(e) => {
                ingest.count_rejected(e.kind());
                continue;
            }
        };
        match windows.get_mut(&h.source) {
            None => {
                windows.insert(h.source, SeqWindow::start(h.sequence));
            }
            Some(w) => match w.handle(h.sequence) {
                SeqVerdict::New { missing: 0 } => {}
                SeqVerdict::New { missing } => ingest.handle_lost_at_input(u64::from(missing)),
                SeqVerdict::Reordered => ingest.handle_reordered_at_input(),
                SeqVerdict::Duplicate => {
                    ingest.count_rejected("duplicate");
                    continue;
                }
            },
        }
        let _ = ingest.submit(Submission { source: h.source, when: h.when, hit_count: h.hit_count, payload });
    }
}

/// A `clb:` input: KM3NeT's DataQueue in front of the ingest. Every datagram goes to the
/// DataQueue; a timeslice is closed half the input latency after its end on the host
/// clock, and each DOM's frame becomes one fragment of its source: a JDAQ superframe
/// (docs/km3net.md). The ingest sends the slice after the full latency.
struct ClbInput {
    queue: DataQueue,
    /// DOM id to source id.
    sources: HashMap<u32, SourceId>,
    det_id: i32,
    run: i32,
    first_slice: SliceNumber,
    slice_ns: u64,
    close_delay_ns: u64,
    report: Arc<Mutex<DataQueueReport>>,
    /// Kinds of frame refusals already logged.
    frames_refused_said: std::collections::HashSet<&'static str>,
}

impl ClbInput {
    fn new(cfg: &Config, ingest: &SharedIngest) -> Result<Self, ConfigError> {
        let doms = cfg.km3net.dom_ids()?;
        let slice_ns = cfg.slice_clock()?.length().as_nanos() as u64;
        let hosted: std::collections::HashSet<SourceId> = cfg.hosted_sources().into_iter().collect();
        // Only the DOMs of the sources this process hosts: another DOM's packets here are
        // refused (`unknown_dom`), not sent as somebody else's fragment.
        let sources: HashMap<u32, SourceId> = doms
            .iter()
            .enumerate()
            .filter(|&(i, _)| hosted.contains(&(i as SourceId)))
            .map(|(i, &d)| (d, i as SourceId))
            .collect();
        let queue = DataQueue::new(DataQueueConfig {
            slice_ns,
            doms: Some(sources.keys().copied().collect()),
            max_packets_per_frame: cfg.km3net.max_packets_per_frame as usize,
        });
        Ok(Self {
            queue,
            sources,
            det_id: cfg.km3net.det_id,
            run: cfg.run.run_number as i32,
            first_slice: ingest.first_slice(),
            slice_ns,
            close_delay_ns: cfg.source.input_latency_ms * 1_000_000 / 2,
            report: Arc::new(Mutex::new(DataQueueReport::default())),
            frames_refused_said: Default::default(),
        })
    }

    fn run(mut self, socket: std::net::UdpSocket, ingest: Arc<SharedIngest>, stop: Arc<AtomicBool>) {
        let local = socket.local_addr().ok();
        let clock = crate::clock::WallClock::new();
        let mut buf = vec![0u8; 65_536];
        // Closing timeslices, the counters and the log: every tick, not per packet (a
        // DOM's timeslice is a burst of packets the loop must keep up with).
        let tick = StdDuration::from_millis((self.slice_ns / 4_000_000).clamp(1, 100));
        let _ = socket.set_read_timeout(Some(tick));
        let mut next_tick = StdInstant::now();
        let mut logged = (0u64, 0u64, StdInstant::now());
        while !stop.load(Ordering::Acquire) && !ingest.is_finished() {
            match socket.recv(&mut buf) {
                Ok(n) => {
                    self.queue.handle_packet(&buf[..n]);
                }
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => warn!("input: udp receive: {e}"),
            }
            if StdInstant::now() < next_tick {
                continue;
            }
            next_tick = StdInstant::now() + tick;
            let now = clock.now().as_nanos();
            let below = now.saturating_sub(self.slice_ns + self.close_delay_ns);
            self.submit_frames(&ingest, below);
            let r = self.publish_report(local);
            // Refusals and the kernel's drops, said at most once a second.
            let refused: u64 = r.refused.values().sum();
            if (refused > logged.0 || r.dropped_by_kernel > logged.1) && logged.2.elapsed() >= StdDuration::from_secs(1)
            {
                warn!(
                    refused = refused - logged.0,
                    dropped_by_kernel = r.dropped_by_kernel - logged.1,
                    by_reason = ?r.refused,
                    "input: CLB packets refused or dropped since the last report (the kernel drops when the \
                     receive buffer is full: raise udp.socket_buffer_mb and net.core.rmem_max)"
                );
                logged = (refused, r.dropped_by_kernel, StdInstant::now());
            }
        }
        // What is still open goes in as it is (the ingest takes it late or refuses it,
        // counted): nothing received is left uncounted.
        self.submit_frames(&ingest, u64::MAX);
        self.publish_report(local);
    }

    fn submit_frames(&mut self, ingest: &SharedIngest, below_ns: u64) {
        for f in self.queue.close_below(below_ns) {
            let Some(&source) = self.sources.get(&f.dom_id) else { continue };
            let slice = f.timeslice_start_ns / self.slice_ns;
            let frame_index = (slice.saturating_sub(self.first_slice) + 1) as i32;
            let header = JdaqHeader::at(self.det_id, self.run, frame_index, f.timeslice_start_ns);
            let frame = JdaqFrame {
                dom_id: f.dom_id,
                // The low 16 bits of KM3NeT's DataQueue status count the packets received.
                dataqueue_status: f.packets & 0xffff,
                dom_status: [f.dom_status, 0, 0, 0],
                hits: f.hits,
            };
            let payload = Bytes::from(encode_superframe(&header, &frame));
            let sub = Submission { source, when: When::TimeNs(f.timeslice_start_ns), hit_count: None, payload };
            if let Err(e) = ingest.submit(sub) {
                // Counted by the ingest; the first of each kind said (a run's end can refuse
                // every DOM's frame of a slice).
                if self.frames_refused_said.insert(e.kind()) {
                    warn!(
                        kind = e.kind(),
                        dom = f.dom_id,
                        "input: a DOM frame refused (counted; said once per kind): {e}"
                    );
                }
            }
        }
    }

    fn publish_report(&self, local: Option<std::net::SocketAddr>) -> DataQueueReport {
        let mut r = self.queue.report().clone();
        r.dropped_by_kernel = local.and_then(crate::transport::udp::kernel_drops).unwrap_or(0);
        *self.report.lock().unwrap_or_else(|p| p.into_inner()) = r.clone();
        r
    }
}

/// A unix socket path is valid for `bind` (for messages before the run starts).
pub fn check_unix_path(path: &Path) -> Result<(), ConfigError> {
    // sun_path holds 108 bytes with its terminating zero.
    if path.as_os_str().len() >= 108 {
        return Err(ConfigError::Invalid(format!(
            "source.input: {} is longer than a unix socket path may be",
            path.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{SeqVerdict, SeqWindow};

    #[test]
    fn sequence_windows_tell_gaps_late_ones_and_duplicates_apart() {
        let mut w = SeqWindow::start(u32::MAX - 1);
        assert_eq!(w.handle(u32::MAX), SeqVerdict::New { missing: 0 });
        assert_eq!(w.handle(2), SeqVerdict::New { missing: 2 }, "0 and 1 missing, across the wrap");
        assert_eq!(w.handle(1), SeqVerdict::Reordered);
        assert_eq!(w.handle(1), SeqVerdict::Duplicate);
        assert_eq!(w.handle(2), SeqVerdict::Duplicate);
        assert_eq!(w.handle(u32::MAX), SeqVerdict::Duplicate);
        assert_eq!(w.handle(0), SeqVerdict::Reordered);
        assert_eq!(w.handle(300), SeqVerdict::New { missing: 297 });
        assert_eq!(w.handle(3), SeqVerdict::Reordered, "too far back to remember");
        assert_eq!(w.handle(299), SeqVerdict::Reordered);
        assert_eq!(w.handle(299), SeqVerdict::Duplicate);
    }
}
