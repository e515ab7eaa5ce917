//! `run.transport = "ucx"` (issue 70): a `shoal run` cluster over UCX keeping every slice,
//! `shoal demo --config F` over each UCX transport this machine has (`tcp` on loopback,
//! `cma,posix,self`, `posix,self` as inside a container without ptrace), and the fault
//! matrix's rows over UCX: a source or builder killed, a builder stopped.
//!
//! UCX is the system's (Debian's libucx-dev, installed by `make test` when root): a
//! shoal built without it says so at CONFIGURE, and these tests fail with that message
//! rather than pass having run nothing.

mod common;

use std::time::Duration;

use common::*;

/// The `[run]` lines of a cluster over UCX.
const UCX_RUN: &str = "policy = \"direct\"\ntransport = \"ucx\"\n";

/// `shoal demo --config F` with `[run] transport = "ucx"` and `UCX_TLS=tls`, every slice
/// complete and the ledger balanced, whatever the policy.
fn demo_over(tls: &str, policy: &str) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("ucx.toml");
    std::fs::write(&cfg, "[run]\ntransport = \"ucx\"\n").unwrap();
    let out = shoal()
        .args(["demo", "--seconds", "2", "--sources", "6", "--builders", "2", "--policy", policy, "--json", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(dir.path())
        .env("UCX_TLS", tls)
        .env("UCX_NET_DEVICES", "lo")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "UCX_TLS={tls} {policy}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let s: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(s["transport"], "ucx", "{s}");
    assert_eq!(s["slices_incomplete"], 0, "UCX_TLS={tls} {policy}: {s}");
    assert!(s["slices_complete"].as_u64().unwrap() >= 150, "UCX_TLS={tls} {policy}: {s}");
    assert_eq!(s["ledger"]["balanced"], true, "UCX_TLS={tls} {policy}: {}", s["ledger"]);
    assert_eq!(s["ledger"]["unaccounted"], 0, "{}", s["ledger"]);
}

#[test]
fn the_demo_over_ucx_tcp_on_loopback_keeps_every_slice() {
    demo_over("tcp", "direct");
    demo_over("tcp", "pull:4");
}

#[test]
fn the_demo_over_ucx_cross_memory_attach_keeps_every_slice() {
    demo_over("cma,posix,self", "delayed:2");
    demo_over("cma,posix,self", "tbf:400Mbit");
}

#[test]
fn the_demo_over_ucx_shared_memory_without_cma_keeps_every_slice() {
    // No transport here detects a failed peer: the TCP connection beside each endpoint
    // does.
    demo_over("posix,self", "direct");
}

#[test]
fn a_shoal_run_cluster_over_ucx_keeps_every_slice_with_its_ledger_balanced() {
    let c = Cluster::start_run("ucx-run", 6, UCX_RUN, ["", "", "wall_timeout_ms = 1500", ""], &[], &|_| String::new());
    let (record, dir) = c.finish();
    assert_accounted(&record);
    assert_eq!(record["slices_incomplete"], 0, "{}", record["diagnosis"]);
    assert!(record["slices_complete"].as_u64().unwrap() >= 40, "{record}");
    let buckets = &record["ledger"]["buckets"];
    assert_eq!(buckets["lost_in_transport"], 0, "{buckets}");
    no_process_left(&dir);
}

#[test]
fn over_ucx_a_source_killed_mid_run_is_restarted_and_its_production_attributed() {
    let c = Cluster::start_run("ucx-kill-source", 12, UCX_RUN, ["", "", "wall_timeout_ms = 1500", ""], &[], &|_| {
        String::new()
    });
    std::thread::sleep(Duration::from_secs(3));
    c.kill_and_await_restart("source1");
    let (record, dir) = c.finish();
    assert_accounted(&record);
    let d = record["departures"].as_array().unwrap();
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(d[0]["name"], "source1");
    assert!(d[0]["rejoined_slice"].as_u64().is_some(), "source1 rejoined: {d:?}");
    assert_eq!(record["ledger"]["buckets"]["lost_in_transport"], 0, "{}", record["ledger"]);
    let causes = assert_causes(&record, &[("process_down", "source1")]);
    println!("ucx source SIGKILL: diagnosis {causes:?}; ledger {}", record["ledger"]);
    no_process_left(&dir);
}

#[test]
fn over_ucx_a_builder_killed_mid_run_is_restarted_and_the_sources_reconnect() {
    let c = Cluster::start_run("ucx-kill-builder", 12, UCX_RUN, ["", "", "wall_timeout_ms = 1500", ""], &[], &|_| {
        String::new()
    });
    std::thread::sleep(Duration::from_secs(3));
    c.kill_and_await_restart("builder1");
    let (record, dir) = c.finish();
    assert_accounted(&record);
    let reports = record["reports"].as_array().unwrap();
    let b1 = reports.iter().find(|r| r["name"] == "builder1").expect("builder1's report");
    assert!(b1["slices_complete"].as_u64().unwrap() > 0, "the restarted builder1 built again over UCX: {b1}");
    assert_eq!(record["ledger"]["buckets"]["lost_in_transport"], 0, "{}", record["ledger"]);
    let causes = assert_causes(&record, &[("process_down", "builder1")]);
    println!("ucx builder SIGKILL: diagnosis {causes:?}; ledger {}", record["ledger"]);
    no_process_left(&dir);
}

/// Whether the stop costs slices depends on what the sources could hold meanwhile (their
/// queues and 16 MiB in flight per link): sometimes nothing is lost. The hang is named
/// either way, and what is lost is put down to it.
#[test]
fn over_ucx_a_builder_stopped_for_6_s_is_named_and_whatever_it_costs_is_put_down_to_it() {
    let c = Cluster::start_run("ucx-stop-builder", 16, UCX_RUN, ["", "", "wall_timeout_ms = 1500", ""], &[], &|_| {
        String::new()
    });
    std::thread::sleep(Duration::from_secs(3));
    c.signal("builder0", "STOP");
    std::thread::sleep(Duration::from_secs(6));
    c.signal("builder0", "CONT");
    let (record, dir) = c.finish();
    assert_accounted(&record);
    assert!(record["departures"].as_array().unwrap().is_empty(), "{}", record["departures"]);
    let reports = record["reports"].as_array().unwrap();
    let b0 = reports.iter().find(|r| r["name"] == "builder0").unwrap();
    assert!(b0["slices_complete"].as_u64().unwrap() > 0, "builder0 built again after it resumed: {b0}");
    assert!(timeline(&record).contains(&("process_hung".into(), "builder0".into())), "{}", record["diagnosis"]);
    let causes = assert_causes_allowing(&record, &[], &[("process_hung", "builder0")]);
    println!("ucx builder SIGSTOP 6 s: diagnosis {causes:?}; ledger {}", record["ledger"]);
    no_process_left(&dir);
}
