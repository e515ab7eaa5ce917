//! The human-readable run summary printed by `shoal demo`.

use std::fmt::Write;

use shoal_net::demo::RunSummary;
use shoal_net::report::DelayStats;

fn us(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} s", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.2} ms", v / 1e3)
    } else {
        format!("{v:.0} us")
    }
}

fn delays(d: &DelayStats) -> String {
    if d.count == 0 {
        return "-".into();
    }
    format!("avg {}   p99 {}   max {}", us(d.mean_us), us(d.p99_us as f64), us(d.max_us as f64))
}

fn counts(m: &std::collections::BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = m.iter().map(|(k, v)| format!("{k} {v}")).collect();
    format!(" ({})", parts.join(", "))
}

/// Events, and the filter's reduction: hits received over hits stored.
fn events(s: &RunSummary) -> String {
    let stored = s.writer.file.hits;
    let reduction = if stored > 0 {
        format!(", reduction {:.0}x", s.hits_received as f64 / stored as f64)
    } else if s.hits_received > 0 {
        ", nothing selected".to_string()
    } else {
        String::new()
    };
    format!("{} ({} of {} hits stored{reduction})", s.writer.file.events, stored, s.hits_received)
}

/// The raw file (alert windows, late fragments) and the burst savers' history.
fn raw(s: &RunSummary) -> String {
    let held_max: u64 = s.builder_reports.iter().filter_map(|b| b.saver.as_ref()).map(|v| v.held_bytes_max).sum();
    let history = format!("history up to {:.1} MB held by the burst savers", held_max as f64 / 1e6);
    match &s.writer.raw {
        Some(r) => format!(
            "{} ({} alert and {} late fragments); {history}",
            r.path.display(),
            r.alert_fragments,
            r.late_fragments
        ),
        None => format!("none (no alert, no late fragment); {history}"),
    }
}

pub fn table(s: &RunSummary) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "shoal demo summary");
    for (k, v) in rows(s) {
        let _ = writeln!(o, "  {k:<15} {v}");
    }
    warnings(s, &mut o);
    o
}

/// The summary's rows: what the run was, what it delivered, where every fragment went.
fn rows(s: &RunSummary) -> Vec<(&'static str, String)> {
    let total = s.slices_complete + s.slices_incomplete;
    let pct = if total > 0 { 100.0 * s.slices_complete as f64 / total as f64 } else { 0.0 };
    vec![
        (
            "run",
            format!(
                "{}: {} sources x {} builders, policy {} over {}{}, {} ms slices, {} s{}",
                s.run,
                s.sources,
                s.builders,
                s.policy,
                if s.transport.is_empty() { "tcp" } else { &s.transport },
                match s.data_security.as_str() {
                    "" | "off" => String::new(),
                    m => format!(" ({m})"),
                },
                s.slice_ms,
                s.seconds,
                if s.sources_per_node > 1 {
                    format!(" ({} sources share each source process's connections)", s.sources_per_node)
                } else {
                    String::new()
                }
            ),
        ),
        (
            "slices",
            format!(
                "{} complete ({pct:.2}%), {} incomplete{}",
                s.slices_complete,
                s.slices_incomplete,
                counts(&s.incomplete_reasons)
            ),
        ),
        ("fragments", format!("{} received", s.fragments_received)),
        ("data", format!("{:.1} MB at {:.1} MB/s", s.bytes_received as f64 / 1e6, s.mbytes_per_s)),
        ("network delay", delays(&s.network_delay)),
        ("shaping delay", delays(&s.shaping_delay)),
        ("send completion", delays(&s.send_completion)),
        (
            "late / dropped",
            format!(
                "late {}, dropped at builder (overload) {}, dropped at source {}",
                s.ledger.buckets.get("late").copied().unwrap_or(0),
                s.ledger.buckets.get("dropped_overload").copied().unwrap_or(0),
                s.ledger.buckets.get("dropped_at_source").copied().unwrap_or(0),
            ),
        ),
        (
            "rejected conns",
            format!("{}{}", s.rejected_connections.values().sum::<u64>(), counts(&s.rejected_connections)),
        ),
        ("workload", s.workload.clone()),
        ("events", events(s)),
        (
            "ledger",
            format!(
                "produced {} = {}; unaccounted {}{}",
                s.ledger.produced,
                s.ledger
                    .buckets
                    .iter()
                    .filter(|(_, v)| **v > 0)
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect::<Vec<_>>()
                    .join(" + "),
                s.ledger.unaccounted,
                if s.ledger.balanced { " (balanced)" } else { " (NOT BALANCED)" }
            ),
        ),
        (
            "output",
            match &s.writer.error {
                None => format!("{} ({} bytes)", s.writer.file.path.display(), s.writer.file.bytes),
                Some(e) => format!(
                    "NOT STORED: {e} ({} events, {} raw records lost)",
                    s.writer.events_not_stored, s.writer.raw_not_stored
                ),
            },
        ),
        ("raw data", raw(s)),
        (
            "memory",
            format!(
                "peak resident {:.0} MB; budget {} MiB, queue bounds {} MiB (builders {} x {} MiB); {} page faults in \
                 the run{}{}",
                s.peak_rss_mb,
                s.memory_budget_mb,
                s.memory_planned_mb,
                s.builders,
                s.builder_memory_mb,
                s.page_faults,
                match s.prefaulted_mb {
                    0 => String::new(),
                    mb => format!("; {mb} MiB mapped before the run in {:.1} s", s.prefault_s),
                },
                match s.dropped_over_memory {
                    0 => String::new(),
                    n => format!("; {n} fragments dropped at sources over their share"),
                }
            ),
        ),
        ("summary", s.summary_path.display().to_string()),
    ]
}

/// Alerts answered, warnings and hints under the rows: what went wrong and what to try.
fn warnings(s: &RunSummary, o: &mut String) {
    for a in &s.writer.alerts {
        let _ = writeln!(o, "  {:<15} {}", "alert", a.describe());
    }
    let not_filtered: u64 = s.builder_reports.iter().map(|b| b.slices_not_filtered).sum();
    if not_filtered > 0 {
        let _ = writeln!(
            o,
            "  warning: {not_filtered} slices were assembled but not filtered (the filter is slower than the load): \
             their fragments were delivered, their events lost"
        );
    }
    let sum = |f: fn(&shoal_net::builder::BuilderReport) -> u64| s.builder_reports.iter().map(f).sum::<u64>();
    let (failed, timeout, malformed) =
        (sum(|b| b.filter_failed), sum(|b| b.filter_timeout), sum(|b| b.filter_malformed_events));
    if failed + timeout + malformed > 0 {
        let _ = writeln!(
            o,
            "  warning: the filter failed on {failed} slices and passed its deadline on {timeout} (their fragments \
             kept whole in the slices file, their events lost); {malformed} malformed events refused"
        );
    }
    if s.slices_skipped > 0 {
        let _ = writeln!(
            o,
            "  warning: the generator could not keep up and skipped {} slices (reached more than source.max_lag_ms late): \
             this machine cannot generate this load in real time (fewer sources, a `fixed` workload or source.replay_pool would)",
            s.slices_skipped
        );
    }
    if s.late_slice_ends > 0 {
        let _ = writeln!(
            o,
            "  warning: sources reached {} slice ends more than a slice late, the worst {:.1} ms late {:.1} s into the \
             run: the machine was short of CPU then",
            s.late_slice_ends, s.worst_late_ms, s.worst_late_at_s
        );
    }
    if let Some(w) = wall_clock_cuts(s) {
        let _ = writeln!(o, "  warning: {w}");
        if let Some(h) = window_hint(&s.policy, s.slice_ms, &s.send_completion) {
            let _ = writeln!(o, "  hint: {h}");
        }
    }
    let behind = s.late_slice_ends > 0 || s.slices_incomplete > 0;
    if let Some(h) = prefault_hint(behind, s.page_faults, s.peak_rss_mb, s.prefaulted_mb, s.memory_budget_mb) {
        let _ = writeln!(o, "  hint: {h}");
    }
    if s.late_slice_ends > 0 && s.slices_incomplete > 0 && s.generated_live {
        let _ = writeln!(
            o,
            "  hint: the sources computed their hits during the run, on the cores that also move, assemble and \
             filter them; `[source] replay_pool = 16` replays slices computed once (docs/benchmarks.md, \
             \"Full shape\")"
        );
    }
}

/// Slices the builders processed at their wall-clock guard, in words: the sources they
/// lacked most often, and whether those sources were still sending (their fragments came
/// later, `salvaged` or `late`) and how late the sources sent. A source that falls behind
/// by more than the guard misses slices although nothing is lost on the way.
fn wall_clock_cuts(s: &RunSummary) -> Option<String> {
    const REASON: &str = "wall_clock_timeout";
    let cut = s.incomplete_reasons.get(REASON).copied().filter(|&n| n > 0)?;
    let mut missing = std::collections::BTreeMap::<u32, u64>::new();
    // Listed cut slices whose every missing fragment came later (the builders' `arrived_late`).
    let mut all_came_later = 0u64;
    for i in s.builder_reports.iter().flat_map(|b| &b.node.incomplete_slices).filter(|i| i.reason == REASON) {
        for &m in &i.missing {
            *missing.entry(m).or_default() += 1;
        }
        all_came_later += u64::from(i.sources_came_late());
    }
    let mut text =
        format!("{cut} slices were processed incomplete at the builders' wall-clock guard (`builder.wall_timeout_ms`)");
    let groups = source_groups(&missing);
    if !groups.is_empty() {
        let shown: Vec<String> = groups
            .iter()
            .take(4)
            .map(|(ids, n)| format!("{ids} ({n} slice{})", if *n == 1 { "" } else { "s" }))
            .collect();
        let more = if groups.len() > 4 { format!(" and {} more", groups.len() - 4) } else { String::new() };
        let _ = write!(text, "; most often missing: sources {}{more}", shown.join(", "));
    }
    let bucket = |k: &str| s.ledger.buckets.get(k).copied().unwrap_or(0);
    let (salvaged, late) = (bucket("salvaged"), bucket("late"));
    if all_came_later > 0 {
        let _ = write!(
            text,
            ". In {all_came_later} of them every missing fragment came later ({salvaged} salvaged, {late} late in \
             the run), and the sources sent up to {} after their slices' end: the sources were sending but fell \
             behind by more than the guard (a machine short of CPU, a path too slow for the load, or a shaping \
             policy that holds them longer)",
            us(s.shaping_delay.max_us as f64)
        );
    }
    Some(text)
}

/// For a barrel shifter with one fragment in flight whose sources fell behind: how fast a
/// source behind can catch up is one fragment per round trip through its link, and when
/// that round trip is a good part of a slot (a busy process), a window lets it hand out
/// more at a time.
fn window_hint(policy: &str, slice_ms: u64, send_completion: &DelayStats) -> Option<String> {
    let Ok(shoal_core::shaping::Policy::Delayed { k, window: 1 }) = policy.parse() else { return None };
    let slot_us = slice_ms as f64 * 1e3;
    (send_completion.count > 0 && send_completion.mean_us >= slot_us / 4.0).then(|| {
        format!(
            "with `delayed:{k}` a source behind its slots sends one fragment per round trip to its link, and that \
             round trip took {} on average against {slice_ms}-ms slices: `delayed:{k}:2` lets a source behind \
             hand out two at a time (docs/configuration.md, `run.policy`)",
            us(send_completion.mean_us)
        )
    })
}

/// When a run that fell behind mapped a good part of its memory while the data flowed
/// (more than a GiB of page faults), mapping it before the run frees that CPU. The size
/// is what was mapped before and faulted after, or the process's peak (`peak_rss_mb`, MB;
/// 0 unknown), the smaller: the allocator gives freed memory back to the kernel and faults
/// it in again, which a prefault stops, so a run can fault more than it ever holds. No
/// hint where that is no more than was mapped already.
fn prefault_hint(
    behind: bool,
    page_faults: u64,
    peak_rss_mb: f64,
    prefaulted_mb: u64,
    budget_mb: u64,
) -> Option<String> {
    const PAGE: u64 = 4096;
    let faulted = page_faults * PAGE;
    if !behind || faulted <= 1 << 30 {
        return None;
    }
    let mapped = (prefaulted_mb << 20) + faulted;
    let peak = (peak_rss_mb * 1e6) as u64;
    let working = if peak > 0 { mapped.min(peak) } else { mapped };
    // In whole GiB, within the budget.
    let gib_in_mb = working.div_ceil(1 << 30) << 10;
    let mb = if budget_mb > 0 { gib_in_mb.min(budget_mb) } else { gib_in_mb };
    let before = match prefaulted_mb {
        0 => String::new(),
        p => format!(" after the {p} MiB mapped before it"),
    };
    (mb > prefaulted_mb).then(|| {
        format!(
            "the kernel mapped {:.1} GiB of this process's memory page by page while the data flowed ({} page \
             faults{before}); `[run] prefault_mb = {mb}` (`shoal demo --prefault-mb {mb}`) maps it before the run \
             (docs/configuration.md, `run.prefault_mb`)",
            faulted as f64 / f64::from(1u32 << 30),
            page_faults
        )
    })
}

/// Sources and how many slices lacked each, as runs of consecutive ids with the same
/// count (the sources of one process usually go missing together), most slices first.
fn source_groups(missing: &std::collections::BTreeMap<u32, u64>) -> Vec<(String, u64)> {
    let mut runs: Vec<(u32, u32, u64)> = Vec::new();
    for (&id, &n) in missing {
        match runs.last_mut() {
            Some((_, last, count)) if *last + 1 == id && *count == n => *last = id,
            _ => runs.push((id, id, n)),
        }
    }
    runs.sort_by_key(|&(first, _, n)| (std::cmp::Reverse(n), first));
    runs.into_iter().map(|(a, b, n)| (if a == b { a.to_string() } else { format!("{a}-{b}") }, n)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_round_trip_under_a_one_fragment_barrel_shifter_suggests_a_window() {
        let completion = |mean_us: f64| DelayStats { count: 10, mean_us, ..DelayStats::default() };
        let hint = window_hint("delayed:8", 10, &completion(12_000.0)).expect("a hint");
        assert!(hint.contains("`delayed:8:2`") && hint.contains("12.00 ms"), "{hint}");
        // A quick round trip, a window already, another policy, nothing measured: no hint.
        assert_eq!(window_hint("delayed:8", 10, &completion(2_000.0)), None);
        assert_eq!(window_hint("delayed:8:2", 10, &completion(12_000.0)), None);
        assert_eq!(window_hint("direct", 10, &completion(12_000.0)), None);
        assert_eq!(window_hint("delayed:8", 10, &DelayStats::default()), None);
    }

    #[test]
    fn a_run_behind_that_faulted_its_memory_in_suggests_a_prefault() {
        // 1.3 M faults of 4 kB: 5.0 GiB, rounded up to whole GiB.
        let hint = prefault_hint(true, 1_300_000, 0.0, 0, 12_000).expect("a hint");
        assert!(hint.contains("`[run] prefault_mb = 5120`") && hint.contains("5.0 GiB"), "{hint}");
        // Faulted more than the process ever held (memory given back and faulted again):
        // its peak, 3.2 GB, is what to map.
        let hint = prefault_hint(true, 1_300_000, 3_200.0, 0, 12_000).expect("a hint");
        assert!(hint.contains("`[run] prefault_mb = 3072`") && hint.contains("5.0 GiB"), "{hint}");
        // Within the budget.
        assert!(prefault_hint(true, 1_300_000, 0.0, 0, 3000).expect("a hint").contains("prefault_mb = 3000`"));
        // On time, or under a GiB of faults: no hint.
        assert_eq!(prefault_hint(false, 1_300_000, 0.0, 0, 12_000), None);
        // Mapped before and faulted more: what both came to, up to the peak.
        let hint = prefault_hint(true, 1_300_000, 6_000.0, 4096, 12_000).expect("a hint");
        assert!(hint.contains("`[run] prefault_mb = 6144`") && hint.contains("after the 4096 MiB"), "{hint}");
        // Mapped as much as the peak already: nothing more to map.
        assert_eq!(prefault_hint(true, 300_000, 6_400.0, 6144, 12_000), None);
        assert_eq!(prefault_hint(true, 200_000, 0.0, 0, 12_000), None);
    }

    #[test]
    fn sources_missing_together_are_named_as_one_range() {
        let missing = [(184, 120), (185, 120), (186, 120), (187, 120), (272, 47), (273, 47), (9, 3), (10, 2)];
        let groups = source_groups(&missing.into_iter().collect());
        assert_eq!(
            groups,
            vec![
                ("184-187".to_string(), 120),
                ("272-273".to_string(), 47),
                ("9".to_string(), 3),
                ("10".to_string(), 2)
            ]
        );
        assert!(source_groups(&Default::default()).is_empty());
    }
}
