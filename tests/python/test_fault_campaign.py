"""The small fault campaign (issue 72): two faults of every kind, each in a run of its own,
injected into `shoal run` clusters under random policies (the network's loss, partition
and delay into `shoal testbed run`'s emulated network); the run's diagnosis must name the
injected cause for every lost slice, name every fault that should be seen, and leave a
fault-free run with nothing named. docs/monitoring.md has the full campaign's matrix.

Kinds that need root (a CPU hog at real-time priority, the writer's disk a tmpfs filled,
the testbed's namespaces) are skipped by the script when not root, and it says so."""

import json
import subprocess
import sys

from conftest import ROOT


def test_the_diagnosis_names_the_injected_cause(shoal_bin, tmp_path):
    out = tmp_path / "campaign.json"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "fault_campaign.py"),
            "--bin",
            str(shoal_bin),
            "--each",
            "2",
            "--seed",
            "72",
            "--clusters",
            "sector,testbed",
            "--max-duration",
            "3",
            "--fault-free",
            "0.3",
            "--check",
            "--json",
            str(out),
            "--keep",
            str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode == 0, f"{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    summary = json.loads(out.read_text())["summary"]
    # Something was injected and something was lost: the check is not vacuous.
    assert summary["faults"] >= 10 and summary["lost_slices"] > 0, summary
    assert summary["named_right"] == summary["lost_slices"], summary
    assert summary["fault_free_runs"] >= 1 and summary["fault_free_named"] == 0, summary
    print(r.stdout[-4000:])
