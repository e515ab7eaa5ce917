//! The builder: accepts every source's connection, finds frames in each byte stream,
//! assembles slices (shoal-core's [`shoal_core::node::BuilderNode`]), filters them on a thread of its own
//! and ships the selected events to the writer.
//!
//! Beside the filter, the burst saver (shoal-core's `BurstSaver`) keeps the last seconds
//! of built slices and the late fragments; what it saves goes through the builder's spool
//! ([`crate::builder::spool`]: local disk first, then the writer). Alerts arrive through
//! [`Live::alerts`].
//!
//! Receiving never waits for filtering: completed slices go to the filter thread through a
//! queue ([`crate::builder::filter_queue`], a batch per round of the assembler's loop) bounded in
//! *bytes* by the assembler's memory budget (the filter releases bytes as it finishes a
//! batch; above the budget new fragments are dropped and counted) and in slices
//! (`builder.filter_queue_slices`; beyond, a slice goes unfiltered, counted). A
//! connection that sends garbage is closed with a logged reason and a counted rejection;
//! the other connections carry on.
//!
//! Pull runs: the builder keeps a connection to the data-flow manager (greeting it with the
//! slices it holds after every connect, reading assignments, returning credits and a
//! heartbeat with its memory in use), and writes its fragment requests back on the
//! connection of the source that greeted it.
//!
//! Laid out by concern: [`BuilderSettings`] derived once from the configuration, the
//! driver that owns the tasks (`driver`), the data port (`accept`), what an arrival does
//! (`assemble`), the hand-off to the filter (`forward`), the filter thread (`filter`), the
//! burst saver (`saving`, [`spool`]) and pull (`pull`).

mod accept;
mod assemble;
mod driver;
mod filter;
pub mod filter_queue;
mod forward;
mod hold;
pub mod km3out;
mod pull;
mod report;
mod saving;
mod settings;
pub mod spool;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

pub use report::BuilderReport;
pub use settings::{BuilderSettings, FilterSettings, SaverSettings};

use crate::clock::WallClock;
use crate::config::{Config, ConfigError, Transport};
use crate::live::Live;
use crate::transport::listen::DataPort;

/// Binds a builder's data port at `addr`: the TCP listener and, for the datagram
/// transport, its UDP socket on the same port ([`crate::transport::listen::bind_data_port`]).
pub fn bind_port(cfg: &Config, addr: std::net::SocketAddr) -> anyhow::Result<DataPort> {
    let udp = matches!(cfg.transport()?, Transport::Udp).then(|| cfg.udp_socket_buffer());
    Ok(crate::transport::listen::bind_data_port(addr, udp)?)
}

/// Runs a builder on an already bound port until every source has ended its stream (or
/// `cancel`), then processes what is left and closes.
pub async fn run_builder(
    settings: BuilderSettings,
    port: impl Into<DataPort>,
    clock: WallClock,
    live: Arc<Live>,
    cancel: CancellationToken,
) -> Result<BuilderReport, ConfigError> {
    let driver = driver::BuilderDriver::start(settings, port.into(), clock, live)?;
    Ok(driver.run(&cancel).await)
}
