//! `shoal testbed up|run|down SCENARIO` and `shoal validate SCENARIO`: the scenario's
//! network emulated with namespaces, the real processes on it, and the simulator beside it.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use shoal_sim::scenario::Scenario;
use shoal_sim::sim::SimSummary;
use shoal_testbed::delay::DelayLines;
use shoal_testbed::netns;
use shoal_testbed::plan::{Congestion, Plan};
use shoal_testbed::run::{TestbedLaunch, TestbedOptions, TestbedSummary, Verdict};

#[derive(clap::Args)]
pub struct TestbedArgs {
    #[command(subcommand)]
    pub command: TestbedCommand,
}

#[derive(clap::Args, Clone)]
pub struct TestbedCommon {
    /// TCP congestion control of every host: reno (what the simulator models) or cubic.
    #[arg(long, default_value = "reno")]
    pub congestion: Congestion,
    /// Namespace prefix (1-6 letters or digits): `<prefix>-s0`, `<prefix>-core`, ...
    #[arg(long, default_value = "tb")]
    pub prefix: String,
}

#[derive(clap::Subcommand)]
pub enum TestbedCommand {
    /// Build the scenario's network and leave it up (inspect it with `ip netns`).
    Up {
        scenario: PathBuf,
        #[command(flatten)]
        common: TestbedCommon,
        /// Random packet loss on every switch port toward a host, in percent (an nft rule).
        #[arg(long, default_value_t = 0.0)]
        loss_pct: f64,
    },
    /// Build the network, run the scenario on it under `shoal run`, print the summary, tear
    /// the network down.
    Run {
        scenario: PathBuf,
        #[command(flatten)]
        common: TestbedCommon,
        /// Length of the run (default: the scenario's load_s).
        #[arg(long)]
        seconds: Option<f64>,
        /// Run records, logs and the generated cluster file.
        #[arg(long, default_value = "shoal-testbed")]
        dir: PathBuf,
        /// Print the summary as JSON.
        #[arg(long)]
        json: bool,
        /// Random packet loss on every switch port toward a host, in percent (an nft rule;
        /// the drops are counted in the summary). With TCP the kernel retransmits; with
        /// `transport = "udp"` shoal's NACKs do.
        #[arg(long, default_value_t = 0.0)]
        loss_pct: f64,
        /// How run control starts the processes: `netns` (ip netns exec) or `ssh` (an sshd
        /// in every host namespace, keys made for the run; Debian openssh-server).
        #[arg(long, default_value = "netns")]
        launch: TestbedLaunch,
        /// The data path over `run.transport = "ucx"`: UCX's tcp transport across the
        /// namespaces (`UCX_TLS`, default `tcp`), the scenario still a TCP one.
        #[arg(long)]
        ucx: bool,
    },
    /// Hold every packet this namespace forwards for a constant delay (a netfilter queue;
    /// started by the testbed in each sector switch when the shore links have a
    /// propagation delay). Stops on SIGTERM and prints what it did as JSON.
    #[command(hide = true)]
    DelayLine {
        #[arg(long)]
        delay_us: f64,
    },
    /// Remove the testbed's namespaces and whatever runs in them (idempotent).
    Down {
        #[arg(long, default_value = "tb")]
        prefix: String,
    },
}

#[derive(clap::Args)]
pub struct ValidateArgs {
    pub scenario: PathBuf,
    #[command(flatten)]
    pub common: TestbedCommon,
    #[arg(long)]
    pub seconds: Option<f64>,
    #[arg(long, default_value = "shoal-testbed")]
    pub dir: PathBuf,
    /// Print both summaries and the comparison as JSON.
    #[arg(long)]
    pub json: bool,
    /// The simulator's wake-up model of the testbed's software hosts: a constant phase per
    /// source, uniform below this. 0 since sources wait on a timerfd (1000 modelled tokio's
    /// millisecond timer wheel; with the timerfd binaries 0 gives the testbed's verdict in
    /// 27 of 35 runs against 24: docs/validation.md).
    #[arg(long, default_value_t = 0.0)]
    pub wake_phase_us: f64,
    /// ... and the mean of the exponential part (default: what the testbed's sources
    /// measured, less half the phase).
    #[arg(long)]
    pub wake_jitter_us: Option<f64>,
    /// The jitter's shape: `exponential` of the record's mean lag, or `measured`, drawn
    /// from the distribution of the record's source wake-up lags where the record has one
    /// (and no phase or jitter is asked). Exponential by default: measured against the
    /// same testbed runs it agreed less (docs/bench/validation-history.md, "Counted a third time").
    #[arg(long, value_enum, default_value_t = WakeLagModel::Exponential)]
    pub wake_lag: WakeLagModel,
    /// Random packet loss on every switch port toward a host, in percent: an nft rule on
    /// the testbed, `topology.host_port_loss_ppm` in the simulator.
    #[arg(long, default_value_t = 0.0)]
    pub loss_pct: f64,
    /// Compare with a testbed run recorded earlier (the `--json` output of `shoal validate`
    /// or of `shoal testbed run`) instead of running the testbed: a model change measured
    /// against the same runs, without root. Its congestion control, loss, length and
    /// delay are the record's.
    #[arg(long, value_name = "JSON")]
    pub testbed_record: Option<PathBuf>,
    /// The simulator's TCP for the testbed's hosts: `linux` (Linux's loss recovery: SACK
    /// scoreboard, RACK loss marking, tail-loss probes), `rack` (NewReno with tail-loss
    /// probes and RACK-style detection of one hole per round trip, the model before SACK)
    /// or `newreno` (the RFCs alone; the lockstep column always runs the scenario as written).
    #[arg(long, default_value = "linux")]
    pub tcp_model: TcpModel,
    /// The testbed kernel's `CONFIG_HZ` for the `linux` TCP model: Linux counts the
    /// tail-loss probe's timeout in timer ticks (this machine's kernel: 250).
    #[arg(long, default_value_t = 250)]
    pub kernel_hz: u32,
    /// Model the testbed's shapers' token buckets in the hosts model (microseconds at the
    /// rate; the testbed's are 250): an idle port lets that much through at once. 0: ports
    /// serialise as wires (docs/validation.md measures both).
    #[arg(long, default_value_t = 0.0)]
    pub shaper_bucket_us: f64,
    /// The hosts model's CPU: the testbed machine's cores shared by every namespace, each
    /// packet a node takes in costing `--cpu-packet-us` (topology.cpu_cores). 0: off.
    #[arg(long, default_value_t = 0)]
    pub cpu_cores: u32,
    /// ... the cost of one packet taken in (scripts/calibrate_cpu.py).
    #[arg(long, default_value_t = 0.0)]
    pub cpu_packet_us: f64,
    /// ... or that cost from the record itself: the testbed machine's busy core-seconds
    /// during the run ((100 - idle) % of `--cpu-cores`, default this machine's) over the
    /// packets the simulated nodes take in (counted by a first simulation without the CPU
    /// model). The load the run had, where `--cpu-packet-us` is one figure for every run.
    #[arg(long, conflicts_with = "cpu_packet_us")]
    pub cpu_per_run: bool,
    /// ... and the processes' run queue: each wake-up of a source's or builder's process
    /// costs a core this long (topology.cpu_wake_us; scripts/calibrate_cpu.py). 0: off.
    #[arg(long, default_value_t = 0.0)]
    pub cpu_wake_us: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TcpModel {
    Linux,
    Rack,
    Newreno,
}

/// The shore delay the testbed had: what was asked for, plus the delay lines' median
/// lateness (averaged over the lines).
fn emulated_shore_delay_us(bed: &TestbedSummary) -> f64 {
    let lines = &bed.delay_lines;
    if bed.shore_delay_us <= 0.0 || lines.is_empty() {
        return bed.shore_delay_us.max(0.0);
    }
    bed.shore_delay_us + lines.iter().map(|d| d.late_p50_us).sum::<f64>() / lines.len() as f64
}

/// The testbed summary in a record of `shoal validate --json` or `shoal testbed run --json`.
fn read_record(path: &Path) -> anyhow::Result<TestbedSummary> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let bed = match v.get_mut("testbed") {
        Some(bed) => bed.take(),
        None => v,
    };
    serde_json::from_value(bed).with_context(|| format!("{}: not a testbed summary", path.display()))
}

fn load(path: &Path) -> anyhow::Result<Scenario> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Scenario::from_toml(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// A loss in percent as packets per million.
fn loss_ppm(pct: f64) -> anyhow::Result<u32> {
    if !(0.0..=100.0).contains(&pct) {
        anyhow::bail!("--loss-pct {pct}: between 0 and 100");
    }
    Ok((pct * 1e4).round() as u32)
}

fn options(common: &TestbedCommon, dir: PathBuf, seconds: Option<f64>) -> anyhow::Result<TestbedOptions> {
    Ok(TestbedOptions {
        loss_ppm: 0,
        launch: TestbedLaunch::Netns,
        ucx: false,
        prefix: common.prefix.clone(),
        congestion: common.congestion,
        dir: std::path::absolute(dir)?,
        shoal: std::env::current_exe().context("locating the shoal executable")?,
        seconds,
    })
}

pub fn command(args: TestbedArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        TestbedCommand::Up { scenario, common, loss_pct } => {
            let sc = load(&scenario)?;
            let plan = Plan::new(&sc, &common.prefix, common.congestion)
                .map_err(anyhow::Error::msg)?
                .with_loss_ppm(loss_ppm(loss_pct)?);
            shoal_testbed::run::preflight(&plan)?;
            netns::up(&plan)?;
            // The delay lines outlive this command; `down` stops them with the rest.
            let logs = std::env::temp_dir().join(format!("shoal-testbed-{}", plan.prefix));
            std::fs::create_dir_all(&logs)?;
            let shoal = std::env::current_exe().context("locating the shoal executable")?;
            match DelayLines::start(&plan, &shoal, &logs) {
                Ok(lines) => lines.detach(),
                Err(e) => {
                    let _ = netns::down(&plan.prefix);
                    return Err(e);
                }
            }
            println!(
                "testbed {} up: {} hosts, {} switches, {} links; `shoal testbed down --prefix {}` removes it",
                sc.name,
                plan.hosts.len(),
                plan.switches.len(),
                plan.links.len(),
                plan.prefix
            );
            if plan.shore_delay_us > 0.0 {
                println!("  shore links delayed {} us (delay lines' logs in {})", plan.shore_delay_us, logs.display());
            }
            for h in &plan.hosts {
                println!("  {:<12} {:?} {}", h.netns, h.role, h.addr);
            }
            Ok(ExitCode::SUCCESS)
        }
        TestbedCommand::DelayLine { delay_us } => {
            if !(0.0..=1e6).contains(&delay_us) {
                anyhow::bail!("--delay-us {delay_us}: 0 to 1 s");
            }
            // SIGTERM (how the testbed stops a line) or SIGINT closes one end of a socket
            // pair; the line waits on the other end beside its queue.
            use std::os::fd::AsFd as _;
            use tokio::signal::unix::{SignalKind, signal};
            let (stop_tx, stop_rx) = std::os::unix::net::UnixStream::pair()?;
            let runtime = tokio::runtime::Handle::current();
            let _in_runtime = runtime.enter();
            let (mut term, mut int) = (signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?);
            runtime.spawn(async move {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
                drop(stop_tx);
            });
            let delay = std::time::Duration::from_secs_f64(delay_us / 1e6);
            let report = shoal_testbed::delay::serve(delay, stop_rx.as_fd())?;
            println!("{}", serde_json::to_string(&report)?);
            Ok(ExitCode::SUCCESS)
        }
        TestbedCommand::Down { prefix } => {
            let n = netns::down(&prefix)?;
            println!("removed {n} namespaces");
            Ok(ExitCode::SUCCESS)
        }
        TestbedCommand::Run { scenario, common, seconds, dir, json, loss_pct, launch, ucx } => {
            let sc = load(&scenario)?;
            let opts = TestbedOptions { loss_ppm: loss_ppm(loss_pct)?, launch, ucx, ..options(&common, dir, seconds)? };
            let s = shoal_testbed::run::run(&sc, &opts)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                print!("{}", table(&s));
            }
            Ok(if s.ledger.balanced { ExitCode::SUCCESS } else { ExitCode::from(2) })
        }
    }
}

/// The shore links' emulated delay and what the delay lines did.
fn delay_lines(s: &TestbedSummary) -> String {
    if s.shore_delay_us <= 0.0 {
        return "none".into();
    }
    let packets: u64 = s.delay_lines.iter().map(|d| d.packets).sum();
    let dropped: u64 = s.delay_lines.iter().map(|d| d.kernel_dropped).sum();
    let worst = |f: fn(&shoal_testbed::delay::DelayLineReport) -> f64| s.delay_lines.iter().map(f).fold(0.0, f64::max);
    format!(
        "{} us each way; {} delay lines held {packets} packets (at most {} at once), let them go late by p50 {:.0} \
         us, p99 {:.0} us, max {:.0} us (the worst line's); {dropped} dropped by the kernel before the lines",
        s.shore_delay_us,
        s.delay_lines.len(),
        s.delay_lines.iter().map(|d| d.held_max).max().unwrap_or(0),
        worst(|d| d.late_p50_us),
        worst(|d| d.late_p99_us),
        worst(|d| d.late_max_us),
    )
}

fn table(s: &TestbedSummary) -> String {
    let total = s.slices_complete + s.slices_incomplete;
    let pct = if total > 0 { 100.0 * s.slices_complete as f64 / total as f64 } else { 0.0 };
    let rows = [
        (
            "scenario",
            format!(
                "{} ({} x {}, {} over {}, {})",
                s.name,
                s.sources,
                s.builders,
                s.policy,
                s.transport,
                s.congestion.name()
            ),
        ),
        ("slices", format!("{} complete ({pct:.2}%), {} incomplete", s.slices_complete, s.slices_incomplete)),
        (
            "net delay",
            format!(
                "avg {:.2} ms, p99 {:.2} ms, max {:.2} ms; after the first second avg {:.2} ms, p99 {:.2} ms, max \
                 {:.2} ms",
                s.network_delay_avg_us / 1e3,
                s.network_delay_p99_us / 1e3,
                s.network_delay_max_us / 1e3,
                s.network_delay_steady_avg_us / 1e3,
                s.network_delay_steady_p99_us / 1e3,
                s.network_delay_steady_max_us / 1e3
            ),
        ),
        ("shore delay", delay_lines(s)),
        (
            "send lag",
            format!(
                "avg {:.2} ms, p50 {:.2} ms, p99 {:.2} ms (slice end to send stamp)",
                s.shaping_delay_avg_us / 1e3,
                s.shaping_delay_p50_us / 1e3,
                s.shaping_delay_p99_us / 1e3
            ),
        ),
        (
            "tcp",
            format!(
                "{} segments, {} retransmitted, {} timeouts; {} fast retransmits, {} loss probes, {} DSACKs, \
                 {} reorderings (during the run; set-up: {} segments, {} retransmitted, {} timeouts)",
                s.tcp_segments,
                s.tcp_retransmitted,
                s.tcp_timeouts,
                s.tcp.fast_retransmits,
                s.tcp.loss_probes,
                s.tcp.dsacks_received,
                s.tcp.reordering_detected,
                s.setup_tcp.segments_out,
                s.setup_tcp.retransmitted_segments,
                s.setup_tcp.timeouts
            ),
        ),
        (
            "drops",
            format!(
                "{} at switch ports, {} in host queues, {} injected ({} ppm toward hosts, shore BER {:e}); control \
                 host apart: {} dropped, {} TCP segments sent again",
                s.queue_drops,
                s.host_queue_drops,
                s.injected_drops,
                s.loss_ppm,
                s.shore_ber,
                s.control_queue_drops,
                s.control_tcp.retransmitted_segments
            ),
        ),
        (
            "udp",
            format!(
                "{} datagrams received, {} recovered by a NACK, {} lost; {} dropped by full socket receive buffers in \
                 the hosts",
                s.udp.datagrams, s.udp.recovered, s.udp.lost, s.udp_hosts.receive_buffer_errors
            ),
        ),
        (
            "ledger",
            format!(
                "produced {}, delivered {}, recovered {}, damaged {}, lost in transport {}{}",
                s.ledger.produced,
                s.ledger.buckets.get("delivered").copied().unwrap_or(0),
                s.ledger.buckets.get("recovered").copied().unwrap_or(0),
                s.ledger.buckets.get("damaged").copied().unwrap_or(0),
                s.ledger.buckets.get("lost_in_transport").copied().unwrap_or(0),
                if s.ledger.balanced { " (balanced)" } else { " (NOT BALANCED)" }
            ),
        ),
        (
            "cpu",
            format!(
                "{:.0}% idle, {:.1}% steal; processes waited {:.2} s for a CPU, the most {} ({:.1}% of the run){}",
                s.cpu_idle_pct,
                s.cpu_steal_pct,
                s.cpu_wait.total_s,
                s.cpu_wait.worst_process,
                100.0 * s.cpu_wait.worst_fraction,
                if s.starved { " (STARVED: delays include waiting for a CPU)" } else { "" }
            ),
        ),
        ("verdict", format!("{:?}", s.verdict).to_lowercase()),
        ("record", s.dir.display().to_string()),
    ];
    let mut o = String::from("shoal testbed summary\n");
    for (k, v) in rows {
        o.push_str(&format!("  {k:<10} {v}\n"));
    }
    for w in &s.warnings {
        o.push_str(&format!("  {:<10} {w}\n", "warning"));
    }
    o
}

/// Whether two figures agree within `tolerance` (relative), with an absolute floor for
/// figures near zero.
fn agree(sim: f64, bed: f64, tolerance: f64, floor: f64) -> bool {
    (sim - bed).abs() <= (tolerance * bed.abs()).max(floor)
}

/// The CPU time a testbed run's machine spent per packet the simulator's nodes take in
/// (`--cpu-per-run`): what the calibration script does for a set of runs, for one.
fn per_run_packet_cost_us(bed: &TestbedSummary, cores: u32, packets: u64) -> anyhow::Result<f64> {
    if !bed.cpu_idle_pct.is_finite() || packets == 0 || bed.seconds <= 0.0 {
        anyhow::bail!(
            "--cpu-per-run needs the record's CPU idle time and a run that moved packets (idle {}, {} packets, {} s)",
            bed.cpu_idle_pct,
            packets,
            bed.seconds
        );
    }
    let busy_core_s = (100.0 - bed.cpu_idle_pct).max(0.0) / 100.0 * f64::from(cores) * bed.seconds;
    Ok(busy_core_s / packets as f64 * 1e6)
}

/// How `shoal validate` draws the simulated sources' wake-up jitter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WakeLagModel {
    Measured,
    Exponential,
}

/// The simulator's model of the testbed's software hosts: `same` (the network the testbed
/// had) with sources waking as late as the record's did, the TCP and the host models asked.
fn hosts_model(same: &Scenario, args: &ValidateArgs, bed: &TestbedSummary) -> Scenario {
    let mut hosts = same.clone();
    hosts.topology.shaper_bucket_us = args.shaper_bucket_us;
    hosts.topology.cpu_cores = args.cpu_cores;
    hosts.topology.cpu_packet_us = args.cpu_packet_us;
    hosts.topology.cpu_wake_us = args.cpu_wake_us;
    hosts.tcp.rack_tlp = args.tcp_model != TcpModel::Newreno;
    hosts.tcp.sack = args.tcp_model == TcpModel::Linux;
    hosts.tcp.kernel_hz = if args.tcp_model == TcpModel::Linux { args.kernel_hz } else { 0 };
    hosts.traffic.wake_phase_us = args.wake_phase_us;
    hosts.traffic.wake_jitter_us =
        args.wake_jitter_us.unwrap_or((bed.source_wake_lag_avg_us - args.wake_phase_us / 2.0).max(0.0));
    if args.wake_lag == WakeLagModel::Measured && args.wake_jitter_us.is_none() && args.wake_phase_us == 0.0 {
        hosts.traffic.wake_lag_us = bed.source_wake_lag_us.clone();
    }
    hosts
}

pub fn validate(args: ValidateArgs) -> anyhow::Result<ExitCode> {
    let mut sc = load(&args.scenario)?;
    let bed = testbed_run(&args, &mut sc)?;
    let same = same_network(&sc, &bed);
    // Before the wake-up model: the scenario as written (hardware boards in lockstep unless
    // it sets traffic.wake_*, NewReno unless it sets tcp.rack_tlp). After: the testbed's
    // software hosts, waking as late as its sources measured, with Linux's loss recovery.
    let lockstep = shoal_sim::sim::run(&same).map_err(anyhow::Error::msg)?.summary;
    let hosts = hosts_with_cpu(&same, &args, &bed)?;
    let sim = shoal_sim::sim::run(&hosts).map_err(anyhow::Error::msg)?.summary;
    let v = Validation { sc, bed, same, hosts, sim, lockstep };
    if args.json {
        print_validation_json(&v, &args)?;
    } else {
        print_validation(&v);
    }
    Ok(if v.bed.ledger.balanced { ExitCode::SUCCESS } else { ExitCode::from(2) })
}

/// One validation: the scenario, the testbed's run, the simulator's network like it, and
/// the simulator's runs with and without the hosts' wake-up model.
struct Validation {
    sc: Scenario,
    bed: TestbedSummary,
    same: Scenario,
    hosts: Scenario,
    sim: SimSummary,
    lockstep: SimSummary,
}

/// The testbed's run: the record given, or a run now (whose length the scenario takes).
fn testbed_run(args: &ValidateArgs, sc: &mut Scenario) -> anyhow::Result<TestbedSummary> {
    Ok(match &args.testbed_record {
        Some(path) => {
            let bed = read_record(path)?;
            if bed.name != sc.name {
                anyhow::bail!("{} records scenario {:?}, not {:?}", path.display(), bed.name, sc.name);
            }
            sc.traffic.load_s = bed.seconds;
            bed
        }
        None => {
            let opts = TestbedOptions {
                loss_ppm: loss_ppm(args.loss_pct)?,
                ..options(&args.common, args.dir.clone(), args.seconds)?
            };
            if let Some(s) = args.seconds {
                sc.traffic.load_s = s;
            }
            shoal_testbed::run::run(sc, &opts)?
        }
    })
}

/// The scenario as the testbed ran it: the testbed delays the shore links (a delay line in
/// each sector switch) and no other link: the boards' and builders' microsecond or so is
/// below what a delay line resolves. The simulator gets the same network: the delay asked
/// for plus how late the lines let packets go (their median, some 30 us).
fn same_network(sc: &Scenario, bed: &TestbedSummary) -> Scenario {
    let mut same = sc.clone();
    same.topology.board_delay_us = 0.0;
    same.topology.shore_delay_us = emulated_shore_delay_us(bed);
    same.topology.builder_delay_us = 0.0;
    same.topology.host_port_loss_ppm = bed.loss_ppm;
    if same.clocks.correct {
        // Run control corrected the testbed's clocks to within its measurement (the run
        // record says how close); the simulator, without run control, runs one clock.
        same.clocks = shoal_sim::scenario::ClockModel::default();
        eprintln!("note: clocks corrected on the testbed: the simulator runs them as one clock");
    }
    if bed.congestion == Congestion::Cubic {
        eprintln!("note: the simulator models NewReno; the testbed runs cubic");
    }
    same
}

/// The hosts' model of the simulator, with a CPU charge per packet measured from this
/// run when `--cpu-per-run`.
fn hosts_with_cpu(same: &Scenario, args: &ValidateArgs, bed: &TestbedSummary) -> anyhow::Result<Scenario> {
    let mut hosts = hosts_model(same, args, bed);
    if args.cpu_per_run {
        let cores = match args.cpu_cores {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            n => n,
        };
        let mut uncharged = hosts.clone();
        uncharged.topology.cpu_cores = 0;
        uncharged.topology.cpu_packet_us = 0.0;
        uncharged.topology.cpu_wake_us = 0.0;
        let packets = shoal_sim::sim::run(&uncharged).map_err(anyhow::Error::msg)?.summary.packet_arrivals;
        hosts.topology.cpu_cores = cores;
        hosts.topology.cpu_packet_us = per_run_packet_cost_us(bed, cores, packets)?;
    }
    Ok(hosts)
}

fn print_validation_json(v: &Validation, args: &ValidateArgs) -> anyhow::Result<()> {
    let Validation { sc, bed, same, hosts, sim, lockstep } = v;
    let (rows, before) = (comparison(sim, bed), comparison(lockstep, bed));
    let (sim_verdict, lockstep_verdict) = (Verdict::of_simulation(sim), Verdict::of_simulation(lockstep));
    let verdicts_agree = sim_verdict == bed.verdict;
    let rows: Vec<_> = rows
        .iter()
        .zip(&before)
        .map(|(&(metric, s, b, tolerance, floor), &(_, l, _, _, _))| {
            serde_json::json!({"metric": metric, "simulator": s, "simulator_lockstep": l, "testbed": b,
                "agree": agree(s, b, tolerance, floor), "agree_lockstep": agree(l, b, tolerance, floor)})
        })
        .collect();
    let out = serde_json::json!({
        "scenario": sc.name,
        "congestion": bed.congestion.name(),
        "testbed_record": args.testbed_record,
        "simulated_shore_delay_us": same.topology.shore_delay_us,
        "tcp_model": clap::ValueEnum::to_possible_value(&args.tcp_model).map(|v| v.get_name().to_owned()),
        "wake_phase_us": hosts.traffic.wake_phase_us,
        "wake_jitter_us": hosts.traffic.wake_jitter_us,
        "wake_lag": if hosts.traffic.wake_lag_us.is_some() { "measured" } else { "exponential" },
        "cpu_cores": hosts.topology.cpu_cores,
        "cpu_packet_us": hosts.topology.cpu_packet_us,
        "simulator": sim,
        "simulator_verdict": sim_verdict,
        "simulator_lockstep": lockstep,
        "simulator_lockstep_verdict": lockstep_verdict,
        "testbed": bed,
        "rows": rows,
        "verdicts_agree": verdicts_agree,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

fn print_validation(v: &Validation) {
    let Validation { sc, bed, hosts, sim, lockstep, .. } = v;
    let (rows, before) = (comparison(sim, bed), comparison(lockstep, bed));
    let (sim_verdict, lockstep_verdict) = (Verdict::of_simulation(sim), Verdict::of_simulation(lockstep));
    let verdicts_agree = sim_verdict == bed.verdict;
    println!(
        "{} ({} x {}, {}, {}): simulator versus testbed",
        sc.name,
        bed.sources,
        bed.builders,
        sc.traffic.policy,
        bed.congestion.name()
    );
    println!(
        "simulator with host wake-up latency: phase {:.0} us + jitter {} (lockstep: sources send at the same \
         instant)",
        hosts.traffic.wake_phase_us,
        match hosts.traffic.wake_lag_us {
            Some(_) => format!("drawn from the testbed's wake-up lags (mean {:.0} us)", hosts.traffic.wake_jitter_us),
            None => format!("{:.0} us, exponential", hosts.traffic.wake_jitter_us),
        }
    );
    println!("| metric | simulator, lockstep | simulator, wake-up | testbed | agree |");
    println!("| --- | ---: | ---: | ---: | --- |");
    for ((name, s, b, tolerance, floor), (_, l, ..)) in rows.into_iter().zip(before) {
        println!(
            "| {name} | {l:.3} | {s:.3} | {b:.3} | {} |",
            if agree(s, b, tolerance, floor) { "yes" } else { "no" }
        );
    }
    println!(
        "| verdict | {lockstep_verdict:?} | {sim_verdict:?} | {:?} | {} |",
        bed.verdict,
        if verdicts_agree { "yes" } else { "no" }
    );
    println!(
        "testbed: {:.0}% CPU idle, {:.1}% steal, processes waited {:.2} s for a CPU (most: {}, {:.1}% of the run); \
         {} drops in host queues; drops by port: {:?}",
        bed.cpu_idle_pct,
        bed.cpu_steal_pct,
        bed.cpu_wait.total_s,
        bed.cpu_wait.worst_process,
        100.0 * bed.cpu_wait.worst_fraction,
        bed.host_queue_drops,
        bed.drops_by_port
    );
    println!("testbed shore delay: {}", delay_lines(bed));
    println!(
        "testbed TCP during the run: {} fast retransmits, {} loss probes, {} DSACKs received, {} reorderings, \
         {} spurious timeouts",
        bed.tcp.fast_retransmits,
        bed.tcp.loss_probes,
        bed.tcp.dsacks_received,
        bed.tcp.reordering_detected,
        bed.tcp.spurious_timeouts
    );
    if bed.starved {
        println!(
            "warning: the host starved the testbed ({:.0}% idle, {:.1}% steal, {} waited {:.1}% of the run for a \
             CPU); do not use this run",
            bed.cpu_idle_pct,
            bed.cpu_steal_pct,
            bed.cpu_wait.worst_process,
            100.0 * bed.cpu_wait.worst_fraction
        );
    }
}

/// (metric, simulator, testbed, relative tolerance, absolute floor), in the units shown.
fn comparison(sim: &SimSummary, bed: &TestbedSummary) -> Vec<(&'static str, f64, f64, f64, f64)> {
    let retransmitted = |n: u64, of: u64| 100.0 * n as f64 / of.max(1) as f64;
    vec![
        (
            "slices complete (%)",
            pct(sim.slices_complete, sim.slices_incomplete),
            pct(bed.slices_complete, bed.slices_incomplete),
            0.0,
            0.5,
        ),
        ("net delay avg (ms)", sim.network_delay_steady_avg_us / 1e3, bed.network_delay_steady_avg_us / 1e3, 0.10, 0.1),
        // The same statistic on both sides: over all fragments where the testbed's builders
        // reported their histograms, else each side's worst builder's p99.
        {
            let (sim_p99, bed_p99) = match bed.network_delay_steady_p99_pooled_us {
                Some(pooled) => (sim.network_delay_steady_p99_us, pooled),
                None => (sim.network_delay_steady_p99_worst_builder_us, bed.network_delay_steady_p99_us),
            };
            ("net delay p99 (ms)", sim_p99 / 1e3, bed_p99 / 1e3, 0.25, 0.5)
        },
        ("send lag avg (ms)", sim.shaping_delay_avg_us / 1e3, bed.shaping_delay_avg_us / 1e3, 0.25, 0.2),
        // Linux's retransmissions that a DSACK later showed unneeded (tail-loss probes fired
        // while a receiver waited for a CPU) have no twin in a model without TLP or CPUs.
        (
            "TCP retransmitted, needed (%)",
            100.0 * sim.tcp_retransmit_fraction,
            retransmitted(bed.tcp_retransmitted.saturating_sub(bed.tcp.dsacks_received), bed.tcp_segments),
            0.5,
            0.1,
        ),
        ("TCP timeouts", sim.tcp_timeouts as f64, bed.tcp_timeouts as f64, 0.5, 2.0),
        ("switch drops", sim.queue_drops as f64, bed.queue_drops as f64, 0.5, 10.0),
        // Random loss plus bit errors (the simulator damages and discards, the testbed drops
        // by frame length: what a failed FCS does).
        ("injected losses", (sim.injected_drops + sim.damaged_packets) as f64, bed.injected_drops as f64, 0.25, 10.0),
    ]
}

fn pct(complete: u64, incomplete: u64) -> f64 {
    let t = complete + incomplete;
    if t == 0 { 0.0 } else { 100.0 * complete as f64 / t as f64 }
}
