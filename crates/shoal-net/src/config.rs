//! The one configuration schema of every shoal process (TOML, serde).
//!
//! Every option has a default (documented in `docs/configuration.md`, and shown in full in
//! `examples/shoal.toml`, which a test keeps equal to [`Config::default`]); `shoal demo`
//! needs no file at all. A node reads the sections that concern its role.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use shoal_core::assembly::AssemblerConfig;
use shoal_core::node::{BuilderNodeConfig, CutoffConfig, SourceNodeConfig};
use shoal_core::shaping::Policy;
use shoal_core::slice::SliceClock;
use shoal_core::{Duration, SourceId};
use shoal_detector::geometry::Geometry;
use shoal_detector::physics::{PhysicsConfig, PhysicsGenerator};
use shoal_detector::workload::{BurstConfig, BurstWorkload, FixedWorkload};
use shoal_detector::{Generator, GeneratorKind, NoiseConfig, NoiseGenerator};
use shoal_trigger::FilterConfig;

/// The whole configuration.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub run: RunConfig,
    pub source: SourceConfig,
    pub builder: BuilderConfig,
    pub writer: WriterConfig,
    pub udp: UdpSettings,
    pub saver: SaverSettings,
    pub tap: TapSettings,
    pub km3net: Km3netSettings,
    pub security: SecurityConfig,
}

/// The bulk path's security (`[security]`; docs/security.md).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecurityConfig {
    /// `off`; `authenticated`: both ends of every data connection (sources to builders,
    /// builders to the writer and to the data-flow manager) prove their certificate from
    /// the cluster CA at connect, then plain TCP; `tls`: TLS 1.3 for the connection's life.
    pub data: shoal_tls::DataSecurity,
    /// With `data`: the ids each process may send as, by the name its certificate gives it
    /// (a source process its source ids, a builder its builder id), e.g. `source0 = [0, 1]`.
    /// Run control fills it from the cluster file; a connection that sends another id is
    /// closed (reason `identity`), as is one whose certificate names no process here.
    pub peers: crate::transport::secure::Peers,
    /// With `data` and `run.transport = "udp"`: the run's datagram key, 64 hex digits
    /// (AES-256-GCM on every datagram, [`crate::transport::udp::mac`]). Run control draws a fresh one for
    /// every run and hands it out with CONFIGURE; never write one into a file.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub udp_key: String,
    /// This process's certificates (never in a file: a node loads its own, the embedded
    /// demo makes throw-away ones).
    #[serde(skip)]
    pub credentials: crate::transport::secure::DataCredentials,
}

/// KM3NeT mode (`[km3net]`; docs/km3net.md): sources take CLB packets
/// (`source.input = "clb:ADDR"`) and send one JDAQ superframe per DOM and timeslice;
/// builders read those frames, give their hits to the filter and publish what KM3NeT's
/// DataFilter publishes (`IO_TSL0`, `IO_TSL1`, `IO_TSSN`, `IO_EVT`, `IO_SUM`) on the
/// dispatcher and in DAQ files. On when DOMs are given (`doms` or `detx`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Km3netSettings {
    /// The detector file: its DOMs, in file order, are sources 0, 1, 2, ...
    pub detx: Option<PathBuf>,
    /// Or the DOM ids listed: source `i` is DOM `doms[i]`.
    pub doms: Vec<u32>,
    /// Detector id written into every JDAQ header.
    pub det_id: i32,
    /// What builders publish on the dispatcher (tags): any of `IO_TSL0` (every hit),
    /// `IO_TSL1` (L1 hits), `IO_TSL2` (L2 hits: needs `detx`), `IO_TSSN` (supernova
    /// coincidences), `IO_EVT` (the filter's events), `IO_SUM` (per-PMT rates).
    pub publish: Vec<String>,
    /// Builders also write what they publish to `writer.out_dir`, one file per tag and
    /// builder (`runNNNNNN.builderB.IO_EVT.dat`), in the framing km3pipe's `DAQPump` reads.
    pub files: bool,
    /// Local coincidence window of L1 hits, ns (KM3NeT's `TMaxLocal`).
    pub l1_window_ns: u32,
    /// L2: the partner PMT's direction within this cosine of the hit's PMT's (0: 90 degrees).
    pub l2_ct_min: f64,
    /// Supernova coincidences: at least this many PMTs of one DOM within `sn_window_ns`.
    pub sn_min_pmts: u32,
    pub sn_window_ns: u32,
    /// Most packets of one DOM in one timeslice (more are refused, counted).
    pub max_packets_per_frame: u32,
}

impl Default for Km3netSettings {
    fn default() -> Self {
        Self {
            detx: None,
            doms: Vec::new(),
            det_id: 0,
            publish: ["IO_TSL0", "IO_TSL1", "IO_TSSN", "IO_EVT", "IO_SUM"].map(String::from).to_vec(),
            files: true,
            l1_window_ns: 10,
            l2_ct_min: 0.0,
            sn_min_pmts: 4,
            sn_window_ns: 10,
            max_packets_per_frame: 4096,
        }
    }
}

/// The tags a KM3NeT builder can publish.
pub const KM3NET_TAGS: [&str; 6] = ["IO_TSL0", "IO_TSL1", "IO_TSL2", "IO_TSSN", "IO_EVT", "IO_SUM"];

impl Km3netSettings {
    /// The DOM ids, source id order (empty: KM3NeT mode is off).
    pub fn dom_ids(&self) -> Result<Vec<u32>, ConfigError> {
        if !self.doms.is_empty() {
            if self.detx.is_some() {
                return invalid("km3net: give doms or detx, not both");
            }
            return Ok(self.doms.clone());
        }
        let Some(path) = &self.detx else { return Ok(Vec::new()) };
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read { path: path.clone(), source: e })?;
        let g = Geometry::from_detx(&text)
            .map_err(|e| ConfigError::Invalid(format!("km3net.detx {}: {e}", path.display())))?;
        Ok(g.modules.iter().map(|m| m.id).collect())
    }

    /// Each DOM's PMT directions in channel order, from the detector file (empty without
    /// one).
    pub fn pmt_directions(&self) -> Result<std::collections::HashMap<u32, Vec<[f64; 3]>>, ConfigError> {
        let Some(path) = &self.detx else { return Ok(Default::default()) };
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read { path: path.clone(), source: e })?;
        let g = Geometry::from_detx(&text)
            .map_err(|e| ConfigError::Invalid(format!("km3net.detx {}: {e}", path.display())))?;
        Ok(g.modules.iter().map(|m| (m.id, m.pmts.iter().map(|p| p.dir).collect())).collect())
    }

    pub fn is_on(&self) -> bool {
        !self.doms.is_empty() || self.detx.is_some()
    }

    pub fn params(&self) -> shoal_core::km3net::datafilter::DataFilterParams {
        shoal_core::km3net::datafilter::DataFilterParams {
            l1_window_ns: self.l1_window_ns,
            sn_window_ns: self.sn_window_ns,
            sn_min_pmts: self.sn_min_pmts as usize,
        }
    }
}

/// Monitoring taps of a run-controlled builder (`[tap]`; see `crate::tap`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TapSettings {
    /// Publish every this many slices a builder processes, whole, on `SHL_RAW` (0: none).
    pub raw_every: u64,
    /// Publish every processed slice's selected events on `SHL_EVT`.
    pub events: bool,
}

impl Default for TapSettings {
    fn default() -> Self {
        Self { raw_every: 100, events: true }
    }
}

/// The builders' burst saver and late-data side stream (`[saver]`); see
/// `shoal_core::saver` for what each limit does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SaverSettings {
    /// Keep a history of raw slices and answer alerts.
    pub enabled: bool,
    /// Slice time kept, seconds.
    pub history_s: f64,
    /// Most history per builder, MiB (default 384: 30 s of an ANTARES builder's 9 MB/s is
    /// 270 MB, the rest is room for bioluminescence bursts).
    pub max_mb: u64,
    /// Embedded runs (`shoal demo`): most history of all builders of the process together,
    /// MiB; each builder keeps at most its share.
    pub embedded_max_mb: u64,
    /// Most saved and late bytes waiting for the local disk, MiB; late fragments beyond it
    /// are dropped (counted).
    pub pending_mb: u64,
    /// An open alert closes at the latest this long after its window's end, ms.
    pub close_grace_ms: u64,
    /// Keep fragments that arrive after their slice was processed.
    pub salvage_late: bool,
    /// Local spool directory (default `<writer.out_dir>/spool`).
    pub spool_dir: Option<PathBuf>,
    /// Most bytes in one builder's spool file per run, MiB; beyond, saved fragments are
    /// dropped and counted.
    pub spool_max_mb: u64,
    /// Most rate at which a builder ships saved data to the writer, MB/s (0: unlimited).
    pub ship_mb_per_s: f64,
}

impl Default for SaverSettings {
    fn default() -> Self {
        let d = shoal_core::saver::SaverConfig::DEFAULT;
        Self {
            enabled: true,
            history_s: d.history.as_secs_f64(),
            max_mb: d.max_bytes >> 20,
            embedded_max_mb: 1024,
            pending_mb: d.max_pending_bytes >> 20,
            close_grace_ms: d.close_grace.as_millis() as u64,
            salvage_late: d.salvage_late,
            spool_dir: None,
            spool_max_mb: 4096,
            ship_mb_per_s: 50.0,
        }
    }
}

/// The data path's transport (`run.transport`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Tcp,
    /// Datagrams with selective retransmission (`shoal_core::datagram`), settings in `[udp]`.
    Udp,
    /// Frames as UCX active messages (`crate::transport::ucx`): RDMA where the hosts have
    /// it, one copy over shared memory (`cma`) on one host; UCX's own `UCX_TLS` chooses.
    Ucx,
}

/// The datagram transport's budgets (`run.transport = "udp"`); see
/// `shoal_core::datagram::UdpConfig` for what each does and why the defaults are what they
/// are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UdpSettings {
    /// Largest datagram payload in bytes (1420: no IP fragmentation on a 1500-byte MTU).
    pub max_payload: u16,
    /// Retransmit buffer per (source, builder) stream: at most this many MiB ...
    pub retransmit_mb: u64,
    /// ... and datagrams at most this old ...
    pub retransmit_age_ms: u64,
    /// ... except those of a stream's first this many ms, kept this long (a path's first
    /// packets may wait a second for the neighbour's resolution).
    pub start_retransmit_age_ms: u64,
    /// A gap is asked for this long after it is seen, again `nack_interval_us` later and
    /// then after twice as long each time, at most `max_nacks` times.
    pub nack_delay_us: u64,
    pub nack_interval_us: u64,
    pub max_nacks: u32,
    /// A partly received frame is given up (counted damaged) after this long.
    pub reassembly_timeout_ms: u64,
    /// Socket send and receive buffers asked of the kernel, MiB (a warning says when it
    /// grants less: raise `net.core.rmem_max` / `wmem_max`).
    pub socket_buffer_mb: u64,
}

impl Default for UdpSettings {
    fn default() -> Self {
        let d = shoal_core::datagram::UdpConfig::default();
        Self {
            max_payload: d.max_payload,
            retransmit_mb: d.retransmit_bytes >> 20,
            retransmit_age_ms: d.retransmit_age.as_millis() as u64,
            start_retransmit_age_ms: d.start_retransmit_age.as_millis() as u64,
            nack_delay_us: d.nack_delay.as_micros() as u64,
            nack_interval_us: d.nack_interval.as_micros() as u64,
            max_nacks: d.max_nacks,
            reassembly_timeout_ms: d.reassembly_timeout.as_millis() as u64,
            socket_buffer_mb: 16,
        }
    }
}

/// What every process of a run must agree on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// Run number, written into every output row and file name.
    pub run_number: u64,
    /// The run's type (`physics`, `calibration`, `test`, `commissioning`), written into
    /// every stored file's metadata (`shoal_store::custody::FileMetadata::runs`).
    pub run_type: String,
    /// How long sources produce data, in seconds (0: until Ctrl-C).
    pub seconds: f64,
    /// Time-slice length in milliseconds (ANTARES 10, KM3NeT 100).
    pub slice_ms: u64,
    /// Number of sources (front-end boards) in the run, numbered from 0.
    pub sources: u32,
    /// Number of builders; slice `s` goes to builder `s mod builders`.
    pub builders: u32,
    /// Traffic-shaping policy: `direct`, `delayed:K`, `tbf:RATE[:BURST]` or
    /// `pull:CREDITS[:cap=N][:timeout=DUR][:reasks=N][:hold=N][:rate=RATE[:burst=BURST]]`
    /// (credit-based pull with a data-flow manager at `dfm_addr`).
    pub policy: String,
    /// Data address of each builder, indexed by builder id.
    pub builder_addrs: Vec<String>,
    /// Address where the writer accepts events from builders.
    pub writer_addr: String,
    /// Pull policies: where the data-flow manager accepts the builders' connections.
    pub dfm_addr: String,
    /// `tcp` (default) or `udp` (datagrams with selective retransmission, `[udp]`; a
    /// builder receives them on the same address and port as TCP).
    pub transport: String,
    /// First slice of the run, so that every source of it agrees (run control and the
    /// embedded demo set it). Unset: the first slice that starts on a whole second after
    /// the process starts, so processes started within the same second agree.
    pub start_slice: Option<u64>,
    /// This process's memory budget, MiB (0: half the machine's memory). Every queue's
    /// bound is a share of it; a configuration that cannot run within it is refused at
    /// start with what would fit (`crate::budget`).
    pub memory_mb: u64,
    /// Memory this process maps before its run and keeps, MiB (0: none; at most the
    /// budget): the run's buffers then land in pages already mapped instead of faulting
    /// their working set in while the data flow (`shoal_net::memory::prefault`).
    pub prefault_mb: u64,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            run_number: 1,
            run_type: "physics".into(),
            seconds: 10.0,
            slice_ms: 10,
            sources: 5,
            builders: 3,
            policy: "direct".into(),
            builder_addrs: vec!["127.0.0.1:5601".into(), "127.0.0.1:5602".into(), "127.0.0.1:5603".into()],
            writer_addr: "127.0.0.1:5700".into(),
            dfm_addr: "127.0.0.1:5650".into(),
            transport: "tcp".into(),
            start_slice: None,
            memory_mb: 0,
            prefault_mb: 0,
        }
    }
}

/// Source (front-end board) settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SourceConfig {
    /// Source ids this process hosts (empty: all of `0..run.sources`). Sources hosted by
    /// one process share one connection per builder; each keeps its own shaper.
    pub ids: Vec<SourceId>,
    /// `physics` (default: K-40 singles and coincidences, afterpulses, bursts, muons on the
    /// ANTARES-like geometry, one floor per source), `noise` (singles only), `fixed` (the
    /// same `fixed_bytes` fragment every slice, as in the studies) or `bursts` (fixed sizes
    /// with domain.md's burst model, `[source.bursts]`). The simulator runs the same ones.
    pub generator: GeneratorKind,
    /// The physics generator's parameters.
    pub physics: PhysicsConfig,
    /// The noise generator's parameters.
    pub noise: NoiseConfig,
    /// `fixed`: every fragment this many bytes on the wire (the studies' constant
    /// fragment; the demo's default ANTARES fragment is about 30,000 bytes).
    pub fixed_bytes: u32,
    /// `bursts`: domain.md's burst model.
    pub bursts: BurstConfig,
    /// 0: generate every fragment live. N > 0: generate N slices per source at start and
    /// replay them in turn (same bytes, new slice numbers), so that a benchmark of the
    /// network path is not limited by the random generator.
    pub replay_pool: u32,
    /// Saturation (benchmarks): produce the next slice as soon as the transport has taken
    /// the previous one instead of at the slice clock's pace, so the data path sets the
    /// rate. The run is `run.seconds / run.slice_ms` slices however long they take. With
    /// `generator = "fixed"` this is the studies' throughput-versus-size measurement.
    pub saturate: bool,
    /// Most bytes queued towards one builder before fragments are dropped (counted).
    /// The ANTARES board has 64 MB for buffering.
    pub queue_limit_mb: u64,
    /// A slice end reached more than this late (ms) is skipped, not produced (counted):
    /// a machine too slow for the configured load stays this close to real time instead
    /// of falling behind without end. 0: never skip.
    pub max_lag_ms: u64,
    /// How far ahead of its slice ends a source node computes its fragments, on a thread of
    /// its own (ms; `crate::source::prefetch`): a slice costly to generate (a burst) is ready at
    /// its end instead of holding the runtime. 0: computed at each slice end, in the
    /// source's task.
    pub generate_ahead_ms: u64,
    /// One connection per hosted source and builder instead of one per builder shared by
    /// the process's sources: what boards that each connect to every builder look like to
    /// a builder (connection scaling, `scripts/conn_scaling.py`).
    pub connection_per_source: bool,
    /// Most bytes a source process holds (set at start from the memory budget; not a
    /// file setting).
    #[serde(skip)]
    pub held_limit_bytes: Option<u64>,
    /// Most payload a source node holds computed ahead of its slice ends (set at start
    /// from the memory budget: `crate::source::prefetch`; not a file setting).
    #[serde(skip)]
    pub prefetch_limit_bytes: Option<u64>,
    /// Burst rate cutoff: during a burst send only the first/last few slices.
    pub cutoff: bool,
    pub cutoff_head: u32,
    pub cutoff_tail: u32,
    /// A fragment still being written after this many slices no longer holds back the
    /// delayed-transmission schedule (so one slow builder cannot stall the others).
    pub stall_limit_slices: u32,
    /// At the end of the run, most time to send what is still queued.
    pub drain_timeout_ms: u64,
    /// Reconnect backoff bounds.
    pub reconnect_min_ms: u64,
    pub reconnect_max_ms: u64,
    /// Where the data come from: `""` (the generator above), `unix:PATH` (readout programs
    /// write fragments in the input framing of docs/sdk.md to this stream socket) or
    /// `udp:ADDR` (one fragment per datagram, sequence numbers per source). The source
    /// SDK (Rust, C, Python) submits through the same path whatever this says.
    pub input: String,
    /// How data times are counted: `unix` (ns since 1970, a board on White Rabbit or GPS
    /// time) or `run` (ns since the start of the run's first slice).
    pub input_time_base: String,
    /// A slice is sent this long after its end on the host clock, so data that reach the
    /// host shortly after their slice ended still travel on time; later data go out as
    /// late fragments (counted).
    pub input_latency_ms: u64,
    /// Most payload bytes of one source's fragment of one slice, MiB.
    pub input_max_fragment_mb: u32,
    /// Most payload bytes held by the input before back-pressure, MiB.
    pub input_held_mb: u64,
    /// A fragment more than this many seconds ahead of the slice being sent is refused
    /// (a board clock gone wrong would otherwise fill memory).
    pub input_max_ahead_s: f64,
    /// When the input is full: `block` the caller (up to `input_block_ms`, then refuse,
    /// counted) or `drop` at once (counted).
    pub input_backpressure: String,
    pub input_block_ms: u64,
    /// `unix:` input: most clients connected at once (more are refused, counted).
    pub input_max_clients: u32,
    /// `unix:` input with `run.seconds = 0`: the run ends when every client that
    /// connected has disconnected (after the first one).
    pub input_end_on_disconnect: bool,
}

impl Default for SourceConfig {
    fn default() -> Self {
        Self {
            ids: Vec::new(),
            generator: GeneratorKind::default(),
            physics: PhysicsConfig::default(),
            noise: NoiseConfig::default(),
            fixed_bytes: 30_000,
            bursts: BurstConfig::default(),
            replay_pool: 0,
            saturate: false,
            queue_limit_mb: 64,
            max_lag_ms: 5_000,
            generate_ahead_ms: 250,
            connection_per_source: false,
            held_limit_bytes: None,
            prefetch_limit_bytes: None,
            cutoff: false,
            cutoff_head: 4,
            cutoff_tail: 4,
            stall_limit_slices: 2,
            drain_timeout_ms: 10_000,
            reconnect_min_ms: 50,
            reconnect_max_ms: 2_000,
            input: String::new(),
            input_time_base: "unix".into(),
            input_latency_ms: 20,
            input_max_fragment_mb: 16,
            input_held_mb: 256,
            input_max_ahead_s: 10.0,
            input_backpressure: "block".into(),
            input_block_ms: 1_000,
            input_max_clients: 64,
            input_end_on_disconnect: true,
        }
    }
}

/// Builder settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BuilderConfig {
    /// This builder's id (its listen address is `run.builder_addrs[id]` unless `listen`).
    pub id: u32,
    /// Overrides the listen address (e.g. `0.0.0.0:5601`).
    pub listen: Option<String>,
    /// Slice-count timeout: most active slices before the oldest is processed incomplete.
    pub max_active: usize,
    /// Wall-clock guard per slice, from its first fragment, in milliseconds.
    pub wall_timeout_ms: u64,
    /// Emergency memory limit for held and unfiltered data, MiB.
    pub memory_budget_mb: u64,
    /// Largest frame payload accepted, MiB; larger lengths close the connection.
    pub max_payload_mb: u32,
    /// After the run, most time to wait for sources to finish, milliseconds.
    pub drain_timeout_ms: u64,
    pub filter: FilterConfig,
    /// Fault injection: the filter takes at least this long per slice, ms (0: off). A
    /// filter too slow for the load, for the fault matrix (docs/reliability.md).
    pub fault_filter_ms_per_slice: u64,
    /// Most slices waiting for the filter; beyond, a processed slice goes unfiltered
    /// (counted, its bytes released). The builder's memory budget bounds their bytes.
    pub filter_queue_slices: u32,
    /// Receive buffer of each data connection when free-running sources are held back,
    /// bytes: 0 (the default) sizes it from the host's TCP memory and the number of sources
    /// (`listen::KernelShare`: the kernel default up to about 6,000 sources); any other
    /// value is asked for as it is (the kernel doubles it).
    pub held_receive_buffer: u64,
    /// How TCP data connections are read: `epoll` (tokio, the default) or `io_uring`
    /// (one thread with a tokio-uring runtime; see docs/benchmarks.md).
    pub receive: ReceivePath,
    /// Store every processed slice whole, each fragment's payload byte for byte, in the
    /// writer's `run{N:06}.slices.parquet` (beside the filter's events): the run's raw
    /// data, for data the filters cannot read (opaque SDK payloads) or a run kept whole.
    pub store_slices: bool,
    /// Shared-memory slice consumers (docs/plugins.md).
    pub consumers: ConsumersConfig,
}

/// `[builder.consumers]`: complete slices published into a shared-memory ring for
/// consumers in other processes (`shoal consume`, the C, Python and Rust clients).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConsumersConfig {
    /// Publish (off by default: a slice is copied once more when someone is attached).
    pub enabled: bool,
    /// Abstract socket name consumers attach to, `{builder}` replaced by the builder id.
    pub socket: String,
    /// The ring's size, MiB (a slice larger than the ring is skipped, counted).
    pub ring_mb: u64,
    /// Most consumers attached at once.
    pub max_consumers: usize,
    /// Longest a `hold` consumer may keep the builder waiting per slice, ms (a consumer's
    /// own bound is cut to this).
    pub max_hold_ms: u64,
    /// Accept consumers run by any user (abstract sockets have no file permissions; by
    /// default only the builder's user and root may attach).
    pub any_user: bool,
}

impl Default for ConsumersConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            socket: "shoal/b{builder}".into(),
            ring_mb: 64,
            max_consumers: 8,
            max_hold_ms: 2_000,
            any_user: false,
        }
    }
}

/// A builder's receive path for TCP data connections (`builder.receive`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReceivePath {
    /// tokio's readiness-based sockets: a reader task per connection.
    #[default]
    Epoll,
    /// io_uring submissions on one thread of their own ([`crate::transport::uring`]).
    IoUring,
}

impl Default for BuilderConfig {
    fn default() -> Self {
        Self {
            id: 0,
            listen: None,
            max_active: 5,
            held_receive_buffer: 0,
            wall_timeout_ms: 2_000,
            memory_budget_mb: 512,
            max_payload_mb: 16,
            drain_timeout_ms: 15_000,
            filter: FilterConfig::default(),
            fault_filter_ms_per_slice: 0,
            filter_queue_slices: 4096,
            receive: ReceivePath::Epoll,
            store_slices: false,
            consumers: ConsumersConfig::default(),
        }
    }
}

/// Writer settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WriterConfig {
    /// Overrides the listen address (default `run.writer_addr`).
    pub listen: Option<String>,
    /// Output directory (created if missing).
    pub out_dir: PathBuf,
    /// Never overwrite a file of the run: continue in `.partK` files (set under run
    /// control, where run numbers are not reused; not a file setting).
    #[serde(skip)]
    pub keep_existing: bool,
    /// Close the events file and go on in the next part (`.part2`, ...) once the events
    /// reach this many seconds of data past the file's first slice: a writer killed loses
    /// at most this window of events (a Parquet file is whole only once closed). Every
    /// closed file is listed in `run{N:06}.events.manifest.jsonl`. 0: one file per run.
    pub checkpoint_s: f64,
    /// Destinations every closed file is archived to, verified (`file:///PATH`,
    /// `root://HOST[:PORT]//PATH`; docs/archive.md). Under run control the writer process
    /// keeps one archiver for `out_dir` for its life. Empty: none.
    pub archive: Vec<String>,
    /// Delete a local copy once it is safe at this many destinations (none: never).
    pub archive_delete_after: Option<usize>,
    /// Copies refused before a file is quarantined at a destination.
    pub archive_max_attempts: u32,
}

impl Default for WriterConfig {
    fn default() -> Self {
        Self {
            listen: None,
            out_dir: PathBuf::from("shoal-out"),
            keep_existing: false,
            checkpoint_s: 60.0,
            archive: Vec::new(),
            archive_delete_after: None,
            archive_max_attempts: 5,
        }
    }
}

/// Where a source process's data come from (`source.input`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InputKind {
    /// The configured generator.
    Generator,
    /// A stream socket readout programs write the input framing to.
    Unix(PathBuf),
    /// Datagrams, one fragment each.
    Udp(SocketAddr),
    /// KM3NeT CLB optical packets (`[km3net]`).
    Clb(SocketAddr),
}

/// What to do when the input holds its bound (`source.input_backpressure`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backpressure {
    /// Block the caller up to this long, then refuse (counted).
    Block(std::time::Duration),
    /// Refuse at once (counted).
    Drop,
}

/// The input's settings, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputSettings {
    pub backpressure: Backpressure,
    /// Data times count from the start of the run's first slice.
    pub run_relative: bool,
}

/// A configuration that parses but cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {source}")]
    Parse { path: PathBuf, source: Box<toml::de::Error> },
    #[error("{0}")]
    Invalid(String),
}

fn invalid<T>(msg: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError::Invalid(msg.into()))
}

impl Config {
    /// Reads and validates a TOML file.
    pub fn from_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
        let cfg: Config =
            toml::from_str(&text).map_err(|e| ConfigError::Parse { path: path.into(), source: Box::new(e) })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses and validates TOML text (the payload of a run-control `CONFIGURE`).
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks everything a node would otherwise trip over later.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.policy()?;
        if !["physics", "calibration", "test", "commissioning"].contains(&self.run.run_type.as_str()) {
            return invalid(format!(
                "run.run_type = {:?}: one of physics, calibration, test, commissioning",
                self.run.run_type
            ));
        }
        for url in &self.writer.archive {
            shoal_archive::Destination::parse(url).map_err(|e| ConfigError::Invalid(format!("writer.archive: {e}")))?;
        }
        if let Some(n) = self.writer.archive_delete_after
            && !(1..=self.writer.archive.len()).contains(&n)
        {
            return invalid(format!(
                "writer.archive_delete_after = {n}: between 1 and the {} destination(s) of writer.archive",
                self.writer.archive.len()
            ));
        }
        if self.transport()? == Transport::Udp && self.udp.max_payload < 64 {
            return invalid("udp.max_payload must be at least 64 bytes");
        }
        if !self.security.udp_key.is_empty() {
            crate::transport::udp::mac::DatagramMac::from_hex(&self.security.udp_key)
                .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        if self.transport()? == Transport::Ucx {
            if !shoal_ucx::AVAILABLE {
                return invalid(format!("run.transport = \"ucx\": {}", shoal_ucx::UcxError::Unavailable));
            }
            if self.security.data == shoal_tls::DataSecurity::Tls {
                return invalid(
                    "security.data = \"tls\" encrypts TCP connections; run.transport = \"ucx\" moves the data \
                     outside them: use \"authenticated\" (the connection that sets UCX up is proven) or tcp",
                );
            }
        }
        self.slice_clock()?;
        let r = &self.run;
        if r.sources == 0 || r.builders == 0 {
            return invalid("run.sources and run.builders must be at least 1");
        }
        if !(r.seconds.is_finite() && r.seconds >= 0.0) {
            return invalid("run.seconds must be a non-negative number");
        }
        if let Some(bad) = self.source.ids.iter().find(|&&id| id >= r.sources) {
            return invalid(format!("source.ids contains {bad}, but run.sources is {}", r.sources));
        }
        if self.builder.id >= r.builders {
            return invalid(format!("builder.id {} but run.builders is {}", self.builder.id, r.builders));
        }
        let cp = self.writer.checkpoint_s;
        if !(cp.is_finite() && (cp == 0.0 || (0.1..=86_400.0).contains(&cp))) {
            return invalid("writer.checkpoint_s must be 0 (one file per run) or 0.1 to 86400 seconds");
        }
        let sv = &self.saver;
        if !(sv.history_s.is_finite() && sv.history_s > 0.0 && sv.history_s <= 3600.0) {
            return invalid("saver.history_s must be between 0 and 3600 seconds");
        }
        if !(sv.ship_mb_per_s.is_finite() && sv.ship_mb_per_s >= 0.0) {
            return invalid("saver.ship_mb_per_s must be a non-negative number");
        }
        if !self.builder.filter.python.is_empty() && self.km3net.is_on() {
            return invalid(
                "builder.filter.python: not in KM3NeT mode yet (the DataFilter's outputs need the filter in the builder)",
            );
        }
        let consumers = &self.builder.consumers;
        if consumers.enabled {
            if consumers.ring_mb == 0 || consumers.ring_mb > 1 << 16 {
                return invalid(format!("builder.consumers.ring_mb {} must be 1..65536", consumers.ring_mb));
            }
            if consumers.max_consumers == 0 {
                return invalid("builder.consumers.max_consumers must be at least 1");
            }
            if consumers.socket.is_empty() || consumers.socket.len() > 100 {
                return invalid("builder.consumers.socket must be 1..100 bytes (an abstract socket name)");
            }
        }
        if self.builder.filter_queue_slices == 0 {
            return invalid("builder.filter_queue_slices must be at least 1");
        }
        if self.builder.max_active == 0 {
            return invalid("builder.max_active must be at least 1");
        }
        self.generator()?;
        let input = self.input()?;
        self.input_settings()?;
        let k = &self.km3net;
        if k.is_on() || matches!(input, InputKind::Clb(_)) {
            let doms = k.dom_ids()?;
            if doms.is_empty() {
                return invalid("source.input clb: needs the detector's DOMs: km3net.doms or km3net.detx");
            }
            if doms.len() as u64 > u64::from(r.sources) {
                return invalid(format!("km3net: {} DOMs but run.sources is {}", doms.len(), r.sources));
            }
            if let Some(bad) = k.publish.iter().find(|t| !KM3NET_TAGS.contains(&t.as_str())) {
                return invalid(format!("km3net.publish: unknown tag {bad:?} (known: {})", KM3NET_TAGS.join(", ")));
            }
            if k.publish.iter().any(|t| t == "IO_TSL2") && k.detx.is_none() {
                return invalid("km3net.publish: IO_TSL2 needs the PMTs' directions: km3net.detx");
            }
            if !(-1.0..=1.0).contains(&k.l2_ct_min) {
                return invalid("km3net.l2_ct_min is a cosine, between -1 and 1");
            }
            if k.sn_min_pmts < 2 || k.max_packets_per_frame == 0 {
                return invalid("km3net.sn_min_pmts must be at least 2 and max_packets_per_frame at least 1");
            }
            if matches!(input, InputKind::Clb(_)) && self.source.input_time_base != "unix" {
                return invalid("source.input clb: CLB times are UNIX time: source.input_time_base must be \"unix\"");
            }
        }
        shoal_trigger::check(&self.builder.filter).map_err(|e| ConfigError::Invalid(format!("builder.filter: {e}")))?;
        Ok(())
    }

    /// A builder's filter plug-in opens and speaks this shoal's ABI (no-op without one):
    /// checked where a builder accepts a configuration, so that a plug-in that cannot run
    /// refuses the run before it starts.
    pub fn probe_filter_plugin(&self) -> Result<(), ConfigError> {
        let f = &self.builder.filter;
        if f.plugin.is_empty() {
            return Ok(());
        }
        shoal_trigger::plugin::probe(&f.plugin).map_err(|e| ConfigError::Invalid(format!("builder.filter: {e}")))
    }

    /// The burst saver's limits for one builder.
    pub fn saver_config(&self) -> shoal_core::saver::SaverConfig {
        let sv = &self.saver;
        shoal_core::saver::SaverConfig {
            history: shoal_core::Duration::from_nanos((sv.history_s * 1e9) as u64),
            max_bytes: sv.max_mb << 20,
            max_pending_bytes: sv.pending_mb << 20,
            close_grace: shoal_core::Duration::from_millis(sv.close_grace_ms),
            salvage_late: sv.salvage_late,
        }
    }

    /// An embedded run's builders share `saver.embedded_max_mb`: each keeps at most its
    /// share of it as history.
    pub fn share_saver_history(&mut self) {
        let share = self.saver.embedded_max_mb / u64::from(self.run.builders.max(1));
        self.saver.max_mb = self.saver.max_mb.min(share.max(1));
    }

    /// Where builders spool saved raw data before shipping it.
    pub fn spool_dir(&self) -> PathBuf {
        self.saver.spool_dir.clone().unwrap_or_else(|| self.writer.out_dir.join("spool"))
    }

    /// The sources' generator (physics on the ANTARES-like geometry with one floor per
    /// source, or noise).
    pub fn generator(&self) -> Result<Generator, ConfigError> {
        let slice = self.slice_clock()?.length();
        match self.source.generator {
            GeneratorKind::Physics => PhysicsGenerator::new(
                self.source.physics.clone(),
                Geometry::antares_for_sources(self.run.sources),
                slice,
            )
            .map(|g| Generator::Physics(Box::new(g)))
            .map_err(|e| ConfigError::Invalid(format!("source.physics: {e}"))),
            GeneratorKind::Noise => NoiseGenerator::new(self.source.noise.clone(), slice)
                .map(|g| Generator::Noise(Box::new(g)))
                .map_err(|e| ConfigError::Invalid(format!("source.noise: {e}"))),
            GeneratorKind::Fixed => Ok(Generator::Fixed(FixedWorkload::new(self.source.fixed_bytes, slice))),
            GeneratorKind::Bursts => BurstWorkload::new(&self.source.bursts, slice)
                .map(|g| Generator::Bursts(Box::new(g)))
                .map_err(|e| ConfigError::Invalid(format!("source.bursts: {e}"))),
        }
    }

    /// The sources' workload in words (summaries).
    pub fn describe_workload(&self) -> String {
        let s = &self.source;
        if !s.input.trim().is_empty() {
            return match self.input() {
                Ok(InputKind::Clb(a)) => format!("KM3NeT CLB packets received on {a}"),
                _ => format!("submitted data ({})", s.input.trim()),
            };
        }
        let base = match s.generator {
            GeneratorKind::Physics => format!(
                "physics: K-40 {:.0} kHz per PMT, bursts {:.0}% of the time, muons {} Hz",
                s.physics.singles_hz / 1e3,
                s.physics.burst_fraction * 100.0,
                s.physics.muon_rate_hz
            ),
            GeneratorKind::Noise => format!("noise: {:.0} kHz per module", s.noise.rate_hz / 1e3),
            GeneratorKind::Fixed => format!("fixed: {} bytes per fragment", s.fixed_bytes),
            GeneratorKind::Bursts => format!(
                "bursts: {} bytes, {} bytes in bursts {:.0}% of the time",
                s.bursts.base_bytes,
                s.bursts.burst_bytes,
                s.bursts.fraction * 100.0
            ),
        };
        if s.replay_pool > 0 { format!("{base} (replaying {} slices)", s.replay_pool) } else { base }
    }

    /// The workload of the sources this process hosts (with `source.replay_pool`, a pool
    /// generated now and replayed in turn).
    pub fn workload(&self) -> Result<Generator, ConfigError> {
        let g = self.generator()?;
        Ok(match self.source.replay_pool {
            0 => g,
            n => g.into_replay_pool(&self.hosted_sources(), n),
        })
    }

    /// Whether the configured generator computes hits for every slice (no replay pool
    /// standing in for it).
    pub fn computes_hits_per_slice(&self) -> bool {
        self.source.replay_pool == 0 && self.source.generator.computes_hits()
    }

    /// Whether the sources compute their hits during the run (a hit generator, no replay
    /// pool, no readout input), taking CPU from the rest of the chain.
    pub fn generates_hits_live(&self) -> bool {
        self.computes_hits_per_slice() && matches!(self.input(), Ok(InputKind::Generator))
    }

    /// Where this source process's data come from (`source.input`).
    pub fn input(&self) -> Result<InputKind, ConfigError> {
        let s = self.source.input.trim();
        if s.is_empty() {
            return Ok(InputKind::Generator);
        }
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return invalid("source.input \"unix:\" needs a path");
            }
            return Ok(InputKind::Unix(PathBuf::from(path)));
        }
        if let Some(addr) = s.strip_prefix("udp:") {
            return addr
                .parse()
                .map(InputKind::Udp)
                .map_err(|e| ConfigError::Invalid(format!("source.input {s:?}: {e}")));
        }
        if let Some(addr) = s.strip_prefix("clb:") {
            return addr
                .parse()
                .map(InputKind::Clb)
                .map_err(|e| ConfigError::Invalid(format!("source.input {s:?}: {e}")));
        }
        invalid(format!("source.input {s:?}: \"\" (the generator), unix:PATH, udp:ADDR or clb:ADDR"))
    }

    /// The input's settings (`source.input_*`).
    pub fn input_settings(&self) -> Result<InputSettings, ConfigError> {
        let s = &self.source;
        let backpressure = match s.input_backpressure.as_str() {
            "block" => Backpressure::Block(std::time::Duration::from_millis(s.input_block_ms)),
            "drop" => Backpressure::Drop,
            other => return invalid(format!("source.input_backpressure {other:?}: block or drop")),
        };
        let run_relative = match s.input_time_base.as_str() {
            "unix" => false,
            "run" => true,
            other => return invalid(format!("source.input_time_base {other:?}: unix or run")),
        };
        if !(s.input_max_ahead_s.is_finite() && s.input_max_ahead_s > 0.0) {
            return invalid("source.input_max_ahead_s must be a positive number of seconds");
        }
        if s.input_max_fragment_mb == 0 || s.input_held_mb == 0 {
            return invalid("source.input_max_fragment_mb and source.input_held_mb must be at least 1");
        }
        if s.input_max_fragment_mb > self.builder.max_payload_mb {
            return invalid(format!(
                "source.input_max_fragment_mb {} is over builder.max_payload_mb {}: builders would refuse such fragments",
                s.input_max_fragment_mb, self.builder.max_payload_mb
            ));
        }
        Ok(InputSettings { backpressure, run_relative })
    }

    /// The ingest's settings for a run that starts at `first_slice`.
    pub fn ingest_config(&self, first_slice: u64) -> Result<shoal_core::ingest::IngestConfig, ConfigError> {
        let clock = self.slice_clock()?;
        let settings = self.input_settings()?;
        let s = &self.source;
        let slice_ns = clock.length().as_nanos() as u64;
        Ok(shoal_core::ingest::IngestConfig {
            sources: self.hosted_sources(),
            slice_clock: clock,
            first_slice,
            end_slice: self.slices()?.map(|n| first_slice + n),
            time_origin_ns: if settings.run_relative { clock.start_of(first_slice).as_nanos() } else { 0 },
            max_fragment_bytes: u64::from(s.input_max_fragment_mb) << 20,
            max_held_bytes: s.input_held_mb << 20,
            max_ahead_slices: ((s.input_max_ahead_s * 1e9) as u64).div_ceil(slice_ns).max(2),
        })
    }

    /// The source node's settings for the sources this process hosts.
    pub fn source_node(&self) -> Result<SourceNodeConfig, ConfigError> {
        let clock = self.slice_clock()?;
        let mut c = SourceNodeConfig::new(self.hosted_sources(), self.run.builders, self.policy()?, clock);
        c.first_slice = self.run.start_slice;
        c.slices = self.slices()?;
        let s = &self.source;
        c.cutoff = s.cutoff.then_some(CutoffConfig { head: s.cutoff_head, tail: s.cutoff_tail });
        c.queue_limit_bytes = s.queue_limit_mb << 20;
        c.held_limit_bytes = s.held_limit_bytes.unwrap_or(u64::MAX);
        c.max_lag = (s.max_lag_ms > 0).then(|| Duration::from_millis(s.max_lag_ms));
        c.stall_limit_slices = s.stall_limit_slices.max(1);
        c.drain_timeout = Duration::from_millis(s.drain_timeout_ms);
        c.saturate = s.saturate;
        if self.input()? != InputKind::Generator {
            c.produce_delay = Duration::from_millis(s.input_latency_ms);
            c.data_driven = true;
        }
        Ok(c)
    }

    /// The builder node's settings.
    pub fn dfm_addr(&self) -> Result<SocketAddr, ConfigError> {
        let s = &self.run.dfm_addr;
        s.parse().map_err(|e| ConfigError::Invalid(format!("run.dfm_addr {s:?}: {e}")))
    }

    /// The run's first slice and slice count (sources produce exactly these).
    pub fn slices(&self) -> Result<Option<u64>, ConfigError> {
        let clock = self.slice_clock()?;
        Ok((self.run.seconds > 0.0)
            .then(|| ((self.run.seconds * 1e9) as u64).div_ceil(clock.length().as_nanos() as u64).max(1)))
    }

    pub fn builder_node(&self, id: u32) -> Result<BuilderNodeConfig, ConfigError> {
        Ok(BuilderNodeConfig { id, assembler: self.assembler(), slice_clock: self.slice_clock()? })
    }

    pub fn policy(&self) -> Result<Policy, ConfigError> {
        self.run.policy.parse().map_err(|e| ConfigError::Invalid(format!("run.policy: {e}")))
    }

    pub fn slice_clock(&self) -> Result<SliceClock, ConfigError> {
        SliceClock::try_new(Duration::from_millis(self.run.slice_ms))
            .filter(|c| c.length() <= Duration::from_secs(4))
            .ok_or_else(|| ConfigError::Invalid("run.slice_ms must be between 1 and 4000".into()))
    }

    /// Source ids this process hosts.
    /// A digest of the configuration as this version of shoal reads it (every field,
    /// defaults filled in): processes given the same text by run control but reading it
    /// differently (another version, other defaults) have different digests.
    pub fn digest(&self) -> String {
        let text = serde_json::to_vec(self).unwrap_or_default();
        format!("{:08x}", shoal_core::checksum::crc32c(&text))
    }

    pub fn hosted_sources(&self) -> Vec<SourceId> {
        if self.source.ids.is_empty() { (0..self.run.sources).collect() } else { self.source.ids.clone() }
    }

    pub fn builder_addr(&self, id: u32) -> Result<SocketAddr, ConfigError> {
        let s = self
            .run
            .builder_addrs
            .get(id as usize)
            .ok_or_else(|| ConfigError::Invalid(format!("run.builder_addrs has no entry for builder {id}")))?;
        s.parse().map_err(|e| ConfigError::Invalid(format!("run.builder_addrs[{id}] {s:?}: {e}")))
    }

    pub fn builder_listen(&self) -> Result<SocketAddr, ConfigError> {
        match &self.builder.listen {
            Some(s) => s.parse().map_err(|e| ConfigError::Invalid(format!("builder.listen {s:?}: {e}"))),
            None => self.builder_addr(self.builder.id),
        }
    }

    pub fn writer_addr(&self) -> Result<SocketAddr, ConfigError> {
        let s = &self.run.writer_addr;
        s.parse().map_err(|e| ConfigError::Invalid(format!("run.writer_addr {s:?}: {e}")))
    }

    pub fn writer_listen(&self) -> Result<SocketAddr, ConfigError> {
        match &self.writer.listen {
            Some(s) => s.parse().map_err(|e| ConfigError::Invalid(format!("writer.listen {s:?}: {e}"))),
            None => self.writer_addr(),
        }
    }

    pub fn assembler(&self) -> AssemblerConfig {
        AssemblerConfig {
            n_sources: self.run.sources,
            max_active: self.builder.max_active,
            wall_timeout: Duration::from_millis(self.builder.wall_timeout_ms),
            memory_budget: self.builder.memory_budget_mb << 20,
        }
    }

    /// The handshake of `role`'s links to `peer_role` (`[security] data`).
    pub fn data_connector(&self, role: &str, peer_role: &str) -> Result<shoal_tls::Connector, ConfigError> {
        let sec = &self.security;
        sec.credentials.connector(sec.data, role, peer_role).map_err(|e| ConfigError::Invalid(format!("{e:#}")))
    }

    /// The handshake on the ports of `role` and what each peer may send as (`[security]
    /// data` and `peers`).
    pub fn data_port(&self, role: &str) -> Result<crate::transport::secure::DataPort, ConfigError> {
        let sec = &self.security;
        if sec.data != shoal_tls::DataSecurity::Off && sec.peers.is_empty() {
            return invalid(format!(
                "security.data = {:?} needs [security.peers]: which ids each certificate's process may send as \
                 (run control fills it from the cluster file; docs/security.md)",
                sec.data.as_str()
            ));
        }
        sec.credentials.data_port(sec.data, role, &sec.peers).map_err(|e| ConfigError::Invalid(format!("{e:#}")))
    }

    /// The data path's transport.
    pub fn transport(&self) -> Result<Transport, ConfigError> {
        match self.run.transport.as_str() {
            "tcp" => Ok(Transport::Tcp),
            "udp" => Ok(Transport::Udp),
            "ucx" => Ok(Transport::Ucx),
            other => invalid(format!("run.transport {other:?}: tcp, udp or ucx")),
        }
    }

    /// The run's datagram seal: with `[security] data` (`authenticated` or `tls`, the same
    /// for datagrams) on the datagram transport, the key must be given (run control and the
    /// demo draw one).
    pub fn datagram_mac(&self) -> Result<Option<std::sync::Arc<crate::transport::udp::mac::DatagramMac>>, ConfigError> {
        use crate::transport::udp::mac::DatagramMac;
        if self.security.data == shoal_tls::DataSecurity::Off || self.transport()? != Transport::Udp {
            return Ok(None);
        }
        if self.security.udp_key.is_empty() {
            return invalid(
                "security.data with run.transport = \"udp\" needs security.udp_key, the run's datagram key \
                 (run control hands out a fresh one with every CONFIGURE; docs/security.md)",
            );
        }
        let mac = DatagramMac::from_hex(&self.security.udp_key).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        Ok(Some(std::sync::Arc::new(mac)))
    }

    /// The datagram transport's budgets.
    pub fn udp_config(&self) -> shoal_core::datagram::UdpConfig {
        let u = &self.udp;
        // A sealed datagram carries its nonce and tag within the configured size.
        let tag = match self.datagram_mac() {
            Ok(Some(_)) => crate::transport::udp::mac::SEAL_LEN as u16,
            _ => 0,
        };
        shoal_core::datagram::UdpConfig {
            max_payload: u.max_payload.saturating_sub(tag),
            retransmit_bytes: u.retransmit_mb << 20,
            retransmit_age: Duration::from_millis(u.retransmit_age_ms),
            start_retransmit_age: Duration::from_millis(u.start_retransmit_age_ms),
            nack_delay: Duration::from_micros(u.nack_delay_us),
            nack_interval: Duration::from_micros(u.nack_interval_us),
            max_nacks: u.max_nacks,
            reassembly_timeout: Duration::from_millis(u.reassembly_timeout_ms),
            ..shoal_core::datagram::UdpConfig::default()
        }
    }

    /// `udp.socket_buffer_mb` in bytes.
    pub fn udp_socket_buffer(&self) -> usize {
        (self.udp.socket_buffer_mb << 20) as usize
    }

    pub fn max_payload(&self) -> u32 {
        self.builder.max_payload_mb.saturating_mul(1 << 20)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_hit_generator_without_a_replay_pool_or_input_generates_live() {
        let with = |text: &str| toml::from_str::<Config>(text).unwrap().generates_hits_live();
        assert!(with(""));
        assert!(with("[source]\ngenerator = \"noise\""));
        assert!(!with("[source]\nreplay_pool = 16"));
        assert!(!with("[source]\ngenerator = \"fixed\""));
        assert!(!with("[source]\ninput = \"unix:/tmp/shoal-readout.sock\""));
    }

    #[test]
    fn example_file_documents_the_defaults() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/shoal.toml");
        let cfg = Config::from_file(&path).expect("examples/shoal.toml parses");
        assert_eq!(cfg, Config::default(), "examples/shoal.toml must show every default");
        Config::default().validate().unwrap();
    }

    #[test]
    fn rejects_bad_input_with_a_clear_message() {
        let bad = |text: &str| {
            let cfg: Result<Config, _> = toml::from_str(text);
            match cfg {
                Err(e) => e.to_string(),
                Ok(c) => c.validate().unwrap_err().to_string(),
            }
        };
        assert!(bad("[run]\npolicy = \"fast\"").contains("run.policy"));
        assert!(bad("[run]\nslice_ms = 0").contains("slice_ms"));
        assert!(bad("[run]\nsources = 2\n[source]\nids = [5]").contains("source.ids"));
        assert!(bad("[run]\nbogus = 1").contains("bogus"));
        assert!(bad("[builder.filter]\nname = \"nope\"").contains("nope"));
        assert!(bad("[source]\ngenerator = \"noise\"\n[source.noise]\nrate_hz = -1.0").contains("rate"));
        assert!(bad("[source.physics]\nsingles_hz = -1.0").contains("source.physics"));
        assert!(bad("[run]\ntransport = \"sctp\"").contains("run.transport"));
        assert!(bad("[source]\ninput = \"tcp:1.2.3.4:5\"").contains("source.input"));
        assert!(bad("[source]\ninput = \"udp:nowhere\"").contains("source.input"));
        assert!(bad("[source]\ninput_backpressure = \"maybe\"").contains("input_backpressure"));
        assert!(bad("[source]\ninput_time_base = \"gps\"").contains("input_time_base"));
        assert!(bad("[source]\ninput_max_fragment_mb = 64").contains("max_payload_mb"));
    }
}
