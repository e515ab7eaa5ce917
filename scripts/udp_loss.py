#!/usr/bin/env python3
"""UDP loss versus message size on the emulated network (issue 13; docs/benchmarks.md
"UDP loss versus message size").

The ATLAS QoS studies sent UDP from several sources to one receiver through a switch and
found loss wherever the sources' bursts overflowed the switch's output buffer; a token
bucket per destination removed it when its rate was low enough for the message size. Here
6 sources send to 1 builder through one switch (every link 200 Mbit/s, the most this
machine's veths carry reliably, with a 100-packet drop-tail buffer per port), one fragment
per source every 20 ms, fragments of 100 B to 60 kB (0.04 to 24 Mbit/s per source, at most
144 of the builder's 200 Mbit/s: the loss is the bursts', not an overload). Policies:
best-effort push (`direct`) and a token bucket per source at 10, 50 and 100 Mbit/s; each
with the datagram transport's NACKs (`udp_max_nacks = 4`, the default) and without
(`0`: best effort, every gap lost and counted). Each scenario runs in the simulator and on
the testbed (root; docs/testbed.md).

usage: scripts/udp_loss.py SHOAL_BINARY OUT_DIR [--sim-only]
Writes OUT_DIR/udp-loss.{csv,md}; stdlib only. Exit 1 if any ledger is unbalanced.
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from push_vs_pull import scenario_text, write_csv  # noqa: E402

SIZES = [100, 1000, 4000, 16000, 60000]
POLICIES = ["direct", "tbf:10Mbit", "tbf:50Mbit", "tbf:100Mbit"]
NACKS = [0, 4]
N_SOURCES, LINK_MBPS, SLICE_MS, LOAD_S = 6, 200.0, 20, 4.0


def scenario(policy, size, nacks):
    name = f"udp-6x1-{policy.replace(':', '')}-{size}-nack{nacks}"
    traffic = f'transport = "udp"\nudp_nack = true\nudp_max_nacks = {nacks}'
    return name, scenario_text(name, N_SOURCES, 1, LINK_MBPS, 10_000.0, policy, size, SLICE_MS, LOAD_S, 0.5, traffic)


def row(where, policy, size, nacks, produced, buckets, drops, unaccounted):
    got = lambda k: buckets.get(k, 0)  # noqa: E731
    complete = got("delivered") + got("recovered")
    return {
        "where": where, "policy": policy, "fragment_bytes": size, "max_nacks": nacks,
        "produced": produced, "delivered": got("delivered"), "recovered": got("recovered"),
        "damaged": got("damaged"), "lost_in_transport": got("lost_in_transport"),
        "dropped_at_source": got("dropped_at_source"), "unsent": got("unsent"),
        "switch_drops": drops,
        "fragment_loss_pct": 100.0 * (produced - complete) / produced if produced else 0.0,
        "unaccounted": unaccounted,
    }


def run(shoal, out, policy, size, nacks, testbed):
    name, text = scenario(policy, size, nacks)
    path = os.path.join(out, name + ".toml")
    with open(path, "w") as f:
        f.write(text)
    subprocess.run([shoal, "sim", path, "--out", out], check=True, capture_output=True)
    with open(os.path.join(out, name + ".summary.json")) as f:
        s = json.load(f)
    produced = sum(v for k, v in s["ledger"].items() if isinstance(v, int))
    rows = [row("sim", policy, size, nacks, produced, s["ledger"], s["queue_drops"], s["ledger_unaccounted"])]
    if testbed:
        tb_dir = os.path.join(out, name + ".testbed")
        r = subprocess.run([shoal, "testbed", "run", "--prefix", "udpl", "--json", "--dir", tb_dir, path],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{name}: shoal testbed run failed: {r.stderr[-2000:]}")
        t = json.loads(r.stdout)
        rows.append(row("testbed", policy, size, nacks, t["ledger"]["produced"], t["ledger"]["buckets"],
                        t["queue_drops"] + t["host_queue_drops"], t["ledger"]["unaccounted"]))
    return rows


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    testbed = "--sim-only" not in sys.argv
    shoal, out = args[0], args[1]
    os.makedirs(out, exist_ok=True)
    jobs = [(p, s, k) for p in POLICIES for s in SIZES for k in NACKS]
    rows = []
    for i, job in enumerate(jobs):
        rows += run(shoal, out, *job, testbed)
        print(f"{i + 1}/{len(jobs)} {job}", file=sys.stderr, flush=True)
    write_csv(rows, os.path.join(out, "udp-loss.csv"))
    with open(os.path.join(out, "udp-loss.md"), "w") as f:
        f.write("| policy | fragment B | NACKs | where | produced | delivered | recovered | damaged | lost in transport "
                "| dropped at source | unsent at end | switch drops (packets) | fragments lost (%) |\n")
        f.write("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
        for r in rows:
            f.write(f"| {r['policy']} | {r['fragment_bytes']} | {r['max_nacks']} | {r['where']} | {r['produced']} | "
                    f"{r['delivered']} | {r['recovered']} | {r['damaged']} | {r['lost_in_transport']} | "
                    f"{r['dropped_at_source']} | {r['unsent']} | {r['switch_drops']} | {r['fragment_loss_pct']:.2f} |\n")
    bad = [r for r in rows if r["unaccounted"] != 0]
    print(f"{len(rows)} rows; ledgers unbalanced: {len(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
