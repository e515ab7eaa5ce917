//! Pull under failure, on real sockets: the data-flow manager restarted mid-run loses no
//! slice; a builder killed mid-run gets no more assignments and every fragment stays in a
//! ledger bucket. Moments are chosen by progress (slices built), never by sleeping.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use common::*;
use shoal_core::ledger::{Bucket, Ledger};
use shoal_net::builder::{BuilderReport, run_builder};
use shoal_net::clock::WallClock;
use shoal_net::config::{Config, ConfigError};
use shoal_net::dfm::{DfmReport, run_dfm};
use shoal_net::live::Live;
use shoal_net::source::{SourceReport, run_source_node};
use shoal_net::writer::{WriterReport, run_writer};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Waits (bounded by the run itself) until `live` counts at least `n` processed slices.
async fn built_at_least(live: &shoal_net::live::Live, n: u64) {
    loop {
        let built = live.slices_complete.load(Ordering::Relaxed) + live.slices_incomplete.load(Ordering::Relaxed);
        if built >= n {
            return;
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// A pull chain (writer, manager, builders, one source process) on ephemeral ports, with
/// 4 sources x 2 builders for 2 s, starting 30 slices from now.
struct Chain {
    cfg: Config,
    out: std::path::PathBuf,
    clock: WallClock,
    live: Arc<Live>,
    writer_stop: CancellationToken,
    writer: JoinHandle<anyhow::Result<WriterReport>>,
    dfm_addr: std::net::SocketAddr,
    dfm: JoinHandle<Result<DfmReport, ConfigError>>,
    builders: Vec<JoinHandle<Result<BuilderReport, ConfigError>>>,
    sources: JoinHandle<Result<SourceReport, ConfigError>>,
}

async fn start(name: &str, policy: &str) -> Chain {
    start_with(name, policy, None).await
}

/// `told_late`: the manager's own [`Live`], through which the test tells it the end slice
/// as run control does, after the sources have ended (its configuration then has no run
/// length: it assigns as the clock passes until told).
async fn start_with(name: &str, policy: &str, told_late: Option<Arc<Live>>) -> Chain {
    let out = temp_dir(name);
    let mut cfg = small_config(4, 2, 2.0, &out);
    cfg.run.policy = policy.into();
    let (wl, bls) = bind_all(&mut cfg).await;
    let dl = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dfm_addr = dl.local_addr().unwrap();
    cfg.run.dfm_addr = dfm_addr.to_string();
    let clock = clock();
    cfg.run.start_slice = Some(cfg.slice_clock().unwrap().slice_at(clock.now()) + 30);
    let live = live();
    let writer_stop = CancellationToken::new();
    let writer = tokio::spawn(run_writer(cfg.clone(), wl, writer_stop.clone()));
    let dfm = match told_late {
        None => tokio::spawn(run_dfm(cfg.clone(), dl, clock, live.clone(), never())),
        Some(dfm_live) => {
            let mut until_told = cfg.clone();
            until_told.run.seconds = 0.0;
            tokio::spawn(run_dfm(until_told, dl, clock, dfm_live, never()))
        }
    };
    let builders = bls
        .into_iter()
        .enumerate()
        .map(|(id, l)| {
            tokio::spawn(run_builder(
                shoal_net::builder::BuilderSettings::from_config(&cfg, id as u32).unwrap(),
                l,
                clock,
                live.clone(),
                never(),
            ))
        })
        .collect();
    let ids = cfg.hosted_sources();
    let sources = tokio::spawn(run_source_node(cfg.clone(), ids, clock, live.clone(), never()));
    Chain { cfg, out, clock, live, writer_stop, writer, dfm_addr, dfm, builders, sources }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_data_flow_manager_loses_no_slice() {
    // The sources hold unrequested fragments for 2,000 slices (20 s): longer than any
    // restart here can take, however busy the machine.
    let mut c = start("pull-dfm-restart", "pull:4:hold=2000").await;

    // A third of the way in, the manager dies (its socket closes) and comes back.
    built_at_least(&c.live, 60).await;
    c.dfm.abort();
    let _ = (&mut c.dfm).await;
    let dl = TcpListener::bind(c.dfm_addr).await.expect("the manager's port again");
    let dfm = tokio::spawn(run_dfm(c.cfg.clone(), dl, c.clock, c.live.clone(), never()));

    let s = c.sources.await.unwrap().unwrap();
    let mut btallies = BTreeMap::new();
    for b in c.builders {
        let r = b.await.unwrap().unwrap();
        btallies.insert(r.node.id, r.node.tally.clone());
    }
    let d = dfm.await.unwrap().unwrap();
    c.writer.await.unwrap().unwrap();
    let ledger = Ledger::combine(&s.tallies, &btallies);
    assert!(ledger.is_balanced(), "{ledger:?}");
    assert_eq!(ledger.get(Bucket::Delivered), ledger.produced, "no slice lost: {ledger:?}");
    assert!(d.done, "the restarted manager saw every slice processed");
    std::fs::remove_dir_all(&c.out).unwrap();
}

/// Under run control the manager hears the end slice only after the sources have drained;
/// meanwhile it assigns slices past the end as the clock passes. Builders whose sources all
/// ended say so (an end of stream) before closing: they are not builders that left, and
/// nothing they were assigned past the end is handed to the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builders_that_end_before_the_manager_knows_the_end_hand_nothing_on() {
    let dfm_live = live();
    let c = start_with("pull-end-late", "pull:4:hold=100", Some(dfm_live.clone())).await;
    let s = c.sources.await.unwrap().unwrap();
    let mut btallies = BTreeMap::new();
    for b in c.builders {
        let r = b.await.unwrap().unwrap();
        btallies.insert(r.node.id, r.node.tally.clone());
    }
    // Run control's STOP reaches the manager last.
    let slices = c.cfg.slices().unwrap().unwrap();
    let end = c.cfg.run.start_slice.unwrap() + slices;
    dfm_live.end_slice.store(end, Ordering::Relaxed);
    let d = c.dfm.await.unwrap().unwrap();
    c.writer.await.unwrap().unwrap();
    let ledger = Ledger::combine(&s.tallies, &btallies);
    assert!(ledger.is_balanced(), "{ledger:?}");
    assert_eq!(ledger.get(Bucket::Delivered), ledger.produced, "{ledger:?}");
    assert!(d.done, "{d:?}");
    assert_eq!((d.stats.builders_left, d.stats.reassigned, d.stats.expired), (0, 0, 0), "{d:?}");
    assert_eq!(d.stats.assigned - d.stats.assigned_past_end, slices, "every slice of the run once: {d:?}");
    std::fs::remove_dir_all(&c.out).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_builder_gets_no_more_slices_and_everything_is_accounted() {
    let mut c = start("pull-builder-kill", "pull:4:hold=100").await;

    // Builder 1 dies mid-run: its sockets close with it.
    built_at_least(&c.live, 60).await;
    let killed = c.builders.remove(1);
    killed.abort();
    let _ = killed.await;

    let s = c.sources.await.unwrap().unwrap();
    let r0 = c.builders.remove(0).await.unwrap().unwrap();
    let d = c.dfm.await.unwrap().unwrap();
    // The writer would wait for the dead builder's end of stream forever; run control
    // stops it at the end of the run, as here.
    c.writer_stop.cancel();
    c.writer.await.unwrap().unwrap();
    let ledger = Ledger::combine(&s.tallies, &BTreeMap::from([(0, r0.node.tally.clone())]));
    assert!(ledger.is_balanced(), "{ledger:?}");
    assert_eq!(d.stats.builders_left, 1);
    assert!(d.done, "the survivor processed every slice assigned to it");
    // The survivor built the rest of the run: more than half of it.
    let slices = c.cfg.slices().unwrap().unwrap();
    assert!(r0.node.slices_complete + r0.node.slices_incomplete > slices / 2, "{:?}", r0.node);
    std::fs::remove_dir_all(&c.out).unwrap();
}
