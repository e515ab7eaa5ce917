"""Run control with processes it did not start (`launch = "external"`, as under systemd):
processes that connected and announced themselves before `shoal run` listened are found,
a run does not start with a process missing, and every process is switched off at the end."""

import json
import subprocess
import time
import urllib.request

from shoal_cluster import free_port


def external_cluster(tmp_path, dispatcher: int, names: list[tuple[str, str, str]], builders: int, sources: int) -> str:
    lines = [
        "[cluster]",
        'name = "external"',
        f'dispatcher = "127.0.0.1:{dispatcher}"',
        "start_dispatcher = false",
        'http = "off"',
        f'state_dir = "{tmp_path / "state"}"',
        "reply_timeout_ms = 3000",
        "seconds = 2.0",
    ]
    for name, role, ids in names:
        lines += ["[[process]]", f'name = "{name}"', f'role = "{role}"', 'launch = "external"']
        if ids:
            lines += [f"ids = [{ids}]"]
    addrs = ", ".join(f'"127.0.0.1:{free_port()}"' for _ in range(builders))
    lines += [
        "[config.run]",
        f"sources = {sources}",
        f"builders = {builders}",
        f"builder_addrs = [{addrs}]",
        f'writer_addr = "127.0.0.1:{free_port()}"',
        "[config.source]",
        'generator = "noise"',
        "drain_timeout_ms = 2000",
        "[config.builder]",
        "drain_timeout_ms = 4000",
        # Slice timeouts out of reach: completeness must not depend on how fast the
        # processes react to START.
        "max_active = 100000",
        "wall_timeout_ms = 600000",
        "[config.writer]",
        f'out_dir = "{tmp_path / "data"}"',
    ]
    return "\n".join(lines) + "\n"


def wait_for_nicknames(http: int, names: list[str], timeout: float = 60.0) -> None:
    """Until the dispatcher lists every process (they announced themselves)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/status", timeout=5) as r:
                text = r.read().decode()
            if all(f'"{n}"' in text for n in names):
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"processes did not connect to the dispatcher: {names}")


def start(shoal_bin, args, log):
    return subprocess.Popen([str(shoal_bin), *args], stdout=log, stderr=log, start_new_session=True)


def start_cluster(shoal_bin, log, names):
    """A dispatcher and the named node processes, connected and announced: returns the
    dispatcher port and the processes (the dispatcher first)."""
    port, http = free_port(), free_port()
    procs = [start(shoal_bin, ["dispatcher", "--listen", f"127.0.0.1:{port}", "--http", f"127.0.0.1:{http}"], log)]
    for name, role, ids in names:
        args = ["node", "--role", role, "--name", name, "--dispatcher", f"127.0.0.1:{port}"]
        if ids:
            args += ["--ids", ids]
        procs.append(start(shoal_bin, args, log))
    wait_for_nicknames(http, [n for n, _, _ in names])
    return port, procs


def stop_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def test_processes_up_before_run_control_are_found(shoal_bin, tmp_path):
    procs = []
    log = open(tmp_path / "processes.log", "w")
    names = [("writer", "writer", ""), ("builder0", "builder", "0"), ("source0", "source", "0"), ("source1", "source", "1")]
    try:
        # Every process has connected and announced itself before run control exists.
        port, procs = start_cluster(shoal_bin, log, names)
        cluster = tmp_path / "cluster.toml"
        cluster.write_text(external_cluster(tmp_path, port, names, builders=1, sources=2))
        r = subprocess.run([str(shoal_bin), "run", str(cluster)], capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, f"stdout: {r.stdout}\nstderr: {r.stderr}"
        assert "shoal run summary" in r.stdout and "(balanced)" in r.stdout, r.stdout
        record = json.loads((tmp_path / "state" / "runs" / "run000001.json").read_text())
        assert all(p["active"] for p in record["processes"]), record["processes"]
        assert record["missing_reports"] == []
        assert record["ledger"]["balanced"]
        assert record["ledger"]["buckets"]["delivered"] == record["ledger"]["produced"] > 0
        assert record["slices_complete"] > 0 and record["slices_incomplete"] == 0
        # OFF reached every node: they exit by themselves.
        for p in procs[1:]:
            assert p.wait(timeout=30) == 0
    finally:
        stop_all(procs)
        log.close()


def test_a_run_does_not_start_with_a_process_missing(shoal_bin, tmp_path):
    procs = []
    log = open(tmp_path / "processes.log", "w")
    present = [("writer", "writer", ""), ("builder0", "builder", "0"), ("source0", "source", "0")]
    try:
        port, procs = start_cluster(shoal_bin, log, present)
        cluster = tmp_path / "cluster.toml"
        # source1 never comes.
        cluster.write_text(external_cluster(tmp_path, port, present + [("source1", "source", "1")], 1, 2))
        r = subprocess.run([str(shoal_bin), "run", str(cluster)], capture_output=True, text=True, timeout=180)
        assert r.returncode != 0
        assert "not starting" in r.stderr and "source1" in r.stderr, r.stderr
        assert not (tmp_path / "state" / "runs" / "run000001.json").exists()
        # The processes that were there were switched off all the same.
        for p in procs[1:]:
            assert p.wait(timeout=30) == 0
    finally:
        stop_all(procs)
        log.close()
