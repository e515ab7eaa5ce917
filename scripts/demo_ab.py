#!/usr/bin/env python3
"""Two shoal binaries on the full ANTARES shape in turn, beside iperf3 (docs/benchmarks.md,
"The refactor, before and after").

The rows of scripts/bench-demo.sh: `shoal demo --seconds S --sources 300 --builders 100
--policy delayed:8 --json` with `[builder] memory_budget_mb = 64` and nothing mapped
before the run; "pool" replays 16 slices computed before the run (`[source] replay_pool =
16`), "live" computes the hits during the run. Each round runs every row with the first
binary, then with the second; iperf3 over loopback with 8 streams before the first round
and after the last. The binaries take turns going first, round by round. Prints, per row and binary, the median MB/s (bytes the builders
received over first to last arrival) and its range, the runs that kept every slice, and
the median CPU seconds (the process's user + system time, from wait4) per GB delivered.
Exit 1 if a run's ledger does not balance or a run fails.

usage: scripts/demo_ab.py BEFORE AFTER [--rounds 5] [--seconds 5] [--rows pool,live]
"""
import json
import os
import statistics
import subprocess
import sys
import socket
import tempfile
import time

ROWS = {
    "pool": "[run]\nprefault_mb = 0\n[source]\nreplay_pool = 16\n[builder]\nmemory_budget_mb = 64\n",
    "live": "[run]\nprefault_mb = 0\n[builder]\nmemory_budget_mb = 64\n",
}


def arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def demo(binary, config, seconds, out):
    """One run: (summary, CPU seconds of the process)."""
    cmd = [binary, "demo", "--seconds", str(seconds), "--sources", "300", "--builders", "100",
           "--policy", "delayed:8", "--config", config, "--out", out, "--json"]
    with open(os.path.join(out, "stderr"), "w") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
        stdout = p.stdout.read()
        _, status, usage = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{binary} failed (exit {os.waitstatus_to_exitcode(status)}); see {out}/stderr")
    return json.loads(stdout), usage.ru_utime + usage.ru_stime


def wait_listening(port, tries=200):
    """Waits until something listens on 127.0.0.1:`port` (bounded: `tries` x 50 ms)."""
    for _ in range(tries):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)


def iperf3(seconds, streams=8):
    """iperf3 over loopback with `streams` streams, MB/s received (NaN if it cannot run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["iperf3", "-s", "-B", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(port)
        r = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", str(seconds),
                            "-P", str(streams), "-J"], capture_output=True, text=True)
        end = json.loads(r.stdout or "{}").get("end", {})
        return end.get("sum_received", {}).get("bits_per_second", float("nan")) / 8e6
    finally:
        server.kill()
        server.wait()


def main():
    if len(sys.argv) < 3 or sys.argv[1].startswith("--"):
        print(__doc__)
        return 2
    bins = [os.path.abspath(b) for b in sys.argv[1:3]]
    rounds = int(arg("--rounds", "5"))
    seconds = float(arg("--seconds", "5"))
    rows = arg("--rows", "pool,live").split(",")
    tmp = tempfile.mkdtemp(prefix="demo-ab-")
    configs = {}
    for row in rows:
        configs[row] = os.path.join(tmp, f"{row}.toml")
        with open(configs[row], "w") as f:
            f.write(ROWS[row])
    peers = [iperf3(seconds)]
    got = {(row, b): [] for row in rows for b in bins}
    for r in range(rounds):
        # The binaries take turns going first: a run after one that freed gigabytes pays
        # for fresh memory on this VM (docs/bench/history.md, "The issue from start to
        # close"), so a fixed order would favour the first.
        order = bins if r % 2 == 0 else bins[::-1]
        for row in rows:
            for b in order:
                out = os.path.join(tmp, f"out-{row}-{bins.index(b)}-{r}")
                os.makedirs(out)
                s, cpu = demo(b, configs[row], seconds, out)
                if s["ledger"]["unaccounted"] != 0 or not s["ledger"]["balanced"]:
                    print(f"ledger unbalanced: {row} {b} round {r}")
                    return 1
                gb = s["bytes_received"] / 1e9
                complete = s["slices_incomplete"] == 0
                got[(row, b)].append((s["mbytes_per_s"], complete, cpu / gb if gb > 0 else float("nan")))
                print(f"round {r + 1} {row} {'before' if b == bins[0] else 'after'}: "
                      f"{s['mbytes_per_s']:.0f} MB/s, complete {complete}, {cpu:.1f} CPU-s", file=sys.stderr)
    peers.append(iperf3(seconds))
    print(f"iperf3 loopback, 8 streams, before and after: {peers[0]:.0f} / {peers[1]:.0f} MB/s")
    print()
    print(f"| row | binary | MB/s, median (range) | runs with every slice | CPU-s per GB, median (range) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for row in rows:
        for b, name in zip(bins, ("before", "after")):
            runs = got[(row, b)]
            mb = [x[0] for x in runs]
            per_gb = [x[2] for x in runs]
            print(f"| {row} | {name} | {statistics.median(mb):.0f} ({min(mb):.0f}-{max(mb):.0f}) | "
                  f"{sum(x[1] for x in runs)} of {len(runs)} | "
                  f"{statistics.median(per_gb):.2f} ({min(per_gb):.2f}-{max(per_gb):.2f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
