//! The fault matrix under `shoal run` (every role its own process on loopback): a process
//! killed or hung mid-run. For each: the others keep running, the run ends by itself,
//! the run record says what happened, and every fragment is in a ledger bucket (a dead
//! source's production attributed, not unknown). Recovery times are printed (`--nocapture`)
//! for docs/reliability.md, never asserted.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
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

fn status(ui: &str) -> Option<serde_json::Value> {
    http_get(ui, "/api/status").and_then(|b| serde_json::from_str(&b).ok())
}

/// A `shoal run` of 2 builders and 3 single-source processes, killed as a group if the
/// test fails half-way.
struct Cluster {
    child: std::process::Child,
    dir: PathBuf,
    ui: String,
    dispatcher: String,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill").args(["-KILL", &format!("-{}", self.child.id())]).status();
            let _ = self.child.wait();
        }
        // Processes restarted by run control are in their own groups: the OFF at the
        // end (or their parent watch) ends them. The directory goes with a passed test
        // (`no_process_left`); a failed one leaves it to look at.
    }
}

impl Cluster {
    fn start(name: &str, seconds: u32) -> Cluster {
        Self::start_with(name, seconds, "")
    }

    /// `builder` is added to the run configuration's `[builder]` table.
    fn start_with(name: &str, seconds: u32, builder: &str) -> Cluster {
        let dir = std::env::temp_dir().join(format!("shoal-fault-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (sources, builders) = (3u32, 2u32);
        let dispatcher = format!("127.0.0.1:{}", free_port());
        let mut text = format!(
            "[cluster]\nname = \"{name}\"\ndispatcher = \"{dispatcher}\"\ndispatcher_http = \"off\"\nstate_dir = \"{}\"\n\
             reply_timeout_ms = 5000\nstats_interval_ms = 500\n\n[[process]]\nname = \"writer\"\nrole = \"writer\"\n",
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
             [config.source]\ndrain_timeout_ms = 2000\nreconnect_max_ms = 500\n[config.source.noise]\nrate_hz = 20000.0\n\
             [config.builder]\ndrain_timeout_ms = 4000\nwall_timeout_ms = 1500\n{builder}\n\
             [config.writer]\nout_dir = \"{}\"\n",
            addrs.join(", "),
            free_port(),
            dir.join("data").display()
        );
        let file = dir.join("cluster.toml");
        std::fs::write(&file, &text).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_shoal"))
            .args(["run", file.to_str().unwrap(), "--seconds", &seconds.to_string(), "--http", "127.0.0.1:0"])
            .current_dir(&dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("run control UI: http://") {
                    let _ = tx.send(rest.trim_end_matches('/').to_string());
                }
            }
        });
        let ui = rx.recv_timeout(Duration::from_secs(120)).expect("shoal run printed its UI address");
        let c = Cluster { child, dir, ui, dispatcher };
        c.wait_for("the cluster RUNNING", |s| s["state"] == "RUNNING");
        c
    }

    fn wait_for(&self, what: &str, ok: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
        let waiting = Instant::now();
        loop {
            if let Some(s) = status(&self.ui)
                && ok(&s)
            {
                return s;
            }
            assert!(waiting.elapsed() < Duration::from_secs(120), "waited 120 s for {what}: {:?}", status(&self.ui));
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn pid(&self, name: &str) -> u32 {
        let s = status(&self.ui).unwrap();
        let p = s["processes"].as_array().unwrap().iter().find(|p| p["name"] == name).unwrap();
        p["pid"].as_u64().unwrap_or_else(|| panic!("no pid for {name}: {p}")) as u32
    }

    fn process<'a>(s: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
        s["processes"].as_array().unwrap().iter().find(|p| p["name"] == name).unwrap()
    }

    /// Sends `signal` to the process `name`; returns its pid and when (UNIX ns).
    fn signal(&self, name: &str, signal: &str) -> (u32, u64) {
        let pid = self.pid(name);
        let at = unix_ns();
        assert!(Command::new("kill").args([&format!("-{signal}"), &pid.to_string()]).status().unwrap().success());
        (pid, at)
    }

    /// Waits for `shoal run` to end by itself; returns the run record.
    fn finish(mut self) -> (serde_json::Value, PathBuf) {
        let waiting = Instant::now();
        let st = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st;
            }
            assert!(waiting.elapsed() < Duration::from_secs(240), "shoal run did not end");
            std::thread::sleep(Duration::from_millis(200));
        };
        assert!(st.success(), "shoal run exited {st}");
        let path = self.dir.join("state").join("runs").join("run000001.json");
        let record: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        (record, self.dir.clone())
    }
}

fn assert_accounted(record: &serde_json::Value) {
    let l = &record["ledger"];
    assert_eq!(l["balanced"], true, "{l}");
    assert_eq!(l["unaccounted"], 0, "{l}");
    assert_eq!(l["excess_received"], 0, "{l}");
}

/// The slice in progress at `unix` ns (100-ms slices on the UNIX epoch).
fn slice_at(unix: u64) -> u64 {
    unix / 100_000_000
}

fn no_process_left(dir: &Path) {
    // Every process of the cluster was launched with this directory's cluster file.
    let file = dir.join("cluster.toml");
    let out = Command::new("pgrep").args(["-f", file.to_str().unwrap()]).output().unwrap();
    assert!(out.stdout.is_empty(), "processes left: {}", String::from_utf8_lossy(&out.stdout));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_source_killed_mid_run_is_restarted_and_rejoins_with_its_production_attributed() {
    let c = Cluster::start("kill-source", 12);
    std::thread::sleep(Duration::from_secs(3));
    let (old, killed) = c.signal("source1", "KILL");
    let back = c.wait_for("source1 started again", |s| {
        Cluster::process(s, "source1")["pid"].as_u64().is_some_and(|pid| pid as u32 != old)
    });
    assert!(Cluster::process(&back, "source0")["active"] == true);
    let (record, dir) = c.finish();
    assert_accounted(&record);
    let d = record["departures"].as_array().unwrap();
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!((d[0]["name"].as_str(), d[0]["role"].as_str()), (Some("source1"), Some("source")));
    let rejoined = d[0]["rejoined_slice"].as_u64().expect("rejoined");
    assert!(rejoined >= d[0]["to_slice"].as_u64().unwrap());
    let running_again = d[0]["rejoined_unix_ns"].as_u64().unwrap();
    let buckets = &record["ledger"]["buckets"];
    // What it held when it died is lost with it; nothing is unknown or lost in transport.
    assert_eq!(buckets["lost_in_transport"], 0, "{buckets}");
    assert!(record["slices_complete"].as_u64().unwrap() > 0);
    // Slices after the rejoin are complete again (the builders saw source 1 again).
    let first_after = rejoined;
    println!(
        "fault source SIGKILL: started again and sent START {:.2} s after the kill (rejoined at slice {}, {} slices \
         after the kill); lost_with_source {}, ledger {}",
        running_again.saturating_sub(killed) as f64 * 1e-9,
        first_after,
        first_after.saturating_sub(slice_at(killed)),
        buckets["lost_with_source"],
        record["ledger"]
    );
    no_process_left(&dir);
}

#[test]
fn a_builder_killed_mid_run_is_restarted_and_the_sources_reconnect() {
    let c = Cluster::start("kill-builder", 12);
    std::thread::sleep(Duration::from_secs(3));
    let (old, killed) = c.signal("builder1", "KILL");
    c.wait_for("builder1 started again", |s| {
        Cluster::process(s, "builder1")["pid"].as_u64().is_some_and(|pid| pid as u32 != old)
    });
    let (record, dir) = c.finish();
    assert_accounted(&record);
    let d = record["departures"].as_array().unwrap();
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(d[0]["name"], "builder1");
    let running_again = d[0]["rejoined_unix_ns"].as_u64().expect("builder1 rejoined");
    let buckets = &record["ledger"]["buckets"];
    assert_eq!(buckets["lost_in_transport"], 0, "what the dead builder had is lost with it: {buckets}");
    // The restarted builder built slices again: its report is there.
    let reports = record["reports"].as_array().unwrap();
    let b1 = reports.iter().find(|r| r["name"] == "builder1").expect("builder1's report");
    assert!(b1["slices_complete"].as_u64().unwrap() > 0, "{b1}");
    println!(
        "fault builder SIGKILL: started again and sent START {:.2} s after the kill; builder1 built {} slices \
         after its restart; ledger {}",
        running_again.saturating_sub(killed) as f64 * 1e-9,
        b1["slices_complete"],
        record["ledger"]
    );
    no_process_left(&dir);
}

#[test]
fn a_builder_hung_for_10_s_costs_counted_data_and_the_run_goes_on() {
    let c = Cluster::start("stop-builder", 20);
    std::thread::sleep(Duration::from_secs(3));
    let (_, stopped) = c.signal("builder0", "STOP");
    std::thread::sleep(Duration::from_secs(10));
    let (_, resumed) = c.signal("builder0", "CONT");
    let (record, dir) = c.finish();
    assert_accounted(&record);
    // A hung process is alive: nothing departed, nothing restarted.
    assert!(record["departures"].as_array().unwrap().is_empty(), "{}", record["departures"]);
    let reports = record["reports"].as_array().unwrap();
    let b1 = reports.iter().find(|r| r["name"] == "builder1").unwrap();
    let b0 = reports.iter().find(|r| r["name"] == "builder0").unwrap();
    assert!(b1["slices_complete"].as_u64().unwrap() > 50, "builder1 kept building: {b1}");
    assert!(b0["slices_complete"].as_u64().unwrap() > 0, "builder0 built again after it resumed: {b0}");
    println!(
        "fault builder SIGSTOP 10 s ({:.1} s): builder0 {} complete / {} incomplete, builder1 {} complete; ledger {}",
        (resumed - stopped) as f64 * 1e-9,
        b0["slices_complete"],
        b0["slices_incomplete"],
        b1["slices_complete"],
        record["ledger"]
    );
    no_process_left(&dir);
}

/// Hostile clients on run control's HTTP port during a run: live views (WebSockets) that
/// never read, up to and past their limit, and a slowloris; the API keeps answering and
/// the run ends normally with nothing lost.
#[test]
fn hostile_clients_on_run_controls_http_port_do_not_stall_it() {
    let c = Cluster::start("hostile-http", 8);
    // Each view from its own address: the HTTP server's limit per peer (32 connections
    // until their upgrade) is not what this test is about.
    let upgrade = |ui: &str, k: u8| {
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        sock.bind(&std::net::SocketAddr::from(([127, 0, 3, k], 0)).into()).unwrap();
        sock.connect(&ui.parse::<std::net::SocketAddr>().unwrap().into()).unwrap();
        let mut s: TcpStream = sock.into();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(
            s,
            "GET /api/ws HTTP/1.1\r\nHost: {ui}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        .unwrap();
        let mut head = [0u8; 12];
        s.read_exact(&mut head).unwrap();
        (s, String::from_utf8_lossy(&head).to_string())
    };
    // 64 live views that never read what they are sent: all accepted ...
    let views: Vec<_> = (1..=64).map(|k| upgrade(&c.ui, k)).collect();
    assert!(
        views.iter().all(|(_, head)| head == "HTTP/1.1 101"),
        "{:?}",
        views.iter().map(|v| &v.1).collect::<Vec<_>>()
    );
    // ... the 65th is refused, and the API still answers.
    let (_, head) = upgrade(&c.ui, 65);
    assert_eq!(head, "HTTP/1.1 503");
    let mut slow = TcpStream::connect(&c.ui).unwrap();
    slow.write_all(b"GET /api/status HTTP/1.1\r\nX-Slow: a").unwrap();
    assert!(status(&c.ui).is_some_and(|s| s["state"] == "RUNNING"));
    let (record, dir) = c.finish();
    assert_accounted(&record);
    // No data connection suffered (lateness would be the machine's load, not the clients').
    let b = &record["ledger"]["buckets"];
    assert_eq!((b["lost_in_transport"].as_u64(), b["send_failed"].as_u64()), (Some(0), Some(0)), "{b}");
    assert!(record["departures"].as_array().unwrap().is_empty());
    drop((views, slow));
    no_process_left(&dir);
}

#[test]
fn the_writer_killed_mid_run_is_restarted_and_continues_in_a_second_file() {
    let c = Cluster::start("kill-writer", 12);
    std::thread::sleep(Duration::from_secs(3));
    let (old, killed) = c.signal("writer", "KILL");
    c.wait_for("the writer started again", |s| {
        Cluster::process(s, "writer")["pid"].as_u64().is_some_and(|pid| pid as u32 != old)
    });
    let (record, dir) = c.finish();
    assert_accounted(&record);
    let d = record["departures"].as_array().unwrap();
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(d[0]["name"], "writer");
    let rejoined = d[0]["rejoined_unix_ns"].as_u64().expect("the writer rejoined");
    // The first file is kept; the restarted writer wrote a second one.
    let data = dir.join("data");
    let size = |name: &str| std::fs::metadata(data.join(name)).map(|m| m.len());
    let first = size("run000001.events.parquet").expect("the first file is kept");
    let second = size("run000001.events.part2.parquet").expect("a second file");
    // The second is a whole Parquet file (the restarted writer closed it at the end).
    let tail = std::fs::read(data.join("run000001.events.part2.parquet")).unwrap();
    assert!(tail.ends_with(b"PAR1"), "the second file has no Parquet footer");
    let writer = record["reports"].as_array().unwrap().iter().find(|r| r["name"] == "writer").expect("writer report");
    assert!(writer["error"].is_null(), "{writer}");
    // What died with the first writer is said: events selected, fewer stored.
    let (events, stored) = (record["events"].as_u64().unwrap(), record["events_stored"].as_u64().unwrap());
    assert!(stored <= events, "{events} selected, {stored} stored");
    println!(
        "fault writer SIGKILL: started again and sent START {:.2} s after the kill; first file {} bytes \
         (footer: {}), second file {} bytes; events selected {}, stored {}; ledger {}",
        rejoined.saturating_sub(killed) as f64 * 1e-9,
        first,
        std::fs::read(data.join("run000001.events.parquet")).unwrap().ends_with(b"PAR1"),
        second,
        events,
        stored,
        record["ledger"]
    );
    no_process_left(&dir);
}

/// A filter 2x too slow for the load (each builder gets a slice every 200 ms, its filter
/// takes 400 ms) for 20 s: the filter queue is bounded by the builder's memory, what does
/// not fit is dropped and counted, the run ends with every fragment accounted.
#[test]
fn a_filter_too_slow_for_the_load_costs_counted_fragments_not_memory() {
    let c = Cluster::start_with("slow-filter", 20, "fault_filter_ms_per_slice = 400\nmemory_budget_mb = 4");
    let (record, dir) = c.finish();
    assert_accounted(&record);
    let b = &record["ledger"]["buckets"];
    let dropped = b["dropped_overload"].as_u64().unwrap();
    assert!(dropped > 0, "the queue must overflow the builders' memory: {b}");
    assert!(record["departures"].as_array().unwrap().is_empty(), "{}", record["departures"]);
    let builders: Vec<_> = record["reports"].as_array().unwrap().iter().filter(|r| r["role"] == "builder").collect();
    assert_eq!(builders.len(), 2, "both builders reported");
    let not_filtered: u64 = builders.iter().map(|b| b["detail"]["slices_not_filtered"].as_u64().unwrap()).sum();
    println!(
        "fault slow filter (400 ms per 200-ms slice, 4 MiB per builder): {} complete, {} incomplete; \
         dropped_overload {}; slices not filtered {}; ledger {}",
        record["slices_complete"], record["slices_incomplete"], dropped, not_filtered, record["ledger"]
    );
    no_process_left(&dir);
}

/// The dispatcher killed mid-run: the data path does not go through it and keeps going;
/// run control starts it again, every client reconnects, and the run is stopped and
/// recorded normally.
#[test]
fn the_dispatcher_killed_mid_run_is_restarted_and_control_comes_back() {
    let c = Cluster::start("kill-dispatcher", 12);
    std::thread::sleep(Duration::from_secs(3));
    let find = || {
        let out =
            Command::new("pgrep").args(["-f", &format!("dispatcher --listen {}", c.dispatcher)]).output().unwrap();
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse::<u32>().ok())
            .collect::<Vec<_>>()
    };
    let old = find();
    assert_eq!(old.len(), 1, "one dispatcher: {old:?}");
    let killed = unix_ns();
    assert!(Command::new("kill").args(["-KILL", &old[0].to_string()]).status().unwrap().success());
    // Started again: a new process listening on the same address.
    let waiting = Instant::now();
    while find().iter().all(|p| *p == old[0]) || TcpStream::connect(&c.dispatcher).is_err() {
        assert!(waiting.elapsed() < Duration::from_secs(60), "the dispatcher was not started again");
        std::thread::sleep(Duration::from_millis(20));
    }
    let listening = unix_ns();
    // Control works again: fresh statistics reach run control through the new dispatcher.
    let seen = c.wait_for("statistics through the new dispatcher", |s| {
        s["processes"].as_array().unwrap().iter().all(|p| p["last_reply"].is_string() || p["stats"].is_object())
    });
    assert_eq!(seen["state"], "RUNNING");
    let (record, dir) = c.finish();
    assert_accounted(&record);
    assert!(record["departures"].as_array().unwrap().is_empty(), "nobody left: {}", record["departures"]);
    assert!(
        record["missing_reports"].as_array().unwrap().is_empty(),
        "every report came: {}",
        record["missing_reports"]
    );
    let b = &record["ledger"]["buckets"];
    assert_eq!((b["lost_in_transport"].as_u64(), b["send_failed"].as_u64()), (Some(0), Some(0)), "{b}");
    println!(
        "fault dispatcher SIGKILL: listening again {:.2} s after the kill; run stopped and recorded with every report; ledger {}",
        listening.saturating_sub(killed) as f64 * 1e-9,
        record["ledger"]
    );
    no_process_left(&dir);
}
