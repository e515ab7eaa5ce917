//! Scenario files (TOML): topology, traffic, transport. Every parameter has a default
//! taken from domain.md section 8; a file only says what differs.

use serde::{Deserialize, Serialize};
use shoal_detector::geometry::Geometry;
use shoal_detector::physics::{PhysicsConfig, PhysicsGenerator};
use shoal_detector::workload::{BurstConfig, BurstWorkload, FixedWorkload};
use shoal_detector::{Generator, NoiseConfig, NoiseGenerator};

/// A whole scenario.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    pub seed: u64,
    pub topology: Topology,
    pub traffic: Traffic,
    pub tcp: TcpParams,
    pub builder: BuilderParams,
    pub clocks: ClockModel,
}

impl Default for Scenario {
    fn default() -> Self {
        Self {
            name: "sector".into(),
            seed: 1,
            topology: Topology::default(),
            traffic: Traffic::default(),
            tcp: TcpParams::default(),
            builder: BuilderParams::default(),
            clocks: ClockModel::default(),
        }
    }
}

/// The source hosts' clocks (`[clocks]`, docs/clocks.md). Default: one clock for all.
///
/// Offsets are spread evenly over `[-spread/2, +spread/2]` and dealt to the sources in an
/// order drawn from the seed, so the worst pair is exactly `offset_spread_us` apart; each
/// source's drift is uniform in `[-drift_ppm, +drift_ppm]`. The testbed gives its source
/// processes the same clocks (`shoal node --test-clock-offset-us`). Builders' clocks only
/// time their timeouts from a slice's first fragment, so they are not modelled.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClockModel {
    pub offset_spread_us: f64,
    pub drift_ppm: f64,
    /// Testbed only: run control measures and corrects the clocks before START
    /// (`cluster.clock.correct`). Default false: both sides see the raw offsets. The
    /// simulator has no run control and refuses it.
    pub correct: bool,
}

impl ClockModel {
    pub fn is_zero(&self) -> bool {
        self.offset_spread_us == 0.0 && self.drift_ppm == 0.0
    }

    /// Whether the simulator can run it (see `correct`).
    pub fn check_simulated(&self) -> Result<(), String> {
        if self.correct {
            return Err("clocks.correct is for the testbed (run control corrects); the simulator has none".into());
        }
        Ok(())
    }

    /// Each source's (offset ns, drift parts per billion).
    pub fn source_clocks(&self, n_sources: u32, seed: u64) -> Vec<(i64, i64)> {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand_pcg::Pcg64Mcg::seed_from_u64(seed ^ 0x434c_4f43_4b53_u64);
        let n = n_sources as usize;
        let spread_ns = self.offset_spread_us * 1e3;
        let mut offsets: Vec<i64> = (0..n)
            .map(|i| if n < 2 { 0 } else { (-spread_ns / 2.0 + spread_ns * i as f64 / (n - 1) as f64).round() as i64 })
            .collect();
        // Fisher-Yates with the scenario's seed: which source gets which offset.
        for i in (1..n).rev() {
            let j = rng.random_range(0..=i);
            offsets.swap(i, j);
        }
        offsets
            .into_iter()
            .map(|o| {
                let drift =
                    if self.drift_ppm == 0.0 { 0.0 } else { rng.random_range(-self.drift_ppm..=self.drift_ppm) };
                (o, (drift * 1e3).round() as i64)
            })
            .collect()
    }
}

/// Boards -> sector switch -> shore cable -> central switch -> builders.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Topology {
    /// `sector` (5 boards), `2-string` (60) or `10-string` (300); `sources` overrides.
    pub scale: String,
    pub sources: Option<u32>,
    /// Default: sources / 3.
    pub builders: Option<u32>,
    pub boards_per_sector: u32,
    /// Effective board uplink rate (domain.md: 100 Mbit/s Ethernet, about 50 effective).
    pub board_mbps: f64,
    pub board_delay_us: f64,
    /// Sector switch uplink to shore.
    pub shore_mbps: f64,
    /// Shore cable propagation (40-50 km: about 300 us).
    pub shore_delay_us: f64,
    /// Bit error rate on the shore cable (stress case 1e-8).
    pub shore_ber: f64,
    /// Effective builder link rate.
    pub builder_mbps: f64,
    pub builder_delay_us: f64,
    /// Switch output queue limit in packets ...
    pub queue_packets: Option<usize>,
    /// ... and/or in bytes (one measured switch: about 108 KB per port).
    pub queue_bytes: Option<u64>,
    /// Host (NIC/qdisc) queue in packets.
    pub host_queue_packets: usize,
    /// Random loss on every switch port toward a host, packets per million (the testbed's
    /// `--loss-pct`; loss where `shore_ber` damages by size).
    pub host_port_loss_ppm: u32,
    /// Every port as the testbed shapes it (a `tbf` with the drop-tail queue as its child):
    /// a token bucket holding this many microseconds at the port's rate, at least two full
    /// frames, lets that much through at once after an idle spell, where a wire serialises
    /// every packet. 0: wires, as hardware has (the default). `shoal validate` sets the
    /// testbed's 250 for its hosts model.
    pub shaper_bucket_us: f64,
    /// Hosts and switches as software on one machine with this many cores (the testbed):
    /// every packet a node takes in costs a core `cpu_packet_us`, first come first served.
    /// 0: nodes take no time (hardware; the default).
    pub cpu_cores: u32,
    /// ... the cost of one packet taken in, all the machine's work per packet included
    /// (calibrated from the testbed's CPU use: docs/validation.md).
    pub cpu_packet_us: f64,
    /// ... and the processes' run queue: every wake-up of a source's or a builder's process
    /// costs a core this long, and a process woken while every core is busy waits for one
    /// (a source sends late, a builder reads late). 0: processes never wait (the model per
    /// packet alone).
    pub cpu_wake_us: f64,
}

impl Default for Topology {
    fn default() -> Self {
        Self {
            scale: "sector".into(),
            sources: None,
            builders: None,
            boards_per_sector: 5,
            board_mbps: 50.0,
            board_delay_us: 1.0,
            shore_mbps: 1000.0,
            shore_delay_us: 300.0,
            shore_ber: 0.0,
            builder_mbps: 500.0,
            builder_delay_us: 1.0,
            queue_packets: Some(100),
            queue_bytes: None,
            host_queue_packets: 1000,
            host_port_loss_ppm: 0,
            shaper_bucket_us: 0.0,
            cpu_cores: 0,
            cpu_packet_us: 0.0,
            cpu_wake_us: 0.0,
        }
    }
}

impl Topology {
    pub fn n_sources(&self) -> Result<u32, String> {
        if let Some(n) = self.sources {
            return Ok(n);
        }
        match self.scale.as_str() {
            "sector" => Ok(5),
            "2-string" => Ok(60),
            "10-string" => Ok(300),
            other => Err(format!("unknown scale {other:?} (sector, 2-string, 10-string)")),
        }
    }
    pub fn n_builders(&self) -> Result<u32, String> {
        Ok(self.builders.unwrap_or((self.n_sources()? / 3).max(1)))
    }
}

/// What the sources send.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Traffic {
    /// `direct`, `delayed:K`, `tbf:RATE[:BURST]`.
    pub policy: String,
    /// `tcp` or `udp`.
    pub transport: String,
    /// UDP: the datagram transport with selective retransmission (MTU-sized datagrams,
    /// NACKs, the runtime's `shoal_core::datagram`) instead of best-effort 60 kB datagrams.
    pub udp_nack: bool,
    /// With `udp_nack`: how many times a missing datagram is asked for before it is
    /// declared lost (the runtime's `udp.max_nacks`); 0 is best effort, every gap lost and
    /// counted.
    pub udp_max_nacks: u32,
    pub slice_ms: f64,
    /// Fragment size when bursts are off.
    pub fragment_bytes: u32,
    pub load_s: f64,
    /// Time after the load for stragglers.
    pub relax_s: f64,
    /// Bioluminescence bursts.
    pub bursts: bool,
    /// Fraction of time a board is in a burst.
    pub burst_fraction: f64,
    /// Burst length is uniform in [0, burst_max_s].
    pub burst_max_s: f64,
    pub burst_fragment_bytes: u32,
    /// Fragment size outside bursts when bursts are modelled.
    pub base_fragment_bytes: u32,
    /// Burst rate cutoff (send only the first/last 4 slices of a burst).
    pub cutoff: bool,
    pub cutoff_head: u32,
    pub cutoff_tail: u32,
    /// The sources' workload, as the runtime's `source.generator`: `fixed`
    /// (`fragment_bytes`), `bursts` (the burst model above), `noise` or `physics` (the
    /// generators with their defaults, on the ANTARES-like geometry). Default: `bursts`
    /// when `bursts` is set, else `fixed`.
    pub generator: Option<String>,
    /// The source node's queue limit per builder (as `source.queue_limit_mb`).
    pub queue_limit_mb: u64,
    /// The source node's stall limit (as `source.stall_limit_slices`).
    pub stall_limit_slices: u32,
    /// Software sources wake late (crate::wake): a constant phase per source, uniform in
    /// [0, wake_phase_us) ...
    pub wake_phase_us: f64,
    /// ... plus an exponential delay with this mean per wake-up. Both 0 (the default):
    /// hardware boards, in lockstep.
    pub wake_jitter_us: f64,
    /// ... or, when given, a delay drawn from this measured distribution (µs, a source
    /// node's `slice_end_lag_us`: `shoal validate` passes the testbed's) instead of the
    /// exponential; `wake_jitter_us` is then only reported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wake_lag_us: Option<shoal_core::loghist::LogHistogram>,
}

impl Default for Traffic {
    fn default() -> Self {
        Self {
            policy: "direct".into(),
            transport: "tcp".into(),
            udp_nack: false,
            udp_max_nacks: shoal_core::datagram::UdpConfig::default().max_nacks,
            slice_ms: 10.0,
            fragment_bytes: 30_000,
            load_s: 60.0,
            relax_s: 10.0,
            bursts: false,
            burst_fraction: 0.05,
            burst_max_s: 3.0,
            burst_fragment_bytes: 150_000,
            base_fragment_bytes: 25_000,
            cutoff: false,
            cutoff_head: 4,
            cutoff_tail: 4,
            generator: None,
            queue_limit_mb: 64,
            stall_limit_slices: 2,
            wake_phase_us: 0.0,
            wake_jitter_us: 0.0,
            wake_lag_us: None,
        }
    }
}

/// TCP model parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TcpParams {
    pub mss: u32,
    pub initial_window: u32,
    pub rwnd_bytes: u64,
    /// Socket send buffer: a write blocks (the source falls behind) when it is full.
    pub sndbuf_bytes: u64,
    pub min_rto_ms: f64,
    pub delayed_ack_ms: f64,
    /// Linux's loss recovery besides NewReno: tail-loss probes and RACK-style detection
    /// after one duplicate ACK (crate::tcp). Off: NewReno as the RFCs have it.
    pub rack_tlp: bool,
    /// SACK blocks and the sender's scoreboard (RFC 6675) with RACK's time-based loss
    /// marking (RFC 8985): with `rack_tlp`, Linux's loss recovery in full (crate::tcp::sack).
    pub sack: bool,
    /// The senders' kernel timer frequency (`CONFIG_HZ`), where Linux counts the tail-loss
    /// probe's timeout in ticks (at 250 Hz at least 12 ms, not 2 SRTT + 2 ms). 0: exact.
    pub kernel_hz: u32,
}

impl Default for TcpParams {
    fn default() -> Self {
        Self {
            mss: 1460,
            initial_window: 10,
            rwnd_bytes: 4 << 20,
            sndbuf_bytes: 256 << 10,
            min_rto_ms: 200.0,
            delayed_ack_ms: 40.0,
            rack_tlp: false,
            sack: false,
            kernel_hz: 0,
        }
    }
}

/// Builder settings (shoal-core's assembler).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BuilderParams {
    pub max_active: usize,
    pub wall_timeout_ms: f64,
}

impl Default for BuilderParams {
    fn default() -> Self {
        Self { max_active: 5, wall_timeout_ms: 2000.0 }
    }
}

impl Scenario {
    pub fn from_toml(text: &str) -> Result<Scenario, String> {
        let s: Scenario = toml_parse(text)?;
        s.validate()?;
        Ok(s)
    }

    pub fn validate(&self) -> Result<(), String> {
        if !self.clocks.offset_spread_us.is_finite() || self.clocks.offset_spread_us < 0.0 {
            return Err("clocks.offset_spread_us must be a number >= 0".into());
        }
        if !self.clocks.drift_ppm.is_finite() || self.clocks.drift_ppm.abs() >= 1e5 {
            return Err("clocks.drift_ppm must be below 100000 in size".into());
        }
        self.topology.n_sources()?;
        if self.topology.n_builders()? == 0 {
            return Err("topology.builders must be at least 1".into());
        }
        self.traffic.policy.parse::<shoal_core::shaping::Policy>().map_err(|e| e.to_string())?;
        if !matches!(self.traffic.transport.as_str(), "tcp" | "udp") {
            return Err(format!("traffic.transport {:?}: tcp or udp", self.traffic.transport));
        }
        if self.traffic.udp_nack && self.traffic.transport != "udp" {
            return Err("traffic.udp_nack needs traffic.transport = \"udp\"".into());
        }
        let positive = [
            ("traffic.slice_ms", self.traffic.slice_ms),
            ("topology.board_mbps", self.topology.board_mbps),
            ("topology.shore_mbps", self.topology.shore_mbps),
            ("topology.builder_mbps", self.topology.builder_mbps),
        ];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{name} must be positive"));
            }
        }
        if !(self.traffic.load_s.is_finite() && self.traffic.load_s > 0.0 && self.traffic.relax_s >= 0.0) {
            return Err("traffic.load_s must be positive and relax_s non-negative".into());
        }
        for (name, v) in [
            ("traffic.wake_phase_us", self.traffic.wake_phase_us),
            ("traffic.wake_jitter_us", self.traffic.wake_jitter_us),
            ("topology.shaper_bucket_us", self.topology.shaper_bucket_us),
            ("topology.cpu_packet_us", self.topology.cpu_packet_us),
            ("topology.cpu_wake_us", self.topology.cpu_wake_us),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name} must be zero or positive"));
            }
        }
        if self.topology.cpu_wake_us > 0.0 && self.topology.cpu_cores == 0 {
            return Err("topology.cpu_wake_us needs topology.cpu_cores (the cores the processes share)".into());
        }
        if self.topology.host_port_loss_ppm > 1_000_000 {
            return Err("topology.host_port_loss_ppm must be at most 1000000".into());
        }
        if !(0.0..=1.0).contains(&self.topology.shore_ber) {
            return Err("topology.shore_ber must be in [0, 1]".into());
        }
        self.traffic.workload(self.topology.n_sources()?, self.seed)?;
        if self.topology.boards_per_sector == 0 || self.tcp.mss == 0 {
            return Err("boards_per_sector and tcp.mss must be at least 1".into());
        }
        Ok(())
    }
}

impl Traffic {
    /// The workload's name: `generator`, or by default `bursts` when `bursts` is set and
    /// `fixed` otherwise.
    pub fn generator_name(&self) -> &str {
        self.generator.as_deref().unwrap_or(if self.bursts { "bursts" } else { "fixed" })
    }

    /// The burst model's parameters (the runtime's `[source.bursts]`).
    pub fn burst_config(&self, seed: u64) -> BurstConfig {
        BurstConfig {
            fraction: self.burst_fraction,
            max_s: self.burst_max_s,
            base_bytes: self.base_fragment_bytes,
            burst_bytes: self.burst_fragment_bytes,
            seed,
        }
    }

    /// The workload named by `generator` (see there), seeded with the scenario's seed, as
    /// shoal-detector builds it for the runtime: the simulator and the runtime run the same
    /// data.
    pub fn workload(&self, n_sources: u32, seed: u64) -> Result<Generator, String> {
        let slice = shoal_core::Duration::from_nanos((self.slice_ms * 1e6) as u64);
        match self.generator_name() {
            "fixed" => Ok(Generator::Fixed(FixedWorkload::new(self.fragment_bytes, slice))),
            "bursts" => BurstWorkload::new(&self.burst_config(seed), slice)
                .map(|w| Generator::Bursts(Box::new(w)))
                .map_err(|e| e.to_string()),
            "noise" => NoiseGenerator::new(NoiseConfig { seed, ..Default::default() }, slice)
                .map(|g| Generator::Noise(Box::new(g)))
                .map_err(|e| e.to_string()),
            "physics" => PhysicsGenerator::new(
                PhysicsConfig { seed, ..Default::default() },
                Geometry::antares_for_sources(n_sources),
                slice,
            )
            .map(|g| Generator::Physics(Box::new(g)))
            .map_err(|e| e.to_string()),
            other => Err(format!("traffic.generator {other:?}: fixed, bursts, noise or physics")),
        }
    }
}

fn toml_parse(text: &str) -> Result<Scenario, String> {
    toml::from_str(text).map_err(|e| e.to_string())
}
