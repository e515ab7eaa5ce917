//! Propagation delay without netem: a delay line on a netfilter queue.
//!
//! This kernel has no netem (../shared/testbed.md), so a link cannot be told to hold its
//! packets. A switch namespace can instead hand every forwarded IPv4 packet to user space
//! (`iptables -A FORWARD -j NFQUEUE`, seen by bridged packets through br_netfilter): the
//! delay line receives the packet's metadata only (not its bytes), holds its id for the
//! delay, then lets the kernel send it on (`NF_ACCEPT`). A constant delay keeps the order,
//! so nothing is reordered; a packet the kernel cannot queue (queue full, socket buffer
//! full) is dropped and counted by the kernel, and reported here as the emulator's loss,
//! apart from the network's.
//!
//! - [`DelayLine`]: the holding logic, sans-IO (time comes in as nanoseconds), tested alone;
//! - [`serve`]: the process around it (`shoal testbed delay-line`), one per switch
//!   namespace that carries a delayed link; it stops on SIGTERM or SIGINT and then prints
//!   its [`DelayLineReport`] as one JSON line (the command turns the signal into a
//!   readable descriptor for [`serve`]);
//! - [`DelayLines`]: starting those processes for a plan and collecting their reports.
//!
//! The price: a system call per packet received and one per release round (a batch
//! verdict, [`crate::nfqueue`]), and the line's own lateness on top of the delay asked
//! for, which each line measures and reports (its wait for a CPU included).

use std::collections::VecDeque;
use std::io::{BufRead as _, BufReader, Write as _};
use std::os::fd::BorrowedFd;
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;

use crate::nfqueue::NfQueue;
use crate::plan::{Plan, QUEUE_NUM};

/// Packets the kernel may hold for one delay line before it drops (a 1 ms delay at 100
/// kpps holds 100).
const KERNEL_QUEUE_MAX: u32 = 1 << 16;

/// The netlink socket's receive buffer (metadata-only messages are about 1 kB of buffer
/// each in the kernel's accounting: room for 16,000 waiting packets).
const RECEIVE_BUFFER: usize = 16 << 20;

/// The first line a delay line prints once it is bound and packets may flow.
pub const READY: &str = "ready";

/// Holds packets (anything: their queue ids in [`serve`]) for a constant delay and gives
/// them back in arrival order once it has passed.
#[derive(Debug)]
pub struct DelayLine<T> {
    delay_ns: u64,
    held: VecDeque<(T, u64)>,
    packets: u64,
    held_max: usize,
    /// How long after its due time each packet was given back (ns).
    late_ns: Histogram<u64>,
}

impl<T> DelayLine<T> {
    pub fn new(delay: Duration) -> Self {
        DelayLine {
            delay_ns: delay.as_nanos() as u64,
            held: VecDeque::new(),
            packets: 0,
            held_max: 0,
            late_ns: Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds"),
        }
    }

    /// A packet arrived at `now_ns`.
    pub fn hold(&mut self, packet: T, now_ns: u64) {
        self.held.push_back((packet, now_ns + self.delay_ns));
        self.packets += 1;
        self.held_max = self.held_max.max(self.held.len());
    }

    /// When the next packet is due, if any is held.
    pub fn next_due(&self) -> Option<u64> {
        self.held.front().map(|&(_, due)| due)
    }

    /// The oldest packet if its delay has passed at `now_ns`.
    pub fn pop_due(&mut self, now_ns: u64) -> Option<T> {
        let &(_, due) = self.held.front()?;
        if due > now_ns {
            return None;
        }
        let (packet, _) = self.held.pop_front().expect("front exists");
        let _ = self.late_ns.record((now_ns - due).max(1));
        Some(packet)
    }

    /// Everything still held, oldest first (when the line stops).
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.held.drain(..).map(|(p, _)| p)
    }

    pub fn held(&self) -> usize {
        self.held.len()
    }

    pub fn report(&self, kernel_dropped: u64) -> DelayLineReport {
        let us = |ns: u64| ns as f64 / 1e3;
        DelayLineReport {
            netns: String::new(),
            delay_us: us(self.delay_ns),
            packets: self.packets,
            held_max: self.held_max as u64,
            late_p50_us: us(self.late_ns.value_at_quantile(0.5)),
            late_p99_us: us(self.late_ns.value_at_quantile(0.99)),
            late_max_us: us(self.late_ns.max()),
            kernel_dropped,
            cpu_s: 0.0,
            realtime: false,
        }
    }
}

/// What one delay line did over its life.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DelayLineReport {
    /// The switch namespace (filled in by [`DelayLines::stop`]).
    #[serde(default)]
    pub netns: String,
    pub delay_us: f64,
    pub packets: u64,
    /// The most packets held at once.
    pub held_max: u64,
    /// How late packets left after their delay, beyond the delay itself: the line's own
    /// scheduling latency (the wait for a CPU included).
    pub late_p50_us: f64,
    pub late_p99_us: f64,
    pub late_max_us: f64,
    /// Packets the kernel dropped instead of queueing them (queue or socket buffer full):
    /// losses of the emulator, not of the emulated network. Zero in a sound run.
    pub kernel_dropped: u64,
    /// CPU time the line used (s), and whether it ran with a real-time priority
    /// (SCHED_FIFO, as the testbed starts it: a switch does not wait for the hosts' CPU).
    #[serde(default)]
    pub cpu_s: f64,
    #[serde(default)]
    pub realtime: bool,
}

/// The kernel's drops of queue `num` in this namespace (`queue_dropped` + `user_dropped`
/// of /proc/self/net/netfilter/nfnetlink_queue).
fn kernel_dropped(num: u16) -> u64 {
    let text = std::fs::read_to_string("/proc/self/net/netfilter/nfnetlink_queue").unwrap_or_default();
    parse_kernel_dropped(&text, num)
}

fn parse_kernel_dropped(text: &str, num: u16) -> u64 {
    // queue_num peer_portid queue_total copy_mode copy_range queue_dropped user_dropped id_sequence 1
    text.lines()
        .map(|l| l.split_whitespace().filter_map(|w| w.parse::<u64>().ok()).collect::<Vec<_>>())
        .find(|f| f.len() >= 7 && f[0] == u64::from(num))
        .map(|f| f[5] + f[6])
        .unwrap_or(0)
}

/// Runs a delay line on queue [`QUEUE_NUM`] of the current network namespace until `stop`
/// becomes readable (the caller turns SIGTERM into that), then lets every held packet go
/// and returns what it did. Prints [`READY`] on stdout once bound.
pub fn serve(delay: Duration, stop: BorrowedFd<'_>) -> anyhow::Result<DelayLineReport> {
    use rustix::event::{PollFd, PollFlags, Timespec};

    // Waits end within the timer slack (50 us by default): ask for none.
    let _ = nix::sys::prctl::set_timerslack(1);

    let mut queue = NfQueue::bind(QUEUE_NUM, KERNEL_QUEUE_MAX)
        .context("binding netfilter queue 0 (root? another delay line in this namespace?)")?;
    if rustix::net::sockopt::set_socket_recv_buffer_size_force(&queue, RECEIVE_BUFFER).is_err() {
        rustix::net::sockopt::set_socket_recv_buffer_size(&queue, RECEIVE_BUFFER)?;
    }
    let mut out = std::io::stdout();
    writeln!(out, "{READY}")?;
    out.flush()?;

    let origin = Instant::now();
    let now_ns = || origin.elapsed().as_nanos() as u64;
    let mut line = DelayLine::new(delay);
    let mut arrived = Vec::new();
    loop {
        while queue.receive_ids(&mut arrived).context("receiving from the netfilter queue")? {
            let now = now_ns();
            for id in arrived.drain(..) {
                line.hold(id, now);
            }
        }
        let now = now_ns();
        let mut last = None;
        while let Some(id) = line.pop_due(now) {
            last = Some(id);
        }
        if let Some(id) = last {
            queue.accept_through(id).context("releasing packets")?;
        }
        let timeout = line.next_due().map(|due| {
            let wait = due.saturating_sub(now_ns());
            Timespec { tv_sec: (wait / 1_000_000_000) as i64, tv_nsec: (wait % 1_000_000_000) as i64 }
        });
        let mut fds = [PollFd::new(&queue, PollFlags::IN), PollFd::new(&stop, PollFlags::IN)];
        match rustix::event::poll(&mut fds, timeout.as_ref()) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e).context("waiting for packets"),
        }
        if !fds[1].revents().is_empty() {
            break;
        }
    }
    if let Some(id) = line.drain().last() {
        queue.accept_through(id)?;
    }
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let (cpu_s, realtime) = parse_stat(&stat);
    Ok(DelayLineReport { cpu_s, realtime, ..line.report(kernel_dropped(QUEUE_NUM)) })
}

/// CPU seconds (user + system) and whether the policy is real-time, from /proc/self/stat.
fn parse_stat(stat: &str) -> (f64, bool) {
    // Fields after the command name's closing parenthesis start at field 3.
    let fields: Vec<&str> =
        stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().collect()).unwrap_or_default();
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    let ticks = field(14).unwrap_or(0) + field(15).unwrap_or(0);
    // USER_HZ is 100 on every Linux architecture shoal runs on.
    let policy = field(41).unwrap_or(0);
    (ticks as f64 / 100.0, policy == 1 || policy == 2)
}

/// The delay lines of a plan's switches, one process each.
pub struct DelayLines {
    lines: Vec<(String, Child, BufReader<ChildStdout>)>,
}

impl DelayLines {
    /// Starts a delay line in every switch namespace of `plan` that delays (none when the
    /// plan has no delay) and waits until each is bound. Each runs `shoal testbed
    /// delay-line` with the `shoal` executable; its log goes to `dir/delay-<netns>.log`.
    pub fn start(plan: &Plan, shoal: &Path, dir: &Path) -> anyhow::Result<DelayLines> {
        let mut started = DelayLines { lines: Vec::new() };
        for netns in plan.delay_switches() {
            let log = std::fs::File::create(dir.join(format!("delay-{netns}.log")))?;
            // Real-time priority: a switch forwards whatever the hosts' CPUs are doing.
            // On this 2-core machine, lines with the hosts' priority let packets go 20-120
            // ms late at the 99th percentile in a 30 x 10 run (docs/validation.md).
            let mut child = Command::new("ip")
                .args(["netns", "exec", netns, "chrt", "--fifo", "20"])
                .arg(shoal)
                .args(["testbed", "delay-line", "--delay-us"])
                .arg(plan.shore_delay_us.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(log)
                .spawn()
                .with_context(|| format!("starting the delay line of {netns}"))?;
            let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
            let mut first = String::new();
            // The line either says it is ready or exits (end of file): bounded.
            stdout.read_line(&mut first)?;
            started.lines.push((netns.to_string(), child, stdout));
            if first.trim() != READY {
                let log = std::fs::read_to_string(dir.join(format!("delay-{netns}.log"))).unwrap_or_default();
                started.kill();
                bail!("the delay line of {netns} did not start: {}", log.trim());
            }
        }
        Ok(started)
    }

    /// Stops every line and collects its report.
    pub fn stop(mut self) -> anyhow::Result<Vec<DelayLineReport>> {
        let mut reports = Vec::new();
        for (netns, child, stdout) in &mut self.lines {
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGTERM)
                .with_context(|| format!("stopping the delay line of {netns}"))?;
            let mut last = String::new();
            stdout.read_line(&mut last)?;
            let status = child.wait()?;
            if !status.success() {
                bail!("the delay line of {netns} failed ({status}); see delay-{netns}.log");
            }
            let mut report: DelayLineReport = serde_json::from_str(last.trim())
                .with_context(|| format!("reading the report of the delay line of {netns}: {last:?}"))?;
            report.netns = netns.clone();
            reports.push(report);
        }
        self.lines.clear();
        Ok(reports)
    }

    /// Leaves the lines running (`shoal testbed up`): `down` kills them with everything
    /// else in the testbed's namespaces.
    pub fn detach(mut self) {
        self.lines.clear();
    }

    fn kill(&mut self) {
        for (_, child, _) in &mut self.lines {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.lines.clear();
    }
}

impl Drop for DelayLines {
    /// Lines neither stopped nor detached (a run that failed) do not outlive it.
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packets_leave_in_order_once_their_delay_has_passed() {
        let mut line = DelayLine::new(Duration::from_micros(300));
        line.hold('a', 1_000);
        line.hold('b', 1_500);
        line.hold('c', 50_000);
        assert_eq!(line.next_due(), Some(301_000));
        assert_eq!(line.pop_due(300_999), None, "not a nanosecond early");
        assert_eq!(line.pop_due(301_600), Some('a'));
        assert_eq!(line.pop_due(301_600), Some('b'));
        assert_eq!(line.pop_due(301_600), None);
        assert_eq!((line.held(), line.next_due()), (1, Some(350_000)));
        assert_eq!(line.drain().collect::<Vec<_>>(), vec!['c']);
        let r = line.report(0);
        assert_eq!((r.packets, r.held_max, r.delay_us), (3, 3, 300.0));
        // 'a' left 600 ns late and 'b' 100 ns late.
        assert!((r.late_max_us - 0.6).abs() < 0.01, "{r:?}");
        assert!((r.late_p50_us - 0.1).abs() < 0.01, "{r:?}");
    }

    #[test]
    fn an_empty_line_waits_for_nothing() {
        let mut line: DelayLine<u32> = DelayLine::new(Duration::from_millis(1));
        assert_eq!(line.next_due(), None);
        assert_eq!(line.pop_due(u64::MAX), None);
        assert_eq!(line.report(0).packets, 0);
    }

    #[test]
    fn cpu_time_and_policy_come_from_proc_stat() {
        // A command name with a space and a parenthesis; 250 + 50 ticks; policy 1 (FIFO).
        let mut stat = String::from("42 (shoal (x) y) S");
        for n in 4..=52 {
            stat.push_str(match n {
                14 => " 250",
                15 => " 50",
                41 => " 1",
                _ => " 0",
            });
        }
        assert_eq!(parse_stat(&stat), (3.0, true));
        assert_eq!(parse_stat(""), (0.0, false));
    }

    #[test]
    fn the_kernels_drops_are_read_for_our_queue_only() {
        let text = "    0  12345     3 1     0     7     2   991  1\n    1  12346     0 2 65535     5     5    10  1\n";
        assert_eq!(parse_kernel_dropped(text, 0), 9);
        assert_eq!(parse_kernel_dropped(text, 1), 10);
        assert_eq!(parse_kernel_dropped(text, 2), 0);
        assert_eq!(parse_kernel_dropped("", 0), 0);
    }
}
