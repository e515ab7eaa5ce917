#!/usr/bin/env python3
"""The studies' push-versus-pull experiment in the simulator (docs/push-vs-pull.md).

Event rate and throughput versus fragment size (1 kB to 64 kB) for 1 source x 1 builder and
6 sources x 1 builder on 1 Gbit/s links: push (direct), push with a token bucket per source
at 20, 40 and 50 Mbit/s, and pull (8 credits) answered at once or through the same token
buckets. Every source offers 20% more than its bottleneck (the link share, or its token
bucket), so each run measures what the policy delivers under overload. Usage: scripts/push_vs_pull.py SHOAL_BINARY OUT_DIR
Writes OUT_DIR/push-vs-pull.{csv,md,svg}; stdlib only.

With --testbed (root; docs/testbed.md) the same experiment, scaled to what the runtime and
this machine can do, runs on the emulated network and in the simulator with the same
scenario files: 20 ms slices (the runtime takes whole milliseconds, so the slice cannot
shrink to microseconds as above), 4 s runs, fragments 1, 4, 16 and 64 kB. The links are
scaled instead of the slices: every link carries 1/1.2 of what the sources offer (direct
and unpaced pull), or the token bucket is 1/1.2 of a source's offer and every link is
25 times the bucket (the study's 40 Mbit/s on 1 Gbit/s; at most 200 Mbit/s, the most this
machine's veths carry reliably). Writes OUT_DIR/push-vs-pull-testbed.{csv,md}.
"""
import concurrent.futures as cf
import json
import os
import subprocess
import sys

SIZES = [1000, 2000, 4000, 8000, 16000, 32000, 64000]
CONFIGS = [(1, 1), (6, 1)]
RATES = [None, "20Mbit", "40Mbit", "50Mbit"]
POLICIES = ["direct" if r is None else f"tbf:{r}" for r in RATES] + [
    "pull:8" if r is None else f"pull:8:rate={r}" for r in RATES
]
LINK_BPS = 1e9
LOAD_S, RELAX_S = 0.5, 0.001


def token_rate(policy):
    """The policy's token-bucket rate in Mbit/s (`tbf:20Mbit`, `pull:8:rate=20Mbit`), or None."""
    parts = policy.split(":")
    if parts[0] == "tbf":
        return float(parts[1].removesuffix("Mbit"))
    rates = [float(p[5:].removesuffix("Mbit")) for p in parts if p.startswith("rate=")]
    return rates[0] if rates else None


def scenario_text(name, n, m, link_mbps, shore_mbps, policy, size, slice_ms, load_s, relax_s, traffic=""):
    """n sources x m builders behind one switch, every board and builder link at link_mbps;
    `traffic` holds more lines of its [traffic] table (it replaces `transport = "tcp"`)."""
    return f"""name = "{name}"
seed = 1
[topology]
sources = {n}
builders = {m}
boards_per_sector = {n}
board_mbps = {link_mbps:.4f}
board_delay_us = 5.0
shore_mbps = {shore_mbps:.4f}
shore_delay_us = 5.0
builder_mbps = {link_mbps:.4f}
builder_delay_us = 5.0
[traffic]
policy = "{policy}"
{traffic or 'transport = "tcp"'}
fragment_bytes = {size}
slice_ms = {slice_ms:.6f}
load_s = {load_s}
relax_s = {relax_s}
"""


def scenario(n, m, policy, size):
    share = LINK_BPS / n
    if token_rate(policy) is not None:
        share = min(share, token_rate(policy) * 1e6)
    offered = 1.2 * share / 8  # bytes per second per source
    slice_ms = size / offered * 1e3
    name = f"{n}x{m}-{policy.replace(':', '').replace('=', '')}-{size}"
    return name, scenario_text(name, n, m, LINK_BPS / 1e6, 10_000.0, policy, size, slice_ms, LOAD_S, RELAX_S)


def run(shoal, out, n, m, policy, size):
    name, text = scenario(n, m, policy, size)
    path = os.path.join(out, name + ".toml")
    with open(path, "w") as f:
        f.write(text)
    subprocess.run([shoal, "sim", path, "--out", out], check=True, capture_output=True)
    with open(os.path.join(out, name + ".summary.json")) as f:
        s = json.load(f)
    rate = s["slices_complete"] / LOAD_S
    return {
        "config": f"{n}x{m}", "policy": policy, "fragment_bytes": size,
        "event_rate_hz": rate,
        "throughput_mbps": rate * n * size * 8 / 1e6,
        "slices_complete": s["slices_complete"], "slices_produced": s["slices"],
        "tcp_timeouts": s["tcp_timeouts"], "queue_drops": s["queue_drops"],
        "dropped_at_source": s["ledger"].get("dropped_at_source", 0),
        "never_requested": s["ledger"].get("never_requested", 0),
        "unsent": s["ledger"].get("unsent", 0),
        "reasks": (s.get("pull") or {}).get("reasks", 0),
        "unaccounted": s["ledger_unaccounted"],
    }


def write_csv(rows, path):
    """rows (dicts with the same keys) as CSV, a header line first."""
    keys = list(rows[0].keys())
    with open(path, "w") as f:
        f.write(",".join(keys) + "\n")
        for r in rows:
            f.write(",".join(str(r[k]) for k in keys) + "\n")


def svg(rows, path):
    w, h, pad = 900, 450, 60
    panels = [c for c in (f"{n}x{m}" for n, m in CONFIGS)]
    # Colour by token rate (none, 20, 40, 50 Mbit/s); push solid, pull dashed.
    palette = dict(zip([None, 20.0, 40.0, 50.0], ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"]))
    colors = {p: palette[token_rate(p)] for p in POLICIES}
    dashes = {p: ' stroke-dasharray="6,3"' if p.startswith("pull") else "" for p in POLICIES}
    import math
    xs = [math.log2(s) for s in SIZES]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">']
    pw = (w - pad * 2) / len(panels)
    for k, cfg in enumerate(panels):
        x0 = pad + k * pw
        out.append(f'<text x="{x0 + pw / 2 - 60}" y="20">{cfg}: throughput (Mbit/s)</text>')
        out.append(f'<rect x="{x0}" y="30" width="{pw - 20}" height="{h - 90}" fill="none" stroke="#999"/>')
        for tick in (0, 250, 500, 750, 1000):
            y = 30 + (h - 90) * (1 - tick / 1000)
            out.append(f'<text x="{x0 - 30}" y="{y + 4}">{tick}</text>')
        for i, s in enumerate(SIZES):
            x = x0 + (pw - 20) * (xs[i] - xs[0]) / (xs[-1] - xs[0])
            out.append(f'<text x="{x - 10}" y="{h - 45}">{s // 1000}k</text>')
        for j, pol in enumerate(POLICIES):
            pts = []
            for r in rows:
                if r["config"] == cfg and r["policy"] == pol:
                    x = x0 + (pw - 20) * (math.log2(r["fragment_bytes"]) - xs[0]) / (xs[-1] - xs[0])
                    y = 30 + (h - 90) * (1 - min(r["throughput_mbps"], 1000) / 1000)
                    pts.append(f"{x:.1f},{y:.1f}")
            out.append(f'<polyline fill="none" stroke="{colors[pol]}" stroke-width="2"{dashes[pol]} points="{" ".join(pts)}"/>')
            if k == 0:
                x, y = pad + 10 + (j % 4) * 190, h - 14 + (j // 4) * 12
                out.append(f'<line x1="{x}" y1="{y - 4}" x2="{x + 20}" y2="{y - 4}" stroke="{colors[pol]}" stroke-width="2"{dashes[pol]}/>')
                out.append(f'<text x="{x + 24}" y="{y}" fill="{colors[pol]}">{pol}</text>')
    out.append(f'<text x="{w / 2 - 40}" y="{h - 30}">fragment size</text></svg>')
    with open(path, "w") as f:
        f.write("\n".join(out))


TB_SIZES = [1000, 4000, 16000, 64000]
# Scaled, the token-bucket variants differ only in the link rate (1000/R times the bucket,
# capped): one of them is run.
TB_POLICIES = ["direct", "tbf:40Mbit", "pull:8", "pull:8:rate=40Mbit"]
TB_SLICE_MS, TB_LOAD_S, TB_MAX_LINK_MBPS = 20, 4.0, 200.0


def testbed_scenario(n, m, policy, size):
    """The scaled scenario of one testbed run: (name, text, link Mbit/s, token Mbit/s)."""
    offered = size * 8 / (TB_SLICE_MS / 1e3) / 1e6  # Mbit/s per source
    study_rate = token_rate(policy)
    if study_rate is None:
        link, token = n * offered / 1.2, None
    else:
        token = offered / 1.2
        link = min(token * 1000 / study_rate, TB_MAX_LINK_MBPS)
    shaped = policy.replace(f"{study_rate:g}Mbit", f"{token:.4f}Mbit") if token else policy
    name = f"tb-{n}x{m}-{policy.replace(':', '').replace('=', '')}-{size}"
    text = scenario_text(name, n, m, link, max(link * n, 1.0), shaped, size, TB_SLICE_MS, TB_LOAD_S, 0.5)
    return name, text, link, token


def testbed_run(shoal, out, n, m, policy, size, prefix):
    name, text, link, token = testbed_scenario(n, m, policy, size)
    path = os.path.join(out, name + ".toml")
    with open(path, "w") as f:
        f.write(text)
    rows = []
    subprocess.run([shoal, "sim", path, "--out", out], check=True, capture_output=True)
    with open(os.path.join(out, name + ".summary.json")) as f:
        s = json.load(f)
    rows.append(("sim", s["slices_complete"], s["slices"], s["tcp_timeouts"], s["queue_drops"], s["ledger"],
                 (s.get("pull") or {}).get("reasks", 0), s["ledger_unaccounted"]))
    tb_dir = os.path.join(out, name + ".testbed")
    r = subprocess.run([shoal, "testbed", "run", "--prefix", prefix, "--json", "--dir", tb_dir, path],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{name}: shoal testbed run failed: {r.stderr[-2000:]}")
    t = json.loads(r.stdout)
    reasks = 0
    runs = os.path.join(tb_dir, "state", "runs")
    for rec in os.listdir(runs):
        with open(os.path.join(runs, rec)) as f:
            for rep in json.load(f)["reports"]:
                reasks += ((rep.get("detail") or {}).get("pull") or {}).get("reasks", 0)
    b = t["ledger"]["buckets"]
    rows.append(("testbed", t["slices_complete"], t["ledger"]["produced"] // n, t["tcp_timeouts"],
                 t["queue_drops"] + t["host_queue_drops"], b, reasks, t["ledger"]["unaccounted"]))
    result = []
    for where, complete, produced, timeouts, drops, ledger, reasks, unaccounted in rows:
        seconds = TB_LOAD_S
        result.append({
            "where": where, "config": f"{n}x{m}", "policy": policy, "fragment_bytes": size,
            "link_mbps": round(link, 3), "token_mbps": round(token, 4) if token else "",
            "event_rate_hz": complete / seconds, "throughput_mbps": complete / seconds * n * size * 8 / 1e6,
            "slices_complete": complete, "slices_produced": produced, "tcp_timeouts": timeouts,
            "queue_drops": drops, "dropped_at_source": ledger.get("dropped_at_source", 0),
            "never_requested": ledger.get("never_requested", 0), "unsent": ledger.get("unsent", 0),
            "reasks": reasks, "unaccounted": unaccounted,
        })
    return result


def testbed_main(shoal, out):
    jobs = [(n, m, p, s) for (n, m) in CONFIGS for p in TB_POLICIES for s in TB_SIZES]
    rows = []
    for i, job in enumerate(jobs):
        rows += testbed_run(shoal, out, *job, prefix="pvp")
        print(f"{i + 1}/{len(jobs)} {job}", file=sys.stderr, flush=True)
    write_csv(rows, os.path.join(out, "push-vs-pull-testbed.csv"))
    with open(os.path.join(out, "push-vs-pull-testbed.md"), "w") as f:
        f.write("| config | policy | fragment B | link Mbit/s | token Mbit/s | where | event rate (Hz) | throughput (Mbit/s) "
                "| complete / produced | TCP timeouts | drops | never requested | unsent at end | re-asks |\n")
        f.write("| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
        for r in rows:
            f.write(f"| {r['config']} | {r['policy']} | {r['fragment_bytes']} | {r['link_mbps']} | {r['token_mbps']} | "
                    f"{r['where']} | {r['event_rate_hz']:.1f} | {r['throughput_mbps']:.2f} | "
                    f"{r['slices_complete']} / {r['slices_produced']} | {r['tcp_timeouts']} | {r['queue_drops']} | "
                    f"{r['never_requested']} | {r['unsent']} | {r['reasks']} |\n")
    bad = [r for r in rows if r["unaccounted"] != 0]
    print(f"{len(rows)} rows; ledgers unbalanced: {len(bad)}")
    return 1 if bad else 0


def main():
    if "--testbed" in sys.argv:
        args = [a for a in sys.argv[1:] if a != "--testbed"]
        os.makedirs(args[1], exist_ok=True)
        return testbed_main(args[0], args[1])
    shoal, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    jobs = [(n, m, p, s) for (n, m) in CONFIGS for p in POLICIES for s in SIZES]
    with cf.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
        rows = list(ex.map(lambda j: run(shoal, out, *j), jobs))
    write_csv(rows, os.path.join(out, "push-vs-pull.csv"))
    with open(os.path.join(out, "push-vs-pull.md"), "w") as f:
        f.write("| config | policy | fragment B | event rate (Hz) | throughput (Mbit/s) | complete / produced | TCP timeouts | switch drops | dropped at source | never requested | unsent at end | re-asks |\n")
        f.write("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
        for r in rows:
            f.write(f"| {r['config']} | {r['policy']} | {r['fragment_bytes']} | {r['event_rate_hz']:.0f} | "
                    f"{r['throughput_mbps']:.0f} | {r['slices_complete']} / {r['slices_produced']} | {r['tcp_timeouts']} | "
                    f"{r['queue_drops']} | {r['dropped_at_source']} | {r['never_requested']} | {r['unsent']} | {r['reasks']} |\n")
    svg(rows, os.path.join(out, "push-vs-pull.svg"))
    bad = [r for r in rows if r["unaccounted"] != 0]
    print(f"{len(rows)} runs; ledgers unbalanced: {len(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
