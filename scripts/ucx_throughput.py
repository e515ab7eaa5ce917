#!/usr/bin/env python3
"""shoal over `ucx` beside shoal over `tcp`, iperf3 and UCX's own `ucx_perftest`, in one
sweep (issue 70; docs/benchmarks.md "The ucx transport").

Every point runs, in turn and `--repeats` times (medians reported): `shoal demo` in
saturation (scripts/throughput.py's runs: fixed-size fragments, no filter, no saver) over
`run.transport = "ucx"` and over `tcp`, iperf3 with the same streams, and `ucx_perftest -t
ucp_am_bw` (one pair of processes: UCX's active-message bandwidth at this size, the limit
one stream of shoal's messages could reach). CPU per GB is the demo process's user plus
system time over the bytes it moved. UCX's transports are the environment's: run with
`UCX_TLS=cma,posix,self` for the shared-memory path on one host.

usage: scripts/ucx_throughput.py SHOAL_BINARY OUT_DIR [--repeats N] [--sizes B,B]
         [--topologies MxN,MxN] [--gb GB]
Writes OUT_DIR/ucx_throughput.{csv,md}. Exit 1 if a shoal run loses or leaves
unaccounted any fragment.
"""
import csv
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import saturated_demo  # noqa: E402
import throughput  # noqa: E402

SIZES = [64_000, 1_000_000, 4_000_000]
TOPOLOGIES = [(1, 1), (3, 1), (6, 1)]
TARGET_BYTES = 4_000_000_000


def demo(shoal, sources, builders, size, transport, target):
    """(MB/s, accounted, CPU seconds per GB moved)."""
    slices = max(200, min(throughput.MAX_SLICES, target // (size * sources)))
    cfg = saturated_demo.config(sources, builders, size, slices, "direct", builder_budget_mb=min(4096, 8000 // builders))
    cfg = cfg.replace("[run]\n", f'[run]\ntransport = "{transport}"\n', 1)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = saturated_demo.run(shoal, cfg)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return r["mbytes_per_s"], saturated_demo.accounted(r), cpu / (r["bytes_received"] / 1e9)


def perftest(size):
    """ucx_perftest ucp_am_bw between two processes, MB/s (10^6 bytes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["ucx_perftest", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        iters = max(200, min(20_000, 4_000_000_000 // size))
        for _ in range(100):
            out = subprocess.run(["ucx_perftest", "127.0.0.1", "-p", str(port), "-t", "ucp_am_bw", "-s", str(size),
                                  "-n", str(iters)], capture_output=True, text=True, timeout=120)
            final = [line for line in out.stdout.splitlines() if line.startswith("Final:")]
            if final:
                # Final: iterations, overhead 50%/avg/overall, bandwidth avg/overall (MiB/s), rate avg/overall
                fields = re.split(r"\s+", final[0].strip())
                return float(fields[6]) * 1.048576
            time.sleep(0.05)  # the server is not listening yet
        raise RuntimeError(f"ucx_perftest gave no result: {out.stdout[-500:]} {out.stderr[-500:]}")
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    shoal, out_dir = sys.argv[1], sys.argv[2]
    arg = lambda name, default: sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default  # noqa: E731
    repeats = int(arg("--repeats", 3))
    sizes = [int(x) for x in arg("--sizes", ",".join(map(str, SIZES))).split(",")]
    topologies = [tuple(int(v) for v in t.split("x")) for t in arg("--topologies", "1x1,3x1,6x1").split(",")]
    target = int(float(arg("--gb", TARGET_BYTES / 1e9)) * 1e9)
    os.makedirs(out_dir, exist_ok=True)
    rows, bad = [], 0
    limits = {}
    for (m, n) in topologies:
        for size in sizes:
            ucx, tcp, iperf, ucx_cpu, tcp_cpu = [], [], [], [], []
            for _ in range(repeats):
                mb, ok, cpu = demo(shoal, m, n, size, "ucx", target)
                bad += not ok
                ucx.append(mb)
                ucx_cpu.append(cpu)
                mb, ok, cpu = demo(shoal, m, n, size, "tcp", target)
                bad += not ok
                tcp.append(mb)
                tcp_cpu.append(cpu)
                iperf.append(throughput.iperf_run(m, n, size))
            if size not in limits:
                limits[size] = statistics.median(perftest(size) for _ in range(repeats))
            u, t, i, p = (statistics.median(x) for x in (ucx, tcp, iperf, [limits[size]]))
            uc, tc = statistics.median(ucx_cpu), statistics.median(tcp_cpu)
            row = {"topology": f"{m}x{n}", "size": size, "ucx_mb_s": round(u), "tcp_mb_s": round(t),
                   "iperf3_mb_s": round(i), "ucx_perftest_mb_s": round(p), "ucx_over_tcp": round(u / t, 2),
                   "ucx_over_iperf3": round(u / i, 2), "ucx_over_perftest": round(u / p, 2),
                   "ucx_cpu_s_per_gb": round(uc, 2), "tcp_cpu_s_per_gb": round(tc, 2)}
            rows.append(row)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    with open(os.path.join(out_dir, "ucx_throughput.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(out_dir, "ucx_throughput.md"), "w") as f:
        f.write("| topology | fragment (B) | shoal ucx (MB/s) | shoal tcp (MB/s) | iperf3 (MB/s) | ucx_perftest am_bw (MB/s) "
                "| ucx / tcp | ucx / iperf3 | ucx / perftest | CPU s per GB, ucx | tcp |\n")
        f.write("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
        for r in rows:
            f.write(f"| {r['topology']} | {r['size']:,} | {r['ucx_mb_s']:,} | {r['tcp_mb_s']:,} | {r['iperf3_mb_s']:,} | "
                    f"{r['ucx_perftest_mb_s']:,} | {r['ucx_over_tcp']:.2f} | {r['ucx_over_iperf3']:.2f} | "
                    f"{r['ucx_over_perftest']:.2f} | {r['ucx_cpu_s_per_gb']:.2f} | {r['tcp_cpu_s_per_gb']:.2f} |\n")
    if bad:
        print(f"{bad} shoal runs lost or left unaccounted fragments")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
