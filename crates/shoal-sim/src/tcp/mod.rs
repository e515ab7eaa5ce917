//! A NewReno TCP model (RFC 5681 + RFC 6582 + RFC 6298), one direction of data.
//!
//! Sequence numbers are `u64` byte offsets from 0 (no wrap-around, no handshake: the
//! connection is persistent and established). The sender does slow start and congestion
//! avoidance with byte counting, fast retransmit on three duplicate ACKs, NewReno fast
//! recovery (partial ACKs retransmit the next hole), and a retransmission timeout with
//! exponential backoff (minimum 200 ms, initial 1 s, Karn's rule for RTT samples); after a
//! timeout it goes back to the first unacknowledged byte. The receiver acknowledges every
//! second full segment or after the delayed-ACK timeout, at once when a segment is out of
//! order or fills a hole, and advertises a fixed window.
//!
//! With [`TcpConfig::rack_tlp`] the sender also recovers as Linux does by default (RFC 8985),
//! to the extent a model without SACK blocks can: a tail-loss probe 2 SRTT after the last
//! transmission (the next new segment, or the last one again), so a loss at the end of a
//! burst is repaired without waiting for the 200 ms timeout; and a RACK-style loss
//! detection that needs one duplicate ACK, not three: the first unacknowledged segment is
//! lost once a quarter of the minimum RTT has passed after a later segment arrived.
//!
//! With [`TcpConfig::sack`] as well, loss recovery is Linux's in full (RFC 6675 + RFC 8985,
//! [`sack`]): the receiver reports up to three SACK blocks, the sender keeps a scoreboard,
//! RACK marks every segment lost that was sent before one since delivered (a burst of drops
//! at once, not one per round trip), recovery sends by the pipe (lost segments first, then
//! new data) with the window at half the flight, and a timeout resends only what was not
//! SACKed, in slow start.
//!
//! Differences from Linux (see docs/simulation.md): no timestamps, no CUBIC (Linux
//! default), no proportional rate reduction (the window drops to half at once), no DSACK
//! undo, no pacing, no TSO/GRO, a fixed receive window, no handshake or slow start after
//! idle.

pub mod sack;

use std::collections::BTreeMap;

use shoal_core::{Duration, Instant};

pub use sack::SackBlocks;
use sack::Scoreboard;

/// Linux's floor under the tail-loss probe's and RACK's reordering timeouts
/// (`TCP_TIMEOUT_MIN_US`).
const TIMEOUT_FLOOR: Duration = Duration::from_millis(2);

/// TCP parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TcpConfig {
    pub mss: u32,
    /// Initial congestion window in segments (Linux: 10).
    pub initial_window: u32,
    /// The receiver's advertised window in bytes.
    pub rwnd: u64,
    pub min_rto: Duration,
    pub initial_rto: Duration,
    pub max_rto: Duration,
    /// Delayed-ACK timeout (Linux: 40 ms minimum).
    pub delayed_ack: Duration,
    /// Tail-loss probes and RACK-style loss detection (Linux's defaults), besides NewReno.
    pub rack_tlp: bool,
    /// SACK blocks, a scoreboard and RACK's time-based loss marking (with `rack_tlp`:
    /// Linux's loss recovery in full).
    pub sack: bool,
    /// The kernel's timer tick (a jiffy: 4 ms at `CONFIG_HZ=250`), where Linux counts the
    /// tail-loss probe's and RACK's reordering timeouts: each with its 2-ms floor added,
    /// then rounded up to whole ticks (Linux since 6.6, "tcp: fix excessive TLP and RACK
    /// timeouts from HZ rounding"). None: exact, the probe plus 2 ms and the reordering
    /// timer with no floor (the model before).
    pub tick: Option<Duration>,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            mss: 1460,
            initial_window: 10,
            rwnd: 4 << 20,
            min_rto: Duration::from_millis(200),
            initial_rto: Duration::from_secs(1),
            max_rto: Duration::from_secs(60),
            delayed_ack: Duration::from_millis(40),
            rack_tlp: false,
            sack: false,
            tick: None,
        }
    }
}

/// IP + TCP header bytes.
pub const HEADER: u32 = 40;

/// A data segment to put on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub seq: u64,
    pub len: u32,
    pub retransmission: bool,
}

/// Sender counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SenderStats {
    pub segments: u64,
    pub retransmitted: u64,
    pub timeouts: u64,
    pub fast_retransmits: u64,
    /// Tail-loss probes sent (Linux's TCPLossProbes).
    pub loss_probes: u64,
}

/// The sending side of one connection.
#[derive(Debug)]
pub struct TcpSender {
    cfg: TcpConfig,
    una: u64,
    nxt: u64,
    /// Highest sequence ever sent (for counting retransmissions).
    high: u64,
    /// Bytes the application has written.
    app_end: u64,
    cwnd: u64,
    ssthresh: u64,
    dupacks: u32,
    recover: u64,
    in_recovery: bool,
    srtt: Option<Duration>,
    rttvar: Duration,
    rto: Duration,
    /// (sequence that completes the sample, send time); cleared on retransmission.
    rtt_probe: Option<(u64, Instant)>,
    /// The retransmission timeout.
    timer: Option<Instant>,
    /// With `rack_tlp`: when the tail-loss probe goes, and the end of the flight when it
    /// went (one probe per flight until that is acknowledged).
    probe_at: Option<Instant>,
    probe_high: Option<u64>,
    probe_was_retransmission: bool,
    /// With `rack_tlp`: when the first unacknowledged segment counts as lost after a
    /// duplicate ACK.
    rack_at: Option<Instant>,
    min_rtt: Option<Duration>,
    /// With `sack`: the segments in flight, and whether a timeout's recovery (every
    /// segment not SACKed resent in slow start) is under way.
    board: Scoreboard,
    in_loss: bool,
    /// With `sack`: proportional rate reduction in recovery (RFC 6937, as Linux): the
    /// window when recovery began, bytes delivered and sent since.
    prr_prior_cwnd: u64,
    prr_delivered: u64,
    prr_out: u64,
    pub stats: SenderStats,
}

impl TcpSender {
    pub fn new(cfg: TcpConfig) -> Self {
        Self {
            cfg,
            una: 0,
            nxt: 0,
            high: 0,
            app_end: 0,
            cwnd: u64::from(cfg.initial_window * cfg.mss),
            ssthresh: u64::MAX,
            dupacks: 0,
            recover: 0,
            in_recovery: false,
            srtt: None,
            rttvar: Duration::ZERO,
            rto: cfg.initial_rto,
            rtt_probe: None,
            timer: None,
            probe_at: None,
            probe_high: None,
            probe_was_retransmission: false,
            rack_at: None,
            min_rtt: None,
            board: Scoreboard::default(),
            in_loss: false,
            prr_prior_cwnd: 0,
            prr_delivered: 0,
            prr_out: 0,
            stats: SenderStats::default(),
        }
    }

    /// The application writes `bytes` more (socket buffer is not limited in this model).
    pub fn write(&mut self, bytes: u64) {
        self.app_end += bytes;
    }

    pub fn acked(&self) -> u64 {
        self.una
    }

    pub fn written(&self) -> u64 {
        self.app_end
    }

    pub fn cwnd(&self) -> u64 {
        self.cwnd
    }

    fn mss(&self) -> u64 {
        u64::from(self.cfg.mss)
    }

    fn flight(&self) -> u64 {
        self.nxt - self.una
    }

    /// When the next timer fires (retransmission timeout, tail-loss probe or RACK's loss
    /// detection), if one is armed.
    pub fn timer(&self) -> Option<Instant> {
        [self.timer, self.probe_at, self.rack_at].into_iter().flatten().min()
    }

    /// Segments the windows allow now.
    pub fn poll_segments(&mut self, now: Instant, out: &mut Vec<Segment>) {
        if self.cfg.sack {
            return self.poll_by_pipe(now, out);
        }
        let wnd = self.cwnd.min(self.cfg.rwnd);
        let before = self.nxt;
        while self.nxt < self.app_end && self.flight() < wnd {
            let len = (self.app_end - self.nxt).min(self.mss()).min(wnd - self.flight());
            if len < self.mss() && self.nxt + len < self.app_end {
                break; // window too small for a full segment and more data follows: wait
            }
            self.emit(now, self.nxt, len as u32, out);
            self.nxt += len;
        }
        if self.nxt > before {
            self.schedule_probe(now);
        }
    }

    /// With SACK (RFC 6675): while the pipe is below the window, segments marked lost
    /// first, then new data.
    fn poll_by_pipe(&mut self, now: Instant, out: &mut Vec<Segment>) {
        let mss = self.mss();
        let before = self.nxt;
        while self.board.pipe() < self.cwnd {
            if let Some((seq, len)) = self.board.first_lost() {
                self.emit(now, seq, len, out);
                continue;
            }
            if self.nxt >= self.app_end || self.flight() >= self.cfg.rwnd {
                break;
            }
            let len = (self.app_end - self.nxt).min(mss).min(self.cfg.rwnd - self.flight());
            if len < mss && self.nxt + len < self.app_end {
                break; // receive window too small for a full segment and more data follows
            }
            self.emit(now, self.nxt, len as u32, out);
            self.nxt += len;
        }
        if self.nxt > before {
            self.schedule_probe(now);
        }
    }

    /// Linux's schedule of the tail-loss probe: 2 SRTT after the last transmission or ACK,
    /// plus the minimum RTO when a single segment is in flight (its ACK may be delayed),
    /// else plus 2 ms; never after the retransmission timeout. Not in recovery, not before
    /// an RTT is known, one probe per flight.
    fn schedule_probe(&mut self, now: Instant) {
        self.probe_at = None;
        if !self.cfg.rack_tlp || self.in_recovery || self.una >= self.nxt || self.probe_high.is_some() {
            return;
        }
        let Some(srtt) = self.srtt else { return };
        let extra = if self.flight() <= self.mss() { self.cfg.min_rto } else { TIMEOUT_FLOOR };
        let at = now + self.in_ticks(srtt * 2 + extra);
        self.probe_at = Some(self.timer.map_or(at, |rto| at.min(rto)));
    }

    /// The kernel's tick, if timers count in ticks.
    fn kernel_tick(&self) -> Option<Duration> {
        self.cfg.tick.filter(|t| !t.is_zero())
    }

    /// How long a kernel timer set for `wait` takes: whole ticks, rounded up (Linux's
    /// `usecs_to_jiffies`); exact without a tick.
    fn in_ticks(&self, wait: Duration) -> Duration {
        match self.kernel_tick() {
            Some(tick) => Duration::from_nanos((wait.as_nanos().div_ceil(tick.as_nanos()) * tick.as_nanos()) as u64),
            None => wait,
        }
    }

    /// RACK's reordering timer for a segment whose time is up at `due` (Linux's
    /// `tcp_rack_mark_lost`: the time left plus the 2-ms floor, in ticks); exact without
    /// a tick (the model before).
    fn reordering_timer(&self, now: Instant, due: Instant) -> Instant {
        match self.kernel_tick() {
            Some(_) => now + self.in_ticks(due.saturating_duration_since(now) + TIMEOUT_FLOOR),
            None => due,
        }
    }

    /// The tail-loss probe: the next new segment if there is one (whatever the window),
    /// else the last segment again.
    fn send_probe(&mut self, now: Instant, out: &mut Vec<Segment>) {
        self.stats.loss_probes += 1;
        let mss = self.mss();
        if self.nxt < self.app_end {
            let len = (self.app_end - self.nxt).min(mss);
            self.emit(now, self.nxt, len as u32, out);
            self.nxt += len;
            self.probe_was_retransmission = false;
        } else if self.cfg.sack {
            if let Some((seq, len)) = self.board.last_unsacked() {
                self.emit(now, seq, len, out);
            }
            self.probe_was_retransmission = true;
        } else {
            let len = (self.nxt - self.una).min(mss);
            self.emit(now, self.nxt - len, len as u32, out);
            self.probe_was_retransmission = true;
        }
        self.probe_high = Some(self.nxt);
        self.timer = Some(now + self.rto);
    }

    /// Fast retransmit of the first unacknowledged segment and NewReno fast recovery.
    fn enter_recovery(&mut self, now: Instant, out: &mut Vec<Segment>) {
        let mss = self.mss();
        self.stats.fast_retransmits += 1;
        self.ssthresh = (self.flight() / 2).max(2 * mss);
        self.recover = self.nxt;
        self.in_recovery = true;
        self.probe_at = None;
        self.rack_at = None;
        self.emit(now, self.una, (self.nxt - self.una).min(mss) as u32, out);
        self.cwnd = self.ssthresh + 3 * mss;
    }

    /// With SACK: RACK marked segments lost. The target window is half the flight; the
    /// rate comes down to it in proportion to what is delivered (PRR), not at once, so a
    /// window that lost most of its segments does not resend them in one burst.
    fn enter_sack_recovery(&mut self) {
        self.stats.fast_retransmits += 1;
        self.ssthresh = (self.flight() / 2).max(2 * self.mss());
        self.prr_prior_cwnd = self.cwnd.max(1);
        self.prr_delivered = 0;
        self.prr_out = 0;
        self.recover = self.nxt;
        self.in_recovery = true;
        self.probe_at = None;
    }

    /// RFC 6937 as Linux's `tcp_cwnd_reduction` does it, for an ACK that delivered
    /// `delivered` bytes: above the target, send in proportion to what was delivered;
    /// below, grow back towards it no faster than slow start (PRR-SSRB); and the first
    /// segment of a recovery goes at once (the fast retransmit).
    fn prr_window(&mut self, delivered: u64, una_advanced: bool, newly_lost: bool) {
        let mss = self.mss();
        let pipe = self.board.pipe();
        self.prr_delivered += delivered;
        let mut sndcnt = if delivered == 0 {
            0
        } else if pipe > self.ssthresh {
            (self.ssthresh * self.prr_delivered).div_ceil(self.prr_prior_cwnd).saturating_sub(self.prr_out)
        } else {
            let bound = self.prr_delivered.saturating_sub(self.prr_out).max(delivered)
                + if una_advanced && !newly_lost { mss } else { 0 };
            bound.min(self.ssthresh - pipe)
        };
        if self.prr_out == 0 {
            sndcnt = sndcnt.max(mss);
        }
        if delivered > 0 || self.prr_out == 0 {
            self.cwnd = pipe + sndcnt;
        }
    }

    /// RACK's reordering window (Linux's `tcp_rack_reo_wnd`, no reordering ever seen):
    /// none in recovery or once three segments are SACKed, else a quarter of the minimum
    /// round trip.
    fn reo_wnd(&self) -> Duration {
        if self.in_recovery || self.in_loss || self.board.sacked_segments() >= 3 {
            return Duration::ZERO;
        }
        self.min_rtt.map_or(Duration::ZERO, |m| m / 4)
    }

    /// With SACK: marks what RACK finds lost, enters recovery if something is, and sets
    /// the window of a recovery for an ACK that delivered `delivered` bytes.
    fn detect_losses(&mut self, now: Instant, delivered: u64, una_advanced: bool) {
        let lost_before = self.board.lost();
        self.rack_at = self.board.detect_loss(now, self.reo_wnd()).map(|due| self.reordering_timer(now, due));
        let newly_lost = self.board.lost() > lost_before;
        if self.board.lost() > 0 && !self.in_recovery && !self.in_loss {
            self.enter_sack_recovery();
        }
        if self.in_recovery {
            self.prr_window(delivered, una_advanced, newly_lost);
        }
    }

    fn emit(&mut self, now: Instant, seq: u64, len: u32, out: &mut Vec<Segment>) {
        let retransmission = seq < self.high;
        if self.cfg.sack {
            if self.in_recovery {
                self.prr_out += u64::from(len);
            }
            if retransmission {
                self.board.resent(now, seq);
            } else {
                self.board.sent(now, seq, len);
            }
        }
        self.stats.segments += 1;
        if retransmission {
            self.stats.retransmitted += 1;
            // Karn: no RTT sample across a retransmission.
            self.rtt_probe = None;
        } else if self.rtt_probe.is_none() {
            self.rtt_probe = Some((seq + u64::from(len), now));
        }
        self.high = self.high.max(seq + u64::from(len));
        if self.timer.is_none() {
            self.timer = Some(now + self.rto);
        }
        out.push(Segment { seq, len, retransmission });
    }

    /// An ACK for everything below `ack`: the RTT sample, if it completes the one timed.
    fn take_rtt_sample(&mut self, now: Instant, ack: u64) {
        if let Some((probe, sent)) = self.rtt_probe
            && ack >= probe
        {
            self.sample_rtt(now - sent);
            self.rtt_probe = None;
        }
    }

    fn sample_rtt(&mut self, r: Duration) {
        self.min_rtt = Some(self.min_rtt.map_or(r, |m| m.min(r)));
        match self.srtt {
            None => {
                self.srtt = Some(r);
                self.rttvar = r / 2;
            }
            Some(s) => {
                let diff = s.abs_diff(r);
                self.rttvar = (self.rttvar * 3 + diff) / 4;
                self.srtt = Some((s * 7 + r) / 8);
            }
        }
        let s = self.srtt.expect("set above");
        self.rto = if self.cfg.sack {
            // Linux (`tcp_rtt_estimator`): the variance term is at least the minimum RTO, so
            // the timeout is the minimum plus the smoothed RTT, never exactly the minimum.
            // That matters in an incast: a timeout of exactly 200 ms keeps a lost segment's
            // resend in phase with a slice period that divides it, every backoff again.
            (s + (self.rttvar * 4).max(self.cfg.min_rto)).min(self.cfg.max_rto)
        } else {
            (s + (self.rttvar * 4).max(Duration::from_millis(1))).clamp(self.cfg.min_rto, self.cfg.max_rto)
        };
    }

    /// The tail-loss probe's flight is acknowledged up to `ack`. Had the probe repaired a
    /// loss (it was a retransmission), Linux reduces the window as after a fast recovery.
    fn probe_acknowledged(&mut self, ack: u64) {
        if let Some(high) = self.probe_high
            && ack >= high
        {
            if self.probe_was_retransmission && !self.in_recovery {
                self.ssthresh = (self.cwnd / 2).max(2 * self.mss());
                self.cwnd = self.ssthresh;
            }
            self.probe_high = None;
        }
    }

    /// An ACK arrived acknowledging everything below `ack` and the ranges in `sack` (read
    /// only with [`TcpConfig::sack`]).
    pub fn handle_ack(&mut self, now: Instant, ack: u64, sack: &SackBlocks, out: &mut Vec<Segment>) {
        if self.cfg.sack {
            return self.handle_ack_with_sack(now, ack, sack, out);
        }
        let mss = self.mss();
        if ack > self.una {
            let acked = ack - self.una;
            self.take_rtt_sample(now, ack);
            self.una = ack;
            // A late ACK after a go-back-N may cover bytes we were about to resend.
            self.nxt = self.nxt.max(self.una);
            if self.in_recovery {
                if ack >= self.recover {
                    self.in_recovery = false;
                    self.cwnd = self.ssthresh.min(self.flight().max(mss) + mss);
                } else {
                    // Partial ACK: resend the next hole, deflate by what was acked.
                    self.emit(now, self.una, (self.nxt - self.una).min(mss) as u32, out);
                    self.cwnd = self.cwnd.saturating_sub(acked) + mss;
                }
            } else if self.cwnd < self.ssthresh {
                self.cwnd += acked.min(mss);
            } else {
                self.cwnd += (mss * mss / self.cwnd).max(1);
            }
            self.dupacks = 0;
            self.rack_at = None;
            self.probe_acknowledged(ack);
            self.timer = (self.una < self.nxt).then(|| now + self.rto);
            self.schedule_probe(now);
        } else if ack == self.una && self.nxt > self.una {
            self.dupacks += 1;
            if self.dupacks == 3 && !self.in_recovery && ack >= self.recover {
                self.enter_recovery(now, out);
            } else if self.in_recovery {
                self.cwnd += mss;
            } else if self.cfg.rack_tlp
                && self.rack_at.is_none()
                && ack >= self.recover
                && let Some(min_rtt) = self.min_rtt
            {
                // A later segment arrived: RACK's reordering window, then the hole is lost.
                self.rack_at = Some(now + min_rtt / 4);
            }
        }
        self.poll_segments(now, out);
    }

    /// RFC 6675 + RFC 8985: the scoreboard takes the ACK, RACK marks losses, recovery
    /// ends once everything sent before it is acknowledged.
    fn handle_ack_with_sack(&mut self, now: Instant, ack: u64, sack: &SackBlocks, out: &mut Vec<Segment>) {
        if ack < self.una {
            return; // an older ACK overtaken by a newer one
        }
        let ack = ack.min(self.nxt); // never past what was sent
        let mss = self.mss();
        let advanced = ack > self.una;
        if advanced {
            self.take_rtt_sample(now, ack);
        }
        let delivered = self.board.handle_ack(now, ack, sack, self.min_rtt);
        if advanced {
            self.una = ack;
            self.timer = (self.una < self.nxt).then(|| now + self.rto);
            if (self.in_recovery || self.in_loss) && ack >= self.recover {
                if self.in_recovery {
                    self.cwnd = self.ssthresh;
                }
                self.in_recovery = false;
                self.in_loss = false;
            }
        }
        if !self.in_recovery && delivered > 0 {
            // Linux counts what the ACK delivered, however many segments (delayed ACKs
            // cover two): slow start by that, up to ssthresh; then one segment per window.
            if self.cwnd < self.ssthresh {
                self.cwnd = (self.cwnd + delivered).min(self.ssthresh);
            } else {
                self.cwnd += (mss * delivered / self.cwnd).max(1);
            }
        }
        self.detect_losses(now, delivered, advanced);
        self.probe_acknowledged(ack);
        if advanced {
            self.schedule_probe(now);
        }
        self.poll_segments(now, out);
    }

    /// A timer fired (call at or after [`TcpSender::timer`]).
    pub fn handle_timeout(&mut self, now: Instant, out: &mut Vec<Segment>) {
        if let Some(at) = self.rack_at
            && now >= at
        {
            self.rack_at = None;
            if self.cfg.sack {
                self.detect_losses(now, 0, false);
                self.poll_segments(now, out);
            } else if !self.in_recovery && self.dupacks > 0 && self.una < self.nxt {
                self.enter_recovery(now, out);
            }
        }
        if let Some(at) = self.probe_at
            && now >= at
        {
            self.probe_at = None;
            if self.una < self.nxt && !self.in_recovery && !self.in_loss {
                self.send_probe(now, out);
            }
        }
        if self.timer.is_none_or(|t| now < t) {
            return;
        }
        self.timer = None;
        self.probe_at = None;
        self.probe_high = None;
        self.rack_at = None;
        if self.una >= self.nxt {
            return;
        }
        let mss = self.mss();
        self.stats.timeouts += 1;
        self.ssthresh = (self.flight() / 2).max(2 * mss);
        self.cwnd = mss;
        self.recover = self.nxt;
        self.in_recovery = false;
        self.dupacks = 0;
        if self.cfg.sack {
            // Every segment not SACKed is lost and resent, lowest first, in slow start.
            self.board.mark_all_lost();
            self.in_loss = true;
        } else {
            self.nxt = self.una; // go back N
        }
        self.rto = (self.rto * 2).min(self.cfg.max_rto);
        self.poll_segments(now, out);
    }
}

/// The receiving side of one connection.
#[derive(Debug)]
pub struct TcpReceiver {
    cfg: TcpConfig,
    nxt: u64,
    /// Out-of-order ranges, merged: start -> (end, when last extended, as a count of
    /// arrivals: the order SACK blocks are reported in).
    ooo: BTreeMap<u64, (u64, u64)>,
    arrivals: u64,
    unacked: u32,
    delack: Option<Instant>,
    pub duplicates: u64,
}

/// What the receiver wants to send back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AckDecision {
    /// Acknowledge `rcv_nxt` now.
    Now,
    /// Wait; the delayed-ACK timer is (re)armed.
    Delay,
}

impl TcpReceiver {
    pub fn new(cfg: TcpConfig) -> Self {
        Self { cfg, nxt: 0, ooo: BTreeMap::new(), arrivals: 0, unacked: 0, delack: None, duplicates: 0 }
    }

    /// Bytes received in order.
    pub fn delivered(&self) -> u64 {
        self.nxt
    }

    pub fn delack_timer(&self) -> Option<Instant> {
        self.delack
    }

    pub fn handle_segment(&mut self, now: Instant, seq: u64, len: u32) -> AckDecision {
        let end = seq + u64::from(len);
        if end <= self.nxt {
            self.duplicates += 1;
            return self.ack_now();
        }
        if seq > self.nxt {
            self.insert_out_of_order(seq, end);
            return self.ack_now(); // duplicate ACK for the hole
        }
        let had_gap = !self.ooo.is_empty();
        self.nxt = end;
        // Merge out-of-order ranges now in sequence.
        while let Some((&s, &(e, _))) = self.ooo.first_key_value() {
            if s > self.nxt {
                break;
            }
            self.nxt = self.nxt.max(e);
            self.ooo.pop_first();
        }
        if had_gap {
            return self.ack_now();
        }
        self.unacked += 1;
        if self.unacked >= 2 {
            return self.ack_now();
        }
        if self.delack.is_none() {
            self.delack = Some(now + self.cfg.delayed_ack);
        }
        AckDecision::Delay
    }

    /// Adds `[seq, end)` above a hole, merged with the ranges it overlaps or touches.
    fn insert_out_of_order(&mut self, mut seq: u64, mut end: u64) {
        self.arrivals += 1;
        while let Some((&s, &(e, _))) = self.ooo.range(..=end).next_back() {
            if e < seq {
                break;
            }
            seq = seq.min(s);
            end = end.max(e);
            self.ooo.remove(&s);
        }
        self.ooo.insert(seq, (end, self.arrivals));
    }

    /// The SACK blocks of the ACK for what has arrived (RFC 2018): the range extended last
    /// first, then the others most recently extended, at most [`sack::MAX_BLOCKS`]. None
    /// without [`TcpConfig::sack`] (no work per ACK for a sender that would not read them).
    pub fn sack_blocks(&self) -> SackBlocks {
        let mut blocks = SackBlocks::default();
        if !self.cfg.sack || self.ooo.is_empty() {
            return blocks;
        }
        let mut recent: [Option<(u64, u64, u64)>; sack::MAX_BLOCKS] = [None; sack::MAX_BLOCKS];
        for (&s, &(e, when)) in &self.ooo {
            // Keep the most recent ones, newest first (a short insertion sort).
            let mut item = (when, s, e);
            for slot in recent.iter_mut() {
                match slot {
                    None => {
                        *slot = Some(item);
                        break;
                    }
                    Some(held) if item.0 > held.0 => std::mem::swap(held, &mut item),
                    Some(_) => {}
                }
            }
        }
        for (_, s, e) in recent.into_iter().flatten() {
            blocks.push(self.nxt, s, e);
        }
        blocks
    }

    fn ack_now(&mut self) -> AckDecision {
        self.unacked = 0;
        self.delack = None;
        AckDecision::Now
    }

    /// The delayed-ACK timer fired: `true` if an ACK must be sent.
    pub fn handle_timeout(&mut self, now: Instant) -> bool {
        if self.delack.is_some_and(|t| now >= t) {
            self.ack_now();
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: u64) -> Instant {
        Instant::from_nanos(ms * 1_000_000)
    }

    #[test]
    fn slow_start_then_fast_retransmit_and_recovery() {
        let cfg = TcpConfig { initial_window: 4, ..Default::default() };
        let mut s = TcpSender::new(cfg);
        let mut out = Vec::new();
        s.write(20 * 1460);
        s.poll_segments(t(0), &mut out);
        assert_eq!(out.len(), 4, "initial window");
        out.clear();
        s.handle_ack(t(1), 1460, &SackBlocks::default(), &mut out);
        assert_eq!(s.cwnd(), 5 * 1460, "slow start adds one MSS per ACK");
        assert_eq!(out.len(), 2);
        // Segment at 1460 is lost: three duplicate ACKs trigger a fast retransmit.
        out.clear();
        for _ in 0..3 {
            s.handle_ack(t(2), 1460, &SackBlocks::default(), &mut out);
        }
        assert_eq!(s.stats.fast_retransmits, 1);
        assert_eq!(out.first(), Some(&Segment { seq: 1460, len: 1460, retransmission: true }));
        // A partial ACK retransmits the next hole.
        out.clear();
        s.handle_ack(t(3), 2 * 1460, &SackBlocks::default(), &mut out);
        assert_eq!(out.first(), Some(&Segment { seq: 2 * 1460, len: 1460, retransmission: true }));
        assert_eq!(s.stats.retransmitted, 2);
    }

    #[test]
    fn timeout_backs_off_and_goes_back_n() {
        let mut s = TcpSender::new(TcpConfig::default());
        let mut out = Vec::new();
        s.write(3000);
        s.poll_segments(t(0), &mut out);
        assert_eq!(s.timer(), Some(t(1000)), "initial RTO 1 s");
        out.clear();
        s.handle_timeout(t(1000), &mut out);
        assert_eq!(out, [Segment { seq: 0, len: 1460, retransmission: true }]);
        assert_eq!(s.timer(), Some(t(3000)), "doubled");
        out.clear();
        s.handle_ack(t(3001), 1460, &SackBlocks::default(), &mut out);
        assert_eq!(s.timer(), Some(t(5001)), "re-armed with the backed-off RTO (no sample: Karn)");
    }

    #[test]
    fn rto_never_below_200ms() {
        let mut s = TcpSender::new(TcpConfig::default());
        let mut out = Vec::new();
        s.write(1460 * 2);
        s.poll_segments(t(0), &mut out);
        s.handle_ack(Instant::from_nanos(100_000), 1460 * 2, &SackBlocks::default(), &mut out); // 100 us RTT
        s.write(1460);
        out.clear();
        s.poll_segments(t(1), &mut out);
        assert_eq!(s.timer(), Some(t(201)));
    }

    fn linux() -> TcpConfig {
        TcpConfig { rack_tlp: true, ..Default::default() }
    }

    /// A sender with `n` segments acknowledged after a 1 ms RTT, then `k` more sent at 10 ms.
    fn after_one_rtt(cfg: TcpConfig, k: u64) -> (TcpSender, Vec<Segment>) {
        let mut s = TcpSender::new(cfg);
        let mut out = Vec::new();
        s.write(2 * 1460);
        s.poll_segments(t(0), &mut out);
        s.handle_ack(t(1), 2 * 1460, &SackBlocks::default(), &mut out);
        assert_eq!(s.timer(), None, "nothing in flight");
        out.clear();
        s.write(k * 1460);
        s.poll_segments(t(10), &mut out);
        assert_eq!(out.len() as u64, k);
        out.clear();
        (s, out)
    }

    #[test]
    fn a_lost_tail_is_probed_after_two_rtts_not_a_timeout() {
        let (mut s, mut out) = after_one_rtt(linux(), 4);
        // 2 SRTT + 2 ms after the last transmission.
        assert_eq!(s.timer(), Some(t(14)));
        // The first two arrive; the last two (the tail) are lost: one ACK, no duplicate.
        s.handle_ack(t(11), 4 * 1460, &SackBlocks::default(), &mut out);
        assert_eq!(s.timer(), Some(t(15)), "re-scheduled from the ACK");
        s.handle_timeout(t(15), &mut out);
        assert_eq!(out, [Segment { seq: 5 * 1460, len: 1460, retransmission: true }], "the last segment again");
        assert_eq!((s.stats.loss_probes, s.stats.timeouts), (1, 0));
        // The probe arrives out of order: one duplicate ACK, and RACK repairs the hole.
        out.clear();
        s.handle_ack(t(16), 4 * 1460, &SackBlocks::default(), &mut out);
        s.handle_timeout(s.timer().unwrap(), &mut out);
        assert_eq!(out, [Segment { seq: 4 * 1460, len: 1460, retransmission: true }]);
        out.clear();
        s.handle_ack(t(17), 6 * 1460, &SackBlocks::default(), &mut out);
        assert_eq!(s.timer(), None);
        assert_eq!((s.stats.fast_retransmits, s.stats.timeouts), (1, 0));
        // NewReno alone waits for the retransmission timeout.
        let (mut s, mut out) = after_one_rtt(TcpConfig::default(), 4);
        s.handle_ack(t(11), 4 * 1460, &SackBlocks::default(), &mut out);
        assert_eq!(s.timer(), Some(t(211)));
    }

    #[test]
    fn a_lone_lost_segment_is_probed_when_its_timeout_would_fire_and_halves_the_window() {
        // As Linux: with one segment in flight the probe waits 2 SRTT + 200 ms (a delayed
        // ACK may be coming), capped at the timeout, and then takes the timeout's place.
        let (mut s, mut out) = after_one_rtt(linux(), 3);
        s.handle_ack(t(11), 4 * 1460, &SackBlocks::default(), &mut out);
        assert_eq!(s.timer(), Some(t(211)));
        s.handle_timeout(t(211), &mut out);
        assert_eq!(out, [Segment { seq: 4 * 1460, len: 1460, retransmission: true }]);
        assert_eq!((s.stats.loss_probes, s.stats.timeouts), (1, 0));
        let cwnd = s.cwnd();
        out.clear();
        s.handle_ack(t(212), 5 * 1460, &SackBlocks::default(), &mut out);
        // Half of the window the ACK itself grew by one segment (slow start).
        assert_eq!(s.cwnd(), (cwnd + 1460) / 2, "a probe that repaired a loss halves the window");
    }

    #[test]
    fn one_duplicate_ack_and_a_quarter_rtt_make_a_fast_retransmit() {
        let (mut s, mut out) = after_one_rtt(linux(), 2);
        // The first is lost, the second arrives: one duplicate ACK.
        s.handle_ack(Instant::from_nanos(11_000_000), 2 * 1460, &SackBlocks::default(), &mut out);
        assert!(out.is_empty());
        assert_eq!(s.timer(), Some(Instant::from_nanos(11_250_000)), "min RTT / 4 later");
        s.handle_timeout(Instant::from_nanos(11_250_000), &mut out);
        assert_eq!(out, [Segment { seq: 2 * 1460, len: 1460, retransmission: true }]);
        assert_eq!((s.stats.fast_retransmits, s.stats.timeouts), (1, 0));
        // NewReno needs three duplicates: one is not enough.
        let (mut s, mut out) = after_one_rtt(TcpConfig::default(), 2);
        s.handle_ack(t(11), 2 * 1460, &SackBlocks::default(), &mut out);
        assert_eq!(s.timer(), Some(t(210)));
    }

    #[test]
    fn receiver_acks_every_second_segment_and_at_once_out_of_order() {
        let mut r = TcpReceiver::new(TcpConfig::default());
        assert_eq!(r.handle_segment(t(0), 0, 1460), AckDecision::Delay);
        assert_eq!(r.delack_timer(), Some(t(40)));
        assert_eq!(r.handle_segment(t(0), 1460, 1460), AckDecision::Now);
        assert_eq!(r.handle_segment(t(0), 4380, 1460), AckDecision::Now, "out of order");
        assert_eq!(r.delivered(), 2920);
        assert_eq!(r.handle_segment(t(0), 2920, 1460), AckDecision::Now, "fills the hole");
        assert_eq!(r.delivered(), 5840);
        assert_eq!(r.handle_segment(t(0), 0, 1460), AckDecision::Now, "duplicate");
        assert_eq!(r.duplicates, 1);
        assert_eq!(r.handle_segment(t(1), 5840, 100), AckDecision::Delay);
        assert!(!r.handle_timeout(t(40)));
        assert!(r.handle_timeout(t(41)));
    }

    #[test]
    fn receiver_reports_merged_ranges_most_recent_first() {
        let mut r = TcpReceiver::new(with_sack());
        for seq in [2, 4, 6, 8] {
            r.handle_segment(t(0), seq * 100, 100);
        }
        // Ranges 200, 400, 600, 800: the three most recent, newest first.
        let ranges = |r: &TcpReceiver| r.sack_blocks().ranges(r.delivered()).collect::<Vec<_>>();
        assert_eq!(ranges(&r), [(800, 900), (600, 700), (400, 500)]);
        // 300 joins 200 and 400 into one range, now the most recent.
        r.handle_segment(t(0), 300, 100);
        assert_eq!(ranges(&r), [(200, 500), (800, 900), (600, 700)]);
        // 0..200 fills the hole: delivered up to 500, the rest still reported.
        r.handle_segment(t(0), 0, 200);
        assert_eq!(r.delivered(), 500);
        assert_eq!(ranges(&r), [(800, 900), (600, 700)]);
    }

    /// One connection over a path with a fixed one-way delay, segments spaced by a
    /// serialisation time, and drops chosen by (segment's first byte, how many times it was
    /// sent before): a transfer in virtual time, as the simulator runs it.
    struct Transfer {
        /// When the receiver had every byte in order.
        done: Instant,
        stats: SenderStats,
        duplicates: u64,
    }

    fn transfer(cfg: TcpConfig, segments: u64, drop: impl Fn(u64, u32) -> bool) -> Transfer {
        enum Ev {
            Data(Segment),
            Ack(u64, SackBlocks),
        }
        let one_way = Duration::from_micros(500);
        let gap = Duration::from_micros(10);
        let mut s = TcpSender::new(cfg);
        let mut r = TcpReceiver::new(cfg);
        let mut sends: BTreeMap<u64, u32> = BTreeMap::new();
        let mut events: BTreeMap<(Instant, u64), Ev> = BTreeMap::new();
        let mut order = 0;
        let mut line_free = Instant::ZERO;
        let mut out = Vec::new();
        let total = segments * 1460;
        s.write(total);
        s.poll_segments(Instant::ZERO, &mut out);
        let mut now = Instant::ZERO;
        let mut done = None;
        for _ in 0..1_000_000 {
            for seg in out.drain(..) {
                let n = sends.entry(seg.seq).or_insert(0);
                let dropped = drop(seg.seq / 1460, *n);
                *n += 1;
                line_free = line_free.max(now) + gap;
                if !dropped {
                    order += 1;
                    events.insert((line_free + one_way, order), Ev::Data(seg));
                }
            }
            if r.delivered() == total {
                done = done.or(Some(now));
            }
            if let Some(done) = done
                && s.acked() == total
            {
                return Transfer { done, stats: s.stats, duplicates: r.duplicates };
            }
            let timers = [s.timer(), r.delack_timer()].into_iter().flatten().min();
            let next_event = events.first_key_value().map(|(&(at, _), _)| at);
            now = match (next_event, timers) {
                (Some(e), Some(t)) if t < e => t,
                (Some(e), _) => e,
                (None, Some(t)) => t,
                (None, None) => panic!("stuck with {} of {total} bytes acknowledged", s.acked()),
            };
            if next_event == Some(now) {
                let (_, ev) = events.pop_first().expect("an event is due");
                match ev {
                    Ev::Data(seg) => {
                        if r.handle_segment(now, seg.seq, seg.len) == AckDecision::Now {
                            order += 1;
                            events.insert((now + one_way, order), Ev::Ack(r.delivered(), r.sack_blocks()));
                        }
                    }
                    Ev::Ack(ack, sack) => s.handle_ack(now, ack, &sack, &mut out),
                }
            } else {
                if r.handle_timeout(now) {
                    order += 1;
                    events.insert((now + one_way, order), Ev::Ack(r.delivered(), r.sack_blocks()));
                }
                if s.timer().is_some_and(|t| t <= now) {
                    s.handle_timeout(now, &mut out);
                }
            }
        }
        panic!("the transfer did not end in a million steps");
    }

    fn with_sack() -> TcpConfig {
        TcpConfig { rack_tlp: true, sack: true, ..Default::default() }
    }

    #[test]
    fn a_burst_of_ten_drops_is_repaired_in_one_round_trip() {
        // 60 segments; the first sending of segments 30..40 is dropped (a full switch
        // buffer), by then the window holds them all.
        let burst = |seg: u64, sent: u32| sent == 0 && (30..40).contains(&seg);
        let clean = transfer(with_sack(), 60, |_, _| false);
        let sack = transfer(with_sack(), 60, burst);
        assert_eq!(sack.stats.retransmitted, 10, "each hole once, nothing resent in vain");
        assert_eq!((sack.stats.timeouts, sack.stats.fast_retransmits, sack.duplicates), (0, 1, 0));
        // Lossless 6.x ms; the holes cost about one more round trip (1 ms) and their own
        // serialisation, not one round trip each.
        let rtt = Duration::from_millis(1);
        assert!(sack.done <= clean.done + rtt * 2, "{:?} against {:?}", sack.done, clean.done);
        // The model before (RACK-style detection, one hole per round trip) takes ten.
        let before = transfer(linux(), 60, burst);
        assert!(before.done >= clean.done + rtt * 9, "{:?} against {:?}", before.done, clean.done);
    }

    #[test]
    fn a_lost_retransmission_is_found_by_later_deliveries_not_a_timeout() {
        // Segment 20 is dropped twice; data keeps flowing behind it.
        let twice = |seg: u64, sent: u32| seg == 20 && sent < 2;
        let sack = transfer(with_sack(), 80, twice);
        assert_eq!((sack.stats.timeouts, sack.stats.retransmitted), (0, 2));
        let before = transfer(linux(), 80, twice);
        assert_eq!(before.stats.timeouts, 1, "NewReno waits for its timeout");
    }

    #[test]
    fn after_a_timeout_only_what_was_not_sacked_goes_again() {
        // Segments 0..3 are lost twice, the rest of a ten-segment window arrives: the
        // resends are lost too and nothing is left to send, so the timeout fires.
        let first_three = |seg: u64, sent: u32| seg < 3 && sent < 2;
        let sack = transfer(with_sack(), 10, first_three);
        assert_eq!(sack.stats.timeouts, 1);
        assert_eq!((sack.stats.retransmitted, sack.duplicates), (6, 0), "three fast, three after the timeout");
        // Going back N sends the SACKed segments again, and the receiver gets duplicates.
        let before = transfer(linux(), 10, first_three);
        assert!(before.duplicates > 0 && before.stats.retransmitted > 6, "{:?}", before.stats);
    }

    #[test]
    fn recovery_comes_down_in_proportion_to_what_is_delivered() {
        // 20 segments in flight, the first lost: the target is half the flight, and PRR
        // sends one segment for every two delivered (RFC 6937), the first at once.
        let mut s = TcpSender::new(TcpConfig { initial_window: 20, ..with_sack() });
        let mut out = Vec::new();
        s.write(40 * 1460);
        s.poll_segments(t(0), &mut out);
        assert_eq!(out.len(), 20);
        out.clear();
        let sacked = |upto: u64| {
            let mut b = SackBlocks::default();
            assert!(b.push(0, 1460, upto * 1460));
            b
        };
        s.handle_ack(t(1), 0, &sacked(2), &mut out);
        assert_eq!(out, [Segment { seq: 0, len: 1460, retransmission: true }], "the fast retransmit alone");
        let mut sent = out.len();
        for k in 3..13 {
            out.clear();
            s.handle_ack(t(1), 0, &sacked(k), &mut out);
            assert!(out.iter().all(|seg| !seg.retransmission));
            sent += out.len();
        }
        // Eleven delivered, six sent: ceil(11 x 10 / 20).
        assert_eq!(sent, 6);
        // RFC 6675 alone would send nothing until the pipe fell to half, then fill it at
        // once; NewReno waits for three duplicate ACKs and then inflates the window.
        assert_eq!(s.stats.fast_retransmits, 1);
    }

    #[test]
    fn linux_adds_the_minimum_to_the_rtt_where_the_rfc_floors_at_it() {
        let mut out = Vec::new();
        for (cfg, rto) in [(with_sack(), 201), (linux(), 200)] {
            let mut s = TcpSender::new(cfg);
            s.write(2 * 1460);
            s.poll_segments(t(0), &mut out);
            s.handle_ack(t(1), 2 * 1460, &SackBlocks::default(), &mut out);
            s.write(1460);
            s.poll_segments(t(10), &mut out);
            // An RTO of exactly 200 ms keeps a resend in phase with any period dividing it.
            assert_eq!(s.timer, Some(t(10 + rto)), "{cfg:?}");
        }
    }

    #[test]
    fn the_tail_loss_probe_waits_in_kernel_ticks() {
        // 1 ms SRTT; four segments out at 10 ms. Exact: 2 SRTT + 2 ms. Linux adds the 2-ms
        // floor, then rounds up to whole ticks: at 250 Hz one 4-ms tick (14 ms, where the
        // kernels before 6.6 rounded 2 SRTT up to a tick and added two: 22), at 100 Hz
        // one 10-ms tick.
        let (s, _) = after_one_rtt(with_sack(), 4);
        assert_eq!(s.probe_at, Some(t(14)));
        for (tick, at) in [(4, 14), (10, 20)] {
            let ticks = TcpConfig { tick: Some(Duration::from_millis(tick)), ..with_sack() };
            let (s, _) = after_one_rtt(ticks, 4);
            assert_eq!(s.probe_at, Some(t(at)), "{tick}-ms ticks");
        }
    }

    #[test]
    fn the_reordering_timer_waits_in_kernel_ticks() {
        // Four segments out at 10 ms (1 ms round trip); only the last is SACKed, at 11 ms:
        // the three before it are lost once a quarter of the minimum RTT has passed since
        // their round trip, at 11.25 ms. Linux arms its timer for the time left plus the
        // 2-ms floor, rounded up to ticks: one 4-ms tick at 250 Hz (15 ms).
        let sack_last = |cfg: TcpConfig| {
            let (mut s, mut out) = after_one_rtt(cfg, 4);
            let mut b = SackBlocks::default();
            assert!(b.push(2 * 1460, 5 * 1460, 6 * 1460));
            s.handle_ack(t(11), 2 * 1460, &b, &mut out);
            assert!(out.iter().all(|seg| !seg.retransmission), "not lost yet: {out:?}");
            s
        };
        let exact = sack_last(with_sack());
        assert_eq!(exact.rack_at, Some(t(11) + Duration::from_micros(250)));
        let mut linux = sack_last(TcpConfig { tick: Some(Duration::from_millis(4)), ..with_sack() });
        assert_eq!(linux.rack_at, Some(t(15)));
        // When it fires, the three are lost and go again (the first at once).
        let mut out = Vec::new();
        linux.handle_timeout(t(15), &mut out);
        assert_eq!(out.first(), Some(&Segment { seq: 2 * 1460, len: 1460, retransmission: true }), "{out:?}");
        assert_eq!(linux.stats.timeouts, 0);
    }

    #[test]
    fn slow_start_grows_by_what_an_ack_delivered() {
        // A delayed ACK covers two segments: Linux adds both, the RFC's byte counting one.
        for (cfg, grown) in [(with_sack(), 2), (linux(), 1)] {
            let mut s = TcpSender::new(cfg);
            let mut out = Vec::new();
            s.write(10 * 1460);
            s.poll_segments(t(0), &mut out);
            s.handle_ack(t(1), 2 * 1460, &SackBlocks::default(), &mut out);
            assert_eq!(s.cwnd(), (10 + grown) * 1460, "{cfg:?}");
        }
    }
}
