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
//! Differences from Linux (see docs/simulation.md): no SACK, no timestamps, no CUBIC (Linux
//! default), no pacing, no TSO/GRO, a fixed receive window, no handshake or slow start after
//! idle.

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
    timer: Option<Instant>,
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

    /// When the retransmission timer fires, if armed.
    pub fn timer(&self) -> Option<Instant> {
        self.timer
    }

    /// Segments the windows allow now.
    pub fn poll_segments(&mut self, now: Instant, out: &mut Vec<Segment>) {
        let wnd = self.cwnd.min(self.cfg.rwnd);
        while self.nxt < self.app_end && self.flight() < wnd {
            let len = (self.app_end - self.nxt).min(self.mss()).min(wnd - self.flight());
            if len < self.mss() && self.nxt + len < self.app_end {
                break; // window too small for a full segment and more data follows: wait
            }
            self.emit(now, self.nxt, len as u32, out);
            self.nxt += len;
        }
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
            self.timer = (self.una < self.nxt).then(|| now + self.rto);
        } else if ack == self.una && self.nxt > self.una {
            self.dupacks += 1;
            if self.dupacks == 3 && !self.in_recovery && ack >= self.recover {
                self.stats.fast_retransmits += 1;
                self.ssthresh = (self.flight() / 2).max(2 * mss);
                self.recover = self.nxt;
                self.in_recovery = true;
                self.emit(now, self.una, (self.nxt - self.una).min(mss) as u32, out);
                self.cwnd = self.ssthresh + 3 * mss;
            } else if self.in_recovery {
                self.cwnd += mss;
            }
        }
        self.poll_segments(now, out);
    }

    /// The retransmission timer fired (call at or after [`TcpSender::timer`]).
    pub fn handle_timeout(&mut self, now: Instant, out: &mut Vec<Segment>) {
        if self.timer.is_none_or(|t| now < t) {
            return;
        }
        self.timer = None;
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
