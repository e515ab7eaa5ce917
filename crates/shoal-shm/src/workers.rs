//! Python filters in worker processes (`builder.filter.python = "module:function"`,
//! docs/plugins.md "Python filters").
//!
//! The builder's filter thread owns a [`WorkerPool`]: `workers` Python processes, each with
//! a socket pair (its end as fd 3), an inbox memfd the builder writes one slice at a time
//! into (the slot format of the slice ring, read by the worker as numpy views) and a
//! results memfd the worker writes its events into. One slice is in flight per worker; the
//! pool hands slices to idle workers and results back in completion order, each with the
//! caller's tag. A worker that raises ([`Outcome::Failed`]), dies (a segmentation fault,
//! `os._exit`, the OOM killer: [`Outcome::Crashed`]) or passes the deadline
//! ([`Outcome::TimedOut`], killed) costs that slice's events, never the builder; the worker
//! is started again. Events that break the rules are refused and counted.
//!
//! The same protocol runs C plug-ins out of process (`builder.filter.isolate`): the worker
//! is `shoal filter-worker`, whose loop is [`serve`].

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use memmap2::{Mmap, MmapMut};
use shoal_core::event::{Event, EventHit};
use shoal_core::slicering::layout;
use shoal_core::slicering::msg::Msg;

use crate::sock::{self, Recv};

/// What a worker runs.
#[derive(Clone, Debug)]
pub enum WorkerProgram {
    /// A Python filter: `python -c <shoal.slices> target python_path config`.
    Python {
        /// The interpreter (`python3`, or a virtual environment's).
        exe: String,
        /// `module:function`.
        target: String,
        /// Prepended to `sys.path` (`:`-separated).
        path: String,
    },
    /// Any program speaking the worker protocol on fd 3 (`shoal filter-worker` for C
    /// plug-ins: [`serve`]).
    Exe { exe: std::path::PathBuf, args: Vec<String> },
}

impl WorkerProgram {
    fn describe(&self) -> String {
        match self {
            WorkerProgram::Python { target, .. } => format!("Python filter worker for {target}"),
            WorkerProgram::Exe { exe, args } => format!("filter worker {} {}", exe.display(), args.join(" ")),
        }
    }
}

/// How to run the workers.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub program: WorkerProgram,
    pub workers: usize,
    /// Handed to the filter's init (the Python module's `init(config)`).
    pub config: String,
    /// Longest a worker may take for one slice before it is killed.
    pub timeout: Duration,
    /// Longest a worker may take to import the module and say it is ready.
    pub start_timeout: Duration,
    /// Most workers started again in a run (then the pool gives up: every slice fails).
    pub max_restarts: u64,
}

/// How one slice ended.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    Events(Vec<Event>),
    /// The filter raised (traceback on the worker's stderr).
    Failed,
    /// The worker died while filtering it.
    Crashed,
    /// The worker passed the deadline and was killed.
    TimedOut,
    /// No worker could be started.
    NoWorker,
}

/// What the pool did in a run.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WorkerReport {
    pub workers: u64,
    pub slices: u64,
    pub failed: u64,
    pub crashed: u64,
    pub timed_out: u64,
    pub no_worker: u64,
    pub restarts: u64,
    /// Events refused: no hit, a source not in the slice, a time past the slice's end, or a
    /// results area that does not parse.
    pub malformed_events: u64,
}

struct Busy<T> {
    seq: u64,
    deadline: Instant,
    sources: Vec<u32>,
    slice_ns: u64,
    tag: T,
}

struct Worker<T> {
    child: Child,
    sock: OwnedFd,
    inbox: Option<(OwnedFd, MmapMut)>,
    results: Option<Mmap>,
    busy: Option<Busy<T>>,
}

/// The pool. `T` travels with each slice and comes back with its outcome.
pub struct WorkerPool<T> {
    cfg: WorkerConfig,
    workers: Vec<Worker<T>>,
    next_seq: u64,
    report: WorkerReport,
}

/// The worker's program: the Python client and its main.
fn worker_source() -> String {
    format!("{}\nworker_main()\n", crate::PYTHON_CLIENT)
}

impl<T> WorkerPool<T> {
    /// Starts every worker and waits until each has imported the module (an import error
    /// refuses the run, with the worker's own message on stderr).
    pub fn start(cfg: WorkerConfig) -> io::Result<Self> {
        if let WorkerProgram::Python { target, .. } = &cfg.program
            && !target.contains(':')
        {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{target:?} is not module:function")));
        }
        let mut pool = WorkerPool { workers: Vec::new(), next_seq: 1, report: WorkerReport::default(), cfg };
        for _ in 0..pool.cfg.workers.max(1) {
            let w = pool.spawn()?;
            pool.workers.push(w);
        }
        pool.report.workers = pool.workers.len() as u64;
        Ok(pool)
    }

    fn spawn(&self) -> io::Result<Worker<T>> {
        let (ours, theirs) = sock::seqpacket_pair()?;
        let theirs_raw = theirs.as_raw_fd();
        let mut cmd = match &self.cfg.program {
            WorkerProgram::Python { exe, target, path } => {
                let mut c = Command::new(exe);
                c.arg("-c").arg(worker_source()).arg(target).arg(path).arg(&self.cfg.config);
                c
            }
            WorkerProgram::Exe { exe, args } => {
                let mut c = Command::new(exe);
                c.args(args);
                c
            }
        };
        cmd.stdin(Stdio::null());
        // SAFETY: between fork and exec only async-signal-safe calls: dup2 (which clears
        // close-on-exec on fd 3, the worker's end; every other descriptor of ours stays
        // close-on-exec, so no worker holds another's socket) and prctl (the worker dies
        // with the builder, even a builder killed with SIGKILL).
        unsafe {
            cmd.pre_exec(move || {
                // dup2 onto itself keeps close-on-exec: clear it by hand in that case.
                let ok = if theirs_raw == 3 { libc::fcntl(3, libc::F_SETFD, 0) } else { libc::dup2(theirs_raw, 3) };
                if ok < 0 {
                    return Err(io::Error::last_os_error());
                }
                rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("starting the {}: {e}", self.cfg.program.describe())))?;
        drop(theirs);
        // Ready: a hello once the module is imported and its init ran.
        let ready = sock::wait_readable(&[ours.as_fd()], Some(self.cfg.start_timeout))?;
        let hello = if ready.is_empty() { None } else { Some(sock::recv(ours.as_fd(), false)?) };
        match hello {
            Some(Recv::Msg(Msg::Hello { policy: 2, .. }, _)) => {}
            other => {
                let _ = child.kill();
                let status = child.wait().ok();
                let why = match other {
                    None => format!("not ready within {:?}", self.cfg.start_timeout),
                    Some(Recv::Closed) => {
                        format!("exited ({}) before it was ready", status.map_or("?".into(), |s| s.to_string()))
                    }
                    Some(_) => "sent something other than its hello".into(),
                };
                return Err(io::Error::other(format!(
                    "{}: {why} (its stderr has the reason)",
                    self.cfg.program.describe()
                )));
            }
        }
        Ok(Worker { child, sock: ours, inbox: None, results: None, busy: None })
    }

    /// Hands a slice to an idle worker, first waiting for one if all are busy. Returns what
    /// completed meanwhile (possibly this very slice, if no worker can take it).
    pub fn submit(
        &mut self,
        slice: u64,
        slice_start_ns: u64,
        slice_ns: u64,
        fragments: &[(u32, u16, u32, &[u8])],
        tag: T,
    ) -> Vec<(T, Outcome)> {
        let mut done = self.poll(false);
        let idle = loop {
            if let Some(i) = self.workers.iter().position(|w| w.busy.is_none()) {
                break Some(i);
            }
            if self.workers.is_empty() {
                break None;
            }
            done.extend(self.poll(true));
        };
        let Some(i) = idle else {
            self.report.no_worker += 1;
            done.push((tag, Outcome::NoWorker));
            return done;
        };
        self.report.slices += 1;
        let seq = self.next_seq;
        self.next_seq += 1;
        let len = layout::slot_len(fragments.iter().map(|f| f.3.len())) as usize;
        let w = &mut self.workers[i];
        // The inbox grows (a new memfd, sent with this slice) when a slice does not fit.
        let mut pass = None;
        if w.inbox.as_ref().is_none_or(|(_, m)| m.len() < len) {
            match new_memfd("shoal-inbox", (len as u64).next_power_of_two().max(1 << 20)) {
                Ok(inbox) => {
                    w.inbox = Some(inbox);
                    pass = Some(());
                }
                Err(e) => {
                    tracing::warn!(%e, "Python filter: no memory for a worker's inbox");
                    self.report.failed += 1;
                    done.push((tag, Outcome::Failed));
                    return done;
                }
            }
        }
        let (fd, map) = w.inbox.as_mut().expect("set above");
        layout::write_slot(&mut map[..len], seq, (slice, slice_start_ns, slice_ns), fragments);
        let m = Msg::Slice { seq, offset: 0, len: len as u64, slice };
        let sent = sock::send(w.sock.as_fd(), &m, pass.map(|_| fd.as_fd()), true);
        let busy = Busy {
            seq,
            deadline: Instant::now() + self.cfg.timeout,
            sources: {
                let mut s: Vec<u32> = fragments.iter().map(|f| f.0).collect();
                s.sort_unstable();
                s
            },
            slice_ns,
            tag,
        };
        w.busy = Some(busy);
        if sent.is_err() {
            // Gone already: seen as a crash by the next poll.
            done.extend(self.poll(false));
        }
        done
    }

    /// Collects completions; with `block`, waits until at least one worker answers, dies or
    /// passes its deadline.
    fn poll(&mut self, block: bool) -> Vec<(T, Outcome)> {
        let mut done = Vec::new();
        let now = Instant::now();
        let wait = if block {
            let next = self.workers.iter().filter_map(|w| w.busy.as_ref().map(|b| b.deadline)).min();
            next.map(|d| d.saturating_duration_since(now)).or(Some(Duration::from_millis(100)))
        } else {
            Some(Duration::ZERO)
        };
        let fds: Vec<_> = self.workers.iter().map(|w| w.sock.as_fd()).collect();
        let readable = sock::wait_readable(&fds, wait).unwrap_or_default();
        let mut restart = Vec::new();
        for i in 0..self.workers.len() {
            let w = &mut self.workers[i];
            if readable.contains(&i) {
                match sock::recv(w.sock.as_fd(), false) {
                    Ok(Recv::Msg(Msg::Done { seq, events, bytes, refused }, fd)) => {
                        self.report.malformed_events += refused;
                        if let Some(fd) = fd {
                            // SAFETY: the worker's results memfd, mapped read-only; it only
                            // grows by a new memfd, never shrinks under this mapping.
                            w.results = unsafe { Mmap::map(&std::fs::File::from(fd)) }.ok();
                        }
                        if let Some(b) = w.busy.take_if(|b| b.seq == seq) {
                            let area = w.results.as_ref().map(|m| &m[..(bytes as usize).min(m.len())]).unwrap_or(&[]);
                            let (evs, bad) = decode_results(area, events, &b.sources, b.slice_ns);
                            self.report.malformed_events += bad;
                            done.push((b.tag, Outcome::Events(evs)));
                        }
                        continue;
                    }
                    Ok(Recv::Msg(Msg::Failed { seq }, _)) => {
                        if let Some(b) = w.busy.take_if(|b| b.seq == seq) {
                            self.report.failed += 1;
                            done.push((b.tag, Outcome::Failed));
                        }
                        continue;
                    }
                    Ok(Recv::Empty) => {}
                    _ => {
                        // Closed, garbage or a socket error: the worker is gone or broken.
                        let _ = w.child.kill();
                        let status = w.child.wait();
                        tracing::warn!(?status, "Python filter worker died; starting another");
                        if let Some(b) = w.busy.take() {
                            self.report.crashed += 1;
                            done.push((b.tag, Outcome::Crashed));
                        }
                        restart.push(i);
                        continue;
                    }
                }
            }
            if w.busy.as_ref().is_some_and(|b| Instant::now() >= b.deadline) {
                let _ = w.child.kill();
                let _ = w.child.wait();
                tracing::warn!(timeout = ?self.cfg.timeout, "Python filter worker passed its deadline; killed, starting another");
                let b = w.busy.take().expect("checked");
                self.report.timed_out += 1;
                done.push((b.tag, Outcome::TimedOut));
                restart.push(i);
            }
        }
        for i in restart.into_iter().rev() {
            self.workers.remove(i);
            if self.report.restarts < self.cfg.max_restarts {
                self.report.restarts += 1;
                match self.spawn() {
                    Ok(w) => self.workers.push(w),
                    Err(e) => tracing::warn!(%e, "Python filter worker could not be started again"),
                }
            }
        }
        done
    }

    /// Slices still being filtered.
    pub fn in_flight(&self) -> usize {
        self.workers.iter().filter(|w| w.busy.is_some()).count()
    }

    /// Collects completions without waiting.
    pub fn poll_done(&mut self) -> Vec<(T, Outcome)> {
        self.poll(false)
    }

    /// Waits for every slice in flight (each within its deadline), then ends the workers.
    pub fn finish(mut self) -> (Vec<(T, Outcome)>, WorkerReport) {
        let mut done = Vec::new();
        while self.in_flight() > 0 {
            done.extend(self.poll(true));
        }
        for w in &mut self.workers {
            let _ = sock::send(w.sock.as_fd(), &Msg::End { offered: 0, skipped: 0, overrun: 0 }, None, false);
        }
        for w in &mut self.workers {
            // It leaves at the end message; one that does not within the start timeout is killed.
            let t = Instant::now();
            while w.child.try_wait().ok().flatten().is_none() && t.elapsed() < self.cfg.start_timeout {
                let _ = sock::wait_readable(&[w.sock.as_fd()], Some(Duration::from_millis(50)));
            }
            let _ = w.child.kill();
            let _ = w.child.wait();
        }
        (done, std::mem::take(&mut self.report))
    }
}

impl<T> Drop for WorkerPool<T> {
    fn drop(&mut self) {
        for w in &mut self.workers {
            let _ = w.child.kill();
            let _ = w.child.wait();
        }
    }
}

fn new_memfd(name: &str, len: u64) -> io::Result<(OwnedFd, MmapMut)> {
    let fd = rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC)?;
    let file = std::fs::File::from(fd);
    file.set_len(len)?;
    // SAFETY: our own memfd, never truncated while mapped.
    let map = unsafe { MmapMut::map_mut(&file)? };
    Ok((file.into(), map))
}

/// Bytes of one event hit in the results area: source u32, time_ns u32, channel u8,
/// amplitude u8, triggered u8, reserved u8 (`shoal.slices.EVENT_HIT`).
pub const RESULT_HIT_LEN: usize = 12;

/// Reads `count` events from a worker's results area: per event `trigger_mask u32,
/// hit_count u32`, then the hits. Returns the good events and how many were refused.
fn decode_results(area: &[u8], count: u64, sorted_sources: &[u32], slice_ns: u64) -> (Vec<Event>, u64) {
    let mut events = Vec::new();
    let mut bad = 0;
    let mut at = 0usize;
    for k in 0..count {
        let Some(head) = area.get(at..at + 8) else {
            // The area ends early: the rest cannot be read.
            return (events, bad + count - k);
        };
        let mask = u32::from_le_bytes(head[0..4].try_into().unwrap());
        let n = u32::from_le_bytes(head[4..8].try_into().unwrap()) as usize;
        at += 8;
        let Some(body) = n.checked_mul(RESULT_HIT_LEN).and_then(|l| area.get(at..at.checked_add(l)?)) else {
            return (events, bad + count - k);
        };
        at += n * RESULT_HIT_LEN;
        let hits: Vec<EventHit> = body
            .chunks_exact(RESULT_HIT_LEN)
            .map(|h| EventHit {
                source: u32::from_le_bytes(h[0..4].try_into().unwrap()),
                time_ns: u32::from_le_bytes(h[4..8].try_into().unwrap()),
                channel: h[8],
                amplitude: h[9],
                triggered: h[10] != 0,
            })
            .collect();
        if shoal_trigger::event_is_well_formed(&hits, sorted_sources, slice_ns) {
            events.push(Event { id: events.len() as u32, trigger_mask: mask, overlays: 0, hits });
        } else {
            bad += 1;
        }
    }
    (events, bad)
}

/// A worker's side of the protocol, for workers written in Rust (`shoal filter-worker`):
/// says it is ready on fd 3 (the socket its builder gave it), then for every slice calls
/// `filter` with a view of it and answers with the events (`Ok`, and how many the filter
/// itself refused) or a failure (`Err`), until the builder ends the run or goes away.
pub fn serve(mut filter: impl FnMut(&shoal_trigger::SliceData) -> Result<(Vec<Event>, u64), ()>) -> io::Result<()> {
    use std::os::fd::FromRawFd;
    // SAFETY: only asks the kernel about fd 3 (a closed descriptor answers EBADF).
    if rustix::net::sockopt::socket_type(unsafe { std::os::fd::BorrowedFd::borrow_raw(3) }).ok()
        != Some(rustix::net::SocketType::SEQPACKET)
    {
        return Err(io::Error::other("fd 3 is not a worker socket: filter-worker is started by a builder"));
    }
    // SAFETY: fd 3 is open and a seqpacket socket (checked above), given to this process by
    // its builder and used by nothing else here.
    let sock = unsafe { OwnedFd::from_raw_fd(3) };
    sock::send(sock.as_fd(), &Msg::Hello { policy: 2, hold_ms: 0, window: 1 }, None, true)?;
    let mut inbox: Option<std::sync::Arc<Mmap>> = None;
    let mut results: Option<(OwnedFd, MmapMut)> = None;
    loop {
        let (seq, offset, len, fd) = match sock::recv(sock.as_fd(), true)? {
            Recv::Msg(Msg::Slice { seq, offset, len, .. }, fd) => (seq, offset as usize, len as usize, fd),
            Recv::Msg(Msg::End { .. }, _) | Recv::Closed => return Ok(()),
            other => return Err(io::Error::new(io::ErrorKind::InvalidData, format!("unexpected {:?}", kind(&other)))),
        };
        if let Some(fd) = fd {
            // SAFETY: the builder's inbox memfd, read-only; it writes a slot only while this
            // worker is idle.
            inbox = Some(std::sync::Arc::new(unsafe { Mmap::map(&std::fs::File::from(fd))? }));
        }
        let map =
            inbox.as_ref().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "a slice before the inbox"))?;
        let slot =
            map.get(offset..offset.saturating_add(len)).ok_or_else(|| io::Error::other("slot outside the inbox"))?;
        let (head, entries) =
            layout::read_slot(slot).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        let fragments = entries
            .iter()
            .map(|e| {
                let at = offset + e.offset as usize;
                shoal_trigger::FragmentData {
                    source: e.source,
                    flags: e.flags,
                    hit_count: e.hit_count,
                    // A view into the inbox, no copy.
                    payload: bytes::Bytes::from_owner(InboxRange { map: map.clone(), at, len: e.len as usize }),
                }
            })
            .collect();
        let data = shoal_trigger::SliceData {
            slice: head.slice,
            slice_start_ns: head.slice_start_ns,
            slice_ns: head.slice_ns,
            fragments,
        };
        match filter(&data) {
            Err(()) => sock::send(sock.as_fd(), &Msg::Failed { seq }, None, true)?,
            Ok((events, refused)) => {
                let size: usize = events.iter().map(|e| 8 + RESULT_HIT_LEN * e.hits.len()).sum();
                let mut pass = None;
                if results.as_ref().is_none_or(|(_, m)| m.len() < size.max(1)) {
                    results = Some(new_memfd("shoal-events", (size as u64).next_power_of_two().max(1 << 20))?);
                    pass = Some(());
                }
                let (rfd, out) = results.as_mut().expect("set above");
                let mut at = 0;
                for e in &events {
                    out[at..at + 4].copy_from_slice(&e.trigger_mask.to_le_bytes());
                    out[at + 4..at + 8].copy_from_slice(&(e.hits.len() as u32).to_le_bytes());
                    at += 8;
                    for h in &e.hits {
                        let r = &mut out[at..at + RESULT_HIT_LEN];
                        r[0..4].copy_from_slice(&h.source.to_le_bytes());
                        r[4..8].copy_from_slice(&h.time_ns.to_le_bytes());
                        r[8..12].copy_from_slice(&[h.channel, h.amplitude, u8::from(h.triggered), 0]);
                        at += RESULT_HIT_LEN;
                    }
                }
                let m = Msg::Done { seq, events: events.len() as u64, bytes: size as u64, refused };
                sock::send(sock.as_fd(), &m, pass.map(|_| rfd.as_fd()), true)?;
            }
        }
    }
}

fn kind(r: &Recv) -> String {
    match r {
        Recv::Msg(m, _) => format!("{m:?}"),
        Recv::Bad(why) => why.clone(),
        Recv::Empty => "nothing".into(),
        Recv::Closed => "end of file".into(),
    }
}

/// A fragment's bytes in a worker's inbox, owned by a `Bytes`.
struct InboxRange {
    map: std::sync::Arc<Mmap>,
    at: usize,
    len: usize,
}

impl AsRef<[u8]> for InboxRange {
    fn as_ref(&self) -> &[u8] {
        &self.map[self.at..self.at + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(mask: u32, hits: &[(u32, u32)]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(mask.to_le_bytes());
        b.extend((hits.len() as u32).to_le_bytes());
        for (s, t) in hits {
            b.extend(s.to_le_bytes());
            b.extend(t.to_le_bytes());
            b.extend([1, 2, 1, 0]);
        }
        b
    }

    #[test]
    fn results_are_checked_event_by_event() {
        let mut area = event(1, &[(3, 10), (4, 20)]);
        area.extend(event(2, &[])); // no hit
        area.extend(event(1, &[(9, 10)])); // source not in the slice
        area.extend(event(1, &[(3, 5000)])); // past the slice's end
        area.extend(event(4, &[(4, 999)]));
        let (evs, bad) = decode_results(&area, 5, &[3, 4], 1000);
        assert_eq!(bad, 3);
        assert_eq!(evs.len(), 2);
        assert_eq!((evs[0].trigger_mask, evs[0].hits.len(), evs[0].hits[0].triggered), (1, 2, true));
        assert_eq!((evs[1].id, evs[1].trigger_mask), (1, 4));
        // A count past the area's end: what cannot be read is refused.
        let (evs, bad) = decode_results(&area[..20], 3, &[3, 4], 1000);
        assert_eq!((evs.len(), bad), (0, 3));
    }
}
