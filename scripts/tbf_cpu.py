#!/usr/bin/env python3
"""CPU per GB of shoal's token bucket beside `direct` (issue 32, goal 4; docs/benchmarks.md
"Token bucket: CPU per GB beside direct").

One source to one builder in saturation (`source.saturate`, fixed 9,000-byte fragments),
in a network namespace of its own (its loopback at MTU 1500, offloads off; the set-up of
scripts/tbf_accuracy.py): `direct` (as fast as the machine goes) and `tbf:RATE:BURST` with
shoal's default burst (max(RATE / 1000, 9,000) bytes), for each binary given, run in turn
(binary A direct, binary A tbf, binary B direct, ...) REPEATS times. CPU is the whole
`shoal demo` process (sources, builder, writer) per GB delivered; the table gives medians
and each token bucket's ratio to the same binary's `direct`.

usage (root): scripts/tbf_cpu.py OUT_DIR BINARY [BINARY ...] [--rates 500,1000] [--repeats 5]
"""
import os
import resource
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import saturated_demo  # noqa: E402
import tbf_accuracy as tbf  # noqa: E402

DIRECT_SLICES = 100_000  # 900 MB


def direct_run(shoal):
    cfg = saturated_demo.config(1, 1, tbf.FRAGMENT, DIRECT_SLICES, "direct")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = saturated_demo.run(shoal, cfg, prefix=("ip", "netns", "exec", tbf.NS))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    gb = sum(b["bytes"] for b in r["builder_reports"]) / 1e9
    return saturated_demo.accounted(r), cpu / gb


def main():
    args = [a for a in sys.argv[1:]]
    rates, repeats = [500, 1000], 5
    if "--rates" in args:
        i = args.index("--rates")
        rates = [int(x) for x in args[i + 1].split(",")]
        del args[i:i + 2]
    if "--repeats" in args:
        i = args.index("--repeats")
        repeats = int(args[i + 1])
        del args[i:i + 2]
    if len(args) < 2:
        print(__doc__)
        return 2
    out_dir, binaries = args[0], [os.path.abspath(b) for b in args[1:]]
    os.makedirs(out_dir, exist_ok=True)
    tbf.sh("ip", "netns", "del", tbf.NS, check=False)
    tbf.sh("ip", "netns", "add", tbf.NS)
    cpu = {(b, p): [] for b in binaries for p in ["direct"] + rates}
    got = {(b, p): [] for b in binaries for p in rates}
    bad = 0
    try:
        tbf.ns("ip", "link", "set", "lo", "mtu", "1500", "up")
        tbf.ns("ethtool", "-K", "lo", "tso", "off", "gso", "off", "gro", "off", check=False)
        for _ in range(repeats):
            for b in binaries:
                ok, per_gb = direct_run(b)
                bad += not ok
                cpu[(b, "direct")].append(per_gb)
                for rate in rates:
                    mbit, ok, per_gb = tbf.shoal_run(b, 1, 1, rate)
                    bad += not ok
                    cpu[(b, rate)].append(per_gb)
                    got[(b, rate)].append(mbit)
    finally:
        tbf.sh("ip", "netns", "del", tbf.NS, check=False)
    lines = ["| binary | policy | rate (Mbit/s, median) | CPU s/GB (median) | min / max | / direct |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for b in binaries:
        d = statistics.median(cpu[(b, "direct")])
        for p in ["direct"] + rates:
            v = cpu[(b, p)]
            name = "direct" if p == "direct" else f"tbf:{p}Mbit:{tbf.burst_bytes(p)}"
            rate = "-" if p == "direct" else f"{statistics.median(got[(b, p)]):.1f}"
            lines.append(f"| {os.path.basename(b)} | {name} | {rate} "
                         f"| {statistics.median(v):.2f} | {min(v):.2f} / {max(v):.2f} | {statistics.median(v) / d:.2f} |")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out_dir, "tbf-cpu.md"), "w") as f:
        f.write(text + "\n")
    if bad:
        print(f"{bad} runs lost a fragment", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
