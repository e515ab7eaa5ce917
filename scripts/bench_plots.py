#!/usr/bin/env python3
"""Plots for the benchmark sections whose scripts write tables only (issue 15: every part
has its table, plot and command in docs/benchmarks.md). Reads what those scripts committed
and writes PNGs beside it; measures nothing.

  - docs/bench/tbf-accuracy.csv   (scripts/tbf_accuracy.py)  -> tbf-accuracy.png
  - docs/bench/probe-switch.csv   (scripts/probe_switch.py)  -> probe-switch.png
  - docs/bench/cpu-profile.json   (scripts/cpu_profile.py)   -> cpu-profile.png
  - docs/benchmarks.md's table of the dispatcher against Redis and NATS
    (scripts/bench-pubsub.sh prints it as Markdown)          -> pubsub.png

usage: .venv/bin/python scripts/bench_plots.py [DOCS_DIR]   (default: docs)
"""
import csv
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save(fig, ax, path, title, legend=True):
    """The common finish of every plot: legend, title, layout, a 110-dpi png."""
    if legend:
        ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def tbf(bench):
    rows = list(csv.DictReader(open(os.path.join(bench, "tbf-accuracy.csv"))))
    fig, ax = plt.subplots(figsize=(7, 4))
    for topo, marker in (("1x1", "o"), ("3x1", "s")):
        mine = [r for r in rows if r["topology"] == topo]
        xs = [float(r["assigned_mbit"]) for r in mine]
        ax.plot(xs, [float(r["shoal_error_pct"]) for r in mine], marker + "-", label=f"shoal tbf, {topo}")
        tc = [(float(r["assigned_mbit"]), float(r["tc_error_pct"])) for r in mine if r["tc_error_pct"] not in ("", "None")]
        if tc:
            ax.plot(*zip(*tc), marker + "--", color="grey", label=f"Linux tc tbf, {topo}")
    ax.axhspan(-1, 1, color="C2", alpha=0.15, label="goal: within 1%")
    ax.set_xscale("log")
    ax.set_xlabel("assigned rate per source, Mbit/s")
    ax.set_ylabel("measured - assigned, %")
    ax.grid(True, which="both", alpha=0.3)
    save(fig, ax, os.path.join(bench, "tbf-accuracy.png"),
         "token bucket: rate error (saturated sources, loopback namespace, 2 cores)")


def probe(bench):
    rows = list(csv.DictReader(open(os.path.join(bench, "probe-switch.csv"))))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['configured']}\n{r['senders']} senders" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [float(r["error_pct_median"]) for r in rows], 0.4, label="median of runs")
    ax.bar([x + 0.2 for x in xs], [float(r["error_pct_worst"]) for r in rows], 0.4, label="worst run")
    ax.axhspan(-5, 5, color="C2", alpha=0.12, label="goal: within 5%")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("identified - configured size, %")
    ax.set_ylim(-6, 6)
    ax.grid(True, axis="y", alpha=0.3)
    save(fig, ax, os.path.join(bench, "probe-switch.png"),
         "shoal probe-switch: buffer size found per configured port queue")


def cpu(bench):
    p = json.load(open(os.path.join(bench, "cpu-profile.json")))
    stages = p["stages"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [s["stage"] for s in stages]
    ax.barh(names, [s["core_s_per_gb"] for s in stages], color="C0")
    for i, s in enumerate(stages):
        ax.text(s["core_s_per_gb"], i, f" {s['share_pct']:.0f}%", va="center", fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("core-seconds per GB delivered")
    ax.grid(True, axis="x", alpha=0.3)
    save(fig, ax, os.path.join(bench, "cpu-profile.png"),
         f"full-shape run: CPU per stage ({p.get('mbytes_per_s', 0):.0f} MB/s, perf samples)", legend=False)


def pubsub(docs):
    text = open(os.path.join(docs, "benchmarks.md")).read()
    section = text[text.index("## Dispatcher versus Redis and NATS"):]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            rows.append(cells)
        elif rows and not line.startswith("|"):
            break
    fig, ax = plt.subplots(figsize=(8, 3.8))
    xs = range(len(rows))
    for k, (name, col) in enumerate((("shoal", 2), ("Redis", 3), ("NATS", 4))):
        ax.bar([x + (k - 1) * 0.27 for x in xs], [float(r[col]) for r in rows], 0.27, label=name)
    ax.set_xticks(list(xs), [f"{r[0]} sub\n{int(r[1]):,} B" for r in rows], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("messages published per s")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    save(fig, ax, os.path.join(docs, "bench", "pubsub.png"),
         "one publisher, N subscribers: shoal dispatcher, Redis, NATS (median of 3)")


def main():
    docs = sys.argv[1] if len(sys.argv) > 1 else "docs"
    bench = os.path.join(docs, "bench")
    tbf(bench)
    probe(bench)
    cpu(bench)
    pubsub(docs)
    print("wrote", ", ".join(f"{bench}/{n}.png" for n in ("tbf-accuracy", "probe-switch", "cpu-profile", "pubsub")))


if __name__ == "__main__":
    main()
