//! The control plane's attack matrix (docs/security.md): a cluster secured as the docs set
//! it up (a CA, `data = "authenticated"`) runs while a stranger with no credential and an
//! insider with a real certificate of the cluster (source1's) try what got through before
//! messages had authors: a forged end-of-run report, a forged departure, a clock moved,
//! forged statistics with a pid, a STOP, a subscription to the commands. Each is refused
//! at the dispatcher and audited with who tried, and the run beside them keeps every slice
//! with its ledger balanced and exit status 0.

mod common;

use std::time::{Duration, Instant};

use common::*;
use shoal_dispatcher::client::{ChClient, ControlTls};

/// A builder's end-of-run report, forged: a million slices complete.
fn forged_report(name: &str) -> Vec<u8> {
    format!(
        r#"{{"name":"{name}","role":"builder","run":1,"source_tallies":{{}},"builder":[0,{{}}],"slices_complete":1000000}}"#
    )
    .into_bytes()
}

/// The audit's refusals at the dispatcher: (identity or "plain", reason, what), one per event.
fn dispatcher_refusals(state: &std::path::Path) -> Vec<(String, String, String)> {
    let Ok((events, _)) = shoal_dispatcher::audit::read(&state.join("audit.jsonl")) else { return Vec::new() };
    events
        .iter()
        .filter(|e| e.kind == "dispatcher" && e.outcome == "refused")
        .flat_map(|e| {
            let who = if e.identity.is_empty() { "plain".to_string() } else { e.identity.clone() };
            let tag = e.what.split_whitespace().next().unwrap_or_default().to_string();
            let tag = if e.reason == "subscribe" { e.what.clone() } else { tag };
            std::iter::repeat_n((who, e.reason.clone(), tag), e.events() as usize)
        })
        .collect()
}

#[test]
fn strangers_and_insiders_on_the_control_plane_are_refused_and_the_run_keeps_every_slice() {
    let ca = tempfile::tempdir().unwrap();
    let ca_dir = ca.path().join("ca");
    assert!(shoal().args(["ca", "init"]).arg(&ca_dir).args(["--cluster", "cp"]).status().unwrap().success());
    let security =
        format!("[cluster.security]\nca_dir = {:?}\ndata = \"authenticated\"\n", ca_dir.display().to_string());
    let cluster = Cluster::start_full("control-plane", 5, &security, "", "wall_timeout_ms = 1500", "");
    let state = cluster.dir.join("state");
    let addr: std::net::SocketAddr = cluster.dispatcher.parse().unwrap();
    let source1 = shoal_tls::Identity::load(&shoal_tls::Credentials::in_dir(&state.join("credentials"), "source1"))
        .expect("run control issued source1 its certificate");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // A stranger on the plain port, from this very host (loopback commands nothing on a
        // secured cluster).
        let mut stranger = ChClient::connect(addr).await.unwrap();
        stranger.publish("RC_END", &forged_report("builder0")).await.unwrap();
        stranger.publish("RC_TIME", b"source0 ADJUST 300000000").await.unwrap();
        stranger.publish("RC_STATS", br#"{"name":"builder0","pid":1}"#).await.unwrap();
        stranger.publish("RC_CMD", b"* STOP").await.unwrap();
        stranger.subscribe("RC_CMD", shoal_core::controlhost::Mode::All).await.unwrap();
        // A forged departure: a plain client naming itself builder1, gone.
        let mut leaver = ChClient::connect(addr).await.unwrap();
        leaver.set_nickname("builder1").await.unwrap();
        drop(leaver);
        // An insider: source1's own certificate, speaking for others.
        let tls = ControlTls::new(&source1).unwrap();
        let mut insider = ChClient::connect_with(addr, Some(tls)).await.unwrap();
        insider.publish("RC_END", &forged_report("builder0")).await.unwrap();
        insider.publish("RC_REPLY", b"builder0 IDLE ok").await.unwrap();
        insider.publish("RC_CMD", b"* STOP").await.unwrap();
        insider.publish("RC_TIME", b"source0 ADJUST 300000000").await.unwrap();
        // A data tag of its own is anyone's to publish.
        insider.publish("MY_DATA", b"anything").await.unwrap();
    });
    let expected: Vec<(&str, &str, &str)> = vec![
        ("plain", "plain", "RC_END"),
        ("plain", "plain", "RC_TIME"),
        ("plain", "plain", "RC_STATS"),
        ("plain", "plain", "RC_CMD"),
        ("plain", "subscribe", "subscribe RC_CMD"),
        ("source1", "subject", "RC_END"),
        ("source1", "subject", "RC_REPLY"),
        ("source1", "role", "RC_CMD"),
        ("source1", "role", "RC_TIME"),
    ];
    // Audited as the dispatcher takes them (a burst's gathered lines within a second).
    let waiting = Instant::now();
    let mut seen = dispatcher_refusals(&state);
    while seen.len() < expected.len() && waiting.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(100));
        seen = dispatcher_refusals(&state);
    }
    seen.sort();
    let mut want: Vec<(String, String, String)> =
        expected.iter().map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string())).collect();
    want.sort();
    assert_eq!(seen, want, "the dispatcher's refusals, audited");
    let (record, dir) = cluster.finish();
    // The forged departure left builder1 as it was; every process reported.
    assert_eq!(record["departures"], serde_json::json!([]), "{}", record["departures"]);
    assert_eq!(record["missing_reports"], serde_json::json!([]), "{}", record["missing_reports"]);
    assert_accounted(&record);
    assert_eq!(record["slices_incomplete"], 0, "{}", record["slices_incomplete"]);
    let complete = record["slices_complete"].as_u64().unwrap();
    assert!(complete > 0 && complete < 1_000_000, "the forged report is not in the record: {complete}");
    no_process_left(&dir);
}

/// A network namespace with a veth pair to this host: the stranger's own network.
struct StrangerNet {
    netns: String,
    host_if: String,
}

impl StrangerNet {
    /// `198.18.77.1` here, `198.18.77.2` in the namespace.
    fn up() -> StrangerNet {
        let id = std::process::id() % 100_000;
        let (netns, host_if, peer_if) = (format!("shoal-cp-{id}"), format!("cpa{id}"), format!("cpb{id}"));
        let ip = |args: &[&str]| {
            let ok = std::process::Command::new("ip").args(args).status().unwrap().success();
            assert!(ok, "ip {args:?}");
        };
        ip(&["netns", "add", &netns]);
        let net = StrangerNet { netns: netns.clone(), host_if: host_if.clone() };
        ip(&["link", "add", &host_if, "type", "veth", "peer", "name", &peer_if]);
        ip(&["link", "set", &peer_if, "netns", &netns]);
        ip(&["addr", "add", "198.18.77.1/30", "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        ip(&["-n", &netns, "addr", "add", "198.18.77.2/30", "dev", &peer_if]);
        ip(&["-n", &netns, "link", "set", &peer_if, "up"]);
        ip(&["-n", &netns, "link", "set", "lo", "up"]);
        net
    }

    /// Runs a Python program in the namespace; its exit status.
    fn python(&self, program: &str) -> bool {
        let python = std::env::var("SHOAL_PYTHON").unwrap_or_else(|_| "python3".into());
        let st = std::process::Command::new("ip").args(["netns", "exec", &self.netns, &python, "-c", program]).status();
        st.unwrap().success()
    }
}

impl Drop for StrangerNet {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip").args(["link", "del", &self.host_if]).status();
        let _ = std::process::Command::new("ip").args(["netns", "del", &self.netns]).status();
    }
}

#[test]
fn a_stranger_in_a_network_of_its_own_commands_nothing_on_a_secured_cluster() {
    if let Some(why) = shoal_testbed::netns::unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let net = StrangerNet::up();
    let ca = tempfile::tempdir().unwrap();
    let ca_dir = ca.path().join("ca");
    assert!(shoal().args(["ca", "init"]).arg(&ca_dir).args(["--cluster", "cp"]).status().unwrap().success());
    let security =
        format!("[cluster.security]\nca_dir = {:?}\ndata = \"authenticated\"\n", ca_dir.display().to_string());
    let tables = [security.as_str(), "", "wall_timeout_ms = 1500", ""];
    let cluster =
        Cluster::start_run_on("198.18.77.1", "control-plane-netns", 4, "policy = \"direct\"\n", tables, &[], &|_| {
            String::new()
        });
    let (host, port) = cluster.dispatcher.rsplit_once(':').unwrap();
    // From its own network: a STOP, a forged report, a clock moved; then it lingers to be
    // sure they were read before it goes.
    let program = format!(
        "import socket, struct, time\n\
         s = socket.create_connection(('{host}', {port}), timeout=10)\n\
         def send(tag, payload):\n    s.sendall(tag.ljust(8, b'\\0') + struct.pack('>i', len(payload)) + b'\\0' * 4 + payload)\n\
         send(b'RC_CMD', b'* STOP')\n\
         send(b'RC_END', b'{{\"name\":\"builder0\",\"role\":\"builder\",\"run\":1}}')\n\
         send(b'RC_TIME', b'source0 ADJUST 300000000')\n\
         s.shutdown(socket.SHUT_WR)\n\
         s.recv(1)\n"
    );
    assert!(net.python(&program), "the stranger's program ran");
    let state = cluster.dir.join("state");
    let waiting = Instant::now();
    let from_netns = || {
        let Ok((events, _)) = shoal_dispatcher::audit::read(&state.join("audit.jsonl")) else { return 0 };
        events
            .iter()
            .filter(|e| e.kind == "dispatcher" && e.address.starts_with("198.18.77.2:"))
            .map(|e| e.events())
            .sum()
    };
    while from_netns() < 3 && waiting.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(from_netns(), 3, "the stranger's three messages refused and audited with its address");
    let (record, dir) = cluster.finish();
    assert_accounted(&record);
    assert_eq!(record["slices_incomplete"], 0, "{}", record["slices_incomplete"]);
    assert_eq!(record["departures"], serde_json::json!([]));
    no_process_left(&dir);
    drop(net);
}
