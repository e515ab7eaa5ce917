//! The source SDK's Rust face: a readout program's handle on a source process.
//!
//! ```no_run
//! use shoal_net::sdk::SourceHandle;
//! use shoal_core::ingest::When;
//!
//! let mut cfg = shoal_net::config::Config::default();
//! cfg.run.seconds = 0.0; // the run ends at close()
//! cfg.source.input_time_base = "run".into(); // data times count from the run's start
//! let source = SourceHandle::open(cfg)?;
//! for slice in 0..100u64 {
//!     let t = slice * 10_000_000; // ns since the run's start: one fragment per 10 ms slice
//!     source.submit(0, When::TimeNs(t), bytes::Bytes::from(vec![0u8; 30_000]))?;
//! }
//! let report = source.close()?; // waits for the drain; every fragment accounted
//! println!("{} fragments produced", report.tallies[&0].produced);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`SourceHandle::open`] starts the same source loop `shoal node --role source` runs
//! (shaping, TCP or UDP links to every builder, pull, the ledger's tallies) on a thread of
//! its own with a small tokio runtime; `submit` hands fragments to its ingest
//! ([`crate::source::ingest`]) from any thread. With `source.input` set, the input socket runs
//! beside the API.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration as StdDuration;

use bytes::Bytes;
use shoal_core::SourceId;
use shoal_core::ingest::{IngestError, Placed, Submission, When};
use tokio_util::sync::CancellationToken;

use crate::clock::WallClock;
use crate::config::{Config, ConfigError};
use crate::live::Live;
use crate::source::SourceReport;
use crate::source::ingest::{InputTask, SharedIngest};

/// Why the SDK could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum SdkError {
    #[error("configuration: {0}")]
    Config(#[from] ConfigError),
    #[error("{0}")]
    Refused(#[from] IngestError),
    #[error("starting the source: {0}")]
    Start(String),
    #[error("the source's data path failed: {0}")]
    Run(String),
}

/// A running source process inside the caller's program. See the module documentation.
///
/// Thread-safety: `submit`, `flush` and the getters take `&self` and may be called from
/// any number of threads at once; `close` consumes the handle.
pub struct SourceHandle {
    ingest: Arc<SharedIngest>,
    cancel: CancellationToken,
    thread: Option<std::thread::JoinHandle<Result<SourceReport, String>>>,
    input: Option<InputTask>,
}

impl SourceHandle {
    /// Starts a source process for `cfg` (the same TOML schema as every process: the
    /// run's builders, policy, transport and `[source]`, whose `input_*` settings apply).
    pub fn open(mut cfg: Config) -> Result<Self, SdkError> {
        cfg.validate()?;
        crate::budget::apply_memory_plan(&mut cfg, shoal_core::runstate::Role::Source)?;
        let clock = WallClock::new();
        let first = match cfg.run.start_slice {
            Some(s) => s,
            None => cfg.slice_clock()?.first_on_a_second_after(clock.now()),
        };
        cfg.run.start_slice = Some(first);
        let ingest = crate::source::ingest::shared_ingest(&cfg, first)?;
        let input = InputTask::start(&cfg.input()?, &cfg, ingest.clone())?;
        let cancel = CancellationToken::new();
        let (i, c) = (ingest.clone(), cancel.clone());
        let thread = std::thread::Builder::new()
            .name("shoal-source".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("shoal-source-rt")
                    .enable_all()
                    .build()
                    .map_err(|e| format!("tokio runtime: {e}"))?;
                let live = Arc::new(Live::default());
                // On a worker, as `shoal node` runs its role (the source's loop woken by its
                // links' tasks without a futex call to wake this thread).
                let source =
                    rt.spawn(async move { crate::source::run_source_with(&cfg, clock, live, c, false, Some(i)).await });
                match rt.block_on(source) {
                    Ok(result) => result.map_err(|e| e.to_string()),
                    Err(e) => Err(format!("the source's task ended without finishing: {e}")),
                }
            })
            .map_err(|e| SdkError::Start(e.to_string()))?;
        Ok(Self { ingest, cancel, thread: Some(thread), input })
    }

    /// [`SourceHandle::open`] with a TOML file.
    pub fn open_file(path: &Path) -> Result<Self, SdkError> {
        Self::open(Config::from_file(path)?)
    }

    /// [`SourceHandle::open`] with TOML text.
    pub fn open_toml(text: &str) -> Result<Self, SdkError> {
        Self::open(Config::from_toml_str(text)?)
    }

    /// Submits opaque payload bytes of `source` at data time or slice `when`. Blocks under
    /// back-pressure (`source.input_backpressure = "block"`, up to `input_block_ms`).
    /// `payload` is not copied when it is the only piece of its (source, slice).
    pub fn submit(&self, source: SourceId, when: When, payload: Bytes) -> Result<Placed, IngestError> {
        self.ingest.submit(Submission { source, when, hit_count: None, payload })
    }

    /// Submits `hit_count` shoal hit records (then whole waveform records), which the
    /// builders' filters read.
    pub fn submit_hits(
        &self,
        source: SourceId,
        when: When,
        hit_count: u32,
        payload: Bytes,
    ) -> Result<Placed, IngestError> {
        self.ingest.submit(Submission { source, when, hit_count: Some(hit_count), payload })
    }

    /// Waits until everything submitted so far is sent (or lost, accounted), at most
    /// `timeout`; a slice's data go out when the host clock passes its end plus
    /// `source.input_latency_ms`. Returns whether it is.
    pub fn flush(&self, timeout: StdDuration) -> bool {
        self.ingest.flush(timeout)
    }

    /// The run's first slice and when it starts (UNIX ns): data times before it are
    /// refused.
    pub fn first_slice(&self) -> u64 {
        self.ingest.first_slice()
    }

    pub fn first_slice_start_ns(&self) -> u64 {
        self.ingest.first_slice_start_ns()
    }

    /// What the input has counted so far.
    pub fn ingest_report(&self) -> shoal_core::ingest::IngestReport {
        self.ingest.report()
    }

    /// Ends the run after the last slice with data, waits for the drain and returns the
    /// end-of-run report (tallies for the ledger, the ingest's counts).
    pub fn close(mut self) -> Result<SourceReport, SdkError> {
        self.finish()
    }

    fn finish(&mut self) -> Result<SourceReport, SdkError> {
        self.ingest.close();
        if let Some(input) = self.input.take() {
            input.stop();
        }
        let Some(t) = self.thread.take() else {
            return Err(SdkError::Run("already closed".into()));
        };
        match t.join() {
            Ok(r) => r.map_err(SdkError::Run).map(|mut report| {
                // The source thread took the input's counts when it ended, which after an
                // abort can be before the caller's last (refused) submissions: the input is
                // closed now, so its counts are final. (Found by CI: a submission refused
                // after abort missing from the report.)
                report.ingest = Some(self.ingest.report());
                report
            }),
            Err(_) => Err(SdkError::Run("the source thread panicked".into())),
        }
    }

    /// Stops at once instead of after the data (Ctrl-C); what is queued still drains.
    pub fn abort(&self) {
        self.cancel.cancel();
        self.ingest.close();
    }
}

impl Drop for SourceHandle {
    /// A handle dropped without `close` ends its run the same way (the report is lost).
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.finish();
        }
    }
}
