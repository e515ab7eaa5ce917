//! An alert under `shoal run`: every role its own process, the alert sent with
//! `shoal alert` through the dispatcher 20 s after its window; the raw file holds every
//! fragment of the window, byte for byte what the sources' generator produces.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

fn unix_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64
}

fn http_get(addr: &str, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.split_once("\r\n\r\n").map(|(_, body)| body.to_string())
}

/// Kills the cluster if the test fails half-way (its own process group).
struct Cluster(std::process::Child);

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = Command::new("kill").args(["-KILL", &format!("-{}", self.0.id())]).status();
            let _ = self.0.wait();
        }
    }
}

#[test]
fn an_alert_under_shoal_run_recovers_its_window_byte_for_byte() {
    let dir = std::env::temp_dir().join(format!("shoal-alert-run-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let dispatcher = format!("127.0.0.1:{}", free_port());
    let (sources, builders) = (3u32, 2u32);
    let mut text = format!(
        "[cluster]\nname = \"alert\"\ndispatcher = \"{dispatcher}\"\ndispatcher_http = \"off\"\nstate_dir = \"{}\"\n\
         reply_timeout_ms = 10000\nstats_interval_ms = 500\n\n[[process]]\nname = \"writer\"\nrole = \"writer\"\n",
        dir.join("state").display()
    );
    for b in 0..builders {
        text += &format!("[[process]]\nname = \"builder{b}\"\nrole = \"builder\"\nids = [{b}]\n");
    }
    for s in 0..sources {
        text += &format!("[[process]]\nname = \"source{s}\"\nrole = \"source\"\nids = [{s}]\n");
    }
    let addrs: Vec<String> = (0..builders).map(|_| format!("\"127.0.0.1:{}\"", free_port())).collect();
    text += &format!(
        "[config.run]\nsources = {sources}\nbuilders = {builders}\nslice_ms = 100\npolicy = \"direct\"\n\
         builder_addrs = [{}]\nwriter_addr = \"127.0.0.1:{}\"\n\
         [config.source]\ndrain_timeout_ms = 2000\n[config.source.noise]\nrate_hz = 20000.0\n\
         [config.builder]\ndrain_timeout_ms = 4000\nmax_active = 100000\nwall_timeout_ms = 600000\n\
         [config.writer]\nout_dir = \"{}\"\n",
        addrs.join(", "),
        free_port(),
        dir.join("data").display()
    );
    let file = dir.join("cluster.toml");
    std::fs::write(&file, &text).unwrap();
    let cluster_cfg = shoal_control::cluster::ClusterFile::load(&file).unwrap().config;

    let mut child = shoal()
        .args(["run", file.to_str().unwrap(), "--seconds", "26", "--http", "127.0.0.1:0"])
        .current_dir(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let cluster = Cluster(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("run control UI: http://") {
                let _ = tx.send(rest.trim_end_matches('/').to_string());
            }
        }
    });
    let ui = rx.recv_timeout(Duration::from_secs(120)).expect("shoal run printed its UI address");

    // Data taking has started once the cluster is RUNNING.
    let waiting = Instant::now();
    loop {
        let status = http_get(&ui, "/api/status").and_then(|b| serde_json::from_str::<serde_json::Value>(&b).ok());
        if status.as_ref().is_some_and(|s| s["state"] == "RUNNING") {
            break;
        }
        assert!(waiting.elapsed() < Duration::from_secs(120), "the cluster never reached RUNNING: {status:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
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

    let mut cluster = cluster;
    let waiting = Instant::now();
    let status = loop {
        if let Some(s) = cluster.0.try_wait().unwrap() {
            break s;
        }
        assert!(waiting.elapsed() < Duration::from_secs(180), "shoal run did not end");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(status.success(), "shoal run exited {status}");

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
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("state").join("runs").join("run000001.json")).unwrap()).unwrap();
    assert_eq!(record["ledger"]["balanced"], true, "{}", record["ledger"]);
    drop(cluster);
    std::fs::remove_dir_all(&dir).unwrap();
}
