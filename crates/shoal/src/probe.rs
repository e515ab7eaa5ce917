//! `shoal probe-switch`: measure a switch port's output buffer by flooding it.
//!
//! `send` runs on each sender host, `measure` on the receiver behind the port under test;
//! `testbed` builds a one-switch emulated network with a configured buffer and runs both
//! on it, to check the probe against a known answer.

use std::net::{SocketAddr, SocketAddrV4};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::Duration;

use anyhow::Context;
use shoal_core::probe::BufferLimit;
use shoal_net::probe::{ProbeOptions, ProbeReport, measure, serve_sender};
use shoal_testbed::netns;
use shoal_testbed::plan::{HostRole, Plan, Queue};

#[derive(clap::Args)]
pub struct ProbeArgs {
    #[command(subcommand)]
    command: ProbeCommand,
}

#[derive(clap::Args, Clone)]
struct FloodArgs {
    /// Length of each flood, milliseconds (long enough to fill the buffer several times
    /// over: the estimate is the median over the stretch in which the port drops).
    #[arg(long, default_value_t = 300.0)]
    flood_ms: f64,
    /// UDP payload of the large datagrams (1472: full 1514-byte frames).
    #[arg(long, default_value_t = 1472)]
    large: u16,
    /// UDP payload of the small datagrams (200: 242-byte frames).
    #[arg(long, default_value_t = 200)]
    small: u16,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Subcommand)]
enum ProbeCommand {
    /// A sender: wait for the receiver's orders and flood it (run one on each sender host).
    Send {
        /// Address to take orders on, e.g. 0.0.0.0:7700.
        #[arg(long)]
        listen: SocketAddr,
        /// Floods to send before exiting (a measurement is two: large and small datagrams).
        #[arg(long, default_value_t = 2)]
        rounds: u32,
        /// Exit after this many seconds without an order.
        #[arg(long, default_value_t = 120.0)]
        idle_exit_s: f64,
    },
    /// The receiver, behind the port under test: order the senders' floods and report the
    /// port's output buffer in packets and bytes, and whether it limits packets or bytes.
    Measure {
        /// The senders' order addresses (comma-separated).
        #[arg(long, value_delimiter = ',', required = true)]
        senders: Vec<SocketAddr>,
        /// Where the floods arrive.
        #[arg(long, default_value = "0.0.0.0:7701")]
        bind: SocketAddr,
        /// Each sender's pace in Mbit/s of frames: the rate of the port under test (N
        /// senders then overload it N times). Keep it below the senders' own link rate,
        /// so that their queues stay empty.
        #[arg(long)]
        pace_mbps: f64,
        #[command(flatten)]
        flood: FloodArgs,
    },
    /// Build a one-switch testbed whose receiver port has the given buffer, probe it, and
    /// compare (root).
    Testbed {
        #[arg(long, default_value_t = 3)]
        senders: u32,
        /// Rate of the probed port (the senders pace at it).
        #[arg(long, default_value_t = 20.0)]
        port_mbps: f64,
        /// Rate of the senders' links (faster than the port: their queues stay empty).
        #[arg(long, default_value_t = 200.0)]
        sender_mbps: f64,
        /// The probed port's buffer: a pfifo of this many packets ...
        #[arg(long, conflicts_with = "queue_bytes", required_unless_present = "queue_bytes")]
        queue_packets: Option<usize>,
        /// ... or a bfifo of this many bytes.
        #[arg(long)]
        queue_bytes: Option<u64>,
        /// Namespace prefix (1-6 letters or digits).
        #[arg(long, default_value = "pb")]
        prefix: String,
        #[command(flatten)]
        flood: FloodArgs,
    },
}

/// The order port of a sender daemon and the receiver's flood port on the testbed (inside
/// namespaces of their own: nothing else listens there).
const SEND_PORT: u16 = 7700;
const RECEIVE_PORT: u16 = 7701;

impl ProbeArgs {
    pub fn builds_a_testbed(&self) -> bool {
        matches!(self.command, ProbeCommand::Testbed { .. })
    }
}

pub fn command(args: ProbeArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        ProbeCommand::Send { listen, rounds, idle_exit_s } => {
            let report = serve_sender(listen, rounds, Duration::from_secs_f64(idle_exit_s.max(0.1)))?;
            eprintln!(
                "sent {} datagrams in {} floods ({} refused by the kernel, {} stray datagrams ignored)",
                report.datagrams_sent, report.rounds, report.send_errors, report.malformed
            );
            Ok(ExitCode::SUCCESS)
        }
        ProbeCommand::Measure { senders, bind, pace_mbps, flood } => {
            anyhow::ensure!(pace_mbps > 0.0 && pace_mbps.is_finite(), "--pace-mbps must be positive");
            let opts = ProbeOptions {
                senders,
                bind,
                pace_bps: (pace_mbps * 1e6) as u64,
                flood: Duration::from_secs_f64(flood.flood_ms.max(1.0) / 1e3),
                large_payload: flood.large,
                small_payload: flood.small,
            };
            let report = measure(&opts)?;
            if flood.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", render(&report));
            }
            Ok(if report.verdict.is_some() { ExitCode::SUCCESS } else { ExitCode::from(3) })
        }
        ProbeCommand::Testbed { senders, port_mbps, sender_mbps, queue_packets, queue_bytes, prefix, flood } => {
            let queue = match (queue_packets, queue_bytes) {
                (_, Some(b)) => Queue::Bytes(b),
                (Some(p), None) => Queue::Packets(p),
                (None, None) => anyhow::bail!("--queue-packets or --queue-bytes"),
            };
            let plan = Plan::star(&prefix, senders, sender_mbps, port_mbps, queue).map_err(anyhow::Error::msg)?;
            netns::up(&plan)?;
            let result = probe_on(&plan, port_mbps, &flood);
            let removed = netns::down(&plan.prefix);
            let (report, tc_drops) = result?;
            removed.context("tearing the testbed down")?;
            let configured = match queue {
                Queue::Packets(n) => format!("pfifo limit {n} (packets)"),
                Queue::Bytes(b) => format!("bfifo limit {b} (bytes)"),
            };
            let check = report.verdict.map(|v| {
                let (want, got, kind) = match queue {
                    Queue::Packets(n) => (n as f64, f64::from(v.packets), BufferLimit::Packets),
                    Queue::Bytes(b) => (b as f64, v.bytes as f64, BufferLimit::Bytes),
                };
                (v.limit == kind, (got - want) / want)
            });
            if flood.json {
                let v = serde_json::json!({
                    "configured": configured,
                    "tc_drops": tc_drops,
                    "identified": check.map(|c| c.0),
                    "relative_error": check.map(|c| c.1),
                    "report": report,
                });
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print!("{}", render(&report));
                println!("configured: {configured}; the port's queue dropped {tc_drops} packets");
                if let Some((same_kind, err)) = check {
                    println!(
                        "{}, size off by {:+.1}%",
                        if same_kind { "limit identified" } else { "limit NOT identified" },
                        err * 100.0
                    );
                }
            }
            Ok(match check {
                Some((true, err)) if err.abs() <= 0.05 => ExitCode::SUCCESS,
                _ => ExitCode::from(3),
            })
        }
    }
}

/// Starts a sender daemon in each sender namespace and runs the receiver in its own; returns
/// its report and what the probed port's queue says it dropped.
fn probe_on(plan: &Plan, port_mbps: f64, flood: &FloodArgs) -> anyhow::Result<(ProbeReport, u64)> {
    let exe = std::env::current_exe().context("finding the shoal executable")?;
    let receiver = plan.host(HostRole::Builder(0)).context("the plan has a receiver")?;
    let mut daemons: Vec<Child> = Vec::new();
    let mut orders = Vec::new();
    let started = (|| -> anyhow::Result<()> {
        for h in plan.hosts.iter().filter(|h| matches!(h.role, HostRole::Source(_))) {
            let listen = SocketAddrV4::new(h.addr, SEND_PORT);
            daemons.push(
                Command::new("ip")
                    .args(["netns", "exec", &h.netns])
                    .arg(&exe)
                    .args(["probe-switch", "send", "--listen", &listen.to_string(), "--idle-exit-s", "30"])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    // Its closing line would mix into the report; the receiver says what
                    // arrived, which is what matters.
                    .stderr(Stdio::null())
                    .spawn()
                    .with_context(|| format!("starting the sender in {}", h.netns))?,
            );
            orders.push(listen.to_string());
        }
        Ok(())
    })();
    let result = started.and_then(|()| {
        // The daemons bind before they read; an order sent before that is lost, so the
        // receiver waits until each namespace has its socket.
        for h in plan.hosts.iter().filter(|h| matches!(h.role, HostRole::Source(_))) {
            wait_for_udp_socket(&h.netns, SEND_PORT)?;
        }
        let out = Command::new("ip")
            .args(["netns", "exec", &receiver.netns])
            .arg(&exe)
            .args(["probe-switch", "measure", "--json", "--senders", &orders.join(",")])
            .args(["--bind", &SocketAddrV4::new(receiver.addr, RECEIVE_PORT).to_string()])
            .args(["--pace-mbps", &port_mbps.to_string(), "--flood-ms", &flood.flood_ms.to_string()])
            .args(["--large", &flood.large.to_string(), "--small", &flood.small.to_string()])
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .context("running the receiver")?;
        let report: ProbeReport = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("reading the receiver's report ({})", out.status))?;
        let switch = plan.switches.first().context("the plan has a switch")?;
        let drops = netns::drops(switch)?.into_iter().filter(|(dev, _)| dev == "r").map(|(_, n)| n).sum();
        Ok((report, drops))
    });
    for mut d in daemons {
        // Done after two rounds; killed if the receiver failed before ordering them.
        let _ = d.kill();
        let _ = d.wait();
    }
    result
}

/// Waits (bounded) until a UDP socket is bound on `port` in `netns`.
fn wait_for_udp_socket(netns: &str, port: u16) -> anyhow::Result<()> {
    for _ in 0..500 {
        let out = Command::new("ip")
            .args(["netns", "exec", netns, "ss", "-Hlun", &format!("sport = :{port}")])
            .stdin(Stdio::null())
            .output()
            .context("running ss")?;
        if !String::from_utf8_lossy(&out.stdout).trim().is_empty() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    anyhow::bail!("no sender listening on port {port} in {netns} after 5 s")
}

fn render(report: &ProbeReport) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:>7} {:>9} {:>9} {:>9} {:>9} {:>10} {:>8} {:>10} {:>12}",
        "frame", "sent", "received", "flood ms", "drain Mb/s", "sampled", "packets", "p10-p90", "bytes"
    );
    for f in &report.floods {
        match (&f.estimate, &f.error) {
            (Some(e), _) => {
                let _ = writeln!(
                    s,
                    "{:>7} {:>9} {:>9} {:>9.0} {:>10.1} {:>10} {:>8} {:>10} {:>12}",
                    e.frame_bytes,
                    e.sent,
                    e.received,
                    e.flood_ms,
                    e.drain_bps as f64 / 1e6,
                    e.saturated,
                    e.packets,
                    format!("{}-{}", e.packets_p10, e.packets_p90),
                    e.bytes
                );
            }
            (None, Some(err)) => {
                let _ = writeln!(s, "payload {}: no estimate: {err}", f.payload);
            }
            (None, None) => {}
        }
        if f.unstamped > 0 || f.malformed > 0 {
            let _ = writeln!(s, "  ({} datagrams without kernel timestamp, {} stray)", f.unstamped, f.malformed);
        }
    }
    match &report.verdict {
        Some(v) => {
            let _ = match v.limit {
                BufferLimit::Packets => writeln!(s, "the buffer limits packets: {} packets", v.packets),
                BufferLimit::Bytes => writeln!(
                    s,
                    "the buffer limits bytes: {} bytes ({:.1} kB; {} full-size frames)",
                    v.bytes,
                    v.bytes as f64 / 1e3,
                    v.large.packets
                ),
            };
        }
        None => s.push_str("no verdict: a flood gave no estimate\n"),
    }
    s
}
