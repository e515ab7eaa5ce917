//! The writer's disk fills up mid-run (a 256 KiB tmpfs; root only, skipped otherwise):
//! the run goes on to its end, the summary is printed and says what was not stored, the
//! ledger balances, and `shoal demo` exits with status 4.

use std::process::Command;

struct Mounted(std::path::PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

#[test]
fn a_full_disk_costs_the_output_not_the_run() {
    if !is_root() {
        eprintln!("skipped: mounting a small tmpfs needs root");
        return;
    }
    let dir = std::env::temp_dir().join(format!("shoal-disk-full-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ok = Command::new("mount").args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"]).arg(&dir).status().unwrap();
    assert!(ok.success(), "mount failed");
    let _mounted = Mounted(dir.clone());
    // An alert during the run saves about 15 MB of raw data: far more than fits.
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["demo", "--seconds", "3", "--alert-at", "2", "--alert-window", "1", "--json", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
    assert_eq!(s["ledger"]["balanced"], true, "{}", s["ledger"]);
    assert!(s["slices_complete"].as_u64().unwrap() > 0);
    let error = s["writer"]["error"].as_str().unwrap_or_default();
    assert!(error.contains("No space left on device"), "{error}; {stderr}");
    assert!(stderr.contains("not stored"), "{stderr}");
}
