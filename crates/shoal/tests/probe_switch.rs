//! `shoal probe-switch testbed`: the probe against switch ports whose buffers are known,
//! a 100-packet pfifo and a 108 kB bfifo (what the studies found on their switch). Each
//! is named (packets or bytes) and sized within 5%, from three senders flooding one port.
//! The estimate counts the datagrams that left the buffer while each accepted one waited,
//! from kernel timestamps, so it does not depend on how fast this machine is; a busy
//! machine makes the senders' floods ragged, which the median over the overflow absorbs.
//! Runs as root with iproute2 and ethtool, and skips with a message otherwise.

use std::process::Command;

fn probe(tag: &str, buffer: &[&str]) -> Option<serde_json::Value> {
    if let Some(why) = shoal_testbed::netns::unavailable() {
        eprintln!("SKIPPED: the probe needs the testbed: {why}");
        return None;
    }
    let prefix = format!("p{tag}{}", std::process::id() % 10_000);
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["probe-switch", "testbed", "--json", "--prefix", &prefix])
        .args(buffer)
        .output()
        .expect("running shoal probe-switch");
    let left = shoal_testbed::netns::existing(&prefix).unwrap();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("{e}: {}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    });
    assert!(out.status.success(), "{report:#}\n{}", String::from_utf8_lossy(&out.stderr));
    Some(report)
}

#[test]
fn a_100_packet_buffer_is_named_and_sized() {
    let Some(r) = probe("k", &["--queue-packets", "100"]) else { return };
    let v = &r["report"]["verdict"];
    assert_eq!(v["limit"], "packets", "{r:#}");
    let packets = v["packets"].as_f64().unwrap();
    assert!((packets - 100.0).abs() <= 5.0, "{r:#}");
    drops_were_at_the_probed_port(&r);
}

/// Both floods overflowed the port, and tc counted (at least) the drops the probe inferred.
fn drops_were_at_the_probed_port(r: &serde_json::Value) {
    let floods = r["report"]["floods"].as_array().unwrap();
    let inferred: u64 = floods
        .iter()
        .map(|f| f["estimate"]["sent"].as_u64().unwrap() - f["estimate"]["received"].as_u64().unwrap())
        .sum();
    let tc_drops = r["tc_drops"].as_u64().unwrap();
    assert!(inferred > 0 && inferred <= tc_drops, "every missing datagram was dropped by the probed port: {r:#}");
}

#[test]
fn a_108_kb_byte_buffer_is_named_and_sized() {
    let Some(r) = probe("y", &["--queue-bytes", "108000"]) else { return };
    let v = &r["report"]["verdict"];
    assert_eq!(v["limit"], "bytes", "{r:#}");
    let bytes = v["bytes"].as_f64().unwrap();
    assert!((bytes - 108_000.0).abs() <= 5_400.0, "{r:#}");
    assert_eq!(r["identified"], true);
    drops_were_at_the_probed_port(&r);
}
