//! The run-control agent follows commands through a real dispatcher and answers with its
//! state; commands for other processes are ignored; refused commands are answered as errors.

use std::time::Duration;

use shoal_core::controlhost::Mode;
use shoal_core::runstate::{Command, RunState};
use shoal_dispatcher::client::ChClient;
use shoal_dispatcher::server::{DispatcherConfig, spawn_dispatcher};
use shoal_net::clock::WallClock;
use shoal_net::rcagent::{RC_CMD, RC_REPLY, RC_TIME, RC_TIME_REPLY, RcAgent, TimeAnswer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

async fn next_text(c: &mut ChClient) -> String {
    let m = tokio::time::timeout(Duration::from_secs(20), c.next_message()).await.expect("a reply in time").unwrap();
    String::from_utf8(m.payload.to_vec()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_follows_commands_and_replies() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let cancel = CancellationToken::new();
    let (h, _core) = spawn_dispatcher(l, DispatcherConfig::default(), cancel.clone()).unwrap();
    let mut control = ChClient::connect(h.addr).await.unwrap();
    control.subscribe(RC_REPLY, Mode::All).await.unwrap();
    // Wait until run control's subscription is in effect (subscriptions are not acknowledged).
    for _ in 0..2000 {
        let s = h.snapshot().await.unwrap();
        if s.clients.iter().any(|c| c.status.subscription == "a RC_REPLY" && c.status.ready != 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let addr = h.addr;
    let agent = tokio::spawn(async move {
        let mut a = RcAgent::connect(addr, "builder0", WallClock::new()).await.unwrap();
        let mut applied = Vec::new();
        while a.state() != RunState::Off {
            applied.push(a.next_command().await.unwrap());
        }
        applied
    });
    assert_eq!(next_text(&mut control).await, "builder0 IDLE ok");
    // The agent subscribed before announcing itself, so commands from now on reach it.
    let script = [
        ("*", "INIT", "builder0 STANDBY ok"),
        ("builder1", "INIT", ""), // not for us: no reply
        ("builder0", "START 5", "builder0 STANDBY error START is not allowed in state STANDBY"),
        ("builder0", "CONFIGURE [run]\nsources = 5", "builder0 READY ok"),
        ("*", "START 5", "builder0 RUNNING ok"),
        ("builder0", "PAUSE", "builder0 PAUSED ok"),
        ("*", "STATUS", "builder0 PAUSED ok"), // a query: answered, nothing changes
        (
            "builder0",
            "FLY",
            "builder0 PAUSED error bad run-control command \"FLY\" (INIT, CONFIGURE <config>, START <run>, PAUSE, CONTINUE, STOP, RESET, OFF, STATUS)",
        ),
        ("builder0", "CONTINUE", "builder0 RUNNING ok"),
        ("*", "STOP", "builder0 READY ok"),
        ("*", "START 5", "builder0 READY error run number 5 is not above the last run 5 of this process"),
        ("*", "OFF", "builder0 OFF ok"),
    ];
    for (target, cmd, expected) in script {
        control.publish(RC_CMD, format!("{target} {cmd}").as_bytes()).await.unwrap();
        if !expected.is_empty() {
            assert_eq!(next_text(&mut control).await, expected, "after {target} {cmd}");
        }
    }
    let applied = agent.await.unwrap();
    let commands: Vec<&str> = applied.iter().map(|a| a.command.name()).collect();
    assert_eq!(
        commands,
        ["INIT", "START", "CONFIGURE", "START", "PAUSE", "STATUS", "CONTINUE", "STOP", "START", "OFF"]
    );
    assert_eq!(applied[3].command, Command::Start { run: 5, start_slice: None });
    assert_eq!(applied[5].result, Ok(RunState::Paused), "STATUS answers and changes nothing");
    assert!(applied[1].result.is_err() && applied[8].result.is_err());
    cancel.cancel();
}

/// A run-controlled writer process (`shoal_net::node`): a configuration it cannot use is
/// refused with the reason and changes nothing; a good one is taken; START opens its port
/// and STOP publishes its end-of-run report before answering READY; OFF ends the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_refuses_bad_configuration_and_reports_at_stop() {
    use shoal_net::node::{NodeOptions, NodeReport, Role, run_controlled};
    use shoal_net::rcagent::RC_REPORT;

    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let cancel = CancellationToken::new();
    let (h, _core) = spawn_dispatcher(l, DispatcherConfig::default(), cancel.clone()).unwrap();
    let mut control = ChClient::connect(h.addr).await.unwrap();
    control.subscribe(RC_REPLY, Mode::All).await.unwrap();
    control.subscribe(RC_REPORT, Mode::All).await.unwrap();
    for _ in 0..2000 {
        let s = h.snapshot().await.unwrap();
        if s.clients.iter().any(|c| c.status.subscription.contains("RC_END") && c.status.ready != 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let out = std::env::temp_dir().join(format!("shoal-node-test-{}", std::process::id()));
    let writer_port = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let opts = NodeOptions {
        role: Role::Writer,
        name: "writer".into(),
        dispatcher: h.addr,
        ids: vec![],
        input: None,
        metrics: None,
        stats_interval: Duration::from_secs(3600),
        clock: WallClock::new(),
        credentials: Default::default(),
        control_tls: None,
        web_config: None,
    };
    let node = tokio::spawn(run_controlled(opts, CancellationToken::new()));
    assert_eq!(next_text(&mut control).await, "writer IDLE ok");
    let good = format!(
        "[run]\nsources = 1\nbuilders = 1\nbuilder_addrs = [\"127.0.0.1:1\"]\nwriter_addr = \"{writer_port}\"\n[writer]\nout_dir = \"{}\"\n",
        out.display()
    );
    let script: Vec<(String, &str)> = vec![
        ("writer INIT".into(), "writer STANDBY ok"),
        (
            "writer CONFIGURE [run]\nsources = 0".into(),
            "writer STANDBY error configuration refused: run.sources and run.builders must be at least 1",
        ),
        ("writer CONFIGURE this is not toml".into(), "writer STANDBY error configuration refused:"),
        (format!("writer CONFIGURE {good}"), "writer READY ok"),
        ("writer START 3 100".into(), "writer RUNNING ok"),
    ];
    for (cmd, expected) in &script {
        control.publish(RC_CMD, cmd.as_bytes()).await.unwrap();
        let got = next_text(&mut control).await;
        assert!(got.starts_with(expected), "after {cmd:?}: {got:?}");
    }
    // STOP: no builder ever ends its stream, so the writer gives up after its guard time,
    // reports, then answers.
    control.publish(RC_CMD, b"writer STOP").await.unwrap();
    let report = tokio::time::timeout(Duration::from_secs(30), control.next_message()).await.unwrap().unwrap();
    assert_eq!(report.tag.to_string(), "RC_END");
    let report: NodeReport = serde_json::from_slice(&report.payload).unwrap();
    assert_eq!((report.name.as_str(), report.role.as_str(), report.run), ("writer", "writer", 3));
    assert_eq!(next_text(&mut control).await, "writer READY ok");
    assert!(out.join("run000003.events.parquet").exists());
    control.publish(RC_CMD, b"* OFF").await.unwrap();
    assert_eq!(next_text(&mut control).await, "writer OFF ok");
    tokio::time::timeout(Duration::from_secs(10), node).await.unwrap().unwrap().unwrap();
    let _ = std::fs::remove_dir_all(&out);
    cancel.cancel();
}

/// The agent's clock responder, on its own connection: a process whose clock is 7 ms ahead
/// is measured within the exchange's stated bound (half the round trip), and a correction
/// puts its clock on the prober's; a correction is refused while a run is on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clock_responder_is_measured_within_its_bound_and_corrected() {
    use shoal_core::clocksync::{TimeSample, estimate};
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let cancel = CancellationToken::new();
    let (h, _core) = spawn_dispatcher(l, DispatcherConfig::default(), cancel.clone()).unwrap();
    let mut control = ChClient::connect(h.addr).await.unwrap();
    control.subscribe(RC_TIME_REPLY, Mode::All).await.unwrap();
    control.subscribe(RC_REPLY, Mode::All).await.unwrap();
    let clock = WallClock::new();
    let offset_ns: i64 = 7_000_000;
    let mut agent = RcAgent::connect(h.addr, "source3", clock.skewed(offset_ns, 0)).await.unwrap();
    assert_eq!(next_text(&mut control).await, "source3 IDLE ok");
    // The responder subscribes on its own connection: probe until it answers (bounded).
    let mut answers = Vec::new();
    let mut seq = 0;
    while answers.len() < 8 {
        seq += 1;
        assert!(seq < 2_000, "the responder never answered");
        let t1 = clock.now().as_nanos();
        control.publish(RC_TIME, format!("* PROBE {seq}").as_bytes()).await.unwrap();
        let reply = tokio::time::timeout(Duration::from_millis(200), control.next_message()).await;
        let Ok(reply) = reply else { continue };
        let t4 = clock.now().as_nanos();
        let a = TimeAnswer::parse(std::str::from_utf8(&reply.unwrap().payload).unwrap()).unwrap();
        assert_eq!((a.name.as_str(), a.seq, a.correction_ns), ("source3", seq, 0));
        answers.push(TimeSample { t1, t2: a.t2, t3: a.t3, t4 });
    }
    let e = estimate(&answers).unwrap();
    let (lo, hi) = e.bounds();
    assert!(lo <= offset_ns && offset_ns <= hi, "7 ms outside {e:?}");

    control.publish(RC_TIME, format!("source3 ADJUST {}", e.offset_ns).as_bytes()).await.unwrap();
    let a = TimeAnswer::parse(&next_text(&mut control).await).unwrap();
    assert_eq!((a.seq, a.correction_ns), (0, e.offset_ns));
    // Read between two readings of the prober's clock: within the bound of both.
    let before = clock.now().as_nanos() as i64;
    let there = agent.clock().now().as_nanos() as i64;
    let after = clock.now().as_nanos() as i64;
    let u = e.uncertainty_ns as i64;
    assert!(before - u <= there && there <= after + u, "{before} {there} {after} +- {u}");

    // During a run the data path keeps its clock: a correction is refused.
    for cmd in ["INIT", "CONFIGURE [run]\nsources = 1", "START 1"] {
        control.publish(RC_CMD, format!("source3 {cmd}").as_bytes()).await.unwrap();
        agent.next_command().await.unwrap();
        next_text(&mut control).await;
    }
    control.publish(RC_TIME, b"source3 ADJUST 1").await.unwrap();
    let a = TimeAnswer::parse(&next_text(&mut control).await).unwrap();
    assert_eq!(a.correction_ns, e.offset_ns, "unchanged while RUNNING");
    cancel.cancel();
}
