"""Python filters in worker processes (docs/plugins.md, "Python filters").

The numpy `l1` of examples/python/l1_filter.py filters a run in two worker processes per
builder (that it selects the built-in `l1`'s very events on the same slices is
crates/shoal-shm/tests/pyfilter.rs). Then a filter that raises on some slices, kills its own
process with SIGSEGV once and hangs once: the run goes on, each slice is counted
(`filter_failed`, `filter_timeout`), its fragments are kept whole in the slices file, the
summary says so, and the ledger balances."""
import json
import os
import pathlib
import subprocess
import sys

import pyarrow.parquet as pq

ROOT = pathlib.Path(__file__).resolve().parents[2]


def demo(shoal_bin, tmp_path, filter_toml: str, seconds: float = 2.0):
    cfg = tmp_path / "shoal.toml"
    cfg.write_text(
        f"[run]\nsources = 5\nbuilders = 2\nseconds = {seconds}\n[source.physics]\nmuon_rate_hz = 200.0\n"
        f"[builder.filter]\npython_exe = \"{sys.executable}\"\n" + filter_toml
    )
    return subprocess.run(
        [str(shoal_bin), "demo", "--config", str(cfg), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600,
    )


def summary(tmp_path) -> dict:
    return json.loads(next((tmp_path / "out").glob("run*.summary.json")).read_text())


def test_the_numpy_l1_filters_a_run_in_worker_processes(shoal_bin, tmp_path):
    r = demo(shoal_bin, tmp_path, f'python = "l1_filter:l1"\npython_path = "{ROOT / "examples" / "python"}"\nworkers = 2\n'
             'config = "coincidence_ns=20 min_sources=2 cluster_ns=2200 snapshot_ns=1000"\n')
    assert r.returncode == 0, r.stderr[-3000:]
    s = summary(tmp_path)
    assert s["ledger"]["balanced"]
    assert s["events"] > 0 and s["writer"]["file"]["events"] == s["events"]
    for b in s["builder_reports"]:
        w = b["filter_workers"]
        assert w["workers"] == 2 and w["slices"] > 0
        assert (w["failed"], w["crashed"], w["timed_out"], w["malformed_events"], w["restarts"]) == (0, 0, 0, 0, 0), w
        assert (b["filter_failed"], b["filter_timeout"], b["slices_not_filtered"]) == (0, 0, 0), b
    assert "warning: the filter failed" not in r.stdout


FAULTY = r'''
import os, signal, time
import numpy as np
from shoal.slices import event_hit_dtype

MARKS = None

def init(config):
    global MARKS
    MARKS = config

def once(name):
    """True the first time in the whole run (across worker processes and restarts)."""
    try:
        os.close(os.open(os.path.join(MARKS, name), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False

def faulty(s):
    if s.slice % 5 == 0:
        raise ValueError(f"slice {s.slice}: not today")
    if s.slice % 7 == 3 and once("segv"):
        os.kill(os.getpid(), signal.SIGSEGV)
    if s.slice % 7 == 4 and once("hang"):
        time.sleep(3600)
    e = np.zeros(1, dtype=event_hit_dtype())
    e["source"] = s.fragments[0].source
    return [e]
'''


def test_a_filter_that_raises_crashes_and_hangs_costs_only_its_slices(shoal_bin, tmp_path):
    (tmp_path / "faulty_filter.py").write_text(FAULTY)
    marks = tmp_path / "marks"
    marks.mkdir()
    r = demo(shoal_bin, tmp_path, f'python = "faulty_filter:faulty"\npython_path = "{tmp_path}"\nworkers = 2\n'
             f'timeout_ms = 3000\nconfig = "{marks}"\n')
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(marks)) == ["hang", "segv"], "both faults happened"
    s = summary(tmp_path)
    assert s["ledger"]["balanced"] and s["ledger"]["unaccounted"] == 0
    reports = s["builder_reports"]
    failed = sum(b["filter_failed"] for b in reports)
    timeout = sum(b["filter_timeout"] for b in reports)
    workers = [b["filter_workers"] for b in reports]
    assert timeout == 1 and sum(w["timed_out"] for w in workers) == 1
    assert sum(w["crashed"] for w in workers) == 1
    assert sum(w["restarts"] for w in workers) == 2, "a new worker for the dead one and the killed one"
    raised = sum(w["failed"] for w in workers)
    assert raised > 0 and failed == raised + 1  # + the crash
    # Every other slice got its event.
    processed = sum(w["slices"] for w in workers)
    assert s["events"] == processed - failed - timeout
    assert f"the filter failed on {failed} slices and passed its deadline on {timeout}" in r.stdout
    # The failed slices' fragments are kept whole.
    kept = pq.read_table(next((tmp_path / "out").glob("run*.slices.parquet")), columns=["slice"]).column("slice").to_pylist()
    assert len(set(kept)) == failed + timeout
    assert all(x % 5 == 0 or x % 7 in (3, 4) for x in set(kept))
