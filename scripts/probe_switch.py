#!/usr/bin/env python3
"""`shoal probe-switch` against known buffers on the testbed (issue 15 part 5;
docs/benchmarks.md "Switch buffer probe").

Each configuration builds a one-switch testbed (`shoal probe-switch testbed`): N senders on
links faster than the probed port, one receiver behind a port shaped by tc tbf with a pfifo
(packets) or bfifo (bytes) of the given size; the probe floods it with 1514- and 242-byte
frames and names the buffer. Medians of N runs per configuration, and the worst run.

usage (root; iproute2, ethtool): scripts/probe_switch.py SHOAL_BINARY OUT_DIR [--repeats N]
Writes OUT_DIR/probe-switch.{csv,md}. Exit 1 if any run misnames a buffer or is off by
more than 5%.
"""
import csv
import json
import os
import statistics
import subprocess
import sys

# (senders, port Mbit/s, sender Mbit/s, kind, size)
CONFIGS = [
    (3, 20, 200, "packets", 100),
    (3, 20, 200, "bytes", 108_000),
    (2, 20, 200, "packets", 30),
    (8, 20, 200, "packets", 1000),
    (3, 20, 200, "bytes", 20_000),
    (4, 100, 1000, "packets", 100),
    (4, 100, 1000, "bytes", 108_000),
]


def run(shoal, senders, port, sender, kind, size):
    out = subprocess.run(
        [shoal, "probe-switch", "testbed", "--json", "--prefix", "pbench",
         "--senders", str(senders), "--port-mbps", str(port), "--sender-mbps", str(sender),
         f"--queue-{kind}", str(size)],
        capture_output=True, text=True, check=False)
    if not out.stdout.strip():
        sys.exit(f"no report ({out.returncode}): {out.stderr}")
    r = json.loads(out.stdout)
    v = r["report"]["verdict"] or {}
    return {
        "limit": v.get("limit"),
        "packets": v.get("packets"),
        "bytes": v.get("bytes"),
        "error_pct": 100 * (r["relative_error"] if r["relative_error"] is not None else float("nan")),
        "identified": bool(r["identified"]),
    }


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    shoal, out_dir = sys.argv[1], sys.argv[2]
    repeats = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 3
    os.makedirs(out_dir, exist_ok=True)
    rows, bad = [], 0
    for senders, port, sender, kind, size in CONFIGS:
        runs = [run(shoal, senders, port, sender, kind, size) for _ in range(repeats)]
        named = sum(r["identified"] for r in runs)
        errors = [r["error_pct"] for r in runs]
        worst = max(errors, key=abs)
        bad += sum(1 for r in runs if not r["identified"] or abs(r["error_pct"]) > 5)
        rows.append({
            "senders": senders, "port_mbps": port, "sender_mbps": sender,
            "configured": f"{'pfifo' if kind == 'packets' else 'bfifo'} {size}",
            "named": f"{named}/{repeats}",
            "packets": statistics.median(r["packets"] for r in runs),
            "bytes": statistics.median(r["bytes"] for r in runs),
            "error_pct_median": round(statistics.median(errors), 2),
            "error_pct_worst": round(worst, 2),
        })
        print(rows[-1], flush=True)
    with open(os.path.join(out_dir, "probe-switch.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(out_dir, "probe-switch.md"), "w") as f:
        f.write("| senders | port Mbit/s | sender links Mbit/s | configured | limit named | packets | bytes | size error, median | worst |\n")
        f.write("|---:|---:|---:|---|---:|---:|---:|---:|---:|\n")
        for r in rows:
            f.write(f"| {r['senders']} | {r['port_mbps']} | {r['sender_mbps']} | {r['configured']} | {r['named']} "
                    f"| {r['packets']:.0f} | {r['bytes']:.0f} | {r['error_pct_median']:+.1f}% | {r['error_pct_worst']:+.1f}% |\n")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
