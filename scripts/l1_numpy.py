#!/usr/bin/env python3
"""numpy baseline for L0 -> L1 (physics.md: "global sort + neighbour differences").

Same slice shapes as `cargo bench -p shoal-trigger` (crates/shoal-trigger/benches):
ANTARES 10-string (300 floors x 3 PMTs at 70 kHz, 10 ms) and ARCA-sized (450 DOMs x 31
PMTs at 7 kHz, 10 ms), Poisson hits with uniform times. The hits are given to numpy as
decoded arrays (module, channel, time), so its figure excludes payload decoding, which
shoal's includes. Prints the median of 7 runs, in M hits/s, as JSON lines.
"""

import json
import time

import numpy as np


def slice_hits(rng, modules, pmts, rate_hz, slice_s=0.01):
    n = rng.poisson(rate_hz * slice_s, size=modules * pmts)
    module = np.repeat(np.arange(modules * pmts) // pmts, n).astype(np.uint64)
    channel = np.repeat(np.arange(modules * pmts) % pmts, n).astype(np.uint8)
    t = rng.integers(0, int(slice_s * 1e9), size=int(n.sum()), dtype=np.uint64)
    return module, channel, t


def l1_numpy(module, channel, t, window, distinct_pmts):
    order = np.argsort((module << np.uint64(32)) | t, kind="stable")
    m, c, ts = module[order], channel[order], t[order].astype(np.int64)
    pair = (m[1:] == m[:-1]) & (np.diff(ts) <= window)
    if distinct_pmts:
        pair &= c[1:] != c[:-1]
    flags = np.zeros(len(ts), bool)
    flags[1:] |= pair
    flags[:-1] |= pair
    return flags


def bench(name, modules, pmts, rate, window, distinct):
    rng = np.random.default_rng(1)
    module, channel, t = slice_hits(rng, modules, pmts, rate)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        flags = l1_numpy(module, channel, t, window, distinct)
        times.append(time.perf_counter() - t0)
    med = float(np.median(times))
    print(json.dumps({"case": name, "hits": int(len(t)), "l1_fraction": float(flags.mean()), "median_s": med, "mhits_per_s": len(t) / med / 1e6}))


if __name__ == "__main__":
    bench("l1_antares_10_string", 300, 3, 70e3, 20, True)
    bench("l1_arca_sized", 450, 31, 7e3, 25, False)
