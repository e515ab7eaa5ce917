//! The driver of [`ClusterControl`]: it moves run control's messages between the
//! dispatcher and the sans-IO controller, gives it the time, keeps the run records and
//! mirrors what the controller knows into the shared status the web UI shows.
//!
//! Two dispatcher connections: the controller's own (it publishes commands) and the
//! listener's ([`listen`]), which follows replies, statistics, end-of-run reports and the
//! dispatcher's `Died` announcements. Statistics go straight to the shared status (they
//! decide nothing); everything else reaches the controller, in the order it arrived, over
//! one channel of [`Incoming`] (launched processes that exit are reported on it too).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use serde::Serialize;
use shoal_core::alert::ALERT_REPLY_TAG;
use shoal_core::cluster::{
    ClusterCommand, ClusterControl, ClusterControlConfig, ClusterEvent, ClusterProcess, CommandOutcome,
};
use shoal_core::controlhost::Mode;
use shoal_core::ledger::Ledger;
use shoal_core::runstate::Reply;
use shoal_dispatcher::client::ChClient;
use shoal_net::clock::WallClock;
use shoal_net::demo::LedgerSummary;
use shoal_net::node::{NodeReport, NodeStats, Role};
use shoal_net::rcagent::{RC_CMD, RC_REPLY, RC_REPORT, RC_STATS, RC_TIME, RC_TIME_REPLY, TimeAnswer};

use crate::clocks::{ClockRecord, ClockWatch};
use crate::diagnose::RunDiagnosis;
use shoal_core::diagnosis::Diagnoser;
use tokio::sync::mpsc;
use tracing::warn;

use crate::cluster::ClusterFile;
use crate::status::{Rates, RunBrief, Shared};

/// What the listener and the process watchers tell the controller.
#[derive(Debug)]
pub enum Incoming {
    /// A reply, with its text as received.
    Reply(Reply, String),
    Report(Box<NodeReport>),
    /// The dispatcher announced that a client left.
    Left(String),
    /// The listener's connection to the dispatcher was broken and is back: replies and
    /// reports sent meanwhile are lost.
    ListenerReconnected,
    /// A launched process exited; its exit status.
    Exited(String, String),
    /// An answer to a clock probe, with the time it arrived (run control's clock).
    Time(TimeAnswer, shoal_core::Instant),
}

/// Follows the dispatcher for run control (see the module documentation).
pub async fn listen(
    mut client: ChClient,
    shared: Arc<Shared>,
    incoming: mpsc::UnboundedSender<Incoming>,
    clock: WallClock,
) {
    let mut last_stats: HashMap<String, NodeStats> = HashMap::new();
    loop {
        let msg = match client.next_message_or_reconnect().await {
            Ok(Some(m)) => m,
            Ok(None) => {
                shared.update(|s| s.warn("run control's listener reconnected to the dispatcher"));
                if incoming.send(Incoming::ListenerReconnected).is_err() {
                    return;
                }
                continue;
            }
            Err(e) => {
                warn!(error = %e, "run control lost the dispatcher");
                shared.update(|s| s.note(format!("lost the dispatcher: {e}")));
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        // First, before anything else takes time: when a clock probe's answer arrived.
        let arrived = clock.now();
        let tag = msg.tag.to_string();
        let text = String::from_utf8_lossy(&msg.payload);
        let delivered = match tag.as_str() {
            RC_TIME_REPLY => match TimeAnswer::parse(&text) {
                Some(a) => incoming.send(Incoming::Time(a, arrived)),
                None => Ok(()),
            },
            RC_REPLY => match Reply::parse(&text) {
                Some(r) => incoming.send(Incoming::Reply(r, text.to_string())),
                None => {
                    shared.update(|s| {
                        s.note(format!("unreadable reply {:?}", text.chars().take(80).collect::<String>()))
                    });
                    Ok(())
                }
            },
            RC_STATS => {
                let Ok(stats) = serde_json::from_slice::<NodeStats>(&msg.payload) else { continue };
                let rates = last_stats.get(&stats.name).map(|prev| Rates::between(prev, &stats));
                // A process's pid comes only from whoever launched it (`pid` below): one
                // learnt from a message is shown with its statistics, never acted on.
                shared.update(|s| {
                    if let Some(p) = s.process_mut(&stats.name) {
                        p.metrics_addr = stats.metrics_addr.clone();
                        if let Some(r) = rates {
                            p.rates = r;
                        }
                        p.stats = Some(stats.clone());
                        p.stats_received_ns = Some(clock.now().as_nanos());
                    }
                });
                last_stats.insert(stats.name.clone(), stats);
                Ok(())
            }
            RC_REPORT => match serde_json::from_slice::<NodeReport>(&msg.payload) {
                Ok(r) => incoming.send(Incoming::Report(Box::new(r))),
                Err(e) => {
                    shared.update(|s| s.note(format!("unreadable end-of-run report: {e}")));
                    Ok(())
                }
            },
            "Died" | shoal_dispatcher::authority::RC_GONE => {
                incoming.send(Incoming::Left(text.trim_end_matches('\0').to_string()))
            }
            ALERT_REPLY_TAG => {
                let Ok(value) = serde_json::from_slice::<serde_json::Value>(&msg.payload) else { continue };
                let line = match serde_json::from_value::<shoal_core::saver::AlertReport>(value.clone()) {
                    Ok(r) => r.describe(),
                    Err(_) => format!("alert answer: {value}"),
                };
                shared.update(|s| {
                    s.note(line);
                    s.alerts.push_front(value);
                    s.alerts.truncate(50);
                });
                Ok(())
            }
            _ => Ok(()),
        };
        if delivered.is_err() {
            return; // the controller is gone
        }
    }
}

/// Whether `r` is a report a process of `file` may make: its name and its role. (A process
/// started with other ids than the file gives it reports what it did: the diagnosis names
/// that mismatch, and on a secured cluster its data was refused for its identity already.)
fn report_belongs(file: &ClusterFile, r: &NodeReport) -> Result<(), String> {
    let Some(p) = file.processes.iter().find(|p| p.name == r.name) else {
        return Err("no process of this cluster".into());
    };
    if p.role.name() != r.role {
        return Err(format!("a {} reporting as a {}", p.role.name(), r.role));
    }
    if r.builder.is_some() && p.role != Role::Builder {
        return Err(format!("a builder's tally from the {} {}", p.role.name(), r.name));
    }
    if !r.source_tallies.is_empty() && p.role != Role::Source {
        return Err(format!("source tallies from the {} {}", p.role.name(), r.name));
    }
    Ok(())
}

/// Subscribes the listener connection. On an authenticated control plane a process's
/// departure is the dispatcher's `RC_GONE` (only it publishes that, for a certificate's
/// own connection), never `Died`, which any client can cause under any nickname.
pub async fn subscribe_listener(client: &mut ChClient, authenticated: bool) -> anyhow::Result<()> {
    let departures = if authenticated { shoal_dispatcher::authority::RC_GONE } else { "Died" };
    for (tag, mode) in [
        (RC_REPLY, Mode::All),
        (RC_REPORT, Mode::All),
        (departures, Mode::All),
        (RC_STATS, Mode::Any),
        (ALERT_REPLY_TAG, Mode::All),
        (RC_TIME_REPLY, Mode::All),
    ] {
        client.subscribe(tag, mode).await?;
    }
    client.set_nickname("runcontrol-listener").await?;
    Ok(())
}

/// What the driver keeps of the run in progress (the controller keeps its numbers).
#[derive(Clone, Debug)]
struct RunMeta {
    started: SystemTime,
    config: String,
}

/// One run's record (`<state_dir>/runs/runNNNNNN.json`).
#[derive(Clone, Debug, Serialize)]
pub struct RunRecord {
    pub run: u64,
    pub cluster: String,
    pub start_time: String,
    pub stop_time: String,
    pub start_unix_ns: u64,
    pub stop_unix_ns: u64,
    pub start_slice: u64,
    /// First slice not taken (sent with STOP).
    pub end_slice: u64,
    pub configuration: String,
    /// Final state per process, with the reason a process was inactive.
    pub processes: Vec<ProcessOutcome>,
    pub ledger: LedgerSummary,
    /// Sources and builders whose end-of-run report never arrived (died or hung).
    pub missing_reports: Vec<String>,
    /// Processes that left the run while it was on (died, stopped answering), what they
    /// took part in, and where a restarted one rejoined; their production is attributed
    /// in the ledger (`lost_with_source`, `lost_with_builder`).
    pub departures: Vec<DepartureRecord>,
    pub slices_complete: u64,
    pub slices_incomplete: u64,
    /// Events the builders selected and sent to the writer ...
    pub events: u64,
    /// ... and those the writer(s) stored: fewer when a writer died during the run with
    /// events not yet on disk (a Parquet file is whole only once closed).
    pub events_stored: u64,
    pub reports: Vec<NodeReport>,
    /// The processes' clocks at START and at the end, the skew judged against the policy
    /// (docs/clocks.md).
    pub clocks: ClockRecord,
    /// Writers that died during the run: the files they did not close and the slices
    /// whose events were in them (bounded by `writer.checkpoint_s`).
    pub events_lost_with_writer: Vec<crate::diagnose::EventsLostWithWriter>,
    /// With `writer.archive`: the run's files in the archive at the run's end, bytes
    /// written = safe + pending + quarantined + lost (docs/archive.md; `shoal archive
    /// status` shows the pending ones become safe).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub archive: Option<shoal_core::custody::ArchiveLedger>,
    /// Automatic recoveries carried out during the run (`cluster.auto_recover`).
    pub recoveries: Vec<Recovery>,
    /// Every lost slice's primary cause and the problems seen during the run
    /// (`shoal diagnose` prints it; docs/monitoring.md).
    pub diagnosis: RunDiagnosis,
    /// How the cluster was protected (docs/security.md): `tokens` (the HTTP API took
    /// tokens, every address on loopback but the UI's), `loopback` (no security, every
    /// address on loopback) or `insecure` (`cluster.insecure = true`: addresses off
    /// loopback that nothing authenticates).
    pub security: &'static str,
    /// The HTTP API's commands, alerts and refusals during the run, with who and from where.
    pub audit: Vec<crate::audit::AuditEvent>,
}

#[derive(Clone, Debug, Serialize)]
pub struct DepartureRecord {
    pub name: String,
    pub role: String,
    /// Took part in slices `from_slice..to_slice`.
    pub from_slice: u64,
    pub to_slice: u64,
    /// When run control found it gone (UNIX ns) and why.
    pub left_unix_ns: u64,
    pub reason: String,
    /// A restarted incarnation took part again from this slice, sent START at this time.
    pub rejoined_slice: Option<u64>,
    pub rejoined_unix_ns: Option<u64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ProcessOutcome {
    pub name: String,
    pub role: String,
    pub final_state: String,
    pub active: bool,
    pub inactive_reason: Option<String>,
    /// Builder: its id. Source: the source ids it hosts (none: all).
    pub ids: Vec<u32>,
}

fn unix_ns(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// Run numbers: the last one handed out is kept in `<state_dir>/last_run` and written
/// before a run starts, so a number is never reused, even after a crash or a restart.
#[derive(Debug)]
pub struct RunNumbers {
    path: PathBuf,
    runs_dir: PathBuf,
}

impl RunNumbers {
    pub fn new(state_dir: &std::path::Path) -> Self {
        Self { path: state_dir.join("last_run"), runs_dir: state_dir.join("runs") }
    }

    /// The highest run number ever handed out here (from the counter file and, in case it
    /// was lost, from the records present).
    pub fn last(&self) -> anyhow::Result<u64> {
        let from_file = match std::fs::read_to_string(&self.path) {
            Ok(t) => t.trim().parse::<u64>().with_context(|| format!("{} is not a run number", self.path.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(e).with_context(|| format!("reading {}", self.path.display())),
        };
        let from_records = std::fs::read_dir(&self.runs_dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let n = e.file_name().into_string().ok()?;
                n.strip_prefix("run")?.strip_suffix(".json")?.parse::<u64>().ok()
            })
            .max()
            .unwrap_or(0);
        Ok(from_file.max(from_records))
    }

    /// Takes the next run number and makes it durable before returning it.
    pub fn take_next(&self) -> anyhow::Result<u64> {
        let next = self.last()? + 1;
        let tmp = self.path.with_extension("tmp");
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
            writeln!(f, "{next}")?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &self.path)?;
        Ok(next)
    }
}

/// Why the controller's loop woke up.
enum Wake {
    Input(Incoming),
    Timeout,
    Closed,
}

/// Drives the cluster controller and keeps the books of runs.
pub struct Controller {
    pub file: ClusterFile,
    control: ClusterControl,
    client: ChClient,
    shared: Arc<Shared>,
    incoming: mpsc::UnboundedReceiver<Incoming>,
    numbers: RunNumbers,
    state_dir: PathBuf,
    /// The controller's time: UNIX nanoseconds (the slice clock's), never going back.
    clock: WallClock,
    run: Option<RunMeta>,
    /// End-of-run reports received during the run in progress.
    reports: Vec<NodeReport>,
    /// Outcomes of commands finished and not yet collected by [`Controller::execute`].
    finished: Vec<CommandOutcome>,
    /// Processes brought back into the run in progress: (name, slice, when, UNIX ns).
    rejoins: Vec<(String, u64, u64)>,
    clocks: ClockWatch,
    /// CONFIGURE's clock rounds are on: the command is not done for the operator yet.
    settling: bool,
    /// The diagnosis rules and their timeline, evaluated every [`DIAGNOSIS_INTERVAL`].
    diagnoser: Diagnoser,
    next_diagnosis: shoal_core::Instant,
    dispatcher_exits_seen: u64,
    /// A process left: evaluate the rules at once (after the status shows it).
    diagnose_now: bool,
    /// Automatic recoveries carried out (`cluster.auto_recover`), for the run record.
    recoveries: Vec<Recovery>,
    /// The HTTP API's audit log, whose events during a run go into its record.
    audit: Option<Arc<crate::audit::Audit>>,
}

/// An automatic recovery run control carried out.
#[derive(Clone, Debug, Serialize)]
pub struct Recovery {
    pub rule: String,
    pub process: String,
    /// When the problem began and when run control acted (UNIX ns).
    pub problem_began_ns: u64,
    pub at_unix_ns: u64,
    pub action: String,
}

/// How often run control evaluates the diagnosis rules.
pub const DIAGNOSIS_INTERVAL: Duration = Duration::from_secs(1);

impl Controller {
    /// Puts the HTTP API's audit events of each run into its record.
    pub fn set_audit(&mut self, audit: Arc<crate::audit::Audit>) {
        self.audit = Some(audit);
    }

    /// Starts discovering the processes at once (`* STATUS`).
    pub fn new(
        file: ClusterFile,
        client: ChClient,
        shared: Arc<Shared>,
        incoming: mpsc::UnboundedReceiver<Incoming>,
        clock: WallClock,
    ) -> anyhow::Result<Self> {
        let c = &file.cluster;
        let processes = file.processes.iter().map(|p| ClusterProcess { name: p.name.clone(), role: p.role }).collect();
        let mut cfg = ClusterControlConfig::new(processes, file.config_text()?, file.config.slice_clock()?);
        cfg.reply_timeout = Duration::from_millis(c.reply_timeout_ms);
        cfg.announce_timeout = cfg.reply_timeout.max(Duration::from_secs(10));
        cfg.start_with_missing = c.start_with_missing;
        cfg.source_drain = Duration::from_millis(file.config.source.drain_timeout_ms);
        cfg.builder_drain = Duration::from_millis(file.config.builder.drain_timeout_ms);
        cfg.writer_drain = Duration::from_secs(5);
        let state_dir = c.state_dir.clone();
        let roles: Vec<(String, Role, String)> =
            file.processes.iter().map(|p| (p.name.clone(), p.role, p.clock())).collect();
        let needs = match (file.config.policy(), file.config.slice_clock()) {
            (Ok(policy), Ok(sc)) => Some(shoal_core::clocksync::ClockNeeds {
                policy,
                slice: sc.length(),
                builder_timeout: Duration::from_millis(file.config.builder.wall_timeout_ms),
            }),
            _ => None,
        };
        let clocks = ClockWatch::new(c.clock.clone(), &roles, needs, clock.now());
        Ok(Self {
            clocks,
            settling: false,
            control: ClusterControl::new(cfg, clock.now()),
            clock,
            numbers: RunNumbers::new(&state_dir),
            state_dir,
            file,
            client,
            shared,
            incoming,
            run: None,
            reports: Vec::new(),
            finished: Vec::new(),
            rejoins: Vec::new(),
            diagnoser: Diagnoser::new(),
            next_diagnosis: shoal_core::Instant::ZERO,
            dispatcher_exits_seen: 0,
            diagnose_now: false,
            recoveries: Vec::new(),
            audit: None,
        })
    }

    /// `cluster.auto_recover`: a process hung for the configured time is killed, so that
    /// the exit watcher starts it again and it rejoins the run. Once per episode; only
    /// processes run control launched (it knows their pid and restarts them).
    fn auto_recover(
        &mut self,
        active: &[shoal_core::diagnosis::Episode],
        status: &crate::status::ClusterStatus,
        now: u64,
    ) {
        for a in &self.file.cluster.auto_recover {
            for e in active.iter().filter(|e| e.rule.name() == a.rule) {
                let due = now.saturating_sub(e.began_ns) as f64 * 1e-9 >= a.after_s;
                let done = self.recoveries.iter().any(|r| r.process == e.process && r.problem_began_ns == e.began_ns);
                if !due || done {
                    continue;
                }
                let spec = self.file.processes.iter().find(|p| p.name == e.process);
                let launch = spec.map(|p| p.launch);
                let launched = matches!(launch, Some(crate::cluster::Launch::Local | crate::cluster::Launch::Netns));
                let pid = status.processes.iter().find(|p| p.name == e.process).and_then(|p| p.pid);
                let action = match (launched, pid) {
                    (true, Some(pid)) => {
                        match std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status() {
                            Ok(st) if st.success() => format!("killed pid {pid} to restart it"),
                            Ok(st) => format!("kill of pid {pid} failed ({st})"),
                            Err(err) => format!("kill of pid {pid} failed ({err})"),
                        }
                    }
                    (false, _) => format!(
                        "launch = {:?}: run control kills only its local and netns processes: nothing done",
                        launch.map(|l| format!("{l:?}").to_lowercase()).unwrap_or_default()
                    ),
                    (true, None) => "no pid known: nothing done".to_string(),
                };
                self.shared.update(|s| {
                    s.warn(format!("auto-recovery for {} on {}: {action}", e.rule, e.process));
                });
                self.recoveries.push(Recovery {
                    rule: e.rule.name().to_string(),
                    process: e.process.clone(),
                    problem_began_ns: e.began_ns,
                    at_unix_ns: now,
                    action,
                });
            }
        }
    }

    /// Evaluates the diagnosis rules on what run control knows now; a problem that begins
    /// is a warning in the log, one that ends a note; the UI shows the active ones.
    fn diagnose(&mut self) {
        let now = self.clock.now();
        self.next_diagnosis = now + DIAGNOSIS_INTERVAL;
        let status = self.shared.snapshot();
        // A dispatcher restarted between two looks was down all the same.
        let down = status.dispatcher_down.clone().or_else(|| {
            (status.dispatcher_exits > self.dispatcher_exits_seen).then(|| "exited, started again".to_string())
        });
        self.dispatcher_exits_seen = status.dispatcher_exits;
        let busy = self.control.busy().is_some() || self.settling;
        let snapshot = crate::diagnose::snapshot(
            &status,
            now.as_nanos(),
            self.file.cluster.stats_interval_ms * 1_000_000,
            self.control.run().is_some(),
            busy,
            down,
        );
        let changes = self.diagnoser.evaluate(&snapshot);
        let active: Vec<_> = self.diagnoser.active().into_iter().cloned().collect();
        self.auto_recover(&active, &status, now.as_nanos());
        let timeline = self.diagnoser.timeline();
        let recent = timeline[timeline.len().saturating_sub(100)..].to_vec();
        self.shared.update(|s| {
            for e in &changes.began {
                s.warn(format!("problem {} on {}: {}", e.rule, e.process, e.detail));
            }
            for e in &changes.ended {
                s.note(format!("problem {} on {} is over", e.rule, e.process));
            }
            s.problems = active;
            s.problem_timeline = recent;
        });
    }

    /// Sends the clock probes that are due and acts on a finished round (corrections,
    /// warnings, the status).
    async fn flush_clocks(&mut self) {
        while let Some(text) = self.clocks.poll_probe(self.clock.now()) {
            if let Err(e) = self.client.publish(RC_TIME, text.as_bytes()).await {
                self.shared.update(|s| s.note(format!("cannot send a clock probe: {e}")));
                break;
            }
        }
        let running = self.control.run().is_some();
        let Some(act) = self.clocks.poll_round(self.clock.now().as_nanos(), running) else { return };
        for text in &act.adjust {
            if let Err(e) = self.client.publish(RC_TIME, text.as_bytes()).await {
                self.shared.update(|s| s.note(format!("cannot send a clock correction: {e}")));
            }
        }
        let clocks = self.clocks.clocks().clone();
        let verdict = self.clocks.verdict();
        self.shared.update(|s| {
            for w in &act.warnings {
                s.warn(w.clone());
            }
            for p in &mut s.processes {
                p.clock = clocks.get(&p.name).cloned();
            }
            s.clock_verdict = verdict;
        });
    }

    /// Measurement rounds until one needs no correction (at most four): at CONFIGURE, so
    /// that START finds every clock measured and corrected, and the operator is told
    /// before START whether the skew left is within what the policy tolerates.
    async fn settle_clocks(&mut self) -> anyhow::Result<()> {
        for _ in 0..4 {
            let round = self.clocks.start_round(self.clock.now());
            self.flush_clocks().await;
            // Bounded: a round ends at its answer timeout whoever answered.
            while self.clocks.rounds_done() < round {
                self.turn().await?;
            }
            if !self.clocks.last_round_adjusted() {
                break;
            }
        }
        let (heard, expected) = self.clocks.heard();
        if let Some(v) = self.clocks.verdict() {
            self.shared.update(|s| {
                let line = format!("clocks of {heard} of {expected} processes: {}", v.reason);
                if v.level > shoal_core::clocksync::ClockLevel::Ok { s.warn(line) } else { s.note(line) }
            });
        }
        Ok(())
    }

    /// Publishes what the controller has to say and acts on its events.
    async fn flush(&mut self) -> anyhow::Result<()> {
        while let Some(out) = self.control.poll_transmit() {
            if let Err(e) = self.client.publish(RC_CMD, out.to_text().as_bytes()).await {
                self.shared.update(|s| s.note(format!("cannot send {} to {}: {e}", out.command.name(), out.target)));
            }
        }
        while let Some(event) = self.control.poll_event() {
            self.on_event(event)?;
        }
        self.flush_clocks().await;
        self.mirror();
        if std::mem::take(&mut self.diagnose_now) {
            self.diagnose();
        }
        Ok(())
    }

    fn on_event(&mut self, event: ClusterEvent) -> anyhow::Result<()> {
        match event {
            ClusterEvent::Announced { .. } => {}
            ClusterEvent::Departed(d) => {
                self.shared.update(|s| {
                    s.note(format!(
                        "{} left run {} ({}): it took part in slices {}..{}",
                        d.name, d.run, d.reason, d.from_slice, d.to_slice
                    ))
                });
                // Seen by the rules now: a process restarted within a second would
                // otherwise never be seen down.
                self.diagnose_now = true;
            }
            ClusterEvent::Rejoined { name, run, start_slice } => {
                self.rejoins.push((name.clone(), start_slice, self.clock.now().as_nanos()));
                self.shared.update(|s| s.note(format!("{name} rejoins run {run} from slice {start_slice}")));
            }
            ClusterEvent::RejoinFailed { name, error } => {
                self.shared.update(|s| s.note(format!("{name} could not rejoin the run: {error}")))
            }
            ClusterEvent::AskedAgain { name, command } => {
                self.shared.update(|s| s.warn(format!("{command} sent again to {name} (its answer was not seen)")))
            }
            ClusterEvent::Reminded { command, names } => self.shared.update(|s| {
                s.note(format!("{command} sent again to {} not yet heard from: {}", names.len(), names.join(", ")))
            }),
            ClusterEvent::Back { name, state } => self.shared.update(|s| s.note(format!("{name} is back ({state})"))),
            ClusterEvent::Inactive { name, reason } => {
                self.shared.update(|s| s.note(format!("{name} inactive: {reason}")));
                self.diagnose_now = true;
            }
            ClusterEvent::DiscoveryDone { missing } => self.shared.update(|s| {
                if missing.is_empty() {
                    s.note("every process announced itself")
                } else {
                    s.note(format!("inactive (never announced): {}", missing.join(", ")))
                }
            }),
            ClusterEvent::RunStarted { run, start_slice } => {
                let started = SystemTime::now();
                self.rejoins.clear();
                self.run = Some(RunMeta { started, config: self.control.config().configuration.clone() });
                self.reports.clear();
                let verdict = self.clocks.run_started();
                self.shared.update(|s| {
                    if let Some(v) = &verdict {
                        s.note(format!("run {run} starts with {}", v.reason));
                    }
                    s.run = Some(run);
                    s.run_started = Some(humantime::format_rfc3339_seconds(started).to_string());
                    s.note(format!("run {run} starts with slice {start_slice}"));
                });
            }
            ClusterEvent::RunStopped { run, start_slice, end_slice } => {
                self.write_record(run, start_slice, end_slice)?;
            }
            ClusterEvent::CommandDone(outcome) => {
                let c = outcome.command;
                // CONFIGURE goes on with its clock rounds (execute_inner): still busy.
                self.settling = c == ClusterCommand::Configure && outcome.is_ok();
                self.shared.update(|s| {
                    if !outcome.refusals.is_empty() {
                        let list: Vec<String> =
                            outcome.refusals.iter().map(|r| format!("{}: {}", r.name, r.error)).collect();
                        s.note(format!("{c} refused: {}", list.join("; ")));
                    }
                    if !outcome.no_answer.is_empty() {
                        s.note(format!("inactive (no answer to {c}): {}", outcome.no_answer.join(", ")));
                    }
                });
                self.finished.push(outcome);
            }
        }
        Ok(())
    }

    /// Copies the controller's view of the processes into the shared status.
    fn mirror(&self) {
        let busy = self.control.busy().map(|c| c.name().to_string());
        let busy = busy.or_else(|| self.settling.then(|| ClusterCommand::Configure.name().to_string()));
        let now = self.clock.now().as_nanos();
        self.shared.update(|s| {
            s.busy = busy;
            for v in self.control.processes() {
                if let Some(p) = s.process_mut(&v.name) {
                    p.state = v.state.map_or_else(|| "UNKNOWN".to_string(), |st| st.to_string());
                    if v.active && !p.active {
                        // Back (restarted, or answering again): its silence counts from
                        // now, not from its previous incarnation's last statistics (a
                        // fresh process must not look hung, let alone be killed for it).
                        p.stats_received_ns = Some(now);
                    }
                    p.active = v.active;
                    p.inactive_reason = v.inactive_reason.as_ref().map(|r| r.to_string());
                    p.not_answering =
                        matches!(v.inactive_reason, Some(shoal_core::cluster::InactiveReason::NoAnswer { .. }));
                    p.switched_off = v.switched_off;
                }
            }
        });
    }

    fn handle(&mut self, input: Incoming) {
        let t = self.clock.now();
        match input {
            Incoming::Reply(reply, text) => {
                if self.control.handle_reply(t, &reply) {
                    self.shared.update(|s| {
                        if let Some(p) = s.process_mut(&reply.name) {
                            p.last_reply = Some(text);
                        }
                    });
                }
            }
            Incoming::Report(r) => {
                // Only the cluster's own processes report, each as the role the file gives
                // it: anything else is refused, never part of the run record.
                if let Err(why) = report_belongs(&self.file, &r) {
                    warn!(process = %r.name, why, "an end-of-run report refused");
                    self.shared.update(|s| s.warn(format!("an end-of-run report for {:?} refused: {why}", r.name)));
                    return;
                }
                if self.control.run().is_some_and(|a| a.run == r.run) {
                    // A process asked again repeats its report: keep one per process.
                    self.reports.retain(|old| old.name != r.name);
                    self.reports.push(*r);
                }
            }
            Incoming::ListenerReconnected => self.control.handle_answers_missed(),
            Incoming::Left(name) => {
                self.clocks.forget(&name);
                self.control.handle_left(t, &name)
            }
            Incoming::Time(answer, arrived) => self.clocks.handle_answer(&answer, arrived),
            Incoming::Exited(name, how) => self.control.handle_exited(t, &name, &how),
        }
    }

    /// Waits for the next input or the controller's next timeout. Cancel-safe: nothing
    /// is taken or sent before it returns.
    async fn wait(&mut self) -> Wake {
        // The controller's next deadline or the clock watch's, whichever comes first.
        let due = self.control.poll_timeout().map_or(self.clocks.poll_timeout(), |t| t.min(self.clocks.poll_timeout()));
        let due = due.min(self.next_diagnosis);
        let deadline = self.clock.deadline(due);
        tokio::select! {
            input = self.incoming.recv() => input.map_or(Wake::Closed, Wake::Input),
            _ = tokio::time::sleep_until(deadline) => Wake::Timeout,
        }
    }

    /// Hands one wake-up to the controller and carries out what follows.
    async fn apply(&mut self, wake: Wake) -> anyhow::Result<()> {
        match wake {
            Wake::Input(i) => self.handle(i),
            Wake::Timeout => {
                let now = self.clock.now();
                if self.control.poll_timeout().is_some_and(|t| t <= now) {
                    self.control.handle_timeout(now);
                }
                self.clocks.handle_timeout(now);
                if self.next_diagnosis <= now {
                    self.diagnose();
                }
            }
            Wake::Closed => anyhow::bail!("run control's listener stopped"),
        }
        self.flush().await
    }

    async fn turn(&mut self) -> anyhow::Result<()> {
        let wake = self.wait().await;
        self.apply(wake).await
    }

    /// Lets the controller follow the cluster (replies, departures) until `until` is done.
    /// `until` is polled only between turns, so a publish is never cut in half.
    pub async fn follow_until<F: std::future::Future>(&mut self, until: F) -> anyhow::Result<F::Output> {
        tokio::pin!(until);
        loop {
            let wake = tokio::select! {
                out = &mut until => return Ok(out),
                wake = self.wait() => wake,
            };
            self.apply(wake).await?;
        }
    }

    /// Until every process announced itself or the announce time is over.
    pub async fn discover(&mut self) -> anyhow::Result<()> {
        self.flush().await?;
        while self.control.is_discovering() {
            self.turn().await?;
        }
        Ok(())
    }

    /// Carries out one cluster command and waits until every answer is in or overdue.
    pub async fn execute(&mut self, command: ClusterCommand) -> anyhow::Result<()> {
        self.shared.update(|s| s.note(format!("command {command}")));
        let result = self.execute_inner(command).await;
        self.shared.update(|s| match &result {
            Ok(()) => s.note(format!("{command} done: cluster {}", s.state)),
            Err(e) => s.note(format!("{command} failed: {e:#}")),
        });
        result
    }

    async fn execute_inner(&mut self, command: ClusterCommand) -> anyhow::Result<()> {
        self.finished.clear();
        let numbers = &self.numbers;
        self.control.handle_command(self.clock.now(), command, || numbers.take_next().map_err(|e| format!("{e:#}")))?;
        self.flush().await?;
        loop {
            if let Some(i) = self.finished.iter().position(|o| o.command == command) {
                let outcome = self.finished.swap_remove(i);
                if outcome.is_ok() {
                    if command == ClusterCommand::Configure {
                        let settled = self.settle_clocks().await;
                        self.settling = false;
                        self.mirror();
                        settled?;
                    }
                    return Ok(());
                }
                let list: Vec<String> = outcome.refusals.iter().map(|r| format!("{}: {}", r.name, r.error)).collect();
                anyhow::bail!("refused by {}", list.join("; "));
            }
            self.turn().await?;
        }
    }

    /// Writes the record of the run that just ended (every STOP answered or overdue, so
    /// the reports, published before the replies, are in).
    fn write_record(&mut self, run: u64, start_slice: u64, end_slice: u64) -> anyhow::Result<()> {
        let meta = self.run.take().unwrap_or(RunMeta { started: SystemTime::now(), config: String::new() });
        let reports = std::mem::take(&mut self.reports);
        self.mirror();
        let clocks = self.clocks.run_ended();
        let mut record = self.record(run, &meta, start_slice, end_slice, reports, clocks);
        // The problems seen during the run, then every lost slice's cause from the record
        // itself (what `shoal diagnose` does with any record).
        record.diagnosis.timeline = self.diagnoser.episodes_between(record.start_unix_ns, record.stop_unix_ns);
        let value = serde_json::to_value(&record)?;
        record.events_lost_with_writer = crate::diagnose::events_lost_with_writer(&value);
        match crate::diagnose::diagnose_record(&value) {
            Ok(d) => record.diagnosis = d,
            Err(e) => self.shared.update(|s| s.warn(format!("run {run} could not be diagnosed: {e:#}"))),
        }
        let dir = self.state_dir.join("runs");
        std::fs::create_dir_all(&dir)?;
        let path = dir.join(format!("run{:06}.json", record.run));
        std::fs::write(&path, serde_json::to_vec_pretty(&record)?)
            .with_context(|| format!("writing {}", path.display()))?;
        let brief = brief(&record);
        self.shared.update(|s| {
            s.run = None;
            s.run_started = None;
            s.note(format!(
                "run {} recorded in {}: {} complete, {} incomplete slices, ledger {}",
                record.run,
                path.display(),
                record.slices_complete,
                record.slices_incomplete,
                if record.ledger.balanced { "balanced" } else { "NOT balanced" }
            ));
            let d = &record.diagnosis.slices;
            if d.lost_slices > 0 {
                let top: Vec<String> = d
                    .causes
                    .iter()
                    .take(3)
                    .map(|c| format!("{} {} on {}", c.slices, c.rule, c.processes.join(",")))
                    .collect();
                s.note(format!(
                    "run {}: {} slices lost, {} unexplained; causes: {}",
                    record.run,
                    d.lost_slices,
                    d.unexplained,
                    top.join("; ")
                ));
            }
            s.history.insert(0, brief);
        });
        Ok(())
    }

    fn record(
        &self,
        run: u64,
        meta: &RunMeta,
        start_slice: u64,
        end_slice: u64,
        reports: Vec<NodeReport>,
        clocks: ClockRecord,
    ) -> RunRecord {
        let stopped = SystemTime::now();
        let archive = archive_of(&reports);
        let mut sources = BTreeMap::new();
        let mut builders = BTreeMap::new();
        for r in &reports {
            // Merged, not replaced: two processes hosting one source (a configuration
            // mismatch) both produced it, and the ledger must say so.
            for (id, t) in &r.source_tallies {
                sources.entry(*id).or_insert_with(shoal_core::ledger::SourceTally::default).merge(t);
            }
            if let Some((id, t)) = &r.builder {
                builders.insert(*id, t.clone());
            }
        }
        let reported: std::collections::BTreeSet<&str> = reports.iter().map(|r| r.name.as_str()).collect();
        let missing_reports = self
            .file
            .processes
            .iter()
            .filter(|p| p.role != Role::Writer && !reported.contains(p.name.as_str()))
            .map(|p| p.name.clone())
            .collect();
        // Processes that died during the run: their part is attributed, not unknown.
        let departures: Vec<_> = self.control.departures().iter().filter(|d| d.run == run).cloned().collect();
        let spec = |name: &str| self.file.processes.iter().find(|p| p.name == name);
        let mut dead_source_slices: BTreeMap<u32, u64> = BTreeMap::new();
        let mut dead_builders = std::collections::BTreeSet::new();
        for d in &departures {
            let Some(p) = spec(&d.name) else { continue };
            match d.role {
                Role::Source => {
                    let ids: Vec<u32> =
                        if p.ids.is_empty() { (0..self.file.config.run.sources).collect() } else { p.ids.clone() };
                    for id in ids {
                        *dead_source_slices.entry(id).or_default() += d.to_slice - d.from_slice;
                    }
                }
                Role::Builder => dead_builders.extend(p.ids.first().copied()),
                _ => {}
            }
        }
        Ledger::attribute_departed_sources(&mut sources, &builders, &dead_source_slices);
        let ledger = Ledger::combine_with_dead_builders(&sources, &builders, &dead_builders);
        let departures = departures
            .iter()
            .map(|d| {
                let rejoin = self.rejoins.iter().find(|(n, slice, _)| *n == d.name && *slice >= d.to_slice);
                DepartureRecord {
                    name: d.name.clone(),
                    role: d.role.name().to_string(),
                    from_slice: d.from_slice,
                    to_slice: d.to_slice,
                    left_unix_ns: d.at.as_nanos(),
                    reason: d.reason.to_string(),
                    rejoined_slice: rejoin.map(|r| r.1),
                    rejoined_unix_ns: rejoin.map(|r| r.2),
                }
            })
            .collect();
        RunRecord {
            run,
            cluster: self.file.cluster.name.clone(),
            start_time: humantime::format_rfc3339_millis(meta.started).to_string(),
            stop_time: humantime::format_rfc3339_millis(stopped).to_string(),
            start_unix_ns: unix_ns(meta.started),
            stop_unix_ns: unix_ns(stopped),
            start_slice,
            end_slice,
            configuration: meta.config.clone(),
            processes: self
                .control
                .processes()
                .iter()
                .map(|p| ProcessOutcome {
                    name: p.name.clone(),
                    role: p.role.name().to_string(),
                    final_state: p.state.map_or_else(|| "UNKNOWN".to_string(), |s| s.to_string()),
                    active: p.active,
                    inactive_reason: p.inactive_reason.as_ref().map(|r| r.to_string()),
                    ids: spec(&p.name).map(|s| s.ids.clone()).unwrap_or_default(),
                })
                .collect(),
            ledger: LedgerSummary::new(&ledger),
            missing_reports,
            departures,
            slices_complete: reports.iter().map(|r| r.slices_complete).sum(),
            slices_incomplete: reports.iter().map(|r| r.slices_incomplete).sum(),
            events: reports.iter().filter(|r| r.role == "builder").map(|r| r.events).sum(),
            events_stored: reports.iter().filter(|r| r.role == "writer").map(|r| r.events).sum(),
            reports,
            clocks,
            events_lost_with_writer: Vec::new(),
            archive,
            recoveries: self
                .recoveries
                .iter()
                .filter(|r| r.at_unix_ns >= unix_ns(meta.started) && r.at_unix_ns <= unix_ns(stopped))
                .cloned()
                .collect(),
            diagnosis: RunDiagnosis::default(),
            security: security_mode(&self.file),
            audit: self.audit.as_ref().map(|a| a.between(meta.started, stopped)).unwrap_or_default(),
        }
    }
}

/// The run's archive ledger from its writers' reports (summed: one writer, as a rule).
fn archive_of(reports: &[NodeReport]) -> Option<shoal_core::custody::ArchiveLedger> {
    let mut ledgers = reports.iter().filter(|r| r.role == "writer").filter_map(|r| {
        serde_json::from_value::<shoal_core::custody::ArchiveLedger>(r.detail.get("archive")?.clone()).ok()
    });
    let mut total = ledgers.next()?;
    ledgers.for_each(|l| total.absorb(l));
    Some(total)
}

/// The record's `security`: what protected the cluster.
pub fn security_mode(file: &ClusterFile) -> &'static str {
    if file.cluster.insecure {
        "insecure"
    } else if file.cluster.security.as_ref().is_some_and(|s| s.tokens.is_some()) {
        "tokens"
    } else {
        "loopback"
    }
}

/// The history line of a record.
pub fn brief(r: &RunRecord) -> RunBrief {
    RunBrief {
        run: r.run,
        start_time: r.start_time.clone(),
        seconds: (r.stop_unix_ns.saturating_sub(r.start_unix_ns)) as f64 * 1e-9,
        slices_complete: r.slices_complete,
        slices_incomplete: r.slices_incomplete,
        events: r.events,
        produced: r.ledger.produced,
        lost: r.ledger.buckets.iter().filter(|(k, _)| *k != "delivered" && *k != "cut_off").map(|(_, v)| v).sum(),
        balanced: r.ledger.balanced,
        inactive: r.processes.iter().filter(|p| !p.active).map(|p| p.name.clone()).collect(),
        archive: r.archive.clone(),
    }
}

/// Reads the history lines of the records already in `state_dir` (newest first).
pub fn load_history(state_dir: &std::path::Path, limit: usize) -> Vec<RunBrief> {
    let dir = state_dir.join("runs");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir).into_iter().flatten().flatten().map(|e| e.path()).collect();
    paths.sort();
    paths.reverse();
    paths
        .into_iter()
        .take(limit)
        .filter_map(|p| {
            let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).ok()?).ok()?;
            let get = |k: &str| v.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
            let ledger = v.get("ledger")?;
            let buckets = ledger.get("buckets")?.as_object()?;
            Some(RunBrief {
                run: get("run"),
                start_time: v.get("start_time")?.as_str()?.to_string(),
                seconds: get("stop_unix_ns").saturating_sub(get("start_unix_ns")) as f64 * 1e-9,
                slices_complete: get("slices_complete"),
                slices_incomplete: get("slices_incomplete"),
                events: get("events"),
                produced: ledger.get("produced")?.as_u64()?,
                lost: buckets
                    .iter()
                    .filter(|(k, _)| *k != "delivered" && *k != "cut_off")
                    .filter_map(|(_, n)| n.as_u64())
                    .sum(),
                balanced: ledger.get("balanced")?.as_bool()?,
                inactive: v
                    .get("processes")?
                    .as_array()?
                    .iter()
                    .filter(|p| p.get("active").and_then(|a| a.as_bool()) == Some(false))
                    .filter_map(|p| Some(p.get("name")?.as_str()?.to_string()))
                    .collect(),
                archive: v.get("archive").and_then(|a| serde_json::from_value(a.clone()).ok()),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_says_what_protected_the_cluster() {
        let mut file: ClusterFile = toml::from_str(
            "[cluster]\n[[process]]\nname = \"w\"\nrole = \"writer\"\n[config.run]\nsources = 0\nbuilders = 0\n",
        )
        .unwrap();
        assert_eq!(security_mode(&file), "loopback");
        file.cluster.security =
            Some(crate::security::SecuritySettings { tokens: Some("t".into()), ..Default::default() });
        assert_eq!(security_mode(&file), "tokens");
        file.cluster.insecure = true;
        assert_eq!(security_mode(&file), "insecure", "insecure wins: something is off loopback unauthenticated");
    }

    #[test]
    fn run_numbers_never_repeat_even_when_the_counter_is_lost() {
        let dir = std::env::temp_dir().join(format!("shoal-runnumbers-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("runs")).unwrap();
        let n = RunNumbers::new(&dir);
        assert_eq!(n.take_next().unwrap(), 1);
        assert_eq!(n.take_next().unwrap(), 2);
        // A fresh controller on the same directory continues.
        assert_eq!(RunNumbers::new(&dir).take_next().unwrap(), 3);
        // The counter file is lost but a record of run 7 exists.
        std::fs::remove_file(dir.join("last_run")).unwrap();
        std::fs::write(dir.join("runs/run000007.json"), "{}").unwrap();
        assert_eq!(n.take_next().unwrap(), 8);
        std::fs::write(dir.join("last_run"), "garbage").unwrap();
        assert!(n.take_next().is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
