//! The whole chain in one process: every fragment accounted, every slice processed once,
//! the Parquet file holds what the writer reported.

mod common;

use common::*;
use parquet::file::reader::{FileReader, SerializedFileReader};
use shoal_net::demo::run_embedded;

async fn run(policy: &str, sources: u32, builders: u32) {
    run_with(policy, sources, builders, |_| {}).await;
}

async fn run_with(
    policy: &str,
    sources: u32,
    builders: u32,
    adjust: impl FnOnce(&mut shoal_net::config::Config),
) -> shoal_net::demo::RunSummary {
    let mut cfg = small_config(sources, builders, 1.0, std::path::Path::new("."));
    cfg.run.policy = policy.into();
    adjust(&mut cfg);
    // Tests run in parallel: the directory names everything that tells two runs apart.
    let receive = format!("{:?}", cfg.builder.receive).to_lowercase();
    let out = temp_dir(&format!("embedded-{}-{}-{receive}", cfg.run.transport, policy.replace(':', "-")));
    cfg.writer.out_dir = out.clone();
    let s = run_embedded(cfg, live(), never()).await.unwrap();
    assert!(s.ledger.balanced, "{:?}", s.ledger);
    assert_eq!(s.ledger.produced, u64::from(sources) * s.slices_produced);
    assert_eq!(s.ledger.unaccounted, 0);
    // Every produced slice was processed exactly once by its builder.
    assert_eq!(s.slices_complete + s.slices_incomplete, s.slices_produced, "{:?} {:?}", s.ledger, s.dfm);
    assert_eq!(s.writer.slices, s.slices_produced);
    assert_eq!(s.writer.builders_ended, builders as usize);
    let file = std::fs::File::open(&s.writer.file.path).unwrap();
    let rows = SerializedFileReader::new(file).unwrap().metadata().file_metadata().num_rows();
    assert_eq!(rows as u64, s.writer.file.events);
    assert_eq!(s.events, s.writer.file.events);
    // Every closed file has its metadata beside it, whose size and adler32 (computed
    // while writing) are the file's as read back.
    assert!(!s.writer.files.is_empty());
    for f in &s.writer.files {
        let meta = shoal_store::custody::FileMetadata::read(&shoal_store::custody::FileMetadata::path_for(&f.path))
            .unwrap_or_else(|e| panic!("{}: no metadata: {e}", f.path.display()));
        assert_eq!(meta.seal(), Some(shoal_store::custody::seal_of_file(&f.path).unwrap()), "{}", f.path.display());
        assert_eq!(
            (meta.events, meta.checksum.as_str(), meta.data_tier.as_str()),
            (f.events, f.checksum.as_str(), "filtered")
        );
    }
    assert!(s.summary_path.exists());
    std::fs::remove_dir_all(&out).unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_policy() {
    run("direct", 5, 3).await;
}

/// The io_uring receive path: the same chain, every fragment accounted; with pull, the
/// requests go back on the io_uring sockets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn io_uring_receive_path() {
    for policy in ["direct", "pull:4"] {
        run_with(policy, 5, 3, |c| c.builder.receive = shoal_net::config::ReceivePath::IoUring).await;
    }
}

/// Free-running sources (saturating: no slice clock) race each other. A source that runs
/// past the builder's window is held back by its connection instead of pushing the oldest
/// slice out incomplete: every slice is built complete (before holding back, 316-398 of the
/// 400 were not). The wall-clock guard is out of reach, so a busy machine changes nothing;
/// the filter may fall behind such a load (slices not filtered, counted), which is not what
/// this checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn free_running_sources_are_held_back_not_cut_off() {
    let out = temp_dir("embedded-free-running");
    let mut cfg = small_config(6, 1, 0.4, &out);
    cfg.run.slice_ms = 1;
    cfg.source.saturate = true;
    cfg.source.generator = shoal_detector::GeneratorKind::Fixed;
    cfg.source.fixed_bytes = 4096;
    cfg.source.connection_per_source = true;
    cfg.builder.max_active = 2;
    cfg.builder.wall_timeout_ms = 600_000;
    cfg.builder.drain_timeout_ms = 60_000;
    let s = run_embedded(cfg, live(), never()).await.unwrap();
    assert!(s.ledger.balanced && s.ledger.unaccounted == 0, "{:?}", s.ledger);
    assert_eq!((s.slices_produced, s.slices_complete, s.slices_incomplete), (400, 400, 0), "{:?}", s.ledger);
    assert_eq!((s.ledger.produced, s.ledger.buckets.get("delivered").copied()), (2400, Some(2400)), "{:?}", s.ledger);
    std::fs::remove_dir_all(&out).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_policy() {
    run("delayed:2", 6, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_bucket_policy() {
    run("tbf:20MB:64k", 4, 2).await;
}

/// A burst far below the fragment size: every fragment goes out in many chunks, the first
/// one splitting header and payload; the builder must still decode every frame intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_bucket_small_chunks() {
    run("tbf:50MB:1000", 3, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_policy() {
    run("pull:4", 5, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_policy_with_a_request_cap() {
    run("pull:2:cap=2", 4, 2).await;
}

/// Pull and traffic shaping together: the sources answer requests through a token bucket
/// per builder. The bucket is the default one millisecond deep: a much shallower one (say
/// 1000 bytes at 20 MB/s) sends one burst per timer wake-up, and on a busy machine, with
/// wake-ups tens of milliseconds apart, falls behind the builders' requests, which then
/// give fragments up (the `tbf` caveat of Linux with a bucket below rate / HZ).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_policy_answered_through_token_buckets() {
    run("pull:4:rate=20MB", 4, 2).await;
}

/// The datagram transport: every fragment cut into datagrams on loopback, reassembled,
/// and accounted (delivered, or recovered after a NACK: loopback may still drop a
/// datagram when a socket buffer overflows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_transport() {
    run_with("direct", 5, 3, |cfg| cfg.run.transport = "udp".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_transport_with_barrel_shifting_and_small_datagrams() {
    run_with("delayed:2", 4, 2, |cfg| {
        cfg.run.transport = "udp".into();
        cfg.udp.max_payload = 200;
    })
    .await;
}

/// A token bucket over datagrams: each 1000-byte chunk the bucket releases goes out as
/// soon as it is released, so the datagrams' pieces (1420 bytes) straddle chunks; every
/// frame must still be cut exactly and reassembled intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_transport_paced_by_a_token_bucket_in_small_chunks() {
    run_with("tbf:50MB:1000", 3, 2, |cfg| cfg.run.transport = "udp".into()).await;
}

/// Credit-based pull over datagrams: each source's stream greets every builder, requests
/// come back as `REQUEST` datagrams, the fragments go out as datagrams; every slice is
/// assigned by the manager and built once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_transport_with_pull() {
    let s = run_with("pull:4", 5, 3, |cfg| cfg.run.transport = "udp".into()).await;
    // Requests that never arrived would leave fragments `never_requested` and slices
    // incomplete.
    assert_eq!(s.slices_incomplete, 0, "{:?}", s.ledger);
    let b = &s.ledger.buckets;
    let got = |k: &str| b.get(k).copied().unwrap_or(0);
    assert_eq!(got("delivered") + got("recovered"), s.ledger.produced, "{:?}", s.ledger);
}
