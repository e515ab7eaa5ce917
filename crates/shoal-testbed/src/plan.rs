//! The emulated network of a scenario, as data: namespaces, addresses, veth links and
//! the commands that configure each namespace. Pure (no command is run here), so the
//! whole layout is tested without root.
//!
//! The layout mirrors the simulator's topology (`shoal_sim::sim`): boards -> sector switch
//! -> shore link -> central switch -> builders. Each host (source process, builder,
//! writer, control) is a network namespace with one `eth0`; each switch is a namespace
//! holding a Linux bridge whose ports are the switch ends of the veth pairs. A link is
//! shaped in both directions: the host's egress by a token bucket at the link rate with
//! the host queue behind it, the switch port's egress (toward the host) by a token bucket
//! with the switch output buffer behind it (drop-tail, packets or bytes). Offloads are off
//! on both ends, so one queued packet is one frame (../shared/testbed.md).

use std::fmt::Write as _;
use std::net::Ipv4Addr;

use shoal_sim::scenario::Scenario;

/// Largest frame on the wire, as tc counts it (1500 MTU + 14 bytes of Ethernet header).
const FRAME: u64 = 1514;

/// TCP congestion control of every host namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Congestion {
    /// What the simulator models (NewReno).
    Reno,
    /// What Linux deployments run.
    Cubic,
}

impl Congestion {
    pub fn name(self) -> &'static str {
        match self {
            Congestion::Reno => "reno",
            Congestion::Cubic => "cubic",
        }
    }
}

impl std::str::FromStr for Congestion {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "reno" => Ok(Congestion::Reno),
            "cubic" => Ok(Congestion::Cubic),
            other => Err(format!("unknown congestion control {other:?} (reno or cubic)")),
        }
    }
}

/// What a host namespace is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase", tag = "role", content = "id")]
pub enum HostRole {
    Source(u32),
    Builder(u32),
    Writer,
    /// Dispatcher and run control.
    Control,
}

/// One host: a namespace with one address.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Host {
    pub netns: String,
    pub role: HostRole,
    pub addr: Ipv4Addr,
}

/// One shaped direction of a link: a token bucket at `mbps` with a drop-tail queue.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shaping {
    pub mbps: f64,
    pub queue: Queue,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Queue {
    Packets(usize),
    Bytes(u64),
}

/// A veth pair between two namespaces, shaped at both ends.
#[derive(Clone, Debug, PartialEq)]
pub struct Link {
    pub a_netns: String,
    pub a_dev: String,
    pub a_egress: Shaping,
    pub b_netns: String,
    pub b_dev: String,
    pub b_egress: Shaping,
}

/// The whole testbed of a scenario.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub prefix: String,
    pub hosts: Vec<Host>,
    /// Switch namespaces (each holds bridge `br0`).
    pub switches: Vec<String>,
    pub links: Vec<Link>,
    pub congestion: Congestion,
    /// Random loss, in packets per million, on every switch port toward a host (an nft
    /// rule in the switch's bridge: ../shared/testbed.md). Switch-to-switch links are
    /// lossless, so a packet meets it once on its way.
    pub loss_ppm: u32,
    /// Bit error rate of the shore links (the scenario's `topology.shore_ber`), both
    /// directions: a frame with a flipped bit fails its FCS and is dropped by the next hop,
    /// so each frame is dropped with probability `1 - (1 - ber)^bits` by its length class
    /// (an nft rule per class on the shore ports), as the simulator damages and discards it.
    pub shore_ber: f64,
    /// Propagation delay of each shore link (the scenario's `topology.shore_delay_us`),
    /// both directions: every IPv4 packet a sector switch forwards crosses its shore link
    /// once, so the sector switch hands it to a delay line ([`crate::delay`]) for this
    /// long. The boards' and builders' links (a microsecond or so) are not delayed: that is
    /// far below what the delay line can resolve.
    pub shore_delay_us: f64,
    /// What this testbed emulates differently from the scenario (and the simulator), said
    /// before the run and in its summary.
    pub warnings: Vec<String>,
}

/// Frame length classes (bridge `meta length`: Ethernet header included, no FCS) and the
/// length whose bit count sets each class's drop probability: ACKs and small control
/// packets, three middle classes at their middle, full 1500-byte-MTU frames.
const BER_CLASSES: [(u32, u32, u32); 5] =
    [(0, 127, 66), (128, 599, 364), (600, 1199, 900), (1200, 1499, 1350), (1500, 1600, 1514)];

/// nft's `numgen random mod` range for probabilities (parts per billion).
const PPB: f64 = 1e9;

/// The netfilter queue every delay line ([`crate::delay`]) binds (one per namespace, so
/// one number will do).
pub const QUEUE_NUM: u16 = 0;

/// The nft table of the injected loss in a switch namespace.
pub const LOSS_TABLE: &str = "shoal_loss";

/// Addresses in 198.18.0.0/15: sources 198.18.x.y, builders 198.19.0.x up, writer and
/// control at the top of 198.19.
fn source_addr(i: u32) -> Ipv4Addr {
    let n = i + 1;
    Ipv4Addr::new(198, 18, (n >> 8) as u8, (n & 0xff) as u8)
}

fn builder_addr(j: u32) -> Ipv4Addr {
    let n = j + 1;
    Ipv4Addr::new(198, 19, (n >> 8) as u8, (n & 0xff) as u8)
}

pub const WRITER_ADDR: Ipv4Addr = Ipv4Addr::new(198, 19, 254, 1);
pub const CONTROL_ADDR: Ipv4Addr = Ipv4Addr::new(198, 19, 254, 2);

impl Plan {
    /// The testbed for `sc`. Namespaces are named `<prefix>-...` so that `down` finds them.
    pub fn new(sc: &Scenario, prefix: &str, congestion: Congestion) -> Result<Plan, String> {
        let t = &sc.topology;
        let n_sources = t.n_sources()?;
        let n_builders = t.n_builders()?;
        if n_sources + n_builders + 2 > 1000 {
            return Err(format!("{n_sources} sources and {n_builders} builders: a bridge holds at most 1023 ports"));
        }
        if prefix.is_empty() || prefix.len() > 6 || !prefix.chars().all(|c| c.is_ascii_alphanumeric()) {
            return Err(format!("testbed prefix {prefix:?}: 1 to 6 letters or digits"));
        }
        let mut warnings = Vec::new();
        let switch_queue = match (t.queue_packets, t.queue_bytes) {
            (Some(p), Some(b)) => {
                // A fifo holds one limit: bfifo counts bytes only. The simulator applies
                // both, so they differ where the packet limit binds first: small packets
                // (ACKs, small fragments' datagrams) fill `p` slots before `b` bytes.
                warnings.push(format!(
                    "topology.queue_bytes = {b} replaces queue_packets = {p} on the testbed's switch ports (one \
                     limit per fifo); the simulator applies both, so the two agree only where the byte limit binds \
                     first ({p} full frames are {} bytes)",
                    p as u64 * 1514
                ));
                Queue::Bytes(b)
            }
            (None, Some(b)) => Queue::Bytes(b),
            (Some(p), None) => Queue::Packets(p),
            (None, None) => Queue::Packets(1000),
        };
        let host_queue = Queue::Packets(t.host_queue_packets);
        let ns = |name: String| format!("{prefix}-{name}");
        let core = ns("core".into());
        let mut hosts = Vec::new();
        let mut switches = vec![core.clone()];
        let mut links = Vec::new();
        let n_sectors = n_sources.div_ceil(t.boards_per_sector);
        for sector in 0..n_sectors {
            let sw = ns(format!("sec{sector}"));
            switches.push(sw.clone());
            // The shore link: shaped at the shore rate with the switch buffer on both sides.
            links.push(Link {
                a_netns: sw.clone(),
                a_dev: "uplink".into(),
                a_egress: Shaping { mbps: t.shore_mbps, queue: switch_queue },
                b_netns: core.clone(),
                b_dev: format!("sec{sector}"),
                b_egress: Shaping { mbps: t.shore_mbps, queue: switch_queue },
            });
            let first = sector * t.boards_per_sector;
            for i in first..(first + t.boards_per_sector).min(n_sources) {
                let h = ns(format!("s{i}"));
                hosts.push(Host { netns: h.clone(), role: HostRole::Source(i), addr: source_addr(i) });
                links.push(Link {
                    a_netns: h,
                    a_dev: "eth0".into(),
                    a_egress: Shaping { mbps: t.board_mbps, queue: host_queue },
                    b_netns: sw.clone(),
                    b_dev: format!("s{i}"),
                    b_egress: Shaping { mbps: t.board_mbps, queue: switch_queue },
                });
            }
        }
        let mut attach = |netns: String, role: HostRole, addr: Ipv4Addr, port: String, mbps: f64| {
            hosts.push(Host { netns: netns.clone(), role, addr });
            links.push(Link {
                a_netns: netns,
                a_dev: "eth0".into(),
                a_egress: Shaping { mbps, queue: host_queue },
                b_netns: core.clone(),
                b_dev: port,
                b_egress: Shaping { mbps, queue: switch_queue },
            });
        };
        for j in 0..n_builders {
            attach(ns(format!("b{j}")), HostRole::Builder(j), builder_addr(j), format!("b{j}"), t.builder_mbps);
        }
        // Writer and control sit on the central switch at the builders' rate; their traffic
        // (events, run control) is small next to the data.
        attach(ns("w".into()), HostRole::Writer, WRITER_ADDR, "w".into(), t.builder_mbps);
        attach(ns("ctl".into()), HostRole::Control, CONTROL_ADDR, "ctl".into(), t.builder_mbps);
        if !(0.0..=1e6).contains(&t.shore_delay_us) {
            return Err(format!("shore_delay_us = {}: 0 to 1 s", t.shore_delay_us));
        }
        Ok(Plan {
            prefix: prefix.to_string(),
            hosts,
            switches,
            links,
            congestion,
            loss_ppm: 0,
            shore_ber: t.shore_ber,
            shore_delay_us: t.shore_delay_us,
            warnings,
        })
    }

    /// The control host's ports (`namespace/device`, as the drop counters name them): its
    /// own interface and the switch port toward it. Their drops are run control's traffic.
    pub fn control_ports(&self) -> Vec<String> {
        let control: Vec<&str> =
            self.hosts.iter().filter(|h| h.role == HostRole::Control).map(|h| h.netns.as_str()).collect();
        self.links
            .iter()
            .filter(|l| control.contains(&l.a_netns.as_str()))
            .flat_map(|l| [format!("{}/{}", l.a_netns, l.a_dev), format!("{}/{}", l.b_netns, l.b_dev)])
            .collect()
    }

    /// One switch, `senders` hosts on links of `sender_mbps` and one receiver behind a port
    /// of `port_mbps` whose output buffer is `port_queue`: what `shoal probe-switch` floods.
    /// Senders are `Source(i)`, the receiver `Builder(0)`; the senders' links are meant to
    /// be faster than the port, so that their own queues stay empty and every drop is the
    /// port's.
    pub fn star(
        prefix: &str,
        senders: u32,
        sender_mbps: f64,
        port_mbps: f64,
        port_queue: Queue,
    ) -> Result<Plan, String> {
        if !(2..=500).contains(&senders) {
            return Err(format!("{senders} senders: 2 to 500"));
        }
        if prefix.is_empty() || prefix.len() > 6 || !prefix.chars().all(|c| c.is_ascii_alphanumeric()) {
            return Err(format!("testbed prefix {prefix:?}: 1 to 6 letters or digits"));
        }
        let switch = format!("{prefix}-sw");
        let host_queue = Queue::Packets(1000);
        let mut plan = Plan {
            prefix: prefix.to_string(),
            hosts: Vec::new(),
            switches: vec![switch.clone()],
            links: Vec::new(),
            congestion: Congestion::Cubic,
            loss_ppm: 0,
            shore_ber: 0.0,
            shore_delay_us: 0.0,
            warnings: Vec::new(),
        };
        let mut attach = |netns: String, role: HostRole, addr: Ipv4Addr, port: String, mbps: f64, queue: Queue| {
            plan.hosts.push(Host { netns: netns.clone(), role, addr });
            plan.links.push(Link {
                a_netns: netns,
                a_dev: "eth0".into(),
                a_egress: Shaping { mbps, queue: host_queue },
                b_netns: switch.clone(),
                b_dev: port,
                b_egress: Shaping { mbps, queue },
            });
        };
        for i in 0..senders {
            attach(
                format!("{prefix}-s{i}"),
                HostRole::Source(i),
                source_addr(i),
                format!("s{i}"),
                sender_mbps,
                host_queue,
            );
        }
        attach(format!("{prefix}-r"), HostRole::Builder(0), builder_addr(0), "r".into(), port_mbps, port_queue);
        Ok(plan)
    }

    /// The same testbed with `ppm` packets per million lost on every switch port toward a
    /// host.
    pub fn with_loss_ppm(mut self, ppm: u32) -> Plan {
        self.loss_ppm = ppm.min(1_000_000);
        self
    }

    /// Switch-side ports that lead to a host (where loss is injected).
    fn host_ports<'a>(&'a self, switch: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.links
            .iter()
            .filter(move |l| l.b_netns == switch && self.hosts.iter().any(|h| h.netns == l.a_netns))
            .map(|l| l.b_dev.as_str())
    }

    /// Ports of switch `switch` that lead to another switch (the shore links).
    fn switch_ports<'a>(&'a self, switch: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        let is_switch = |n: &str| self.switches.iter().any(|s| s == n);
        self.links.iter().filter(move |l| is_switch(&l.a_netns) && is_switch(&l.b_netns)).filter_map(move |l| {
            if l.a_netns == switch {
                Some(l.a_dev.as_str())
            } else if l.b_netns == switch {
                Some(l.b_dev.as_str())
            } else {
                None
            }
        })
    }

    /// The nft rules of switch `netns`: random loss toward hosts, bit errors on shore links.
    fn loss_rules(&self, netns: &str) -> Vec<String> {
        let mut rules = Vec::new();
        let list = |ports: Vec<&str>| ports.iter().map(|p| format!("\"{p}\"")).collect::<Vec<_>>().join(", ");
        let hosts: Vec<&str> = self.host_ports(netns).collect();
        if self.loss_ppm > 0 && !hosts.is_empty() {
            // numgen draws per packet in the bridge's forward path: an independent loss
            // with probability ppm / 1e6, counted by the rule (netem is not available).
            // IPv4 packets only, as in the simulator, which has no ARP: a lost ARP request
            // or reply holds a path's first packets for Linux's `retrans_time_ms` (1 s) and
            // drops those beyond `unres_qlen_bytes`, a one-second outage rather than a
            // packet loss (it lost UDP runs 6 whole fragments, older than the sources'
            // retransmit buffers by the time the NACKs came; docs/testbed.md).
            rules.push(format!(
                "oifname {{ {} }} ether type ip numgen random mod 1000000 < {} counter drop",
                list(hosts),
                self.loss_ppm
            ));
        }
        let shore: Vec<&str> = self.switch_ports(netns).collect();
        if self.shore_ber > 0.0 && !shore.is_empty() {
            let ports = list(shore);
            for (lo, hi, len) in BER_CLASSES {
                let bits = 8.0 * f64::from(shoal_sim::net::wire_size(len.saturating_sub(14)));
                let p = 1.0 - (1.0 - self.shore_ber).powf(bits);
                let ppb = (p * PPB).round() as u64;
                if ppb > 0 {
                    rules.push(format!(
                        "oifname {{ {ports} }} ether type ip meta length {lo}-{hi} numgen random mod {} < {ppb} counter drop",
                        PPB as u64
                    ));
                }
            }
        }
        rules
    }

    /// The switch namespaces that delay what they forward: the sector switches, when the
    /// shore links have a propagation delay.
    pub fn delay_switches(&self) -> impl Iterator<Item = &str> {
        let delays = self.shore_delay_us > 0.0;
        self.switches.iter().skip(1).filter(move |_| delays).map(String::as_str)
    }

    /// Every namespace of the testbed.
    pub fn namespaces(&self) -> impl Iterator<Item = &str> {
        self.hosts.iter().map(|h| h.netns.as_str()).chain(self.switches.iter().map(String::as_str))
    }

    pub fn host(&self, role: HostRole) -> Option<&Host> {
        self.hosts.iter().find(|h| h.role == role)
    }

    /// `ip -b` lines run in the root namespace: the namespaces, then the veth pairs created
    /// directly inside them (nothing stays in the root namespace).
    pub fn root_batch(&self) -> String {
        let mut s = String::new();
        for n in self.namespaces() {
            let _ = writeln!(s, "netns add {n}");
        }
        for l in &self.links {
            let _ = writeln!(
                s,
                "link add {} netns {} type veth peer name {} netns {}",
                l.a_dev, l.a_netns, l.b_dev, l.b_netns
            );
        }
        s
    }

    /// The shell script that configures namespace `netns` (run inside it with `sh -e`).
    pub fn namespace_script(&self, netns: &str) -> String {
        let mut s = String::from("sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1\n");
        s.push_str("ip link set lo up\n");
        let is_switch = self.switches.iter().any(|n| n == netns);
        if is_switch {
            s.push_str("ip link add br0 type bridge stp_state 0 forward_delay 0 mcast_snooping 0\n");
            s.push_str("ip link set br0 up\n");
        } else {
            let _ = writeln!(s, "sysctl -qw net.ipv4.tcp_congestion_control={}", self.congestion.name());
        }
        for (dev, shaping) in self.devices(netns) {
            let _ = writeln!(s, "ethtool -K {dev} tso off gso off gro off >/dev/null 2>&1 || true");
            if is_switch {
                let _ = writeln!(s, "ip link set dev {dev} master br0");
            }
            let _ = writeln!(s, "ip link set dev {dev} up");
            s.push_str(&shaper(dev, shaping));
        }
        if let Some(h) = self.hosts.iter().find(|h| h.netns == netns) {
            let _ = writeln!(s, "ip addr add {}/15 dev eth0", h.addr);
        }
        let rules = if is_switch { self.loss_rules(netns) } else { Vec::new() };
        if !rules.is_empty() {
            let _ = writeln!(
                s,
                "nft -f - <<'EOF'\ntable bridge {LOSS_TABLE} {{\n  chain fw {{\n    type filter hook forward priority 0;\n{}  }}\n}}\nEOF",
                rules.iter().map(|r| format!("    {r}\n")).collect::<String>()
            );
        }
        if self.delay_switches().any(|d| d == netns) {
            // Bridged IPv4 passes the ip FORWARD hook (br_netfilter) and waits in the
            // delay line. No --queue-bypass: without its delay line a switch forwards
            // nothing, rather than forwarding without the delay.
            s.push_str(
                "sysctl -qw net.bridge.bridge-nf-call-iptables=1
",
            );
            let _ = writeln!(s, "iptables -w -A FORWARD -j NFQUEUE --queue-num {}", QUEUE_NUM);
        }
        s
    }

    /// The devices in `netns` with the shaping of their egress.
    pub fn devices<'a>(&'a self, netns: &'a str) -> impl Iterator<Item = (&'a str, Shaping)> + 'a {
        self.links.iter().flat_map(move |l| {
            let a = (l.a_netns == netns).then_some((l.a_dev.as_str(), l.a_egress));
            let b = (l.b_netns == netns).then_some((l.b_dev.as_str(), l.b_egress));
            a.into_iter().chain(b)
        })
    }
}

/// How long a shaper's bucket lasts at its rate: shorter is timer-limited at 1 Gbit/s
/// (docs/testbed.md). The simulator models it for `shoal validate`
/// (`topology.shaper_bucket_us`): after an idle spell a port lets this much through at once.
pub const SHAPER_BUCKET_US: f64 = 250.0;

/// A token bucket at the link rate (it spaces packets, where htb lets bursts through:
/// ../shared/testbed.md) with the drop-tail queue as its child. The bucket holds
/// [`SHAPER_BUCKET_US`] at the rate, never less than two frames.
fn shaper(dev: &str, s: Shaping) -> String {
    let rate_bps = s.mbps * 1e6;
    let burst = ((rate_bps / 8.0 * SHAPER_BUCKET_US * 1e-6) as u64).max(2 * FRAME);
    let child = match s.queue {
        Queue::Packets(n) => format!("pfifo limit {}", n.max(1)),
        Queue::Bytes(b) => format!("bfifo limit {}", b.max(FRAME)),
    };
    format!(
        "tc qdisc add dev {dev} root handle 1: tbf rate {}kbit burst {burst} latency 1s\n\
         tc qdisc add dev {dev} parent 1:1 handle 10: {child}\n",
        (rate_bps / 1e3).round() as u64
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(sources: u32, builders: u32) -> Scenario {
        let mut sc = Scenario::default();
        sc.topology.sources = Some(sources);
        sc.topology.builders = Some(builders);
        sc
    }

    #[test]
    fn every_host_and_switch_has_a_namespace_and_one_address() {
        let p = Plan::new(&scenario(12, 4), "tb", Congestion::Reno).unwrap();
        // 12 sources, 4 builders, writer, control; central switch and 3 sector switches.
        assert_eq!(p.hosts.len(), 18);
        assert_eq!(p.switches.len(), 4);
        let mut addrs: Vec<_> = p.hosts.iter().map(|h| h.addr).collect();
        addrs.sort();
        addrs.dedup();
        assert_eq!(addrs.len(), 18);
        assert!(p.hosts.iter().all(|h| h.addr.octets()[0] == 198 && (h.addr.octets()[1] & 0xfe) == 18));
        assert!(p.namespaces().all(|n| n.starts_with("tb-")));
        // 12 board links, 3 shore links, 4 builder links, writer, control.
        assert_eq!(p.links.len(), 21);
        assert_eq!(p.host(HostRole::Source(300)), None);
        assert_eq!(p.host(HostRole::Builder(3)).unwrap().addr, Ipv4Addr::new(198, 19, 0, 4));
        // Run control's ports, whose drops are not the data path's.
        assert_eq!(p.control_ports(), ["tb-ctl/eth0", "tb-core/ctl"]);
    }

    #[test]
    fn links_are_shaped_at_the_scenario_rates_with_its_buffers() {
        let mut sc = scenario(5, 2);
        sc.topology.queue_packets = Some(100);
        sc.topology.host_queue_packets = 1000;
        let p = Plan::new(&sc, "tb", Congestion::Cubic).unwrap();
        let s0 = p.namespace_script("tb-s0");
        assert!(s0.contains("tcp_congestion_control=cubic"), "{s0}");
        assert!(s0.contains("tbf rate 50000kbit burst 3028 "), "{s0}");
        assert!(s0.contains("pfifo limit 1000"), "{s0}");
        assert!(s0.contains("ip addr add 198.18.0.1/15 dev eth0"));
        let core = p.namespace_script("tb-core");
        assert!(core.contains("ip link set dev b1 master br0"));
        // The builder port: 500 Mbit/s, 15625-byte bucket, 100-packet switch buffer.
        assert!(core.contains("dev b1 root handle 1: tbf rate 500000kbit burst 15625 "), "{core}");
        assert!(core.contains("dev b1 parent 1:1 handle 10: pfifo limit 100"));
        assert!(!core.contains("tcp_congestion_control"), "switches carry no TCP");
        assert!(p.root_batch().contains("link add eth0 netns tb-b1 type veth peer name b1 netns tb-core"));
    }

    #[test]
    fn byte_buffers_and_bad_prefixes() {
        let mut sc = scenario(3, 1);
        sc.topology.queue_bytes = Some(108_000);
        let p = Plan::new(&sc, "x1", Congestion::Reno).unwrap();
        assert!(p.namespace_script("x1-core").contains("bfifo limit 108000"));
        // The scenario's default packet limit is replaced, and the plan says so (the
        // simulator applies both).
        assert_eq!(p.warnings.len(), 1, "{:?}", p.warnings);
        assert!(p.warnings[0].contains("queue_bytes = 108000 replaces queue_packets = 100"), "{:?}", p.warnings);
        sc.topology.queue_packets = None;
        assert!(Plan::new(&sc, "x1", Congestion::Reno).unwrap().warnings.is_empty());
        assert!(Plan::new(&scenario(3, 1), "x1", Congestion::Reno).unwrap().warnings.is_empty());
        assert!(Plan::new(&sc, "bad-prefix", Congestion::Reno).is_err());
        assert!(Plan::new(&scenario(1200, 10), "tb", Congestion::Reno).unwrap_err().contains("1023"));
    }

    #[test]
    fn a_star_puts_the_probed_buffer_on_the_receivers_port_only() {
        let p = Plan::star("pb", 3, 200.0, 20.0, Queue::Bytes(108_000)).unwrap();
        assert_eq!((p.hosts.len(), p.switches.len(), p.links.len()), (4, 1, 4));
        let sw = p.namespace_script("pb-sw");
        assert!(sw.contains("dev r root handle 1: tbf rate 20000kbit "), "{sw}");
        assert!(sw.contains("dev r parent 1:1 handle 10: bfifo limit 108000"), "{sw}");
        assert!(sw.contains("dev s2 root handle 1: tbf rate 200000kbit "), "{sw}");
        assert_eq!(sw.matches("bfifo").count(), 1, "only the probed port: {sw}");
        assert_eq!(p.host(HostRole::Builder(0)).unwrap().netns, "pb-r");
        assert!(Plan::star("pb", 1, 200.0, 20.0, Queue::Packets(100)).is_err());
    }

    #[test]
    fn loss_goes_on_the_switch_ports_toward_hosts_only() {
        let p = Plan::new(&scenario(6, 2), "tb", Congestion::Reno).unwrap();
        assert!(!p.namespace_script("tb-core").contains("nft"), "no loss unless asked");
        let p = p.with_loss_ppm(1000);
        let core = p.namespace_script("tb-core");
        assert!(
            core.contains(
                r#"oifname { "b0", "b1", "w", "ctl" } ether type ip numgen random mod 1000000 < 1000 counter drop"#
            ),
            "{core}"
        );
        let sector = p.namespace_script("tb-sec0");
        assert!(sector.contains(r#"oifname { "s0", "s1", "s2", "s3", "s4" } ether type ip numgen"#), "{sector}");
        let rule = sector.lines().find(|l| l.contains("numgen")).unwrap();
        assert!(!rule.contains("uplink"), "switch-to-switch links stay lossless: {rule}");
        assert!(!p.namespace_script("tb-s0").contains("nft"), "hosts have no loss rule");
    }

    #[test]
    fn shore_bit_errors_drop_frames_by_length_on_both_ends_of_each_shore_link() {
        let mut sc = scenario(6, 2);
        sc.topology.shore_ber = 1e-7;
        let p = Plan::new(&sc, "tb", Congestion::Reno).unwrap();
        let core = p.namespace_script("tb-core");
        let sector = p.namespace_script("tb-sec1");
        // A full frame: 1514 bytes on the bridge, 1538 on the simulator's wire (preamble,
        // FCS, gap): 1 - (1 - 1e-7)^(8 x 1538) = 1,229,643 parts per billion.
        assert!(
            core.contains(r#"oifname { "sec0", "sec1" } ether type ip meta length 1500-1600 numgen random mod 1000000000 < 1229643 counter drop"#),
            "{core}"
        );
        assert!(sector.contains(r#"oifname { "uplink" } ether type ip meta length 0-127 numgen"#), "{sector}");
        assert_eq!(sector.matches("meta length").count(), 5, "{sector}");
        assert!(!core.contains(r#""b0""#), "host ports keep no bit errors: {core}");
        assert!(
            !Plan::new(&scenario(6, 2), "tb", Congestion::Reno).unwrap().namespace_script("tb-core").contains("nft")
        );
    }

    #[test]
    fn a_shore_delay_queues_what_each_sector_switch_forwards() {
        let mut sc = scenario(6, 2);
        sc.topology.shore_delay_us = 0.0;
        let p = Plan::new(&sc, "tb", Congestion::Reno).unwrap();
        assert_eq!(p.delay_switches().count(), 0);
        assert!(!p.namespace_script("tb-sec0").contains("NFQUEUE"));
        sc.topology.shore_delay_us = 300.0;
        let p = Plan::new(&sc, "tb", Congestion::Reno).unwrap();
        // Two sectors of five boards; the central switch forwards without delay, so a
        // packet is delayed once per shore crossing, in each direction.
        assert_eq!(p.delay_switches().collect::<Vec<_>>(), vec!["tb-sec0", "tb-sec1"]);
        let sector = p.namespace_script("tb-sec1");
        assert!(sector.contains("iptables -w -A FORWARD -j NFQUEUE --queue-num 0\n"), "{sector}");
        assert!(!sector.contains("queue-bypass"), "{sector}");
        assert!(!p.namespace_script("tb-core").contains("NFQUEUE"));
        assert!(!p.namespace_script("tb-s0").contains("NFQUEUE"));
        sc.topology.shore_delay_us = -1.0;
        assert!(Plan::new(&sc, "tb", Congestion::Reno).is_err());
    }
}
