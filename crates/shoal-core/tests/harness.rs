//! A deterministic in-memory harness (like quinn-proto's test `Pair`): N source nodes and M
//! builder nodes joined by in-memory connections with virtual time, and property tests over
//! random schedules for the node-level invariants.
//!
//! Each (source node, builder) pair has a connection that serialises the node's pieces at a
//! byte rate (0: a stuck builder that never reads), then delivers them after a latency,
//! optionally losing whole frames (silently, as a failing network would: the source saw
//! them sent). The receiving end reassembles the byte stream frame by frame and decodes it
//! with the checked wire-format decoder, so interleaved or corrupted frames fail the test.
//! In datagram mode the same connection's frames go through the datagram transport
//! (`shoal_core::datagram`: a sender per stream, an endpoint per builder) with every datagram
//! lost at random in both directions, NACKs and retransmissions included.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use shoal_core::assembly::AssemblerConfig;
use shoal_core::datagram::{BuilderEndpoint, Datagram, DatagramSender, EndpointEvent, Kind as DatagramKind, UdpConfig};
use shoal_core::frame::{self, Flags, HEADER_LEN};
use shoal_core::ledger::{Bucket, Ledger};
use shoal_core::node::{
    Arrival, BuilderNode, BuilderNodeConfig, DataFlowManager, DfmConfig, GeneratedFragment, SourceNode,
    SourceNodeConfig, SourceTransmit, TransmitKind, Workload,
};
use shoal_core::shaping::{Policy, PullConfig, PullRequest, TokenRate};
use shoal_core::slice::{SliceClock, SliceNumber, builder_for};
use shoal_core::{BuilderId, Duration, Instant, SourceId};

const SLICE: Duration = Duration::from_millis(10);
/// The run number the datagram streams carry.
const RUN: u32 = 1;

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
            opaque: false,
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
    /// Pull: probability that a request is lost, and a builder killed at a time (ms).
    request_loss: f64,
    kill: Option<(BuilderId, u64)>,
    /// The datagram transport instead of byte streams: each datagram (both directions) is
    /// lost with this probability; `spare_recovery`: only first transmissions are lost.
    udp: Option<Udp>,
}

#[derive(Clone, Copy, Debug)]
struct Udp {
    loss: f64,
    spare_recovery: bool,
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
    Served {
        node: usize,
        builder: usize,
    },
    Arrive {
        node: usize,
        builder: usize,
        bytes: Bytes,
        lost: bool,
    },
    /// Pull: a request reaches the source node hosting `source`.
    Request {
        builder: BuilderId,
        source: SourceId,
        slice: SliceNumber,
    },
    /// Pull: an assignment reaches a builder; a builder's credit returns to the manager.
    Assign {
        builder: BuilderId,
        slice: SliceNumber,
    },
    Done {
        builder: BuilderId,
        slice: SliceNumber,
    },
    Kill {
        builder: BuilderId,
    },
    /// Datagram transport: a datagram reaches a builder (`to_builder`) or a source.
    Datagram {
        to_builder: bool,
        builder: BuilderId,
        bytes: Bytes,
    },
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
    /// Pull: every assignment the manager made, requests per (builder, slice, source),
    /// and broken limits (credits, cap).
    assignments: Vec<(SliceNumber, BuilderId, Instant)>,
    requests: BTreeMap<(BuilderId, SliceNumber, SourceId), u32>,
    limit_broken: Vec<String>,
    /// Datagram transport: frames that needed a retransmission, frames given up.
    recovered_frames: u64,
    damaged: u64,
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
    dfm: Option<DataFlowManager>,
    dead: BTreeSet<BuilderId>,
    /// Datagram transport: a sender per (source, builder) stream and the frame it is
    /// collecting from the connection's pieces; an endpoint per builder.
    senders: BTreeMap<(SourceId, BuilderId), (DatagramSender, BytesMut)>,
    endpoints: Vec<BuilderEndpoint>,
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
        let pull = setup.policy.pull();
        let builders = (0..setup.n_builders)
            .map(|id| {
                let b = BuilderNode::new(BuilderNodeConfig { id, assembler, slice_clock: clock });
                match pull {
                    Some(p) => b.with_pull(p),
                    None => b,
                }
            })
            .collect();
        let dfm = pull.map(|p| {
            let mut c = DfmConfig::new(p, clock, 0, setup.n_builders);
            c.end_slice = Some(setup.slices);
            // The harness's builders send no heartbeats; a death is told explicitly.
            c.silence_timeout = Duration::from_secs(3600);
            let mut d = DataFlowManager::new(c, Instant::ZERO);
            for b in 0..setup.n_builders {
                d.handle_hello(Instant::ZERO, b, [], []);
            }
            d
        });
        let conns = setup.nodes.iter().map(|_| (0..setup.n_builders).map(|_| Conn::default()).collect()).collect();
        let out = Outcome {
            emitted: vec![Vec::new(); setup.n_builders as usize],
            closed_at: vec![None; setup.nodes.len()],
            ..Default::default()
        };
        let rng = setup.seed | 1;
        let kill = setup.kill.filter(|_| pull.is_some());
        let udp_cfg = UdpConfig { max_payload: 200, ..UdpConfig::default() };
        let mut senders = BTreeMap::new();
        let mut endpoints = Vec::new();
        if setup.udp.is_some() {
            for src in 0..setup.n_sources() {
                for b in 0..setup.n_builders {
                    senders.insert((src, b), (DatagramSender::new(udp_cfg, RUN, src, b), BytesMut::new()));
                }
            }
            endpoints =
                (0..setup.n_builders).map(|b| BuilderEndpoint::new(udp_cfg, RUN, b, setup.n_sources())).collect();
        }
        let mut pair = Pair {
            setup,
            sources,
            builders,
            conns,
            events: BTreeMap::new(),
            seq: 0,
            rng,
            out,
            dfm,
            dead: BTreeSet::new(),
            senders,
            endpoints,
        };
        if let Some((builder, ms)) = kill {
            pair.schedule(Instant::from_nanos(ms * 1_000_000), Ev::Kill { builder });
        }
        pair
    }

    fn node_of(&self, source: SourceId) -> usize {
        self.setup.nodes.iter().position(|ids| ids.contains(&source)).expect("a hosted source")
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
                self.builders
                    .iter()
                    .enumerate()
                    .filter(|(b, _)| !self.dead.contains(&(*b as BuilderId)))
                    .filter_map(|(_, b)| b.poll_timeout())
                    .min(),
                self.dfm.as_ref().and_then(|d| d.poll_timeout()),
                self.senders.values().filter_map(|(s, _)| s.poll_timeout()).min(),
                self.endpoints.iter().filter_map(BuilderEndpoint::poll_timeout).min(),
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
        // A killed builder leaves no tally: what was sent to it is lost with it.
        let btallies = self
            .builders
            .iter()
            .filter(|b| !self.dead.contains(&b.config().id))
            .map(|b| (b.config().id, b.report().tally))
            .collect();
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
                Ev::Request { builder, source, slice } => {
                    let n = self.node_of(source);
                    self.sources[n].handle_request(now, source, PullRequest { builder, slice });
                }
                Ev::Assign { builder, slice } => {
                    if !self.dead.contains(&builder) {
                        self.builders[builder as usize].handle_assignment(now, slice);
                    }
                }
                Ev::Done { builder, slice } => {
                    if let Some(d) = self.dfm.as_mut() {
                        d.handle_done(now, builder, slice);
                    }
                }
                Ev::Datagram { to_builder, builder, bytes } => self.datagram(now, to_builder, builder, bytes),
                Ev::Kill { builder } => {
                    self.dead.insert(builder);
                    // The manager sees the connection close one latency later.
                    if let Some(d) = self.dfm.as_mut() {
                        d.handle_builder_left(now + self.setup.latency, builder);
                    }
                }
            }
        }
        if let Some(d) = self.dfm.as_mut() {
            if d.poll_timeout().is_some_and(|t| t <= now) {
                d.handle_timeout(now);
            }
            let mut assigned = Vec::new();
            while let Some(a) = d.poll_assignment() {
                assigned.push(a);
            }
            for b in 0..self.setup.n_builders {
                if d.assigned_to(b) > d.config().pull.credits as usize {
                    self.out.limit_broken.push(format!("manager: builder {b} holds {} slices", d.assigned_to(b)));
                }
            }
            for a in assigned {
                self.out.assignments.push((a.slice, a.builder, now));
                self.schedule(now + self.setup.latency, Ev::Assign { builder: a.builder, slice: a.slice });
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
        self.datagram_timers(now);
        for b in 0..self.builders.len() {
            if self.dead.contains(&(b as BuilderId)) {
                continue;
            }
            if self.builders[b].poll_timeout().is_some_and(|t| t <= now) {
                self.builders[b].handle_timeout(now);
            }
            while let Some(o) = self.builders[b].poll_slice() {
                self.out.emitted[b].push((o.slice, o.is_complete()));
                self.builders[b].handle_released(o.bytes);
            }
            self.pull_outputs(now, b);
        }
    }

    /// Pull: a builder's requests go to the sources (some lost), its returned credits to
    /// the manager; its limits are checked.
    fn pull_outputs(&mut self, now: Instant, b: usize) {
        let Some(p) = self.builders[b].pull() else { return };
        let cfg = *p.config();
        if p.open() > cfg.credits as usize {
            self.out.limit_broken.push(format!("builder {b}: {} slices open", p.open()));
        }
        if cfg.request_cap > 0 && p.outstanding() > u64::from(cfg.request_cap) {
            self.out.limit_broken.push(format!("builder {b}: {} requests outstanding", p.outstanding()));
        }
        let builder = b as BuilderId;
        while let Some(r) = self.builders[b].poll_request() {
            *self.out.requests.entry((builder, r.slice, r.source)).or_default() += 1;
            if !self.chance(self.setup.request_loss) {
                self.schedule(now + self.setup.latency, Ev::Request { builder, source: r.source, slice: r.slice });
            }
        }
        while let Some(slice) = self.builders[b].poll_done() {
            self.schedule(now + self.setup.latency, Ev::Done { builder, slice });
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
        if self.setup.udp.is_some() {
            self.send_as_datagrams(now, &piece.tx, &bytes);
        } else {
            let ev = Ev::Arrive { node, builder, bytes: bytes.freeze(), lost: piece.lost };
            self.schedule(now + self.setup.latency, ev);
        }
        self.start(now, node, builder);
    }

    /// Datagram transport: the connection's pieces are collected into whole frames and
    /// handed to the stream's sender; the end-of-stream marker becomes the sender's end.
    fn send_as_datagrams(&mut self, now: Instant, tx: &SourceTransmit, bytes: &[u8]) {
        let key = (tx.source, tx.dest);
        let (sender, frame) = self.senders.get_mut(&key).expect("a sender per stream");
        frame.extend_from_slice(bytes);
        if tx.last {
            match tx.kind {
                TransmitKind::Data => sender.handle_frame(now, tx.slice, frame),
                TransmitKind::EndOfStream => sender.handle_end(now),
            }
            frame.clear();
        }
        self.flush_sender(now, key);
    }

    fn flush_sender(&mut self, now: Instant, key: (SourceId, BuilderId)) {
        let udp = self.setup.udp.expect("datagram transport");
        while let Some(d) = self.senders.get_mut(&key).expect("a sender").0.poll_transmit() {
            let first = Datagram::decode(&d).is_ok_and(|x| x.header.kind == DatagramKind::Data && !x.header.retransmit);
            if (first || !udp.spare_recovery) && self.chance(udp.loss) {
                continue;
            }
            self.schedule(now + self.setup.latency, Ev::Datagram { to_builder: true, builder: key.1, bytes: d });
        }
    }

    fn flush_endpoint(&mut self, now: Instant, b: usize) {
        let udp = self.setup.udp.expect("datagram transport");
        while let Some((_, d)) = self.endpoints[b].poll_transmit() {
            if !udp.spare_recovery && self.chance(udp.loss) {
                continue;
            }
            self.schedule(
                now + self.setup.latency,
                Ev::Datagram { to_builder: false, builder: b as BuilderId, bytes: d },
            );
        }
        while let Some(e) = self.endpoints[b].poll_event() {
            match e {
                EndpointEvent::Fragment(f) => {
                    if f.recovered {
                        self.out.recovered_frames += 1;
                    }
                    self.deliver(now, b, &f.frame, f.recovered);
                }
                EndpointEvent::Damaged { source, n } => {
                    self.builders[b].handle_damaged(source, n);
                    self.out.damaged += n;
                }
                EndpointEvent::Ended { source } => self.builders[b].handle_end_of_stream(now, source),
            }
        }
        self.pull_outputs(now, b);
    }

    fn datagram(&mut self, now: Instant, to_builder: bool, builder: BuilderId, bytes: Bytes) {
        if self.dead.contains(&builder) {
            return;
        }
        if to_builder {
            let b = builder as usize;
            if let Err(e) = self.endpoints[b].handle_bytes(now, &bytes) {
                self.out.bad_frames.push(format!("datagram refused: {e}"));
            }
            self.flush_endpoint(now, b);
        } else {
            let d = Datagram::decode(&bytes).expect("the harness's datagrams decode");
            let key = (d.header.source, d.header.builder);
            self.senders.get_mut(&key).expect("a sender").0.handle_datagram(now, &d);
            self.flush_sender(now, key);
        }
    }

    fn datagram_timers(&mut self, now: Instant) {
        if self.setup.udp.is_none() {
            return;
        }
        let keys: Vec<_> = self.senders.keys().copied().collect();
        for key in keys {
            let (sender, _) = self.senders.get_mut(&key).expect("listed");
            if sender.poll_timeout().is_some_and(|t| t <= now) {
                sender.handle_timeout(now);
            }
            self.flush_sender(now, key);
        }
        for b in 0..self.endpoints.len() {
            if self.dead.contains(&(b as BuilderId)) {
                continue;
            }
            if self.endpoints[b].poll_timeout().is_some_and(|t| t <= now) {
                self.endpoints[b].handle_timeout(now);
            }
            self.flush_endpoint(now, b);
        }
    }

    /// A whole frame from the datagram transport: decoded and checked like the byte
    /// stream's.
    fn deliver(&mut self, now: Instant, builder: usize, frame_bytes: &Bytes, recovered: bool) {
        match frame::decode(frame_bytes, 1 << 24) {
            Ok((f, used)) if used == frame_bytes.len() => {
                let h = f.header;
                let tag = Tagged::byte(h.source, h.slice);
                if f.payload.iter().any(|&b| b != tag) {
                    self.out.bad_frames.push(format!("frame of ({}, {}) carries other bytes", h.source, h.slice));
                }
                self.out.received.push((builder, h.source, h.slice, h.payload_len));
                let arrival = Arrival { recovered, ..Arrival::from_header(&h) };
                self.builders[builder].handle_fragment(now, arrival, ());
            }
            Ok(_) => self.out.bad_frames.push("a datagram frame with trailing bytes".into()),
            Err(e) => self.out.bad_frames.push(format!("datagram frame: {e}")),
        }
    }

    fn arrive(&mut self, now: Instant, node: usize, builder: usize, bytes: Bytes, lost: bool) {
        if lost || self.dead.contains(&(builder as BuilderId)) {
            return;
        }
        self.reassemble(now, node, builder, &bytes);
        self.pull_outputs(now, builder);
    }

    fn reassemble(&mut self, now: Instant, node: usize, builder: usize, bytes: &[u8]) {
        let conn = &mut self.conns[node][builder];
        conn.rx.extend_from_slice(bytes);
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
        (1u32..4).prop_map(|k| Policy::Delayed { k, window: 1 }),
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
                request_loss: 0.0,
                kill: None,
                udp: None,
            },
        )
}

/// Pull setups: random credits, cap, re-ask budget and hold; answers paced by a token
/// bucket or not; requests lost at random; a builder killed at a random moment (or not).
fn pull_setup() -> impl Strategy<Value = Setup> {
    (
        setup(),
        (1u32..6, prop_oneof![Just(0u32), 1u32..8], 0u32..3, 5u64..40, 4u32..80),
        prop_oneof![Just(None), (10_000u64..50_000_000, 100u64..20_000).prop_map(Some)],
        prop_oneof![Just(0.0), 0.0..0.2],
        prop_oneof![Just(None), (0u32..3, 0u64..400).prop_map(Some)],
    )
        .prop_map(|(mut s, (credits, cap, reasks, timeout_ms, hold), rate, request_loss, kill)| {
            let mut p = PullConfig::new(credits);
            p.request_cap = cap;
            p.max_reasks = reasks;
            p.reask_timeout = Duration::from_millis(timeout_ms);
            p.hold_slices = hold;
            p.answer_rate = rate.map(|(bytes_per_s, burst_bytes)| TokenRate { bytes_per_s, burst_bytes });
            s.policy = Policy::Pull(p);
            s.request_loss = request_loss;
            s.kill = kill.map(|(b, ms)| (b % s.n_builders, ms));
            s
        })
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
        prop_assert!(o.assignments.is_empty() && o.requests.is_empty());
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
        s.policy = Policy::Delayed { k, window: 1 };
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

    /// Pull, whatever the transport, losses, limits and a builder killed at a random
    /// moment: the ledger balances; limits hold (credits at the manager and the builder,
    /// the request cap); each request is asked at most 1 + max_reasks times; without a
    /// kill each slice is assigned exactly once; a killed builder's slices go to the others.
    #[test]
    fn pull_ledger_balances_limits_hold_and_reasks_are_bounded(s in pull_setup()) {
        let p = s.policy.pull().unwrap();
        let o = Pair::new(s.clone()).run();
        let ledger = o.ledger.as_ref().unwrap();
        prop_assert!(ledger.is_balanced(), "{:?}", ledger);
        prop_assert_eq!(ledger.produced, s.slices * u64::from(s.n_sources()));
        prop_assert!(o.bad_frames.is_empty(), "{:?}", o.bad_frames);
        prop_assert!(o.limit_broken.is_empty(), "{:?}", o.limit_broken);
        for (key, n) in &o.requests {
            prop_assert!(*n <= 1 + p.max_reasks, "{:?} asked {} times", key, n);
        }
        let mut slices: Vec<SliceNumber> = o.assignments.iter().map(|a| a.0).collect();
        slices.sort();
        let once = slices.windows(2).all(|w| w[0] < w[1]);
        if s.kill.is_none() {
            prop_assert!(once, "a slice assigned twice: {:?}", o.assignments);
        }
        if let Some((dead, ms)) = s.kill {
            // The manager hears of the death one latency later and assigns it nothing after.
            let heard = Instant::from_nanos(ms * 1_000_000) + s.latency;
            let after: Vec<_> = o.assignments.iter().filter(|a| a.1 == dead && a.2 > heard).collect();
            prop_assert!(after.is_empty(), "assigned to dead builder {} after {}: {:?}", dead, heard, after);
        }
        for (b, emitted) in o.emitted.iter().enumerate() {
            prop_assert!(emitted.windows(2).all(|w| w[0].0 < w[1].0), "builder {} out of order: {:?}", b, emitted);
        }
    }

    /// Pull over an ideal transport, nothing lost and nobody killed: every slice is
    /// assigned once, built once and complete, every fragment delivered.
    #[test]
    fn pull_over_an_ideal_transport_builds_every_slice_once(s in pull_setup().prop_map(|mut s| {
        s.request_loss = 0.0;
        s.kill = None;
        if let Policy::Pull(p) = &mut s.policy {
            // Nothing is evicted before its request can come, however far behind a
            // builder with few requests outstanding falls (one request at a time for six
            // sources, 2.7 ms each way, takes 3 slices of time per slice).
            p.hold_slices = p.hold_slices.max(1_000_000);
            p.reask_timeout = Duration::from_millis(500);
            // Paced answers still use the buckets (fragments cut into bursts), at an ample rate.
            if let Some(r) = &mut p.answer_rate {
                r.bytes_per_s = r.bytes_per_s.max(1_000_000_000);
            }
        }
        ideal(s)
    })) {
        let o = Pair::new(s.clone()).run();
        let ledger = o.ledger.unwrap();
        prop_assert_eq!(ledger.get(shoal_core::ledger::Bucket::Delivered), ledger.produced, "{:?}", ledger);
        let mut assigned: Vec<SliceNumber> = o.assignments.iter().map(|a| a.0).collect();
        assigned.sort();
        prop_assert_eq!(&assigned, &(0..s.slices).collect::<Vec<_>>());
        let mut all: Vec<(SliceNumber, bool)> = o.emitted.concat();
        all.sort();
        prop_assert_eq!(all, (0..s.slices).map(|sl| (sl, true)).collect::<Vec<_>>());
    }
}

/// Datagram setups: any push policy and schedule, every datagram (data, NACKs,
/// retransmissions, ends, acknowledgements) lost with a random probability.
fn udp_setup(spare_recovery: bool) -> impl Strategy<Value = Setup> {
    (setup(), 0.0f64..0.3).prop_map(move |(mut s, loss)| {
        s.loss = 0.0;
        s.udp = Some(Udp { loss, spare_recovery });
        s
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Over lossy datagrams: the ledger balances, every fragment in one bucket (recovered,
    /// damaged and lost in transport included); no frame is corrupted or mixed; slices
    /// come once and in order.
    #[test]
    fn udp_ledger_balances_with_every_unrecovered_fragment_accounted(s in udp_setup(false)) {
        let o = Pair::new(s.clone()).run();
        let ledger = o.ledger.as_ref().unwrap();
        prop_assert!(ledger.is_balanced(), "{:?}", ledger);
        prop_assert_eq!(ledger.produced, s.slices * u64::from(s.n_sources()));
        prop_assert!(o.bad_frames.is_empty(), "{:?}", o.bad_frames);
        prop_assert_eq!(ledger.get(Bucket::Damaged), o.damaged);
        for emitted in &o.emitted {
            prop_assert!(emitted.windows(2).all(|w| w[0].0 < w[1].0));
        }
    }

    /// Loss within the retransmission budget (first transmissions only, up to 30%; NACKs
    /// and retransmissions get through) over an ideal link: no fragment is damaged or lost
    /// in transport, and the recovered ones are counted.
    #[test]
    fn udp_loss_within_the_budget_is_recovered(s in udp_setup(true).prop_map(|s| {
        let udp = s.udp;
        Setup { udp, ..ideal(s) }
    })) {
        let o = Pair::new(s.clone()).run();
        let ledger = o.ledger.as_ref().unwrap();
        prop_assert!(ledger.is_balanced(), "{:?}", ledger);
        prop_assert!(o.bad_frames.is_empty(), "{:?}", o.bad_frames);
        prop_assert_eq!(ledger.get(Bucket::Damaged), 0, "{:?}", ledger);
        prop_assert_eq!(ledger.get(Bucket::LostInTransport), 0, "{:?}", ledger);
        let sent: u64 = o.sent.values().flatten().filter(|p| p.first && p.kind == TransmitKind::Data).count() as u64;
        prop_assert_eq!(o.received.len() as u64, sent, "every frame sent arrived whole");
        prop_assert!(ledger.get(Bucket::Recovered) <= o.recovered_frames);
    }
}
