//! The writer's disk fills up mid-run (a 256 KiB tmpfs; root only, skipped otherwise):
//! the run goes on to its end, the summary is printed and says what was not stored, the
//! ledger balances, and `shoal demo` exits with status 4.

mod common;

use std::process::Command;

use common::{Mounted, is_root};

#[test]
fn a_full_disk_costs_the_output_not_the_run() {
    if !is_root() {
        eprintln!("skipped: mounting a small tmpfs needs root");
        return;
    }
    let mounted = Mounted::tmpfs(&std::env::temp_dir().join(format!("shoal-disk-full-{}", std::process::id())), "256k");
    let dir = mounted.0.clone();
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
