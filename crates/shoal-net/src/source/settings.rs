//! A source node's settings, derived once from the [`Config`] where the role starts:
//! nothing below reads the `Config`.

use std::net::SocketAddr;
use std::time::Duration as StdDuration;

use shoal_core::Duration;
use shoal_core::datagram::UdpConfig;
use shoal_core::node::SourceNodeConfig;
use shoal_core::slice::SliceNumber;
use shoal_detector::Generator;

use crate::config::{Config, ConfigError, Transport};
use crate::source::prefetch;
use crate::transport::link::Backoff;

/// What a source node (the sources of `cfg.source.ids`) runs with.
pub struct SourceSettings {
    /// The node machine's configuration: sources, policy, slices, queue limits.
    pub node: SourceNodeConfig,
    /// The generator of the workload (unused when an ingest feeds the node).
    pub generator: Generator,
    /// Every builder's data address, by builder id.
    pub builder_addrs: Vec<SocketAddr>,
    pub backoff: Backoff,
    pub transport: Transport,
    pub udp: UdpConfig,
    pub run_number: u64,
    pub udp_socket_buffer: usize,
    /// One connection per hosted source and builder, as boards that each hold their own.
    pub connection_per_source: bool,
    /// Slices computed ahead off the runtime's workers (0: at each slice end, in the loop).
    pub ahead_slices: SliceNumber,
    /// Most bytes computed ahead.
    pub ahead_limit_bytes: u64,
    /// How long the links may take to deliver what is queued at the end.
    pub drain_timeout: StdDuration,
    /// The handshake of every link to a builder (`[security] data`).
    pub connector: shoal_tls::Connector,
    /// `run.transport = "udp"` under `[security] data`: the run's datagram MAC.
    pub datagram_mac: Option<std::sync::Arc<crate::transport::udp::mac::DatagramMac>>,
}

impl SourceSettings {
    /// The settings of `cfg`'s hosted sources; `record_transmits` keeps the node's log of
    /// every transmit (parity tests). `ingest_first_slice`: user code submits the
    /// fragments (the SDK, an input socket) from that slice on.
    pub fn from_config(
        cfg: &Config,
        record_transmits: bool,
        ingest_first_slice: Option<SliceNumber>,
    ) -> Result<Self, ConfigError> {
        let mut node = cfg.source_node()?;
        node.record_transmits = record_transmits;
        if let Some(first) = ingest_first_slice {
            node.first_slice = Some(first);
            node.produce_delay = Duration::from_millis(cfg.source.input_latency_ms);
            node.data_driven = true;
        }
        let s = &cfg.source;
        Ok(Self {
            node,
            generator: cfg.workload()?,
            builder_addrs: (0..cfg.run.builders).map(|b| cfg.builder_addr(b)).collect::<Result<_, _>>()?,
            backoff: Backoff {
                min: StdDuration::from_millis(s.reconnect_min_ms.max(1)),
                max: StdDuration::from_millis(s.reconnect_max_ms.max(s.reconnect_min_ms.max(1))),
            },
            transport: cfg.transport()?,
            udp: cfg.udp_config(),
            run_number: cfg.run.run_number,
            udp_socket_buffer: cfg.udp_socket_buffer(),
            connection_per_source: s.connection_per_source,
            ahead_slices: prefetch::ahead_slices(cfg)?,
            ahead_limit_bytes: s.prefetch_limit_bytes.unwrap_or(prefetch::MAX_BYTES),
            drain_timeout: StdDuration::from_millis(s.drain_timeout_ms.max(1000)),
            connector: cfg.data_connector("source", "builder")?,
            datagram_mac: cfg.datagram_mac()?,
        })
    }
}
