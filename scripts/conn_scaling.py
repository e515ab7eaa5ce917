#!/usr/bin/env python3
"""Connection scaling (issue 15, part 4; docs/benchmarks.md "Connection scaling"): one
builder process receiving from 1, 10, 100, 1,000 and 10,000 TCP connections, its CPU per
GB and the rate it sustained.

Each point is a real cluster of `shoal node` processes on loopback: a writer, one builder
(`--ids 0`), and source processes hosting N sources with `source.connection_per_source`,
so the builder holds N data connections (at most 2,500 per source process: the
per-process limit is 20,000 descriptors). Sources saturate (`source.saturate`): each
produces its next fixed-size fragment as soon as its connection has taken the last one,
so the data path sets the rate; every source sends the same number of bytes in total.

Measured:
  - the builder's CPU (user + system, from wait4's rusage of its process) per GB it
    received, and per fragment;
  - its rate: bytes received / (last arrival - first arrival), from its own report;
  - the senders' CPU beside it (they share the 2 cores: the rate is this machine's, with
    senders and builder on the same cores, not the builder's alone).
Every run's ledger is checked: every fragment produced was delivered.
With --syscalls (perf), the builder runs under `perf stat` counting its system calls
(all; recvfrom, the socket reads; epoll_wait) and context switches, per fragment: where
the CPU per GB goes as connections grow.

With --receive epoll,io_uring every point is run once per receive path
(`builder.receive`), interleaved, so the two are compared under the same machine load;
--window likewise for the builder's window (`builder.max_active`, default 5: a source
that runs further ahead is held back by its connection; with 1000000, as the series before
2026-11-26 ran, nothing is held and the builder keeps whatever the drift brings). Every
slice must be built complete: the processes share a first slice (`run.start_slice`).

`--receive sink` puts scripts/tcp_sink.c (built with cc) in the builder's place: a receiver
that accepts, reads into one 64-kB buffer and discards, nothing else (`sink:16384` reads at
most 16 kB at a time, as the builder's readers do; `sink:65536:64` reads each time into a
buffer of its own and keeps the 64 latest, as a builder keeps what it has read until the
slice is built, so that the kernel's copy writes into memory freed a while ago). Its CPU per GB at
each count is what the kernel alone costs for the same connections and the same senders:
the floor under the builder's figure (its rows fill the builder's columns; no writer runs,
and its bytes must be every fragment's).

usage: scripts/conn_scaling.py SHOAL OUT_DIR [--counts 1,10,100,1000,10000]
         [--fragment BYTES] [--mb-per-point MB] [--repeats R] [--syscalls]
         [--receive epoll[,io_uring][,sink[:BYTES[:KEEP]]]] [--window 5[,1000000]] [--name conn-scaling]
         [--perf-record]
Writes OUT_DIR/NAME.{csv,md} (medians of R runs per count and path); with --perf-record
the builder runs under `perf record -g` (2,000 samples a second), one
OUT_DIR/NAME-COUNT-PATH-wWINDOW-rREPEAT.perf.data per run, for `perf report -i` (its CPU
figures are then the profiled process's, dearer than without);
`scripts/conn_scaling.py --table OUT_DIR` writes the table again from the CSV.
"""
import csv
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib

PER_PROCESS = 2500
SYSCALLS = ["raw_syscalls:sys_enter", "syscalls:sys_enter_recvfrom", "syscalls:sys_enter_epoll_wait",
            "syscalls:sys_enter_io_uring_enter", "context-switches"]


def arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(n, fragment, slices, out, receive="epoll", window=5):
    b, w = free_port(), free_port()
    # Every process numbers its slices from the same first one: left to themselves, processes
    # that start either side of a whole second begin a second (1,000 slices) apart, and then
    # no slice ever gets every source's fragment.
    start_slice = (int(time.time()) + 2) * 1000
    return f"""[run]
run_number = 1
sources = {n}
builders = 1
slice_ms = 1
seconds = {slices / 1000}
start_slice = {start_slice}
policy = "direct"
builder_addrs = ["127.0.0.1:{b}"]
writer_addr = "127.0.0.1:{w}"

[source]
generator = "fixed"
fixed_bytes = {fragment}
saturate = true
connection_per_source = true

[builder]
receive = "{receive}"
max_active = {window}
wall_timeout_ms = 600000
memory_budget_mb = 2048

[builder.filter]
name = "none"

[saver]
enabled = false

[writer]
out_dir = "{out}"
"""


def wait_rusage(p, timeout):
    """(returncode, user+system seconds, peak resident MB, page faults) of a child, waited
    for at most `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid == p.pid:
            p.returncode = os.waitstatus_to_exitcode(status)
            return p.returncode, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024, ru.ru_minflt + ru.ru_majflt
        time.sleep(0.05)
    p.kill()
    raise RuntimeError(f"process {p.args[:4]} did not end in {timeout} s")


def wait_report(p, timeout, what):
    """(the JSON a process printed, its CPU seconds, peak RSS MB, page faults) once it ended well."""
    out = p.stdout.read()
    rc, cpu, rss_mb, faults = wait_rusage(p, timeout)
    if rc != 0:
        raise RuntimeError(f"{what} failed ({rc})")
    return json.loads(out), cpu, rss_mb, faults


def start_sources(shoal, path, n):
    """The source processes of a point, at most PER_PROCESS sources each."""
    groups = [(lo, min(n, lo + PER_PROCESS)) for lo in range(0, n, PER_PROCESS)]
    return [subprocess.Popen([shoal, "node", "--role", "source", "--config", path,
                              "--ids", ",".join(map(str, range(lo, hi)))],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for lo, hi in groups]


def wait_sources(sources):
    """(their CPU seconds together, fragments they produced) once every source process ended."""
    source_cpu, produced = 0.0, 0
    for s in sources:
        report, cpu, _, _ = wait_report(s, 900, "a source process")
        source_cpu += cpu
        produced += sum(t["produced"] for t in report["tallies"].values())
    return source_cpu, produced


def build_sink():
    """scripts/tcp_sink.c built into a temporary directory; its path."""
    out = os.path.join(tempfile.mkdtemp(prefix="tcpsink"), "tcp_sink")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tcp_sink.c")
    subprocess.run(["cc", "-O2", "-Wall", "-o", out, src], check=True)
    return out


def sink_run(shoal, sink, n, fragment, mb, receive):
    """One point with tcp_sink in the builder's place (`receive` is `sink[:READ_BYTES[:KEEP]]`):
    its CPU per GB beside the builder's."""
    given = [int(x) for x in receive.split(":")[1:]]
    read_bytes = given[0] if given else 65536
    keep = given[1] if len(given) > 1 else 0
    slices = max(20, math.ceil(mb * 1e6 / (n * fragment)))
    with tempfile.TemporaryDirectory(prefix="connscale") as d:
        path = os.path.join(d, "cfg.toml")
        text = config(n, fragment, slices, os.path.join(d, "out"))
        with open(path, "w") as f:
            f.write(text)
        port = tomllib.loads(text)["run"]["builder_addrs"][0].rsplit(":", 1)[1]
        receiver = subprocess.Popen([sink, port, str(n), str(read_bytes), str(keep)], stdout=subprocess.PIPE)
        sources = []
        try:
            # The sources retry their connections until the sink listens.
            sources = start_sources(shoal, path, n)
            source_cpu, produced = wait_sources(sources)
            got, cpu, rss_mb, faults = wait_report(receiver, 120, "tcp_sink")
        finally:
            for p in [receiver, *sources]:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    if got["connections"] != n or got["bytes"] < produced * fragment:
        raise RuntimeError(f"{n} connections: tcp_sink took {got['connections']} connections and "
                           f"{got['bytes']} bytes for {produced} fragments of {fragment}")
    gb = got["bytes"] / 1e9
    return {
        "builder_page_faults_per_fragment": faults / produced,
        "receive": receive, "window": 0, "read_holds": 0,
        "held_fragments_most": 0, "connections": n,
        "fragment_bytes": fragment, "slices": slices, "gb": gb,
        "builder_cpu_s": cpu, "builder_cpu_s_per_gb": cpu / gb,
        "builder_cpu_us_per_fragment": 1e6 * cpu / produced,
        "mbytes_per_s": got["bytes"] / 1e6 / got["span_s"] if got["span_s"] > 0 else float("nan"),
        "sender_cpu_s_per_gb": source_cpu / gb,
        "builder_peak_rss_mb": rss_mb,
    }


def one_run(shoal, n, fragment, mb, syscalls=False, receive="epoll", window=5, record=None):
    slices = max(20, math.ceil(mb * 1e6 / (n * fragment)))
    with tempfile.TemporaryDirectory(prefix="connscale") as d:
        path = os.path.join(d, "cfg.toml")
        with open(path, "w") as f:
            f.write(config(n, fragment, slices, os.path.join(d, "out"), receive, window))
        counts = os.path.join(d, "perf.csv")
        node = lambda role, ids=None, prefix=(): subprocess.Popen(
            [*prefix, shoal, "node", "--role", role, "--config", path] + (["--ids", ids] if ids else []),
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        writer = node("writer")
        perf = ["perf", "stat", "-x,", "-o", counts, "-e", ",".join(SYSCALLS), "--"] if syscalls else []
        if record:
            perf = ["perf", "record", "-F", "2000", "-g", "-q", "-o", record, "--"]
        builder = node("builder", "0", perf)
        sources = start_sources(shoal, path, n)
        try:
            source_cpu, produced = wait_sources(sources)
            report, builder_cpu, builder_rss_mb, builder_faults = wait_report(builder, 900, "the builder")
            writer.stdout.read()
            wait_rusage(writer, 120)
            events = {}
            if syscalls:
                for line in open(counts):
                    f = line.strip().split(",")
                    if len(f) > 2 and f[2] in SYSCALLS and f[0].isdigit():
                        events[f[2].split(":")[-1].replace("sys_enter_", "").replace("sys_enter", "syscalls")] = int(f[0])
        finally:
            for p in [writer, builder, *sources]:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    delivered = report["tally"]["delivered"]
    if delivered != produced or report["connections"] != n or report["slices_incomplete"]:
        raise RuntimeError(f"{n} connections: produced {produced}, delivered {delivered}, "
                           f"connections {report['connections']}, incomplete slices {report['slices_incomplete']}")
    gb = report["bytes"] / 1e9
    span_s = (report["last_arrival_ns"] - report["first_arrival_ns"]) / 1e9
    per_fragment = {f"{k}_per_fragment": v / delivered for k, v in events.items()}
    # First touch of the builder's peak memory, in pages: at 10,000 connections a slice is
    # 40 MB and what the builder holds is a large part of a short point (docs/benchmarks.md).
    per_fragment["builder_page_faults_per_fragment"] = builder_faults / delivered
    return {
        **per_fragment,
        "receive": receive, "window": window, "read_holds": report.get("read_holds", 0),
        "held_fragments_most": report.get("held_fragments_most", 0), "connections": n, "fragment_bytes": fragment, "slices": slices, "gb": gb,
        "builder_cpu_s": builder_cpu, "builder_cpu_s_per_gb": builder_cpu / gb,
        "builder_cpu_us_per_fragment": 1e6 * builder_cpu / delivered,
        "mbytes_per_s": report["bytes"] / 1e6 / span_s if span_s > 0 else float("nan"),
        "sender_cpu_s_per_gb": source_cpu / gb,
        "builder_peak_rss_mb": builder_rss_mb,
    }


def write_table(runs, out_dir, name="conn-scaling"):
    """OUT_DIR/NAME.md: medians per receive path and connection count, from the runs' rows."""
    for x in runs:
        x.setdefault("receive", "epoll")
    # The sink has no window: only the builders' rows are told apart by theirs.
    several_windows = len({str(x.get("window")) for x in runs if not x["receive"].startswith("sink")}) > 1
    for x in runs:
        if several_windows and not x["receive"].startswith("sink") and "window" not in x["receive"]:
            x["receive"] = f"{x['receive']}, window {x.get('window') or 1000000}"
    paths = sorted({x["receive"] for x in runs})
    counts = sorted({x["connections"] for x in runs})
    keys = ["builder_cpu_s_per_gb", "builder_cpu_us_per_fragment", "mbytes_per_s", "builder_peak_rss_mb",
            "sender_cpu_s_per_gb"]
    extra = [k for k in runs[0] if k.endswith("_per_fragment") and k not in keys]
    medians = {}
    for path in paths:
        for n in counts:
            rows = [x for x in runs if x["connections"] == n and x["receive"] == path]
            if rows:
                medians[path, n] = {k: statistics.median(float(x[k]) for x in rows if x.get(k) not in (None, ""))
                                    for k in keys + extra if any(x.get(k) not in (None, "") for x in rows)}
    repeats = len(runs) // len(medians)
    fragment, mb = runs[0]["fragment_bytes"], float(runs[0]["gb"]) * 1e3
    md = os.path.join(out_dir, f"{name}.md")
    with open(md, "w") as f:
        f.write(f"{fragment}-byte fragments, about {mb:.0f} MB per point, median of {repeats}\n\n")
        f.write("| receive | connections | builder core-s per GB | vs 10 | builder us per fragment | MB/s "
                "| builder peak RSS MB | senders' core-s per GB |" + "".join(f" {k.replace('_', ' ')} |" for k in extra)
                + "\n")
        f.write("|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(extra) + "\n")
        for (path, n), m in medians.items():
            base = medians.get((path, 10))
            ratio = f"{m['builder_cpu_s_per_gb'] / base['builder_cpu_s_per_gb']:.2f}" if base else "-"
            f.write(f"| {path} | {n} | {m['builder_cpu_s_per_gb']:.2f} | {ratio} | {m['builder_cpu_us_per_fragment']:.2f} "
                    f"| {m['mbytes_per_s']:.0f} | {m['builder_peak_rss_mb']:.0f} | {m['sender_cpu_s_per_gb']:.2f} |"
                    + "".join(f" {m[k]:.2f} |" if k in m else " - |" for k in extra) + "\n")
    print(open(md).read())
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    # Every run, not only the medians: the spread is the finding.
    fig, (cpu, rss) = plt.subplots(1, 2, figsize=(10, 4))
    for c, path in enumerate(paths):
        mine = [x for x in runs if x["receive"] == path]
        xs = [x["connections"] for x in mine]
        ns = [n for n in counts if (path, n) in medians]
        label = f" ({path})" if len(paths) > 1 else ""
        cpu.scatter(xs, [float(x["builder_cpu_s_per_gb"]) for x in mine], s=14, alpha=0.5, color=f"C{2 * c}",
                    label="one run" + label)
        cpu.plot(ns, [medians[path, n]["builder_cpu_s_per_gb"] for n in ns], "o-", color=f"C{2 * c + 1}",
                 label="median" + label)
        rss.scatter(xs, [float(x["builder_peak_rss_mb"]) for x in mine], s=14, alpha=0.6, color=f"C{2 * c}",
                    label=path)
        base = medians.get((path, 10))
        if base and c == 0:
            cpu.axhline(1.2 * base["builder_cpu_s_per_gb"], ls="--", color="grey",
                        label=f"goal: 1.2 x the 10-connection median{label}")
    cpu.set_ylabel("builder CPU, core-s per GB")
    rss.set_ylabel("builder peak RSS, MB")
    for ax in (cpu, rss):
        ax.set_xscale("log")
        ax.set_xlabel("connections to the builder")
        ax.grid(True, which="both", alpha=0.3)
    cpu.legend(fontsize=7)
    if len(paths) > 1:
        rss.legend(fontsize=7)
    fig.suptitle(f"one builder, {fragment}-byte fragments, saturating sources (loopback, 2 cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=110)


def main():
    name = arg("--name", "conn-scaling")
    if "--table" in sys.argv:
        # Tables again from a run's CSV: scripts/conn_scaling.py --table OUT_DIR [--name NAME]
        out_dir = sys.argv[sys.argv.index("--table") + 1]
        with open(os.path.join(out_dir, f"{name}.csv")) as f:
            runs = [{k: (int(v) if k in ("connections", "fragment_bytes") else v) for k, v in r.items()}
                    for r in csv.DictReader(f)]
        return write_table(runs, out_dir, name)
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    shoal, out_dir = sys.argv[1], sys.argv[2]
    counts = [int(c) for c in arg("--counts", "1,10,100,1000,10000").split(",")]
    fragment = int(arg("--fragment", "4096"))
    mb = float(arg("--mb-per-point", "1000"))
    repeats = int(arg("--repeats", "3"))
    paths = arg("--receive", "epoll").split(",")
    windows = [int(w) for w in arg("--window", "5").split(",")]
    os.makedirs(out_dir, exist_ok=True)
    sink = build_sink() if any(p.startswith("sink") for p in paths) else None
    runs = []
    for r in range(repeats):
        for n in counts:
            for path in paths:
                if path.startswith("sink"):
                    row = sink_run(shoal, sink, n, fragment, mb, path)
                    row["repeat"] = r
                    runs.append(row)
                    print(json.dumps(row), flush=True)
                    continue
                for window in windows:
                    record = None
                    if "--perf-record" in sys.argv:
                        record = os.path.join(out_dir, f"{name}-{n}-{path}-w{window}-r{r}.perf.data")
                    row = one_run(shoal, n, fragment, mb, "--syscalls" in sys.argv, path, window, record)
                    row["repeat"] = r
                    runs.append(row)
                    print(json.dumps(row), flush=True)
    with open(os.path.join(out_dir, f"{name}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(runs[0].keys()))
        w.writeheader()
        w.writerows(runs)
    write_table(runs, out_dir, name)


if __name__ == "__main__":
    main()
