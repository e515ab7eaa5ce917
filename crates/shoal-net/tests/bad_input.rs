//! Bad bytes on a builder's data port close only that connection, with a counted reason;
//! the builder keeps assembling from the real sources.

mod common;

use std::collections::BTreeMap;

use common::*;
use rand::{Rng, SeedableRng};
use shoal_core::Instant;
use shoal_core::frame::{self, Flags, FrameHeader};
use shoal_core::ledger::Ledger;
use shoal_net::builder::run_builder;
use shoal_net::live::Live;
use shoal_net::source::run_source_node;
use shoal_net::writer::run_writer;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

async fn run_with_intruder(name: &str, bad: Vec<u8>) -> (shoal_net::builder::BuilderReport, Ledger) {
    let out = temp_dir(name);
    let mut cfg = small_config(2, 1, 1.0, &out);
    let (wl, mut bls) = bind_all(&mut cfg).await;
    let addr = bls[0].local_addr().unwrap();
    let writer = tokio::spawn(run_writer(cfg.clone(), wl, never()));
    let builder = tokio::spawn(run_builder(
        shoal_net::builder::BuilderSettings::from_config(&cfg, 0).unwrap(),
        bls.remove(0),
        clock(),
        live(),
        never(),
    ));
    let intruder = tokio::spawn(async move {
        let mut s = TcpStream::connect(addr).await.unwrap();
        // The builder may close on us mid-write; that is the point.
        let _ = s.write_all(&bad).await;
        let _ = s.shutdown().await;
    });
    let sources = run_source_node(cfg.clone(), vec![0, 1], clock(), live(), never()).await.unwrap();
    intruder.await.unwrap();
    let b = builder.await.unwrap().unwrap();
    let w = writer.await.unwrap().unwrap();
    assert!(w.error.is_none());
    let ledger = Ledger::combine(&sources.tallies, &BTreeMap::from([(0, b.node.tally.clone())]));
    std::fs::remove_dir_all(&out).unwrap();
    (b, ledger)
}

fn assert_builder_carried_on(b: &shoal_net::builder::BuilderReport, ledger: &Ledger) {
    assert!(ledger.is_balanced(), "{ledger:?}");
    assert_eq!(ledger.lost(), 0, "no fragment of the real sources may be lost: {ledger:?}");
    assert!(b.node.slices_complete > 0);
    assert_eq!(b.node.rejected_connections.values().sum::<u64>(), 1, "{:?}", b.node.rejected_connections);
}

/// A valid header (correct CRC) of an empty frame from source 0.
fn header() -> FrameHeader {
    FrameHeader {
        flags: Flags::EMPTY,
        source: 0,
        hit_count: 0,
        slice: 1,
        slice_start: Instant::ZERO,
        send_time: Instant::ZERO,
        payload_len: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_bytes_close_only_that_connection() {
    let mut rng = rand_pcg::Pcg64Mcg::seed_from_u64(7);
    let mut bad = vec![0u8; 100_000];
    rng.fill_bytes(&mut bad);
    let (b, ledger) = run_with_intruder("random", bad).await;
    assert_builder_carried_on(&b, &ledger);
    assert_eq!(b.node.rejected_connections.get("bad_magic"), Some(&1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_length_is_rejected_before_allocation() {
    let h = header();
    // A valid header (correct CRC) announcing 17 MiB, above the 16 MiB default limit.
    let mut bytes = frame::encode(&h, &vec![0u8; 17 << 20]).to_vec();
    bytes.truncate(frame::HEADER_LEN + 10);
    let (b, ledger) = run_with_intruder("oversized", bytes).await;
    assert_builder_carried_on(&b, &ledger);
    assert_eq!(b.node.rejected_connections.get("payload_too_large"), Some(&1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_frame_at_eof_is_counted() {
    let h = header();
    let mut bytes = frame::encode(&h, &[0u8; 600]).to_vec();
    bytes.truncate(300);
    let (b, ledger) = run_with_intruder("truncated", bytes).await;
    assert_builder_carried_on(&b, &ledger);
    assert_eq!(b.node.rejected_connections.get("truncated"), Some(&1));
}

/// Datagram transport: garbage, truncated, corrupted, other-run, other-builder and
/// unknown-source datagrams on a builder's UDP port all through the run are counted by
/// reason and ignored; every fragment of the real sources is still delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_datagrams_are_counted_and_ignored() {
    use shoal_core::datagram::{Datagram, DatagramHeader, Kind};
    let out = temp_dir("udp-intruder");
    let mut cfg = small_config(2, 1, 1.0, &out);
    cfg.run.transport = "udp".into();
    let (wl, mut bls) = bind_all(&mut cfg).await;
    let addr = bls[0].local_addr().unwrap();
    let writer = tokio::spawn(run_writer(cfg.clone(), wl, never()));
    let builder = tokio::spawn(run_builder(
        shoal_net::builder::BuilderSettings::from_config(&cfg, 0).unwrap(),
        bls.remove(0),
        clock(),
        live(),
        never(),
    ));
    let run = cfg.run.run_number as u32;
    let data = |run: u32, source: u32, builder: u32| {
        let h =
            DatagramHeader { seq: 1, slice: 7, frame_len: 10, ..DatagramHeader::new(Kind::Data, run, source, builder) };
        Datagram::encode(&h, &[1u8; 10])
    };
    let mut corrupted = data(run, 0, 0).to_vec();
    corrupted[60] ^= 0xFF;
    let bad: Vec<Vec<u8>> = vec![
        b"not a datagram".to_vec(),
        vec![0u8; 200],
        data(run, 0, 0)[..30].to_vec(),
        corrupted,
        data(run + 1, 0, 0).to_vec(),
        data(run, 0, 5).to_vec(),
        data(run, 9, 0).to_vec(),
    ];
    let stop = tokio_util::sync::CancellationToken::new();
    let stop_intruder = stop.clone();
    let intruder = tokio::spawn(async move {
        let s = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let mut rounds = 0u64;
        // Until the sources are done (bounded: at most 100,000 rounds).
        while !stop_intruder.is_cancelled() && rounds < 100_000 {
            for b in &bad {
                let _ = s.send_to(b, addr).await;
            }
            rounds += 1;
            tokio::select! {
                _ = tokio::time::sleep(std::time::Duration::from_millis(5)) => {}
                _ = stop_intruder.cancelled() => {}
            }
        }
    });
    let sources = run_source_node(cfg.clone(), vec![0, 1], clock(), live(), never()).await.unwrap();
    stop.cancel();
    intruder.await.unwrap();
    let b = builder.await.unwrap().unwrap();
    writer.await.unwrap().unwrap();
    let ledger = Ledger::combine(&sources.tallies, &BTreeMap::from([(0, b.node.tally.clone())]));
    std::fs::remove_dir_all(&out).unwrap();
    assert!(ledger.is_balanced(), "{ledger:?}");
    assert_eq!(ledger.lost(), 0, "no fragment of the real sources may be lost: {ledger:?}");
    let udp = b.udp.expect("a UDP report");
    let e = &udp.endpoint;
    for reason in ["truncated", "bad_magic", "bad_crc"] {
        assert!(e.refused.get(reason).copied().unwrap_or(0) > 0, "{reason}: {e:?}");
    }
    assert!(e.other_run > 0 && e.other_builder > 0 && e.unknown_source > 0, "{e:?}");
}

/// Sends `bytes`, then waits for the peer to close the connection (it rejected them).
async fn rejected(addr: std::net::SocketAddr, bytes: &[u8]) {
    use tokio::io::AsyncReadExt;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(bytes).await;
    let mut sink = [0u8; 64];
    // Guard against a hang only: the writer closes a rejected connection at once.
    let closed = tokio::time::timeout(std::time::Duration::from_secs(60), async {
        while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
    assert!(closed.is_ok(), "the writer never closed a connection that sent {:?}", &bytes[..bytes.len().min(16)]);
}

/// A writer for one builder on a port of its own, with no builder: its output directory,
/// its address and its task.
async fn writer_alone(
    name: &str,
) -> (std::path::PathBuf, std::net::SocketAddr, tokio::task::JoinHandle<anyhow::Result<shoal_net::writer::WriterReport>>)
{
    let out = temp_dir(name);
    let cfg = small_config(1, 1, 1.0, &out);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    (out, addr, tokio::spawn(run_writer(cfg, listener, never())))
}

/// The builder of a [`writer_alone`] on its connection `b`: one slice's (empty) events,
/// then its end of stream; the writer's report, which must say it stored that slice and
/// saw the builder end, without error.
async fn one_slice_and_end(
    mut b: TcpStream,
    writer: tokio::task::JoinHandle<anyhow::Result<shoal_net::writer::WriterReport>>,
) -> shoal_net::writer::WriterReport {
    let events = FrameHeader { flags: Flags::EVENTS, source: 0, ..header() };
    b.write_all(&frame::encode(&events, &[])).await.unwrap();
    b.write_all(&frame::encode(&FrameHeader { flags: Flags::END_OF_STREAM, ..header() }, &[])).await.unwrap();
    let w = writer.await.unwrap().unwrap();
    assert!(w.error.is_none(), "{:?}", w.error);
    assert_eq!((w.slices, w.builders_ended), (1, 1));
    w
}

/// Hostile clients on the writer's port: each is closed with a counted reason, a client
/// that sends one byte and stalls (slowloris) holds nothing up, and the real builder's
/// slices are stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_clients_on_the_writer_port_are_counted_and_closed() {
    let (out, addr, writer) = writer_alone("writer-hostile").await;

    // A slowloris: the start of a header, then nothing, kept open to the end.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(&frame::encode(&header(), &[])[..3]).await.unwrap();
    // Garbage, an oversized length, a data frame where events belong, a short raw record.
    rejected(addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let huge = FrameHeader { flags: Flags::EVENTS, payload_len: u32::MAX, ..header() };
    rejected(addr, &frame::encode_header_with_crc(&huge, u32::MAX, 0)).await;
    rejected(addr, &frame::encode(&header(), &[])).await;
    rejected(addr, &frame::encode(&FrameHeader { flags: Flags::RAW, payload_len: 4, ..header() }, &[1, 2, 3, 4])).await;

    // The real builder.
    let w = one_slice_and_end(TcpStream::connect(addr).await.unwrap(), writer).await;
    drop(slow);
    let reasons: Vec<&str> = w.rejected_connections.keys().map(String::as_str).collect();
    assert_eq!(
        reasons,
        ["bad_magic", "not_events", "payload_too_large", "raw_too_short"],
        "{:?}",
        w.rejected_connections
    );
    assert!(w.rejected_connections.values().all(|&n| n == 1));
    std::fs::remove_dir_all(&out).unwrap();
}

/// A connection flood on the writer's port stops at its limit (builders + 256): the
/// connections beyond are closed and counted, the builder connected before the flood has
/// its slice stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_flood_on_the_writer_port_stops_at_its_limit() {
    let (out, addr, writer) = writer_alone("writer-flood").await;
    let b = TcpStream::connect(addr).await.unwrap();
    // Room for 1 + 256; one is the builder's: 256 flood connections fit, 3 do not.
    let mut flood = Vec::new();
    for _ in 0..259 {
        flood.push(TcpStream::connect(addr).await.unwrap());
    }
    // A refused connection is closed once it is counted: wait for the last three to close,
    // so the builder's end of stream comes after the count.
    for s in &mut flood[256..] {
        use tokio::io::AsyncReadExt;
        let mut sink = [0u8; 16];
        // Guard against a hang only.
        let closed = tokio::time::timeout(std::time::Duration::from_secs(60), s.read(&mut sink)).await;
        assert!(matches!(closed, Ok(Ok(0))), "a connection beyond the limit was not closed: {closed:?}");
    }
    let w = one_slice_and_end(b, writer).await;
    drop(flood);
    assert_eq!(w.rejected_connections, BTreeMap::from([("connection_limit".to_string(), 3)]));
    std::fs::remove_dir_all(&out).unwrap();
}

/// A builder's slices in one write, several hundred, then a bad frame: the writer stores
/// every slice before it (taken in batches, as they were read) and counts the connection
/// rejected; the builder's end of stream on a new connection ends the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writer_stores_what_came_before_a_bad_frame_in_the_same_write() {
    let (out, addr, writer) = writer_alone("writer-batch").await;
    let events = |slice| frame::encode(&FrameHeader { flags: Flags::EVENTS, slice, ..header() }, &[]);
    let mut bytes: Vec<u8> = (1..=700).flat_map(|s| events(s).to_vec()).collect();
    bytes.extend_from_slice(&frame::encode(&header(), &[]));
    rejected(addr, &bytes).await;
    let mut b = TcpStream::connect(addr).await.unwrap();
    b.write_all(&frame::encode(&FrameHeader { flags: Flags::END_OF_STREAM, ..header() }, &[])).await.unwrap();
    let w = writer.await.unwrap().unwrap();
    assert!(w.error.is_none(), "{:?}", w.error);
    assert_eq!((w.slices, w.builders_ended), (700, 1));
    assert_eq!(w.rejected_connections, BTreeMap::from([("not_events".to_string(), 1)]));
    std::fs::remove_dir_all(&out).unwrap();
}

/// A connection flood on a builder's data port stops at its limit (sources + 256): the
/// connections beyond are closed at once and counted, the real source's connection keeps
/// its data flowing, nothing is lost. The run lasts until the flood is counted (a run of
/// fixed length could end, and its builder stop listening, before a loaded machine had
/// made the 298 connections: one was refused on a clean clone's `make test`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_flood_on_the_data_port_stops_at_its_limit() {
    let out = temp_dir("flood");
    let mut cfg = small_config(2, 1, 600.0, &out);
    let (wl, mut bls) = bind_all(&mut cfg).await;
    let addr = bls[0].local_addr().unwrap();
    let live = live();
    let writer = tokio::spawn(run_writer(cfg.clone(), wl, never()));
    let builder = tokio::spawn(run_builder(
        shoal_net::builder::BuilderSettings::from_config(&cfg, 0).unwrap(),
        bls.remove(0),
        clock(),
        live.clone(),
        never(),
    ));
    let stop = never();
    let sources = tokio::spawn(run_source_node(cfg.clone(), vec![0, 1], clock(), live.clone(), stop.clone()));
    // The source's connection is in (data arrives) before the flood.
    let waiting = std::time::Instant::now();
    while Live::get(&live.fragments_received) == 0 {
        assert!(waiting.elapsed() < std::time::Duration::from_secs(120), "no data reached the builder");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // Room for 2 + 256; one is the source's: 257 flood connections fit, 41 do not.
    let mut flood = Vec::new();
    for _ in 0..298 {
        flood.push(TcpStream::connect(addr).await.unwrap());
    }
    let waiting = std::time::Instant::now();
    while Live::get(&live.rejected_connections) < 41 {
        assert!(waiting.elapsed() < std::time::Duration::from_secs(120), "the flood was not refused");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    stop.cancel();
    let sources = sources.await.unwrap().unwrap();
    let b = builder.await.unwrap().unwrap();
    let w = writer.await.unwrap().unwrap();
    drop(flood);
    assert!(w.error.is_none());
    let ledger = Ledger::combine(&sources.tallies, &BTreeMap::from([(0, b.node.tally.clone())]));
    assert!(ledger.is_balanced(), "{ledger:?}");
    assert_eq!(ledger.lost(), 0, "the source's data must all arrive: {ledger:?}");
    assert_eq!(b.node.rejected_connections.get("connection_limit"), Some(&41), "{:?}", b.node.rejected_connections);
    std::fs::remove_dir_all(&out).unwrap();
}
