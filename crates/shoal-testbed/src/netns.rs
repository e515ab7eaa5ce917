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
    for tool in ["ip", "tc", "ethtool", "nstat"] {
        let found = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
            .unwrap_or(false);
        if !found {
            return Some(format!("`{tool}` is missing (Debian packages iproute2, ethtool)"));
        }
    }
    None
}

/// Why loss cannot be injected here, if it cannot: `nft` (Debian package nftables) missing.
pub fn loss_unavailable() -> Option<String> {
    let found =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).any(|d| d.join("nft").is_file())).unwrap_or(false);
    (!found).then(|| "`nft` is missing (Debian package nftables): loss is injected by an nft rule".into())
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

/// TCP counters of one namespace (`nstat`; a namespace starts from zero).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct TcpCounters {
    pub retransmitted_segments: u64,
    pub timeouts: u64,
    pub segments_out: u64,
}

pub fn tcp_counters(netns: &str) -> anyhow::Result<TcpCounters> {
    let text = run(Command::new("ip").args([
        "netns",
        "exec",
        netns,
        "nstat",
        "-asz",
        "TcpRetransSegs",
        "TcpExtTCPTimeouts",
        "TcpOutSegs",
    ]))?;
    let mut c = TcpCounters::default();
    for line in text.lines() {
        let mut w = line.split_whitespace();
        let (Some(name), Some(v)) = (w.next(), w.next().and_then(|v| v.parse::<u64>().ok())) else { continue };
        match name {
            "TcpRetransSegs" => c.retransmitted_segments = v,
            "TcpExtTCPTimeouts" => c.timeouts = v,
            "TcpOutSegs" => c.segments_out = v,
            _ => {}
        }
    }
    Ok(c)
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
        let listing = "table bridge shoal_loss {\n\tchain fw {\n\t\ttype filter hook forward priority filter; policy accept;\n\t\toifname { \"b0\", \"b1\" } numgen random mod 1000000 < 1000 counter packets 17 bytes 25024 drop\n\t}\n}\n";
        assert_eq!(super::counted_packets(listing), 17);
        assert_eq!(super::counted_packets(""), 0);
    }
}
