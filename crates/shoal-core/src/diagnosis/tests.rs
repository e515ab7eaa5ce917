use super::*;
use crate::clocksync::{ClockLevel, ClockVerdict};
use slices::{Departed, Host};

fn view(name: &str, role: &str) -> ProcessView {
    ProcessView { name: name.into(), role: role.into(), last_stats_ns: Some(0), ..Default::default() }
}

fn snapshot(now_s: u64, processes: Vec<ProcessView>) -> Snapshot {
    Snapshot {
        now_ns: now_s * 1_000_000_000,
        stats_interval_ns: 500_000_000,
        running: true,
        busy: false,
        processes,
        clock: None,
    }
}

#[test]
fn a_process_down_is_an_episode_from_when_it_is_seen_to_when_it_is_back() {
    let mut d = Diagnoser::new();
    let mut p = view("builder1", "builder");
    assert_eq!(d.evaluate(&snapshot(1, vec![p.clone()])), Changes::default());
    p.presence = Presence::Down("process exited (signal 9)".into());
    let c = d.evaluate(&snapshot(2, vec![p.clone()]));
    assert_eq!(c.began.len(), 1);
    assert_eq!((c.began[0].rule, c.began[0].process.as_str()), (Rule::ProcessDown, "builder1"));
    assert!(c.began[0].detail.contains("signal 9"));
    // Still down: the same episode, nothing new.
    assert_eq!(d.evaluate(&snapshot(3, vec![p.clone()])), Changes::default());
    assert_eq!(d.active().len(), 1);
    p.presence = Presence::Active;
    // Back: the episode ends once it has not been seen for QUIET_NS, at the last sight.
    for t in 4..6 {
        p.last_stats_ns = Some(t * 1_000_000_000);
        assert_eq!(d.evaluate(&snapshot(t, vec![p.clone()])), Changes::default(), "quiet for {} s", t - 3);
    }
    p.last_stats_ns = Some(6_000_000_000);
    let c = d.evaluate(&snapshot(6, vec![p]));
    assert_eq!(c.ended.len(), 1);
    assert_eq!(c.ended[0].ended_ns, Some(3_000_000_000));
    assert!(d.active().is_empty());
    assert_eq!(d.timeline().len(), 1);
    assert_eq!(d.episodes_between(1_000_000_000, 2_500_000_000).len(), 1);
    assert!(d.episodes_between(5_000_000_000, 6_000_000_000).is_empty());
}

#[test]
fn silence_is_a_hang_only_while_running_and_no_command_is_carried_out() {
    let mut d = Diagnoser::new();
    let p = view("builder0", "builder"); // last statistics at 0 s
    assert!(d.evaluate(&snapshot(2, vec![p.clone()])).began.is_empty(), "2 s of silence is not a hang");
    let mut busy = snapshot(10, vec![p.clone()]);
    busy.busy = true;
    assert!(d.evaluate(&busy).began.is_empty(), "a process answering STOP may be silent");
    let mut idle = snapshot(10, vec![p.clone()]);
    idle.running = false;
    assert!(d.evaluate(&idle).began.is_empty());
    let c = d.evaluate(&snapshot(10, vec![p.clone()]));
    assert_eq!(c.began.len(), 1);
    assert_eq!(c.began[0].rule, Rule::ProcessHung);
    assert!(c.began[0].detail.contains("10.0 s"), "{}", c.began[0].detail);
    let mut q = p;
    q.presence = Presence::NotAnswering("no answer to STOP within 10s".into());
    let c = d.evaluate(&snapshot(11, vec![q]));
    assert!(c.began.is_empty() && c.ended.is_empty(), "still the same hang: {c:?}");
}

#[test]
fn counter_rules_speak_when_their_counter_grows_and_stop_when_it_does_not() {
    let mut d = Diagnoser::new();
    let mut s = view("source2", "source");
    let mut b = view("builder0", "builder");
    s.counters.fragments_dropped_at_source = 5;
    b.counters.slices_not_filtered = 3;
    b.counters.fragments_discarded_at_builder = 1;
    // First look: totals are history, not growth.
    assert!(d.evaluate(&snapshot(1, vec![s.clone(), b.clone()])).began.is_empty());
    s.counters.fragments_dropped_at_source = 9;
    s.counters.fragments_produced = 100;
    b.counters.slices_not_filtered = 4;
    b.counters.rejected_connections = 1;
    let c = d.evaluate(&snapshot(2, vec![s.clone(), b.clone()]));
    let rules: Vec<(Rule, &str)> = c.began.iter().map(|e| (e.rule, e.process.as_str())).collect();
    assert_eq!(
        rules,
        [(Rule::FilterBehind, "builder0"), (Rule::SourceDropping, "source2"), (Rule::ConnectionsRefused, "builder0")]
    );
    assert!(c.began[1].detail.contains("dropped 4 of 100"), "{}", c.began[1].detail);
    // Not found again: over after QUIET_NS, not at once.
    for t in 3..5 {
        s.last_stats_ns = Some(t * 1_000_000_000);
        b.last_stats_ns = Some(t * 1_000_000_000);
        assert!(d.evaluate(&snapshot(t, vec![s.clone(), b.clone()])).ended.is_empty());
    }
    s.last_stats_ns = Some(5_000_000_000);
    b.last_stats_ns = Some(5_000_000_000);
    let c = d.evaluate(&snapshot(5, vec![s.clone(), b.clone()]));
    assert_eq!(c.ended.len(), 3);
    // A restarted process's counters start again from zero: no growth, no alarm.
    s.counters = Counters::default();
    s.last_stats_ns = Some(6_000_000_000);
    b.last_stats_ns = Some(6_000_000_000);
    assert!(d.evaluate(&snapshot(6, vec![s, b])).began.is_empty());
}

#[test]
fn a_builder_discarding_says_how_much_its_budget_refused() {
    let mut d = Diagnoser::new();
    let mut b = view("builder0", "builder");
    d.evaluate(&snapshot(0, vec![b.clone()]));
    b.counters.fragments_discarded_at_builder = 5;
    b.counters.fragments_refused_by_budget = 3;
    let c = d.evaluate(&snapshot(0, vec![b]));
    assert_eq!(c.began.len(), 1);
    assert_eq!(c.began[0].rule, Rule::BuilderDiscarding);
    assert!(
        c.began[0].detail.contains("5 fragments")
            && c.began[0].detail.contains("3 refused by its memory budget, 2 late"),
        "{}",
        c.began[0].detail
    );
}

#[test]
fn a_flapping_problem_is_one_episode() {
    let mut d = Diagnoser::new();
    let mut b = view("builder0", "builder");
    d.evaluate(&snapshot(0, vec![b.clone()]));
    for t in 1..10u64 {
        b.last_stats_ns = Some(t * 1_000_000_000);
        if t % 2 == 1 {
            b.counters.slices_not_filtered += 1;
        }
        d.evaluate(&snapshot(t, vec![b.clone()]));
    }
    assert_eq!(d.timeline().len(), 1, "{:?}", d.timeline());
    assert_eq!(d.active().len(), 1);
}

#[test]
fn a_clock_skew_is_named_on_the_two_processes_furthest_apart() {
    let mut d = Diagnoser::new();
    let mut snap = snapshot(1, vec![view("source0", "source"), view("source1", "source"), view("b", "builder")]);
    snap.clock = Some(ClockVerdict {
        skew_ns: 80_000_000,
        skew_certain_ns: 79_000_000,
        between: Some(("source1".into(), "source0".into())),
        tolerated_ns: 5_000_000,
        limit_ns: 50_000_000,
        level: ClockLevel::Beyond,
        reason: "skew 80 ms".into(),
    });
    // Beyond only at the far ends of the measurements (one slow round trip): no problem.
    let mut slow = snap.clone();
    if let Some(v) = slow.clock.as_mut() {
        v.skew_certain_ns = 1_000_000;
    }
    assert!(Diagnoser::new().evaluate(&slow).began.is_empty());
    let c = d.evaluate(&snap);
    let names: Vec<&str> = c.began.iter().map(|e| e.process.as_str()).collect();
    assert_eq!(names, ["source1", "source0"]);
    assert!(c.began.iter().all(|e| e.rule == Rule::ClockSkew));
}

/// The rules found at the second of two looks, `before` then `after` (growth between).
fn found_after(before: Vec<ProcessView>, after: Vec<ProcessView>) -> Vec<(Rule, String, String)> {
    let mut d = Diagnoser::new();
    d.evaluate(&snapshot(1, before));
    d.evaluate(&snapshot(2, after)).began.into_iter().map(|e| (e.rule, e.process, e.detail)).collect()
}

#[test]
fn a_path_that_retransmits_stalls_or_loses_connections_with_its_peers_up_is_named() {
    let mut s = view("source0", "source");
    s.counters.tcp_segments_out = 10_000;
    let b = view("builder0", "builder");
    // 0.1 % sent again: below the share; 1 %: the path loses.
    let mut quiet = s.clone();
    quiet.counters.tcp_segments_out += 10_000;
    quiet.counters.tcp_retransmitted = 10;
    assert!(found_after(vec![s.clone(), b.clone()], vec![quiet, b.clone()]).is_empty());
    // Two of a hundred: a large share, but too few to be more than a probe in flight.
    let mut few = s.clone();
    few.counters.tcp_segments_out += 100;
    few.counters.tcp_retransmitted = 2;
    assert!(found_after(vec![s.clone(), b.clone()], vec![few, b.clone()]).is_empty());
    let mut lossy = s.clone();
    lossy.counters.tcp_segments_out += 10_000;
    lossy.counters.tcp_retransmitted = 100;
    let f = found_after(vec![s.clone(), b.clone()], vec![lossy, b.clone()]);
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!((f[0].0, f[0].1.as_str()), (Rule::NetworkPath, "source0"));
    assert!(f[0].2.contains("100 of 10000 TCP segments again (1.00 %)"), "{}", f[0].2);
    // A link in retransmission timeouts is a stall, whatever the counts.
    let mut stalled = s.clone();
    stalled.counters.tcp_links_stalled = 2;
    let f = found_after(vec![s.clone(), b.clone()], vec![stalled, b.clone()]);
    assert!(f[0].2.contains("2 links in retransmission timeouts"), "{f:?}");
    // Datagrams sent again on NACKs.
    let mut udp = s.clone();
    udp.counters.udp_datagrams = 5_000;
    udp.counters.udp_retransmitted = 40;
    let f = found_after(vec![s.clone(), b.clone()], vec![udp, b.clone()]);
    assert!(f[0].2.contains("40 datagrams again"), "{f:?}");
    // A connection lost while every builder is up: the path.
    let mut failed = s.clone();
    failed.counters.link_failures = 1;
    let f = found_after(vec![s.clone(), b.clone()], vec![failed.clone(), b.clone()]);
    assert!(f[0].2.contains("lost 1 connections"), "{f:?}");
    // ... but a builder that died or was restarted meanwhile broke it: not the path.
    let mut down = b.clone();
    down.presence = Presence::Down("exited".into());
    let f = found_after(vec![s.clone(), down.clone()], vec![failed.clone(), b.clone()]);
    assert!(f.iter().all(|x| x.0 != Rule::NetworkPath), "{f:?}");
    // ... as are segments sent again just after it came back (its catch-up burst).
    let mut lossy = s.clone();
    lossy.counters.tcp_segments_out += 240;
    lossy.counters.tcp_retransmitted = 3;
    let f = found_after(vec![s.clone(), down], vec![lossy.clone(), b.clone()]);
    assert!(f.iter().all(|x| x.0 != Rule::NetworkPath), "{f:?}");
    assert_eq!(found_after(vec![s.clone(), b.clone()], vec![lossy, b.clone()])[0].0, Rule::NetworkPath);
    let (mut old, mut new) = (b.clone(), b.clone());
    old.pid = Some(10);
    new.pid = Some(11);
    let f = found_after(vec![s.clone(), old], vec![failed, new]);
    assert!(f.iter().all(|x| x.0 != Rule::NetworkPath), "{f:?}");
}

#[test]
fn a_writer_whose_disk_refused_or_is_too_slow_is_named() {
    let mut w = view("writer", "writer");
    w.counters.taken_ns = 1_000_000_000;
    let mut failed = w.clone();
    failed.counters.storage_failed = 1;
    let f = found_after(vec![w.clone()], vec![failed]);
    assert_eq!(f.len(), 1);
    assert_eq!(f[0].0, Rule::StorageFailing);
    assert!(f[0].2.contains("refused a write"), "{}", f[0].2);
    let mut slow = w.clone();
    slow.counters.taken_ns += 1_000_000_000;
    slow.counters.storage_busy_ns = 950_000_000;
    let f = found_after(vec![w.clone()], vec![slow]);
    assert!(f[0].2.contains("busy writing 95 %"), "{f:?}");
    let mut fine = w.clone();
    fine.counters.taken_ns += 1_000_000_000;
    fine.counters.storage_busy_ns = 300_000_000;
    assert!(found_after(vec![w], vec![fine]).is_empty());
}

#[test]
fn a_burst_cut_off_is_named_though_nothing_is_lost() {
    let s = view("source3", "source");
    let mut cut = s.clone();
    cut.counters.fragments_produced = 50;
    cut.counters.fragments_cut_off = 12;
    let f = found_after(vec![s], vec![cut]);
    assert_eq!(f.len(), 1);
    assert_eq!((f[0].0, f[0].1.as_str()), (Rule::SourceCutOff, "source3"));
    assert!(f[0].2.contains("12 of 50"), "{}", f[0].2);
}

#[test]
fn processes_that_disagree_on_the_run_are_named_the_majority_is_not() {
    let p = |name: &str, role: &str, version: &str, digest: &str, sources: &[u32]| ProcessView {
        version: version.into(),
        config_digest: digest.into(),
        hosted_sources: sources.to_vec(),
        ..view(name, role)
    };
    let agree = vec![
        p("source0", "source", "0.1.0", "aa", &[0, 1]),
        p("source1", "source", "0.1.0", "aa", &[2, 3]),
        p("builder0", "builder", "0.1.0", "aa", &[]),
    ];
    let found_now = |processes: Vec<ProcessView>| -> Vec<(Rule, String, String)> {
        Diagnoser::new()
            .evaluate(&snapshot(1, processes))
            .began
            .into_iter()
            .map(|e| (e.rule, e.process, e.detail))
            .collect()
    };
    assert!(found_now(agree).is_empty());
    let differ = vec![
        p("source0", "source", "0.1.0", "aa", &[0, 1]),
        p("source1", "source", "0.1.0", "aa", &[1, 2, 3]),
        p("builder0", "builder", "0.2.0", "bb", &[]),
        p("builder1", "builder", "0.1.0", "aa", &[]),
    ];
    let f = found_now(differ);
    let named: Vec<(&str, &str)> = f.iter().map(|x| (x.1.as_str(), x.2.as_str())).collect();
    assert_eq!(f.len(), 3, "{named:?}");
    assert!(f.iter().all(|x| x.0 == Rule::ConfigMismatch));
    assert!(named[0].0 == "builder0" && named[0].1.contains("runs shoal 0.2.0, most processes 0.1.0"), "{named:?}");
    assert!(named[0].1.contains("as bb, most processes as aa"), "{named:?}");
    assert!(named[1].0 == "source0" && named[1].1.contains("hosts source 1, as do source0 and source1"), "{named:?}");
    assert_eq!(named[2].0, "source1");
}

const S: u64 = 100_000_000; // 100-ms slices

fn facts() -> RunFacts {
    let host = |name: &str, role: &str, sources: &[u32], builder: Option<u32>| Host {
        name: name.into(),
        role: role.into(),
        sources: sources.to_vec(),
        builder,
    };
    RunFacts {
        start_slice: 1000,
        end_slice: 1100,
        slice_ns: S,
        n_builders: 2,
        margin_ns: 500_000_000,
        hosts: vec![
            host("source0", "source", &[0], None),
            host("source1", "source", &[1], None),
            host("builder0", "builder", &[], Some(0)),
            host("builder1", "builder", &[], Some(1)),
        ],
        ..Default::default()
    }
}

fn lost(slice: u64, loss: SliceLoss, lacking: &[u32]) -> LostSlice {
    LostSlice { slice, builder: (slice % 2) as u32, loss, lacking: lacking.to_vec(), lacking_came_late: false }
}

fn episode(rule: Rule, process: &str, role: &str, from_slice: u64, to_slice: Option<u64>) -> Episode {
    Episode {
        rule,
        process: process.into(),
        role: role.into(),
        began_ns: from_slice * S,
        ended_ns: to_slice.map(|s| s * S),
        last_seen_ns: to_slice.map_or(from_slice * S, |s| s * S),
        detail: String::new(),
        action: String::new(),
    }
}

#[test]
fn a_dead_source_claims_the_slices_that_lack_it_and_nothing_else() {
    let mut f = facts();
    f.departures = vec![Departed { name: "source1".into(), to_slice: 1030, rejoined_slice: Some(1050) }];
    f.lost = (1029..1052).map(|s| lost(s, SliceLoss::Incomplete, &[1])).collect();
    f.lost.push(lost(1090, SliceLoss::Incomplete, &[0]));
    let d = attribute(&f);
    assert_eq!((d.lost_slices, d.explained, d.unexplained), (24, 23, 1));
    assert_eq!(d.causes[0].rule, "process_down");
    assert_eq!(d.causes[0].processes, ["source1"]);
    assert_eq!((d.causes[0].slices, d.causes[0].first_slice, d.causes[0].last_slice), (23, 1029, 1051));
    assert_eq!(d.causes[1].rule, "unexplained");
}

#[test]
fn a_dead_builder_loses_its_slices_until_it_rejoins() {
    let mut f = facts();
    f.departures = vec![Departed { name: "builder1".into(), to_slice: 1020, rejoined_slice: Some(1040) }];
    let d = attribute(&f);
    // Builder 1 has the odd slices: 1021, 1023, ..., 1039.
    assert_eq!((d.lost_slices, d.explained), (10, 10));
    assert_eq!(d.causes[0].losses["not_built"], 10);
    assert_eq!(d.causes[0].processes, ["builder1"]);
}

#[test]
fn a_hung_builder_claims_its_sources_drops_and_the_filter_its_unfiltered_slices() {
    let mut f = facts();
    f.episodes = vec![
        episode(Rule::ProcessHung, "builder0", "builder", 1030, Some(1060)),
        episode(Rule::SourceDropping, "source0", "source", 1031, Some(1062)),
        episode(Rule::SourceDropping, "source1", "source", 1080, Some(1081)),
    ];
    f.lost = vec![
        lost(1040, SliceLoss::Incomplete, &[0, 1]), // builder 0's own slice
        lost(1041, SliceLoss::Incomplete, &[0]),    // builder 1's, lacking a held-back source
        lost(1081, SliceLoss::Incomplete, &[1]),    // a burst of source 1 alone
        lost(1095, SliceLoss::NotFiltered, &[]),
    ];
    let d = attribute(&f);
    let by: Vec<(&str, &[String], u64)> =
        d.causes.iter().map(|c| (c.rule.as_str(), c.processes.as_slice(), c.slices)).collect();
    assert_eq!(
        by,
        [
            ("process_hung", &["builder0".to_string()][..], 2),
            ("filter_behind", &["builder1".to_string()][..], 1),
            ("source_dropping", &["source1".to_string()][..], 1),
        ]
    );
    assert_eq!(d.unexplained, 0);
}

#[test]
fn an_episode_far_from_the_slice_does_not_claim_it() {
    let mut f = facts();
    f.episodes = vec![episode(Rule::SourceDropping, "source0", "source", 1000, Some(1010))];
    f.lost = vec![lost(1030, SliceLoss::Incomplete, &[0]), lost(1012, SliceLoss::Incomplete, &[0])];
    let d = attribute(&f);
    assert_eq!((d.explained, d.unexplained), (1, 1), "{d:?}");
}

mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever the run, every lost slice has exactly one cause: the groups add up.
        #[test]
        fn every_lost_slice_has_exactly_one_cause(
            slices in proptest::collection::btree_set(1000u64..1100, 0..60),
            lacking in proptest::collection::vec(0u32..2, 0..3),
            episodes in proptest::collection::vec((0usize..7, 0usize..4, 1000u64..1100, 1u64..30), 0..6),
            dead in proptest::option::of((0usize..4, 1000u64..1100)),
        ) {
            let mut f = facts();
            let names = ["source0", "source1", "builder0", "builder1"];
            f.lost = slices.iter().map(|s| lost(*s, if s % 7 == 0 { SliceLoss::NotFiltered } else { SliceLoss::Incomplete }, &lacking)).collect();
            f.episodes = episodes.iter().map(|(r, p, from, len)| {
                let role = if *p < 2 { "source" } else { "builder" };
                episode(Rule::ALL[*r], names[*p], role, *from, Some(from + len))
            }).collect();
            if let Some((p, at)) = dead {
                f.departures.push(Departed { name: names[p].into(), to_slice: at, rejoined_slice: None });
            }
            let d = attribute(&f);
            prop_assert_eq!(d.explained + d.unexplained, d.lost_slices);
            prop_assert_eq!(d.causes.iter().map(|c| c.slices).sum::<u64>(), d.lost_slices);
            prop_assert!(d.lost_slices >= slices.len() as u64);
            for c in &d.causes {
                prop_assert!(
                    c.rule == "unexplained" || c.rule == SOURCES_LATE || Rule::ALL.iter().any(|r| r.name() == c.rule)
                );
                prop_assert_eq!(c.losses.values().sum::<u64>(), c.slices);
            }
        }
    }
}

#[test]
fn events_the_writers_disk_refused_are_the_disks_not_the_writers_death() {
    let mut f = facts();
    f.hosts.push(Host { name: "writer".into(), role: "writer".into(), sources: Vec::new(), builder: None });
    f.lost = (1050..1060).map(|s| lost(s, SliceLoss::NotStored, &[])).collect();
    let d = attribute(&f);
    assert_eq!((d.lost_slices, d.explained, d.unexplained), (10, 10, 0));
    assert_eq!(d.causes.len(), 1);
    assert_eq!(
        (d.causes[0].rule.as_str(), d.causes[0].processes.as_slice()),
        ("storage_failing", &["writer".to_string()][..])
    );
    assert_eq!(d.causes[0].losses.get("not_stored"), Some(&10));
}

#[test]
fn a_burst_cut_off_claims_no_lost_slice() {
    let mut f = facts();
    f.lost = vec![lost(1030, SliceLoss::Incomplete, &[0])];
    f.episodes = vec![episode(Rule::SourceCutOff, "source0", "source", 1020, Some(1040))];
    assert_eq!(attribute(&f).unexplained, 1, "the markers arrive: a cut-off source lost nothing");
    f.episodes.push(episode(Rule::SourceDropping, "source0", "source", 1020, Some(1040)));
    let d = attribute(&f);
    assert_eq!((d.unexplained, d.causes[0].rule.as_str()), (0, "source_dropping"));
}

#[test]
fn a_slice_lost_twice_is_lost_by_what_lost_the_most_of_it() {
    let mut f = facts();
    f.hosts.push(Host { name: "writer".into(), role: "writer".into(), sources: Vec::new(), builder: None });
    f.episodes = vec![episode(Rule::SourceDropping, "source0", "source", 1020, Some(1040))];
    // Incomplete (source 0 dropping) and its events not stored: the disk's.
    f.lost = vec![lost(1030, SliceLoss::Incomplete, &[0]), lost(1030, SliceLoss::NotStored, &[])];
    let d = attribute(&f);
    assert_eq!((d.lost_slices, d.causes.len()), (1, 1));
    assert_eq!(d.causes[0].rule, "storage_failing");
}

#[test]
fn slices_whose_missing_sources_all_came_late_are_those_sources_being_late() {
    let mut f = facts();
    f.hosts.push(Host { name: "source23".into(), role: "source".into(), sources: vec![2, 3], builder: None });
    // As the run record's builders list them.
    let late = |slice, lacking: &[u32], arrived: &[u32]| {
        let listed = crate::node::IncompleteSlice {
            slice,
            missing: lacking.to_vec(),
            arrived_late: arrived.to_vec(),
            ..Default::default()
        };
        LostSlice { lacking_came_late: listed.sources_came_late(), ..lost(slice, SliceLoss::Incomplete, lacking) }
    };
    f.lost = vec![
        late(1030, &[0], &[0]),
        late(1031, &[2, 3], &[2, 3]),
        // Source 3 never sent: not lateness alone.
        late(1032, &[2, 3], &[2]),
    ];
    let d = attribute(&f);
    assert_eq!((d.lost_slices, d.explained, d.unexplained), (3, 2, 1), "{d:?}");
    let of = |p: &str| d.causes.iter().find(|c| c.processes == [p.to_string()]).unwrap_or_else(|| panic!("{d:?}"));
    assert_eq!((of("source0").rule.as_str(), of("source0").slices), (SOURCES_LATE, 1));
    assert_eq!((of("source23").rule.as_str(), of("source23").slices), (SOURCES_LATE, 1));
    assert!(of("source23").action.contains("wall_timeout_ms"), "{d:?}");
    // The builders' discarding of the late fragments is their symptom, not a cause.
    f.episodes = vec![
        episode(Rule::BuilderDiscarding, "builder0", "builder", 1020, Some(1040)),
        episode(Rule::BuilderDiscarding, "builder1", "builder", 1020, Some(1040)),
    ];
    let d = attribute(&f);
    assert_eq!(d.causes.iter().filter(|c| c.rule == SOURCES_LATE).map(|c| c.slices).sum::<u64>(), 2, "{d:?}");
    assert_eq!(d.unexplained, 0, "the slice source 3 never sent is the discarding builder's: {d:?}");
    // An episode on the source at the time comes first: a hung source that sent late
    // afterwards was hung.
    f.episodes = vec![episode(Rule::ProcessHung, "source0", "source", 1020, Some(1040))];
    let d = attribute(&f);
    assert_eq!(d.causes.iter().find(|c| c.processes == ["source0".to_string()]).unwrap().rule, "process_hung");
}

#[test]
fn a_stall_shorter_than_the_hung_threshold_is_a_past_hang_that_claims_the_stalled_builders_slices() {
    let mut d = Diagnoser::new();
    let stall = StallSeen { from_ns: 1_020 * S, to_ns: 1_024 * S, waited_for_cpu_ns: 0, key: 77 };
    let mut b = view("builder0", "builder");
    b.last_stats_ns = Some(1_025 * S);
    b.stalls = vec![stall];
    let c = d.evaluate(&snapshot(1_025 * S / 1_000_000_000 + 1, vec![b.clone()]));
    assert_eq!(c.began.len(), 1, "{c:?}");
    let e = &c.began[0];
    assert_eq!(
        (e.rule, e.process.as_str(), e.began_ns, e.ended_ns),
        (Rule::ProcessHung, "builder0", stall.from_ns, Some(stall.to_ns))
    );
    assert!(e.detail.contains("stopped"), "{}", e.detail);
    // Reported again in the next statistics (put on run control's clock a little
    // differently): the same stall, not a second one.
    b.stalls = vec![StallSeen { from_ns: stall.from_ns + 3, to_ns: stall.to_ns + 3, ..stall }];
    assert!(d.evaluate(&snapshot(1_025 * S / 1_000_000_000 + 2, vec![b.clone()])).began.is_empty());
    assert_eq!(d.timeline().len(), 1);
    // A starved process says so.
    let starved = StallSeen { waited_for_cpu_ns: 3 * S, key: 78, ..stall };
    assert!(starved.detail().contains("CPU was taken"), "{}", starved.detail());
    // Its slices, processed late with every source "late", are the stall's.
    let mut f = facts();
    f.episodes = d.timeline().to_vec();
    f.lost = (1_020..1_026)
        .filter(|s| s % 2 == 0)
        .map(|s| LostSlice { lacking_came_late: true, ..lost(s, SliceLoss::Incomplete, &[0, 1]) })
        .collect();
    let a = attribute(&f);
    assert_eq!((a.explained, a.causes.len()), (3, 1), "{a:?}");
    assert_eq!(
        (a.causes[0].rule.as_str(), a.causes[0].processes.as_slice()),
        ("process_hung", &["builder0".to_string()][..])
    );
}

#[test]
fn under_pull_a_departed_builder_leaves_no_unbuilt_slices_and_claims_what_the_others_lost_meanwhile() {
    let mut f = facts();
    f.pull = true;
    f.departures = vec![Departed { name: "builder1".into(), to_slice: 1020, rejoined_slice: Some(1040) }];
    f.episodes = vec![episode(Rule::ProcessDown, "builder1", "builder", 1020, Some(1040))];
    // Builder 0 processed two slices builder 1 had been handed fragments of.
    f.lost = vec![
        LostSlice { builder: 0, ..lost(1021, SliceLoss::Incomplete, &[0, 1]) },
        LostSlice { builder: 0, ..lost(1023, SliceLoss::Incomplete, &[1]) },
    ];
    let d = attribute(&f);
    assert_eq!((d.lost_slices, d.explained), (2, 2), "the manager gave builder 1's slices to builder 0: {d:?}");
    assert_eq!(d.causes[0].processes, ["builder1"]);
    // And the data-flow manager stopped claims what was lost while it assigned nothing.
    f.departures.clear();
    f.hosts.push(Host { name: "dfm".into(), role: "dfm".into(), sources: vec![], builder: None });
    f.episodes = vec![episode(Rule::ProcessHung, "dfm", "dfm", 1020, Some(1022))];
    let d = attribute(&f);
    assert_eq!(
        (d.causes[0].rule.as_str(), d.causes[0].processes.as_slice()),
        ("process_hung", &["dfm".to_string()][..])
    );
    // Without pull the same episode on the manager's role claims nothing it is not part of.
    f.pull = false;
    assert_eq!(attribute(&f).unexplained, 2);
}

#[test]
fn when_no_statistics_come_from_anyone_the_dispatcher_is_hung_not_each_process() {
    let mut d = Diagnoser::new();
    let dispatcher = ProcessView { name: "dispatcher".into(), role: "dispatcher".into(), ..Default::default() };
    let procs = vec![view("builder0", "builder"), view("source0", "source"), dispatcher];
    let c = d.evaluate(&snapshot(10, procs.clone()));
    let named: Vec<_> = c.began.iter().map(|e| (e.rule, e.process.as_str())).collect();
    assert_eq!(named, [(Rule::ProcessHung, "dispatcher")], "{c:?}");
    // One process silent while the others speak: that process.
    let mut procs = procs;
    procs[1].last_stats_ns = Some(10_000_000_000);
    let mut d = Diagnoser::new();
    let c = d.evaluate(&snapshot(10, procs));
    let named: Vec<_> = c.began.iter().map(|e| (e.rule, e.process.as_str())).collect();
    assert_eq!(named, [(Rule::ProcessHung, "builder0")], "{c:?}");
}

/// Every 0.5 s from `from_s` to `to_s`: builder0 and source0 report, except builder0 in
/// `[gap_from_s, gap_to_s)`; builder0 reports `stall` once it speaks again. The timeline.
fn gap_run(gap_from_s: f64, gap_to_s: f64, stall: Option<StallSeen>, others_silent: bool) -> Vec<Episode> {
    let mut d = Diagnoser::new();
    let ns = |s: f64| (s * 1e9) as u64;
    let (mut b_last, mut s_last) = (0, 0);
    for step in 0..60 {
        let now = 5.0 + 0.5 * step as f64;
        let silent = now >= gap_from_s && now < gap_to_s;
        if !silent {
            b_last = ns(now);
        }
        if !(silent && others_silent) {
            s_last = ns(now);
        }
        let mut b = view("builder0", "builder");
        b.last_stats_ns = Some(b_last);
        if !silent && now >= gap_to_s {
            b.stalls = stall.into_iter().collect();
        }
        let mut s = view("source0", "source");
        s.last_stats_ns = Some(s_last);
        let dispatcher = ProcessView { name: "dispatcher".into(), role: "dispatcher".into(), ..Default::default() };
        d.evaluate(&Snapshot {
            now_ns: ns(now),
            stats_interval_ns: 500_000_000,
            running: true,
            busy: false,
            processes: vec![b, s, dispatcher],
            clock: None,
        });
    }
    d.timeline().to_vec()
}

#[test]
fn a_process_silent_while_it_ran_and_the_others_spoke_was_unreachable_not_hung() {
    let on_builder = |t: &[Episode]| {
        t.iter().filter(|e| e.process == "builder0").map(|e| (e.rule, e.began_ns / 100_000_000)).collect::<Vec<_>>()
    };
    // 8 s cut off: found hung while silent, then given to the path (no stall of its own).
    let t = gap_run(10.5, 18.5, None, false);
    assert_eq!(on_builder(&t), [(Rule::NetworkPath, 100)], "{t:?}");
    assert!(t[0].detail.contains("unreachable"), "{}", t[0].detail);
    // Stopped for those 8 s: it says so afterwards, and stays hung.
    let stopped = StallSeen { from_ns: 10_400_000_000, to_ns: 18_500_000_000, waited_for_cpu_ns: 0, key: 1 };
    let t = gap_run(10.5, 18.5, Some(stopped), false);
    assert_eq!(on_builder(&t), [(Rule::ProcessHung, 104)], "{t:?}");
    // A gap of 1.5 s, below the hung threshold: a past episode of the path.
    let t = gap_run(10.5, 12.0, None, false);
    assert_eq!(on_builder(&t), [(Rule::NetworkPath, 100)], "{t:?}");
    assert_eq!(t[0].ended_ns, Some(12_000_000_000), "{t:?}");
    // One report late (a gap of one interval) is nothing.
    assert!(on_builder(&gap_run(10.5, 11.0, None, false)).is_empty());
    // Everyone silent at once: the dispatcher, not the path to each.
    let t = gap_run(10.5, 18.5, None, true);
    assert!(t.iter().all(|e| e.rule != Rule::NetworkPath), "{t:?}");
}
