//! shoal-control: run control for a multi-process deployment (`shoal run CLUSTER.toml`).
//!
//! The decisions (command order, start and end slices, reply deadlines, inactive
//! processes, discovery) are shoal-core's sans-IO [`shoal_core::cluster::ClusterControl`];
//! this crate is its driver and everything around it:
//! - [`cluster`]: the cluster file ([`cluster::ClusterFile`]): processes, hosts, settings;
//! - [`control`]: the [`control::Controller`] that drives `ClusterControl` over the
//!   dispatcher and writes the run records ([`control::RunRecord`]);
//! - [`diagnose`]: shoal-core's diagnosis rules fed from run control's view (every
//!   second, [`diagnose::snapshot`]) and the post-mortem of a run record
//!   ([`diagnose::diagnose_record`], `shoal diagnose`);
//! - [`clocks`]: the processes' clocks ([`clocks::ClockWatch`] over shoal-core's
//!   `clocksync`): probe rounds, corrections before START, the skew judged per policy;
//! - [`status`]: the status shared with the UI ([`status::ClusterStatus`]);
//! - [`http`]: the HTTP API, WebSocket and the web UI (compiled in from `ui/`);
//! - [`security`], [`audit`], [`credentials`]: tokens and roles, the audit log, and the
//!   certificates run control hands the processes it launches;
//! - [`slurm`]: `launch = "slurm"`, the processes as the steps of one Slurm job;
//! - [`k8s`]: `launch = "k8s"`, the processes as Pods pinned to their nodes;
//! - [`command`]: the whole of `shoal run`, given [`RunOptions`].
//!
//! `shoal run` starts a dispatcher and every process of the cluster file (each role its own OS
//! process, in its own process group so that a terminal's Ctrl-C reaches only run
//! control), waits for them to announce themselves, and then either drives one run
//! (INIT, CONFIGURE, START, wait, STOP, OFF) or, with `--interactive`, waits for commands
//! from the web UI / HTTP API. Ctrl-C stops a run in progress cleanly and switches
//! everything off. Each run leaves a record in `<state_dir>/runs/`.

pub use shoal_dispatcher::audit;
pub mod clocks;
pub mod cluster;
pub mod control;
pub mod credentials;
pub mod diagnose;
pub mod http;
pub mod k8s;
pub mod k8s_names;
pub mod security;
pub mod slurm;
pub mod status;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use shoal_dispatcher::client::ChClient;
use shoal_net::node::Role;
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use cluster::{ClusterFile, Launch, ProcessSpec};
use control::{Controller, Incoming};
use shoal_core::cluster::ClusterCommand;
use status::{ClusterStatus, ProcStatus, Rates, Shared};

/// What `shoal run` was asked to do (the command line's options, or a caller's).
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// The cluster file.
    pub cluster: PathBuf,
    /// Wait for commands from the web UI / HTTP API instead of driving one run.
    pub interactive: bool,
    /// Length of the run in seconds (default: cluster.seconds).
    pub seconds: Option<f64>,
    /// Override cluster.http (`127.0.0.1:0` for any free port, `off` for none).
    pub http: Option<String>,
    /// Override cluster.state_dir.
    pub state_dir: Option<PathBuf>,
    /// Override cluster.dispatcher.
    pub dispatcher: Option<String>,
    /// End by printing the last run's summary as JSON instead of a table.
    pub json: bool,
}

struct Launched {
    spec: ProcessSpec,
    child: Proc,
}

/// A launched process: a child of run control's (local, netns, ssh, a Slurm step's
/// `srun`) or a Pod.
enum Proc {
    Child(Child),
    Pod(k8s::PodHandle),
}

impl Proc {
    fn pid(&self) -> Option<u32> {
        match self {
            Proc::Child(c) => c.id(),
            Proc::Pod(_) => None,
        }
    }

    /// Until it ends: how, and whether that was a failure.
    async fn wait(&mut self) -> (String, bool) {
        match self {
            Proc::Child(c) => match c.wait().await {
                Ok(st) => (st.to_string(), !st.success()),
                Err(e) => (e.to_string(), true),
            },
            Proc::Pod(p) => {
                let end = p.wait().await;
                (end.how, end.failed)
            }
        }
    }

    async fn kill(&mut self) {
        match self {
            Proc::Child(c) => {
                let _ = c.start_kill();
                let _ = c.wait().await;
            }
            Proc::Pod(p) => p.kill().await,
        }
    }
}

/// The schedulers' hold on the run: the Slurm job, the Kubernetes session.
#[derive(Clone, Default)]
struct Engines {
    slurm: Option<slurm::SlurmJob>,
    k8s: Option<std::sync::Arc<k8s::Session>>,
}

/// How to start a process again after it died.
#[derive(Clone)]
struct Relaunch {
    file: ClusterFile,
    /// The Slurm job of the `slurm` processes, the Kubernetes session of the `k8s` ones.
    engines: Engines,
    binary: std::path::PathBuf,
    logs: std::path::PathBuf,
    shared: std::sync::Arc<Shared>,
    /// Most restarts per process.
    limit: u32,
}

fn process_args(spec: &ProcessSpec, file: &ClusterFile) -> Vec<String> {
    let mut args = vec![
        "node".into(),
        "--role".into(),
        spec.role.name().into(),
        "--name".into(),
        spec.name.clone(),
        "--dispatcher".into(),
        file.cluster.dispatcher.clone(),
        "--stats-ms".into(),
        file.cluster.stats_interval_ms.to_string(),
        "--metrics".into(),
        spec.metrics.clone().unwrap_or_else(|| "127.0.0.1:0".into()),
    ];
    if !spec.ids.is_empty() {
        args.push("--ids".into());
        args.push(spec.ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(","));
    }
    if let Some(input) = &spec.input {
        args.push("--input".into());
        args.push(input.clone());
    }
    if let Some(dir) = credentials::dir_for(spec, file) {
        args.push("--credentials".into());
        args.push(dir.display().to_string());
        // A process with credentials proves them to the dispatcher too, unless run control
        // has none for the control plane (it is then plain for everyone).
        if !credentials::has_control_plane(file) {
            args.push("--control-plain".into());
        }
    }
    if let Some(web) = file.cluster.security.as_ref().and_then(|s| s.metrics_web_config.as_ref()) {
        args.push("--web-config".into());
        args.push(web.display().to_string());
    }
    if spec.test_clock_offset_us != 0.0 {
        args.push(format!("--test-clock-offset-us={}", spec.test_clock_offset_us));
    }
    if spec.test_clock_drift_ppm != 0.0 {
        args.push(format!("--test-clock-drift-ppm={}", spec.test_clock_drift_ppm));
    }
    args
}

/// `program args`, its output to `log`, in a process group of its own (with `env` set).
fn spawn_logged(
    program: &Path,
    args: &[String],
    log: &Path,
    append: bool,
    env: Option<(&str, &Path)>,
) -> anyhow::Result<Child> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .open(log)
        .with_context(|| format!("creating {}", log.display()))?;
    let err = out.try_clone()?;
    let mut cmd = Command::new(program);
    cmd.args(args).stdin(std::process::Stdio::null()).stdout(out).stderr(err).process_group(0).kill_on_drop(true);
    if let Some((key, value)) = env {
        cmd.env(key, value);
    }
    cmd.spawn().with_context(|| format!("starting {} {}", program.display(), args.join(" ")))
}

/// Whether `tool` is an executable file in a directory of `PATH`.
pub(crate) fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

/// Starts `spec` as its launch kind says (`attempt` > 0: a restart); None for `external`.
async fn launch(
    spec: &ProcessSpec,
    file: &ClusterFile,
    binary: &Path,
    logs: &Path,
    attempt: u32,
    engines: &Engines,
) -> anyhow::Result<Option<Proc>> {
    let append = attempt > 0;
    let mut args = process_args(spec, file);
    if matches!(spec.launch, Launch::Local | Launch::Netns) {
        // Our child (`ip netns exec` execs): if this process is killed, it stops too.
        args.push("--exit-with-parent".into());
    }
    let log = logs.join(format!("{}.log", spec.name));
    let child = match spec.launch {
        Launch::External => return Ok(None),
        Launch::K8s => {
            let session = engines.k8s.as_ref().context("a k8s process without the cluster's Kubernetes session")?;
            let pod = session.launch(spec, &args, attempt).await?;
            let line = format!(
                "{} runs in Pod {} on node {}: kubectl -n {} logs {}\n",
                spec.name, pod.name, spec.host, session.namespace, pod.name
            );
            let _ = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()));
            return Ok(Some(Proc::Pod(pod)));
        }
        Launch::Local => spawn_logged(binary, &args, &log, append, None),
        Launch::Ssh => {
            let mut ssh = vec!["-o".into(), "BatchMode=yes".into()];
            ssh.extend(file.cluster.ssh_options.iter().cloned());
            ssh.push(spec.host.clone());
            ssh.push(binary.display().to_string());
            ssh.extend(args);
            spawn_logged(Path::new("ssh"), &ssh, &log, append, None)
        }
        Launch::Netns => {
            let mut exec = vec!["netns".into(), "exec".into(), spec.host.clone(), binary.display().to_string()];
            exec.extend(args);
            spawn_logged(Path::new("ip"), &exec, &log, append, None)
        }
        Launch::Slurm => {
            let job = engines.slurm.as_ref().context("a slurm process without the cluster's Slurm job")?;
            let (srun, args) = job.step(spec, binary, &args);
            let conf = job.conf.as_deref().map(|c| ("SLURM_CONF", c));
            spawn_logged(&srun, &args, &log, append, conf)
        }
    }?;
    Ok(Some(Proc::Child(child)))
}

async fn wait_for_port(addr: std::net::SocketAddr, timeout: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!("nothing listens on {addr} after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Publishes pings from `sender` until `listener` sees one: then the listener's
/// subscriptions are in force (the dispatcher does not acknowledge subscriptions).
async fn await_subscription(sender: &mut ChClient, listener: &mut ChClient) -> anyhow::Result<()> {
    use shoal_core::controlhost::Mode;
    listener.subscribe("RC_PING", Mode::All).await?;
    for _ in 0..100 {
        sender.publish("RC_PING", b"ping").await?;
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(100), listener.next_message()).await
            && m.tag.to_string() == "RC_PING"
        {
            listener.unsubscribe("RC_PING").await?;
            return Ok(());
        }
    }
    anyhow::bail!("the dispatcher does not deliver run control's messages")
}

pub async fn command(args: RunOptions) -> anyhow::Result<ExitCode> {
    let file = cluster_file(&args)?;
    let dispatcher = file.dispatcher_addr()?;
    let state_dir = file.cluster.state_dir.clone();
    let logs = state_dir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    std::fs::create_dir_all(state_dir.join("runs"))?;
    let binary = match &file.cluster.binary {
        Some(b) => b.clone(),
        None => std::env::current_exe().context("locating the shoal executable")?,
    };
    shoal_net::demo::raise_fd_limit();

    // Ctrl-C: stop cleanly (the processes have their own process groups).
    let interrupted = CancellationToken::new();
    {
        let t = interrupted.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!("interrupted: stopping the run and switching the processes off");
                t.cancel();
            }
        });
    }

    let shared = Shared::new(initial_status(&file, &state_dir));
    let control_plane = credentials::control_plane(&file)?;
    if control_plane.is_none() && file.cluster.security.is_some() {
        shared.update(|s| {
            s.warn("the control plane is not authenticated: [cluster.security] has no ca_dir, nor runcontrol.pem in credentials_dir (docs/security.md)")
        });
    }
    let control_tls = control_plane.as_ref().map(|c| c.tls.clone());
    let dispatcher_child = start_dispatcher(&file, &binary, &logs, &shared, control_plane.as_ref())?;
    wait_for_port(dispatcher, Duration::from_secs(10)).await.context("waiting for the dispatcher")?;
    let mut listener_client = ChClient::connect_with(dispatcher, control_tls.clone()).await?;
    let mut client = ChClient::connect_with(dispatcher, control_tls.clone()).await?;
    client.set_nickname("runcontrol").await?;
    control::subscribe_listener(&mut listener_client, control_tls.is_some()).await?;
    await_subscription(&mut client, &mut listener_client).await?;

    let (incoming_tx, incoming_rx) = mpsc::unbounded_channel();
    // One clock for the controller and its listener: the listener stamps the clock probes'
    // answers, the controller their questions.
    let clock = shoal_net::clock::WallClock::new();
    let listen_task = tokio::spawn(control::listen(listener_client, shared.clone(), incoming_tx.clone(), clock));

    let issued = credentials::issue_all(&file)?;
    if issued > 0 {
        tracing::info!(issued, dir = %credentials::issued_dir(&file).display(), "certificates issued to the processes");
    }
    let allocation = slurm::Allocation::request(&file, &logs).await?;
    if let Some(a) = &allocation {
        shared.update(|s| s.note(format!("Slurm job {} over {}", a.job.id, slurm::hosts(&file).join(","))));
    }
    let k8s_session = match k8s::Session::open(&file, &shared).await {
        Ok(s) => s,
        Err(e) => {
            if let Some(a) = allocation {
                let _ = a.release().await;
            }
            return Err(e.context("launch = \"k8s\""));
        }
    };
    let engines = Engines { slurm: allocation.as_ref().map(|a| a.job.clone()), k8s: k8s_session.clone() };
    let launched = match launch_all(&file, &binary, &logs, &shared, &engines).await {
        Ok(l) => l,
        Err(e) => {
            // Nothing half-started is left: the Pods already made, the job.
            if let Some(s) = &k8s_session
                && let Err(end) = s.end().await
            {
                eprintln!("Kubernetes: {end:#}");
            }
            if let Some(a) = allocation {
                let _ = a.release().await;
            }
            return Err(e);
        }
    };
    let relaunch = Relaunch {
        file: file.clone(),
        engines,
        binary: binary.clone(),
        logs: logs.clone(),
        shared: shared.clone(),
        limit: file.cluster.restarts,
    };
    let exits = watch_exits(launched, incoming_tx, relaunch);

    let mut controller = Controller::new(file.clone(), client, shared.clone(), incoming_rx, clock)?;
    let guard = guard_of(&file, control_tls.clone())?;
    controller.set_audit(guard.audit.clone());
    controller.discover().await?;

    let http_cancel = CancellationToken::new();
    let (cmd_tx, cmd_rx) = mpsc::channel::<ClusterCommand>(1);
    serve_ui(&file, &shared, cmd_tx, &state_dir, dispatcher, guard, &http_cancel).await?;

    let mut ok = if args.interactive {
        follow_commands(&mut controller, cmd_rx, &interrupted).await?
    } else {
        run_once(&mut controller, file.cluster.seconds, &interrupted).await?
    };

    // Everyone was told OFF; give them a moment to exit, then make sure.
    exits.finish(Duration::from_secs(10)).await;
    if let Some(a) = allocation {
        let id = a.job.id;
        if let Err(e) = a.release().await {
            eprintln!("the Slurm job {id}: {e:#}");
            ok = false;
        }
    }
    if let Some(s) = &k8s_session
        && let Err(e) = s.end().await
    {
        eprintln!("Kubernetes, session {}: {e:#}", s.run);
        ok = false;
    }
    listen_task.abort();
    if let Some(d) = dispatcher_child {
        d.cancel();
        let _ = d.task.await;
    }
    http_cancel.cancel();
    ok &= print_last_run(&shared, &state_dir, args.json)?;
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::from(2) })
}

/// The cluster file with the command line's overrides.
fn cluster_file(args: &RunOptions) -> anyhow::Result<ClusterFile> {
    let mut file = ClusterFile::load(&args.cluster)?;
    if let Some(h) = &args.http {
        file.cluster.http = h.clone();
    }
    if let Some(d) = &args.state_dir {
        file.cluster.state_dir = d.clone();
    }
    if let Some(d) = &args.dispatcher {
        file.cluster.dispatcher = d.clone();
    }
    if let Some(s) = args.seconds {
        if !(s.is_finite() && s > 0.0) {
            anyhow::bail!("--seconds must be positive");
        }
        file.cluster.seconds = s;
    }
    Ok(file)
}

/// What the UI shows before anything answers: every process of the file, state unknown.
fn initial_status(file: &ClusterFile, state_dir: &std::path::Path) -> ClusterStatus {
    ClusterStatus {
        cluster: file.cluster.name.clone(),
        security: control::security_mode(file).to_string(),
        processes: file
            .processes
            .iter()
            .map(|p| ProcStatus {
                name: p.name.clone(),
                role: p.role.name().into(),
                host: p.host.clone(),
                pid: None,
                state: "UNKNOWN".into(),
                active: true,
                inactive_reason: None,
                not_answering: false,
                switched_off: false,
                last_reply: None,
                metrics_addr: None,
                stats: None,
                stats_received_ns: None,
                rates: Rates::default(),
                clock: None,
            })
            .collect(),
        history: control::load_history(state_dir, 50),
        dispatcher_metrics: (file.cluster.start_dispatcher && file.cluster.dispatcher_http != "off")
            .then(|| file.cluster.dispatcher_http.clone()),
        ..Default::default()
    }
}

/// The dispatcher as a child of run control, restarted if it dies, when the file asks
/// run control to start it.
fn start_dispatcher(
    file: &ClusterFile,
    binary: &std::path::Path,
    logs: &std::path::Path,
    shared: &std::sync::Arc<Shared>,
    control_plane: Option<&credentials::ControlPlane>,
) -> anyhow::Result<Option<KeptDispatcher>> {
    if !file.cluster.start_dispatcher {
        return Ok(None);
    }
    let dispatcher = file.dispatcher_addr()?;
    let mut args = vec![
        "dispatcher".into(),
        "--listen".into(),
        dispatcher.to_string(),
        "--http".into(),
        file.cluster.dispatcher_http.clone(),
        "--exit-with-parent".into(),
    ];
    // The file's check_listeners let a non-loopback dispatcher through only so.
    if file.cluster.insecure {
        args.push("--insecure".into());
    }
    if let Some(web) = file.cluster.security.as_ref().and_then(|s| s.metrics_web_config.as_ref()) {
        args.push("--web-config".into());
        args.push(web.display().to_string());
    }
    // Secured: shoal's tags by certificate; the plain port's command tags only from the
    // networks the file names (none by default), audited in the state directory.
    if let Some(cp) = control_plane {
        args.extend(["--credentials".into(), cp.dir.display().to_string()]);
        args.extend(["--name".into(), credentials::DISPATCHER.into()]);
        args.extend(["--audit-dir".into(), file.cluster.state_dir.display().to_string()]);
        for net in &file.cluster.command_from {
            args.extend(["--control-from".into(), net.clone()]);
        }
        return keep_started(file, binary, args, logs, shared, dispatcher).map(Some);
    }
    // Command tags from this host (run control itself, `shoal alert`; on the dispatcher's
    // own address where it is not loopback, as in the testbed's control namespace) and
    // from the networks the file names.
    let own =
        (!dispatcher.ip().is_loopback() && !dispatcher.ip().is_unspecified()).then(|| dispatcher.ip().to_string());
    let nets = ["127.0.0.0/8".to_string(), "::1/128".to_string()]
        .into_iter()
        .chain(own)
        .chain(file.cluster.command_from.clone());
    for net in nets {
        args.push("--control-from".into());
        args.push(net);
    }
    keep_started(file, binary, args, logs, shared, dispatcher).map(Some)
}

/// Starts the dispatcher with `args` and keeps it (restarted if it dies).
fn keep_started(
    file: &ClusterFile,
    binary: &std::path::Path,
    args: Vec<String>,
    logs: &std::path::Path,
    shared: &std::sync::Arc<Shared>,
    dispatcher: std::net::SocketAddr,
) -> anyhow::Result<KeptDispatcher> {
    let first = spawn_logged(binary, &args, &logs.join("dispatcher.log"), false, None)?;
    Ok(keep_dispatcher(
        first,
        binary.to_path_buf(),
        args,
        logs.join("dispatcher.log"),
        file.cluster.restarts,
        KeepWatch { shared: shared.clone(), addr: dispatcher },
    ))
}

/// Launches every process the file's launch kinds start, writer first (the order does
/// not matter for correctness: nothing flows before START).
async fn launch_all(
    file: &ClusterFile,
    binary: &std::path::Path,
    logs: &std::path::Path,
    shared: &std::sync::Arc<Shared>,
    engines: &Engines,
) -> anyhow::Result<Vec<Launched>> {
    let mut launched = Vec::new();
    let mut specs: Vec<&ProcessSpec> = file.processes.iter().collect();
    specs.sort_by_key(|p| match p.role {
        Role::Writer => 0,
        Role::Dfm => 1,
        Role::Builder => 2,
        Role::Source => 3,
    });
    for spec in specs {
        if let Some(child) = launch(spec, file, binary, logs, 0, engines).await? {
            let pid = child.pid();
            shared.update(|s| {
                if let Some(p) = s.process_mut(&spec.name) {
                    p.pid = pid;
                }
            });
            launched.push(Launched { spec: spec.clone(), child });
        }
    }
    shared.update(|s| s.note(format!("launched {} processes; logs in {}", launched.len(), logs.display())));
    Ok(launched)
}

/// The web UI and HTTP API, unless `cluster.http = "off"`.
async fn serve_ui(
    file: &ClusterFile,
    shared: &std::sync::Arc<Shared>,
    cmd_tx: mpsc::Sender<ClusterCommand>,
    state_dir: &std::path::Path,
    dispatcher: std::net::SocketAddr,
    guard: http::Guard,
    cancel: &CancellationToken,
) -> anyhow::Result<()> {
    if file.cluster.http == "off" {
        return Ok(());
    }
    let addr: std::net::SocketAddr =
        file.cluster.http.parse().with_context(|| format!("cluster.http {:?}", file.cluster.http))?;
    let l = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding the UI port {addr}"))?;
    let local = l.local_addr()?;
    // Scripts (and the tests) read this line to find the UI.
    let scheme = if guard.web.as_ref().is_some_and(|w| w.tls.is_some()) { "https" } else { "http" };
    println!("run control UI: {scheme}://{local}/");
    match &guard.tokens {
        Some(_) => {
            println!("run control UI needs a token (docs/security.md); audit log {}", guard.audit.path().display())
        }
        None if file.cluster.insecure => {
            eprintln!(
                "warning: cluster.insecure = true: run control's HTTP API takes commands from anyone who reaches {local}"
            )
        }
        None => {}
    }
    let audit = guard.audit.clone();
    tokio::spawn(http::serve(l, shared.clone(), cmd_tx, state_dir.to_path_buf(), dispatcher, guard, cancel.clone()));
    tokio::spawn(flush_audit(audit, cancel.clone()));
    Ok(())
}

/// Writes the audit's gathered refusals every second, and what is left at the end.
async fn flush_audit(audit: std::sync::Arc<audit::Audit>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => audit.flush_at(std::time::SystemTime::now()),
            _ = cancel.cancelled() => return audit.flush(),
        }
    }
}

/// The HTTP API's guard from `[cluster.security]`: its tokens, the origins it allows, and
/// the audit log in the state directory.
fn guard_of(file: &ClusterFile, control: Option<shoal_dispatcher::client::ControlTls>) -> anyhow::Result<http::Guard> {
    let security = file.cluster.security.clone().unwrap_or_default();
    let tokens = match &security.tokens {
        Some(path) => Some(std::sync::Arc::new(security::WatchedTokens::load(path)?)),
        None => None,
    };
    let audit = std::sync::Arc::new(audit::Audit::new(&file.cluster.state_dir));
    let web = match &security.web_config {
        Some(path) => Some(std::sync::Arc::new(shoal_tls::web::WebConfig::load(path)?)),
        None => None,
    };
    Ok(http::Guard { tokens, allowed_origins: security.allowed_origins, audit, web, control })
}

/// `--interactive`: the UI's and API's commands, one at a time, until OFF (or Ctrl-C,
/// which is OFF). Whether OFF went through.
async fn follow_commands(
    controller: &mut Controller,
    mut cmd_rx: mpsc::Receiver<ClusterCommand>,
    interrupted: &CancellationToken,
) -> anyhow::Result<bool> {
    loop {
        let next = controller
            .follow_until(async {
                tokio::select! {
                    c = cmd_rx.recv() => c,
                    _ = interrupted.cancelled() => None,
                }
            })
            .await?;
        let command = next.unwrap_or(ClusterCommand::Off);
        let result = controller.execute(command).await;
        if let Err(e) = &result {
            eprintln!("{command}: {e:#}");
        }
        if command == ClusterCommand::Off {
            return Ok(result.is_ok());
        }
    }
}

/// One run: INIT, CONFIGURE, START, `seconds` of data taking (or Ctrl-C), OFF. Whether
/// every command went through.
async fn run_once(controller: &mut Controller, seconds: f64, interrupted: &CancellationToken) -> anyhow::Result<bool> {
    let mut ok = true;
    for command in [ClusterCommand::Init, ClusterCommand::Configure, ClusterCommand::Start] {
        if let Err(e) = controller.execute(command).await {
            eprintln!("{command}: {e:#}");
            ok = false;
            break;
        }
    }
    if ok {
        eprintln!("running for {seconds} s (Ctrl-C stops earlier)");
        controller
            .follow_until(async {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs_f64(seconds)) => {}
                    _ = interrupted.cancelled() => {}
                }
            })
            .await?;
    }
    if let Err(e) = controller.execute(ClusterCommand::Off).await {
        eprintln!("OFF: {e:#}");
        ok = false;
    }
    Ok(ok)
}

/// The last run's summary (or its JSON), and the processes left inactive. Whether its
/// ledger balanced (true without a run).
fn print_last_run(shared: &std::sync::Arc<Shared>, state_dir: &std::path::Path, json: bool) -> anyhow::Result<bool> {
    let status = shared.snapshot();
    let mut balanced = true;
    if let Some(last) = status.history.first() {
        if json {
            println!("{}", serde_json::to_string_pretty(last)?);
        } else {
            print!("{}", brief_table(last, state_dir));
        }
        balanced = last.balanced;
    }
    let inactive: Vec<&str> = status.processes.iter().filter(|p| !p.active).map(|p| p.name.as_str()).collect();
    if !inactive.is_empty() {
        eprintln!("inactive processes: {}", inactive.join(", "));
    }
    Ok(balanced)
}

/// The last run in words, like `shoal demo`'s summary.
fn brief_table(b: &status::RunBrief, state_dir: &std::path::Path) -> String {
    let total = b.slices_complete + b.slices_incomplete;
    let pct = if total > 0 { 100.0 * b.slices_complete as f64 / total as f64 } else { 0.0 };
    let rows = [
        ("run", format!("{} started {}, {:.1} s", b.run, b.start_time, b.seconds)),
        ("slices", format!("{} complete ({pct:.2}%), {} incomplete", b.slices_complete, b.slices_incomplete)),
        ("events", b.events.to_string()),
        (
            "ledger",
            format!(
                "produced {}, lost {}{}",
                b.produced,
                b.lost,
                if b.balanced { " (balanced)" } else { " (NOT BALANCED)" }
            ),
        ),
        ("inactive", if b.inactive.is_empty() { "none".to_string() } else { b.inactive.join(", ") }),
        ("record", state_dir.join("runs").join(format!("run{:06}.json", b.run)).display().to_string()),
    ];
    let mut o = String::from("shoal run summary\n");
    for (k, v) in rows {
        o.push_str(&format!("  {k:<10} {v}\n"));
    }
    if let Some(a) = &b.archive {
        o.push_str(&format!("  {:<10} {}\n", "archive", archive_line(a)));
    }
    o
}

/// The run's files in the archive, in a line.
fn archive_line(a: &shoal_core::custody::ArchiveLedger) -> String {
    let mb = |b: u64| format!("{:.1} MB", b as f64 / 1e6);
    let mut s = format!("{} file(s), {}: {} safe", a.files, mb(a.bytes_written), a.files_safe);
    if a.files_pending > 0 {
        s += &format!(", {} pending ({}; `shoal archive status` follows them)", a.files_pending, mb(a.bytes_pending));
    }
    if a.files_quarantined > 0 {
        s += &format!(", {} QUARANTINED", a.files_quarantined);
    }
    if a.bytes_lost > 0 {
        s += &format!(", {} LOST", mb(a.bytes_lost));
    }
    s + if a.balanced() { " (balanced)" } else { " (NOT BALANCED)" }
}

/// The dispatcher run control started, started again if it dies (up to `limit` times):
/// every client (run control's own, the nodes' agents) reconnects and subscribes again by
/// itself, and the data path does not go through it.
struct KeptDispatcher {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl KeptDispatcher {
    fn cancel(&self) {
        self.stop.cancel();
    }
}

/// Where a kept dispatcher's outages are told (the diagnosis sees them).
struct KeepWatch {
    shared: std::sync::Arc<Shared>,
    addr: std::net::SocketAddr,
}

fn keep_dispatcher(
    mut child: Child,
    binary: std::path::PathBuf,
    args: Vec<String>,
    log: std::path::PathBuf,
    limit: u32,
    watch: KeepWatch,
) -> KeptDispatcher {
    let stop = CancellationToken::new();
    let watching = stop.clone();
    let task = tokio::spawn(async move {
        let mut restarts = 0;
        loop {
            let status = tokio::select! {
                st = child.wait() => st,
                _ = watching.cancelled() => {
                    let _ = child.start_kill();
                    let _ = child.wait().await;
                    return;
                }
            };
            let failed = status.as_ref().map_or(true, |st| !st.success());
            let how = status.as_ref().map_or_else(|e| e.to_string(), |st| st.to_string());
            watch.shared.update(|s| {
                s.dispatcher_down = Some(format!("the dispatcher exited ({how})"));
                s.dispatcher_exits += 1;
            });
            if !failed || restarts >= limit {
                eprintln!("the dispatcher exited ({status:?}); not starting it again");
                return;
            }
            restarts += 1;
            eprintln!("the dispatcher exited ({status:?}); starting it again ({restarts} of {limit})");
            match spawn_logged(&binary, &args, &log, true, None) {
                Ok(c) => {
                    child = c;
                    if wait_for_port(watch.addr, Duration::from_secs(10)).await.is_ok() {
                        watch.shared.update(|s| s.dispatcher_down = None);
                    }
                }
                Err(e) => {
                    eprintln!("the dispatcher could not be started again: {e:#}");
                    return;
                }
            }
        }
    });
    KeptDispatcher { stop, task }
}

/// Follows the launched children: one that exits on its own is marked inactive.
struct Exits {
    tasks: Vec<(String, tokio::task::JoinHandle<()>)>,
    kill: CancellationToken,
}

/// A process that exits with a failure (killed, crashed) is started again, up to
/// `relaunch.limit` times; it announces itself and run control brings it back into the
/// run. A clean exit (after OFF) ends the watch.
fn watch_exits(launched: Vec<Launched>, incoming: mpsc::UnboundedSender<Incoming>, relaunch: Relaunch) -> Exits {
    let kill = CancellationToken::new();
    let tasks = launched
        .into_iter()
        .map(|mut l| {
            let incoming = incoming.clone();
            let kill = kill.clone();
            let relaunch = relaunch.clone();
            let name = l.spec.name.clone();
            let task = tokio::spawn(async move {
                let mut restarts = 0;
                loop {
                    let (how, failed) = tokio::select! {
                        end = l.child.wait() => end,
                        _ = kill.cancelled() => {
                            eprintln!("{} did not exit after OFF; killing it", l.spec.name);
                            l.child.kill().await;
                            return;
                        }
                    };
                    // The controller decides whether that was expected (after OFF) or not.
                    let _ = incoming.send(Incoming::Exited(l.spec.name.clone(), how.clone()));
                    if !failed || restarts >= relaunch.limit || kill.is_cancelled() {
                        return;
                    }
                    restarts += 1;
                    relaunch.shared.update(|s| {
                        s.note(format!(
                            "{} exited ({how}); starting it again ({restarts} of {})",
                            l.spec.name, relaunch.limit
                        ))
                    });
                    if let Proc::Pod(_) = l.child {
                        // A Pod ended is still there (Failed): out of the way first.
                        l.child.kill().await;
                    }
                    match launch(&l.spec, &relaunch.file, &relaunch.binary, &relaunch.logs, restarts, &relaunch.engines)
                        .await
                    {
                        Ok(Some(child)) => {
                            let pid = child.pid();
                            relaunch.shared.update(|s| {
                                if let Some(p) = s.process_mut(&l.spec.name) {
                                    p.pid = pid;
                                }
                            });
                            l.child = child;
                        }
                        Ok(None) => return,
                        Err(e) => {
                            relaunch
                                .shared
                                .update(|s| s.note(format!("{} could not be started again: {e:#}", l.spec.name)));
                            return;
                        }
                    }
                }
            });
            (name, task)
        })
        .collect();
    Exits { tasks, kill }
}

impl Exits {
    /// Waits up to `grace` for every child to exit, then kills the rest.
    async fn finish(self, grace: Duration) {
        let deadline = tokio::time::Instant::now() + grace;
        let mut left = Vec::new();
        for (name, mut task) in self.tasks {
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                left.push((name, task));
            }
        }
        self.kill.cancel();
        for (_, task) in left {
            let _ = task.await;
        }
    }
}
