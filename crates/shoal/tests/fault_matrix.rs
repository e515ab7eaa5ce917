//! The fault matrix under `shoal run` (every role its own process on loopback): a process
//! killed or hung mid-run. For each: the others keep running, the run ends by itself,
//! the run record says what happened, and every fragment is in a ledger bucket (a dead
//! source's production attributed, not unknown). Recovery times are printed (`--nocapture`)
//! for docs/reliability.md, never asserted.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

/// The slice in progress at `unix` ns (100-ms slices on the UNIX epoch).
fn slice_at(unix: u64) -> u64 {
    unix / 100_000_000
}

#[test]
fn a_source_killed_mid_run_is_restarted_and_rejoins_with_its_production_attributed() {
    let c = Cluster::start("kill-source", 12);
    std::thread::sleep(Duration::from_secs(3));
    let killed = c.kill_and_await_restart("source1");
    assert!(Cluster::process(&status(&c.ui).unwrap(), "source0")["active"] == true);
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
    // Every slice it cost is put down to its death, and the death was seen live.
    let causes = assert_causes(&record, &[("process_down", "source1")]);
    assert!(timeline(&record).contains(&("process_down".into(), "source1".into())), "{}", record["diagnosis"]);
    println!("diagnosis: {causes:?}");
    // `shoal diagnose` says the same of the record, in text and JSON.
    let path = dir.join("state/runs/run000001.json");
    let out = shoal().args(["diagnose", path.to_str().unwrap()]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("0 unexplained") && text.contains("process_down") && text.contains("source1"), "{text}");
    let out = shoal().args(["diagnose", "--json", path.to_str().unwrap()]).output().unwrap();
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["slices"], record["diagnosis"]["slices"]);
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
    let killed = c.kill_and_await_restart("builder1");
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
    let causes = assert_causes(&record, &[("process_down", "builder1")]);
    let lost: u64 = causes.iter().map(|c| c.2).sum();
    assert!(lost > 0, "the slices builder1 was gone for are lost");
    println!("diagnosis: {causes:?}");
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
    // It processed its share of the 20 s (complete or, on a starved machine, not).
    let processed =
        |b: &serde_json::Value| b["slices_complete"].as_u64().unwrap() + b["slices_incomplete"].as_u64().unwrap();
    assert!(processed(b1) > 50, "builder1 kept building: {b1}");
    assert!(b0["slices_complete"].as_u64().unwrap() > 0, "builder0 built again after it resumed: {b0}");
    // The hang is seen (its statistics stop) and claims what it cost.
    assert!(timeline(&record).contains(&("process_hung".into(), "builder0".into())), "{}", record["diagnosis"]);
    // Its host still answered (the sources' links saw a closed window, not timeouts): not
    // the network.
    assert!(!timeline(&record).iter().any(|(rule, _)| rule == "network_path"), "{}", record["diagnosis"]);
    let causes = assert_causes(&record, &[("process_hung", "builder0")]);
    println!("diagnosis: {causes:?}");
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

/// `cluster.auto_recover`: a builder hung (SIGSTOP) is killed 2 s after run control sees
/// the hang, started again, and rejoins the run; the record lists the recovery, and the
/// slices lost are put down to the builder.
#[test]
fn a_hung_builder_is_restarted_by_auto_recovery() {
    let c = Cluster::start_full(
        "auto-recover",
        16,
        "auto_recover = [{ rule = \"process_hung\", after_s = 2.0 }]",
        "",
        "wall_timeout_ms = 1500",
        "",
    );
    std::thread::sleep(Duration::from_secs(3));
    let (old, stopped) = c.signal("builder0", "STOP");
    c.wait_for("builder0 killed and started again", |s| {
        Cluster::process(s, "builder0")["pid"].as_u64().is_some_and(|pid| pid as u32 != old)
    });
    let restarted = unix_ns();
    let (record, dir) = c.finish();
    assert_accounted(&record);
    let r = record["recoveries"].as_array().unwrap();
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!((r[0]["rule"].as_str(), r[0]["process"].as_str()), (Some("process_hung"), Some("builder0")));
    assert_eq!(r[0]["action"], format!("killed pid {old} to restart it"));
    let d = record["departures"].as_array().unwrap();
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(d[0]["name"], "builder0");
    assert!(d[0]["rejoined_slice"].as_u64().is_some(), "builder0 rejoined: {d:?}");
    let causes = assert_causes(&record, &[("process_down", "builder0")]);
    assert!(timeline(&record).contains(&("process_hung".into(), "builder0".into())), "{}", record["diagnosis"]);
    println!(
        "auto-recovery: builder0 stopped, killed and running again {:.1} s later; diagnosis {causes:?}",
        restarted.saturating_sub(stopped) as f64 * 1e-9
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

/// With `writer.checkpoint_s = 1` the writer closes its file every second of data: what
/// the killed writer had closed survives, what it had open is lost and said.
#[test]
fn the_writer_killed_mid_run_is_restarted_and_continues_in_a_second_file() {
    let c = Cluster::start_with_writer("kill-writer", 12, "wall_timeout_ms = 1500", "checkpoint_s = 1.0");
    std::thread::sleep(Duration::from_secs(3));
    let killed = c.kill_and_await_restart("writer");
    let (record, dir) = c.finish();
    assert_accounted(&record);
    let d = record["departures"].as_array().unwrap();
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(d[0]["name"], "writer");
    let rejoined = d[0]["rejoined_unix_ns"].as_u64().expect("the writer rejoined");
    // The killed writer closed a file a second (listed in the manifest, whole); the one it
    // had open is lost, and the record says which slices' events were in it.
    let data = dir.join("data");
    let manifest = std::fs::read_to_string(data.join("run000001.events.manifest.jsonl")).unwrap();
    let closed: Vec<serde_json::Value> = manifest.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let whole = |p: &serde_json::Value| std::fs::read(p.as_str().unwrap()).unwrap().ends_with(b"PAR1");
    assert!(closed.iter().all(|f| whole(&f["path"])), "{manifest}");
    let lost = record["events_lost_with_writer"].as_array().unwrap();
    assert_eq!(lost.len(), 1, "{}", record["events_lost_with_writer"]);
    let (from, to) = (lost[0]["from_slice"].as_u64().unwrap(), lost[0]["to_slice"].as_u64().unwrap());
    let unclosed = lost[0]["unclosed_files"].as_array().unwrap();
    assert_eq!(unclosed.len(), 1, "{lost:?}");
    assert!(!whole(&unclosed[0]), "the unclosed file has no footer");
    // Nothing closed before the kill is in the lost window; the restarted writer's
    // files (after it) are whole and come after it.
    let before_kill: Vec<_> = closed.iter().filter(|f| f["last_slice"].as_u64().unwrap() < from).collect();
    let after: Vec<_> = closed.iter().filter(|f| f["first_slice"].as_u64().unwrap() >= to).collect();
    assert_eq!(before_kill.len() + after.len(), closed.len(), "a closed file overlaps the lost window: {manifest}");
    assert!(!after.is_empty(), "the restarted writer closed its files: {manifest}");
    let (first, second) = (before_kill.len(), after.len());
    // The diagnosis puts those slices down to the writer's death.
    let causes = assert_causes(&record, &[("process_down", "writer")]);
    let by_writer = losses_put_down_to(&record, "process_down");
    assert_eq!(by_writer["events_lost"].as_u64(), Some(to - from), "{by_writer}");
    println!("diagnosis: {causes:?}; events of slices {from}..{to} lost ({} slices)", to - from);
    assert!(timeline(&record).contains(&("process_down".into(), "writer".into())), "{}", record["diagnosis"]);
    let writer = record["reports"].as_array().unwrap().iter().find(|r| r["name"] == "writer").expect("writer report");
    assert!(writer["error"].is_null(), "{writer}");
    // What died with the first writer is said: events selected, fewer stored.
    let (events, stored) = (record["events"].as_u64().unwrap(), record["events_stored"].as_u64().unwrap());
    assert!(stored <= events, "{events} selected, {stored} stored");
    println!(
        "fault writer SIGKILL: started again and sent START {:.2} s after the kill; {} files closed before the \
         kill, {} after; events selected {}, stored {}; ledger {}",
        rejoined.saturating_sub(killed) as f64 * 1e-9,
        first,
        second,
        events,
        stored,
        record["ledger"]
    );
    no_process_left(&dir);
}

/// The writer's disk fills up mid-run (a small tmpfs; root only, skipped otherwise), with
/// `writer.checkpoint_s = 1`: the files closed before are whole, the events from the one
/// open then to the end are not stored, and the diagnosis puts exactly those slices down
/// to `storage_failing` on the writer, live and in the record.
#[test]
fn the_writers_disk_filling_up_is_named_and_costs_only_what_was_not_stored() {
    if !is_root() {
        eprintln!("skipped: mounting a small tmpfs needs root");
        return;
    }
    let disk = Mounted::tmpfs(&std::env::temp_dir().join(format!("shoal-fault-disk-{}", std::process::id())), "24k");
    let c = Cluster::start_with_writer(
        "disk-full",
        12,
        "wall_timeout_ms = 1500",
        &format!("out_dir = \"{}\"\ncheckpoint_s = 1.0", disk.0.display()),
    );
    let (record, dir) = c.finish();
    assert_accounted(&record);
    let writer = record["reports"].as_array().unwrap().iter().find(|r| r["name"] == "writer").expect("writer report");
    let error = writer["error"].as_str().unwrap_or_default();
    assert!(error.contains("No space left on device"), "{writer}");
    let lost = record["events_lost_with_writer"].as_array().unwrap();
    assert_eq!(lost.len(), 1, "{}", record["events_lost_with_writer"]);
    assert_eq!(lost[0]["reason"], "disk_failed", "{lost:?}");
    let (from, to) = (lost[0]["from_slice"].as_u64().unwrap(), lost[0]["to_slice"].as_u64().unwrap());
    assert_eq!(to, record["end_slice"].as_u64().unwrap(), "not stored to the run's end: {lost:?}");
    // The files closed before the disk filled are whole and before the window.
    let closed = writer["detail"]["files"].as_array().cloned().unwrap_or_default();
    assert!(!closed.is_empty(), "some files closed before the disk filled: {writer}");
    for f in &closed {
        let bytes = std::fs::read(f["path"].as_str().unwrap()).unwrap();
        assert!(bytes.ends_with(b"PAR1"), "{f}");
        assert!(f["last_slice"].as_u64().unwrap() < from, "{f} in the lost window {from}..{to}");
    }
    let causes = assert_causes(&record, &[("storage_failing", "writer")]);
    let by_disk = losses_put_down_to(&record, "storage_failing");
    assert_eq!(by_disk["not_stored"].as_u64(), Some(to - from), "{by_disk}");
    assert!(timeline(&record).contains(&("storage_failing".into(), "writer".into())), "{}", record["diagnosis"]);
    let stored = writer["detail"]["file"]["events"].as_u64().unwrap();
    let not_stored = writer["detail"]["events_not_stored"].as_u64().unwrap();
    println!(
        "fault writer's disk full: {} files closed whole ({stored} events), slices {from}..{to} not stored \
         ({not_stored} events); diagnosis {causes:?}",
        closed.len()
    );
    drop(disk);
    no_process_left(&dir);
}

/// Sources in bioluminescence bursts most of the time with the burst rate cutoff on (the
/// first and last 2 slices of a burst sent, the middle emptied): the slices stay complete,
/// nothing is lost, and the diagnosis names the sources that cut data off.
#[test]
fn a_burst_over_the_cutoff_is_named_though_no_slice_is_lost() {
    let c = Cluster::start_full(
        "cutoff",
        10,
        "",
        "generator = \"bursts\"\ncutoff = true\ncutoff_head = 2\ncutoff_tail = 2\n\
         [config.source.bursts]\nfraction = 0.9\nmax_s = 3.0\nbase_bytes = 2000\nburst_bytes = 20000",
        "wall_timeout_ms = 1500",
        "",
    );
    let (record, dir) = c.finish();
    assert_accounted(&record);
    let cut = record["ledger"]["buckets"]["cut_off"].as_u64().unwrap_or(0);
    assert!(cut > 0, "bursts 90 % of the time, up to 3 s each, were cut: {}", record["ledger"]);
    let named: Vec<String> =
        timeline(&record).into_iter().filter(|(rule, _)| rule == "source_cut_off").map(|(_, p)| p).collect();
    assert!(!named.is_empty() && named.iter().all(|p| p.starts_with("source")), "{}", record["diagnosis"]);
    // The markers complete the slices: nothing for the cutoff to explain.
    let causes = assert_causes(&record, &[]);
    println!("fault bursts over the cutoff: {cut} fragments cut off, named on {named:?}; lost slices {causes:?}");
    no_process_left(&dir);
}

/// Sources that send later than the builders wait: `delayed:1` holds source 1 back one
/// 100-ms slice and source 2 two, and the builders' wall-clock guard is 50 ms, so every
/// slice is processed without them and their fragments come after it. Nothing is lost on
/// the way: the diagnosis puts the slices down to the sources being late, not to the
/// builders that discarded their fragments as late.
#[test]
fn sources_behind_the_builders_guard_are_named_late() {
    let c = Cluster::start_policy("late", 6, "delayed:1", ["", "", "wall_timeout_ms = 50", ""], &[]);
    let (record, dir) = c.finish();
    assert_accounted(&record);
    let b = &record["ledger"]["buckets"];
    let late = b["late"].as_u64().unwrap_or(0) + b["salvaged"].as_u64().unwrap_or(0);
    assert!(late > 0, "the delayed sources' fragments came after their slices: {b}");
    assert!(record["slices_incomplete"].as_u64().unwrap() > 0, "{}", record["slices_incomplete"]);
    let causes = assert_causes_allowing(
        &record,
        &[("sources_late", "source1,source2")],
        &[("sources_late", "source1"), ("sources_late", "source2")],
    );
    let losses = losses_put_down_to(&record, "sources_late");
    println!("fault sources behind the guard: {late} fragments after their slices; diagnosis {causes:?} {losses}");
    no_process_left(&dir);
}

/// A source process started by hand with the wrong `--ids` (source2 given source 1,
/// already source1's): source 1 comes twice and source 2 never. Run control sees two
/// processes hosting one source; the diagnosis names the mismatch and puts the slices
/// lacking source 2 down to it.
#[test]
fn a_source_started_with_another_ones_ids_is_a_configuration_mismatch() {
    let c = Cluster::start_external("mismatch", 8, ["", "", "wall_timeout_ms = 1500", ""], &[("source2", "1")]);
    let (record, dir) = c.finish();
    assert_accounted(&record);
    let timeline = timeline(&record);
    for p in ["source1", "source2"] {
        assert!(timeline.contains(&("config_mismatch".into(), p.into())), "{}", record["diagnosis"]);
    }
    assert!(record["slices_incomplete"].as_u64().unwrap() > 0, "source 2 was never sent");
    // Source 2's slices are the mismatch's on source2; a slice that also lacked source 1
    // (a fragment late on a busy machine) is put on source1, the other side of it.
    let causes = assert_causes_allowing(&record, &[("config_mismatch", "source2")], &[("config_mismatch", "source1")]);
    let detail = &record["diagnosis"]["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["rule"] == "config_mismatch")
        .unwrap()["detail"];
    println!("fault source started with another's ids: {detail}; diagnosis {causes:?}");
    no_process_left(&dir);
}

/// A filter 2x too slow for the load (each builder gets a slice every 200 ms, its filter
/// takes 400 ms) for 20 s: the filter queue is bounded by the builder's memory, what does
/// not fit is dropped and counted, the run ends with every fragment accounted.
#[test]
fn a_filter_too_slow_for_the_load_costs_counted_fragments_not_memory() {
    let c = Cluster::start_with(
        "slow-filter",
        20,
        "wall_timeout_ms = 1500\nfault_filter_ms_per_slice = 400\nmemory_budget_mb = 4",
    );
    let (record, dir) = c.finish();
    assert_accounted(&record);
    let b = &record["ledger"]["buckets"];
    let dropped = b["dropped_overload"].as_u64().unwrap();
    assert!(dropped > 0, "the queue must overflow the builders' memory: {b}");
    assert!(record["departures"].as_array().unwrap().is_empty(), "{}", record["departures"]);
    let builders: Vec<_> = record["reports"].as_array().unwrap().iter().filter(|r| r["role"] == "builder").collect();
    assert_eq!(builders.len(), 2, "both builders reported");
    let not_filtered: u64 = builders.iter().map(|b| b["detail"]["slices_not_filtered"].as_u64().unwrap()).sum();
    let causes = assert_causes(&record, &[("filter_behind", "builder0"), ("filter_behind", "builder1")]);
    println!("diagnosis: {causes:?}");
    println!(
        "fault slow filter (400 ms per 200-ms slice, 4 MiB per builder): {} complete, {} incomplete; \
         dropped_overload {}; slices not filtered {}; ledger {}",
        record["slices_complete"], record["slices_incomplete"], dropped, not_filtered, record["ledger"]
    );
    no_process_left(&dir);
}

/// The dispatcher killed mid-run: the data path does not go through it and keeps going;
/// run control starts it again, every client reconnects, and the run, stopped right
/// away, is recorded normally.
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
    // Stop the run at once (Ctrl-C), while the processes and run control's listener may
    // still be reconnecting: a command or answer published meanwhile is lost, and comes
    // again (a reconnected process announces its state; run control asks again).
    assert!(Command::new("kill").args(["-INT", &c.child.id().to_string()]).status().unwrap().success());
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
    // The outage is in the timeline; it cost no slice (the data path does not use it).
    assert!(timeline(&record).contains(&("process_down".into(), "dispatcher".into())), "{}", record["diagnosis"]);
    assert_causes(&record, &[]);
    let log = std::fs::read_to_string(dir.join("run-control.log")).unwrap_or_default();
    let again = log.lines().filter(|l| l.contains("sent again")).count();
    println!(
        "fault dispatcher SIGKILL: listening again {:.2} s after the kill; run stopped at once and recorded with \
         every report ({again} commands sent again for lost answers); ledger {}",
        listening.saturating_sub(killed) as f64 * 1e-9,
        record["ledger"]
    );
    no_process_left(&dir);
}

/// Under credit-based pull (`pull:4`, a data-flow manager) a builder killed mid-run is
/// routed around: the manager stops assigning to it the moment its connection closes and
/// gives what it held to the other builder; its restarted self greets the manager once
/// the sources have connected to it again and takes slices with fresh credits. What it
/// cost (at most what it held) is put down to its death; it built again after.
#[test]
fn pull_a_builder_killed_mid_run_costs_at_most_what_it_held() {
    let c = Cluster::start_policy("pull-kill-builder", 12, "pull:4", ["", "", "", ""], &[]);
    std::thread::sleep(Duration::from_secs(3));
    c.kill_and_await_restart("builder1");
    let (record, dir) = c.finish();
    assert_accounted(&record);
    let dfm = pull_manager(&record);
    assert!(dfm["builders_left"].as_u64().unwrap() >= 1, "{dfm}");
    let b1 = record["reports"].as_array().unwrap().iter().find(|r| r["name"] == "builder1").unwrap();
    assert!(b1["slices_complete"].as_u64().unwrap() > 0, "the restarted builder1 built again: {b1}");
    let causes = assert_causes_allowing(&record, &[], &[("process_down", "builder1")]);
    let lost: u64 = causes.iter().map(|c| c.2).sum();
    // What it held: its credits (4), plus the slices whose fragments it had been handed.
    assert!(lost <= 8, "a builder killed under pull costs what it held, not its share of the outage: {causes:?}");
    println!("fault pull builder SIGKILL: {lost} slices lost {causes:?}; manager {dfm}");
    no_process_left(&dir);
}

/// Under pull, a builder stopped for 4 s (SIGSTOP) is taken for gone after the manager's
/// silence timeout, its slices go to the other builder, and it rejoins with fresh credits
/// when it runs again. Its slices lost are put on its stall, not on the sources.
#[test]
fn pull_a_builder_stopped_for_4_s_is_routed_around_and_rejoins() {
    let c = Cluster::start_policy("pull-stop-builder", 14, "pull:4", ["", "", "", ""], &[]);
    std::thread::sleep(Duration::from_secs(3));
    c.signal("builder0", "STOP");
    std::thread::sleep(Duration::from_secs(4));
    c.signal("builder0", "CONT");
    let (record, dir) = c.finish();
    assert_accounted(&record);
    let dfm = pull_manager(&record);
    assert!(dfm["builders_left"].as_u64().unwrap() >= 1 && dfm["builders_rejoined"].as_u64().unwrap() >= 1, "{dfm}");
    let b0 = record["reports"].as_array().unwrap().iter().find(|r| r["name"] == "builder0").unwrap();
    assert!(b0["detail"]["pull"]["assignments"].as_u64().unwrap() > 0, "{b0}");
    assert!(timeline(&record).contains(&("process_hung".into(), "builder0".into())), "{}", record["diagnosis"]);
    let causes = assert_causes_allowing(&record, &[], &[("process_hung", "builder0")]);
    assert!(causes.iter().all(|c| c.0 != "sources_late"), "the sources were on time: {causes:?}");
    println!("fault pull builder SIGSTOP 4 s: lost {causes:?}; manager {dfm}");
    no_process_left(&dir);
}

/// Under pull, the data-flow manager killed mid-run is started again and rebuilds its
/// state from the builders' hellos; stopped for 2 s, it does not take its builders for
/// gone when it runs again (their heartbeats wait unread). What either costs is the
/// manager's.
#[test]
fn pull_the_data_flow_manager_killed_or_stopped_mid_run_is_named_for_what_it_cost() {
    for fault in ["KILL", "STOP"] {
        let c = Cluster::start_policy(&format!("pull-dfm-{fault}"), 12, "pull:4", ["", "", "", ""], &[]);
        std::thread::sleep(Duration::from_secs(3));
        let expected = if fault == "KILL" {
            c.kill_and_await_restart("dfm");
            "process_down"
        } else {
            c.signal("dfm", "STOP");
            std::thread::sleep(Duration::from_secs(2));
            c.signal("dfm", "CONT");
            "process_hung"
        };
        let (record, dir) = c.finish();
        assert_accounted(&record);
        assert!(timeline(&record).contains(&(expected.into(), "dfm".into())), "{}", record["diagnosis"]);
        let causes = assert_causes_allowing(&record, &[], &[(expected, "dfm")]);
        let dfm = pull_manager(&record);
        if fault == "STOP" {
            assert_eq!(dfm["builders_left"], 0, "its own stall is not its builders' silence: {dfm}");
        }
        println!("fault pull dfm SIG{fault}: lost {causes:?}; manager {dfm}");
        no_process_left(&dir);
    }
}

/// The data-flow manager's report in a pull run's record.
fn pull_manager(record: &serde_json::Value) -> serde_json::Value {
    let reports = record["reports"].as_array().unwrap();
    reports.iter().find(|r| r["role"] == "dfm").expect("the manager's report")["detail"].clone()
}
