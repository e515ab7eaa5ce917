//! The simulated DAQ: each board host runs a shoal-core [`SourceNode`] and each builder
//! host a [`BuilderNode`], the very machines the runtime drives, fed by the same
//! workloads, over [`crate::net`] with [`crate::tcp`] or UDP. This driver only moves
//! bytes and time: every decision (schedule, cutoff, shaping, stall and queue limits,
//! drain, end of stream, assembly; for pull the assignments, requests and re-asks) is the
//! nodes'.
//!
//! Pull runs add a data-flow manager host on the central switch, running shoal-core's
//! [`DataFlowManager`]. Assignments (manager to builder), credit reports (builder to
//! manager) and fragment requests (builder to source) are single small packets on the
//! modelled network, each one 56-byte frame header in a UDP/IP packet: they queue behind
//! data and acknowledgements and can be dropped at a full port, which the builders'
//! re-asks recover (the runtime carries them on TCP connections instead).
//!
//! UDP with `traffic.udp_nack` runs shoal-core's datagram transport, the runtime's: a
//! [`DatagramSender`] per (source, builder) stream at the board, a [`BuilderEndpoint`] per
//! builder; every datagram (data, NACKs, retransmissions, probes, ends) is one packet of its
//! size. Without it, UDP is best effort: 60 kB datagrams split into IP fragments, as in the
//! ANTARES study.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, VecDeque};

use bytes::Bytes;

use shoal_core::assembly::AssemblerConfig;
use shoal_core::datagram::{
    BuilderEndpoint, Datagram, DatagramSender, EndpointEvent, ReceiverStats, SenderStats, UdpConfig,
};
use shoal_core::frame::Flags;
use shoal_core::ledger::Ledger;
pub use shoal_core::node::TransmitRecord;
use shoal_core::node::{
    Arrival, BuilderNode, BuilderNodeConfig, BuilderNodeReport, CutoffConfig, DataFlowManager, DfmConfig, DfmStats,
    GeneratedFragment, SourceNode, SourceNodeConfig, SourceTransmit, TransmitKind, Workload,
};
use shoal_core::shaping::{Policy, PullRequest};
use shoal_core::slice::{SliceClock, SliceNumber};
use shoal_core::{Duration, Instant, SourceId};
use shoal_detector::Generator;

use crate::engine::EventQueue;
use crate::net::{NetEvent, Network, NodeId, Packet, PortSpec, wire_size};
use crate::scenario::Scenario;
use crate::tcp::{AckDecision, SackBlocks, Segment, TcpConfig, TcpReceiver, TcpSender};

/// IP header bytes; UDP header bytes; largest IP payload per fragment (MTU 1500).
const IP_HEADER: u32 = 20;
const UDP_HEADER: u32 = 8;
const IP_FRAGMENT_PAYLOAD: u32 = 1480;
/// Largest UDP datagram the sources send; bigger fragments go as several datagrams.
const MAX_DATAGRAM: u32 = 60_000;
#[derive(Clone, Debug)]
enum Body {
    Data {
        conn: u32,
        seq: u64,
        len: u32,
    },
    Ack {
        conn: u32,
        ack: u64,
        sack: SackBlocks,
    },
    Udp {
        source: u32,
        slice: SliceNumber,
        kind: TransmitKind,
        dgram: u64,
        ip_fragments: u16,
        dgram_bytes: u32,
        fragment_bytes: u32,
    },
    /// Pull control messages (one small packet each).
    Request {
        builder: u32,
        source: u32,
        slice: SliceNumber,
    },
    /// A datagram of the datagram transport (`udp_nack`), either direction.
    Dgram(Bytes),
    Assign {
        builder: u32,
        slice: SliceNumber,
    },
    Done {
        builder: u32,
        slice: SliceNumber,
    },
}

/// A pull control message on the wire: one frame header in a UDP/IP packet.
const CONTROL_PACKET: u32 = shoal_core::frame::HEADER_LEN as u32 + UDP_HEADER + IP_HEADER;

#[derive(Debug)]
enum Ev {
    Net(NetEvent<Body>),
    /// A slice ended: every source node waiting for it is woken (one event for all, as the
    /// boards share the slice clock).
    SliceTick(SliceNumber),
    /// A source node's own earlier timer (token bucket, stall limit, drain deadline).
    SourceWake(u32),
    /// With the run queue (`topology.cpu_wake_us`): a woken source's process gets a core.
    SourceRun(u32),
    /// ... a builder's process, woken by data to read, gets a core and reads all there is.
    BuilderRun(u32),
    Rto(u32),
    DelAck(u32),
    BuilderWake(u32),
    DfmWake,
    /// Datagram transport timers: a (source, builder) stream's sender, a builder's endpoint.
    SenderWake(u32, u32),
    EndpointWake(u32),
}

/// The datagram transport of a `udp_nack` run.
struct Nack {
    cfg: UdpConfig,
    senders: HashMap<(u32, u32), (DatagramSender, Option<Instant>)>,
    endpoints: Vec<(BuilderEndpoint, Option<Instant>)>,
    /// A frame's bytes (the model carries no hit content: zeros of the frame's length).
    zeros: Vec<u8>,
    datagrams: u64,
}

/// The datagram transport's counts, summed over streams.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct NackSummary {
    /// Datagrams sent, both directions (those hit by a bit error are discarded by the
    /// receiving host, counted in `damaged_packets`, as the CRC would).
    pub datagrams: u64,
    /// The sources' streams (NACKs received, retransmitted, unanswerable, ...).
    pub sender: SenderStats,
    /// The builders' streams (NACKs sent, recovered, lost, damaged, ...).
    pub receiver: ReceiverStats,
}

/// One fragment's life.
#[derive(Clone, Copy, Debug, Default)]
pub struct FragRecord {
    pub source: u32,
    pub slice: SliceNumber,
    pub builder: u32,
    pub bytes: u32,
    pub burst: bool,
    pub cut_off: bool,
    /// Slice end: the fragment is ready.
    pub ready_ns: u64,
    /// First byte handed to the transport (0: never).
    pub sent_ns: u64,
    /// Complete at the builder (0: never).
    pub arrived_ns: u64,
}

struct Conn {
    source: u32,
    builder: u32,
    src: NodeId,
    dst: NodeId,
    tx: TcpSender,
    rx: TcpReceiver,
    sndbuf: u64,
    /// Pending application writes: (slice, kind, bytes left, ends the frame).
    writes: VecDeque<(SliceNumber, TransmitKind, u64, bool)>,
    /// Stream offsets at which frames end.
    ends: VecDeque<(u64, SliceNumber, TransmitKind)>,
    rto_event: Option<Instant>,
    delack_event: Option<Instant>,
}

struct SourceApp {
    host: NodeId,
    node: SourceNode,
    wake: Option<Instant>,
    /// With wake latency: the timer last drawn for (due, when the host wakes for it), so
    /// that arming the same timer again does not draw again.
    late: Option<(Instant, Instant)>,
    /// With the run queue: woken and waiting for a core (its [`Ev::SourceRun`] is due).
    queued: bool,
}

struct BuilderApp {
    host: NodeId,
    node: BuilderNode<()>,
    wake: Option<Instant>,
    /// With the run queue: what the kernel holds for the builder's process until it runs
    /// (frames received in full, datagrams), and whether it is waiting for a core.
    inbox: Vec<Readable>,
    queued: bool,
}

/// What a builder's process reads when it runs.
enum Readable {
    /// A TCP frame received in full (the kernel has acknowledged its segments already).
    Frame { source: u32, slice: SliceNumber, kind: TransmitKind },
    /// A datagram: the whole packet, read and handled by the process.
    Packet(NodeId, Packet<Body>),
}

struct DfmApp {
    host: NodeId,
    node: DataFlowManager,
    wake: Option<Instant>,
}

/// The scenario's workload, counting the boards in a burst per slice (a check of the
/// burst generator, domain.md section 8).
struct CountingWorkload {
    inner: Generator,
    bursts: RefCell<HashMap<SliceNumber, u32>>,
}

impl Workload for CountingWorkload {
    fn generate(&self, source: SourceId, slice: SliceNumber) -> GeneratedFragment {
        let f = self.inner.generate(source, slice);
        if f.burst {
            *self.bursts.borrow_mut().entry(slice).or_default() += 1;
        }
        f
    }
}

/// Results of one run.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SimSummary {
    pub name: String,
    pub seed: u64,
    pub transport: String,
    pub policy: String,
    pub sources: u32,
    pub builders: u32,
    pub slices: u64,
    pub fragment_bytes: u32,
    pub fragments_produced: u64,
    pub fragments_arrived: u64,
    pub network_delay_avg_us: f64,
    pub network_delay_p99_us: f64,
    pub network_delay_max_us: f64,
    /// The same without the first second of slices
    /// ([`shoal_core::node::STEADY_AFTER`]), as the runtime's builders report it.
    pub network_delay_steady_avg_us: f64,
    pub network_delay_steady_p99_us: f64,
    pub network_delay_steady_max_us: f64,
    /// The p99 of each builder's steady delays, the largest of them: the statistic the
    /// testbed reports (each builder process keeps its own histogram, and a run's p99 is
    /// its worst builder's), so `shoal validate` compares like with like.
    #[serde(default)]
    pub network_delay_steady_p99_worst_builder_us: f64,
    pub shaping_delay_avg_us: f64,
    pub shaping_delay_p99_us: f64,
    pub shaping_delay_max_us: f64,
    /// From a slice's end (true time) to its last fragment's arrival, complete slices
    /// only: what a consumer of built slices waits (docs/clocks.md).
    #[serde(default)]
    pub slice_delay_avg_us: f64,
    #[serde(default)]
    pub slice_delay_p99_us: f64,
    pub tcp_segments: u64,
    pub tcp_retransmitted: u64,
    pub tcp_retransmit_fraction: f64,
    pub tcp_timeouts: u64,
    /// Tail-loss probes sent (with `tcp.rack_tlp`).
    pub tcp_loss_probes: u64,
    /// Packets taken in by a node, host or switch (what the CPU model charges for).
    pub packet_arrivals: u64,
    /// With the CPU model (`topology.cpu_cores`): the cores' busy fraction over the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_busy_fraction: Option<f64>,
    /// With the run queue (`topology.cpu_wake_us`): process wake-ups served, sources' and
    /// builders'.
    #[serde(default)]
    pub process_wakeups: u64,
    /// ... and the time they waited for a core, summed (seconds).
    #[serde(default)]
    pub process_wait_s: f64,
    pub udp_ip_fragments_sent: u64,
    pub udp_fragments_sent: u64,
    pub udp_fragments_lost: u64,
    pub udp_fragment_loss_fraction: f64,
    pub slices_complete: u64,
    pub slices_incomplete: u64,
    pub queue_drops: u64,
    pub damaged_packets: u64,
    /// Packets lost at random on switch ports toward hosts (`topology.host_port_loss_ppm`).
    pub injected_drops: u64,
    pub ledger: BTreeMap<String, u64>,
    pub ledger_produced: u64,
    pub ledger_unaccounted: i128,
    /// Mean fraction of boards in a burst per slice, and the histogram of boards in burst.
    pub burst_mean_fraction: f64,
    pub burst_histogram: Vec<u64>,
    /// Pull runs: the manager's counts, and the builders' requests, re-asks, fragments
    /// given up and waits, summed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dfm: Option<DfmStats>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pull: Option<shoal_core::node::PullStats>,
    /// Pull runs: control packets sent (requests, assignments, credit reports).
    pub control_packets: u64,
    /// UDP with `udp_nack`: datagrams, NACKs, retransmissions, recovered and lost.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp_nack: Option<NackSummary>,
    pub events: u64,
    pub wall_s: f64,
}

/// A finished run: summary plus per-fragment records.
#[derive(Debug)]
pub struct SimResult {
    pub summary: SimSummary,
    pub records: Vec<FragRecord>,
    /// With [`RunOptions::log_transmits`]: every piece a source node handed out, in order.
    pub transmits: Vec<TransmitRecord>,
    /// Each builder node's report (per-slice outcomes and its tally).
    pub builders: Vec<BuilderNodeReport>,
}

/// What a run keeps beyond the summary and the per-fragment records.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunOptions {
    pub log_transmits: bool,
}

struct World {
    sc: Scenario,
    q: EventQueue<Ev>,
    net: Network<Body>,
    workload: CountingWorkload,
    slice_clock: SliceClock,
    n_slices: u64,
    n_builders: u32,
    tcp: bool,
    sources: Vec<SourceApp>,
    builders: Vec<BuilderApp>,
    conns: Vec<Conn>,
    /// host -> builder index
    builder_of_host: HashMap<NodeId, u32>,
    records: Vec<FragRecord>,
    next_dgram: u64,
    udp_dgrams: HashMap<u64, u16>,
    udp_progress: HashMap<(u32, SliceNumber), u32>,
    udp_ip_sent: u64,
    udp_frags_sent: u64,
    to_pump: Vec<u32>,
    segs: Vec<Segment>,
    dfm: Option<DfmApp>,
    source_of_host: HashMap<NodeId, u32>,
    control_packets: u64,
    nack: Option<Nack>,
    /// How late each source host wakes (zero: hardware boards in lockstep).
    wake_latency: crate::wake::WakeLatency,
    /// Each source host's clock (offset ns, drift ppb) when `[clocks]` is set: its node
    /// sees its own time, its timers fire when its clock says (docs/clocks.md).
    clocks: Option<Vec<(i64, i64)>>,
}

/// Timers are scheduled lazily: at most one pending event per timer, unless it moved
/// earlier. Returns the instant to schedule, if any, and records it in `pending`.
fn rearm(pending: &mut Option<Instant>, due: Option<Instant>) -> Option<Instant> {
    let t = due?;
    if pending.is_some_and(|p| p <= t) {
        return None;
    }
    *pending = Some(t);
    Some(t)
}

fn mbps(v: f64) -> u64 {
    (v * 1e6) as u64
}

fn us(v: f64) -> Duration {
    Duration::from_nanos((v * 1e3) as u64)
}

/// Runs a scenario to the end and returns its summary and records.
pub fn run(sc: &Scenario) -> Result<SimResult, String> {
    run_with(sc, RunOptions::default())
}

/// [`run`] with options.
pub fn run_with(sc: &Scenario, opts: RunOptions) -> Result<SimResult, String> {
    sc.validate()?;
    sc.clocks.check_simulated()?;
    let started = std::time::Instant::now();
    let mut w = World::build(sc, opts)?;
    let end = Instant::ZERO + Duration::from_secs_f64(sc.traffic.load_s + sc.traffic.relax_s);
    if w.clocks.is_none() {
        // One tick for every source at each slice end (sources in lockstep).
        w.q.schedule(w.slice_clock.end_of(0), Ev::SliceTick(0));
    }
    for s in 0..w.sources.len() as u32 {
        w.arm_source(s);
    }
    w.dfm_outputs(Instant::ZERO);
    while let Some((now, ev)) = w.q.pop(end) {
        w.handle(now, ev);
    }
    Ok(w.finish(end, started.elapsed().as_secs_f64()))
}

impl World {
    fn build(sc: &Scenario, opts: RunOptions) -> Result<World, String> {
        let t = &sc.topology;
        let n_sources = t.n_sources()?;
        let n_builders = t.n_builders()?;
        let policy: Policy =
            sc.traffic.policy.parse().map_err(|e: shoal_core::shaping::PolicyParseError| e.to_string())?;
        let slice_len = Duration::from_nanos((sc.traffic.slice_ms * 1e6) as u64);
        let slice_clock = SliceClock::try_new(slice_len).ok_or("traffic.slice_ms is too small")?;
        let n_slices = ((sc.traffic.load_s * 1e9) as u64 / slice_len.as_nanos() as u64).max(1);
        let pull = policy.pull();
        let (net, source_hosts, builder_hosts, dfm_host) =
            Self::build_network(sc, n_sources, n_builders, pull.is_some());
        let tcp = sc.traffic.transport == "tcp";
        let conns = if tcp { Self::tcp_connections(sc, &source_hosts, &builder_hosts) } else { Vec::new() };
        let sources = Self::source_apps(sc, &opts, policy, slice_clock, n_slices, n_builders, &source_hosts);
        let (builders, dfm) = Self::builder_apps(sc, n_sources, slice_clock, n_slices, pull, &builder_hosts, dfm_host);
        let source_of_host = source_hosts.iter().enumerate().map(|(i, &h)| (h, i as u32)).collect();
        let builder_of_host = builder_hosts.iter().enumerate().map(|(i, &h)| (h, i as u32)).collect();
        // The runtime's default budgets.
        let udp_cfg = UdpConfig { max_nacks: sc.traffic.udp_max_nacks, ..UdpConfig::default() };
        Ok(World {
            sc: sc.clone(),
            q: EventQueue::new(),
            net,
            workload: CountingWorkload {
                inner: sc.traffic.workload(n_sources, sc.seed)?,
                bursts: RefCell::new(HashMap::new()),
            },
            slice_clock,
            n_slices,
            n_builders,
            tcp,
            sources,
            builders,
            conns,
            builder_of_host,
            records: vec![FragRecord::default(); (n_slices * u64::from(n_sources)) as usize],
            next_dgram: 0,
            udp_dgrams: HashMap::new(),
            udp_progress: HashMap::new(),
            udp_ip_sent: 0,
            udp_frags_sent: 0,
            to_pump: Vec::new(),
            segs: Vec::new(),
            dfm,
            source_of_host,
            control_packets: 0,
            clocks: (!sc.clocks.is_zero()).then(|| sc.clocks.source_clocks(n_sources, sc.seed)),
            wake_latency: crate::wake::WakeLatency::new(
                n_sources,
                sc.traffic.wake_phase_us,
                sc.traffic.wake_jitter_us,
                sc.traffic.wake_lag_us.clone(),
                sc.seed,
            ),
            nack: (!tcp && sc.traffic.udp_nack).then(|| Nack {
                cfg: udp_cfg,
                senders: HashMap::new(),
                endpoints: (0..n_builders).map(|b| (BuilderEndpoint::new(udp_cfg, 1, b, n_sources), None)).collect(),
                zeros: Vec::new(),
                datagrams: 0,
            }),
        })
    }

    /// The network of the scenario's topology: a switch per sector of boards on the
    /// shore cable to the central switch, the builders (and pull's data-flow manager) on
    /// the central switch. Returns the network and its source, builder and manager hosts.
    fn build_network(
        sc: &Scenario,
        n_sources: u32,
        n_builders: u32,
        pull: bool,
    ) -> (Network<Body>, Vec<crate::net::NodeId>, Vec<crate::net::NodeId>, Option<crate::net::NodeId>) {
        let t = &sc.topology;
        let mut net = Network::new(sc.seed ^ 0x5eed);
        // The testbed's tbf bucket: 250 us at the rate, never below two full frames.
        let bucket = |rate: f64| {
            (t.shaper_bucket_us > 0.0)
                .then(|| ((rate * t.shaper_bucket_us / 8.0) as u64).max(2 * u64::from(wire_size(1500))))
        };
        let switch_q = |rate: f64, delay: f64, ber: f64| PortSpec {
            bucket_bytes: bucket(rate),
            rate_bps: mbps(rate),
            delay: us(delay),
            queue_packets: t.queue_packets,
            queue_bytes: t.queue_bytes,
            ber,
            loss: 0.0,
        };
        let host_q = |rate: f64, delay: f64| PortSpec {
            bucket_bytes: bucket(rate),
            rate_bps: mbps(rate),
            delay: us(delay),
            queue_packets: Some(t.host_queue_packets),
            queue_bytes: None,
            ber: 0.0,
            loss: 0.0,
        };
        // The testbed's injected loss: on every switch port toward a host.
        let lossy = |spec: PortSpec| PortSpec { loss: t.host_port_loss_ppm as f64 / 1e6, ..spec };
        let central = net.add_switch();
        let mut source_hosts = Vec::new();
        let n_sectors = n_sources.div_ceil(t.boards_per_sector);
        for sector in 0..n_sectors {
            let sw = net.add_switch();
            // The shore cable: bit errors in both directions.
            net.link(
                sw,
                central,
                switch_q(t.shore_mbps, t.shore_delay_us, t.shore_ber),
                switch_q(t.shore_mbps, t.shore_delay_us, t.shore_ber),
            );
            let first = sector * t.boards_per_sector;
            for _ in first..(first + t.boards_per_sector).min(n_sources) {
                let h = net.add_host();
                net.link(
                    h,
                    sw,
                    host_q(t.board_mbps, t.board_delay_us),
                    lossy(switch_q(t.board_mbps, t.board_delay_us, 0.0)),
                );
                source_hosts.push(h);
            }
        }
        // The data-flow manager's host sits on the central switch like a builder.
        let dfm_host = pull.then(|| {
            let h = net.add_host();
            net.link(
                h,
                central,
                host_q(t.builder_mbps, t.builder_delay_us),
                lossy(switch_q(t.builder_mbps, t.builder_delay_us, 0.0)),
            );
            h
        });
        let mut builder_hosts = Vec::new();
        for _ in 0..n_builders {
            let h = net.add_host();
            net.link(
                h,
                central,
                host_q(t.builder_mbps, t.builder_delay_us),
                lossy(switch_q(t.builder_mbps, t.builder_delay_us, 0.0)),
            );
            builder_hosts.push(h);
        }
        net.build_routes();
        if t.cpu_cores > 0 {
            net.cpu = Some(
                crate::net::SharedCpu::new(t.cpu_cores as usize, us(t.cpu_packet_us)).with_wake_cost(us(t.cpu_wake_us)),
            );
        }

        (net, source_hosts, builder_hosts, dfm_host)
    }

    /// A TCP connection from every source to every builder.
    fn tcp_connections(
        sc: &Scenario,
        source_hosts: &[crate::net::NodeId],
        builder_hosts: &[crate::net::NodeId],
    ) -> Vec<Conn> {
        let tcp_cfg = TcpConfig {
            mss: sc.tcp.mss,
            initial_window: sc.tcp.initial_window,
            rwnd: sc.tcp.rwnd_bytes,
            min_rto: Duration::from_nanos((sc.tcp.min_rto_ms * 1e6) as u64),
            delayed_ack: Duration::from_nanos((sc.tcp.delayed_ack_ms * 1e6) as u64),
            rack_tlp: sc.tcp.rack_tlp,
            sack: sc.tcp.sack,
            tick: (sc.tcp.kernel_hz > 0).then(|| Duration::from_nanos(1_000_000_000 / u64::from(sc.tcp.kernel_hz))),
            ..TcpConfig::default()
        };
        let mut conns = Vec::new();
        {
            for s in 0..source_hosts.len() as u32 {
                for b in 0..builder_hosts.len() as u32 {
                    conns.push(Conn {
                        source: s,
                        builder: b,
                        src: source_hosts[s as usize],
                        dst: builder_hosts[b as usize],
                        tx: TcpSender::new(tcp_cfg),
                        rx: TcpReceiver::new(tcp_cfg),
                        sndbuf: sc.tcp.sndbuf_bytes,
                        writes: VecDeque::new(),
                        ends: VecDeque::new(),
                        rto_event: None,
                        delack_event: None,
                    });
                }
            }
        }
        conns
    }

    /// One source node per source, each on its board's host.
    fn source_apps(
        sc: &Scenario,
        opts: &RunOptions,
        policy: Policy,
        slice_clock: SliceClock,
        n_slices: u64,
        n_builders: u32,
        source_hosts: &[crate::net::NodeId],
    ) -> Vec<SourceApp> {
        let n_sources = source_hosts.len() as u32;
        let tr = &sc.traffic;
        (0..n_sources)
            .map(|s| {
                let mut c = SourceNodeConfig::new(vec![s], n_builders, policy, slice_clock);
                c.first_slice = Some(0);
                c.slices = Some(n_slices);
                c.cutoff = tr.cutoff.then_some(CutoffConfig { head: tr.cutoff_head, tail: tr.cutoff_tail });
                c.queue_limit_bytes = tr.queue_limit_mb << 20;
                c.stall_limit_slices = tr.stall_limit_slices.max(1);
                // The drain ends with the simulation: load_s of slices, then relax_s.
                c.drain_timeout = Duration::from_secs_f64(tr.relax_s);
                c.record_transmits = opts.log_transmits;
                SourceApp {
                    host: source_hosts[s as usize],
                    node: SourceNode::new(c, Instant::ZERO),
                    wake: None,
                    late: None,
                    queued: false,
                }
            })
            .collect()
    }

    /// One builder node per builder host, and pull's data-flow manager.
    fn builder_apps(
        sc: &Scenario,
        n_sources: u32,
        slice_clock: SliceClock,
        n_slices: u64,
        pull: Option<shoal_core::shaping::PullConfig>,
        builder_hosts: &[crate::net::NodeId],
        dfm_host: Option<crate::net::NodeId>,
    ) -> (Vec<BuilderApp>, Option<DfmApp>) {
        let n_builders = builder_hosts.len() as u32;
        let asm_cfg = AssemblerConfig {
            n_sources,
            max_active: sc.builder.max_active,
            wall_timeout: Duration::from_nanos((sc.builder.wall_timeout_ms * 1e6) as u64),
            memory_budget: u64::MAX,
        };
        let builders = builder_hosts
            .iter()
            .enumerate()
            .map(|(id, &host)| {
                let cfg = BuilderNodeConfig { id: id as u32, assembler: asm_cfg, slice_clock };
                let node = BuilderNode::new(cfg);
                let node = match pull {
                    Some(p) => node.with_pull(p),
                    None => node,
                };
                BuilderApp { host, node, wake: None, inbox: Vec::new(), queued: false }
            })
            .collect();
        let dfm = pull.zip(dfm_host).map(|(p, host)| {
            let mut c = DfmConfig::new(p, slice_clock, 0, n_builders);
            c.end_slice = Some(n_slices);
            let mut node = DataFlowManager::new(c, Instant::ZERO);
            // Every builder says hello at the start (their connections are up).
            for b in 0..n_builders {
                node.handle_hello(Instant::ZERO, b, [], []);
            }
            DfmApp { host, node, wake: None }
        });
        (builders, dfm)
    }

    fn record(&mut self, source: u32, slice: SliceNumber) -> &mut FragRecord {
        let n = self.sources.len() as u64;
        &mut self.records[(slice * n + u64::from(source)) as usize]
    }

    fn handle(&mut self, now: Instant, ev: Ev) {
        match ev {
            Ev::Net(NetEvent::TxDone(port)) => {
                let q = &mut self.q;
                self.net.handle_tx_done(now, port, &mut |t, e| q.schedule(t, Ev::Net(e)));
            }
            Ev::Net(NetEvent::Arrive(port, pkt)) => {
                let q = &mut self.q;
                if let Some((host, pkt)) = self.net.handle_arrive(now, port, pkt, &mut |t, e| q.schedule(t, Ev::Net(e)))
                {
                    self.receive(now, host, pkt);
                }
            }
            Ev::Net(NetEvent::Processed(port, pkt)) => {
                let q = &mut self.q;
                if let Some((host, pkt)) =
                    self.net.handle_processed(now, port, pkt, &mut |t, e| q.schedule(t, Ev::Net(e)))
                {
                    self.receive(now, host, pkt);
                }
            }
            Ev::SliceTick(slice) => {
                let mut open = false;
                let late = self.timers_fire_late();
                for s in 0..self.sources.len() as u32 {
                    let node = &mut self.sources[s as usize].node;
                    if let Some(due) = node.poll_timeout().filter(|&t| t <= now) {
                        if late {
                            // A software host sees the slice end when it wakes.
                            let at = self.late_wake(s, due);
                            if let Some(t) = rearm(&mut self.sources[s as usize].wake, Some(at)) {
                                self.q.schedule(t, Ev::SourceWake(s));
                            }
                        } else {
                            node.handle_timeout(now, &self.workload);
                            self.to_pump.push(s);
                        }
                    }
                    open |= !self.sources[s as usize].node.is_closed();
                }
                if open {
                    self.q.schedule(self.slice_clock.end_of(slice + 1), Ev::SliceTick(slice + 1));
                }
            }
            Ev::SourceWake(s) if self.run_queue() => {
                // The timer fired: the process waits for a core (once, however many fire).
                let src = &mut self.sources[s as usize];
                src.wake = None;
                if !src.queued {
                    src.queued = true;
                    let start = self.net.cpu.as_mut().expect("run queue").run(now);
                    self.q.schedule(start, Ev::SourceRun(s));
                }
            }
            Ev::SourceWake(s) | Ev::SourceRun(s) => {
                let mut local = self.local(s, now);
                let src = &mut self.sources[s as usize];
                src.wake = None;
                src.queued = false;
                // The host woke for the timer it was armed for: its clock has reached it
                // (rounding in the conversion must not leave it a nanosecond short).
                if let Some((due, at)) = src.late
                    && at <= now
                {
                    local = local.max(due);
                }
                src.node.handle_timeout(local, &self.workload);
                self.to_pump.push(s);
            }
            Ev::Rto(c) => {
                let conn = &mut self.conns[c as usize];
                conn.rto_event = None;
                let mut segs = std::mem::take(&mut self.segs);
                segs.clear();
                conn.tx.handle_timeout(now, &mut segs);
                self.send_segments(now, c, &segs);
                self.segs = segs;
                self.arm_conn(c);
            }
            Ev::DelAck(c) => {
                let conn = &mut self.conns[c as usize];
                conn.delack_event = None;
                if conn.rx.handle_timeout(now) {
                    self.send_ack(now, c);
                }
                self.arm_conn(c);
            }
            Ev::BuilderRun(b) => {
                let bl = &mut self.builders[b as usize];
                bl.queued = false;
                for item in std::mem::take(&mut bl.inbox) {
                    self.read(now, b, item);
                }
            }
            Ev::BuilderWake(b) => {
                let bl = &mut self.builders[b as usize];
                bl.wake = None;
                bl.node.handle_timeout(now);
                self.drain_outcomes(now, b);
            }
            Ev::SenderWake(s, b) => {
                if let Some(n) = self.nack.as_mut()
                    && let Some((sender, wake)) = n.senders.get_mut(&(s, b))
                {
                    *wake = None;
                    if sender.poll_timeout().is_some_and(|t| t <= now) {
                        sender.handle_timeout(now);
                    }
                }
                self.flush_sender(now, s, b);
            }
            Ev::EndpointWake(b) => {
                if let Some(n) = self.nack.as_mut() {
                    let (ep, wake) = &mut n.endpoints[b as usize];
                    *wake = None;
                    if ep.poll_timeout().is_some_and(|t| t <= now) {
                        ep.handle_timeout(now);
                    }
                }
                self.flush_endpoint(now, b);
            }
            Ev::DfmWake => {
                if let Some(d) = self.dfm.as_mut() {
                    d.wake = None;
                    d.node.handle_timeout(now);
                }
                self.dfm_outputs(now);
            }
        }
        self.pump(now);
    }

    /// Sends one pull control packet.
    fn send_control(&mut self, now: Instant, src: NodeId, dst: NodeId, body: Body) {
        let pkt = Packet { src, dst, size: wire_size(CONTROL_PACKET), damaged: false, body };
        let q = &mut self.q;
        self.net.send(now, src, pkt, &mut |t, e| q.schedule(t, Ev::Net(e)));
        self.control_packets += 1;
    }

    /// The manager's assignments go out; its next timer is armed.
    fn dfm_outputs(&mut self, now: Instant) {
        let Some(d) = self.dfm.as_mut() else { return };
        let host = d.host;
        let mut out = Vec::new();
        while let Some(a) = d.node.poll_assignment() {
            out.push(a);
        }
        while d.node.poll_event().is_some() {}
        if let Some(t) = rearm(&mut d.wake, d.node.poll_timeout()) {
            self.q.schedule(t, Ev::DfmWake);
        }
        for a in out {
            let dst = self.builders[a.builder as usize].host;
            self.send_control(now, host, dst, Body::Assign { builder: a.builder, slice: a.slice });
        }
    }

    /// A pull builder's requests go to the sources, its returned credits to the manager.
    fn builder_outputs(&mut self, now: Instant, b: u32) {
        let host = self.builders[b as usize].host;
        while let Some(r) = self.builders[b as usize].node.poll_request() {
            let dst = self.sources[r.source as usize].host;
            self.send_control(now, host, dst, Body::Request { builder: b, source: r.source, slice: r.slice });
        }
        let Some(dfm_host) = self.dfm.as_ref().map(|d| d.host) else { return };
        while let Some(slice) = self.builders[b as usize].node.poll_done() {
            self.send_control(now, host, dfm_host, Body::Done { builder: b, slice });
        }
    }

    /// Drains every source node that may have something to send.
    fn pump(&mut self, now: Instant) {
        while let Some(s) = self.to_pump.pop() {
            let local = self.local(s, now);
            while let Some(tx) = self.sources[s as usize].node.poll_transmit(local) {
                self.transmit(now, s, tx);
            }
            self.arm_source(s);
        }
    }

    /// Schedules the source node's next timeout, unless it falls on a slice boundary (the
    /// slice tick wakes it then).
    fn arm_source(&mut self, s: u32) {
        let clock = self.slice_clock;
        let ticks = self.clocks.is_none();
        let due =
            self.sources[s as usize].node.poll_timeout().filter(|&t| !ticks || clock.start_of(clock.slice_at(t)) != t);
        // Every timer of a software host fires late, the slice tick's (above) and these;
        // a host with a clock of its own fires them when its clock says.
        let due = match due {
            Some(t) if self.timers_fire_late() || !ticks => Some(self.late_wake(s, t)),
            other => other,
        };
        let src = &mut self.sources[s as usize];
        if let Some(t) = rearm(&mut src.wake, due) {
            self.q.schedule(t, Ev::SourceWake(s));
        }
    }

    /// When source `s`'s host wakes for a timer due at `due`: drawn once per timer.
    fn late_wake(&mut self, s: u32, due: Instant) -> Instant {
        let true_due = self.true_time(s, due);
        let src = &mut self.sources[s as usize];
        match src.late {
            Some((d, at)) if d == due => at,
            _ => {
                let at = true_due + self.wake_latency.draw(s);
                src.late = Some((due, at));
                at
            }
        }
    }

    /// Source `s`'s clock at true time `t`.
    fn local(&self, s: u32, t: Instant) -> Instant {
        let Some(clocks) = &self.clocks else { return t };
        let (offset, drift_ppb) = clocks[s as usize];
        let ns = t.as_nanos() as i128;
        Instant::from_nanos((ns + ns * drift_ppb as i128 / 1_000_000_000 + offset as i128).max(0) as u64)
    }

    /// The true time at which source `s`'s clock reads `local` (never before the start).
    fn true_time(&self, s: u32, local: Instant) -> Instant {
        let Some(clocks) = &self.clocks else { return local };
        let (offset, drift_ppb) = clocks[s as usize];
        let ns = (local.as_nanos() as i128 - offset as i128) * 1_000_000_000 / (1_000_000_000 + drift_ppb as i128);
        // Rounded up, so that the host's clock has reached `local` by then.
        Instant::from_nanos((ns + 1).max(0) as u64)
    }

    fn transmit(&mut self, now: Instant, s: u32, tx: SourceTransmit) {
        if tx.kind == TransmitKind::Data && tx.first() {
            let ready_ns = self.slice_clock.end_of(tx.slice).as_nanos();
            *self.record(s, tx.slice) = FragRecord {
                source: s,
                slice: tx.slice,
                builder: tx.dest,
                bytes: tx.frame_len as u32,
                burst: tx.flags.contains(Flags::BURST),
                cut_off: tx.flags.contains(Flags::CUT_OFF),
                ready_ns,
                sent_ns: now.as_nanos().max(1),
                arrived_ns: 0,
            };
        }
        if self.tcp {
            let c = s * self.n_builders + tx.dest;
            self.conns[c as usize].writes.push_back((tx.slice, tx.kind, tx.len(), tx.last));
            self.try_write(now, c);
        } else if self.nack.is_some() {
            self.send_datagrams(now, s, &tx);
            if tx.last {
                let local = self.local(s, now);
                self.sources[s as usize].node.handle_sent(local, s, tx.slice);
                self.to_pump.push(s);
            }
        } else {
            self.send_udp(now, s, &tx);
            if tx.last {
                let local = self.local(s, now);
                self.sources[s as usize].node.handle_sent(local, s, tx.slice);
                self.to_pump.push(s);
            }
        }
    }

    /// Datagram transport: each part of a frame to the stream's sender as the shaper
    /// releases it (its datagrams leave at the shaper's pace), or the end of the stream.
    fn send_datagrams(&mut self, now: Instant, s: u32, tx: &SourceTransmit) {
        let n = self.nack.as_mut().expect("datagram transport");
        let cfg = n.cfg;
        let (sender, _) =
            n.senders.entry((s, tx.dest)).or_insert_with(|| (DatagramSender::new(cfg, 1, s, tx.dest), None));
        match tx.kind {
            TransmitKind::Data => {
                let len = tx.len() as usize;
                if n.zeros.len() < len {
                    n.zeros.resize(len, 0);
                }
                sender.handle_frame_part(now, tx.slice, tx.frame_len as u32, &n.zeros[..len]);
                if tx.last {
                    // Lost = sent and never arrived, after retransmissions.
                    self.udp_frags_sent += 1;
                }
            }
            TransmitKind::EndOfStream if tx.last => sender.handle_end(now),
            TransmitKind::EndOfStream => {}
        }
        self.flush_sender(now, s, tx.dest);
    }

    fn send_datagram(&mut self, now: Instant, src: NodeId, dst: NodeId, d: Bytes) {
        let size = wire_size(d.len() as u32 + UDP_HEADER + IP_HEADER);
        let pkt = Packet { src, dst, size, damaged: false, body: Body::Dgram(d) };
        let q = &mut self.q;
        self.net.send(now, src, pkt, &mut |t, e| q.schedule(t, Ev::Net(e)));
        if let Some(n) = self.nack.as_mut() {
            n.datagrams += 1;
        }
    }

    /// A stream's datagrams go out; its next timer is armed.
    fn flush_sender(&mut self, now: Instant, s: u32, b: u32) {
        let (src, dst) = (self.sources[s as usize].host, self.builders[b as usize].host);
        let mut out = Vec::new();
        let Some(n) = self.nack.as_mut() else { return };
        let Some((sender, wake)) = n.senders.get_mut(&(s, b)) else { return };
        while let Some(d) = sender.poll_transmit() {
            out.push(d);
        }
        if let Some(t) = rearm(wake, sender.poll_timeout()) {
            self.q.schedule(t, Ev::SenderWake(s, b));
        }
        for d in out {
            self.send_datagram(now, src, dst, d);
        }
    }

    /// A builder endpoint's NACKs and acknowledgements go out, its frames, damage and ends
    /// of stream to the node; its timer is armed.
    fn flush_endpoint(&mut self, now: Instant, b: u32) {
        let Some(n) = self.nack.as_mut() else { return };
        let (ep, wake) = &mut n.endpoints[b as usize];
        let mut back = Vec::new();
        while let Some(x) = ep.poll_transmit() {
            back.push(x);
        }
        let mut events = Vec::new();
        while let Some(e) = ep.poll_event() {
            events.push(e);
        }
        if let Some(t) = rearm(wake, ep.poll_timeout()) {
            self.q.schedule(t, Ev::EndpointWake(b));
        }
        let host = self.builders[b as usize].host;
        for (s, d) in back {
            let dst = self.sources[s as usize].host;
            self.send_datagram(now, host, dst, d);
        }
        for e in events {
            match e {
                EndpointEvent::Fragment(f) => self.fragment_arrived(now, f.source, b, f.slice, f.recovered),
                EndpointEvent::Damaged { source, n } => self.builders[b as usize].node.handle_damaged(source, n),
                EndpointEvent::Ended { source } => self.builders[b as usize].node.handle_end_of_stream(now, source),
            }
        }
        self.drain_outcomes(now, b);
    }

    fn send_udp(&mut self, now: Instant, s: u32, tx: &SourceTransmit) {
        let src_host = self.sources[s as usize].host;
        let dst = self.builders[tx.dest as usize].host;
        let mut left = tx.len() as u32;
        while left > 0 {
            let dgram_bytes = left.min(MAX_DATAGRAM);
            left -= dgram_bytes;
            let ip_payload = dgram_bytes + UDP_HEADER;
            let n = ip_payload.div_ceil(IP_FRAGMENT_PAYLOAD);
            let dgram = self.next_dgram;
            self.next_dgram += 1;
            for i in 0..n {
                let part = if i + 1 == n { ip_payload - i * IP_FRAGMENT_PAYLOAD } else { IP_FRAGMENT_PAYLOAD };
                let pkt = Packet {
                    src: src_host,
                    dst,
                    size: wire_size(part + IP_HEADER),
                    damaged: false,
                    body: Body::Udp {
                        source: s,
                        slice: tx.slice,
                        kind: tx.kind,
                        dgram,
                        ip_fragments: n as u16,
                        dgram_bytes,
                        fragment_bytes: tx.frame_len as u32,
                    },
                };
                let q = &mut self.q;
                self.net.send(now, src_host, pkt, &mut |t, e| q.schedule(t, Ev::Net(e)));
                self.udp_ip_sent += 1;
            }
        }
        if tx.last && tx.kind == TransmitKind::Data {
            self.udp_frags_sent += 1;
        }
    }

    /// Moves pending application writes into the connection's socket buffer.
    fn try_write(&mut self, now: Instant, c: u32) {
        let source = self.conns[c as usize].source;
        let local = self.local(source, now);
        let conn = &mut self.conns[c as usize];
        loop {
            let used = conn.tx.written() - conn.tx.acked();
            let space = conn.sndbuf.saturating_sub(used);
            let Some(front) = conn.writes.front_mut() else { break };
            if space == 0 {
                break;
            }
            let n = front.2.min(space);
            conn.tx.write(n);
            front.2 -= n;
            if front.2 > 0 {
                break;
            }
            let (slice, kind, _, last) = conn.writes.pop_front().expect("front exists");
            if last {
                conn.ends.push_back((conn.tx.written(), slice, kind));
                // The last byte is in the socket buffer: the source node counts it sent.
                self.sources[source as usize].node.handle_sent(local, source, slice);
                self.to_pump.push(source);
            }
        }
        let mut segs = std::mem::take(&mut self.segs);
        segs.clear();
        self.conns[c as usize].tx.poll_segments(now, &mut segs);
        self.send_segments(now, c, &segs);
        self.segs = segs;
        self.arm_conn(c);
    }

    fn send_segments(&mut self, now: Instant, c: u32, segs: &[Segment]) {
        let (src, dst) = (self.conns[c as usize].src, self.conns[c as usize].dst);
        for seg in segs {
            let pkt = Packet {
                src,
                dst,
                size: wire_size(seg.len + crate::tcp::HEADER),
                damaged: false,
                body: Body::Data { conn: c, seq: seg.seq, len: seg.len },
            };
            let q = &mut self.q;
            self.net.send(now, src, pkt, &mut |t, e| q.schedule(t, Ev::Net(e)));
        }
    }

    fn send_ack(&mut self, now: Instant, c: u32) {
        let conn = &self.conns[c as usize];
        let pkt = Packet {
            src: conn.dst,
            dst: conn.src,
            size: wire_size(crate::tcp::HEADER),
            damaged: false,
            body: Body::Ack { conn: c, ack: conn.rx.delivered(), sack: conn.rx.sack_blocks() },
        };
        let host = conn.dst;
        let q = &mut self.q;
        self.net.send(now, host, pkt, &mut |t, e| q.schedule(t, Ev::Net(e)));
    }

    /// Schedules the connection's timers lazily (one pending event per timer at most,
    /// unless the timer moved earlier).
    fn arm_conn(&mut self, c: u32) {
        let conn = &mut self.conns[c as usize];
        if let Some(t) = rearm(&mut conn.rto_event, conn.tx.timer()) {
            self.q.schedule(t, Ev::Rto(c));
        }
        if let Some(t) = rearm(&mut conn.delack_event, conn.rx.delack_timer()) {
            self.q.schedule(t, Ev::DelAck(c));
        }
    }

    /// Whether a source's timers fire late, through its wake-up latency or the run queue
    /// (hardware boards: on time).
    fn timers_fire_late(&self) -> bool {
        !self.wake_latency.is_zero() || self.run_queue()
    }

    /// Whether processes wait for a core (`topology.cpu_wake_us` with the CPU model).
    fn run_queue(&self) -> bool {
        self.net.cpu.as_ref().is_some_and(|c| c.has_run_queue())
    }

    /// Hands `item` to builder `b`'s process: at once, or with the run queue when the
    /// process next gets a core (everything that arrived by then is read in that turn).
    fn hand_to_builder(&mut self, now: Instant, b: u32, item: Readable) {
        if !self.run_queue() {
            return self.read(now, b, item);
        }
        let bl = &mut self.builders[b as usize];
        bl.inbox.push(item);
        if !bl.queued {
            bl.queued = true;
            let start = self.net.cpu.as_mut().expect("run queue").run(now);
            self.q.schedule(start, Ev::BuilderRun(b));
        }
    }

    /// Builder `b`'s process reads `item`.
    fn read(&mut self, now: Instant, b: u32, item: Readable) {
        match item {
            Readable::Frame { source, slice, kind } => self.frame_arrived(now, source, b, slice, kind),
            Readable::Packet(host, pkt) => self.receive_now(now, host, pkt),
        }
    }

    /// A packet reaches `host`: the kernel's part (TCP) at once, a datagram for a builder
    /// through its process.
    fn receive(&mut self, now: Instant, host: NodeId, pkt: Packet<Body>) {
        if self.run_queue()
            && matches!(pkt.body, Body::Udp { .. } | Body::Dgram(_))
            && let Some(&b) = self.builder_of_host.get(&host)
        {
            return self.hand_to_builder(now, b, Readable::Packet(host, pkt));
        }
        self.receive_now(now, host, pkt)
    }

    fn receive_now(&mut self, now: Instant, host: NodeId, pkt: Packet<Body>) {
        match pkt.body {
            Body::Data { conn: c, seq, len } => {
                let conn = &mut self.conns[c as usize];
                if conn.rx.handle_segment(now, seq, len) == AckDecision::Now {
                    self.send_ack(now, c);
                }
                let conn = &mut self.conns[c as usize];
                let mut done = Vec::new();
                while let Some(&(end, slice, kind)) = conn.ends.front() {
                    if end > conn.rx.delivered() {
                        break;
                    }
                    conn.ends.pop_front();
                    done.push((slice, kind));
                }
                let (source, builder) = (conn.source, conn.builder);
                for (slice, kind) in done {
                    self.hand_to_builder(now, builder, Readable::Frame { source, slice, kind });
                }
                self.arm_conn(c);
            }
            Body::Ack { conn: c, ack, sack } => {
                let mut segs = std::mem::take(&mut self.segs);
                segs.clear();
                self.conns[c as usize].tx.handle_ack(now, ack, &sack, &mut segs);
                self.send_segments(now, c, &segs);
                self.segs = segs;
                self.try_write(now, c);
            }
            Body::Udp { source, slice, kind, dgram, ip_fragments, dgram_bytes, fragment_bytes } => {
                let got = self.udp_dgrams.entry(dgram).or_insert(0);
                *got += 1;
                if *got < ip_fragments {
                    return;
                }
                self.udp_dgrams.remove(&dgram);
                let p = self.udp_progress.entry((source, slice)).or_insert(0);
                *p += dgram_bytes;
                if *p >= fragment_bytes {
                    self.udp_progress.remove(&(source, slice));
                    let builder = self.builder_of_host[&host];
                    self.frame_arrived(now, source, builder, slice, kind);
                }
            }
            Body::Dgram(bytes) => {
                if let Some(&b) = self.builder_of_host.get(&host) {
                    let n = self.nack.as_mut().expect("datagram transport");
                    // A refused datagram is counted by the endpoint.
                    let _ = n.endpoints[b as usize].0.handle_bytes(now, &bytes);
                    self.flush_endpoint(now, b);
                } else if let Ok(d) = Datagram::decode(&bytes) {
                    let (s, b) = (d.header.source, d.header.builder);
                    if let Some((sender, _)) = self.nack.as_mut().and_then(|n| n.senders.get_mut(&(s, b))) {
                        sender.handle_datagram(now, &d);
                    }
                    self.flush_sender(now, s, b);
                }
            }
            Body::Request { builder, source, slice } => {
                let s = self.source_of_host[&host];
                let local = self.local(s, now);
                self.sources[s as usize].node.handle_request(local, source, PullRequest { builder, slice });
                self.to_pump.push(s);
            }
            Body::Assign { builder, slice } => {
                self.builders[builder as usize].node.handle_assignment(now, slice);
                self.drain_outcomes(now, builder);
            }
            Body::Done { builder, slice } => {
                if let Some(d) = self.dfm.as_mut() {
                    d.node.handle_done(now, builder, slice);
                }
                self.dfm_outputs(now);
            }
        }
    }

    fn frame_arrived(&mut self, now: Instant, source: u32, builder: u32, slice: SliceNumber, kind: TransmitKind) {
        if kind == TransmitKind::EndOfStream {
            self.builders[builder as usize].node.handle_end_of_stream(now, source);
            self.drain_outcomes(now, builder);
            return;
        }
        self.fragment_arrived(now, source, builder, slice, false);
        self.drain_outcomes(now, builder);
    }

    fn fragment_arrived(&mut self, now: Instant, source: u32, builder: u32, slice: SliceNumber, recovered: bool) {
        let r = self.record(source, slice);
        r.arrived_ns = now.as_nanos();
        // Delays are measured from the records; the send time stays unknown to the node.
        let arrival = Arrival {
            source,
            slice,
            wire_bytes: u64::from(r.bytes),
            cut_off: r.cut_off,
            send_time: Instant::ZERO,
            recovered,
            late: false,
        };
        self.builders[builder as usize].node.handle_fragment(now, arrival, ());
    }

    /// Processed slices go straight through the (instant) filter; a pull builder's
    /// requests and credit reports go out.
    fn drain_outcomes(&mut self, now: Instant, builder: u32) {
        let b = &mut self.builders[builder as usize];
        while let Some(o) = b.node.poll_slice() {
            b.node.handle_released(o.bytes);
        }
        self.builder_outputs(now, builder);
        let b = &mut self.builders[builder as usize];
        if let Some(t) = rearm(&mut b.wake, b.node.poll_timeout()) {
            self.q.schedule(t, Ev::BuilderWake(builder));
        }
    }

    fn finish(mut self, end: Instant, wall_s: f64) -> SimResult {
        for b in 0..self.builders.len() as u32 {
            self.builders[b as usize].node.handle_drain(end);
            self.drain_outcomes(end, b);
        }
        // Fragments the source nodes still hold at the end count as unsent.
        let mut sources = BTreeMap::new();
        let mut transmits = Vec::new();
        for s in &self.sources {
            let r = s.node.report();
            sources.extend(r.tallies);
            transmits.extend(r.transmits);
        }
        transmits.sort_by_key(|t| t.at);
        let reports: Vec<_> = self.builders.iter().map(|b| b.node.report()).collect();
        let builders: BTreeMap<u32, _> = reports.iter().map(|r| (r.id, r.tally.clone())).collect();
        let ledger = Ledger::combine(&sources, &builders);

        let d = self.delays();
        let (mut segs, mut retx, mut tos, mut probes) = (0, 0, 0, 0);
        for c in &self.conns {
            segs += c.tx.stats.segments;
            retx += c.tx.stats.retransmitted;
            tos += c.tx.stats.timeouts;
            probes += c.tx.stats.loss_probes;
        }
        let arrived = self.records.iter().filter(|r| r.arrived_ns > 0).count() as u64;
        let udp_lost = if self.tcp { 0 } else { self.udp_frags_sent - arrived.min(self.udp_frags_sent) };
        let (burst_hist, burst_mean) = self.burst_histogram();
        let summary = SimSummary {
            name: self.sc.name.clone(),
            seed: self.sc.seed,
            transport: self.sc.traffic.transport.clone(),
            policy: self.sc.traffic.policy.clone(),
            sources: self.sources.len() as u32,
            builders: self.n_builders,
            slices: self.n_slices,
            fragment_bytes: if self.sc.traffic.bursts {
                self.sc.traffic.base_fragment_bytes
            } else {
                self.sc.traffic.fragment_bytes
            },
            fragments_produced: self.records.len() as u64,
            fragments_arrived: arrived,
            network_delay_avg_us: d.net.0,
            network_delay_steady_avg_us: d.steady.0,
            network_delay_steady_p99_us: d.steady.1,
            network_delay_steady_max_us: d.steady.2,
            network_delay_steady_p99_worst_builder_us: d.steady_p99_worst_builder,
            network_delay_p99_us: d.net.1,
            network_delay_max_us: d.net.2,
            shaping_delay_avg_us: d.shaping.0,
            shaping_delay_p99_us: d.shaping.1,
            shaping_delay_max_us: d.shaping.2,
            slice_delay_avg_us: d.slice.0,
            slice_delay_p99_us: d.slice.1,
            tcp_segments: segs,
            tcp_retransmitted: retx,
            tcp_retransmit_fraction: if segs > 0 { retx as f64 / segs as f64 } else { 0.0 },
            tcp_timeouts: tos,
            tcp_loss_probes: probes,
            packet_arrivals: self.net.arrivals,
            cpu_busy_fraction: self.net.cpu.as_ref().map(|c| c.busy_fraction(end - Instant::ZERO)),
            process_wakeups: self.net.cpu.as_ref().map_or(0, |c| c.wakes()),
            process_wait_s: self.net.cpu.as_ref().map_or(0.0, |c| c.waited().as_secs_f64()),
            udp_ip_fragments_sent: self.udp_ip_sent,
            udp_fragments_sent: self.udp_frags_sent,
            udp_fragments_lost: udp_lost,
            udp_fragment_loss_fraction: if self.udp_frags_sent > 0 {
                udp_lost as f64 / self.udp_frags_sent as f64
            } else {
                0.0
            },
            slices_complete: reports.iter().map(|r| r.slices_complete).sum(),
            slices_incomplete: reports.iter().map(|r| r.slices_incomplete).sum(),
            queue_drops: self.net.ports.iter().map(|p| p.stats.dropped).sum(),
            damaged_packets: self.net.ports.iter().map(|p| p.stats.damaged).sum(),
            injected_drops: self.net.ports.iter().map(|p| p.stats.lost).sum(),
            ledger: ledger.buckets().map(|(b, n)| (b.name().to_string(), n)).collect(),
            ledger_produced: ledger.produced,
            ledger_unaccounted: ledger.unaccounted(),
            burst_mean_fraction: burst_mean,
            burst_histogram: if self.sc.traffic.bursts { burst_hist } else { Vec::new() },
            dfm: self.dfm.as_ref().map(|d| d.node.stats().clone()),
            pull: self.dfm.as_ref().map(|_| {
                let mut total = shoal_core::node::PullStats::default();
                for p in reports.iter().filter_map(|r| r.pull.as_ref()) {
                    total.merge(p);
                }
                total
            }),
            control_packets: self.control_packets,
            udp_nack: self.nack.as_ref().map(|n| {
                let mut sum = NackSummary { datagrams: n.datagrams, ..Default::default() };
                for (sender, _) in n.senders.values() {
                    sum.sender.merge(sender.stats());
                }
                for (ep, _) in &n.endpoints {
                    sum.receiver.merge(&ep.receiver_totals());
                }
                sum
            }),
            events: self.q.processed(),
            wall_s,
        };
        SimResult { summary, records: self.records, transmits, builders: reports }
    }
    /// The run's delays from its fragment records: network (all, and steady from the
    /// warm-up on, also per builder), shaping, and each slice's last arrival after its end.
    fn delays(&self) -> Delays {
        let mut net_delays: Vec<u64> = Vec::new();
        let mut steady: Vec<u64> = Vec::new();
        let mut steady_by_builder: Vec<Vec<u64>> = vec![Vec::new(); self.builders.len()];
        let mut shaping: Vec<u64> = Vec::new();
        let steady_from = shoal_core::node::steady_from(0, self.slice_clock);
        for r in &self.records {
            if r.sent_ns > 0 {
                // A source whose clock is ahead sends before the slice's true end.
                shaping.push(r.sent_ns.saturating_sub(r.ready_ns));
                if r.arrived_ns > 0 {
                    net_delays.push(r.arrived_ns - r.sent_ns);
                    if r.slice >= steady_from {
                        steady.push(r.arrived_ns - r.sent_ns);
                        if let Some(v) = steady_by_builder.get_mut(r.builder as usize) {
                            v.push(r.arrived_ns - r.sent_ns);
                        }
                    }
                }
            }
        }
        // Per slice (a record for every source and slice): its last arrival, or None once
        // a fragment of it never arrived.
        let mut last_arrival: BTreeMap<SliceNumber, Option<u64>> = BTreeMap::new();
        for r in &self.records {
            let e = last_arrival.entry(r.slice).or_insert(Some(0));
            *e = match (*e, r.arrived_ns) {
                (Some(t), a) if a > 0 => Some(t.max(a)),
                _ => None,
            };
        }
        let mut slice_delays: Vec<u64> = last_arrival
            .iter()
            .filter_map(|(&slice, &t)| Some(t?.saturating_sub(self.slice_clock.end_of(slice).as_nanos())))
            .collect();
        Delays {
            net: delay_stats(&mut net_delays),
            steady: delay_stats(&mut steady),
            steady_p99_worst_builder: steady_by_builder.iter_mut().map(|v| delay_stats(v).1).fold(0.0, f64::max),
            shaping: delay_stats(&mut shaping),
            slice: delay_stats(&mut slice_delays),
        }
    }

    /// How many slices had k sources in a burst, for every k, and the mean fraction.
    fn burst_histogram(&self) -> (Vec<u64>, f64) {
        let mut burst_hist = vec![0u64; self.sources.len() + 1];
        let bursts = self.workload.bursts.borrow();
        for slice in 0..self.n_slices {
            burst_hist[bursts.get(&slice).copied().unwrap_or(0) as usize] += 1;
        }
        let n = self.sources.len() as f64;
        let burst_mean =
            burst_hist.iter().enumerate().map(|(k, &c)| k as f64 * c as f64).sum::<f64>() / self.n_slices as f64 / n;
        (burst_hist, burst_mean)
    }
}

/// Delay statistics of a run in microseconds: (mean, p99, max).
struct Delays {
    net: (f64, f64, f64),
    steady: (f64, f64, f64),
    steady_p99_worst_builder: f64,
    shaping: (f64, f64, f64),
    slice: (f64, f64, f64),
}

/// (mean, p99, max) of nanosecond delays, in microseconds; sorts `v`.
fn delay_stats(v: &mut [u64]) -> (f64, f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    v.sort_unstable();
    let avg = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
    let p99 = v[((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1];
    (avg / 1e3, p99 as f64 / 1e3, *v.last().expect("non-empty") as f64 / 1e3)
}
