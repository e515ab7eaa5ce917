//! shoal-sim: a deterministic, packet-level discrete-event network simulator that runs
//! shoal-core's real node machines (a [`shoal_core::node::SourceNode`] per board, a
//! [`shoal_core::node::BuilderNode`] per builder, the runtime's workloads) over modelled
//! links, switches, TCP and UDP.
//!
//! Main types:
//! - [`engine::EventQueue`]: timestamp-ordered events (ties broken by insertion order), no
//!   wall clock; time is [`shoal_core::Instant`] in ns since the start of the simulation.
//! - [`net::Network`]: hosts and switches joined by unidirectional ports (rate,
//!   propagation delay, drop-tail queue in packets or bytes, bit error rate, optionally a
//!   token bucket), switches forward by destination; [`net::SharedCpu`]: software nodes
//!   taking packets in on shared cores (off by default).
//! - [`tcp`]: a NewReno TCP model, with Linux's RACK, tail-loss probes and (in
//!   [`tcp::sack`]) SACK recovery as options; UDP (in [`sim`]): datagrams split into IP fragments.
//! - [`wake::WakeLatency`]: how late software sources wake after a slice ends (off for
//!   hardware boards).
//!
//! Everything random comes from the scenario's seed (the network's PCG stream, the workloads'
//! per (seed, source, slice) draws): the same scenario and seed give identical results.

pub mod engine;
pub mod net;
pub mod plot;
pub mod report;
pub mod scenario;
pub mod sim;
pub mod tcp;
pub mod wake;
