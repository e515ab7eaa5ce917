//! A process is alive but silent: connected, yet it did not answer a command, or its
//! statistics stopped coming during a run (a stopped process, a host swapping or starved
//! of CPU). Only while a run takes data and no command is in progress (a process busy
//! with STOP's drain sends no statistics and is not hung). When no process's statistics
//! come at all, the dispatcher they all come through is the one hung.

use super::super::{Evaluation, Finding, Presence, Rule};

/// How a silence's finding begins (the path takes it over: `diagnosis::silence`).
pub const SILENT: &str = "sent no statistics for";

/// Silence that makes a process hung: five statistics intervals, at least 3 s (a busy
/// machine delays a process's timer by a fraction of that, not by all of it).
pub fn silence_limit_ns(stats_interval_ns: u64) -> u64 {
    stats_interval_ns.saturating_mul(5).max(3_000_000_000)
}

pub fn check(ev: &Evaluation, out: &mut Vec<Finding>) {
    let s = ev.snapshot;
    let limit = silence_limit_ns(s.stats_interval_ns);
    // Every process's statistics come through the dispatcher: when none has come from
    // anyone, it is the dispatcher that is silent (stopped, its host starved), not each
    // of them.
    let latest = s.processes.iter().filter(|p| p.role != "dispatcher").filter_map(|p| p.last_stats_ns).max();
    if s.running
        && !s.busy
        && let Some(latest) = latest
        && s.now_ns.saturating_sub(latest) > limit
        && let Some(d) = s.processes.iter().find(|p| p.role == "dispatcher" && p.presence == Presence::Active)
    {
        let silent = s.now_ns.saturating_sub(latest) as f64 * 1e-9;
        out.push(super::finding(
            Rule::ProcessHung,
            d,
            format!("no process's statistics came through it for {silent:.1} s"),
        ));
        return;
    }
    for p in &s.processes {
        match &p.presence {
            Presence::NotAnswering(why) => {
                out.push(super::finding(Rule::ProcessHung, p, format!("does not answer: {why}")))
            }
            Presence::Active if s.running && !s.busy => {
                let Some(last) = p.last_stats_ns else { continue };
                let silent = s.now_ns.saturating_sub(last);
                if silent > limit {
                    out.push(super::finding(Rule::ProcessHung, p, format!("{SILENT} {:.1} s", silent as f64 * 1e-9)));
                }
            }
            _ => {}
        }
    }
}
