//! A builder's settings, derived once from the [`Config`] where the role starts: every
//! check of the configuration a builder depends on happens here, so that a bad value
//! refuses the run before a port is touched, and nothing below reads the `Config`.

use std::net::SocketAddr;
use std::time::Duration as StdDuration;

use shoal_core::datagram::UdpConfig;
use shoal_core::node::BuilderNodeConfig;
use shoal_core::saver::SaverConfig;
use shoal_core::shaping::PullConfig;
use shoal_core::slice::{SliceClock, SliceNumber};
use shoal_trigger::FilterConfig;

use crate::builder::km3out::Km3Settings;
use crate::builder::spool::SpoolConfig;
use crate::config::{Config, ConfigError, ConsumersConfig, ReceivePath, Transport};
use crate::transport::link::Backoff;

/// What builder `id` runs with.
/// How far ahead of the builder's clock a fragment's slice may begin: sources send a slice
/// once it has ended by their clock, and run control keeps the clocks within milliseconds,
/// so only a broken or hostile source sends further ahead (a slice opened there would push
/// the run's real slices out of the window, incomplete).
pub const FUTURE_HORIZON: StdDuration = StdDuration::from_secs(2);

#[derive(Clone, Debug)]
pub struct BuilderSettings {
    pub id: u32,
    /// Sources that send to this builder (every source of the run).
    pub sources: u32,
    pub run_number: u64,
    pub slice_clock: SliceClock,
    /// The node machine's configuration (assembler, window, budget).
    pub node: BuilderNodeConfig,
    /// Pull policies: the credits' configuration and the data-flow manager's address.
    pub pull: Option<(PullConfig, SocketAddr)>,
    pub transport: Transport,
    /// The datagram endpoint's configuration (used with [`Transport::Udp`]).
    pub udp: UdpConfig,
    pub udp_socket_buffer: usize,
    pub receive: ReceivePath,
    /// Largest payload a frame on the data port may carry.
    pub max_payload: u32,
    /// Free-running sources over TCP are held back by their connections
    /// (`builder::hold`) rather than pushed out incomplete.
    pub holds_connections: bool,
    /// Sources on the run's slice clock: a fragment for a slice that begins more than this
    /// after the builder's now is refused with its connection (`window`). None where the
    /// sources' data time is not the wall clock's (free-running, KM3NeT's CLB packets).
    pub future_horizon: Option<StdDuration>,
    /// `run.transport = "udp"` under `[security] data`: the run's datagram MAC.
    pub datagram_mac: Option<std::sync::Arc<crate::transport::udp::mac::DatagramMac>>,
    /// `builder.held_receive_buffer` as asked (0: a share of the host's TCP memory).
    pub held_receive_buffer: u64,
    pub writer_addr: SocketAddr,
    pub writer_backoff: Backoff,
    /// The handshakes (`[security] data`): on the data port, to the writer, to the
    /// data-flow manager.
    pub data_port: crate::transport::secure::DataPort,
    pub to_writer: shoal_tls::Connector,
    pub to_dfm: shoal_tls::Connector,
    pub saver: Option<SaverSettings>,
    pub filter: FilterSettings,
    /// `[tap] raw_every`: every n-th processed slice to the raw tap (0: none).
    pub raw_every: u64,
    /// Delays count as steady from this slice (the run's first plus the warm-up).
    pub steady_from: Option<SliceNumber>,
    /// How long the filter thread may take to finish its queue at the end of a run.
    pub filter_drain: StdDuration,
}

/// The burst saver and its spool.
#[derive(Clone, Debug)]
pub struct SaverSettings {
    pub saver: SaverConfig,
    pub spool: SpoolConfig,
}

/// The filter thread's work.
#[derive(Clone, Debug)]
pub struct FilterSettings {
    pub filter: FilterConfig,
    /// Most processed slices queued for the filter; beyond, a slice goes unfiltered.
    pub queue_slices: usize,
    /// Fault injection (`builder.fault_filter_ms_per_slice`): least time per slice.
    pub least_per_slice: StdDuration,
    /// Offer every slice's events to the `SHL_EVT` tap.
    pub tap_events: bool,
    /// Every fragment of every processed slice to the writer.
    pub store_slices: bool,
    pub consumers: ConsumersConfig,
    /// KM3NeT mode: superframes in, the DataFilter's outputs out.
    pub km3: Option<Km3Settings>,
}

impl BuilderSettings {
    /// Builder `id`'s settings, or the configuration's first error that concerns it.
    pub fn from_config(cfg: &Config, id: u32) -> Result<Self, ConfigError> {
        let slice_clock = cfg.slice_clock()?;
        let transport = cfg.transport()?;
        let pull = match cfg.policy()?.pull() {
            Some(p) => Some((p, cfg.dfm_addr()?)),
            None => None,
        };
        let saver = cfg.saver.enabled.then(|| SaverSettings {
            saver: cfg.saver_config(),
            spool: SpoolConfig {
                builder: id,
                run: cfg.run.run_number,
                dir: cfg.spool_dir(),
                max_bytes: cfg.saver.spool_max_mb << 20,
                slice_clock,
                ship_bytes_per_s: (cfg.saver.ship_mb_per_s * 1e6) as u64,
            },
        });
        Ok(Self {
            id,
            sources: cfg.run.sources,
            run_number: cfg.run.run_number,
            slice_clock,
            node: cfg.builder_node(id)?,
            pull,
            transport,
            udp: cfg.udp_config(),
            udp_socket_buffer: cfg.udp_socket_buffer(),
            receive: cfg.builder.receive,
            max_payload: cfg.max_payload(),
            holds_connections: cfg.source.saturate && matches!(transport, Transport::Tcp),
            future_horizon: (!cfg.source.saturate && !cfg.km3net.is_on()).then_some(FUTURE_HORIZON),
            datagram_mac: cfg.datagram_mac()?,
            held_receive_buffer: cfg.builder.held_receive_buffer,
            writer_addr: cfg.writer_addr()?,
            writer_backoff: Backoff {
                min: StdDuration::from_millis(cfg.source.reconnect_min_ms.max(1)),
                max: StdDuration::from_millis(cfg.source.reconnect_max_ms.max(1)),
            },
            data_port: cfg.data_port("builder")?,
            to_writer: cfg.data_connector("builder", "writer")?,
            to_dfm: cfg.data_connector("builder", "dfm")?,
            saver,
            filter: FilterSettings {
                filter: cfg.builder.filter.clone(),
                queue_slices: cfg.builder.filter_queue_slices as usize,
                least_per_slice: StdDuration::from_millis(cfg.builder.fault_filter_ms_per_slice),
                tap_events: cfg.tap.events,
                store_slices: cfg.builder.store_slices,
                consumers: cfg.builder.consumers.clone(),
                km3: Km3Settings::from_config(cfg)?,
            },
            raw_every: cfg.tap.raw_every,
            steady_from: cfg.run.start_slice.map(|first| shoal_core::node::steady_from(first, slice_clock)),
            filter_drain: StdDuration::from_millis(cfg.builder.drain_timeout_ms / 2),
        })
    }
}
