//! The builder's side: the ring in a memfd, the listening socket, and publication.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant as StdInstant};

use memmap2::MmapMut;
use shoal_core::Instant;
use shoal_core::slicering::layout::{self, Control};
use shoal_core::slicering::msg::Msg;
use shoal_core::slicering::{ConsumerCounters, ConsumerId, Policy, Released, Reserve, RingLedger};

use crate::sock::{self, Recv};

/// Where and how big (`[builder.consumers]`).
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// Abstract socket name (see [`crate::socket_name`]).
    pub socket: String,
    /// Bytes of the ring's data area.
    pub ring_bytes: u64,
    /// Most consumers attached at once; more are refused (counted).
    pub max_consumers: usize,
    /// A `Hold` consumer's bound is cut to this (the builder must still answer STOP).
    pub max_hold: Duration,
    /// Accept consumers of any user. Abstract sockets have no file permissions, so by
    /// default a consumer whose user is not the builder's (or root) is refused.
    pub any_user: bool,
    pub run: u64,
    pub builder: u32,
}

/// What a publisher did in a run.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PublisherReport {
    /// Slices written into the ring (with at least one consumer attached).
    pub published: u64,
    /// Slices not written because nobody was attached.
    pub unwatched: u64,
    /// Slices larger than the ring (skipped for every consumer).
    pub too_large: u64,
    /// Time spent waiting for `Hold` consumers, seconds.
    pub held_s: f64,
    /// Consumers attached in the run.
    pub attached: u64,
    /// Connections refused (too many consumers, a bad hello).
    pub refused: u64,
    /// Consumers dropped for a protocol error or a full socket.
    pub dropped: u64,
    /// Releases of slots a consumer did not hold.
    pub bad_releases: u64,
    /// Per consumer, in attach order.
    pub consumers: Vec<ConsumerCounters>,
}

struct Attached {
    id: ConsumerId,
    fd: OwnedFd,
    hold: bool,
}

/// Publishes slices into the ring. Not `Sync`: one thread publishes; a thread of its own
/// accepts consumers.
pub struct SlicePublisher {
    ledger: RingLedger,
    map: MmapMut,
    attached: Vec<Attached>,
    incoming: mpsc::Receiver<(OwnedFd, Policy, u32)>,
    /// Dropped to stop the acceptor at once (its end then reads end-of-file).
    stop: Option<OwnedFd>,
    refused: Arc<AtomicU64>,
    /// Consumers attached now (the acceptor's limit).
    live: Arc<AtomicUsize>,
    acceptor: Option<std::thread::JoinHandle<()>>,
    epoch: StdInstant,
    report: PublisherReport,
}

impl SlicePublisher {
    /// Creates the memfd ring and starts accepting consumers on the abstract socket.
    pub fn start(cfg: &PublisherConfig) -> io::Result<Self> {
        let ring = cfg.ring_bytes / shoal_core::slicering::SLOT_ALIGN * shoal_core::slicering::SLOT_ALIGN;
        if ring < 4096 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "the slice ring needs at least 4 KiB"));
        }
        let name = format!("shoal-run{:06}-b{}", cfg.run, cfg.builder);
        let memfd = rustix::fs::memfd_create(&name, rustix::fs::MemfdFlags::CLOEXEC)?;
        let file = std::fs::File::from(memfd);
        file.set_len(layout::CONTROL_LEN + ring)?;
        // SAFETY: the memfd is ours and never truncated; consumers map it read-only.
        // Populated now: page faults at start-up, not in the middle of a run.
        let mut map = unsafe { memmap2::MmapOptions::new().populate().map_mut(&file)? };
        Control { data_len: ring, builder: cfg.builder, run: cfg.run }.encode(&mut map[..]);
        store_reclaimed_below(&mut map, 1);
        let memfd: Arc<OwnedFd> = Arc::new(file.into());

        let listener = sock::seqpacket()?;
        rustix::net::bind(&listener, &sock::addr(&cfg.socket)?).map_err(|e| {
            io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("slice consumers socket @{}: {e} (another builder with the same name?)", cfg.socket),
            )
        })?;
        rustix::net::listen(&listener, 16)?;
        let (tx, incoming) = mpsc::channel();
        let (stop, stop_rx) = sock::seqpacket_pair()?;
        let refused = Arc::new(AtomicU64::new(0));
        let live = Arc::new(AtomicUsize::new(0));
        let map_len = layout::CONTROL_LEN + ring;
        let acceptor = {
            let (refused, live, memfd) = (refused.clone(), live.clone(), memfd.clone());
            let (run, builder, max, max_hold, any_user) =
                (cfg.run, cfg.builder as u64, cfg.max_consumers, cfg.max_hold, cfg.any_user);
            std::thread::Builder::new().name(format!("consumers-{builder}")).spawn(move || {
                let welcome = Msg::Welcome { run, builder, map_len };
                accept_loop(listener, memfd, welcome, (max, max_hold, any_user), tx, stop_rx, refused, live)
            })?
        };
        Ok(Self {
            ledger: RingLedger::new(ring),
            map,
            attached: Vec::new(),
            incoming,
            stop: Some(stop),
            refused,
            live,
            acceptor: Some(acceptor),
            epoch: StdInstant::now(),
            report: PublisherReport::default(),
        })
    }

    fn now(&self) -> Instant {
        Instant::from_nanos(self.epoch.elapsed().as_nanos() as u64)
    }

    /// Consumers attached now.
    pub fn consumers(&mut self) -> usize {
        self.take_new_consumers();
        self.attached.len()
    }

    fn take_new_consumers(&mut self) {
        while let Ok((fd, policy, window)) = self.incoming.try_recv() {
            let id = self.ledger.add_consumer(policy, window);
            self.attached.push(Attached { id, fd, hold: matches!(policy, Policy::Hold { .. }) });
            self.report.attached += 1;
        }
    }

    /// Reads every waiting release; drops consumers that closed or misbehaved.
    fn poll_releases(&mut self) {
        let mut gone = Vec::new();
        for (i, a) in self.attached.iter().enumerate() {
            loop {
                let end = match sock::recv(a.fd.as_fd(), false) {
                    Ok(Recv::Msg(Msg::Release { seq }, _)) => {
                        if self.ledger.release(a.id, seq) == Released::NotHeld {
                            self.report.bad_releases += 1;
                        }
                        continue;
                    }
                    Ok(Recv::Empty) => None,
                    Ok(Recv::Closed) => Some(false),
                    Ok(Recv::Msg(other, _)) => {
                        tracing::warn!(?other, "slice consumer sent an unexpected message; dropped");
                        Some(true)
                    }
                    Ok(Recv::Bad(why)) => {
                        tracing::warn!(why, "slice consumer sent a malformed message; dropped");
                        Some(true)
                    }
                    Err(e) => {
                        tracing::warn!(%e, "slice consumer socket failed; dropped");
                        Some(true)
                    }
                };
                if let Some(bad) = end {
                    gone.push((i, bad));
                }
                break;
            }
        }
        for (i, bad) in gone.into_iter().rev() {
            let a = self.attached.remove(i);
            if bad {
                self.report.dropped += 1;
            }
            self.ledger.remove_consumer(a.id);
            self.live.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Publishes one slice: `fragments` are (source, flags, hit_count, payload). Waits for
    /// `Hold` consumers as their bound allows; never fails the caller (what could not be
    /// published is counted).
    pub fn publish(&mut self, slice: u64, slice_start_ns: u64, slice_ns: u64, fragments: &[(u32, u16, u32, &[u8])]) {
        self.take_new_consumers();
        self.poll_releases();
        if self.attached.is_empty() {
            self.report.unwatched += 1;
            return;
        }
        let len = layout::slot_len(fragments.iter().map(|f| f.3.len()));
        let (seq, offset) = loop {
            match self.ledger.reserve(len, self.now()) {
                Reserve::Ready { seq, offset, reclaimed_below } => {
                    store_reclaimed_below(&mut self.map, reclaimed_below);
                    break (seq, offset);
                }
                Reserve::TooLarge => {
                    self.report.too_large += 1;
                    self.ledger.skip_all();
                    return;
                }
                Reserve::Wait { until } => {
                    let t = StdInstant::now();
                    let left = until.saturating_duration_since(self.now());
                    let holders: Vec<_> = self.attached.iter().filter(|a| a.hold).map(|a| a.fd.as_fd()).collect();
                    let _ = sock::wait_readable(&holders, Some(left.max(Duration::from_micros(100))));
                    self.report.held_s += t.elapsed().as_secs_f64();
                    self.poll_releases();
                }
            }
        };
        let start = (layout::CONTROL_LEN + offset) as usize;
        let slot = &mut self.map[start..start + len as usize];
        layout::write_slot(slot, seq, (slice, slice_start_ns, slice_ns), fragments);
        self.report.published += 1;
        let recipients = self.ledger.offer(seq);
        let m = Msg::Slice { seq, offset: start as u64, len, slice };
        let mut stuck = Vec::new();
        for (i, a) in self.attached.iter().enumerate() {
            if recipients.contains(&a.id) && sock::send(a.fd.as_fd(), &m, None, false).is_err() {
                // Its socket is full or gone: it is not reading its messages at all.
                stuck.push(i);
            }
        }
        for i in stuck.into_iter().rev() {
            let a = self.attached.remove(i);
            self.report.dropped += 1;
            self.ledger.remove_consumer(a.id);
            self.live.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Ends the run: every consumer is told (with its counters) and closed.
    pub fn finish(mut self) -> PublisherReport {
        self.take_new_consumers();
        self.poll_releases();
        // `Hold` consumers are waited for, up to their bound, for the slices they still
        // hold: their counters then say what they really did.
        while let Some(until) = self.ledger.hold_deadline() {
            let left = until.saturating_duration_since(self.now());
            if left.is_zero() {
                break;
            }
            let t = StdInstant::now();
            let holders: Vec<_> = self.attached.iter().filter(|a| a.hold).map(|a| a.fd.as_fd()).collect();
            let _ = sock::wait_readable(&holders, Some(left));
            self.report.held_s += t.elapsed().as_secs_f64();
            self.poll_releases();
        }
        for a in &self.attached {
            if let Some(c) = self.ledger.counters(a.id) {
                let _ = sock::send(
                    a.fd.as_fd(),
                    &Msg::End { offered: c.offered, skipped: c.skipped, overrun: c.overrun },
                    None,
                    false,
                );
            }
        }
        self.stop = None;
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
        let mut report = std::mem::take(&mut self.report);
        report.refused = self.refused.load(Ordering::Relaxed);
        report.consumers = self.ledger.all_counters().into_iter().map(|(_, c)| c).collect();
        report
    }
}

impl Drop for SlicePublisher {
    fn drop(&mut self) {
        self.stop = None;
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
    }
}

/// Stores the ring's `reclaimed_below` with release ordering: a consumer that reads it
/// (acquire) after reading a slot and sees a number at or below the slot's knows no byte
/// of it was reused meanwhile.
fn store_reclaimed_below(map: &mut MmapMut, v: u64) {
    let p = map[layout::RECLAIMED_BELOW_AT..].as_mut_ptr() as *mut u64;
    // SAFETY: the offset is 8-aligned in a page-aligned mapping that lives as long as `map`;
    // other processes only read this word, atomically.
    let a = unsafe { AtomicU64::from_ptr(p) };
    a.store(v, Ordering::Release);
}

#[allow(clippy::too_many_arguments)]
fn accept_loop(
    listener: OwnedFd,
    memfd: Arc<OwnedFd>,
    welcome: Msg,
    (max, max_hold, any_user): (usize, Duration, bool),
    tx: mpsc::Sender<(OwnedFd, Policy, u32)>,
    stop: OwnedFd,
    refused: Arc<AtomicU64>,
    live: Arc<AtomicUsize>,
) {
    loop {
        // A connection, or the publisher's end of `stop` closed (then this end reads EOF).
        match sock::wait_readable(&[listener.as_fd(), stop.as_fd()], None) {
            Ok(r) if r.contains(&1) => break,
            Ok(r) if r.is_empty() => continue,
            Ok(_) => {}
            Err(_) => break,
        }
        let Ok(conn) = rustix::net::accept_with(&listener, rustix::net::SocketFlags::CLOEXEC) else { continue };
        if !any_user {
            let me = rustix::process::getuid();
            match rustix::net::sockopt::socket_peercred(&conn) {
                Ok(peer) if peer.uid == me || peer.uid.is_root() => {}
                other => {
                    let uid = other.map(|p| p.uid.as_raw().to_string()).unwrap_or_else(|e| e.to_string());
                    tracing::warn!(uid, "slice consumer of another user refused (builder.consumers.any_user)");
                    refused.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            }
        }
        // The hello comes right after connect; one that does not come in a second is refused.
        let hello = match sock::wait_readable(&[conn.as_fd()], Some(Duration::from_secs(1))) {
            Ok(r) if !r.is_empty() => sock::recv(conn.as_fd(), false),
            _ => Ok(Recv::Empty),
        };
        let (policy, window) = match hello {
            Ok(Recv::Msg(Msg::Hello { policy: 0, hold_ms, window }, _)) => {
                (Policy::Hold { max: Duration::from_millis(hold_ms).min(max_hold) }, window.clamp(1, 1 << 20) as u32)
            }
            Ok(Recv::Msg(Msg::Hello { policy: 1, window, .. }, _)) => (Policy::Skip, window.clamp(1, 1 << 20) as u32),
            other => {
                let what = match other {
                    Ok(Recv::Bad(why)) => why,
                    Ok(Recv::Msg(m, _)) => format!("{m:?} instead of a hello"),
                    _ => "no hello".into(),
                };
                tracing::warn!(what, "slice consumer refused");
                refused.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        if live.load(Ordering::Relaxed) >= max {
            tracing::warn!(max, "slice consumer refused: too many attached");
            refused.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        if sock::send(conn.as_fd(), &welcome, Some(memfd.as_fd()), true).is_err() {
            refused.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        live.fetch_add(1, Ordering::Relaxed);
        if tx.send((conn, policy, window)).is_err() {
            break;
        }
    }
}
