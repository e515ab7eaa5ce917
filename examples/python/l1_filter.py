"""The built-in `l1` filter in numpy, as a Python filter (docs/plugins.md, "Python filters").

    [builder.filter]
    python = "l1_filter:l1"                  # module:function
    python_path = "examples/python"
    workers = 2
    config = "coincidence_ns=20 min_sources=2 cluster_ns=2200 snapshot_ns=1000"

Local coincidences (two hits on different channels of one source within `coincidence_ns`),
then a multiplicity trigger (L1 hits on at least `min_sources` distinct sources within
`cluster_ns`); an event keeps every hit within `snapshot_ns` of its L1 hits, those marked
`triggered`. It selects the very events of the built-in `l1` on the same slices (a test
compares them).
"""
import numpy as np

from shoal.slices import event_hit_dtype

CFG = {"coincidence_ns": 20, "high_amplitude": 0, "min_sources": 2, "cluster_ns": 2200, "snapshot_ns": 1000}
EVENT_HIT = event_hit_dtype()


def init(config: str) -> None:
    """`key=value` pairs separated by spaces (the C example's syntax)."""
    for kv in config.split():
        key, _, value = kv.partition("=")
        if key not in CFG:
            raise ValueError(f"unknown parameter {key!r} (known: {', '.join(CFG)})")
        CFG[key] = int(value)
    if CFG["min_sources"] < 1:
        raise ValueError("min_sources must be at least 1")


def l1_mask(t: np.ndarray, ch: np.ndarray, amp: np.ndarray) -> np.ndarray:
    """Hits (sorted by time) with a partner on another channel within the window."""
    n = len(t)
    if n == 0:
        return np.zeros(0, dtype=bool)
    # Runs of equal channel in time order: the nearest hit on another channel is just
    # before the run's start or just after its end.
    boundary = np.flatnonzero(ch[1:] != ch[:-1]) + 1
    starts = np.concatenate(([0], boundary))
    ends = np.concatenate((boundary, [n]))
    run = np.repeat(np.arange(len(starts)), ends - starts)
    prev_other, next_other = starts[run] - 1, ends[run]
    c = CFG["coincidence_ns"]
    mask = np.zeros(n, dtype=bool)
    has_prev = prev_other >= 0
    mask[has_prev] |= t[has_prev] - t[prev_other[has_prev]] <= c
    has_next = next_other < n
    mask[has_next] |= t[next_other[has_next]] - t[has_next] <= c
    if CFG["high_amplitude"] > 0:
        mask |= amp >= CFG["high_amplitude"]
    return mask


def l1(s):
    frags = []  # per fragment: source, sorted hits, L1 mask
    l1_t, l1_frag, l1_idx = [], [], []
    for fi, f in enumerate(s.fragments):
        if f.flags & (1 << 10):  # OPAQUE: not hits
            continue
        h = s.hits(f)
        order = np.lexsort((h["amplitude"], h["channel"], h["time_ns"]))
        t, ch, amp = (h["time_ns"][order].astype(np.int64), h["channel"][order], h["amplitude"][order])
        m = l1_mask(t, ch, amp)
        idx = np.flatnonzero(m)
        frags.append((f.source, t, ch, amp))
        l1_t.append(t[idx])
        l1_frag.append(np.full(len(idx), len(frags) - 1))
        l1_idx.append(idx)
    if not frags:
        return []
    lt = np.concatenate(l1_t)
    lf = np.concatenate(l1_frag)
    li = np.concatenate(l1_idx)
    # The built-in sorts (time, fragment, index).
    order = np.lexsort((li, lf, lt))
    lt, lf, li = lt[order].tolist(), lf[order].tolist(), li[order].tolist()

    # Sliding window of `cluster_ns` from each L1 hit: distinct fragments within it.
    windows, per, distinct, end, n = [], {}, 0, 0, len(lt)
    cluster, need = CFG["cluster_ns"], CFG["min_sources"]
    for i in range(n):
        while end < n and lt[end] - lt[i] <= cluster:
            k = lf[end]
            per[k] = per.get(k, 0) + 1
            distinct += per[k] == 1
            end += 1
        if distinct >= need:
            j = end - 1
            if windows and i <= windows[-1][1]:
                windows[-1][1] = max(windows[-1][1], j)
            else:
                windows.append([i, j])
        k = lf[i]
        per[k] -= 1
        distinct -= per[k] == 0

    events = []
    snap = CFG["snapshot_ns"]
    for a, b in windows:
        t0, t1 = max(lt[a] - snap, 0), lt[b] + snap
        trig = {}
        for k in range(a, b + 1):
            trig.setdefault(lf[k], []).append(li[k])
        parts = []
        for fi, (source, t, ch, amp) in enumerate(frags):
            lo, hi = np.searchsorted(t, t0, "left"), np.searchsorted(t, t1, "right")
            if hi <= lo:
                continue
            e = np.zeros(hi - lo, dtype=EVENT_HIT)
            e["source"], e["time_ns"], e["channel"], e["amplitude"] = source, t[lo:hi], ch[lo:hi], amp[lo:hi]
            if fi in trig:
                marked = np.asarray(trig[fi])
                marked = marked[(marked >= lo) & (marked < hi)] - lo
                e["triggered"][marked] = 1
            parts.append(e)
        hits = np.concatenate(parts)
        hits = hits[np.lexsort((hits["channel"], hits["source"], hits["time_ns"]))]
        events.append((1, hits))
    return events
