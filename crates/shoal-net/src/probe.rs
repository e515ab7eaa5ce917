//! The switch buffer probe on real sockets: the senders' daemon ([`serve_sender`]) and the
//! receiver that drives the floods and analyses them ([`measure`]).
//!
//! Plain blocking UDP sockets on threads of their own, not tokio: a sender paces datagrams
//! to a few microseconds and the receiver reads kernel receive timestamps
//! (`SO_TIMESTAMPNS`), so the arrival times are those of the packets, not of the reads.
//! What the floods mean is decided in `shoal_core::probe`.

use std::collections::BTreeMap;
use std::io::IoSliceMut;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use nix::sys::socket::{ControlMessageOwned, MsgFlags, SockaddrStorage, recvmsg, setsockopt, sockopt};
use shoal_core::probe::{
    Arrival, BufferVerdict, End, FRAME_OVERHEAD, FloodEstimate, Go, ProbeMessage, analyse_flood, base_delays, classify,
    pace_interval_ns,
};

/// Calibration datagrams each sender sends before its flood, and their spacing.
const CALIBRATION_DATAGRAMS: u32 = 10;
const CALIBRATION_SPACING: Duration = Duration::from_millis(2);
/// From a GO to the flood: room for the calibration datagrams of every sender.
const START_AFTER: Duration = Duration::from_millis(60);
/// From a sender's last data datagram to its END reports: the buffer drains meanwhile.
const DRAIN_WAIT: Duration = Duration::from_millis(200);
const END_REPEATS: u32 = 5;
/// The longest flood a sender accepts to send (an order is a datagram anyone could send).
const MAX_FLOOD: Duration = Duration::from_secs(60);

fn unix_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// What a sender daemon did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SenderReport {
    pub rounds: u32,
    pub datagrams_sent: u64,
    /// Sends the kernel refused (a full host queue): not counted as sent.
    pub send_errors: u64,
    /// Datagrams on the port that were not probe orders (counted and ignored).
    pub malformed: u64,
}

/// Waits on `listen` for the receiver's orders and floods it, `rounds` times; gives up
/// after `idle_exit` without an order.
pub fn serve_sender(listen: SocketAddr, rounds: u32, idle_exit: Duration) -> anyhow::Result<SenderReport> {
    let socket = UdpSocket::bind(listen).with_context(|| format!("binding {listen}"))?;
    socket.set_read_timeout(Some(Duration::from_millis(200)))?;
    let mut report = SenderReport::default();
    let mut last_round: Option<u16> = None;
    let mut idle_since = Instant::now();
    let mut buf = [0u8; 2048];
    while report.rounds < rounds {
        if idle_since.elapsed() > idle_exit {
            anyhow::bail!("no order from a receiver in {idle_exit:?} (after {} rounds)", report.rounds);
        }
        let (n, from) = match socket.recv_from(&mut buf) {
            Ok(x) => x,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(e) => return Err(e).context("receiving an order"),
        };
        let received_at = Instant::now();
        let go = match ProbeMessage::decode(&buf[..n]) {
            Ok(ProbeMessage::Go(go)) => go,
            Ok(ProbeMessage::Ping(p)) => {
                let _ = socket.send_to(&ProbeMessage::Pong(p).encode(0), from);
                idle_since = Instant::now();
                continue;
            }
            Ok(other) => {
                tracing::debug!(?other, "not an order");
                report.malformed += 1;
                continue;
            }
            Err(e) => {
                tracing::warn!(%from, "ignoring a datagram: {e}");
                report.malformed += 1;
                continue;
            }
        };
        if go.flood_ns() > MAX_FLOOD.as_nanos() {
            tracing::warn!(%from, "refusing an order for a flood of {} s (at most {MAX_FLOOD:?})", go.flood_ns() / 1_000_000_000);
            report.malformed += 1;
            continue;
        }
        // The receiver sends each order twice in case one is lost: one flood per round.
        if last_round == Some(go.round) {
            continue;
        }
        last_round = Some(go.round);
        flood(&socket, from, go, received_at, &mut report)?;
        report.rounds += 1;
        idle_since = Instant::now();
    }
    Ok(report)
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

/// Calibration datagrams, the paced flood, then (after the buffer drained) the END reports.
fn flood(
    socket: &UdpSocket,
    to: SocketAddr,
    go: Go,
    received_at: Instant,
    report: &mut SenderReport,
) -> anyhow::Result<()> {
    let send = |m: ProbeMessage, report: &mut SenderReport| -> bool {
        match socket.send_to(&m.encode(go.payload), to) {
            Ok(_) => true,
            Err(e) => {
                tracing::debug!("send: {e}");
                report.send_errors += 1;
                false
            }
        }
    };
    // Calibration: spaced, each sender at its own phase, while the port is idle.
    let phase = Duration::from_micros(150 * u64::from(go.sender % 10));
    for k in 0..CALIBRATION_DATAGRAMS {
        sleep_until(received_at + phase + CALIBRATION_SPACING * k);
        send(
            ProbeMessage::Calib(shoal_core::probe::Stamp {
                sender: go.sender,
                round: go.round,
                seq: k,
                send_ns: unix_ns(),
            }),
            report,
        );
    }
    let start = received_at + Duration::from_micros(u64::from(go.start_after_us));
    let interval = Duration::from_nanos(pace_interval_ns(u32::from(go.payload) + FRAME_OVERHEAD, go.pace_bps));
    let mut sent = 0u32;
    let mut last_send_ns = 0;
    for seq in 0..go.count {
        // Sleeping to each due time; when woken late, the datagrams due go at once.
        sleep_until(start + interval * seq);
        let send_ns = unix_ns();
        if send(
            ProbeMessage::Data(shoal_core::probe::Stamp { sender: go.sender, round: go.round, seq, send_ns }),
            report,
        ) {
            sent += 1;
            last_send_ns = send_ns;
        }
    }
    report.datagrams_sent += u64::from(sent);
    let done = Instant::now();
    let end = ProbeMessage::End(End { sender: go.sender, round: go.round, sent: go.count, last_send_ns });
    for k in 0..END_REPEATS {
        sleep_until(done + DRAIN_WAIT + Duration::from_millis(5) * k);
        send(end, report);
    }
    Ok(())
}

/// A receiver's floods.
#[derive(Clone, Debug)]
pub struct ProbeOptions {
    /// The sender daemons (`shoal probe-switch send`).
    pub senders: Vec<SocketAddr>,
    /// The receiver's own address (the port behind the switch port under test).
    pub bind: SocketAddr,
    /// Each sender's pace, bits per second of Ethernet frames: the probed port's rate, so
    /// that N senders overload it N times.
    pub pace_bps: u64,
    pub flood: Duration,
    /// UDP payload of the large and of the small datagrams.
    pub large_payload: u16,
    pub small_payload: u16,
}

/// One flood as the receiver saw it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct FloodRecord {
    pub payload: u16,
    pub calibration_received: u64,
    pub data_received: u64,
    pub ends_received: u64,
    /// Datagrams without a kernel timestamp (their read time was used).
    pub unstamped: u64,
    pub malformed: u64,
    pub estimate: Option<FloodEstimate>,
    pub error: Option<String>,
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ProbeReport {
    pub floods: Vec<FloodRecord>,
    pub verdict: Option<BufferVerdict>,
}

/// Receives one datagram with its kernel timestamp; None on the read timeout.
fn recv_stamped(socket: &UdpSocket, buf: &mut [u8]) -> std::io::Result<Option<(usize, Option<u64>)>> {
    let mut space = nix::cmsg_space!(nix::sys::time::TimeSpec);
    let mut iov = [IoSliceMut::new(buf)];
    match recvmsg::<SockaddrStorage>(socket.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::empty()) {
        Ok(msg) => {
            let stamp = msg.cmsgs().ok().and_then(|mut c| {
                c.find_map(|m| match m {
                    ControlMessageOwned::ScmTimestampns(ts) => {
                        Some(ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64)
                    }
                    _ => None,
                })
            });
            Ok(Some((msg.bytes, stamp)))
        }
        Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Pings every sender until each has answered (bounded): the daemons are up, and the
/// addresses on both paths are resolved, so that no order waits for ARP and every sender
/// starts its flood at the same time.
fn ping_senders(socket: &UdpSocket, senders: &[SocketAddr]) -> anyhow::Result<()> {
    let mut answered = vec![false; senders.len()];
    let mut buf = [0u8; 2048];
    for attempt in 0..100u32 {
        for (i, to) in senders.iter().enumerate().filter(|(i, _)| !answered[*i]) {
            let ping = shoal_core::probe::Stamp { sender: i as u16, round: 0, seq: attempt, send_ns: unix_ns() };
            socket.send_to(&ProbeMessage::Ping(ping).encode(0), to).with_context(|| format!("pinging sender {to}"))?;
        }
        let until = Instant::now() + Duration::from_millis(50);
        while Instant::now() < until {
            let Some((n, _)) = recv_stamped(socket, &mut buf)? else { continue };
            if let Ok(ProbeMessage::Pong(p)) = ProbeMessage::decode(&buf[..n])
                && let Some(a) = answered.get_mut(usize::from(p.sender))
            {
                *a = true;
            }
        }
        if answered.iter().all(|a| *a) {
            return Ok(());
        }
    }
    let missing: Vec<String> =
        senders.iter().zip(&answered).filter(|(_, a)| !**a).map(|(s, _)| s.to_string()).collect();
    anyhow::bail!(
        "no answer from sender(s) {} in 5 s (is `shoal probe-switch send` running there?)",
        missing.join(", ")
    )
}

/// Floods the receiver with large, then with small datagrams, and names the buffer.
pub fn measure(opts: &ProbeOptions) -> anyhow::Result<ProbeReport> {
    anyhow::ensure!(opts.senders.len() >= 2, "the probe needs at least two senders to overload one port");
    let socket = UdpSocket::bind(opts.bind).with_context(|| format!("binding {}", opts.bind))?;
    socket.set_read_timeout(Some(Duration::from_millis(20)))?;
    setsockopt(&socket, sockopt::ReceiveTimestampns, &true).context("asking for receive timestamps")?;
    let rcvbuf = 64 << 20;
    if setsockopt(&socket, sockopt::RcvBufForce, &rcvbuf).is_err() {
        setsockopt(&socket, sockopt::RcvBuf, &rcvbuf).context("receive buffer")?;
    }
    ping_senders(&socket, &opts.senders)?;
    let mut floods = Vec::new();
    for (round, payload) in [opts.large_payload, opts.small_payload].into_iter().enumerate() {
        floods.push(one_flood(&socket, opts, round as u16, payload)?);
    }
    let verdict = match (floods[0].estimate, floods[1].estimate) {
        (Some(large), Some(small)) => Some(classify(large, small)),
        _ => None,
    };
    Ok(ProbeReport { floods, verdict })
}

fn one_flood(socket: &UdpSocket, opts: &ProbeOptions, round: u16, payload: u16) -> anyhow::Result<FloodRecord> {
    let frame = u32::from(payload) + FRAME_OVERHEAD;
    let count = ((opts.flood.as_nanos() as u64 / pace_interval_ns(frame, opts.pace_bps)).max(1))
        .min(u64::from(u32::MAX)) as u32;
    for (i, to) in opts.senders.iter().enumerate() {
        let go = Go {
            sender: i as u16,
            round,
            payload,
            count,
            pace_bps: opts.pace_bps,
            start_after_us: START_AFTER.as_micros() as u32,
        };
        for _ in 0..2 {
            socket.send_to(&ProbeMessage::Go(go).encode(0), to).with_context(|| format!("ordering sender {to}"))?;
        }
    }
    // Bounded: the flood, the drain wait, the reports, and a margin for a late sender.
    let deadline = Instant::now() + START_AFTER + opts.flood + DRAIN_WAIT + Duration::from_secs(3);
    let mut record = FloodRecord {
        payload,
        calibration_received: 0,
        data_received: 0,
        ends_received: 0,
        unstamped: 0,
        malformed: 0,
        estimate: None,
        error: None,
    };
    let (mut calibration, mut data) = (Vec::new(), Vec::new());
    let mut ends: BTreeMap<u16, End> = BTreeMap::new();
    let mut buf = vec![0u8; 65536];
    while Instant::now() < deadline && ends.len() < opts.senders.len() {
        let Some((n, stamp)) = recv_stamped(socket, &mut buf).context("receiving the flood")? else { continue };
        let arrival_ns = stamp.unwrap_or_else(|| {
            record.unstamped += 1;
            unix_ns()
        });
        match ProbeMessage::decode(&buf[..n]) {
            Ok(ProbeMessage::Calib(s)) if s.round == round => {
                record.calibration_received += 1;
                calibration.push(Arrival::of(s, arrival_ns, n));
            }
            Ok(ProbeMessage::Data(s)) if s.round == round => {
                record.data_received += 1;
                data.push(Arrival::of(s, arrival_ns, n));
            }
            Ok(ProbeMessage::End(e)) if e.round == round => {
                record.ends_received += u64::from(ends.insert(e.sender, e).is_none());
            }
            // An END repeat of the round before, or a stray datagram.
            Ok(_) => {}
            Err(e) => {
                tracing::warn!("ignoring a datagram: {e}");
                record.malformed += 1;
            }
        }
    }
    // The senders repeat their END reports: let them finish before the next order, or the
    // sender still repeating would start its next flood late.
    std::thread::sleep(Duration::from_millis(5) * END_REPEATS + Duration::from_millis(20));
    match analyse_flood(&data, &base_delays(&calibration), &ends) {
        Ok(e) => record.estimate = Some(e),
        Err(e) => record.error = Some(e.to_string()),
    }
    Ok(record)
}
