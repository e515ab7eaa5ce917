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
