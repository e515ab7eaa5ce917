//! A deterministic in-memory harness (like quinn-proto's test `Pair`): N source nodes and M
//! builder nodes joined by in-memory connections with virtual time, and property tests over
//! random schedules for the node-level invariants.
//!
//! Each (source node, builder) pair has a connection that serialises the node's pieces at a
//! byte rate (0: a stuck builder that never reads), then delivers them after a latency,
//! optionally losing whole frames (silently, as a failing network would: the source saw
//! them sent). The receiving end reassembles the byte stream frame by frame and decodes it
//! with the checked wire-format decoder, so interleaved or corrupted frames fail the test.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use shoal_core::assembly::AssemblerConfig;
use shoal_core::frame::{self, Flags, HEADER_LEN};
use shoal_core::ledger::Ledger;
use shoal_core::node::{
    BuilderNode, BuilderNodeConfig, GeneratedFragment, SourceNode, SourceNodeConfig, SourceTransmit, TransmitKind,
    Workload,
};
use shoal_core::shaping::Policy;
use shoal_core::slice::{SliceClock, SliceNumber, builder_for};
use shoal_core::{BuilderId, Duration, Instant, SourceId};

const SLICE: Duration = Duration::from_millis(10);

/// Fixed-size fragments whose bytes say whose they are, so a mixed-up frame is detected.
struct Tagged(usize);

impl Tagged {
    fn byte(source: SourceId, slice: SliceNumber) -> u8 {
        (u64::from(source) * 31 + slice * 7) as u8
    }
}

impl Workload for Tagged {
    fn generate(&self, source: SourceId, slice: SliceNumber) -> GeneratedFragment {
        GeneratedFragment {
            hit_count: 0,
            waveform_count: 0,
            payload: Bytes::from(vec![Tagged::byte(source, slice); self.0]),
            burst: false,
        }
    }
}

#[derive(Clone, Debug)]
struct Setup {
    /// Source ids hosted by each source node.
    nodes: Vec<Vec<SourceId>>,
    n_builders: u32,
    policy: Policy,
    slices: u64,
    payload_bytes: usize,
    /// Connection rate towards each builder, bytes per second (0: the builder never reads).
    rate: Vec<u64>,
    latency: Duration,
    /// Probability that a frame is lost in transport.
    loss: f64,
    seed: u64,
    /// Slices produced while paused.
    paused: BTreeSet<SliceNumber>,
    queue_limit: u64,
    stall_limit_slices: u32,
    drain_timeout: Duration,
    max_active: usize,
}

impl Setup {
    fn n_sources(&self) -> u32 {
        self.nodes.iter().map(|n| n.len() as u32).sum()
    }
    fn clock(&self) -> SliceClock {
        SliceClock::new(SLICE)
    }
}

/// A piece on a connection, and the frame it belongs to.
struct Piece {
    tx: SourceTransmit,
    lost: bool,
}

#[derive(Default)]
struct Conn {
    queue: VecDeque<Piece>,
    /// When the head of the queue has been serialised (None: idle).
    busy_until: Option<Instant>,
    /// Receiving end: the bytes of the frame being reassembled.
    rx: BytesMut,
    /// Whether the frame in the queue's head is lost (decided at its first piece).
    losing: bool,
}

enum Ev {
    Served { node: usize, builder: usize },
    Arrive { node: usize, builder: usize, bytes: Bytes, lost: bool },
}

/// What one transmitted piece was.
#[derive(Clone, Copy, Debug)]
struct Sent {
    at: Instant,
    dest: BuilderId,
    slice: SliceNumber,
    first: bool,
    kind: TransmitKind,
}

#[derive(Debug, Default)]
struct Outcome {
    ledger: Option<Ledger>,
    /// Per builder, the slices emitted and whether complete.
    emitted: Vec<Vec<(SliceNumber, bool)>>,
    /// Per source, every piece handed out.
    sent: BTreeMap<SourceId, Vec<Sent>>,
    /// Per source node, when it closed.
    closed_at: Vec<Option<Instant>>,
    /// Frames that reached a builder: (builder, source, slice, payload length).
    received: Vec<(usize, SourceId, SliceNumber, u32)>,
    /// A node's bytes in transport towards a builder exceeded the queue limit.
    queue_limit_exceeded: bool,
    /// A reassembled frame did not decode or carried another frame's bytes.
    bad_frames: Vec<String>,
}

struct Pair {
    setup: Setup,
    sources: Vec<SourceNode>,
    builders: Vec<BuilderNode<()>>,
    conns: Vec<Vec<Conn>>,
    events: BTreeMap<(Instant, u64), Ev>,
    seq: u64,
    rng: u64,
    out: Outcome,
}

impl Pair {
    fn new(setup: Setup) -> Self {
        let clock = setup.clock();
        let sources = setup
            .nodes
            .iter()
            .map(|ids| {
                let mut c = SourceNodeConfig::new(ids.clone(), setup.n_builders, setup.policy, clock);
                c.first_slice = Some(0);
                c.slices = Some(setup.slices);
                c.queue_limit_bytes = setup.queue_limit;
                c.stall_limit_slices = setup.stall_limit_slices;
                c.drain_timeout = setup.drain_timeout;
                SourceNode::new(c, Instant::ZERO)
            })
            .collect();
        let assembler = AssemblerConfig { max_active: setup.max_active, ..AssemblerConfig::new(setup.n_sources()) };
        let builders = (0..setup.n_builders)
            .map(|id| BuilderNode::new(BuilderNodeConfig { id, assembler, slice_clock: clock }))
            .collect();
        let conns = setup.nodes.iter().map(|_| (0..setup.n_builders).map(|_| Conn::default()).collect()).collect();
        let out = Outcome {
            emitted: vec![Vec::new(); setup.n_builders as usize],
            closed_at: vec![None; setup.nodes.len()],
            ..Default::default()
        };
        let rng = setup.seed | 1;
        Pair { setup, sources, builders, conns, events: BTreeMap::new(), seq: 0, rng, out }
    }

    fn schedule(&mut self, at: Instant, ev: Ev) {
        self.seq += 1;
        self.events.insert((at, self.seq), ev);
    }

    fn chance(&mut self, p: f64) -> bool {
        // xorshift64: the harness's own seeded randomness.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let u = (self.rng >> 11) as f64 / (1u64 << 53) as f64;
        u < p
    }

    /// Runs until every node is done and nothing is in flight (bounded).
    fn run(mut self) -> Outcome {
        let workload = Tagged(self.setup.payload_bytes);
        let mut now = Instant::ZERO;
        for _ in 0..5_000_000 {
            self.step(now, &workload);
            let next = [
                self.events.keys().next().map(|k| k.0),
                self.sources.iter().filter_map(|s| s.poll_timeout()).min(),
                self.builders.iter().filter_map(|b| b.poll_timeout()).min(),
            ]
            .into_iter()
            .flatten()
            .min();
            match next {
                Some(t) => now = t.max(now),
                None => break,
            }
        }
        let tallies = self.sources.iter().flat_map(|s| s.report().tallies).collect();
        let btallies = self.builders.iter().map(|b| (b.config().id, b.report().tally)).collect();
        self.out.ledger = Some(Ledger::combine(&tallies, &btallies));
        self.out
    }

    fn step(&mut self, now: Instant, workload: &Tagged) {
        while let Some(entry) = self.events.first_entry() {
            if entry.key().0 > now {
                break;
            }
            match entry.remove() {
                Ev::Served { node, builder } => self.served(now, node, builder),
                Ev::Arrive { node, builder, bytes, lost } => self.arrive(now, node, builder, bytes, lost),
            }
        }
        for n in 0..self.sources.len() {
            let src = &mut self.sources[n];
            if src.poll_timeout().is_some_and(|t| t <= now) {
                src.handle_pause(self.setup.paused.contains(&src.next_slice()));
                src.handle_timeout(now, workload);
            }
            while let Some(tx) = self.sources[n].poll_transmit(now) {
                let dest = tx.dest as usize;
                if self.sources[n].in_transport(tx.dest) > self.setup.queue_limit {
                    self.out.queue_limit_exceeded = true;
                }
                let sent = Sent { at: now, dest: tx.dest, slice: tx.slice, first: tx.first(), kind: tx.kind };
                self.out.sent.entry(tx.source).or_default().push(sent);
                self.conns[n][dest].queue.push_back(Piece { tx, lost: false });
                self.start(now, n, dest);
            }
            if self.sources[n].is_closed() && self.out.closed_at[n].is_none() {
                self.out.closed_at[n] = Some(now);
            }
        }
        for b in 0..self.builders.len() {
            if self.builders[b].poll_timeout().is_some_and(|t| t <= now) {
                self.builders[b].handle_timeout(now);
            }
            while let Some(o) = self.builders[b].poll_slice() {
                self.out.emitted[b].push((o.slice, o.is_complete()));
                self.builders[b].handle_released(o.bytes);
            }
        }
    }

    /// Starts serialising the head piece of an idle connection.
    fn start(&mut self, now: Instant, node: usize, builder: usize) {
        let rate = self.setup.rate[builder];
        let Some(head) = self.conns[node][builder].queue.front() else { return };
        if self.conns[node][builder].busy_until.is_some() || rate == 0 {
            return;
        }
        let len = head.tx.len();
        let first = head.tx.first();
        if first {
            let lose = self.setup.loss > 0.0 && head.tx.kind == TransmitKind::Data && self.chance(self.setup.loss);
            self.conns[node][builder].losing = lose;
        }
        let conn = &mut self.conns[node][builder];
        conn.queue.front_mut().expect("head").lost = conn.losing;
        let done = now + Duration::from_nanos(len * 1_000_000_000 / rate);
        conn.busy_until = Some(done);
        self.schedule(done, Ev::Served { node, builder });
    }

    fn served(&mut self, now: Instant, node: usize, builder: usize) {
        let conn = &mut self.conns[node][builder];
        conn.busy_until = None;
        let piece = conn.queue.pop_front().expect("a piece was being served");
        if piece.tx.last && piece.tx.kind == TransmitKind::Data {
            self.sources[node].handle_sent(now, piece.tx.source, piece.tx.slice);
        }
        let mut bytes = BytesMut::from(&piece.tx.head[..]);
        bytes.extend_from_slice(&piece.tx.body);
        let ev = Ev::Arrive { node, builder, bytes: bytes.freeze(), lost: piece.lost };
        self.schedule(now + self.setup.latency, ev);
        self.start(now, node, builder);
    }

    fn arrive(&mut self, now: Instant, node: usize, builder: usize, bytes: Bytes, lost: bool) {
        if lost {
            return;
        }
        let conn = &mut self.conns[node][builder];
        conn.rx.extend_from_slice(&bytes);
        loop {
            if conn.rx.len() < HEADER_LEN {
                return;
            }
            let need = match frame::decode_header(&conn.rx, 1 << 24) {
                Ok(h) => HEADER_LEN + h.payload_len as usize,
                Err(e) => {
                    self.out.bad_frames.push(format!("header: {e}"));
                    conn.rx.clear();
                    return;
                }
            };
            if conn.rx.len() < need {
                return;
            }
            let buf = conn.rx.split_to(need).freeze();
            match frame::decode(&buf, 1 << 24) {
                Ok((f, _)) => {
                    let h = f.header;
                    let tag = Tagged::byte(h.source, h.slice);
                    if !h.flags.contains(Flags::END_OF_STREAM) && f.payload.iter().any(|&b| b != tag) {
                        self.out.bad_frames.push(format!("frame of ({}, {}) carries other bytes", h.source, h.slice));
                    }
                    if !h.flags.contains(Flags::END_OF_STREAM) {
                        self.out.received.push((builder, h.source, h.slice, h.payload_len));
                    }
                    self.builders[builder].handle_frame(now, &h, ());
                }
                Err(e) => self.out.bad_frames.push(format!("frame: {e}")),
            }
        }
    }
}

fn policy() -> impl Strategy<Value = Policy> {
    prop_oneof![
        Just(Policy::Direct),
        (1u32..4).prop_map(|k| Policy::Delayed { k }),
        (20_000u64..2_000_000, 40u64..5_000)
            .prop_map(|(rate, burst)| Policy::TokenBucket { rate_bytes_per_s: rate, burst_bytes: burst }),
    ]
}

/// 1 to 6 sources spread over 1 to 3 nodes.
fn nodes() -> impl Strategy<Value = Vec<Vec<SourceId>>> {
    (1u32..7, 1usize..4).prop_map(|(n, k)| {
        let k = k.min(n as usize);
        let mut nodes = vec![Vec::new(); k];
        for s in 0..n {
            nodes[s as usize % k].push(s);
        }
        nodes
    })
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        nodes(),
        1u32..4,
        policy(),
        1u64..30,
        1usize..2_000,
        proptest::collection::vec(100_000u64..50_000_000, 3),
        0u64..3_000_000,
        prop_oneof![Just(0.0), 0.0..0.3],
        any::<u64>(),
        proptest::collection::btree_set(0u64..30, 0..5),
        (prop_oneof![Just(u64::MAX), 500u64..20_000], 1u32..4, 20u64..2_000, 1usize..6),
    )
        .prop_map(
            |(nodes, m, policy, slices, payload, rates, lat, loss, seed, paused, (ql, stall, drain, act))| Setup {
                nodes,
                n_builders: m,
                policy,
                slices,
                payload_bytes: payload,
                rate: rates[..m as usize].to_vec(),
                latency: Duration::from_nanos(lat),
                loss,
                seed,
                paused,
                queue_limit: ql,
                stall_limit_slices: stall,
                drain_timeout: Duration::from_millis(drain),
                max_active: act,
            },
        )
}

/// An ideal transport: fast, no loss, ample limits.
fn ideal(mut s: Setup) -> Setup {
    s.rate = vec![1_000_000_000; s.n_builders as usize];
    s.loss = 0.0;
    s.queue_limit = u64::MAX;
    s.drain_timeout = Duration::from_secs(10);
    s.max_active = 1_000;
    if let Policy::TokenBucket { burst_bytes, .. } = &mut s.policy {
        // Fast enough that the drain is never the limit.
        s.policy = Policy::TokenBucket { rate_bytes_per_s: 100_000_000, burst_bytes: *burst_bytes };
    }
    s
}

/// The last slice's end plus the drain timeout: no node may close later.
fn drain_deadline(s: &Setup) -> Instant {
    s.clock().end_of(s.slices - 1) + s.drain_timeout
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Under any schedule: the ledger balances; every builder emits each slice at most once,
    /// in order, and only its own slices; frames never mix; drain ends in bounded time; the
    /// queue limit is never exceeded.
    #[test]
    fn ledger_balances_and_slices_come_once_in_order(s in setup()) {
        let o = Pair::new(s.clone()).run();
        let ledger = o.ledger.as_ref().unwrap();
        prop_assert!(ledger.is_balanced(), "{:?}", ledger);
        prop_assert_eq!(ledger.unaccounted(), 0);
        prop_assert_eq!(ledger.produced, s.slices * u64::from(s.n_sources()));
        prop_assert!(o.bad_frames.is_empty(), "{:?}", o.bad_frames);
        prop_assert!(!o.queue_limit_exceeded);
        for (b, emitted) in o.emitted.iter().enumerate() {
            prop_assert!(emitted.windows(2).all(|w| w[0].0 < w[1].0), "builder {} out of order: {:?}", b, emitted);
            prop_assert!(emitted.iter().all(|(sl, _)| builder_for(*sl, s.n_builders) as usize == b));
        }
        for closed in &o.closed_at {
            let t = closed.expect("every source node closes");
            prop_assert!(t <= drain_deadline(&s), "closed at {} after the drain deadline {}", t, drain_deadline(&s));
        }
    }

    /// With an ideal transport every slice is emitted exactly once, complete, and every
    /// fragment is delivered.
    #[test]
    fn ideal_transport_delivers_everything(s in setup().prop_map(ideal)) {
        let o = Pair::new(s.clone()).run();
        let ledger = o.ledger.unwrap();
        prop_assert_eq!(ledger.get(shoal_core::ledger::Bucket::Delivered), ledger.produced);
        let mut all: Vec<(SliceNumber, bool)> = o.emitted.concat();
        all.sort();
        prop_assert_eq!(all, (0..s.slices).map(|sl| (sl, true)).collect::<Vec<_>>());
    }

    /// Pause keeps the schedule: every source sends a fragment for every slice, empty
    /// exactly for the slices produced while paused.
    #[test]
    fn pause_sends_empty_fragments_on_schedule(s in setup().prop_map(ideal)) {
        let o = Pair::new(s.clone()).run();
        let mut got: Vec<(SourceId, SliceNumber, bool)> =
            o.received.iter().map(|&(_, src, sl, len)| (src, sl, len == 0)).collect();
        got.sort();
        let mut want = Vec::new();
        for src in 0..s.n_sources() {
            for sl in 0..s.slices {
                want.push((src, sl, s.paused.contains(&sl) || s.payload_bytes == 0));
            }
        }
        prop_assert_eq!(got, want);
    }

    /// A builder that never reads holds each source's barrel-shifter schedule for at most
    /// the stall limit: the next fragment leaves no later than the stall limit after the
    /// stuck one, or when it is due, whichever is later. The others keep building.
    #[test]
    fn a_stuck_builder_releases_the_schedule_within_the_stall_limit(
        s in setup().prop_map(ideal), k in 1u32..4, stall in 1u32..4,
    ) {
        let mut s = s;
        s.n_builders = s.n_builders.max(2);
        s.rate = vec![1_000_000_000; s.n_builders as usize];
        s.rate[0] = 0;
        s.policy = Policy::Delayed { k };
        s.stall_limit_slices = stall;
        s.drain_timeout = Duration::from_millis(50);
        s.max_active = 3;
        let clock = s.clock();
        let o = Pair::new(s.clone()).run();
        prop_assert!(o.ledger.as_ref().unwrap().is_balanced());
        let stall_limit = SLICE * stall;
        for (src, sent) in &o.sent {
            let delay = u64::from(*src / k);
            let firsts: Vec<&Sent> = sent.iter().filter(|x| x.first && x.kind == TransmitKind::Data).collect();
            for w in firsts.windows(2) {
                let (prev, next) = (w[0], w[1]);
                let due = clock.end_of(next.slice + delay);
                if prev.dest == 0 && next.at < drain_deadline(&s) {
                    prop_assert!(next.at <= (prev.at + stall_limit).max(due),
                        "source {}: slice {} left at {}, stuck slice {} at {}", src, next.slice, next.at, prev.slice, prev.at);
                }
            }
        }
        // The builders that read build every slice handed to them. (Whether the sources
        // keep up depends on the stall limit against the cycle; what they could not hand
        // out by the drain deadline is unsent, in the ledger.)
        let mut built: Vec<SliceNumber> = o.emitted[1..].iter().flatten().map(|e| e.0).collect();
        built.sort();
        let handed: BTreeSet<SliceNumber> = o.sent.values().flatten().filter(|x| x.dest != 0 && x.kind == TransmitKind::Data).map(|x| x.slice).collect();
        prop_assert_eq!(built, handed.into_iter().collect::<Vec<_>>());
    }
}
