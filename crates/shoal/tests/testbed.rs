//! `shoal testbed run` on a small scenario (6 sources x 2 builders behind two sector
//! switches, a few seconds): every process in its own network namespace with its own
//! address, links shaped by tc. Runs as root with iproute2 and ethtool present, and skips
//! with a message otherwise. The builders' timeouts are out of reach, so the test checks
//! that every fragment crossed the emulated network, not how fast this machine is; and
//! that nothing is left behind.

use std::process::Command;

fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

#[test]
fn a_small_scenario_runs_on_the_emulated_network_and_leaves_nothing_behind() {
    run_small_scenario("delayed:2", "b");
}

/// The same with credit-based pull: the data-flow manager runs on the control host, and
/// every slice is assigned, requested and built across the emulated network.
#[test]
fn a_pull_scenario_runs_on_the_emulated_network_with_its_manager() {
    run_small_scenario("pull:4", "p");
}

fn run_small_scenario(policy: &str, tag: &str) {
    if let Some(why) = shoal_testbed::netns::unavailable() {
        eprintln!("SKIPPED: the testbed test needs root and iproute2/ethtool: {why}");
        return;
    }
    // Two tests may run at once: each has its own namespace prefix.
    let prefix = format!("t{tag}{}", std::process::id() % 10_000);
    let dir = std::env::temp_dir().join(format!("shoal-testbed-test-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let scenario = dir.join("small.toml");
    std::fs::write(
        &scenario,
        format!(
            r#"
name = "testbed-6x2"
[topology]
sources = 6
builders = 2
boards_per_sector = 3
[traffic]
policy = "{policy}"
transport = "tcp"
slice_ms = 100.0
fragment_bytes = 20000
load_s = 2.0
[builder]
max_active = 100000
wall_timeout_ms = 600000.0
"#
        ),
    )
    .unwrap();
    let out = shoal()
        .args(["testbed", "run", "--prefix", &prefix, "--json", "--dir"])
        .arg(dir.join("out"))
        .arg(&scenario)
        .output()
        .unwrap();
    // Whatever happened, the namespaces must be gone.
    let left = shoal_testbed::netns::existing(&prefix).unwrap();
    if !left.is_empty() {
        let _ = shoal_testbed::netns::down(&prefix);
    }
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
    assert!(
        out.status.success(),
        "shoal testbed run failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ledger = &s["ledger"];
    assert_eq!(ledger["balanced"], true, "{s}");
    let produced = ledger["produced"].as_u64().unwrap();
    assert!(produced >= 6 * 10, "6 sources over about 20 slices: {produced}");
    assert_eq!(ledger["buckets"]["delivered"].as_u64(), Some(produced), "{s}");
    assert_eq!(s["slices_incomplete"], 0, "{s}");
    assert!(s["tcp_segments"].as_u64().unwrap() > 0, "the data crossed TCP in the namespaces");
    // Each process ran in its own namespace: the cluster file says so, and the builders
    // were reached at their testbed addresses.
    let cluster = std::fs::read_to_string(dir.join("out").join("cluster.toml")).unwrap();
    let pull = policy.starts_with("pull");
    assert_eq!(cluster.matches("launch = \"netns\"").count(), 9 + usize::from(pull), "{cluster}");
    if pull {
        // The manager, on the control host, assigned every slice once.
        let record = std::fs::read_to_string(dir.join("out/state/runs/run000001.json")).unwrap();
        let record: serde_json::Value = serde_json::from_str(&record).unwrap();
        let reports = record["reports"].as_array().unwrap();
        let manager = reports.iter().find(|r| r["role"] == "dfm").expect("the manager reported");
        assert_eq!(manager["detail"]["assigned"], s["slices_complete"], "{manager}");
        assert_eq!(manager["detail"]["done"], true, "{manager}");
    }
    assert!(cluster.contains("198.19.0.1:5601") && cluster.contains("198.19.0.2:5601"));
    let _ = std::fs::remove_dir_all(&dir);
}
