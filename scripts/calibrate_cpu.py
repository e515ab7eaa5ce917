#!/usr/bin/env python3
"""Calibrates the simulator's host CPU model (topology.cpu_packet_us) from testbed runs.

For each `shoal validate --json` record in DIR (scripts/validation_table.py's output): the
CPU time the testbed machine spent during the run, (100 - idle) % of its cores over the
run's seconds of load, divided by the packets the simulator's hosts model had its nodes
take in over the same run (`packet_arrivals`: every host and switch a packet passed).
Prints each run's cost per packet and the median of the unstarved runs, the value to give
`shoal validate --cpu-cores N --cpu-packet-us X`.

Records of runs with the processes' run queue (`--cpu-wake-us W`) give, too, the time the
simulated processes waited for a core against the testbed's (`cpu_wait.total_s`, from
/proc/PID/schedstat): the W at which the median ratio is 1 is the one that matches.

    python3 scripts/calibrate_cpu.py docs/bench/validation --cores 2
"""
import argparse
import json
import pathlib
import statistics


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=pathlib.Path, help="validate --json records")
    ap.add_argument("--cores", type=int, default=2, help="the testbed machine's cores")
    a = ap.parse_args()
    costs = []
    waits = []
    for f in sorted(a.dir.glob("*.json")):
        try:
            r = json.loads(f.read_text())
            bed, sim = r["testbed"], r["simulator"]
            arrivals = sim["packet_arrivals"]
        except (KeyError, ValueError):
            continue
        if arrivals == 0:
            continue
        busy_s = (100.0 - bed["cpu_idle_pct"]) / 100.0 * a.cores * bed["seconds"]
        cost_us = busy_s / arrivals * 1e6
        starved = bed.get("starved", False)
        print(f"{f.stem:45} busy {busy_s:6.2f} core-s  packets {arrivals:9d}  {cost_us:6.2f} us/packet"
              + ("  (starved, left out)" if starved else ""))
        if not starved:
            costs.append(cost_us)
            # Records of a run with the run queue (--cpu-wake-us): the processes' wait.
            bed_wait = bed.get("cpu_wait", {}).get("total_s", 0.0)
            if sim.get("process_wakeups", 0) > 0 and bed_wait > 0:
                waits.append(sim["process_wait_s"] / bed_wait)
    if not costs:
        raise SystemExit("no record with packet_arrivals (records of a simulator before the CPU model?)")
    q = statistics.quantiles(costs, n=4) if len(costs) > 1 else [costs[0]] * 3
    print(f"\n{len(costs)} unstarved runs: median {statistics.median(costs):.2f} us per packet "
          f"(quartiles {q[0]:.2f} / {q[2]:.2f})")
    if waits:
        q = statistics.quantiles(waits, n=4) if len(waits) > 1 else [waits[0]] * 3
        print(f"processes' wait for a core, simulated / testbed: median {statistics.median(waits):.2f} "
              f"(quartiles {q[0]:.2f} / {q[2]:.2f}); 1 is the --cpu-wake-us that matches the testbed's")


if __name__ == "__main__":
    main()
