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

/// Largest payload [`frame_reads`] accepts: above the 16-kB size from which a frame gets a
/// read buffer of its own, so that the fuzzer's frames take both of the decoder's paths.
pub const READS_MAX_PAYLOAD: u32 = 1 << 18;

/// A builder connection's bytes read as the builder reads them (`shoal_net`'s
/// `FrameReader`): room made before each read (`StreamDecoder::prepare_read`), reads of
/// the sizes the input chooses into that room as tokio's `read_buf` makes them, the buffer
/// given back while the connection waits (`release_idle`). The frames are built from the
/// input with valid checksums (small and large, some with a bit flipped, the stream perhaps
/// cut short), so that the fuzzer reaches every path of the decoder's buffers; whatever
/// they are, the decoder must return what decoding the whole stream at once returns
/// ([`check_builder_reads`]).
pub fn frame_reads(data: &[u8]) {
    let (stream, reads) = stream_and_reads(data);
    if let Err(e) = check_builder_reads(&stream, &reads, READS_MAX_PAYLOAD) {
        panic!("{e}");
    }
}

/// The stream and the read sizes that the input describes: up to 8 frames of 3 bytes each
/// (size, fill, and a bit to flip when the third is 240 or more: which one from the next
/// two bytes), a byte that cuts the stream short when it is 128 or more, then one read size
/// per byte (1 + b * b bytes). Payloads run from empty to 262,525 bytes: the largest size
/// is over [`READS_MAX_PAYLOAD`], so a refused length is in the mix too.
pub fn stream_and_reads(data: &[u8]) -> (Vec<u8>, Vec<usize>) {
    use shoal_core::frame::{FrameHeader, encode};
    let mut bytes = data.iter().copied();
    let mut stream = Vec::new();
    for slice in 0..8u64 {
        let (Some(size), Some(fill), Some(flip)) = (bytes.next(), bytes.next(), bytes.next()) else { break };
        let len = match size {
            0..192 => usize::from(size) * 13,
            _ => (16 << 10) + usize::from(size - 192) * 3_907,
        };
        let payload: Vec<u8> = (0..len).map(|i| fill.wrapping_add((i % 251) as u8)).collect();
        let header = FrameHeader {
            flags: shoal_core::frame::Flags::OPAQUE,
            source: u32::from(fill),
            hit_count: 0,
            slice,
            slice_start: Instant::from_nanos(slice * 10_000_000),
            send_time: Instant::ZERO,
            payload_len: len as u32,
        };
        let mut frame = encode(&header, &payload).to_vec();
        if flip >= 240 {
            let at = usize::from(bytes.next().unwrap_or(0)) << 8 | usize::from(bytes.next().unwrap_or(0));
            let at = at % frame.len();
            frame[at] ^= 1 << (flip & 7);
        }
        stream.extend_from_slice(&frame);
    }
    if let Some(cut) = bytes.next().filter(|&c| c >= 128) {
        stream.truncate(stream.len().saturating_sub(usize::from(cut - 128) * 17));
    }
    let reads = bytes.map(|b| 1 + usize::from(b) * usize::from(b)).collect();
    (stream, reads)
}

/// How a stream of frames ended.
#[derive(Debug, PartialEq)]
pub enum StreamEnd {
    /// At a frame boundary.
    Clean,
    /// Inside a frame, this many bytes after the last whole one.
    Truncated(usize),
    /// Refused.
    Refused(shoal_core::frame::FrameError),
}

/// Reads `stream` through a `StreamDecoder` as a builder's connection does, `reads` giving
/// the size of each read (cycled; 4,096 if empty; 64 kB after 10,000 reads), and compares
/// the frames and the end with decoding the whole stream at once (`frame::decode`, frame
/// after frame). `Err` says how
/// they differ.
pub fn check_builder_reads(stream: &[u8], reads: &[usize], max_payload: u32) -> Result<(), String> {
    use shoal_core::frame::{FrameError, StreamDecoder, decode};
    let mut whole = Vec::new();
    let mut rest = stream;
    let whole_end = loop {
        if rest.is_empty() {
            break StreamEnd::Clean;
        }
        match decode(rest, max_payload) {
            Ok((frame, used)) => {
                whole.push(frame);
                rest = &rest[used..];
            }
            Err(FrameError::TooShort { .. }) => break StreamEnd::Truncated(rest.len()),
            Err(e) => break StreamEnd::Refused(e),
        }
    };

    let mut d = StreamDecoder::new(max_payload);
    let mut read = Vec::new();
    let (mut at, mut next_read) = (0, 0);
    let read_end = 'conn: loop {
        loop {
            match d.next_frame() {
                Ok(Some(frame)) => read.push(frame),
                Ok(None) => break,
                Err(e) => break 'conn StreamEnd::Refused(e),
            }
        }
        if at == stream.len() {
            break match d.finish() {
                Ok(()) => StreamEnd::Clean,
                Err(FrameError::Truncated(n)) => StreamEnd::Truncated(n),
                Err(e) => StreamEnd::Refused(e),
            };
        }
        d.release_idle();
        d.prepare_read();
        // tokio's `read_buf` reads into the room there is, making 64 bytes where there is none.
        let buf = d.buffer_mut();
        if buf.capacity() == buf.len() {
            buf.reserve(64);
        }
        // After MANY_READS reads, 64 kB at a time: a 2-MB stream read a byte at a time
        // would take a fuzzer's run from microseconds to tens of milliseconds.
        const MANY_READS: usize = 10_000;
        let want = match reads.get(next_read % reads.len().max(1)) {
            _ if next_read >= MANY_READS => 1 << 16,
            Some(&n) => n.max(1),
            None => 4096,
        };
        next_read += 1;
        let n = want.min(buf.capacity() - buf.len()).min(stream.len() - at);
        let capacity = buf.capacity();
        buf.extend_from_slice(&stream[at..at + n]);
        if buf.capacity() != capacity {
            return Err(format!("a read of {n} bytes grew the buffer from {capacity} to {}", buf.capacity()));
        }
        at += n;
    };
    if read.len() != whole.len() {
        return Err(format!(
            "{} frames read, {} decoded whole; ends {read_end:?} and {whole_end:?}",
            read.len(),
            whole.len()
        ));
    }
    for (i, (r, w)) in read.iter().zip(&whole).enumerate() {
        if r != w {
            return Err(format!("frame {i} differs: read {:?}, whole {:?}", r.header, w.header));
        }
    }
    if read_end != whole_end {
        return Err(format!("the stream read ended {read_end:?}, decoded whole {whole_end:?}"));
    }
    Ok(())
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

/// What the security checks read from strangers: an `Authorization` header against a set
/// of tokens for every role, a token file, a network (`--control-from`,
/// `cluster.command_from`), and a command tag from an address the bytes name.
pub fn security(data: &[u8]) {
    use shoal_control::security::{Role, TokenEntry, TokenFile, Tokens};
    use shoal_core::controlhost::{CommandAccess, IpNet, Tag};
    let text = String::from_utf8_lossy(data);
    let known = TokenEntry { name: "a".into(), role: Role::Operator, sha256: "0".repeat(64), created: 0, expires: 0 };
    let mut tokens = Tokens::new(TokenFile { tokens: vec![known] });
    if let Ok(file) = TokenFile::parse(&text) {
        tokens = Tokens::new(file);
    }
    for role in [Role::Viewer, Role::Operator, Role::Admin] {
        let _ = tokens.authorize(Some(&text), role);
        let _ = tokens.authorize(text.lines().next(), role);
    }
    if let Ok(net) = text.trim().parse::<IpNet>() {
        let _ = net.to_string();
        for ip in ["127.0.0.1", "::1", "192.0.2.1", "::ffff:192.0.2.1"] {
            let _ = net.contains(ip.parse().expect("an address"));
        }
    }
    if let (Some(tag), Some(rest)) = (data.get(..8).and_then(Tag::new), data.get(8..)) {
        let ip = match <[u8; 16]>::try_from(rest.get(..16).unwrap_or(&[])) {
            Ok(v6) => std::net::IpAddr::from(v6),
            Err(_) => match <[u8; 4]>::try_from(rest.get(..4).unwrap_or(&[])) {
                Ok(v4) => std::net::IpAddr::from(v4),
                Err(_) => std::net::IpAddr::from([127, 0, 0, 1]),
            },
        };
        let _ = CommandAccess::default().allows(&tag, ip);
    }
}

/// What the cluster identity reads from files and peers: a Prometheus web configuration
/// (`WebConfig::parse`, its basic-auth check with the same bytes as a header), PEM text as
/// a CA, certificate and key (`Identity::from_pem`), and the bytes as a peer's DER
/// certificate (`PeerName::of`).
pub fn tls_inputs(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(web) = shoal_tls::web::WebConfig::parse(&text, std::path::Path::new("/nonexistent")) {
        let _ = web.authorize(text.lines().next());
    }
    let third = data.len() / 3;
    let (a, rest) = data.split_at(third);
    let (b, c) = rest.split_at(third);
    let _ = shoal_tls::Identity::from_pem(a, b, c);
    let _ = shoal_tls::Identity::from_pem(data, data, data);
    let _ = shoal_tls::peer::PeerName::of_der(data);
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
pub const TARGETS: [(&str, Target); 14] = [
    ("frame_stream", frame_stream),
    ("frame_reads", frame_reads),
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
    ("security", security),
    ("tls_inputs", tls_inputs),
];
