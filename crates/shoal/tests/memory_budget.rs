//! The process memory budget, through `shoal demo` as a new user runs it: a run too big
//! for any builder is refused at start with what would fit; a run too big for the
//! machine's CPU (3,000 physics sources on 2 cores) ends on its own with its memory inside
//! the budget and every fragment accounted; the demo's builders share its budget when
//! their default would not fit, unless the configuration sets theirs.

mod common;

use common::shoal;

#[test]
fn a_run_no_builder_can_hold_is_refused_at_start_with_what_fits() {
    let dir = tempfile::tempdir().unwrap();
    let out =
        shoal().args(["demo", "--sources", "100000", "--seconds", "1", "--out"]).arg(dir.path()).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("refused at start, memory"), "{stderr}");
    assert!(stderr.contains("builder.memory_budget_mb"), "{stderr}");
    // What fits, as a number of sources that is itself accepted.
    let fit = common::number_after(&stderr, "at most ").unwrap_or_else(|| panic!("no 'at most N sources' in {stderr}"));
    assert!((1000..100_000).contains(&fit), "{stderr}");
    // Nothing ran: no output file.
    assert!(!dir.path().join("run000001.events.parquet").exists());
}

#[test]
fn an_overloaded_demo_ends_by_itself_within_its_memory_budget() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("budget.toml");
    std::fs::write(&cfg, "[run]\nmemory_mb = 4096\n").unwrap();
    let out = shoal()
        .args(["demo", "--sources", "3000", "--builders", "3", "--seconds", "1", "--json", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(s["memory_budget_mb"], 4096);
    assert_eq!(s["generated_live"], true, "3,000 physics sources compute their hits");
    assert!(s["memory_planned_mb"].as_u64().unwrap() <= 4096);
    // MB of the peak against MiB of the budget.
    let peak_mib = s["peak_rss_mb"].as_f64().unwrap() * 1e6 / f64::from(1 << 20);
    assert!(peak_mib > 0.0 && peak_mib <= 4096.0, "peak resident {peak_mib:.0} MiB over the 4096 MiB budget");
    assert_eq!(s["ledger"]["balanced"], true, "{}", s["ledger"]);
    assert_eq!(s["ledger"]["unaccounted"], 0);
    // No repeated warnings: each kind of log line is said a bounded number of times.
    let warnings = stderr.lines().filter(|l| l.contains("WARN")).count();
    assert!(warnings < 50, "{warnings} warnings:\n{stderr}");
}

#[test]
fn a_prefault_is_mapped_before_the_run_and_stays_within_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let run = |prefault_mb: u64| {
        let cfg = dir.path().join(format!("prefault-{prefault_mb}.toml"));
        std::fs::write(&cfg, format!("[run]\nmemory_mb = 4096\nprefault_mb = {prefault_mb}\n")).unwrap();
        shoal()
            .args(["demo", "--seconds", "1", "--json", "--config"])
            .arg(&cfg)
            .arg("--out")
            .arg(dir.path())
            .output()
            .unwrap()
    };
    let out = run(256);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(s["prefaulted_mb"], 256, "{s}");
    assert!(s["prefault_s"].as_f64().unwrap() > 0.0);
    // The mapped memory stays with the process (MB of the peak against MiB).
    assert!(s["peak_rss_mb"].as_f64().unwrap() * 1e6 >= 256.0 * f64::from(1 << 20), "{}", s["peak_rss_mb"]);
    assert!(s["page_faults"].as_u64().is_some());
    assert_eq!(s["ledger"]["balanced"], true, "{}", s["ledger"]);
    // More than the budget: refused before anything runs.
    let out = run(4097);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("run.prefault_mb = 4097 is more than this process's memory budget (4096 MiB"), "{stderr}");
}

#[test]
fn the_demos_builders_share_its_budget_unless_the_configuration_sets_theirs() {
    let dir = tempfile::tempdir().unwrap();
    let run = |builder_table: &str| {
        let cfg = dir.path().join("shared.toml");
        std::fs::write(&cfg, format!("[run]\nmemory_mb = 2048\n{builder_table}")).unwrap();
        shoal()
            .args(["demo", "--sources", "8", "--builders", "8", "--seconds", "0.3", "--json", "--config"])
            .arg(&cfg)
            .arg("--out")
            .arg(dir.path())
            .output()
            .unwrap()
    };
    // 8 builders at the default 512 MiB would need 4 GiB of the 2 GiB: they share it.
    let out = run("");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let each = common::number_after(&stderr, "8 builders share this process: builder.memory_budget_mb = ")
        .unwrap_or_else(|| panic!("no share in {stderr}"));
    assert!(each > 0 && 8 * each <= 1024, "{each} MiB each: at most half of the 2 GiB");
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(s["memory_planned_mb"].as_u64().unwrap() <= 2048, "{s}");
    assert_eq!(s["builder_memory_mb"], each, "the summary keeps the share");
    assert_eq!(s["ledger"]["balanced"], true, "{}", s["ledger"]);
    // Set in the configuration, even to the default: kept, and refused as before.
    let out = run("[builder]\nmemory_budget_mb = 512\n");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("refused at start, memory") && !stderr.contains("share this process"), "{stderr}");
}

#[test]
fn the_demo_maps_seconds_of_its_offered_data_unless_told_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    // 4 sources of 2-MB fragments every millisecond offer 8 GB/s: the 0.2-s run's whole
    // data (a run shorter than 6 s maps at most its own) is more than half the 2-GiB
    // budget, so the demo maps half. The run cannot keep up (sources drop what their
    // queues cannot hold, builders give slices up), and its ledger still balances.
    let run = |extra_toml: &str, args: &[&str]| {
        let cfg = dir.path().join("offered.toml");
        std::fs::write(
            &cfg,
            format!(
                "[run]\nmemory_mb = 2048\n{extra_toml}[source]\ngenerator = \"fixed\"\nfixed_bytes = 2000000\n\
                 [builder.filter]\nname = \"none\"\n[saver]\nenabled = false\n"
            ),
        )
        .unwrap();
        let out = shoal()
            .args(["demo", "--sources", "4", "--builders", "2", "--slice-ms", "1", "--seconds", "0.2", "--json"])
            .args(args)
            .arg("--config")
            .arg(&cfg)
            .arg("--out")
            .arg(dir.path())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{stderr}");
        let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(s["ledger"]["balanced"], true, "{}", s["ledger"]);
        (s["prefaulted_mb"].as_u64().unwrap(), stderr)
    };
    let (mapped, stderr) = run("", &[]);
    assert_eq!(mapped, 1024, "{stderr}");
    let said = common::number_after(&stderr, "run.prefault_mb = ").unwrap_or_else(|| panic!("not said: {stderr}"));
    assert_eq!(said, 1024);
    let offered = common::number_after(&stderr, "4 sources offer about ").expect("the rate");
    assert!((7_900..=8_100).contains(&offered), "{stderr}");
    // The flag, and the file even at 0, choose instead; nothing is said.
    for (toml, args) in [("", &["--prefault-mb", "0"][..]), ("", &["--prefault-mb", "300"]), ("prefault_mb = 0\n", &[])]
    {
        let (mapped, stderr) = run(toml, args);
        assert_eq!(mapped, if args.contains(&"300") { 300 } else { 0 }, "{stderr}");
        assert!(!stderr.contains("sources offer about"), "{stderr}");
    }
}
