//! The controller: sends run-control commands in data-flow order, waits for the answers,
//! marks processes that do not answer as inactive, and keeps the run records.
//!
//! Two dispatcher connections: the controller's own (it publishes commands) and the
//! listener's ([`listen`]), which follows replies, statistics, end-of-run reports and the
//! dispatcher's `Died` announcements, updates the shared status, and hands replies and
//! reports to the controller over channels.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use serde::Serialize;
use shoal_core::controlhost::Mode;
use shoal_core::ledger::Ledger;
use shoal_core::runstate::{Command, Reply, RunState};
use shoal_dispatcher::client::ChClient;
use shoal_net::config::Config;
use shoal_net::demo::LedgerSummary;
use shoal_net::node::{NodeReport, NodeStats, Role};
use shoal_net::rcagent::{RC_CMD, RC_REPLY, RC_REPORT, RC_STATS};
use tokio::sync::mpsc;
use tracing::warn;

use super::cluster::ClusterFile;
use super::status::{Rates, RunBrief, Shared};

/// Follows the dispatcher for run control (see the module documentation).
pub async fn listen(
    mut client: ChClient,
    shared: Arc<Shared>,
    replies: mpsc::UnboundedSender<Reply>,
    reports: mpsc::UnboundedSender<NodeReport>,
) {
    let mut last_stats: HashMap<String, NodeStats> = HashMap::new();
    loop {
        let msg = match client.next_message().await {
            Ok(m) => m,
            Err(e) => {
                warn!(error = %e, "run control lost the dispatcher");
                shared.update(|s| s.note(format!("lost the dispatcher: {e}")));
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let tag = msg.tag.to_string();
        let text = String::from_utf8_lossy(&msg.payload);
        match tag.as_str() {
            RC_REPLY => {
                let Some(r) = Reply::parse(&text) else {
                    shared.update(|s| {
                        s.note(format!("unreadable reply {:?}", text.chars().take(80).collect::<String>()))
                    });
                    continue;
                };
                shared.update(|s| {
                    if let Some(p) = s.process_mut(&r.name) {
                        p.state = r.state.to_string();
                        p.last_reply = Some(text.to_string());
                        if r.state != RunState::Off {
                            p.active = true;
                            p.inactive_reason = None;
                        }
                    }
                });
                let _ = replies.send(r);
            }
            RC_STATS => {
                let Ok(stats) = serde_json::from_slice::<NodeStats>(&msg.payload) else { continue };
                let rates = last_stats.get(&stats.name).map(|prev| Rates::between(prev, &stats));
                shared.update(|s| {
                    if let Some(p) = s.process_mut(&stats.name) {
                        p.pid = Some(stats.pid);
                        p.metrics_addr = stats.metrics_addr.clone();
                        if let Some(r) = rates {
                            p.rates = r;
                        }
                        p.stats = Some(stats.clone());
                    }
                });
                last_stats.insert(stats.name.clone(), stats);
            }
            RC_REPORT => match serde_json::from_slice::<NodeReport>(&msg.payload) {
                Ok(r) => {
                    let _ = reports.send(r);
                }
                Err(e) => shared.update(|s| s.note(format!("unreadable end-of-run report: {e}"))),
            },
            "Died" => {
                let name = text.trim_end_matches('\0').to_string();
                shared.update(|s| {
                    if let Some(p) = s.process_mut(&name)
                        && !p.switched_off
                    {
                        p.active = false;
                        p.inactive_reason = Some("left the dispatcher".into());
                        s.note(format!("{name} left the dispatcher: inactive"));
                    }
                });
            }
            _ => {}
        }
    }
}

/// Subscribes the listener connection.
pub async fn subscribe_listener(client: &mut ChClient) -> anyhow::Result<()> {
    for (tag, mode) in [(RC_REPLY, Mode::All), (RC_REPORT, Mode::All), ("Died", Mode::All), (RC_STATS, Mode::Any)] {
        client.subscribe(tag, mode).await?;
    }
    client.set_nickname("runcontrol-listener").await?;
    Ok(())
}

/// A run in progress.
#[derive(Clone, Debug)]
struct ActiveRun {
    run: u64,
    start_slice: u64,
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
    pub slices_complete: u64,
    pub slices_incomplete: u64,
    pub events: u64,
    pub reports: Vec<NodeReport>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ProcessOutcome {
    pub name: String,
    pub role: String,
    pub final_state: String,
    pub active: bool,
    pub inactive_reason: Option<String>,
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

/// Sends commands and keeps the books of runs.
pub struct Controller {
    pub file: ClusterFile,
    client: ChClient,
    shared: Arc<Shared>,
    replies: mpsc::UnboundedReceiver<Reply>,
    reports: mpsc::UnboundedReceiver<NodeReport>,
    numbers: RunNumbers,
    state_dir: PathBuf,
    run: Option<ActiveRun>,
}

impl Controller {
    pub fn new(
        file: ClusterFile,
        client: ChClient,
        shared: Arc<Shared>,
        replies: mpsc::UnboundedReceiver<Reply>,
        reports: mpsc::UnboundedReceiver<NodeReport>,
    ) -> Self {
        let state_dir = file.cluster.state_dir.clone();
        Self { numbers: RunNumbers::new(&state_dir), state_dir, file, client, shared, replies, reports, run: None }
    }

    fn reply_timeout(&self) -> Duration {
        Duration::from_millis(self.file.cluster.reply_timeout_ms)
    }

    fn active(&self, role: Option<Role>) -> Vec<String> {
        let s = self.shared.snapshot();
        let roles: HashMap<&str, Role> = self.file.processes.iter().map(|p| (p.name.as_str(), p.role)).collect();
        s.processes
            .iter()
            .filter(|p| p.active && role.is_none_or(|r| roles.get(p.name.as_str()) == Some(&r)))
            .map(|p| p.name.clone())
            .collect()
    }

    /// Processes of the cluster file that are not active, with the reason.
    fn inactive(&self) -> Vec<String> {
        let s = self.shared.snapshot();
        s.processes
            .iter()
            .filter(|p| !p.active)
            .map(|p| format!("{}: {}", p.name, p.inactive_reason.as_deref().unwrap_or("inactive")))
            .collect()
    }

    /// Asks every process for its state (`* STATUS`): processes that were up before run
    /// control listened (started by systemd, `launch = "external"`) answer like new ones.
    async fn ask_status(&mut self) {
        let text = format!("* {}", Command::Status.to_text());
        if let Err(e) = self.client.publish(RC_CMD, text.as_bytes()).await {
            self.shared.update(|s| s.note(format!("cannot ask for the processes' states: {e}")));
        }
    }

    /// Waits until every process has announced itself (or `timeout`); the silent ones are
    /// marked inactive. Asks for the states at once and every half second, so processes
    /// that announced themselves before run control listened are found too.
    pub async fn await_announcements(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut next_ask = Instant::now();
        loop {
            if Instant::now() >= next_ask {
                self.ask_status().await;
                next_ask = Instant::now() + Duration::from_millis(500);
            }
            let s = self.shared.snapshot();
            let missing: Vec<String> =
                s.processes.iter().filter(|p| p.state == "UNKNOWN").map(|p| p.name.clone()).collect();
            if missing.is_empty() {
                self.shared.update(|s| s.note("every process announced itself"));
                return;
            }
            if Instant::now() >= deadline {
                self.shared.update(|s| {
                    for name in &missing {
                        if let Some(p) = s.process_mut(name) {
                            p.active = false;
                            p.inactive_reason = Some(format!("did not announce itself within {timeout:?}"));
                        }
                    }
                    s.note(format!("inactive (never announced): {}", missing.join(", ")));
                });
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends one command to each of `targets` (CONFIGURE gets each process's own
    /// configuration), then waits up to `timeout` for every answer. Processes that do not
    /// answer in time are marked inactive. Returns the refusals.
    async fn send_and_wait(&mut self, targets: &[String], command: &Command, timeout: Duration) -> Vec<String> {
        while self.replies.try_recv().is_ok() {}
        for name in targets {
            let text = format!("{name} {}", command.to_text());
            if let Err(e) = self.client.publish(RC_CMD, text.as_bytes()).await {
                self.shared.update(|s| s.note(format!("cannot send {} to {name}: {e}", command.name())));
            }
        }
        let mut waiting: Vec<String> = targets.to_vec();
        let mut refusals = Vec::new();
        let deadline = tokio::time::Instant::now() + timeout;
        while !waiting.is_empty() {
            match tokio::time::timeout_at(deadline, self.replies.recv()).await {
                Ok(Some(r)) => {
                    if let Some(i) = waiting.iter().position(|n| *n == r.name) {
                        waiting.swap_remove(i);
                        if let Some(e) = r.error {
                            refusals.push(format!("{}: {e}", r.name));
                        }
                    }
                }
                Ok(None) => break,
                Err(_) => break,
            }
        }
        if !waiting.is_empty() {
            let what = command.name();
            self.shared.update(|s| {
                for name in &waiting {
                    if let Some(p) = s.process_mut(name) {
                        p.active = false;
                        p.inactive_reason = Some(format!("no answer to {what} within {timeout:?}"));
                    }
                }
                s.note(format!("inactive (no answer to {what}): {}", waiting.join(", ")));
            });
        }
        if !refusals.is_empty() {
            self.shared.update(|s| s.note(format!("{} refused: {}", command.name(), refusals.join("; "))));
        }
        refusals
    }

    /// Carries out one cluster command (`INIT`, `CONFIGURE`, `START`, `PAUSE`, `CONTINUE`,
    /// `STOP`, `RESET`, `OFF`).
    pub async fn execute(&mut self, name: &str) -> anyhow::Result<()> {
        let name = name.trim().to_ascii_uppercase();
        self.shared.update(|s| {
            s.busy = Some(name.clone());
            s.note(format!("command {name}"));
        });
        let result = self.execute_inner(&name).await;
        self.shared.update(|s| {
            s.busy = None;
            match &result {
                Ok(()) => s.note(format!("{name} done: cluster {}", s.state)),
                Err(e) => s.note(format!("{name} failed: {e:#}")),
            }
        });
        result
    }

    async fn execute_inner(&mut self, name: &str) -> anyhow::Result<()> {
        let t = self.reply_timeout();
        let order = [Role::Writer, Role::Builder, Role::Source];
        match name {
            "INIT" | "PAUSE" | "CONTINUE" | "RESET" => {
                let cmd = Command::parse(name)?;
                let all = self.active(None);
                Self::check_refusals(self.send_and_wait(&all, &cmd, t).await)
            }
            "CONFIGURE" => {
                let text = self.file.config_text()?;
                let all = self.active(None);
                Self::check_refusals(self.send_and_wait(&all, &Command::Configure(text), t).await)
            }
            "START" => {
                if self.run.is_some() {
                    anyhow::bail!("a run is in progress");
                }
                let missing = self.inactive();
                if !missing.is_empty() && !self.file.cluster.start_with_missing {
                    anyhow::bail!(
                        "not starting: {} of {} processes inactive ({}); bring them back, or set \
                         cluster.start_with_missing = true to run without them",
                        missing.len(),
                        self.file.processes.len(),
                        missing.join(", ")
                    );
                }
                let run = self.numbers.take_next()?;
                // Every source begins with the same slice, far enough ahead for the START
                // to reach all of them.
                let slice_clock = self.file.config.slice_clock()?;
                let lead = t.min(Duration::from_secs(1));
                let now = shoal_core::Instant::from_nanos(unix_ns(SystemTime::now() + lead));
                let start_slice = slice_clock.slice_at(now) + 1;
                let cmd = Command::Start { run, start_slice: Some(start_slice) };
                self.run =
                    Some(ActiveRun { run, start_slice, started: SystemTime::now(), config: self.file.config_text()? });
                let started = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
                self.shared.update(|s| {
                    s.run = Some(run);
                    s.run_started = Some(started);
                });
                let mut refusals = Vec::new();
                // Downstream first, so the receivers listen before data arrives.
                for role in order {
                    let targets = self.active(Some(role));
                    refusals.extend(self.send_and_wait(&targets, &cmd, t).await);
                }
                Self::check_refusals(refusals)
            }
            "STOP" => self.stop().await,
            "OFF" => {
                if self.run.is_some() {
                    self.stop().await?;
                }
                // Upstream first, the reverse of START; to every process of the cluster, also
                // those marked inactive (a process that is alive but was not heard from must
                // not keep running a data path without control).
                for role in order.iter().rev() {
                    let targets: Vec<String> =
                        self.file.processes.iter().filter(|p| p.role == *role).map(|p| p.name.clone()).collect();
                    self.shared.update(|s| {
                        for p in s.processes.iter_mut().filter(|p| targets.contains(&p.name)) {
                            p.switched_off = true;
                        }
                    });
                    self.send_and_wait(&targets, &Command::Off, t).await;
                }
                Ok(())
            }
            other => anyhow::bail!("unknown command {other:?}"),
        }
    }

    fn check_refusals(refusals: Vec<String>) -> anyhow::Result<()> {
        if refusals.is_empty() { Ok(()) } else { anyhow::bail!("refused by {}", refusals.join("; ")) }
    }

    /// Stops the run in data-flow order (sources drain, builders finish, the writer
    /// closes its file), collects the end-of-run reports and writes the run record.
    async fn stop(&mut self) -> anyhow::Result<()> {
        let Some(active) = self.run.take() else { anyhow::bail!("no run in progress") };
        let cfg: &Config = &self.file.config;
        let t = self.reply_timeout();
        let waits = [
            (Role::Source, t + Duration::from_millis(cfg.source.drain_timeout_ms)),
            (Role::Builder, t + Duration::from_millis(cfg.builder.drain_timeout_ms)),
            (Role::Writer, t + Duration::from_secs(5)),
        ];
        // Every source produces up to the same slice, a little ahead so that the STOP
        // reaches all of them first; the builders and the writer finish behind them.
        let slice_clock = cfg.slice_clock()?;
        let lead = t.min(Duration::from_millis(500));
        let end_slice = slice_clock.slice_at(shoal_core::Instant::from_nanos(unix_ns(SystemTime::now() + lead))) + 1;
        let mut refusals = Vec::new();
        for (role, timeout) in waits {
            let targets = self.active(Some(role));
            let stop = Command::Stop { end_slice: (role == Role::Source).then_some(end_slice) };
            refusals.extend(self.send_and_wait(&targets, &stop, timeout + lead).await);
        }
        // Reports are published before the replies, so they are here by now.
        let mut reports = Vec::new();
        while let Ok(r) = self.reports.try_recv() {
            if r.run == active.run {
                reports.push(r);
            }
        }
        let record = self.record(&active, end_slice, reports);
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
            s.history.insert(0, brief);
        });
        Self::check_refusals(refusals)
    }

    fn record(&self, active: &ActiveRun, end_slice: u64, reports: Vec<NodeReport>) -> RunRecord {
        let stopped = SystemTime::now();
        let mut sources = BTreeMap::new();
        let mut builders = BTreeMap::new();
        for r in &reports {
            sources.extend(r.source_tallies.iter().map(|(k, v)| (*k, v.clone())));
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
        let ledger = Ledger::combine(&sources, &builders);
        let status = self.shared.snapshot();
        RunRecord {
            run: active.run,
            cluster: self.file.cluster.name.clone(),
            start_time: humantime::format_rfc3339_millis(active.started).to_string(),
            stop_time: humantime::format_rfc3339_millis(stopped).to_string(),
            start_unix_ns: unix_ns(active.started),
            stop_unix_ns: unix_ns(stopped),
            start_slice: active.start_slice,
            end_slice,
            configuration: active.config.clone(),
            processes: status
                .processes
                .iter()
                .map(|p| ProcessOutcome {
                    name: p.name.clone(),
                    role: p.role.clone(),
                    final_state: p.state.clone(),
                    active: p.active,
                    inactive_reason: p.inactive_reason.clone(),
                })
                .collect(),
            ledger: LedgerSummary::new(&ledger),
            missing_reports,
            slices_complete: reports.iter().map(|r| r.slices_complete).sum(),
            slices_incomplete: reports.iter().map(|r| r.slices_incomplete).sum(),
            events: reports.iter().filter(|r| r.role == "builder").map(|r| r.events).sum(),
            reports,
        }
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
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
