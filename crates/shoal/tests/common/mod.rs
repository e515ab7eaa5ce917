//! Helpers shared by the `shoal run` integration tests: a cluster of a writer, 2 builders
//! and 3 single-source processes on loopback, started, watched and ended like a user would.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

/// A loopback port nothing listens on, for a process the test starts to bind. Chosen
/// outside the kernel's ephemeral range: a port from that range (what binding port 0
/// gives) can be taken by any outgoing connection between the choice and the process's
/// bind, and on a busy machine one was ("binding builder port ...: Address already in
/// use"). Candidates are drawn at random so that tests running at once rarely try the same.
/// A small tmpfs mounted for a test (root only), unmounted and removed when dropped.
pub struct Mounted(pub PathBuf);

impl Mounted {
    pub fn tmpfs(dir: &Path, size: &str) -> Mounted {
        std::fs::create_dir_all(dir).unwrap();
        let ok = Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"]).arg(dir).status();
        assert!(ok.unwrap().success(), "mount failed");
        Mounted(dir.to_path_buf())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// The whole number written right after the first `prefix` in `text` (up to the next
/// space), as a message states it: "at most 4096 sources", "In 12 of them".
pub fn number_after(text: &str, prefix: &str) -> Option<u64> {
    text.split(prefix).nth(1)?.split(' ').next()?.parse().ok()
}

pub fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// A port for a process a test starts, outside the kernel's ephemeral range (so no
/// outgoing connection takes it), free now (TCP and UDP), and never handed out before in
/// this test binary. The last matters: the tests of a binary run at once, each cluster
/// takes five ports, and two tests drawing the same random port raced for it (a builder
/// refused to start with "Address already in use", seen once on a clean clone).
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let mut r = range.split_whitespace().filter_map(|v| v.parse::<u32>().ok());
    let (lo, hi) = (r.next().unwrap_or(32768), r.next().unwrap_or(60999));
    // Below the range if there is room there, above it otherwise.
    let (first, last) = if lo > 11_000 { (10_000, lo - 1) } else { (hi + 1, 65_535) };
    assert!(first < last, "no ports outside the ephemeral range {lo}-{hi}");
    for _ in 0..10_000 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64);
        let port = (first + (h.finish() % u64::from(last - first + 1)) as u32) as u16;
        let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
        if !handed_out.contains(&port)
            && TcpListener::bind(("127.0.0.1", port)).is_ok()
            && std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok()
        {
            handed_out.insert(port);
            return port;
        }
    }
    panic!("no free port in {first}-{last}")
}

pub fn unix_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64
}

pub fn http_get(addr: &str, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.split_once("\r\n\r\n").map(|(_, body)| body.to_string())
}

pub fn status(ui: &str) -> Option<serde_json::Value> {
    http_get(ui, "/api/status").and_then(|b| serde_json::from_str(&b).ok())
}

/// The address `shoal run` (its stdout piped) prints for its UI, when it prints it.
pub fn ui_address(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    let stdout = child.stdout.take().expect("shoal run's stdout piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("run control UI: http://") {
                let _ = tx.send(rest.trim_end_matches('/').to_string());
            }
        }
    });
    rx
}

/// A `shoal run` of 2 builders and 3 single-source processes, killed as a group if the
/// test fails half-way.
pub struct Cluster {
    pub child: std::process::Child,
    pub dir: PathBuf,
    pub ui: String,
    pub dispatcher: String,
    /// Source processes the test started itself (`launch = "external"`).
    pub external: Vec<std::process::Child>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill").args(["-KILL", &format!("-{}", self.child.id())]).status();
            let _ = self.child.wait();
        }
        for e in &mut self.external {
            let _ = e.kill();
            let _ = e.wait();
        }
        // Processes restarted by run control are in their own groups: the OFF at the
        // end (or their parent watch) ends them. The directory goes with a passed test
        // (`no_process_left`); a failed one leaves it to look at.
    }
}

impl Cluster {
    /// A run of `seconds` with the builders' default timeouts for these tests.
    pub fn start(name: &str, seconds: u32) -> Cluster {
        Self::start_with(name, seconds, "wall_timeout_ms = 1500")
    }

    /// `builder` is added to the run configuration's `[builder]` table.
    pub fn start_with(name: &str, seconds: u32, builder: &str) -> Cluster {
        Self::start_with_writer(name, seconds, builder, "")
    }

    /// ... and `writer` to its `[writer]` table.
    pub fn start_with_writer(name: &str, seconds: u32, builder: &str, writer: &str) -> Cluster {
        Self::start_full(name, seconds, "", "", builder, writer)
    }

    /// ... and `cluster` to the `[cluster]` table.
    pub fn start_full(name: &str, seconds: u32, cluster: &str, source: &str, builder: &str, writer: &str) -> Cluster {
        Self::start_external(name, seconds, [cluster, source, builder, writer], &[])
    }

    /// ... with the source processes `external` names (name, the `--ids` it is started
    /// with) started by the test as someone else would (`launch = "external"`), whatever
    /// ids the cluster file gives them.
    pub fn start_external(name: &str, seconds: u32, tables: [&str; 4], external: &[(&str, &str)]) -> Cluster {
        Self::start_policy(name, seconds, "direct", tables, external)
    }

    /// ... with the sources' shaping `policy` (`direct` in the others).
    pub fn start_policy(
        name: &str,
        seconds: u32,
        policy: &str,
        tables: [&str; 4],
        external: &[(&str, &str)],
    ) -> Cluster {
        Self::start_placed(name, seconds, policy, tables, external, &|_| String::new())
    }

    /// ... with `placed(process)`'s lines added to each process's table (its launch kind
    /// and host).
    pub fn start_placed(
        name: &str,
        seconds: u32,
        policy: &str,
        tables: [&str; 4],
        external: &[(&str, &str)],
        placed: &dyn Fn(&str) -> String,
    ) -> Cluster {
        Self::start_run(name, seconds, &format!("policy = \"{policy}\"\n"), tables, external, placed)
    }

    /// ... with `run`'s lines (the policy among them, `policy = "..."`) in the run
    /// configuration's `[run]` table.
    pub fn start_run(
        name: &str,
        seconds: u32,
        run: &str,
        tables: [&str; 4],
        external: &[(&str, &str)],
        placed: &dyn Fn(&str) -> String,
    ) -> Cluster {
        Self::start_run_on("127.0.0.1", name, seconds, run, tables, external, placed)
    }

    /// ... with the dispatcher on `dispatcher_ip` (an address of this host's).
    pub fn start_run_on(
        dispatcher_ip: &str,
        name: &str,
        seconds: u32,
        run: &str,
        tables: [&str; 4],
        external: &[(&str, &str)],
        placed: &dyn Fn(&str) -> String,
    ) -> Cluster {
        let [cluster, source, builder, writer] = tables;
        let dir = std::env::temp_dir().join(format!("shoal-fault-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (sources, builders) = (3u32, 2u32);
        let dispatcher = format!("{dispatcher_ip}:{}", free_port());
        let mut text = format!(
            "[cluster]\nname = \"{name}\"\ndispatcher = \"{dispatcher}\"\ndispatcher_http = \"off\"\nstate_dir = \"{}\"\n\
             reply_timeout_ms = 10000\nstats_interval_ms = 500\n{cluster}\n\n[[process]]\nname = \"writer\"\nrole = \"writer\"\n{}",
            dir.join("state").display(),
            placed("writer")
        );
        // Pull: the data-flow manager, started before the builders.
        let pull = run.contains("policy = \"pull");
        if pull {
            text += &format!("[[process]]\nname = \"dfm\"\nrole = \"dfm\"\n{}", placed("dfm"));
        }
        for b in 0..builders {
            text += &format!(
                "[[process]]\nname = \"builder{b}\"\nrole = \"builder\"\nids = [{b}]\n{}",
                placed(&format!("builder{b}"))
            );
        }
        for s in 0..sources {
            text += &format!(
                "[[process]]\nname = \"source{s}\"\nrole = \"source\"\nids = [{s}]\n{}",
                placed(&format!("source{s}"))
            );
            if external.iter().any(|(n, _)| *n == format!("source{s}")) {
                text += "launch = \"external\"\n";
            }
        }
        let addrs: Vec<String> = (0..builders).map(|_| format!("\"127.0.0.1:{}\"", free_port())).collect();
        text += &format!(
            "[config.run]\nsources = {sources}\nbuilders = {builders}\nslice_ms = 100\n{run}\
             builder_addrs = [{}]\nwriter_addr = \"127.0.0.1:{}\"\n{}\
             [config.source]\ndrain_timeout_ms = 2000\nreconnect_max_ms = 500\n{source}\n[config.source.noise]\nrate_hz = 20000.0\n\
             [config.builder]\ndrain_timeout_ms = 4000\n{builder}\n\
             [config.writer]\n{}{writer}\n",
            addrs.join(", "),
            free_port(),
            if pull { format!("dfm_addr = \"127.0.0.1:{}\"\n", free_port()) } else { String::new() },
            // The test's own output directory, or the cluster's.
            if writer.contains("out_dir") {
                String::new()
            } else {
                format!("out_dir = \"{}\"\n", dir.join("data").display())
            }
        );
        let file = dir.join("cluster.toml");
        std::fs::write(&file, &text).unwrap();
        let mut child = shoal()
            .args(["run", file.to_str().unwrap(), "--seconds", &seconds.to_string(), "--http", "127.0.0.1:0"])
            .current_dir(&dir)
            .stdout(Stdio::piped())
            // Run control's own log, beside the processes' (a failed test leaves them).
            .stderr(std::fs::File::create(dir.join("run-control.log")).unwrap())
            .process_group(0)
            .spawn()
            .unwrap();
        let rx = ui_address(&mut child);
        // Started as soon as the dispatcher listens: run control waits 10 s for them to
        // announce themselves.
        if !external.is_empty() {
            let waiting = Instant::now();
            while TcpStream::connect(&dispatcher).is_err() {
                assert!(waiting.elapsed() < Duration::from_secs(120), "the dispatcher never listened");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let external: Vec<std::process::Child> = external
            .iter()
            .map(|(name, ids)| {
                shoal()
                    .args([
                        "node",
                        "--role",
                        "source",
                        "--name",
                        name,
                        "--dispatcher",
                        &dispatcher,
                        "--stats-ms",
                        "500",
                    ])
                    .args(["--metrics", "127.0.0.1:0", "--ids", ids])
                    .stdout(Stdio::null())
                    .stderr(std::fs::File::create(dir.join(format!("{name}.external.log"))).unwrap())
                    .process_group(0)
                    .spawn()
                    .unwrap()
            })
            .collect();
        let ui = rx.recv_timeout(Duration::from_secs(120)).expect("shoal run printed its UI address");
        let c = Cluster { child, dir, ui, dispatcher, external };
        c.wait_for("the cluster RUNNING", |s| s["state"] == "RUNNING");
        c
    }

    pub fn wait_for(&self, what: &str, ok: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
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

    pub fn pid(&self, name: &str) -> u32 {
        let s = status(&self.ui).unwrap();
        let p = s["processes"].as_array().unwrap().iter().find(|p| p["name"] == name).unwrap();
        p["pid"].as_u64().unwrap_or_else(|| panic!("no pid for {name}: {p}")) as u32
    }

    pub fn process<'a>(s: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
        s["processes"].as_array().unwrap().iter().find(|p| p["name"] == name).unwrap()
    }

    /// Sends `signal` to the process `name`; returns its pid and when (UNIX ns).
    pub fn signal(&self, name: &str, signal: &str) -> (u32, u64) {
        let pid = self.pid(name);
        let at = unix_ns();
        assert!(Command::new("kill").args([&format!("-{signal}"), &pid.to_string()]).status().unwrap().success());
        (pid, at)
    }

    /// SIGKILL to `name`, then waits until run control has started it again; returns when
    /// it was killed (UNIX ns).
    pub fn kill_and_await_restart(&self, name: &str) -> u64 {
        let (old, killed) = self.signal(name, "KILL");
        self.wait_for(&format!("{name} started again"), |s| {
            Cluster::process(s, name)["pid"].as_u64().is_some_and(|pid| pid as u32 != old)
        });
        killed
    }

    /// Waits for `shoal run` to end by itself; returns the run record.
    pub fn finish(mut self) -> (serde_json::Value, PathBuf) {
        let waiting = Instant::now();
        let st = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st;
            }
            assert!(waiting.elapsed() < Duration::from_secs(240), "shoal run did not end");
            std::thread::sleep(Duration::from_millis(200));
        };
        assert!(st.success(), "shoal run exited {st}");
        // Run control's OFF ends them too; a process that did not leave is ended here.
        for mut e in self.external.drain(..) {
            let waiting = Instant::now();
            while e.try_wait().unwrap().is_none() && waiting.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = e.kill();
            let _ = e.wait();
        }
        let path = self.dir.join("state").join("runs").join("run000001.json");
        let record: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        // For the docs' examples: keep the record where asked (`SHOAL_KEEP_RECORDS=DIR`).
        if let Some(keep) = std::env::var_os("SHOAL_KEEP_RECORDS") {
            let name = self.dir.file_name().unwrap().to_string_lossy().to_string();
            let _ = std::fs::create_dir_all(&keep);
            let _ = std::fs::copy(&path, std::path::Path::new(&keep).join(format!("{name}.json")));
        }
        (record, self.dir.clone())
    }
}

/// Every fragment in a bucket, nothing unaccounted, nothing received beyond what was sent.
pub fn assert_accounted(record: &serde_json::Value) {
    let l = &record["ledger"];
    assert_eq!(l["balanced"], true, "{l}");
    assert_eq!(l["unaccounted"], 0, "{l}");
    assert_eq!(l["excess_received"], 0, "{l}");
}

/// How the slices the diagnosis put down to `rule` were lost (`incomplete`, `events_lost`,
/// ... with counts): its first group of causes.
pub fn losses_put_down_to<'a>(record: &'a serde_json::Value, rule: &str) -> &'a serde_json::Value {
    let causes = record["diagnosis"]["slices"]["causes"].as_array().expect("the record's diagnosis");
    &causes.iter().find(|c| c["rule"] == rule).unwrap_or_else(|| panic!("no slice put down to {rule}: {causes:?}"))["losses"]
}

/// Nothing of the cluster runs any more (every process was launched with this directory's
/// cluster file); the directory goes.
pub fn no_process_left(dir: &Path) {
    let file = dir.join("cluster.toml");
    let out = Command::new("pgrep").args(["-f", file.to_str().unwrap()]).output().unwrap();
    assert!(out.stdout.is_empty(), "processes left: {}", String::from_utf8_lossy(&out.stdout));
    std::fs::remove_dir_all(dir).unwrap();
}

/// Causes a loaded machine adds to any run (late fragments, a filter starved of CPU, a
/// source behind, a process starved so long its statistics stop for 3 s): named, so allowed beside the injected fault's, never instead of it.
pub const LOAD_CAUSES: [&str; 5] =
    ["builder_discarding", "source_dropping", "filter_behind", "process_hung", "sources_late"];

/// The run record's diagnosis names the `expected` causes (rule, process) for the slices it
/// lost, each at least once, any other only from [`LOAD_CAUSES`], and leaves none
/// unexplained. Returns the causes.
pub fn assert_causes(record: &serde_json::Value, expected: &[(&str, &str)]) -> Vec<(String, String, u64)> {
    assert_causes_allowing(record, expected, &[])
}

/// [`assert_causes`], with `allowed` causes that may claim slices beside them but need not.
pub fn assert_causes_allowing(
    record: &serde_json::Value,
    expected: &[(&str, &str)],
    allowed: &[(&str, &str)],
) -> Vec<(String, String, u64)> {
    let d = &record["diagnosis"]["slices"];
    let causes: Vec<(String, String, u64)> = d["causes"]
        .as_array()
        .unwrap_or_else(|| panic!("no diagnosis in the record: {}", record["diagnosis"]))
        .iter()
        .map(|c| {
            let names: Vec<&str> = c["processes"].as_array().unwrap().iter().filter_map(|p| p.as_str()).collect();
            (c["rule"].as_str().unwrap().to_string(), names.join(","), c["slices"].as_u64().unwrap())
        })
        .collect();
    let shown = || format!("causes {causes:?}; timeline {}", record["diagnosis"]["timeline"]);
    assert_eq!(d["unexplained"], 0, "every lost slice explained: {}", shown());
    for (rule, process, _) in &causes {
        let fault = expected.iter().chain(allowed).any(|(r, p)| r == rule && p == process);
        assert!(fault || LOAD_CAUSES.contains(&rule.as_str()), "unexpected cause {rule} on {process}: {}", shown());
    }
    for (rule, process) in expected {
        assert!(causes.iter().any(|(r, p, _)| r == rule && p == process), "{rule} on {process} not named: {}", shown());
    }
    causes
}

/// The problems seen during the run, as (rule, process).
pub fn timeline(record: &serde_json::Value) -> Vec<(String, String)> {
    record["diagnosis"]["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["rule"].as_str().unwrap().to_string(), e["process"].as_str().unwrap().to_string()))
        .collect()
}
