//! shoal-sim: a deterministic, packet-level discrete-event network simulator that runs
//! shoal-core's real policies (shapers, slice assembler, ledger) over modelled links,
//! switches, TCP and UDP.
//!
//! Main types:
//! - [`engine::EventQueue`]: timestamp-ordered events (ties broken by insertion order), no
//!   wall clock; time is [`shoal_core::Instant`] in ns since the start of the simulation.
//! - [`net::Network`]: hosts and switches joined by unidirectional ports (rate,
//!   propagation delay, drop-tail queue in packets or bytes, bit error rate); switches
//!   forward by destination.
//! - [`tcp`]: a NewReno TCP model; [`udp`]: datagrams split into IP fragments.
//!
//! Everything random comes from one seeded PCG stream: the same scenario and seed give
//! identical results.

pub mod engine;
pub mod net;
pub mod plot;
pub mod report;
pub mod scenario;
pub mod sim;
pub mod tcp;
