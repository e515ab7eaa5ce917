//! What the rest of a writer process sees of its archiver (`writer.archive`; started by
//! `crate::writer::archiving`): the ledgers as they change, for the writer's end report
//! (the run record) and `/metrics` (`shoal_archive_*`).

use std::sync::Mutex;
use std::sync::atomic::AtomicBool;

use shoal_archive::Snapshot;
use shoal_core::custody::ArchiveLedger;
use tokio::sync::watch;

/// The process's archiver, seen from the rest of it.
#[derive(Debug, Default)]
pub struct ArchiveLive {
    pub(crate) started: AtomicBool,
    pub(crate) ledgers: Mutex<Option<watch::Receiver<Snapshot>>>,
    /// Why the archiver stopped or could not start.
    pub(crate) error: Mutex<Option<String>>,
}

impl ArchiveLive {
    /// The ledger of `run`'s files now (none: no archiver, or no file of that run yet).
    pub fn ledger_of(&self, run: u64) -> Option<ArchiveLedger> {
        let g = self.ledgers.lock().expect("archive ledgers lock");
        g.as_ref().and_then(|rx| rx.borrow().by_run.get(&run).cloned())
    }

    /// The ledger over every file the archiver keeps.
    pub fn total(&self) -> Option<ArchiveLedger> {
        let g = self.ledgers.lock().expect("archive ledgers lock");
        g.as_ref().map(|rx| rx.borrow().total.clone())
    }

    pub fn error(&self) -> Option<String> {
        self.error.lock().expect("archive error lock").clone()
    }
}

/// `shoal_archive_*` on `/metrics`: bytes and files by state, the oldest pending file's age.
pub fn register_metrics(
    reg: &mut prometheus_client::registry::Registry,
    labels: &[(String, String)],
    live: &ArchiveLive,
) {
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    let Some(l) = live.total() else { return };
    let bytes = Family::<Vec<(String, String)>, Gauge>::default();
    let files = Family::<Vec<(String, String)>, Gauge>::default();
    for (state, b, f) in [
        ("written", l.bytes_written, l.files),
        ("safe", l.bytes_safe, l.files_safe),
        ("pending", l.bytes_pending, l.files_pending),
        ("quarantined", l.bytes_quarantined, l.files_quarantined),
        ("lost", l.bytes_lost, l.lost.len() as u64),
    ] {
        let mut with = labels.to_vec();
        with.push(("state".into(), state.into()));
        bytes.get_or_create(&with).set(b as i64);
        files.get_or_create(&with).set(f as i64);
    }
    reg.register("shoal_archive_bytes", "Bytes the writer stored, by their state in the archive", bytes);
    reg.register("shoal_archive_files", "Files the writer stored, by their state in the archive", files);
    let age = Family::<Vec<(String, String)>, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    let oldest = l.oldest_pending_closed_at.map_or(0.0, |t| (shoal_store::custody::unix_now() - t).max(0.0));
    age.get_or_create(&labels.to_vec()).set(oldest);
    reg.register(
        "shoal_archive_oldest_pending_seconds",
        "Time since the oldest file not yet safe closed (0: none pending)",
        age,
    );
    let up = Family::<Vec<(String, String)>, Gauge>::default();
    up.get_or_create(&labels.to_vec()).set(i64::from(live.error().is_none()));
    reg.register("shoal_archive_up", "1 while the writer's archiver runs, 0 once it stopped on an error", up);
}
