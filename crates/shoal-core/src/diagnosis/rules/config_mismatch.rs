//! Processes disagree on the run: another shoal version than most, the configuration run
//! control sent read differently (its digest differs from most: other defaults), or a
//! source hosted by two processes (each builder then gets two fragments of that source and
//! discards one, while the source another process should host is missing). Named on the
//! processes that differ from the majority, or on both hosts of a source.

use std::collections::BTreeMap;

use super::super::{Evaluation, Finding, Presence, ProcessView, Rule};

/// The processes whose `key` is not the most common one (ties: the smallest value wins,
/// so the verdict does not depend on the processes' order).
fn minority<'a>(processes: &[&'a ProcessView], key: impl Fn(&ProcessView) -> &str) -> Vec<(&'a ProcessView, String)> {
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    for p in processes.iter().filter(|p| !key(p).is_empty()) {
        *count.entry(key(p)).or_default() += 1;
    }
    let Some(most) = count.iter().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0))).map(|(k, _)| k.to_string()) else {
        return Vec::new();
    };
    processes.iter().filter(|p| !key(p).is_empty() && key(p) != most).map(|p| (*p, most.clone())).collect()
}

pub fn check(ev: &Evaluation, out: &mut Vec<Finding>) {
    let up: Vec<&ProcessView> = ev
        .snapshot
        .processes
        .iter()
        .filter(|p| p.role != "dispatcher" && matches!(p.presence, Presence::Active))
        .collect();
    // What each process differs in, by name (one finding per process).
    let mut found: BTreeMap<&str, (&ProcessView, Vec<String>)> = BTreeMap::new();
    let mut differences = Vec::new();
    for (p, most) in minority(&up, |p| &p.version) {
        differences.push((p, format!("runs shoal {}, most processes {most}", p.version)));
    }
    for (p, most) in minority(&up, |p| &p.config_digest) {
        differences.push((p, format!("reads the configuration as {}, most processes as {most}", p.config_digest)));
    }
    let mut hosts: BTreeMap<u32, Vec<&ProcessView>> = BTreeMap::new();
    for p in up.iter().filter(|p| p.role == "source") {
        for &s in &p.hosted_sources {
            hosts.entry(s).or_default().push(p);
        }
    }
    for (source, by) in hosts.iter().filter(|(_, by)| by.len() > 1) {
        let names: Vec<&str> = by.iter().map(|p| p.name.as_str()).collect();
        for p in by {
            differences.push((p, format!("hosts source {source}, as do {}", names.join(" and "))));
        }
    }
    for (p, what) in differences {
        found.entry(p.name.as_str()).or_insert_with(|| (p, Vec::new())).1.push(what);
    }
    for (_, (p, what)) in found {
        // One source hosted twice is usually many: say the first few.
        let shown: Vec<String> = what.iter().take(3).cloned().collect();
        let more = what.len().saturating_sub(shown.len());
        let detail = if more > 0 { format!("{}; and {more} more", shown.join("; ")) } else { shown.join("; ") };
        out.push(super::finding(Rule::ConfigMismatch, p, detail));
    }
}
