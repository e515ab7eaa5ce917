//! Selective acknowledgements: the blocks an ACK carries (RFC 2018) and the sender's
//! scoreboard (RFC 6675's pipe, RFC 8985's time-based loss marking).
//!
//! The scoreboard keeps one entry per segment in flight, in sequence order, with when it
//! was last sent and whether the receiver has SACKed it or RACK has marked it lost. A
//! segment is lost once a segment sent after it has been delivered and more than the
//! delivered one's round trip plus a reordering window has passed since it went out: a
//! burst of drops is marked at once, by the first ACK that SACKs anything beyond it, and
//! every hole is resent within one round trip (where NewReno resends one per round trip).

use std::collections::VecDeque;

use shoal_core::{Duration, Instant};

/// Most SACK blocks one ACK carries (Linux with timestamps, the default: 3).
pub const MAX_BLOCKS: usize = 3;

/// The SACK blocks of one ACK, as byte offsets above its cumulative acknowledgement:
/// compact, since ACKs are a good part of the simulator's packets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SackBlocks {
    blocks: [(u32, u32); MAX_BLOCKS],
    len: u8,
}

impl SackBlocks {
    /// Adds the block `[start, end)` of an ACK for `ack`; `false` when the ACK is full or
    /// the block lies too far above `ack` to be encoded (more than 4 GiB: no window is).
    pub fn push(&mut self, ack: u64, start: u64, end: u64) -> bool {
        let (Ok(s), Ok(e)) = (u32::try_from(start.saturating_sub(ack)), u32::try_from(end.saturating_sub(ack))) else {
            return false;
        };
        if usize::from(self.len) == MAX_BLOCKS || s >= e {
            return false;
        }
        self.blocks[usize::from(self.len)] = (s, e);
        self.len += 1;
        true
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The blocks as sequence ranges of an ACK for `ack`, the most recent first.
    pub fn ranges(&self, ack: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.blocks[..usize::from(self.len)].iter().map(move |&(s, e)| (ack + u64::from(s), ack + u64::from(e)))
    }
}

#[derive(Clone, Copy, Debug)]
struct Sent {
    seq: u64,
    len: u32,
    /// When it was last sent.
    at: Instant,
    sacked: bool,
    /// Marked lost and not sent again since.
    lost: bool,
    retransmitted: bool,
}

impl Sent {
    fn end(&self) -> u64 {
        self.seq + u64::from(self.len)
    }
}

/// The sender's view of its segments in flight.
#[derive(Debug, Default)]
pub struct Scoreboard {
    segs: VecDeque<Sent>,
    /// Bytes in the network as RFC 6675 counts them: sent, neither SACKed nor marked lost.
    pipe: u64,
    sacked: u64,
    sacked_segments: u32,
    /// Bytes marked lost and not yet sent again.
    lost: u64,
    /// Retransmitted segments not yet delivered (when none, the segments in flight were
    /// sent in sequence order and loss marking can stop at the first one sent later).
    retransmitted_out: u32,
    /// RACK: send time and end of the most recently sent segment known delivered.
    rack: Option<(Instant, u64)>,
    /// RACK: that segment's round trip.
    rack_rtt: Duration,
}

impl Scoreboard {
    pub fn pipe(&self) -> u64 {
        self.pipe
    }

    pub fn lost(&self) -> u64 {
        self.lost
    }

    pub fn sacked_segments(&self) -> u32 {
        self.sacked_segments
    }

    /// A new segment went out.
    pub fn sent(&mut self, now: Instant, seq: u64, len: u32) {
        debug_assert!(self.segs.back().is_none_or(|s| s.end() <= seq));
        self.segs.push_back(Sent { seq, len, at: now, sacked: false, lost: false, retransmitted: false });
        self.pipe += u64::from(len);
    }

    /// The segment at `seq` went out again (`false`: no such segment in flight).
    pub fn resent(&mut self, now: Instant, seq: u64) -> bool {
        let i = self.segs.partition_point(|s| s.seq < seq);
        let Some(s) = self.segs.get_mut(i).filter(|s| s.seq == seq) else {
            return false;
        };
        if s.lost {
            s.lost = false;
            self.lost -= u64::from(s.len);
            self.pipe += u64::from(s.len);
        }
        if !s.retransmitted {
            s.retransmitted = true;
            self.retransmitted_out += 1;
        }
        s.at = now;
        true
    }

    /// The first segment marked lost and not sent again: (sequence, length).
    pub fn first_lost(&self) -> Option<(u64, u32)> {
        if self.lost == 0 {
            return None;
        }
        self.segs.iter().find(|s| s.lost).map(|s| (s.seq, s.len))
    }

    /// The last segment not SACKed (what a tail-loss probe sends again).
    pub fn last_unsacked(&self) -> Option<(u64, u32)> {
        self.segs.iter().rev().find(|s| !s.sacked).map(|s| (s.seq, s.len))
    }

    /// A retransmission timeout: every segment not SACKed is lost.
    pub fn mark_all_lost(&mut self) {
        for s in self.segs.iter_mut().filter(|s| !s.sacked && !s.lost) {
            s.lost = true;
            self.lost += u64::from(s.len);
        }
        self.pipe = 0;
    }

    /// An ACK: everything below `ack` and the SACKed ranges arrived. Returns the bytes
    /// newly delivered (cumulatively or selectively). `min_rtt` tells a retransmission's
    /// delivery from its original's (RFC 8985's test without timestamps).
    pub fn handle_ack(&mut self, now: Instant, ack: u64, sack: &SackBlocks, min_rtt: Option<Duration>) -> u64 {
        let mut delivered = 0;
        while let Some(front) = self.segs.front_mut() {
            if front.end() <= ack {
                let s = self.segs.pop_front().expect("front exists");
                if !s.sacked {
                    delivered += u64::from(s.len);
                }
                self.forget(&s);
                self.rack_update(now, &s, min_rtt);
            } else {
                if front.seq < ack {
                    // Acknowledged in part (a segment cut differently when resent): the rest stays.
                    let cut = ack - front.seq;
                    let s = *front;
                    front.seq = ack;
                    front.len -= cut as u32;
                    delivered += if s.sacked { 0 } else { cut };
                    self.sub(&s, cut);
                }
                break;
            }
        }
        for (start, end) in sack.ranges(ack) {
            let first = self.segs.partition_point(|s| s.seq < start);
            for i in first..self.segs.len() {
                let s = self.segs[i];
                if s.end() > end {
                    break;
                }
                if s.sacked {
                    continue;
                }
                let len = u64::from(s.len);
                if s.lost {
                    self.lost -= len;
                } else {
                    self.pipe -= len;
                }
                if s.retransmitted {
                    self.retransmitted_out -= 1;
                }
                self.sacked += len;
                self.sacked_segments += 1;
                delivered += len;
                let seg = &mut self.segs[i];
                seg.sacked = true;
                seg.lost = false;
                self.rack_update(now, &s, min_rtt);
            }
        }
        delivered
    }

    /// Removes a delivered segment from the counts.
    fn forget(&mut self, s: &Sent) {
        let len = u64::from(s.len);
        if s.sacked {
            self.sacked -= len;
            self.sacked_segments -= 1;
        } else {
            if s.retransmitted {
                self.retransmitted_out -= 1;
            }
            self.sub(s, len);
        }
    }

    /// `bytes` of a segment not SACKed were delivered.
    fn sub(&mut self, s: &Sent, bytes: u64) {
        if s.sacked {
            self.sacked -= bytes;
        } else if s.lost {
            self.lost -= bytes;
        } else {
            self.pipe -= bytes;
        }
    }

    /// RFC 8985 step 2: the most recently sent delivered segment, unless a retransmission
    /// came back faster than any round trip (its original arrived).
    fn rack_update(&mut self, now: Instant, s: &Sent, min_rtt: Option<Duration>) {
        let rtt = now - s.at;
        if s.retransmitted && min_rtt.is_some_and(|m| rtt < m) {
            return;
        }
        if self.rack.is_none_or(|(at, end)| (s.at, s.end()) > (at, end)) {
            self.rack = Some((s.at, s.end()));
            self.rack_rtt = rtt;
        }
    }

    /// RFC 8985 step 5: marks lost every segment sent before the most recently sent
    /// delivered one whose time is up (its round trip plus `reo_wnd` since it went out).
    /// Returns when the next segment's time is up, if one is waiting (RACK's reordering
    /// timer).
    pub fn detect_loss(&mut self, now: Instant, reo_wnd: Duration) -> Option<Instant> {
        let (rack_at, rack_end) = self.rack?;
        if self.sacked == 0 && self.retransmitted_out == 0 {
            // Everything in flight was sent in order after whatever was delivered.
            return None;
        }
        let in_order = self.retransmitted_out == 0;
        let mut timer: Option<Instant> = None;
        for s in self.segs.iter_mut() {
            if in_order && s.at > rack_at {
                break;
            }
            if s.sacked || s.lost || (s.at, s.end()) >= (rack_at, rack_end) {
                continue;
            }
            let due = s.at + self.rack_rtt + reo_wnd;
            if due <= now {
                s.lost = true;
                self.lost += u64::from(s.len);
                self.pipe -= u64::from(s.len);
            } else {
                timer = Some(timer.map_or(due, |t| t.min(due)));
            }
        }
        timer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(us: u64) -> Instant {
        Instant::from_nanos(us * 1000)
    }

    fn blocks(ack: u64, ranges: &[(u64, u64)]) -> SackBlocks {
        let mut b = SackBlocks::default();
        for &(s, e) in ranges {
            assert!(b.push(ack, s, e));
        }
        b
    }

    #[test]
    fn blocks_round_trip_and_hold_three() {
        let mut b = blocks(1000, &[(3000, 4000), (5000, 6000), (7000, 9000)]);
        assert!(!b.push(1000, 10_000, 11_000), "full");
        assert_eq!(b.ranges(1000).collect::<Vec<_>>(), [(3000, 4000), (5000, 6000), (7000, 9000)]);
        assert!(!SackBlocks::default().push(0, 1 << 33, (1 << 33) + 1), "too far to encode");
    }

    #[test]
    fn a_burst_of_drops_is_marked_lost_by_the_first_sack_beyond_it() {
        let mut sb = Scoreboard::default();
        for i in 0..10 {
            sb.sent(t(i), i * 100, 100);
        }
        assert_eq!(sb.pipe(), 1000);
        // 0 and 1 arrive; 2..=6 are dropped; 7 arrives at 1 ms + 7 us.
        assert_eq!(sb.handle_ack(t(1000), 200, &SackBlocks::default(), None), 200);
        assert_eq!(sb.detect_loss(t(1000), Duration::ZERO), None, "nothing SACKed: nothing to mark");
        let got = sb.handle_ack(t(1007), 200, &blocks(200, &[(700, 800)]), Some(Duration::from_micros(999)));
        assert_eq!(got, 100);
        assert_eq!(sb.detect_loss(t(1007), Duration::ZERO), None);
        assert_eq!(sb.lost(), 500, "the five holes at once");
        assert_eq!(sb.pipe(), 200, "8 and 9, sent after 7, are still in flight");
        assert_eq!(sb.first_lost(), Some((200, 100)));
        sb.resent(t(1008), 200);
        assert_eq!((sb.lost(), sb.pipe()), (400, 300));
        assert_eq!(sb.first_lost(), Some((300, 100)));
    }

    #[test]
    fn the_reordering_window_delays_marking_and_arms_a_timer() {
        let mut sb = Scoreboard::default();
        for i in 0..3 {
            sb.sent(t(i), i * 100, 100);
        }
        sb.handle_ack(t(1002), 0, &blocks(0, &[(100, 300)]), None);
        let due = sb.detect_loss(t(1002), Duration::from_micros(250));
        // Segment 0 went out at 0; the delivered segment 2's round trip is 1000 us.
        assert_eq!(due, Some(t(1250)));
        assert_eq!(sb.lost(), 0);
        assert_eq!(sb.detect_loss(t(1250), Duration::from_micros(250)), None);
        assert_eq!(sb.lost(), 100);
    }

    #[test]
    fn a_retransmission_acked_too_fast_is_its_original() {
        let mut sb = Scoreboard::default();
        sb.sent(t(0), 0, 100);
        sb.sent(t(1), 100, 100);
        sb.resent(t(500), 0);
        // 0's original arrives 100 us after the resend: not a sample of the resend.
        sb.handle_ack(t(600), 100, &SackBlocks::default(), Some(Duration::from_micros(1000)));
        assert_eq!(sb.detect_loss(t(600), Duration::ZERO), None);
        assert_eq!(sb.lost(), 0, "segment 1 is not lost because of the resend's time");
    }

    #[test]
    fn a_timeout_marks_all_but_sacked_lost_and_acks_clear_the_counts() {
        let mut sb = Scoreboard::default();
        for i in 0..4 {
            sb.sent(t(i), i * 100, 100);
        }
        sb.handle_ack(t(1003), 0, &blocks(0, &[(300, 400)]), None);
        sb.mark_all_lost();
        assert_eq!((sb.pipe(), sb.lost(), sb.sacked_segments()), (0, 300, 1));
        assert_eq!(sb.last_unsacked(), Some((200, 100)));
        for i in 0..3 {
            sb.resent(t(2000 + i), i * 100);
        }
        assert_eq!((sb.pipe(), sb.lost()), (300, 0));
        assert_eq!(sb.handle_ack(t(3000), 400, &SackBlocks::default(), None), 300);
        assert_eq!((sb.pipe(), sb.lost(), sb.sacked_segments(), sb.retransmitted_out), (0, 0, 0, 0));
    }
}
