//! The simulator and the runtime run the same node machines: one scenario (5 sources x 3
//! builders, fixed 30,000-byte fragments, no loss) run by the simulator and by the runtime
//! over loopback gives, per source, the same transmissions, the same per-builder slice
//! outcomes and the same ledger, bucket by bucket.
//!
//! What is compared does not depend on timing, so a busy machine cannot fail the test:
//! per source the frames in order (builder, slice, bytes) and per (source, builder) every
//! piece in order. (When a starved runtime reaches two slice ends at once, a token bucket
//! may interleave two builders' pieces differently than the simulator; each builder's own
//! sequence is still fixed.) Slice timeouts are set out of reach, so every slice is
//! complete whatever the scheduling.

use std::collections::BTreeMap;
use std::sync::Arc;

use shoal_core::ledger::{Ledger, SourceTally};
use shoal_core::node::{BuilderNodeReport, TransmitRecord};
use shoal_detector::GeneratorKind;
use shoal_net::clock::WallClock;
use shoal_net::live::Live;
use shoal_sim::scenario::Scenario;
use shoal_sim::sim::{RunOptions, run_with};
use shoal_testbed::run::runtime_config;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const SOURCES: u32 = 5;
const BUILDERS: u32 = 3;
const SLICES: u64 = 30;
const FRAGMENT: u32 = 30_000;
const MAX_ACTIVE: usize = 100_000;

/// (builder, slice counted from the run's first slice, bytes) of every piece.
type Piece = (u32, u64, u64);

struct Run {
    /// Per source: whole frames (first pieces' destination and slice, frame bytes).
    frames: BTreeMap<u32, Vec<Piece>>,
    /// Per (source, builder): every piece.
    pieces: BTreeMap<(u32, u32), Vec<Piece>>,
    builders: Vec<BuilderNodeReport>,
    ledger: BTreeMap<String, u64>,
}

fn digest(
    transmits: &[TransmitRecord],
    first_slice: u64,
    builders: Vec<BuilderNodeReport>,
    ledger: BTreeMap<String, u64>,
) -> Run {
    let mut frames: BTreeMap<u32, Vec<Piece>> = BTreeMap::new();
    let mut pieces: BTreeMap<(u32, u32), Vec<Piece>> = BTreeMap::new();
    for t in transmits {
        let p = (t.dest, t.slice - first_slice, t.bytes);
        pieces.entry((t.source, t.dest)).or_default().push(p);
        let f = frames.entry(t.source).or_default();
        match f.iter_mut().find(|x| x.0 == p.0 && x.1 == p.1) {
            Some(x) => x.2 += t.bytes,
            None => f.push(p),
        }
    }
    Run { frames, pieces, builders, ledger }
}

fn scenario(policy: &str) -> Scenario {
    let mut sc = Scenario { name: format!("parity-{policy}"), ..Default::default() };
    sc.topology.sources = Some(SOURCES);
    sc.topology.builders = Some(BUILDERS);
    sc.traffic.policy = policy.into();
    sc.traffic.generator = Some("fixed".into());
    sc.traffic.fragment_bytes = FRAGMENT;
    sc.traffic.load_s = SLICES as f64 * 0.01;
    sc.traffic.relax_s = 5.0;
    sc.builder.max_active = MAX_ACTIVE;
    sc.builder.wall_timeout_ms = 600_000.0;
    sc
}

fn simulated(policy: &str) -> Run {
    let r = run_with(&scenario(policy), RunOptions { log_transmits: true }).expect("scenario runs");
    assert_eq!(r.summary.ledger_unaccounted, 0);
    digest(&r.transmits, 0, r.builders, r.summary.ledger)
}

async fn runtime(policy: &str) -> Run {
    let out = std::env::temp_dir().join(format!("shoal-parity-{}-{}", std::process::id(), policy.replace(':', "_")));
    let writer_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut listeners = Vec::new();
    for _ in 0..BUILDERS {
        listeners.push(TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    // The very scenario the simulator runs, as the runtime's configuration.
    let mut cfg = runtime_config(
        &scenario(policy),
        listeners.iter().map(|l| l.local_addr().unwrap().to_string()).collect(),
        writer_listener.local_addr().unwrap().to_string(),
        SLICES as f64 * 0.01,
    )
    .unwrap();
    assert_eq!(cfg.source.generator, GeneratorKind::Fixed);
    assert_eq!(cfg.builder.filter.name, "none");
    cfg.writer.out_dir = out.clone();
    // The simulator starts with slice 0 (builder 0); so does this run, modulo the builders.
    let clock = WallClock::new();
    let slice_clock = cfg.slice_clock().unwrap();
    let soon = slice_clock.slice_at(clock.now() + shoal_core::Duration::from_millis(300));
    let first = soon.div_ceil(u64::from(BUILDERS)) * u64::from(BUILDERS);
    cfg.run.start_slice = Some(first);

    let live = Arc::new(Live::default());
    let never = CancellationToken::new();
    let writer = tokio::spawn(shoal_net::writer::run_writer(cfg.clone(), writer_listener, never.clone()));
    let builders: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(id, l)| {
            tokio::spawn(shoal_net::builder::run_builder(
                shoal_net::builder::BuilderSettings::from_config(&cfg, id as u32).unwrap(),
                l,
                clock,
                live.clone(),
                never.clone(),
            ))
        })
        .collect();
    // One node per source, as the simulator gives every board its own host.
    let sources: Vec<_> = (0..SOURCES)
        .map(|id| {
            let mut c = cfg.clone();
            c.source.ids = vec![id];
            let (live, never) = (live.clone(), never.clone());
            tokio::spawn(async move { shoal_net::source::run_source(&c, clock, live, never, true).await })
        })
        .collect();
    let mut tallies: BTreeMap<u32, SourceTally> = BTreeMap::new();
    let mut transmits = Vec::new();
    for s in sources {
        let r = s.await.unwrap().unwrap();
        tallies.extend(r.tallies);
        transmits.extend(r.transmits);
    }
    let mut reports = Vec::new();
    for b in builders {
        reports.push(b.await.unwrap().unwrap().node);
    }
    writer.await.unwrap().unwrap();
    let _ = std::fs::remove_dir_all(&out);
    reports.sort_by_key(|r| r.id);
    let btallies = reports.iter().map(|r| (r.id, r.tally.clone())).collect();
    let ledger = Ledger::combine(&tallies, &btallies);
    transmits.sort_by_key(|t| t.at);
    let ledger = ledger.buckets().map(|(b, n)| (b.name().to_string(), n)).collect();
    digest(&transmits, first, reports, ledger)
}

/// What must agree in a builder report (arrival times and connection counts do not).
fn outcomes(r: &BuilderNodeReport) -> impl PartialEq + std::fmt::Debug {
    (r.id, r.slices_complete, r.slices_incomplete, r.incomplete_reasons.clone(), r.fragments, r.bytes, r.tally.clone())
}

/// `ordered`: the per-source order of frames is fixed by the policy (barrel shifting is a
/// FIFO); under a token bucket only each builder's sequence is.
fn compare(policy: &str, mut sim: Run, mut rt: Run, ordered: bool) {
    if !ordered {
        for f in sim.frames.values_mut().chain(rt.frames.values_mut()) {
            f.sort_by_key(|p| p.1);
        }
    }
    assert_eq!(sim.frames.len(), SOURCES as usize, "{policy}: every source sent");
    for (s, frames) in &sim.frames {
        assert_eq!(frames.len() as u64, SLICES, "{policy}: source {s} sent every slice");
        assert!(frames.iter().all(|f| f.2 == u64::from(FRAGMENT)), "{policy}: fixed fragments");
    }
    assert_eq!(sim.frames, rt.frames, "{policy}: per-source frames");
    assert_eq!(sim.pieces, rt.pieces, "{policy}: per-(source, builder) pieces");
    let (a, b): (Vec<_>, Vec<_>) =
        (sim.builders.iter().map(outcomes).collect(), rt.builders.iter().map(outcomes).collect());
    assert_eq!(a, b, "{policy}: per-builder slice outcomes and tallies");
    assert_eq!(sim.builders.iter().map(|r| r.slices_complete).sum::<u64>(), SLICES, "{policy}: every slice complete");
    assert_eq!(sim.ledger, rt.ledger, "{policy}: ledger bucket by bucket");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulator_and_runtime_agree_delayed() {
    let policy = "delayed:2";
    compare(policy, simulated(policy), runtime(policy).await, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulator_and_runtime_agree_token_bucket() {
    // 5 MB/s in 9,000-byte pieces: each 30,000-byte fragment leaves in 4 pieces over 4.2 ms.
    let policy = "tbf:5M:9000";
    compare(policy, simulated(policy), runtime(policy).await, false);
}
