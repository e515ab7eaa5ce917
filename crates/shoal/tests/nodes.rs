//! Each role as its own OS process (`shoal node --role ...`), configured by one TOML file.

use std::net::TcpListener;
use std::process::{Command, Stdio};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

#[test]
fn source_builder_writer_as_separate_processes() {
    let dir = std::env::temp_dir().join(format!("shoal-nodes-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (b0, b1, w) = (free_port(), free_port(), free_port());
    // All processes agree on the first slice: one second from now (10 ms slices).
    let now_ns = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let start_slice = now_ns / 10_000_000 + 100;
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

[source.noise]
rate_hz = 10000.0
waveform_rate_hz = 0.0

[writer]
out_dir = "{out}"
"#,
        out = dir.display()
    );
    let base = dir.join("cluster.toml");
    std::fs::write(&base, &toml).unwrap();
    let with = |name: &str, extra: &str| {
        let p = dir.join(format!("{name}.toml"));
        // Append role-specific tables (TOML tables may not repeat, so only new ones).
        std::fs::write(&p, format!("{toml}\n{extra}")).unwrap();
        p
    };
    let spawn = |role: &str, cfg: &std::path::Path| {
        shoal()
            .args(["node", "--role", role, "--config"])
            .arg(cfg)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let writer = spawn("writer", &base);
    let builder0 = spawn("builder", &with("builder0", "[builder]\nid = 0\n"));
    let builder1 = spawn("builder", &with("builder1", "[builder]\nid = 1\n"));
    // Sources start after the listeners exist; they would reconnect with backoff anyway.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let source_a = spawn("source", &with("source_a", "[source]\nids = [0, 1]\n"));
    let source_b = spawn("source", &with("source_b", "[source]\nids = [2]\n"));

    let mut reports = Vec::new();
    for child in [source_a, source_b, builder0, builder1, writer] {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "a node failed: {:?}", out.status);
        reports.push(serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap());
    }
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
    let writer = &reports[4];
    assert_eq!(writer["builders_ended"], 2);
    assert!(dir.join("run000042.events.parquet").exists());
    assert!(dir.join("run000042.writer.json").exists());
    assert!(dir.join("run000042.builder0.json").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
