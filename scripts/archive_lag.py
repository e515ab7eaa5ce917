#!/usr/bin/env python3
"""The archive at the demo's nominal rate (docs/benchmarks.md, "The archive: lag and
catch-up"), to a mounted-file-system destination on this machine:

1. lag: `shoal demo` with every processed slice stored whole (`builder.store_slices`, so
   the writer stores what the builders receive) and a new events file every second, while
   `shoal archive run OUT --to file://DEST` keeps the directory; the lag of each file is
   its `safe` record's time minus its close time (both in the journal): p50, p99, max;
2. catch-up: the same run with no archiver (a destination down for the whole run), then
   `shoal archive run --once` over everything: MB/s, beside the demo's write rate and
   `cp` of the same files to another directory (the peer, as xrdcp would be to XRootD).

usage: scripts/archive_lag.py [--bin target/release/shoal] [--seconds 30]
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_ab import arg  # noqa: E402

CONFIG = """[builder]
store_slices = true
[writer]
checkpoint_s = 1.0
"""


def demo(binary, seconds, out, cfg):
    r = subprocess.run([binary, "demo", "--seconds", str(seconds), "--config", cfg, "--out", out, "--json"],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise SystemExit(f"demo failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def journal(out):
    with open(os.path.join(out, ".shoal-archive", "journal.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def data_files(out):
    return [os.path.join(out, n[:-5]) for n in os.listdir(out) if n.endswith(".json") and ".parquet" in n]


def main():
    binary = os.path.abspath(arg("--bin", "target/release/shoal"))
    seconds = float(arg("--seconds", "30"))
    tmp = tempfile.mkdtemp(prefix="archive-lag-")
    cfg = os.path.join(tmp, "store.toml")
    with open(cfg, "w") as f:
        f.write(CONFIG)

    # 1. Lag, the archiver running beside the run.
    out, dest = os.path.join(tmp, "out"), os.path.join(tmp, "dest")
    os.makedirs(out)
    archiver = subprocess.Popen([binary, "archive", "run", out, "--to", f"file://{dest}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    s = demo(binary, seconds, out, cfg)
    # Bounded: the last files become safe within seconds of the run's end.
    deadline = time.time() + 120
    while time.time() < deadline:
        recs = journal(out)
        closed = {r["file"]: r["closed_at"] for r in recs if r["record"] == "closed"}
        safe = {r["file"]: r["at"] for r in recs if r["record"] == "safe"}
        if closed and set(closed) <= set(safe):
            break
        time.sleep(0.2)
    archiver.terminate()
    archiver.wait(timeout=60)
    lags = sorted(safe[f] - closed[f] for f in closed if f in safe)
    written = sum(os.path.getsize(p) for p in data_files(out))
    rate = written / seconds / 1e6
    p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
    print(f"run: {s['mbytes_per_s']:.1f} MB/s received, {written / 1e6:.1f} MB stored in {len(closed)} files "
          f"({rate:.1f} MB/s), every slice: {s['slices_incomplete'] == 0}")
    print(f"lag from close to safe: p50 {statistics.median(lags):.2f} s, p99 {p99:.2f} s, max {lags[-1]:.2f} s "
          f"({len(lags)} of {len(closed)} files safe)")

    # 2. Catch-up: nothing archived during the run, then everything at once.
    out2, dest2, peer = os.path.join(tmp, "out2"), os.path.join(tmp, "dest2"), os.path.join(tmp, "peer")
    os.makedirs(out2)
    demo(binary, seconds, out2, cfg)
    files = data_files(out2)
    size = sum(os.path.getsize(p) for p in files)
    began = time.time()
    r = subprocess.run([binary, "archive", "run", out2, "--once", "--json", "--to", f"file://{dest2}"],
                       capture_output=True, text=True)
    took = time.time() - began
    ledger = json.loads(r.stdout)
    os.makedirs(peer)
    began = time.time()
    subprocess.run(["cp", *files, peer], check=True)
    subprocess.run(["sync", "-f", peer], check=True)
    cp_took = time.time() - began
    print(f"catch-up: {size / 1e6:.1f} MB in {len(files)} files, safe {ledger['files_safe']} of {ledger['files']}: "
          f"{size / took / 1e6:.0f} MB/s ({size / took / 1e6 / rate:.1f} x the write rate); "
          f"cp + sync of the same files {size / cp_took / 1e6:.0f} MB/s")
    shutil.rmtree(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
