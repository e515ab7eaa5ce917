//! Diagnosis: which known problem the cluster has, on which processes, since when, and
//! what to do; and, after a run, one primary cause for every slice it lost.
//!
//! Like CMS's DAQExpert, the knowledge is a set of small independent rules
//! ([`rules`], one module each), every one a function over a [`Snapshot`] of what run
//! control knows (each process's presence, its counters, how they moved since the last
//! evaluation, the clocks' verdict). [`Diagnoser`] evaluates them (run control: every
//! second) and keeps the timeline of [`Episode`]s: when each problem began and ended. An
//! episode ends after [`QUIET_NS`] without its problem (a filter that is busy 120 % of one
//! second and 80 % of the next is one episode, not one a second).
//!
//! Two kinds of episode come from what processes report afterwards. A stall a process
//! reports is a past `process_hung` episode. A gap in its statistics with no stall over it
//! is a `network_path` episode: it was unreachable ([`silence`]).
//!
//! After the run, [`slices::attribute`] gives every lost slice (incomplete, assembled but
//! not filtered, or never built) exactly one primary cause, or `unexplained`, from the
//! builders' lists of incomplete slices, the departures and the timeline, naming the rule
//! that claimed it ([`SliceDiagnosis`]).
//!
//! Sans-IO: time comes in the snapshot (UNIX ns, run control's clock).

pub mod rules;
pub mod silence;
pub mod slices;

use std::collections::BTreeMap;

use crate::clocksync::ClockVerdict;

pub use slices::{LostSlice, RunFacts, SOURCES_LATE, SliceDiagnosis, SliceLoss, attribute};

/// The known problems, highest priority first: when several could explain a lost slice,
/// the first one claims it (a dead builder explains its sources' drops, not the reverse;
/// a filter behind fills its builder's memory, so it explains the builder's discards).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(rename_all = "snake_case"))]
pub enum Rule {
    ProcessDown,
    ProcessHung,
    ConfigMismatch,
    StorageFailing,
    FilterBehind,
    NetworkPath,
    BuilderDiscarding,
    SourceDropping,
    ConnectionsRefused,
    SourceCutOff,
    ClockSkew,
}

impl Rule {
    pub const ALL: [Rule; 11] = [
        Rule::ProcessDown,
        Rule::ProcessHung,
        Rule::ConfigMismatch,
        Rule::StorageFailing,
        Rule::FilterBehind,
        Rule::NetworkPath,
        Rule::BuilderDiscarding,
        Rule::SourceDropping,
        Rule::ConnectionsRefused,
        Rule::SourceCutOff,
        Rule::ClockSkew,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Rule::ProcessDown => "process_down",
            Rule::ProcessHung => "process_hung",
            Rule::BuilderDiscarding => "builder_discarding",
            Rule::FilterBehind => "filter_behind",
            Rule::SourceDropping => "source_dropping",
            Rule::ConnectionsRefused => "connections_refused",
            Rule::ClockSkew => "clock_skew",
            Rule::ConfigMismatch => "config_mismatch",
            Rule::StorageFailing => "storage_failing",
            Rule::NetworkPath => "network_path",
            Rule::SourceCutOff => "source_cut_off",
        }
    }

    /// The best action, for the operator.
    pub fn action(self) -> &'static str {
        match self {
            Rule::ProcessDown => {
                "run control restarts it (cluster.restart_limit); if it keeps dying, read its log in the \
                 state directory's logs/"
            }
            Rule::ProcessHung => {
                "it is alive but silent: look at its host (CPU, swap, a stopped process); restart it if it \
                 does not come back"
            }
            Rule::BuilderDiscarding => {
                "the builder refuses fragments for lack of memory or they come too late: raise \
                 builder.memory_budget_mb or wall_timeout_ms, or add builders"
            }
            Rule::FilterBehind => {
                "the filter is slower than the slices arrive: add builders or filter workers \
                 (builder.filter.workers), or make the filter cheaper"
            }
            Rule::SourceDropping => {
                "the source cannot send as fast as it produces (burst limit, back-pressure from its \
                 builders or the network): check the builders it sends to and its link; raise \
                 source.burst_cutoff or the queue if it is a burst"
            }
            Rule::ConnectionsRefused => {
                "a process refuses connections (bad frames, a version or configuration mismatch, \
                 a stranger on its port): compare the processes' configurations and versions"
            }
            Rule::ClockSkew => {
                "hosts' clocks differ beyond what the policy absorbs: let run control correct them \
                 (cluster.clock.correct) or fix the hosts' time service"
            }
            Rule::ConfigMismatch => {
                "processes disagree on the run (another shoal version, the configuration read \
                 differently, a source hosted twice): install one version everywhere and check each \
                 process's --ids"
            }
            Rule::StorageFailing => {
                "the writer's disk is full, gone or too slow: free space or point writer.out_dir at \
                 another disk (a failed disk is not tried again in this run), then start a new run"
            }
            Rule::NetworkPath => {
                "the path between these processes loses or stalls packets (retransmissions, a \
                 connection lost): check the links, switch ports and their error counters \
                 (ip -s link, ethtool -S)"
            }
            Rule::SourceCutOff => {
                "a burst went over the source's rate limit and the cutoff emptied fragments (their \
                 slices complete, their data gone): raise source.cutoff_head/cutoff_tail or the \
                 bandwidth if the bursts are physics"
            }
        }
    }
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The counters a rule looks at, for one process (totals since it started).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Counters {
    pub fragments_produced: u64,
    pub fragments_dropped_at_source: u64,
    pub fragments_discarded_at_builder: u64,
    /// Of those: refused by the builder's memory budget.
    pub fragments_refused_by_budget: u64,
    pub slices_complete: u64,
    pub slices_incomplete: u64,
    pub slices_not_filtered: u64,
    /// Time the builder's filter spent on slices, ns.
    pub filter_busy_ns: u64,
    /// When the process took these counters (its clock, ns): the time base of the
    /// counters' growth.
    pub taken_ns: u64,
    pub rejected_connections: u64,
    /// Fragments the burst rate cutoff emptied.
    pub fragments_cut_off: u64,
    /// The outgoing data links: connections lost while writing, TCP segments sent and
    /// sent again, datagrams sent and sent again on a NACK.
    pub link_failures: u64,
    pub tcp_segments_out: u64,
    pub tcp_retransmitted: u64,
    pub udp_datagrams: u64,
    pub udp_retransmitted: u64,
    /// A gauge, not a total: links in retransmission timeouts now.
    pub tcp_links_stalled: u64,
    /// A gauge: the writer's disk refused a write (1) or not (0).
    pub storage_failed: u64,
    /// Time the writer's disk thread spent writing, ns.
    pub storage_busy_ns: u64,
}

impl Counters {
    /// How much each counter grew from `before` (a restarted process starts again from
    /// zero: no growth, not a wrap).
    pub fn since(&self, before: &Counters) -> Counters {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        Counters {
            fragments_produced: d(self.fragments_produced, before.fragments_produced),
            fragments_dropped_at_source: d(self.fragments_dropped_at_source, before.fragments_dropped_at_source),
            fragments_discarded_at_builder: d(
                self.fragments_discarded_at_builder,
                before.fragments_discarded_at_builder,
            ),
            fragments_refused_by_budget: d(self.fragments_refused_by_budget, before.fragments_refused_by_budget),
            slices_complete: d(self.slices_complete, before.slices_complete),
            slices_incomplete: d(self.slices_incomplete, before.slices_incomplete),
            slices_not_filtered: d(self.slices_not_filtered, before.slices_not_filtered),
            filter_busy_ns: d(self.filter_busy_ns, before.filter_busy_ns),
            taken_ns: d(self.taken_ns, before.taken_ns),
            rejected_connections: d(self.rejected_connections, before.rejected_connections),
            fragments_cut_off: d(self.fragments_cut_off, before.fragments_cut_off),
            link_failures: d(self.link_failures, before.link_failures),
            tcp_segments_out: d(self.tcp_segments_out, before.tcp_segments_out),
            tcp_retransmitted: d(self.tcp_retransmitted, before.tcp_retransmitted),
            udp_datagrams: d(self.udp_datagrams, before.udp_datagrams),
            udp_retransmitted: d(self.udp_retransmitted, before.udp_retransmitted),
            // Gauges: their value now.
            tcp_links_stalled: self.tcp_links_stalled,
            storage_failed: self.storage_failed,
            storage_busy_ns: d(self.storage_busy_ns, before.storage_busy_ns),
        }
    }
}

/// Whether run control can reach a process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Presence {
    /// Announced, answering.
    #[default]
    Active,
    /// Gone: exited, left the dispatcher, or never announced itself (the reason).
    Down(String),
    /// Connected but did not answer a command in time (the reason).
    NotAnswering(String),
    /// Told OFF: leaving is expected.
    SwitchedOff,
}

/// One process as run control sees it now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessView {
    pub name: String,
    /// `source`, `builder`, `writer`, `dfm`, or `dispatcher`.
    pub role: String,
    pub presence: Presence,
    /// When its last statistics arrived (run control's clock, UNIX ns); none yet: none.
    pub last_stats_ns: Option<u64>,
    pub counters: Counters,
    /// Its process id (a new one: it was restarted).
    pub pid: Option<u32>,
    /// Its shoal version and the digest of its configuration (empty: not known).
    pub version: String,
    pub config_digest: String,
    /// Source processes: the sources it hosts.
    pub hosted_sources: Vec<u32>,
    /// The latest times it was not scheduled for 0.2 s or more, as it reported them.
    pub stalls: Vec<StallSeen>,
}

/// A process not scheduled for a while (stopped, its CPU taken), as it reported once it
/// ran again: stalls shorter than the hung threshold fall between the live checks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StallSeen {
    /// On run control's clock, UNIX ns.
    pub from_ns: u64,
    pub to_ns: u64,
    /// Of that time, it was runnable and waited for a CPU, ns.
    pub waited_for_cpu_ns: u64,
    /// Its end on the process's own clock: what tells one stall from the next (the same
    /// stall reported twice is put on run control's clock a little differently each time).
    pub key: u64,
}

impl StallSeen {
    pub fn detail(&self) -> String {
        let secs = self.to_ns.saturating_sub(self.from_ns) as f64 * 1e-9;
        let waited = self.waited_for_cpu_ns as f64 * 1e-9;
        if waited >= 0.5 * secs {
            format!("not scheduled for {secs:.2} s, runnable {waited:.2} s of it: its CPU was taken")
        } else {
            format!("not scheduled for {secs:.2} s, not runnable: stopped (or its host frozen)")
        }
    }
}

/// What run control knows at one moment.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Run control's clock, UNIX ns.
    pub now_ns: u64,
    /// How often processes send statistics.
    pub stats_interval_ns: u64,
    /// A run is taking data (rules on data flow only speak then).
    pub running: bool,
    /// Run control is carrying out a command (processes answering it may be silent).
    pub busy: bool,
    pub processes: Vec<ProcessView>,
    /// The tolerance rule on the data processes' clocks after the latest round.
    pub clock: Option<ClockVerdict>,
}

/// One problem found now: a rule, the process it is on, what was seen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub rule: Rule,
    pub process: String,
    pub role: String,
    pub detail: String,
}

/// What a rule is given: the snapshot and each process's counters' growth since the
/// previous evaluation (none for a process seen for the first time).
pub struct Evaluation<'a> {
    pub snapshot: &'a Snapshot,
    pub growth: &'a BTreeMap<String, Counters>,
    /// When each process was last seen gone, silent or replaced by a new incarnation
    /// (run control's clock): what its peers' connections saw then is its doing.
    pub last_away_ns: &'a BTreeMap<String, u64>,
}

impl Evaluation<'_> {
    pub fn growth_of(&self, name: &str) -> Counters {
        self.growth.get(name).copied().unwrap_or_default()
    }

    /// Whether a process of `role` was gone, silent or restarted within `window_ns`.
    pub fn role_away_within(&self, role: &str, window_ns: u64) -> bool {
        self.snapshot.processes.iter().filter(|p| p.role == role).any(|p| {
            self.last_away_ns.get(&p.name).is_some_and(|&t| self.snapshot.now_ns.saturating_sub(t) <= window_ns)
        })
    }
}

/// A problem over time: when it began, when it ended (none: still on).
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Episode {
    pub rule: Rule,
    pub process: String,
    pub role: String,
    pub began_ns: u64,
    pub ended_ns: Option<u64>,
    /// The last evaluation that found it.
    #[cfg_attr(feature = "serde", serde(default))]
    pub last_seen_ns: u64,
    /// What was seen, latest.
    pub detail: String,
    pub action: String,
}

impl Episode {
    /// Whether it was on at any time in `[from, to)` (widened by `margin` either side).
    pub fn overlaps(&self, from: u64, to: u64, margin: u64) -> bool {
        let end = self.ended_ns.unwrap_or(u64::MAX);
        self.began_ns < to.saturating_add(margin) && end.saturating_add(margin) > from
    }
}

/// An episode ends when its problem was not found for this long (it ends at the last time
/// it was found).
pub const QUIET_NS: u64 = 3_000_000_000;

/// Most episodes kept (the oldest ended ones go first; the count of those dropped is kept).
pub const MAX_EPISODES: usize = 2_000;

/// Evaluates the rules and keeps the timeline. See the module documentation.
#[derive(Debug, Default)]
pub struct Diagnoser {
    previous: BTreeMap<String, Counters>,
    previous_pid: BTreeMap<String, u32>,
    last_away_ns: BTreeMap<String, u64>,
    /// The latest stall recorded of each process (its key).
    last_stall: BTreeMap<String, u64>,
    /// Gaps in the processes' statistics: unreachable or hung.
    silences: silence::Silences,
    episodes: Vec<Episode>,
    forgotten: u64,
}

/// What changed at one evaluation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub began: Vec<Episode>,
    pub ended: Vec<Episode>,
}

impl Diagnoser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs every rule on `snapshot`; problems found begin an episode (or continue it),
    /// those not found for [`QUIET_NS`] end theirs.
    pub fn evaluate(&mut self, snapshot: &Snapshot) -> Changes {
        let mut growth = BTreeMap::new();
        for p in &snapshot.processes {
            if let Some(before) = self.previous.get(&p.name) {
                growth.insert(p.name.clone(), p.counters.since(before));
            }
        }
        let now = snapshot.now_ns;
        for p in &snapshot.processes {
            let replaced = p.pid.zip(self.previous_pid.get(&p.name)).is_some_and(|(a, &b)| a != b);
            if replaced || !matches!(p.presence, Presence::Active) {
                self.last_away_ns.insert(p.name.clone(), now);
            }
            if let Some(pid) = p.pid {
                self.previous_pid.insert(p.name.clone(), pid);
            }
        }
        let findings = rules::check_all(&Evaluation { snapshot, growth: &growth, last_away_ns: &self.last_away_ns });
        let mut changes = Changes::default();
        self.record_stalls(snapshot, &mut changes);
        for (name, role, from, to) in self.silences.observe(snapshot, &self.last_away_ns) {
            if let Some(e) = silence::record(&mut self.episodes, &name, &role, from, to) {
                changes.began.push(e.clone());
                self.episodes.push(e);
            }
        }
        self.previous = snapshot.processes.iter().map(|p| (p.name.clone(), p.counters)).collect();
        for e in self.episodes.iter_mut().filter(|e| e.ended_ns.is_none()) {
            let found = findings.iter().any(|f| f.rule == e.rule && f.process == e.process);
            if !found && now.saturating_sub(e.last_seen_ns) >= QUIET_NS {
                e.ended_ns = Some(e.last_seen_ns);
                changes.ended.push(e.clone());
            }
        }
        for f in findings {
            match self.episodes.iter_mut().find(|e| e.ended_ns.is_none() && e.rule == f.rule && e.process == f.process)
            {
                Some(e) => {
                    e.detail = f.detail;
                    e.last_seen_ns = now;
                }
                None => {
                    let e = Episode {
                        rule: f.rule,
                        process: f.process,
                        role: f.role,
                        began_ns: now,
                        ended_ns: None,
                        last_seen_ns: now,
                        detail: f.detail,
                        action: f.rule.action().to_string(),
                    };
                    changes.began.push(e.clone());
                    self.episodes.push(e);
                }
            }
        }
        while self.episodes.len() > MAX_EPISODES {
            match self.episodes.iter().position(|e| e.ended_ns.is_some()) {
                Some(i) => {
                    self.episodes.remove(i);
                    self.forgotten += 1;
                }
                None => break,
            }
        }
        changes
    }

    /// Stalls the processes reported that are not recorded yet: each a past
    /// [`Rule::ProcessHung`] episode, or the start of the live one it belongs to (a
    /// process stopped long enough to be found hung began to hang when it stopped).
    fn record_stalls(&mut self, snapshot: &Snapshot, changes: &mut Changes) {
        for p in &snapshot.processes {
            let last = self.last_stall.get(&p.name).copied().unwrap_or(0);
            for s in p.stalls.iter().filter(|s| s.key > last) {
                self.last_stall.insert(p.name.clone(), s.key);
                self.silences.stalled(&p.name, s.from_ns, s.to_ns);
                let joins = |e: &Episode| {
                    e.rule == Rule::ProcessHung
                        && e.process == p.name
                        && e.began_ns <= s.to_ns.saturating_add(QUIET_NS)
                        && e.ended_ns.unwrap_or(u64::MAX).saturating_add(QUIET_NS) >= s.from_ns
                };
                if let Some(e) = self.episodes.iter_mut().rev().find(|e| joins(e)) {
                    e.began_ns = e.began_ns.min(s.from_ns);
                    if let Some(end) = &mut e.ended_ns {
                        *end = (*end).max(s.to_ns);
                    }
                    e.last_seen_ns = e.last_seen_ns.max(s.to_ns);
                    continue;
                }
                let e = Episode {
                    rule: Rule::ProcessHung,
                    process: p.name.clone(),
                    role: p.role.clone(),
                    began_ns: s.from_ns,
                    ended_ns: Some(s.to_ns),
                    last_seen_ns: s.to_ns,
                    detail: s.detail(),
                    action: Rule::ProcessHung.action().to_string(),
                };
                changes.began.push(e.clone());
                self.episodes.push(e);
            }
        }
    }

    /// The problems on now, highest priority first.
    pub fn active(&self) -> Vec<&Episode> {
        let mut on: Vec<&Episode> = self.episodes.iter().filter(|e| e.ended_ns.is_none()).collect();
        on.sort_by(|a, b| (a.rule, &a.process).cmp(&(b.rule, &b.process)));
        on
    }

    /// Every episode kept, in the order they began.
    pub fn timeline(&self) -> &[Episode] {
        &self.episodes
    }

    /// Episodes on at any time in `[from_ns, to_ns)`.
    pub fn episodes_between(&self, from_ns: u64, to_ns: u64) -> Vec<Episode> {
        self.episodes.iter().filter(|e| e.overlaps(from_ns, to_ns, 0)).cloned().collect()
    }

    /// Ended episodes dropped to keep the timeline bounded.
    pub fn forgotten(&self) -> u64 {
        self.forgotten
    }
}

#[cfg(test)]
mod tests;
