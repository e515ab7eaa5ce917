//! A run-controlled process: one role (source, builder, writer or the data-flow manager of
//! a pull run) driven by run-control commands from the dispatcher instead of a fixed
//! configuration file.
//!
//! The process starts IDLE with no configuration. `CONFIGURE <toml>` hands it the run's
//! configuration (checked before the state changes: a configuration it cannot use is
//! refused and the state stays); `START <run> <first slice>` starts its data path with that
//! run number; `STOP` ends the data path the way the role needs (a source stops producing
//! and drains; the data-flow manager waits until every slice before the end slice is
//! assigned and processed; a builder waits for its sources' end of stream; the writer for
//! the builders'),
//! publishes the end-of-run [`NodeReport`] on `RC_END`, then answers `READY`. `PAUSE`
//! makes sources send empty fragments on the same schedule (builders see every slice, with
//! no hits). `OFF` stops a running data path first, then exits.
//!
//! Every `stats_interval` the process publishes [`NodeStats`] on `RC_STATS`, and it serves
//! Prometheus `/metrics` on its own HTTP port (announced in the statistics).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration as StdDuration;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use shoal_core::SourceId;
use shoal_core::alert::ALERT_REPLY_TAG;
use shoal_core::ledger::{BuilderTally, SourceTally};
use shoal_core::runstate::{Command, RunState};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::clock::WallClock;
use crate::config::Config;
use crate::live::Live;
use crate::rcagent::{Inbound, RC_REPORT, RC_STATS, RcAgent};
use crate::report::DelayStats;

pub use shoal_core::runstate::Role;

/// How a run-controlled process is started (the `shoal node --dispatcher ...` options).
#[derive(Clone, Debug)]
pub struct NodeOptions {
    pub role: Role,
    /// Process name: run-control target and dispatcher nickname.
    pub name: String,
    pub dispatcher: SocketAddr,
    /// Builder id or, for a source process, the source ids it hosts (empty: all).
    pub ids: Vec<u32>,
    /// A source process's `source.input` (this process's socket, overriding the run
    /// configuration's: e.g. each KM3NeT DataQueue process its own `clb:` port).
    pub input: Option<String>,
    /// Where to serve `/metrics` (`127.0.0.1:0`: any free port, announced in the stats).
    pub metrics: Option<SocketAddr>,
    pub stats_interval: StdDuration,
    /// The host's clock (with an error injected on purpose in tests: `WallClock::skewed`).
    pub clock: WallClock,
    /// This process's certificate for `[security] data` (`--credentials DIR`; none: the
    /// data path can only be `off`).
    pub credentials: crate::transport::secure::DataCredentials,
    /// The same certificate for the dispatcher (mutual TLS), on a secured cluster.
    pub control_tls: Option<shoal_dispatcher::client::ControlTls>,
    /// The Prometheus web configuration of `/metrics` (`--web-config FILE`: TLS, client
    /// certificates, basic-auth users).
    pub web_config: Option<Arc<shoal_tls::web::WebConfig>>,
}

/// Periodic statistics of one process (payload of `RC_STATS`, JSON). Counters are totals
/// since the process started; the delay percentiles cover the last interval only.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct NodeStats {
    pub name: String,
    pub role: String,
    pub state: String,
    pub run: Option<u64>,
    pub pid: u32,
    pub metrics_addr: Option<String>,
    /// UNIX ns when taken.
    pub time_ns: u64,
    pub fragments_produced: u64,
    pub fragments_received: u64,
    pub bytes_received: u64,
    pub slices_complete: u64,
    pub slices_incomplete: u64,
    pub events: u64,
    pub rejected_connections: u64,
    pub fragments_dropped_at_source: u64,
    pub fragments_discarded_at_builder: u64,
    /// Slices assembled but never filtered (a filter slower than the load).
    #[serde(default)]
    pub slices_not_filtered: u64,
    /// Time the filter spent on slices, ns (the process's clock).
    #[serde(default)]
    pub filter_busy_ns: u64,
    /// Of the fragments discarded: those the memory budget had no room for.
    #[serde(default)]
    pub fragments_refused_by_budget: u64,
    /// Fragments the burst rate cutoff replaced by empty markers (sources).
    #[serde(default)]
    pub fragments_cut_off: u64,
    /// Source processes: fragments reported written and the sum of their send
    /// completions (µs, from handing a fragment to its link to the link's report; their
    /// ratio over an interval is the mean, which a source behind with delayed
    /// transmission needs per fragment to catch up).
    #[serde(default)]
    pub send_completions: u64,
    #[serde(default)]
    pub send_completion_us: u64,
    /// The outgoing data links: connections lost, TCP segments sent and sent again,
    /// links stalled in retransmission timeouts now, datagrams sent and sent again on a
    /// NACK.
    #[serde(default)]
    pub link_failures: u64,
    #[serde(default)]
    pub tcp_segments_out: u64,
    #[serde(default)]
    pub tcp_retransmitted: u64,
    #[serde(default)]
    pub tcp_links_stalled: u64,
    #[serde(default)]
    pub udp_datagrams: u64,
    #[serde(default)]
    pub udp_retransmitted: u64,
    /// The writer's disk refused a write (0 or 1), and the time it spent writing, ns.
    #[serde(default)]
    pub storage_failed: u64,
    #[serde(default)]
    pub storage_busy_ns: u64,
    /// This process's shoal version, and a digest of the configuration it runs (the
    /// parts every process shares): processes that differ disagree on the run.
    #[serde(default)]
    pub version: String,
    #[serde(default)]
    pub config_digest: String,
    /// Source processes: the sources it hosts.
    #[serde(default)]
    pub hosted_sources: Vec<u32>,
    pub delay_p50_us: u64,
    pub delay_p99_us: u64,
    pub delay_max_us: u64,
    /// The latest times this process was not scheduled for 0.2 s or more (stopped, its
    /// CPU taken), on its clock, oldest first, and its time stalled in all, ns
    /// ([`crate::stallwatch`]).
    #[serde(default)]
    pub stalls: Vec<crate::stallwatch::Stall>,
    #[serde(default)]
    pub stalled_ns: u64,
}

/// A process's end-of-run report (payload of `RC_REPORT`, JSON): what run control needs
/// for the run's ledger, plus the role's full report as `detail`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct NodeReport {
    pub name: String,
    pub role: String,
    pub run: u64,
    /// Source processes: one tally per hosted source.
    pub source_tallies: BTreeMap<SourceId, SourceTally>,
    /// Builder processes: the builder id and its tally.
    pub builder: Option<(u32, BuilderTally)>,
    pub slices_complete: u64,
    pub slices_incomplete: u64,
    pub events: u64,
    pub bytes_received: u64,
    pub network_delay: Option<DelayStatsRecord>,
    /// The data path failed (the error) instead of ending normally.
    pub error: Option<String>,
    /// CPU this process ran and waited for over the run (absent where the kernel keeps no
    /// scheduler statistics).
    #[serde(default)]
    pub cpu: Option<crate::schedstat::CpuUse>,
    pub detail: serde_json::Value,
}

/// A builder's report as its node report's detail, with its steady delays' histogram as
/// `[µs, count]` pairs (`network_delay_steady_counts`): a cluster's builders pooled by
/// whoever reads the run record (the testbed). The embedded demo's summary leaves it out.
fn builder_detail(r: &crate::builder::BuilderReport) -> serde_json::Value {
    let mut detail = serde_json::to_value(r).unwrap_or_default();
    if let Some(map) = detail.as_object_mut() {
        map.insert(
            "network_delay_steady_counts".into(),
            serde_json::json!(crate::report::recorded_counts(&r.net_delay_steady_us)),
        );
    }
    detail
}

/// [`DelayStats`] in a form that can be read back.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DelayStatsRecord {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

impl From<DelayStats> for DelayStatsRecord {
    fn from(d: DelayStats) -> Self {
        Self { count: d.count, mean_us: d.mean_us, p50_us: d.p50_us, p99_us: d.p99_us, max_us: d.max_us }
    }
}

struct RunningData {
    run: u64,
    task: JoinHandle<NodeReport>,
    cancel: CancellationToken,
    /// When data taking started, and this process's scheduler times then.
    started: std::time::Instant,
    sched_at_start: Option<crate::schedstat::SchedTimes>,
}

/// Runs a run-controlled process until `OFF` (or `cancel`, e.g. Ctrl-C, which stops a
/// running data path first).
pub async fn run_controlled(opts: NodeOptions, cancel: CancellationToken) -> anyhow::Result<()> {
    let mut clock = opts.clock;
    let live = Arc::new(Live::default());
    let metrics_addr = match opts.metrics {
        Some(addr) => {
            let l = TcpListener::bind(addr).await.with_context(|| format!("binding the metrics port {addr}"))?;
            let local = l.local_addr()?;
            tokio::spawn(serve_metrics(l, opts.clone(), live.clone(), cancel.clone()));
            Some(local.to_string())
        }
        None => None,
    };
    let stall_watch = crate::stallwatch::StallWatch::start()
        .map_err(|e| warn!(error = %e, "no stall watch: stalls shorter than the hung threshold go unseen"))
        .ok();
    let mut agent = RcAgent::connect_with(opts.dispatcher, opts.control_tls.clone(), &opts.name, clock)
        .await
        .with_context(|| format!("connecting to the dispatcher at {}", opts.dispatcher))?;
    // Builders answer alerts: they arrive here and go to the running data path; what it
    // saved goes back on ALERT_RE.
    let mut alert_reports = live.alerts.reports.subscribe();
    if opts.role == Role::Builder {
        agent.subscribe_alerts().await?;
        // Monitoring taps: sampled raw slices and selected events, on a connection of
        // their own so a slow dispatcher never holds up commands.
        live.tap.open(opts.dispatcher, opts.control_tls.clone(), cancel.clone());
    }
    info!(name = %opts.name, role = opts.role.name(), "run-controlled process up");
    let mut config: Option<Config> = None;
    // What the statistics say of the configuration (for run control's config_mismatch).
    let mut configured: Option<Configured> = None;
    let mut running: Option<RunningData> = None;
    // The end-of-run report of the command carried out last: a repeat of that command
    // (run control did not see the answer) is answered again, not carried out again.
    let mut last_report: Option<Vec<u8>> = None;
    let mut tick = tokio::time::interval(opts.stats_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    loop {
        tokio::select! {
            inbound = agent.recv() => {
                let cmd = match inbound? {
                    Inbound::Command(c) => c,
                    Inbound::Alert(a) => {
                        on_alert(&opts, &mut agent, &live, running.is_some(), a).await?;
                        continue;
                    }
                };
                let command = match cmd {
                    Ok(c) => {
                        info!(name = %opts.name, command = c.name(), "run-control command");
                        c
                    }
                    Err(e) => {
                        agent.refuse(&e.to_string()).await?;
                        continue;
                    }
                };
                if agent.run_control().is_repeat(&command) {
                    info!(name = %opts.name, command = command.name(), "asked again: answering again");
                    if let Some(report) = &last_report {
                        agent.publish(RC_REPORT, report).await?;
                    }
                    agent.repeat_answer().await?;
                    continue;
                }
                if let Err(e) = agent.check(&command) {
                    agent.refuse(&e.to_string()).await?;
                    continue;
                }
                let mut report_sent = None;
                match &command {
                    Command::Configure(text) => match check_config(&opts, text) {
                        Ok((c, said)) => {
                            configured = Some(said);
                            config = Some(c);
                        }
                        Err(e) => {
                            agent.refuse(&format!("configuration refused: {e:#}")).await?;
                            continue;
                        }
                    },
                    Command::Start { run, start_slice } => {
                        let cfg = config.clone().expect("READY implies a configuration");
                        // The clock as run control corrected it; fixed for the run.
                        clock = agent.clock();
                        match start_data(&opts, cfg, *run, *start_slice, clock, live.clone()).await {
                            Ok(r) => running = Some(r),
                            Err(e) => {
                                agent.refuse(&format!("cannot start: {e:#}")).await?;
                                continue;
                            }
                        }
                    }
                    Command::Pause => live.paused.store(true, Ordering::Relaxed),
                    Command::Continue => live.paused.store(false, Ordering::Relaxed),
                    Command::Stop { .. } | Command::Off => {
                        if let Some(r) = running.take() {
                            let end_slice = match &command {
                                Command::Stop { end_slice } => *end_slice,
                                _ => None,
                            };
                            let report = stop_data(&opts, r, config.as_ref(), end_slice, &live, clock).await;
                            let report = serde_json::to_vec(&report)?;
                            agent.publish(RC_REPORT, &report).await?;
                            report_sent = Some(report);
                        }
                        live.paused.store(false, Ordering::Relaxed);
                    }
                    Command::Reset => {
                        config = None;
                        configured = None;
                    }
                    Command::Init | Command::Status => {}
                }
                let applied = agent.commit(command).await?;
                if applied.result.is_ok() && applied.command != Command::Status {
                    last_report = report_sent;
                }
                if applied.result.is_ok_and(|s| s == RunState::Off) {
                    info!(name = %opts.name, "OFF: exiting");
                    return Ok(());
                }
            }
            r = alert_reports.recv() => {
                if let Ok(report) = r {
                    agent.publish(ALERT_REPLY_TAG, &serde_json::to_vec(&report)?).await?;
                }
            }
            _ = tick.tick() => {
                let mut stats = snapshot(&opts, &agent, &live, metrics_addr.clone(), clock, configured.as_ref());
                if let Some(w) = &stall_watch {
                    let (stalls, total) = w.stalls(&clock);
                    (stats.stalls, stats.stalled_ns) = (stalls, total.as_nanos() as u64);
                }
                agent.publish(RC_STATS, &serde_json::to_vec(&stats)?).await?;
            }
            _ = cancel.cancelled() => {
                if let Some(r) = running.take() {
                    let report = stop_data(&opts, r, config.as_ref(), None, &live, clock).await;
                    let _ = agent.publish(RC_REPORT, &serde_json::to_vec(&report)?).await;
                }
                return Ok(());
            }
        }
    }
}

/// An `ALERT` for a builder: to the running data path, or answered at once when it cannot
/// be taken (malformed, or no run to save from).
async fn on_alert(
    opts: &NodeOptions,
    agent: &mut RcAgent,
    live: &Live,
    running: bool,
    alert: Result<shoal_core::alert::Alert, shoal_core::alert::AlertError>,
) -> anyhow::Result<()> {
    let refusal = match alert {
        Err(e) => format!("alert refused: {e}"),
        Ok(_) if !running => "alert refused: no run is taking data".to_string(),
        Ok(a) => {
            info!(name = %opts.name, %a, "alert received");
            if live.alerts.alerts.send(a).is_ok() {
                return Ok(());
            }
            "alert refused: the burst saver is disabled (saver.enabled = false)".to_string()
        }
    };
    warn!(name = %opts.name, "{refusal}");
    let reply = serde_json::json!({ "name": opts.name, "error": refusal });
    agent.publish(ALERT_REPLY_TAG, &serde_json::to_vec(&reply)?).await?;
    Ok(())
}

/// Cancels `cancel` when the process that started this one is gone: an orphan is
/// re-parented, so its parent id changes (checked every 250 ms). For processes `shoal run`
/// launches: a launcher killed with SIGKILL leaves no data path running without control;
/// each stops the way Ctrl-C stops it, within its drain time.
pub fn watch_parent(cancel: CancellationToken) {
    let parent = rustix::process::getppid();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(StdDuration::from_millis(250));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = cancel.cancelled() => return,
            }
            if rustix::process::getppid() != parent {
                warn!(?parent, "the process that started this one is gone; stopping");
                cancel.cancel();
                return;
            }
        }
    });
}

/// What a configured process says of its configuration in its statistics.
#[derive(Clone, Debug, Default)]
struct Configured {
    /// [`Config::digest`] of the text run control sent, as this process reads it.
    digest: String,
    hosted_sources: Vec<u32>,
}

/// Parses a `CONFIGURE` payload and checks that this process can play its part in it; with
/// what its statistics will say of it.
fn check_config(opts: &NodeOptions, text: &str) -> anyhow::Result<(Config, Configured)> {
    let mut cfg = Config::from_toml_str(text)?;
    // As read, before this process's own parts (its ids, its input) are filled in.
    let digest = cfg.digest();
    match opts.role {
        Role::Source => {
            if !opts.ids.is_empty() {
                cfg.source.ids = opts.ids.clone();
            }
            if let Some(input) = &opts.input {
                cfg.source.input = input.clone();
            }
        }
        Role::Builder => {
            if let Some(&id) = opts.ids.first() {
                cfg.builder.id = id;
            }
            cfg.probe_filter_plugin()?;
        }
        Role::Writer => {}
        Role::Dfm => {
            if cfg.policy()?.pull().is_none() {
                anyhow::bail!("the dfm role needs a pull policy (run.policy = {:?})", cfg.run.policy);
            }
            cfg.dfm_addr()?;
        }
    }
    cfg.validate()?;
    if cfg.security.data != shoal_tls::DataSecurity::Off && opts.credentials.is_empty() {
        anyhow::bail!(
            "security.data = {:?} but this process has no certificate: run control hands one out with \
             [cluster.security] ca_dir; by hand, `shoal node --credentials DIR` (docs/security.md)",
            cfg.security.data.as_str()
        );
    }
    cfg.security.credentials = opts.credentials.clone();
    crate::budget::apply_memory_plan(&mut cfg, opts.role)?;
    let hosted_sources = if opts.role == Role::Source { cfg.hosted_sources() } else { Vec::new() };
    Ok((cfg, Configured { digest, hosted_sources }))
}

async fn start_data(
    opts: &NodeOptions,
    mut cfg: Config,
    run: u64,
    start_slice: Option<u64>,
    clock: WallClock,
    live: Arc<Live>,
) -> anyhow::Result<RunningData> {
    cfg.run.run_number = run;
    cfg.run.start_slice = start_slice;
    // Run control decides when the run ends.
    cfg.run.seconds = 0.0;
    cfg.source.input_end_on_disconnect = false;
    cfg.writer.keep_existing = true;
    std::fs::create_dir_all(&cfg.writer.out_dir)
        .with_context(|| format!("creating {}", cfg.writer.out_dir.display()))?;
    let cancel = CancellationToken::new();
    let name = opts.name.clone();
    let started = std::time::Instant::now();
    let sched_at_start = crate::schedstat::SchedTimes::of_this_process();
    let base = NodeReport { name: name.clone(), role: opts.role.name().into(), run, ..Default::default() };
    let task = match opts.role {
        Role::Source => {
            let ids = cfg.hosted_sources();
            let c = cancel.clone();
            tokio::spawn(async move {
                match crate::source::run_source_node(cfg, ids, clock, live, c).await {
                    Ok(r) => NodeReport {
                        source_tallies: r.tallies.clone(),
                        detail: serde_json::to_value(&r).unwrap_or_default(),
                        ..base
                    },
                    Err(e) => NodeReport { error: Some(e.to_string()), ..base },
                }
            })
        }
        Role::Builder => {
            let addr = cfg.builder_listen()?;
            let listener =
                crate::builder::bind_port(&cfg, addr).with_context(|| format!("binding builder port {addr}"))?;
            let id = cfg.builder.id;
            let c = cancel.clone();
            tokio::spawn(async move {
                let settings = crate::builder::BuilderSettings::from_config(&cfg, id);
                let ran = match settings {
                    Ok(settings) => crate::builder::run_builder(settings, listener, clock, live, c).await,
                    Err(e) => Err(e),
                };
                match ran {
                    Ok(r) => NodeReport {
                        builder: Some((r.node.id, r.node.tally.clone())),
                        slices_complete: r.node.slices_complete,
                        slices_incomplete: r.node.slices_incomplete,
                        events: r.events,
                        bytes_received: r.node.bytes,
                        network_delay: Some(DelayStats::from_histogram(&r.net_delay_us).into()),
                        detail: builder_detail(&r),
                        ..base
                    },
                    Err(e) => NodeReport { error: Some(e.to_string()), ..base },
                }
            })
        }
        Role::Writer => {
            crate::writer::archiving::ensure_started(&cfg, &live);
            let addr = cfg.writer_listen()?;
            let listener =
                crate::transport::listen::bind(addr).with_context(|| format!("binding writer port {addr}"))?;
            let c = cancel.clone();
            tokio::spawn(async move {
                match crate::writer::run_writer_with(cfg, listener, c, live).await {
                    Ok(r) => NodeReport {
                        events: r.file.events,
                        error: r.error.clone(),
                        detail: serde_json::to_value(&r).unwrap_or_default(),
                        ..base
                    },
                    Err(e) => NodeReport { error: Some(format!("{e:#}")), ..base },
                }
            })
        }
        Role::Dfm => {
            let addr = cfg.dfm_addr()?;
            let listener = crate::transport::listen::bind(addr)
                .with_context(|| format!("binding the data-flow manager port {addr}"))?;
            let c = cancel.clone();
            tokio::spawn(async move {
                match crate::dfm::run_dfm(cfg, listener, clock, live, c).await {
                    Ok(r) => NodeReport {
                        error: (!r.done).then(|| "stopped before every slice was assigned and processed".into()),
                        detail: serde_json::to_value(&r).unwrap_or_default(),
                        ..base
                    },
                    Err(e) => NodeReport { error: Some(e.to_string()), ..base },
                }
            })
        }
    };
    info!(name = %name, run, ?start_slice, "data taking started");
    Ok(RunningData { run, task, cancel, started, sched_at_start })
}

/// Ends the data path: sources stop producing before `end_slice` (at once if `None`) and
/// drain; builders and the writer first wait for their upstream's end of stream (run
/// control stops the processes in data-flow order), then give up after a guard time.
async fn stop_data(
    opts: &NodeOptions,
    r: RunningData,
    cfg: Option<&Config>,
    end_slice: Option<u64>,
    live: &Live,
    clock: WallClock,
) -> NodeReport {
    let guard = match (opts.role, cfg, end_slice) {
        // Sources produce up to the end slice, then drain. The manager ends once every slice
        // before it is assigned and processed; the builders still run, so after the end
        // slice it waits their drain time.
        (Role::Source | Role::Dfm, Some(c), Some(end)) => {
            live.end_slice.store(end, Ordering::Relaxed);
            let until_end = c.slice_clock().map(|sc| sc.end_of(end.saturating_sub(1))).unwrap_or(clock.now());
            let wait = until_end.saturating_duration_since(clock.now());
            let drain_ms =
                if opts.role == Role::Source { c.source.drain_timeout_ms } else { c.builder.drain_timeout_ms };
            wait + StdDuration::from_millis(drain_ms + 2_000)
        }
        (Role::Source | Role::Dfm, _, _) => StdDuration::ZERO,
        (Role::Builder, Some(c), _) => StdDuration::from_millis(c.builder.drain_timeout_ms),
        (Role::Writer, Some(_), _) | (_, None, _) => StdDuration::from_secs(5),
    };
    let RunningData { run, mut task, cancel, started, sched_at_start } = r;
    let result = if guard.is_zero() {
        cancel.cancel();
        task.await
    } else {
        match tokio::time::timeout(guard, &mut task).await {
            Ok(r) => r,
            Err(_) => {
                warn!(name = %opts.name, ?guard, "upstream did not end its streams in time; stopping");
                cancel.cancel();
                task.await
            }
        }
    };
    live.end_slice.store(0, Ordering::Relaxed);
    let cpu = sched_at_start
        .zip(crate::schedstat::SchedTimes::of_this_process())
        .map(|(a, b)| crate::schedstat::CpuUse::between(a, b, started.elapsed()));
    let report = match result {
        Ok(report) => report,
        Err(e) => NodeReport {
            name: opts.name.clone(),
            role: opts.role.name().into(),
            run,
            error: Some(format!("data path panicked: {e}")),
            ..Default::default()
        },
    };
    NodeReport { cpu, ..report }
}

fn snapshot(
    opts: &NodeOptions,
    agent: &RcAgent,
    live: &Live,
    metrics_addr: Option<String>,
    clock: WallClock,
    configured: Option<&Configured>,
) -> NodeStats {
    let delays = live.take_delays().map(|h| DelayStats::from_histogram(&h)).unwrap_or_default();
    let paths = live.paths.sample();
    NodeStats {
        name: opts.name.clone(),
        role: opts.role.name().into(),
        state: agent.state().to_string(),
        run: agent.run_control().run(),
        pid: std::process::id(),
        metrics_addr,
        time_ns: clock.now().as_nanos(),
        fragments_produced: Live::get(&live.fragments_produced),
        fragments_received: Live::get(&live.fragments_received),
        bytes_received: Live::get(&live.bytes_received),
        slices_complete: Live::get(&live.slices_complete),
        slices_incomplete: Live::get(&live.slices_incomplete),
        events: Live::get(&live.events),
        rejected_connections: Live::get(&live.rejected_connections),
        fragments_dropped_at_source: Live::get(&live.fragments_dropped_at_source),
        fragments_discarded_at_builder: Live::get(&live.fragments_discarded_at_builder),
        slices_not_filtered: Live::get(&live.slices_not_filtered),
        filter_busy_ns: Live::get(&live.filter_busy_ns),
        fragments_refused_by_budget: Live::get(&live.fragments_refused_by_budget),
        fragments_cut_off: Live::get(&live.fragments_cut_off),
        send_completions: Live::get(&live.send_completions),
        send_completion_us: Live::get(&live.send_completion_us),
        link_failures: paths.link_failures,
        tcp_segments_out: paths.tcp_segments_out,
        tcp_retransmitted: paths.tcp_retransmitted,
        tcp_links_stalled: paths.tcp_links_stalled,
        udp_datagrams: paths.udp_datagrams,
        udp_retransmitted: paths.udp_retransmitted,
        storage_failed: Live::get(&live.storage_failed),
        storage_busy_ns: Live::get(&live.storage_busy_ns),
        version: env!("CARGO_PKG_VERSION").to_string(),
        config_digest: configured.map(|c| c.digest.clone()).unwrap_or_default(),
        hosted_sources: configured.map(|c| c.hosted_sources.clone()).unwrap_or_default(),
        delay_p50_us: delays.p50_us,
        delay_p99_us: delays.p99_us,
        delay_max_us: delays.max_us,
        stalls: Vec::new(),
        stalled_ns: 0,
    }
}

/// Prometheus text of a process's live counters (`shoal_node_*`, labelled by name and role).
pub fn metrics_text(opts: &NodeOptions, live: &Live) -> String {
    use prometheus_client::encoding::text::encode;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::registry::Registry;
    type Labels = Vec<(String, String)>;
    let labels: Labels = vec![("name".into(), opts.name.clone()), ("role".into(), opts.role.name().into())];
    let mut reg = Registry::default();
    let counters: [(&str, &str, &std::sync::atomic::AtomicU64); 14] = [
        ("shoal_node_fragments_produced", "Fragments produced by this process's sources", &live.fragments_produced),
        ("shoal_node_fragments_received", "Fragments accepted into slices", &live.fragments_received),
        ("shoal_node_bytes_received", "Bytes of accepted fragments", &live.bytes_received),
        ("shoal_node_slices_complete", "Slices processed with every fragment", &live.slices_complete),
        ("shoal_node_slices_incomplete", "Slices processed with fragments missing", &live.slices_incomplete),
        ("shoal_node_events", "Events selected by the filter", &live.events),
        ("shoal_node_rejected_connections", "Connections closed for bad input", &live.rejected_connections),
        (
            "shoal_node_fragments_dropped_at_source",
            "Fragments a source dropped or failed to send",
            &live.fragments_dropped_at_source,
        ),
        (
            "shoal_node_fragments_discarded_at_builder",
            "Fragments discarded by a builder (late, duplicate, overload, unknown source)",
            &live.fragments_discarded_at_builder,
        ),
        (
            "shoal_node_fragments_refused_by_budget",
            "Of the fragments discarded by a builder: those its memory budget had no room for",
            &live.fragments_refused_by_budget,
        ),
        (
            "shoal_node_slices_not_filtered",
            "Slices assembled but never filtered (the filter's queue full: a filter slower than the load)",
            &live.slices_not_filtered,
        ),
        ("shoal_node_alerts_answered", "Alerts this builder answered (saved what it held)", &live.alerts_answered),
        ("shoal_node_fragments_saved", "Fragments saved for alerts (to the raw file)", &live.fragments_saved),
        ("shoal_node_late_salvaged", "Late fragments kept in the late-data stream", &live.late_salvaged),
    ];
    for (name, help, value) in counters {
        let fam = Family::<Labels, Counter>::default();
        fam.get_or_create(&labels).inc_by(Live::get(value));
        reg.register(name, help, fam);
    }
    let tap = live.tap.stats();
    let paths = live.paths.sample();
    for (name, help, value) in [
        (
            "shoal_node_fragments_cut_off",
            "Fragments the burst rate cutoff replaced by empty markers",
            Live::get(&live.fragments_cut_off),
        ),
        (
            "shoal_node_send_completions",
            "Fragments this process's sources handed to their links and had reported written",
            Live::get(&live.send_completions),
        ),
        (
            "shoal_node_send_completion_us",
            "Sum of those fragments' times from hand-out to the link's report, us (over send_completions: the mean)",
            Live::get(&live.send_completion_us),
        ),
        (
            "shoal_node_link_failures",
            "Outgoing data connections lost while writing (peer gone or path cut)",
            paths.link_failures,
        ),
        ("shoal_node_tcp_segments_out", "TCP segments the outgoing data links sent", paths.tcp_segments_out),
        (
            "shoal_node_tcp_retransmitted",
            "TCP segments the outgoing data links sent again (the path lost or delayed them)",
            paths.tcp_retransmitted,
        ),
        ("shoal_node_udp_datagrams", "Datagrams the outgoing data links sent", paths.udp_datagrams),
        (
            "shoal_node_udp_retransmitted",
            "Datagrams sent again in answer to a NACK (the path lost them)",
            paths.udp_retransmitted,
        ),
        (
            "shoal_node_storage_busy_ns",
            "Time the writer's disk thread spent writing, ns",
            Live::get(&live.storage_busy_ns),
        ),
        (
            "shoal_node_page_faults",
            "Pages the kernel mapped into this process on first touch (minor faults since it started): a rate during a \
             run is its working set growing (run.prefault_mb maps it before)",
            crate::memory::minor_faults(),
        ),
        ("shoal_node_tap_published", "Monitoring tap messages published (SHL_EVT, SHL_RAW)", tap.published),
        (
            "shoal_node_tap_dropped",
            "Monitoring tap messages dropped (queue full or dispatcher lost)",
            tap.dropped + tap.failed,
        ),
    ] {
        let fam = Family::<Labels, Counter>::default();
        fam.get_or_create(&labels).inc_by(value);
        reg.register(name, help, fam);
    }
    for (name, help, value) in [
        (
            "shoal_node_tcp_links_stalled",
            "Outgoing TCP data links in retransmission timeouts now",
            paths.tcp_links_stalled,
        ),
        (
            "shoal_node_storage_failed",
            "1 when the writer's disk refused a write (what arrives is not stored)",
            Live::get(&live.storage_failed),
        ),
    ] {
        let fam = Family::<Labels, prometheus_client::metrics::gauge::Gauge>::default();
        fam.get_or_create(&labels).set(value as i64);
        reg.register(name, help, fam);
    }
    let held = Family::<Labels, prometheus_client::metrics::gauge::Gauge>::default();
    held.get_or_create(&labels).set(Live::get(&live.saver_bytes) as i64);
    reg.register(
        "shoal_node_saver_bytes",
        "Bytes the burst saver keeps alive (history and data waiting for disk)",
        held,
    );
    let h = live.delay_histogram.0.clone();
    let delays =
        Family::<Labels, prometheus_client::metrics::histogram::Histogram, _>::new_with_constructor(move || h.clone());
    // Created with the process's labels, so that the series exists before any delay.
    let _ = delays.get_or_create(&labels);
    reg.register(
        "shoal_node_fragment_delay_seconds",
        "Network delay of the fragments a builder received (send to complete arrival)",
        delays,
    );
    register_refusals(&mut reg, &labels);
    crate::archive::register_metrics(&mut reg, &labels, &live.archive);
    crate::writer::disk::register_metrics(&mut reg, &labels, live);
    let mut out = String::new();
    encode(&mut out, &reg).expect("writing to a String");
    out
}

/// Handshakes refused on this process's data ports, by reason (`[security] data`), and data
/// refused after them.
fn register_refusals(reg: &mut prometheus_client::registry::Registry, labels: &[(String, String)]) {
    use crate::transport::secure::{DATA_REFUSED, REFUSED};
    let by_reason = |counts: &[(&'static str, u64)]| {
        let fam = Family::<Vec<(String, String)>, Counter>::default();
        for (reason, n) in counts {
            let mut l = labels.to_vec();
            l.push(("reason".into(), reason.to_string()));
            fam.get_or_create(&l).inc_by(*n);
        }
        fam
    };
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    reg.register(
        "shoal_data_handshakes_refused",
        "Data connections refused in the handshake (security.data): no or a foreign certificate, another role's, expired, not TLS, too slow",
        by_reason(&REFUSED.snapshot()),
    );
    reg.register(
        "shoal_data_refused",
        "Data refused after the handshake: identity (an id the certificate does not hold, or a certificate naming no process of the cluster), window (a slice outside what the run can hold)",
        by_reason(&DATA_REFUSED.snapshot()),
    );
}

async fn serve_metrics(listener: TcpListener, opts: NodeOptions, live: Arc<Live>, cancel: CancellationToken) {
    use axum::{Router, extract::State, http::header, response::IntoResponse, routing::get};
    type S = (NodeOptions, Arc<Live>);
    async fn metrics(State((opts, live)): State<S>) -> impl IntoResponse {
        (
            [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
            metrics_text(&opts, &live),
        )
    }
    let web = opts.web_config.clone();
    let app = Router::new().route("/metrics", get(metrics)).with_state((opts, live));
    let limits = shoal_dispatcher::httpd::HttpLimits::default();
    let stats = Arc::new(shoal_dispatcher::httpd::HttpStats::default());
    if let Err(e) = shoal_dispatcher::httpd::serve_with(listener, app, limits, stats, "metrics", web, cancel).await {
        warn!(error = %e, "metrics server failed");
    }
}
