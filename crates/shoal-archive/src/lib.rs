//! shoal-archive: custody of every file shoal stores, from the writer's disk to permanent
//! storage, verified before anything is deleted.
//!
//! The [`Archiver`] watches one output directory. A file is closed when its metadata
//! (`NAME.json`, size and adler32 computed while it was written: `shoal_store::custody`)
//! exists; it is then copied to every [`Destination`] in the order files closed, each copy
//! checked against the destination's own checksum, retried with back-off on a failure or a
//! mismatch (the bad copy removed), quarantined after the limit, and its local copy deleted
//! only once it is safe where it must be (by default never). The decisions are
//! `shoal_core::custody`'s (sans-IO); this crate copies, deletes and keeps the
//! [`journal`], synced before each step, which is the state after a crash of any process
//! at any step.
//!
//! It runs where the files are: `shoal archive run DIR --to URL` beside the writer (a
//! process of its own, so that a slow or failing destination never holds up the data
//! path, and so that it goes on after the run), or inside `shoal demo --archive DIR`.
//! `shoal archive status DIR` reads the journal.

pub mod dest;
pub mod journal;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use shoal_core::custody::{Action, ArchiveLedger, Custody, CustodyConfig, FileState, Record, Seal};
use shoal_store::custody::{FileMetadata, unix_now};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub use dest::Destination;
use journal::{Journal, JournalConfig};

/// What an archiver is asked to do.
#[derive(Clone, Debug)]
pub struct ArchiveConfig {
    /// The directory whose closed files it keeps (the writer's `out_dir`).
    pub dir: PathBuf,
    pub destinations: Vec<Destination>,
    /// Delete a local copy once it is safe at this many destinations (none: never).
    pub delete_after: Option<usize>,
    pub max_attempts: u32,
    pub backoff: Duration,
    pub max_backoff: Duration,
    pub max_parallel: usize,
    /// How often the directory is looked at for newly closed files.
    pub scan_every: Duration,
}

impl ArchiveConfig {
    pub fn new(dir: impl Into<PathBuf>, destinations: Vec<Destination>) -> Self {
        let d = CustodyConfig::default();
        Self {
            dir: dir.into(),
            destinations,
            delete_after: None,
            max_attempts: d.max_attempts,
            backoff: d.backoff,
            max_backoff: d.max_backoff,
            max_parallel: d.max_parallel,
            scan_every: Duration::from_secs(1),
        }
    }

    fn custody(&self) -> CustodyConfig {
        CustodyConfig {
            destinations: self.destinations.len(),
            delete_after: self.delete_after,
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            max_backoff: self.max_backoff,
            max_parallel: self.max_parallel.max(1),
        }
    }
}

/// The ledgers at one moment: over every file, and run by run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub total: ArchiveLedger,
    pub by_run: std::collections::BTreeMap<u64, ArchiveLedger>,
}

/// One copy's outcome, from its task.
struct CopyDone {
    file: String,
    dest: usize,
    result: anyhow::Result<dest::Copied>,
}

/// Keeps one directory's files. See the crate documentation.
pub struct Archiver {
    cfg: ArchiveConfig,
    custody: Custody,
    journal: Journal,
    epoch: std::time::Instant,
    copies: JoinSet<CopyDone>,
    /// Journal lines a crash left cut short (read at start).
    pub torn_records: u64,
    /// Where each change of the ledgers goes ([`Archiver::watch`]).
    publish: Option<tokio::sync::watch::Sender<Snapshot>>,
}

impl Archiver {
    /// Opens `cfg.dir`'s journal and takes up where it stood.
    pub fn open(cfg: ArchiveConfig) -> anyhow::Result<Self> {
        anyhow::ensure!(!cfg.destinations.is_empty(), "an archive needs at least one destination");
        if let Some(n) = cfg.delete_after {
            anyhow::ensure!(
                (1..=cfg.destinations.len()).contains(&n),
                "delete_after = {n}: between 1 and the {} destination(s)",
                cfg.destinations.len()
            );
        }
        let (journal, read) =
            Journal::open(&cfg.dir).with_context(|| format!("the archive journal in {}", cfg.dir.display()))?;
        if let Ok(before) = Journal::read_config(&cfg.dir) {
            let now: Vec<String> = cfg.destinations.iter().map(Destination::url).collect();
            anyhow::ensure!(
                before.destinations == now,
                "{} was archived to {:?}; archiving it to {:?} would mix two journals' numbering of destinations \
                 (docs/archive.md)",
                cfg.dir.display(),
                before.destinations,
                now
            );
        }
        Journal::write_config(
            &cfg.dir,
            &JournalConfig {
                destinations: cfg.destinations.iter().map(Destination::url).collect(),
                delete_after: cfg.delete_after,
                max_attempts: cfg.max_attempts,
            },
        )?;
        let epoch = std::time::Instant::now();
        let mut custody = Custody::new(cfg.custody());
        for r in &read.records {
            custody.replay(r, shoal_core::Instant::ZERO);
        }
        if read.torn > 0 {
            warn!(torn = read.torn, "the archive journal had a line cut short by a crash; skipped");
        }
        Ok(Self { cfg, custody, journal, epoch, copies: JoinSet::new(), torn_records: read.torn, publish: None })
    }

    /// The ledgers now, over every file and run by run.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            total: self.custody.ledger(None),
            by_run: self.custody.runs().into_iter().map(|r| (r, self.custody.ledger(Some(r)))).collect(),
        }
    }

    /// The ledgers as they change, from now on.
    pub fn watch(&mut self) -> tokio::sync::watch::Receiver<Snapshot> {
        let (tx, rx) = tokio::sync::watch::channel(self.snapshot());
        self.publish = Some(tx);
        rx
    }

    fn publish(&self) {
        if let Some(tx) = &self.publish {
            tx.send_if_modified(|s| {
                let now = self.snapshot();
                let changed = *s != now;
                *s = now;
                changed
            });
        }
    }

    fn now(&self) -> shoal_core::Instant {
        shoal_core::Instant::from_nanos(self.epoch.elapsed().as_nanos() as u64)
    }

    fn record(&mut self, r: &Record) -> anyhow::Result<()> {
        self.journal.append(r).with_context(|| format!("writing {}", self.journal.path().display()))
    }

    /// Takes every file closed since the last look (its metadata exists), in the order
    /// they closed. Returns how many were new.
    pub fn scan(&mut self) -> anyhow::Result<usize> {
        let mut found: Vec<(f64, String, FileMetadata)> = Vec::new();
        for entry in std::fs::read_dir(&self.cfg.dir)? {
            let path = entry?.path();
            let Some(data) = FileMetadata::data_file_of(&path) else { continue };
            let name = data.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
            match FileMetadata::read(&path) {
                Ok(m) => {
                    let known = m.seal().is_some_and(|s| {
                        self.custody.knows(&name, Seal { bytes: s.bytes, adler32: s.adler32 }, m.closed_at)
                    });
                    if !known {
                        found.push((m.closed_at, name, m));
                    }
                }
                Err(e) => warn!(path = %path.display(), error = %e, "unreadable file metadata; file not archived"),
            }
        }
        found.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let now = self.now();
        for (_, name, m) in &found {
            let Some(seal) = m.seal() else {
                warn!(file = %name, checksum = %m.checksum, "metadata without an adler32; file not archived");
                continue;
            };
            let run = m.runs.first().map_or(0, |r| r.0);
            let seal = Seal { bytes: seal.bytes, adler32: seal.adler32 };
            let r = Record::Closed { file: name.clone(), run, seal, closed_at: m.closed_at };
            self.record(&r)?;
            self.custody.handle_closed(name, run, seal, m.closed_at, now);
        }
        if !found.is_empty() {
            self.publish();
        }
        Ok(found.len())
    }

    /// Starts or does what custody asks now.
    fn act(&mut self) -> anyhow::Result<()> {
        while let Some(action) = self.custody.poll_action(self.now()) {
            match action {
                Action::Copy { file, dest } => {
                    self.record(&Record::Copying { file: file.clone(), dest })?;
                    let d = self.cfg.destinations[dest].clone();
                    let local = self.cfg.dir.join(&file);
                    self.copies.spawn(async move {
                        let result = if local.exists() {
                            d.copy(&local, &file).await
                        } else {
                            Err(anyhow::anyhow!("the local copy is gone"))
                        };
                        CopyDone { file, dest, result }
                    });
                }
                Action::Delete { file } => {
                    let local = self.cfg.dir.join(&file);
                    match std::fs::remove_file(&local) {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                            warn!(file = %file, error = %e, "cannot delete a safe local copy; kept");
                            // Asked again at the next look, not in a loop now.
                            return Ok(());
                        }
                        _ => {}
                    }
                    self.record(&Record::Deleted { file: file.clone(), at: unix_now() })?;
                    self.custody.handle_deleted(&file);
                    self.publish();
                    info!(file = %file, "safe where it must be; local copy deleted");
                }
            }
        }
        Ok(())
    }

    /// A copy's outcome into custody and the journal.
    async fn finish_copy(&mut self, done: CopyDone) -> anyhow::Result<()> {
        let now = self.now();
        let r = match done.result {
            Ok(c) => self.custody.handle_copied(&done.file, done.dest, c.read, c.remote, now, unix_now()),
            Err(e) if !self.cfg.dir.join(&done.file).exists() => {
                warn!(file = %done.file, error = %e, "a file to archive is gone from the disk");
                self.record(&Record::Deleted { file: done.file.clone(), at: unix_now() })?;
                self.custody.handle_deleted(&done.file);
                self.publish();
                return Ok(());
            }
            Err(e) => {
                let reason = format!("{e:#}");
                self.custody.handle_refused(&done.file, done.dest, &reason, now);
                Record::Refused { file: done.file.clone(), dest: done.dest, reason, at: unix_now() }
            }
        };
        match &r {
            Record::Refused { reason, .. } => {
                warn!(file = %done.file, dest = %self.cfg.destinations[done.dest].url(), %reason, "copy refused");
                // A copy that did not verify is removed there before it is tried again.
                if reason.contains("mismatch")
                    && let Err(e) = self.cfg.destinations[done.dest].remove(&done.file).await
                {
                    warn!(file = %done.file, error = %e, "cannot remove a bad copy at the destination");
                }
            }
            Record::LocalAltered { .. } => {
                warn!(file = %done.file, "the local copy no longer matches its checksum; quarantined, never copied");
                // What the copy took there is not the file that was written.
                if let Err(e) = self.cfg.destinations[done.dest].remove(&done.file).await {
                    warn!(file = %done.file, error = %e, "cannot remove an altered copy at the destination");
                }
            }
            _ => {}
        }
        self.record(&r)?;
        self.publish();
        Ok(())
    }

    /// Keeps the directory until `cancel`; with `until_settled`, also returns once every
    /// file closed so far is safe, deleted or quarantined. The ledger at the end.
    pub async fn run(&mut self, cancel: CancellationToken, until_settled: bool) -> anyhow::Result<ArchiveLedger> {
        let mut next_scan = tokio::time::Instant::now();
        loop {
            if tokio::time::Instant::now() >= next_scan {
                self.scan()?;
                next_scan = tokio::time::Instant::now() + self.cfg.scan_every;
            }
            self.act()?;
            if until_settled && self.copies.is_empty() && self.custody.is_settled() && self.scan()? == 0 {
                return Ok(self.ledger(None));
            }
            let wake = self
                .custody
                .poll_timeout()
                .map(|t| tokio::time::Instant::from_std(self.epoch + Duration::from_nanos(t.as_nanos())))
                .map_or(next_scan, |t| t.min(next_scan));
            tokio::select! {
                Some(done) = self.copies.join_next(), if !self.copies.is_empty() => {
                    let done = done.context("a copy task")?;
                    self.finish_copy(done).await?;
                }
                _ = tokio::time::sleep_until(wake) => {}
                _ = cancel.cancelled() => {
                    // What is under way is let finish (a copy's result is journaled).
                    while let Some(done) = self.copies.join_next().await {
                        self.finish_copy(done.context("a copy task")?).await?;
                    }
                    return Ok(self.ledger(None));
                }
            }
        }
    }

    pub fn ledger(&self, run: Option<u64>) -> ArchiveLedger {
        self.custody.ledger(run)
    }

    pub fn custody(&self) -> &Custody {
        &self.custody
    }
}

/// `dir`'s journal read back under the rules it was written with: its rules, its records,
/// the custody they give.
fn replayed(dir: &Path) -> anyhow::Result<(JournalConfig, journal::Read, Custody)> {
    let cfg = Journal::read_config(dir)
        .with_context(|| format!("{} has no archive journal (shoal archive run DIR --to URL)", dir.display()))?;
    let read = Journal::read(dir)?;
    let mut custody = Custody::new(CustodyConfig {
        destinations: cfg.destinations.len(),
        delete_after: cfg.delete_after,
        max_attempts: cfg.max_attempts,
        ..CustodyConfig::default()
    });
    for r in &read.records {
        custody.replay(r, shoal_core::Instant::ZERO);
    }
    Ok((cfg, read, custody))
}

/// `shoal archive release DIR FILE`: a quarantined file tried again from the start (by
/// the next `shoal archive run`; none may run on `dir` meanwhile). Whether it was
/// quarantined.
pub fn release(dir: &Path, file: &str) -> anyhow::Result<bool> {
    let (_, _, custody) = replayed(dir)?;
    // Held from here: no archiver may act on the file meanwhile.
    let (mut journal, _) = Journal::open(dir)?;
    anyhow::ensure!(custody.entry(file).is_some(), "{file} is not in the archive of {}", dir.display());
    if !matches!(custody.state(file), Some(FileState::Quarantined(_))) {
        return Ok(false);
    }
    journal.append(&Record::Released { file: file.into(), at: unix_now() })?;
    Ok(true)
}

/// One file's line of `shoal archive status`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FileStatus {
    pub file: String,
    pub run: u64,
    pub state: String,
    /// The reason of a quarantine, or of the last refusal of a file still pending.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub bytes: u64,
    pub checksum: String,
    /// Destinations where it is safe.
    pub safe_at: Vec<String>,
    pub closed_at: f64,
}

/// What `shoal archive status DIR` shows: the files, the ledger.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Status {
    pub dir: PathBuf,
    pub destinations: Vec<String>,
    pub delete_after: Option<usize>,
    pub files: Vec<FileStatus>,
    pub ledger: ArchiveLedger,
    pub torn_records: u64,
}

/// The state of `dir`'s archive as its journal says (of one run's files, or all).
pub fn status(dir: &Path, run: Option<u64>) -> anyhow::Result<Status> {
    let (cfg, read, custody) = replayed(dir)?;
    let files = custody
        .files()
        .filter(|(_, e)| run.is_none_or(|r| r == e.run))
        .map(|(f, e)| {
            let state = e.state(custody.required());
            let reason = match &state {
                FileState::Quarantined(r) => Some(r.clone()),
                _ => e.last_refusal.iter().flatten().last().cloned().filter(|_| state != FileState::Safe),
            };
            FileStatus {
                file: f.clone(),
                run: e.run,
                state: state.name().into(),
                reason,
                bytes: e.seal.bytes,
                checksum: format!("adler32:{:08x}", e.seal.adler32),
                safe_at: e
                    .at
                    .iter()
                    .zip(&cfg.destinations)
                    .filter(|(a, _)| **a == shoal_core::custody::AtDestination::Safe)
                    .map(|(_, d)| d.clone())
                    .collect(),
                closed_at: e.closed_at,
            }
        })
        .collect();
    Ok(Status {
        dir: dir.to_path_buf(),
        destinations: cfg.destinations,
        delete_after: cfg.delete_after,
        files,
        ledger: custody.ledger(run),
        torn_records: read.torn,
    })
}
