//! `shoal demo --archive DIR` with no other set-up: every file the run stored is safe in
//! DIR (the same bytes), the summary's archive ledger balances, and `shoal archive status`
//! reads the same from the journal; `shoal archive run` of a directory whose file was
//! altered after close quarantines it and exits 1.

mod common;

#[test]
fn the_demo_archives_every_file_it_stored_and_status_reads_it_back() {
    let dir = tempfile::tempdir().unwrap();
    let (out, archive) = (dir.path().join("out"), dir.path().join("archive"));
    let run = common::shoal()
        .args(["demo", "--seconds", "1", "--sources", "4", "--builders", "2", "--json", "--out"])
        .arg(&out)
        .arg("--archive")
        .arg(&archive)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let v: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    let l = &v["archive"];
    assert!(l["files"].as_u64().unwrap() >= 1, "{l}");
    assert_eq!(l["files"], l["files_safe"], "{l}");
    assert_eq!(l["bytes_written"], l["bytes_safe"], "{l}");
    assert_eq!((l["bytes_pending"].as_u64(), l["bytes_lost"].as_u64()), (Some(0), Some(0)), "{l}");
    let events = out.join("run000001.events.parquet");
    assert_eq!(std::fs::read(&events).unwrap(), std::fs::read(archive.join("run000001.events.parquet")).unwrap());

    let status = common::shoal().args(["archive", "status", "--json"]).arg(&out).output().unwrap();
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    let s: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(s["ledger"], *l);
    assert!(s["files"].as_array().unwrap().iter().all(|f| f["state"] == "safe"), "{s}");

    // A byte of a closed file flipped before it is archived elsewhere: quarantined, kept.
    let mut bytes = std::fs::read(&events).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&events, &bytes).unwrap();
    let other = tempfile::tempdir().unwrap();
    let moved = other.path().join("run000001.events.parquet");
    std::fs::copy(&events, &moved).unwrap();
    std::fs::copy(out.join("run000001.events.parquet.json"), other.path().join("run000001.events.parquet.json"))
        .unwrap();
    let quarantined = common::shoal()
        .args(["archive", "run", "--once", "--to"])
        .arg(format!("file://{}", dir.path().join("second").display()))
        .arg(other.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&quarantined.stdout);
    assert_eq!(quarantined.status.code(), Some(1), "{text}");
    assert!(text.contains("quarantined run000001.events.parquet: local copy altered"), "{text}");
    assert!(moved.exists() && !dir.path().join("second").join("run000001.events.parquet").exists());
}

/// Under run control with `writer.archive`: the writer process keeps an archiver for its
/// output directory; the run record's writer report carries the archive's ledger of the
/// run (balanced, files pending at the run's end said so), and a later `shoal archive run`
/// makes every file safe, which `shoal archive status` then shows.
#[test]
fn a_run_s_record_carries_the_archive_s_ledger_and_what_is_pending_becomes_safe_later() {
    let dest = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dest.path().display());
    let c = common::Cluster::start_with_writer(
        "archive",
        4,
        "wall_timeout_ms = 1500",
        &format!("checkpoint_s = 1.0\narchive = [\"{url}\"]\narchive_delete_after = 1\n"),
    );
    let (record, dir) = c.finish();
    common::assert_accounted(&record);
    let writer = record["reports"].as_array().unwrap().iter().find(|r| r["name"] == "writer").expect("writer report");
    let l = &writer["detail"]["archive"];
    assert_eq!(record["archive"], *l, "the record's archive ledger is its writer's");
    assert!(l["files"].as_u64().unwrap() >= 2, "a file a second: {l}");
    let sum: u64 =
        ["bytes_safe", "bytes_pending", "bytes_quarantined", "bytes_lost"].iter().map(|k| l[k].as_u64().unwrap()).sum();
    assert_eq!(l["bytes_written"].as_u64().unwrap(), sum, "{l}");
    let stored: u64 = writer["detail"]["files"].as_array().unwrap().iter().map(|f| f["bytes"].as_u64().unwrap()).sum();
    assert!(l["bytes_written"].as_u64().unwrap() >= stored, "{l} against {stored} stored");
    assert_eq!((l["bytes_quarantined"].as_u64(), l["bytes_lost"].as_u64()), (Some(0), Some(0)), "{l}");

    // The writer is gone with the cluster: another archiver takes up its journal.
    let data = dir.join("data");
    let after = common::shoal()
        .args(["archive", "run", "--once", "--delete-after", "1", "--to", &url])
        .arg(&data)
        .output()
        .unwrap();
    assert!(after.status.success(), "{}", String::from_utf8_lossy(&after.stdout));
    let status = common::shoal().args(["archive", "status", "--json", "--run", "1"]).arg(&data).output().unwrap();
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stdout));
    let s: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert!(s["files"].as_array().unwrap().iter().all(|f| f["state"] == "deleted"), "{s}");
    for f in s["files"].as_array().unwrap() {
        let name = f["file"].as_str().unwrap();
        assert!(dest.path().join(name).exists() && !data.join(name).exists(), "{name}");
    }
    common::no_process_left(&dir);
}
