//! `shoal`: the one binary of the shoal event builder.
//!
//! - `shoal demo`: the whole chain in one process with no configuration needed.
//! - `shoal node --role source|builder|writer|dfm --config FILE`: one role per process, or
//!   `--dispatcher ADDR --name NAME`: the same role under run control.
//! - `shoal run CLUSTER.toml`: run control: launches a cluster's processes and drives runs
//!   (web UI and HTTP API).
//! - `shoal config`: prints the full default configuration.
//! - `shoal dispatcher`: a ControlHost-compatible message dispatcher.
//! - `shoal ledger REPORT.json...`: one ledger over a run's per-process reports (the
//!   source SDK's close reports included); exit 1 when it does not balance.
//! - `shoal diagnose RUN_RECORD`: every lost slice of a run with its primary cause.
//!
//! The rest (`sim`, `testbed`, `validate`, `replay`, `trigger-eval`, `alert`, probes) are
//! listed by `shoal --help`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use shoal_core::runstate::Role;
use shoal_net::clock::WallClock;
use shoal_net::config::Config;
use shoal_net::demo::{RunSummary, run_embedded};
use shoal_net::live::Live;
use tokio_util::sync::CancellationToken;

mod alert;
mod archive;
mod consume;
mod diagnose;
mod filter_worker;
mod km3net;
mod ledger;
mod probe;
mod replay;
mod security;
use shoal_control as run;
mod sim;
mod summary;
mod testbed;
mod trigger;

// The data path allocates and frees many fragment-sized buffers from several threads;
// glibc's allocator spent about a third of the CPU in page clearing and malloc there
// (and with huge pages mimalloc did too: `shoal_net::memory`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "shoal", version, about = "Time-slice event builder for detector data acquisition")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct RunArgs {
    /// The cluster file (see examples/sector.toml and docs/run-control.md).
    cluster: std::path::PathBuf,
    /// Wait for commands from the web UI / HTTP API instead of driving one run.
    #[arg(long)]
    interactive: bool,
    /// Length of the run in seconds (default: cluster.seconds).
    #[arg(long)]
    seconds: Option<f64>,
    /// Override cluster.http (e.g. 127.0.0.1:0 for any free port; "off" for none).
    #[arg(long)]
    http: Option<String>,
    /// Override cluster.state_dir.
    #[arg(long)]
    state_dir: Option<std::path::PathBuf>,
    /// Override cluster.dispatcher.
    #[arg(long)]
    dispatcher: Option<String>,
    /// End by printing the last run's summary as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

impl From<RunArgs> for run::RunOptions {
    fn from(a: RunArgs) -> Self {
        run::RunOptions {
            cluster: a.cluster,
            interactive: a.interactive,
            seconds: a.seconds,
            http: a.http,
            state_dir: a.state_dir,
            dispatcher: a.dispatcher,
            json: a.json,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run sources, builders and a writer in one process over loopback TCP and print a summary.
    Demo(DemoArgs),
    /// Run one role of a distributed deployment.
    Node(NodeArgs),
    /// Combine the end-of-run reports of hand-started processes (and source SDK handles)
    /// into the run's ledger; exits 1 when it does not balance.
    Ledger(ledger::LedgerArgs),
    /// Every lost slice of a past run with its primary cause, and the problems run control
    /// saw during it; exits 1 when a lost slice has no known cause.
    Diagnose(diagnose::DiagnoseArgs),
    /// Attach to a builder's shared-memory slice ring (`builder.consumers`) and print what
    /// arrives, slice by slice, and each run's counters.
    Consume(consume::ConsumeArgs),
    /// Run a C filter plug-in for a builder, out of its process (started by builders with
    /// `builder.filter.isolate = true`; not for use by hand).
    #[command(hide = true)]
    FilterWorker(filter_worker::FilterWorkerArgs),
    /// KM3NeT: CLB optical packets from a recorded timeslice file, a CLB dump or the physics
    /// generator, to a dump and/or UDP at the real pace.
    ClbEmulate(km3net::EmulateArgs),
    /// KM3NeT: a CLB dump reassembled per DOM and timeslice into JDAQTimeslices.
    ClbAssemble(km3net::AssembleArgs),
    /// Decode every JDAQ object (timeslice, event, summaryslice) of DAQ files and encode it
    /// again: the bytes must be the very bytes read (checks shoal's KM3NeT codecs on real files).
    JdaqCheck(km3net::JdaqCheckArgs),
    /// Run control: launch the processes of a cluster file, drive runs, serve the web UI.
    Run(RunArgs),
    /// Generate slices with known muons, filter them, and print efficiency, purity,
    /// background rate and data reduction.
    TriggerEval(trigger::EvalArgs),
    /// Replay real KM3NeT data (converted by scripts/km3net_to_shoal.py) through assembly
    /// and the filter; for triggered events, compare with the stored trigger flags.
    Replay(replay::ReplayArgs),
    /// Print the full default configuration as TOML.
    Config,
    /// Run a ControlHost-compatible message dispatcher (KM3NeT Ligier dialect).
    Dispatcher(DispatcherArgs),
    /// Send an external alert: every builder saves the raw data of a time window it still
    /// holds, plus what arrives until the window's end, and says what it saved.
    Alert(alert::AlertArgs),
    /// Packet-level network simulation running shoal's real shaping and assembly code.
    Sim(SimArgs),
    /// The real processes on an emulated network of network namespaces (root).
    Testbed(testbed::TestbedArgs),
    /// Run a scenario on the simulator and on the testbed and compare them (root).
    Validate(testbed::ValidateArgs),
    /// Measure a switch port's output buffer by flooding it from synchronised senders:
    /// its size in packets and bytes, and which of the two it limits.
    ProbeSwitch(probe::ProbeArgs),
    /// The cluster's CA and its certificates (`shoal ca init DIR`, `shoal ca issue DIR NAME`).
    Ca(security::CaArgs),
    /// Tokens for run control's HTTP API (`shoal token add FILE --name N --role R`).
    Token(security::TokenArgs),
    /// Print run control's audit log: every command, alert and refusal, who and from where.
    Audit(security::AuditArgs),
    /// Custody of stored files to permanent storage: `shoal archive run DIR --to URL`,
    /// `shoal archive status DIR` (docs/archive.md).
    Archive(archive::ArchiveArgs),
}

#[derive(Parser)]
#[command(args_conflicts_with_subcommands = true)]
struct SimArgs {
    #[command(subcommand)]
    command: Option<SimCommand>,
    /// Scenario file (TOML; see scenarios/ and docs/simulation.md).
    scenario: Option<PathBuf>,
    /// Output directory.
    #[arg(long, default_value = "sim-out")]
    out: PathBuf,
}

#[derive(Subcommand)]
enum SimCommand {
    /// Run every scenario of a directory in parallel and write a comparison table.
    Sweep {
        dir: PathBuf,
        #[arg(long, default_value = "sim-out/sweep")]
        out: PathBuf,
        /// Parallel runs (default: the number of cores).
        #[arg(long)]
        threads: Option<usize>,
        /// Also write per-fragment CSV files (large: 1.8 M rows for a 10-string minute).
        #[arg(long)]
        records: bool,
        /// Also write this Markdown results page, with the plots copied beside it.
        #[arg(long)]
        doc: Option<PathBuf>,
    },
}

#[derive(Parser)]
struct DispatcherArgs {
    /// Address for ControlHost clients.
    #[arg(long, default_value = "127.0.0.1:5553")]
    listen: std::net::SocketAddr,
    /// Address for HTTP /status and /metrics, or "off".
    #[arg(long, default_value = "127.0.0.1:5554")]
    http: String,
    /// Listen off loopback although the dispatcher authenticates nobody (a network you
    /// trust; docs/security.md). Without it a non-loopback address is refused.
    #[arg(long)]
    insecure: bool,
    /// Networks whose clients may publish command tags (RC_CMD, ALERT), as ADDRESS/PREFIX;
    /// repeat for several. Default: this host only (127.0.0.0/8, ::1). From anywhere else
    /// such a message is dropped and counted; subscribing and other tags are anyone's.
    #[arg(long = "control-from", value_name = "NET")]
    control_from: Vec<shoal_core::controlhost::IpNet>,
    /// Messages queued per client before any-mode (w) messages are dropped for it.
    #[arg(long, default_value_t = 100)]
    queue_limit: usize,
    /// Bytes held for all clients (MiB) above which publishers are paused.
    #[arg(long, default_value_t = 1024)]
    memory_limit_mb: u64,
    /// Largest accepted payload (MiB); larger lengths close the connection.
    #[arg(long, default_value_t = 64)]
    max_payload_mb: u32,
    /// Most clients connected at once; beyond, a connection is closed at once and counted
    /// (a flood cannot take every descriptor of the process)
    #[arg(long, default_value_t = 16_000)]
    max_clients: usize,
    /// A Prometheus web configuration (web.yml) for the HTTP /status and /metrics: TLS,
    /// client certificates, bcrypt basic-auth users.
    #[arg(long)]
    web_config: Option<PathBuf>,
    /// Exit when the process that started this one exits, even killed (`shoal run`).
    #[arg(long)]
    exit_with_parent: bool,
    /// This dispatcher's credentials: a directory with ca.pem, NAME.pem and NAME.key (`shoal
    /// ca issue DIR dispatcher --host ...`). The port then also takes mutual TLS, knows each
    /// such client by its certificate, and enforces who may publish and subscribe shoal's
    /// tags; plain clients keep their data tags, and command tags only from --control-from
    /// (loopback no longer implied) (docs/security.md).
    #[arg(long, value_name = "DIR")]
    credentials: Option<PathBuf>,
    /// The certificate's name in --credentials.
    #[arg(long, default_value = "dispatcher")]
    name: String,
    /// With --credentials: append refusals and the plain port's commands to DIR/audit.jsonl
    /// (run control's state directory).
    #[arg(long, value_name = "DIR")]
    audit_dir: Option<PathBuf>,
}

#[derive(Parser)]
struct NodeArgs {
    /// source, builder, writer or dfm (the data-flow manager of a pull run).
    #[arg(long)]
    role: Role,
    /// TOML configuration (see examples/shoal.toml); defaults apply to what it omits.
    /// Runs one run at once; with --dispatcher the configuration comes from run control.
    #[arg(long, conflicts_with = "dispatcher")]
    config: Option<PathBuf>,
    /// Follow run control through this dispatcher (address:port).
    #[arg(long, requires = "name")]
    dispatcher: Option<std::net::SocketAddr>,
    /// Process name under run control (command target, dispatcher nickname).
    #[arg(long)]
    name: Option<String>,
    /// Builder id, or the comma-separated source ids this process hosts.
    #[arg(long, value_delimiter = ',')]
    ids: Vec<u32>,
    /// Source process: where its data come from (`source.input`: unix:PATH, udp:ADDR,
    /// clb:ADDR), overriding the configuration's.
    #[arg(long)]
    input: Option<String>,
    /// Serve Prometheus /metrics here (127.0.0.1:0: any free port).
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// This process's certificate for `[security] data`: DIR/ca.pem, DIR/NAME.pem and
    /// DIR/NAME.key, as `shoal ca issue` writes them (run control passes its own).
    /// The same certificate proves this process to the dispatcher (mutual TLS), unless
    /// --control-plain.
    #[arg(long)]
    credentials: Option<PathBuf>,
    /// Reach the dispatcher in plain ControlHost although --credentials is given (a
    /// dispatcher that is not shoal's, or one started without credentials).
    #[arg(long)]
    control_plain: bool,
    /// A Prometheus web configuration (web.yml) for /metrics: TLS, client certificates,
    /// bcrypt basic-auth users.
    #[arg(long)]
    web_config: Option<PathBuf>,
    /// Statistics period under run control, milliseconds.
    #[arg(long, default_value_t = 1000)]
    stats_ms: u64,
    /// Stop (like Ctrl-C) when the process that started this one exits, even killed
    /// (what `shoal run` passes to the processes it launches).
    #[arg(long)]
    exit_with_parent: bool,
    /// Test only: run this process's clock this many microseconds ahead of the host's
    /// (negative: behind), to emulate hosts with different clocks on one machine (Linux
    /// time namespaces do not move CLOCK_REALTIME). See docs/clocks.md.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    test_clock_offset_us: f64,
    /// Test only: make this process's clock run fast by this many parts per million
    /// (negative: slow).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    test_clock_drift_ppm: f64,
}

#[derive(Parser)]
struct DemoArgs {
    /// Seconds of data taking.
    #[arg(long)]
    seconds: Option<f64>,
    /// Number of sources (front-end boards).
    #[arg(long)]
    sources: Option<u32>,
    /// Number of builders.
    #[arg(long)]
    builders: Option<u32>,
    /// Traffic shaping: `direct`, `delayed:K[:W]` (barrel shifting, W fragments in flight for a source behind), `tbf:RATE[:BURST]` (e.g. `tbf:40Mbit`) or `pull:CREDITS[:cap=N][:rate=RATE]` (credit-based pull, answers optionally paced).
    #[arg(long)]
    policy: Option<String>,
    /// Data transport: tcp, udp (datagrams with selective retransmission, `[udp]`) or ucx (UCX active messages: RDMA, or one copy over shared memory on one host).
    #[arg(long)]
    transport: Option<String>,
    /// Output directory for events and summaries.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Time-slice length in milliseconds.
    #[arg(long)]
    slice_ms: Option<u64>,
    /// Start from this configuration file instead of the defaults.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Memory in MiB to map before the run (`run.prefault_mb`; 0: none). Unset here and in
    /// the --config file, the demo maps 6 s of what its sources offer (a shorter run's whole
    /// data) when that is a GiB or more (at most half the memory budget) and says so.
    #[arg(long, value_name = "MIB")]
    prefault_mb: Option<u64>,
    /// Exit with status 3 if fewer than this fraction of slices is complete (e.g. 0.99).
    #[arg(long)]
    min_complete: Option<f64>,
    /// Print the summary as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// After the run, archive every file it stored to this directory (file://DIR): each
    /// copy verified by its adler32, the local files kept; the summary gives the archive's
    /// ledger (exit 4 if a file could not be made safe). docs/archive.md.
    #[arg(long, value_name = "DIR")]
    archive: Option<PathBuf>,
    /// Atmospheric muons per second through the generation disk. Without --config the demo
    /// runs 200 Hz (enriched from the natural ~10 Hz, as for the filter's efficiency curves)
    /// so that the filter visibly selects muons in a short run on one sector.
    #[arg(long)]
    muon_hz: Option<f64>,
    /// Send an alert this many seconds into the run: every builder saves the raw data of
    /// the last --alert-window seconds it still holds (the burst saver) to the raw file.
    #[arg(long)]
    alert_at: Option<f64>,
    /// The alert's window length, seconds.
    #[arg(long, default_value_t = 20.0)]
    alert_window: f64,
    /// How long after the window's end the alert comes, seconds (a gamma-ray-burst notice
    /// comes 10-30 s after the fact).
    #[arg(long, default_value_t = 0.0)]
    alert_lag: f64,
    /// `antares` (the generator in the sources) or `km3net`: the KM3NeT chain, CLB packets
    /// from the emulator through the DataQueue to IO_* messages on an in-process
    /// dispatcher and DAQ files (docs/km3net.md).
    #[arg(long, default_value = "antares", value_parser = ["antares", "km3net"])]
    detector: String,
    /// km3net: detection units of the ARCA-like block, and DOMs on each.
    #[arg(long, default_value_t = 1)]
    lines: u32,
    #[arg(long, default_value_t = 18)]
    doms_per_line: u32,
}

/// The demo's muon rate when no configuration file is given.
const DEMO_MUON_HZ: f64 = 200.0;

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SHOAL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Colours only on a terminal: process logs under `shoal run` go to files.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
}

fn load(path: Option<&PathBuf>) -> anyhow::Result<Config> {
    Ok(match path {
        Some(p) => Config::from_file(p)?,
        None => Config::default(),
    })
}

/// The demo's builders share this process. Unless the configuration file says what each
/// may hold, they share what its memory budget leaves (said on stderr), so that a
/// newcomer's `--sources 300 --builders 100` runs instead of being refused for 100 x 512 MiB.
fn share_builder_memory(cfg: &mut Config, config: Option<&PathBuf>) -> anyhow::Result<()> {
    if !config_sets(config, "builder", "memory_budget_mb")?
        && let Some(mb) = shoal_net::demo::shared_builder_memory_mb(cfg)?
    {
        eprintln!(
            "{} builders share this process: builder.memory_budget_mb = {mb} each instead of {} (half of what \
             run.memory_mb leaves them); set it in a --config to choose",
            cfg.run.builders, cfg.builder.memory_budget_mb
        );
        cfg.builder.memory_budget_mb = mb;
    }
    Ok(())
}

/// `run.prefault_mb` for the demo: `--prefault-mb`, else the file's, else
/// [`shoal_net::budget::auto_prefault`] (6 s of the offered data), said on stderr: a
/// newcomer's `shoal demo --sources 300 --builders 100` otherwise faults its working set in
/// page by page while the data flow, and falls behind (docs/bench/history.md, "Memory mapped
/// before the run").
fn choose_prefault(cfg: &mut Config, config: Option<&PathBuf>, flag: Option<u64>) -> anyhow::Result<()> {
    if let Some(mb) = flag {
        cfg.run.prefault_mb = mb;
        return Ok(());
    }
    if config_sets(config, "run", "prefault_mb")? {
        return Ok(());
    }
    if let Some(auto) = shoal_net::budget::auto_prefault(cfg)? {
        let (mb, rate) = (auto.mb, auto.offered_bytes_per_s);
        eprintln!(
            "{} sources offer about {:.0} MB/s: run.prefault_mb = {mb} maps {:.1} s of it before the run, so that \
             the run does not fault its memory in page by page; --prefault-mb (0: none) or the --config to choose",
            cfg.run.sources,
            rate as f64 / 1e6,
            (mb << 20) as f64 / rate.max(1) as f64
        );
        cfg.run.prefault_mb = mb;
    }
    Ok(())
}

/// Whether the configuration file at `path` sets `[section] key` itself (not the default).
fn config_sets(path: Option<&PathBuf>, section: &str, key: &str) -> anyhow::Result<bool> {
    let Some(path) = path else { return Ok(false) };
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let table: toml::Table = text.parse().with_context(|| format!("parsing {}", path.display()))?;
    Ok(table.get(section).and_then(|s| s.get(key)).is_some())
}

fn ctrl_c_token() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("interrupted: stopping data taking and draining");
            t.cancel();
        }
    });
    token
}

fn main() -> ExitCode {
    init_tracing();
    if let Err(e) = shoal_net::memory::disable_huge_pages() {
        tracing::debug!("transparent huge pages stay on: {e}");
    }
    let cli = Cli::parse();
    // The command runs as a task on the runtime's workers, not on this thread under
    // `block_on`: a builder's loop woken by its readers' tasks then runs on a worker, where
    // the wake-up is a push to that worker's queue rather than a futex call to wake this
    // thread (docs/bench/history.md "The node's loop on a worker"). The workers get the main
    // thread's 8-MiB stack (tokio's default is 2 MiB), which the commands had before.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .thread_stack_size(8 << 20)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = match rt.block_on(async { tokio::spawn(run(cli)).await }) {
        Ok(result) => result,
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => Err(anyhow::anyhow!("the command's task ended without finishing: {e}")),
        },
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Runs `f` on a blocking thread while Ctrl-C is caught: `shoal run` (a child in the same
/// process group) gets it and stops the run cleanly, and `f` goes on to collect and to tear
/// the testbed down instead of dying with the namespaces still up.
async fn with_ctrl_c_ignored(
    f: impl FnOnce() -> anyhow::Result<ExitCode> + Send + 'static,
) -> anyhow::Result<ExitCode> {
    let watch = tokio::spawn(async {
        while tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("interrupted: the run stops, then the testbed is torn down");
        }
    });
    let r = tokio::task::spawn_blocking(f).await?;
    watch.abort();
    r
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Demo(args) => demo(args).await,
        Command::Node(args) => node(args).await,
        Command::Ledger(args) => ledger::run(args),
        Command::Diagnose(args) => diagnose::run(args),
        Command::Consume(args) => tokio::task::spawn_blocking(move || consume::run(args)).await?,
        Command::FilterWorker(args) => tokio::task::spawn_blocking(move || filter_worker::run(args)).await?,
        Command::ClbEmulate(args) => km3net::emulate(args),
        Command::ClbAssemble(args) => km3net::assemble(args),
        Command::JdaqCheck(args) => km3net::jdaq_check(args),
        Command::Run(args) => run::command(args.into()).await,
        Command::TriggerEval(args) => tokio::task::spawn_blocking(move || trigger::eval(args)).await?,
        Command::Replay(args) => tokio::task::spawn_blocking(move || replay::command(args)).await?,
        Command::Dispatcher(args) => dispatcher(args).await,
        Command::Alert(args) => alert::command(args).await,
        Command::Sim(args) => tokio::task::spawn_blocking(move || sim::command(args)).await?,
        Command::Testbed(args) => with_ctrl_c_ignored(move || testbed::command(args)).await,
        Command::Validate(args) => with_ctrl_c_ignored(move || testbed::validate(args)).await,
        // Ctrl-C stops a sender or receiver at once, but lets the testbed be torn down.
        Command::ProbeSwitch(args) if args.builds_a_testbed() => {
            with_ctrl_c_ignored(move || probe::command(args)).await
        }
        Command::ProbeSwitch(args) => tokio::task::spawn_blocking(move || probe::command(args)).await?,
        Command::Ca(args) => security::ca(args).map(|()| ExitCode::SUCCESS),
        Command::Token(args) => security::token(args).map(|()| ExitCode::SUCCESS),
        Command::Archive(args) => archive::run(args, ctrl_c_token()).await,
        Command::Audit(args) => security::audit(args).map(|()| ExitCode::SUCCESS),
        Command::Config => {
            print!("{}", toml::to_string(&Config::default())?);
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn demo(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let mut cfg = load(args.config.as_ref())?;
    if let Some(v) = args.seconds {
        cfg.run.seconds = v;
    }
    if let Some(v) = args.sources {
        cfg.run.sources = v;
    }
    if let Some(v) = args.builders {
        cfg.run.builders = v;
    }
    if let Some(v) = args.policy {
        cfg.run.policy = v;
    }
    if let Some(v) = args.transport {
        cfg.run.transport = v;
    }
    if let Some(v) = args.out {
        cfg.writer.out_dir = v;
    }
    if let Some(v) = args.slice_ms {
        cfg.run.slice_ms = v;
    }
    match (args.muon_hz, &args.config) {
        (Some(v), _) => cfg.source.physics.muon_rate_hz = v,
        (None, None) => cfg.source.physics.muon_rate_hz = DEMO_MUON_HZ,
        (None, Some(_)) => {}
    }
    if cfg.run.seconds <= 0.0 {
        anyhow::bail!("demo needs --seconds > 0");
    }
    let live = Arc::new(Live::default());
    let mut km3 = match args.detector.as_str() {
        "km3net" => {
            if args.sources.is_some() || args.slice_ms.is_some() {
                anyhow::bail!(
                    "--detector km3net: the DOMs are the sources (--lines, --doms-per-line) and slices are 100 ms"
                );
            }
            Some(km3net::KmDemo::prepare(&mut cfg, args.lines, args.doms_per_line, &live).await?)
        }
        _ => None,
    };
    cfg.validate()?;
    share_builder_memory(&mut cfg, args.config.as_ref())?;
    choose_prefault(&mut cfg, args.config.as_ref(), args.prefault_mb)?;

    let cancel = ctrl_c_token();
    let total_slices = (cfg.run.seconds * 1000.0 / cfg.run.slice_ms as f64).ceil() as u64;
    let bar = ProgressBar::new(total_slices);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} slices  {msg}")
            .expect("template"),
    );
    let ticker = {
        let live = live.clone();
        let bar = bar.clone();
        let sources = u64::from(cfg.run.sources);
        tokio::spawn(async move {
            let mut last_bytes = 0;
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tick.tick().await;
                bar.set_position(Live::get(&live.fragments_produced) / sources.max(1));
                let bytes = Live::get(&live.bytes_received);
                bar.set_message(format!(
                    "complete {}  incomplete {}  {:.1} MB/s",
                    Live::get(&live.slices_complete),
                    Live::get(&live.slices_incomplete),
                    (bytes - last_bytes) as f64 / 0.5 / 1e6
                ));
                last_bytes = bytes;
            }
        })
    };
    let alerter = args.alert_at.map(|at| {
        let live = live.clone();
        let (window, lag) = (args.alert_window, args.alert_lag);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs_f64(at.max(0.0))).await;
            let ns = |s: f64| (s.max(0.0) * 1e9) as u64;
            let to = WallClock::new().now().as_nanos().saturating_sub(ns(lag));
            let (from, to) = (to.saturating_sub(ns(window.max(0.001))), to);
            let (from, to) = (shoal_core::Instant::from_nanos(from), shoal_core::Instant::from_nanos(to));
            match shoal_core::alert::Alert::new("demo", from, to, "shoal-demo") {
                Ok(a) => {
                    if live.alerts.alerts.send(a).is_err() {
                        eprintln!("alert not sent: the burst saver is disabled");
                    }
                }
                Err(e) => eprintln!("alert not sent: {e}"),
            }
        })
    });
    if let Some(k) = km3.as_mut() {
        k.start_emulator(&cfg)?;
    }
    let out_dir = cfg.writer.out_dir.clone();
    let result = run_embedded(cfg, live, cancel).await;
    if let Some(a) = alerter {
        a.abort();
    }
    ticker.abort();
    bar.finish_and_clear();
    let summary = result?;
    let km3 = match km3 {
        Some(k) => Some(k.finish(&summary).await?),
        None => None,
    };
    let archived = match &args.archive {
        Some(dir) => Some(archive::demo(&out_dir, dir).await?),
        None => None,
    };
    if args.json {
        let mut v = serde_json::to_value(&summary)?;
        if let Some(k) = &km3 {
            v["km3net_demo"] = serde_json::to_value(k)?;
        }
        if let Some(a) = &archived {
            v["archive"] = serde_json::to_value(a)?;
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", summary::table(&summary));
        if let Some(k) = &km3 {
            print!("{}", km3net::demo_table(&summary, k));
        }
        if let (Some(a), Some(dir)) = (&archived, &args.archive) {
            print!("{}", archive::ledger_table(a, &format!("file://{}", dir.display())));
        }
    }
    let code = exit_code(&summary, args.min_complete);
    if archived.is_some_and(|a| a.files_quarantined > 0 || a.bytes_lost > 0 || !a.balanced())
        && code == ExitCode::SUCCESS
    {
        return Ok(ExitCode::from(4));
    }
    Ok(code)
}

fn cfg_access_text(nets: &[shoal_core::controlhost::IpNet]) -> String {
    match nets {
        [] => "this host only".into(),
        nets => nets.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
    }
}

async fn dispatcher(args: DispatcherArgs) -> anyhow::Result<ExitCode> {
    use shoal_core::controlhost::RouterConfig;
    use shoal_dispatcher::server::{DispatcherConfig, serve_http, spawn_dispatcher};
    if args.queue_limit == 0 || args.max_payload_mb == 0 {
        anyhow::bail!("--queue-limit and --max-payload-mb must be at least 1");
    }
    let secure = match &args.credentials {
        None => None,
        Some(dir) => {
            let identity = shoal_tls::Identity::load(&shoal_tls::Credentials::in_dir(dir, &args.name))
                .with_context(|| format!("--credentials {}", dir.display()))?;
            let authority = shoal_dispatcher::authority::Authority::new(args.control_from.clone());
            let audit = args.audit_dir.as_deref().map(|d| std::sync::Arc::new(shoal_dispatcher::audit::Audit::new(d)));
            Some(shoal_dispatcher::server::SecureControl::new(&identity, authority, audit)?)
        }
    };
    let secured = secure.is_some();
    let cfg = DispatcherConfig {
        secure,
        router: RouterConfig {
            queue_limit: args.queue_limit,
            memory_limit: args.memory_limit_mb << 20,
            ..Default::default()
        },
        max_payload: args.max_payload_mb.saturating_mul(1 << 20).min(i32::MAX as u32),
        max_clients: args.max_clients.max(1),
        access: match args.control_from.is_empty() {
            true => shoal_core::controlhost::CommandAccess::default(),
            false => shoal_core::controlhost::CommandAccess::new(args.control_from.clone()),
        },
    };
    let http_off_loopback =
        args.http != "off" && args.http.parse::<std::net::SocketAddr>().is_ok_and(|a| !a.ip().is_loopback());
    // Off loopback, the ControlHost port is safe for commands once the operator has said
    // whose command tags it takes (ControlHost has no credentials to check); the status page
    // once a web configuration protects it.
    if !args.insecure && !secured && !args.listen.ip().is_loopback() && args.control_from.is_empty() {
        anyhow::bail!(
            "the dispatcher authenticates nobody: --listen {} off loopback would let anyone who reaches it publish \
             run-control commands; say whose command tags it takes (--control-from NET), or add --insecure on a \
             network you trust (docs/security.md)",
            args.listen
        );
    }
    if !args.insecure && http_off_loopback && args.web_config.is_none() {
        anyhow::bail!(
            "--http {} off loopback: give --web-config (a Prometheus web.yml: TLS, client certificates) or \
             --insecure on a network you trust (docs/security.md)",
            args.http
        );
    }
    let web = match &args.web_config {
        Some(f) => Some(std::sync::Arc::new(shoal_tls::web::WebConfig::load(f)?)),
        None => None,
    };
    shoal_net::demo::raise_fd_limit();
    let cancel = ctrl_c_token();
    if args.exit_with_parent {
        shoal_net::node::watch_parent(cancel.clone());
    }
    // A deep accept backlog: whole farms (re)connect at once after a restart.
    let socket =
        if args.listen.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    let listener = socket
        .bind(args.listen)
        .and_then(|()| socket.listen(4096))
        .with_context(|| format!("binding the dispatcher port {}", args.listen))?;
    let (handle, core) = spawn_dispatcher(listener, cfg, cancel.clone())?;
    match secured {
        true => eprintln!(
            "shoal dispatcher listening on {} (plain and mutual TLS: shoal's tags by certificate; plain command tags from {})",
            handle.addr,
            if args.control_from.is_empty() { "nowhere".to_string() } else { cfg_access_text(&args.control_from) }
        ),
        false => eprintln!(
            "shoal dispatcher listening on {}; command tags from {}",
            handle.addr,
            cfg_access_text(&args.control_from)
        ),
    }
    if args.http != "off" {
        let addr: std::net::SocketAddr = args.http.parse().with_context(|| format!("--http {:?}", args.http))?;
        let http = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding HTTP port {addr}"))?;
        let scheme = if web.as_ref().is_some_and(|w| w.tls.is_some()) { "https" } else { "http" };
        eprintln!("status {scheme}://{addr}/status  metrics {scheme}://{addr}/metrics");
        tokio::spawn(serve_http(http, handle.clone(), web, cancel.clone()));
    }
    core.await?;
    Ok(ExitCode::SUCCESS)
}

fn exit_code(s: &RunSummary, min_complete: Option<f64>) -> ExitCode {
    if !s.ledger.balanced {
        eprintln!("error: the ledger does not balance (unaccounted {})", s.ledger.unaccounted);
        return ExitCode::from(2);
    }
    if let Some(min) = min_complete {
        let total = s.slices_complete + s.slices_incomplete;
        let frac = if total == 0 { 0.0 } else { s.slices_complete as f64 / total as f64 };
        if frac < min {
            eprintln!("error: {:.2}% complete slices, below the required {:.2}%", frac * 100.0, min * 100.0);
            return ExitCode::from(3);
        }
    }
    if let Some(e) = &s.writer.error {
        eprintln!(
            "error: the run's output was not stored ({e}): {} events and {} raw records lost",
            s.writer.events_not_stored, s.writer.raw_not_stored
        );
        return ExitCode::from(4);
    }
    ExitCode::SUCCESS
}

/// `--ids` on the command line overrides the configuration file's ids for the role, or is
/// refused: an option is never silently ignored.
fn apply_ids(cfg: &mut Config, role: Role, ids: &[u32]) -> anyhow::Result<()> {
    match (role, ids) {
        (_, []) => {}
        (Role::Source, ids) => cfg.source.ids = ids.to_vec(),
        (Role::Builder, [id]) => cfg.builder.id = *id,
        (Role::Builder, _) => anyhow::bail!("a builder process has one id: --ids {ids:?}"),
        (Role::Writer, _) => anyhow::bail!("the writer takes no --ids"),
        (Role::Dfm, _) => anyhow::bail!("the data-flow manager takes no --ids"),
    }
    Ok(())
}

async fn node(args: NodeArgs) -> anyhow::Result<ExitCode> {
    let role = args.role;
    if let Some(dispatcher) = args.dispatcher {
        let identity = match &args.credentials {
            Some(dir) => {
                let name = args.name.as_deref().expect("clap requires --name");
                Some(shoal_tls::Identity::load(&shoal_tls::Credentials::in_dir(dir, name))?)
            }
            None => None,
        };
        let opts = shoal_net::node::NodeOptions {
            role,
            name: args.name.clone().expect("clap requires --name"),
            dispatcher,
            ids: args.ids,
            input: args.input,
            metrics: args.metrics,
            stats_interval: Duration::from_millis(args.stats_ms.max(50)),
            clock: WallClock::new()
                .skewed((args.test_clock_offset_us * 1e3) as i64, (args.test_clock_drift_ppm * 1e3) as i64),
            credentials: match &identity {
                Some(id) => shoal_net::transport::secure::DataCredentials::single(id.clone())?,
                None => Default::default(),
            },
            control_tls: match (&identity, args.control_plain) {
                (Some(id), false) => Some(shoal_dispatcher::client::ControlTls::new(id)?),
                _ => None,
            },
            web_config: match &args.web_config {
                Some(f) => Some(std::sync::Arc::new(shoal_tls::web::WebConfig::load(f)?)),
                None => None,
            },
        };
        shoal_net::demo::raise_fd_limit();
        let cancel = ctrl_c_token();
        if args.exit_with_parent {
            shoal_net::node::watch_parent(cancel.clone());
        }
        shoal_net::node::run_controlled(opts, cancel).await?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut cfg = load(args.config.as_ref())?;
    apply_ids(&mut cfg, role, &args.ids)?;
    if let Some(input) = args.input {
        if role != Role::Source {
            anyhow::bail!("--input is for source processes");
        }
        cfg.source.input = input;
    }
    cfg.validate()?;
    shoal_net::budget::apply_memory_plan(&mut cfg, role)?;
    let clock = WallClock::new();
    let live = Arc::new(Live::default());
    let cancel = ctrl_c_token();
    shoal_net::demo::raise_fd_limit();
    std::fs::create_dir_all(&cfg.writer.out_dir)
        .with_context(|| format!("creating {}", cfg.writer.out_dir.display()))?;
    let run = cfg.run.run_number;
    let (name, json) = match role {
        Role::Source => {
            let ids = cfg.hosted_sources();
            let r = shoal_net::source::run_source_node(cfg.clone(), ids.clone(), clock, live, cancel).await?;
            let first = ids.first().copied().unwrap_or(0);
            (format!("run{run:06}.source{first}.json"), serde_json::to_string_pretty(&r)?)
        }
        Role::Builder => {
            let addr = cfg.builder_listen()?;
            let listener =
                shoal_net::builder::bind_port(&cfg, addr).with_context(|| format!("binding builder port {addr}"))?;
            let id = cfg.builder.id;
            let r = shoal_net::builder::run_builder(
                shoal_net::builder::BuilderSettings::from_config(&cfg, id)?,
                listener,
                clock,
                live,
                cancel,
            )
            .await?;
            (format!("run{run:06}.builder{id}.json"), serde_json::to_string_pretty(&r)?)
        }
        Role::Writer => {
            let addr = cfg.writer_listen()?;
            let listener =
                shoal_net::transport::listen::bind(addr).with_context(|| format!("binding writer port {addr}"))?;
            let r = shoal_net::writer::run_writer(cfg.clone(), listener, cancel).await?;
            (format!("run{run:06}.writer.json"), serde_json::to_string_pretty(&r)?)
        }
        Role::Dfm => {
            let addr = cfg.dfm_addr()?;
            let listener = shoal_net::transport::listen::bind(addr)
                .with_context(|| format!("binding the data-flow manager port {addr}"))?;
            let r = shoal_net::dfm::run_dfm(cfg.clone(), listener, clock, live, cancel).await?;
            (format!("run{run:06}.dfm.json"), serde_json::to_string_pretty(&r)?)
        }
    };
    let path = cfg.writer.out_dir.join(name);
    std::fs::write(&path, &json).with_context(|| format!("writing {}", path.display()))?;
    println!("{json}");
    eprintln!("report written to {}", path.display());
    Ok(ExitCode::SUCCESS)
}
