#!/usr/bin/env python3
"""Rate accuracy of shoal's token bucket beside Linux `tc tbf` (issue 15 part 2;
docs/benchmarks.md "Token bucket: assigned versus measured rate").

Everything runs in a network namespace of its own (its loopback, MTU 1500, segmentation
offloads off), so that `tc` touches nothing of the machine's. shoal: `shoal demo` in
saturation (`source.saturate`, fixed 9,000-byte fragments, policy `tbf:RATE:BURST`, one
bucket per source and builder), so the bucket is the only limit; the measured rate is the
builders' received frame bytes after the first fragment over first-to-last arrival, per
source-builder pair. Linux: iperf3 (one stream) through `tc qdisc ... tbf rate RATE burst
BURST` on the namespace's loopback; its rate in IP bytes is iperf3's goodput x 1500 / 1448
(TCP/IP headers with timestamps). Both buckets get the same burst, max(RATE / 1000, 9,000)
bytes (shoal's default), each run about 3 s of data; medians of N runs. 1x3 is not measured: a saturated source
produces its next slice only when the previous one is taken, so one source's buckets to
three builders take turns instead of each running at its rate.

usage (root; needs iperf3 and ethtool): scripts/tbf_accuracy.py SHOAL_BINARY OUT_DIR [--repeats N] [--quick]
Writes OUT_DIR/tbf-accuracy.{csv,md}. Exit 1 if a shoal run loses a fragment.
"""
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import saturated_demo  # noqa: E402

NS = "tbfbench"
RATES_MBIT = [1, 10, 100, 500, 1000, 2000, 4000]
TOPOLOGIES = [(1, 1), (3, 1)]
FRAGMENT = 9_000
SECONDS = 3.0


def sh(*args, check=True):
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


def ns(*args, check=True):
    return sh("ip", "netns", "exec", NS, *args, check=check)


def burst_bytes(rate_mbit):
    return max(int(rate_mbit * 1e6 / 8 / 1000), 9000)


def shoal_run(shoal, sources, builders, rate_mbit):
    rate_bps = rate_mbit * 1e6 / 8
    slices = max(100, int(rate_bps * SECONDS / FRAGMENT))
    cfg = saturated_demo.config(sources, builders, FRAGMENT, slices, f"tbf:{rate_mbit}Mbit:{burst_bytes(rate_mbit)}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = saturated_demo.run(shoal, cfg, prefix=("ip", "netns", "exec", NS))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    # Per source-builder pair: direct assignment sends slice s of every source to builder
    # s mod B, so each builder's bytes came from `sources` buckets.
    rates = []
    for b in r["builder_reports"]:
        span = (b["last_arrival_ns"] - b["first_arrival_ns"]) / 1e9
        per_frag = b["bytes"] / b["fragments"]
        rates.append((b["bytes"] - sources * per_frag) * 8 / span / 1e6 / sources)
    ok = saturated_demo.accounted(r)
    total_gb = sum(b["bytes"] for b in r["builder_reports"]) / 1e9
    return statistics.mean(rates), ok, cpu / total_gb


def tc_run(rate_mbit):
    ns("tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", f"{rate_mbit}mbit",
       "burst", str(burst_bytes(rate_mbit)), "latency", "100ms")
    server = subprocess.Popen(["ip", "netns", "exec", NS, "iperf3", "-s", "-1", "-p", "5201"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            if ":5201" in ns("ss", "-ltn").stdout:
                break
            time.sleep(0.01)
        out = ns("iperf3", "-c", "127.0.0.1", "-p", "5201", "-t", str(SECONDS), "-O", "1", "-J")
        goodput = json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"]
        return goodput * 1500 / 1448 / 1e6
    finally:
        server.kill()
        server.wait()
        ns("tc", "qdisc", "del", "dev", "lo", "root", check=False)


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    shoal, out_dir = os.path.abspath(sys.argv[1]), sys.argv[2]
    repeats = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 3
    global RATES_MBIT, TOPOLOGIES
    if "--quick" in sys.argv:
        RATES_MBIT, TOPOLOGIES = [10, 100], [(1, 1)]
    os.makedirs(out_dir, exist_ok=True)
    sh("ip", "netns", "del", NS, check=False)
    sh("ip", "netns", "add", NS)
    rows, bad = [], 0
    try:
        ns("ip", "link", "set", "lo", "mtu", "1500", "up")
        ns("ethtool", "-K", "lo", "tso", "off", "gso", "off", "gro", "off", check=False)
        for (m, n) in TOPOLOGIES:
            for rate in RATES_MBIT:
                got, cpus = [], []
                for _ in range(repeats):
                    r, ok, cpu = shoal_run(shoal, m, n, rate)
                    bad += not ok
                    got.append(r)
                    cpus.append(cpu)
                tc = statistics.median([tc_run(rate) for _ in range(repeats)]) if (m, n) == (1, 1) else None
                s = statistics.median(got)
                row = {"topology": f"{m}x{n}", "assigned_mbit": rate, "shoal_mbit": round(s, 3),
                       "shoal_error_pct": round((s / rate - 1) * 100, 2),
                       "tc_mbit": None if tc is None else round(tc, 3),
                       "tc_error_pct": None if tc is None else round((tc / rate - 1) * 100, 2),
                       "shoal_cpu_s_per_gb": round(statistics.median(cpus), 2)}
                rows.append(row)
                print(row, flush=True)
    finally:
        sh("ip", "netns", "del", NS, check=False)
    with open(os.path.join(out_dir, "tbf-accuracy.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(out_dir, "tbf-accuracy.md"), "w") as f:
        f.write("| topology | assigned (Mbit/s) | shoal tbf (Mbit/s) | error | tc tbf (Mbit/s) | error | shoal CPU (s/GB) |\n")
        f.write("| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n")
        for r in rows:
            tc = "-" if r["tc_mbit"] is None else f"{r['tc_mbit']:,.2f}"
            tce = "-" if r["tc_error_pct"] is None else f"{r['tc_error_pct']:+.2f}%"
            f.write(f"| {r['topology']} | {r['assigned_mbit']:,} | {r['shoal_mbit']:,.2f} | {r['shoal_error_pct']:+.2f}% "
                    f"| {tc} | {tce} | {r['shoal_cpu_s_per_gb']} |\n")
    if bad:
        print(f"{bad} shoal runs lost fragments or slices")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
