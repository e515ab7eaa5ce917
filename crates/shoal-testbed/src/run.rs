//! One testbed run: the scenario's network up, the real `shoal node` processes in their
//! namespaces under `shoal run`, the counters collected into a [`TestbedSummary`], the
//! network down again (also when something fails).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};
use shoal_control::cluster::{ClusterFile, ClusterSettings, Launch, ProcessSpec};
use shoal_net::config::Config;
use shoal_net::node::Role;
use shoal_sim::scenario::Scenario;
use shoal_sim::sim::SimSummary;

use crate::delay::{DelayLineReport, DelayLines};
use crate::netns;
use crate::plan::{CONTROL_ADDR, Congestion, HostRole, Plan, WRITER_ADDR};
use crate::ssh::SshKeys;

const BUILDER_PORT: u16 = 5601;
const WRITER_PORT: u16 = 5700;
const DISPATCHER_PORT: u16 = 5553;
const DFM_PORT: u16 = 5650;

/// What to run.
#[derive(Clone, Debug)]
pub struct TestbedOptions {
    pub prefix: String,
    pub congestion: Congestion,
    /// Run records, logs and the generated cluster file.
    pub dir: PathBuf,
    /// The shoal executable every process runs.
    pub shoal: PathBuf,
    /// Length of the run (default: the scenario's `load_s`).
    pub seconds: Option<f64>,
    /// Random loss on every switch port toward a host, packets per million.
    pub loss_ppm: u32,
    /// How `shoal run` starts the processes in their namespaces.
    pub launch: TestbedLaunch,
    /// The data path over `run.transport = "ucx"` (UCX's own tcp transport across the
    /// namespaces unless `UCX_TLS` says otherwise) instead of TCP; the scenario, and the
    /// hosts model that would simulate it, stay TCP's.
    pub ucx: bool,
}

/// How the testbed's processes are started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TestbedLaunch {
    /// `ip netns exec <namespace> shoal node ...` (run control's `netns` launch mode).
    #[default]
    Netns,
    /// `ssh <address> shoal node ...` to an sshd in each host namespace (run control's
    /// `ssh` launch mode, as on a farm of real machines).
    Ssh,
}

/// The builders' datagram counts over a UDP run (zero over TCP).
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct UdpLosses {
    pub datagrams: u64,
    pub recovered: u64,
    pub lost: u64,
}

/// How a run went, judged the same way for the simulator and the testbed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Every slice complete and no delay bound by TCP's retransmission timeout.
    Healthy,
    /// Some slices incomplete (under 1%), or TCP timeouts.
    Degraded,
    /// More than 1% of the slices incomplete, or a steady-state 99th-percentile delay at
    /// the 200 ms minimum retransmission timeout or beyond (incast collapse).
    Collapsed,
}

impl Verdict {
    pub fn judge(slices_complete: u64, slices_incomplete: u64, p99_delay_us: f64, tcp_timeouts: u64) -> Verdict {
        let total = slices_complete + slices_incomplete;
        let incomplete = if total == 0 { 1.0 } else { slices_incomplete as f64 / total as f64 };
        if incomplete > 0.01 || p99_delay_us >= 200_000.0 {
            Verdict::Collapsed
        } else if slices_incomplete > 0 || tcp_timeouts > 0 {
            Verdict::Degraded
        } else {
            Verdict::Healthy
        }
    }

    /// With the testbed's p99: the worst builder's.
    pub fn of_simulation(s: &SimSummary) -> Verdict {
        Verdict::judge(
            s.slices_complete,
            s.slices_incomplete,
            s.network_delay_steady_p99_worst_builder_us,
            s.tcp_timeouts,
        )
    }
}

/// What a testbed run measured, with the simulator's field names where they mean the same.
/// Read back by `shoal validate --testbed-record`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct TestbedSummary {
    pub name: String,
    pub congestion: Congestion,
    pub policy: String,
    pub sources: u32,
    pub builders: u32,
    pub fragment_bytes: u32,
    pub seconds: f64,
    pub slices_complete: u64,
    pub slices_incomplete: u64,
    /// Fragment network delay (application send to complete arrival): the mean over all
    /// fragments; p99 and maximum are the largest of the builders'.
    pub network_delay_avg_us: f64,
    pub network_delay_p99_us: f64,
    pub network_delay_max_us: f64,
    /// The same without the first second of slices (the builders' `network_delay_steady`:
    /// start-up is not the network's steady state; the simulator leaves out the same).
    pub network_delay_steady_avg_us: f64,
    pub network_delay_steady_p99_us: f64,
    pub network_delay_steady_max_us: f64,
    /// The steady p99 over every builder's fragments together (from their histograms;
    /// `None` in records made before builders reported them). The simulator's
    /// `network_delay_steady_p99_us` is this statistic.
    #[serde(default)]
    pub network_delay_steady_p99_pooled_us: Option<f64>,
    /// How late the source processes woke after a slice end, on average (their nodes'
    /// `slice_end_lag`): the host's wake-up latency, whatever the policy. `shoal validate`
    /// gives it to the simulator's wake-up model.
    pub source_wake_lag_avg_us: f64,
    /// Their distribution, every source pooled (µs; `None` in records made before source
    /// nodes kept it): `shoal validate` draws the simulator's wake-ups from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_wake_lag_us: Option<shoal_core::loghist::LogHistogram>,
    /// Slice end to the fragment's send stamp. With `direct` this is only the hosts'
    /// wake-up latency (timers, scheduling), which the simulator models as
    /// `traffic.wake_phase_us` and `traffic.wake_jitter_us`; p50 and p99 are the largest
    /// of the builders'.
    pub shaping_delay_avg_us: f64,
    pub shaping_delay_p50_us: f64,
    pub shaping_delay_p99_us: f64,
    /// Over the run only: counted from when data taking started (the `tcp_*` fields above
    /// are these), and separately what connection set-up and configuration sent before.
    pub tcp: netns::TcpCounters,
    pub setup_tcp: netns::TcpCounters,
    /// The control host's TCP over the run (run control, the dispatcher, a pull run's
    /// data-flow manager: control connections only), kept out of `tcp` and the verdict.
    /// The data hosts' own control connections (their statistics and commands) are still
    /// in `tcp`: one namespace's counters do not tell connections apart.
    #[serde(default)]
    pub control_tcp: netns::TcpCounters,
    /// The hosts' UDP counters over the run: datagrams their full receive buffers dropped
    /// are lost inside a host, not in the network.
    #[serde(default)]
    pub udp_hosts: netns::UdpCounters,
    pub tcp_segments: u64,
    pub tcp_retransmitted: u64,
    pub tcp_timeouts: u64,
    /// Packets dropped by the switch output buffers, and by the hosts' own queues, on the
    /// data path (the control host's ports are apart: `control_queue_drops`).
    pub queue_drops: u64,
    pub host_queue_drops: u64,
    /// Drops at the control host's switch port and its own queue: run control's
    /// traffic, not data; kept out of `queue_drops` and the comparison with the simulator.
    #[serde(default)]
    pub control_queue_drops: u64,
    /// What the testbed cannot emulate as the scenario asks (e.g. a byte-limited switch
    /// buffer, which replaces the packet limit here while the simulator applies both).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// Packets the injected loss and the shore links' bit errors dropped (the nft rules'
    /// counters), and the rates asked for.
    pub injected_drops: u64,
    pub loss_ppm: u32,
    pub shore_ber: f64,
    /// Propagation delay of the shore links, and what each delay line (one per sector
    /// switch) held, how late it let packets go, and what the kernel dropped before them.
    #[serde(default)]
    pub shore_delay_us: f64,
    #[serde(default)]
    pub delay_lines: Vec<DelayLineReport>,
    /// `tcp` or `udp`.
    pub transport: String,
    /// UDP: datagrams the builders received, recovered by a NACK, and declared lost.
    pub udp: UdpLosses,
    /// Where the drops were: `namespace/device` -> packets (devices with drops only).
    pub drops_by_port: std::collections::BTreeMap<String, u64>,
    pub ledger: shoal_net::demo::LedgerSummary,
    /// CPU time the machine was idle and stolen by the hypervisor during the run (%): a
    /// starved run is flagged, not averaged in.
    pub cpu_idle_pct: f64,
    pub cpu_steal_pct: f64,
    pub starved: bool,
    /// How long the processes waited for a CPU while runnable (their reports' scheduler
    /// statistics).
    pub cpu_wait: CpuWait,
    pub verdict: Verdict,
    /// Where the run record and the logs are.
    pub dir: PathBuf,
}

impl std::str::FromStr for TestbedLaunch {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "netns" => Ok(TestbedLaunch::Netns),
            "ssh" => Ok(TestbedLaunch::Ssh),
            other => Err(format!("launch mode {other:?}: netns or ssh")),
        }
    }
}

/// A run is starved when a process waited for a CPU this fraction of the run or more.
/// Measured (docs/validation.md): in runs whose busiest process waited under half the run
/// the simulator's average delay matched within 15%; at 30 x 10 with 30 kB fragments the
/// busiest waited 67-79% and delays were 10 to 100 times the simulator's.
pub const STARVED_WAIT_FRACTION: f64 = 0.5;

/// The processes' wait for a CPU over a run.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct CpuWait {
    /// Processes that reported scheduler statistics.
    pub processes: u32,
    /// Wait summed over them (s).
    pub total_s: f64,
    /// The most any one waited, per second of the run, and which.
    pub worst_fraction: f64,
    pub worst_process: String,
}

/// The runtime configuration of a scenario on the testbed's addresses.
pub fn testbed_config(sc: &Scenario, plan: &Plan, seconds: f64) -> anyhow::Result<Config> {
    let n_builders = sc.topology.n_builders().map_err(anyhow::Error::msg)?;
    let builder_addrs = (0..n_builders)
        .map(|j| {
            let h = plan.host(HostRole::Builder(j)).expect("the plan has every builder");
            format!("{}:{BUILDER_PORT}", h.addr)
        })
        .collect();
    let mut cfg = runtime_config(sc, builder_addrs, format!("{WRITER_ADDR}:{WRITER_PORT}"), seconds)?;
    // A pull run's data-flow manager lives on the control host.
    cfg.run.dfm_addr = format!("{CONTROL_ADDR}:{DFM_PORT}");
    Ok(cfg)
}

/// A scenario as the runtime's configuration: the same sources and builders, policy,
/// slice length, workload, cutoff, source limits and builder limits, the builders and the
/// writer at the given addresses, `seconds` of data taking. The filter selects nothing:
/// what is compared with the simulator is the data network (the simulator has no writer
/// traffic).
pub fn runtime_config(
    sc: &Scenario,
    builder_addrs: Vec<String>,
    writer_addr: String,
    seconds: f64,
) -> anyhow::Result<Config> {
    let t = &sc.traffic;
    let n_sources = sc.topology.n_sources().map_err(anyhow::Error::msg)?;
    let n_builders = sc.topology.n_builders().map_err(anyhow::Error::msg)?;
    if builder_addrs.len() != n_builders as usize {
        bail!("{} builder addresses for {n_builders} builders", builder_addrs.len());
    }
    let mut cfg = Config::default();
    cfg.run.sources = n_sources;
    cfg.run.builders = n_builders;
    cfg.run.seconds = seconds;
    if t.slice_ms.fract() != 0.0 || t.slice_ms < 1.0 {
        bail!("traffic.slice_ms = {}: the runtime takes whole milliseconds", t.slice_ms);
    }
    cfg.run.slice_ms = t.slice_ms as u64;
    cfg.run.policy = t.policy.clone();
    cfg.run.builder_addrs = builder_addrs;
    cfg.run.writer_addr = writer_addr;
    match (t.transport.as_str(), t.udp_nack) {
        ("tcp", _) => {}
        ("udp", true) => {
            cfg.run.transport = "udp".into();
            cfg.udp.max_nacks = t.udp_max_nacks;
        }
        (other, _) => bail!(
            "traffic.transport = {other:?}, udp_nack = {}: the runtime speaks TCP, or UDP with selective \
             retransmission (transport = \"udp\", udp_nack = true); the simulator's best-effort UDP has no runtime twin",
            t.udp_nack
        ),
    }
    cfg.source.generator = t.generator_name().parse().map_err(anyhow::Error::msg)?;
    cfg.source.fixed_bytes = t.fragment_bytes;
    cfg.source.bursts = t.burst_config(sc.seed);
    cfg.source.cutoff = t.cutoff;
    cfg.source.cutoff_head = t.cutoff_head;
    cfg.source.cutoff_tail = t.cutoff_tail;
    cfg.source.queue_limit_mb = t.queue_limit_mb;
    cfg.source.stall_limit_slices = t.stall_limit_slices;
    cfg.builder.max_active = sc.builder.max_active;
    cfg.builder.wall_timeout_ms = sc.builder.wall_timeout_ms as u64;
    // No event traffic to the writer competes with the fragments (on the testbed, five
    // builders forwarding everything with `pass` overflowed the writer's port).
    cfg.builder.filter.name = "none".into();
    // The burst saver's history and spool are for alerts, which the simulator does not
    // have; on the testbed they are CPU and memory that 20 to 50 processes on two cores
    // cannot spare.
    cfg.saver.enabled = false;
    cfg.validate()?;
    Ok(cfg)
}

/// The cluster file of a testbed run: every process in its own namespace, started there
/// by `ip netns exec`, or through the host's sshd at its address (`ssh`: the options to
/// reach it).
pub fn cluster_file(
    sc: &Scenario,
    plan: &Plan,
    opts: &TestbedOptions,
    seconds: f64,
    ssh: Option<&SshKeys>,
) -> anyhow::Result<ClusterFile> {
    let mut config = testbed_config(sc, plan, seconds)?;
    if opts.ucx {
        if config.run.transport != "tcp" {
            bail!("--ucx runs a TCP scenario's data path over UCX; this one is {}", config.run.transport);
        }
        config.run.transport = "ucx".into();
    }
    // The scenario's source clocks, the simulator's very ones (docs/clocks.md).
    let n_sources = plan.hosts.iter().filter(|h| matches!(h.role, HostRole::Source(_))).count() as u32;
    let clocks = sc.clocks.source_clocks(n_sources, sc.seed);
    let clock_of = |role: Role, ids: &[u32]| match (role, ids.first()) {
        (Role::Source, Some(&i)) => clocks.get(i as usize).copied().unwrap_or((0, 0)),
        _ => (0, 0),
    };
    let spec = |name: String, role: Role, ids: Vec<u32>, h: &crate::plan::Host| ProcessSpec {
        test_clock_offset_us: clock_of(role, &ids).0 as f64 / 1e3,
        test_clock_drift_ppm: clock_of(role, &ids).1 as f64 / 1e3,
        name,
        role,
        ids,
        launch: if ssh.is_some() { Launch::Ssh } else { Launch::Netns },
        host: if ssh.is_some() { h.addr.to_string() } else { h.netns.clone() },
        metrics: None,
        input: None,
    };
    let mut processes = Vec::new();
    for h in &plan.hosts {
        match h.role {
            HostRole::Source(i) => processes.push(spec(format!("source{i}"), Role::Source, vec![i], h)),
            HostRole::Builder(j) => processes.push(spec(format!("builder{j}"), Role::Builder, vec![j], h)),
            HostRole::Writer => processes.push(spec("writer".into(), Role::Writer, vec![], h)),
            HostRole::Control => {
                if config.policy()?.pull().is_some() {
                    processes.push(spec("dfm".into(), Role::Dfm, vec![], h));
                }
            }
        }
    }
    config.writer.out_dir = opts.dir.join("data");
    let file = ClusterFile {
        cluster: ClusterSettings {
            name: sc.name.clone(),
            dispatcher: format!("{CONTROL_ADDR}:{DISPATCHER_PORT}"),
            start_dispatcher: true,
            dispatcher_http: "off".into(),
            http: "off".into(),
            state_dir: opts.dir.join("state"),
            seconds,
            // Twice a second: run control's diagnosis sees a silent process within 3 s.
            stats_interval_ms: 500,
            binary: Some(opts.shoal.clone()),
            ssh_options: ssh.map(SshKeys::client_options).unwrap_or_default(),
            clock: shoal_control::clocks::ClockSettings { correct: sc.clocks.correct, ..Default::default() },
            // The testbed's namespaces are a network of its own, reached by nothing else
            // (docs/security.md): their addresses are not loopback, and nothing on them
            // authenticates yet.
            insecure: true,
            ..ClusterSettings::default()
        },
        processes,
        config,
    };
    file.validate()?;
    Ok(file)
}

/// CPU jiffies (total, idle, steal) from /proc/stat.
fn cpu_times() -> Option<(u64, u64, u64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = text.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = cpu.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    let total: u64 = v.iter().take(8).sum();
    Some((total, *v.get(3)? + v.get(4).copied().unwrap_or(0), v.get(7).copied().unwrap_or(0)))
}

/// Builds the testbed, runs the scenario on it, collects, and tears it down.
pub fn run(sc: &Scenario, opts: &TestbedOptions) -> anyhow::Result<TestbedSummary> {
    let plan = Plan::new(sc, &opts.prefix, opts.congestion).map_err(anyhow::Error::msg)?.with_loss_ppm(opts.loss_ppm);
    preflight(&plan)?;
    let seconds = opts.seconds.unwrap_or(sc.traffic.load_s);
    if opts.dir.exists() {
        std::fs::remove_dir_all(&opts.dir).with_context(|| format!("clearing {}", opts.dir.display()))?;
    }
    std::fs::create_dir_all(&opts.dir)?;
    let ssh = match opts.launch {
        TestbedLaunch::Netns => None,
        TestbedLaunch::Ssh => Some(SshKeys::make(&opts.dir.join("ssh"), &plan)?),
    };
    let file = cluster_file(sc, &plan, opts, seconds, ssh.as_ref())?;
    let cluster_path = opts.dir.join("cluster.toml");
    std::fs::write(&cluster_path, toml::to_string(&file)?)?;
    netns::up(&plan)?;
    let result = (|| -> anyhow::Result<TestbedSummary> {
        let delay_lines = DelayLines::start(&plan, &opts.shoal, &opts.dir)?;
        if let Some(keys) = &ssh {
            keys.start_daemons(&plan)?;
        }
        let mut summary = run_on(&plan, sc, opts, &cluster_path, seconds)?;
        summary.delay_lines = delay_lines.stop()?;
        Ok(summary)
    })();
    let removed = netns::down(&plan.prefix);
    let summary = result?;
    removed.context("tearing the testbed down")?;
    Ok(summary)
}

/// Whether this machine can emulate what `plan` asks for: loss and bit errors need `nft`,
/// a shore delay `iptables` (its NFQUEUE target).
pub fn preflight(plan: &Plan) -> anyhow::Result<()> {
    if (plan.loss_ppm > 0 || plan.shore_ber > 0.0)
        && let Some(why) = netns::loss_unavailable()
    {
        bail!("cannot inject loss or bit errors: {why}");
    }
    if plan.shore_delay_us > 0.0
        && let Some(why) = netns::delay_unavailable()
    {
        bail!("cannot delay the shore links by {} us: {why}", plan.shore_delay_us);
    }
    Ok(())
}

/// The network's counters at one moment: TCP per host namespace, queue drops per port,
/// injected drops, CPU.
#[derive(Clone, Debug, Default)]
struct Counters {
    tcp: netns::TcpCounters,
    /// The control host's, apart.
    control_tcp: netns::TcpCounters,
    udp: netns::UdpCounters,
    host_drops: std::collections::BTreeMap<String, u64>,
    switch_drops: std::collections::BTreeMap<String, u64>,
    injected: u64,
    cpu: Option<(u64, u64, u64)>,
}

impl Counters {
    fn read(plan: &Plan) -> anyhow::Result<Counters> {
        let mut c = Counters { cpu: cpu_times(), ..Counters::default() };
        for h in &plan.hosts {
            let (tcp, udp) = netns::counters(&h.netns)?;
            if h.role == HostRole::Control {
                c.control_tcp.add(&tcp);
            } else {
                c.tcp.add(&tcp);
            }
            c.udp.add(&udp);
        }
        for h in &plan.hosts {
            for (dev, d) in netns::drops(&h.netns)? {
                c.host_drops.insert(format!("{}/{dev}", h.netns), d);
            }
        }
        for s in &plan.switches {
            c.injected += netns::injected_drops(s)?;
            for (dev, d) in netns::drops(s)? {
                c.switch_drops.insert(format!("{s}/{dev}"), d);
            }
        }
        Ok(c)
    }
}

/// Per-port drops counted since `before`.
fn drops_since(
    now: &std::collections::BTreeMap<String, u64>,
    before: &std::collections::BTreeMap<String, u64>,
) -> std::collections::BTreeMap<String, u64> {
    now.iter()
        .map(|(port, &d)| (port.clone(), d.saturating_sub(before.get(port).copied().unwrap_or(0))))
        .filter(|&(_, d)| d > 0)
        .collect()
}

/// Delay statistics of several builders (their reports' `count`, `mean_us`, `p50_us`,
/// `p99_us`, `max_us`) pooled: the mean over all fragments, and the largest of the
/// builders' percentiles and maxima (their histograms are not in the reports).
#[derive(Clone, Copy, Debug, Default)]
struct DelayPool {
    count: u64,
    sum_us: f64,
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
}

impl DelayPool {
    fn add(&mut self, d: &serde_json::Value) {
        let count = d["count"].as_u64().unwrap_or(0);
        let get = |k: &str| d[k].as_f64().unwrap_or(0.0);
        self.count += count;
        self.sum_us += get("mean_us") * count as f64;
        self.p50_us = self.p50_us.max(get("p50_us"));
        self.p99_us = self.p99_us.max(get("p99_us"));
        self.max_us = self.max_us.max(get("max_us"));
    }

    fn mean_us(&self) -> f64 {
        if self.count > 0 { self.sum_us / self.count as f64 } else { 0.0 }
    }
}

/// Builders' delay histograms added together, from their reports' `[µs, count]` pairs.
#[derive(Default)]
struct PooledHistogram {
    hist: Option<hdrhistogram::Histogram<u64>>,
}

impl PooledHistogram {
    fn add(&mut self, counts: &serde_json::Value) {
        let Some(pairs) = counts.as_array() else { return };
        let h = self.hist.get_or_insert_with(shoal_net::report::new_histogram);
        for pair in pairs {
            if let (Some(v), Some(n)) = (pair[0].as_u64(), pair[1].as_u64()) {
                // Within the builders' own bounds, so it cannot fail; skip what could.
                let _ = h.record_n(v, n);
            }
        }
    }

    /// `None` when no builder reported a histogram (an older binary) or none had data.
    fn quantile(&self, q: f64) -> Option<f64> {
        self.hist.as_ref().filter(|h| !h.is_empty()).map(|h| h.value_at_quantile(q) as f64)
    }
}

/// What `shoal run` prints when the processes were told to start taking data.
const RUNNING_MARK: &str = "running for ";

fn run_on(
    plan: &Plan,
    sc: &Scenario,
    opts: &TestbedOptions,
    cluster_path: &Path,
    seconds: f64,
) -> anyhow::Result<TestbedSummary> {
    let (at_setup, at_start, at_end, status) = run_shoal(plan, opts, cluster_path)?;
    let record = read_record(opts, status)?;
    let ledger: shoal_net::demo::LedgerSummary = serde_json::from_value(record["ledger"].clone())?;
    let reports = record["reports"].as_array().cloned().unwrap_or_default();
    let BuilderPools { net, steady, lag, udp, steady_pooled } = BuilderPools::of(&reports);
    let (lag_count, lag_sum_ns, lag_us) = source_wake_lag(&reports);
    let cpu_wait = CpuWait::of(&reports);
    let tcp = at_end.tcp.since(&at_start.tcp);
    let setup_tcp = at_start.tcp.since(&at_setup.tcp);
    let udp_hosts = at_end.udp.since(&at_start.udp);
    let host = drops_since(&at_end.host_drops, &at_start.host_drops);
    let switch = drops_since(&at_end.switch_drops, &at_start.switch_drops);
    let control_ports = plan.control_ports();
    let is_control = |port: &String| control_ports.contains(port);
    let control_drops: u64 = host.iter().chain(&switch).filter(|(p, _)| is_control(p)).map(|(_, d)| d).sum();
    let host_drops: u64 = host.iter().filter(|(p, _)| !is_control(p)).map(|(_, d)| d).sum();
    let switch_drops: u64 = switch.iter().filter(|(p, _)| !is_control(p)).map(|(_, d)| d).sum();
    let mut by_port = host;
    by_port.extend(switch);
    let injected = at_end.injected.saturating_sub(at_start.injected);
    let (idle, steal) = match (at_start.cpu, at_end.cpu) {
        (Some(a), Some(b)) if b.0 > a.0 => {
            let dt = (b.0 - a.0) as f64;
            (100.0 * (b.1 - a.1) as f64 / dt, 100.0 * (b.2 - a.2) as f64 / dt)
        }
        _ => (f64::NAN, f64::NAN),
    };
    let slices_complete = record["slices_complete"].as_u64().unwrap_or(0);
    let slices_incomplete = record["slices_incomplete"].as_u64().unwrap_or(0);
    Ok(TestbedSummary {
        name: sc.name.clone(),
        congestion: opts.congestion,
        policy: sc.traffic.policy.clone(),
        sources: sc.topology.n_sources().map_err(anyhow::Error::msg)?,
        builders: sc.topology.n_builders().map_err(anyhow::Error::msg)?,
        fragment_bytes: sc.traffic.fragment_bytes,
        seconds,
        slices_complete,
        slices_incomplete,
        network_delay_avg_us: net.mean_us(),
        network_delay_p99_us: net.p99_us,
        network_delay_max_us: net.max_us,
        network_delay_steady_avg_us: steady.mean_us(),
        network_delay_steady_p99_us: steady.p99_us,
        network_delay_steady_max_us: steady.max_us,
        network_delay_steady_p99_pooled_us: steady_pooled.quantile(0.99),
        source_wake_lag_us: lag_us.filter(|h| !h.is_empty()),
        source_wake_lag_avg_us: if lag_count > 0 { lag_sum_ns as f64 / lag_count as f64 / 1e3 } else { 0.0 },
        shaping_delay_avg_us: lag.mean_us(),
        shaping_delay_p50_us: lag.p50_us,
        shaping_delay_p99_us: lag.p99_us,
        tcp_segments: tcp.segments_out,
        tcp_retransmitted: tcp.retransmitted_segments,
        tcp_timeouts: tcp.timeouts,
        tcp,
        setup_tcp,
        control_tcp: at_end.control_tcp.since(&at_start.control_tcp),
        udp_hosts,
        queue_drops: switch_drops,
        host_queue_drops: host_drops,
        control_queue_drops: control_drops,
        warnings: plan.warnings.clone(),
        drops_by_port: by_port,
        injected_drops: injected,
        loss_ppm: plan.loss_ppm,
        shore_ber: plan.shore_ber,
        shore_delay_us: plan.shore_delay_us,
        delay_lines: Vec::new(),
        transport: if opts.ucx {
            "ucx".into()
        } else if sc.traffic.transport == "udp" {
            "udp".into()
        } else {
            "tcp".into()
        },
        udp,
        ledger,
        cpu_idle_pct: idle,
        cpu_steal_pct: steal,
        // Under 5% idle with both cores busy, or a process whose threads waited for a CPU
        // half the run: delays then include waiting for a CPU.
        starved: idle < 5.0 || steal > 10.0 || cpu_wait.worst_fraction > STARVED_WAIT_FRACTION,
        cpu_wait,
        verdict: Verdict::judge(slices_complete, slices_incomplete, steady.p99_us, tcp.timeouts),
        dir: opts.dir.clone(),
    })
}

/// Runs `shoal run` on the cluster file in the control namespace, its log to run.log;
/// the counters at set-up, when data taking started (read the moment the log says so),
/// and at the end, and how it exited.
fn run_shoal(
    plan: &Plan,
    opts: &TestbedOptions,
    cluster_path: &Path,
) -> anyhow::Result<(Counters, Counters, Counters, std::process::ExitStatus)> {
    let ctl = plan.host(HostRole::Control).expect("the plan has a control host");
    let at_setup = Counters::read(plan)?;
    let mut child = Command::new("ip")
        .args(["netns", "exec", &ctl.netns])
        .arg(&opts.shoal)
        .arg("run")
        .arg(cluster_path)
        .arg("--json")
        // 20 to 50 processes share the machine's cores: one runtime worker each (a host
        // of its own would have its own core) halves the time they wait for a CPU at 15 x 5
        // (docs/validation.md). Set in the environment, it is left as it is.
        .env("TOKIO_WORKER_THREADS", std::env::var("TOKIO_WORKER_THREADS").unwrap_or_else(|_| "1".into()))
        // Across namespaces UCX's shared memory would bypass the emulated network.
        .env("UCX_TLS", std::env::var("UCX_TLS").unwrap_or_else(|_| "tcp".into()))
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(opts.dir.join("run.json"))?)
        .stderr(Stdio::piped())
        .spawn()
        .context("running shoal run in the control namespace")?;
    // Its log goes to run.log; the line that says data taking started is the moment the
    // counters are read, so connection set-up and configuration are not counted as the
    // run's (they were: 5 TCP timeouts per run at 15 x 5 came from start-up).
    let stderr = child.stderr.take().expect("piped");
    let mut log = std::fs::File::create(opts.dir.join("run.log"))?;
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let logger = std::thread::spawn(move || {
        use std::io::{BufRead, Write};
        let mut started_tx = Some(started_tx);
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = writeln!(log, "{line}");
            if line.starts_with(RUNNING_MARK)
                && let Some(tx) = started_tx.take()
            {
                let _ = tx.send(());
            }
        }
    });
    // No start (the run failed before it): the set-up counters are the baseline.
    let at_start = match started_rx.recv() {
        Ok(()) => Counters::read(plan)?,
        Err(_) => at_setup.clone(),
    };
    let status = child.wait().context("waiting for shoal run")?;
    let _ = logger.join();
    let at_end = Counters::read(plan)?;
    Ok((at_setup, at_start, at_end, status))
}

/// The record of the run `shoal run` left in the testbed's state directory.
fn read_record(opts: &TestbedOptions, status: std::process::ExitStatus) -> anyhow::Result<serde_json::Value> {
    let state = opts.dir.join("state");
    let last: u64 = std::fs::read_to_string(state.join("last_run"))
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .with_context(|| format!("shoal run left no run ({status}); see {}", opts.dir.join("run.log").display()))?;
    let record_path = state.join("runs").join(format!("run{last:06}.json"));
    let record: serde_json::Value = serde_json::from_slice(
        &std::fs::read(&record_path).with_context(|| format!("reading {}", record_path.display()))?,
    )?;
    Ok(record)
}

/// Pooled over the builders' reports: all delays, the steady state, the send lag, the
/// datagram streams' losses.
struct BuilderPools {
    net: DelayPool,
    steady: DelayPool,
    lag: DelayPool,
    udp: UdpLosses,
    steady_pooled: PooledHistogram,
}

impl BuilderPools {
    fn of(reports: &[serde_json::Value]) -> Self {
        // Pooled over the builders: all delays, the steady state, the send lag.
        let (mut net, mut steady, mut lag) = (DelayPool::default(), DelayPool::default(), DelayPool::default());
        let mut udp = UdpLosses::default();
        let mut steady_pooled = PooledHistogram::default();
        for r in reports.iter().filter(|r| r["role"] == "builder") {
            net.add(&r["network_delay"]);
            steady.add(&r["detail"]["network_delay_steady"]);
            steady_pooled.add(&r["detail"]["network_delay_steady_counts"]);
            lag.add(&r["detail"]["shaping_delay"]);
            let streams = &r["detail"]["udp"]["streams"];
            udp.datagrams += streams["datagrams"].as_u64().unwrap_or(0);
            udp.recovered += streams["recovered_datagrams"].as_u64().unwrap_or(0);
            udp.lost += streams["lost_datagrams"].as_u64().unwrap_or(0);
        }
        Self { net, steady, lag, udp, steady_pooled }
    }
}

/// The sources' lateness at slice ends: count, sum (ns), and the pooled histogram (us).
fn source_wake_lag(reports: &[serde_json::Value]) -> (u64, u64, Option<shoal_core::loghist::LogHistogram>) {
    let (mut lag_count, mut lag_sum_ns) = (0u64, 0u64);
    let mut lag_us: Option<shoal_core::loghist::LogHistogram> = None;
    for r in reports.iter().filter(|r| r["role"] == "source") {
        lag_count += r["detail"]["slice_end_lag_count"].as_u64().unwrap_or(0);
        lag_sum_ns += r["detail"]["slice_end_lag_sum_ns"].as_u64().unwrap_or(0);
        if let Ok(h) =
            serde_json::from_value::<shoal_core::loghist::LogHistogram>(r["detail"]["slice_end_lag_us"].clone())
        {
            lag_us.get_or_insert_with(Default::default).merge(&h);
        }
    }
    (lag_count, lag_sum_ns, lag_us)
}

impl CpuWait {
    /// How long the run's processes waited for a CPU, and the one that waited most.
    fn of(reports: &[serde_json::Value]) -> Self {
        let mut cpu_wait = CpuWait::default();
        for r in reports {
            let Ok(Some(cpu)) = serde_json::from_value::<Option<shoal_net::schedstat::CpuUse>>(r["cpu"].clone()) else {
                continue;
            };
            cpu_wait.processes += 1;
            cpu_wait.total_s += cpu.wait_s;
            if cpu.wait_fraction() >= cpu_wait.worst_fraction {
                cpu_wait.worst_fraction = cpu.wait_fraction();
                cpu_wait.worst_process = r["name"].as_str().unwrap_or_default().to_string();
            }
        }
        cpu_wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_net::report::{new_histogram, recorded_counts};

    #[test]
    fn builders_delays_pool_into_one_p99_not_the_worst_of_theirs() {
        // A builder with few fragments and a tail, beside one with many and none.
        let (mut few, mut many) = (new_histogram(), new_histogram());
        few.record_n(1_000, 98).unwrap();
        few.record_n(50_000, 2).unwrap();
        many.record_n(1_000, 10_000).unwrap();
        let mut pooled = PooledHistogram::default();
        assert_eq!(pooled.quantile(0.99), None, "nothing reported");
        for h in [&few, &many] {
            pooled.add(&serde_json::to_value(recorded_counts(h)).unwrap());
        }
        let mut both = few.clone();
        both.add(&many).unwrap();
        assert_eq!(pooled.quantile(0.99), Some(both.value_at_quantile(0.99) as f64));
        assert_eq!(pooled.quantile(0.99), Some(1_000.0));
        assert!(few.value_at_quantile(0.99) >= 50_000, "the worst builder's p99 is another statistic");
        // An older builder's report has no counts: it adds nothing.
        pooled.add(&serde_json::Value::Null);
        assert_eq!(pooled.quantile(0.99), Some(1_000.0));
    }
}
