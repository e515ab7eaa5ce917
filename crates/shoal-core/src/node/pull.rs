//! Credit-based pull, the builder's side: which fragment to ask which source for, when to
//! ask again, and when to give a fragment up.
//!
//! The data-flow manager ([`super::DataFlowManager`]) assigns slices; the builder opens at
//! most [`PullConfig::credits`] of them at a time and requests each one's fragment from
//! every source, keeping at most [`PullConfig::request_cap`] requests outstanding (0: no
//! cap). A request unanswered for [`PullConfig::reask_timeout`] is asked again, at most
//! [`PullConfig::max_reasks`] times; then the fragment is given up and, once nothing else
//! is pending for its slice, the slice is processed without it. A slice's credit returns
//! when the assembler has processed the slice; the builder reports that to the manager.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::shaping::PullConfig;
use crate::slice::SliceNumber;
use crate::{Instant, SourceId};

/// How many assigned slices a builder remembers, for a restarted manager to rebuild its
/// state from (more than any source's hold time, in slices, needs).
pub const ASSIGNED_HISTORY: usize = 4096;

/// Ask `source` for its fragment of `slice`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FragmentRequest {
    pub source: SourceId,
    pub slice: SliceNumber,
    /// A repeat of an unanswered request.
    pub reask: bool,
}

/// What a builder's pull side counted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct PullStats {
    pub assignments: u64,
    /// Assignments of a slice this builder already had (a restarted manager's overlap).
    pub duplicate_assignments: u64,
    /// First requests, and repeats of unanswered ones.
    pub requests: u64,
    pub reasks: u64,
    /// Fragments given up after the last re-ask.
    pub given_up: u64,
    /// Assignments that had to wait for a free credit, and requests held back by the cap.
    pub credit_waits: u64,
    pub cap_waits: u64,
}

impl PullStats {
    /// Adds another builder's counts (a run's totals).
    pub fn merge(&mut self, other: &PullStats) {
        self.assignments += other.assignments;
        self.duplicate_assignments += other.duplicate_assignments;
        self.requests += other.requests;
        self.reasks += other.reasks;
        self.given_up += other.given_up;
        self.credit_waits += other.credit_waits;
        self.cap_waits += other.cap_waits;
    }
}

#[derive(Debug)]
struct OpenSlice {
    /// Sources not asked yet: `next_source..n_sources`.
    next_source: SourceId,
    /// Asked and not answered: when last asked, and how many times.
    pending: BTreeMap<SourceId, (Instant, u32)>,
    given_up: u32,
}

/// The builder's pull decisions. How it decides: the documentation of its module, `shoal-core/src/node/pull.rs`.
#[derive(Debug)]
pub struct PullRequester {
    cfg: PullConfig,
    n_sources: u32,
    /// Assigned, waiting for a credit.
    queued: VecDeque<SliceNumber>,
    open: BTreeMap<SliceNumber, OpenSlice>,
    deadlines: BTreeSet<(Instant, SliceNumber, SourceId)>,
    outstanding: u64,
    /// Held back by the cap since the last request went out.
    cap_blocked: bool,
    requests: VecDeque<FragmentRequest>,
    done: VecDeque<SliceNumber>,
    give_up: VecDeque<SliceNumber>,
    /// The last assigned slices (newest at the back), and the same as a set.
    history: VecDeque<SliceNumber>,
    history_set: BTreeSet<SliceNumber>,
    stats: PullStats,
}

impl PullRequester {
    pub fn new(cfg: PullConfig, n_sources: u32) -> Self {
        Self {
            cfg,
            n_sources,
            queued: VecDeque::new(),
            open: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            outstanding: 0,
            cap_blocked: false,
            requests: VecDeque::new(),
            done: VecDeque::new(),
            give_up: VecDeque::new(),
            history: VecDeque::new(),
            history_set: BTreeSet::new(),
            stats: PullStats::default(),
        }
    }

    pub fn config(&self) -> &PullConfig {
        &self.cfg
    }

    /// The manager assigned `slice` to this builder.
    pub fn handle_assignment(&mut self, now: Instant, slice: SliceNumber) {
        if !self.history_set.insert(slice) {
            self.stats.duplicate_assignments += 1;
            return;
        }
        self.history.push_back(slice);
        if self.history.len() > ASSIGNED_HISTORY
            && let Some(old) = self.history.pop_front()
        {
            self.history_set.remove(&old);
        }
        self.stats.assignments += 1;
        if self.open.len() >= self.cfg.credits as usize {
            self.stats.credit_waits += 1;
        }
        self.queued.push_back(slice);
        self.issue(now);
    }

    /// A fragment arrived (whatever the assembler made of it).
    pub fn handle_arrival(&mut self, now: Instant, source: SourceId, slice: SliceNumber) {
        let Some(open) = self.open.get_mut(&slice) else { return };
        let Some((asked, _)) = open.pending.remove(&source) else { return };
        self.deadlines.remove(&(asked + self.cfg.reask_timeout, slice, source));
        self.outstanding -= 1;
        self.check_given_up(slice);
        self.issue(now);
    }

    /// Requests unanswered for the re-ask timeout are asked again, or given up.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(&(due, slice, source)) = self.deadlines.first() {
            if due > now {
                break;
            }
            self.deadlines.pop_first();
            let open = self.open.get_mut(&slice).expect("a deadline belongs to an open slice");
            let entry = open.pending.get_mut(&source).expect("a deadline belongs to a pending request");
            if entry.1 <= self.cfg.max_reasks {
                *entry = (now, entry.1 + 1);
                self.deadlines.insert((now + self.cfg.reask_timeout, slice, source));
                self.requests.push_back(FragmentRequest { source, slice, reask: true });
                self.stats.requests += 1;
                self.stats.reasks += 1;
            } else {
                open.pending.remove(&source);
                open.given_up += 1;
                self.outstanding -= 1;
                self.stats.given_up += 1;
                self.check_given_up(slice);
            }
        }
        self.issue(now);
    }

    /// The assembler processed `slice` (complete or not): its credit is free again and
    /// requests still pending for it are forgotten (a late answer is the assembler's).
    pub fn handle_slice_done(&mut self, now: Instant, slice: SliceNumber) {
        let Some(open) = self.open.remove(&slice) else { return };
        for (source, (asked, _)) in open.pending {
            self.deadlines.remove(&(asked + self.cfg.reask_timeout, slice, source));
            self.outstanding -= 1;
        }
        self.done.push_back(slice);
        self.issue(now);
    }

    /// Nothing more can arrive (every source ended its stream): every assigned slice, open
    /// or still waiting for a credit, is over and its credit returns.
    pub fn handle_drain(&mut self, now: Instant) {
        let slices: Vec<SliceNumber> = self.assigned().collect();
        for slice in slices {
            if self.open.contains_key(&slice) {
                self.handle_slice_done(now, slice);
            } else {
                self.done.push_back(slice);
            }
        }
        self.queued.clear();
    }

    /// The next request to send.
    pub fn poll_request(&mut self) -> Option<FragmentRequest> {
        self.requests.pop_front()
    }

    /// The next slice whose credit returned, for the manager.
    pub fn poll_done(&mut self) -> Option<SliceNumber> {
        self.done.pop_front()
    }

    /// The next slice to process without the fragments given up.
    pub fn poll_give_up(&mut self) -> Option<SliceNumber> {
        self.give_up.pop_front()
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadlines.first().map(|d| d.0)
    }

    /// Assigned slices not yet processed (open or waiting for a credit).
    pub fn assigned(&self) -> impl Iterator<Item = SliceNumber> + '_ {
        self.open.keys().copied().chain(self.queued.iter().copied())
    }

    /// The last [`ASSIGNED_HISTORY`] assigned slices, processed or not.
    pub fn history(&self) -> impl Iterator<Item = SliceNumber> + '_ {
        self.history.iter().copied()
    }

    /// Slices open (holding a credit).
    pub fn open(&self) -> usize {
        self.open.len()
    }

    /// Requests sent and not yet answered or given up.
    pub fn outstanding(&self) -> u64 {
        self.outstanding
    }

    pub fn stats(&self) -> &PullStats {
        &self.stats
    }

    fn check_given_up(&mut self, slice: SliceNumber) {
        let open = &self.open[&slice];
        if open.given_up > 0 && open.pending.is_empty() && open.next_source >= self.n_sources {
            self.give_up.push_back(slice);
        }
    }

    /// Opens slices while credits last, then asks while the cap allows.
    fn issue(&mut self, now: Instant) {
        while self.open.len() < self.cfg.credits as usize {
            let Some(slice) = self.queued.pop_front() else { break };
            self.open.insert(slice, OpenSlice { next_source: 0, pending: BTreeMap::new(), given_up: 0 });
        }
        let cap = if self.cfg.request_cap == 0 { u64::MAX } else { u64::from(self.cfg.request_cap) };
        for (&slice, open) in self.open.iter_mut() {
            while open.next_source < self.n_sources {
                if self.outstanding >= cap {
                    if !self.cap_blocked {
                        self.cap_blocked = true;
                        self.stats.cap_waits += 1;
                    }
                    return;
                }
                let source = open.next_source;
                open.next_source += 1;
                open.pending.insert(source, (now, 1));
                self.deadlines.insert((now + self.cfg.reask_timeout, slice, source));
                self.outstanding += 1;
                self.cap_blocked = false;
                self.requests.push_back(FragmentRequest { source, slice, reask: false });
                self.stats.requests += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Duration;

    fn ms(v: u64) -> Instant {
        Instant::from_nanos(v * 1_000_000)
    }

    fn drain(r: &mut PullRequester) -> Vec<(SourceId, SliceNumber, bool)> {
        std::iter::from_fn(|| r.poll_request()).map(|q| (q.source, q.slice, q.reask)).collect()
    }

    #[test]
    fn credits_cap_reasks_and_give_up() {
        let mut cfg = PullConfig::new(2);
        cfg.request_cap = 3;
        cfg.max_reasks = 1;
        cfg.reask_timeout = Duration::from_millis(10);
        let mut r = PullRequester::new(cfg, 2);
        for s in [5, 6, 7] {
            r.handle_assignment(ms(0), s);
        }
        r.handle_assignment(ms(0), 6);
        assert_eq!(r.stats().duplicate_assignments, 1);
        // Two credits: slices 5 and 6 open; the cap lets three requests out.
        assert_eq!(drain(&mut r), [(0, 5, false), (1, 5, false), (0, 6, false)]);
        assert_eq!((r.open(), r.outstanding(), r.stats().cap_waits), (2, 3, 1));
        r.handle_arrival(ms(1), 0, 5);
        assert_eq!(drain(&mut r), [(1, 6, false)]);
        r.handle_arrival(ms(2), 1, 5);
        r.handle_arrival(ms(2), 0, 6);
        // Slice 5 is complete; the assembler processes it and its credit opens slice 7.
        r.handle_slice_done(ms(3), 5);
        assert_eq!(r.poll_done(), Some(5));
        assert_eq!(drain(&mut r), [(0, 7, false), (1, 7, false)]);
        // Source 1 never answers for slice 6: asked again once at 11 ms, given up at 21 ms.
        assert_eq!(r.poll_timeout(), Some(ms(11)));
        r.handle_timeout(ms(11));
        assert_eq!(drain(&mut r), [(1, 6, true)]);
        r.handle_arrival(ms(12), 0, 7);
        r.handle_arrival(ms(12), 1, 7);
        r.handle_timeout(ms(21));
        assert_eq!(r.poll_give_up(), Some(6));
        assert_eq!(r.stats().given_up, 1);
        assert_eq!(r.outstanding(), 0);
        r.handle_slice_done(ms(21), 6);
        r.handle_slice_done(ms(21), 7);
        assert_eq!(r.assigned().count(), 0);
        let s = r.stats();
        assert_eq!((s.assignments, s.requests, s.reasks, s.credit_waits), (3, 7, 1, 1));
    }
}
