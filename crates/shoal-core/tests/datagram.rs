//! The datagram transport between one source and one builder over a channel that loses,
//! duplicates, reorders and delays datagrams, in virtual time (seeded, deterministic).
//!
//! Reassembly never hands out a corrupted or mixed frame, each slice at most once; with
//! loss only on first transmissions (NACKs and retransmissions get through) every frame
//! is recovered; whatever is lost is counted.

use std::collections::BTreeMap;

use bytes::Bytes;
use proptest::prelude::*;
use shoal_core::datagram::{BuilderEndpoint, Datagram, DatagramSender, EndpointEvent, UdpConfig};
use shoal_core::{Duration, Instant};

const RUN: u32 = 5;
const SOURCE: u32 = 2;
const BUILDER: u32 = 1;

/// A small deterministic generator (the test's own seed, no OS randomness).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() % 1_000_000) as f64 / 1e6 < p
    }
}

#[derive(Clone, Debug)]
struct Channel {
    loss: f64,
    dup: f64,
    /// Extra delay up to this many microseconds (reordering).
    jitter_us: u64,
    /// Lose only first transmissions of data; NACKs, retransmissions and control pass.
    spare_recovery: bool,
}

struct Outcome {
    sent: BTreeMap<u64, Bytes>,
    received: Vec<(u64, Bytes, bool)>,
    damaged: u64,
    lost_datagrams: u64,
    end_acked: bool,
    ended: bool,
}

/// Frames of random sizes, one per 1 ms slice, through the channel both ways.
fn run(sizes: &[usize], ch: &Channel, cfg: UdpConfig, seed: u64) -> Outcome {
    let mut rng = Rng(seed | 1);
    let mut tx = DatagramSender::new(cfg, RUN, SOURCE, BUILDER);
    let mut rx = BuilderEndpoint::new(cfg, RUN, BUILDER, 4);
    let mut sent = BTreeMap::new();
    // In flight: (arrival time, to builder?, bytes).
    let mut wire: Vec<(Instant, bool, Bytes)> = Vec::new();
    let base = Duration::from_micros(50);
    let mut received = Vec::new();
    let mut now = Instant::ZERO;
    let mut slice = 0u64;
    for _ in 0..200_000 {
        if (slice as usize) < sizes.len() && now >= Instant::from_nanos(slice * 1_000_000) {
            let frame: Vec<u8> =
                (0..sizes[slice as usize]).map(|i| (i as u64 ^ slice.wrapping_mul(31)) as u8).collect();
            tx.handle_frame(now, slice, &frame);
            sent.insert(slice, Bytes::from(frame));
            slice += 1;
            if slice as usize == sizes.len() {
                tx.handle_end(now);
            }
        }
        tx.handle_timeout(now);
        rx.handle_timeout(now);
        while let Some(d) = tx.poll_transmit() {
            let first_data = Datagram::decode(&d)
                .is_ok_and(|x| x.header.kind == shoal_core::datagram::Kind::Data && !x.header.retransmit);
            let lossy = !ch.spare_recovery || first_data;
            if lossy && rng.chance(ch.loss) {
                continue;
            }
            let copies = if rng.chance(ch.dup) { 2 } else { 1 };
            for _ in 0..copies {
                let jitter = Duration::from_micros(if ch.jitter_us > 0 { rng.next() % ch.jitter_us } else { 0 });
                wire.push((now + base + jitter, true, d.clone()));
            }
        }
        while let Some((source, d)) = rx.poll_transmit() {
            assert_eq!(source, SOURCE);
            if !ch.spare_recovery && rng.chance(ch.loss) {
                continue;
            }
            wire.push((now + base, false, d));
        }
        // Deliver what is due, in arrival order.
        wire.sort_by_key(|w| w.0);
        let due = wire.iter().take_while(|w| w.0 <= now).count();
        for (_, to_builder, d) in wire.drain(..due) {
            if to_builder {
                rx.handle_bytes(now, &d).expect("well-formed datagrams are accepted");
            } else {
                tx.handle_datagram(now, &Datagram::decode(&d).unwrap());
            }
        }
        while let Some(e) = rx.poll_event() {
            if let EndpointEvent::Fragment(f) = e {
                received.push((f.slice, f.frame, f.recovered));
            }
        }
        if slice as usize == sizes.len() && tx.is_finished() && wire.is_empty() && rx.poll_timeout().is_none() {
            break;
        }
        // Next event: the next slice, a timer, or an arrival.
        let next_slice = ((slice as usize) < sizes.len()).then(|| Instant::from_nanos(slice * 1_000_000));
        let next = [tx.poll_timeout(), rx.poll_timeout(), wire.iter().map(|w| w.0).min(), next_slice]
            .into_iter()
            .flatten()
            .min();
        now = match next {
            Some(t) => t.max(now + Duration::from_micros(1)),
            None => now + Duration::from_millis(1),
        };
    }
    let stream = rx.stream(SOURCE);
    Outcome {
        sent,
        received,
        damaged: stream.map_or(0, |s| s.stats().fragments_damaged),
        lost_datagrams: stream.map_or(0, |s| s.stats().lost_datagrams),
        end_acked: tx.end_acknowledged(),
        ended: rx.all_ended([SOURCE]),
    }
}

fn small_cfg() -> UdpConfig {
    UdpConfig { max_payload: 100, ..UdpConfig::default() }
}

#[test]
fn a_perfect_channel_delivers_every_frame_without_a_nack() {
    let sizes: Vec<usize> = (0..50).map(|i| 1 + i * 37).collect();
    let o = run(&sizes, &Channel { loss: 0.0, dup: 0.0, jitter_us: 0, spare_recovery: false }, small_cfg(), 1);
    assert_eq!(o.received.len(), 50);
    for (slice, frame, recovered) in &o.received {
        assert_eq!(frame, &o.sent[slice]);
        assert!(!recovered);
    }
    assert!(o.end_acked && o.ended);
    assert_eq!((o.damaged, o.lost_datagrams), (0, 0));
}

#[test]
fn the_loss_of_a_streams_last_datagrams_is_seen_from_its_end() {
    // Lose everything once: only NACKed retransmissions get through, found from the
    // sender's probes and its end's sequence number.
    let sizes = vec![250; 5];
    let o = run(&sizes, &Channel { loss: 1.0, dup: 0.0, jitter_us: 0, spare_recovery: true }, small_cfg(), 3);
    assert_eq!(o.received.len(), 5, "every frame recovered");
    assert!(o.received.iter().all(|(s, f, recovered)| *recovered && f == &o.sent[s]));
    assert!(o.end_acked && o.ended);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Whatever the channel does: every frame handed out is byte for byte the frame sent
    /// for its slice, each slice at most once, and frames delivered + damaged never exceed
    /// frames sent.
    #[test]
    fn reassembly_never_emits_a_corrupted_or_mixed_frame(
        sizes in proptest::collection::vec(1usize..2_000, 1..40),
        loss in 0.0f64..0.5,
        dup in 0.0f64..0.3,
        jitter_us in 0u64..3_000,
        seed in any::<u64>(),
    ) {
        let o = run(&sizes, &Channel { loss, dup, jitter_us, spare_recovery: false }, small_cfg(), seed);
        let mut seen = std::collections::BTreeSet::new();
        for (slice, frame, _) in &o.received {
            prop_assert!(seen.insert(*slice), "slice {} handed out twice", slice);
            prop_assert_eq!(frame, &o.sent[slice]);
        }
        prop_assert!(o.received.len() as u64 + o.damaged <= o.sent.len() as u64);
    }

    /// Loss within the budget (first transmissions only, any fraction; retransmissions and
    /// NACKs get through, reordering below the NACK delay): every frame is recovered and
    /// nothing is counted lost.
    #[test]
    fn loss_within_the_budget_is_recovered(
        sizes in proptest::collection::vec(1usize..2_000, 1..40),
        loss in 0.0f64..0.6,
        dup in 0.0f64..0.3,
        seed in any::<u64>(),
    ) {
        let o = run(&sizes, &Channel { loss, dup, jitter_us: 500, spare_recovery: true }, small_cfg(), seed);
        prop_assert_eq!(o.received.len(), sizes.len());
        for (slice, frame, _) in &o.received {
            prop_assert_eq!(frame, &o.sent[slice]);
        }
        prop_assert_eq!((o.damaged, o.lost_datagrams), (0, 0));
        prop_assert!(o.end_acked && o.ended);
    }
}

#[test]
fn an_endpoint_counts_and_ignores_what_it_cannot_use() {
    use shoal_core::datagram::{DatagramHeader, Kind};
    let cfg = small_cfg();
    let mut ep = BuilderEndpoint::new(cfg, RUN, BUILDER, 4);
    let now = Instant::ZERO;
    let data = |run, source, builder, slice, frame_len, offset, len: usize| {
        let h = DatagramHeader {
            seq: slice,
            slice,
            frame_len,
            offset,
            ..DatagramHeader::new(Kind::Data, run, source, builder)
        };
        Datagram::encode(&h, &vec![7u8; len])
    };
    assert_eq!(ep.handle_bytes(now, &Bytes::from_static(b"hello")), Err("truncated"));
    assert_eq!(ep.handle_bytes(now, &Bytes::from(vec![0u8; 60])), Err("bad_magic"));
    assert_eq!(ep.handle_bytes(now, &data(RUN + 1, 0, BUILDER, 0, 10, 0, 10)), Err("other_run"));
    assert_eq!(ep.handle_bytes(now, &data(RUN, 0, BUILDER + 1, 0, 10, 0, 10)), Err("other_builder"));
    assert_eq!(ep.handle_bytes(now, &data(RUN, 4, BUILDER, 0, 10, 0, 10)), Err("unknown_source"));
    assert_eq!(ep.handle_bytes(now, &Datagram::nack(RUN, 0, BUILDER, &[1])), Err("wrong_direction"));
    assert_eq!(ep.handle_bytes(now, &Datagram::request(RUN, 0, BUILDER, 9)), Err("wrong_direction"));
    // Forged pieces: a frame longer than the reassembly budget, a misaligned offset, a
    // short middle piece. Accepted as datagrams of source 0, refused as pieces.
    let huge = u32::try_from(cfg.reassembly_bytes + 1).unwrap();
    assert_eq!(ep.handle_bytes(now, &data(RUN, 0, BUILDER, 1, huge, 0, 100)), Ok(0));
    assert_eq!(ep.handle_bytes(now, &data(RUN, 0, BUILDER, 2, 300, 50, 100)), Ok(0));
    assert_eq!(ep.handle_bytes(now, &data(RUN, 0, BUILDER, 3, 300, 100, 60)), Ok(0));
    let s = ep.stream(0).unwrap().stats();
    assert_eq!((s.inconsistent, s.frames), (3, 0));
    let st = ep.stats();
    assert_eq!(st.refused.values().sum::<u64>(), 2);
    assert_eq!((st.other_run, st.other_builder, st.unknown_source, st.wrong_direction), (1, 1, 1, 2));
    assert!(ep.poll_event().is_none());
}

proptest! {
    /// Random bytes never panic an endpoint and never produce a frame.
    #[test]
    fn garbage_never_makes_a_frame(packets in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 1..50)) {
        let mut ep = BuilderEndpoint::new(small_cfg(), RUN, BUILDER, 4);
        for (i, p) in packets.into_iter().enumerate() {
            let _ = ep.handle_bytes(Instant::from_nanos(i as u64 * 1000), &Bytes::from(p));
            ep.handle_timeout(Instant::from_nanos(i as u64 * 1000));
        }
        prop_assert!(ep.poll_event().is_none());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// A frame handed over in parts (as a token bucket releases it) is cut exactly as the
    /// whole frame, each datagram queued as soon as its bytes are all there.
    #[test]
    fn a_frame_in_parts_is_cut_as_the_whole_frame(
        len in 0usize..20_000,
        cuts in proptest::collection::vec(0usize..20_000, 0..12),
    ) {
        let cfg = small_cfg();
        let frame: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let now = Instant::ZERO;
        let mut whole = DatagramSender::new(cfg, 1, 2, 0);
        whole.handle_frame(now, 5, &frame);
        let want: Vec<Bytes> = std::iter::from_fn(|| whole.poll_transmit()).collect();

        let mut bounds: Vec<usize> = cuts.into_iter().map(|c| c % (len + 1)).collect();
        bounds.extend([0, len]);
        bounds.sort_unstable();
        let mut parts = DatagramSender::new(cfg, 1, 2, 0);
        let mut got = Vec::new();
        for w in bounds.windows(2) {
            parts.handle_frame_part(now, 5, len as u32, &frame[w[0]..w[1]]);
            while let Some(d) = parts.poll_transmit() {
                got.push(d);
            }
            // Every full piece the parts so far hold has left.
            let piece = usize::from(cfg.max_payload);
            let expect = if w[1] == len { want.len() } else { w[1] / piece };
            prop_assert_eq!(got.len(), expect);
        }
        prop_assert_eq!(got, want);
        prop_assert_eq!(parts.stats().frames, 1);
        prop_assert_eq!(parts.stats().abandoned, 0);
    }
}

/// A part of the next frame before the current one is complete abandons it, counted; the
/// next frame is cut from its own start.
#[test]
fn a_frame_left_half_handed_over_is_abandoned_and_counted() {
    let cfg = small_cfg();
    let piece = usize::from(cfg.max_payload);
    let mut s = DatagramSender::new(cfg, 1, 2, 0);
    let first = vec![1u8; 3 * piece];
    s.handle_frame_part(Instant::ZERO, 1, first.len() as u32, &first[..piece + 10]);
    assert_eq!(std::iter::from_fn(|| s.poll_transmit()).count(), 1);
    s.handle_frame(Instant::ZERO, 2, &[9u8; 100]);
    let next: Vec<Bytes> = std::iter::from_fn(|| s.poll_transmit()).collect();
    assert_eq!(next.len(), 1);
    let d = Datagram::decode(&next[0]).unwrap();
    assert_eq!((d.header.slice, d.header.offset, d.header.frame_len), (2, 0, 100));
    assert_eq!((s.stats().frames, s.stats().abandoned), (2, 1));
}

/// NACKs repeat after 5, 10 and 20 ms: a source that answers 60 ms late (a software host
/// that waited for a CPU) still repairs the frame. With a fixed 5 ms interval the datagram
/// was declared lost 21 ms after its gap, the late answer counted a duplicate and the
/// frame damaged (a testbed run with 0.1% loss did exactly that).
#[test]
fn a_source_that_answers_late_is_still_heard() {
    let cfg = small_cfg();
    let mut tx = DatagramSender::new(cfg, RUN, SOURCE, BUILDER);
    let mut rx = BuilderEndpoint::new(cfg, RUN, BUILDER, 4);
    let frame = vec![3u8; 250];
    tx.handle_frame(Instant::ZERO, 0, &frame);
    let pieces: Vec<Bytes> = std::iter::from_fn(|| tx.poll_transmit()).collect();
    assert_eq!(pieces.len(), 3);
    // The middle piece is lost.
    for d in [&pieces[0], &pieces[2]] {
        rx.handle_bytes(Instant::ZERO, d).unwrap();
    }
    let mut nacks = Vec::new();
    while let Some(now) = rx.poll_timeout().filter(|t| *t < Instant::from_nanos(60_000_000)) {
        rx.handle_timeout(now);
        while let Some((_, d)) = rx.poll_transmit() {
            nacks.push((now.as_nanos() / 1_000_000, d));
        }
    }
    let at: Vec<u64> = nacks.iter().map(|(t, _)| *t).collect();
    assert_eq!(at, vec![1, 6, 16, 36], "NACKs at the gap + 1 ms, then 5, 10, 20 ms apart");
    // The source wakes at 60 ms and answers every NACK; the first answer repairs the frame.
    let late = Instant::from_nanos(60_000_000);
    for (_, nack) in &nacks {
        tx.handle_datagram(late, &Datagram::decode(nack).unwrap());
    }
    while let Some(d) = tx.poll_transmit() {
        rx.handle_bytes(late, &d).unwrap();
    }
    let mut frames = Vec::new();
    while let Some(e) = rx.poll_event() {
        if let EndpointEvent::Fragment(f) = e {
            frames.push(f);
        }
    }
    assert_eq!(frames.len(), 1, "the frame was completed");
    assert!(frames[0].recovered && frames[0].frame[..] == frame[..]);
    let s = rx.stream(SOURCE).unwrap().stats();
    assert_eq!((s.lost_datagrams, s.fragments_damaged), (0, 0));
}

/// Linux holds a path's first packets while it resolves the neighbour (ARP). When that
/// exchange is lost it asks again only after a second, and drops the oldest packets it
/// holds beyond its queue. The builder then sees the stream's first gap a second late. The
/// sender keeps its stream's first datagrams for `start_retransmit_age`, so it answers
/// those NACKs and every frame is recovered. With only `retransmit_age` (500 ms) the
/// oldest were gone, and a testbed run lost 6 fragments that way (docs/testbed.md).
#[test]
fn a_path_that_held_the_streams_first_second_recovers_every_frame() {
    let cfg = UdpConfig::default();
    let mut tx = DatagramSender::new(cfg, RUN, SOURCE, BUILDER);
    let mut rx = BuilderEndpoint::new(cfg, RUN, BUILDER, 4);
    // The path opens 1.05 s after the first datagram; until then the kernel holds the
    // newest 100 (about unres_qlen_bytes over a datagram's size in memory).
    let resolved = Instant::from_nanos(1_050_000_000);
    let mut held: std::collections::VecDeque<Bytes> = std::collections::VecDeque::new();
    let mut dropped = 0;
    let (mut sent, mut got) = (BTreeMap::new(), BTreeMap::new());
    for ms in 0..3_000u64 {
        let now = Instant::from_nanos(ms * 1_000_000);
        // A 4,000-byte frame (3 datagrams) every 10 ms for 2 s, then the end.
        if ms % 10 == 0 && ms < 2_000 {
            let frame: Vec<u8> = (0..4_000u64).map(|i| (i ^ ms) as u8).collect();
            tx.handle_frame(now, ms / 10, &frame);
            sent.insert(ms / 10, Bytes::from(frame));
        }
        if ms == 2_000 {
            tx.handle_end(now);
        }
        tx.handle_timeout(now);
        while let Some(d) = tx.poll_transmit() {
            if now < resolved {
                held.push_back(d);
                if held.len() > 100 {
                    held.pop_front();
                    dropped += 1;
                }
            } else {
                rx.handle_bytes(now, &d).unwrap();
            }
        }
        if now >= resolved {
            for d in held.drain(..) {
                rx.handle_bytes(now, &d).unwrap();
            }
        }
        rx.handle_timeout(now);
        while let Some((_, d)) = rx.poll_transmit() {
            tx.handle_datagram(now, &Datagram::decode(&d).unwrap());
        }
        while let Some(e) = rx.poll_event() {
            if let EndpointEvent::Fragment(f) = e {
                got.insert(f.slice, f.frame);
            }
        }
    }
    assert!(dropped > 200, "the path dropped the stream's oldest datagrams: {dropped}");
    assert_eq!(tx.stats().unanswerable, 0, "{:?}", tx.stats());
    let s = rx.stream(SOURCE).unwrap().stats();
    assert_eq!((s.lost_datagrams, s.fragments_damaged), (0, 0), "{s:?}");
    assert_eq!(got.len(), sent.len());
    assert!(got == sent, "every frame recovered, byte for byte");
}

/// A pull stream greets its builder before any data, and a request round-trips the wire.
#[test]
fn a_greeting_announces_the_stream_and_a_request_names_its_slice() {
    let mut s = DatagramSender::new(small_cfg(), RUN, 2, BUILDER);
    s.handle_greet(Instant::ZERO);
    let sync = Datagram::decode(&s.poll_transmit().unwrap()).unwrap();
    assert_eq!((sync.header.kind, sync.header.seq, sync.header.source), (shoal_core::datagram::Kind::Sync, 0, 2));
    let mut ep = BuilderEndpoint::new(small_cfg(), RUN, BUILDER, 4);
    assert_eq!(ep.handle_bytes(Instant::ZERO, &Datagram::encode(&sync.header, &[])), Ok(2));
    let r = Datagram::decode(&Datagram::request(RUN, 2, BUILDER, 77)).unwrap();
    assert_eq!((r.header.kind, r.header.slice, r.payload.len()), (shoal_core::datagram::Kind::Request, 77, 0));
    // A stream's sender refuses a request (its driver reads them first).
    s.handle_datagram(Instant::ZERO, &r);
    assert_eq!(s.stats().refused, 1);
}
