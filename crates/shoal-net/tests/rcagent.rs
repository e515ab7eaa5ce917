//! The run-control agent follows commands through a real dispatcher and answers with its
//! state; commands for other processes are ignored; refused commands are answered as errors.

use std::time::Duration;

use shoal_core::controlhost::Mode;
use shoal_core::runstate::{Command, RunState};
use shoal_dispatcher::client::ChClient;
use shoal_dispatcher::server::{DispatcherConfig, spawn_dispatcher};
use shoal_net::clock::WallClock;
use shoal_net::rcagent::{RC_CMD, RC_REPLY, RcAgent};
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
