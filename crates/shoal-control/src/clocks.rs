//! Run control's watch over the processes' clocks (docs/clocks.md): it drives shoal-core's
//! [`ClockProber`] (probes out on `RC_TIME`, answers in from the listener), keeps each
//! process's offset, decides the corrections to send and judges the skew left with
//! [`clocksync::judge`]. No I/O here: the controller publishes what this returns.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use shoal_core::clocksync::{self, ClockLevel, ClockNeeds, ClockProber, ClockVerdict, OffsetEstimate, ProberConfig};
use shoal_core::{Duration, Instant};
use shoal_net::node::Role;
use shoal_net::rcagent::TimeAnswer;

/// `[cluster.clock]`: how run control measures and corrects the processes' clocks.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClockSettings {
    /// Between two measurement rounds during and between runs, ms (one round also at
    /// every CONFIGURE).
    pub probe_interval_ms: u64,
    /// Probes per round; the one with the least round trip gives the offset.
    pub samples: u32,
    /// Send each process the correction that puts its clock on run control's before a
    /// run (false: only measure and warn).
    pub correct: bool,
    /// Warn when a process's clock (uncorrected) is further than this from run control's, us.
    pub warn_offset_us: f64,
}

impl Default for ClockSettings {
    fn default() -> Self {
        Self { probe_interval_ms: 5_000, samples: 8, correct: true, warn_offset_us: 1_000.0 }
    }
}

/// What run control knows of one process's clock.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcessClock {
    /// The host's clock minus run control's, ns, as the process would read it uncorrected.
    pub offset_ns: i64,
    /// The correction the process applies (subtracted from its host's clock), ns.
    pub correction_ns: i64,
    /// The corrected clock minus run control's, ns: what the data path runs with.
    pub residual_ns: i64,
    /// The true offset is within this of the measured one, ns.
    pub uncertainty_ns: u64,
    /// The least round trip of the latest round, ns.
    pub round_trip_ns: u64,
    /// UNIX ns of the latest round that heard the process.
    pub measured_unix_ns: u64,
    /// How fast the host's clock runs against run control's, parts per million, from the
    /// first round that heard this process to the latest (the longer apart, the tighter) ...
    pub drift_ppm: Option<f64>,
    /// ... within this (both rounds' bounds over the time between them).
    pub drift_bound_ppm: Option<f64>,
    /// The first round that heard the process: (offset ns, bound ns, UNIX ns).
    #[serde(skip)]
    first: Option<(i64, u64, u64)>,
}

/// The clocks' part of a run record.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ClockRecord {
    /// Each process's clock when the run started (the last round before START) ...
    pub at_start: BTreeMap<String, ProcessClock>,
    /// ... the tolerance rule's verdict then ...
    pub verdict_at_start: Option<ClockVerdict>,
    /// ... and at the end of the run (the latest round).
    pub at_end: BTreeMap<String, ProcessClock>,
    /// The worst skew between data processes over the run's rounds, ns.
    pub worst_skew_ns: u64,
    /// Warnings of the run (clock over the bound, skew over the tolerance).
    pub warnings: Vec<String>,
}

/// What a finished round asks the controller to do.
#[derive(Debug, Default)]
pub struct RoundActions {
    /// `RC_TIME` texts to publish (corrections).
    pub adjust: Vec<String>,
    /// Lines for the operator.
    pub warnings: Vec<String>,
}

/// The clock watch (see the module documentation).
#[derive(Debug)]
pub struct ClockWatch {
    pub settings: ClockSettings,
    prober: ClockProber,
    /// Processes whose clock the schedule depends on (sources, builders, the manager).
    data_processes: BTreeSet<String>,
    /// Each process's clock: processes of one host read one kernel clock, so they are
    /// compared as one ([`ClockWatch::verdict`]).
    clock_of: BTreeMap<String, String>,
    /// Everyone run control expects an answer from.
    expected: usize,
    clocks: BTreeMap<String, ProcessClock>,
    /// Processes warned about (once until they are back within the bound).
    warned: BTreeSet<String>,
    skew_warned: bool,
    needs: Option<ClockNeeds>,
    record: ClockRecord,
    rounds_done: u64,
    /// Whether the latest finished round asked for corrections.
    last_round_adjusted: bool,
}

impl ClockWatch {
    /// `processes`: each one's name, role and clock (its host's:
    /// `crate::cluster::ProcessSpec::clock`).
    pub fn new(
        settings: ClockSettings,
        processes: &[(String, Role, String)],
        needs: Option<ClockNeeds>,
        now: Instant,
    ) -> Self {
        let cfg = ProberConfig {
            samples: settings.samples.max(1),
            spacing: Duration::from_millis(5),
            interval: Duration::from_millis(settings.probe_interval_ms.max(100)),
            answer_timeout: Duration::from_millis(500),
        };
        Self {
            prober: ClockProber::new(cfg, now),
            data_processes: processes
                .iter()
                .filter(|(_, r, _)| *r != Role::Writer)
                .map(|(n, _, _)| n.clone())
                .collect(),
            clock_of: processes.iter().map(|(n, _, c)| (n.clone(), c.clone())).collect(),
            expected: processes.len(),
            settings,
            clocks: BTreeMap::new(),
            warned: BTreeSet::new(),
            skew_warned: false,
            needs,
            record: ClockRecord::default(),
            rounds_done: 0,
            last_round_adjusted: false,
        }
    }

    /// The next probe's `RC_TIME` text, if one is due (to be published at once: `t1` is
    /// `now`).
    pub fn poll_probe(&mut self, now: Instant) -> Option<String> {
        self.prober.poll_probe(now).map(|p| format!("* PROBE {}", p.seq))
    }

    /// `t1` of probe `seq` is kept by the prober; the text carries only the sequence.
    pub fn handle_answer(&mut self, a: &TimeAnswer, t4: Instant) {
        if a.seq == 0 {
            // The answer to a correction: its new value.
            if let Some(c) = self.clocks.get_mut(&a.name) {
                c.residual_ns += c.correction_ns - a.correction_ns;
                c.correction_ns = a.correction_ns;
            }
            return;
        }
        // Offsets are of the uncorrected clock: add back the correction in effect.
        self.prober.handle_answer(&a.name, a.seq, a.t2, a.t3, t4);
        self.clocks.entry(a.name.clone()).or_default().correction_ns = a.correction_ns;
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        self.prober.handle_timeout(now);
    }

    pub fn poll_timeout(&self) -> Instant {
        self.prober.poll_timeout()
    }

    /// Starts a round at once (CONFIGURE); its number.
    pub fn start_round(&mut self, now: Instant) -> u64 {
        self.prober.start_round(now)
    }

    /// A process left: its next incarnation has a clock of its own.
    pub fn forget(&mut self, name: &str) {
        self.clocks.remove(name);
        self.prober.forget(name);
    }

    pub fn clocks(&self) -> &BTreeMap<String, ProcessClock> {
        &self.clocks
    }

    /// The tolerance rule on the data processes' clocks as they run now (corrected). The
    /// processes of one clock count once, by the one measured best: what their
    /// measurements differ by is the measurements' error, not a skew.
    pub fn verdict(&self) -> Option<ClockVerdict> {
        let needs = self.needs.as_ref()?;
        let mut best: BTreeMap<&str, (&String, OffsetEstimate)> = BTreeMap::new();
        for (n, c) in self.clocks.iter().filter(|(n, _)| self.data_processes.contains(*n)) {
            let e = OffsetEstimate {
                offset_ns: c.residual_ns,
                uncertainty_ns: c.uncertainty_ns,
                delay_ns: c.round_trip_ns,
                samples: 1,
            };
            let clock = self.clock_of.get(n).map_or(n.as_str(), String::as_str);
            match best.get(clock) {
                Some((_, b)) if b.uncertainty_ns <= e.uncertainty_ns => {}
                _ => {
                    best.insert(clock, (n, e));
                }
            }
        }
        let running: BTreeMap<String, OffsetEstimate> = best.into_values().map(|(n, e)| (n.clone(), e)).collect();
        Some(clocksync::judge(needs, &running))
    }

    /// The round that just ended, if any: the processes' clocks updated, corrections to
    /// send, warnings. `running`: a run is on (its data paths keep their clocks).
    pub fn poll_round(&mut self, unix_ns: u64, running: bool) -> Option<RoundActions> {
        let done = self.prober.poll_round()?;
        self.rounds_done = done.round;
        let mut act = RoundActions::default();
        for (name, e) in &done.estimates {
            let c = self.clocks.entry(name.clone()).or_default();
            c.residual_ns = e.offset_ns;
            c.offset_ns = e.offset_ns + c.correction_ns;
            c.uncertainty_ns = e.uncertainty_ns;
            c.round_trip_ns = e.delay_ns;
            c.measured_unix_ns = unix_ns;
            match c.first {
                None => c.first = Some((c.offset_ns, e.uncertainty_ns, unix_ns)),
                // At least a second apart: a drift from rounds closer is mostly noise.
                Some((o0, u0, t0)) if unix_ns >= t0 + 1_000_000_000 => {
                    let dt = (unix_ns - t0) as f64;
                    c.drift_ppm = Some((c.offset_ns - o0) as f64 / dt * 1e6);
                    c.drift_bound_ppm = Some((u0 + e.uncertainty_ns) as f64 / dt * 1e6);
                }
                Some(_) => {}
            }
            let bound = (self.settings.warn_offset_us * 1e3) as i64;
            if c.offset_ns.abs() > bound {
                if self.warned.insert(name.clone()) {
                    act.warnings.push(format!(
                        "{name}: host clock {:+.0} us (+/- {:.0}) from run control's (bound {:.0} us){}",
                        c.offset_ns as f64 / 1e3,
                        c.uncertainty_ns as f64 / 1e3,
                        self.settings.warn_offset_us,
                        if self.settings.correct { ", corrected" } else { "" }
                    ));
                }
            } else if c.offset_ns.abs() < bound * 9 / 10 {
                self.warned.remove(name);
            }
            if self.settings.correct
                && !running
                && let Some(by) = clocksync::correction(e, c.correction_ns)
            {
                act.adjust.push(format!("{name} ADJUST {by}"));
            }
        }
        if let Some(v) = self.verdict() {
            if running {
                self.record.worst_skew_ns = self.record.worst_skew_ns.max(v.skew_ns);
            }
            if v.level > ClockLevel::Ok {
                if !self.skew_warned {
                    act.warnings.push(v.reason.clone());
                    self.skew_warned = true;
                }
            } else {
                self.skew_warned = false;
            }
        }
        if running {
            self.record.warnings.extend(act.warnings.iter().cloned());
        }
        self.last_round_adjusted = !act.adjust.is_empty();
        Some(act)
    }

    /// At START: the clocks and verdict the run starts with.
    pub fn run_started(&mut self) -> Option<ClockVerdict> {
        let verdict = self.verdict();
        self.record = ClockRecord {
            at_start: self.clocks.clone(),
            verdict_at_start: verdict.clone(),
            worst_skew_ns: verdict.as_ref().map_or(0, |v| v.skew_ns),
            ..Default::default()
        };
        verdict
    }

    /// At the end of a run: its record.
    pub fn run_ended(&mut self) -> ClockRecord {
        let mut r = std::mem::take(&mut self.record);
        r.at_end = self.clocks.clone();
        r
    }

    /// The number of the latest round finished.
    pub fn rounds_done(&self) -> u64 {
        self.rounds_done
    }

    /// Whether the latest finished round asked for corrections (CONFIGURE measures again).
    pub fn last_round_adjusted(&self) -> bool {
        self.last_round_adjusted
    }

    /// How many processes answered the latest round, of those expected.
    pub fn heard(&self) -> (usize, usize) {
        (self.clocks.len(), self.expected)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host clock running 50 ppm fast: the drift from the first round to the latest, its
    /// bound shrinking as the rounds grow apart.
    #[test]
    fn the_drift_is_measured_between_the_first_round_and_the_latest() {
        let procs = vec![("s0".to_string(), Role::Source, "host0".to_string())];
        let settings = ClockSettings { samples: 1, correct: false, ..Default::default() };
        let t0 = 1_000_000_000_000u64;
        let mut w = ClockWatch::new(settings, &procs, None, Instant::from_nanos(t0));
        let mut bounds = Vec::new();
        for round in 0..4u64 {
            let t = Instant::from_nanos(t0 + round * 10_000_000_000);
            w.start_round(t);
            let text = w.poll_probe(t).unwrap();
            let seq: u64 = text.rsplit(' ').next().unwrap().parse().unwrap();
            let drift = (round * 10_000_000_000 / 1_000_000 * 50) as i64; // 50 ns per ms
            let (a, t4) = answer("s0", seq, t.as_nanos(), drift, 0);
            w.handle_answer(&a, t4);
            let end = w.poll_timeout();
            w.handle_timeout(end);
            w.poll_round(t.as_nanos(), false).unwrap();
            let c = &w.clocks()["s0"];
            if round == 0 {
                assert_eq!(c.drift_ppm, None);
                continue;
            }
            let (d, b) = (c.drift_ppm.unwrap(), c.drift_bound_ppm.unwrap());
            assert!((d - 50.0).abs() <= b, "{d} +- {b}");
            bounds.push(b);
        }
        assert!(bounds.windows(2).all(|w| w[1] < w[0]), "{bounds:?}");
    }

    fn answer(name: &str, seq: u64, t1: u64, offset: i64, correction: i64) -> (TimeAnswer, Instant) {
        let t2 = (t1 + 50_000) as i64 + offset - correction;
        let a = TimeAnswer { name: name.into(), seq, t2: t2 as u64, t3: t2 as u64 + 1_000, correction_ns: correction };
        (a, Instant::from_nanos(t1 + 101_000))
    }

    /// A round measures, corrects the clock that is off, and the next round finds it on
    /// time; the raw offset stays what the host has.
    #[test]
    fn a_clock_off_is_measured_corrected_and_then_found_on_time() {
        let procs = vec![
            ("s0".to_string(), Role::Source, "host0".to_string()),
            ("b0".to_string(), Role::Builder, "host1".to_string()),
        ];
        let needs = ClockNeeds {
            policy: "delayed:2".parse().unwrap(),
            slice: std::time::Duration::from_millis(100),
            builder_timeout: std::time::Duration::from_secs(2),
        };
        let settings = ClockSettings { samples: 2, ..Default::default() };
        let mut w = ClockWatch::new(settings, &procs, Some(needs), Instant::from_nanos(1_000_000_000));
        let mut correction = 0;
        for round in 1..=2 {
            let mut t = w.poll_timeout();
            let mut actions = None;
            while actions.is_none() {
                while let Some(text) = w.poll_probe(t) {
                    let seq: u64 = text.rsplit(' ').next().unwrap().parse().unwrap();
                    for (name, off, corr) in [("s0", 3_000_000, correction), ("b0", 0, 0)] {
                        let (a, t4) = answer(name, seq, t.as_nanos(), off, corr);
                        w.handle_answer(&a, t4);
                    }
                    t = w.poll_timeout().max(t);
                }
                w.handle_timeout(t);
                actions = w.poll_round(t.as_nanos(), false);
                t = w.poll_timeout().max(t);
            }
            let act = actions.unwrap();
            let s0 = &w.clocks()["s0"];
            assert_eq!(s0.offset_ns, 3_000_000, "round {round}: {s0:?}");
            if round == 1 {
                assert_eq!(act.adjust, vec!["s0 ADJUST 3000000".to_string()]);
                assert!(act.warnings.iter().any(|l| l.contains("s0: host clock +3000 us")), "{act:?}");
                assert_eq!(w.verdict().unwrap().level, ClockLevel::Ok, "3 ms of 100 ms slices");
                correction = 3_000_000;
            } else {
                assert!(act.adjust.is_empty(), "{act:?}");
                assert_eq!(s0.residual_ns, 0);
                assert!(act.warnings.is_empty(), "warned once: {act:?}");
                assert!(w.verdict().unwrap().skew_ns <= 2 * 50_500);
            }
        }
    }

    /// Two processes of one host measured 7 ms apart (one of them answering late): one
    /// clock, no skew; the same measurements as two hosts' are a skew over the tolerance.
    #[test]
    fn processes_of_one_host_are_compared_as_one_clock() {
        let needs = ClockNeeds {
            policy: "delayed:2".parse().unwrap(),
            slice: std::time::Duration::from_millis(100),
            builder_timeout: std::time::Duration::from_secs(2),
        };
        let verdict = |b0_clock: &str| {
            let procs = vec![
                ("s0".to_string(), Role::Source, "host0".to_string()),
                ("b0".to_string(), Role::Builder, b0_clock.to_string()),
            ];
            let settings = ClockSettings { samples: 1, correct: false, ..Default::default() };
            let mut w = ClockWatch::new(settings, &procs, Some(needs), Instant::from_nanos(1_000_000_000));
            let mut t = w.poll_timeout();
            let mut done = None;
            while done.is_none() {
                while let Some(text) = w.poll_probe(t) {
                    let seq: u64 = text.rsplit(' ').next().unwrap().parse().unwrap();
                    for (name, off) in [("s0", 7_000_000), ("b0", 0)] {
                        let (a, t4) = answer(name, seq, t.as_nanos(), off, 0);
                        w.handle_answer(&a, t4);
                    }
                    t = w.poll_timeout().max(t);
                }
                w.handle_timeout(t);
                done = w.poll_round(t.as_nanos(), false);
                t = w.poll_timeout().max(t);
            }
            w.verdict().unwrap()
        };
        let one = verdict("host0");
        assert_eq!((one.level, one.skew_ns), (ClockLevel::Ok, 0), "{one:?}");
        let two = verdict("host1");
        assert_eq!(two.level, ClockLevel::Degraded, "{two:?}");
        assert!(two.skew_certain_ns > 5_000_000, "{two:?}");
    }
}
