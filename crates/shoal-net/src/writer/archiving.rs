//! The writer's archive under run control (`writer.archive`): one archiver
//! (`shoal_archive::Archiver`) for the writer's `out_dir`, started with the process's first
//! run that asks for it and kept for the process's life, so that files still pending at a
//! run's end become safe after it. What it says is in [`crate::archive::ArchiveLive`].

use shoal_archive::{ArchiveConfig, Archiver, Destination};
use tracing::{error, info};

use crate::config::Config;

/// The archiver's settings from the configuration (none: `writer.archive` is empty).
pub fn settings(cfg: &Config) -> Result<Option<ArchiveConfig>, crate::config::ConfigError> {
    let w = &cfg.writer;
    if w.archive.is_empty() {
        return Ok(None);
    }
    let destinations = w
        .archive
        .iter()
        .map(|u| Destination::parse(u).map_err(|e| crate::config::ConfigError::Invalid(format!("writer.archive: {e}"))))
        .collect::<Result<Vec<_>, _>>()?;
    let mut a = ArchiveConfig::new(&w.out_dir, destinations);
    a.delete_after = w.archive_delete_after;
    a.max_attempts = w.archive_max_attempts.max(1);
    Ok(Some(a))
}

/// Starts the process's archiver for `cfg`'s output directory, once; later calls do
/// nothing (the first run's destinations hold for the process's life).
pub fn ensure_started(cfg: &Config, live: &std::sync::Arc<crate::live::Live>) {
    let Ok(Some(settings)) = settings(cfg) else { return };
    if live.archive.started.swap(true, std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    let live = live.clone();
    let dir = settings.dir.clone();
    match Archiver::open(settings) {
        Ok(mut archiver) => {
            *live.archive.ledgers.lock().expect("archive ledgers lock") = Some(archiver.watch());
            info!(dir = %dir.display(), "archiver started");
            tokio::spawn(async move {
                // Never cancelled: it keeps the files as long as the process lives.
                let r = archiver.run(tokio_util::sync::CancellationToken::new(), false).await;
                if let Err(e) = r {
                    error!(dir = %dir.display(), error = %format!("{e:#}"), "the archiver stopped");
                    *live.archive.error.lock().expect("archive error lock") = Some(format!("{e:#}"));
                }
            });
        }
        Err(e) => {
            error!(dir = %dir.display(), error = %format!("{e:#}"), "the archiver cannot start");
            *live.archive.error.lock().expect("archive error lock") = Some(format!("{e:#}"));
        }
    }
}
