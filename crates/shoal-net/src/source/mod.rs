//! The source process: a [`shoal_core::node::SourceNode`] (every decision) on one
//! [`crate::transport::link::Link`] per builder (the bytes), or with
//! `source.connection_per_source` one per hosted source and builder, as boards that each
//! hold their own connections. [`SourceSettings`] are derived from the configuration once;
//! the driver (`driver`) owns the links and the workload.
//!
//! The loop sleeps until the node's next timeout or a link report, feeds the node the
//! time, run control's end slice and pause flag, and hands the node's transmits to the
//! links. A link never blocks the loop, so a dead or slow builder cannot stall the others;
//! what that costs (the queue limit, drops at the source, the stall limit) is the node's
//! decision.

mod driver;
pub mod ingest;
mod links;
pub mod prefetch;
pub mod sdk;
mod settings;

use std::sync::Arc;

use shoal_core::SourceId;
use shoal_core::node::SourceNodeReport;
use tokio_util::sync::CancellationToken;

pub use settings::SourceSettings;

use crate::clock::WallClock;
use crate::config::{Config, ConfigError};
use crate::live::Live;
use crate::source::ingest::SharedIngest;

/// What a source process reports at the end (the node's report).
pub type SourceReport = SourceNodeReport;

/// Runs a source node until its run time is over (or `cancel`), then drains.
pub async fn run_source_node(
    cfg: Config,
    ids: Vec<SourceId>,
    clock: WallClock,
    live: Arc<Live>,
    cancel: CancellationToken,
) -> Result<SourceReport, ConfigError> {
    let mut cfg = cfg;
    cfg.source.ids = ids;
    let kind = cfg.input()?;
    if kind == crate::config::InputKind::Generator {
        return run_source(&cfg, clock, live, cancel, false).await;
    }
    // Real data from an input socket: fix the first slice now, so the ingest and the node
    // agree on it.
    let first = cfg
        .run
        .start_slice
        .unwrap_or_else(|| cfg.slice_clock().map(|c| c.first_on_a_second_after(clock.now())).unwrap_or_default());
    cfg.run.start_slice = Some(first);
    if let crate::config::InputKind::Unix(path) = &kind {
        crate::source::ingest::check_unix_path(path)?;
    }
    let ingest = crate::source::ingest::shared_ingest(&cfg, first)?;
    let input = crate::source::ingest::InputTask::start(&kind, &cfg, ingest.clone())?;
    let mut r = run_source_with(&cfg, clock, live, cancel, false, Some(ingest)).await;
    let clb = input.and_then(crate::source::ingest::InputTask::stop);
    if let Ok(report) = &mut r {
        report.clb = clb;
    }
    r
}

/// [`run_source_node`] for the sources of `cfg.source.ids`, optionally keeping the log of
/// every transmit (parity tests).
pub async fn run_source(
    cfg: &Config,
    clock: WallClock,
    live: Arc<Live>,
    cancel: CancellationToken,
    record_transmits: bool,
) -> Result<SourceReport, ConfigError> {
    run_source_with(cfg, clock, live, cancel, record_transmits, None).await
}

/// [`run_source`] whose fragments come from `ingest` (the source SDK, input sockets)
/// instead of the generator, when given. The ingest's first slice is the node's.
pub async fn run_source_with(
    cfg: &Config,
    clock: WallClock,
    live: Arc<Live>,
    cancel: CancellationToken,
    record_transmits: bool,
    ingest: Option<Arc<SharedIngest>>,
) -> Result<SourceReport, ConfigError> {
    let settings = SourceSettings::from_config(cfg, record_transmits, ingest.as_ref().map(|i| i.first_slice()));
    // Whatever becomes of the settings, the ingest is finished: submitters blocked on it
    // are released.
    let settings = match settings {
        Ok(s) => s,
        Err(e) => {
            if let Some(i) = &ingest {
                i.finish();
            }
            return Err(e);
        }
    };
    let driver = driver::SourceDriver::start(settings, clock, live, ingest)?;
    Ok(driver.run(&cancel).await)
}
