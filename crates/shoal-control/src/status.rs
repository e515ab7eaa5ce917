//! What run control knows about the cluster, shared between the controller, the dispatcher
//! listener and the HTTP API (which pushes it to the web UI on every change).

use std::collections::VecDeque;
use std::sync::{Arc, RwLock};

use serde::Serialize;
use shoal_net::node::NodeStats;

/// One process as the UI shows it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ProcStatus {
    pub name: String,
    pub role: String,
    pub host: String,
    pub pid: Option<u32>,
    /// Last state the process reported (`UNKNOWN` before it announced itself).
    pub state: String,
    /// Answered the last command in time and is still connected.
    pub active: bool,
    pub inactive_reason: Option<String>,
    /// Inactive because it did not answer a command in time (connected but silent: hung),
    /// not gone.
    #[serde(default)]
    pub not_answering: bool,
    /// Run control told it OFF: leaving the dispatcher and exiting is expected now.
    pub switched_off: bool,
    pub last_reply: Option<String>,
    pub metrics_addr: Option<String>,
    pub stats: Option<NodeStats>,
    /// When its last statistics arrived (run control's clock, UNIX ns).
    pub stats_received_ns: Option<u64>,
    pub rates: Rates,
    /// Its clock as run control measured it (docs/clocks.md).
    pub clock: Option<crate::clocks::ProcessClock>,
}

/// Per-second rates from the last two statistics of a process.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Rates {
    pub fragments_produced_per_s: f64,
    pub slices_complete_per_s: f64,
    pub slices_incomplete_per_s: f64,
    pub mbytes_per_s: f64,
    pub events_per_s: f64,
    pub drops_per_s: f64,
}

impl Rates {
    pub fn between(a: &NodeStats, b: &NodeStats) -> Rates {
        let dt = (b.time_ns.saturating_sub(a.time_ns)) as f64 * 1e-9;
        if dt <= 0.0 {
            return Rates::default();
        }
        let r = |x: u64, y: u64| y.saturating_sub(x) as f64 / dt;
        Rates {
            fragments_produced_per_s: r(a.fragments_produced, b.fragments_produced),
            slices_complete_per_s: r(a.slices_complete, b.slices_complete),
            slices_incomplete_per_s: r(a.slices_incomplete, b.slices_incomplete),
            mbytes_per_s: r(a.bytes_received, b.bytes_received) / 1e6,
            events_per_s: r(a.events, b.events),
            drops_per_s: r(
                a.fragments_dropped_at_source + a.fragments_discarded_at_builder,
                b.fragments_dropped_at_source + b.fragments_discarded_at_builder,
            ),
        }
    }
}

/// A finished run, as listed in the history.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct RunBrief {
    pub run: u64,
    pub start_time: String,
    pub seconds: f64,
    pub slices_complete: u64,
    pub slices_incomplete: u64,
    pub events: u64,
    pub produced: u64,
    pub lost: u64,
    pub balanced: bool,
    pub inactive: Vec<String>,
    /// The run's files in the archive at its end (`writer.archive`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub archive: Option<shoal_core::custody::ArchiveLedger>,
}

/// The cluster as a whole.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ClusterStatus {
    pub cluster: String,
    /// What protects the cluster: `tokens`, `loopback` or `insecure` (docs/security.md).
    pub security: String,
    /// The common state of the active processes, `MIXED` when they differ.
    pub state: String,
    /// The command being carried out, if any.
    pub busy: Option<String>,
    pub run: Option<u64>,
    pub run_started: Option<String>,
    pub processes: Vec<ProcStatus>,
    pub history: Vec<RunBrief>,
    /// The started dispatcher's `/status` and `/metrics` address.
    pub dispatcher_metrics: Option<String>,
    /// Recent run-control messages, newest last.
    pub log: VecDeque<String>,
    /// The time of this snapshot, UNIX ms.
    pub time_ms: u64,
    /// The builders' answers to the latest alerts (newest first, at most 50).
    pub alerts: VecDeque<serde_json::Value>,
    /// The tolerance rule on the data processes' clocks, after the latest round.
    pub clock_verdict: Option<shoal_core::clocksync::ClockVerdict>,
    /// The problems the diagnosis rules see now, highest priority first (docs/monitoring.md).
    pub problems: Vec<shoal_core::diagnosis::Episode>,
    /// The latest problems, on or over, oldest first (at most 100).
    pub problem_timeline: Vec<shoal_core::diagnosis::Episode>,
    /// Run control's dispatcher exited and is not back yet (why).
    pub dispatcher_down: Option<String>,
    /// How often it exited.
    pub dispatcher_exits: u64,
}

impl ClusterStatus {
    pub fn process_mut(&mut self, name: &str) -> Option<&mut ProcStatus> {
        self.processes.iter_mut().find(|p| p.name == name)
    }

    pub fn update_overall(&mut self) {
        // An inactive process's last rates are history, not its present.
        for p in self.processes.iter_mut().filter(|p| !p.active) {
            p.rates = Rates::default();
        }
        let mut states = self.processes.iter().filter(|p| p.active).map(|p| p.state.as_str());
        self.state = match states.next() {
            None => "NO PROCESS".into(),
            Some(first) if states.all(|s| s == first) => first.to_string(),
            Some(_) => "MIXED".into(),
        };
    }

    pub fn note(&mut self, text: impl Into<String>) {
        let text = text.into();
        tracing::info!("{text}");
        self.keep(text);
    }

    /// A note that is also a warning in run control's log (something went wrong and was
    /// repaired: an operator looking at the log later wants to see it).
    pub fn warn(&mut self, text: impl Into<String>) {
        let text = text.into();
        tracing::warn!("{text}");
        self.keep(text);
    }

    fn keep(&mut self, text: String) {
        self.log.push_back(format!("{} {text}", humantime::format_rfc3339_seconds(std::time::SystemTime::now())));
        while self.log.len() > 200 {
            self.log.pop_front();
        }
    }
}

/// The shared status plus a change counter the WebSocket clients wait on.
#[derive(Debug)]
pub struct Shared {
    status: RwLock<ClusterStatus>,
    changed: tokio::sync::watch::Sender<u64>,
}

impl Shared {
    pub fn new(status: ClusterStatus) -> Arc<Self> {
        Arc::new(Self { status: RwLock::new(status), changed: tokio::sync::watch::channel(0).0 })
    }

    /// Changes the status and wakes the watchers.
    pub fn update<R>(&self, f: impl FnOnce(&mut ClusterStatus) -> R) -> R {
        let r = {
            let mut s = self.status.write().unwrap_or_else(|e| e.into_inner());
            let r = f(&mut s);
            s.update_overall();
            r
        };
        self.changed.send_modify(|v| *v += 1);
        r
    }

    pub fn snapshot(&self) -> ClusterStatus {
        let mut s = self.status.read().unwrap_or_else(|e| e.into_inner()).clone();
        s.time_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        s
    }

    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }
}
