//! Bad input at the source's entries: malformed frames, refused fragments, oversized
//! frames and clients that vanish mid-fragment on a `unix:` input; garbage, gaps,
//! reordering and duplicates on a `udp:` input; a caller that never closes its SDK handle. Each case is
//! counted under its own name, closes at most its own connection, and takes nothing from
//! the good data beside it.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use shoal_core::ingest::wire::{self, INPUT_HEADER_LEN, InputHeader};
use shoal_core::ingest::{Submission, When};
use shoal_core::ledger::Ledger;
use shoal_net::builder::run_builder;
use shoal_net::config::Config;
use shoal_net::sdk::SourceHandle;
use shoal_net::source::ingest::{InputTask, shared_ingest};
use shoal_net::writer::run_writer;

const SLICE_NS: u64 = 10_000_000;

fn payload(slice: u64) -> Vec<u8> {
    (0..200 + slice as usize * 13).map(|i| (i as u64 * 7 + slice) as u8).collect()
}

fn frame(source: u32, when: When, data: Vec<u8>, seq: u32) -> Bytes {
    wire::encode(&Submission { source, when, hit_count: None, payload: Bytes::from(data) }, seq)
}

fn config(out: &std::path::Path) -> Config {
    let mut cfg = small_config(1, 1, 0.0, out);
    cfg.builder.filter.name = "none".into();
    cfg.builder.store_slices = true;
    cfg.builder.max_active = 100_000;
    cfg.builder.wall_timeout_ms = 600_000;
    cfg.builder.drain_timeout_ms = 60_000;
    cfg.source.input_time_base = "run".into();
    cfg.source.saturate = true;
    cfg.source.input_max_fragment_mb = 1;
    cfg.saver.enabled = false;
    // Every process agrees on the first slice, a little ahead of now.
    let first = cfg.slice_clock().unwrap().slice_at(clock().now() + shoal_core::Duration::from_millis(300)) + 1;
    cfg.run.start_slice = Some(first);
    cfg
}

fn connect(path: &std::path::Path) -> UnixStream {
    let s = (0..3000)
        .find_map(|_| {
            UnixStream::connect(path).ok().or_else(|| {
                std::thread::sleep(Duration::from_millis(10));
                None
            })
        })
        .expect("the input socket comes up within 30 s");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s
}

/// Reads until the server closes the connection; true when it did.
fn closed_by_server(s: &mut UnixStream) -> bool {
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_unix_clients_are_counted_and_cost_the_good_one_nothing() {
    let out = temp_dir("input-bad-unix");
    let mut cfg = config(&out);
    // Two boards: one client each. (Two connections feeding one board are not ordered
    // with each other, so data-driven production could pass one's data by the other's.)
    cfg.run.sources = 2;
    let (wl, bls) = bind_all(&mut cfg).await;
    let sock = out.join("in.sock");
    cfg.source.input = format!("unix:{}", sock.display());
    let writer = tokio::spawn(run_writer(cfg.clone(), wl, never()));
    let builder = tokio::spawn(run_builder(
        shoal_net::builder::BuilderSettings::from_config(&cfg, 0).unwrap(),
        bls.into_iter().next().unwrap(),
        clock(),
        live(),
        never(),
    ));
    let source = tokio::spawn(shoal_net::source::run_source_node(cfg.clone(), vec![0, 1], clock(), live(), never()));
    let first = cfg.run.start_slice.unwrap();

    let clients = std::thread::spawn(move || {
        // The good client stays connected while the bad ones come and go (the input ends
        // the run when its last client has gone).
        let mut good = connect(&sock);
        for slice in 0..10 {
            good.write_all(&frame(0, When::TimeNs(slice * SLICE_NS + 100), payload(slice), slice as u32)).unwrap();
        }

        // Not the framing at all: this connection is closed, counted as bad_magic.
        let mut garbage = connect(&sock);
        garbage.write_all(&[0x5a; 100]).unwrap();
        assert!(closed_by_server(&mut garbage), "a malformed frame closes its connection");

        // Refused fragments keep their connection: the good frames after them are taken.
        let mut refusing = connect(&sock);
        refusing.write_all(&frame(9, When::TimeNs(10 * SLICE_NS), b"not in this run".to_vec(), 0)).unwrap();
        refusing.write_all(&frame(1, When::TimeNs(3_600_000_000_000), b"an hour ahead".to_vec(), 1)).unwrap();
        for slice in 0..30 {
            refusing.write_all(&frame(1, When::Slice(first + slice), payload(slice + 1), slice as u32)).unwrap();
        }
        drop(refusing);

        // A header announcing more than input_max_fragment_mb: the stream cannot be
        // resynchronised, so the connection is closed (counted too_large).
        let mut oversize = connect(&sock);
        let h =
            InputHeader { source: 0, when: When::Slice(20), hit_count: None, payload_len: (1 << 20) + 1, sequence: 0 };
        oversize.write_all(&wire::encode_header(&h)).unwrap();
        assert!(closed_by_server(&mut oversize), "an oversized frame closes its connection");

        // Half a fragment, then gone.
        let mut partial = connect(&sock);
        let f = frame(0, When::Slice(20), vec![1u8; 1000], 0);
        partial.write_all(&f[..INPUT_HEADER_LEN + 500]).unwrap();
        drop(partial);

        for slice in 10..30 {
            good.write_all(&frame(0, When::TimeNs(slice * SLICE_NS + 100), payload(slice), slice as u32)).unwrap();
        }
    });
    clients.join().expect("the clients' side");

    // The last client has gone: the run ends after the last slice with data.
    let report = source.await.unwrap().expect("the source node survives its bad clients");
    let b = builder.await.unwrap().unwrap();
    let w = writer.await.unwrap().unwrap();

    let ingest = report.ingest.clone().expect("an input's report");
    let rejected: BTreeMap<_, _> = ingest.rejected.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(
        rejected,
        BTreeMap::from([
            ("bad_magic", 1),
            ("unknown_source", 1),
            ("too_far_ahead", 1),
            ("too_large", 1),
            ("partial_at_disconnect", 1)
        ]),
        "{ingest:?}"
    );
    assert_eq!(ingest.accepted, 60, "{ingest:?}");
    assert!(ingest.balanced(), "{ingest:?}");

    let mut bt = BTreeMap::new();
    bt.insert(0, b.node.tally.clone());
    let ledger = Ledger::combine(&report.tallies, &bt);
    assert!(ledger.is_balanced() && ledger.unaccounted() == 0, "{ledger:?}");
    assert_eq!(ledger.get(shoal_core::ledger::Bucket::Delivered), 60, "{ledger:?}");

    let stored: BTreeMap<(u64, u32), Vec<u8>> = shoal_store::read_raw(&w.slices_file.expect("slice file").path)
        .unwrap()
        .into_iter()
        .map(|r| ((r.slice, r.source), r.payload))
        .collect();
    assert_eq!(stored.len(), 60);
    for slice in 0..30 {
        assert_eq!(stored.get(&(first + slice, 0)), Some(&payload(slice)), "slice {slice} of the good client");
        assert_eq!(stored.get(&(first + slice, 1)), Some(&payload(slice + 1)), "slice {slice} after refusals");
    }
    std::fs::remove_dir_all(&out).unwrap();
}

/// Waits (bounded) until `cond` holds on the ingest's report.
fn wait_for(
    ingest: &shoal_net::source::ingest::SharedIngest,
    what: &str,
    cond: impl Fn(&shoal_core::ingest::IngestReport) -> bool,
) {
    for _ in 0..6000 {
        if cond(&ingest.report()) {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("{what} within a minute: {:?}", ingest.report());
}

#[test]
fn udp_input_counts_garbage_gaps_and_reordering() {
    let out = temp_dir("input-bad-udp");
    let mut cfg = config(&out);
    cfg.source.input = "udp:127.0.0.1:0".into();
    let first = cfg.run.start_slice.unwrap();
    let ingest = shared_ingest(&cfg, first).unwrap();
    let task = InputTask::start(&cfg.input().unwrap(), &cfg, ingest.clone()).unwrap().expect("a udp input");
    let addr = task.udp_addr().expect("bound");
    let tx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let send = |b: &[u8]| {
        tx.send_to(b, addr).unwrap();
    };

    // Sequence 0, 1, 2, then 5 (3 and 4 lost), then 4 after all (reordered).
    for seq in [0u32, 1, 2, 5] {
        send(&frame(0, When::Slice(first + u64::from(seq)), payload(u64::from(seq)), seq));
    }
    wait_for(&ingest, "the first four datagrams", |r| r.accepted == 4);
    assert_eq!(ingest.report().lost_at_input, 2);
    send(&frame(0, When::Slice(first + 4), payload(4), 4));
    // The same datagram twice: dropped the second time, not appended to its fragment.
    send(&frame(0, When::Slice(first + 2), payload(2), 2));
    // Garbage, a datagram shorter than its header says, a source outside the run.
    send(b"definitely not a shoal input frame, but long enough for a header");
    let f = frame(0, When::Slice(first + 6), payload(6), 6);
    send(&f[..f.len() - 10]);
    send(&frame(77, When::Slice(first + 6), payload(6), 0));
    wait_for(&ingest, "every datagram", |r| r.accepted == 5 && r.rejected_total() == 4);

    let r = ingest.report();
    assert_eq!((r.lost_at_input, r.reordered_at_input), (1, 1), "{r:?}");
    let rejected: BTreeMap<_, _> = r.rejected.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(
        rejected,
        BTreeMap::from([("bad_magic", 1), ("duplicate", 1), ("length_mismatch", 1), ("unknown_source", 1)])
    );
    task.stop();
    std::fs::remove_dir_all(&out).unwrap();
}

/// A program that drops its handle without `close` (or returns early) still ends its run:
/// the builders finish, and every fragment it submitted is accounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_dropped_without_close_ends_the_run_accounted() {
    let out = temp_dir("input-never-closed");
    let mut cfg = config(&out);
    let (wl, bls) = bind_all(&mut cfg).await;
    let writer = tokio::spawn(run_writer(cfg.clone(), wl, never()));
    let builder = tokio::spawn(run_builder(
        shoal_net::builder::BuilderSettings::from_config(&cfg, 0).unwrap(),
        bls.into_iter().next().unwrap(),
        clock(),
        live(),
        never(),
    ));
    let c = cfg.clone();
    tokio::task::spawn_blocking(move || {
        let handle = SourceHandle::open(c).unwrap();
        for slice in 0..10 {
            handle.submit(0, When::TimeNs(slice * SLICE_NS), Bytes::from(payload(slice))).unwrap();
        }
        // No close: the caller forgets, or returns early on an error of its own.
    })
    .await
    .unwrap();
    let b = builder.await.unwrap().expect("the builder's run ends");
    let w = writer.await.unwrap().unwrap();
    let t = &b.node.tally;
    assert_eq!(t.delivered, 10, "{t:?}");
    let stored = shoal_store::read_raw(&w.slices_file.expect("slice file").path).unwrap();
    assert_eq!(stored.len(), 10);
    std::fs::remove_dir_all(&out).unwrap();
}

/// A `clb:` input (KM3NeT's DataQueue in a source): garbage, a truncated packet, an
/// acoustic packet, a DOM not in the detector, a misaligned time, a packet of a timeslice
/// long gone, a duplicate, a gap and packets out of order. Each is counted by name; the
/// good packets make one superframe per DOM, hits in sequence order, the gap marked.
#[test]
fn clb_input_counts_bad_packets_and_keeps_the_good_ones() {
    use shoal_core::km3net::clb::{ClbDataType, ClbHeader, ClbHit, encode_optical};
    use shoal_core::km3net::jdaq::decode_superframe;
    use shoal_core::node::Workload;

    let out = temp_dir("input-bad-clb");
    let mut cfg = config(&out);
    cfg.run.sources = 2;
    cfg.source.input = "clb:127.0.0.1:0".into();
    cfg.source.input_time_base = "unix".into();
    cfg.km3net.doms = vec![11, 12];
    cfg.km3net.det_id = 7;
    cfg.validate().unwrap();
    let first = cfg.run.start_slice.unwrap();
    let slice_ns = 10_000_000u64;
    let ingest = shared_ingest(&cfg, first).unwrap();
    let task = InputTask::start(&cfg.input().unwrap(), &cfg, ingest.clone()).unwrap().expect("a clb input");
    let addr = task.udp_addr().expect("bound");
    let tx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let send = |b: &[u8]| {
        tx.send_to(b, addr).unwrap();
    };
    let packet = |dom: u32, start_ns: u64, seq: u32, times: &[u32]| {
        let h = ClbHeader {
            data_type: ClbDataType::Optical,
            run: 1,
            udp_sequence: seq,
            timestamp_s: (start_ns / 1_000_000_000) as u32,
            ticks: ((start_ns % 1_000_000_000) / 16) as u32,
            dom_id: dom,
            dom_status: 1 << 31,
        };
        let hits: Vec<ClbHit> =
            times.iter().map(|&t| ClbHit { channel: (t % 31) as u8, time_ns: t, tot: 26 }).collect();
        encode_optical(&h, &hits)
    };
    let t = (first + 1) * slice_ns;
    send(&packet(11, t, 0, &[10, 20]));
    send(&packet(11, t, 2, &[500]));
    send(&packet(11, t, 2, &[500])); // duplicate
    send(&packet(12, t, 1, &[900])); // out of order
    send(&packet(12, t, 0, &[100, 200]));
    send(&packet(99, t, 0, &[1])); // not in the detector
    send(&packet(11, t + 16, 3, &[1])); // not on a timeslice boundary
    send(&packet(11, (first - 1000) * slice_ns, 0, &[1])); // a timeslice long gone
    let mut acoustic = packet(11, t, 9, &[]);
    acoustic[..4].copy_from_slice(b"TAES");
    send(&acoustic);
    send(b"definitely not a CLB packet");
    let good = packet(12, t, 2, &[1]);
    send(&good[..good.len() - 3]); // hits cut short
    wait_for(&ingest, "both DOMs' frames", |r| r.accepted == 2);

    // Sequence order within a frame; DOM 11's packet 1 never came.
    let frame = |source: u32| {
        let f = ingest.generate(source, first + 1);
        let (h, frame) = decode_superframe(&f.payload).expect("a superframe");
        assert_eq!((h.det_id, h.frame_index, h.start_ns()), (7, 2, t));
        frame
    };
    let f11 = frame(0);
    assert_eq!((f11.dom_id, f11.dataqueue_status), (11, 2), "two packets received");
    assert_eq!(f11.hits.iter().map(|h| h.time_ns).collect::<Vec<_>>(), [10, 20, 500]);
    let f12 = frame(1);
    assert_eq!(f12.hits.iter().map(|h| h.time_ns).collect::<Vec<_>>(), [100, 200, 900]);

    let r = task.stop().expect("the DataQueue's counters");
    let refused: BTreeMap<_, _> = r.refused.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(
        refused,
        BTreeMap::from([
            ("duplicate", 1),
            ("late", 1),
            ("misaligned", 1),
            ("ragged_hits", 1),
            ("short", 1),
            ("unknown_dom", 1)
        ]),
        "{r:?}"
    );
    assert_eq!(r.skipped.get("acoustic"), Some(&1));
    assert_eq!((r.packets, r.optical_packets, r.hits), (11, 4, 6));
    assert_eq!((r.frames, r.frames_incomplete, r.packets_missing, r.dropped_by_kernel), (2, 1, 1, 0));
    std::fs::remove_dir_all(&out).unwrap();
}
