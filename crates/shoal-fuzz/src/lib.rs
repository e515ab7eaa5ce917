//! shoal-fuzz: the fuzz targets' bodies, on stable Rust.
//!
//! Every decoder of untrusted input has one function here taking arbitrary bytes; it must
//! never panic, whatever they are. `fuzz/` (cargo-fuzz, nightly) drives each with
//! libFuzzer (`scripts/fuzz.sh` runs the campaign), and this crate's test replays the
//! committed corpus and every crash ever found (`fuzz/corpus/<target>/`,
//! `fuzz/regressions/<target>/`) on stable in `make test`. [`TARGETS`] lists them by name.

use bytes::Bytes;
use shoal_core::controlhost::{MessageDecoder, parse_subscription};
use shoal_core::datagram::{BuilderEndpoint, DATAGRAM_HEADER_LEN, Datagram, UdpConfig};
use shoal_core::{Duration, Instant};

/// Largest payload the fuzzed decoders accept (small, so that length fields hit it).
const MAX_PAYLOAD: u32 = 1 << 16;

/// A byte stream of data frames, as a builder's connection reads it: frames decoded one
/// after another until the bytes run out or one is refused; each frame's payload parsed as
/// hits, or as a pull control message.
pub fn frame_stream(data: &[u8]) {
    let mut rest = data;
    while let Ok((frame, used)) = shoal_core::frame::decode(rest, MAX_PAYLOAD) {
        let _ = shoal_core::hit::HitPayload::parse(&frame.payload, frame.header.hit_count);
        let _ = shoal_core::pullmsg::PullMessage::from_frame(&frame);
        if used == 0 {
            break;
        }
        rest = &rest[used..];
    }
    let _ = shoal_core::frame::decode_header(data, MAX_PAYLOAD);
}

/// Datagrams at a `shoal probe-switch` receiver, cut at lengths taken from the bytes: each
/// decoded, the calibration, data and END ones collected with arrival times taken from the
/// bytes too, then the flood analysed and classified as the receiver does.
pub fn probe(data: &[u8]) {
    use shoal_core::probe::{Arrival, ProbeMessage, analyse_flood, base_delays, classify};
    let (mut calibration, mut flood, mut ends) = (Vec::new(), Vec::new(), std::collections::BTreeMap::new());
    let mut rest = data;
    let mut arrival_ns = 0u64;
    while let Some((&n, tail)) = rest.split_first() {
        let take = usize::from(n).min(tail.len());
        arrival_ns = arrival_ns.wrapping_add(u64::from(n) << 20);
        match ProbeMessage::decode(&tail[..take]) {
            Ok(ProbeMessage::Calib(s)) => calibration.push(Arrival::of(s, arrival_ns, take)),
            Ok(ProbeMessage::Data(s)) => flood.push(Arrival::of(s, arrival_ns, take)),
            Ok(ProbeMessage::End(e)) => {
                ends.insert(e.sender, e);
            }
            _ => {}
        }
        rest = &tail[take..];
    }
    if let Ok(e) = analyse_flood(&flood, &base_delays(&calibration), &ends) {
        let _ = classify(e, e);
    }
}

/// A writer's `EVENTS` payload.
pub fn events(data: &[u8]) {
    let _ = shoal_core::event::decode_events(data);
}

/// Datagrams at a builder's endpoint: the bytes cut into datagrams at lengths taken from
/// the bytes themselves, time advancing between them so that NACK and reassembly timers
/// fire. When the length byte is odd the datagram's CRC is made right, so the fuzzer gets
/// past the checksum into reassembly (random bytes almost never carry a valid CRC32C).
pub fn datagrams(data: &[u8]) {
    let cfg = UdpConfig { max_payload: 64, reassembly_bytes: 1 << 16, max_missing: 256, ..UdpConfig::default() };
    let mut ep = BuilderEndpoint::new(cfg, 1, 0, 4);
    let mut now = Instant::ZERO;
    let mut rest = data;
    while let Some((&n, tail)) = rest.split_first() {
        let take = usize::from(n).min(tail.len());
        let mut d = tail[..take].to_vec();
        if n & 1 == 1 && d.len() >= DATAGRAM_HEADER_LEN {
            let crc = shoal_core::datagram::crc_of(&d);
            d[48..52].copy_from_slice(&crc.to_le_bytes());
        }
        let d = Bytes::from(d);
        let _ = Datagram::decode(&d);
        let _ = ep.handle_bytes(now, &d);
        now += Duration::from_micros(u64::from(n) * 100);
        ep.handle_timeout(now);
        while ep.poll_transmit().is_some() {}
        while ep.poll_event().is_some() {}
        rest = &tail[take..];
    }
}

/// A ControlHost client's byte stream (the dispatcher's decoder), and subscription
/// requests.
pub fn controlhost(data: &[u8]) {
    let mut d = MessageDecoder::new(MAX_PAYLOAD);
    for chunk in data.chunks(7) {
        d.extend(chunk);
        while let Ok(Some(m)) = d.next_message() {
            let _ = parse_subscription(&m.payload);
        }
    }
    let _ = d.finish();
    let _ = parse_subscription(data);
}

/// Run-control text: commands, replies and states as the dispatcher and the HTTP API
/// receive them.
pub fn run_control(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let _ = shoal_core::runstate::Command::parse(&text);
    let _ = shoal_core::runstate::Reply::parse(&text);
    let _ = shoal_core::runstate::RunState::parse(&text);
}

/// Configuration files: a node's configuration, a cluster file, a simulator scenario.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let _ = shoal_net::config::Config::from_toml_str(text);
    if let Ok(file) = toml::from_str::<shoal_control::cluster::ClusterFile>(text) {
        let _ = file.validate();
    }
    let _ = shoal_sim::scenario::Scenario::from_toml(text);
}

/// What the burst saver's path reads: `ALERT` messages (from any dispatcher client or the
/// HTTP API), and the writer's `RAW` records with the builders' JSON alert reports.
pub fn alerts(data: &[u8]) {
    let _ = shoal_core::alert::Alert::parse(data);
    let mut rest = data;
    while let Ok((frame, used)) = shoal_core::frame::decode(rest, MAX_PAYLOAD) {
        if let Ok(r) = shoal_core::rawrec::RawRecord::from_frame(&frame) {
            let _ = shoal_core::alert::Alert::parse(&r.body);
            let _ = serde_json::from_slice::<shoal_core::saver::AlertReport>(&r.body);
        }
        if used == 0 {
            break;
        }
        rest = &rest[used..];
    }
}

/// Bytes at a source's input (`source.input = "unix:"`): the stream decoder fed in chunks
/// whose size comes from the first byte, every frame submitted to an ingest; then every
/// slice taken, late fragments polled and the run finished, after which the ingest's own
/// books must balance (accepted = in fragments + held + discarded). The same bytes as one
/// `udp:` datagram too.
pub fn input(data: &[u8]) {
    use shoal_core::ingest::wire::{InputStreamDecoder, decode_datagram};
    use shoal_core::ingest::{Ingest, IngestConfig, Submission};
    let sources = [0, 1, 3];
    let mut ingest = Ingest::new(IngestConfig {
        sources: sources.to_vec(),
        slice_clock: shoal_core::slice::SliceClock::new(Duration::from_millis(10)),
        first_slice: 100,
        end_slice: Some(160),
        time_origin_ns: 0,
        max_fragment_bytes: 4096,
        max_held_bytes: 16_384,
        max_ahead_slices: 40,
    });
    let mut decoder = InputStreamDecoder::new(MAX_PAYLOAD);
    let step = data.first().map_or(1, |b| usize::from(b % 61) + 1);
    let mut produced = 100;
    'stream: for chunk in data.chunks(step) {
        decoder.push(chunk);
        loop {
            match decoder.next_frame() {
                Ok(Some((h, payload))) => {
                    let sub = Submission { source: h.source, when: h.when, hit_count: h.hit_count, payload };
                    let _ = ingest.handle_submit(sub);
                }
                Ok(None) => break,
                Err(_) => break 'stream,
            }
        }
        // The node moves on as data come, so some later frames are late.
        if produced < 160 && chunk.first().is_some_and(|b| b & 0x80 != 0) {
            for s in sources {
                let _ = ingest.take(s, produced);
            }
            produced += 1;
        }
    }
    let _ = decoder.partial();
    ingest.handle_close();
    let end = ingest.end_after_data().min(160);
    for slice in produced..end {
        for s in sources {
            let _ = ingest.take(s, slice);
        }
    }
    while ingest.poll_late().is_some() {}
    ingest.handle_finish();
    let report = ingest.report();
    assert!(report.balanced(), "{report:?}");
    let _ = decode_datagram(&Bytes::copy_from_slice(data), MAX_PAYLOAD);
}

/// KM3NeT CLB packets: the bytes read as a dump (length-prefixed packets), each record
/// given to a DataQueue, timeslices closed at times taken from the bytes; and the bytes as
/// one packet. Every frame closed must account for its packets.
pub fn clb(data: &[u8]) {
    use shoal_core::km3net::clb::{decode_packet, dump_records};
    use shoal_core::km3net::dataqueue::{DataQueue, DataQueueConfig};
    let mut q = DataQueue::new(DataQueueConfig { slice_ns: 100_000_000, doms: None, max_packets_per_frame: 64 });
    let mut taken = 0u64;
    for rec in dump_records(data) {
        let Ok(rec) = rec else { break };
        taken += u64::from(q.handle_packet(rec));
        if let Ok(p) = decode_packet(rec)
            && p.header.udp_sequence & 0xff == 0xff
        {
            let _ = q.close_below(p.header.timeslice_start_ns());
        }
    }
    let frames = q.close_below(u64::MAX);
    let r = q.report();
    assert_eq!(taken, r.optical_packets);
    assert!(u64::from(frames.iter().map(|f| f.packets).sum::<u32>()) <= taken);
    let _ = decode_packet(data).map(|p| p.hits().count());
}

/// KM3NeT's JDAQ objects (what a builder decodes from fragments and what files hold): the
/// bytes read as a superframe, an event, a summaryslice and a timeslice. Whatever decodes
/// must encode back to the very bytes it came from.
pub fn jdaq(data: &[u8]) {
    use shoal_core::km3net::datafilter::{DataFilterParams, filtered_frame, summary_frame};
    use shoal_core::km3net::jdaq::*;
    if let Ok((h, f)) = decode_superframe(data) {
        assert_eq!(encode_superframe(&h, &f), data);
        let p = DataFilterParams::default();
        assert!(filtered_frame(&f, &p, false).hits.len() <= f.hits.len());
        assert!(filtered_frame(&f, &p, true).hits.len() <= f.hits.len());
        let _ = summary_frame(&f, 100_000_000);
    }
    if let Ok((e, n)) = decode_event(data) {
        assert_eq!(encode_event(&e), &data[..n]);
    }
    if let Ok((s, n)) = decode_summaryslice(data) {
        assert_eq!(encode_summaryslice(&s), &data[..n]);
    }
    if let Ok((t, n)) = decode_timeslice(data) {
        assert_eq!(encode_timeslice(&t), &data[..n]);
    }
    let _ = peek_preamble(data);
}

/// A target's body: arbitrary bytes in, never a panic.
pub type Target = fn(&[u8]);

/// Every target, by the name of its directory under `fuzz/corpus` and `fuzz/regressions`.
pub const TARGETS: [(&str, Target); 11] = [
    ("frame_stream", frame_stream),
    ("events", events),
    ("datagrams", datagrams),
    ("controlhost", controlhost),
    ("run_control", run_control),
    ("config", config),
    ("alerts", alerts),
    ("probe", probe),
    ("input", input),
    ("clb", clb),
    ("jdaq", jdaq),
];
