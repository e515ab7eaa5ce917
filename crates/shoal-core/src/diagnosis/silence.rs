//! A process whose statistics stopped while it ran: unreachable, not hung.
//!
//! A process that is stopped, or whose CPU is taken, reports the stall afterwards
//! (`ProcessView::stalls`, from its own stall watch). A process on the far side of a cut
//! or lossy network keeps running: its statistics stop reaching run control, the other
//! processes' keep coming, and when the path is back it reports no stall over that time.
//! [`Silences`] finds such gaps in the arrival of a process's statistics. Each one becomes
//! a [`Rule::NetworkPath`] episode on the process ("unreachable"). A `process_hung` episode
//! that the silence began (the gap was long enough) is given that rule instead, so the
//! slices it cost go to the path.
//!
//! Kept out: a gap while the process was away (gone, restarted: `process_down`'s), and a
//! gap during which no other process's statistics came either. That is the dispatcher or
//! run control itself (`process_hung`'s dispatcher clause).

use std::collections::BTreeMap;

use super::{Episode, Rule, Snapshot};

/// A gap in a process's statistics this long is looked at: three intervals, at least 1 s
/// (a report late by one interval on a busy machine is not a gap).
pub fn gap_limit_ns(stats_interval_ns: u64) -> u64 {
    stats_interval_ns.saturating_mul(3).max(1_000_000_000)
}

/// How long after a gap its process's reports are awaited for a stall over it (the stall
/// watch's report may come in the report after the first one).
pub const STALL_REPORT_WAIT_NS: u64 = 2_000_000_000;

/// The gaps of the processes' statistics, while they are open and until decided.
#[derive(Debug, Default)]
pub struct Silences {
    /// Each process's latest statistics (run control's clock), at the previous evaluation.
    last_stats: BTreeMap<String, u64>,
    /// Processes silent for two intervals or more while another process's statistics came.
    others_talked: BTreeMap<String, bool>,
    /// Gaps closed, waiting for the process's stall reports: (process, role, from, to).
    pending: Vec<(String, String, u64, u64)>,
    /// Stalls each process reported (run control's clock), the latest few.
    stalls: BTreeMap<String, Vec<(u64, u64)>>,
}

/// Stalls remembered per process.
const STALLS_KEPT: usize = 32;

impl Silences {
    /// A stall `process` reported over `[from_ns, to_ns]`.
    pub fn stalled(&mut self, process: &str, from_ns: u64, to_ns: u64) {
        let s = self.stalls.entry(process.to_string()).or_default();
        s.push((from_ns, to_ns));
        if s.len() > STALLS_KEPT {
            s.remove(0);
        }
    }

    /// Follows the arrivals in `snapshot`; returns the gaps decided unreachable now, as
    /// (process, role, from, to). `last_away_ns`: when each process was last seen gone or
    /// replaced.
    pub fn observe(
        &mut self,
        snapshot: &Snapshot,
        last_away_ns: &BTreeMap<String, u64>,
    ) -> Vec<(String, String, u64, u64)> {
        let now = snapshot.now_ns;
        let limit = gap_limit_ns(snapshot.stats_interval_ns);
        let fresh = snapshot.stats_interval_ns.saturating_mul(2);
        let data = || snapshot.processes.iter().filter(|p| p.role != "dispatcher");
        for p in data() {
            let Some(last) = p.last_stats_ns else { continue };
            let prev = self.last_stats.insert(p.name.clone(), last);
            if now.saturating_sub(last) > fresh {
                let talked =
                    data().any(|q| q.name != p.name && q.last_stats_ns.is_some_and(|l| now.saturating_sub(l) <= fresh));
                *self.others_talked.entry(p.name.clone()).or_default() |= talked;
            }
            if let Some(prev) = prev
                && last > prev
                && last - prev > limit
            {
                let talked = self.others_talked.remove(&p.name).unwrap_or(false);
                let away = last_away_ns.get(&p.name).is_some_and(|&t| t >= prev);
                if talked && !away && snapshot.running {
                    self.pending.push((p.name.clone(), p.role.clone(), prev, last));
                }
            }
        }
        let (due, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.pending).into_iter().partition(|(_, _, _, to)| now >= to + STALL_REPORT_WAIT_NS);
        self.pending = waiting;
        due.into_iter()
            .filter(|(name, _, from, to)| {
                let stalled = self.stalls.get(name).is_some_and(|s| s.iter().any(|&(a, b)| a < *to && b > *from));
                let away = last_away_ns.get(name).is_some_and(|t| t >= from);
                !stalled && !away
            })
            .collect()
    }
}

/// What an unreachable gap says.
pub fn detail(from_ns: u64, to_ns: u64) -> String {
    format!(
        "unreachable: its statistics stopped for {:.1} s while it ran (no stall of its own) and the others' came",
        to_ns.saturating_sub(from_ns) as f64 * 1e-9
    )
}

/// The gap as an episode: a `process_hung` episode the silence began is given the path
/// (it never hung), or a past `network_path` episode is added. Returns the episode added.
pub fn record(episodes: &mut [Episode], process: &str, role: &str, from: u64, to: u64) -> Option<Episode> {
    let silent = |e: &Episode| {
        e.rule == Rule::ProcessHung
            && e.process == process
            && e.detail.starts_with(super::rules::process_hung::SILENT)
            && e.overlaps(from, to, 0)
    };
    if let Some(e) = episodes.iter_mut().rev().find(|e| silent(e)) {
        e.rule = Rule::NetworkPath;
        e.began_ns = e.began_ns.min(from);
        e.detail = detail(from, to);
        e.action = Rule::NetworkPath.action().to_string();
        return None;
    }
    Some(Episode {
        rule: Rule::NetworkPath,
        process: process.to_string(),
        role: role.to_string(),
        began_ns: from,
        ended_ns: Some(to),
        last_seen_ns: to,
        detail: detail(from, to),
        action: Rule::NetworkPath.action().to_string(),
    })
}
