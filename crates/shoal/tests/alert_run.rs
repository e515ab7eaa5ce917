//! An alert under `shoal run`: every role its own process, the alert sent with
//! `shoal alert` through the dispatcher 20 s after its window; the raw file holds every
//! fragment of the window, byte for byte what the sources' generator produces.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn an_alert_under_shoal_run_recovers_its_window_byte_for_byte() {
    // Every fragment held as long as it takes: the alert checks byte for byte.
    let c = Cluster::start_with("alert", 26, "max_active = 100000\nwall_timeout_ms = 600000");
    let (sources, dispatcher) = (3u32, c.dispatcher.clone());
    let cluster_cfg = shoal_control::cluster::ClusterFile::load(&c.dir.join("cluster.toml")).unwrap().config;
    let t0 = unix_ns();
    let (from, to) = (t0 + 2_000_000_000, t0 + 3_000_000_000);
    // The notice comes 20 s after the window's end.
    let send_at = to + 20_000_000_000;
    std::thread::sleep(Duration::from_nanos(send_at.saturating_sub(unix_ns())));
    let fmt = shoal_core::alert::format_unix_seconds;
    let out = shoal()
        .args(["alert", "--dispatcher", &dispatcher, "--from", &fmt(from), "--to", &fmt(to)])
        .args(["--name", "GRB261123B", "--expect", "2", "--wait", "60"])
        .output()
        .unwrap();
    let answers = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "shoal alert: {answers} {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(answers.lines().filter(|l| l.contains("alert GRB261123B saved")).count(), 2, "{answers}");
    assert!(!answers.contains("evicted"), "{answers}");

    let (record, dir) = c.finish();

    let slice_clock = cluster_cfg.slice_clock().unwrap();
    let first = slice_clock.slice_at(shoal_core::Instant::from_nanos(from));
    let last = slice_clock.slice_at(shoal_core::Instant::from_nanos(to - 1));
    let rows = shoal_store::read_raw(dir.join("data").join("run000001.raw.parquet")).unwrap();
    let alert_rows: Vec<_> = rows.iter().filter(|r| r.stream == "alert").collect();
    assert_eq!(alert_rows.len() as u64, (last - first + 1) * u64::from(sources), "one row per slice and source");
    let generator = cluster_cfg.workload().unwrap();
    for slice in first..=last {
        for source in 0..sources {
            let row = alert_rows
                .iter()
                .find(|r| r.slice == slice && r.source == source)
                .unwrap_or_else(|| panic!("slice {slice} source {source} not saved"));
            assert_eq!(row.alert_name.as_deref(), Some("GRB261123B"));
            assert_eq!(
                row.payload,
                generator.generate(source, slice).payload.to_vec(),
                "slice {slice} source {source}"
            );
        }
    }
    assert_eq!(record["ledger"]["balanced"], true, "{}", record["ledger"]);
    no_process_left(&dir);
}
