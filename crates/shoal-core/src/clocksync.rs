//! Clocks across hosts: how far each process's clock is from run control's, and whether
//! the cluster can run with what is left after correction.
//!
//! Every shoal process derives slice numbers and send times from its host's clock, so the
//! hosts must agree. Run control measures each process with NTP's four-timestamp exchange
//! and tells it the correction to apply before a run (docs/clocks.md):
//!
//! - [`TimeSample`]: one exchange. Run control sends at `t1` (its clock), the process
//!   receives at `t2` and answers at `t3` (its clock), run control receives at `t4`. The
//!   offset is `((t2 - t1) + (t3 - t4)) / 2`, the round trip `(t4 - t1) - (t3 - t2)`.
//!   Whatever the asymmetry of the two ways, the true offset lies within half the round
//!   trip of that estimate: the stated uncertainty.
//! - [`estimate`]: of several samples the one with the least round trip (NTP's clock
//!   filter): queueing only ever adds delay, so the quickest exchange is the best.
//! - [`ClockProber`]: the rounds of probes (several samples each, at CONFIGURE and every
//!   few seconds), driven like the other machines: `poll_probe` out, `handle_answer` in,
//!   time passed in.
//! - [`judge`]: the tolerance rule. The offsets left after correction, each widened by its
//!   uncertainty, give the worst skew between two processes; the policy's slot and the
//!   builders' timeout say how much skew the run tolerates ([`ClockVerdict`]).

use std::collections::BTreeMap;

use crate::Duration;
use crate::Instant;
use crate::shaping::Policy;

/// One four-timestamp exchange, nanoseconds (`t1`, `t4` on run control's clock, `t2`,
/// `t3` on the process's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimeSample {
    pub t1: u64,
    pub t2: u64,
    pub t3: u64,
    pub t4: u64,
}

impl TimeSample {
    /// How far the process's clock is ahead of run control's (negative: behind), ns.
    pub fn offset_ns(&self) -> i64 {
        let there = self.t2 as i128 - self.t1 as i128;
        let back = self.t3 as i128 - self.t4 as i128;
        ((there + back) / 2) as i64
    }

    /// The round trip less the process's own time between receiving and answering, ns
    /// (0 when the timestamps contradict each other, e.g. a clock stepped between them).
    pub fn delay_ns(&self) -> u64 {
        let total = self.t4 as i128 - self.t1 as i128;
        let held = self.t3 as i128 - self.t2 as i128;
        (total - held).max(0) as u64
    }

    /// Whether the timestamps can be used: run control's answer after its question, the
    /// process's answer not before its receipt.
    pub fn is_plausible(&self) -> bool {
        self.t4 >= self.t1 && self.t3 >= self.t2 && (self.t4 - self.t1) >= (self.t3 - self.t2)
    }
}

/// What the samples of one round say of a process's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct OffsetEstimate {
    /// The process's clock minus run control's, ns (of the sample with the least round
    /// trip).
    pub offset_ns: i64,
    /// The true offset is within this of `offset_ns`: half that sample's round trip, ns.
    pub uncertainty_ns: u64,
    /// The least round trip, ns.
    pub delay_ns: u64,
    /// Samples used (plausible ones).
    pub samples: u32,
}

impl OffsetEstimate {
    /// The interval the true offset lies in, ns.
    pub fn bounds(&self) -> (i64, i64) {
        let u = self.uncertainty_ns.min(i64::MAX as u64) as i64;
        (self.offset_ns.saturating_sub(u), self.offset_ns.saturating_add(u))
    }
}

/// The estimate from a round's samples: the one with the least round trip; `None`
/// without a plausible sample.
pub fn estimate(samples: &[TimeSample]) -> Option<OffsetEstimate> {
    let good = samples.iter().filter(|s| s.is_plausible());
    let best = good.clone().min_by_key(|s| s.delay_ns())?;
    Some(OffsetEstimate {
        offset_ns: best.offset_ns(),
        // Rounded up: the bound must hold for odd round trips too.
        uncertainty_ns: best.delay_ns().div_ceil(2),
        delay_ns: best.delay_ns(),
        samples: good.count() as u32,
    })
}

/// When and how run control probes the clocks.
#[derive(Clone, Copy, Debug)]
pub struct ProberConfig {
    /// Samples per round.
    pub samples: u32,
    /// Between two samples of a round.
    pub spacing: Duration,
    /// Between rounds.
    pub interval: Duration,
    /// How long a round waits for its last answers after its last probe.
    pub answer_timeout: Duration,
}

impl Default for ProberConfig {
    fn default() -> Self {
        Self {
            samples: 8,
            spacing: Duration::from_millis(5),
            interval: Duration::from_secs(5),
            answer_timeout: Duration::from_millis(500),
        }
    }
}

/// A probe to send to every process: its sequence number and `t1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    pub seq: u64,
    pub t1: u64,
}

/// A finished round: the estimate of every process that answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoundDone {
    pub round: u64,
    pub estimates: BTreeMap<String, OffsetEstimate>,
}

/// The rounds of clock probes (sans-IO): one probe goes to every process at once; each
/// answer is matched to its probe by sequence number.
#[derive(Debug)]
pub struct ClockProber {
    cfg: ProberConfig,
    /// Probes of the round in progress: seq -> t1.
    sent: BTreeMap<u64, u64>,
    /// Samples of the round in progress, per process.
    samples: BTreeMap<String, Vec<TimeSample>>,
    next_seq: u64,
    round: u64,
    /// Probes left to send in this round (0: none in progress, or all sent).
    to_send: u32,
    in_round: bool,
    next_at: Instant,
    /// The round in progress ends at this time (after its last probe).
    round_end: Option<Instant>,
    done: Option<RoundDone>,
    /// The latest estimate of every process ever heard.
    latest: BTreeMap<String, OffsetEstimate>,
    /// Answers that matched no probe of the round in progress (late or forged).
    pub stray_answers: u64,
}

impl ClockProber {
    /// The first round starts at `now`.
    pub fn new(cfg: ProberConfig, now: Instant) -> Self {
        Self {
            cfg,
            sent: BTreeMap::new(),
            samples: BTreeMap::new(),
            next_seq: 1,
            round: 0,
            to_send: 0,
            in_round: false,
            next_at: now,
            round_end: None,
            done: None,
            latest: BTreeMap::new(),
            stray_answers: 0,
        }
    }

    /// Starts a round now (e.g. at CONFIGURE), unless one is in progress; returns its
    /// number, which [`ClockProber::poll_round`] reports when it is over.
    pub fn start_round(&mut self, now: Instant) -> u64 {
        if !self.in_round {
            self.next_at = now;
            self.begin(now);
        }
        self.round
    }

    fn begin(&mut self, now: Instant) {
        self.round += 1;
        self.in_round = true;
        self.to_send = self.cfg.samples.max(1);
        self.sent.clear();
        self.samples.clear();
        self.round_end = None;
        self.next_at = now;
    }

    /// The next probe to send, if one is due at `now`.
    pub fn poll_probe(&mut self, now: Instant) -> Option<Probe> {
        if !self.in_round && now >= self.next_at {
            self.begin(now);
        }
        if !self.in_round || self.to_send == 0 || now < self.next_at {
            return None;
        }
        let probe = Probe { seq: self.next_seq, t1: now.as_nanos() };
        self.next_seq += 1;
        self.to_send -= 1;
        self.sent.insert(probe.seq, probe.t1);
        if self.to_send == 0 {
            self.round_end = Some(now + self.cfg.answer_timeout);
        } else {
            self.next_at = now + self.cfg.spacing;
        }
        Some(probe)
    }

    /// An answer from `name` to probe `seq`, received at `t4`; `t2`, `t3` on its clock.
    pub fn handle_answer(&mut self, name: &str, seq: u64, t2: u64, t3: u64, t4: Instant) {
        let Some(&t1) = self.sent.get(&seq) else {
            self.stray_answers += 1;
            return;
        };
        let sample = TimeSample { t1, t2, t3, t4: t4.as_nanos() };
        self.samples.entry(name.to_string()).or_default().push(sample);
    }

    /// Ends the round whose time is over.
    pub fn handle_timeout(&mut self, now: Instant) {
        if let Some(end) = self.round_end
            && now >= end
        {
            let estimates: BTreeMap<String, OffsetEstimate> =
                self.samples.iter().filter_map(|(n, s)| Some((n.clone(), estimate(s)?))).collect();
            self.latest.extend(estimates.iter().map(|(n, e)| (n.clone(), *e)));
            self.done = Some(RoundDone { round: self.round, estimates });
            self.in_round = false;
            self.round_end = None;
            self.sent.clear();
            self.samples.clear();
            self.next_at = now + self.cfg.interval;
        }
    }

    /// When the machine next wants [`ClockProber::poll_probe`] or
    /// [`ClockProber::handle_timeout`].
    pub fn poll_timeout(&self) -> Instant {
        match self.round_end {
            Some(end) => end,
            None => self.next_at,
        }
    }

    /// The round that just ended, once.
    pub fn poll_round(&mut self) -> Option<RoundDone> {
        self.done.take()
    }

    /// The latest estimate of each process.
    pub fn latest(&self) -> &BTreeMap<String, OffsetEstimate> {
        &self.latest
    }

    /// Forgets a process (it left; its next incarnation has a clock of its own).
    pub fn forget(&mut self, name: &str) {
        self.latest.remove(name);
    }
}

/// How much skew a run tolerates, and what it has.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ClockVerdict {
    /// Worst difference between two data processes' clocks, each taken at the far end
    /// of its uncertainty, ns.
    pub skew_ns: u64,
    /// The least skew the measurements allow: the same two clocks' difference taken at
    /// the near ends of their uncertainty (0 when the bounds overlap). A skew beyond the
    /// limit only at the far ends may be a slow round trip, not a clock.
    #[cfg_attr(feature = "serde", serde(default))]
    pub skew_certain_ns: u64,
    /// The two processes of that skew (ahead, behind).
    pub between: Option<(String, String)>,
    /// The skew the policy absorbs without effect on completeness or slice delay, ns.
    pub tolerated_ns: u64,
    /// The skew beyond which data are lost or the shaping undone, ns.
    pub limit_ns: u64,
    pub level: ClockLevel,
    /// One line for the operator.
    pub reason: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum ClockLevel {
    /// Within what the policy absorbs.
    Ok,
    /// Runs, but slices wait longer or the shaping overlaps.
    Degraded,
    /// Fragments will miss their slices or the builders' timeouts.
    Beyond,
}

/// What a run needs of its clocks: the policy, the slice length, the builders' slice
/// timeout (from a slice's first fragment).
#[derive(Clone, Copy, Debug)]
pub struct ClockNeeds {
    pub policy: Policy,
    pub slice: Duration,
    pub builder_timeout: Duration,
}

impl ClockNeeds {
    /// The skew absorbed without effect, and the skew beyond which data are lost, ns.
    ///
    /// Every policy cuts time into slices and every source closes a slice by its own clock,
    /// so a skew delays the last fragment of a slice by as much: 5 % of a slice keeps the
    /// delay of every slice within 10 % of its zero-skew value (docs/clocks.md measures
    /// it). The barrel shifter and the token bucket also rely on the sources' sending
    /// times not overlapping: at half a slice two slots overlap by half. Beyond the
    /// builders' timeout, the last fragments of a slice arrive after it was given up.
    pub fn thresholds(&self) -> (u64, u64) {
        let slice = self.slice.as_nanos() as u64;
        let tolerated = slice / 20;
        let overlap_limit = match self.policy {
            Policy::Delayed { .. } | Policy::TokenBucket { .. } => slice / 2,
            // Direct sends at once at every slice end anyway; pull asks for a slice only
            // once its source has it: both are bounded by the builders' timeout only.
            _ => u64::MAX,
        };
        let timeout_limit = self.builder_timeout.as_nanos() as u64 / 2;
        (tolerated, overlap_limit.min(timeout_limit).max(tolerated))
    }
}

/// The tolerance rule: the skew between two of `clocks` (after whatever correction was
/// applied) against what `needs` tolerates. The level is judged on the skew the
/// measurements make certain (the two clocks' difference less both their bounds): a skew
/// over the tolerance only at the far ends of the bounds is inside the measurement's own
/// error (a slow round trip, two processes of one busy host) and warns of nothing.
pub fn judge(needs: &ClockNeeds, clocks: &BTreeMap<String, OffsetEstimate>) -> ClockVerdict {
    let (tolerated_ns, limit_ns) = needs.thresholds();
    // At the far ends (the most the skew may be) and at the near ends (the least).
    let (skew_ns, far) = worst_pair(clocks, |e| e.bounds().1, |e| e.bounds().0);
    let (skew_certain_ns, near) = worst_pair(clocks, |e| e.bounds().0, |e| e.bounds().1);
    let between = if skew_certain_ns > 0 { near } else { far };
    let level = if skew_certain_ns <= tolerated_ns {
        ClockLevel::Ok
    } else if skew_certain_ns <= limit_ns {
        ClockLevel::Degraded
    } else {
        ClockLevel::Beyond
    };
    let us = |ns: u64| ns as f64 / 1e3;
    let pair = between.as_ref().map(|(a, b)| format!(" ({a} ahead of {b})")).unwrap_or_default();
    let measured = format!("{:.0}-{:.0} us", us(skew_certain_ns), us(skew_ns));
    let reason = match level {
        ClockLevel::Ok => format!(
            "clock skew {measured}{pair}: at least {:.0} us, within the {:.0} us that {} with {:.0} ms slices absorbs",
            us(skew_certain_ns),
            us(tolerated_ns),
            needs.policy,
            needs.slice.as_nanos() as f64 / 1e6
        ),
        ClockLevel::Degraded => format!(
            "clock skew {measured}{pair}: at least {:.0} us, over the {:.0} us that {} absorbs: slices wait \
             longer and sending slots overlap; fix the hosts' time service (limit {:.0} us)",
            us(skew_certain_ns),
            us(tolerated_ns),
            needs.policy,
            us(limit_ns)
        ),
        ClockLevel::Beyond => format!(
            "clock skew {measured}{pair}: at least {:.0} us, beyond the {:.0} us {} can take: fragments \
             will miss their slots or the builders' timeout",
            us(skew_certain_ns),
            us(limit_ns),
            needs.policy
        ),
    };
    ClockVerdict { skew_ns, skew_certain_ns, between, tolerated_ns, limit_ns, level, reason }
}

/// The largest `ahead(A) - behind(B)` over two different processes A and B, and that pair
/// (ahead, behind); 0 with fewer than two clocks or when no difference is positive. With
/// the upper bound for `ahead` and the lower for `behind`, the skew at the far ends of the
/// uncertainty; the other way round, at the near ends.
fn worst_pair(
    clocks: &BTreeMap<String, OffsetEstimate>,
    ahead: impl Fn(&OffsetEstimate) -> i64,
    behind: impl Fn(&OffsetEstimate) -> i64,
) -> (u64, Option<(String, String)>) {
    // The two highest `ahead` and the two lowest `behind` suffice: the worst pair is
    // (highest, lowest) unless that is one process, then the better of the runners-up.
    let mut hi: Vec<(i64, &String)> = clocks.iter().map(|(n, e)| (ahead(e), n)).collect();
    let mut lo: Vec<(i64, &String)> = clocks.iter().map(|(n, e)| (behind(e), n)).collect();
    if hi.len() < 2 {
        return (0, None);
    }
    hi.sort_unstable_by(|a, b| b.cmp(a));
    lo.sort_unstable();
    let pairs = [(hi[0], lo[0]), (hi[0], lo[1]), (hi[1], lo[0])];
    let best = pairs
        .iter()
        .filter(|(a, b)| a.1 != b.1)
        .max_by_key(|(a, b)| a.0 as i128 - b.0 as i128)
        .expect("two processes make a pair");
    let skew = (best.0.0 as i128 - best.1.0 as i128).max(0) as u64;
    (skew, Some((best.0.1.clone(), best.1.1.clone())))
}

/// The correction to give a process whose clock, already corrected by `in_effect_ns`, was
/// just measured `e` from run control's: its host's whole offset, when the residual is
/// clearly more than the measurement's own error (twice its bound, and at least 10 us: a
/// correction by noise would only move the clock about); `None` otherwise.
pub fn correction(e: &OffsetEstimate, in_effect_ns: i64) -> Option<i64> {
    let worth = e.offset_ns.unsigned_abs() > (2 * e.uncertainty_ns).max(10_000);
    worth.then(|| in_effect_ns.saturating_add(e.offset_ns))
}

/// The estimates as they are once each process applied `corrections` (ns subtracted from
/// its clock): what the next round would measure, were the clocks steady.
pub fn after_correction(
    clocks: &BTreeMap<String, OffsetEstimate>,
    corrections: &BTreeMap<String, i64>,
) -> BTreeMap<String, OffsetEstimate> {
    clocks
        .iter()
        .map(|(n, e)| {
            let c = corrections.get(n).copied().unwrap_or(0);
            (n.clone(), OffsetEstimate { offset_ns: e.offset_ns.saturating_sub(c), ..*e })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: u64 = 1_000_000;

    /// The exchange as it happens: the process's clock is `offset` ahead; the probe takes
    /// `there` ns, the answer `back`, the process holds it `held`.
    fn exchange(t1: u64, offset: i64, there: u64, held: u64, back: u64) -> TimeSample {
        let t2 = (t1 + there) as i64 + offset;
        let t3 = t2 + held as i64;
        TimeSample { t1, t2: t2 as u64, t3: t3 as u64, t4: t1 + there + held + back }
    }

    #[test]
    fn a_symmetric_exchange_gives_the_offset_exactly() {
        let s = exchange(10 * MS, 1_234_567, 40_000, 5_000, 40_000);
        assert_eq!(s.offset_ns(), 1_234_567);
        assert_eq!(s.delay_ns(), 80_000);
        let s = exchange(10 * MS, -3 * MS as i64, 40_000, 5_000, 40_000);
        assert_eq!(s.offset_ns(), -3 * MS as i64);
    }

    #[test]
    fn the_quickest_sample_wins_and_implausible_ones_are_ignored() {
        let slow = exchange(0, 500_000, 900_000, 0, 100_000); // asymmetric: off by 400 us
        let quick = exchange(5 * MS, 500_000, 20_000, 0, 22_000);
        let broken = TimeSample { t1: 9 * MS, t2: 1, t3: 0, t4: 8 * MS };
        let e = estimate(&[slow, broken, quick]).unwrap();
        assert_eq!(e.samples, 2);
        assert_eq!(e.delay_ns, 42_000);
        assert!((e.offset_ns - 500_000).abs() <= 1_000, "{e:?}");
        assert_eq!(estimate(&[broken]), None);
    }

    #[test]
    fn rounds_send_their_probes_spaced_and_end_after_the_answer_timeout() {
        let cfg = ProberConfig {
            samples: 3,
            spacing: Duration::from_millis(10),
            interval: Duration::from_secs(2),
            answer_timeout: Duration::from_millis(100),
        };
        let t0 = Instant::from_nanos(1_000 * MS);
        let mut p = ClockProber::new(cfg, t0);
        let offsets = [("a", 2 * MS as i64), ("b", -(MS as i64))];
        let mut t = t0;
        let mut probes = 0;
        while p.poll_round().is_none() {
            while let Some(probe) = p.poll_probe(t) {
                probes += 1;
                for (name, off) in offsets {
                    let s = exchange(probe.t1, off, 30_000, 1_000, 30_000);
                    p.handle_answer(name, probe.seq, s.t2, s.t3, Instant::from_nanos(s.t4));
                }
            }
            p.handle_timeout(t);
            if let Some(r) = p.poll_round() {
                assert_eq!(r.round, 1);
                assert_eq!(probes, 3);
                assert_eq!(r.estimates["a"].offset_ns, 2 * MS as i64);
                assert_eq!(r.estimates["b"].offset_ns, -(MS as i64));
                assert_eq!(r.estimates["b"].samples, 3);
                break;
            }
            t = p.poll_timeout().max(t);
        }
        // Next round after the interval; a late answer to an old probe is stray.
        assert_eq!(p.poll_timeout(), t + Duration::from_secs(2));
        p.handle_answer("a", 1, 0, 0, t);
        assert_eq!(p.stray_answers, 1);
        assert_eq!(p.poll_probe(t), None);
        assert_eq!(p.start_round(t), 2, "a round on demand starts at once");
        assert!(p.poll_probe(t).is_some());
    }

    fn needs(policy: &str) -> ClockNeeds {
        ClockNeeds {
            policy: policy.parse().unwrap(),
            slice: Duration::from_millis(100),
            builder_timeout: Duration::from_millis(2000),
        }
    }

    fn clocks(offsets: &[(i64, u64)]) -> BTreeMap<String, OffsetEstimate> {
        offsets
            .iter()
            .enumerate()
            .map(|(i, &(offset_ns, uncertainty_ns))| {
                (
                    format!("p{i}"),
                    OffsetEstimate { offset_ns, uncertainty_ns, delay_ns: 2 * uncertainty_ns, samples: 8 },
                )
            })
            .collect()
    }

    #[test]
    fn a_lan_ntp_offset_is_absorbed_and_a_slice_is_not() {
        let ms = MS as i64;
        for policy in ["direct", "delayed:8", "tbf:125M", "pull:4"] {
            let v = judge(&needs(policy), &clocks(&[(ms / 2, 50_000), (-ms / 2, 50_000), (0, 10)]));
            assert_eq!(v.level, ClockLevel::Ok, "{policy}: {v:?}");
            assert_eq!(v.skew_ns, 1_100_000);
            // At the near ends: 1 ms less the two bounds.
            assert_eq!(v.skew_certain_ns, 900_000);
            assert_eq!(v.between, Some(("p0".into(), "p1".into())));
        }
        // A slow round trip alone (a 120-ms one): far ends 60 ms apart, near ends
        // overlapping: inside the measurement's error, no warning.
        let v = judge(&needs("delayed:8"), &clocks(&[(0, 60 * MS), (0, 10)]));
        assert_eq!((v.level, v.skew_certain_ns, v.skew_ns), (ClockLevel::Ok, 0, 60 * MS + 10), "{v:?}");
        // 600 us apart at the far ends with 100-us bounds on 100-ms slices (5 ms tolerated):
        // Ok; 7 ms apart less 2 x 0.5 ms: 6 ms certain, over the tolerance.
        let v = judge(&needs("delayed:8"), &clocks(&[(250_000, 50_000), (-250_000, 50_000)]));
        assert_eq!((v.level, v.skew_certain_ns), (ClockLevel::Ok, 400_000), "{v:?}");
        let v = judge(&needs("delayed:8"), &clocks(&[(7 * ms, 500_000), (0, 500_000)]));
        assert_eq!((v.level, v.skew_certain_ns), (ClockLevel::Degraded, 6 * MS), "{v:?}");
        assert!(v.reason.contains("at least 6000 us"), "{}", v.reason);
        let v = judge(&needs("delayed:8"), &clocks(&[(60 * ms, 0), (0, 0)]));
        assert_eq!(v.level, ClockLevel::Beyond, "{v:?}");
        let v = judge(&needs("delayed:8"), &clocks(&[(20 * ms, 0), (0, 0)]));
        assert_eq!(v.level, ClockLevel::Degraded, "{v:?}");
        // Direct is bounded by the builders' timeout only.
        assert_eq!(judge(&needs("direct"), &clocks(&[(60 * ms, 0), (0, 0)])).level, ClockLevel::Degraded);
        assert_eq!(judge(&needs("direct"), &clocks(&[(1_100 * ms, 0), (0, 0)])).level, ClockLevel::Beyond);
        // One process has no one to disagree with.
        assert_eq!(judge(&needs("direct"), &clocks(&[(9_000 * ms, 0)])).skew_ns, 0);
    }

    #[test]
    fn a_correction_is_given_only_for_more_than_the_noise() {
        let e = |offset_ns, uncertainty_ns| OffsetEstimate { offset_ns, uncertainty_ns, delay_ns: 0, samples: 8 };
        assert_eq!(correction(&e(3_000_000, 100_000), 0), Some(3_000_000));
        // Already corrected by 2.9 ms, 100 us left over a bound of 40 us: the whole offset.
        assert_eq!(correction(&e(100_000, 40_000), 2_900_000), Some(3_000_000));
        assert_eq!(correction(&e(150_000, 100_000), 2_900_000), None, "within twice the bound");
        assert_eq!(correction(&e(-9_000, 1_000), 0), None, "under 10 us");
        assert_eq!(correction(&e(-11_000, 1_000), 5), Some(-10_995));
    }

    fn policy() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec!["direct", "delayed:1", "delayed:8", "tbf:60M", "pull:2"])
    }

    proptest! {
        /// Whatever the asymmetry of the two ways and the process's holding time, the true
        /// offset is within the stated uncertainty of the estimate.
        #[test]
        fn the_true_offset_is_within_the_stated_uncertainty(
            offset in -5_000_000_000i64..5_000_000_000,
            ways in prop::collection::vec((0u64..5_000_000, 0u64..1_000_000, 0u64..5_000_000), 1..12),
        ) {
            let t0 = 10_000_000_000u64;
            let samples: Vec<TimeSample> = ways
                .iter()
                .enumerate()
                .map(|(i, &(there, held, back))| exchange(t0 + i as u64 * 10 * MS, offset, there, held, back))
                .collect();
            let e = estimate(&samples).unwrap();
            let (lo, hi) = e.bounds();
            prop_assert!(lo <= offset && offset <= hi, "{offset} outside {e:?}");
            let least = ways.iter().map(|&(a, _, b)| a + b).min().unwrap();
            prop_assert_eq!(e.delay_ns, least);
        }

        /// More skew never gives a better verdict, the skew is never below the spread of
        /// the offsets, and a correction by the measured offsets leaves only the
        /// uncertainties.
        #[test]
        fn the_verdict_is_monotone_and_correction_leaves_the_uncertainty(
            policy in policy(),
            offsets in prop::collection::vec((-200_000_000i64..200_000_000, 0u64..2_000_000), 2..30),
            extra in 0i64..100_000_000,
        ) {
            let n = needs(policy);
            let c = clocks(&offsets);
            let v = judge(&n, &c);
            let spread = offsets.iter().map(|o| o.0).max().unwrap() - offsets.iter().map(|o| o.0).min().unwrap();
            prop_assert!(v.skew_ns >= spread as u64);
            // The clock furthest ahead moves further ahead.
            let mut wider = offsets.clone();
            let top = (0..wider.len()).max_by_key(|&i| wider[i].0).unwrap();
            wider[top].0 += extra;
            prop_assert!(judge(&n, &clocks(&wider)).level >= v.level);
            let corrections: BTreeMap<String, i64> = c.iter().map(|(k, e)| (k.clone(), e.offset_ns)).collect();
            let after = judge(&n, &after_correction(&c, &corrections));
            let mut u: Vec<u64> = offsets.iter().map(|o| o.1).collect();
            u.sort_unstable();
            let worst_two = u[u.len() - 1] + u[u.len() - 2];
            prop_assert!(after.skew_ns <= worst_two, "{after:?}");
            prop_assert!(after.level <= v.level);
        }
    }
}
