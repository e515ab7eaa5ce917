#!/usr/bin/env python3
"""What one fragment costs the machine, in counts rather than seconds (issue 32).

Runs a fixed `shoal demo` workload REPS times under `perf stat` with the kernel's software
events and tracepoints (this VM exposes no hardware counters: no instruction counts) and
prints, per fragment and per megabyte received, the system calls by kind, the wake-ups
(`sched:sched_wakeup`), the context switches and the CPU time. Counts depend far less on a
shared machine's noise than times do: quote them before and after a change to the data
path (median of the runs, with min-max to show how repeatable they are).
Instructions per fragment, which perf cannot count here, come from callgrind:
scripts/cost_instructions.py.

  scripts/cost.py target/release/shoal                     # 30 x 10, delayed:8, 3 s x 3
  scripts/cost.py target/release/shoal --policy direct --policy tbf:1000Mbit:20000
  scripts/cost.py target/release/shoal --json > cost.json

Each policy is one workload: SOURCES sources and BUILDERS builders in one process over
loopback TCP, FRAGMENT-byte fragments replayed from a pool (no generator cost, no filter),
10-ms slices. Needs `perf` (Debian linux-perf) and permission for tracepoints (root, or
kernel.perf_event_paranoid <= -1).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SYSCALLS = [
    "write",
    "writev",
    "sendmsg",
    "sendto",
    "read",
    "readv",
    "recvmsg",
    "recvfrom",
    "epoll_wait",
    "epoll_pwait",
    "epoll_ctl",
    "timerfd_settime",
    "futex",
    "io_uring_enter",
    "clock_nanosleep",
    "nanosleep",
    "sched_yield",
    "getsockopt",
    "setsockopt",
    "connect",
    "accept4",
    "close",
]
EVENTS = (
    ["raw_syscalls:sys_enter", "sched:sched_wakeup", "context-switches", "cpu-migrations", "page-faults",
     "task-clock"]
    + [f"syscalls:sys_enter_{s}" for s in SYSCALLS]
)


def run_once(shoal, policy, a, tmp):
    cfg = os.path.join(tmp, "cost.toml")
    with open(cfg, "w") as f:
        f.write(
            "[run]\nslice_ms = 10\nprefault_mb = 0\n"
            f"[source]\nreplay_pool = 16\ngenerator = \"fixed\"\nfixed_bytes = {a.fragment}\n"
            "[builder]\nmemory_budget_mb = 64\n[builder.filter]\nname = \"none\"\n"
        )
    perf_out = os.path.join(tmp, "perf.csv")
    cmd = [
        "perf", "stat", "-x", ",", "-o", perf_out, "-e", ",".join(EVENTS), "--",
        shoal, "demo", "--seconds", str(a.seconds), "--sources", str(a.sources), "--builders", str(a.builders),
        "--policy", policy, "--config", cfg, "--out", os.path.join(tmp, "out"), "--json",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    summary = json.loads(p.stdout)
    counts = {}
    with open(perf_out) as f:
        for line in f:
            parts = line.strip().split(",")
            if len(parts) < 3 or line.startswith("#") or not parts[0]:
                continue
            value, event = parts[0], parts[2]
            try:
                counts[event] = float(value)
            except ValueError:
                counts[event] = float("nan")  # <not supported> / <not counted>
    listed = sum(v for e, v in counts.items() if e.startswith("syscalls:sys_enter_"))
    counts["other syscalls"] = counts.get("raw_syscalls:sys_enter", 0.0) - listed
    fragments = summary["fragments_received"]
    mb = summary["bytes_received"] / 1e6
    if fragments == 0:
        sys.exit("no fragment received: nothing to divide by")
    row = {"fragments": fragments, "mb": mb, "complete": summary["slices_complete"],
           "incomplete": summary["slices_incomplete"], "balanced": summary["ledger"]["balanced"]}
    for e, v in counts.items():
        name = e.replace("syscalls:sys_enter_", "").replace("raw_syscalls:sys_enter", "syscalls")
        name = name.replace("sched:sched_wakeup", "wakeups").replace("other syscalls", "other_syscalls")
        if name == "task-clock":
            # perf gives milliseconds of CPU.
            row["cpu_us_per_fragment"] = v * 1e3 / fragments
            row["cpu_ms_per_mb"] = v / mb
        else:
            row[f"{name}_per_fragment"] = v / fragments
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shoal")
    ap.add_argument("--policy", action="append", help="one workload per policy (default delayed:8)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--sources", type=int, default=30)
    ap.add_argument("--builders", type=int, default=10)
    ap.add_argument("--fragment", type=int, default=30000, help="bytes per fragment")
    ap.add_argument("--json", action="store_true", help="every run's figures as JSON")
    a = ap.parse_args()
    policies = a.policy or ["delayed:8"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="shoal-cost-") as tmp:
        for policy in policies:
            results[policy] = [run_once(a.shoal, policy, a, tmp) for _ in range(a.reps)]
    if a.json:
        json.dump(results, sys.stdout, indent=1)
        print()
        return
    for policy, rows in results.items():
        print(f"\n{policy}: {a.sources} sources x {a.builders} builders, {a.fragment}-byte fragments, "
              f"10-ms slices, {a.seconds} s, {a.reps} runs (median [min-max])")
        print(f"  fragments {statistics.median(r['fragments'] for r in rows):.0f}, "
              f"slices complete {[r['complete'] for r in rows]}, incomplete {[r['incomplete'] for r in rows]}, "
              f"ledger balanced {all(r['balanced'] for r in rows)}")
        keys = [k for k in rows[0] if k.endswith("_per_fragment") or k.endswith("_per_mb")]
        for k in keys:
            vals = [r[k] for r in rows]
            if all(v == 0 for v in vals):
                continue
            print(f"  {k:<32} {statistics.median(vals):10.3f}  [{min(vals):.3f}-{max(vals):.3f}]")


if __name__ == "__main__":
    main()
