//! `shoal archive run` and `shoal archive status`: custody of an output directory's files
//! to permanent storage (shoal-archive; docs/archive.md), and `shoal demo --archive`'s
//! share of it.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use shoal_archive::{ArchiveConfig, Archiver, Destination};
use shoal_core::custody::ArchiveLedger;
use tokio_util::sync::CancellationToken;

#[derive(clap::Args)]
pub struct ArchiveArgs {
    #[command(subcommand)]
    pub command: ArchiveCommand,
}

#[derive(clap::Subcommand)]
pub enum ArchiveCommand {
    /// Copy every closed file of DIR (the writer's `out_dir`: a file is closed when its
    /// metadata `NAME.json` exists) to each destination in the order they closed, verify
    /// each copy by the destination's own adler32, and delete local copies only once safe
    /// (--delete-after). Runs until Ctrl-C (or, with --once, until every file closed so far
    /// is safe or quarantined); its journal in DIR/.shoal-archive survives any crash.
    Run {
        dir: PathBuf,
        /// A destination: `file:///PATH` (a mounted file system) or `root://HOST[:PORT]//PATH`
        /// (XRootD: EOS, dCache; needs xrdcp and xrdfs). Repeat for several.
        #[arg(long = "to", required = true)]
        to: Vec<String>,
        /// Delete a local copy once it is safe at this many destinations (default: never).
        #[arg(long)]
        delete_after: Option<usize>,
        /// Copies refused (failed, or not verified) before a file is quarantined.
        #[arg(long, default_value_t = 5)]
        max_attempts: u32,
        /// The first wait after a refused copy, seconds (doubled each time, up to 60).
        #[arg(long, default_value_t = 1.0)]
        backoff_s: f64,
        /// Stop once every file closed so far is safe, deleted or quarantined.
        #[arg(long)]
        once: bool,
        /// Print the ledger as JSON at the end.
        #[arg(long)]
        json: bool,
    },
    /// Release a quarantined file once its cause is fixed: the next `shoal archive run`
    /// tries it again from the start at every destination where it was quarantined, and
    /// checks its local copy against its checksum again. Stop the archiver of DIR first.
    Release { dir: PathBuf, file: String },
    /// Every file the archive of DIR keeps, its state (written, copying, safe, deleted,
    /// quarantined with its reason) and the ledger: bytes written = safe + pending +
    /// quarantined + lost. Exit 1 while any file is pending or quarantined.
    Status {
        dir: PathBuf,
        /// Only this run's files.
        #[arg(long)]
        run: Option<u64>,
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(args: ArchiveArgs, cancel: CancellationToken) -> anyhow::Result<ExitCode> {
    match args.command {
        ArchiveCommand::Run { dir, to, delete_after, max_attempts, backoff_s, once, json } => {
            let destinations = to.iter().map(|u| Destination::parse(u)).collect::<Result<Vec<_>, _>>()?;
            let mut cfg = ArchiveConfig::new(&dir, destinations);
            cfg.delete_after = delete_after;
            cfg.max_attempts = max_attempts.max(1);
            cfg.backoff = Duration::from_secs_f64(backoff_s.max(0.001));
            let mut archiver = Archiver::open(cfg)?;
            let ledger = archiver.run(cancel, once).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&ledger)?);
            } else {
                print!("{}", ledger_table(&ledger, &to.join(", ")));
            }
            Ok(settled_code(&ledger))
        }
        ArchiveCommand::Release { dir, file } => {
            if shoal_archive::release(&dir, &file)? {
                println!("{file} released: the next `shoal archive run` tries it again");
                Ok(ExitCode::SUCCESS)
            } else {
                println!("{file} is not quarantined; nothing to release");
                Ok(ExitCode::from(1))
            }
        }
        ArchiveCommand::Status { dir, run, json } => {
            let st = shoal_archive::status(&dir, run)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&st)?);
            } else {
                for f in &st.files {
                    let why = f.reason.as_deref().map(|r| format!("  ({r})")).unwrap_or_default();
                    println!("{:<11} run {:>6}  {:>12} B  {}  {}{why}", f.state, f.run, f.bytes, f.checksum, f.file);
                }
                print!("{}", ledger_table(&st.ledger, &st.destinations.join(", ")));
                if st.torn_records > 0 {
                    println!("journal: {} line(s) cut short by a crash, skipped", st.torn_records);
                }
            }
            Ok(settled_code(&st.ledger))
        }
    }
}

/// 0 when every file is safe, 1 while any is pending, quarantined or lost.
fn settled_code(l: &ArchiveLedger) -> ExitCode {
    if l.files_pending + l.files_quarantined == 0 && l.bytes_lost == 0 && l.balanced() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn mb(b: u64) -> String {
    format!("{:.1} MB", b as f64 / 1e6)
}

/// The archive's ledger as a few lines of text.
pub fn ledger_table(l: &ArchiveLedger, to: &str) -> String {
    let mut s = format!(
        "archive    {} file(s), {} written -> {to}\n  safe     {} file(s), {} ({} local copies deleted)\n",
        l.files,
        mb(l.bytes_written),
        l.files_safe,
        mb(l.bytes_safe),
        l.files_deleted
    );
    if l.files_pending > 0 {
        let age = l.oldest_pending_closed_at.map(|t| shoal_store::custody::unix_now() - t).unwrap_or(0.0);
        s += &format!(
            "  pending  {} file(s), {}, the oldest closed {age:.0} s ago\n",
            l.files_pending,
            mb(l.bytes_pending)
        );
    }
    for (f, why) in &l.quarantined {
        s += &format!("  quarantined {f}: {why}\n");
    }
    for (f, why) in &l.lost {
        s += &format!("  LOST     {f}: {why}\n");
    }
    s += &format!(
        "  ledger   written = safe + pending + quarantined + lost: {}\n",
        if l.balanced() { "balanced" } else { "NOT BALANCED" }
    );
    s
}

/// `shoal demo --archive DIR`: the demo's output directory archived to `file://DIR` once
/// the run ended, until every file is safe or quarantined (local copies kept).
pub async fn demo(out_dir: &Path, archive: &Path) -> anyhow::Result<ArchiveLedger> {
    std::fs::create_dir_all(archive)?;
    let root = std::fs::canonicalize(archive)?;
    let url = Destination::File { root: root.clone() }.url();
    if let Ok(before) = shoal_archive::journal::Journal::read_config(out_dir)
        && before.destinations != [url.clone()]
    {
        // A demo's output directory is scratch: a journal kept for other destinations is
        // set aside (kept, renamed), not mixed with this one.
        let folder = out_dir.join(shoal_archive::journal::FOLDER);
        let aside = out_dir.join(format!("{}.{}", shoal_archive::journal::FOLDER, std::process::id()));
        std::fs::rename(&folder, &aside)?;
        eprintln!(
            "{} was archived to {:?}; that journal is now {}",
            out_dir.display(),
            before.destinations,
            aside.display()
        );
    }
    let mut archiver = Archiver::open(ArchiveConfig::new(out_dir, vec![Destination::File { root }]))?;
    archiver.run(CancellationToken::new(), true).await
}
