//! The archiver on mounted-file-system destinations: every closed file copied, verified,
//! deleted only when safe; a local copy altered after close quarantined and kept; a
//! destination that refuses every copy retried with back-off, then quarantined; a crash
//! in the middle of a copy taken up from the journal; the ledger balanced in every case.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use shoal_archive::{ArchiveConfig, Archiver, Destination, status};
use shoal_core::custody::Record;
use shoal_store::custody::{ChecksumWriter, FileMetadata, seal_of_file, unix_now};
use tokio_util::sync::CancellationToken;

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shoal-archive-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A closed file as the writer leaves it: data synced, metadata beside it.
fn closed_file(dir: &Path, name: &str, run: u64, size: usize) -> PathBuf {
    let path = dir.join(name);
    let mut w = ChecksumWriter::new(std::fs::File::create(&path).unwrap());
    let data: Vec<u8> = (0..size).map(|i| (i * 13 + size) as u8).collect();
    w.write_all(&data).unwrap();
    let (f, seal) = w.into_parts();
    f.sync_all().unwrap();
    FileMetadata {
        file_name: name.into(),
        file_size: seal.bytes,
        checksum: seal.checksum(),
        runs: vec![(run, 0, "test".into())],
        events: 1,
        data_tier: "filtered".into(),
        file_format: "parquet".into(),
        producer: "test".into(),
        closed_at: unix_now(),
        application_version: "test".into(),
        ..Default::default()
    }
    .write_beside(&path)
    .unwrap();
    path
}

fn config(dir: &Path, dests: &[&Path]) -> ArchiveConfig {
    let mut cfg = ArchiveConfig::new(
        dir,
        dests.iter().map(|d| Destination::parse(&format!("file://{}", d.display())).unwrap()).collect(),
    );
    cfg.backoff = Duration::from_millis(10);
    cfg.max_backoff = Duration::from_millis(40);
    cfg.scan_every = Duration::from_millis(20);
    cfg
}

async fn settle(cfg: ArchiveConfig) -> shoal_core::custody::ArchiveLedger {
    let mut a = Archiver::open(cfg).unwrap();
    // Bounded: a settled archive returns by itself; the timeout only turns a hang into a
    // failure with a message.
    tokio::time::timeout(Duration::from_secs(120), a.run(CancellationToken::new(), true))
        .await
        .expect("the archive settles")
        .unwrap()
}

#[tokio::test]
async fn every_file_reaches_both_destinations_verified_and_goes_only_then() {
    let (dir, d1, d2) = (temp("two-out"), temp("two-d1"), temp("two-d2"));
    let files: Vec<PathBuf> =
        (0..4).map(|i| closed_file(&dir, &format!("run000001.events.part{i}.parquet"), 1, 100_000 + i)).collect();
    let seals: Vec<_> = files.iter().map(|f| seal_of_file(f).unwrap()).collect();
    // A file still being written (no metadata) is left alone.
    std::fs::write(dir.join("run000001.events.part9.parquet"), b"open").unwrap();
    let mut cfg = config(&dir, &[&d1, &d2]);
    cfg.delete_after = Some(2);
    let l = settle(cfg).await;
    assert!(l.balanced(), "{l:?}");
    assert_eq!((l.files, l.files_safe, l.files_deleted, l.bytes_pending), (4, 4, 4, 0));
    for (f, s) in files.iter().zip(&seals) {
        assert!(!f.exists(), "{} deleted once safe at both", f.display());
        let name = f.file_name().unwrap();
        assert_eq!(seal_of_file(&d1.join(name)).unwrap(), *s);
        assert_eq!(seal_of_file(&d2.join(name)).unwrap(), *s);
    }
    assert!(dir.join("run000001.events.part9.parquet").exists());
    let st = status(&dir, Some(1)).unwrap();
    assert_eq!(st.files.len(), 4);
    assert!(st.files.iter().all(|f| f.state == "deleted" && f.safe_at.len() == 2), "{:?}", st.files);
    for d in [dir, d1, d2] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[tokio::test]
async fn a_local_copy_altered_after_close_is_quarantined_and_kept() {
    let (dir, dest) = (temp("flip-out"), temp("flip-dest"));
    let good = closed_file(&dir, "run000002.events.parquet", 2, 50_000);
    let bad = closed_file(&dir, "run000002.raw.parquet", 2, 50_000);
    let mut bytes = std::fs::read(&bad).unwrap();
    bytes[1234] ^= 0x40;
    std::fs::write(&bad, &bytes).unwrap();
    let mut cfg = config(&dir, &[&dest]);
    cfg.delete_after = Some(1);
    let l = settle(cfg).await;
    assert!(l.balanced(), "{l:?}");
    assert_eq!((l.files_safe, l.files_quarantined), (1, 1));
    assert!(l.quarantined[0].1.contains("altered"), "{:?}", l.quarantined);
    assert!(!good.exists() && bad.exists(), "the safe one deleted, the altered one kept");
    assert!(!dest.join("run000002.raw.parquet").exists(), "nothing of the altered one at the destination");
    let st = status(&dir, None).unwrap();
    let q = st.files.iter().find(|f| f.state == "quarantined").unwrap();
    assert!(q.reason.as_deref().unwrap_or("").contains("altered"), "{q:?}");
    for d in [dir, dest] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[tokio::test]
async fn a_destination_that_refuses_every_copy_is_tried_again_then_the_file_quarantined() {
    let dir = temp("down-out");
    let f = closed_file(&dir, "run000003.events.parquet", 3, 10_000);
    // A destination whose root is a file: every copy fails.
    let blocked = temp("down-dest").join("not-a-directory");
    std::fs::write(&blocked, b"x").unwrap();
    let mut cfg = config(&dir, &[&blocked]);
    cfg.delete_after = Some(1);
    cfg.max_attempts = 3;
    let l = settle(cfg).await;
    assert!(l.balanced(), "{l:?}");
    assert_eq!(l.files_quarantined, 1);
    assert!(l.quarantined[0].1.starts_with("3 attempts"), "{:?}", l.quarantined);
    assert!(f.exists(), "never deleted");
    let read = shoal_archive::journal::Journal::read(&dir).unwrap();
    let refused = read.records.iter().filter(|r| matches!(r, Record::Refused { .. })).count();
    assert_eq!(refused, 3);
    // The destination fixed, the file released: safe at the next run, and only then deleted.
    std::fs::remove_file(&blocked).unwrap();
    assert!(shoal_archive::release(&dir, "run000003.events.parquet").unwrap());
    assert!(!shoal_archive::release(&dir, "run000003.events.parquet").unwrap(), "released once");
    let mut cfg = config(&dir, &[&blocked]);
    cfg.delete_after = Some(1);
    let l = settle(cfg).await;
    assert!(l.balanced() && l.files_safe == 1 && l.files_deleted == 1, "{l:?}");
    assert!(!f.exists() && blocked.join("run000003.events.parquet").exists());
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(blocked.parent().unwrap()).unwrap();
}

#[tokio::test]
async fn a_copy_under_way_at_a_crash_is_made_again_from_the_journal() {
    let (dir, dest) = (temp("crash-out"), temp("crash-dest"));
    let f = closed_file(&dir, "run000004.events.parquet", 4, 70_000);
    let seal = seal_of_file(&f).unwrap();
    // What a kill -9 in the middle of the copy leaves: the journal says the copy began,
    // the destination holds a partial temporary file, nothing says it ended.
    {
        let mut cfg = config(&dir, &[&dest]);
        cfg.delete_after = Some(1);
        let mut a = Archiver::open(cfg).unwrap();
        a.scan().unwrap();
    }
    let mut j = shoal_archive::journal::Journal::open(&dir).unwrap().0;
    j.append(&Record::Copying { file: "run000004.events.parquet".into(), dest: 0 }).unwrap();
    std::fs::write(dest.join(".run000004.events.parquet.part"), &b"partial"[..]).unwrap();
    drop(j);
    let mut cfg = config(&dir, &[&dest]);
    cfg.delete_after = Some(1);
    let l = settle(cfg).await;
    assert!(l.balanced() && l.files_safe == 1 && l.files_deleted == 1, "{l:?}");
    assert_eq!(seal_of_file(&dest.join("run000004.events.parquet")).unwrap(), seal);
    for d in [dir, dest] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[tokio::test]
async fn one_archiver_a_directory() {
    let (dir, dest) = (temp("lock-out"), temp("lock-dest"));
    let first = Archiver::open(config(&dir, &[&dest])).unwrap();
    let err = Archiver::open(config(&dir, &[&dest])).err().expect("refused").to_string();
    assert!(format!("{err:#}").contains("locked") || err.contains("journal"), "{err}");
    drop(first);
    Archiver::open(config(&dir, &[&dest])).unwrap();
    for d in [dir, dest] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[tokio::test]
async fn another_list_of_destinations_for_an_archived_directory_is_refused() {
    let (dir, d1, d2) = (temp("mix-out"), temp("mix-d1"), temp("mix-d2"));
    closed_file(&dir, "run000005.events.parquet", 5, 1000);
    settle(config(&dir, &[&d1])).await;
    let err = Archiver::open(config(&dir, &[&d2])).err().expect("refused").to_string();
    assert!(err.contains("was archived to"), "{err}");
    for d in [dir, d1, d2] {
        std::fs::remove_dir_all(d).unwrap();
    }
}
