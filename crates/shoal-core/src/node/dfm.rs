//! The data-flow manager (credit-based pull): assigns each slice to one builder.
//!
//! Slices become ready as they end on the slice clock. Each is assigned round robin to the
//! next builder that has a free credit ([`PullConfig::credits`] slices assigned and not yet
//! processed) and whose reported memory is under the limit; a builder without either is
//! skipped, as flesnet and ALICE do. When no builder can take it, the slice waits (a credit
//! wait, counted) and assignment resumes as builders report slices done.
//!
//! A builder that leaves (its connection closed, or silent for
//! [`DfmConfig::silence_timeout`] while holding slices) gets no more assignments; its
//! unprocessed slices are assigned again to the others (counted), whose requests the
//! sources answer from what they still hold.
//!
//! The manager keeps no state a restart could lose: it starts by gathering every
//! builder's hello (the slices assigned to it and not processed, and its recent
//! assignments) for [`DfmConfig::gather_timeout`] or until all have spoken. A fresh run
//! has empty hellos; after a restart the union of the histories says which slices were
//! already assigned, and every slice that ended within the sources' hold time and that no
//! builder claims is assigned again. Nothing is lost as long as the manager is back within
//! the hold time.
//!
//! A slice that waited for a credit longer than the sources' hold time is not assigned at
//! all (counted as expired): its fragments are gone, and asking for them would only cost
//! re-asks while newer slices wait.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::shaping::PullConfig;
use crate::slice::{SliceClock, SliceNumber};
use crate::{BuilderId, Duration, Instant};

/// What the manager is told at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DfmConfig {
    pub pull: PullConfig,
    pub slice_clock: SliceClock,
    /// The run's first slice.
    pub first_slice: SliceNumber,
    /// The first slice not to assign (`None`: until [`DataFlowManager::handle_end_slice`]).
    pub end_slice: Option<SliceNumber>,
    /// Builders expected (ids `0..builders`).
    pub builders: u32,
    /// A builder reporting more bytes in use than this is skipped.
    pub memory_limit: u64,
    /// A builder holding slices that says nothing for this long has left.
    pub silence_timeout: Duration,
    /// How long to wait for every builder's hello before assigning.
    pub gather_timeout: Duration,
}

impl DfmConfig {
    pub fn new(pull: PullConfig, slice_clock: SliceClock, first_slice: SliceNumber, builders: u32) -> Self {
        Self {
            pull,
            slice_clock,
            first_slice,
            end_slice: None,
            builders,
            memory_limit: u64::MAX,
            silence_timeout: Duration::from_secs(2),
            gather_timeout: Duration::from_millis(500),
        }
    }
}

/// Slice `slice` goes to builder `builder`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Assignment {
    pub slice: SliceNumber,
    pub builder: BuilderId,
}

/// Something the driver should log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DfmEvent {
    /// Gathering ended: how many builders spoke, and how many ended slices were found
    /// assigned before (a restart) or not.
    Started { builders: u32, claimed: u64, unclaimed: u64 },
    /// A builder left; its unprocessed slices are assigned again.
    BuilderLeft { builder: BuilderId, reassigned: u64, silent: bool },
    /// A builder that had left (fallen silent) spoke again: it takes assignments again,
    /// with fresh credits (what it held went to the others when it left).
    BuilderRejoined { builder: BuilderId },
    /// A builder ended cleanly (every source ended its stream to it); `dropped`
    /// assignments reached it after that and were never processed (at the end of a run:
    /// slices past the end, assigned before run control told the manager the end).
    BuilderEnded { builder: BuilderId, dropped: u64 },
}

/// What the manager counted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct DfmStats {
    pub assigned: u64,
    /// Assignments of slices whose builder left before processing them.
    pub reassigned: u64,
    /// Slices that found no builder with a free credit (and memory) when ready.
    pub credit_waits: u64,
    /// Builders passed over for a full credit count, or for memory.
    pub skipped_no_credit: u64,
    pub skipped_memory: u64,
    pub builders_left: u64,
    /// Builders that spoke again after leaving (silent, then back) and took assignments
    /// again.
    #[cfg_attr(feature = "serde", serde(default))]
    pub builders_rejoined: u64,
    /// Slices not assigned because they waited longer than the sources hold fragments.
    pub expired: u64,
    /// Slices assigned at or beyond the run's end slice before run control said where it
    /// was (the manager assigns as the clock passes; STOP reaches it after the sources
    /// have drained). The sources never produce them, so they are never built: the run's
    /// slices are `assigned - assigned_past_end` (less reassignments).
    #[cfg_attr(feature = "serde", serde(default))]
    pub assigned_past_end: u64,
    /// Slice end to assignment: sum and maximum, nanoseconds.
    pub assignment_latency_sum_ns: u64,
    pub assignment_latency_max_ns: u64,
}

#[derive(Debug, Default)]
struct BuilderState {
    assigned: BTreeSet<SliceNumber>,
    memory: u64,
    last_heard: Option<Instant>,
    alive: bool,
    /// Ended cleanly (its sources did): never assigned to again.
    ended: bool,
    /// Left for silence, its connection open: what it says next brings it back (a
    /// builder whose connection closed comes back only by a new hello).
    left_silent: bool,
}

#[derive(Debug)]
enum Phase {
    Gathering { until: Instant, claimed: BTreeSet<SliceNumber> },
    Assigning,
}

/// The data-flow manager. How it assigns: the documentation of its module, `shoal-core/src/node/dfm.rs`.
#[derive(Debug)]
pub struct DataFlowManager {
    cfg: DfmConfig,
    phase: Phase,
    builders: BTreeMap<BuilderId, BuilderState>,
    /// The next slice whose end is awaited.
    next_slice: SliceNumber,
    /// Ended and not assigned: (slice, when it became ready), oldest first.
    ready: VecDeque<(SliceNumber, Instant)>,
    /// The front of `ready` already counted as a credit wait.
    waiting_counted: Option<SliceNumber>,
    cursor: BuilderId,
    out: VecDeque<Assignment>,
    events: VecDeque<DfmEvent>,
    stats: DfmStats,
    /// The last [`DataFlowManager::handle_timeout`]: a long gap since means the manager
    /// itself did not run (stopped, starved), and the builders' silence meanwhile is its
    /// own, not theirs.
    last_tick: Option<Instant>,
}

impl DataFlowManager {
    /// A manager (new, or restarted mid-run) that gathers the builders' hellos first.
    pub fn new(cfg: DfmConfig, now: Instant) -> Self {
        Self {
            phase: Phase::Gathering { until: now + cfg.gather_timeout, claimed: BTreeSet::new() },
            builders: BTreeMap::new(),
            next_slice: cfg.first_slice,
            ready: VecDeque::new(),
            waiting_counted: None,
            cursor: 0,
            out: VecDeque::new(),
            events: VecDeque::new(),
            stats: DfmStats::default(),
            last_tick: None,
            cfg,
        }
    }

    pub fn config(&self) -> &DfmConfig {
        &self.cfg
    }

    /// A builder (re)connected: the slices assigned to it and not yet processed, and its
    /// recent assignments (processed or not).
    pub fn handle_hello(
        &mut self,
        now: Instant,
        builder: BuilderId,
        open: impl IntoIterator<Item = SliceNumber>,
        history: impl IntoIterator<Item = SliceNumber>,
    ) {
        let b = self.builders.entry(builder).or_default();
        b.alive = !b.ended;
        b.last_heard = Some(now);
        b.assigned.extend(open);
        if let Phase::Gathering { claimed, .. } = &mut self.phase {
            claimed.extend(b.assigned.iter().copied());
            claimed.extend(history);
        }
        let spoken = self.builders.values().filter(|b| b.alive).count() as u32;
        if matches!(self.phase, Phase::Gathering { .. }) && spoken >= self.cfg.builders {
            self.start(now);
        }
        self.assign(now);
    }

    /// `builder` processed `slice`: its credit is free.
    pub fn handle_done(&mut self, now: Instant, builder: BuilderId, slice: SliceNumber) {
        if let Some(b) = self.builders.get_mut(&builder) {
            b.assigned.remove(&slice);
            b.last_heard = Some(now);
        }
        self.heard_again(builder);
        self.assign(now);
    }

    /// `builder` reports the bytes it holds (assembler and filter queue).
    pub fn handle_memory(&mut self, now: Instant, builder: BuilderId, bytes: u64) {
        if let Some(b) = self.builders.get_mut(&builder) {
            b.memory = bytes;
            b.last_heard = Some(now);
        }
        self.heard_again(builder);
        self.assign(now);
    }

    /// A builder that left for silence and speaks again on the same connection (it was
    /// stopped, or its host starved it) takes assignments again.
    fn heard_again(&mut self, builder: BuilderId) {
        let Some(b) = self.builders.get_mut(&builder) else { return };
        if b.alive || b.ended || !b.left_silent || !matches!(self.phase, Phase::Assigning) {
            return;
        }
        b.alive = true;
        b.left_silent = false;
        self.stats.builders_rejoined += 1;
        self.events.push_back(DfmEvent::BuilderRejoined { builder });
    }

    /// `builder` is gone (its connection closed, or it was killed).
    pub fn handle_builder_left(&mut self, now: Instant, builder: BuilderId) {
        self.remove_builder(builder, false);
        self.assign(now);
    }

    /// `builder` ended cleanly: every source ended its stream to it, so no fragment can
    /// reach it any more and, the sources having closed, none can be asked for elsewhere.
    /// It takes no more assignments, and what it still holds is not handed on: nothing of
    /// it could be built (at the end of a run these are slices at or past the end).
    pub fn handle_builder_ended(&mut self, now: Instant, builder: BuilderId) {
        let Some(b) = self.builders.get_mut(&builder) else { return };
        if b.ended {
            return;
        }
        b.alive = false;
        b.ended = true;
        let dropped = std::mem::take(&mut b.assigned).len() as u64;
        self.events.push_back(DfmEvent::BuilderEnded { builder, dropped });
        self.assign(now);
    }

    /// Run control ends the run: `end` is the first slice not to assign.
    pub fn handle_end_slice(&mut self, now: Instant, end: SliceNumber) {
        let previous = self.cfg.end_slice.unwrap_or(SliceNumber::MAX);
        // Slices in [end, previous end) that left the ready queue were assigned.
        let ready: BTreeSet<SliceNumber> = self.ready.iter().map(|&(s, _)| s).collect();
        self.stats.assigned_past_end +=
            (end..self.next_slice.min(previous)).filter(|s| !ready.contains(s)).count() as u64;
        self.cfg.end_slice = Some(self.cfg.end_slice.map_or(end, |e| e.min(end)));
        self.ready.retain(|&(s, _)| s < end);
        // Those past the end still held are never produced, so never processed: their
        // credits come back now (a builder leaving later does not hand them on).
        for b in self.builders.values_mut() {
            b.assigned.retain(|&s| s < end);
        }
        self.assign(now);
    }

    /// Time has passed: ended slices become ready; silent builders leave; gathering ends.
    pub fn handle_timeout(&mut self, now: Instant) {
        if let Phase::Gathering { until, .. } = self.phase
            && now >= until
        {
            self.start(now);
        }
        if matches!(self.phase, Phase::Gathering { .. }) {
            return;
        }
        // The driver looks every 50 ms at least (`shoal-net`'s dfm); a gap of half the
        // silence timeout (200 ms or more)
        // is the manager's own stall: what the builders sent meanwhile is still unread,
        // so their silence is not judged from it.
        if self.last_tick.is_some_and(|t| now >= t + self.cfg.silence_timeout / 2) {
            for b in self.builders.values_mut() {
                b.last_heard = Some(now);
            }
        }
        self.last_tick = Some(now);
        let clock = self.cfg.slice_clock;
        while now >= clock.end_of(self.next_slice) && !self.ended(self.next_slice) {
            self.ready.push_back((self.next_slice, clock.end_of(self.next_slice)));
            self.next_slice += 1;
        }
        let silent: Vec<BuilderId> = self
            .builders
            .iter()
            .filter(|(_, b)| b.alive && !b.assigned.is_empty())
            .filter(|(_, b)| b.last_heard.is_some_and(|t| now >= t + self.cfg.silence_timeout))
            .map(|(&id, _)| id)
            .collect();
        for id in silent {
            self.remove_builder(id, true);
        }
        self.assign(now);
    }

    pub fn poll_assignment(&mut self) -> Option<Assignment> {
        self.out.pop_front()
    }

    pub fn poll_event(&mut self) -> Option<DfmEvent> {
        self.events.pop_front()
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        if let Phase::Gathering { until, .. } = self.phase {
            return Some(until);
        }
        let mut t =
            if self.ended(self.next_slice) { Instant::MAX } else { self.cfg.slice_clock.end_of(self.next_slice) };
        for b in self.builders.values().filter(|b| b.alive && !b.assigned.is_empty()) {
            if let Some(heard) = b.last_heard {
                t = t.min(heard + self.cfg.silence_timeout);
            }
            // Looking again well before a gap would read as the manager's own stall.
            if let Some(last) = self.last_tick {
                t = t.min(last + self.cfg.silence_timeout / 4);
            }
        }
        (t != Instant::MAX).then_some(t)
    }

    /// Every slice up to the end slice is assigned and processed, or no builder is left to
    /// take what remains (what it held is then never requested, in the sources' ledger).
    pub fn is_done(&self) -> bool {
        let alive = self.builders.values().any(|b| b.alive);
        matches!(self.phase, Phase::Assigning)
            && self.ended(self.next_slice)
            && (self.ready.is_empty() || !alive)
            && self.builders.values().filter(|b| b.alive).all(|b| b.assigned.is_empty())
    }

    /// Slices assigned to `builder` and not yet processed.
    pub fn assigned_to(&self, builder: BuilderId) -> usize {
        self.builders.get(&builder).map_or(0, |b| b.assigned.len())
    }

    /// Slices ended and not yet assigned.
    pub fn backlog(&self) -> usize {
        self.ready.len()
    }

    pub fn stats(&self) -> &DfmStats {
        &self.stats
    }

    fn ended(&self, slice: SliceNumber) -> bool {
        self.cfg.end_slice.is_some_and(|e| slice >= e)
    }

    /// Gathering is over: every slice that ended within the sources' hold time and that
    /// no builder claims is ready; the clock takes over from the current slice.
    fn start(&mut self, now: Instant) {
        let Phase::Gathering { claimed, .. } = std::mem::replace(&mut self.phase, Phase::Assigning) else { return };
        let clock = self.cfg.slice_clock;
        let current = clock.slice_at(now).max(self.cfg.first_slice);
        let oldest = current.saturating_sub(u64::from(self.cfg.pull.hold_slices)).max(self.cfg.first_slice);
        let (mut n_claimed, mut n_unclaimed) = (0, 0);
        for slice in oldest..current {
            if self.ended(slice) || now < clock.end_of(slice) {
                break;
            }
            if claimed.contains(&slice) {
                n_claimed += 1;
            } else {
                n_unclaimed += 1;
                self.ready.push_back((slice, clock.end_of(slice)));
            }
        }
        self.next_slice = current;
        let builders = self.builders.values().filter(|b| b.alive).count() as u32;
        self.events.push_back(DfmEvent::Started { builders, claimed: n_claimed, unclaimed: n_unclaimed });
        self.handle_timeout(now);
    }

    fn remove_builder(&mut self, builder: BuilderId, silent: bool) {
        let Some(b) = self.builders.get_mut(&builder) else { return };
        if !b.alive {
            return;
        }
        b.alive = false;
        b.left_silent = silent;
        let orphans = std::mem::take(&mut b.assigned);
        self.stats.builders_left += 1;
        self.stats.reassigned += orphans.len() as u64;
        self.events.push_back(DfmEvent::BuilderLeft { builder, reassigned: orphans.len() as u64, silent });
        // Back in front of the queue, oldest first, keeping the queue ordered.
        let mut merged: Vec<(SliceNumber, Instant)> = self.ready.drain(..).collect();
        let clock = self.cfg.slice_clock;
        merged.extend(orphans.into_iter().map(|s| (s, clock.end_of(s))));
        merged.sort_unstable_by_key(|&(s, _)| s);
        merged.dedup_by_key(|&mut (s, _)| s);
        self.ready = merged.into();
    }

    fn assign(&mut self, now: Instant) {
        if matches!(self.phase, Phase::Gathering { .. }) {
            return;
        }
        let credits = self.cfg.pull.credits as usize;
        let hold = u64::from(self.cfg.pull.hold_slices);
        while let Some(&(slice, ready_at)) = self.ready.front() {
            // The sources evict a fragment `hold` slices after it ended: a slice that old
            // would only cost its builder re-asks. It is not assigned (its fragments end as
            // never requested at the sources).
            if slice + hold <= self.next_slice {
                self.ready.pop_front();
                self.stats.expired += 1;
                continue;
            }
            let ids: Vec<BuilderId> = self
                .builders
                .range(self.cursor..)
                .chain(self.builders.range(..self.cursor))
                .map(|(&id, _)| id)
                .collect();
            let mut chosen = None;
            for id in ids {
                let b = &self.builders[&id];
                if !b.alive {
                    continue;
                }
                if b.assigned.len() >= credits {
                    self.stats.skipped_no_credit += 1;
                } else if b.memory > self.cfg.memory_limit {
                    self.stats.skipped_memory += 1;
                } else {
                    chosen = Some(id);
                    break;
                }
            }
            let Some(id) = chosen else {
                if self.waiting_counted != Some(slice) {
                    self.waiting_counted = Some(slice);
                    self.stats.credit_waits += 1;
                }
                return;
            };
            self.ready.pop_front();
            self.builders.get_mut(&id).expect("chosen").assigned.insert(slice);
            self.cursor = id.wrapping_add(1);
            let latency = now.saturating_duration_since(ready_at).as_nanos() as u64;
            self.stats.assigned += 1;
            self.stats.assignment_latency_sum_ns += latency;
            self.stats.assignment_latency_max_ns = self.stats.assignment_latency_max_ns.max(latency);
            self.out.push_back(Assignment { slice, builder: id });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn cfg(builders: u32, credits: u32) -> DfmConfig {
        DfmConfig::new(PullConfig::new(credits), SliceClock::new(Duration::from_millis(10)), 0, builders)
    }

    fn at(ms: u64) -> Instant {
        Instant::from_nanos(ms * MS)
    }

    fn drain(d: &mut DataFlowManager) -> Vec<(SliceNumber, BuilderId)> {
        std::iter::from_fn(|| d.poll_assignment()).map(|a| (a.slice, a.builder)).collect()
    }

    #[test]
    fn slices_assigned_before_the_end_slice_was_known_are_counted_past_the_end() {
        let mut d = DataFlowManager::new(cfg(1, 8), at(0));
        d.handle_hello(at(0), 0, [], []);
        d.handle_timeout(at(60));
        // Slices 0-5 ended and were assigned; the run ends at slice 4.
        assert_eq!(drain(&mut d).len(), 6);
        d.handle_end_slice(at(61), 4);
        assert_eq!(d.stats().assigned_past_end, 2);
        // An earlier end counts only what it adds; a later one nothing.
        d.handle_end_slice(at(62), 3);
        d.handle_end_slice(at(63), 5);
        assert_eq!((d.stats().assigned, d.stats().assigned_past_end), (6, 3));
    }

    #[test]
    fn round_robin_skips_full_builders_and_waits_for_credits() {
        let mut d = DataFlowManager::new(cfg(2, 1), at(0));
        d.handle_hello(at(0), 0, [], []);
        assert!(drain(&mut d).is_empty(), "still gathering: builder 1 has not spoken");
        d.handle_hello(at(1), 1, [], []);
        assert_eq!(d.poll_event(), Some(DfmEvent::Started { builders: 2, claimed: 0, unclaimed: 0 }));
        d.handle_timeout(at(30));
        // Slices 0, 1, 2 ended; one credit each: 0 -> b0, 1 -> b1, 2 waits.
        assert_eq!(drain(&mut d), [(0, 0), (1, 1)]);
        assert_eq!((d.backlog(), d.stats().credit_waits), (1, 1));
        d.handle_done(at(31), 1, 1);
        assert_eq!(drain(&mut d), [(2, 1)], "builder 0 is still full: skipped");
        d.handle_memory(at(32), 0, 10);
        d.handle_done(at(32), 0, 0);
        d.handle_timeout(at(40));
        assert_eq!(drain(&mut d), [(3, 0)]);
        assert_eq!(d.stats().assignment_latency_max_ns, 20 * MS, "slice 0 ended at 10 ms, assigned at 30");
    }

    #[test]
    fn a_builder_that_leaves_or_falls_silent_loses_its_slices_to_the_others() {
        let mut d = DataFlowManager::new(cfg(2, 4), at(0));
        d.handle_hello(at(0), 0, [], []);
        d.handle_hello(at(0), 1, [], []);
        d.handle_timeout(at(40));
        assert_eq!(drain(&mut d), [(0, 0), (1, 1), (2, 0), (3, 1)]);
        d.handle_builder_left(at(41), 1);
        assert_eq!(drain(&mut d), [(1, 0), (3, 0)]);
        assert_eq!(d.stats().reassigned, 2);
        // Builder 0 now says nothing while holding four slices: it leaves after 2 s (the
        // manager looking all the while).
        assert_eq!(d.poll_timeout(), Some(at(50)));
        for t in (90..=2040).step_by(50) {
            d.handle_timeout(at(t));
        }
        let left: Vec<_> = std::iter::from_fn(|| d.poll_event()).collect();
        assert!(left.contains(&DfmEvent::BuilderLeft { builder: 0, reassigned: 4, silent: true }), "{left:?}");
        assert!(drain(&mut d).is_empty(), "nobody left to assign to");
    }

    #[test]
    fn a_builder_silent_for_a_while_loses_its_slices_then_rejoins_with_fresh_credits() {
        // Silent for 300 ms: well within the 640 ms the sources hold a fragment.
        let mut c = cfg(2, 2);
        c.silence_timeout = Duration::from_millis(300);
        let mut d = DataFlowManager::new(c, at(0));
        d.handle_hello(at(0), 0, [], []);
        d.handle_hello(at(0), 1, [], []);
        d.handle_timeout(at(40));
        assert_eq!(drain(&mut d), [(0, 0), (1, 1), (2, 0), (3, 1)]);
        // Builder 1 is stopped at 40 ms; builder 0 returns its credits and takes more.
        d.handle_done(at(45), 0, 0);
        d.handle_done(at(45), 0, 2);
        d.handle_timeout(at(60));
        assert_eq!(drain(&mut d), [(4, 0), (5, 0)]);
        d.handle_done(at(65), 0, 4);
        d.handle_done(at(65), 0, 5);
        // The manager looks every 50 ms (its driver); builder 0 keeps taking slices.
        let mut taken = Vec::new();
        for t in (70..=341).step_by(50).chain([341]) {
            d.handle_timeout(at(t));
            let got = drain(&mut d);
            for &(s, b) in &got {
                if b == 0 {
                    d.handle_done(at(t), 0, s);
                }
            }
            taken.extend(got);
        }
        let handed: Vec<_> = taken.iter().filter(|&&(s, _)| s == 1 || s == 3).collect();
        assert_eq!(handed, [&(1, 0), &(3, 0)], "builder 1's two slices went to builder 0: {taken:?}");
        // Builder 1 runs again: its heartbeat brings it back, empty-handed.
        d.handle_memory(at(400), 1, 0);
        let events: Vec<_> = std::iter::from_fn(|| d.poll_event()).collect();
        assert!(events.contains(&DfmEvent::BuilderRejoined { builder: 1 }), "{events:?}");
        assert_eq!(d.stats().builders_rejoined, 1);
        let fresh: Vec<_> = drain(&mut d).into_iter().filter(|&(_, b)| b == 1).collect();
        assert_eq!(fresh.len(), 2, "builder 1 takes assignments again, two credits' worth: {fresh:?}");
        assert!(fresh.iter().all(|&(s, _)| s > 5), "new slices, not the ones it held: {fresh:?}");
        // A builder that ended cleanly is never brought back.
        d.handle_builder_ended(at(420), 0);
        d.handle_memory(at(430), 0, 0);
        assert_eq!(d.stats().builders_rejoined, 1);
    }

    #[test]
    fn a_manager_that_was_stopped_itself_does_not_take_the_builders_for_silent() {
        let mut c = cfg(2, 2);
        c.silence_timeout = Duration::from_millis(300);
        let mut d = DataFlowManager::new(c, at(0));
        d.handle_hello(at(0), 0, [], []);
        d.handle_hello(at(0), 1, [], []);
        d.handle_timeout(at(20));
        assert_eq!(drain(&mut d).len(), 2);
        // Nothing from 20 ms to 900 ms: the manager was stopped, its builders' heartbeats
        // wait unread in its sockets.
        d.handle_timeout(at(900));
        assert_eq!(d.stats().builders_left, 0);
        assert!(std::iter::from_fn(|| d.poll_event()).all(|e| !matches!(e, DfmEvent::BuilderLeft { .. })));
        // Silence after that, with the manager running, is the builders'.
        for t in (950..=1300).step_by(50) {
            d.handle_timeout(at(t));
        }
        assert_eq!(d.stats().builders_left, 2);
    }

    #[test]
    fn at_the_end_of_a_run_nothing_past_the_end_is_handed_on() {
        // Both builders' sources end at slice 4 (STOP has not reached the manager yet):
        // slices 4 and 5 went out meanwhile and will never be produced.
        let mut d = DataFlowManager::new(cfg(2, 8), at(0));
        d.handle_hello(at(0), 0, [], []);
        d.handle_hello(at(0), 1, [], []);
        d.handle_timeout(at(60));
        assert_eq!(drain(&mut d), [(0, 0), (1, 1), (2, 0), (3, 1), (4, 0), (5, 1)]);
        for s in 0..4 {
            d.handle_done(at(61), (s % 2) as BuilderId, s);
        }
        // Builder 1 ends cleanly holding slice 5: dropped, not handed to builder 0.
        d.handle_builder_ended(at(62), 1);
        let events: Vec<_> = std::iter::from_fn(|| d.poll_event()).collect();
        assert_eq!(events.last(), Some(&DfmEvent::BuilderEnded { builder: 1, dropped: 1 }));
        d.handle_builder_left(at(62), 1);
        assert!(drain(&mut d).is_empty());
        // Run control's end slice frees builder 0's credit for slice 4; leaving later
        // hands nothing on either.
        d.handle_end_slice(at(63), 4);
        assert_eq!(d.assigned_to(0), 0);
        assert!(d.is_done());
        d.handle_builder_left(at(64), 0);
        assert_eq!(d.stats().reassigned, 0);
        assert_eq!(d.stats().assigned_past_end, 2);
        assert!(drain(&mut d).is_empty());
    }

    #[test]
    fn a_restarted_manager_assigns_what_no_builder_claims() {
        // The old manager assigned 0..=5 and died with 3 in flight to builder 1; slices up
        // to 9 ended while it was away.
        let mut d = DataFlowManager::new(cfg(2, 4), at(100));
        d.handle_hello(at(100), 0, [4], [0, 2, 4]);
        d.handle_hello(at(100), 1, [5], [1, 5]);
        assert_eq!(d.poll_event(), Some(DfmEvent::Started { builders: 2, claimed: 5, unclaimed: 5 }));
        let got = drain(&mut d);
        let slices: Vec<_> = got.iter().map(|a| a.0).collect();
        assert_eq!(slices, [3, 6, 7, 8, 9]);
        assert_eq!(d.assigned_to(0) + d.assigned_to(1), 7);
    }
}
