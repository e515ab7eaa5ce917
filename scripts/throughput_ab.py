#!/usr/bin/env python3
"""Two shoal binaries' goodput side by side at small fragments, beside iperf3 (issue 32,
goal 2; docs/bench/history.md "Small fragments with a source holding bytes, not slices").

The runs of scripts/throughput.py (saturated `shoal demo`, policy `direct`, no filter, no
saver; iperf3 with the same streams), for two binaries in turn, REPEATS times per point,
iperf3 after each pair; prints medians and each one's ratio to iperf3. Exit 1 if a shoal
run loses or leaves unaccounted any fragment.

usage: scripts/throughput_ab.py BEFORE AFTER [--sizes 1000,4000,16000]
         [--topologies 1x1,3x1,1x3,8x8] [--repeats 3]
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import throughput as tp  # noqa: E402


def arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main():
    if len(sys.argv) < 3 or sys.argv[1].startswith("--"):
        print(__doc__)
        return 2
    bins = [os.path.abspath(b) for b in sys.argv[1:3]]
    sizes = [int(x) for x in arg("--sizes", "1000,4000,16000").split(",")]
    topologies = [tuple(int(n) for n in t.split("x")) for t in arg("--topologies", "1x1,3x1,1x3,8x8").split(",")]
    repeats = int(arg("--repeats", "3"))
    bad = 0
    print("| topology | fragment (B) | iperf3 (MB/s) | before (MB/s) | / iperf3 | after (MB/s) | / iperf3 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (m, n) in topologies:
        for size in sizes:
            got = {b: [] for b in bins}
            iperf = []
            for _ in range(repeats):
                for b in bins:
                    mb, ok, _, _ = tp.shoal_run(b, m, n, size)
                    bad += not ok
                    got[b].append(mb)
                iperf.append(tp.iperf_run(m, n, size))
            i = statistics.median(iperf)
            cells = " | ".join(f"{statistics.median(got[b]):,.0f} | {statistics.median(got[b]) / i:.2f}" for b in bins)
            print(f"| {m}x{n} | {size:,} | {i:,.0f} | {cells} |", flush=True)
    if bad:
        print(f"{bad} runs lost a fragment", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
