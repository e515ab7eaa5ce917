#!/usr/bin/env python3
"""What the bulk path's security costs (docs/benchmarks.md, "Security"): the full ANTARES
shape (`shoal demo --sources 300 --builders 100 --policy delayed:8`, the replay pool, the
`muon` filter and the burst saver, as scripts/demo_ab.py's "pool" row) with
`[security] data = "off"`, `"authenticated"` and `"tls"`, in turn, round by round (the
first mode of each round moves along), beside rustls' own AES-GCM rate on one core
(`tls-bench aead`) and the 10,000 handshakes timed (`tls-bench handshakes`).

Prints, per mode, the median MB/s and its range, the runs that kept every slice, and the
median CPU seconds per GB delivered; the limits; the ratios to `off`. Exit 1 if a ledger
does not balance or a run fails.

With `--transport udp` the same over the datagram transport, `off` against `authenticated`
(every datagram then sealed with AES-256-GCM under the run's key), in turn.

usage: scripts/security_cost.py [--bin target/release/shoal] [--rounds 3] [--seconds 5] [--saturate]
                                [--transport udp]
"""
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_ab import ROWS, arg, demo  # noqa: E402

MODES = ["off", "authenticated", "tls"]


def main():
    binary = os.path.abspath(arg("--bin", "target/release/shoal"))
    bench = os.path.join(os.path.dirname(binary), "tls-bench")
    rounds = int(arg("--rounds", "3"))
    seconds = float(arg("--seconds", "5"))
    base = ROWS["pool"]
    udp = arg("--transport", "tcp") == "udp"
    modes = MODES[:2] if udp else MODES
    if udp:
        base = base.replace("[run]\n", '[run]\ntransport = "udp"\n')
    if "--saturate" in sys.argv:
        base = base.replace("[source]\n", "[source]\nsaturate = true\n")
    tmp = tempfile.mkdtemp(prefix="security-cost-")
    configs = {}
    for m in modes:
        configs[m] = os.path.join(tmp, f"{m}.toml")
        with open(configs[m], "w") as f:
            f.write(base + f'[security]\ndata = "{m}"\n')
    got = {m: [] for m in modes}
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for m in order:
            out = os.path.join(tmp, f"out-{m}-{r}")
            os.makedirs(out)
            s, cpu = demo(binary, configs[m], seconds, out)
            if s["ledger"]["unaccounted"] != 0 or not s["ledger"]["balanced"]:
                print(f"ledger unbalanced: {m} round {r}")
                return 1
            gb = s["bytes_received"] / 1e9
            data_cpu = s.get("cpu_s_from_first_slice") or float("nan")
            got[m].append((s["mbytes_per_s"], s["slices_incomplete"] == 0, cpu / gb if gb > 0 else float("nan"),
                           data_cpu / gb if gb > 0 else float("nan")))
            print(f"round {r + 1} {m}: {s['mbytes_per_s']:.0f} MB/s, every slice {s['slices_incomplete'] == 0}, "
                  f"{cpu:.1f} CPU-s", file=sys.stderr)
    limits = []
    for cmd in [] if udp else (["aead", "--mb", "2048"], ["handshakes", "--count", "10000", "--mode", "authenticated"],
                ["handshakes", "--count", "10000", "--mode", "tls"]):
        r = subprocess.run([bench, *cmd], capture_output=True, text=True)
        limits.append(r.stdout.strip() or r.stderr.strip())
    print("\n".join(limits))
    print()
    print("| data | MB/s, median (range) | runs with every slice | CPU-s per GB, whole process | "
          "CPU-s per GB from the first slice | MB/s / off | CPU per GB from the first slice / off |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    med = {m: [statistics.median(x[k] for x in got[m]) for k in (0, 2, 3)] for m in modes}
    for m in modes:
        runs = got[m]
        mb = [x[0] for x in runs]
        per_gb = [x[2] for x in runs]
        data = [x[3] for x in runs]
        print(f"| {m} | {med[m][0]:.0f} ({min(mb):.0f}-{max(mb):.0f}) | {sum(x[1] for x in runs)} of {len(runs)} | "
              f"{med[m][1]:.2f} ({min(per_gb):.2f}-{max(per_gb):.2f}) | {med[m][2]:.2f} ({min(data):.2f}-{max(data):.2f}) | "
              f"{med[m][0] / med['off'][0]:.3f} | {med[m][2] / med['off'][2]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
