#!/usr/bin/env python3
"""Where the embedded full-shape run spends its CPU, per stage, in core-seconds per GB
(issue 15 part 6; docs/bench/history.md "CPU per stage").

Runs `shoal demo` (300 sources x 100 builders, delayed:8, 10 ms slices, one process over
loopback TCP, like scripts/bench-demo.sh) under `perf record` (sampling every thread at
FREQ Hz, DWARF call stacks) and gives every sample one stage:

  generation        threads `shoal-generate` (the workload, computed ahead: prefetch), and
                    the generator's code wherever it runs (inline when its thread is behind)
  filter            threads `filter-N`, and the trigger's code wherever it runs
  saver spool       threads `spool-N` (the burst saver writing raw data to its spool)
  writer            threads `writer-disk`
  send              runtime workers inside the sources' code (`shoal_net::source`,
                    `link`, the shapers) or a send/write system call
  receive+assembly  runtime workers inside the builders' code (`shoal_net::builder`,
                    `framed`, the assembler, the burst saver) or a read system call
  loopback delivery the receiving half of TCP that Linux runs in the sender's system call
                    on loopback (`tcp_v4_rcv` under a send): on a real network, the
                    builder's machine does it
  runtime           the rest of the runtime workers (tokio's scheduler, epoll, timers)
  other             everything else of the process

Every sample's stack is read from the leaf up; the first rule that matches names the stage
(a system call outranks the user code that made it). Core-seconds = samples / FREQ; per GB
= divided by the gigabytes the builders received in the run.

The same demo runs once without perf first, as the peer: sampling with DWARF call stacks
slows the run (the shares are the result, not the absolute rate).

usage (root, perf): scripts/cpu_profile.py SHOAL_BINARY OUT_DIR [--seconds S] [--live] [--freq F]
  --live: the physics generator (default: a replay pool of 16 slices per source, as in the
  transport-and-assembly row of the full-shape table)
Writes OUT_DIR/cpu-profile.{json,md}.
"""
import collections
import json
import os
import subprocess
import sys
import tempfile

STAGES = ["generation", "send", "loopback delivery", "receive+assembly", "filter", "saver spool", "writer", "runtime",
          "other"]


def arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def classify(comm, frames):
    """frames: leaf first."""
    if comm.startswith("shoal-generate"):
        return "generation"
    if comm.startswith("filter-"):
        return "filter"
    if comm.startswith("writer"):
        return "writer"
    if comm.startswith("spool"):
        return "saver spool"
    if not comm.startswith("tokio-rt-worker"):
        return "other"
    # Work done inline on a runtime worker: the generator when its thread fell behind, the
    # filter when called in place.
    if any("shoal_detector::" in f for f in frames):
        return "generation"
    if any("shoal_trigger::" in f for f in frames):
        return "filter"
    joined = "\n".join(frames)
    in_send_syscall = any(s in joined for s in ("tcp_sendmsg", "__sys_sendmsg", "do_writev", "ksys_write"))
    if in_send_syscall and "tcp_v4_rcv" in joined:
        return "loopback delivery"
    if in_send_syscall:
        return "send"
    if any(s in joined for s in ("tcp_recvmsg", "__sys_recvmsg", "do_readv", "ksys_read", "tcp_v4_rcv")):
        return "receive+assembly"
    for f in frames:
        if any(s in f for s in ("shoal_net::builder", "shoal_net::framed", "shoal_core::assembly",
                                "shoal_core::saver", "shoal_core::node::builder", "shoal_core::frame")):
            return "receive+assembly"
        if any(s in f for s in ("shoal_net::source", "shoal_net::link", "shoal_core::shaping",
                                "shoal_core::node::source")):
            return "send"
    return "runtime"


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    shoal, out_dir = sys.argv[1], sys.argv[2]
    seconds = arg("--seconds", "5")
    freq = int(arg("--freq", "49"))
    os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="cpuprof")
    cfg = os.path.join(tmp, "cfg.toml")
    with open(cfg, "w") as f:
        # 100 builders in one process: 64 MiB each (the default 512 would be refused by
        # the memory budget, as in scripts/bench-demo.sh); nothing mapped before the run.
        f.write("[run]\nprefault_mb = 0\n[builder]\nmemory_budget_mb = 64\n")
        if "--live" not in sys.argv:
            f.write("[source]\nreplay_pool = 16\n")
    perf_data = os.path.join(tmp, "perf.data")
    demo = [shoal, "demo", "--seconds", seconds, "--sources", "300", "--builders", "100", "--policy", "delayed:8",
            "--config", cfg, "--out", os.path.join(tmp, "out"), "--json"]
    # The same run without perf first: what sampling with call stacks costs the run.
    unprofiled = json.loads(subprocess.run(demo, capture_output=True, text=True, check=True).stdout)
    summary_json = subprocess.run(
        ["perf", "record", "-q", "-F", str(freq), "-g", "--call-graph", "dwarf,8192", "-o", perf_data, "--", *demo],
        capture_output=True, text=True, check=True).stdout
    summary = json.loads(summary_json)
    script = subprocess.Popen(["perf", "script", "-i", perf_data, "-F", "comm,tid,time,ip,sym"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, errors="replace")
    samples = collections.Counter()
    threads = collections.Counter()
    comm, frames = None, []

    def flush():
        if comm is not None:
            samples[classify(comm, frames)] += 1
            threads[comm.rstrip("0123456789-")] += 1

    for line in script.stdout:
        if not line.strip():
            flush()
            comm, frames = None, []
        elif not line.startswith((" ", "\t")):
            comm = line.split()[0]
        else:
            frames.append(line.strip())
    flush()
    script.wait()
    gb = summary["bytes_received"] / 1e9
    total = sum(samples.values())
    rows = []
    for stage in STAGES:
        core_s = samples[stage] / freq
        rows.append({"stage": stage, "core_s": round(core_s, 2), "share_pct": round(100 * samples[stage] / max(total, 1), 1),
                     "core_s_per_gb": round(core_s / gb, 2) if gb else None})
    result = {
        "workload": "live physics generator" if "--live" in sys.argv else "replay pool",
        "seconds": float(seconds), "mbytes_per_s": summary["mbytes_per_s"], "gb_received": round(gb, 3),
        "slices_complete": summary["slices_complete"], "slices_incomplete": summary["slices_incomplete"],
        "late_slice_ends": summary["late_slice_ends"], "cpu_core_s": round(total / freq, 2),
        "stages": rows, "threads": dict(threads),
        "without_perf": {k: unprofiled[k] for k in ("mbytes_per_s", "slices_complete", "slices_incomplete",
                                                     "late_slice_ends")},
    }
    name = "cpu-profile-live" if "--live" in sys.argv else "cpu-profile"
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write(f"{result['workload']}: {result['mbytes_per_s']:.0f} MB/s, {gb:.2f} GB in {seconds} s, "
                f"{result['cpu_core_s']} core-s sampled; slices {summary['slices_complete']} complete, "
                f"{summary['slices_incomplete']} incomplete, {summary['late_slice_ends']} late slice ends. "
                f"The same run without perf: {unprofiled['mbytes_per_s']:.0f} MB/s, slices "
                f"{unprofiled['slices_complete']} complete, {unprofiled['slices_incomplete']} incomplete, "
                f"{unprofiled['late_slice_ends']} late slice ends.\n\n")
        f.write("| stage | core-s | share | core-s per GB |\n|---|---:|---:|---:|\n")
        for r in rows:
            f.write(f"| {r['stage']} | {r['core_s']} | {r['share_pct']}% | {r['core_s_per_gb']} |\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
