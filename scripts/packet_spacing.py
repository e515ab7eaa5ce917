#!/usr/bin/env python3
"""Packet spacing leaving a source, from a real capture (issue 15 part 3;
docs/bench/history.md "Packet spacing").

One source sends to one builder (`shoal demo`, fixed 30,000-byte fragments, no filter) in a
network namespace of its own whose loopback runs at MTU 1500 with segmentation offloads off,
so every TCP segment is a wire-sized packet. tcpdump (nanosecond timestamps) records the
data packets (over 200 bytes: not the ACKs); the intervals between consecutive ones are the
spacing. Four cases: with and without shaping (`direct`; a token bucket `tbf:RATE:BURST`),
with a regular 1 kHz trigger (1 ms slices, one fragment each) and free-running
(`source.saturate`: the next fragment as soon as the transport takes the last).

usage (root; needs tcpdump, Debian package tcpdump): scripts/packet_spacing.py SHOAL_BINARY OUT_DIR
Writes OUT_DIR/packet-spacing.{csv,md,png}.
"""
import csv
import os
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import saturated_demo  # noqa: E402

NS = "spacingbench"
FRAGMENT = 30_000
TBF = "tbf:400Mbit:20000"
CASES = [
    ("direct, 1 kHz trigger", "direct", False),
    (f"{TBF}, 1 kHz trigger", TBF, False),
    ("direct, free-running", "direct", True),
    (f"{TBF}, free-running", TBF, True),
]


def ns(*args, **kw):
    return subprocess.run(["ip", "netns", "exec", NS, *args], **kw)


def config(policy, saturate):
    # Triggered: 2 s of 1 ms slices; free-running: 500 fragments.
    return saturated_demo.config(1, 1, FRAGMENT, 500 if saturate else 2000, policy, saturate=saturate)


def read_pcap(path):
    """Timestamps (ns) of the records of a nanosecond pcap."""
    with open(path, "rb") as f:
        data = f.read()
    magic = struct.unpack_from("<I", data, 0)[0]
    if magic != 0xA1B23C4D:
        raise RuntimeError(f"not a nanosecond pcap: {magic:#x}")
    off, out = 24, []
    while off + 16 <= len(data):
        sec, nsec, incl, _orig = struct.unpack_from("<IIII", data, off)
        out.append(sec * 1_000_000_000 + nsec)
        off += 16 + incl
    return out


def capture(shoal, policy, saturate, d):
    cfg = os.path.join(d, "cfg.toml")
    with open(cfg, "w") as f:
        f.write(config(policy, saturate))
    pcap = os.path.join(d, "cap.pcap")
    dump = subprocess.Popen(["ip", "netns", "exec", NS, "tcpdump", "-i", "lo", "-s", "96", "-U", "-n",
                             "--time-stamp-precision=nano", "-w", pcap, "tcp and greater 200"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # tcpdump says "listening on lo" once it captures.
    line = dump.stderr.readline()
    if "listening" not in line:
        raise RuntimeError(f"tcpdump did not start: {line}")
    r = ns(shoal, "demo", "--config", cfg, "--out", os.path.join(d, "out"), "--json",
           capture_output=True, text=True, timeout=300)
    dump.terminate()  # -U writes every packet as it comes; SIGTERM flushes and ends it
    dump.wait()
    if r.returncode != 0:
        raise RuntimeError(f"shoal demo failed: {r.stderr[-1500:]}")
    ts = read_pcap(pcap)
    return [b - a for a, b in zip(ts, ts[1:])]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    shoal, out_dir = os.path.abspath(sys.argv[1]), sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    subprocess.run(["ip", "netns", "add", NS], check=True)
    results = {}
    try:
        ns("ip", "link", "set", "lo", "mtu", "1500", "up", check=True)
        ns("ethtool", "-K", "lo", "tso", "off", "gso", "off", "gro", "off", capture_output=True)
        for name, policy, saturate in CASES:
            with tempfile.TemporaryDirectory() as d:
                results[name] = capture(shoal, policy, saturate, d)
            iv = results[name]
            print(f"{name}: {len(iv)} intervals, median {pct(iv, 0.5) / 1e3:.1f} us", flush=True)
    finally:
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    rows = []
    for name, iv in results.items():
        us = [x / 1e3 for x in iv]
        rows.append({"case": name, "packets": len(iv) + 1,
                     "p10_us": round(pct(us, 0.1), 2), "median_us": round(pct(us, 0.5), 2),
                     "p90_us": round(pct(us, 0.9), 2), "p99_us": round(pct(us, 0.99), 1),
                     "under_5us_pct": round(100 * sum(x < 5 for x in us) / len(us), 1),
                     "over_100us_pct": round(100 * sum(x > 100 for x in us) / len(us), 1)})
    with open(os.path.join(out_dir, "packet-spacing.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(out_dir, "packet-spacing.md"), "w") as f:
        f.write("| case | data packets | p10 (us) | median (us) | p90 (us) | p99 (us) | under 5 us | over 100 us |\n")
        f.write("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
        for r in rows:
            f.write(f"| {r['case']} | {r['packets']:,} | {r['p10_us']} | {r['median_us']} | {r['p90_us']} | "
                    f"{r['p99_us']} | {r['under_5us_pct']}% | {r['over_100us_pct']}% |\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    bins = np.logspace(-1, 4, 101)
    for ax, (name, iv) in zip(axes.flat, results.items()):
        ax.hist([x / 1e3 for x in iv], bins=bins, color="C0")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("interval between data packets, us")
    for ax in axes[:, 0]:
        ax.set_ylabel("packets")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "packet-spacing.png"), dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
