//! Each role as its own OS process (`shoal node --role ...`), configured by one TOML file
//! and `--ids`.
//!
//! The processes start one after another, and a cold start can take longer than the first
//! slice is ahead: a source may then produce its first slices late. The builders' slice
//! timeouts are set out of reach, so they wait for every source whatever the start-up
//! timing and the test checks completeness, not the machine's speed. (With the default
//! slice-count timeout, a source 330 ms late had 33 fragments counted `late`: in the
//! ledger, but not delivered.)

mod common;
use common::free_port;

use std::process::{Child, Command, Stdio};

fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

/// An empty directory for one test's files.
fn test_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("shoal-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The slice every process starts at, agreed with no message: one second from now (10 ms
/// slices).
fn start_slice() -> u64 {
    let now_ns = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    now_ns / 10_000_000 + 100
}

/// `shoal node --role ROLE --config BASE [--ids IDS]`, its report on stdout.
fn spawn_node(base: &std::path::Path, role: &str, ids: &str) -> Child {
    let mut c = shoal();
    c.args(["node", "--role", role, "--config"]).arg(base);
    if !ids.is_empty() {
        c.args(["--ids", ids]);
    }
    c.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap()
}

/// A node's report, once it has ended successfully.
fn report(child: Child) -> serde_json::Value {
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "a node failed: {:?}", out.status);
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn source_builder_writer_as_separate_processes() {
    let dir = test_dir("nodes");
    let (b0, b1, w) = (free_port(), free_port(), free_port());
    let start_slice = start_slice();
    let toml = format!(
        r#"
[run]
run_number = 42
seconds = 1.0
sources = 3
builders = 2
policy = "delayed:2"
builder_addrs = ["127.0.0.1:{b0}", "127.0.0.1:{b1}"]
writer_addr = "127.0.0.1:{w}"
start_slice = {start_slice}

[source]
generator = "noise"

[source.noise]
rate_hz = 10000.0
waveform_rate_hz = 0.0

[builder]
max_active = 100000
wall_timeout_ms = 600000

[writer]
out_dir = "{out}"
"#,
        out = dir.display()
    );
    let base = dir.join("cluster.toml");
    std::fs::write(&base, &toml).unwrap();
    let spawn = |role: &str, ids: &str| spawn_node(&base, role, ids);
    // Sources reconnect with backoff until the listeners exist: no start order is needed.
    let writer = spawn("writer", "");
    let builder0 = spawn("builder", "0");
    let builder1 = spawn("builder", "1");
    let source_a = spawn("source", "0,1");
    let source_b = spawn("source", "2");

    let reports: Vec<_> = [source_a, source_b, builder0, builder1, writer].into_iter().map(report).collect();
    let produced: u64 = reports[..2]
        .iter()
        .flat_map(|r| r["tallies"].as_object().unwrap().values())
        .map(|t| t["produced"].as_u64().unwrap())
        .sum();
    let delivered: u64 = reports[2..4].iter().map(|r| r["tally"]["delivered"].as_u64().unwrap()).sum();
    assert_eq!(produced, 3 * 100, "3 sources x 1 s of 10 ms slices");
    assert_eq!(delivered, produced, "every fragment delivered to a builder");
    let complete: u64 = reports[2..4].iter().map(|r| r["slices_complete"].as_u64().unwrap()).sum();
    assert_eq!(complete, 100, "every slice complete: the processes agreed on the slices");
    assert_eq!(reports[2]["id"], 0, "--ids 0 applied");
    assert_eq!(reports[3]["id"], 1, "--ids 1 applied");
    for b in &reports[2..4] {
        assert_eq!(b["network_delay"]["count"], b["fragments"], "the standalone report has the network delay");
    }
    let writer = &reports[4];
    assert_eq!(writer["builders_ended"], 2);
    assert!(dir.join("run000042.events.parquet").exists());
    assert!(dir.join("run000042.writer.json").exists());
    assert!(dir.join("run000042.builder0.json").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ids_that_do_not_fit_the_role_are_refused() {
    for (role, ids) in [("builder", "0,1"), ("writer", "0")] {
        let out = shoal().args(["node", "--role", role, "--ids", ids]).output().unwrap();
        assert!(!out.status.success(), "{role} --ids {ids} must be refused");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--ids"), "{role}: {err}");
    }
}

/// `source.connection_per_source`: one source process hosting three sources opens a
/// connection per source to the builder (as three boards would), and every fragment
/// arrives.
#[test]
fn a_connection_per_source_when_asked() {
    let dir = test_dir("nodes-per-source");
    let (b0, w) = (free_port(), free_port());
    let start_slice = start_slice();
    let toml = format!(
        r#"
[run]
run_number = 43
seconds = 0.5
sources = 3
builders = 1
policy = "direct"
builder_addrs = ["127.0.0.1:{b0}"]
writer_addr = "127.0.0.1:{w}"
start_slice = {start_slice}

[source]
generator = "fixed"
fixed_bytes = 1000
connection_per_source = true

[builder]
max_active = 100000
wall_timeout_ms = 600000

[builder.filter]
name = "none"

[writer]
out_dir = "{out}"
"#,
        out = dir.display()
    );
    let base = dir.join("cluster.toml");
    std::fs::write(&base, &toml).unwrap();
    let writer = spawn_node(&base, "writer", "");
    let builder = spawn_node(&base, "builder", "0");
    let source = spawn_node(&base, "source", "0,1,2");
    let reports: Vec<_> = [source, builder, writer].into_iter().map(report).collect();
    let produced: u64 =
        reports[0]["tallies"].as_object().unwrap().values().map(|t| t["produced"].as_u64().unwrap()).sum();
    assert_eq!(produced, 3 * 50, "3 sources x 0.5 s of 10 ms slices");
    assert_eq!(reports[1]["tally"]["delivered"].as_u64().unwrap(), produced);
    assert_eq!(reports[1]["connections"], 3, "one connection per source: {:#}", reports[1]);
    std::fs::remove_dir_all(&dir).unwrap();
}
