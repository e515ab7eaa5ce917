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
//! Differences from Linux (see docs/simulation.md): no SACK scoreboard (one hole repaired
//! per round trip), no timestamps, no CUBIC (Linux default), no pacing, no TSO/GRO, a fixed
//! receive window, no handshake or slow start after idle.

use std::collections::BTreeMap;

use shoal_core::{Duration, Instant};

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
        let extra = if self.flight() <= self.mss() { self.cfg.min_rto } else { Duration::from_millis(2) };
        let at = now + srtt * 2 + extra;
        self.probe_at = Some(self.timer.map_or(at, |rto| at.min(rto)));
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

    fn emit(&mut self, now: Instant, seq: u64, len: u32, out: &mut Vec<Segment>) {
        let retransmission = seq < self.high;
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
        self.rto = (s + (self.rttvar * 4).max(Duration::from_millis(1))).clamp(self.cfg.min_rto, self.cfg.max_rto);
    }

    /// An ACK arrived acknowledging everything below `ack`.
    pub fn handle_ack(&mut self, now: Instant, ack: u64, out: &mut Vec<Segment>) {
        let mss = self.mss();
        if ack > self.una {
            let acked = ack - self.una;
            if let Some((probe, sent)) = self.rtt_probe
                && ack >= probe
            {
                self.sample_rtt(now - sent);
                self.rtt_probe = None;
            }
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
            if let Some(high) = self.probe_high
                && ack >= high
            {
                // The probe's flight is acknowledged. Had the probe repaired a loss (it was
                // a retransmission), Linux reduces the window as after a fast recovery.
                if self.probe_was_retransmission && !self.in_recovery {
                    self.ssthresh = (self.cwnd / 2).max(2 * mss);
                    self.cwnd = self.ssthresh;
                }
                self.probe_high = None;
            }
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

    /// A timer fired (call at or after [`TcpSender::timer`]).
    pub fn handle_timeout(&mut self, now: Instant, out: &mut Vec<Segment>) {
        if let Some(at) = self.rack_at
            && now >= at
        {
            self.rack_at = None;
            if !self.in_recovery && self.dupacks > 0 && self.una < self.nxt {
                self.enter_recovery(now, out);
            }
        }
        if let Some(at) = self.probe_at
            && now >= at
        {
            self.probe_at = None;
            if self.una < self.nxt && !self.in_recovery {
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
        self.nxt = self.una; // go back N
        self.rto = (self.rto * 2).min(self.cfg.max_rto);
        self.poll_segments(now, out);
    }
}

/// The receiving side of one connection.
#[derive(Debug)]
pub struct TcpReceiver {
    cfg: TcpConfig,
    nxt: u64,
    /// Out-of-order ranges: start -> end.
    ooo: BTreeMap<u64, u64>,
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
        Self { cfg, nxt: 0, ooo: BTreeMap::new(), unacked: 0, delack: None, duplicates: 0 }
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
            let e = self.ooo.entry(seq).or_insert(end);
            *e = (*e).max(end);
            return self.ack_now(); // duplicate ACK for the hole
        }
        let had_gap = !self.ooo.is_empty();
        self.nxt = end;
        // Merge out-of-order ranges now in sequence.
        while let Some((&s, &e)) = self.ooo.first_key_value() {
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
        s.handle_ack(t(1), 1460, &mut out);
        assert_eq!(s.cwnd(), 5 * 1460, "slow start adds one MSS per ACK");
        assert_eq!(out.len(), 2);
        // Segment at 1460 is lost: three duplicate ACKs trigger a fast retransmit.
        out.clear();
        for _ in 0..3 {
            s.handle_ack(t(2), 1460, &mut out);
        }
        assert_eq!(s.stats.fast_retransmits, 1);
        assert_eq!(out.first(), Some(&Segment { seq: 1460, len: 1460, retransmission: true }));
        // A partial ACK retransmits the next hole.
        out.clear();
        s.handle_ack(t(3), 2 * 1460, &mut out);
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
        s.handle_ack(t(3001), 1460, &mut out);
        assert_eq!(s.timer(), Some(t(5001)), "re-armed with the backed-off RTO (no sample: Karn)");
    }

    #[test]
    fn rto_never_below_200ms() {
        let mut s = TcpSender::new(TcpConfig::default());
        let mut out = Vec::new();
        s.write(1460 * 2);
        s.poll_segments(t(0), &mut out);
        s.handle_ack(Instant::from_nanos(100_000), 1460 * 2, &mut out); // 100 us RTT
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
        s.handle_ack(t(1), 2 * 1460, &mut out);
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
        s.handle_ack(t(11), 4 * 1460, &mut out);
        assert_eq!(s.timer(), Some(t(15)), "re-scheduled from the ACK");
        s.handle_timeout(t(15), &mut out);
        assert_eq!(out, [Segment { seq: 5 * 1460, len: 1460, retransmission: true }], "the last segment again");
        assert_eq!((s.stats.loss_probes, s.stats.timeouts), (1, 0));
        // The probe arrives out of order: one duplicate ACK, and RACK repairs the hole.
        out.clear();
        s.handle_ack(t(16), 4 * 1460, &mut out);
        s.handle_timeout(s.timer().unwrap(), &mut out);
        assert_eq!(out, [Segment { seq: 4 * 1460, len: 1460, retransmission: true }]);
        out.clear();
        s.handle_ack(t(17), 6 * 1460, &mut out);
        assert_eq!(s.timer(), None);
        assert_eq!((s.stats.fast_retransmits, s.stats.timeouts), (1, 0));
        // NewReno alone waits for the retransmission timeout.
        let (mut s, mut out) = after_one_rtt(TcpConfig::default(), 4);
        s.handle_ack(t(11), 4 * 1460, &mut out);
        assert_eq!(s.timer(), Some(t(211)));
    }

    #[test]
    fn a_lone_lost_segment_is_probed_when_its_timeout_would_fire_and_halves_the_window() {
        // As Linux: with one segment in flight the probe waits 2 SRTT + 200 ms (a delayed
        // ACK may be coming), capped at the timeout, and then takes the timeout's place.
        let (mut s, mut out) = after_one_rtt(linux(), 3);
        s.handle_ack(t(11), 4 * 1460, &mut out);
        assert_eq!(s.timer(), Some(t(211)));
        s.handle_timeout(t(211), &mut out);
        assert_eq!(out, [Segment { seq: 4 * 1460, len: 1460, retransmission: true }]);
        assert_eq!((s.stats.loss_probes, s.stats.timeouts), (1, 0));
        let cwnd = s.cwnd();
        out.clear();
        s.handle_ack(t(212), 5 * 1460, &mut out);
        // Half of the window the ACK itself grew by one segment (slow start).
        assert_eq!(s.cwnd(), (cwnd + 1460) / 2, "a probe that repaired a loss halves the window");
    }

    #[test]
    fn one_duplicate_ack_and_a_quarter_rtt_make_a_fast_retransmit() {
        let (mut s, mut out) = after_one_rtt(linux(), 2);
        // The first is lost, the second arrives: one duplicate ACK.
        s.handle_ack(Instant::from_nanos(11_000_000), 2 * 1460, &mut out);
        assert!(out.is_empty());
        assert_eq!(s.timer(), Some(Instant::from_nanos(11_250_000)), "min RTT / 4 later");
        s.handle_timeout(Instant::from_nanos(11_250_000), &mut out);
        assert_eq!(out, [Segment { seq: 2 * 1460, len: 1460, retransmission: true }]);
        assert_eq!((s.stats.fast_retransmits, s.stats.timeouts), (1, 0));
        // NewReno needs three duplicates: one is not enough.
        let (mut s, mut out) = after_one_rtt(TcpConfig::default(), 2);
        s.handle_ack(t(11), 2 * 1460, &mut out);
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
}
