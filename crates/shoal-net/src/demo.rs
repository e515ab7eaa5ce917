//! The whole chain in one process: writer, builders and source nodes on real loopback TCP,
//! with the same code the separate processes run.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration as StdDuration;

use shoal_core::SourceId;
use shoal_core::ledger::{BuilderTally, Ledger, SourceTally};
use shoal_core::loghist::LogHistogram;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::builder::{BuilderReport, BuilderSettings, run_builder};
use crate::clock::WallClock;
use crate::config::Config;
use crate::dfm::{DfmReport, run_dfm};
use crate::live::Live;
use crate::report::{DelayStats, new_histogram};
use crate::source::run_source_node;
use crate::writer::{WriterReport, run_writer};

const LOOPBACK_ANY: std::net::SocketAddr =
    std::net::SocketAddr::V4(std::net::SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 0));

/// The outcome of a run, printed by `shoal demo` and written as `run{N:06}.summary.json`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RunSummary {
    pub run: u64,
    pub policy: String,
    /// `tcp` or `udp`.
    pub transport: String,
    /// `[security] data`: `off`, `authenticated` or `tls`.
    pub data_security: String,
    /// The process's CPU seconds from the first slice's start to the end (set-up and the
    /// data path's handshakes before it left out).
    pub cpu_s_from_first_slice: f64,
    pub sources: u32,
    pub builders: u32,
    /// Sources hosted per source process (sharing one connection per builder).
    pub sources_per_node: usize,
    pub slice_ms: u64,
    pub seconds: f64,
    pub slices_produced: u64,
    pub slices_complete: u64,
    pub slices_incomplete: u64,
    pub incomplete_reasons: BTreeMap<String, u64>,
    pub fragments_received: u64,
    pub bytes_received: u64,
    /// Hits in the fragments accepted into slices (the filter's input).
    pub hits_received: u64,
    /// What the sources generated, in words.
    pub workload: String,
    /// The sources computed their hits during the run ([`crate::config::Config::generates_hits_live`]).
    pub generated_live: bool,
    /// Bytes received over the time from the first to the last arrival.
    pub mbytes_per_s: f64,
    pub network_delay: DelayStats,
    pub shaping_delay: DelayStats,
    /// The sources' time from handing a fragment to its link to the link's report that
    /// the kernel took it: a full socket buffer (a builder reading slowly) or a process
    /// short of CPU. With delayed transmission it is what a source that is behind needs
    /// per fragment to catch up.
    pub send_completion: DelayStats,
    pub rejected_connections: BTreeMap<String, u64>,
    pub late_slice_ends: u64,
    /// The latest slice end (ms late) and when it was (s into the run), over every node.
    #[serde(default)]
    pub worst_late_ms: f64,
    #[serde(default)]
    pub worst_late_at_s: f64,
    /// Slices skipped by the most-behind source node (reached more than
    /// `source.max_lag_ms` late: the machine could not generate the load in real time).
    pub slices_skipped: u64,
    /// Fragments dropped at the sources because their memory share was full (part of
    /// the ledger's `dropped_at_source`).
    pub dropped_over_memory: u64,
    /// The process's memory budget and what its queues' bounds add up to, MiB.
    pub memory_budget_mb: u64,
    pub memory_planned_mb: u64,
    /// Each builder's memory (`builder.memory_budget_mb`, or the demo's share), MiB.
    #[serde(default)]
    pub builder_memory_mb: u64,
    /// Memory mapped before the run (`run.prefault_mb`), MiB, and the seconds it took.
    #[serde(default)]
    pub prefaulted_mb: u64,
    #[serde(default)]
    pub prefault_s: f64,
    /// Pages the kernel mapped on first touch during the run (minor faults, after the
    /// prefault): the working set growing while the data flowed.
    #[serde(default)]
    pub page_faults: u64,
    pub events: u64,
    pub ledger: LedgerSummary,
    pub writer: WriterReport,
    pub builder_reports: Vec<BuilderReport>,
    /// Pull runs: the data-flow manager's report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dfm: Option<DfmReport>,
    /// KM3NeT mode: the sources' DataQueues and the builders' outputs, summed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clb: Option<shoal_core::km3net::dataqueue::DataQueueReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub km3net: Option<crate::builder::km3out::Km3OutReport>,
    pub summary_path: PathBuf,
    /// This process's peak resident memory (VmHWM), MB.
    pub peak_rss_mb: f64,
}

/// This process's peak resident set (`VmHWM` of /proc/self/status), MB; 0 if unknown.
pub fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb * 1024.0 / 1e6)
}

/// The ledger as written to JSON.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct LedgerSummary {
    pub produced: u64,
    pub buckets: BTreeMap<String, u64>,
    pub unaccounted: i128,
    pub excess_received: u64,
    pub tally_errors: i128,
    pub balanced: bool,
}

impl LedgerSummary {
    pub fn new(l: &Ledger) -> Self {
        Self {
            produced: l.produced,
            buckets: l.buckets().map(|(b, n)| (b.name().to_string(), n)).collect(),
            unaccounted: l.unaccounted(),
            excess_received: l.excess_received,
            tally_errors: l.tally_errors,
            balanced: l.is_balanced(),
        }
    }
}

/// `builder.memory_budget_mb` for this run's builders sharing this process
/// ([`crate::budget::shared_builder_memory_mb`]), when the configured value does not fit;
/// planned as [`run_embedded`] plans, with the burst savers' history shared.
pub fn shared_builder_memory_mb(cfg: &Config) -> Result<Option<u64>, crate::config::ConfigError> {
    let mut cfg = cfg.clone();
    cfg.share_saver_history();
    let hosting = crate::budget::embedded_hosting(cfg.run.sources, cfg.run.builders, raise_fd_limit());
    crate::budget::shared_builder_memory_mb(&cfg, &hosting)
}

/// Raises the soft open-file limit to the hard limit; returns the limit in force.
pub fn raise_fd_limit() -> u64 {
    rlimit::increase_nofile_limit(u64::MAX).unwrap_or(1024)
}

/// Runs writer, builders and sources in this process. `cancel` (e.g. Ctrl-C) ends data
/// taking early; the chain then drains normally.
pub async fn run_embedded(mut cfg: Config, live: Arc<Live>, cancel: CancellationToken) -> anyhow::Result<RunSummary> {
    cfg.validate()?;
    cfg.probe_filter_plugin()?;
    cfg.share_saver_history();
    // Every role in one process: a throw-away CA and a certificate per role, so that each
    // port still checks the role it takes.
    if cfg.security.data != shoal_tls::DataSecurity::Off && cfg.security.credentials.is_empty() {
        cfg.security.credentials = crate::transport::secure::DataCredentials::ephemeral()?;
        // Each of those certificates is named for its role and speaks for all of it.
        cfg.security.peers =
            crate::transport::secure::DataCredentials::ephemeral_peers(cfg.run.sources, cfg.run.builders);
    }
    if cfg.security.data != shoal_tls::DataSecurity::Off && cfg.security.udp_key.is_empty() {
        cfg.security.udp_key = crate::transport::udp::mac::DatagramMac::new_key_hex()?;
    }
    let clock = WallClock::new();
    let fd_limit = raise_fd_limit();
    // An input socket (`source.input`) feeds one node: every source in it.
    let per_node = match cfg.input()? {
        crate::config::InputKind::Generator => {
            crate::budget::sources_per_node(cfg.run.sources, cfg.run.builders, fd_limit)
        }
        _ => cfg.hosted_sources().len().max(1),
    };
    let builders = cfg.run.builders;
    let plan = crate::budget::plan(&cfg, |n| crate::budget::embedded_hosting(n, builders, fd_limit))?;
    crate::budget::apply(&mut cfg, &plan);
    info!("{}", crate::budget::describe(&plan));
    // Before the run's first slice is chosen below, so that it does not eat the start's lead.
    let prefaulted = crate::memory::prefault_configured(cfg.run.prefault_mb);
    let faults_at_start = crate::memory::minor_faults();
    let lead_ms = handshake_lead_ms(&cfg, per_node);
    let ports = Ports::bind(&mut cfg, clock, lead_ms)?;
    let cpu_at_first_slice = cpu_at(clock, cfg.slice_clock()?.start_of(cfg.run.start_slice.unwrap_or(0)));

    let dfm_cancel = CancellationToken::new();
    let dfm = ports.dfm.map(|l| tokio::spawn(run_dfm(cfg.clone(), l, clock, live.clone(), dfm_cancel.clone())));
    let writer_cancel = CancellationToken::new();
    let writer = tokio::spawn(run_writer(cfg.clone(), ports.writer, writer_cancel.clone()));
    let builder_cancel = CancellationToken::new();
    let builders: Vec<_> = ports
        .builders
        .into_iter()
        .enumerate()
        .map(|(id, l)| {
            let (settings, live, cancel) =
                (BuilderSettings::from_config(&cfg, id as u32), live.clone(), builder_cancel.clone());
            tokio::spawn(async move { run_builder(settings?, l, clock, live, cancel).await })
        })
        .collect();
    let ids = cfg.hosted_sources();
    let nodes: Vec<_> = ids
        .chunks(per_node)
        .map(|chunk| tokio::spawn(run_source_node(cfg.clone(), chunk.to_vec(), clock, live.clone(), cancel.clone())))
        .collect();
    info!(nodes = nodes.len(), per_node, fd_limit, "embedded run started");

    let sources = SourcesDone::collect(nodes).await?;
    // Sources are done and their links closed; builders finish when every source's end of
    // stream has arrived. A guard in case a stream end was lost:
    let guard = StdDuration::from_millis(cfg.builder.drain_timeout_ms + cfg.builder.wall_timeout_ms);
    let builder_reports = within(guard, &builder_cancel, "builders did not finish in time; stopping them", async {
        let mut reports = Vec::new();
        for b in builders {
            reports.push(b.await??);
        }
        anyhow::Ok(reports)
    })
    .await?;
    // The manager is done once every slice is processed; if a builder's last credits never
    // came back, it stops with the builders.
    dfm_cancel.cancel();
    let dfm = match dfm {
        Some(t) => Some(t.await??),
        None => None,
    };
    let writer = within(StdDuration::from_secs(30), &writer_cancel, "the writer did not finish in time", async {
        anyhow::Ok(writer.await??)
    })
    .await?;

    let SourcesDone { tallies, slices_produced, late_slice_ends, .. } = &sources;
    let mut summary = summarize(&cfg, per_node, *slices_produced, *late_slice_ends, tallies, builder_reports, writer);
    sources.fill(&mut summary);
    summary.dfm = dfm;
    summary.memory_budget_mb = plan.memory.budget >> 20;
    summary.memory_planned_mb = plan.memory.total() >> 20;
    summary.builder_memory_mb = cfg.builder.memory_budget_mb;
    summary.page_faults = crate::memory::minor_faults().saturating_sub(faults_at_start);
    summary.cpu_s_from_first_slice = process_cpu_s() - cpu_at_first_slice.await.unwrap_or(f64::NAN);
    if let Some(p) = prefaulted {
        summary.prefaulted_mb = p.bytes >> 20;
        summary.prefault_s = p.took.as_secs_f64();
    }
    write_summary(&cfg, &mut summary)?;
    Ok(summary)
}

/// The embedded run's ports on loopback, their addresses written into the configuration
/// every role then derives its settings from; and the run's first slice, a little ahead
/// of now so that every source node is up by then.
struct Ports {
    writer: tokio::net::TcpListener,
    builders: Vec<crate::transport::listen::DataPort>,
    /// Pull: the data-flow manager, on a port of its own.
    dfm: Option<tokio::net::TcpListener>,
}

/// The process's user and system CPU seconds so far.
pub fn process_cpu_s() -> f64 {
    use nix::sys::resource::{UsageWho, getrusage};
    let Ok(u) = getrusage(UsageWho::RUSAGE_SELF) else { return f64::NAN };
    let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
    t(u.user_time()) + t(u.system_time())
}

/// The process's CPU seconds at `at` (read by a task that sleeps until then).
fn cpu_at(clock: WallClock, at: shoal_core::Instant) -> tokio::task::JoinHandle<f64> {
    tokio::spawn(async move {
        let wait = at.saturating_duration_since(clock.now());
        tokio::time::sleep(wait).await;
        process_cpu_s()
    })
}

/// Time for a secured run's handshakes before its first slice: about 1 ms of CPU per
/// connection (both ends; `tls-bench handshakes` measures 0.8) spread over the machine's
/// cores, so that the handshakes of thousands of links are made before the data begins.
fn handshake_lead_ms(cfg: &Config, sources_per_node: usize) -> u64 {
    if cfg.security.data == shoal_tls::DataSecurity::Off {
        return 0;
    }
    let nodes = cfg.run.sources.div_ceil(sources_per_node.max(1) as u32);
    let links = u64::from(nodes) * u64::from(cfg.run.builders) + u64::from(cfg.run.builders);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    links / cores
}

impl Ports {
    fn bind(cfg: &mut Config, clock: WallClock, lead_ms: u64) -> anyhow::Result<Self> {
        let writer = crate::transport::listen::bind(LOOPBACK_ANY)?;
        cfg.run.writer_addr = writer.local_addr()?.to_string();
        let mut builders = Vec::new();
        cfg.run.builder_addrs.clear();
        for _ in 0..cfg.run.builders {
            let l = crate::builder::bind_port(cfg, LOOPBACK_ANY)?;
            cfg.run.builder_addrs.push(l.local_addr()?.to_string());
            builders.push(l);
        }
        if cfg.run.start_slice.is_none() {
            let slice_clock = cfg.slice_clock()?;
            let ahead = clock.now() + shoal_core::Duration::from_millis(200 + lead_ms);
            cfg.run.start_slice = Some(slice_clock.slice_at(ahead) + 1);
        }
        let dfm = match cfg.policy()?.pull() {
            Some(_) => {
                let l = crate::transport::listen::bind(LOOPBACK_ANY)?;
                cfg.run.dfm_addr = l.local_addr()?.to_string();
                Some(l)
            }
            None => None,
        };
        Ok(Self { writer, builders, dfm })
    }
}

/// What the source nodes reported, added up.
#[derive(Default)]
struct SourcesDone {
    tallies: BTreeMap<SourceId, SourceTally>,
    slices_produced: u64,
    late_slice_ends: u64,
    slices_skipped: u64,
    dropped_over_memory: u64,
    /// The worst slice end's lateness and when in the run it came (ns).
    worst_late: (u64, u64),
    clb: Option<shoal_core::km3net::dataqueue::DataQueueReport>,
    send_completion: LogHistogram,
}

impl SourcesDone {
    async fn collect(
        nodes: Vec<tokio::task::JoinHandle<Result<crate::source::SourceReport, crate::config::ConfigError>>>,
    ) -> anyhow::Result<Self> {
        let mut done = Self::default();
        for n in nodes {
            let r = n.await??;
            done.send_completion.merge(&r.send_completion_us);
            debug!(
                sources = ?r.tallies.keys().collect::<Vec<_>>(),
                send_completion = ?DelayStats::from_log(&r.send_completion_us),
                late_slice_ends = r.late_slice_ends,
                worst_late_ms = r.worst_late_ns / 1_000_000,
                dropped_over_memory = r.dropped_over_memory,
                "source node report"
            );
            if let Some(c) = &r.clb {
                done.clb.get_or_insert_with(Default::default).merge(c);
            }
            done.slices_produced = done.slices_produced.max(r.slices);
            done.late_slice_ends += r.late_slice_ends;
            done.worst_late = done.worst_late.max((r.worst_late_ns, r.worst_late_into_run_ns));
            done.slices_skipped = done.slices_skipped.max(r.slices_skipped);
            done.dropped_over_memory += r.dropped_over_memory;
            done.tallies.extend(r.tallies);
        }
        Ok(done)
    }

    /// What only the sources know, into the run's summary.
    fn fill(self, summary: &mut RunSummary) {
        summary.clb = self.clb;
        summary.slices_skipped = self.slices_skipped;
        summary.worst_late_ms = self.worst_late.0 as f64 / 1e6;
        summary.worst_late_at_s = self.worst_late.1 as f64 / 1e9;
        summary.dropped_over_memory = self.dropped_over_memory;
        summary.send_completion = DelayStats::from_log(&self.send_completion);
    }
}

/// `work`, with `cancel` cancelled (and `why` logged) if it takes longer than `guard`: the
/// roles it waits for then stop and drain.
async fn within<T>(
    guard: StdDuration,
    cancel: &CancellationToken,
    why: &'static str,
    work: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    let c = cancel.clone();
    let guard_task = tokio::spawn(async move {
        tokio::time::sleep(guard).await;
        warn!("{why}");
        c.cancel();
    });
    let out = work.await;
    guard_task.abort();
    out
}

/// The run's summary as `runNNNNNN.summary.json` beside its output. The run happened: a
/// summary that cannot be written is said on the terminal, not an error.
fn write_summary(cfg: &Config, summary: &mut RunSummary) -> anyhow::Result<()> {
    let path = cfg.writer.out_dir.join(format!("run{:06}.summary.json", cfg.run.run_number));
    summary.summary_path = path.clone();
    if let Err(e) = std::fs::write(&path, serde_json::to_vec_pretty(&*summary)?) {
        warn!(path = %path.display(), error = %e, "cannot write the run's summary");
        summary.summary_path = PathBuf::from(format!("not written: {e}"));
    }
    Ok(())
}

fn summarize(
    cfg: &Config,
    per_node: usize,
    slices_produced: u64,
    late_slice_ends: u64,
    tallies: &BTreeMap<SourceId, SourceTally>,
    builder_reports: Vec<BuilderReport>,
    writer: WriterReport,
) -> RunSummary {
    let mut net = new_histogram();
    let mut shaping = new_histogram();
    let mut incomplete_reasons = BTreeMap::new();
    let mut rejected = BTreeMap::new();
    let btallies: BTreeMap<u32, BuilderTally> =
        builder_reports.iter().map(|b| (b.node.id, b.node.tally.clone())).collect();
    let (mut first, mut last) = (u64::MAX, 0u64);
    for b in &builder_reports {
        let _ = net.add(&b.net_delay_us);
        let _ = shaping.add(&b.shaping_delay_us);
        for (k, v) in &b.node.incomplete_reasons {
            *incomplete_reasons.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &b.node.rejected_connections {
            *rejected.entry(k.clone()).or_default() += v;
        }
        if b.node.fragments > 0 {
            first = first.min(b.node.first_arrival_ns);
            last = last.max(b.node.last_arrival_ns);
        }
    }
    let bytes: u64 = builder_reports.iter().map(|b| b.node.bytes).sum();
    let span_s = if last > first { (last - first) as f64 * 1e-9 } else { 0.0 };
    let ledger = Ledger::combine(tallies, &btallies);
    let km3net = builder_reports.iter().filter_map(|b| b.km3net.as_ref()).fold(None, |acc, k| {
        let mut acc: crate::builder::km3out::Km3OutReport = acc.unwrap_or_default();
        acc.merge(k);
        Some(acc)
    });
    RunSummary {
        run: cfg.run.run_number,
        policy: cfg.run.policy.clone(),
        transport: cfg.run.transport.clone(),
        data_security: cfg.security.data.as_str().into(),
        cpu_s_from_first_slice: f64::NAN,
        sources: cfg.run.sources,
        builders: cfg.run.builders,
        sources_per_node: per_node,
        slice_ms: cfg.run.slice_ms,
        seconds: cfg.run.seconds,
        slices_produced,
        slices_complete: builder_reports.iter().map(|b| b.node.slices_complete).sum(),
        slices_incomplete: builder_reports.iter().map(|b| b.node.slices_incomplete).sum(),
        incomplete_reasons,
        fragments_received: builder_reports.iter().map(|b| b.node.fragments).sum(),
        bytes_received: bytes,
        hits_received: builder_reports.iter().map(|b| b.hits + b.km3net.as_ref().map_or(0, |k| k.hits)).sum(),
        workload: cfg.describe_workload(),
        generated_live: cfg.generates_hits_live(),
        mbytes_per_s: if span_s > 0.0 { bytes as f64 / span_s / 1e6 } else { 0.0 },
        network_delay: DelayStats::from_histogram(&net),
        shaping_delay: DelayStats::from_histogram(&shaping),
        send_completion: DelayStats::default(),
        rejected_connections: rejected,
        late_slice_ends,
        worst_late_ms: 0.0,
        worst_late_at_s: 0.0,
        slices_skipped: 0,
        dropped_over_memory: 0,
        memory_budget_mb: 0,
        memory_planned_mb: 0,
        builder_memory_mb: 0,
        prefaulted_mb: 0,
        prefault_s: 0.0,
        page_faults: 0,
        events: builder_reports.iter().map(|b| b.events).sum(),
        ledger: LedgerSummary::new(&ledger),
        writer,
        builder_reports,
        dfm: None,
        clb: None,
        km3net,
        summary_path: PathBuf::new(),
        peak_rss_mb: peak_rss_mb(),
    }
}
