//! Building and tearing down a [`Plan`] with `ip`, `tc`, `ethtool` and `sysctl`.
//!
//! Creation is batched (`ip -b` for the namespaces and veth pairs, one `sh` per namespace
//! for its configuration); teardown kills every process left in the testbed's
//! namespaces and deletes them, and is idempotent: it finds the namespaces by prefix, so
//! it also cleans up after a run that crashed.

use std::io::Write as _;
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

use crate::plan::{Congestion, Plan};

/// Runs a command, failing with its stderr.
fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.stdin(Stdio::null()).output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `program` with `input` on its stdin.
fn run_with_input(program: &str, args: &[&str], input: &str) -> anyhow::Result<()> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {program}"))?;
    child.stdin.take().expect("piped").write_all(input.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("{program} {} failed ({}): {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Why a testbed cannot be built here, if it cannot: not root, or a tool missing.
pub fn unavailable() -> Option<String> {
    // SAFETY-free check of the effective user: /proc/self/status has the uids.
    let root = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(2) == Some("0")))
        .unwrap_or(false);
    if !root {
        return Some("the testbed needs root (network namespaces, tc)".into());
    }
    for tool in ["ip", "tc", "ethtool"] {
        if !on_path(tool) {
            return Some(format!("`{tool}` is missing (Debian packages iproute2, ethtool)"));
        }
    }
    None
}

/// Whether `tool` is an executable file in a directory of `PATH`.
pub(crate) fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH").map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file())).unwrap_or(false)
}

/// Why loss cannot be injected here, if it cannot: `nft` (Debian package nftables) missing.
pub fn loss_unavailable() -> Option<String> {
    (!on_path("nft")).then(|| "`nft` is missing (Debian package nftables): loss is injected by an nft rule".into())
}

/// Why a propagation delay cannot be emulated here, if it cannot: `iptables` (Debian
/// package iptables, for its NFQUEUE target) or `chrt` (util-linux, for the delay lines'
/// real-time priority) missing.
pub fn delay_unavailable() -> Option<String> {
    if !on_path("iptables") {
        return Some(
            "`iptables` is missing (Debian package iptables): the delay lines take packets from its NFQUEUE \
             target; or set topology.shore_delay_us = 0"
                .into(),
        );
    }
    (!on_path("chrt")).then(|| "`chrt` is missing (Debian package util-linux): delay lines run real-time".into())
}

/// The testbed's namespaces that exist now.
pub fn existing(prefix: &str) -> anyhow::Result<Vec<String>> {
    let list = run(Command::new("ip").args(["netns", "list"]))?;
    let want = format!("{prefix}-");
    Ok(list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&want))
        .map(String::from)
        .collect())
}

/// Kills what runs in the testbed's namespaces and deletes them. Returns how many there were.
pub fn down(prefix: &str) -> anyhow::Result<usize> {
    let names = existing(prefix)?;
    for n in &names {
        if let Ok(pids) = run(Command::new("ip").args(["netns", "pids", n])) {
            for pid in pids.split_whitespace() {
                let _ = Command::new("kill").args(["-KILL", pid]).stdin(Stdio::null()).status();
            }
        }
    }
    if !names.is_empty() {
        let batch: String = names.iter().map(|n| format!("netns del {n}\n")).collect();
        run_with_input("ip", &["-force", "-b", "-"], &batch)?;
    }
    Ok(names.len())
}

/// Builds the testbed (after removing any leftover of the same prefix). On failure
/// everything built so far is removed again.
pub fn up(plan: &Plan) -> anyhow::Result<()> {
    if let Some(why) = unavailable() {
        bail!("cannot build a testbed: {why}");
    }
    down(&plan.prefix)?;
    let built = (|| -> anyhow::Result<()> {
        if plan.congestion == Congestion::Cubic {
            allow_congestion_control("cubic")?;
        }
        run_with_input("ip", &["-b", "-"], &plan.root_batch()).context("creating namespaces and links")?;
        for n in plan.namespaces() {
            run(Command::new("ip").args(["netns", "exec", n, "sh", "-e", "-c", &plan.namespace_script(n)]))
                .with_context(|| format!("configuring {n}"))?;
        }
        Ok(())
    })();
    if let Err(e) = built {
        let _ = down(&plan.prefix);
        return Err(e);
    }
    Ok(())
}

/// A namespace may only choose a congestion control the root namespace allows.
fn allow_congestion_control(name: &str) -> anyhow::Result<()> {
    let path = "/proc/sys/net/ipv4/tcp_allowed_congestion_control";
    let allowed = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    if allowed.split_whitespace().any(|a| a == name) {
        return Ok(());
    }
    let value = format!("{} {name}", allowed.trim());
    std::fs::write(path, &value).with_context(|| format!("allowing {name} in {path}"))
}

/// TCP counters of one namespace (a namespace starts from zero). Besides the segments
/// sent, retransmitted and the timeouts, Linux's loss recovery says how it recovered:
/// fast retransmits, tail-loss probes, and what turned out spurious (DSACKs received,
/// reordering detected, undone timeouts), which a model without SACK, RACK or TLP does
/// not have.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TcpCounters {
    pub segments_out: u64,
    pub retransmitted_segments: u64,
    pub timeouts: u64,
    pub fast_retransmits: u64,
    pub loss_probes: u64,
    pub dsacks_received: u64,
    pub reordering_detected: u64,
    pub spurious_timeouts: u64,
}

impl TcpCounters {
    /// Counts from `/proc/net/snmp` and `/proc/net/netstat`.
    fn parse(snmp: &str, netstat: &str) -> TcpCounters {
        let values = snmp_values(&[snmp, netstat]);
        let get = |k: &str| values.get(k).copied().unwrap_or(0);
        TcpCounters {
            segments_out: get("TcpOutSegs"),
            retransmitted_segments: get("TcpRetransSegs"),
            timeouts: get("TcpExtTCPTimeouts"),
            fast_retransmits: get("TcpExtTCPFastRetrans"),
            loss_probes: get("TcpExtTCPLossProbes"),
            dsacks_received: get("TcpExtTCPDSACKRecv"),
            reordering_detected: get("TcpExtTCPSACKReorder") + get("TcpExtTCPRenoReorder") + get("TcpExtTCPTSReorder"),
            spurious_timeouts: get("TcpExtTCPSpuriousRTOs"),
        }
    }

    /// What was counted since `earlier` (counters only grow).
    pub fn since(&self, earlier: &TcpCounters) -> TcpCounters {
        TcpCounters {
            segments_out: self.segments_out.saturating_sub(earlier.segments_out),
            retransmitted_segments: self.retransmitted_segments.saturating_sub(earlier.retransmitted_segments),
            timeouts: self.timeouts.saturating_sub(earlier.timeouts),
            fast_retransmits: self.fast_retransmits.saturating_sub(earlier.fast_retransmits),
            loss_probes: self.loss_probes.saturating_sub(earlier.loss_probes),
            dsacks_received: self.dsacks_received.saturating_sub(earlier.dsacks_received),
            reordering_detected: self.reordering_detected.saturating_sub(earlier.reordering_detected),
            spurious_timeouts: self.spurious_timeouts.saturating_sub(earlier.spurious_timeouts),
        }
    }

    pub fn add(&mut self, o: &TcpCounters) {
        self.segments_out += o.segments_out;
        self.retransmitted_segments += o.retransmitted_segments;
        self.timeouts += o.timeouts;
        self.fast_retransmits += o.fast_retransmits;
        self.loss_probes += o.loss_probes;
        self.dsacks_received += o.dsacks_received;
        self.reordering_detected += o.reordering_detected;
        self.spurious_timeouts += o.spurious_timeouts;
    }
}

/// The counters of `/proc/net/snmp`-style texts (a header line of names followed by a line
/// of values, per protocol), as `<protocol><name>` -> value.
fn snmp_values(texts: &[&str]) -> std::collections::HashMap<String, u64> {
    let mut values = std::collections::HashMap::new();
    for text in texts {
        let lines: Vec<&str> = text.lines().collect();
        for pair in lines.chunks(2) {
            let [names, nums] = pair else { continue };
            let (Some((proto, names)), Some((_, nums))) = (names.split_once(':'), nums.split_once(':')) else {
                continue;
            };
            for (name, v) in names.split_whitespace().zip(nums.split_whitespace()) {
                if let Ok(v) = v.parse::<u64>() {
                    values.insert(format!("{proto}{name}"), v);
                }
            }
        }
    }
    values
}

/// UDP counters of one namespace: what its sockets received, and what they dropped because
/// a receive buffer was full (a process that did not read in time) or for another error.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UdpCounters {
    pub datagrams_in: u64,
    pub receive_buffer_errors: u64,
    pub in_errors: u64,
}

impl UdpCounters {
    fn parse(snmp: &str) -> UdpCounters {
        let values = snmp_values(&[snmp]);
        let get = |k: &str| values.get(k).copied().unwrap_or(0);
        UdpCounters {
            datagrams_in: get("UdpInDatagrams"),
            receive_buffer_errors: get("UdpRcvbufErrors"),
            in_errors: get("UdpInErrors"),
        }
    }

    pub fn since(&self, earlier: &UdpCounters) -> UdpCounters {
        UdpCounters {
            datagrams_in: self.datagrams_in.saturating_sub(earlier.datagrams_in),
            receive_buffer_errors: self.receive_buffer_errors.saturating_sub(earlier.receive_buffer_errors),
            in_errors: self.in_errors.saturating_sub(earlier.in_errors),
        }
    }

    pub fn add(&mut self, o: &UdpCounters) {
        self.datagrams_in += o.datagrams_in;
        self.receive_buffer_errors += o.receive_buffer_errors;
        self.in_errors += o.in_errors;
    }
}

/// The TCP and UDP counters of a namespace, read by a thread that joins it (`setns`) and reads
/// `/proc/thread-self/net`: microseconds, where `ip netns exec nstat` takes milliseconds
/// per namespace, so a snapshot of every host at the start of a run is close to one instant.
pub fn counters(netns: &str) -> anyhow::Result<(TcpCounters, UdpCounters)> {
    let path = format!("/run/netns/{netns}");
    let ns = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| -> anyhow::Result<(TcpCounters, UdpCounters)> {
                // Only this short-lived thread changes its namespace.
                nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                    .with_context(|| format!("joining namespace {netns}"))?;
                let snmp = std::fs::read_to_string("/proc/thread-self/net/snmp")?;
                let netstat = std::fs::read_to_string("/proc/thread-self/net/netstat")?;
                Ok((TcpCounters::parse(&snmp, &netstat), UdpCounters::parse(&snmp)))
            })
            .join()
            .map_err(|_| anyhow::anyhow!("reading the counters of {netns} panicked"))?
    })
}

/// Packets dropped by each shaped device of a namespace (its root token bucket counts
/// the drops of the queue behind it).
pub fn drops(netns: &str) -> anyhow::Result<Vec<(String, u64)>> {
    let text = run(Command::new("ip").args(["netns", "exec", netns, "tc", "-s", "-j", "qdisc", "show"]))?;
    let v: serde_json::Value = serde_json::from_str(&text).context("reading tc -j output")?;
    Ok(v.as_array()
        .into_iter()
        .flatten()
        .filter(|q| q.get("kind").and_then(|k| k.as_str()) == Some("tbf"))
        .filter_map(|q| Some((q.get("dev")?.as_str()?.to_string(), q.get("drops")?.as_u64()?)))
        .collect())
}

/// Packets the injected loss dropped in a switch namespace (0 when it has no loss rule).
pub fn injected_drops(netns: &str) -> anyhow::Result<u64> {
    let out = Command::new("ip")
        .args(["netns", "exec", netns, "nft", "list", "table", "bridge", crate::plan::LOSS_TABLE])
        .stdin(Stdio::null())
        .output()
        .context("running nft")?;
    if !out.status.success() {
        // No such table: this switch has no host port, or no loss was asked for.
        return Ok(0);
    }
    Ok(counted_packets(&String::from_utf8_lossy(&out.stdout)))
}

/// The sum of `counter packets N` in nft's listing.
fn counted_packets(listing: &str) -> u64 {
    let words: Vec<&str> = listing.split_whitespace().collect();
    words.windows(3).filter(|w| w[0] == "counter" && w[1] == "packets").filter_map(|w| w[2].parse::<u64>().ok()).sum()
}

#[cfg(test)]
mod tests {
    #[test]
    fn nft_counters_are_summed() {
        let listing = "table bridge shoal_loss {\n\tchain fw {\n\t\ttype filter hook forward priority filter; policy accept;\n\t\toifname { \"b0\", \"b1\" } ether type ip numgen random mod 1000000 < 1000 counter packets 17 bytes 25024 drop\n\t}\n}\n";
        assert_eq!(super::counted_packets(listing), 17);
        assert_eq!(super::counted_packets(""), 0);
    }

    #[test]
    fn tcp_counters_are_read_by_name_and_differenced() {
        let snmp = "Ip: Forwarding DefaultTTL\nIp: 1 64\nTcp: RtoAlgorithm OutSegs RetransSegs\nTcp: 1 1000 7\n\
                    Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors\nUdp: 500 1 4 9 3\n";
        let netstat = "TcpExt: TCPTimeouts TCPLossProbes TCPFastRetrans TCPDSACKRecv TCPSACKReorder TCPSpuriousRTOs\n\
                       TcpExt: 2 3 4 5 6 1\nIpExt: InOctets\nIpExt: 99\n";
        let c = super::TcpCounters::parse(snmp, netstat);
        let want = super::TcpCounters {
            segments_out: 1000,
            retransmitted_segments: 7,
            timeouts: 2,
            fast_retransmits: 4,
            loss_probes: 3,
            dsacks_received: 5,
            reordering_detected: 6,
            spurious_timeouts: 1,
        };
        assert_eq!(c, want);
        let earlier = super::TcpCounters { segments_out: 400, timeouts: 2, ..Default::default() };
        let d = c.since(&earlier);
        assert_eq!((d.segments_out, d.timeouts, d.retransmitted_segments), (600, 0, 7));
        let u = super::UdpCounters::parse(snmp);
        assert_eq!(u, super::UdpCounters { datagrams_in: 500, receive_buffer_errors: 3, in_errors: 4 });
        assert_eq!(u.since(&super::UdpCounters { datagrams_in: 100, ..u }).datagrams_in, 400);
    }
}
