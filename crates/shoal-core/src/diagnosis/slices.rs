//! One primary cause for every slice a run lost.
//!
//! A slice is lost when it was processed incomplete (a source sent nothing for it, or its
//! fragment was discarded), assembled but never filtered (its events lost), never built
//! (its builder was gone), its events died with a writer before their file was closed, or
//! the writer's disk refused them. [`attribute`] looks for a cause in this order, the
//! first found claims the slice:
//! 1. events the writer's disk refused: [`Rule::StorageFailing`] on the writer; a
//!    departure: the slice's builder, or the process hosting a source it lacked, was
//!    gone at the slice's time (from [`RunFacts::departures`]): [`Rule::ProcessDown`];
//!    events lost with a writer are that writer's;
//! 2. an [`Episode`] of the timeline, in [`Rule`]'s priority order, on a process involved
//!    in the slice (its builder, the hosts of the sources it lacked), on at the slice's
//!    time give or take [`RunFacts::margin_ns`]. A builder hung or down while the hosts of
//!    the missing sources were dropping claims the slice too: the sources were held
//!    back by that builder (direct back-pressure), so their drops are its symptom; under
//!    pull ([`RunFacts::pull`]) any builder or the data-flow manager hung or down claims
//!    the slices lost at its time (what a builder held went with it; the manager assigned
//!    nothing meanwhile). A process's stall (not scheduled for 0.2 s or more, reported
//!    once it runs again) is a hang episode of its own. A builder discarding fragments as late does not claim a slice whose missing sources
//!    all came late: their lateness is what it shows;
//! 3. a slice processed without sources that all sent its fragment afterwards
//!    ([`LostSlice::lacking_came_late`]): [`SOURCES_LATE`] on their hosts. They were sending,
//!    but behind by more than the builder waited (its wall-clock guard, its window);
//! 4. a slice never filtered is the filter's, even without an episode (its queue was full
//!    by definition): [`Rule::FilterBehind`];
//! 5. otherwise `unexplained`.

use std::collections::BTreeMap;

use super::{Episode, Rule};
use crate::slice::builder_for;

/// How a slice was lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(rename_all = "snake_case"))]
pub enum SliceLoss {
    /// Processed without every source's fragment.
    Incomplete,
    /// Assembled, never filtered: its events are lost.
    NotFiltered,
    /// Its builder was gone: never built.
    NotBuilt,
    /// Built and filtered, its events sent to a writer that died before closing the file
    /// they were in.
    EventsLost,
    /// Built and filtered, its events sent to a writer whose disk refused them (or the
    /// file they were in).
    NotStored,
}

impl SliceLoss {
    /// How much of the slice is gone (the larger, the more).
    pub fn severity(self) -> u8 {
        match self {
            SliceLoss::Incomplete => 0,
            SliceLoss::NotFiltered => 1,
            SliceLoss::EventsLost => 2,
            SliceLoss::NotStored => 3,
            SliceLoss::NotBuilt => 4,
        }
    }
}

/// One lost slice and what is known of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostSlice {
    pub slice: u64,
    pub builder: u32,
    pub loss: SliceLoss,
    /// Sources it lacked (sent nothing, or discarded).
    pub lacking: Vec<u32>,
    /// Every source it lacked sent its fragment after the slice was processed
    /// ([`crate::node::IncompleteSlice::sources_came_late`]).
    pub lacking_came_late: bool,
}

/// The cause of a slice whose lacking sources all sent their fragments after the builder
/// had processed it (not a [`Rule`]: no live rule sees it, the builders' lists do).
pub const SOURCES_LATE: &str = "sources_late";

/// What to do about [`SOURCES_LATE`].
pub const SOURCES_LATE_ACTION: &str = "the sources were sending but fell behind by more than the builders wait \
     (builder.wall_timeout_ms, builder.max_active): look at the sources' hosts (CPU, their links); under \
     delayed:K a source behind sends one fragment per round trip to its link, and delayed:K:2 lets it catch \
     up faster on a busy host; a longer guard holds more in the builders' memory";

/// A process of the run and what it hosts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Host {
    pub name: String,
    pub role: String,
    pub sources: Vec<u32>,
    pub builder: Option<u32>,
}

/// A process that left during the run: gone for slices `to_slice..rejoined_slice` (to the
/// end of the run if it never came back).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Departed {
    pub name: String,
    pub to_slice: u64,
    pub rejoined_slice: Option<u64>,
}

/// What is known of a finished run.
#[derive(Clone, Debug, Default)]
pub struct RunFacts {
    pub start_slice: u64,
    pub end_slice: u64,
    pub slice_ns: u64,
    pub n_builders: u32,
    /// Credit-based pull: a data-flow manager assigns slices, so a builder's slices are
    /// not known in advance (none is "never built" for a builder's absence: the manager
    /// gave them to the others), and what a builder that left or stopped held is lost in
    /// slices the others processed without it.
    pub pull: bool,
    /// Slices are numbered on the UNIX epoch: slice `n` starts at `n * slice_ns`.
    /// How far apart in time a cause and a lost slice may be and still be linked (the
    /// builders' timeout, the statistics interval, detection delays).
    pub margin_ns: u64,
    pub hosts: Vec<Host>,
    pub departures: Vec<Departed>,
    pub lost: Vec<LostSlice>,
    /// Incomplete slices the builders counted but did not list (beyond their list's
    /// bound): not attributed, said.
    pub unlisted: u64,
    pub episodes: Vec<Episode>,
}

/// Who lost a slice, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Cause {
    /// A [`Rule`]'s name, [`SOURCES_LATE`], or `unexplained`.
    pub rule: String,
    pub processes: Vec<String>,
}

/// The slices one cause claimed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct CauseSummary {
    pub rule: String,
    pub processes: Vec<String>,
    pub slices: u64,
    pub first_slice: u64,
    pub last_slice: u64,
    /// How they were lost: `incomplete`, `not_filtered`, `not_built`, with counts.
    pub losses: BTreeMap<String, u64>,
    pub action: String,
}

/// The post-mortem: every lost slice's primary cause, grouped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SliceDiagnosis {
    pub lost_slices: u64,
    pub explained: u64,
    pub unexplained: u64,
    /// Incomplete slices counted but not listed by their builder: not attributed.
    pub not_listed: u64,
    /// Largest group first.
    pub causes: Vec<CauseSummary>,
}

/// The slices of builder `b` that no incarnation of it built: from its departure to its
/// rejoining (or the end of the run). Static assignment (`builder_for`); a pull run's
/// data-flow manager reassigns a dead builder's slices, which then are not lost.
pub fn not_built(facts: &RunFacts, builder: u32, departed: &Departed) -> Vec<LostSlice> {
    let from = departed.to_slice.max(facts.start_slice);
    let to = departed.rejoined_slice.unwrap_or(facts.end_slice).min(facts.end_slice);
    (from..to)
        .filter(|s| facts.n_builders > 0 && builder_for(*s, facts.n_builders) == builder)
        .map(|slice| LostSlice {
            slice,
            builder,
            loss: SliceLoss::NotBuilt,
            lacking: Vec::new(),
            lacking_came_late: false,
        })
        .collect()
}

fn cause(rule: Rule, process: &str) -> Cause {
    Cause { rule: rule.name().to_string(), processes: vec![process.to_string()] }
}

/// The primary cause of one lost slice (see the module documentation).
pub fn cause_of(facts: &RunFacts, s: &LostSlice) -> Cause {
    let builder_host = facts.hosts.iter().find(|h| h.builder == Some(s.builder));
    let source_hosts: Vec<&Host> =
        facts.hosts.iter().filter(|h| h.sources.iter().any(|id| s.lacking.contains(id))).collect();
    let margin_slices = facts.margin_ns.div_ceil(facts.slice_ns.max(1));
    // 1. Departures.
    let gone = |name: &str| {
        facts.departures.iter().any(|d| {
            d.name == name
                && s.slice + margin_slices >= d.to_slice
                && s.slice < d.rejoined_slice.unwrap_or(u64::MAX).saturating_add(margin_slices)
        })
    };
    if s.loss == SliceLoss::NotStored
        && let Some(w) = facts.hosts.iter().find(|h| h.role == "writer")
    {
        return cause(Rule::StorageFailing, &w.name);
    }
    if s.loss == SliceLoss::EventsLost {
        // Only a writer that died leaves events unclosed: the one that departed, or the
        // run's writer if run control did not see it go.
        let writers = || facts.hosts.iter().filter(|h| h.role == "writer");
        if let Some(w) =
            writers().find(|w| facts.departures.iter().any(|d| d.name == w.name)).or_else(|| writers().next())
        {
            return cause(Rule::ProcessDown, &w.name);
        }
    }
    if let Some(b) = builder_host
        && (s.loss == SliceLoss::NotBuilt || gone(&b.name))
    {
        return cause(Rule::ProcessDown, &b.name);
    }
    if let Some(h) = source_hosts.iter().find(|h| gone(&h.name)) {
        return cause(Rule::ProcessDown, &h.name);
    }
    // 2. Episodes on the processes involved, at the slice's time.
    let from = s.slice.saturating_mul(facts.slice_ns);
    let to = from.saturating_add(facts.slice_ns);
    let on = |e: &&Episode| e.overlaps(from, to, facts.margin_ns);
    let involved =
        |name: &str| builder_host.is_some_and(|b| b.name == name) || source_hosts.iter().any(|h| h.name == name);
    let sources_dropping =
        facts.episodes.iter().filter(on).any(|e| e.rule == Rule::SourceDropping && involved(&e.process));
    // Every source it lacked sent its fragment after it was processed: the builder that
    // discarded them as late shows their lateness, it did not cause it.
    let all_late = s.loss == SliceLoss::Incomplete && s.lacking_came_late;
    // Under pull a builder gone or stopped took the fragments it had been handed into the
    // slices the manager gave to the others, and a manager gone or stopped assigned
    // nothing meanwhile: theirs are the slices lost at that time.
    let pull_cause = |e: &Episode| {
        facts.pull
            && matches!(e.rule, Rule::ProcessDown | Rule::ProcessHung)
            && (e.role == "builder" || e.role == "dfm")
    };
    let mut candidates: Vec<&Episode> = facts
        .episodes
        .iter()
        .filter(on)
        // A cut-off fragment arrives (an empty marker): the cutoff never loses a slice.
        .filter(|e| e.rule != Rule::SourceCutOff)
        .filter(|e| !(all_late && e.rule == Rule::BuilderDiscarding))
        .filter(|e| {
            involved(&e.process)
                || pull_cause(e)
                || (sources_dropping && e.role == "builder" && matches!(e.rule, Rule::ProcessDown | Rule::ProcessHung))
        })
        .collect();
    candidates.sort_by_key(|e| (e.rule, e.began_ns));
    if let Some(e) = candidates.first() {
        return cause(e.rule, &e.process);
    }
    // 3. Every source it lacked sent its fragment, after the slice was processed.
    if all_late {
        return Cause { rule: SOURCES_LATE.into(), processes: source_hosts.iter().map(|h| h.name.clone()).collect() };
    }
    // 4. Never filtered: the filter's queue was full.
    if s.loss == SliceLoss::NotFiltered
        && let Some(b) = builder_host
    {
        return cause(Rule::FilterBehind, &b.name);
    }
    Cause { rule: "unexplained".into(), processes: Vec::new() }
}

/// Every lost slice of the run (`facts.lost` plus the slices departed builders never
/// built) given its primary cause, grouped by cause.
pub fn attribute(facts: &RunFacts) -> SliceDiagnosis {
    let mut lost = facts.lost.clone();
    for d in facts.departures.iter().filter(|_| !facts.pull) {
        if let Some(b) = facts.hosts.iter().find(|h| h.name == d.name).and_then(|h| h.builder) {
            lost.extend(not_built(facts, b, d));
        }
    }
    // A slice listed twice (not filtered and incomplete, incomplete and its events not
    // stored) is lost once, by what lost the most of it: never built, then its output gone
    // whole, then not filtered, then incomplete.
    lost.sort_by_key(|l| (l.slice, std::cmp::Reverse(l.loss.severity())));
    lost.dedup_by_key(|l| l.slice);
    let mut groups: BTreeMap<(String, Vec<String>), CauseSummary> = BTreeMap::new();
    let mut d = SliceDiagnosis { lost_slices: lost.len() as u64, not_listed: facts.unlisted, ..Default::default() };
    for s in &lost {
        let c = cause_of(facts, s);
        if c.rule == "unexplained" {
            d.unexplained += 1;
        } else {
            d.explained += 1;
        }
        let action = if c.rule == SOURCES_LATE {
            SOURCES_LATE_ACTION
        } else {
            Rule::ALL.iter().find(|r| r.name() == c.rule).map_or(
                "no rule knows this loss: read the builders' and sources' logs around these slices, and report it",
                |r| r.action(),
            )
        };
        let g = groups.entry((c.rule.clone(), c.processes.clone())).or_insert_with(|| CauseSummary {
            rule: c.rule.clone(),
            processes: c.processes.clone(),
            slices: 0,
            first_slice: s.slice,
            last_slice: s.slice,
            losses: BTreeMap::new(),
            action: action.to_string(),
        });
        g.slices += 1;
        g.first_slice = g.first_slice.min(s.slice);
        g.last_slice = g.last_slice.max(s.slice);
        let kind = match s.loss {
            SliceLoss::Incomplete => "incomplete",
            SliceLoss::NotFiltered => "not_filtered",
            SliceLoss::NotBuilt => "not_built",
            SliceLoss::EventsLost => "events_lost",
            SliceLoss::NotStored => "not_stored",
        };
        *g.losses.entry(kind.to_string()).or_default() += 1;
    }
    d.causes = groups.into_values().collect();
    d.causes.sort_by(|a, b| b.slices.cmp(&a.slices).then(a.rule.cmp(&b.rule)));
    d
}
