//! The diagnosis's cost on a 300-source, 100-builder cluster (plus its writer and
//! dispatcher), beside what run control already does for the same cluster each statistics
//! interval (reading every process's statistics message).
//!
//! - `live_evaluation`: one evaluation as run control does it every second: the snapshot
//!   from the shared status, then every rule and the timeline (a quarter of the sources
//!   dropping, so problems begin and end).
//! - `read_statistics`: parsing the 401 processes' statistics (JSON), the peer.
//! - `post_mortem`: the run record's slice attribution for 10,000 lost slices (once per
//!   run).
//!
//! `cargo bench -p shoal-control --bench diagnosis` (docs/benchmarks.md).

use divan::{Bencher, black_box};
use shoal_control::status::{ClusterStatus, ProcStatus};
use shoal_core::diagnosis::slices::{Departed, Host};
use shoal_core::diagnosis::{Diagnoser, Episode, LostSlice, Rule, RunFacts, SliceLoss};
use shoal_net::node::NodeStats;

fn main() {
    divan::main();
}

const SOURCES: u32 = 300;
const BUILDERS: u32 = 100;

fn stats(name: &str, role: &str, t: u64, k: u64) -> NodeStats {
    NodeStats {
        name: name.into(),
        role: role.into(),
        state: "RUNNING".into(),
        run: Some(1),
        pid: 1000 + k as u32,
        time_ns: t,
        fragments_produced: 1_000 * t / 1_000_000_000,
        fragments_received: 3_000 * t / 1_000_000_000,
        slices_complete: 10 * t / 1_000_000_000,
        // A quarter of the sources drop a little every second.
        fragments_dropped_at_source: if k.is_multiple_of(4) { t / 1_000_000_000 } else { 0 },
        filter_busy_ns: t / 2,
        // What config_mismatch and network_path read: every process the same version and
        // configuration, each source process its own source, its links' TCP counters.
        version: "0.1.0".into(),
        config_digest: "5e1f00d5".into(),
        hosted_sources: if role == "source" { vec![k as u32] } else { Vec::new() },
        tcp_segments_out: 700 * t / 1_000_000_000,
        tcp_retransmitted: if k.is_multiple_of(10) { t / 1_000_000_000 } else { 0 },
        ..Default::default()
    }
}

fn status(t: u64) -> ClusterStatus {
    let mut processes = Vec::new();
    let mut add = |name: String, role: &str, k: u64| {
        processes.push(ProcStatus {
            stats: Some(stats(&name, role, t, k)),
            stats_received_ns: Some(t),
            name,
            role: role.into(),
            active: true,
            state: "RUNNING".into(),
            ..Default::default()
        })
    };
    for s in 0..SOURCES {
        add(format!("source{s}"), "source", u64::from(s));
    }
    for b in 0..BUILDERS {
        add(format!("builder{b}"), "builder", u64::from(b));
    }
    add("writer".into(), "writer", 0);
    ClusterStatus { processes, ..Default::default() }
}

#[divan::bench]
fn live_evaluation(bencher: Bencher) {
    let statuses: Vec<ClusterStatus> = (1..=8).map(|s| status(s * 1_000_000_000)).collect();
    let mut d = Diagnoser::new();
    let mut i = 0;
    bencher.bench_local(|| {
        let st = &statuses[i % statuses.len()];
        i += 1;
        let t = st.processes[0].stats_received_ns.unwrap_or(0);
        let snap = shoal_control::diagnose::snapshot(st, t, 1_000_000_000, true, false, None);
        black_box(d.evaluate(&snap))
    });
}

#[divan::bench]
fn read_statistics(bencher: Bencher) {
    let messages: Vec<Vec<u8>> = status(5_000_000_000)
        .processes
        .iter()
        .map(|p| serde_json::to_vec(p.stats.as_ref().unwrap()).unwrap())
        .collect();
    bencher.bench_local(|| {
        for m in &messages {
            black_box(serde_json::from_slice::<NodeStats>(m).unwrap());
        }
    });
}

#[divan::bench]
fn post_mortem(bencher: Bencher) {
    const SLICE: u64 = 100_000_000;
    let mut hosts: Vec<Host> = (0..SOURCES)
        .map(|s| Host { name: format!("source{s}"), role: "source".into(), sources: vec![s], builder: None })
        .collect();
    hosts.extend((0..BUILDERS).map(|b| Host {
        name: format!("builder{b}"),
        role: "builder".into(),
        sources: vec![],
        builder: Some(b),
    }));
    let start = 17_000_000_000u64;
    let episodes: Vec<Episode> = (0..200)
        .map(|k| Episode {
            rule: Rule::ALL[k % Rule::ALL.len()],
            process: format!("source{}", k * 7 % SOURCES as usize),
            role: "source".into(),
            began_ns: (start + k as u64 * 50) * SLICE,
            ended_ns: Some((start + k as u64 * 50 + 30) * SLICE),
            last_seen_ns: (start + k as u64 * 50 + 30) * SLICE,
            detail: String::new(),
            action: String::new(),
        })
        .collect();
    let lost: Vec<LostSlice> = (0..10_000u64)
        .map(|k| LostSlice {
            slice: start + k,
            builder: (k % u64::from(BUILDERS)) as u32,
            loss: SliceLoss::Incomplete,
            lacking: vec![(k * 13 % u64::from(SOURCES)) as u32, (k * 7 % u64::from(SOURCES)) as u32],
            lacking_came_late: false,
        })
        .collect();
    let facts = RunFacts {
        start_slice: start,
        end_slice: start + 12_000,
        slice_ns: SLICE,
        n_builders: BUILDERS,
        pull: false,
        margin_ns: 5_500_000_000,
        hosts,
        departures: vec![Departed {
            name: "builder3".into(),
            to_slice: start + 5_000,
            rejoined_slice: Some(start + 5_100),
        }],
        lost,
        unlisted: 0,
        episodes,
    };
    bencher.bench_local(|| black_box(shoal_core::diagnosis::attribute(&facts)));
}
