#!/usr/bin/env python3
"""Instructions per fragment, by stage, from callgrind (issue 32's cost report in counts).

This VM exposes no hardware counters, so `perf stat` cannot count instructions
(scripts/cost.py counts system calls, wake-ups and page faults instead). Valgrind's
callgrind can: it runs the program on its own virtual CPU and counts every user-space
instruction it executes, whatever else the machine is doing. A saturated `shoal demo` of
a fixed number of fragments (SOURCES sources, BUILDERS builders, FRAGMENT-byte fragments,
policy `direct`, no filter, no saver; scripts/saturated_demo.py) runs twice under
callgrind, with SLICES and 3 x SLICES slices; the difference between the two runs,
divided by the difference in fragments, is the cost of one more fragment with the start
and the end of the run (loading, the summary, the histograms' reports) taken out.

  scripts/cost_instructions.py target/release/shoal                 # 4 x 2, 4,000 B, 500 slices
  scripts/cost_instructions.py BEFORE/shoal AFTER/shoal             # side by side
  scripts/cost_instructions.py target/release/shoal --fragment 64000 --json
  scripts/cost_instructions.py target/release/shoal --top 40        # and the costliest functions

Prints instructions per fragment in all and per stage: the self cost of each function,
grouped by what it belongs to (the source's node and link, the builder's reader and
assembler, the frame code, CRC32C, copies, the allocator, tokio, the delay histograms, the
rest). Repeatable to a fraction of a percent run to run (docs/bench/history.md "Instructions
per fragment"). What it does not count: the kernel (system calls, the socket copies), and
time: a cache miss is one instruction here. Valgrind runs the process's threads one at a
time and reports a CPU without AVX-512, so CRC32C runs its SSE path under it; compare
binaries with each other under callgrind, not with perf's figures.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import saturated_demo  # noqa: E402

# (stage, substrings of "file:function [object]" that put a function in it), first match wins.
STAGES = [
    ("CRC32C", ["crc_fast::", "crc32c::"]),  # crc_fast since 2026-11-27, the crc32c crate before
    ("copies and fills (libc)", ["memmove", "memcpy", "memset", "memcmp"]),
    ("allocator (mimalloc)", ["mimalloc", "mi_free", "_mi_", "mi_theap"]),
    ("frame encode and decode", ["shoal_core::frame::"]),
    ("source: node, generator, link", ["shoal_core::node::source", "shoal_net::source", "shoal_net::link",
                                       "shoal_detector::", "shoal_core::shaping"]),
    ("builder: reader, hold, assembly", ["shoal_core::node::builder", "shoal_core::assembly", "shoal_net::builder",
                                         "shoal_net::hold", "shoal_net::framed"]),
    ("writer", ["shoal_net::writer", "shoal_core::node::writer", "shoal_core::event"]),
    ("delay histograms", ["hdrhistogram::", "shoal_core::loghist"]),
    ("tokio", ["tokio::", "tokio_util::"]),
    ("bytes", ["bytes::"]),
]
LINE = re.compile(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.+)$")


def stage_of(where):
    for stage, keys in STAGES:
        if any(k in where for k in keys):
            return stage
    return "the rest (std, libc, other crates)"


def callgrind(shoal, cfg_text):
    """(instructions by stage, fragments delivered) of one run under callgrind."""
    with tempfile.TemporaryDirectory(prefix="costinstr") as d:
        path, out = os.path.join(d, "cfg.toml"), os.path.join(d, "callgrind.out")
        with open(path, "w") as f:
            f.write(cfg_text)
        run = subprocess.run(["valgrind", "--tool=callgrind", "-q", f"--callgrind-out-file={out}", shoal, "demo",
                              "--config", path, "--out", os.path.join(d, "out"), "--json"],
                             capture_output=True, text=True, timeout=1800)
        if run.returncode != 0:
            raise RuntimeError(f"shoal demo under callgrind failed ({run.returncode}): {run.stderr[-2000:]}")
        summary = json.loads(run.stdout)
        if not saturated_demo.accounted(summary):
            raise RuntimeError("a run under callgrind lost a fragment or left a slice incomplete")
        # Every function (not only the top 99 %), and no annotated source after them.
        text = subprocess.run(["callgrind_annotate", "--threshold=100", "--auto=no", out],
                              capture_output=True, text=True, check=True).stdout
    by_stage, by_function = {}, {}
    for line in text.splitlines():
        m = LINE.match(line)
        if not m or "PROGRAM TOTALS" in m.group(2):
            continue
        count = int(m.group(1).replace(",", ""))
        stage = stage_of(m.group(2))
        by_stage[stage] = by_stage.get(stage, 0) + count
        # callgrind_annotate gives one line per (source file, function): the code inlined
        # from other files comes apart. Summed by the function's name.
        function = re.sub(r" \[[^\]]*\]$", "", m.group(2)).split(":", 1)[-1]
        by_function[function] = by_function.get(function, 0) + count
    return by_stage, by_function, summary["ledger"]["buckets"]["delivered"]


def per_fragment(shoal, args):
    """Instructions per added fragment, by stage, from runs of SLICES and 3 x SLICES slices."""
    runs = []
    for slices in (args.slices, 3 * args.slices):
        cfg = saturated_demo.config(args.sources, args.builders, args.fragment, slices, "direct",
                                    builder_budget_mb=256)
        runs.append(callgrind(shoal, cfg))
    (small, small_fn, n_small), (large, large_fn, n_large) = runs
    fragments = n_large - n_small

    def added(a, b):
        """Per added fragment, largest first."""
        keys = sorted(set(a) | set(b), key=lambda k: -(b.get(k, 0) - a.get(k, 0)))
        return {k: (b.get(k, 0) - a.get(k, 0)) / fragments for k in keys}

    per = added(small, large)
    functions = dict(list(added(small_fn, large_fn).items())[:args.top])
    return {"binary": shoal, "fragments": [n_small, n_large], "total": sum(per.values()), "stages": per,
            "functions": functions}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shoal", nargs="+", help="one binary, or several to set side by side")
    p.add_argument("--sources", type=int, default=4)
    p.add_argument("--builders", type=int, default=2)
    p.add_argument("--fragment", type=int, default=4000)
    p.add_argument("--slices", type=int, default=500)
    p.add_argument("--top", type=int, default=0, help="also list the N functions that cost most per fragment")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    results = [per_fragment(os.path.abspath(s), args) for s in args.shoal]
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"instructions per fragment (callgrind), {args.sources} x {args.builders}, {args.fragment}-byte "
          f"fragments, `direct`, saturated; runs of {args.slices} and {3 * args.slices} slices\n")
    names = [os.path.relpath(r["binary"]) for r in results]
    print("| stage | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(results))
    stages = []
    for r in results:
        stages += [s for s in r["stages"] if s not in stages]
    for s in stages:
        print(f"| {s} | " + " | ".join(f"{r['stages'].get(s, 0):,.0f}" for r in results) + " |")
    print("| **all** | " + " | ".join(f"**{r['total']:,.0f}**" for r in results) + " |")
    for r, name in zip(results, names):
        if r["functions"]:
            print(f"\n{name}: the {len(r['functions'])} functions that cost most per fragment (self)\n")
            print("| instructions | function |\n| ---: | --- |")
            for f, n in r["functions"].items():
                print(f"| {n:,.0f} | `{f}` |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
