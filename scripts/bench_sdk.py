#!/usr/bin/env python3
"""Fragments in through the source SDK, beside the replay pool (issue 29; docs/benchmarks.md
"Source SDK: submission through Rust, C and Python").

One board, one builder and the writer, each its own process, on loopback; slices of 1 ms,
policy `direct`, no filter, no burst saver. Each producer hands COUNT fragments of SIZE
bytes to the same source loop, fragment i into slice first + i:

- replay: `shoal node --role source` with `generator = "fixed"` and a replay pool of 16
  slices (the fastest built-in producer: the fragments exist before the run);
- rust-copy / rust-lent: crates/shoal-net/examples/submit_bench.rs (SourceHandle::submit),
  each fragment copied from a reused buffer, or lent from a ring of 256 buffers without a
  copy (`Bytes::from_owner`, back to the ring when sent);
- c-copy / c-lent: examples/c/submit_bench.c through libshoal, `shoal_source_submit_slice`
  (copies) or `shoal_source_submit_slice_lent` (a ring of 256 buffers, released back);
- python: `shoal.Source.submit_slice` from one thread, `bytes` for 100 B (copied below
  16 KiB), one numpy array for the larger sizes (held without a copy).

The sources are data-driven (`source.saturate = true`: a slice goes out as soon as the
transport has room), so each run goes as fast as its slowest stage. Two figures per run:
at the builder, fragments and payload bytes per second between the first and the last
arrival (the figure of the throughput benchmark, the same for every producer); at the
submitter, fragments per second of its submit loop alone (how fast the API takes data;
`input_held_mb` is set above each run's data, so the loop is not held back by the chain).
Every run's ledger must balance with every fragment delivered. The ratio to the replay pool
is of fragments per second (the payloads are the same size but at 100 B, where the replay
pool's are 96 B of whole hits).

usage: scripts/bench_sdk.py SHOAL_BINARY OUT_DIR [--repeats N] [--quick]
       (run from the repository root after `make build c-examples py-sdk` and
        `cargo build --release -p shoal-net --example submit_bench`)
Writes OUT_DIR/bench_sdk.{csv,md}. Medians of N repeats (default 3), the producers
interleaved within each repeat so that the machine's mood hits them alike.
"""
import argparse
import csv
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
C_BENCH = ROOT / "target" / "c" / "submit_bench"
RUST_BENCH = ROOT / "target" / "release" / "examples" / "submit_bench"
# (size, count): about a second of data at loopback speeds.
CASES = [(100, 300_000), (30_000, 40_000), (65_536, 20_000), (1_000_000, 1_500)]
PRODUCERS = ["replay", "rust-copy", "rust-lent", "c-copy", "c-lent", "python"]
# `fixed_bytes` counts the frame header (docs/wire-format.md): the replay pool's payloads
# are then the submitted size (below 1,371 B rounded down to whole 6-byte hits: 96 B for 100).
FRAME_HEADER = 56
# Room for every run's data (at most 1.5 GB), so that the submit loop measures the API,
# not back-pressure.
HELD_MB = 2048


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(out, size, count, replay):
    slice_ms = 1
    start = time.time_ns() // (slice_ms * 1_000_000) + 1000
    return f"""[run]
run_number = 1
sources = 1
builders = 1
slice_ms = {slice_ms}
seconds = {count * slice_ms / 1000 if replay else 0.0}
policy = "direct"
builder_addrs = ["127.0.0.1:{free_port()}"]
writer_addr = "127.0.0.1:{free_port()}"
start_slice = {start}
[source]
ids = [0]
generator = "fixed"
fixed_bytes = {size + FRAME_HEADER}
replay_pool = {16 if replay else 0}
saturate = true
input_time_base = "run"
input_max_ahead_s = 100000
input_held_mb = {HELD_MB}
[builder]
max_active = 1000000
wall_timeout_ms = 60000
drain_timeout_ms = 60000
memory_budget_mb = 1024
[builder.filter]
name = "none"
[saver]
enabled = false
[writer]
out_dir = "{out}"
"""


def python_submit(cfg_path, size, count):
    """The Python producer, run as its own process (`--python-submit`)."""
    import numpy as np
    import shoal

    data = bytes(range(256)) * (size // 256) + bytes(size % 256) if size < 16_384 else (
        np.arange(size, dtype=np.uint64) * 7).astype(np.uint8)
    src = shoal.Source(str(cfg_path))
    first = src.first_slice
    submit = src.submit_slice
    t0 = time.perf_counter()
    for i in range(count):
        submit(0, first + i, data)
    t1 = time.perf_counter()
    report = src.close()
    t2 = time.perf_counter()
    print(json.dumps({"submit_s": t1 - t0, "close_s": t2 - t1, "report": report}))


def one_run(shoal, producer, size, count):
    with tempfile.TemporaryDirectory() as d:
        d = pathlib.Path(d)
        out = d / "out"
        out.mkdir()
        cfg = d / "run.toml"
        cfg.write_text(config(out, size, count, producer == "replay"))
        logs = {k: open(d / f"{k}.log", "w") for k in ("writer", "builder", "producer")}
        procs = [
            subprocess.Popen([shoal, "node", "--role", "writer", "--config", cfg], stdout=subprocess.DEVNULL, stderr=logs["writer"]),
            subprocess.Popen([shoal, "node", "--role", "builder", "--ids", "0", "--config", cfg], stdout=subprocess.DEVNULL, stderr=logs["builder"]),
        ]
        try:
            cmd = {
                "replay": [shoal, "node", "--role", "source", "--config", cfg],
                "rust-copy": [RUST_BENCH, cfg, "0", str(size), str(count), "copy"],
                "rust-lent": [RUST_BENCH, cfg, "0", str(size), str(count), "lent"],
                "c-copy": [C_BENCH, cfg, "0", str(size), str(count), "copy"],
                "c-lent": [C_BENCH, cfg, "0", str(size), str(count), "lent"],
                "python": [sys.executable, __file__, "--python-submit", cfg, str(size), str(count)],
            }[producer]
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=logs["producer"], text=True, timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"{producer} failed: {(d / 'producer.log').read_text()[-2000:]}")
            for q in procs:
                if q.wait(timeout=600) != 0:
                    raise RuntimeError(f"a node failed: {(d / 'builder.log').read_text()[-2000:]}")
        finally:
            for q in procs:
                if q.poll() is None:
                    q.kill()
                    q.wait()
        builder = json.loads((out / "run000001.builder0.json").read_text())
        if producer == "replay":
            source_report = out / "run000001.source0.json"
            submit_rate = None
        else:
            r = json.loads(p.stdout)
            source_report = d / "source.json"
            source_report.write_text(json.dumps(r["report"]))
            submit_rate = count / r["submit_s"]
        books = subprocess.run([shoal, "ledger", source_report, out / "run000001.builder0.json"],
                               capture_output=True, text=True, timeout=60)
        ledger = json.loads(books.stdout)["ledger"] if books.stdout else {}
        delivered = ledger.get("buckets", {}).get("delivered", 0)
        if books.returncode != 0 or delivered != count:
            raise RuntimeError(f"{producer} {size} B: ledger {ledger} ({books.stderr})")
        span = (builder["last_arrival_ns"] - builder["first_arrival_ns"]) * 1e-9
        return {"frag_s": builder["fragments"] / span, "mb_s": builder["bytes"] / span / 1e6, "submit_frag_s": submit_rate}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--python-submit":
        python_submit(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("shoal")
    ap.add_argument("out")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a tenth of the fragments, one repeat")
    ap.add_argument("--sizes", help="comma-separated fragment sizes (default: every case)")
    ap.add_argument("--producers", help="comma-separated producers (default: all; replay is always run)")
    a = ap.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    repeats = 1 if a.quick else a.repeats
    cases = [c for c in CASES if not a.sizes or str(c[0]) in a.sizes.split(",")]
    producers = PRODUCERS if not a.producers else ["replay"] + [p for p in a.producers.split(",") if p != "replay"]
    results = {}
    for size, count in cases:
        count = max(100, count // 10) if a.quick else count
        for _ in range(repeats):
            for producer in producers:
                r = one_run(a.shoal, producer, size, count)
                results.setdefault((size, producer), []).append(r)
                print(f"{size:>9} B {producer:>7}: {r['frag_s']:>10,.0f} frag/s {r['mb_s']:>8,.0f} MB/s"
                      + (f"  (submit loop {r['submit_frag_s']:,.0f}/s)" if r["submit_frag_s"] else ""),
                      file=sys.stderr)
    rows = []
    for size, _ in cases:
        base = statistics.median(r["frag_s"] for r in results[(size, "replay")])
        for producer in producers:
            rs = results[(size, producer)]
            med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
            sub = [r["submit_frag_s"] for r in rs if r["submit_frag_s"]]
            rows.append({
                "fragment_bytes": size, "producer": producer,
                "fragments_per_s": round(med("frag_s")), "mbytes_per_s": round(med("mb_s"), 1),
                "of_replay": round(med("frag_s") / base, 3),
                "submit_loop_fragments_per_s": round(statistics.median(sub)) if sub else "",
                "runs": len(rs),
            })
    with open(out / "bench_sdk.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = ["| fragment (B) | producer | fragments/s | MB/s | of replay | submit loop (fragments/s) |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        sub = f"{r['submit_loop_fragments_per_s']:,}" if r["submit_loop_fragments_per_s"] else "-"
        lines.append(f"| {r['fragment_bytes']:,} | {r['producer']} | {r['fragments_per_s']:,} | "
                     f"{r['mbytes_per_s']:,.0f} | {r['of_replay']:.2f} | {sub} |")
    (out / "bench_sdk.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
