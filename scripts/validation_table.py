#!/usr/bin/env python3
"""Runs `shoal validate --json` over scenarios and congestion controls and writes the
results (one JSON per run) and a markdown table for docs/validation.md.

    sudo python3 scripts/validation_table.py target/release/shoal docs/bench/validation \
        scenarios/testbed/*.toml --congestion reno cubic --seconds 5

--counts prints issue 33's goals counted over the runs as well, and

    python3 scripts/validation_table.py --count-records DIR

counts every record in DIR (the runs of several invocations at once).

With --testbed-records DIR the testbed is not run again: each run is compared with the
record of the same name in DIR (an earlier out_dir), so a change to the model (say
--wake-phase-us 0) is measured against the same testbed runs, without root.

    python3 scripts/validation_table.py target/release/shoal /tmp/phase0 scenarios/testbed/15x5-*.toml \
        --testbed-records docs/bench/validation --wake-phase-us 0

Needs root (the testbed) otherwise. Each run records the host's CPU idle, steal and the processes'
wait for a CPU; a starved run is marked, not left out, so the table shows it.
"""
import argparse
import json
import pathlib
import shlex
import subprocess
import sys
import tempfile

# Run records and logs of the last run (not kept).
WORK_DIR = tempfile.mkdtemp(prefix="shoal-validation-")


def stem(scenario, cc, loss_pct):
    name = pathlib.Path(scenario).stem
    return f"{name}-{cc}" + (f"-loss{loss_pct:g}" if loss_pct else "")


def run_one(shoal, scenario, cc, seconds, loss_pct, out_dir, records=None, model_args=()):
    name = stem(scenario, cc, loss_pct)
    out = out_dir / f"{name}.json"
    cmd = [shoal, "validate", scenario, "--congestion", cc, "--seconds", str(seconds), "--json",
           "--loss-pct", str(loss_pct), "--dir", WORK_DIR, *model_args]
    if records is not None:
        record = records / f"{name}.json"
        if not record.exists():
            return None
        cmd += ["--testbed-record", str(record)]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    if p.returncode not in (0, 2) or not p.stdout.strip():
        print(f"{name} {cc}: failed ({p.returncode}): {p.stderr.strip()[-500:]}", file=sys.stderr)
        return None
    out.write_text(p.stdout)
    return json.loads(p.stdout)


def fmt(v, digits=2):
    return f"{v:.{digits}f}"


def table(results):
    head = ("| scenario | TCP | slices complete (%) | net delay avg (ms) | p99 (ms) | send lag (ms) | "
            "switch drops | TCP timeouts | testbed retransmitted: needed / spurious (DSACK) | verdict | "
            "CPU idle / steal / worst wait |")
    rows = [head, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in results:
        by = {row["metric"]: row for row in r["rows"]}
        def cell(metric, digits=2):
            x = by[metric]
            mark = "" if x["agree"] else " **x**"
            return f"{fmt(x['simulator_lockstep'], digits)} / {fmt(x['simulator'], digits)} / {fmt(x['testbed'], digits)}{mark}"
        bed = r["testbed"]
        v = f"{r['simulator_lockstep_verdict']} / {r['simulator_verdict']} / {bed['verdict']}"
        v += " (agree)" if r["verdicts_agree"] else " **(differ)**"
        worst = bed["cpu_wait"]["worst_fraction"]
        cpu = (f"{bed['cpu_idle_pct']:.0f}% / {bed['cpu_steal_pct']:.1f}% / "
               f"{100 * worst:.0f}%" + (" **starved**" if starved(bed) else ""))
        loss = bed.get("loss_ppm", 0)
        name = r["scenario"] + (f", {loss / 1e4:g}% loss" if loss else "")
        tcp = bed["tcp"]
        spurious = min(tcp["dsacks_received"], tcp["retransmitted_segments"])
        retx = f"{tcp['retransmitted_segments'] - spurious} / {spurious}"
        rows.append(f"| {name} | {r['congestion']} | {cell('slices complete (%)', 1)} | "
                    f"{cell('net delay avg (ms)')} | {cell('net delay p99 (ms)', 1)} | {cell('send lag avg (ms)')} | "
                    f"{cell('switch drops', 0)} | {cell('TCP timeouts', 0)} | {retx} | {v} | {cpu} |")
    return "\n".join(rows) + "\n"


def starved(bed):
    # The rule of shoal_testbed::run (STARVED_WAIT_FRACTION), also for older files.
    worst = bed["cpu_wait"]["worst_fraction"]
    return bed["cpu_idle_pct"] < 5 or bed["cpu_steal_pct"] > 10 or worst >= 0.5


def within(sim, bed, factor):
    """Within `factor` either way (both zero agrees)."""
    lo, hi = sorted((sim, bed))
    return hi <= factor * lo if lo > 0 else hi == 0


def counts(results):
    """Issue 33's goals counted over the unstarved runs: the verdict; the average delay
    within 10 % and the p99 within 25 % where both sides say healthy; TCP timeouts and
    incomplete slices within 2x where either side has more than 5."""
    runs = [r for r in results if not starved(r["testbed"])]
    c = {k: [0, 0] for k in ("verdict", "timeouts agree", "avg 10%", "p99 25%", "timeouts 2x", "incomplete 2x")}

    def count(key, ok):
        c[key][0] += bool(ok)
        c[key][1] += 1

    for r in runs:
        by = {row["metric"]: row for row in r["rows"]}
        bed = r["testbed"]
        count("verdict", r["verdicts_agree"])
        count("timeouts agree", by["TCP timeouts"]["agree"])
        if r["simulator_verdict"] == "healthy" and bed["verdict"] == "healthy":
            avg, p99 = by["net delay avg (ms)"], by["net delay p99 (ms)"]
            count("avg 10%", abs(avg["simulator"] - avg["testbed"]) <= 0.10 * avg["testbed"])
            count("p99 25%", abs(p99["simulator"] - p99["testbed"]) <= 0.25 * p99["testbed"])
        to = by["TCP timeouts"]
        if max(to["simulator"], to["testbed"]) > 5:
            count("timeouts 2x", within(to["simulator"], to["testbed"], 2.0))
        inc = (r["simulator"]["slices_incomplete"], bed["slices_incomplete"])
        if max(inc) > 5:
            count("incomplete 2x", within(*inc, 2.0))
    head = f"| runs (unstarved) | {' | '.join(c)} |"
    line = f"| {len(runs)} of {len(results)} | " + " | ".join(f"{a} of {n}" for a, n in c.values()) + " |"
    return "\n".join([head, "| ---: |" + " ---: |" * len(c), line]) + "\n"


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--count-records":
        # Every record of a directory at once (the runs of several invocations).
        records = sorted(pathlib.Path(sys.argv[2]).glob("*.json"))
        print(counts([json.loads(f.read_text()) for f in records]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shoal")
    ap.add_argument("out_dir", type=pathlib.Path)
    ap.add_argument("scenarios", nargs="+")
    ap.add_argument("--congestion", nargs="+", default=["reno", "cubic"])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--loss-pct", type=float, nargs="+", default=[0.0],
                    help="random loss on every switch port toward a host, percent (one run per value)")
    ap.add_argument("--table-only", action="store_true", help="print the table from the JSON files")
    ap.add_argument("--testbed-records", type=pathlib.Path,
                    help="compare with the testbed runs recorded in this directory instead of running them")
    ap.add_argument("--wake-phase-us", type=float, help="the simulator's wake-up phase (shoal validate's default)")
    ap.add_argument("--tcp-model", choices=["linux", "rack", "newreno"], help="the simulator's TCP (shoal validate's default)")
    ap.add_argument("--validate-args", default="",
                    help="more of shoal validate's model options, e.g. \"--cpu-cores 2 --cpu-packet-us 6.75\"")
    ap.add_argument("--counts", action="store_true",
                    help="also print issue 33's goals counted over the runs (docs/validation.md)")
    a = ap.parse_args()
    a.out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for loss in a.loss_pct:
        for cc in a.congestion:
            for sc in a.scenarios:
                if a.table_only:
                    f = a.out_dir / f"{stem(sc, cc, loss)}.json"
                    r = json.loads(f.read_text()) if f.exists() else None
                else:
                    model = [] if a.wake_phase_us is None else ["--wake-phase-us", str(a.wake_phase_us)]
                    model += [] if a.tcp_model is None else ["--tcp-model", a.tcp_model]
                    model += shlex.split(a.validate_args)
                    r = run_one(a.shoal, sc, cc, a.seconds, loss, a.out_dir, a.testbed_records, model)
                    if r is None and a.testbed_records is not None:
                        continue
                    print(f"{stem(sc, cc, loss)}: done", file=sys.stderr, flush=True)
                if r:
                    results.append(r)
    print(table(results))
    if a.counts:
        print(counts(results))


if __name__ == "__main__":
    main()
