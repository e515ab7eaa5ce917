//! Real data in: fragments submitted through the Rust SDK and written to a `unix:` input by
//! a readout client travel the whole chain; every payload is in the writer's slice file
//! byte for byte, every fragment and every submission accounted.

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use shoal_core::ingest::wire;
use shoal_core::ingest::{IngestError, Placed, Submission, When};
use shoal_core::ledger::Ledger;
use shoal_net::builder::run_builder;
use shoal_net::config::Config;
use shoal_net::sdk::SourceHandle;
use shoal_net::writer::run_writer;

const SLICES: u64 = 40;
const SLICE_NS: u64 = 10_000_000;

/// A payload that names its (source, slice, piece), of a size that varies with them.
fn payload(source: u32, slice: u64, piece: u32) -> Vec<u8> {
    let len = 100 + (slice as usize * 37 + source as usize * 101 + piece as usize) % 3000;
    (0..len).map(|i| (i as u64 ^ slice.wrapping_mul(31) ^ u64::from(source) << 3) as u8).collect()
}

fn base_config(out: &std::path::Path) -> Config {
    let mut cfg = small_config(3, 2, 0.0, out);
    cfg.builder.filter.name = "none".into();
    cfg.builder.store_slices = true;
    cfg.source.input_time_base = "run".into();
    cfg.source.input_latency_ms = 30;
    cfg.saver.enabled = false;
    // Data-driven: a slice goes out when every board's data has moved past it, and the
    // builders' timeouts are out of reach, so what arrives does not depend on how busy
    // this machine is.
    cfg.source.saturate = true;
    cfg.builder.max_active = 100_000;
    cfg.builder.wall_timeout_ms = 600_000;
    cfg.builder.drain_timeout_ms = 60_000;
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_and_unix_input_fragments_arrive_byte_for_byte_and_are_accounted() {
    let out = temp_dir("sdk-chain");
    let mut cfg = base_config(&out);
    let (wl, bls) = bind_all(&mut cfg).await;
    // Every process agrees on the first slice, a little ahead of now.
    let slice_clock = cfg.slice_clock().unwrap();
    let first = slice_clock.slice_at(clock().now() + shoal_core::Duration::from_millis(300)) + 1;
    cfg.run.start_slice = Some(first);

    let writer = tokio::spawn(run_writer(cfg.clone(), wl, never()));
    let builders: Vec<_> = bls
        .into_iter()
        .enumerate()
        .map(|(id, l)| {
            tokio::spawn(run_builder(
                shoal_net::builder::BuilderSettings::from_config(&cfg, id as u32).unwrap(),
                l,
                clock(),
                live(),
                never(),
            ))
        })
        .collect();

    // Source 2: a readout client writing the input framing to a unix socket.
    let sock = out.join("readout.sock");
    let mut unix_cfg = cfg.clone();
    unix_cfg.source.input = format!("unix:{}", sock.display());
    let unix_source = tokio::spawn(shoal_net::source::run_source_node(unix_cfg, vec![2], clock(), live(), never()));
    let client = std::thread::spawn(move || {
        let mut stream = (0..500)
            .find_map(|_| {
                UnixStream::connect(&sock).ok().or_else(|| {
                    std::thread::sleep(Duration::from_millis(10));
                    None
                })
            })
            .expect("the input socket comes up");
        for slice in 0..SLICES {
            let sub = Submission {
                source: 2,
                when: When::TimeNs(slice * SLICE_NS + 1234),
                hit_count: None,
                payload: Bytes::from(payload(2, slice, 0)),
            };
            stream.write_all(&wire::encode(&sub, slice as u32)).unwrap();
        }
    });

    // Sources 0 and 1: the Rust SDK, two pieces per slice for source 1 from another thread.
    let mut sdk_cfg = cfg.clone();
    sdk_cfg.source.ids = vec![0, 1];
    let handle = std::sync::Arc::new(SourceHandle::open(sdk_cfg).unwrap());
    assert_eq!(handle.first_slice(), first);
    let h1 = handle.clone();
    let second = std::thread::spawn(move || {
        for slice in 0..SLICES {
            for piece in 0..2 {
                let p = Bytes::from(payload(1, slice, piece));
                assert!(matches!(h1.submit(1, When::Slice(first + slice), p), Ok(Placed::OnTime(_))));
            }
        }
    });
    for slice in 0..SLICES {
        let r = handle.submit(0, When::TimeNs(slice * SLICE_NS + 5_000_000), Bytes::from(payload(0, slice, 0)));
        assert_eq!(r, Ok(Placed::OnTime(first + slice)));
    }
    // Refused, counted, and nothing else disturbed.
    let bad = [
        handle.submit(7, When::Slice(first), Bytes::from_static(b"x")).unwrap_err(),
        handle.submit(0, When::Slice(first - 1), Bytes::from_static(b"x")).unwrap_err(),
        handle.submit(0, When::TimeNs(3_600_000_000_000), Bytes::from_static(b"x")).unwrap_err(),
        handle.submit(0, When::Slice(first), Bytes::from(vec![0u8; 17 << 20])).unwrap_err(),
        handle.submit_hits(0, When::Slice(first + 1), 5, Bytes::from_static(b"short")).unwrap_err(),
    ];
    let kinds: Vec<_> = bad.iter().map(IngestError::kind).collect();
    assert_eq!(kinds, ["unknown_source", "before_run", "too_far_ahead", "too_large", "bad_hits"]);
    second.join().unwrap();
    client.join().unwrap();
    assert!(handle.flush(Duration::from_secs(60)), "everything submitted goes out");
    let handle = std::sync::Arc::into_inner(handle).expect("the other thread is done");
    let sdk_report = tokio::task::spawn_blocking(move || handle.close()).await.unwrap().unwrap();
    // The unix input's run ends when its client has gone.
    let unix_report = unix_source.await.unwrap().unwrap();

    let mut builder_tallies = BTreeMap::new();
    for b in builders {
        let r = b.await.unwrap().unwrap();
        builder_tallies.insert(r.node.id, r.node.tally.clone());
    }
    let w = writer.await.unwrap().unwrap();

    let ingest = sdk_report.ingest.clone().expect("the SDK's ingest report");
    assert_eq!((ingest.accepted, ingest.rejected_total(), ingest.late), (3 * SLICES, 5, 0), "{ingest:?}");
    assert!(ingest.balanced() && ingest.held == 0, "{ingest:?}");
    let unix_ingest = unix_report.ingest.clone().expect("the input's ingest report");
    assert_eq!((unix_ingest.accepted, unix_ingest.rejected_total()), (SLICES, 0), "{unix_ingest:?}");

    let mut source_tallies = sdk_report.tallies.clone();
    source_tallies.extend(unix_report.tallies.clone());
    let ledger = Ledger::combine(&source_tallies, &builder_tallies);
    assert!(ledger.is_balanced(), "{ledger:?}");
    assert_eq!(ledger.unaccounted(), 0);

    // Every payload, byte for byte, in the slice file; empty fragments for slices without data.
    let stored: BTreeMap<(u64, u32), Vec<u8>> =
        shoal_store::read_raw(&w.slices_file.as_ref().expect("slice file").path)
            .unwrap()
            .into_iter()
            .map(|r| {
                assert_eq!(r.stream, "slice");
                ((r.slice, r.source), r.payload)
            })
            .collect();
    for slice in 0..SLICES {
        assert_eq!(stored[&(first + slice, 0)], payload(0, slice, 0), "source 0 slice {slice}");
        assert_eq!(stored[&(first + slice, 1)], [payload(1, slice, 0), payload(1, slice, 1)].concat());
        assert_eq!(stored[&(first + slice, 2)], payload(2, slice, 0), "source 2 slice {slice}");
    }
    assert_eq!(stored.len() as u64, ledger.get(shoal_core::ledger::Bucket::Delivered));
    std::fs::remove_dir_all(&out).unwrap();
}

/// Data that reach the source after their slice was sent go out late and the builder's
/// late path counts them; the ledger still balances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_after_its_slice_went_out_is_sent_late_and_counted() {
    let out = temp_dir("sdk-late");
    let mut cfg = base_config(&out);
    cfg.run.sources = 1;
    cfg.run.builders = 1;
    cfg.source.input_latency_ms = 0;
    // Paced by the clock, so that slices go out whether or not data came.
    cfg.source.saturate = false;
    let (wl, bls) = bind_all(&mut cfg).await;
    let writer = tokio::spawn(run_writer(cfg.clone(), wl, never()));
    let l = bls.into_iter().next().unwrap();
    let builder = tokio::spawn(run_builder(
        shoal_net::builder::BuilderSettings::from_config(&cfg, 0).unwrap(),
        l,
        clock(),
        live(),
        never(),
    ));
    let handle = SourceHandle::open(cfg.clone()).unwrap();
    let first = handle.first_slice();
    assert_eq!(handle.submit(0, When::Slice(first + 2), Bytes::from_static(b"on time")), Ok(Placed::OnTime(first + 2)));
    // Wait (bounded, a minute at most) until slice first+2 has been produced: then data for
    // slice `first` is late.
    let mut placed = None;
    for _ in 0..12_000 {
        match handle.submit(0, When::Slice(first), Bytes::from_static(b"late")) {
            Ok(Placed::Late(s)) => {
                placed = Some(s);
                break;
            }
            Ok(Placed::OnTime(_)) => {}
            Err(e) => panic!("{e}"),
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(placed, Some(first), "slice {first} was produced within a minute");
    let report = tokio::task::spawn_blocking(move || handle.close()).await.unwrap().unwrap();
    let b = builder.await.unwrap().unwrap();
    writer.await.unwrap().unwrap();
    assert_eq!(report.late_fragments, 1);
    let t = &b.node.tally;
    assert_eq!((t.late + t.salvaged), 1, "{t:?}");
    let mut bt = BTreeMap::new();
    bt.insert(0, t.clone());
    let ledger = Ledger::combine(&report.tallies, &bt);
    assert!(ledger.is_balanced(), "{ledger:?}");
    let ingest = report.ingest.unwrap();
    assert!(ingest.balanced() && ingest.late == 1, "{ingest:?}");
    std::fs::remove_dir_all(&out).unwrap();
}
