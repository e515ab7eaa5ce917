#!/usr/bin/env python3
"""A fault campaign with ground truth (docs/monitoring.md, "Is the diagnosis right?").

Runs `shoal run` clusters (the ANTARES sector, 5 sources x 3 builders, and a larger one,
10 x 5) under every policy, injects faults drawn at random from a list at random times
with random durations (0.2 s to 10 s, log-uniform), sometimes two at once, and compares
each run's diagnosis (its run record) with what was injected:

  stop     SIGSTOP, SIGCONT after the duration   expected: process_hung on it
  kill     SIGKILL (run control restarts it)      expected: process_down on it
  hog      the process pinned to one core and a   expected: process_hung on it
           SCHED_FIFO busy loop on that core
  disk     the writer's disk (a tmpfs) filled     expected: storage_failing on the writer
  filter   the builders' filter slower than the   expected: filter_behind on a builder
           load for the whole run
  garbage  random bytes to a builder's data port  expected: connections_refused on it
  clock    a source's clock 50 ms ahead           expected: clock_skew on it
  twin     a source started by hand with another  expected: config_mismatch on it
           one's ids (that one's data twice, its
           own never)
  burst    the sources in bursts over the rate    expected: source_cut_off on a source
           cutoff (nothing lost: the data is)

of each role (source, builder, writer, the data-flow manager under pull, the dispatcher),
and on the emulated network (`--clusters testbed`: `shoal testbed run`, 6 x 3, every
process in a namespace of its own behind a switch; docs/testbed.md), on the switch port of
a source, a builder or the writer:

  loss       random loss both ways, 2-30 %        expected: network_path on the host
  partition  the port down, up after the duration                or on a sender whose
  delay      the port's packets held 20-200 ms                    links cross that port
             (a delay line on a netfilter queue)

`hog`, `disk` and the testbed need root (skipped otherwise, said). Runs without a fault (`--fault-free
MINUTES`) count what the diagnosis names with nothing injected.

A lost slice is named right when its primary cause is an injected fault's rule on that
fault's process. The result: the confusion matrices (injected cause by named cause, in
lost slices and in faults), the rules reached, the accuracy, as Markdown (`--markdown F`)
and JSON (`--json F`). With `--check`, exit 1 when any lost slice is named other than
its injected cause, a fault that should be named is not, or a fault-free run names a
cause: `make test` runs a small campaign that way (tests/python/test_fault_campaign.py).

usage: scripts/fault_campaign.py [--bin target/release/shoal] [--faults 200 | --each N] [--seed 1]
           [--fault-free MINUTES] [--kinds stop,kill,...] [--policies direct,...]
           [--clusters sector,large,testbed] [--max-duration 10] [--check] [--json F] [--markdown F]
           [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "python"))
from shoal_cluster import cluster_toml  # noqa: E402

KINDS = ["stop", "kill", "hog", "disk", "filter", "garbage", "clock", "twin", "burst", "loss", "partition", "delay"]
# Kinds on the emulated network's switch ports, drawn for the testbed cluster only (and
# only they are: its processes run in namespaces, out of the reach of the others).
NETWORK_KINDS = {"loss", "partition", "delay"}
EXPECTED = {
    "stop": "process_hung",
    "kill": "process_down",
    "hog": "process_hung",
    "disk": "storage_failing",
    "filter": "filter_behind",
    "garbage": "connections_refused",
    "clock": "clock_skew",
    "twin": "config_mismatch",
    "burst": "source_cut_off",
    "loss": "network_path",
    "partition": "network_path",
    "delay": "network_path",
}
# Which roles a kind is injected on.
TARGETS = {
    "stop": ["source", "builder", "writer", "dfm", "dispatcher"],
    "kill": ["source", "builder", "writer", "dfm", "dispatcher"],
    "hog": ["source", "builder", "writer", "dfm"],
    "disk": ["writer"],
    "filter": ["builder"],
    "garbage": ["builder"],
    "clock": ["source"],
    "twin": ["source"],
    "burst": ["source"],
    "loss": ["source", "builder", "writer"],
    "partition": ["source", "builder", "writer"],
    "delay": ["source", "builder", "writer"],
}
# Kinds that act for the whole run (set in the cluster file), not at a time.
WHOLE_RUN = {"filter", "clock", "twin", "burst"}
POLICIES = ["direct", "delayed:2", "tbf:40M", "pull:8:cap=16"]
CLUSTERS = {"sector": (5, 3), "large": (10, 5), "testbed": (6, 3)}
# The testbed's sector switches hold this many sources each (docs/testbed.md).
BOARDS_PER_SECTOR = 3
SLICE_MS = 10
CLOCK_AHEAD_US = 50_000.0


def is_root() -> bool:
    return os.geteuid() == 0


def cluster_file(name, sources, builders, policy, state, faults) -> str:
    clock_of = {f["target"] for f in faults if f["kind"] == "clock"}
    twins = {f["target"] for f in faults if f["kind"] == "twin"}

    def process_lines(process):
        # A source whose clock is ahead; a source the campaign starts itself (run_one),
        # with another source's ids.
        return ([f"test_clock_offset_us = {CLOCK_AHEAD_US}"] if process in clock_of else []) + (
            ['launch = "external"'] if process in twins else []
        )

    source_lines = ()
    if any(f["kind"] == "burst" for f in faults):
        # Bioluminescence bursts most of the time over the cutoff: the fault matrix's row.
        source_lines = ('generator = "bursts"', "cutoff = true", "cutoff_head = 2", "cutoff_tail = 2",
                        "[config.source.bursts]", "fraction = 0.9", "max_s = 3.0", "base_bytes = 2000",
                        "burst_bytes = 20000")
    builder_lines = ()
    if any(f["kind"] == "filter" for f in faults):
        # Twice the time a builder has per slice (it gets one every SLICE_MS * builders).
        builder_lines = (f"fault_filter_ms_per_slice = {2 * SLICE_MS * builders}", "memory_budget_mb = 8")
    return cluster_toml(
        name, sources, builders, state, policy=policy, slice_ms=SLICE_MS,
        # Run control corrects a clock it measured off (cluster.clock.correct): the fault
        # is a host whose clock cannot be corrected, which the diagnosis must name.
        cluster_tables=("[cluster.clock]", "correct = false") if clock_of else (),
        process_lines=process_lines, source_lines=source_lines, builder_lines=builder_lines,
        source_drain_ms=3000, builder_drain_ms=5000,
    )


def kinds_for(cluster) -> list[str]:
    """The kinds that can be injected in `cluster`: the network's on the testbed only."""
    return [k for k in KINDS_ENABLED if (k in NETWORK_KINDS) == (cluster == "testbed")]


def draw_fault(rng, cluster, policy, roles_of, max_duration) -> dict:
    kinds = kinds_for(cluster)
    while True:
        kind = rng.choice(kinds)
        roles = [r for r in TARGETS[kind] if (r != "dfm" or policy.startswith("pull")) and r in ROLES_ENABLED]
        role = rng.choice(roles) if roles else None
        if roles and role in roles_of:
            break
    return new_fault(rng, kind, role, rng.choice(roles_of[role]), cluster, max_duration)


def new_fault(rng, kind, role, target, cluster, max_duration) -> dict:
    f = {"kind": kind, "role": role, "target": target, "duration": duration(rng, max_duration)}
    if kind == "loss":
        f["loss_pct"] = round(math.exp(rng.uniform(math.log(2), math.log(30))), 1)
    if kind == "delay":
        f["delay_ms"] = round(math.exp(rng.uniform(math.log(20), math.log(200))), 1)
    if kind == "twin":
        sources = CLUSTERS[cluster][0]
        own = int(target.removeprefix("source"))
        f["ids_of"] = rng.choice([i for i in range(sources) if i != own])
        f["crossing"] = [target, f"source{f['ids_of']}"]
    if kind == "burst":
        f["crossing"] = [f"source{i}" for i in range(CLUSTERS[cluster][0])]
    if kind in NETWORK_KINDS:
        # The processes whose data links cross the port: network_path names the sender.
        sources, builders = CLUSTERS[cluster]
        if role == "source":
            f["crossing"] = [target]
        elif role == "builder":
            f["crossing"] = [target] + [f"source{i}" for i in range(sources)]
        else:
            f["crossing"] = [target] + [f"builder{j}" for j in range(builders)]
    return f


def duration(rng, max_duration) -> float:
    """0.2 s to `max_duration`, log-uniform."""
    return round(math.exp(rng.uniform(math.log(0.2), math.log(max_duration))), 2)


def http_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def dispatcher_pid(text: str) -> int | None:
    addr = re.search(r'^dispatcher = "([^"]+)"', text, re.M).group(1)
    out = subprocess.run(["pgrep", "-f", f"dispatcher --listen {addr}"], capture_output=True, text=True).stdout
    pids = [int(p) for p in out.split()]
    return pids[0] if pids else None


class Hog:
    """A SCHED_FIFO busy loop on `cpu`, with the victim's threads pinned there."""

    def __init__(self, pid: int, cpu: int):
        self.pid = pid
        self.proc = subprocess.Popen(
            ["chrt", "-f", "10", "taskset", "-c", str(cpu), sys.executable, "-c", "while True: pass"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)], capture_output=True)

    def end(self):
        self.proc.kill()
        self.proc.wait()
        subprocess.run(["taskset", "-a", "-p", "-c", f"0-{os.cpu_count() - 1}", str(self.pid)], capture_output=True)


def garbage(addr: str, seconds: float, rng: random.Random):
    """Connections that send random bytes to `addr` for `seconds` (bounded)."""
    host, port = addr.rsplit(":", 1)
    end = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < end and sent < 200:
        try:
            with socket.create_connection((host, int(port)), timeout=1) as s:
                s.sendall(rng.randbytes(4096))
                sent += 1
        except OSError:
            pass
        time.sleep(min(0.05, max(0.0, end - time.monotonic())))


def inject(fault, pids, text, state, rng, started):
    """Carries out one fault at its time; returns what happened (when, to which pid)."""
    kind, target = fault["kind"], fault["target"]
    wait = started + fault["start"] - time.monotonic()
    if wait > 0:
        time.sleep(wait)
    pid = dispatcher_pid(text) if target == "dispatcher" else pids.get(target)
    fault["injected_unix"] = time.time()
    if kind == "stop":
        os.kill(pid, signal.SIGSTOP)
        time.sleep(fault["duration"])
        os.kill(pid, signal.SIGCONT)
    elif kind == "kill":
        os.kill(pid, signal.SIGKILL)
    elif kind == "hog":
        cpu = rng.randrange(os.cpu_count())
        h = Hog(pid, cpu)
        try:
            time.sleep(fault["duration"])
        finally:
            h.end()
    elif kind == "disk":
        fill = state / "data" / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={fill}", "bs=1M"], capture_output=True)
    elif kind == "garbage":
        b = int(target.removeprefix("builder"))
        addrs = re.search(r"^builder_addrs = \[(.*)\]", text, re.M).group(1)
        addr = [a.strip().strip('"') for a in addrs.split(",")][b]
        garbage(addr, fault["duration"], rng)
    fault["ended_unix"] = time.time()


def switch_port(target: str, prefix: str) -> tuple[str, str]:
    """The switch namespace and bridge port of a testbed host (docs/testbed.md)."""
    if target.startswith("source"):
        i = int(target.removeprefix("source"))
        return f"{prefix}-sec{i // BOARDS_PER_SECTOR}", f"s{i}"
    if target.startswith("builder"):
        return f"{prefix}-core", f"b{int(target.removeprefix('builder'))}"
    return f"{prefix}-core", "w"


def in_ns(ns: str, *cmd: str, check=True):
    return subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, check=check)


def inject_network(fault, prefix, binary, started, log):
    """One fault on a testbed switch port, at its time, undone after its duration."""
    wait = started + fault["start"] - time.monotonic()
    if wait > 0:
        time.sleep(wait)
    ns, port = switch_port(fault["target"], prefix)
    fault["injected_unix"] = time.time()
    kind = fault["kind"]
    try:
        if kind == "partition":
            in_ns(ns, "ip", "link", "set", port, "down")
            time.sleep(fault["duration"])
            in_ns(ns, "ip", "link", "set", port, "up")
        elif kind == "loss":
            # nft's numgen in parts per million, both directions through the port.
            ppm = int(fault["loss_pct"] * 10_000)
            rules = "".join(
                f'    {d}name "{port}" numgen random mod 1000000 < {ppm} counter drop\n' for d in ("iif", "oif")
            )
            table = f"table bridge shoal_fault {{\n  chain fw {{\n    type filter hook forward priority -1;\n{rules}  }}\n}}\n"
            subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=table, text=True, check=True,
                           capture_output=True)
            time.sleep(fault["duration"])
            in_ns(ns, "nft", "delete", "table", "bridge", "shoal_fault")
        elif kind == "delay":
            # A delay line of the testbed's own (shoal testbed delay-line) on the port's
            # packets: bridged packets reach iptables through br_netfilter; bypass the
            # queue rather than drop should the line be gone.
            line = subprocess.Popen(
                ["ip", "netns", "exec", ns, "chrt", "--fifo", "20", str(binary), "testbed", "delay-line",
                 "--delay-us", str(fault["delay_ms"] * 1000)],
                stdout=subprocess.PIPE, stderr=log, text=True,
            )
            try:
                if line.stdout.readline().strip() != "ready":
                    raise RuntimeError("the delay line did not start")
                in_ns(ns, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1")
                rules = [["-m", "physdev", f"--physdev-{d}", port, "-j", "NFQUEUE", "--queue-num", "0",
                          "--queue-bypass"] for d in ("in", "out")]
                for r in rules:
                    in_ns(ns, "iptables", "-w", "-I", "FORWARD", *r)
                time.sleep(fault["duration"])
                for r in rules:
                    in_ns(ns, "iptables", "-w", "-D", "FORWARD", *r)
                line.send_signal(signal.SIGTERM)
                report = line.stdout.readline()  # its one JSON line, then it exits
                fault["delay_line"] = json.loads(report) if report.strip() else {}
            finally:
                if line.poll() is None:
                    line.kill()
                line.wait()
    except (subprocess.CalledProcessError, RuntimeError, OSError) as e:
        # The testbed gone under it (the run ended early): said in the results.
        fault["error"] = str(getattr(e, "stderr", "") or e)
    fault["ended_unix"] = time.time()


def testbed_scenario(policy, seconds) -> str:
    sources, builders = CLUSTERS["testbed"]
    return f"""name = "campaign-testbed"
[topology]
sources = {sources}
builders = {builders}
boards_per_sector = {BOARDS_PER_SECTOR}
shore_delay_us = 0.0
[traffic]
policy = "{policy}"
transport = "tcp"
slice_ms = {float(SLICE_MS)}
fragment_bytes = 20000
load_s = {float(seconds)}
[clocks]
correct = true
"""


def run_testbed(binary, work, index, policy, faults, seconds):
    """One `shoal testbed run` with network faults on its switch ports; its run record."""
    d = work / f"run{index:04}"
    d.mkdir(parents=True)
    (d / "scenario.toml").write_text(testbed_scenario(policy, seconds))
    prefix = f"fc{index % 10000}"
    out_dir = d / "out"
    log = open(d / "faults.log", "w")
    proc = subprocess.Popen(
        [str(binary), "testbed", "run", "--prefix", prefix, "--json", "--dir", str(out_dir), "scenario.toml"],
        cwd=d, stdout=open(d / "summary.json", "w"), stderr=open(d / "testbed.log", "w"), start_new_session=True,
    )
    try:
        # The testbed says when data taking starts in its run.log (bounded: it exits).
        run_log = out_dir / "run.log"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if run_log.exists() and any(line.startswith("running for ") for line in run_log.read_text().splitlines()):
                break
            time.sleep(0.05)
        started = time.monotonic()
        threads = [threading.Thread(target=inject_network, args=(f, prefix, binary, started, log)) for f in faults]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rc = proc.wait(timeout=seconds + 300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        subprocess.run([str(binary), "testbed", "down", "--prefix", prefix], capture_output=True)
        log.close()
    records = sorted((out_dir / "state" / "runs").glob("run*.json"))
    if not records:
        raise RuntimeError(f"no run record (shoal testbed run exited {rc}): {d / 'testbed.log'}")
    return json.loads(records[0].read_text())


def testbed_unavailable() -> str | None:
    if not is_root():
        return "not root"
    missing = [t for t in ("ip", "tc", "ethtool", "nft", "iptables", "chrt") if shutil.which(t) is None]
    return f"{', '.join(missing)} missing" if missing else None


def start_twin(binary, text, fault, d):
    """The `twin` fault: the target source started by hand, as `launch = "external"` asks,
    with another source's ids, once the dispatcher listens (run control waits for it)."""
    addr = re.search(r'^dispatcher = "([^"]+)"', text, re.M).group(1)
    host, port = addr.rsplit(":", 1)
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("the dispatcher never listened") from None
            time.sleep(0.02)
    return subprocess.Popen(
        [str(binary), "node", "--role", "source", "--name", fault["target"], "--dispatcher", addr, "--stats-ms", "500",
         "--metrics", "127.0.0.1:0", "--ids", str(fault["ids_of"])],
        stdout=subprocess.DEVNULL, stderr=open(d / f"{fault['target']}.twin.log", "w"), start_new_session=True,
    )


def run_one(binary, work, index, cluster, policy, faults, seconds):
    """One `shoal run` with `faults` injected; returns its run record."""
    if cluster == "testbed":
        return run_testbed(binary, work, index, policy, faults, seconds)
    sources, builders = CLUSTERS[cluster]
    d = work / f"run{index:04}"
    d.mkdir(parents=True)
    state = d / "state"
    (state / "data").mkdir(parents=True)
    mounted = False
    if any(f["kind"] == "disk" for f in faults):
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(state / "data")], check=True)
        mounted = True
    text = cluster_file(f"campaign{index}", sources, builders, policy, state, faults)
    (d / "cluster.toml").write_text(text)
    log = open(d / "shoal-run.log", "w")
    rng = random.Random(index)
    twins = []
    proc = None
    try:
        # Inside the try: the tmpfs comes off whatever fails.
        proc = subprocess.Popen(
            [str(binary), "run", "cluster.toml", "--seconds", str(seconds), "--http", "127.0.0.1:0"],
            cwd=d,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
        )
        for f in faults:
            if f["kind"] == "twin":
                twins.append(start_twin(binary, text, f, d))
        url = None
        for line in proc.stdout:
            if line.startswith("run control UI: "):
                url = line.split(": ", 1)[1].strip().rstrip("/")
                break
        if url is None:
            raise RuntimeError(f"shoal run did not start: {d / 'shoal-run.log'}")
        deadline = time.monotonic() + 120
        status = {}
        while time.monotonic() < deadline:
            status = http_json(url + "/api/status")
            if status.get("state") == "RUNNING":
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"the run did not start: {json.dumps(status)[:500]}")
        started = time.monotonic()
        pids = {p["name"]: p["pid"] for p in status["processes"] if p["pid"]}
        threads = [
            threading.Thread(target=inject, args=(f, pids, text, state, random.Random(rng.random()), started))
            for f in faults
            if f["kind"] not in WHOLE_RUN
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        proc.stdout.read()
        rc = proc.wait(timeout=seconds + 180)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for t in twins:
            t.kill()
            t.wait()
        log.close()
        if mounted:
            subprocess.run(["umount", "-l", str(state / "data")], capture_output=True)
    records = sorted((state / "runs").glob("run*.json"))
    if not records:
        raise RuntimeError(f"no run record (shoal run exited {rc}): {d / 'shoal-run.log'}")
    return json.loads(records[0].read_text())


def matches(cause_rule, processes, fault) -> bool:
    if cause_rule != EXPECTED[fault["kind"]]:
        return False
    if fault["kind"] == "filter":
        return any(p.startswith("builder") for p in processes)
    return any(p in processes for p in fault.get("crossing", [fault["target"]]))


def score(record, faults):
    """What the run's diagnosis named against what was injected."""
    causes = record["diagnosis"]["slices"]["causes"]
    timeline = [(e["rule"], e["process"]) for e in record["diagnosis"]["timeline"]]
    slices = []  # (injected kind or "none", named rule, slices, right)
    for c in causes:
        right = next((f for f in faults if matches(c["rule"], c["processes"], f)), None)
        # The fault the slices belong to: the right one, else one on a named process.
        owner = right or next(
            (f for f in faults if any(p in c["processes"] for p in f.get("crossing", [f["target"]]))),
            faults[0] if faults else None,
        )
        slices.append(
            {
                "injected": f"{owner['kind']} {owner['role']}" if owner else "none",
                "named": c["rule"],
                "processes": c["processes"],
                "slices": c["slices"],
                "right": right is not None,
            }
        )
    named = []
    for f in faults:
        seen = any(matches(rule, [p], f) for rule, p in timeline) or any(
            matches(c["rule"], c["processes"], f) for c in causes
        )
        on_target = sorted({rule for rule, p in timeline if p == f["target"]})
        named.append({"injected": f"{f['kind']} {f['role']}", "named": EXPECTED[f["kind"]] if seen else
                      (on_target[0] if on_target else "nothing"), "right": seen})
    return {
        "slices": slices,
        "named_faults": named,
        "timeline": timeline,
        "lost": record["diagnosis"]["slices"]["lost_slices"],
        "unexplained": record["diagnosis"]["slices"]["unexplained"],
        "balanced": record["ledger"]["balanced"],
    }


# Faults that must be named even though they may cost no slice (a fault that cost nothing
# and that no rule can see is not held against the diagnosis: a 0.2-s stop of a source
# whose buffer covered it).
def must_be_named(f, s) -> bool:
    if f["kind"] == "clock":
        # Named when beyond what the policy can take (docs/clocks.md): a 50-ms skew is for
        # the barrel shifter and the token bucket (half a slice), not for direct or pull
        # (half the builders' timeout).
        return s["policy"].startswith(("delayed", "tbf"))
    if f["kind"] in ("garbage", "disk", "filter", "twin", "burst"):
        return True
    if f["kind"] in ("loss", "partition"):
        # Seen once a retransmission timeout (200 ms at least) or a few segments sent again
        # fall in one of run control's looks (every 0.5 s).
        return f["duration"] >= 1.0
    if f["kind"] == "delay":
        # No rule looks at delay (TCP carries it; the latency alert does): held against
        # the diagnosis only when it cost slices, like a stall.
        return any(x["slices"] > 0 and x["injected"].startswith("delay") for x in s["slices"])
    if f["kind"] == "kill":
        return True
    if f["role"] == "dispatcher":
        # The data path does not go through it: a stop is seen once nothing has come
        # through it for the hung threshold (3 s), plus a look.
        return f["kind"] == "stop" and f["duration"] >= 4.5
    return any(x["slices"] > 0 and x["injected"].startswith(f["kind"]) for x in s["slices"])


def plan_each(args, rng):
    """`--each N`: N faults of every kind, one a run (the small campaign of `make test`)."""
    runs = []
    for kind in KINDS_ENABLED:
        clusters = [c for c in args.clusters if kind in kinds_for(c)]
        if not clusters:
            continue
        for _ in range(args.each):
            cluster = rng.choice(clusters)
            policy = rng.choice(args.policies)
            roles_of = roles_in(cluster, policy)
            roles = [r for r in TARGETS[kind] if r in roles_of and r in ROLES_ENABLED]
            if not roles:
                continue
            role = rng.choice(roles)
            f = new_fault(rng, kind, role, rng.choice(roles_of[role]), cluster, args.max_duration)
            f["start"] = 0.0 if kind in WHOLE_RUN else round(rng.uniform(1.5, 4.0), 2)
            end = f["start"] + (0 if kind in WHOLE_RUN else f["duration"])
            runs.append({"cluster": cluster, "policy": policy, "faults": [f], "seconds": round(max(8.0, end + 4), 1)})
    return runs


def roles_in(cluster, policy):
    sources, builders = CLUSTERS[cluster]
    roles_of = {
        "source": [f"source{i}" for i in range(sources)],
        "builder": [f"builder{i}" for i in range(builders)],
        "writer": ["writer"],
        "dispatcher": ["dispatcher"],
    }
    if policy.startswith("pull"):
        roles_of["dfm"] = ["dfm"]
    return roles_of


def plan(args, rng):
    if args.each:
        return plan_each(args, rng)
    runs = []
    total = 0
    while total < args.faults:
        cluster = rng.choice([c for c in args.clusters if kinds_for(c)])
        policy = rng.choice(args.policies)
        roles_of = roles_in(cluster, policy)
        n = 2 if rng.random() < 0.2 and args.faults - total >= 2 else 1
        faults = []
        while len(faults) < n:
            f = draw_fault(rng, cluster, policy, roles_of, args.max_duration)
            # Two at once: on two processes, and not two of a whole-run kind.
            if any(g["target"] == f["target"] or (g["kind"] == f["kind"] and f["kind"] in WHOLE_RUN) for g in faults):
                continue
            faults.append(f)
        for f in faults:
            f["start"] = 0.0 if f["kind"] in WHOLE_RUN else round(rng.uniform(1.5, 4.0), 2)
        end = max(f["start"] + (0 if f["kind"] in WHOLE_RUN else f["duration"]) for f in faults)
        runs.append({"cluster": cluster, "policy": policy, "faults": faults, "seconds": round(max(8.0, end + 4), 1)})
        total += n
    return runs


def matrix(rows, key_row, key_col, weight):
    table: dict[str, dict[str, int]] = {}
    for r in rows:
        table.setdefault(r[key_row], {}).setdefault(r[key_col], 0)
        table[r[key_row]][r[key_col]] += weight(r)
    return table


def markdown_matrix(title, table, unit) -> str:
    cols = sorted({c for row in table.values() for c in row})
    out = [f"**{title}** ({unit})", "", "| injected \\ named | " + " | ".join(cols) + " |",
           "| --- | " + " | ".join("---:" for _ in cols) + " |"]
    for r in sorted(table):
        out.append(f"| {r} | " + " | ".join(str(table[r].get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "shoal"))
    ap.add_argument("--faults", type=int, default=200)
    ap.add_argument("--each", type=int, default=0, help="instead: this many faults of every kind, one a run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fault-free", type=float, default=0.0, help="minutes of runs without a fault")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--clusters", default="sector,large,testbed")
    ap.add_argument("--roles", default="source,builder,writer,dfm,dispatcher", help="roles to inject on")
    ap.add_argument("--max-duration", type=float, default=10.0)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    ap.add_argument("--keep", help="keep the runs' directories here")
    args = ap.parse_args()
    args.policies = args.policies.split(",")
    args.clusters = args.clusters.split(",")
    global KINDS_ENABLED, ROLES_ENABLED
    ROLES_ENABLED = args.roles.split(",")
    KINDS_ENABLED = [k for k in args.kinds.split(",") if k]
    skipped = [k for k in KINDS_ENABLED if k in ("hog", "disk") and not is_root()]
    KINDS_ENABLED = [k for k in KINDS_ENABLED if k not in skipped]
    if skipped:
        print(f"not root: {', '.join(skipped)} skipped", flush=True)
    if "testbed" in args.clusters and (why := testbed_unavailable()):
        print(f"the testbed cannot run here ({why}): its cluster and network faults skipped", flush=True)
        args.clusters = [c for c in args.clusters if c != "testbed"]
    rng = random.Random(args.seed)
    runs = plan(args, rng) if args.faults > 0 or args.each > 0 else []
    free_runs = []
    free_seconds = args.fault_free * 60
    while sum(r["seconds"] for r in free_runs) < free_seconds:
        free_runs.append(
            {"cluster": rng.choice(args.clusters), "policy": rng.choice(args.policies), "faults": [], "seconds": 30.0}
        )
    work = pathlib.Path(args.keep) if args.keep else pathlib.Path(tempfile.mkdtemp(prefix="fault-campaign-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    # Fault-free runs among the others, so that a campaign cut short has both; the
    # results are written after every run.
    everything = runs + free_runs
    rng.shuffle(everything)
    for i, r in enumerate(everything):
        began = time.monotonic()
        try:
            record = run_one(pathlib.Path(args.bin).resolve(), work, i, r["cluster"], r["policy"], r["faults"], r["seconds"])
            s = score(record, r["faults"])
        except Exception as e:  # a run that failed is a result too, and named
            s = {"error": str(e), "slices": [], "named_faults": [], "timeline": [], "lost": 0, "unexplained": 0,
                 "balanced": False}
        r.update(s)
        r["wall_s"] = round(time.monotonic() - began, 1)
        results.append(r)
        what = ", ".join(f"{f['kind']} {f['target']} {f['duration']}s@{f['start']}" for f in r["faults"]) or "none"
        print(
            f"[{i + 1}/{len(everything)}] {r['cluster']} {r['policy']}: {what} -> lost {r['lost']}, "
            + ", ".join(f"{x['named']} {','.join(x['processes'])} {x['slices']}{'' if x['right'] else ' WRONG'}"
                        for x in r["slices"])
            + (f" timeline {r['timeline']}" if not r["faults"] and r["timeline"] else "")
            + (f" ERROR {r['error']}" if "error" in r else ""),
            flush=True,
        )
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps({"runs": results, "summary": summarize(results)}, indent=1))
        if args.markdown:
            pathlib.Path(args.markdown).write_text(render(summarize(results), args) + "\n")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(results)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"runs": results, "summary": summary}, indent=1))
    text = render(summary, args)
    print(text)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(text + "\n")
    if args.check and summary["failures"]:
        print("FAILED:\n  " + "\n  ".join(summary["failures"]))
        sys.exit(1)


def summarize(results):
    faulty = [r for r in results if r["faults"]]
    free = [r for r in results if not r["faults"]]
    slice_rows = [x for r in faulty for x in r["slices"]]
    fault_rows = [x for r in faulty for x in r.get("named_faults", [])]
    lost = sum(x["slices"] for x in slice_rows)
    right = sum(x["slices"] for x in slice_rows if x["right"])
    failures = []
    for r in results:
        what = f"{r['cluster']} {r['policy']} {[(f['kind'], f['target'], f['duration']) for f in r['faults']]}"
        if "error" in r:
            failures.append(f"{what}: {r['error']}")
            continue
        if not r["balanced"]:
            failures.append(f"{what}: ledger not balanced")
        for x in r["slices"]:
            if not x["right"]:
                failures.append(f"{what}: {x['slices']} slices named {x['named']} {x['processes']}")
        if not r["faults"] and (r["timeline"] or r["lost"]):
            failures.append(f"{what}: fault-free run named {r['timeline']} (lost {r['lost']})")
    reached = sorted({x["named"] for x in fault_rows if x["right"]})
    unnamed = []
    for r in faulty:
        if "error" in r:
            continue
        for f, n in zip(r["faults"], r["named_faults"]):
            if not n["right"] and must_be_named(f, r):
                unnamed.append(f"{r['cluster']} {r['policy']}: {f['kind']} {f['target']} {f['duration']}s "
                               f"not named (named {n['named']})")
    failures += unnamed
    return {
        "runs": len(faulty),
        "faults": sum(len(r["faults"]) for r in faulty),
        "fault_free_runs": len(free),
        "fault_free_seconds": sum(r["seconds"] for r in free),
        "fault_free_named": sum(1 for r in free if r["timeline"] or r["lost"]),
        "lost_slices": lost,
        "named_right": right,
        "unexplained": sum(r["unexplained"] for r in faulty),
        "slice_matrix": matrix(slice_rows, "injected", "named", lambda x: x["slices"]),
        "fault_matrix": matrix(fault_rows, "injected", "named", lambda x: 1),
        "rules_reached": reached,
        "failures": failures,
    }


def render(s, args) -> str:
    share = s["named_right"] / s["lost_slices"] if s["lost_slices"] else 1.0
    lines = [
        f"{s['faults']} faults in {s['runs']} runs (seed {args.seed}, policies {', '.join(args.policies)}, "
        f"clusters {', '.join(args.clusters)}); {s['fault_free_runs']} fault-free runs, "
        f"{s['fault_free_seconds'] / 60:.1f} min, {s['fault_free_named']} with a cause named.",
        f"Lost slices {s['lost_slices']}, named right {s['named_right']} ({100 * share:.1f} %), "
        f"unexplained {s['unexplained']}.",
        f"Rules reached by an injected fault: {', '.join(s['rules_reached']) or 'none'}.",
        "",
        markdown_matrix("Lost slices", s["slice_matrix"], "slices"),
        "",
        markdown_matrix("Faults", s["fault_matrix"], "faults; named: the expected rule on the process if the "
                        "timeline or the causes name it, else the first rule on it, else nothing"),
    ]
    if s["failures"]:
        lines += ["", "Misses:", *(f"- {f}" for f in s["failures"])]
    return "\n".join(lines)


KINDS_ENABLED = KINDS
ROLES_ENABLED = ["source", "builder", "writer", "dfm", "dispatcher"]

if __name__ == "__main__":
    main()
