#!/usr/bin/env python3
"""Event-building goodput versus fragment size on loopback, beside iperf3 (issue 15 part 1;
docs/bench/history.md "Throughput versus fragment size").

The studies measured transfer speed against message size for 1x1, 3x1, 1x3 and 6x1
sources x builders. Here `shoal demo` runs in saturation (`source.saturate = true`: a
source produces its next fixed-size fragment as soon as the transport has taken the
previous one), with no filter and no burst saver, so the figure is the data path's: frame
building, TCP, the builders' reading, checking and slice assembly, and the writer. Each
point is beside iperf3 run in the same sweep with the same streams: one iperf3 server per
builder and one client per builder with one stream per source (`-P sources`), writing
blocks of the fragment size. Goodput is payload bytes received per second of receiving
(shoal: first to last arrival at the builders; iperf3: its receiver sum).

Each shoal run moves about as many bytes as the iperf3 beside it moves in its 2 seconds
(6 GB, `--gb` to change; at most 1,000,000 slices), so both figures are averages over
about the same time: a run of a few tenths of a second is mostly its start (connections
opening, windows growing, the first buffers faulted in), and until 2026-11-29 the runs were
1.5 GB, 0.2-0.4 s at 17 of 20 points from 64 kB up (at most 1.3 s) (docs/bench/history.md, "Runs as long as iperf3's").

usage: scripts/throughput.py SHOAL_BINARY OUT_DIR [--repeats N] [--quick] [--sizes B,B]
         [--topologies MxN,MxN] [--prefault MB] [--gb GB]
Writes OUT_DIR/throughput.{csv,md,png} (with each point's median shoal run length, s). Medians of N repeats (default 3). Exit 1 if a
shoal run loses or leaves unaccounted any fragment. With --prefault every shoal run is
followed by the same run with `run.prefault_mb = MB` (the process's memory mapped before
the run; docs/configuration.md), both beside the same iperf3 figure (extra columns).
"""
import csv
import json
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import saturated_demo  # noqa: E402

SIZES = [1_000, 4_000, 16_000, 64_000, 256_000, 1_000_000, 4_000_000]
TOPOLOGIES = [(1, 1), (3, 1), (1, 3), (6, 1), (8, 8)]
# Bytes per shoal run (all sources together) and most slices: about iperf3's 2 seconds at
# the rates of 64 kB and up on this machine, 1-2 s of 4-kB fragments.
TARGET_BYTES = 6_000_000_000
MAX_SLICES = 1_000_000
IPERF_SECONDS = 2
# iperf3 writes at most 1 MiB per call; larger fragments are compared with 1 MiB writes.
IPERF_MAX_BLOCK = 1 << 20


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shoal_run(shoal, sources, builders, size, policy="direct", prefault_mb=0, target_bytes=TARGET_BYTES):
    """(MB/s, every fragment accounted, peak RSS MB, seconds from first to last arrival)."""
    slices = max(200, min(MAX_SLICES, target_bytes // (size * sources)))
    cfg = saturated_demo.config(sources, builders, size, slices, policy, builder_budget_mb=min(4096, 8000 // builders))
    if prefault_mb:
        cfg = cfg.replace("[run]\n", f"[run]\nprefault_mb = {prefault_mb}\n", 1)
    r = saturated_demo.run(shoal, cfg)
    seconds = r["bytes_received"] / (r["mbytes_per_s"] * 1e6)
    return r["mbytes_per_s"], saturated_demo.accounted(r), r["peak_rss_mb"], seconds


def iperf_run(sources, builders, size):
    servers, clients = [], []
    ports = [free_port() for _ in range(builders)]
    try:
        for p in ports:
            servers.append(subprocess.Popen(["iperf3", "-s", "-p", str(p)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for p in ports:  # up once it accepts (a bare connection costs a persistent server nothing)
            for _ in range(500):
                try:
                    socket.create_connection(("127.0.0.1", p), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.01)
        def client(p):
            return subprocess.Popen(
                ["iperf3", "-c", "127.0.0.1", "-p", str(p), "-t", str(IPERF_SECONDS), "-P", str(sources),
                 "-l", str(min(size, IPERF_MAX_BLOCK)), "-J"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        clients = [client(p) for p in ports]
        total = 0.0
        for k, p in enumerate(ports):
            for attempt in range(5):
                out, _ = clients[k].communicate(timeout=60)
                r = json.loads(out)
                if "sum_received" in r.get("end", {}):
                    break
                # "the server is busy": the readiness probe's test is still being torn down.
                time.sleep(0.2)
                clients[k] = client(p)
            else:
                raise RuntimeError(f"iperf3 failed: {r.get('error')}")
            total += r["end"]["sum_received"]["bytes"] / IPERF_SECONDS
        return total / 1e6
    finally:
        for p in servers + clients:
            if p.poll() is None:
                p.kill()
                p.wait()


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    shoal, out_dir = sys.argv[1], sys.argv[2]
    repeats = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 3
    sizes, topologies = SIZES, TOPOLOGIES
    if "--quick" in sys.argv:
        sizes, topologies = [16_000, 1_000_000], [(1, 1), (3, 1)]
    if "--sizes" in sys.argv:
        sizes = [int(x) for x in sys.argv[sys.argv.index("--sizes") + 1].split(",")]
    if "--topologies" in sys.argv:
        topologies = [tuple(int(v) for v in t.split("x")) for t in sys.argv[sys.argv.index("--topologies") + 1].split(",")]
    prefault = int(sys.argv[sys.argv.index("--prefault") + 1]) if "--prefault" in sys.argv else 0
    target = int(float(sys.argv[sys.argv.index("--gb") + 1]) * 1e9) if "--gb" in sys.argv else TARGET_BYTES
    os.makedirs(out_dir, exist_ok=True)
    rows, bad = [], 0
    for (m, n) in topologies:
        for size in sizes:
            shoal_mb, iperf_mb, rss, pf_mb, secs = [], [], [], [], []
            for _ in range(repeats):
                mb, ok, peak, took = shoal_run(shoal, m, n, size, target_bytes=target)
                bad += not ok
                shoal_mb.append(mb)
                rss.append(peak)
                secs.append(took)
                if prefault:
                    mb, ok, _, _ = shoal_run(shoal, m, n, size, prefault_mb=prefault, target_bytes=target)
                    bad += not ok
                    pf_mb.append(mb)
                iperf_mb.append(iperf_run(m, n, size))
            s, i = statistics.median(shoal_mb), statistics.median(iperf_mb)
            row = {"topology": f"{m}x{n}", "size": size, "shoal_mb_s": round(s, 1),
                   "iperf3_mb_s": round(i, 1), "ratio": round(s / i, 3), "shoal_peak_rss_mb": round(max(rss)),
                   "shoal_run_s": round(statistics.median(secs), 2)}
            line = f"{m}x{n} {size:>9} B  shoal {s:8.1f} MB/s  iperf3 {i:8.1f} MB/s  ratio {s / i:.2f}"
            if prefault:
                p = statistics.median(pf_mb)
                row.update({"shoal_prefault_mb_s": round(p, 1), "ratio_prefault": round(p / i, 3)})
                line += f"  with prefault_mb {prefault}: {p:8.1f} MB/s  ratio {p / i:.2f}"
            rows.append(row)
            print(line, flush=True)
    with open(os.path.join(out_dir, "throughput.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(out_dir, "throughput.md"), "w") as f:
        extra = f" shoal, prefault_mb {prefault} (MB/s) | its ratio |" if prefault else ""
        f.write(f"| topology | fragment (B) | shoal (MB/s) | iperf3 (MB/s) | shoal / iperf3 | shoal peak RSS (MB) | shoal run (s) |{extra}\n")
        f.write("| --- | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if prefault else "") + "\n")
        for r in rows:
            cells = f" {r['shoal_prefault_mb_s']:,.0f} | {r['ratio_prefault']:.2f} |" if prefault else ""
            f.write(f"| {r['topology']} | {r['size']:,} | {r['shoal_mb_s']:,.0f} | {r['iperf3_mb_s']:,.0f} | {r['ratio']:.2f} | {r['shoal_peak_rss_mb']:,} | {r['shoal_run_s']:.2f} |{cells}\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 5))
        for k, (m, n) in enumerate(topologies):
            t = f"{m}x{n}"
            xs = [r["size"] for r in rows if r["topology"] == t]
            color = f"C{k}"
            ax.plot(xs, [r["shoal_mb_s"] for r in rows if r["topology"] == t], "o-", color=color, label=f"shoal {t}")
            ax.plot(xs, [r["iperf3_mb_s"] for r in rows if r["topology"] == t], "x--", color=color, label=f"iperf3 {t}")
        ax.set_xscale("log")
        ax.set_xlabel("fragment (iperf3: write) size, bytes")
        ax.set_ylabel("goodput, MB/s (loopback, 2 cores)")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "throughput.png"), dpi=110)
    except ImportError:
        print("matplotlib missing: no plot")
    if bad:
        print(f"{bad} shoal runs lost or left unaccounted fragments")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
