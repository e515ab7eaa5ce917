//! Hosts, switches and ports.
//!
//! A duplex link is two [`Port`]s, one per direction. A port serialises one packet at a
//! time at its rate, then the packet propagates for the port's delay and arrives at the
//! other end; or, with a token bucket ([`PortSpec::bucket_bytes`], the testbed's `tbf`),
//! sends its head packet at once when the bucket holds its bytes, else when it will. Packets waiting plus the one being serialised count against the drop-tail
//! limit (packets and/or bytes); a packet that does not fit is dropped and counted. A packet
//! of `b` bits is damaged on a port with bit error rate `ber` with probability
//! `1 - (1 - ber)^b`; the next node (a store-and-forward switch or a host) discards it,
//! counted. Switches forward by destination host along shortest paths.
//!
//! With a [`SharedCpu`] (software nodes on one machine, as the testbed's namespaces are),
//! every node takes a packet in only once a core has spent the per-packet cost on it, first
//! come first served: a burst of packets waits for the cores as it waits in a queue.

use std::collections::VecDeque;

use rand::{RngExt, SeedableRng};
use rand_pcg::Pcg64Mcg;
use shoal_core::{Duration, Instant};

pub type NodeId = usize;
pub type PortId = usize;

/// Ethernet framing added to every IP packet on the wire: preamble 8 + header 14 + FCS 4 +
/// inter-frame gap 12 bytes.
pub const ETHERNET_OVERHEAD: u32 = 38;
/// The smallest Ethernet frame on the wire including preamble and gap (64 + 20).
pub const MIN_WIRE: u32 = 84;

/// The wire size of an IP packet of `ip_bytes`.
pub fn wire_size(ip_bytes: u32) -> u32 {
    (ip_bytes + ETHERNET_OVERHEAD).max(MIN_WIRE)
}

/// Properties of one direction of a link.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PortSpec {
    pub rate_bps: u64,
    pub delay: Duration,
    /// Drop-tail limit in packets (None: unlimited).
    pub queue_packets: Option<usize>,
    /// Drop-tail limit in bytes (None: unlimited).
    pub queue_bytes: Option<u64>,
    /// Bit error rate.
    pub ber: f64,
    /// Probability that a packet is lost on the way, whatever its size (the testbed's
    /// injected random loss, `--loss-pct`, on every switch port toward a host).
    pub loss: f64,
    /// A token bucket of this depth refilled at `rate_bps` in place of serialisation: an
    /// idle port lets this many bytes through at once (a software shaper over a link with
    /// no rate of its own). None: a wire.
    pub bucket_bytes: Option<u64>,
}

/// A packet in flight. `body` is the transport's business.
#[derive(Clone, Debug, PartialEq)]
pub struct Packet<B> {
    pub src: NodeId,
    pub dst: NodeId,
    /// Size on the wire in bytes (see [`wire_size`]).
    pub size: u32,
    pub damaged: bool,
    pub body: B,
}

/// Counters of one port.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortStats {
    pub packets: u64,
    pub bytes: u64,
    pub dropped: u64,
    pub damaged: u64,
    /// Lost at random ([`PortSpec::loss`]).
    pub lost: u64,
    pub max_queue: usize,
}

#[derive(Debug)]
pub struct Port<B> {
    pub spec: PortSpec,
    pub from: NodeId,
    pub to: NodeId,
    queue: VecDeque<Packet<B>>,
    queued_bytes: u64,
    busy: bool,
    /// With a bucket: its bytes as of `tokens_at`.
    tokens: f64,
    tokens_at: Instant,
    pub stats: PortStats,
}

impl<B> Port<B> {
    /// Tokens accrued at the rate since last counted, up to the bucket's depth.
    fn refill(&mut self, now: Instant) {
        let depth = self.spec.bucket_bytes.unwrap_or(0) as f64;
        let accrued = (now - self.tokens_at).as_nanos() as f64 * self.spec.rate_bps as f64 / 8e9;
        self.tokens = (self.tokens + accrued).min(depth);
        self.tokens_at = now;
    }
}

#[derive(Debug)]
enum Node {
    Host { uplink: Option<PortId> },
    Switch { route: Vec<Option<PortId>> },
}

/// What the network asks the driver to schedule.
#[derive(Debug)]
pub enum NetEvent<B> {
    /// The port finished serialising its head packet.
    TxDone(PortId),
    /// A packet reaches the far end of a port.
    Arrive(PortId, Packet<B>),
    /// With a [`SharedCpu`]: a core has taken in a packet that arrived over the port.
    Processed(PortId, Packet<B>),
}

/// The cores every software node shares: each packet a node (host or switch) takes in
/// costs one core `per_packet`, and each wake-up of a process (a source woken by its timer,
/// a builder woken by data to read) costs one core `per_wake`: both served in the order they
/// ask by the first core free. A process that asks when every core is busy waits in the run
/// queue, which is where a software host's tail of delays comes from.
#[derive(Clone, Debug)]
pub struct SharedCpu {
    free_at: Vec<Instant>,
    per_packet: Duration,
    per_wake: Duration,
    busy: Duration,
    wakes: u64,
    waited: Duration,
}

impl SharedCpu {
    pub fn new(cores: usize, per_packet: Duration) -> Self {
        Self {
            free_at: vec![Instant::ZERO; cores.max(1)],
            per_packet,
            per_wake: Duration::ZERO,
            busy: Duration::ZERO,
            wakes: 0,
            waited: Duration::ZERO,
        }
    }

    /// Processes share the cores too, each wake-up costing `per_wake` (zero: processes take
    /// no time and never wait, the model per packet alone).
    pub fn with_wake_cost(mut self, per_wake: Duration) -> Self {
        self.per_wake = per_wake;
        self
    }

    /// Whether processes wait for a core ([`SharedCpu::run`]).
    pub fn has_run_queue(&self) -> bool {
        !self.per_wake.is_zero()
    }

    /// Core time spent so far, packets and wake-ups.
    pub fn busy(&self) -> Duration {
        self.busy
    }

    /// Process wake-ups served so far.
    pub fn wakes(&self) -> u64 {
        self.wakes
    }

    /// The time processes spent runnable, waiting for a core, summed (the testbed measures
    /// the same: `cpu_wait.total_s`).
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// The cores' busy fraction over `span`.
    pub fn busy_fraction(&self, span: Duration) -> f64 {
        self.busy.as_secs_f64() / (self.free_at.len() as f64 * span.as_secs_f64()).max(f64::MIN_POSITIVE)
    }

    /// Reserves the first free core from `now` for `cost`: when the work starts.
    fn reserve(&mut self, now: Instant, cost: Duration) -> Instant {
        let core = self.free_at.iter_mut().min().expect("at least one core");
        let start = (*core).max(now);
        *core = start + cost;
        self.busy += cost;
        start
    }

    /// A packet arrives at `now`: when a core has taken it in.
    fn take(&mut self, now: Instant) -> Instant {
        self.reserve(now, self.per_packet) + self.per_packet
    }

    /// A process becomes runnable at `now`: when it gets a core (and runs; it holds the
    /// core `per_wake` from then).
    pub fn run(&mut self, now: Instant) -> Instant {
        self.wakes += 1;
        let start = self.reserve(now, self.per_wake);
        self.waited += start - now;
        start
    }
}

/// The topology and its queues.
#[derive(Debug)]
pub struct Network<B> {
    nodes: Vec<Node>,
    pub ports: Vec<Port<B>>,
    rng: Pcg64Mcg,
    /// Damaged packets discarded at hosts (they count in the sending port's `damaged`).
    pub discarded_damaged: u64,
    /// Software nodes sharing cores (None: nodes take no time).
    pub cpu: Option<SharedCpu>,
    /// Packets taken in by a node (host or switch), in total.
    pub arrivals: u64,
}

impl<B> Network<B> {
    pub fn new(seed: u64) -> Self {
        Self {
            nodes: Vec::new(),
            ports: Vec::new(),
            rng: Pcg64Mcg::seed_from_u64(seed),
            discarded_damaged: 0,
            cpu: None,
            arrivals: 0,
        }
    }

    pub fn add_host(&mut self) -> NodeId {
        self.nodes.push(Node::Host { uplink: None });
        self.nodes.len() - 1
    }

    pub fn add_switch(&mut self) -> NodeId {
        self.nodes.push(Node::Switch { route: Vec::new() });
        self.nodes.len() - 1
    }

    /// A duplex link: `a_to_b` is the spec from `a` to `b`, `b_to_a` the reverse. A host
    /// has exactly one link (its uplink). Returns the two port ids.
    pub fn link(&mut self, a: NodeId, b: NodeId, a_to_b: PortSpec, b_to_a: PortSpec) -> (PortId, PortId) {
        let mut add = |from, to, spec| {
            self.ports.push(Port {
                spec,
                from,
                to,
                queue: VecDeque::new(),
                queued_bytes: 0,
                busy: false,
                tokens: spec.bucket_bytes.unwrap_or(0) as f64,
                tokens_at: Instant::ZERO,
                stats: PortStats::default(),
            });
            self.ports.len() - 1
        };
        let pa = add(a, b, a_to_b);
        let pb = add(b, a, b_to_a);
        for (node, port) in [(a, pa), (b, pb)] {
            if let Node::Host { uplink } = &mut self.nodes[node] {
                assert!(uplink.is_none(), "a host has one link");
                *uplink = Some(port);
            }
        }
        (pa, pb)
    }

    /// Computes every switch's forwarding table (shortest paths by hop count).
    pub fn build_routes(&mut self) {
        let n = self.nodes.len();
        let mut out: Vec<Vec<PortId>> = vec![Vec::new(); n];
        for (id, p) in self.ports.iter().enumerate() {
            out[p.from].push(id);
        }
        let hosts: Vec<NodeId> = (0..n).filter(|&i| matches!(self.nodes[i], Node::Host { .. })).collect();
        let mut routes = vec![vec![None; n]; n];
        for &h in &hosts {
            // BFS backwards from h: for each node, the first port on a shortest path to h.
            let mut dist = vec![usize::MAX; n];
            dist[h] = 0;
            let mut frontier = VecDeque::from([h]);
            while let Some(v) = frontier.pop_front() {
                for (pid, p) in self.ports.iter().enumerate() {
                    if p.to == v && dist[p.from] == usize::MAX {
                        dist[p.from] = dist[v] + 1;
                        routes[p.from][h] = Some(pid);
                        // Only switches relay; hosts are path ends.
                        if matches!(self.nodes[p.from], Node::Switch { .. }) {
                            frontier.push_back(p.from);
                        }
                    }
                }
            }
        }
        for (i, node) in self.nodes.iter_mut().enumerate() {
            if let Node::Switch { route } = node {
                *route = std::mem::take(&mut routes[i]);
            }
        }
    }

    /// A host hands a packet to its uplink.
    pub fn send(
        &mut self,
        now: Instant,
        host: NodeId,
        packet: Packet<B>,
        sched: &mut impl FnMut(Instant, NetEvent<B>),
    ) {
        let Node::Host { uplink: Some(port) } = self.nodes[host] else { panic!("host {host} has no link") };
        self.enqueue(now, port, packet, sched);
    }

    fn enqueue(&mut self, now: Instant, port: PortId, packet: Packet<B>, sched: &mut impl FnMut(Instant, NetEvent<B>)) {
        let p = &mut self.ports[port];
        let full = p.spec.queue_packets.is_some_and(|l| p.queue.len() >= l)
            || p.spec.queue_bytes.is_some_and(|l| p.queued_bytes + u64::from(packet.size) > l);
        if full {
            p.stats.dropped += 1;
            return;
        }
        p.queued_bytes += u64::from(packet.size);
        p.queue.push_back(packet);
        p.stats.max_queue = p.stats.max_queue.max(p.queue.len());
        if !p.busy {
            self.start_tx(now, port, sched);
        }
    }

    fn serialization(spec: &PortSpec, size: u32) -> Duration {
        Duration::from_nanos((u128::from(size) * 8 * 1_000_000_000 / u128::from(spec.rate_bps)) as u64)
    }

    fn start_tx(&mut self, now: Instant, port: PortId, sched: &mut impl FnMut(Instant, NetEvent<B>)) {
        let p = &mut self.ports[port];
        let Some(size) = p.queue.front().map(|head| head.size) else { return };
        p.busy = true;
        let wait = if p.spec.bucket_bytes.is_some() {
            p.refill(now);
            // Until the bucket holds the packet's bytes.
            let short = (f64::from(size) - p.tokens).max(0.0);
            Duration::from_nanos((short * 8e9 / p.spec.rate_bps as f64).ceil() as u64)
        } else {
            Self::serialization(&p.spec, size)
        };
        sched(now + wait, NetEvent::TxDone(port));
    }

    /// Handles [`NetEvent::TxDone`]: the head packet leaves (maybe damaged), the next starts.
    pub fn handle_tx_done(&mut self, now: Instant, port: PortId, sched: &mut impl FnMut(Instant, NetEvent<B>)) {
        let p = &mut self.ports[port];
        p.busy = false;
        let Some(mut packet) = p.queue.pop_front() else { return };
        p.queued_bytes -= u64::from(packet.size);
        if p.spec.bucket_bytes.is_some() {
            p.refill(now);
            p.tokens = (p.tokens - f64::from(packet.size)).max(0.0);
        }
        p.stats.packets += 1;
        p.stats.bytes += u64::from(packet.size);
        if p.spec.ber > 0.0 {
            let bits = f64::from(packet.size) * 8.0;
            let p_damage = 1.0 - (1.0 - p.spec.ber).powf(bits);
            if self.rng.random::<f64>() < p_damage {
                packet.damaged = true;
                p.stats.damaged += 1;
            }
        }
        if p.spec.loss > 0.0 && self.rng.random::<f64>() < p.spec.loss {
            p.stats.lost += 1;
            self.start_tx(now, port, sched);
            return;
        }
        let delay = p.spec.delay;
        sched(now + delay, NetEvent::Arrive(port, packet));
        self.start_tx(now, port, sched);
    }

    /// Handles [`NetEvent::Arrive`]: a switch forwards, a host receives (`Some`). Damaged
    /// packets are discarded at the next node.
    pub fn handle_arrive(
        &mut self,
        now: Instant,
        port: PortId,
        packet: Packet<B>,
        sched: &mut impl FnMut(Instant, NetEvent<B>),
    ) -> Option<(NodeId, Packet<B>)> {
        if packet.damaged {
            // The receiving port drops a bad frame before any CPU sees it.
            self.discarded_damaged += 1;
            return None;
        }
        self.arrivals += 1;
        if let Some(cpu) = &mut self.cpu {
            sched(cpu.take(now), NetEvent::Processed(port, packet));
            return None;
        }
        self.handle_processed(now, port, packet, sched)
    }

    /// Handles [`NetEvent::Processed`] (and an arrival, without a CPU model): a switch
    /// forwards, a host receives (`Some`).
    pub fn handle_processed(
        &mut self,
        now: Instant,
        port: PortId,
        packet: Packet<B>,
        sched: &mut impl FnMut(Instant, NetEvent<B>),
    ) -> Option<(NodeId, Packet<B>)> {
        let node = self.ports[port].to;
        match &self.nodes[node] {
            Node::Host { .. } => Some((node, packet)),
            Node::Switch { route } => {
                let next = route.get(packet.dst).copied().flatten().expect("routes cover every host");
                self.enqueue(now, next, packet, sched);
                None
            }
        }
    }

    /// Draws from the network's random stream (for generators sharing the run's seed).
    pub fn rng(&mut self) -> &mut Pcg64Mcg {
        &mut self.rng
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EventQueue;

    fn spec(rate_bps: u64, delay_us: u64, queue: Option<usize>) -> PortSpec {
        PortSpec {
            rate_bps,
            delay: Duration::from_micros(delay_us),
            queue_packets: queue,
            queue_bytes: None,
            ber: 0.0,
            loss: 0.0,
            bucket_bytes: None,
        }
    }

    /// Host `a` -> switch -> host `b`: a fast first hop, `to_b` from the switch to `b`.
    fn line(to_b: PortSpec) -> (Network<u32>, NodeId, NodeId, NodeId) {
        let mut net = Network::new(1);
        let a = net.add_host();
        let s = net.add_switch();
        let b = net.add_host();
        net.link(a, s, spec(10_000_000_000, 0, None), spec(10_000_000_000, 0, None));
        net.link(s, b, to_b, spec(to_b.rate_bps, 0, None));
        net.build_routes();
        (net, a, s, b)
    }

    /// Runs until idle; returns (arrival time, packet id) at hosts.
    fn run(net: &mut Network<u32>, q: &mut EventQueue<NetEvent<u32>>) -> Vec<(u64, NodeId, u32)> {
        let mut got = Vec::new();
        while let Some((now, ev)) = q.pop(Instant::MAX) {
            let mut pending = Vec::new();
            let mut sched = |t, e| pending.push((t, e));
            match ev {
                NetEvent::TxDone(p) => net.handle_tx_done(now, p, &mut sched),
                NetEvent::Arrive(p, pkt) => {
                    if let Some((host, pkt)) = net.handle_arrive(now, p, pkt, &mut sched) {
                        got.push((now.as_nanos(), host, pkt.body));
                    }
                }
                NetEvent::Processed(p, pkt) => {
                    if let Some((host, pkt)) = net.handle_processed(now, p, pkt, &mut sched) {
                        got.push((now.as_nanos(), host, pkt.body));
                    }
                }
            }
            for (t, e) in pending {
                q.schedule(t, e);
            }
        }
        got
    }

    fn three_hop() -> (Network<u32>, NodeId, NodeId) {
        // a --(50 Mbit/s, 2 us)-- s1 --(1 Gbit/s, 300 us)-- s2 --(500 Mbit/s, 1 us)-- b
        let mut net = Network::new(1);
        let a = net.add_host();
        let b = net.add_host();
        let s1 = net.add_switch();
        let s2 = net.add_switch();
        net.link(a, s1, spec(50_000_000, 2, None), spec(50_000_000, 2, None));
        net.link(s1, s2, spec(1_000_000_000, 300, Some(100)), spec(1_000_000_000, 300, Some(100)));
        net.link(s2, b, spec(500_000_000, 1, Some(100)), spec(500_000_000, 1, Some(100)));
        net.build_routes();
        (net, a, b)
    }

    #[test]
    fn lone_packet_delay_is_propagation_plus_serialisation_on_every_hop() {
        let (mut net, a, b) = three_hop();
        let mut q = EventQueue::new();
        let pkt = Packet { src: a, dst: b, size: 1538, damaged: false, body: 7 };
        net.send(Instant::ZERO, a, pkt, &mut |t, e| q.schedule(t, e));
        let got = run(&mut net, &mut q);
        // 1538 B = 12304 bits: 246080 ns at 50 Mb/s, 12304 ns at 1 Gb/s, 24608 ns at 500 Mb/s.
        let expected = 246_080 + 2_000 + 12_304 + 300_000 + 24_608 + 1_000;
        assert_eq!(got, [(expected, b, 7)]);
    }

    #[test]
    fn drop_tail_drops_exactly_when_full() {
        // A burst of 10 packets into a port that holds 4: 4 pass, 6 are dropped.
        let (mut net, a, s, b) = line(spec(1_000_000, 0, Some(4)));
        let mut q = EventQueue::new();
        for i in 0..10 {
            let pkt = Packet { src: a, dst: b, size: 1000, damaged: false, body: i };
            net.send(Instant::ZERO, a, pkt, &mut |t, e| q.schedule(t, e));
        }
        let got = run(&mut net, &mut q);
        let bottleneck = net.ports.iter().find(|p| p.from == s && p.to == b).unwrap();
        // The fast first hop delivers all 10 to the switch long before the slow port frees a
        // slot (0.8 us apart versus 8 ms), so exactly the 4 first fit.
        assert_eq!(got.iter().map(|g| g.2).collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(bottleneck.stats.dropped, 6);
        assert_eq!(bottleneck.stats.max_queue, 4);
    }

    #[test]
    fn a_token_bucket_lets_its_depth_through_at_once_then_paces_at_the_rate() {
        // The testbed's tbf: 3000 bytes of bucket at 1 Mbit/s, a link with no rate of its own.
        let (mut net, a, _, b) = line(PortSpec { bucket_bytes: Some(3000), ..spec(1_000_000, 0, None) });
        let mut q = EventQueue::new();
        let burst = |net: &mut Network<u32>, q: &mut EventQueue<NetEvent<u32>>, at: Instant, first: u32| {
            for i in first..first + 3 {
                let pkt = Packet { src: a, dst: b, size: 1500, damaged: false, body: i };
                net.send(at, a, pkt, &mut |t, e| q.schedule(t, e));
            }
        };
        burst(&mut net, &mut q, Instant::ZERO, 0);
        let got = run(&mut net, &mut q);
        let ms = |g: &(u64, NodeId, u32)| g.0 / 1_000_000;
        // Two at once (the first hop's 1.2 us apart), the third when 1500 bytes accrued: 12 ms.
        assert_eq!(got.iter().map(ms).collect::<Vec<_>>(), [0, 0, 12]);
        // After 100 ms idle the bucket is full again (never more than its depth).
        burst(&mut net, &mut q, Instant::from_nanos(100_000_000), 3);
        let got = run(&mut net, &mut q);
        assert_eq!(got.iter().map(ms).collect::<Vec<_>>(), [100, 100, 112]);
    }

    #[test]
    fn shared_cores_take_packets_in_turn() {
        // Two cores at 10 us a packet: four packets arriving at once at the switch are
        // forwarded at 10, 10, 20, 20 us; the host's turn for the first two comes when the
        // cores have done the switch's last two (20 us), first come first served.
        let mut net = Network::new(1);
        let a = net.add_host();
        let s = net.add_switch();
        let b = net.add_host();
        let fast = spec(1_000_000_000_000, 0, None);
        net.link(a, s, fast, fast);
        net.link(s, b, fast, fast);
        net.build_routes();
        net.cpu = Some(SharedCpu::new(2, Duration::from_micros(10)));
        let mut q = EventQueue::new();
        for i in 0..4 {
            let pkt = Packet { src: a, dst: b, size: 100, damaged: false, body: i };
            net.send(Instant::ZERO, a, pkt, &mut |t, e| q.schedule(t, e));
        }
        let got = run(&mut net, &mut q);
        let us: Vec<u64> = got.iter().map(|g| g.0 / 1000).collect();
        assert_eq!(us, [30, 30, 40, 40], "in arrival order, two at a time");
        assert_eq!(got.iter().map(|g| g.2).collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(net.arrivals, 8);
        let cpu = net.cpu.as_ref().unwrap();
        assert_eq!(cpu.busy(), Duration::from_micros(80));
        assert!((cpu.busy_fraction(Duration::from_micros(40)) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn processes_wait_for_a_core_in_turn() {
        // Two cores; a wake-up costs 50 us, a packet 10 us. Three processes woken at once:
        // two run at once, the third when a core is free (50 us, having waited 50). A
        // packet arriving at 10 us waits for the first core free, the one freed at 50 us.
        let mut cpu = SharedCpu::new(2, Duration::from_micros(10)).with_wake_cost(Duration::from_micros(50));
        assert!(cpu.has_run_queue());
        let t = |us| Instant::ZERO + Duration::from_micros(us);
        let starts: Vec<_> = (0..3).map(|_| cpu.run(t(0))).collect();
        assert_eq!(starts, [t(0), t(0), t(50)]);
        assert_eq!(cpu.take(t(10)), t(60), "taken in when its core is done with it");
        // A process woken when a core is idle runs at once.
        assert_eq!(cpu.run(t(500)), t(500));
        assert_eq!(cpu.wakes(), 4);
        assert_eq!(cpu.waited(), Duration::from_micros(50));
        assert_eq!(cpu.busy(), Duration::from_micros(4 * 50 + 10));
        // Without a wake-up cost there is no run queue.
        assert!(!SharedCpu::new(2, Duration::from_micros(10)).has_run_queue());
    }

    #[test]
    fn byte_limit_counts_bytes() {
        let (mut net, a, _, b) = line(PortSpec { queue_bytes: Some(2500), ..spec(1_000_000, 0, None) });
        let mut q = EventQueue::new();
        for (i, size) in [1000u32, 1000, 600, 400, 100].into_iter().enumerate() {
            let pkt = Packet { src: a, dst: b, size, damaged: false, body: i as u32 };
            net.send(Instant::ZERO, a, pkt, &mut |t, e| q.schedule(t, e));
        }
        let got: Vec<u32> = run(&mut net, &mut q).into_iter().map(|g| g.2).collect();
        // 1000 + 1000 fit (2000), 600 would make 2600 > 2500: dropped; 400 fits (2400); 100 fits (2500).
        assert_eq!(got, [0, 1, 3, 4]);
    }

    #[test]
    fn bit_errors_lose_packets_with_the_analytic_probability() {
        // BER 1e-5 on 1500-byte packets: p = 1 - (1 - 1e-5)^12000 = 0.1131.
        let mut net = Network::new(42);
        let a = net.add_host();
        let b = net.add_host();
        let noisy = PortSpec { ber: 1e-5, ..spec(1_000_000_000, 0, None) };
        net.link(a, b, noisy, noisy);
        net.build_routes();
        let mut q = EventQueue::new();
        let n = 20_000;
        for i in 0..n {
            let pkt = Packet { src: a, dst: b, size: 1500, damaged: false, body: i };
            net.send(Instant::ZERO, a, pkt, &mut |t, e| q.schedule(t, e));
        }
        let got = run(&mut net, &mut q).len() as f64;
        let p = 1.0 - (1.0f64 - 1e-5).powf(12_000.0);
        let lost = 1.0 - got / f64::from(n);
        // Binomial sd = sqrt(p(1-p)/n) = 0.00224; allow 5 sd.
        assert!((lost - p).abs() < 5.0 * (p * (1.0 - p) / f64::from(n)).sqrt(), "lost {lost}, expected {p}");
    }

    #[test]
    fn random_loss_drops_that_fraction_whatever_the_size_and_counts_it() {
        let mut net = Network::new(7);
        let a = net.add_host();
        let b = net.add_host();
        let lossy = PortSpec { loss: 0.01, ..spec(1_000_000_000, 0, None) };
        let (ab, _) = net.link(a, b, lossy, lossy);
        net.build_routes();
        let mut q = EventQueue::new();
        let n = 50_000u32;
        for i in 0..n {
            let pkt = Packet { src: a, dst: b, size: 64 + (i % 1400), damaged: false, body: i };
            net.send(Instant::ZERO, a, pkt, &mut |t, e| q.schedule(t, e));
        }
        let got = run(&mut net, &mut q).len() as u64;
        let lost = net.ports[ab].stats.lost;
        assert_eq!(got + lost, u64::from(n), "every packet arrives or is counted lost");
        // Binomial: 500 expected, sd 22; allow 5 sd.
        assert!((lost as f64 - 500.0).abs() < 111.0, "lost {lost}");
    }
}
