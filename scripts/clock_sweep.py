#!/usr/bin/env python3
"""Clock offsets between source hosts, from 0 to one slice: completeness and slice delay
for direct, delayed:8, a token bucket and pull, in the simulator at the full ANTARES shape
(300 x 100) and, side by side with the testbed (real processes, emulated network), at the
testbed's 15 x 5 incast shape. The tables and the plot of docs/clocks.md.

    python3 scripts/clock_sweep.py target/release/shoal docs/bench/clocks            # simulator only
    sudo python3 scripts/clock_sweep.py target/release/shoal docs/bench/clocks --testbed

Offsets are spread evenly over [-S/2, +S/2] across the sources (`[clocks]
offset_spread_us`), so S is the worst pair; the testbed gives each source process the
same offset (`--test-clock-offset-us`). Uncorrected unless marked: these tables measure
what a skew does. The last table has run control correct the clocks (`clocks.correct`).
"""
import argparse
import concurrent.futures
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Pull at the full shape needs its cap (docs/simulation-results.md: pull:8 alone collapses
# there with no clock offset at all); a token bucket cannot keep 300 sources off one
# builder at 10 ms slices and collapses at any offset: shown for completeness.
FULL_POLICIES = ["direct", "delayed:8", "tbf:5M:9000", "pull:8:cap=8"]
POLICIES = ["direct", "delayed:8", "tbf:5M:9000", "pull:8"]
FULL_SPREADS_US = [0, 100, 500, 1000, 2000, 5000, 10000]
INCAST_SPREADS_US = [0, 1000, 5000, 10000]


def scenario_text(base: pathlib.Path, policy: str, spread_us: float, slice_ms=None, load_s=None, correct=False):
    """The base scenario with its policy, clocks and (optionally) slice length replaced."""
    lines = []
    for line in base.read_text().splitlines():
        key = line.split("=")[0].strip()
        if key == "policy":
            line = f'policy = "{policy}"'
        elif key == "slice_ms" and slice_ms is not None:
            continue
        elif key in ("load_s",) and load_s is not None:
            line = f"load_s = {load_s}"
        elif key == "relax_s" and load_s is not None:
            line = "relax_s = 3.0"
        elif key == "name":
            tag = policy.replace(":", "").replace(".", "")
            line = f'name = "{base.stem}-{tag}-clocks{int(spread_us)}{"-corrected" if correct else ""}{"-" + str(slice_ms) + "ms" if slice_ms else ""}"'
        lines.append(line)
        if line.strip() == "[traffic]" and slice_ms is not None:
            lines.append(f"slice_ms = {float(slice_ms)}")
    lines += ["", "[clocks]", f"offset_spread_us = {float(spread_us)}", f"correct = {'true' if correct else 'false'}"]
    return "\n".join(lines) + "\n"


def simulate(shoal, text, work):
    path = pathlib.Path(tempfile.mkstemp(suffix=".toml", dir=work)[1])
    path.write_text(text)
    out = path.with_suffix("")
    subprocess.run([shoal, "sim", str(path), "--out", str(out)], check=True, capture_output=True)
    return json.loads(next(out.glob("*.summary.json")).read_text())


def testbed(shoal, text, work, seconds):
    path = pathlib.Path(tempfile.mkstemp(suffix=".toml", dir=work)[1])
    path.write_text(text)
    r = subprocess.run(
        [shoal, "validate", str(path), "--json", "--seconds", str(seconds), "--dir", str(path.with_suffix(".bed"))],
        capture_output=True,
        text=True,
    )
    if r.returncode not in (0, 2):
        sys.exit(f"shoal validate failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)


def pct(complete, incomplete):
    total = complete + incomplete
    return 100.0 * complete / total if total else 0.0


def verdict(s):
    total = s["slices_complete"] + s["slices_incomplete"]
    incomplete = s["slices_incomplete"] / total if total else 1.0
    if incomplete > 0.01 or s["network_delay_steady_p99_us"] >= 200_000:
        return "collapsed"
    if s["slices_incomplete"] > 0 or s["tcp_timeouts"] > 0:
        return "degraded"
    return "healthy"


def full_shape(args, jobs, full_base, work):
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as ex:
        futs = {
            ex.submit(simulate, args.shoal, scenario_text(full_base, p, s, load_s=10.0), work): (p, s) for p, s in jobs
        }
        full = {futs[f]: f.result() for f in concurrent.futures.as_completed(futs)}
    rows = []
    for p, s in jobs:
        r = full[(p, s)]
        rows.append(
            {
                "policy": p,
                "spread_us": s,
                "complete_pct": pct(r["slices_complete"], r["slices_incomplete"]),
                "slice_delay_avg_us": r["slice_delay_avg_us"],
                "slice_delay_p99_us": r["slice_delay_p99_us"],
                "network_delay_p99_us": r["network_delay_steady_p99_us"],
                "tcp_timeouts": r["tcp_timeouts"],
                "verdict": verdict(r),
            }
        )
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shoal")
    ap.add_argument("out_dir")
    ap.add_argument("--testbed", action="store_true", help="also run the testbed (root)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="testbed runs per point of the tolerance table")
    ap.add_argument(
        "--parts",
        default="full,incast,tolerance",
        help="what to run (full, incast, tolerance: the last two need --testbed); the others are read from OUT_DIR",
    )
    args = ap.parse_args()
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix="shoal-clocks-")
    full_base = ROOT / "scenarios" / "10-string-delayed8.toml"
    incast_base = ROOT / "scenarios" / "testbed" / "15x5-delayed8.toml"

    # 1. Full shape, simulator: 10 s of 10 ms slices per point.
    jobs = [(p, s) for p in FULL_POLICIES for s in FULL_SPREADS_US]
    if "full" not in args.parts:
        rows = json.loads((out / "full-shape.json").read_text())
    else:
        rows = full_shape(args, jobs, full_base, work)
        (out / "full-shape.json").write_text(json.dumps(rows, indent=1))

    # 2. The incast shape (15 x 5), simulator and testbed side by side (10 ms slices); 3.
    # 100 ms slices with 1 ms, uncorrected and corrected (tolerance_part).
    if "tolerance" in args.parts:
        tolerance_part(args, incast_base, work, out)
    if "incast" not in args.parts:
        incast = json.loads((out / "incast.json").read_text())
        write_tables(out, rows, incast)
        plot(out, rows)
        return
    points = [(p, s, None, False) for p in POLICIES for s in INCAST_SPREADS_US]
    incast = []
    for p, s, slice_ms, correct in points:
        text = scenario_text(incast_base, p, s, slice_ms=slice_ms, correct=correct)
        row = {"policy": p, "spread_us": s, "slice_ms": slice_ms or 10, "correct": correct}
        if not correct and not args.testbed:
            sim = simulate(args.shoal, text, work)
            row["sim"] = {
                "complete_pct": pct(sim["slices_complete"], sim["slices_incomplete"]),
                "slice_delay_avg_us": sim["slice_delay_avg_us"],
                "network_delay_p99_us": sim["network_delay_steady_p99_us"],
                "verdict": verdict(sim),
            }
        if args.testbed:
            v = testbed(args.shoal, text.replace("correct = true", "correct = false") if not correct else text, work, args.seconds)
            bed = v["testbed"]
            row["testbed"] = {
                "complete_pct": pct(bed["slices_complete"], bed["slices_incomplete"]),
                "network_delay_avg_us": bed["network_delay_steady_avg_us"],
                "network_delay_p99_us": bed["network_delay_steady_p99_us"],
                "lost": bed["ledger"]["produced"] - bed["ledger"]["buckets"].get("delivered", 0) - bed["ledger"]["buckets"].get("recovered", 0),
                "verdict": bed["verdict"],
                "starved": bed["starved"],
            }
            if not correct:
                # The simulator as `shoal validate` runs it beside the testbed: the hosts'
                # measured wake-up latency and Linux's loss recovery.
                hs = v["simulator"]
                row["sim_with_hosts"] = {
                    "complete_pct": pct(hs["slices_complete"], hs["slices_incomplete"]),
                    "slice_delay_avg_us": hs["slice_delay_avg_us"],
                    "network_delay_p99_us": hs["network_delay_steady_p99_us"],
                    "verdict": v["simulator_verdict"],
                    "agree": v["verdicts_agree"],
                }
        incast.append(row)
        print(json.dumps(row), file=sys.stderr)
    (out / "incast.json").write_text(json.dumps(incast, indent=1))
    write_tables(out, rows, incast)
    plot(out, rows)


def tolerance_part(args, incast_base, work, out):
    """100 ms slices, source hosts 1 ms apart, uncorrected and corrected, against one clock:
    `--repeats` testbed runs each (medians), the simulator once (it is deterministic)."""
    import statistics

    rows = []
    for p in POLICIES:
        for s, correct in ((0, False), (1000, False), (1000, True)):
            text = scenario_text(incast_base, p, s, slice_ms=100, correct=correct)
            runs = [testbed(args.shoal, text, work, args.seconds) for _ in range(args.repeats)]
            beds = [v["testbed"] for v in runs]
            lost = sum(b["ledger"]["produced"] - b["ledger"]["buckets"].get("delivered", 0) for b in beds)
            sim = None if correct else runs[0]["simulator"]
            row = {
                "policy": p,
                "spread_us": s,
                "correct": correct,
                "runs": len(beds),
                "incomplete": sum(b["slices_incomplete"] for b in beds),
                "lost": lost,
                "delay_avg_us_median": statistics.median(b["network_delay_steady_avg_us"] for b in beds),
                "delay_p99_us_median": statistics.median(b["network_delay_steady_p99_us"] for b in beds),
                "starved": sum(1 for b in beds if b["starved"]),
                "sim_slice_delay_avg_us": sim["slice_delay_avg_us"] if sim else None,
                "sim_network_delay_avg_us": sim["network_delay_steady_avg_us"] if sim else None,
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    (out / "tolerance.json").write_text(json.dumps(rows, indent=1))


def write_tables(out, rows, incast):
    md = ["### Full ANTARES shape (300 x 100, 10 ms slices), simulator", ""]
    md += ["| policy | offset spread | slices complete | slice delay avg | p99 | verdict |", "|---|---|---|---|---|---|"]
    for r in rows:
        # No complete slice, no slice delay.
        delays = (
            f"{r['slice_delay_avg_us'] / 1000:.2f} ms | {r['slice_delay_p99_us'] / 1000:.2f} ms"
            if r["complete_pct"] > 0
            else "- | -"
        )
        md.append(f"| {r['policy']} | {r['spread_us'] / 1000:g} ms | {r['complete_pct']:.1f} % | {delays} | {r['verdict']} |")
    md += ["", "### Incast shape (15 x 5), simulator and testbed", ""]
    md += [
        "| policy | slice | offset spread | corrected | sim complete | sim slice delay | sim delay p99 | sim verdict | testbed complete | testbed delay p99 | testbed lost | testbed verdict | agree |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in incast:
        bed, hosts = r.get("testbed"), r.get("sim_with_hosts")
        # Beside the testbed: the simulator as `shoal validate` ran it (the hosts' wake-up
        # latency); alone: the scenario as written (boards in lockstep).
        sim = hosts or r.get("sim")
        md.append(
            f"| {r['policy']} | {r['slice_ms']} ms | {r['spread_us'] / 1000:g} ms | {'yes' if r['correct'] else 'no'} | "
            + (
                f"{sim['complete_pct']:.1f} % | {sim['slice_delay_avg_us'] / 1000:.2f} ms | {sim['network_delay_p99_us'] / 1000:.2f} ms | {sim['verdict']} | "
                if sim
                else "- | - | - | - | "
            )
            + (
                f"{bed['complete_pct']:.1f} % | {bed['network_delay_p99_us'] / 1000:.2f} ms | {bed['lost']} | {bed['verdict']}{' (starved)' if bed['starved'] else ''} | "
                if bed
                else "- | - | - | - | "
            )
            + (f"{'yes' if hosts['agree'] else 'no'} |" if hosts else "- |")
        )
    tol = out / "tolerance.json"
    if tol.exists():
        md += ["", "### 100 ms slices, source hosts 1 ms apart (testbed medians; simulator)", ""]
        md += [
            "| policy | offset spread | corrected | testbed runs | incomplete slices | lost | network delay avg | p99 | sim slice delay |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in json.loads(tol.read_text()):
            sim = r["sim_slice_delay_avg_us"]
            md.append(
                f"| {r['policy']} | {r['spread_us'] / 1000:g} ms | {'yes' if r['correct'] else 'no'} | {r['runs']}"
                f"{' (' + str(r['starved']) + ' starved)' if r['starved'] else ''} | {r['incomplete']} | {r['lost']} | "
                f"{r['delay_avg_us_median'] / 1000:.2f} ms | {r['delay_p99_us_median'] / 1000:.2f} ms | "
                + (f"{sim / 1000:.2f} ms |" if sim is not None else "- |")
            )
    (out / "tables.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def plot(out, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for p in FULL_POLICIES:
        pts = [r for r in rows if r["policy"] == p]
        x = [max(r["spread_us"], 10) / 1000 for r in pts]
        a.plot(x, [r["complete_pct"] for r in pts], marker="o", label=p)
        b.plot(x, [r["slice_delay_avg_us"] / 1000 if r["complete_pct"] > 0 else float("nan") for r in pts], marker="o", label=p)
    for ax in (a, b):
        ax.set_xscale("log")
        ax.set_xlabel("offset spread between source hosts, ms (one slice = 10 ms)")
        ax.grid(True, alpha=0.3)
    a.set_ylabel("slices complete, %")
    b.set_ylabel("slice delay (slice end to last fragment), ms")
    b.set_yscale("log")
    a.legend()
    fig.suptitle("300 sources x 100 builders, simulator")
    fig.tight_layout()
    fig.savefig(out / "clocks.svg")


if __name__ == "__main__":
    main()
