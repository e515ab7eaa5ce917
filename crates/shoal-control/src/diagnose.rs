//! Diagnosis in run control: the live snapshot shoal-core's rules look at
//! ([`snapshot`]), and the post-mortem of a run record ([`diagnose_record`]: every lost
//! slice's primary cause), used when a run is recorded and by `shoal diagnose`.
//!
//! The post-mortem reads only the record (JSON), so a past run is diagnosed with the rules
//! of today; the timeline of problems seen live is part of the record (`diagnosis.timeline`).

use anyhow::Context;
use serde::{Deserialize, Serialize};
use shoal_core::diagnosis::slices::{Departed, Host};
use shoal_core::diagnosis::{
    Counters, Episode, LostSlice, Presence, ProcessView, RunFacts, SliceDiagnosis, SliceLoss, Snapshot, StallSeen,
};

use crate::status::ClusterStatus;

/// The `diagnosis` section of a run record.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RunDiagnosis {
    /// Every lost slice's primary cause, grouped.
    pub slices: SliceDiagnosis,
    /// The problems seen while the run was on (began, ended), from run control's rules.
    pub timeline: Vec<Episode>,
}

/// What the live rules are given: the processes as the UI shows them.
pub fn snapshot(
    status: &ClusterStatus,
    now_ns: u64,
    stats_interval_ns: u64,
    running: bool,
    busy: bool,
    dispatcher_down: Option<String>,
) -> Snapshot {
    let mut processes: Vec<ProcessView> = status
        .processes
        .iter()
        .map(|p| {
            let presence = if p.switched_off {
                Presence::SwitchedOff
            } else if p.active {
                Presence::Active
            } else {
                let why = p.inactive_reason.clone().unwrap_or_else(|| "inactive".into());
                // Connected but silent is a hang; gone is down.
                if p.not_answering { Presence::NotAnswering(why) } else { Presence::Down(why) }
            };
            let counters = p
                .stats
                .as_ref()
                .map(|s| Counters {
                    fragments_produced: s.fragments_produced,
                    fragments_dropped_at_source: s.fragments_dropped_at_source,
                    fragments_discarded_at_builder: s.fragments_discarded_at_builder,
                    slices_complete: s.slices_complete,
                    slices_incomplete: s.slices_incomplete,
                    slices_not_filtered: s.slices_not_filtered,
                    fragments_refused_by_budget: s.fragments_refused_by_budget,
                    filter_busy_ns: s.filter_busy_ns,
                    taken_ns: s.time_ns,
                    rejected_connections: s.rejected_connections,
                    fragments_cut_off: s.fragments_cut_off,
                    link_failures: s.link_failures,
                    tcp_segments_out: s.tcp_segments_out,
                    tcp_retransmitted: s.tcp_retransmitted,
                    udp_datagrams: s.udp_datagrams,
                    udp_retransmitted: s.udp_retransmitted,
                    tcp_links_stalled: s.tcp_links_stalled,
                    storage_failed: s.storage_failed,
                    storage_busy_ns: s.storage_busy_ns,
                })
                .unwrap_or_default();
            let stats = p.stats.as_ref();
            ProcessView {
                name: p.name.clone(),
                role: p.role.clone(),
                presence,
                last_stats_ns: p.stats_received_ns,
                counters,
                pid: stats.map(|s| s.pid),
                version: stats.map(|s| s.version.clone()).unwrap_or_default(),
                config_digest: stats.map(|s| s.config_digest.clone()).unwrap_or_default(),
                hosted_sources: stats.map(|s| s.hosted_sources.clone()).unwrap_or_default(),
                stalls: stats.map(|s| stalls_on_our_clock(s, p.stats_received_ns)).unwrap_or_default(),
            }
        })
        .collect();
    processes.push(ProcessView {
        name: "dispatcher".into(),
        role: "dispatcher".into(),
        presence: dispatcher_down.map_or(Presence::Active, Presence::Down),
        last_stats_ns: None,
        ..Default::default()
    });
    Snapshot { now_ns, stats_interval_ns, running, busy, processes, clock: status.clock_verdict.clone() }
}

/// A process's stalls put on run control's clock: its statistics say when they were
/// taken on its clock and run control when they arrived on its own; the difference (the
/// clocks' offset plus a transit of milliseconds) moves the stalls over.
fn stalls_on_our_clock(s: &shoal_net::node::NodeStats, received_ns: Option<u64>) -> Vec<StallSeen> {
    let shift = received_ns.map_or(0, |r| r as i128 - s.time_ns as i128);
    let ours = |t: u64| (t as i128 + shift).max(0) as u64;
    s.stalls
        .iter()
        .map(|st| StallSeen {
            from_ns: ours(st.from_ns),
            to_ns: ours(st.to_ns),
            waited_for_cpu_ns: st.waited_for_cpu_ns,
            key: st.to_ns,
        })
        .collect()
}

/// The parts of a run record the post-mortem reads.
#[derive(Debug, Deserialize)]
struct RecordFacts {
    start_slice: u64,
    end_slice: u64,
    configuration: String,
    #[serde(default)]
    processes: Vec<ProcessFacts>,
    #[serde(default)]
    departures: Vec<DepartureFacts>,
    #[serde(default)]
    reports: Vec<ReportFacts>,
    #[serde(default)]
    diagnosis: Option<RunDiagnosis>,
}

#[derive(Debug, Deserialize)]
struct ProcessFacts {
    name: String,
    role: String,
    #[serde(default)]
    ids: Vec<u32>,
}

#[derive(Debug, Deserialize)]
struct DepartureFacts {
    name: String,
    to_slice: u64,
    rejoined_slice: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct ReportFacts {
    role: String,
    #[serde(default)]
    builder: Option<(u32, serde_json::Value)>,
    #[serde(default)]
    detail: serde_json::Value,
}

#[derive(Debug, Default, Deserialize)]
struct WriterDetail {
    #[serde(default)]
    lost_with_previous: Option<shoal_net::writer::LostWithWriter>,
    #[serde(default)]
    not_stored: Option<shoal_net::writer::LostWithWriter>,
}

#[derive(Debug, Default, Deserialize)]
struct BuilderDetail {
    #[serde(default)]
    incomplete_slices: Vec<shoal_core::node::IncompleteSlice>,
    #[serde(default)]
    incomplete_unlisted: u64,
    #[serde(default)]
    not_filtered_slices: Vec<u64>,
    #[serde(default)]
    slices_not_filtered: u64,
}

/// The post-mortem of a run record: every lost slice's primary cause, with the timeline
/// the record holds (none for a record from before diagnosis: departures and the
/// builders' lists alone).
pub fn diagnose_record(record: &serde_json::Value) -> anyhow::Result<RunDiagnosis> {
    let mut facts: RecordFacts = serde_json::from_value(record.clone()).context("not a shoal run record")?;
    let config = shoal_net::config::Config::from_toml_str(&facts.configuration)
        .map_err(|e| anyhow::anyhow!("the record's configuration: {e}"))?;
    let slice_ns = config.slice_clock().map_err(|e| anyhow::anyhow!("{e}"))?.length().as_nanos() as u64;
    let timeline = facts.diagnosis.take().map(|d| d.timeline).unwrap_or_default();
    let n_sources = config.run.sources;
    let hosts = facts
        .processes
        .iter()
        .map(|p| Host {
            name: p.name.clone(),
            role: p.role.clone(),
            // A source process without ids hosts every source.
            sources: match p.role.as_str() {
                "source" if p.ids.is_empty() => (0..n_sources).collect(),
                "source" => p.ids.clone(),
                _ => Vec::new(),
            },
            builder: (p.role == "builder").then(|| p.ids.first().copied().unwrap_or(0)),
        })
        .collect();
    let mut lost = Vec::new();
    let mut unlisted = 0;
    for r in facts.reports.iter().filter(|r| r.role == "writer") {
        let Ok(w) = serde_json::from_value::<WriterDetail>(r.detail.clone()) else { continue };
        for (window, loss) in [(&w.lost_with_previous, SliceLoss::EventsLost), (&w.not_stored, SliceLoss::NotStored)] {
            let Some((from, to)) = window.as_ref().map(|l| events_lost_window(l, &facts)) else { continue };
            lost.extend((from..to).map(|slice| LostSlice {
                slice,
                builder: shoal_core::slice::builder_for(slice, config.run.builders.max(1)),
                loss,
                lacking: Vec::new(),
                lacking_came_late: false,
            }));
        }
    }
    for r in facts.reports.iter().filter(|r| r.role == "builder") {
        let Some((id, _)) = &r.builder else { continue };
        let d: BuilderDetail = serde_json::from_value(r.detail.clone()).unwrap_or_default();
        let d = &d;
        lost.extend(d.incomplete_slices.iter().map(|s| LostSlice {
            slice: s.slice,
            builder: *id,
            loss: SliceLoss::Incomplete,
            lacking: s.missing.iter().chain(&s.dropped).copied().collect(),
            lacking_came_late: s.sources_came_late(),
        }));
        lost.extend(d.not_filtered_slices.iter().map(|s| LostSlice {
            slice: *s,
            builder: *id,
            loss: SliceLoss::NotFiltered,
            lacking: Vec::new(),
            lacking_came_late: false,
        }));
        unlisted += d.incomplete_unlisted + d.slices_not_filtered.saturating_sub(d.not_filtered_slices.len() as u64);
    }
    // A cause and its lost slices are linked within the builders' timeout plus the time
    // the rules need to see a problem (a hang: 3 s of silence; a counter: one look).
    let margin_ns = (config.builder.wall_timeout_ms + 4_000) * 1_000_000;
    let run = RunFacts {
        start_slice: facts.start_slice,
        end_slice: facts.end_slice,
        slice_ns,
        n_builders: config.run.builders,
        pull: config.policy().ok().and_then(|p| p.pull()).is_some(),
        margin_ns,
        hosts,
        departures: facts
            .departures
            .iter()
            .map(|d| Departed { name: d.name.clone(), to_slice: d.to_slice, rejoined_slice: d.rejoined_slice })
            .collect(),
        lost,
        unlisted,
        episodes: timeline.clone(),
    };
    Ok(RunDiagnosis { slices: shoal_core::diagnosis::attribute(&run), timeline })
}

/// The slices whose events died with a writer, `from..to`: after the last slice of a file
/// it closed (or from the run's start), before the first its successor received (or to
/// the run's end).
fn events_lost_window(l: &shoal_net::writer::LostWithWriter, facts: &RecordFacts) -> (u64, u64) {
    let from = l.after_slice.map_or(facts.start_slice, |s| s + 1).max(facts.start_slice);
    let to = l.before_slice.unwrap_or(facts.end_slice).min(facts.end_slice);
    (from, to.max(from))
}

/// The slices whose events were lost with a writer that died, from a record's writer
/// reports (the run record's `events_lost_with_writer`).
pub fn events_lost_with_writer(record: &serde_json::Value) -> Vec<EventsLostWithWriter> {
    let Ok(facts) = serde_json::from_value::<RecordFacts>(record.clone()) else { return Vec::new() };
    facts
        .reports
        .iter()
        .filter(|r| r.role == "writer")
        .filter_map(|r| serde_json::from_value::<WriterDetail>(r.detail.clone()).ok())
        .flat_map(|w| [(w.lost_with_previous, "writer_died"), (w.not_stored, "disk_failed")])
        .filter_map(|(l, reason)| {
            let l = l?;
            let (from_slice, to_slice) = events_lost_window(&l, &facts);
            Some(EventsLostWithWriter { unclosed_files: l.unclosed_files, from_slice, to_slice, reason: reason.into() })
        })
        .collect()
}

/// Slices `from_slice..to_slice` had their events in files a writer did not close.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EventsLostWithWriter {
    pub unclosed_files: Vec<std::path::PathBuf>,
    pub from_slice: u64,
    pub to_slice: u64,
    /// `writer_died` (a writer killed before closing them) or `disk_failed` (its disk
    /// refused a write: they, and everything after, were not stored).
    #[serde(default)]
    pub reason: String,
}

/// `shoal diagnose`'s text: the causes, largest first, then the timeline (times from
/// `start_unix_ns`, the run's start).
pub fn describe(d: &RunDiagnosis, run: u64, start_unix_ns: u64) -> String {
    use std::fmt::Write;
    let s = &d.slices;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "run {run}: {} slices lost, {} explained, {} unexplained{}",
        s.lost_slices,
        s.explained,
        s.unexplained,
        if s.not_listed > 0 { format!(" ({} more counted but not listed)", s.not_listed) } else { String::new() }
    );
    for c in &s.causes {
        let losses: Vec<String> = c.losses.iter().map(|(k, n)| format!("{n} {k}")).collect();
        let _ = writeln!(
            out,
            "  {:>6} slices  {:<20} {:<24} slices {}..={} ({})\n          action: {}",
            c.slices,
            c.rule,
            c.processes.join(", "),
            c.first_slice,
            c.last_slice,
            losses.join(", "),
            c.action
        );
    }
    if d.timeline.is_empty() {
        let _ = writeln!(out, "no problem seen while the run was on");
    } else {
        let _ = writeln!(out, "problems seen while the run was on:");
        let _ = writeln!(out, "  (seconds from the run's start)");
        let at = |t: u64| (t as i128 - start_unix_ns as i128) as f64 * 1e-9;
        for e in &d.timeline {
            let end = e.ended_ns.map_or("the end".to_string(), |t| format!("{:.1} s", at(t)));
            let _ = writeln!(
                out,
                "  {:>7.1} s .. {:<8} {:<20} {:<12} {}",
                at(e.began_ns),
                end,
                e.rule.name(),
                e.process,
                e.detail
            );
        }
    }
    out
}
